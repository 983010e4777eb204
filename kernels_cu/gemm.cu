// gemm.cu: batched C = A B^T (NT) and C = A B (NN), float32 accumulation, same-dtype output.
//
//   impl       idea                                                                dtypes
//   v1 simt    smem-tiled 128x64x16 block tile, 256 threads, 8x4 register micro-tile  f32 f16 bf16
//              per thread, next K tile prefetched into registers while computing
//   v2 mma     tensor cores: mma.sync m16n8k16 (f32 acc), ldmatrix fragments (.trans   f16 bf16
//              for NN's B), 128x128x32 block tile, 8 warps of 64x32, a STAGES-deep
//              cp.async ring in dynamic smem with one barrier per k-tile (scalar
//              zero-filled loads on tails / unaligned operands), grouped tile raster
//   v3 skinny  M <= 16 (decode projections), NT only: streams each row of B (a weight  f32 f16 bf16
//              W [N, K]) once with 16-byte loads straight into registers; A's rows
//              are the m16 tile of mma.sync (fp16/bf16) or FMA rows (fp32); the
//              block's warps split K and meet in smem (main loop: skinny.cuh, which
//              the fused decode kernels of fused_decode.cu share)
//
// Layouts (all row-major, last dim contiguous; row strides lda/ldb in elements):
//   a: [batch, M, K]   b: NT [batch, N, K] | NN [batch, K, N]   c: [batch, M, N] contiguous
// Batch index z (0..nbatch) maps to operand offsets through two collapsed batch dims:
//   off = (z / batch_inner) * s_outer + (z % batch_inner) * s_inner   (stride 0 = broadcast)
// (cupyattn/gemm.py folds a batch that shares one b into M before launching: one GEMM, not B.)
//
// Tile shapes come from cupyattn/config.py (GEMM_TILES, GEMM_SKINNY, with the reason for each)
// as template arguments; the thread mappings below are written for those shapes and
// static_assert them.
#include "common.cuh"
#include "ptx.cuh"
#include "skinny.cuh"

// --- v1: SIMT register-blocked --------------------------------------------------------------
// a: [nbatch, M, K] (row stride lda), b: NT [nbatch, N, K] | NN [nbatch, K, N] (row stride ldb),
// c: [nbatch, M, N] contiguous. grid = (tiles_m * tiles_n, min(nbatch, 65535)), block = 256.
template <typename T, bool NT, int S_BM, int S_BN, int S_BK, int S_THREADS>
__global__ void __launch_bounds__(S_THREADS)
gemm_simt_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                 int M, int N, int K, int tiles_n, long long nbatch, long long batch_inner,
                 long long a_so, long long a_si, long long lda,
                 long long b_so, long long b_si, long long ldb, int /*vec_ok: unused by v1*/) {
    static_assert(S_BM == 128 && S_BN == 64 && S_BK == 16 && S_THREADS == 256,
                  "the 16x16-thread, 8x4-per-thread mapping below is written for 128x64x16");
    __shared__ __align__(16) float As[S_BK][S_BM + 4];  // As[k][m]: A tile, transposed
    __shared__ __align__(16) float Bs[S_BK][S_BN + 4];  // Bs[k][n]
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int m0 = (blockIdx.x / tiles_n) * S_BM, n0 = (blockIdx.x % tiles_n) * S_BN;

    for (long long z = blockIdx.y; z < nbatch; z += gridDim.y) {
        const T* A = a + (z / batch_inner) * a_so + (z % batch_inner) * a_si;
        const T* B = b + (z / batch_inner) * b_so + (z % batch_inner) * b_si;
        T* C = c + z * (long long)M * N;

        float acc[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

        // Global -> register staging. A tile 128x16: element e = tid + 256 i -> row e/16, k e%16
        // (16 consecutive threads read 16 consecutive k of one row). B likewise, or for NN
        // 16x64: k = e/64, n = e%64. Out-of-range elements read as 0 (tails in M, N and K).
        float ra[8], rb[4];
        auto load_tile = [&](int k0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int gm = m0 + ty + 16 * i, gk = k0 + tx;
                ra[i] = (gm < M && gk < K) ? to_float(A[gm * lda + gk]) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (NT) {
                    const int gn = n0 + ty + 16 * i, gk = k0 + tx;
                    rb[i] = (gn < N && gk < K) ? to_float(B[gn * ldb + gk]) : 0.f;
                } else {
                    const int gk = k0 + tid / 64 + 4 * i, gn = n0 + tid % 64;
                    rb[i] = (gk < K && gn < N) ? to_float(B[gk * ldb + gn]) : 0.f;
                }
            }
        };

        load_tile(0);
        for (int k0 = 0; k0 < K; k0 += S_BK) {
#pragma unroll
            for (int i = 0; i < 8; ++i) As[tx][ty + 16 * i] = ra[i];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (NT) Bs[tx][ty + 16 * i] = rb[i];
                else Bs[tid / 64 + 4 * i][tid % 64] = rb[i];
            }
            __syncthreads();
            if (k0 + S_BK < K) load_tile(k0 + S_BK);  // in flight while the tile below is used

            // C_tile += A_tile B_tile: thread owns rows {ty*4+i, 64+ty*4+i}, cols tx*4+j.
#pragma unroll
            for (int kk = 0; kk < S_BK; ++kk) {
                const float4 a_lo = *reinterpret_cast<const float4*>(&As[kk][ty * 4]);
                const float4 a_hi = *reinterpret_cast<const float4*>(&As[kk][64 + ty * 4]);
                const float4 bv = *reinterpret_cast<const float4*>(&Bs[kk][tx * 4]);
                const float av[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
                const float bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
            }
            __syncthreads();  // the next iteration overwrites As/Bs
        }

        // Epilogue: guarded stores (M, N tails).
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int gm = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
            if (gm >= M) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int gn = n0 + tx * 4 + j;
                if (gn < N) C[(long long)gm * N + gn] = from_float<T>(acc[i][j]);
            }
        }
    }
}

// --- v2 helpers -----------------------------------------------------------------------------
// Stage an R x C tile (C a multiple of 8) of a row-major 16-bit matrix g (row stride ld) at
// (r0, c0) into smem s (row stride LDS) as 16-byte chunks: chunk ch = tid + 256 i is row ch/(C/8),
// cols (ch%(C/8))*8..+7. A chunk fully inside (rlim, clim) on an aligned operand goes by
// cp.async; any other chunk is read element by element with zero fill (tails, odd strides).
template <int R, int C, int LDS, int THREADS>
__device__ __forceinline__ void stage_tile(unsigned short* s, const unsigned short* g, long long ld,
                                           int r0, int rlim, int c0, int clim, bool vec_ok) {
    constexpr int CPR = C / 8;
    static_assert(R * CPR % THREADS == 0, "every thread stages the same number of chunks");
#pragma unroll
    for (int i = 0; i < R * CPR / THREADS; ++i) {
        const int ch = threadIdx.x + THREADS * i;
        const int r = ch / CPR, cc = (ch % CPR) * 8;
        const int gr = r0 + r, gc = c0 + cc;
        unsigned short* sp = s + r * LDS + cc;
        if (vec_ok && gr < rlim && gc + 8 <= clim) {
            cp_async<16>(sp, g + gr * ld + gc);
        } else {
            unsigned short v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = (gr < rlim && gc + e < clim) ? g[gr * ld + gc + e] : 0;
            uint4 w;
            w.x = v[0] | (unsigned(v[1]) << 16);
            w.y = v[2] | (unsigned(v[3]) << 16);
            w.z = v[4] | (unsigned(v[5]) << 16);
            w.w = v[6] | (unsigned(v[7]) << 16);
            *reinterpret_cast<uint4*>(sp) = w;
        }
    }
}

// --- v2: tensor-core mma.sync ----------------------------------------------------------------
// Same arguments as v1. vec_ok bit 0: both operands' base pointers are 16-byte aligned and every
// stride (lda/ldb, batch strides) is a multiple of 8 elements (cp.async needs that); bit 1: c is
// 4-byte aligned and N is even (paired 32-bit stores in the epilogue).
// Dynamic shared memory: STAGES x (A [BM][BK+PAD] + B [BN][BK+PAD] | [BK][BN+PAD]) halves, the
// size cupyattn/gemm.py launches with. Tiles are rastered in groups of GROUP_M tile rows (all
// tile columns of a group before the next), so the B tiles a group reads stay in L2.
template <typename T, bool NT, int T_BM, int T_BN, int T_BK, int T_THREADS, int T_PAD, int STAGES, int MINB,
          int GROUP_M>
__global__ void __launch_bounds__(T_THREADS, MINB)
gemm_mma_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                int M, int N, int K, int tiles_n, long long nbatch, long long batch_inner,
                long long a_so, long long a_si, long long lda,
                long long b_so, long long b_si, long long ldb, int vec_ok) {
    static_assert(T_BM == 128 && T_BN == 128 && T_BK == 32 && T_THREADS == 256,
                  "the 2x4 warps of 64x32 below are written for a 128x128x32 tile and 8 warps");
    constexpr int T_LDA = T_BK + T_PAD;     // smem row stride (halves) of A and of NT's B
    constexpr int T_LDB_NN = T_BN + T_PAD;  // smem row stride of NN's B [k][n]
    constexpr int B_ROWS = NT ? T_BN : T_BK;            // NT: Bs[n][k]; NN: Bs[k][n]
    constexpr int B_LDS = NT ? T_LDA : T_LDB_NN;
    constexpr int A_ELEMS = T_BM * T_LDA, B_ELEMS = B_ROWS * B_LDS;  // per stage
    static_assert(STAGES >= 2 && A_ELEMS % 8 == 0, "ring of >= 2 stages, 16-byte aligned B slots");
    extern __shared__ uint4 smem_u4[];
    unsigned short* As = reinterpret_cast<unsigned short*>(smem_u4);  // [STAGES][m][k]
    unsigned short* Bs = As + STAGES * A_ELEMS;                        // [STAGES][n][k] | [STAGES][k][n]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // warp tile: rows wm*64..+63, cols wn*32..+31
    const int tiles_m = (M + T_BM - 1) / T_BM;
    const int grp = blockIdx.x / (GROUP_M * tiles_n), first_m = grp * GROUP_M;
    const int grp_m = min(tiles_m - first_m, GROUP_M), in_grp = blockIdx.x - grp * GROUP_M * tiles_n;
    const int m0 = (first_m + in_grp % grp_m) * T_BM, n0 = (in_grp / grp_m) * T_BN;
    const int nk = (K + T_BK - 1) / T_BK;
    const bool vec = (vec_ok & 1) != 0, pair_store = (vec_ok & 2) != 0;

    for (long long z = blockIdx.y; z < nbatch; z += gridDim.y) {
        const unsigned short* A = reinterpret_cast<const unsigned short*>(a) +
                                  (z / batch_inner) * a_so + (z % batch_inner) * a_si;
        const unsigned short* B = reinterpret_cast<const unsigned short*>(b) +
                                  (z / batch_inner) * b_so + (z % batch_inner) * b_si;
        T* C = c + z * (long long)M * N;

        auto load_stage = [&](int st, int k0) {
            stage_tile<T_BM, T_BK, T_LDA, T_THREADS>(As + st * A_ELEMS, A, lda, m0, M, k0, K, vec);
            if constexpr (NT) stage_tile<T_BN, T_BK, T_LDA, T_THREADS>(Bs + st * B_ELEMS, B, ldb, n0, N, k0, K, vec);
            else stage_tile<T_BK, T_BN, T_LDB_NN, T_THREADS>(Bs + st * B_ELEMS, B, ldb, k0, K, n0, N, vec);
        };

        float acc[4][4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

        // Ring: k-tiles kt+1 .. kt+STAGES-1 are in flight (cp.async) while k-tile kt feeds the mma.
        // One barrier per k-tile: wait for tile kt, barrier (tile kt visible to all, and every warp
        // is done with tile kt-1), refill tile kt-1's slot with tile kt+STAGES-1, compute kt.
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nk) load_stage(s, s * T_BK);
            cp_async_commit();
        }
        for (int kt = 0; kt < nk; ++kt) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (kt + STAGES - 1 < nk) load_stage((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * T_BK);
            cp_async_commit();  // (empty past the end: keeps the group count uniform)
            const unsigned short* sA = As + kt % STAGES * A_ELEMS;
            const unsigned short* sB = Bs + kt % STAGES * B_ELEMS;
#pragma unroll
            for (int ks = 0; ks < T_BK; ks += 16) {
                // B fragments of the warp's 4 n8-tiles: matrix i = lane/8 covers n-tile
                // 2p + i/2 and k half i%2, so r = {b0, b1} of tile 2p then of tile 2p+1.
                unsigned bf[4][2];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    unsigned r[4];
                    if constexpr (NT) {
                        const int n = wn * 32 + p * 16 + (lane >> 4) * 8 + (lane & 7);
                        const int k = ks + ((lane >> 3) & 1) * 8;
                        ldmatrix<4>(r, sB + n * B_LDS + k);
                    } else {
                        const int k = ks + ((lane >> 3) & 1) * 8 + (lane & 7);
                        const int n = wn * 32 + p * 16 + (lane >> 4) * 8;
                        ldmatrix<4, true>(r, sB + k * B_LDS + n);
                    }
                    bf[2 * p][0] = r[0]; bf[2 * p][1] = r[1];
                    bf[2 * p + 1][0] = r[2]; bf[2 * p + 1][1] = r[3];
                }
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    // A fragment: matrix i covers rows (i%2)*8.. and k half i/2 -> a[0..3].
                    unsigned af[4];
                    const int m = wm * 64 + mt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
                    ldmatrix<4>(af, sA + m * T_LDA + ks + (lane >> 4) * 8);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) mma_m16n8k16<T>(acc[mt][nt], af, bf[nt]);
                }
            }
        }
        __syncthreads();  // a next batch entry's prologue refills slots the last k-tiles still read

        // Epilogue: acc[mt][nt][e] is C[row, col] with row = wm*64 + mt*16 + g + 8*(e/2),
        // col = wn*32 + nt*8 + 2t + e%2. Pairs go out as one 32-bit store when aligned.
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int gm = m0 + wm * 64 + mt * 16 + g + 8 * h;
                if (gm >= M) continue;
                T* crow = C + (long long)gm * N;
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const int gn = n0 + wn * 32 + nt * 8 + 2 * t;
                    const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
                    if (pair_store && gn + 1 < N) {  // gn even, N even, c aligned: 4-byte aligned pair
                        *reinterpret_cast<unsigned*>(crow + gn) = pack2<T>(v0, v1);
                    } else {
                        if (gn < N) crow[gn] = from_float<T>(v0);
                        if (gn + 1 < N) crow[gn + 1] = from_float<T>(v1);
                    }
                }
            }
    }
}

// --- v3: skinny M (GEMV-like), NT ----------------------------------------------------------------
// Same arguments as v1 (NT only; vec_ok bit 0: both operands 16-byte aligned, every stride a
// multiple of 16 bytes). grid = (tiles_m * tiles_n, min(nbatch, 65535)), tiles_m = ceil(M / 16),
// tiles_n = ceil(N / NR): a block owns C rows m0..m0+15 and columns n0..n0+NR-1, NR = 8 * S_NT.
// Its S_WARPS warps split K in steps of KSTEP elements (warp w takes steps w, w + S_WARPS, ...),
// so one block round reads S_WARPS * KSTEP contiguous elements of each of its NR rows of B; the
// loop and its register layout are skinny_tile (skinny.cuh). The warps' partial C tiles meet in
// smem, one thread per output element sums and rounds once.
template <typename T, int S_WARPS, int S_NT, int S_CH>
__global__ void SKINNY_LAUNCH_BOUNDS(T, S_WARPS)
gemm_skinny_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                   int M, int N, int K, int tiles_n, long long nbatch, long long batch_inner,
                   long long a_so, long long a_si, long long lda,
                   long long b_so, long long b_si, long long ldb, int vec_ok) {
    constexpr int NR = 8 * S_NT, NT = S_WARPS * 32;
    __shared__ float red[S_WARPS][16][NR];  // per-warp partial C tile [m][n]
    const int tid = threadIdx.x;
    const int m0 = (blockIdx.x / tiles_n) * 16, n0 = (blockIdx.x % tiles_n) * NR;
    int brow[S_NT], bend[S_NT];  // 8-row group nt of B: rows n0 + 8 nt .. (rows >= N read as 0)
    skinny_rows(n0, N, brow, bend);

    for (long long z = blockIdx.y; z < nbatch; z += gridDim.y) {
        const T* A = a + (z / batch_inner) * a_so + (z % batch_inner) * a_si;
        const T* B = b + (z / batch_inner) * b_so + (z % batch_inner) * b_si;
        T* C = c + z * (long long)M * N;
        skinny_tile<T, S_WARPS, S_NT, S_CH, false>(A, M, lda, m0, B, ldb, brow, bend, K, (vec_ok & 1) != 0,
                                                   nullptr, nullptr, red);
        __syncthreads();
        for (int i = tid; i < 16 * NR; i += NT) {
            const int m = i / NR, n = i - m * NR;
            if (m0 + m < M && n0 + n < N) C[(long long)(m0 + m) * N + n0 + n] = from_float<T>(skinny_sum(red, m, n));
        }
        __syncthreads();  // red is rewritten by the next batch entry
    }
}
