// skinny.cuh: the main loop of the skinny (M <= 16, "GEMV-like") C = A W^T, shared by gemm.cu's
// gemm_skinny_kernel and the fused decode kernels of fused_decode.cu, which differ only in what
// they do before (an RMSNorm of A's rows) and after (the epilogue) this loop.
//
//   load_chunk / dot4          16-byte operand chunks straight from global memory into registers
//   skinny_rms_rows            prologue: 1 / sqrt(mean(a^2) + eps) of the block's 16 rows of A
//   skinny_tile                one block's partial C tile: 16 rows x S_NT groups of 8 weight rows,
//                              split over the warps along K (one partial tile per warp in smem)
//   skinny_rows                the weight rows of a block that owns consecutive outputs
//   skinny_sum                 a C element: the sum of the warps' partials (after a barrier)
//
// Lane (g, tq) = (lane / 4, lane % 4) loads, per K step of warp w, S_CH 16-byte chunks
// k = k0 + (4u + tq) * VEC of weight rows brow[nt] + g and (fp16/bf16) the same chunks of A rows
// m0 + g and m0 + g + 8:
//   fp16/bf16: a dot product does not depend on the order of k, so the 8 elements of a chunk
//     become two m16n8k16 k-steps without any shuffle: 32-bit pair i of the A chunks and of
//     the W chunk are fragment registers a[.] / b[.] (pairs 0, 1 -> first mma, 2, 3 -> second),
//     the same k permutation on both sides;
//   fp32: FMAs of the W chunk with the same chunk of each of the 16 A rows; the 4 lanes of a
//     row (tq) are summed by shuffles.
// With NORM, A's elements become T(a * inv_rms[m] * w[k]) as they are loaded: exactly the value
// (and the rounding) the unfused rmsnorm kernel writes, so the fused product sees the same A.
#pragma once
#include "common.cuh"
#include "ptx.cuh"

// The 16 bytes at row `row`, columns k..k+16/sizeof(T)-1 of a row-major matrix p (row stride ld),
// as raw bits: one vector load when `vec` (p 16-byte aligned, ld a multiple of the chunk) and the
// chunk lies inside [0, K); else element by element, zero outside the matrix (rows >= rows or
// columns >= K are never read).
template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* p, int row, int rows, long long ld, long long k, int K, bool vec) {
    constexpr int VEC = 16 / sizeof(T);
    uint4 r = {0u, 0u, 0u, 0u};
    if (row >= rows) return r;
    const T* src = p + row * ld + k;
    if (vec && k + VEC <= K) return *reinterpret_cast<const uint4*>(src);
    unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        if (k + e < K) {
            if constexpr (sizeof(T) == 2)
                w[e / 2] |= (unsigned)reinterpret_cast<const unsigned short*>(src)[e] << (16 * (e % 2));
            else
                w[e] = reinterpret_cast<const unsigned*>(src)[e];
        }
    }
    r.x = w[0]; r.y = w[1]; r.z = w[2]; r.w = w[3];
    return r;
}

__device__ __forceinline__ float dot4(const uint4& x, const uint4& y) {
    return __uint_as_float(x.x) * __uint_as_float(y.x) + __uint_as_float(x.y) * __uint_as_float(y.y) +
           __uint_as_float(x.z) * __uint_as_float(y.z) + __uint_as_float(x.w) * __uint_as_float(y.w);
}

// A chunk x of T elements scaled as rmsnorm_write does: T(x * inv_rms * w), w the same chunk of
// the norm weight.
template <typename T>
__device__ __forceinline__ uint4 norm_chunk(const uint4& x, const uint4& w, float inv_rms) {
    constexpr int VEC = 16 / sizeof(T);
    uint4 r;
    const T* xe = reinterpret_cast<const T*>(&x);
    const T* we = reinterpret_cast<const T*>(&w);
    T* re = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int e = 0; e < VEC; ++e) re[e] = from_float<T>(to_float(xe[e]) * inv_rms * to_float(we[e]));
    return r;
}

// --- prologue: RMSNorm statistics of the block's rows -----------------------------------------
// inv_rms[m] = 1 / sqrt(mean_k A[m0 + m][k]^2 + eps) for m < 16 (0 for rows >= M): warp w takes
// rows w, w + S_WARPS, ... The caller puts a barrier between this and skinny_tile.
template <typename T, int S_WARPS>
__device__ __forceinline__ void skinny_rms_rows(const T* A, int M, long long lda, int m0, int K, float eps,
                                                float* inv_rms /* smem [16] */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = warp; m < 16; m += S_WARPS) {
        float ss = 0.f;
        if (m0 + m < M) {  // warp-uniform
            const T* row = A + (long long)(m0 + m) * lda;
            for (int k = lane; k < K; k += 32) {
                const float f = to_float(row[k]);
                ss = fmaf(f, f, ss);
            }
        }
        ss = warp_reduce_sum(ss);
        if (lane == 0) inv_rms[m] = m0 + m < M ? 1.0f / sqrtf(ss / (float)K + eps) : 0.f;
    }
}

// __launch_bounds__ of the kernels built on skinny_tile (gemm.cu, fused_decode.cu), S_WARPS warps.
// The fp32 tile keeps a chunk of all 16 A rows in flight and needs more than 128 registers (207 on
// sm_90); ptxas for sm_100 given no minimum caps it at 128 and spills (gemm_skinny_kernel,
// gemm_residual_kernel), so from sm_100 on the bound names a minimum: one block per SM for fp32,
// two for the 16-bit tiles (they fit in 128 registers). Older arches keep the plain bound their
// code was measured with (the H100 run of 2026-11-26).
template <typename T>
constexpr int skinny_min_blocks() { return sizeof(T) == 4 ? 1 : 2; }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define SKINNY_LAUNCH_BOUNDS(T, S_WARPS) __launch_bounds__((S_WARPS) * 32, skinny_min_blocks<T>())
#else
#define SKINNY_LAUNCH_BOUNDS(T, S_WARPS) __launch_bounds__((S_WARPS) * 32)
#endif

// --- the main loop ----------------------------------------------------------------------------
// red[warp][m][8 nt + j] = this warp's share (its K steps) of sum_k A'[m0 + m][k] * W[brow[nt] + j][k],
// A' = A or its normalised rows (NORM: norm_w [K], inv_rms [16] from skinny_rms_rows). Weight rows
// at or past bend[nt] read as zero. vec: A, W (and norm_w) 16-byte aligned, lda / ldb multiples of
// a chunk. The caller syncs before reading red.
template <typename T, int S_WARPS, int S_NT, int S_CH, bool NORM>
__device__ __forceinline__ void skinny_tile(const T* __restrict__ A, int M, long long lda, int m0,
                                            const T* __restrict__ B, long long ldb, const int (&brow)[S_NT],
                                            const int (&bend)[S_NT], int K, bool vec,
                                            const T* __restrict__ norm_w, const float* inv_rms,
                                            float (&red)[S_WARPS][16][8 * S_NT]) {
    constexpr int VEC = 16 / sizeof(T), KSTEP = 4 * S_CH * VEC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    if constexpr (sizeof(T) == 2) {
        float acc[S_NT][4];  // C fragment: rows g (e < 2), g + 8, cols nt*8 + 2tq + e % 2
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
        for (long long k0 = (long long)warp * KSTEP; k0 < K; k0 += (long long)S_WARPS * KSTEP) {
            uint4 xa[S_CH][2], wb[S_CH][S_NT];  // all loads of the step issued before any math
#pragma unroll
            for (int u = 0; u < S_CH; ++u) {
                const long long k = k0 + (4 * u + tq) * VEC;
                xa[u][0] = load_chunk(A, m0 + g, M, lda, k, K, vec);
                xa[u][1] = load_chunk(A, m0 + g + 8, M, lda, k, K, vec);
#pragma unroll
                for (int nt = 0; nt < S_NT; ++nt) wb[u][nt] = load_chunk(B, brow[nt] + g, bend[nt], ldb, k, K, vec);
            }
#pragma unroll
            for (int u = 0; u < S_CH; ++u) {
                if constexpr (NORM) {
                    const uint4 wn = load_chunk(norm_w, 0, 1, 0, k0 + (4 * u + tq) * VEC, K, vec);
                    xa[u][0] = norm_chunk<T>(xa[u][0], wn, inv_rms[g]);
                    xa[u][1] = norm_chunk<T>(xa[u][1], wn, inv_rms[g + 8]);
                }
                const unsigned af0[4] = {xa[u][0].x, xa[u][1].x, xa[u][0].y, xa[u][1].y};
                const unsigned af1[4] = {xa[u][0].z, xa[u][1].z, xa[u][0].w, xa[u][1].w};
#pragma unroll
                for (int nt = 0; nt < S_NT; ++nt) {
                    const unsigned bf0[2] = {wb[u][nt].x, wb[u][nt].y}, bf1[2] = {wb[u][nt].z, wb[u][nt].w};
                    mma_m16n8k16<T>(acc[nt], af0, bf0);
                    mma_m16n8k16<T>(acc[nt], af1, bf1);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][g + 8 * (e / 2)][nt * 8 + 2 * tq + e % 2] = acc[nt][e];
    } else {
        float acc[S_NT][16];  // rows m0 + m of C, column 8 nt + g (this lane's k part)
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int m = 0; m < 16; ++m) acc[nt][m] = 0.f;
        for (long long k0 = (long long)warp * KSTEP; k0 < K; k0 += (long long)S_WARPS * KSTEP) {
            uint4 wb[S_CH][S_NT];
#pragma unroll
            for (int u = 0; u < S_CH; ++u)
#pragma unroll
                for (int nt = 0; nt < S_NT; ++nt)
                    wb[u][nt] = load_chunk(B, brow[nt] + g, bend[nt], ldb, k0 + (4 * u + tq) * VEC, K, vec);
#pragma unroll
            for (int u = 0; u < S_CH; ++u) {
                const long long k = k0 + (4 * u + tq) * VEC;
                uint4 wn = {0u, 0u, 0u, 0u};
                if constexpr (NORM) wn = load_chunk(norm_w, 0, 1, 0, k, K, vec);
#pragma unroll
                for (int m = 0; m < 16; ++m) {
                    if (m0 + m < M) {  // block-uniform
                        uint4 xv = load_chunk(A, m0 + m, M, lda, k, K, vec);
                        if constexpr (NORM) xv = norm_chunk<T>(xv, wn, inv_rms[m]);
#pragma unroll
                        for (int nt = 0; nt < S_NT; ++nt) acc[nt][m] += dot4(xv, wb[u][nt]);
                    }
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int m = 0; m < 16; ++m) {
                acc[nt][m] = quad_sum(acc[nt][m]);
                if (tq == 0) red[warp][m][nt * 8 + g] = acc[nt][m];
            }
    }
}

// Weight rows of a block that owns the 8 * S_NT consecutive outputs from n0: group nt is rows
// n0 + 8 nt .. n0 + 8 nt + 7 (rows >= N read as zero).
template <int S_NT>
__device__ __forceinline__ void skinny_rows(int n0, int N, int (&brow)[S_NT], int (&bend)[S_NT]) {
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) { brow[nt] = n0 + 8 * nt; bend[nt] = N; }
}

// C element (m, n) of the block's tile: the warps' partials summed in a fixed order.
template <int S_WARPS, int NR>
__device__ __forceinline__ float skinny_sum(const float (&red)[S_WARPS][16][NR], int m, int n) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < S_WARPS; ++w) sum += red[w][m][n];
    return sum;
}
