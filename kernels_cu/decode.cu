// decode.cu: single-token decode attention over a KV cache, with split-KV (flash-decoding).
// The cache and its append kernels: kernels_cu/kvcache.cu.
//
// Variants (reached from cupyattn/decode.py):
//   decode_kernel<T, D, ...>          one block per (split, kv head, head tile, sequence): K/V chunk
//                                staged in smem by cp.async, every query head of the kv head
//                                (up to GT = 8) scored against each staged key, online softmax;
//                                writes O directly (1 split) or a float32 partial O and lse
//   decode_combine_kernel<T,..>  merges the per-split partials: O = sum_c exp(lse_c - lse) O_c
//
// Layouts (row-major, last dim contiguous):
//   cache (one layer)  k, v: [B, Hkv, max_seq, D]   lengths: int32 [B]
//   q: [B, Hq, 1, D] with strides (q_sb, q_sh, 1) in elements;  out: [B, Hq, 1, D] contiguous
//   partials: o_part float32 [splits, B, Hq, D], lse_part float32 [splits, B, Hq] (natural log)
//
// Split-KV chunking (the same as reference.decode_split_partials): for a sequence of live length
// len, chunk = ceil(len / splits) and split c covers keys [c*chunk, min((c+1)*chunk, len)); a
// chunk may be empty (its lse is -inf, its O is 0, and the combine gives it weight 0).
// Block size, head tile and the combine kernel's split limit come from cupyattn/config.py
// (DECODE_*) as template arguments: THREADS threads per block, GT query heads per block.
#include "common.cuh"
#include "ptx.cuh"

// Tile table, chosen by the byte size of one K row (D * sizeof(T)) so that the K and V tiles
// together take at most 32 KB of smem (plus padding), under the 48 KB static limit and
// small enough for 5+ blocks per SM to overlap one block's loads with another's math:
//   row <= 256 B  (fp16/bf16 D <= 128, fp32 D <= 64)  -> BN 64 keys, 2 threads per key
//   row <= 512 B  (fp16/bf16 D = 256,  fp32 D 80-128) -> BN 32 keys, 4 threads per key
//   row  = 1024 B (fp32 D = 256)                      -> BN 16 keys, 8 threads per key
// Rows are padded so that the 8 lanes of a quarter-warp, which read 16-byte chunks
// (key, part) = (lane / TPK, lane % TPK), land on 8 distinct 16-byte bank groups.
template <typename T, int D, int DEC_THREADS, int DEC_GT>
struct DecodeCfg {
    static constexpr int VEC = 16 / sizeof(T);          // elements per 16-byte chunk
    static constexpr int ROW_BYTES = D * (int)sizeof(T);
    static constexpr int NC = ROW_BYTES / 16;           // 16-byte chunks per row
    static constexpr int BN = ROW_BYTES <= 256 ? 64 : (ROW_BYTES <= 512 ? 32 : 16);
    static constexpr int TPK = DEC_THREADS / BN;        // threads sharing one key's dot products
    static constexpr int CPT = (NC + TPK - 1) / TPK;    // chunks per thread in a dot product
    static constexpr int PITCH = ROW_BYTES + ((TPK * 16 - ROW_BYTES % 128) % 128 + 128) % 128;
    static constexpr int SLOTS = (DEC_GT * NC + DEC_THREADS - 1) / DEC_THREADS;  // O slots/thread
    static_assert(ROW_BYTES % 16 == 0, "D * sizeof(T) must be a multiple of 16 bytes");
    static_assert(ROW_BYTES <= 1024, "head dim too large for the decode tile table");
    static_assert(PITCH % 16 == 0 && PITCH >= ROW_BYTES, "bad smem row pitch");
    static_assert(32 % TPK == 0, "a key's thread group must not straddle warps");
    // The end-of-kernel O reduction reuses the K tile: it needs max(NT, GT*NC) * VEC floats.
    static_assert(BN * PITCH >= 4 * VEC * (DEC_THREADS > DEC_GT * NC ? DEC_THREADS : DEC_GT * NC),
                  "K tile too small to hold the O reduction");
};

// --- helpers -------------------------------------------------------------------------------
// One 16-byte chunk of T elements -> VEC floats.
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[4], float) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[8], __half) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __half22float2(h[i]);
        f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
}
__device__ __forceinline__ void chunk_to_float(const uint4& u, float (&f)[8], __nv_bfloat16) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
}

// --- decode --------------------------------------------------------------------------------
// Grid (splits, Hkv * n_head_tiles, B), DEC_THREADS threads (a multiple of 32 that divides
// DEC_GT * 32, so each warp owns DEC_GT / warps heads in the softmax step). The block owns sequence b, kv head
// kvh, query heads kvh*G + ht*GT + g for g < g_tile, and keys [lo, hi) of its split. It streams
// those keys in tiles of BN: for each tile (FlashAttention-2 Algorithm 1 with one query row per
// head, in the log2 domain: q is pre-scaled by scale * log2(e) so exp becomes exp2):
//   S_j   = q_g . K_j                    (all heads g share one smem read of K_j)
//   m_new = max(m, max_j S_j);  P_j = exp2(S_j - m_new);  alpha = exp2(m - m_new)
//   l     = alpha * l + sum_j P_j;  O = alpha * O + sum_j P_j V_j;  m = m_new
// At the end O / l (0 when l = 0: empty range) and lse = (m + log2 l) * ln 2.
// Launch bounds (128 threads, 4 blocks/SM) cap registers at 128: 4 blocks of <= 46 KB smem
// fit an SM, and ptxas keeps every instantiation spill-free (80-126 registers).
template <typename T, int D, int DEC_THREADS, int DEC_GT>
__global__ void __launch_bounds__(DEC_THREADS, 4) decode_kernel(
    const T* __restrict__ q,            // [B, Hq, 1, D], element (b,h,d) at b*q_sb + h*q_sh + d
    const T* __restrict__ k_cache,      // [B, Hkv, max_seq, D] (one layer), contiguous
    const T* __restrict__ v_cache,      // [B, Hkv, max_seq, D]
    const int* __restrict__ lengths,    // [B] live length of each sequence
    T* __restrict__ out,                // [B, Hq, 1, D] contiguous (when write_partials == 0)
    float* __restrict__ o_part,         // [splits, B, Hq, D] (when write_partials == 1)
    float* __restrict__ lse_part,       // [splits, B, Hq]
    long long q_sb, long long q_sh,
    int B, int Hq, int Hkv, int max_seq, int num_splits, float scale_log2, int write_partials) {
    using Cfg = DecodeCfg<T, D, DEC_THREADS, DEC_GT>;
    constexpr int DEC_WARPS = DEC_THREADS / 32;
    static_assert(DEC_THREADS % 32 == 0 && DEC_GT % DEC_WARPS == 0, "heads per warp must be whole");
    constexpr int VEC = Cfg::VEC, NC = Cfg::NC, BN = Cfg::BN, TPK = Cfg::TPK, PITCH = Cfg::PITCH;
    constexpr int GT = DEC_GT, NT = DEC_THREADS;

    __shared__ __align__(16) unsigned char k_s[BN * PITCH];  // K tile [BN, D] (rows PITCH bytes)
    __shared__ __align__(16) unsigned char v_s[BN * PITCH];  // V tile [BN, D]
    __shared__ __align__(16) float q_s[GT * D];              // [GT, D] q * scale * log2(e)
    __shared__ float p_s[GT * BN];                           // [GT, BN] scores, then P
    __shared__ float alpha_s[GT];                            // per-head rescale of this tile
    __shared__ float m_fin[GT], l_fin[GT];                   // final m, l per head

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, b = blockIdx.z;
    const int G = Hq / Hkv;
    const int n_ht = (G + GT - 1) / GT;
    const int kvh = blockIdx.y / n_ht, ht = blockIdx.y - kvh * n_ht;
    const int g_tile = min(GT, G - ht * GT);                 // heads in this tile (>= 1)
    const int h0 = kvh * G + ht * GT;                        // first query head of the tile

    // key range of this split (same chunking as reference.decode_split_partials)
    const int len = min(max(lengths[b], 0), max_seq);
    const int chunk = (len + num_splits - 1) / num_splits;
    const int lo = min(split * chunk, len);
    const int hi = min(lo + chunk, len);

    const size_t kv_off = ((size_t)b * Hkv + kvh) * (size_t)max_seq * D;
    const T* kg = k_cache + kv_off;                          // [max_seq, D] this kv head
    const T* vg = v_cache + kv_off;

    // q tile -> smem, pre-scaled
    for (int i = tid; i < g_tile * D; i += NT) {
        const int g = i / D, d = i - g * D;
        q_s[i] = to_float(q[b * q_sb + (long long)(h0 + g) * q_sh + d]) * scale_log2;
    }

    // Score role: thread -> (key kj, part kpart) of the tile; a part reads chunks kpart + i*TPK.
    const int kj = tid / TPK, kpart = tid - kj * TPK;
    // Softmax role: warp w owns heads w and w + DEC_WARPS; m, l live in its lanes' registers.
    constexpr int HPW = GT / DEC_WARPS;
    float m_i[HPW], l_i[HPW];
#pragma unroll
    for (int i = 0; i < HPW; ++i) { m_i[i] = -CUDART_INF_F; l_i[i] = 0.f; }
    // PV role: slot v = tid + s*NT -> (key part, head, chunk). With few (head, chunk) pairs the
    // keys of a tile are also split KP ways (v = kp * n_pairs + pair); partial O's are summed
    // at the end, which is exact because every part of a head is rescaled by the same alpha.
    const int n_pairs = g_tile * NC;
    const int KP = n_pairs >= NT ? 1 : NT / n_pairs;
    float acc[Cfg::SLOTS][VEC];                              // O (unnormalised), per slot
    int slot_g[Cfg::SLOTS], slot_c[Cfg::SLOTS], slot_kp[Cfg::SLOTS];
#pragma unroll
    for (int s = 0; s < Cfg::SLOTS; ++s) {
        const int v = tid + s * NT;
        const int pair = v % n_pairs;
        slot_kp[s] = v < n_pairs * KP ? v / n_pairs : KP;  // KP marks an idle slot
        slot_g[s] = pair / NC;
        slot_c[s] = pair - slot_g[s] * NC;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[s][e] = 0.f;
    }

    for (int t0 = lo; t0 < hi; t0 += BN) {
        const int tile_n = min(BN, hi - t0);                 // valid keys in this tile (>= 1)

        // ---- load K tile (group 0) and V tile (group 1); rows >= tile_n are never read
        for (int i = tid; i < BN * NC; i += NT) {
            const int j = i / NC, c = i - j * NC;
            if (j < tile_n) cp_async<16>(k_s + j * PITCH + c * 16, kg + (size_t)(t0 + j) * D + c * VEC);
        }
        cp_async_commit();
        for (int i = tid; i < BN * NC; i += NT) {
            const int j = i / NC, c = i - j * NC;
            if (j < tile_n) cp_async<16>(v_s + j * PITCH + c * 16, vg + (size_t)(t0 + j) * D + c * VEC);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this thread's K copies are done (V may still be in flight)
        __syncthreads();     // ... and everyone's; also orders the q_s writes before first use

        // ---- S_j = q_g . K_j for every head g of the tile (K chunk read once, used g_tile times)
        {
            float s_acc[GT];
#pragma unroll
            for (int g = 0; g < GT; ++g) s_acc[g] = 0.f;
            if (kj < tile_n) {
#pragma unroll
                for (int i = 0; i < Cfg::CPT; ++i) {
                    const int c = kpart + i * TPK;
                    if (c < NC) {
                        float kf[VEC];
                        chunk_to_float(*reinterpret_cast<const uint4*>(k_s + kj * PITCH + c * 16), kf, T());
#pragma unroll
                        for (int g = 0; g < GT; ++g) {
                            if (g < g_tile) {
                                const float* qg = q_s + g * D + c * VEC;
#pragma unroll
                                for (int e = 0; e < VEC; e += 4) {
                                    const float4 qv = *reinterpret_cast<const float4*>(qg + e);
                                    s_acc[g] += qv.x * kf[e] + qv.y * kf[e + 1] + qv.z * kf[e + 2] + qv.w * kf[e + 3];
                                }
                            }
                        }
                    }
                }
            }
            // sum the TPK partial dots of a key (its lanes are adjacent; all lanes take part)
#pragma unroll
            for (int g = 0; g < GT; ++g) {
                if (g < g_tile) {  // block-uniform, so every lane shuffles or none does
#pragma unroll
                    for (int o = TPK / 2; o > 0; o >>= 1) s_acc[g] += __shfl_xor_sync(0xffffffffu, s_acc[g], o);
                }
            }
            if (kpart == 0 && kj < tile_n) {
#pragma unroll
                for (int g = 0; g < GT; ++g)
                    if (g < g_tile) p_s[g * BN + kj] = s_acc[g];
            }
        }
        __syncthreads();

        // ---- online softmax per head: m_new, P = exp2(S - m_new), alpha = exp2(m - m_new), l
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const int g = warp + i * DEC_WARPS;
            if (g < g_tile) {  // warp-uniform
                float mx = -CUDART_INF_F;
                for (int j = lane; j < tile_n; j += 32) mx = fmaxf(mx, p_s[g * BN + j]);
                mx = warp_reduce_max(mx);
                const float m_new = fmaxf(m_i[i], mx);  // finite: the tile has a valid key
                const float alpha = exp2f(m_i[i] - m_new);  // m = -inf on the first tile -> 0
                float sum = 0.f;
                for (int j = lane; j < BN; j += 32) {
                    const float p = j < tile_n ? exp2f(p_s[g * BN + j] - m_new) : 0.f;
                    p_s[g * BN + j] = p;
                    sum += p;
                }
                sum = warp_reduce_sum(sum);
                l_i[i] = alpha * l_i[i] + sum;
                m_i[i] = m_new;
                if (lane == 0) alpha_s[g] = alpha;
            }
        }
        cp_async_wait<0>();  // V tile landed (this thread's part)
        __syncthreads();     // P, alpha and everyone's V visible

        // ---- O = alpha * O + sum_j P_j V_j   (rescale O by exp(m_old - m_new), then accumulate)
#pragma unroll
        for (int s = 0; s < Cfg::SLOTS; ++s) {
            if (slot_kp[s] < KP) {
                const int g = slot_g[s], c = slot_c[s];
                const float alpha = alpha_s[g];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[s][e] *= alpha;
                for (int j = slot_kp[s]; j < tile_n; j += KP) {
                    const float p = p_s[g * BN + j];
                    float vf[VEC];
                    chunk_to_float(*reinterpret_cast<const uint4*>(v_s + j * PITCH + c * 16), vf, T());
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[s][e] += p * vf[e];
                }
            }
        }
        __syncthreads();  // the next tile overwrites k_s, v_s, p_s, alpha_s
    }

    // ---- finalise: sum the KP partial O's (through the K tile's smem), divide by l, write
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const int g = warp + i * DEC_WARPS;
            if (g < g_tile) { m_fin[g] = m_i[i]; l_fin[g] = l_i[i]; }
        }
    }
    float* red = reinterpret_cast<float*>(k_s);  // [KP, n_pairs, VEC]; free after the loop's sync
#pragma unroll
    for (int s = 0; s < Cfg::SLOTS; ++s) {
        if (slot_kp[s] < KP) {
            const int v = tid + s * NT;  // == kp * n_pairs + pair
#pragma unroll
            for (int e = 0; e < VEC; ++e) red[v * VEC + e] = acc[s][e];
        }
    }
    __syncthreads();
    for (int pair = tid; pair < n_pairs; pair += NT) {
        const int g = pair / NC, c = pair - g * NC;
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = 0.f;
        for (int kp = 0; kp < KP; ++kp) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) o[e] += red[(kp * n_pairs + pair) * VEC + e];
        }
        const float l = l_fin[g];
        const float inv_l = l > 0.f ? 1.f / l : 0.f;  // empty range -> zeros
        const int h = h0 + g;
        if (write_partials) {
            float* op = o_part + (((size_t)split * B + b) * Hq + h) * D + c * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) op[e] = o[e] * inv_l;
        } else {
            T* op = out + ((size_t)b * Hq + h) * D + c * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) op[e] = from_float<T>(o[e] * inv_l);
        }
    }
    if (write_partials && tid < g_tile) {
        const float l = l_fin[tid];
        lse_part[((size_t)split * B + b) * Hq + h0 + tid] =
            l > 0.f ? (m_fin[tid] + log2f(l)) * LN2_F : -CUDART_INF_F;
    }
}

// --- combine -------------------------------------------------------------------------------
// Grid (B * Hq), THREADS threads. Row r = (b, h): lse = logsumexp_c lse_c, w_c = exp(lse_c - max),
// out = sum_c w_c O_c / sum_c w_c (zeros when every chunk was empty), as reference.merge_partials.
template <typename T, int DEC_MAX_SPLITS, int THREADS>
__global__ void __launch_bounds__(THREADS) decode_combine_kernel(
    const float* __restrict__ o_part,   // [splits, B*Hq, D]
    const float* __restrict__ lse_part, // [splits, B*Hq]
    T* __restrict__ out,                // [B*Hq, D] contiguous
    int num_splits, int BH, int D) {
    __shared__ float w_s[DEC_MAX_SPLITS];  // weight of each split
    __shared__ float inv_total_s;
    const int r = blockIdx.x, tid = threadIdx.x;
    if (tid < 32) {
        float mx = -CUDART_INF_F;
        for (int c = tid; c < num_splits; c += 32) mx = fmaxf(mx, lse_part[(size_t)c * BH + r]);
        mx = warp_reduce_max(mx);
        const float m_safe = mx == -CUDART_INF_F ? 0.f : mx;  // all chunks empty -> weights 0
        float total = 0.f;
        for (int c = tid; c < num_splits; c += 32) {
            const float w = expf(lse_part[(size_t)c * BH + r] - m_safe);  // exp(-inf) = 0
            w_s[c] = w;
            total += w;
        }
        total = warp_reduce_sum(total);
        if (tid == 0) inv_total_s = total > 0.f ? 1.f / total : 0.f;
    }
    __syncthreads();
    const float inv_total = inv_total_s;
    for (int d = tid; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int c = 0; c < num_splits; ++c) o += w_s[c] * o_part[((size_t)c * BH + r) * D + d];
        out[(size_t)r * D + d] = from_float<T>(o * inv_total);
    }
}
