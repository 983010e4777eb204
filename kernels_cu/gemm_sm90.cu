// gemm_sm90.cu: batched C = A B^T (NT) and C = A B (NN) on Hopper tensor cores (sm_90a only; the
// sibling of gemm.cu, whose variants serve every other GPU).
//
//   impl       idea                                                                dtypes
//   v4 wgmma   warp-specialised and persistent: a producer warp streams A and B     f16 bf16
//              tiles by TMA into a STAGES-deep shared-memory ring (full/empty
//              mbarriers, StageRing in sm90.cuh); two consumer warpgroups each
//              own 64 rows of the 128 x BN output tile and multiply with
//              wgmma.m64nBNk16 straight from the 128-byte-swizzled stages, one
//              wgmma group in flight; registers moved from producer to consumers
//              with setmaxnreg; every block walks tiles blockIdx.x, + gridDim.x,
//              ... in a grouped raster; the epilogue stores the fp32 accumulators
//              rounded to T straight from registers (guarded tails)
//
// Layouts: a [batch, M, K] and, NT, b [batch, N, K], NN, b [batch, K, N], last dim contiguous,
// reached only through their tensor maps (cupyattn/gemm.py builds them, cupyattn/tma.py checks
// what TMA can read); c [batch, M, N] contiguous. The maps are 4-D, innermost first:
//   a: {K, M, batch_inner, batch_outer}   b NT: {K, N, ...}   b NN: {N, K, ...}
// a batch dimension an operand does not have (stride 0: broadcast) has size 1 in its map and
// coordinate 0 (flags bits A_INNER .. B_OUTER say which it has). Tails in M, N and K are the
// TMA's zero fill: out-of-bounds rows and k contribute zeros; the epilogue skips rows/cols
// outside C.
//
// Shared memory per stage (1 KB-aligned, so the 128 B swizzle pattern starts on its boundary):
//   A tile [128 m][64 k], 128-byte rows (one swizzle atom per 8 rows)           16 KB
//   B tile NT [BN n][64 k] as A;  NN BN/64 boxes of [64 k][64 n] (N-major)       BN x 128 B
// wgmma descriptors (layouts: ptx_sm90.cuh): K-major operands SBO = 1024 (8 rows of 128 B),
// the k16 step s at start + 32 s; NN's B is N-major: SBO = 1024 (8 k rows), LBO = 8 KB (the next
// box of 64 n), step s at start + 16 s rows = 2 KB.
#include "common.cuh"
#include "sm90.cuh"

constexpr int WG_BM = 128, WG_BK = 64, WG_CONSUMERS = 2, WG_THREADS = 128 * (1 + WG_CONSUMERS);
enum GemmWgmmaFlags { A_INNER = 1, A_OUTER = 2, B_INNER = 4, B_OUTER = 8, PAIR_STORE = 16 };

// --- tile scheduler ------------------------------------------------------------------------------
// Tile t of the batch-major sequence: batch z, then a grouped raster of GROUP_M tile rows (all
// tile columns of a group before the next group) so that the B tiles a group reads stay in L2.
struct GemmTile { long long z; int m0, n0; };
template <int BN, int GROUP_M>
__device__ __forceinline__ GemmTile gemm_tile(long long t, int tiles_m, int tiles_n) {
    const long long per_batch = (long long)tiles_m * tiles_n;
    const long long z = t / per_batch;
    const int r = (int)(t - z * per_batch);
    const int grp = r / (GROUP_M * tiles_n), first_m = grp * GROUP_M;
    const int grp_m = min(tiles_m - first_m, GROUP_M), in_grp = r - grp * GROUP_M * tiles_n;
    return {z, (first_m + in_grp % grp_m) * WG_BM, (in_grp / grp_m) * BN};
}

// --- producer: one thread issues every TMA copy ---------------------------------------------------
template <bool NT, int BN, int STAGES, int GROUP_M>
__device__ __forceinline__ void gemm_produce(const TmaMap* map_a, const TmaMap* map_b, unsigned char* smem,
                                             StageRing<STAGES>& ring, int K, int tiles_m, int tiles_n,
                                             long long total, long long batch_inner, int flags) {
    constexpr int A_BYTES = WG_BM * WG_BK * 2, STAGE_BYTES = A_BYTES + BN * WG_BK * 2;
    const int nk = (K + WG_BK - 1) / WG_BK;
    for (long long t = blockIdx.x; t < total; t += gridDim.x) {
        const GemmTile tile = gemm_tile<BN, GROUP_M>(t, tiles_m, tiles_n);
        const int zi = (int)(tile.z % batch_inner), zo = (int)(tile.z / batch_inner);
        const int a_zi = flags & A_INNER ? zi : 0, a_zo = flags & A_OUTER ? zo : 0;
        const int b_zi = flags & B_INNER ? zi : 0, b_zo = flags & B_OUTER ? zo : 0;
        for (int kb = 0; kb < nk; ++kb) {
            ring.acquire();                                  // every consumer released this slot
            ring.commit(STAGE_BYTES);                        // the copies below complete its phase
            unsigned char* sa = smem + ring.stage * STAGE_BYTES;
            unsigned char* sb = sa + A_BYTES;
            tma_load<4>(sa, map_a, ring.full_bar(), {kb * WG_BK, tile.m0, a_zi, a_zo});
            if constexpr (NT) {
                tma_load<4>(sb, map_b, ring.full_bar(), {kb * WG_BK, tile.n0, b_zi, b_zo});
            } else {
#pragma unroll
                for (int j = 0; j < BN / 64; ++j)
                    tma_load<4>(sb + j * WG_BK * 128, map_b, ring.full_bar(), {tile.n0 + 64 * j, kb * WG_BK, b_zi, b_zo});
            }
            ring.advance();
        }
    }
}

// --- consumer: one warpgroup, 64 rows of the tile ------------------------------------------------------
// acc[BN/2]: the wgmma m64nBN fp32 fragment (row 16 w + lane/4 + 8 (i/2), col 8 j + 2 (lane%4) + i%2
// for acc[4 j + i], w = warp in the warpgroup).
template <typename T, bool NT, int BN, int STAGES>
__device__ __forceinline__ void gemm_mainloop(float (&acc)[BN / 2], unsigned char* smem, StageRing<STAGES>& ring,
                                              int nk, int wg, bool leader) {
    constexpr int A_BYTES = WG_BM * WG_BK * 2, STAGE_BYTES = A_BYTES + BN * WG_BK * 2;
    int prev = -1;
    for (int kb = 0; kb < nk; ++kb) {
        ring.wait();                                         // the stage's TMA bytes landed
        const unsigned char* sa = smem + ring.stage * STAGE_BYTES + wg * 64 * 128;
        const unsigned char* sb = smem + ring.stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < WG_BK / 16; ++ks) {
            const unsigned long long da = smem_desc(sa + 32 * ks, 16, 1024, SWIZZLE_128B);
            const unsigned long long db = NT ? smem_desc(sb + 32 * ks, 16, 1024, SWIZZLE_128B)
                                             : smem_desc(sb + 16 * 128 * ks, WG_BK * 128, 1024, SWIZZLE_128B);
            wgmma_ss<T, BN, 0, NT ? 0 : 1>(acc, da, db, (kb | ks) != 0);  // scale-d 0: the tile's first
        }
        wgmma_commit_group();
        wgmma_wait_group<1>();                               // k-block kb-1 has read its stage
        if (prev >= 0 && leader) ring.release(prev);
        prev = ring.stage;
        ring.advance();
    }
    wgmma_wait_group<0>();
    wgmma_fence_acc(acc);
    if (leader) ring.release(prev);
}

// --- epilogue: fp32 accumulators -> T, straight to global memory ---------------------------------------
template <typename T, int BN>
__device__ __forceinline__ void gemm_store(const float (&acc)[BN / 2], T* __restrict__ c, int M, int N,
                                           int row0, int n0, bool pair_store) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int gm = row0 + g + 8 * h;
        if (gm >= M) continue;
        T* crow = c + (long long)gm * N;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int gn = n0 + 8 * j + 2 * t;
            const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if (pair_store && gn + 1 < N) {  // gn even, N even, c 4-byte aligned
                *reinterpret_cast<unsigned*>(crow + gn) = pack2<T>(v0, v1);
            } else {
                if (gn < N) crow[gn] = from_float<T>(v0);
                if (gn + 1 < N) crow[gn + 1] = from_float<T>(v1);
            }
        }
    }
}

// --- v4: the kernel ----------------------------------------------------------------------------------
// grid = (min(tiles, SMs)), block = 384 (warpgroup 0: producer, 1-2: consumers); dynamic shared
// memory STAGES x (16 KB + BN x 128 B) + 1 KB (alignment). REG_P / REG_C: per-thread registers
// after setmaxnreg for the producer / consumer warpgroups (128 REG_P + 256 REG_C <= 65536).
template <typename T, bool NT, int BN, int STAGES, int GROUP_M, int REG_P, int REG_C>
__global__ void __launch_bounds__(WG_THREADS, 1)
gemm_wgmma_kernel(const __grid_constant__ TmaMap map_a, const __grid_constant__ TmaMap map_b, T* __restrict__ c,
                  int M, int N, int K, int tiles_m, int tiles_n, long long nbatch, long long batch_inner, int flags) {
    static_assert(BN % 64 == 0 && BN <= 256, "BN: a multiple of 64 (NN boxes), at most 256 (wgmma N)");
    static_assert(128 * REG_P + 128 * WG_CONSUMERS * REG_C <= 65536, "register budget of one SM");
    extern __shared__ uint4 smem_raw[];  // aligned here: an __align__(1024) would pad the static part
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw) + (1024 - smem_u32(smem_raw) % 1024) % 1024;
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    StageRing<STAGES> ring(full, empty);
    if (threadIdx.x == 0) ring.init(WG_CONSUMERS);
    __syncthreads();

    const long long total = nbatch * tiles_m * tiles_n;
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<REG_P>();
        if (threadIdx.x == 0)
            gemm_produce<NT, BN, STAGES, GROUP_M>(&map_a, &map_b, smem, ring, K, tiles_m, tiles_n, total,
                                                  batch_inner, flags);
    } else {
        setmaxnreg_inc<REG_C>();
        const int nk = (K + WG_BK - 1) / WG_BK, cw = wg - 1;
        const bool leader = threadIdx.x % 128 == 0;
        float acc[BN / 2];
        for (long long t = blockIdx.x; t < total; t += gridDim.x) {
            const GemmTile tile = gemm_tile<BN, GROUP_M>(t, tiles_m, tiles_n);
            gemm_mainloop<T, NT, BN, STAGES>(acc, smem, ring, nk, cw, leader);
            const int row0 = tile.m0 + cw * 64 + 16 * ((threadIdx.x % 128) / 32);
            gemm_store<T, BN>(acc, c + tile.z * (long long)M * N, M, N, row0, tile.n0, (flags & PAIR_STORE) != 0);
        }
    }
}
