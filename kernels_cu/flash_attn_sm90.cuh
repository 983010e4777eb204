// flash_attn_sm90.cuh: the pieces both Hopper attention kernels share (flash_attn_sm90.cu, v3 one
// tile per block; flash_attn_sm90_persistent.cu, v4 persistent): the tile shape and its shared
// memory, the loader's zeroing of V rows past a sequence, the consumer warpgroups' wgmma steps
// (S = Q K^T, O += P V from registers) and one key tile's step built from them (fa3_key_step: the
// kernel passes its own masking), a masked score, the online softmax, the O rescale and P packing,
// and the ping-pong turns. Layouts and descriptors: flash_attn_sm90.cu's header.
#pragma once
#include "common.cuh"
#include "sm90.cuh"

constexpr int FA3_BLOCK_M = 128, FA3_CONSUMERS = 2, FA3_THREADS = 128 * (1 + FA3_CONSUMERS);

// The additive mask of one (batch, head), or none: element (i, j) at p[i * sq + j * sk].
struct Fa3Mask { const float* p; long long sq, sk; };

template <int D, int BLOCK_N>
struct Fa3Smem {
    static constexpr int BOXES = D / 64;                  // 128-byte column boxes per row
    static constexpr int Q_BYTES = FA3_BLOCK_M * D * 2;
    static constexpr int KV_BYTES = BLOCK_N * D * 2;      // one K or V slot
    static constexpr int Q_BOX = FA3_BLOCK_M * 128, KV_BOX = BLOCK_N * 128;
};

// --- producer: the V slot of a key tile that runs past the sequence's keys ------------------------
// TMA has landed the slot (the caller waited on the barrier it was loaded against), but its rows
// from `row` on hold another sequence's values or an unwritten cache's NaN / inf: P is 0 there,
// and 0 x inf is NaN. The loader warp zeroes them, makes its stores visible to the async proxy
// (wgmma reads the slot) and completes the slot's full barrier by a plain arrive.
template <int D, int BLOCK_N, int STAGES>
__device__ __forceinline__ void fa3_zero_v_rows_and_publish(unsigned char* slot, int row, StageRing<STAGES>& vring) {
    using L = Fa3Smem<D, BLOCK_N>;
    const int lane = threadIdx.x % 32;
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
#pragma unroll
    for (int c = 0; c < L::BOXES; ++c) {                  // a box row is 8 chunks of 16 bytes
        uint4* box = reinterpret_cast<uint4*>(slot + c * L::KV_BOX);
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
    using L = Fa3Smem<D, BLOCK_N>;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int off = 32 * (ks % 4);  // k16 step inside the 128-byte row
        wgmma_ss<T, BLOCK_N, 0, 0>(s, smem_desc(sq + (ks / 4) * L::Q_BOX + off, 16, 1024, SWIZZLE_128B),
                                   smem_desc(kt + (ks / 4) * L::KV_BOX + off, 16, 1024, SWIZZLE_128B), ks != 0);
    }
    wgmma_commit_group();
}

// O_i += P_ij V_j issued as one wgmma group: BLOCK_N / 16 k-steps, A (P) from registers, V_j
// MN-major in shared memory.
template <typename T, int D, int BLOCK_N>
__device__ __forceinline__ void fa3_issue_pv(float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4], const unsigned char* vt) {
    using L = Fa3Smem<D, BLOCK_N>;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        wgmma_rs<T, D, 1>(o, p[kk], smem_desc(vt + 16 * 128 * kk, L::KV_BOX, 1024, SWIZZLE_128B), 1);
    wgmma_commit_group();
}

// One score of a masked key tile: y = S_ij in scaled log2 units (capped, where the kernel caps), the
// additive mask's entry mrow[at] added when there is a mask (a -inf entry hides the key, even a NaN
// score), -inf where the key is not seen, so P is exactly 0 there.
__device__ __forceinline__ float fa3_masked_score(float y, const float* mrow, int at, bool seen) {
    if (mrow && seen) {
        const float add = mrow[at];
        y = add == -CUDART_INF_F ? -CUDART_INF_F : fmaf(add, LOG2E_F, y);
    }
    return seen ? y : -CUDART_INF_F;
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

// The wgmma group of P V has retired: O_i and P_ij's registers are free, V_j's slot is released.
template <int D, int BLOCK_N, int STAGES>
__device__ __forceinline__ void fa3_retire_pv(float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4],
                                              StageRing<STAGES>& vring, bool leader) {
    wgmma_wait_group<0>();
    wgmma_fence_acc(o);
    wgmma_fence_frag(p);
    if (leader) vring.release(vring.stage);
    vring.advance();
}

// S_ij = Q_i K_j^T as one turn of its own: wait for K_j, issue, retire, release K_j's slot.
template <typename T, int D, int BLOCK_N, int STAGES, bool PINGPONG>
__device__ __forceinline__ void fa3_s_alone(float (&s)[BLOCK_N / 2], const unsigned char* sq, const unsigned char* sk,
                                            StageRing<STAGES>& kring, int cw, bool leader) {
    kring.wait();
    fa3_turn_begin<PINGPONG>(cw);
    fa3_issue_s<T, D, BLOCK_N>(s, sq, sk + kring.stage * Fa3Smem<D, BLOCK_N>::KV_BYTES);
    fa3_turn_end<PINGPONG>(cw);
    wgmma_wait_group<0>();
    wgmma_fence_acc(s);
    if (leader) kring.release(kring.stage);
    kring.advance();
}

// O_i += P_ij V_j as one turn of its own: wait for V_j, issue, retire, release V_j's slot.
template <typename T, int D, int BLOCK_N, int STAGES, bool PINGPONG>
__device__ __forceinline__ void fa3_pv_alone(float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4], const unsigned char* sv,
                                             StageRing<STAGES>& vring, int cw, bool leader) {
    vring.wait();
    fa3_turn_begin<PINGPONG>(cw);
    fa3_issue_pv<T, D, BLOCK_N>(o, p, sv + vring.stage * Fa3Smem<D, BLOCK_N>::KV_BYTES);
    fa3_turn_end<PINGPONG>(cw);
    fa3_retire_pv<D, BLOCK_N, STAGES>(o, p, vring, leader);
}

// One key tile j of a warpgroup's key loop (tile 0 excepted under OVERLAP: the caller issues S_0
// alone first). ``softmax(alpha)``: the kernel's masking and fa3_online_softmax on S_ij in place,
// alpha out. OVERLAP (FA3 section 3.2): S_j is issued behind P_{j-1} V_{j-1}, its softmax runs
// while that P V is in flight, and only the O rescale and P_j's packing wait for it; else S_ij,
// softmax, P_ij V_j in order. A K slot is released once its S has retired, a V slot once its P V
// has. Straight-line for ptxas, which tracks wgmma accumulators path by path (C7514).
template <typename T, int D, int BLOCK_N, int STAGES, bool OVERLAP, bool PINGPONG, typename Softmax>
__device__ __forceinline__ void fa3_key_step(float (&s)[BLOCK_N / 2], float (&o)[D / 2], unsigned (&p)[BLOCK_N / 16][4],
                                             const unsigned char* sq, const unsigned char* sk, const unsigned char* sv,
                                             StageRing<STAGES>& kring, StageRing<STAGES>& vring, int cw, bool leader,
                                             Softmax&& softmax) {
    using L = Fa3Smem<D, BLOCK_N>;
    float alpha[2];
    if constexpr (OVERLAP) {
        kring.wait();
        fa3_turn_begin<PINGPONG>(cw);
        fa3_issue_s<T, D, BLOCK_N>(s, sq, sk + kring.stage * L::KV_BYTES);
        vring.wait();                                     // P_{j-1} V_{j-1} behind S_j
        fa3_issue_pv<T, D, BLOCK_N>(o, p, sv + vring.stage * L::KV_BYTES);
        fa3_turn_end<PINGPONG>(cw);
        wgmma_wait_group<1>();                            // S_j has retired; P V may still run
        wgmma_fence_acc(s);
        if (leader) kring.release(kring.stage);           // K_j read
        kring.advance();
        softmax(alpha);
        fa3_retire_pv<D, BLOCK_N, STAGES>(o, p, vring, leader);  // P_{j-1} V_{j-1}, V_{j-1} read
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
    } else {
        fa3_s_alone<T, D, BLOCK_N, STAGES, PINGPONG>(s, sq, sk, kring, cw, leader);  // S_ij = Q_i K_j^T
        softmax(alpha);
        fa3_rescale_and_pack<T, D, BLOCK_N>(o, alpha, s, p);
        fa3_pv_alone<T, D, BLOCK_N, STAGES, PINGPONG>(o, p, sv, vring, cw, leader);  // O_i += P_ij V_j
    }
}
