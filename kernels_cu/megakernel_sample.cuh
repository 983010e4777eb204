// megakernel_sample.cuh: the two-level sampler of the megakernel (megakernel.cu; the op list's
// sample="two_level"). The one-block sampler (MK_OP_SAMPLE with arg0 = 0: sampling.cuh's
// sample_row) reads a sequence's whole row of logits on one block, about 48 dependent rounds of
// loads for SmolLM2's 49152 logits before the first radix pass; here the row is cut into P chunks
// of C logits (whole LM-head tiles, so a chunk waits only for its own tiles), one instruction each,
// and one merge per sequence reads P small answers.
//
//   opcode            tile           what
//   MK_OP_SAMPLE_PART b * P + p      logits [pC, min(V, (p+1)C)) of sequence b (arg0 = P, arg1 = C):
//                                    the chunk's max and its smallest id; when the draw is
//                                    top-k with 0 < k <= MK_SAMPLE_CAND (and not greedy), its
//                                    candidates: every id whose key reaches the chunk's k-th
//                                    largest (ties kept), in id order, or "too many" (-2)
//   MK_OP_SAMPLE      b (arg0 = P)   the largest of the chunks' maxima (the greedy token); else,
//                                    when every chunk kept its candidates, sampling.cuh's draw
//                                    over their union in id order; else the draw over the whole
//                                    row (one block, as arg0 = 0). The RNG step advances by one.
//
// Why the union draws what the whole row would: a token that survives the global top-k cut has
// fewer than k tokens with a larger key anywhere, so fewer than k in its own chunk: it reaches its
// chunk's k-th largest key and is a candidate. The union holds every survivor, the global argmax
// and, with at least k tokens, the global k-th largest key; the draw's cuts, masses and inverse
// CDF over it (in id order) are those over the whole row. Exact, not approximate: the tests compare
// the tokens with reference.sample_token's.
//
// Layouts: sp_val float [B][P][1 + MK_SAMPLE_CAND] (the chunk's max, then the candidates' logits),
// sp_idx int [B][P][2 + MK_SAMPLE_CAND] (the max's id or -1, the candidate count or -1 (none kept)
// / -2 (too many), then the candidates' ids). Written by one instruction, read by the merge after
// its counter wait (through L2).
#pragma once
#include "sampling.cuh"

static_assert(MK_SAMPLE_CHUNK % MK_TILE_ROWS == 0, "a vocabulary chunk is whole LM-head tiles");

// A draw's source in the megakernel: the candidates' logits in shared memory, or a row of logits
// (read through L2). One type for both, so the kernel holds one copy of the draw, not three.
template <typename T>
struct MkSampleSrc {
    const float* cand;  // null: read `row`
    const T* row;
    __device__ __forceinline__ float operator()(int i) const {
        return cand != nullptr ? cand[i] : to_float(__ldcg(row + i));
    }
};

struct SamplePartSmem {
    SampleSmem<MK_THREADS> s;
};

struct SampleMergeSmem {
    SampleSmem<MK_THREADS> s;
    float cv[MK_SAMPLE_MAX_CANDS];  // the candidates' logits, chunk after chunk (id order)
    int ci[MK_SAMPLE_MAX_CANDS];    // their ids
    int off[MK_SAMPLE_MAX_PARTS];   // where chunk p's candidates start
    int n;                          // how many, or -1: draw over the whole row
};

template <typename T>
__device__ void mk_sample_part(const MkModel& m, const MkState& st, const MkIns& ins, SamplePartSmem& sm) {
    const int P = ins.arg0, C = ins.arg1, b = ins.tile / P, p = ins.tile % P, V = (int)m.V;
    const int lo = min(V, p * C), n = min(V, lo + C) - lo;
    const MkSampleSrc<T> src{nullptr, (const T*)st.logits + (size_t)b * V + lo};
    float* vals = st.sp_val + ((size_t)b * m.parts + p) * (1 + MK_SAMPLE_CAND);
    int* ids = st.sp_idx + ((size_t)b * m.parts + p) * (2 + MK_SAMPLE_CAND);
    // the chunk's max and its smallest index
    float best;
    int best_i;
    thread_argmax<MK_THREADS>(src, n, best, best_i);
    block_argmax<MK_THREADS>(best, best_i, sm.s.sv, sm.s.si);
    const float beta = m.fparams[2 * b];
    const int top_k = m.iparams[4 * b];
    int count = -1;
    if (best > -CUDART_INF_F && beta < CUDART_INF_F && top_k > 0 && top_k <= MK_SAMPLE_CAND) {
        // the chunk's k-th largest key (all of a chunk of at most k keys), then its ids at or
        // above it compacted in id order: thread t owns [t ch, (t + 1) ch)
        unsigned thr = 0u;
        if (top_k < n)
            thr = radix_threshold<false>(src, n, 0u, (u64)top_k, best, beta, sm.s.hist, &sm.s.sel_digit,
                                         &sm.s.sel_need);
        const int ch = (n + MK_THREADS - 1) / MK_THREADS;
        const int t0 = min(n, (int)threadIdx.x * ch), t1 = min(n, t0 + ch);
        u64 own = 0ull, total = 0ull;
        for (int i = t0; i < t1; ++i) own += order_key(src(i)) >= thr;
        u64 at = block_exclusive_scan<MK_THREADS>(own, &total, sm.s.sw);
        if (total <= MK_SAMPLE_CAND) {
            for (int i = t0; i < t1; ++i) {
                const float l = src(i);
                if (order_key(l) >= thr) {
                    vals[1 + at] = l;
                    ids[2 + at] = lo + i;
                    ++at;
                }
            }
        }
        count = total <= MK_SAMPLE_CAND ? (int)total : -2;
    }
    if (threadIdx.x == 0) {
        vals[0] = best;
        ids[0] = best > -CUDART_INF_F ? lo + best_i : -1;
        ids[1] = count;
    }
}

// MK_OP_SAMPLE: arg0 = P chunks (the merge above), or 0: the draw over the whole row on this block
// (sampling.cuh's sample_row). One function for both, so the kernel holds one copy of the draw.
template <typename T>
__device__ void mk_sample(const MkModel& m, const MkState& st, const MkIns& ins, SampleMergeSmem& sm) {
    const int P = ins.arg0, b = ins.tile, V = (int)m.V;
    const float* fp = m.fparams + 2 * b;
    int* ip = m.iparams + 4 * b;
    const float beta = fp[0], top_p = fp[1];
    const int top_k = ip[0], step = ip[3];
    const unsigned seed_lo = (unsigned)ip[1], seed_hi = (unsigned)ip[2];
    const float* vals = st.sp_val + (size_t)b * m.parts * (1 + MK_SAMPLE_CAND);
    const int* ids = st.sp_idx + (size_t)b * m.parts * (2 + MK_SAMPLE_CAND);
    // the greedy token: the largest chunk max, the smallest id among equals
    float best = -CUDART_INF_F;
    int best_i = 0x7fffffff;
    for (int p = threadIdx.x; p < P; p += MK_THREADS) {
        const float v = __ldcg(vals + (size_t)p * (1 + MK_SAMPLE_CAND));
        const int i = __ldcg(ids + (size_t)p * (2 + MK_SAMPLE_CAND));
        if (i >= 0 && arg_better(v, i, best, best_i)) {
            best = v;
            best_i = i;
        }
    }
    if (P > 0) block_argmax<MK_THREADS>(best, best_i, sm.s.sv, sm.s.si);
    int token = best > -CUDART_INF_F ? best_i : -1;
    if (P == 0 || (token >= 0 && beta < CUDART_INF_F)) {
        if (threadIdx.x == 0) {  // the candidates' offsets, or -1 when a chunk kept none / too many
            int total = P > 0 ? 0 : -1;
            for (int p = 0; p < P && total >= 0; ++p) {
                const int c = __ldcg(ids + (size_t)p * (2 + MK_SAMPLE_CAND) + 1);
                sm.off[p] = total;
                total = c < 0 || total + c > MK_SAMPLE_MAX_CANDS ? -1 : total + c;
            }
            sm.n = total;
        }
        __syncthreads();
        const int n = sm.n;
        MkSampleSrc<T> src{nullptr, (const T*)st.logits + (size_t)b * V};
        if (n > 0) {
            for (int p = 0; p < P; ++p) {
                const int c = __ldcg(ids + (size_t)p * (2 + MK_SAMPLE_CAND) + 1), o = sm.off[p];
                for (int j = threadIdx.x; j < c; j += MK_THREADS) {
                    sm.cv[o + j] = __ldcg(vals + (size_t)p * (1 + MK_SAMPLE_CAND) + 1 + j);
                    sm.ci[o + j] = __ldcg(ids + (size_t)p * (2 + MK_SAMPLE_CAND) + 2 + j);
                }
            }
            __syncthreads();
            src.cand = sm.cv;
        }
        const int i = sample_draw<MK_THREADS>(src, n > 0 ? n : V, beta, top_p, top_k, seed_lo, seed_hi, step, sm.s);
        token = n > 0 && i >= 0 ? sm.ci[i] : i;
    }
    if (threadIdx.x == 0) {
        st.tokens[b] = token;
        ip[3] = step + 1;  // every thread read step at the top
    }
}
