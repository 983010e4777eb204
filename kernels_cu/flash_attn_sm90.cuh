// flash_attn_sm90.cuh: the consumer's steps of the Hopper attention kernel (flash_attn_sm90.cu): the
// tile shape and its shared memory, the loader's zeroing of V rows past a sequence, the wgmma steps
// (S = Q K^T, O += P V from registers), the masking of one key tile's scores, the online softmax,
// the O rescale and P packing, the ping-pong turns, and one key tile's step built from them
// (fa3_key_step). Layouts and descriptors: flash_attn_sm90.cu's header.
#pragma once
#include "common.cuh"
#include "paged.cuh"
#include "sm90.cuh"

constexpr int FA3_BLOCK_M = 128, FA3_CONSUMERS = 2, FA3_THREADS = 128 * (1 + FA3_CONSUMERS);
constexpr int FA3_SMEM_LIMIT = 227 * 1024;   // dynamic shared memory per block (sm_90)

// Shared memory of one block: Q_SLOTS Q tiles, STAGES K slots and STAGES V slots, + 1 KB to align.
// A persistent block takes a second Q slot where it fits (the next tile's Q loads while this one
// computes); a grid block computes one tile. cupyattn/flash_attn_sm90.py smem_bytes says the same.
template <int D, int BLOCK_N, int STAGES, bool PERSIST>
struct Fa3Smem {
    static constexpr int BOXES = D / 64;                  // 128-byte column boxes per row
    static constexpr int Q_BYTES = FA3_BLOCK_M * D * 2;
    static constexpr int KV_BYTES = BLOCK_N * D * 2;      // one K or V slot
    static constexpr int Q_BOX = FA3_BLOCK_M * 128, KV_BOX = BLOCK_N * 128;
    static constexpr int Q_SLOTS = PERSIST && 2 * Q_BYTES + 2 * STAGES * KV_BYTES + 1024 <= FA3_SMEM_LIMIT ? 2 : 1;
    static constexpr int K_OFF = Q_SLOTS * Q_BYTES, V_OFF = K_OFF + STAGES * KV_BYTES;
    static constexpr int BYTES = V_OFF + STAGES * KV_BYTES + 1024;
};

// --- producer: the V slot of a key tile that runs past the sequence's keys ------------------------
// TMA has landed the slot (the caller waited on the barrier it was loaded against), but its rows
// from `row` on hold another sequence's values or an unwritten cache's NaN / inf: P is 0 there,
// and 0 x inf is NaN. The loader warp zeroes them, makes its stores visible to the async proxy
// (wgmma reads the slot) and completes the slot's full barrier by a plain arrive.
template <int BOXES, int BLOCK_N, int STAGES>
__device__ __forceinline__ void fa3_zero_v_rows_and_publish(unsigned char* slot, int row, StageRing<STAGES>& vring) {
    const int lane = threadIdx.x % 32;
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
#pragma unroll
    for (int c = 0; c < BOXES; ++c) {                     // a box row is 8 chunks of 16 bytes
        uint4* box = reinterpret_cast<uint4*>(slot + c * BLOCK_N * 128);
        for (int i = row * 8 + lane; i < BLOCK_N * 8; i += 32) box[i] = zero;
    }
    fence_proxy_async_shared();                           // generic stores -> visible to wgmma
    __syncwarp();
    if (lane == 0) mbar_arrive(vring.full_bar());
}

// --- consumer steps: one warpgroup, query rows m0 + 64 c .. + 63 of the tile --------------------
// Accumulator fragments (ptx_sm90.cuh): register 4 j + e of s[] / o[] is row 16 w + g + 8 (e / 2),
// column 8 j + 2 t + e % 2 (w = warp in the warpgroup, g = lane / 4, t = lane % 4), so each
// thread holds two rows, r = 0 (g) and r = 1 (g + 8), and a row's values are spread over the 4
// lanes of a quad.
struct Fa3Row { int row0, t; };  // this thread's first row (the other is row0 + 8), column pair

// S_ij = Q_i K_j^T issued as one wgmma group: D / 16 k-steps, both operands in shared memory.
template <typename T, int D, int BLOCK_N>
__device__ __forceinline__ void fa3_issue_s(float (&s)[BLOCK_N / 2], const unsigned char* sq, const unsigned char* kt) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int off = 32 * (ks % 4);  // k16 step inside the 128-byte row
        wgmma_ss<T, BLOCK_N, 0, 0>(s, smem_desc(sq + (ks / 4) * FA3_BLOCK_M * 128 + off, 16, 1024, SWIZZLE_128B),
                                   smem_desc(kt + (ks / 4) * BLOCK_N * 128 + off, 16, 1024, SWIZZLE_128B), ks != 0);
    }
    wgmma_commit_group();
}

// O_i += P_ij V_j: BLOCK_N / 16 k-steps, A (P) from registers, V_j MN-major in shared memory. The
// caller commits the group (a first key tile under OVERLAP has none to issue, and commits an empty
// group in its place).
template <typename T, int D, int BLOCK_N>
__device__ __forceinline__ void fa3_issue_pv(float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4], const unsigned char* vt) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_rs<T, D, 1>(o, p[kk], smem_desc(vt + 16 * 128 * kk, BLOCK_N * 128, 1024, SWIZZLE_128B), 1);
}

// What a masked key tile needs to know about its rows: local row i of the sequence sees keys
// [lo(i), hi(i)) with lo(i) = i + diag - left, hi(i) = i + diag + right + 1, within [0, k_end).
struct Fa3Vis {
    int left, right;       // window; -1 unbounded
    float softcap_log2;    // 0: off
    const float* mask;     // additive [b, h, i, j] at b m_sb + h m_sh + i m_sq + j m_sk; or null
    long long m_sb, m_sh, m_sq, m_sk;
};

// The masking of one key tile at key n0, in place on S_ij: scaled to log2 units, capped (softcap),
// the mask tensor added (a -inf entry hides its key, even a NaN score), keys outside a row's range
// -inf, so P is exactly 0 there. Only tiles some row does not see whole come here (the scheduler's
// j_left / j_right), and the key loop holds one call of it. Written as passes over the registers,
// each branch around a pass of its own: one inner branch per element (the cap, the mask's load)
// made the compiler clone the whole step, softmax included, once per combination.
template <int BLOCK_N>
__device__ __forceinline__ void fa3_mask_scores(float (&s)[BLOCK_N / 2], Fa3Row me, int b, int h, int sq, int sk,
                                                int k_end, const Fa3Vis& v, int n0, float scale_log2) {
    if (v.softcap_log2 > 0.0f) {                          // S in scaled log2 units, capped
#pragma unroll
        for (int i = 0; i < BLOCK_N / 2; ++i) s[i] = soft_cap(s[i] * scale_log2, v.softcap_log2);
    } else {
#pragma unroll
        for (int i = 0; i < BLOCK_N / 2; ++i) s[i] *= scale_log2;
    }
    const int diag = sk - sq;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = me.row0 + 8 * r, pos = i + diag;    // pos: the row's diagonal key
        const int lo = v.left < 0 || pos <= v.left ? 0 : pos - v.left;
        const int hi = v.right < 0 || pos >= k_end - 1 - v.right ? k_end : pos + v.right + 1;
        if (v.mask && i < sq) {                           // the additive mask, read through its strides
            // a row's mask reads are constant offsets from one pointer (key stride 0 or 1)
            const float* mrow = v.mask + b * v.m_sb + h * v.m_sh + i * v.m_sq + (v.m_sk ? n0 + 2 * me.t : 0);
#pragma unroll
            for (int jj = 0; jj < BLOCK_N / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[4 * jj + 2 * r + e];
                    // keys past the sequence are past the mask's key extent: not read (hidden below)
                    const float add = n0 + 8 * jj + 2 * me.t + e < sk ? mrow[v.m_sk ? 8 * jj + e : 0] : 0.0f;
                    x = add == -CUDART_INF_F ? -CUDART_INF_F : fmaf(add, LOG2E_F, x);
                }
        }
#pragma unroll
        for (int jj = 0; jj < BLOCK_N / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = n0 + 8 * jj + 2 * me.t + e;
                float& x = s[4 * jj + 2 * r + e];
                x = j >= lo && j < hi ? x : -CUDART_INF_F;
            }
    }
}

// The online softmax step of one key tile on S_ij (registers only), after its masking: with S in
// units where S * mul are scaled log2 scores (mul >= 0: the fast path's unscaled S, mul = scale;
// masked tiles are already scaled, mul = 1; hidden keys -inf),
//   m_i^(j) = max(m_i^(j-1), rowmax(S_ij) * mul)
//   P_ij = exp2(S_ij * mul - m_i^(j))                  (the scale folded into one FMA)
//   l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(P_ij)
// and alpha = exp(m_i^(j-1) - m_i^(j)), the factor O_i still has to be rescaled by.
template <int BLOCK_N>
__device__ __forceinline__ void fa3_online_softmax(float (&s)[BLOCK_N / 2], float (&m)[2], float (&l)[2],
                                                   float (&alpha)[2], float mul) {
    float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {                         // mul >= 0: rowmax(S) * mul = max of the scaled row
        const float m_new = fmaxf(m[r], quad_max(mx[r]) * mul);
        m_use[r] = m_new == -CUDART_INF_F ? 0.0f : m_new;  // nothing seen yet: exp2 -> 0
        alpha[r] = exp2f(m[r] - m_use[r]);
        m[r] = m_new;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) {
        s[i] = exp2f(fmaf(s[i], mul, -m_use[(i >> 1) & 1]));
        l[(i >> 1) & 1] += s[i];
    }
}

// Once the previous P V has retired: O_i rescaled by alpha, and P_ij rounded to T as wgmma A
// fragments (keys 16 kk .. 16 kk + 15 are S registers 8 kk .. 8 kk + 7 = (row g, keys 2t..),
// (row g+8, 2t..), (row g, 8+2t..), (row g+8, 8+2t..)).
template <typename T, int D, int BLOCK_N>
__device__ __forceinline__ void fa3_rescale_and_pack(float (&o)[D / 2], const float (&alpha)[2],
                                                     const float (&s)[BLOCK_N / 2], unsigned (&p)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[kk][e] = pack2<T>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}

// Ping-pong (FA3 section 3.1): the two consumer warpgroups take turns issuing their wgmmas, so one
// warpgroup's softmax runs while the other's matmuls occupy the tensor cores. Warpgroup c issues
// only between named_bar_sync(1 + c) and handing the turn over (bar.arrive on the other's
// barrier); each barrier counts 256 threads: its own 128 waiting, the other's 128 arriving.
template <bool PINGPONG>
__device__ __forceinline__ void fa3_turn_begin(int cw) {
    if constexpr (PINGPONG) named_bar_sync(1 + cw, 256);
}
template <bool PINGPONG>
__device__ __forceinline__ void fa3_turn_end(int cw) {
    if constexpr (PINGPONG) named_bar_arrive(2 - cw, 256);
}

// The rings and roles a key step needs (one per consumer thread, for the whole launch).
template <int STAGES>
struct Fa3Pipe {
    StageRing<STAGES>& kring;
    StageRing<STAGES>& vring;
    const unsigned char* sq;   // this warpgroup's 64 rows of the tile's Q slot
    const unsigned char* sk;   // K slot 0; V slot 0
    const unsigned char* sv;
    int cw;                    // consumer warpgroup 0 or 1
    bool leader;               // thread 0 of the warpgroup: releases the ring slots
};

// O_i += P_ij V_j as one turn of its own: wait for V_j, issue, retire, release V_j's slot.
template <typename T, int D, int BLOCK_N, int STAGES, bool PINGPONG>
__device__ __forceinline__ void fa3_pv_alone(float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4], Fa3Pipe<STAGES>& q) {
    q.vring.wait();
    fa3_turn_begin<PINGPONG>(q.cw);
    fa3_issue_pv<T, D, BLOCK_N>(o, p, q.sv + q.vring.stage * BLOCK_N * D * 2);
    wgmma_commit_group();
    fa3_turn_end<PINGPONG>(q.cw);
    wgmma_wait_group<0>();
    wgmma_fence_acc(o);
    wgmma_fence_frag(p);
    if (q.leader) q.vring.release(q.vring.stage);
    q.vring.advance();
}

// One key tile j of a warpgroup's key loop. ``softmax(alpha)``: the masking (for a masked step) and
// fa3_online_softmax on S_ij in place, alpha out; it returns the thread's row sums l_0 + l_1, a
// value that depends on every exp2 of the step.
// OVERLAP (FA3 section 3.2): S_j is issued together with P_{j-1} V_{j-1} (none for j = 0: an empty
// group keeps the wait counts), its softmax runs while that P V is in flight, and only the O rescale
// and P_j's packing wait for it. ptxas would move that wait up into the first latency gap of the
// row max, ahead of every exp2 (seen in the 2026-11-27 kernels' machine code); keep_before on the
// row sums, a branch it cannot remove, holds the exp2s before it (check --sass: "wait0 after").
// Without OVERLAP: S_ij, softmax, P_ij V_j in order, each its own turn.
// A K slot is released once its S has retired, a V slot once its P V has. Straight-line for ptxas,
// which tracks wgmma accumulators path by path (C7514); the branches on j > 0 cover no wait (written
// another way, as `if (leader && j > 0) release; if (j > 0) advance;`, ptxas C7520 serialised every
// wgmma of the kernel: check --sass shows a DEPBAR per HGMMA then).
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, typename Softmax>
__device__ __forceinline__ void fa3_key_step(float (&s)[BLOCK_N / 2], float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4],
                                             Fa3Pipe<STAGES>& q, int j, Softmax&& softmax) {
    constexpr int KV_BYTES = BLOCK_N * D * 2;
    float alpha[2];
    q.kring.wait();
    fa3_turn_begin<PINGPONG>(q.cw);
    fa3_issue_s<T, D, BLOCK_N>(s, q.sq, q.sk + q.kring.stage * KV_BYTES);
    if constexpr (OVERLAP) {
        if (j > 0) {                                      // P_{j-1} V_{j-1} behind S_j
            q.vring.wait();
            fa3_issue_pv<T, D, BLOCK_N>(o, p, q.sv + q.vring.stage * KV_BYTES);
        }
        wgmma_commit_group();
        fa3_turn_end<PINGPONG>(q.cw);
        wgmma_wait_group<1>();                            // S_j has retired; P V may still run
    } else {
        fa3_turn_end<PINGPONG>(q.cw);
        wgmma_wait_group<0>();
    }
    wgmma_fence_acc(s);
    if (q.leader) q.kring.release(q.kring.stage);         // K_j read
    q.kring.advance();
    const float sums = softmax(alpha);
    if constexpr (OVERLAP) {
        keep_before(sums);                                // every exp2 of the softmax before the wait
        wgmma_wait_group<0>();                            // P_{j-1} V_{j-1} has retired
        wgmma_fence_acc(o);
        wgmma_fence_frag(p);
        if (j > 0) {
            if (q.leader) q.vring.release(q.vring.stage);  // V_{j-1} read
            q.vring.advance();
        }
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
    } else {
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
        fa3_pv_alone<T, D, BLOCK_N, STAGES, PINGPONG>(o, p, q);  // O_i += P_ij V_j
    }
}
