// megakernel_attention.cuh: decode attention inside the megakernel (megakernel.cu), split over the
// keys as flash-decoding does and over the query heads of a kv head, one instruction per
// (sequence b, kv head, head split, key split).
//
//   opcode          tile                                what
//   MK_OP_ATTN      ((b * Hkv + kvh) * hs + i) * splits the query heads [i gh, (i + 1) gh) of kv head
//                   + split (hs = arg0 head splits,     kvh (gh = ceil(G / hs) <= MK_HEAD_TILE, G =
//                   gh heads each)                      Hq / Hkv) against keys [lo, hi) of split
//                                                       `split` (chunk = ceil(len / splits), len =
//                                                       lengths[b] + 1: the token of this step,
//                                                       appended by MK_OP_QKV, included). One
//                                                       split: the output rows of att directly;
//                                                       else normalised partials O_c and lse_c.
//                                                       arg1: 0 the v1 loop below, 1 the ring
//   MK_OP_REDUCE    b * Hkv + kvh                       att = sum_c exp(lse_c - lse) O_c over the
//                                                       splits (reference.merge_partials; mk_merge_rows)
//
// v1 (FlashAttention-2's online softmax, per warp): warp w takes key tiles w, w + MK_WARPS,
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

// The tile's place: sequence b, kv head kvh, its query heads [g_lo, g_hi) of the group, keys [lo, hi).
struct AttnTile {
    int b, kvh, split, g_lo, g_hi, lo, hi;
};

__device__ __forceinline__ AttnTile mk_attn_tile(const MkModel& m, const MkState& st, const MkIns& ins) {
    const int Hkv = (int)m.Hkv, splits = (int)m.splits, G = (int)(m.Hq / m.Hkv), hs = ins.arg0 > 1 ? ins.arg0 : 1;
    AttnTile a;
    a.split = ins.tile % splits;
    const int r = ins.tile / splits, i = r % hs, bk = r / hs, gh = (G + hs - 1) / hs;
    a.kvh = bk % Hkv;
    a.b = bk / Hkv;
    a.g_lo = min(G, i * gh);
    a.g_hi = min(G, a.g_lo + gh);
    const int len = __ldcg(st.lengths + (size_t)ins.layer * m.B + a.b) + 1;
    const int chunk = (len + splits - 1) / splits;
    a.lo = min(a.split * chunk, len);
    a.hi = min(a.lo + chunk, len);
    return a;
}

template <typename T>
__device__ void mk_attention(const MkModel& m, const MkState& st, const MkIns& ins, AttnSmem& sm) {
    constexpr int VEC = 16 / sizeof(T);
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, splits = (int)m.splits, G = Hq / Hkv;
    const AttnTile a = mk_attn_tile(m, st, ins);
    const int split = a.split, kvh = a.kvh, b = a.b, lo = a.lo, hi = a.hi;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t kv0 = ((size_t)b * Hkv + kvh) * (size_t)m.max_seq * D;
    const T* kc = mk_layer_cache<T>(m, st.k_cache, ins.layer) + kv0;
    const T* vc = mk_layer_cache<T>(m, st.v_cache, ins.layer) + kv0;
    const float scale = (float)m.scale_log2;
    for (int g0 = a.g_lo; g0 < a.g_hi; g0 += MK_HEAD_TILE) {
        const int ng = min(MK_HEAD_TILE, a.g_hi - g0), h0 = kvh * G + g0;
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

// att rows of the G heads of (b, kvh) from the splits' partials (mk_merge_rows; lse: cap floats of
// scratch).
template <typename T>
__device__ void mk_attention_reduce(const MkModel& m, const MkState& st, const MkIns& ins, float* lse, int cap) {
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, G = Hq / Hkv;
    const int b = ins.tile / Hkv, kvh = ins.tile % Hkv;
    mk_merge_rows<T>(m, st, b, 1, kvh * G, G, (T*)st.att + ((size_t)b * Hq + kvh * G) * D, (size_t)Hq * D, lse, cap);
}

// --- the ring variant (arg1 = 1) -------------------------------------------------------------------
// The keys of the tile go through shared memory in chunks of CK = m.attn_keys keys (<=
// MK_ATTN_MAX_KEYS), K and V rows copied by cp.async as 16-byte vectors into two slots (the ring:
// chunk c + 1 is in flight while chunk c is computed; rows padded by 16 bytes so that a warp's
// score reads of 32 rows hit distinct banks). A tile of one chunk costs one L2 round trip for its
// K/V (issued before the queries load), not a round trip per vector as v1's loop. Per chunk
// (FlashAttention-2's online softmax over the block):
//   S = q K^T: one (head, key) score per thread, -inf past hi (V rows past hi are zero-filled);
//   per head (warp g): m_new = max(m, rowmax S), P = exp2(S - m_new), alpha = exp2(m - m_new),
//   l = l alpha + rowsum P;  O = O alpha + P V: one (head, dim) output per thread and step.
// The slots live in the dynamic shared memory of the GEMV input rows (xs_off), which no GEMV holds
// across an attention instruction (megakernel.cu resets its xs key after one).
#define MK_ATTN_OUT ((MK_HEAD_TILE * MK_MAX_HEAD_DIM + MK_THREADS - 1) / MK_THREADS)  // outputs per thread
static_assert(MK_HEAD_TILE * MK_ATTN_MAX_KEYS <= 2 * MK_THREADS, "at most two scores per thread and chunk");
static_assert(MK_ATTN_MAX_KEYS <= 64 && MK_HEAD_TILE <= MK_WARPS, "a warp's softmax takes two keys per lane");

struct AttnRingSmem {
    float q[MK_HEAD_TILE][MK_MAX_HEAD_DIM];   // the tile's queries, scaled by scale * log2(e)
    float s[MK_HEAD_TILE][MK_ATTN_MAX_KEYS];  // S, then P, of the chunk
    float m[MK_HEAD_TILE], l[MK_HEAD_TILE], alpha[MK_HEAD_TILE];
};

template <typename T>
__device__ void mk_attention_ring(const MkModel& m, const MkState& st, const MkIns& ins, AttnRingSmem& sm,
                                  unsigned char* slots) {
    constexpr int VEC = 16 / sizeof(T);
    const int D = (int)m.D, Hq = (int)m.Hq, Hkv = (int)m.Hkv, G = Hq / Hkv, CK = (int)m.attn_keys;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, NV = D / VEC, RB = D * (int)sizeof(T) + 16;
    const AttnTile a = mk_attn_tile(m, st, ins);
    const int ng = a.g_hi - a.g_lo, h0 = a.kvh * G + a.g_lo, nchunks = (a.hi - a.lo + CK - 1) / CK;
    const size_t kv0 = ((size_t)a.b * Hkv + a.kvh) * (size_t)m.max_seq * D;
    const T* kc = mk_layer_cache<T>(m, st.k_cache, ins.layer) + kv0;
    const T* vc = mk_layer_cache<T>(m, st.v_cache, ins.layer) + kv0;
    float o[MK_ATTN_OUT];
#pragma unroll
    for (int j = 0; j < MK_ATTN_OUT; ++j) o[j] = 0.f;
    // c = -1 issues chunk 0 and loads the queries while it is in flight; c >= 0 issues chunk c + 1
    // (into chunk c - 1's slot) and computes chunk c
    for (int c = -1; c < nchunks; ++c) {
        if (c >= 0) __syncthreads();  // every thread is done with chunk c - 1 (its slot refills next)
        if (c + 1 < nchunks) {  // chunk c + 1's K rows (then its V rows) into slot (c + 1) & 1, zero-filled past hi
            unsigned char* base = slots + (size_t)((c + 1) & 1) * 2 * CK * RB;
            const int k0 = a.lo + (c + 1) * CK;
            for (int i = threadIdx.x; i < 2 * CK * NV; i += MK_THREADS) {
                const int which = i / (CK * NV), r = (i / NV) % CK, v = i % NV, key = k0 + r;
                const bool ok = key < a.hi;
                const T* src = (which ? vc : kc) + (size_t)(ok ? key : 0) * D + v * VEC;
                cp_async_zfill<16>(base + (size_t)which * CK * RB + (size_t)r * RB + v * 16, src, ok ? 16 : 0);
            }
            cp_async_commit();
        }
        if (c < 0) {  // the queries (scaled) and the softmax state, while chunk 0 is in flight
            const float scale = (float)m.scale_log2;
            for (int i = threadIdx.x; i < ng * D; i += MK_THREADS)
                sm.q[i / D][i % D] =
                    to_float(__ldcg((const T*)st.q + ((size_t)a.b * Hq + h0 + i / D) * D + i % D)) * scale;
            if ((int)threadIdx.x < MK_HEAD_TILE) {
                sm.m[threadIdx.x] = -CUDART_INF_F;
                sm.l[threadIdx.x] = 0.f;
            }
            continue;
        }
        if (c + 1 < nchunks) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // chunk c has landed for every thread; q, m, l are set
        const unsigned char* ks = slots + (size_t)(c & 1) * 2 * CK * RB;
        const unsigned char* vs = ks + (size_t)CK * RB;
        const int k0 = a.lo + c * CK;
        // S_ij = q_i . k_j
        for (int i = threadIdx.x; i < ng * CK; i += MK_THREADS) {
            const int g = i / CK, r = i % CK;
            float sv = -CUDART_INF_F;
            if (k0 + r < a.hi) {
                sv = 0.f;
                const uint4* kr = reinterpret_cast<const uint4*>(ks + (size_t)r * RB);
                for (int v = 0; v < NV; ++v) {
                    const uint4 kv = kr[v];
                    const T* ke = reinterpret_cast<const T*>(&kv);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) sv = fmaf(sm.q[g][v * VEC + e], to_float(ke[e]), sv);
                }
            }
            sm.s[g][r] = sv;
        }
        __syncthreads();
        // m_new = max(m_old, rowmax S); P = exp2(S - m_new); l = l exp2(m_old - m_new) + rowsum P
        if (warp < ng) {
            float mx = -CUDART_INF_F;
            for (int r = lane; r < CK; r += 32) mx = fmaxf(mx, sm.s[warp][r]);
            const float mold = sm.m[warp], mnew = fmaxf(mold, warp_reduce_max(mx));
            const float ms = mnew == -CUDART_INF_F ? 0.f : mnew;
            float sum = 0.f;
            for (int r = lane; r < CK; r += 32) {
                const float p = exp2f(sm.s[warp][r] - ms);
                sm.s[warp][r] = p;
                sum += p;
            }
            sum = warp_reduce_sum(sum);
            __syncwarp();  // every lane has read m_old before lane 0 rewrites it
            if (lane == 0) {
                const float alpha = exp2f(mold - ms);
                sm.alpha[warp] = alpha;
                sm.l[warp] = sm.l[warp] * alpha + sum;
                sm.m[warp] = mnew;
            }
        }
        __syncthreads();
        // O_i = O_i exp2(m_old - m_new) + P_ij V_j
#pragma unroll
        for (int j = 0; j < MK_ATTN_OUT; ++j) {
            const int i = threadIdx.x + j * MK_THREADS;
            if (i < ng * D) {
                const int g = i / D, d = i % D;
                float acc = o[j] * sm.alpha[g];
                for (int r = 0; r < CK; ++r)
                    acc = fmaf(sm.s[g][r], to_float(reinterpret_cast<const T*>(vs + (size_t)r * RB)[d]), acc);
                o[j] = acc;
            }
        }
    }
    __syncthreads();  // the last chunk's m and l (or the initial ones) are visible
#pragma unroll
    for (int j = 0; j < MK_ATTN_OUT; ++j) {
        const int i = threadIdx.x + j * MK_THREADS;
        if (i < ng * D) {
            const int g = i / D, d = i % D, h = h0 + g;
            const float L = sm.l[g], out = L > 0.f ? o[j] / L : 0.f;  // no key at all: zeros (an empty split)
            if (m.splits == 1) {
                ((T*)st.att)[((size_t)a.b * Hq + h) * D + d] = from_float<T>(out);
            } else {
                const size_t r = ((size_t)a.split * m.B + a.b) * Hq + h;
                st.o_part[r * D + d] = out;
                if (d == 0) st.lse_part[r] = L > 0.f ? (sm.m[g] + log2f(L)) * LN2_F : -CUDART_INF_F;
            }
        }
    }
}
