// megakernel_attention.cuh: decode attention inside the megakernel (megakernel.cu), split over the
// keys as flash-decoding does, one instruction per (sequence b, kv head, split).
//
//   opcode          tile                                what
//   MK_OP_ATTN      (b * Hkv + kvh) * splits + split    the G = Hq / Hkv query heads of kv head kvh
//                                                       against keys [lo, hi) of split `split`
//                                                       (chunk = ceil(len / splits), len =
//                                                       lengths[b] + 1: the token of this step,
//                                                       appended by MK_OP_QKV, included). One
//                                                       split: the output rows of att directly;
//                                                       else normalised partials O_c and lse_c
//   MK_OP_REDUCE    b * Hkv + kvh                       att = sum_c exp(lse_c - lse) O_c over the
//                                                       splits (reference.merge_partials)
//
// Algorithm (FlashAttention-2's online softmax, per warp): warp w takes key tiles w, w + MK_WARPS,
// ... of 32 keys, lane = key: s = q . k for up to MK_HEAD_TILE heads at once (q pre-scaled by
// scale * log2(e), so exp2 gives the softmax weights), m_i and l_i updated per tile by warp
// reductions, O_i += P V with each lane owning dims lane, lane + 32, ... and P passed through
// shared memory. The warps' (m, l, O) are merged at the end. Keys past `hi` are never read.
// K/V rows and q were written by other blocks during this kernel: read through L2 (__ldcg).
// Shapes: cache (one layer) [B, Hkv, max_seq, D]; q [B, Hq, D]; att [B, Hq * D];
// o_part float32 [splits, B, Hq, D]; lse_part float32 [splits, B, Hq] (natural log).
#pragma once
#include "common.cuh"

#define MK_DLANE (MK_MAX_HEAD_DIM / 32)  // head dims per lane

struct AttnSmem {
    float q[MK_HEAD_TILE][MK_MAX_HEAD_DIM];           // the head tile's queries, scaled
    float p[MK_WARPS][MK_HEAD_TILE][32];              // a warp's P row of its key tile
    float wm[MK_WARPS][MK_HEAD_TILE], wl[MK_WARPS][MK_HEAD_TILE];
    float wo[MK_WARPS][MK_HEAD_TILE][MK_MAX_HEAD_DIM];  // each warp's unnormalised O
};

template <typename T>
__device__ void mk_attention(const MkModel& m, const MkState& st, const MkIns& ins, AttnSmem& sm) {
    constexpr int VEC = 16 / sizeof(T);
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, splits = (int)m.splits, G = Hq / Hkv;
    const int split = ins.tile % splits, kvh = (ins.tile / splits) % Hkv, b = ins.tile / (splits * Hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int len = __ldcg(st.lengths + (size_t)ins.layer * m.B + b) + 1;
    const int chunk = (len + splits - 1) / splits, lo = min(split * chunk, len), hi = min(lo + chunk, len);
    const size_t kv0 = ((size_t)b * Hkv + kvh) * (size_t)m.max_seq * D;
    const T* kc = mk_layer_cache<T>(m, st.k_cache, ins.layer) + kv0;
    const T* vc = mk_layer_cache<T>(m, st.v_cache, ins.layer) + kv0;
    const float scale = (float)m.scale_log2;
    for (int g0 = 0; g0 < G; g0 += MK_HEAD_TILE) {
        const int ng = min(MK_HEAD_TILE, G - g0), h0 = kvh * G + g0;
        for (int i = threadIdx.x; i < ng * D; i += MK_THREADS)
            sm.q[i / D][i % D] = to_float(__ldcg((const T*)st.q + ((size_t)b * Hq + h0 + i / D) * D + i % D)) * scale;
        __syncthreads();
        float mi[MK_HEAD_TILE], li[MK_HEAD_TILE], o[MK_HEAD_TILE][MK_DLANE];
#pragma unroll
        for (int g = 0; g < MK_HEAD_TILE; ++g) {
            mi[g] = -CUDART_INF_F;
            li[g] = 0.f;
#pragma unroll
            for (int i = 0; i < MK_DLANE; ++i) o[g][i] = 0.f;
        }
        for (int k0 = lo + 32 * warp; k0 < hi; k0 += 32 * MK_WARPS) {
            // S_ij = q_i . k_j for this lane's key (-inf past hi)
            const int key = k0 + lane;
            float s[MK_HEAD_TILE];
#pragma unroll
            for (int g = 0; g < MK_HEAD_TILE; ++g) s[g] = 0.f;
            if (key < hi) {
                const uint4* kr = reinterpret_cast<const uint4*>(kc + (size_t)key * D);
                for (int c = 0; c < D / VEC; ++c) {
                    const uint4 kv = __ldcg(kr + c);
                    const T* ke = reinterpret_cast<const T*>(&kv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        const float kf = to_float(ke[e]);
#pragma unroll
                        for (int g = 0; g < MK_HEAD_TILE; ++g)
                            if (g < ng) s[g] = fmaf(sm.q[g][c * VEC + e], kf, s[g]);
                    }
                }
            }
            // m_new = max(m_old, rowmax S); P = exp2(S - m_new); l = l exp2(m_old - m_new) + rowsum P;
            // rescale O by exp2(m_old - m_new)
#pragma unroll
            for (int g = 0; g < MK_HEAD_TILE; ++g) {
                if (g >= ng) break;  // uniform
                const float sv = key < hi ? s[g] : -CUDART_INF_F;
                const float mnew = fmaxf(mi[g], warp_reduce_max(sv));
                const float ms = mnew == -CUDART_INF_F ? 0.f : mnew;
                const float p = exp2f(sv - ms), alpha = exp2f(mi[g] - ms);
                li[g] = li[g] * alpha + warp_reduce_sum(p);
                mi[g] = mnew;
#pragma unroll
                for (int i = 0; i < MK_DLANE; ++i) o[g][i] *= alpha;
                sm.p[warp][g][lane] = p;
            }
            __syncwarp();
            // O_i += P_ij V_j: lane owns dims lane + 32 i
            const int nk = min(32, hi - k0);
            for (int j = 0; j < nk; ++j) {
                const T* vr = vc + (size_t)(k0 + j) * D;
#pragma unroll
                for (int i = 0; i < MK_DLANE; ++i) {
                    const int d = lane + 32 * i;
                    if (d < D) {
                        const float vf = to_float(__ldcg(vr + d));
#pragma unroll
                        for (int g = 0; g < MK_HEAD_TILE; ++g)
                            if (g < ng) o[g][i] = fmaf(sm.p[warp][g][j], vf, o[g][i]);
                    }
                }
            }
            __syncwarp();  // the P row is read before the next tile overwrites it
        }
        // merge the warps' states: M = max_w m_w, L = sum_w l_w exp2(m_w - M), O = sum_w O_w exp2(m_w - M)
#pragma unroll
        for (int g = 0; g < MK_HEAD_TILE; ++g) {
            if (g >= ng) break;
            if (lane == 0) { sm.wm[warp][g] = mi[g]; sm.wl[warp][g] = li[g]; }
#pragma unroll
            for (int i = 0; i < MK_DLANE; ++i)
                if (lane + 32 * i < D) sm.wo[warp][g][lane + 32 * i] = o[g][i];
        }
        __syncthreads();
        for (int it = threadIdx.x; it < ng * D; it += MK_THREADS) {
            const int g = it / D, d = it % D, h = h0 + g;
            float M = -CUDART_INF_F;
            for (int w = 0; w < MK_WARPS; ++w) M = fmaxf(M, sm.wm[w][g]);
            const float Ms = M == -CUDART_INF_F ? 0.f : M;
            float L = 0.f, O = 0.f;
            for (int w = 0; w < MK_WARPS; ++w) {
                const float f = exp2f(sm.wm[w][g] - Ms);
                L = fmaf(sm.wl[w][g], f, L);
                O = fmaf(sm.wo[w][g][d], f, O);
            }
            const float out = L > 0.f ? O / L : 0.f;  // no key at all: zeros (an empty split)
            if (splits == 1) {
                ((T*)st.att)[((size_t)b * Hq + h) * D + d] = from_float<T>(out);
            } else {
                const size_t r = ((size_t)split * m.B + b) * Hq + h;
                st.o_part[r * D + d] = out;
                if (d == 0) st.lse_part[r] = L > 0.f ? (M + log2f(L)) * LN2_F : -CUDART_INF_F;
            }
        }
        __syncthreads();  // q, wm, wl, wo are read before the next head tile rewrites them
    }
}

// att rows of the G heads of (b, kvh) from the splits' partials: lse = max_c lse_c, w_c =
// exp(lse_c - lse), out = sum_c w_c O_c / sum_c w_c (zeros when every split was empty).
template <typename T>
__device__ void mk_attention_reduce(const MkModel& m, const MkState& st, const MkIns& ins) {
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, splits = (int)m.splits, G = Hq / Hkv;
    const int b = ins.tile / Hkv, kvh = ins.tile % Hkv, B = (int)m.B;
    for (int it = threadIdx.x; it < G * D; it += MK_THREADS) {
        const int h = kvh * G + it / D, d = it % D;
        float M = -CUDART_INF_F;
        for (int c = 0; c < splits; ++c) M = fmaxf(M, __ldcg(st.lse_part + ((size_t)c * B + b) * Hq + h));
        float W = 0.f, O = 0.f;
        if (M > -CUDART_INF_F) {
            for (int c = 0; c < splits; ++c) {
                const size_t r = ((size_t)c * B + b) * Hq + h;
                const float w = expf(__ldcg(st.lse_part + r) - M);
                W += w;
                O = fmaf(w, __ldcg(st.o_part + r * D + d), O);
            }
        }
        ((T*)st.att)[((size_t)b * Hq + h) * D + d] = from_float<T>(W > 0.f ? O / W : 0.f);
    }
}
