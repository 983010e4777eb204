// flash_attn_sm90_persistent.cu: v4, the persistent Hopper attention kernel (sm_90a only). The same
// FlashAttention-2 algorithm and warp-specialised wgmma pipeline as v3 (flash_attn_sm90.cu, whose
// header explains the layouts and descriptors; the consumer's wgmma steps are shared through
// flash_attn_sm90.cuh), with what v3 lacks:
//   - grid = the SMs; a tile scheduler (Fa3Sched, flash_attn_sm90_sched.cuh) hands each block tile
//     after tile. Order: one sequence after another; within it, query heads in sections of
//     `heads_per_section` (whose K/V fit in L2 together, config.attn_wgmma_heads_per_section);
//     within a section, query-tile ranks across its heads, heaviest rank first when a right bound
//     (causal) makes tiles unequal.
//     Static: block i takes tiles i, i + grid, ...; dynamic (`counter`): the scheduler warp claims
//     the next tile with one relaxed atomic add while the consumers still compute this one.
//   - packed sequences (cu_q / cu_k, attention_varlen's layout) and paged keys (a block table over
//     pages [num_pages, page_size, Hkv, D], attention_paged), beside the dense [B, H, S, D] layout;
//   - window=(left, right) (tiles outside it never loaded) and softcap (the cap on the fp32
//     scores, before any mask: paged.cuh soft_cap, as flash_attn.cu's serving variants);
//   - diagonal-only masking: each tile's key tiles fall in three runs, [0, j_left) and
//     [j_right, n_tiles) masked (window's left edge; diagonal, window's right edge, key end) and
//     the bulk between them in a loop of its own with no masking at all.
// impl="wgmma_persistent" of attention, attention_varlen and attention_paged (explicit only: not yet
// run on a GPU; cupyattn/flash_attn_sm90_persistent.py).
//
// Tensor maps (cupyattn/flash_attn_sm90_persistent.py builds them): 4-D, innermost first, every
// box 64 elements wide (one 128-byte swizzle row), coordinates {64 c, row, head, outer}:
//   q dense [B, Hq, Sq, D]: {D, Sq, Hq, B}, row = m0, outer = b; packed [total_q, Hq, D]:
//     {D, total_q, Hq, 1}, row = q0 + m0 (q0 = cu_q[b]), outer = 0. Box rows 128.
//   k, v dense {D, Sk, Hkv, B}, row = n0, outer = b; packed [total_k, Hkv, D] {D, total_k, Hkv, 1},
//     row = k0 + n0; paged [num_pages, P, Hkv, D] {D, P, Hkv, num_pages}, row = key % P, outer =
//     its page id. Box rows BLOCK_N, or P when a page holds fewer (P >= 8: each box is whole 1 KB
//     swizzle atoms): BLOCK_N / P copies per box column, lane l of the loader warp issues the
//     copy of the tile's page l, whose id it read from the block table itself (one coalesced load
//     of the tile's page ids per warp and key tile, none per row; FlashInfer stages them in shared
//     memory for its many loader threads, here the one warp keeps them in registers).
// TMA reads whatever lies in a box: rows past a packed sequence belong to the next one, rows past
// a paged sequence to some page. Keys past the sequence's end get S = -inf in the masked run; V
// rows past it are zeroed in shared memory by the loader before P V reads them (as v3 does for
// key_lengths), wherever they are not TMA's zero fill. Query rows past a sequence are computed and
// never stored.
//
// Warps: the producer warpgroup (setmaxnreg REG_P) runs the loader (warp 0: every TMA copy) and
// the scheduler (warp 1: tile order, counter); warps 2-3 leave at once. Two consumer warpgroups
// (REG_C) compute 64 query rows each, as in v3.
// Shared memory: v3's (Q, STAGES K and V slots; config.AttnWgmmaTile.smem_bytes), plus static
// barriers and two work slots. The rings, with their owners:
//   work  2 slots of Fa3Work   the scheduler warp writes one, arrives on full; the loader warp and
//                              the consumers read it in place (the registers are the pipeline's):
//                              the loader's lane 0 arrives on empty once the tile's copies are
//                              issued, every consumer thread once the tile is stored (count 257)
//   q     1 slot (Q_i)         loader: expect_tx + TMA; the consumers' leaders release it once
//                              the tile's last S = Q K^T has retired (count 2)
//   k, v  STAGES slots each    as v3; the rings run on across tiles (stage and phase carry over)
//   tail  1 barrier            a V slot whose rows past the keys must be zeroed lands here first
// Counter (dynamic schedule): unsigned[1] in global memory, 0 at launch. Exactly `total` adds are
// made in a launch (every block that had a first tile makes one per tile it computed, the last of
// them claiming past the end), so the add that returns total - 1 is the last one of the launch:
// that block subtracts `total` again, and the counter is 0 for the next launch (no memset).
#include "common.cuh"
#include "paged.cuh"
#include "flash_attn_sm90.cuh"
#include "flash_attn_sm90_sched.cuh"

// --- loader: warp 0 of the producer warpgroup -----------------------------------------------------
// Per tile of the work ring: Q_i (once the consumers released the last one), then K_j and V_j in
// key order. Lane 0 issues every copy, except paged tiles over pages shorter than BLOCK_N: lane l
// issues page l's. A V slot holding rows past the keys is loaded against `tail_bar` and zeroed
// there first (v3's scheme; its phase flips on each use).
template <int D, int BLOCK_N, int STAGES>
__device__ __forceinline__ void fa3p_load(const TmaMap* map_q, const TmaMap* map_k, const TmaMap* map_v,
                                          unsigned char* smem, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                          StageRing<1>& qring, StageRing<2>& wring, const Fa3Work* slots,
                                          unsigned long long* tail_bar, const int* table, int bt_stride, int log2_page,
                                          int num_pages, int Hq, int Hkv, bool packed_q, bool packed_k) {
    using L = Fa3Smem<D, BLOCK_N>;
    const int lane = threadIdx.x % 32;
    const bool paged = table != nullptr;
    const int rows = paged ? min(BLOCK_N, 1 << log2_page) : BLOCK_N;  // per copy (the maps' box)
    const int copies = BLOCK_N / rows;
    unsigned tail_phase = 0;
    for (;;) {
        wring.wait();
        const Fa3Work& w = slots[wring.stage];            // read in place, where used (few registers here)
        if (w.b < 0) return;
        const int hk = w.h / (Hq / Hkv);                  // GQA: K/V never repeated
        if (w.n_tiles > 0) {
            if (lane == 0) {                              // Q_i, once the last tile's S are done with its slot
                qring.acquire();
                qring.commit(L::Q_BYTES);
#pragma unroll
                for (int c = 0; c < L::BOXES; ++c)
                    tma_load<4>(smem + c * L::Q_BOX, map_q, qring.full_bar(),
                                {64 * c, w.q0 + w.m0, w.h, packed_q ? 0 : w.b});
            }
            qring.advance();
        }
        for (int j = 0; j < w.n_tiles; ++j) {
            const int n0 = w.n_lo + j * BLOCK_N;
            // this lane's copy: rows n0 + lane * rows .. (+ rows); its page id (a page past the
            // sequence's keys is never looked up: page 0 stands in, its rows are hidden)
            const int key = n0 + lane * rows;
            int row = w.k0 + key, outer = packed_k ? 0 : w.b;
            if (paged && lane < copies) {
                const int pg = key < w.sk ? table[(long long)w.b * bt_stride + (key >> log2_page)] : 0;
                outer = min(max(pg, 0), num_pages - 1);
                row = key & ((1 << log2_page) - 1);
            }
            kring.acquire();                              // every lane that issues has seen the slot free
            if (lane == 0) kring.commit(L::KV_BYTES);
            __syncwarp();                                 // expect_tx before any copy completes
            unsigned char* dk = smem + L::Q_BYTES + kring.stage * L::KV_BYTES + lane * rows * 128;
            if (lane < copies) {
#pragma unroll
                for (int c = 0; c < L::BOXES; ++c)
                    tma_load<4>(dk + c * L::KV_BOX, map_k, kring.full_bar(), {64 * c, row, hk, outer});
            }
            kring.advance();
            unsigned char* dv = smem + L::Q_BYTES + (STAGES + vring.stage) * L::KV_BYTES;
            const bool tail = n0 + BLOCK_N > w.v_zero_from;
            unsigned long long* bar = tail ? tail_bar : vring.full_bar();
            vring.acquire();
            if (lane == 0) mbar_arrive_expect_tx(bar, L::KV_BYTES);
            __syncwarp();
            if (lane < copies) {
#pragma unroll
                for (int c = 0; c < L::BOXES; ++c)
                    tma_load<4>(dv + lane * rows * 128 + c * L::KV_BOX, map_v, bar, {64 * c, row, hk, outer});
            }
            if (tail) {                                   // zero V rows v_zero_from - n0 .., then publish
                mbar_wait(tail_bar, tail_phase);
                tail_phase ^= 1u;
                fa3_zero_v_rows_and_publish<D, BLOCK_N, STAGES>(dv, max(w.v_zero_from - n0, 0), vring);
            }
            vring.advance();
        }
        __syncwarp();                                     // every lane is done with the slot
        if (lane == 0) wring.release(wring.stage);
        wring.advance();
    }
}

// --- consumer: the softmax of one key tile, masked or not (window, softcap, mask tensor) -----------
// What a masked key tile needs to know about its rows: local row i of the sequence sees keys
// [lo(i), hi(i)) with lo(i) = i + diag - left, hi(i) = i + diag + right + 1, within [0, k_end).
struct Fa3Vis {
    int left, right;       // window; -1 unbounded
    float softcap_log2;    // 0: off
    const float* mask;     // additive [b, h, i, j] at b m_sb + h m_sh + i m_sq + j m_sk; or null
    long long m_sb, m_sh, m_sq, m_sk;
};

// MASK = false: the bulk, every key visible to every row (fast path: the max of unscaled S, the
// scale folded into the exp2 FMA; the host takes it only with scale >= 0). MASK = true: S scaled
// to log2 units, capped (softcap), the mask tensor added, keys outside a row's range -inf. Then
// the online softmax step (flash_attn_sm90.cuh fa3_online_softmax: m_i, P_ij, l_i and alpha).
template <int BLOCK_N, bool MASK>
__device__ __forceinline__ void fa3p_softmax(float (&s)[BLOCK_N / 2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             Fa3Row me, const Fa3Work& w, const Fa3Vis& v, int n0, float scale_log2) {
    float mul = scale_log2;
    if constexpr (MASK) {
        mul = 1.0f;                                       // S in scaled log2 units from here
        const int k_end = w.k_end, diag = w.sk - w.sq;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = me.row0 + 8 * r, pos = i + diag;  // pos: the row's diagonal key
            const int lo = v.left < 0 || pos <= v.left ? 0 : pos - v.left;
            const int hi = v.right < 0 || pos >= k_end - 1 - v.right ? k_end : pos + v.right + 1;
            // a row's mask reads are constant offsets from one pointer (key stride 0 or 1)
            const float* mrow = v.mask && i < w.sq ? v.mask + w.b * v.m_sb + w.h * v.m_sh + i * v.m_sq
                                                         + (v.m_sk ? n0 + 2 * me.t : 0) : nullptr;
#pragma unroll
            for (int jj = 0; jj < BLOCK_N / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * jj + 2 * r + e];
                    const int j = n0 + 8 * jj + 2 * me.t + e;
                    const bool seen = j >= lo && j < hi;
                    x = fa3_masked_score(soft_cap(x * scale_log2, v.softcap_log2), mrow, v.m_sk ? 8 * jj + e : 0, seen);
                }
        }
    }
    fa3_online_softmax<BLOCK_N>(s, m, l, alpha, mul);
}

// --- consumer: the key loop of one warpgroup over one tile ---------------------------------------------
// v3's schedule (fa3_consume: OVERLAP, PINGPONG), in three runs of key tiles: masked [0, j_left),
// unmasked [j_left, j_right), masked [j_right, n_tiles); each run a loop of its own whose body is
// straight-line (ptxas tracks wgmma accumulators path by path: C7514). With OVERLAP the first tile
// is issued alone and always takes the masked softmax (correct for any tile). Q_i's slot is released
// as soon as the tile's last S has retired, so the producer loads the next Q_i under the last P V.
// Turns (PINGPONG) carry over from tile to tile: both warpgroups take the same number in each tile,
// so warpgroup 1's last hand-off of a tile is warpgroup 0's first turn of the next.
//
// One key tile of a run: flash_attn_sm90.cuh fa3_key_step with this kernel's softmax (MASK: the
// masked or the bulk one) at key n0 = n_lo + j BLOCK_N.
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, bool MASK>
__device__ __forceinline__ void fa3p_step(float (&s)[BLOCK_N / 2], float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4],
                                          float (&m)[2], float (&l)[2], const unsigned char* sq, const unsigned char* sk,
                                          const unsigned char* sv, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                          int cw, bool leader, Fa3Row me, const Fa3Work& w, const Fa3Vis& v, int n0,
                                          float scale_log2) {
    fa3_key_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG>(s, o, p, sq, sk, sv, kring, vring, cw, leader,
                                                           [&](float (&alpha)[2]) {
        fa3p_softmax<BLOCK_N, MASK>(s, m, l, alpha, me, w, v, n0, scale_log2);
    });
}

template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG>
__device__ __forceinline__ void fa3p_consume(unsigned char* smem, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                             StageRing<1>& qring, const Fa3Work& w, const Fa3Vis& v, float scale_log2,
                                             float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
    using L = Fa3Smem<D, BLOCK_N>;
    const int cw = threadIdx.x / 128 - 1, wi = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const Fa3Row me{w.m0 + 64 * cw + 16 * wi + lane / 4, lane % 4};
    const bool leader = threadIdx.x % 128 == 0;
    const unsigned char* sq = smem + 64 * cw * 128;
    const unsigned char* sk = smem + L::Q_BYTES;
    const unsigned char* sv = sk + STAGES * L::KV_BYTES;

    // On chip: O_i = 0, l_i = 0 (this lane's part of the row sum), m_i = -inf (scaled log2 units).
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.0f;
    if (w.n_tiles == 0) return;
    qring.wait();                                         // Q_i has landed

    float s[BLOCK_N / 2];
    unsigned p[BLOCK_N / 16][4];
    int j = 0;
    if constexpr (OVERLAP) {                              // tile 0: S_0 alone, masked softmax, P_0 packed
        float alpha[2];
        fa3_s_alone<T, D, BLOCK_N, STAGES, PINGPONG>(s, sq, sk, kring, cw, leader);
        fa3p_softmax<BLOCK_N, true>(s, m, l, alpha, me, w, v, w.n_lo, scale_log2);
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
        j = 1;
    }
    for (; j < w.j_left; ++j)
        fa3p_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG, true>(s, o, p, m, l, sq, sk, sv, kring, vring, cw, leader,
                                                                  me, w, v, w.n_lo + j * BLOCK_N, scale_log2);
    for (; j < w.j_right; ++j)
        fa3p_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG, false>(s, o, p, m, l, sq, sk, sv, kring, vring, cw, leader,
                                                                   me, w, v, w.n_lo + j * BLOCK_N, scale_log2);
    for (; j < w.n_tiles; ++j)
        fa3p_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG, true>(s, o, p, m, l, sq, sk, sv, kring, vring, cw, leader,
                                                                  me, w, v, w.n_lo + j * BLOCK_N, scale_log2);
    if (leader) qring.release(qring.stage);               // every S of the tile has retired
    qring.advance();
    if constexpr (OVERLAP) fa3_pv_alone<T, D, BLOCK_N, STAGES, PINGPONG>(o, p, sv, vring, cw, leader);  // the last P V
}

// --- epilogue: O_i / l_i rounded to T, straight to global memory; lse ---------------------------
// Local row i of the tile's sequence goes to out row out0 + i * stride (rows of D elements; dense
// [B, Hq, Sq, D]: out0 = (b Hq + h) Sq, stride 1; packed [total_q, Hq, D]: out0 = q0 Hq + h,
// stride Hq) and lse[lse0 + i] (dense [B, Hq, Sq]: (b Hq + h) Sq; packed [Hq, total_q]: h total_q
// + q0). L_i = m_i + log(l_i); no key seen: zeros and -inf (common.cuh row_scale / row_lse).
template <typename T, int D, int R>
__device__ __forceinline__ void fa3p_store_row(const float (&o)[D / 2], float m, float l, T* __restrict__ out,
                                               float* __restrict__ lse, long long out0, int stride, long long lse0,
                                               int i, int t, int sq, bool pair_store) {
    const float lsum = quad_sum(l);
    const float inv = row_scale(lsum);
    if (i >= sq) return;
    if (lse && t == 0) lse[lse0 + i] = row_lse(m, lsum);
    T* orow = out + (out0 + (long long)i * stride) * D;
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
        const int col = 8 * jj + 2 * t;
        const float v0 = o[4 * jj + 2 * R] * inv, v1 = o[4 * jj + 2 * R + 1] * inv;
        if (pair_store) {
            *reinterpret_cast<unsigned*>(orow + col) = pack2<T>(v0, v1);
        } else {
            orow[col] = from_float<T>(v0);
            orow[col + 1] = from_float<T>(v1);
        }
    }
}

template <typename T, int D>
__device__ __forceinline__ void fa3p_store(const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                           T* __restrict__ out, float* __restrict__ lse, long long out0, int stride,
                                           long long lse0, int m0, int sq, bool pair_store) {
    const int cw = threadIdx.x / 128 - 1, wi = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int i = m0 + 64 * cw + 16 * wi + lane / 4;    // rows i (R = 0) and i + 8 (R = 1)
    fa3p_store_row<T, D, 0>(o, m[0], l[0], out, lse, out0, stride, lse0, i, lane % 4, sq, pair_store);
    fa3p_store_row<T, D, 1>(o, m[1], l[1], out, lse, out0, stride, lse0, i + 8, lane % 4, sq, pair_store);
}

// The dynamic shared memory, from its first 1 KB boundary (every 128 B-swizzled box on its pattern).
__device__ __forceinline__ unsigned char* fa3p_align(uint4* raw) {
    return reinterpret_cast<unsigned char*>(raw) + (1024 - smem_u32(raw) % 1024) % 1024;
}

// --- v4: the kernel --------------------------------------------------------------------------------
// grid = (min(SMs, tiles)), block = 384 (warpgroup 0: producer, 1-2: consumers); dynamic shared
// memory as v3 (config.AttnWgmmaTile.smem_bytes). Sq: dense rows per sequence, packed total_q (lse's
// row length); Sk: dense keys, packed total_k (the maps' row extent), paged unused. flags bit 0:
// out is 4-byte aligned (pairs of elements stored as one 32-bit word).
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, int REG_P, int REG_C>
__global__ void __launch_bounds__(FA3_THREADS, 1)
flash_attn_wgmma_persistent(const __grid_constant__ TmaMap map_q,   // q, see the header
                            const __grid_constant__ TmaMap map_k,   // k: dense, packed or pages
                            const __grid_constant__ TmaMap map_v,   // v: as k
                            T* __restrict__ out,                    // shaped as q, C-contiguous
                            float* __restrict__ lse,                // [B, Hq, Sq] / [Hq, total_q] or null
                            const int* __restrict__ kv_lens,        // key_lengths [B] / seq_lens [B] or null
                            const float* __restrict__ mask,         // additive, dense only; or null
                            long long m_sb, long long m_sh, long long m_sq, long long m_sk,
                            const int* __restrict__ cu_q,           // [B + 1] or null
                            const int* __restrict__ cu_k,           // [B + 1] or null
                            const int* __restrict__ block_table,    // [B, bt_stride] or null
                            int bt_stride, int log2_page, int num_pages,
                            unsigned* __restrict__ counter,         // [1], 0 at launch; null: static
                            int B, int Hq, int Hkv, int Sq, int Sk, int heads_per_section,
                            int win_left, int win_right, float softcap_log2, float scale_log2, int flags) {
    static_assert(D % 64 == 0 && D <= 256, "D: whole 128-byte boxes, at most 256 (wgmma N)");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N: whole k16 steps of P V, wgmma N <= 256");
    static_assert(128 * REG_P + 128 * FA3_CONSUMERS * REG_C <= 65536, "register budget of one SM");
    extern __shared__ uint4 smem_raw[];  // aligned below: an __align__(1024) would pad the static part
    __shared__ unsigned long long kfull[STAGES], kempty[STAGES], vfull[STAGES], vempty[STAGES];
    __shared__ unsigned long long qfull[1], qempty[1], wfull[2], wempty[2], tail_bar;
    __shared__ Fa3Work slots[2];
    StageRing<STAGES> kring(kfull, kempty), vring(vfull, vempty);
    StageRing<1> qring(qfull, qempty);
    StageRing<2> wring(wfull, wempty);
    if (threadIdx.x == 0) {
        kring.init(FA3_CONSUMERS);
        vring.init(FA3_CONSUMERS);
        qring.init(FA3_CONSUMERS);
        wring.init(128 * FA3_CONSUMERS + 1);           // every consumer thread and the loader
        mbar_init(&tail_bar, 1);
        mbar_fence_init();
    }
    __syncthreads();

    // Nothing computed before the role split stays live across it: a value in a register numbered
    // past a role's setmaxnreg budget would have to be spilled there.
    if (threadIdx.x < 128) {
        setmaxnreg_dec<REG_P>();
        if (threadIdx.x < 32) {
            unsigned char* smem = fa3p_align(smem_raw);
            fa3p_load<D, BLOCK_N, STAGES>(&map_q, &map_k, &map_v, smem, kring, vring, qring, wring, slots, &tail_bar,
                                          block_table, bt_stride, log2_page, num_pages, Hq, Hkv, cu_q != nullptr,
                                          cu_k != nullptr);
        } else if (threadIdx.x < 64) {
            const Fa3Args a{kv_lens, cu_q, cu_k, block_table, bt_stride, log2_page, num_pages, B, Hq, Hkv, Sq, Sk,
                            heads_per_section, win_left, win_right,
                            mask != nullptr || scale_log2 < 0.0f || softcap_log2 > 0.0f};
            fa3p_schedule<BLOCK_N>(wring, slots, a, counter);
        }
        return;
    }
    setmaxnreg_inc<REG_C>();
    unsigned char* smem = fa3p_align(smem_raw);
    const int cw = threadIdx.x / 128 - 1;
    if (PINGPONG && cw == 1) named_bar_arrive(1, 256);   // warpgroup 0 takes the first turn (of the launch)
    const bool packed = cu_q != nullptr;
    float o[D / 2], m[2], l[2];
    for (;;) {
        wring.wait();
        // the work stays in its slot until the tile is stored, read where used: the consumers'
        // registers are S, O and P's (none of it is held across the key loop)
        const Fa3Work& w = slots[wring.stage];
        if (w.b < 0) return;
        fa3p_consume<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG>(smem, kring, vring, qring, w,
                                                               {win_left, win_right, softcap_log2, mask, m_sb, m_sh,
                                                                m_sq, m_sk}, scale_log2, o, m, l);
        const long long bh = (long long)w.b * Hq + w.h;
        fa3p_store<T, D>(o, m, l, out, lse, packed ? (long long)w.q0 * Hq + w.h : bh * Sq, packed ? Hq : 1,
                         packed ? (long long)w.h * Sq + w.q0 : bh * Sq, w.m0, w.sq, (flags & 1) != 0);
        wring.release(wring.stage);                       // every consumer thread: done with the slot
        wring.advance();
    }
}
