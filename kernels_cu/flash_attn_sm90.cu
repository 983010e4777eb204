// flash_attn_sm90.cu: fused attention forward on Hopper tensor cores (sm_90a only; the sibling of
// flash_attn.cu, whose variants serve every other GPU and every case this one does not take).
//
// One kernel, FlashAttention-3's split (hopper/flash_fwd_kernel_sm90.h): a mainloop shared by
// every case (a loader warp, two consumer warpgroups, the stage rings), one epilogue (dense and
// packed outputs, lse) and a tile scheduler as a template parameter (flash_attn_sm90_sched.cuh):
//
//   SCHED        scheduler                                               impl
//   FA3_GRID     one block per tile, in the scheduler's order             "wgmma" (attention)
//   FA3_PERSIST  one block per SM, tile after tile (a counter where      "wgmma_persistent"
//                tiles are unequal, a static stride where equal)         (attention, _varlen, _paged)
//
// The algorithm is FlashAttention-2's (Dao 2023, Algorithm 1) in FlashAttention-3's shape (Shah et
// al. 2024): warp-specialised; the loader loads Q_i and K_j, V_j by TMA into stage rings (full /
// empty mbarriers, StageRing in sm90.cuh); two consumer warpgroups own 64 query rows each:
// S_ij = Q_i K_j^T by wgmma from shared memory, the online softmax on the fp32 accumulators, P_ij
// rounded to T straight into wgmma A fragments, O_i += P_ij V_j by wgmma with A from registers and
// V_j from shared memory (MN-major descriptor: no transposed copy); setmaxnreg moves registers from
// the producer warpgroup to the consumers. Per key tile (flash_attn_sm90.cuh fa3_key_step):
//   OVERLAP   the softmax of tile j runs while P_{j-1} V_{j-1} is in flight (FA3 section 3.2);
//             off: each tile's steps in order.
//   PINGPONG  the consumer warpgroups take turns issuing wgmmas (named barriers), so one's softmax
//             overlaps the other's matmuls (FA3 section 3.1).
// Key tiles: those past the causal diagonal, a window or a sequence's keys are never loaded; of the
// rest only those some row does not see whole (the diagonal, window edges, the key end; every tile
// under a mask tensor, a softcap or a negative scale) take the masked step, whose body exists once.
//
// Tensor maps (cupyattn/flash_attn_sm90.py builds them): 4-D, innermost first, every box 64
// elements wide (one 128-byte swizzle row), coordinates {64 c, row, head, outer}:
//   q dense [B, Hq, Sq, D]: {D, Sq, Hq, B}, row = m0, outer = b; packed [total_q, Hq, D]:
//     {D, total_q, Hq, 1}, row = q0 + m0 (q0 = cu_q[b]), outer = 0. Box rows 128.
//   k, v dense {D, Sk, Hkv, B}, row = n0, outer = b; packed [total_k, Hkv, D] {D, total_k, Hkv, 1},
//     row = k0 + n0; paged [num_pages, P, Hkv, D] {D, P, Hkv, num_pages}, row = key % P, outer =
//     its page id. Box rows BLOCK_N, or P when a page holds fewer (P >= 8: each box is whole 1 KB
//     swizzle atoms): BLOCK_N / P copies per box column, lane l of the loader warp issues the
//     copy of the tile's page l, whose id it read from the block table itself.
// TMA reads whatever lies in a box: rows past a packed sequence belong to the next one, rows past
// a paged sequence to some page, rows past key_lengths to an unwritten cache. Keys past the
// sequence's end get S = -inf in the masked step; V rows past it are zeroed in shared memory by
// the loader before P V reads them (P = 0 times NaN would be NaN), wherever they are not TMA's zero
// fill. Query rows past a sequence are computed and never stored.
//
// Shared memory (dynamic, 1 KB-aligned so every 128 B-swizzled box starts on its pattern; sizes in
// flash_attn_sm90.cuh Fa3Smem):
//   Q_i   Q_SLOTS slots of D/64 boxes of [BLOCK_M = 128 rows][128 B]
//   K_j   STAGES slots, each D/64 boxes of [BLOCK_N rows][128 B]
//   V_j   STAGES slots, as K_j
// plus static barriers and two work slots. The rings, with their owners:
//   work  2 slots of Fa3Work   the scheduler warp writes one, arrives on full; the loader warp and
//                              the consumers read it in place; every loader lane and every consumer
//                              thread arrives on empty when done with it (count 256 + 32)
//   q     Q_SLOTS slots        loader: expect_tx + TMA; the consumers' leaders release a slot once
//                              the tile's last S = Q K^T has retired (count 2)
//   k, v  STAGES slots each    the rings run on across tiles (stage and phase carry over)
//   tail  1 barrier            a V slot whose rows past the keys must be zeroed lands here first
// wgmma descriptors (layouts: ptx_sm90.cuh): Q (A) and K (B of S = Q K^T) are K-major: SBO = 1024
// (8 rows of 128 B), k16 step ks at box ks / 4, byte 32 (ks % 4); consumer warpgroup c reads Q
// rows 64c.. (+ 64c x 128 B). V (B of O = P V, B[key][d] = V[key][d]) is MN-major: SBO = 1024
// (8 keys), LBO = BLOCK_N x 128 B (the next box of 64 d), k16 step kk at + 16 kk rows.
//
// Masking and non-finite values (cupyattn/reference.py): keys j >= key_lengths[b] (clamped to
// [0, Sk]) and keys outside the window (causal: right = 0, bottom-right) get S = -inf before the
// row max; `mask` (optional, dense only) is an additive fp32 tensor read through 4 element strides
// (0 on broadcast dims, the key stride 0 or 1), its -inf entries hiding their keys whatever the
// score. A row that sees no key keeps m_i = -inf, l_i = 0 and is written as zeros, lse = -inf.
//
// Counter (FA3_PERSIST, dynamic): unsigned[1] in global memory, 0 at launch. Exactly `total` adds
// are made in a launch (every block that had a first tile makes one per tile it computed, the last
// of them claiming past the end), so the add that returns total - 1 is the last one of the launch:
// that block subtracts `total` again, and the counter is 0 for the next launch (no memset).
#include "common.cuh"
#include "flash_attn_sm90.cuh"
#include "flash_attn_sm90_sched.cuh"

// --- mainloop, producer: warp 0 of the producer warpgroup -----------------------------------------
// Per tile of the work ring: Q_i (into the next Q slot, once the consumers released it), then K_j
// and V_j in key order. Lane 0 issues every copy, except paged tiles over pages shorter than
// BLOCK_N: lane l issues page l's. A V slot holding rows past the keys is loaded against
// `tail_bar` and zeroed there first (its phase flips on each use).
template <int D, int BLOCK_N, int STAGES, bool PERSIST>
__device__ __forceinline__ void fa3_load(const TmaMap* map_q, const TmaMap* map_k, const TmaMap* map_v,
                                         unsigned char* smem, StageRing<STAGES>& kring, StageRing<STAGES>& vring,
                                         StageRing<Fa3Smem<D, BLOCK_N, STAGES, PERSIST>::Q_SLOTS>& qring,
                                         StageRing<2>& wring, const Fa3Work* slots, unsigned long long* tail_bar,
                                         const int* table, int bt_stride, int log2_page, int num_pages, int Hq,
                                         int Hkv, bool packed_q, bool packed_k) {
    using L = Fa3Smem<D, BLOCK_N, STAGES, PERSIST>;
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
            if (lane == 0) {                              // Q_i, once the slot's last tile is done with it
                qring.acquire();
                qring.commit(L::Q_BYTES);
                unsigned char* dq = smem + qring.stage * L::Q_BYTES;
#pragma unroll
                for (int c = 0; c < L::BOXES; ++c)
                    tma_load<4>(dq + c * L::Q_BOX, map_q, qring.full_bar(), {64 * c, w.q0 + w.m0, w.h, packed_q ? 0 : w.b});
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
            unsigned char* dk = smem + L::K_OFF + kring.stage * L::KV_BYTES + lane * rows * 128;
            if (lane < copies) {
#pragma unroll
                for (int c = 0; c < L::BOXES; ++c)
                    tma_load<4>(dk + c * L::KV_BOX, map_k, kring.full_bar(), {64 * c, row, hk, outer});
            }
            kring.advance();
            unsigned char* dv = smem + L::V_OFF + vring.stage * L::KV_BYTES;
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
                fa3_zero_v_rows_and_publish<L::BOXES, BLOCK_N, STAGES>(dv, max(w.v_zero_from - n0, 0), vring);
            }
            vring.advance();
        }
        wring.release(wring.stage);                       // every lane: done with the slot
        wring.advance();
    }
}

// --- mainloop, consumer: the key loop of one warpgroup over one tile -------------------------------
// Key tiles [j_left, j_right) are seen whole by every row: they run in a loop of their own with no
// masking (the fast path: the max of unscaled S, the scale folded into the exp2 FMA; the host
// takes it only with scale >= 0). The others (before j_left: a window's left edge; from j_right:
// the diagonal, a window's right edge, the key end) take the masked step, one copy of it, one tile
// at a time. Q_i's slot is released as soon as the tile's last S has retired, so the loader fills
// it again under the last P V. Turns (PINGPONG) carry over from tile to tile: both warpgroups take
// the same number in each tile, so warpgroup 1's last hand-off of a tile is warpgroup 0's first
// turn of the next.
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, int Q_SLOTS>
__device__ __forceinline__ void fa3_consume(Fa3Pipe<STAGES>& pipe, StageRing<Q_SLOTS>& qring, unsigned char* smem,
                                            const Fa3Work& w, const Fa3Vis& v, float scale_log2, float (&o)[D / 2],
                                            float (&m)[2], float (&l)[2]) {
    const int wi = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const Fa3Row me{w.m0 + 64 * pipe.cw + 16 * wi + lane / 4, lane % 4};

    // On chip: O_i = 0, l_i = 0 (this lane's part of the row sum), m_i = -inf (scaled log2 units).
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.0f;
    const int n = w.n_tiles;
    if (n == 0) return;                                   // nothing seen, nothing loaded
    qring.wait();                                         // Q_i has landed
    pipe.sq = smem + qring.stage * (FA3_BLOCK_M * D * 2) + 64 * pipe.cw * 128;

    float s[BLOCK_N / 2];
    unsigned p[BLOCK_N / 16][4];
    // the work's fields are read from its slot where used (registers are S, O and P's)
    for (int j = 0; j < n;) {
        if (j >= w.j_left && j < w.j_right) {
            do {                                          // the bulk: every key of the tile seen by every row
                fa3_key_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG>(s, o, p, pipe, j, [&](float (&alpha)[2]) {
                    fa3_online_softmax<BLOCK_N>(s, m, l, alpha, scale_log2);
                    return l[0] + l[1];
                });
            } while (++j < w.j_right);
        } else {                                          // the masked step
            fa3_key_step<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG>(s, o, p, pipe, j, [&](float (&alpha)[2]) {
                fa3_mask_scores<BLOCK_N>(s, me, w.b, w.h, w.sq, w.sk, w.k_end, v, w.n_lo + j * BLOCK_N, scale_log2);
                fa3_online_softmax<BLOCK_N>(s, m, l, alpha, 1.0f);  // S in scaled log2 units now
                return l[0] + l[1];
            });
            ++j;
        }
    }
    if (pipe.leader) qring.release(qring.stage);          // every S of the tile has retired
    qring.advance();
    if constexpr (OVERLAP) fa3_pv_alone<T, D, BLOCK_N, STAGES, PINGPONG>(o, p, pipe);  // the last P V
}

// --- epilogue: O_i / l_i rounded to T, straight to global memory; lse ---------------------------
// Local row i of the tile's sequence goes to out row out0 + i * stride (rows of D elements; dense
// [B, Hq, Sq, D]: out0 = (b Hq + h) Sq, stride 1; packed [total_q, Hq, D]: out0 = q0 Hq + h,
// stride Hq) and lse[lse0 + i] (dense [B, Hq, Sq]: (b Hq + h) Sq; packed [Hq, total_q]: h total_q
// + q0). Rows past the sequence (i >= sq; q0 + sq <= total_q, the scheduler's clamp) are not
// stored. L_i = m_i + log(l_i); no key seen: zeros and -inf (common.cuh row_scale / row_lse).
template <typename T, int D, int R>
__device__ __forceinline__ void fa3_store_row(const float (&o)[D / 2], float m, float l, T* __restrict__ out,
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
__device__ __forceinline__ void fa3_store(const float (&o)[D / 2], const float (&m)[2], const float (&l)[2],
                                          T* __restrict__ out, float* __restrict__ lse, const Fa3Work& w, int Hq,
                                          int Sq, bool packed, bool pair_store) {
    const int cw = threadIdx.x / 128 - 1, wi = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int i = w.m0 + 64 * cw + 16 * wi + lane / 4;    // rows i (R = 0) and i + 8 (R = 1)
    const long long bh = (long long)w.b * Hq + w.h;
    const long long out0 = packed ? (long long)w.q0 * Hq + w.h : bh * Sq;
    const long long lse0 = packed ? (long long)w.h * Sq + w.q0 : bh * Sq;
    const int stride = packed ? Hq : 1;
    fa3_store_row<T, D, 0>(o, m[0], l[0], out, lse, out0, stride, lse0, i, lane % 4, w.sq, pair_store);
    fa3_store_row<T, D, 1>(o, m[1], l[1], out, lse, out0, stride, lse0, i + 8, lane % 4, w.sq, pair_store);
}

// The dynamic shared memory, from its first 1 KB boundary (every 128 B-swizzled box on its pattern).
__device__ __forceinline__ unsigned char* fa3_align(uint4* raw) {
    return reinterpret_cast<unsigned char*>(raw) + (1024 - smem_u32(raw) % 1024) % 1024;
}

// --- the kernel ------------------------------------------------------------------------------------
// grid: FA3_GRID the launch's tiles (B Hq ceil(Sq / 128) dense), FA3_PERSIST min(SMs, tiles);
// block = 384 (warpgroup 0: producer, 1-2: consumers); dynamic shared memory Fa3Smem::BYTES
// (cupyattn/flash_attn_sm90.py smem_bytes). Sq: dense rows per sequence, packed total_q (the rows
// of q, out and lse); Sk: dense keys, packed total_k (the rows of k and v), paged unused. flags
// bit 0: out is 4-byte aligned (pairs of elements stored as one 32-bit word).
// REG_P / REG_C: per-thread registers after setmaxnreg (128 REG_P + 256 REG_C <= 65536).
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, int SCHED, int REG_P, int REG_C>
__global__ void __launch_bounds__(FA3_THREADS, 1)
flash_attn_sm90(const __grid_constant__ TmaMap map_q,   // q, see the header
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
                unsigned* __restrict__ counter,         // [1], 0 at launch (FA3_PERSIST); null: static
                int B, int Hq, int Hkv, int Sq, int Sk, int heads_per_section,
                int win_left, int win_right, float softcap_log2, float scale_log2, int flags) {
    static_assert(D % 64 == 0 && D <= 256, "D: whole 128-byte boxes, at most 256 (wgmma N)");
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "BLOCK_N: whole k16 steps of P V, wgmma N <= 256");
    static_assert(128 * REG_P + 128 * FA3_CONSUMERS * REG_C <= 65536, "register budget of one SM");
    using L = Fa3Smem<D, BLOCK_N, STAGES, SCHED == FA3_PERSIST>;
    static_assert(L::BYTES <= FA3_SMEM_LIMIT, "shared memory of one block");
    extern __shared__ uint4 smem_raw[];  // aligned below: an __align__(1024) would pad the static part
    __shared__ unsigned long long kfull[STAGES], kempty[STAGES], vfull[STAGES], vempty[STAGES];
    __shared__ unsigned long long qfull[L::Q_SLOTS], qempty[L::Q_SLOTS], wfull[2], wempty[2], tail_bar;
    __shared__ Fa3Work slots[2];
    StageRing<STAGES> kring(kfull, kempty), vring(vfull, vempty);
    StageRing<L::Q_SLOTS> qring(qfull, qempty);
    StageRing<2> wring(wfull, wempty);
    if (threadIdx.x == 0) {
        kring.init(FA3_CONSUMERS);
        vring.init(FA3_CONSUMERS);
        qring.init(FA3_CONSUMERS);
        wring.init(128 * FA3_CONSUMERS + 32);           // every consumer thread and every loader lane
        mbar_init(&tail_bar, 1);
        mbar_fence_init();
    }
    __syncthreads();

    // Nothing computed before the role split stays live across it: a value in a register numbered
    // past a role's setmaxnreg budget would have to be spilled there.
    if (threadIdx.x < 128) {
        setmaxnreg_dec<REG_P>();
        if (threadIdx.x < 32) {
            fa3_load<D, BLOCK_N, STAGES, SCHED == FA3_PERSIST>(&map_q, &map_k, &map_v, fa3_align(smem_raw), kring,
                                                               vring, qring, wring, slots, &tail_bar, block_table,
                                                               bt_stride, log2_page, num_pages, Hq, Hkv,
                                                               cu_q != nullptr, cu_k != nullptr);
        } else if (threadIdx.x < 64) {
            const Fa3Args a{kv_lens, cu_q, cu_k, block_table, bt_stride, log2_page, num_pages, B, Hq, Hkv, Sq, Sk,
                            heads_per_section, win_left, win_right,
                            mask != nullptr || scale_log2 < 0.0f || softcap_log2 > 0.0f};
            fa3_schedule<SCHED, BLOCK_N>(wring, slots, a, SCHED == FA3_PERSIST ? counter : nullptr);
        }
        return;
    }
    setmaxnreg_inc<REG_C>();
    unsigned char* smem = fa3_align(smem_raw);
    const int cw = threadIdx.x / 128 - 1;
    Fa3Pipe<STAGES> pipe{kring, vring, nullptr, smem + L::K_OFF, smem + L::V_OFF, cw, threadIdx.x % 128 == 0};
    if (PINGPONG && cw == 1) named_bar_arrive(1, 256);   // warpgroup 0 takes the first turn (of the launch)
    const Fa3Vis vis{win_left, win_right, softcap_log2, mask, m_sb, m_sh, m_sq, m_sk};
    float o[D / 2], m[2], l[2];
    for (;;) {
        wring.wait();
        // the work stays in its slot until the tile is stored, read where used: the consumers'
        // registers are S, O and P's (none of it is held across the key loop)
        const Fa3Work& w = slots[wring.stage];
        if (w.b < 0) return;
        fa3_consume<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG, L::Q_SLOTS>(pipe, qring, smem, w, vis, scale_log2, o, m, l);
        fa3_store<T, D>(o, m, l, out, lse, w, Hq, Sq, cu_q != nullptr, (flags & 1) != 0);
        wring.release(wring.stage);                       // every consumer thread: done with the slot
        wring.advance();
    }
}
