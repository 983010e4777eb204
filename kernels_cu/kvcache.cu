// kvcache.cu: KV-cache append (cupyattn/kvcache.py, KVCache.append).
//
//   kv_append_kernel<T>          copy T new tokens of K and V into the cache at lengths[b] + t
//   kv_advance_lengths_kernel    lengths[b] += num_new[b]; launched after the append, same stream
//   qkv_rope_append_kernel<T,NEOX>  fused step right after the packed QKV projection: rotate q
//                                into its own [B, Hq, T, D] buffer, rotate k and copy v into the
//                                cache rows lengths[b] + t, all at positions lengths[b] + t (no
//                                position input), and, when one block holds the whole sequence
//                                (decode), advance lengths[b] itself: one launch instead of rope q,
//                                rope k, head-split copies, append and advance.
//   PAGED = true (both append kernels)  the same into a paged cache (cupyattn.paged.PagedKVCache):
//                                pages [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv,
//                                page_size, D] (HND, page_hnd = 1; paged.cuh), position p of
//                                sequence b in row p % page_size of page block_table[b, p / page_size]
//
// Layouts (row-major, last dim contiguous): cache (one layer) k, v [B, Hkv, max_seq, D],
// lengths int32 [B]. Launch shapes: cupyattn/config.py KV_APPEND_* / KV_ADVANCE_THREADS /
// KV_ROPE_APPEND_* (KV_ROPE_APPEND_THREADS arrives as a -D option).
#include "common.cuh"
#include "paged.cuh"
#include "rope.cuh"
#ifndef KV_ROPE_APPEND_THREADS
#error "compile with the -D options of cupyattn/config.py (the kvcache KernelSpec passes them)"
#endif

// The extra arguments of the append kernels (null / 0 for the contiguous cache).
#define KV_PAGED_PARAMS                                                                            \
    const int* __restrict__ block_table,  /* [B, bt_stride] page ids (PAGED) */                     \
    int bt_stride, int log2_page, int num_pages,                                                   \
    int page_hnd                          /* pages HND (1) or NHD (0) */

// Element offset of row (sequence b, kv head hk, position p): [B, Hkv, max_seq, D], or through
// the block table into pages [num_pages, page, Hkv, D] (NHD) or [num_pages, Hkv, page, D] (HND)
// (page ids clamped as KvRows does).
template <bool PAGED>
__device__ __forceinline__ size_t cache_row(int b, int hk, int p, int Hkv, int max_seq, int D,
                                            const int* table, int bt_stride, int log2_page, int num_pages,
                                            int page_hnd) {
    if (!PAGED) return (((size_t)b * Hkv + hk) * (size_t)max_seq + (size_t)p) * D;
    const int pg = min(max(table[(size_t)b * bt_stride + (p >> log2_page)], 0), num_pages - 1);
    const size_t in_page = (size_t)(p & ((1 << log2_page) - 1));
    if (page_hnd) return ((((size_t)pg * Hkv + hk) << log2_page) | in_page) * D;
    return ((((size_t)pg << log2_page) | in_page) * Hkv + hk) * D;
}

// Whether position p is a row of the cache (max_seq rows per sequence: the contiguous cache's, or
// the block table's capacity, bt_stride pages). The host keeps lengths + counts <= max_seq on its
// mirror; the device lengths are the caller's too (KVCache.lengths), so a write checks its row and
// a corrupt length drops rows instead of writing past the cache (or its table row).
__device__ __forceinline__ bool in_cache(int p, int max_seq) { return (unsigned)p < (unsigned)max_seq; }

// --- append --------------------------------------------------------------------------------
// Grid (ceil(T / tok_per_block), Hkv, B), any block size. Token t of sequence b, kv head h goes
// to cache row lengths[b] + t for t < n_b (n_b = num_new[b] if use_counts else uniform_n).
// The positions come from the device lengths; this kernel never writes them (other blocks of
// the same sequence read them), kv_advance_lengths_kernel does, after it, in stream order.
// The host has checked lengths[b] + n_b <= max_seq (from its mirror) before launching.
template <typename T, bool PAGED = false>
__global__ void kv_append_kernel(
    T* __restrict__ k_cache,            // [B, Hkv, max_seq, D] (one layer), contiguous
    T* __restrict__ v_cache,            // [B, Hkv, max_seq, D]
    const T* __restrict__ k_new,        // [B, Hkv, T, D], element (b,h,t,d) at b*sb+h*sh+t*st+d
    const T* __restrict__ v_new,        // [B, Hkv, T, D], its own strides
    const int* __restrict__ lengths,    // [B] tokens already cached (before this append)
    const int* __restrict__ num_new,    // [B] tokens to take from each sequence (if use_counts)
    long long k_sb, long long k_sh, long long k_st,
    long long v_sb, long long v_sh, long long v_st,
    int Hkv, int max_seq, int D, int tok_per_block, int uniform_n, int use_counts, KV_PAGED_PARAMS) {
    const int b = blockIdx.z, h = blockIdx.y;
    const int n = use_counts ? num_new[b] : uniform_n;
    const int t0 = blockIdx.x * tok_per_block;
    if (t0 >= n) return;  // whole block past this sequence's count (uniform per block)
    const int ntok = min(tok_per_block, n - t0);
    const int base = lengths[b];
    const T* ks = k_new + b * k_sb + h * k_sh + (long long)t0 * k_st;  // [ntok, D] source rows
    const T* vs = v_new + b * v_sb + h * v_sh + (long long)t0 * v_st;
    for (int i = threadIdx.x; i < ntok * D; i += blockDim.x) {
        const int t = i / D, d = i - t * D;
        if (!in_cache(base + t0 + t, max_seq)) continue;  // corrupt lengths: drop the row, never write past
        // destination row of position base + t0 + t (consecutive rows unless paged)
        const size_t row = cache_row<PAGED>(b, h, base + t0 + t, Hkv, max_seq, D, block_table, bt_stride,
                                            log2_page, num_pages, page_hnd);
        k_cache[row + d] = ks[t * k_st + d];
        v_cache[row + d] = vs[t * v_st + d];
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

// --- fused rope + append ---------------------------------------------------------------------
// Grid (ceil(T / tok_per_block), B), any block size. One work item = one rotation pair (or one
// element pair of v) of one head of one token: items (t, head, i) with head in [0, Hq + 2 Hkv)
// over the packed q|k|v heads and i in [0, D/2). Pair i is (i, i + D/2) for NEOX, else
// (2i, 2i+1); v is copied pair by pair in the same layout. Token t < n_b of sequence b (n_b =
// num_new[b] if use_counts else uniform_n) sits at position p = lengths[b] + t: q turns by p into
// q_out, k turns by p into k_cache row p, v goes to v_cache row p. Tokens t >= n_b (right padding
// of a ragged batch) rotate q only, so q_out has no unwritten rows. With `advance` (host: only when
// gridDim.x == 1, i.e. every token of sequence b is in this block) the block moves lengths[b] to
// lengths[b] + n_b after a barrier: no other block reads it, and every thread of this one has read
// it already. Otherwise the host launches kv_advance_lengths_kernel after this kernel.
// The host has checked lengths[b] + n_b <= max_seq on its mirror before launching.
template <typename T, bool NEOX, bool PAGED = false>
__global__ void __launch_bounds__(KV_ROPE_APPEND_THREADS) qkv_rope_append_kernel(
    const T* __restrict__ qkv,          // [B, T, (Hq + 2 Hkv) * D]: token (b, t) at b*qkv_sb + t*qkv_st
    T* __restrict__ q_out,              // [B, Hq, T, D] contiguous
    T* __restrict__ k_cache,            // [B, Hkv, max_seq, D] (one layer), contiguous
    T* __restrict__ v_cache,            // [B, Hkv, max_seq, D]
    int* __restrict__ lengths,          // [B] tokens cached before this append (advanced if `advance`)
    const int* __restrict__ num_new,    // [B] tokens to append per sequence (if use_counts)
    long long qkv_sb, long long qkv_st,
    int T_, int Hq, int Hkv, int D, int max_seq, int tok_per_block, int uniform_n, int use_counts,
    double freq_scale,
    const float* __restrict__ freq_div,  // [D/2] per-pair frequency divisors (Llama 3's rope_freqs), or null
    int advance, KV_PAGED_PARAMS) {
    const int b = blockIdx.y;
    const int base = lengths[b];
    const int n = use_counts ? num_new[b] : uniform_n;
    const int t0 = blockIdx.x * tok_per_block;
    const int ntok = min(tok_per_block, T_ - t0);
    const int half = D / 2, heads = Hq + 2 * Hkv;
    const int items = ntok * heads * half;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        const int i = it % half, rest = it / half;
        const int h = rest % heads, t = t0 + rest / heads;
        int ia, ib;
        rope_pair<NEOX>(i, half, &ia, &ib);
        const T* src = qkv + b * qkv_sb + t * qkv_st + (long long)h * D;
        if (h >= Hq && t >= n) continue;  // padding token: nothing goes to the cache
        T* dst;
        if (h < Hq) {
            dst = q_out + (((long long)b * Hq + h) * T_ + t) * D;
        } else {
            const int hk = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
            if (!in_cache(base + t, max_seq)) continue;  // corrupt lengths: no cache row, never write past
            const size_t row = cache_row<PAGED>(b, hk, base + t, Hkv, max_seq, D, block_table, bt_stride,
                                                log2_page, num_pages, page_hnd);
            dst = (h < Hq + Hkv ? k_cache : v_cache) + row;
            if (h >= Hq + Hkv) {  // v: copied as it is
                dst[ia] = src[ia];
                dst[ib] = src[ib];
                continue;
            }
        }
        // q and k: rotated by position base + t
        float s, c, y0, y1;
        rope_sincos(base + t, rope_inv_freq(i, freq_scale, freq_div), &s, &c);
        rope_rotate(to_float(src[ia]), to_float(src[ib]), s, c, &y0, &y1);
        dst[ia] = from_float<T>(y0);
        dst[ib] = from_float<T>(y1);
    }
    if (advance) {
        __syncthreads();  // every thread has read lengths[b] (base) before it moves
        if (threadIdx.x == 0) lengths[b] = base + n;
    }
}
