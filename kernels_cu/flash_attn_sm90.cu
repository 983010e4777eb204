// flash_attn_sm90.cu: fused attention forward on Hopper tensor cores (sm_90a only; the sibling of
// flash_attn.cu, whose variants serve every other GPU and every case this one does not take).
//
//   impl       idea                                                                dtypes
//   v3 wgmma   FlashAttention-2's algorithm (Dao 2023, Algorithm 1) in the shape of     f16 bf16
//              FlashAttention-3 (Shah et al. 2024): warp-specialised. A producer warp
//              loads Q_i once and K_j, V_j by TMA into two stage rings (full/empty
//              mbarriers, StageRing in sm90.cuh); two consumer warpgroups own 64 query
//              rows each: S_ij = Q_i K_j^T by wgmma with both operands in shared memory,
//              the online softmax on the fp32 accumulators in registers, P_ij rounded to
//              T straight into wgmma A fragments, O_i += P_ij V_j by wgmma with A from
//              registers and V_j from shared memory (MN-major descriptor: no transpose
//              copy); registers moved from producer to consumers with setmaxnreg.
//              OVERLAP: the softmax of tile j runs while P_{j-1} V_{j-1} is in flight
//              (FA3 section 3.2); off: each tile's steps in order. PINGPONG: the two
//              consumer warpgroups take turns issuing wgmmas through named barriers, so
//              one's softmax overlaps the other's matmuls (FA3 section 3.1).
//              impl="wgmma" (impl=None on sm_90 where config.ATTN_AUTO_WGMMA says).
//   v4 wgmma_  v3 in a persistent grid (one block per SM) fed by a tile scheduler,   f16 bf16
//      persistent  longest first in L2-sized head sections; also window, softcap, packed
//              and paged sequences. Its own file, flash_attn_sm90_persistent.cu (the
//              steps both share: flash_attn_sm90.cuh). Explicit impl only: not yet run on a GPU.
//
// Layouts: q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (last dim contiguous), reached only through
// their tensor maps (cupyattn/flash_attn_sm90.py builds them): 4-D, innermost first
// {D, S, H, B}, box {64, rows, 1, 1}: one box is 64 elements = one 128-byte swizzle row per
// sequence position, so a D-wide tile is D / 64 boxes side by side. Rows past Sq / Sk are TMA's
// zero fill. out [B, Hq, Sq, D] C-contiguous, lse [B, Hq, Sq] fp32 (or null), key_lengths [B].
//
// Shared memory (dynamic, 1 KB-aligned so every 128 B-swizzled box starts on its pattern):
//   Q_i   D/64 boxes of [BLOCK_M = 128 rows][128 B]                   BLOCK_M x D x 2 bytes
//   K_j   STAGES slots, each D/64 boxes of [BLOCK_N rows][128 B]       BLOCK_N x D x 2 per slot
//   V_j   STAGES slots, as K_j
// wgmma descriptors (layouts: ptx_sm90.cuh): Q (A) and K (B of S = Q K^T) are K-major: SBO = 1024
// (8 rows of 128 B), k16 step ks at box ks / 4, byte 32 (ks % 4); consumer warpgroup c reads Q
// rows 64c.. (+ 64c x 128 B). V (B of O = P V, B[key][d] = V[key][d]) is MN-major: SBO = 1024
// (8 keys), LBO = BLOCK_N x 128 B (the next box of 64 d), k16 step kk at + 16 kk rows.
//
// Masking and non-finite values (cupyattn/reference.py): keys j >= key_lengths[b] (clamped to
// [0, Sk]) and, with CAUSAL, j > i + Sk - Sq (bottom-right) get S = -inf before the row max;
// `mask` (optional) is an additive fp32 tensor read through 4 element strides (0 on broadcast
// dims, the key stride 0 or 1), its -inf entries hiding their keys whatever the score. Key tiles
// past the last visible key are never loaded. A V row hidden by key_lengths may hold
// anything (an unwritten cache: NaN), and P = 0 times NaN is NaN, so the producer zeroes those
// rows of a slot after its TMA lands and before the consumers may read it. A row that sees no
// key keeps m_i = -inf, l_i = 0 and is written as zeros, lse = -inf.
#include "common.cuh"
#include "flash_attn_sm90.cuh"

// --- tile scheduler: which (batch*head, query tile) a block computes --------------------------
// One block per tile, grid = m_tiles x B*Hq. Non-causal: the query tiles of one head are
// neighbours in launch order (they read the same K/V, which then stays in L2). Causal: query
// tile m sees (m + 1) / m_tiles of the keys, so the last tiles of every head launch first and
// the light ones fill the tail of the grid.
struct Fa3Tile { int bh, m0; };
template <bool CAUSAL>
__device__ __forceinline__ Fa3Tile fa3_tile(int m_tiles) {
    const int idx = blockIdx.x, heads = gridDim.x / m_tiles;
    if (CAUSAL) return {idx % heads, (m_tiles - 1 - idx / heads) * FA3_BLOCK_M};
    return {idx / m_tiles, (idx % m_tiles) * FA3_BLOCK_M};
}

// Keys the tile may see: [0, k_end); kl = keys that exist for this sequence (key_lengths).
struct Fa3Keys { int k_end, kl, n_tiles; };
template <bool CAUSAL, int BLOCK_N>
__device__ __forceinline__ Fa3Keys fa3_keys(const int* key_lengths, int b, int m0, int Sq, int Sk) {
    const int kl = key_lengths ? min(Sk, max(key_lengths[b], 0)) : Sk;
    int k_end = kl;
    if (CAUSAL) k_end = min(k_end, m0 + FA3_BLOCK_M + Sk - Sq);
    return {k_end, kl, k_end > 0 ? (k_end + BLOCK_N - 1) / BLOCK_N : 0};
}

// --- producer: warp 0; lane 0 issues every TMA copy --------------------------------------------
// Q_i once (its own barrier), then K_j and V_j into their rings in key order. A V slot that holds
// rows past key_lengths is loaded against `tail_bar` instead: the warp waits for it, zeroes those
// rows, makes the stores visible to the async proxy (wgmma) and then completes the slot's full
// barrier by a plain arrive. That happens at most once per block (the last key tile).
template <int D, int BLOCK_N, int STAGES>
__device__ __forceinline__ void fa3_produce(const TmaMap* map_q, const TmaMap* map_k, const TmaMap* map_v,
                                            unsigned char* smem, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                            unsigned long long* q_bar, unsigned long long* tail_bar,
                                            Fa3Keys keys, int b, int h, int hk, int m0, int Sk) {
    using L = Fa3Smem<D, BLOCK_N>;
    const int lane = threadIdx.x % 32;
    if (keys.n_tiles == 0) return;                        // nothing to see: nothing is loaded
    unsigned char* sk = smem + L::Q_BYTES;
    unsigned char* sv = sk + STAGES * L::KV_BYTES;
    if (lane == 0) {
        mbar_arrive_expect_tx(q_bar, L::Q_BYTES);
#pragma unroll
        for (int c = 0; c < L::BOXES; ++c) tma_load<4>(smem + c * L::Q_BOX, map_q, q_bar, {64 * c, m0, h, b});
    }
    for (int j = 0; j < keys.n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        if (lane == 0) {                                  // K_j
            kring.acquire();                              // both consumers released this slot
            kring.commit(L::KV_BYTES);
            unsigned char* dst = sk + kring.stage * L::KV_BYTES;
#pragma unroll
            for (int c = 0; c < L::BOXES; ++c)
                tma_load<4>(dst + c * L::KV_BOX, map_k, kring.full_bar(), {64 * c, n0, hk, b});
        }
        kring.advance();
        unsigned char* dst = sv + vring.stage * L::KV_BYTES;
        const bool tail = keys.kl < Sk && n0 + BLOCK_N > keys.kl;  // rows kl.. are not this sequence's
        if (lane == 0) {                                  // V_j
            vring.acquire();
            unsigned long long* bar = tail ? tail_bar : vring.full_bar();
            mbar_arrive_expect_tx(bar, L::KV_BYTES);
#pragma unroll
            for (int c = 0; c < L::BOXES; ++c) tma_load<4>(dst + c * L::KV_BOX, map_v, bar, {64 * c, n0, hk, b});
        }
        if (tail) {
            mbar_wait(tail_bar, 0);                       // once per block: parity 0
            fa3_zero_v_rows_and_publish<D, BLOCK_N, STAGES>(dst, keys.kl - n0, vring);
        }
        vring.advance();
    }
}

// --- consumer: the softmax of one key tile (the wgmma steps around it: flash_attn_sm90.cuh) ------
// The softmax of one key tile, in place on S_ij (fp32, registers only: it may run while the
// previous tile's P V is in flight). Masking first, only on tiles that need it (keys past k_end,
// keys above the causal diagonal of the tile's first row, a mask tensor, or a negative scale: the
// fast path takes the max of unscaled S); hidden keys get -inf, so P is exactly 0 there. Then the
// online softmax step (flash_attn_sm90.cuh fa3_online_softmax: m_i, P_ij, l_i and alpha).
template <int BLOCK_N, bool CAUSAL>
__device__ __forceinline__ void fa3_softmax(float (&s)[BLOCK_N / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            Fa3Row me, Fa3Keys keys, Fa3Mask mask, int n0, int m0, int Sq, int diag,
                                            float scale_log2) {
    float mul = scale_log2;
    if (scale_log2 < 0.0f || mask.p || n0 + BLOCK_N > keys.k_end || (CAUSAL && n0 + BLOCK_N - 1 > m0 + diag)) {
        mul = 1.0f;                                       // S in scaled log2 units from here
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = me.row0 + 8 * r;
            const int lim = CAUSAL ? min(keys.k_end, i + diag + 1) : keys.k_end;
            // a row's mask reads are constant offsets from one pointer (key stride 0 or 1)
            const float* mrow = mask.p && i < Sq ? mask.p + i * mask.sq + (mask.sk ? n0 + 2 * me.t : 0) : nullptr;
#pragma unroll
            for (int jj = 0; jj < BLOCK_N / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * jj + 2 * r + e];
                    const bool seen = n0 + 8 * jj + 2 * me.t + e < lim;
                    x = fa3_masked_score(x * scale_log2, mrow, mask.sk ? 8 * jj + e : 0, seen);
                }
        }
    }
    fa3_online_softmax<BLOCK_N>(s, m, l, alpha, mul);
}

// --- consumer: the key loop of one warpgroup ------------------------------------------------------
// OVERLAP = false: each tile in order, S_ij | wait | softmax | P_ij V_j | wait.
// OVERLAP = true (FlashAttention-3's intra-warpgroup pipelining, section 3.2): S_{j+1} and P_j V_j
// are issued together, and the softmax of S_{j+1} runs while P_j V_j is still in flight; only the
// O rescale and the P packing wait for it:
//   S_0 | wait | softmax_0 | pack_0
//   tile j >= 1:  issue S_j, then P_{j-1} V_{j-1} | wait S_j (wait_group 1) | softmax_j |
//                 wait P V (wait_group 0) | rescale O, pack P_j
//   P_{n-1} V_{n-1} | wait
// A K slot is released once its S has retired, a V slot once its P V has. PINGPONG: every group
// of wgmmas issued above is one turn (fa3_turn_begin / _end); warpgroup 1 gives warpgroup 0 the
// first turn. Both see the same number of key tiles, so the turns alternate to the end (the last
// hand-off is never taken, which a barrier allows). Ring waits cannot deadlock against the turns:
// the slot a warpgroup waits for was released by the other one turns earlier (STAGES >= 2).
template <typename T, int D, int BLOCK_N, int STAGES, bool CAUSAL, bool OVERLAP, bool PINGPONG>
__device__ __forceinline__ void fa3_consume(unsigned char* smem, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                            unsigned long long* q_bar, Fa3Keys keys, Fa3Mask mask, int m0, int Sq,
                                            int Sk, float scale_log2, float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
    using L = Fa3Smem<D, BLOCK_N>;
    const int cw = threadIdx.x / 128 - 1, w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const Fa3Row me{m0 + 64 * cw + 16 * w + lane / 4, lane % 4};
    const bool leader = threadIdx.x % 128 == 0;
    const int diag = Sk - Sq;
    const unsigned char* sq = smem + 64 * cw * 128;
    const unsigned char* sk = smem + L::Q_BYTES;
    const unsigned char* sv = sk + STAGES * L::KV_BYTES;

    // On chip: O_i = 0, l_i = 0 (this lane's part of the row sum), m_i = -inf (scaled log2 units).
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.0f;
    if (keys.n_tiles == 0) return;
    mbar_wait(q_bar, 0);                                  // Q_i has landed (loaded once)

    float s[BLOCK_N / 2], alpha[2];
    unsigned p[BLOCK_N / 16][4];
    if (PINGPONG && cw == 1) named_bar_arrive(1, 256);   // warpgroup 0 takes the first turn
    // Each tile's step is straight-line (fa3_key_step): ptxas tracks wgmma accumulators path by
    // path, and a wait that only a correlated branch provides makes it serialise every wgmma (C7514).
    int j = 0;
    if constexpr (OVERLAP) {
        fa3_s_alone<T, D, BLOCK_N, STAGES, PINGPONG>(s, sq, sk, kring, cw, leader);  // tile 0: S_0 alone
        fa3_softmax<BLOCK_N, CAUSAL>(s, m, l, alpha, me, keys, mask, 0, m0, Sq, diag, scale_log2);
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
        j = 1;
    }
    for (; j < keys.n_tiles; ++j)
        fa3_key_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG>(s, o, p, sq, sk, sv, kring, vring, cw, leader,
                                                               [&](float (&a)[2]) {
            fa3_softmax<BLOCK_N, CAUSAL>(s, m, l, a, me, keys, mask, j * BLOCK_N, m0, Sq, diag, scale_log2);
        });
    if constexpr (OVERLAP) fa3_pv_alone<T, D, BLOCK_N, STAGES, PINGPONG>(o, p, sv, vring, cw, leader);  // the last P V
}

// --- epilogue: O_i / l_i rounded to T, straight to global memory; lse ---------------------------
// L_i = m_i + log(l_i) (natural log; m in log2 units). Rows that saw no key: zeros and -inf; rows
// with a NaN (or +inf) visible score: NaN (common.cuh row_scale / row_lse).
template <typename T, int D>
__device__ __forceinline__ void fa3_store(const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                          T* __restrict__ out, float* __restrict__ lse, long long bh, int m0,
                                          int Sq, bool pair_store) {
    const int cw = threadIdx.x / 128 - 1, w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float lsum = quad_sum(l[r]);
        const float inv = row_scale(lsum);
        const int i = m0 + 64 * cw + 16 * w + g + 8 * r;
        if (i >= Sq) continue;
        if (lse && t == 0) lse[bh * Sq + i] = row_lse(m[r], lsum);
        T* orow = out + (bh * Sq + i) * D;
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj) {
            const int col = 8 * jj + 2 * t;
            const float v0 = o[4 * jj + 2 * r] * inv, v1 = o[4 * jj + 2 * r + 1] * inv;
            if (pair_store) {
                *reinterpret_cast<unsigned*>(orow + col) = pack2<T>(v0, v1);
            } else {
                orow[col] = from_float<T>(v0);
                orow[col + 1] = from_float<T>(v1);
            }
        }
    }
}

// --- v3: the kernel --------------------------------------------------------------------------------
// grid = (m_tiles * B * Hq), block = 384 (warpgroup 0: producer, 1-2: consumers); dynamic shared
// memory Q + 2 x STAGES K/V slots + 1 KB (alignment), cupyattn.config.AttnWgmmaTile.smem_bytes.
// REG_P / REG_C: per-thread registers after setmaxnreg (128 REG_P + 256 REG_C <= 65536).
// flags bit 0: out is 4-byte aligned (pairs of elements stored as one 32-bit word).
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, bool CAUSAL, int REG_P, int REG_C>
__global__ void __launch_bounds__(FA3_THREADS, 1)
flash_attn_wgmma(const __grid_constant__ TmaMap map_q,   // q [B, Hq, Sq, D]
                 const __grid_constant__ TmaMap map_k,   // k [B, Hkv, Sk, D]
                 const __grid_constant__ TmaMap map_v,   // v [B, Hkv, Sk, D]
                 T* __restrict__ out,                    // [B, Hq, Sq, D] C-contiguous
                 float* __restrict__ lse,                // [B, Hq, Sq] or null
                 const int* __restrict__ key_lengths,    // [B] or null
                 const float* __restrict__ mask,         // additive, broadcast by m_s*; or null
                 long long m_sb, long long m_sh, long long m_sq, long long m_sk,
                 int Hq, int Hkv, int Sq, int Sk, int m_tiles, float scale_log2, int flags) {
    static_assert(D % 64 == 0 && D <= 256, "D: whole 128-byte boxes, at most 256 (wgmma N)");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N: whole k16 steps of P V, wgmma N <= 256");
    static_assert(128 * REG_P + 128 * FA3_CONSUMERS * REG_C <= 65536, "register budget of one SM");
    extern __shared__ uint4 smem_raw[];  // aligned here: an __align__(1024) would pad the static part
    unsigned char* smem = reinterpret_cast<unsigned char*>(smem_raw) + (1024 - smem_u32(smem_raw) % 1024) % 1024;
    __shared__ unsigned long long kfull[STAGES], kempty[STAGES], vfull[STAGES], vempty[STAGES], q_bar, tail_bar;
    StageRing<STAGES> kring(kfull, kempty), vring(vfull, vempty);
    if (threadIdx.x == 0) {
        kring.init(FA3_CONSUMERS);
        vring.init(FA3_CONSUMERS);
        mbar_init(&q_bar, 1);
        mbar_init(&tail_bar, 1);
        mbar_fence_init();
    }
    __syncthreads();

    const Fa3Tile tile = fa3_tile<CAUSAL>(m_tiles);
    const int b = tile.bh / Hq, h = tile.bh % Hq, hk = h / (Hq / Hkv);  // GQA: K/V never repeated
    const Fa3Keys keys = fa3_keys<CAUSAL, BLOCK_N>(key_lengths, b, tile.m0, Sq, Sk);
    if (threadIdx.x < 128) {
        setmaxnreg_dec<REG_P>();
        if (threadIdx.x < 32)
            fa3_produce<D, BLOCK_N, STAGES>(&map_q, &map_k, &map_v, smem, kring, vring, &q_bar, &tail_bar, keys, b, h,
                                            hk, tile.m0, Sk);
    } else {
        setmaxnreg_inc<REG_C>();
        float o[D / 2], m[2], l[2];
        const Fa3Mask mk{mask ? mask + b * m_sb + h * m_sh : nullptr, m_sq, m_sk};
        fa3_consume<T, D, BLOCK_N, STAGES, CAUSAL, OVERLAP, PINGPONG>(smem, kring, vring, &q_bar, keys, mk, tile.m0, Sq,
                                                                      Sk, scale_log2, o, m, l);
        fa3_store<T, D>(o, m, l, out, lse, tile.bh, tile.m0, Sq, (flags & 1) != 0);
    }
}
