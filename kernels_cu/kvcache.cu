// kvcache.cu: KV-cache append (cupyattn/kvcache.py, KVCache.append).
//
//   kv_append_kernel<T>          copy T new tokens of K and V into the cache at lengths[b] + t
//   kv_advance_lengths_kernel    lengths[b] += num_new[b]; launched after the append, same stream
//
// Layouts (row-major, last dim contiguous): cache (one layer) k, v [B, Hkv, max_seq, D],
// lengths int32 [B]. Launch shapes: cupyattn/config.py KV_APPEND_* / KV_ADVANCE_THREADS.
#include "common.cuh"

// --- append --------------------------------------------------------------------------------
// Grid (ceil(T / tok_per_block), Hkv, B), any block size. Token t of sequence b, kv head h goes
// to cache row lengths[b] + t for t < n_b (n_b = num_new[b] if use_counts else uniform_n).
// The positions come from the device lengths; this kernel never writes them (other blocks of
// the same sequence read them), kv_advance_lengths_kernel does, after it, in stream order.
// The host has checked lengths[b] + n_b <= max_seq (from its mirror) before launching.
template <typename T>
__global__ void kv_append_kernel(
    T* __restrict__ k_cache,            // [B, Hkv, max_seq, D] (one layer), contiguous
    T* __restrict__ v_cache,            // [B, Hkv, max_seq, D]
    const T* __restrict__ k_new,        // [B, Hkv, T, D], element (b,h,t,d) at b*sb+h*sh+t*st+d
    const T* __restrict__ v_new,        // [B, Hkv, T, D], its own strides
    const int* __restrict__ lengths,    // [B] tokens already cached (before this append)
    const int* __restrict__ num_new,    // [B] tokens to take from each sequence (if use_counts)
    long long k_sb, long long k_sh, long long k_st,
    long long v_sb, long long v_sh, long long v_st,
    int Hkv, int max_seq, int D, int tok_per_block, int uniform_n, int use_counts) {
    const int b = blockIdx.z, h = blockIdx.y;
    const int n = use_counts ? num_new[b] : uniform_n;
    const int t0 = blockIdx.x * tok_per_block;
    if (t0 >= n) return;  // whole block past this sequence's count (uniform per block)
    const int ntok = min(tok_per_block, n - t0);
    const long long base = lengths[b];
    const size_t row0 = ((size_t)b * Hkv + h) * (size_t)max_seq + (size_t)(base + t0);
    T* kd = k_cache + row0 * D;                                  // [ntok, D] destination rows
    T* vd = v_cache + row0 * D;
    const T* ks = k_new + b * k_sb + h * k_sh + (long long)t0 * k_st;  // [ntok, D] source rows
    const T* vs = v_new + b * v_sb + h * v_sh + (long long)t0 * v_st;
    for (int i = threadIdx.x; i < ntok * D; i += blockDim.x) {
        const int t = i / D, d = i - t * D;
        kd[(size_t)t * D + d] = ks[t * k_st + d];
        vd[(size_t)t * D + d] = vs[t * v_st + d];
    }
}

// One thread per sequence: lengths[b] += n_b. Runs after kv_append_kernel on the same stream.
__global__ void kv_advance_lengths_kernel(
    int* __restrict__ lengths,          // [B] of the appended layer
    const int* __restrict__ num_new,    // [B] (if use_counts)
    int B, int uniform_n, int use_counts) {
    for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < B; b += gridDim.x * blockDim.x)
        lengths[b] += use_counts ? num_new[b] : uniform_n;
}
