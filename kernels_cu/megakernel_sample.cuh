// megakernel_sample.cuh: the two-level sampler of the megakernel (megakernel.cu; the op list's
// sample="two_level"). The one-block sampler (MK_OP_SAMPLE with arg0 = 0: sampling.cuh's
// sample_row) reads a sequence's whole row of logits on one block, about 48 dependent rounds of
// loads for SmolLM2's 49152 logits before the first radix pass, and several passes more for a
// top-p cut; here the row is cut into P chunks of C logits (whole LM-head tiles), one instruction
// each, and one merge per sequence reads P small answers.
//
//   opcode            tile           what
//   MK_OP_SAMPLE_PART b * P + p      logits [pC, min(V, (p+1)C)) of sequence b (arg0 = P, arg1 = C):
//                                    the chunk's max and its smallest id; when sampling (not
//                                    greedy) with a top-k, or with no top-k and a top-p below 1, its
//                                    candidates: every id whose key reaches the chunk's k-th largest
//                                    (k: top_k up to MK_SAMPLE_CAND, else MK_SAMPLE_CAND; ties kept),
//                                    in id order, or "too many" (-2), and (k not top_k) the largest
//                                    key it left out; with no top-k, the chunk's mass against the
//                                    row's largest logit (the largest of the LM-head tiles' maxima,
//                                    sp_tmax)
//   MK_OP_SAMPLE      b (arg0 = P,   the largest of the chunks' maxima (the greedy token); else with
//                     arg1 = C)      a top-k: sampling.cuh's draw over the candidates' union in id
//                                    order (a top-k above MK_SAMPLE_CAND: when its cut lies inside
//                                    the union); with no cut at all (top-k none, top-p 1): the chunk
//                                    that holds the RNG's draw of the row's mass (the chunks' sums in
//                                    id order), then that chunk's logits in id order; with top-p
//                                    only: the draw over the union with the row's mass, when its
//                                    top-p set lies inside the union; else the draw over the whole
//                                    row (one block, as arg0 = 0). The RNG step advances by one.
//
// Why each draws what the whole row would (the tests compare the tokens with
// reference.sample_token's): top-k: a token that survives the global top-k cut has fewer than k
// tokens with a larger key anywhere, so fewer than k in its own chunk: it is a candidate. The union
// holds every survivor, the global argmax and, with at least k tokens, the global k-th largest key;
// the cuts, masses and inverse CDF over it (in id order) are those over the whole row. A top-k
// above the chunks' k: the union's k-th largest key, if above every key left out, is the whole
// row's (every token at or above it is a candidate), and the rest follows as before. No cut: the
// masses are the whole row's (every chunk against the same largest logit), an integer sum in any
// order, and the inverse CDF in id order passes the chunks in order. Top-p: with the row's mass the
// need ceil(top_p * mass) is the whole row's; the cut found among the candidates, if its key is
// above every key left out, keeps exactly the tokens the whole row's cut keeps (all of them are
// candidates, and so are all larger ones), and the draw among them is the top-k case's.
//
// Layouts: sp_val float [B][P][1 + MK_SAMPLE_CAND] (the chunk's max, then the candidates' logits),
// sp_idx int [B][P][MK_SAMPLE_HEAD + MK_SAMPLE_CAND]: the max's id or -1, the candidate count or -1
// (none kept) / -2 (too many), the largest key left out (a wide cut), the chunk's mass (two words, low
// first; no top-k), then the candidates' ids. Written by one instruction, read by the merge after
// its counter wait (through L2). sp_tmax float [B][ceil(V / MK_TILE_ROWS)], written by the LM head.
#pragma once
#include "sampling.cuh"

static_assert(MK_SAMPLE_CHUNK % MK_TILE_ROWS == 0, "a vocabulary chunk is whole LM-head tiles");
static_assert(MK_SAMPLE_HEAD == 5, "a chunk's answer: max id, count, key left out, mass (2 words)");

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
    u64 row_mass, r;                // the row's mass (no top-k); the draw's offset in its chunk
    unsigned outside_key;           // the largest key of a token left out of the candidates
};

// The sampler's settings of sequence b: beta, top_p, top_k, and whether top-k cuts nothing.
struct MkDrawSettings {
    float beta, top_p;
    int top_k;
    bool no_cut;
};

__device__ __forceinline__ MkDrawSettings mk_draw_settings(const MkModel& m, int b) {
    const int top_k = m.iparams[4 * b];
    return MkDrawSettings{m.fparams[2 * b], m.fparams[2 * b + 1], top_k, top_k <= 0 || top_k >= (int)m.V};
}

template <typename T>
__device__ void mk_sample_part(const MkModel& m, const MkState& st, const MkIns& ins, SamplePartSmem& sm) {
    const int P = ins.arg0, C = ins.arg1, b = ins.tile / P, p = ins.tile % P, V = (int)m.V;
    const int lo = min(V, p * C), n = min(V, lo + C) - lo;
    const MkSampleSrc<T> src{nullptr, (const T*)st.logits + (size_t)b * V + lo};
    float* vals = st.sp_val + ((size_t)b * m.parts + p) * (1 + MK_SAMPLE_CAND);
    int* ids = st.sp_idx + ((size_t)b * m.parts + p) * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
    // the chunk's max and its smallest index
    float best;
    int best_i;
    thread_argmax<MK_THREADS>(src, n, best, best_i);
    block_argmax<MK_THREADS>(best, best_i, sm.s.sv, sm.s.si);
    const MkDrawSettings d = mk_draw_settings(m, b);
    const bool draw = best > -CUDART_INF_F && d.beta < CUDART_INF_F;
    // by_k: a top-k the candidates always hold; wide: a top-k above MK_SAMPLE_CAND, or top-p with no
    // top-k, whose cut the merge checks against the largest key left out
    const bool by_k = draw && !d.no_cut && d.top_k <= MK_SAMPLE_CAND;
    const bool wide = draw && (d.no_cut ? d.top_p < 1.0f : d.top_k > MK_SAMPLE_CAND);
    int count = -1;
    unsigned thr = 0u;
    if (by_k || wide) {
        // the chunk's k-th largest key (all of a chunk of at most k keys), then its ids at or
        // above it compacted in id order: thread t owns [t ch, (t + 1) ch)
        const int k = by_k ? d.top_k : MK_SAMPLE_CAND;
        if (k < n)
            thr = radix_threshold<false>(src, n, 0u, (u64)k, best, d.beta, sm.s.hist, &sm.s.sel_digit,
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
                    ids[MK_SAMPLE_HEAD + at] = lo + i;
                    ++at;
                }
            }
        }
        count = total <= MK_SAMPLE_CAND ? (int)total : -2;
    }
    unsigned outside = 0u;
    u64 mass = 0ull;
    int unused = 0;
    if (wide) {  // the largest logit left out (NaN never wins; none: -inf, below every weighed key)
        float left = -CUDART_INF_F;
        for (int i = threadIdx.x; i < n; i += MK_THREADS) {
            const float l = src(i);
            if (order_key(l) < thr) left = fmaxf(left, l);
        }
        block_argmax<MK_THREADS>(left, unused, sm.s.sv, sm.s.si);
        outside = order_key(left);
    }
    if (draw && d.no_cut) {
        // the row's largest logit: the largest of its LM-head tiles' maxima (written before this
        // instruction's wait), and the chunk's mass against it
        const int nt = (V + MK_TILE_ROWS - 1) / MK_TILE_ROWS;
        const float* tmax = st.sp_tmax + (size_t)b * nt;
        float lmax = -CUDART_INF_F;
        for (int j = threadIdx.x; j < nt; j += MK_THREADS) lmax = fmaxf(lmax, __ldcg(tmax + j));
        block_argmax<MK_THREADS>(lmax, unused, sm.s.sv, sm.s.si);
        for (int i = threadIdx.x; i < n; i += MK_THREADS) mass += mass_of(src(i), lmax, d.beta);
        u64 total = 0ull;
        block_exclusive_scan<MK_THREADS>(mass, &total, sm.s.sw);
        mass = total;
    }
    if (threadIdx.x == 0) {
        vals[0] = best;
        ids[0] = best > -CUDART_INF_F ? lo + best_i : -1;
        ids[1] = count;
        ids[2] = (int)outside;
        ids[3] = (int)(unsigned)mass;
        ids[4] = (int)(unsigned)(mass >> 32);
    }
}

// No cut at all (top-k none, top-p 1): the RNG's draw r of the row's mass (the chunks' sums), the
// chunk holding it, then sampling.cuh's inverse CDF over that chunk in id order (thread t owns
// [t ch, (t + 1) ch)): the token the whole row's draw picks. lmax: the row's largest logit.
template <typename T>
__device__ int mk_sample_scan(const MkModel& m, const MkState& st, int b, int P, int C, float lmax, float beta,
                              unsigned seed_lo, unsigned seed_hi, int step, int token, SampleMergeSmem& sm) {
    const int V = (int)m.V;
    const int* ids = st.sp_idx + (size_t)b * m.parts * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
    if (threadIdx.x == 0) {
        u64 total = 0ull;
        for (int p = 0; p < P; ++p) {
            const int* h = ids + (size_t)p * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
            total += (u64)(unsigned)__ldcg(h + 3) | (u64)(unsigned)__ldcg(h + 4) << 32;
        }
        const Philox4 rnd = philox4x32_10(Philox4{(unsigned)step, 0u, 0u, 0u}, seed_lo, seed_hi);
        u64 r = (u64)(uniform53(rnd.x, rnd.y) * (double)total);
        if (r >= total) r = total - 1ull;
        int p = 0;
        for (; p < P; ++p) {  // the chunk holding r
            const int* h = ids + (size_t)p * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
            const u64 w = (u64)(unsigned)__ldcg(h + 3) | (u64)(unsigned)__ldcg(h + 4) << 32;
            if (r < w) break;
            r -= w;
        }
        sm.n = min(p, P - 1);
        sm.r = r;
        sm.s.chosen = token;
    }
    __syncthreads();
    const int lo = min(V, sm.n * C), n = min(V, lo + C) - lo;
    const u64 r = sm.r;
    const T* row = (const T*)st.logits + (size_t)b * V + lo;
    const int ch = (n + MK_THREADS - 1) / MK_THREADS;
    const int t0 = min(n, (int)threadIdx.x * ch), t1 = min(n, t0 + ch);
    u64 own = 0ull, total = 0ull;
    for (int i = t0; i < t1; ++i) own += mass_of(to_float(__ldcg(row + i)), lmax, beta);
    const u64 before = block_exclusive_scan<MK_THREADS>(own, &total, sm.s.sw);
    if (before <= r && r < before + own) {  // exactly one thread's range holds r
        u64 cum = before;
        for (int i = t0; i < t1; ++i) {
            cum += mass_of(to_float(__ldcg(row + i)), lmax, beta);
            if (r < cum) {
                sm.s.chosen = lo + i;
                break;
            }
        }
    }
    __syncthreads();
    return sm.s.chosen;
}

// MK_OP_SAMPLE: arg0 = P chunks of arg1 = C logits (the merge above), or 0: the draw over the whole
// row on this block (sampling.cuh's sample_row). One function for all, so the kernel holds one copy
// of the draw.
template <typename T>
__device__ void mk_sample(const MkModel& m, const MkState& st, const MkIns& ins, SampleMergeSmem& sm) {
    const int P = ins.arg0, C = ins.arg1, b = ins.tile, V = (int)m.V;
    const MkDrawSettings d = mk_draw_settings(m, b);
    int* ip = m.iparams + 4 * b;
    const int step = ip[3];
    const unsigned seed_lo = (unsigned)ip[1], seed_hi = (unsigned)ip[2];
    const float* vals = st.sp_val + (size_t)b * m.parts * (1 + MK_SAMPLE_CAND);
    const int* ids = st.sp_idx + (size_t)b * m.parts * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
    // the greedy token: the largest chunk max, the smallest id among equals
    float best = -CUDART_INF_F;
    int best_i = 0x7fffffff;
    for (int p = threadIdx.x; p < P; p += MK_THREADS) {
        const float v = __ldcg(vals + (size_t)p * (1 + MK_SAMPLE_CAND));
        const int i = __ldcg(ids + (size_t)p * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND));
        if (i >= 0 && arg_better(v, i, best, best_i)) {
            best = v;
            best_i = i;
        }
    }
    if (P > 0) block_argmax<MK_THREADS>(best, best_i, sm.s.sv, sm.s.si);
    int token = best > -CUDART_INF_F ? best_i : -1;
    if (P > 0 && token >= 0 && d.beta < CUDART_INF_F && d.no_cut && d.top_p >= 1.0f) {
        token = mk_sample_scan<T>(m, st, b, P, C, best, d.beta, seed_lo, seed_hi, step, token, sm);
    } else if (P == 0 || (token >= 0 && d.beta < CUDART_INF_F)) {
        if (threadIdx.x == 0) {  // the candidates' offsets, or -1 when a chunk kept none / too many
            int total = P > 0 ? 0 : -1;
            u64 mass = 0ull;
            unsigned outside = 0u;
            for (int p = 0; p < P && total >= 0; ++p) {
                const int* h = ids + (size_t)p * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
                const int c = __ldcg(h + 1);
                sm.off[p] = total;
                total = c < 0 || total + c > MK_SAMPLE_MAX_CANDS ? -1 : total + c;
                outside = max(outside, (unsigned)__ldcg(h + 2));
                mass += (u64)(unsigned)__ldcg(h + 3) | (u64)(unsigned)__ldcg(h + 4) << 32;
            }
            sm.n = total;
            sm.row_mass = d.no_cut ? mass : 0ull;  // top-p with no top-k: the row's mass
            sm.outside_key = outside;
        }
        __syncthreads();
        const int n = sm.n;
        MkSampleSrc<T> src{nullptr, (const T*)st.logits + (size_t)b * V};
        if (n > 0) {
            for (int p = 0; p < P; ++p) {
                const int* h = ids + (size_t)p * (MK_SAMPLE_HEAD + MK_SAMPLE_CAND);
                const int c = __ldcg(h + 1), o = sm.off[p];
                for (int j = threadIdx.x; j < c; j += MK_THREADS) {
                    sm.cv[o + j] = __ldcg(vals + (size_t)p * (1 + MK_SAMPLE_CAND) + 1 + j);
                    sm.ci[o + j] = __ldcg(h + MK_SAMPLE_HEAD + j);
                }
            }
            __syncthreads();
            src.cand = sm.cv;
        }
        // over the union (a wide cut only where it lies inside: -2 when it does not), else over the
        // whole row on this block; one call site, so the kernel holds one copy of the draw
        const bool wide = d.no_cut || d.top_k > MK_SAMPLE_CAND;
        int i = -2;
        for (bool union_ = n > 0; i == -2; union_ = false) {
            if (!union_) src.cand = nullptr;
            i = sample_draw<MK_THREADS>(src, union_ ? n : V, d.beta, d.top_p, union_ && d.no_cut ? 0 : d.top_k, seed_lo,
                                        seed_hi, step, sm.s, union_ && wide, sm.row_mass, sm.outside_key);
            if (union_ && i >= 0) i = sm.ci[i];
        }
        token = i;
    }
    if (threadIdx.x == 0) {
        st.tokens[b] = token;
        ip[3] = step + 1;  // every thread read step at the top
    }
}
