// sampling.cuh: next-token sampling by one block, shared by sample_kernel (sampling.cu: one block per
// sequence) and the megakernel's sampling instruction (megakernel.cu). The semantics and the
// algorithm are sampling.cu's header; everything here is written for a block of NT threads.
//
//   philox4x32_10, uniform53    the generator and its 53-bit uniform
//   order_key, mass_of          the monotone key of a logit and its fixed-point probability mass
//   block_argmax, block_exclusive_scan   block reductions (NT threads)
//   radix_threshold             the top-k / top-p cut by 8-bit radix selection
//   sample_draw                 the whole draw over a source of n logits (RowSrc: a row in global
//                               memory; the megakernel's merge: its top-k or top-p candidates in
//                               shared memory)
//   sample_row                  sample_draw over one row of logits, its RNG step advanced
//
// SAMPLING_MASS_BITS comes from cupyattn/config.py as a -D option (the specs that include this
// file pass it).
#pragma once
#include "common.cuh"
#if !defined(SAMPLING_MASS_BITS)
#error "compile with -DSAMPLING_MASS_BITS (cupyattn/config.py)"
#endif

#define RADIX_BINS 256
#define FULL_MASK 0xffffffffu

typedef unsigned long long u64;

// A logit of a row: plain load, or through L2 only (CG) for rows written during the same kernel.
template <bool CG, typename T>
__device__ __forceinline__ T sample_load(const T* p) {
    if constexpr (CG) return __ldcg(p);
    else return *p;
}

// The logits a draw reads: src(i) is logit i (as float) of n. The draw's answer is an index i; the
// caller maps it to a token id (a row: i itself).
template <typename T, bool CG>
struct RowSrc {
    const T* row;
    __device__ __forceinline__ float operator()(int i) const { return to_float(sample_load<CG>(row + i)); }
};

// --- Philox-4x32-10 (Salmon et al., SC'11; the Random123 definition) -------------------------
struct Philox4 {
    unsigned x, y, z, w;
};

__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {  // key schedule: Weyl sequence
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u64 p0 = (u64)0xD2511F53u * c.x;  // mulhilo of the two multipliers
        const u64 p1 = (u64)0xCD9E8D57u * c.z;
        c = Philox4{(unsigned)(p1 >> 32) ^ c.y ^ k0, (unsigned)p1, (unsigned)(p0 >> 32) ^ c.w ^ k1,
                    (unsigned)p0};
    }
    return c;
}

// 53-bit uniform in [0, 1) from two 32-bit words (27 high bits of x, 26 of y).
__device__ __forceinline__ double uniform53(unsigned x, unsigned y) {
    return ((double)(x >> 5) * 67108864.0 + (double)(y >> 6)) * (1.0 / 9007199254740992.0);
}

// --- keys and masses ---------------------------------------------------------------------------
// Monotone float -> uint32 map (a < b <=> key(a) < key(b)); -0 joins +0; NaN maps to 0, the
// bottom, so it can only be "kept" by a threshold of 0, and it weighs nothing anyway.
__device__ __forceinline__ unsigned order_key(float f) {
    if (f != f) return 0u;
    const unsigned u = __float_as_uint(f == 0.f ? 0.f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Mass of logit l against the row's largest l_max (beta finite, >= 0; see the header).
__device__ __forceinline__ u64 mass_of(float l, float lmax, float beta) {
    if (!(l > -CUDART_INF_F)) return 0ull;  // NaN or -inf: never drawn
    if (l >= lmax) return 1ull << SAMPLING_MASS_BITS;
    const float d = l - lmax;
    float x = d * beta;
    if (d == -CUDART_INF_F) {
        if (lmax == CUDART_INF_F) return 0ull;  // only the +inf logits weigh
        // |l - l_max| beyond float32's range (both finite): halve first (exact at these
        // magnitudes), double after beta, so a tiny beta still gives exp(x) > 0 (beta = 0: 1)
        x = ((0.5f * l - 0.5f * lmax) * beta) * 2.0f;
    }
    return (u64)(expf(x) * (float)(1ull << SAMPLING_MASS_BITS));
}

// --- block reductions (NT threads per block) -----------------------------------------------------
__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// This thread's (max, smallest index holding it) over row(i) for i = threadIdx.x, + NT, ... < n;
// a NaN never wins. block_argmax then combines the threads'.
template <int NT, typename Row>
__device__ __forceinline__ void thread_argmax(const Row& row, int n, float& best, int& best_i) {
    best = -CUDART_INF_F;
    best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += NT) {
        const float l = row(i);
        const float v = l != l ? -CUDART_INF_F : l;
        if (arg_better(v, i, best, best_i)) {
            best = v;
            best_i = i;
        }
    }
}

// (max, smallest index holding it) over the block; every thread gets the result.
template <int NT>
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (arg_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < NT / 32; ++w)
        if (arg_better(sv[w], si[w], v, i)) {
            v = sv[w];
            i = si[w];
        }
    __syncthreads();  // sv/si may be reused right after
}

// Exclusive prefix sum of x over threads in index order; *total gets the block's sum.
template <int NT>
__device__ u64 block_exclusive_scan(u64 x, u64* total, u64* sw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) sw[warp] = incl;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int w = 0; w < NT / 32; ++w) {
        before += w < warp ? sw[w] : 0ull;
        all += sw[w];
    }
    __syncthreads();
    *total = all;
    return before + incl - x;
}

// --- radix selection of a cut --------------------------------------------------------------------
// Largest key `thr` such that weight(key >= thr) >= need among the candidates (key >= floor_key),
// where a token weighs 1 (top-k: need = k gives the k-th largest key) or its mass (top-p). Four
// passes over 8-bit digits, most significant first: histogram the weight of the candidates that
// match the digits chosen so far, then one warp finds the digit at which the weight counted from
// the largest digit down reaches what is still needed. Integer weights: the histogram does not
// depend on the order of the atomic adds.
template <bool MASS, typename Src>
__device__ unsigned radix_threshold(const Src& row, int V, unsigned floor_key, u64 need, float lmax,
                                    float beta, u64* hist, unsigned* sel_digit, u64* sel_need) {
    const int lane = threadIdx.x & 31;
    unsigned prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < RADIX_BINS; j += blockDim.x) hist[j] = 0ull;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float l = row(i);
            const unsigned key = order_key(l);
            if (key < floor_key || (key & mask) != prefix) continue;
            atomicAdd(&hist[(key >> shift) & 255u], MASS ? mass_of(l, lmax, beta) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // lane L holds digits 255 - 8L down to 248 - 8L: lane order is descending digit order
            u64 own = 0ull;
            for (int k = 0; k < 8; ++k) own += hist[255 - 8 * lane - k];
            u64 incl = own;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 y = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += y;
            }
            const u64 total = __shfl_sync(FULL_MASK, incl, 31);
            u64 cum = incl - own;  // weight of the candidates in larger digits
            if (cum < need && need <= incl) {  // the crossing lies in this lane's digits
                for (int k = 0; k < 8; ++k) {
                    const int digit = 255 - 8 * lane - k;
                    if (cum + hist[digit] >= need) {
                        *sel_digit = (unsigned)digit;
                        *sel_need = need - cum;
                        break;
                    }
                    cum += hist[digit];
                }
            }
            if (lane == 0 && total < need) {  // not enough weight (not for valid inputs): keep all
                *sel_digit = 0u;
                *sel_need = 1ull;
            }
        }
        __syncthreads();
        prefix |= *sel_digit << shift;
        mask |= 255u << shift;
        need = *sel_need;
        __syncthreads();  // everyone has read sel_* before the next pass writes them
    }
    return prefix;
}

// --- the sampler -----------------------------------------------------------------------------------
// The shared memory of sample_row for a block of NT threads.
template <int NT>
struct SampleSmem {
    u64 hist[RADIX_BINS];
    u64 sw[NT / 32];
    float sv[NT / 32];
    int si[NT / 32];
    unsigned sel_digit;
    u64 sel_need;
    int chosen;
};

// One draw by the whole block of NT threads over the n logits of `row` (a Src: src(i) is logit i),
// with beta (inverse temperature), top_p, top_k and the RNG's seed and step: the index drawn, or
// -1 when no logit is a candidate (all NaN or -inf). blockDim.x must be NT: the loops stride by
// the constant NT (with blockDim.x strides, sample_kernel spilled at its 64-register bound on
// sm_120). The logits are an order: the argmax takes the smallest index of the largest, the
// inverse CDF runs in index order (so a source in token-id order draws what the whole row would).
// partial: the source is candidates of a longer row (the megakernel's merge), every token left out
// with a key at most outside_key, row_mass (when there is no top-k) the whole row's mass; the draw is
// the whole row's when each cut (the top-k's, or with no top-k the top-p's) lies above outside_key,
// else -2 (the caller draws over the whole row).
template <int NT, typename Src>
__device__ int sample_draw(const Src& row, int V, float beta, float top_p, int top_k, unsigned seed_lo,
                           unsigned seed_hi, int step, SampleSmem<NT>& sm, bool partial = false,
                           u64 row_mass = 0ull, unsigned outside_key = 0u) {
    u64* hist = sm.hist;
    u64* sw = sm.sw;
    float* sv = sm.sv;
    int* si = sm.si;
    unsigned& sel_digit = sm.sel_digit;
    u64& sel_need = sm.sel_need;
    int& chosen = sm.chosen;

    // step 1: max logit and its smallest index (the greedy answer; l_max for the masses)
    float best;
    int best_i;
    thread_argmax<NT>(row, V, best, best_i);
    block_argmax<NT>(best, best_i, sv, si);
    // no candidate (every logit NaN or -inf): -1, documented; the host side reports it
    int token = best > -CUDART_INF_F ? best_i : -1;

    if (token >= 0 && beta < CUDART_INF_F) {
        // step 2: top-k cut, the k-th largest key (ties kept)
        unsigned thr = 0u;
        if (partial && top_k >= V) return -2;  // the k-th largest lies outside the candidates
        if (top_k > 0 && top_k < V) {
            thr = radix_threshold<false>(row, V, 0u, (u64)top_k, best, beta, hist, &sel_digit, &sel_need);
            if (partial && thr <= outside_key) return -2;  // uniform: thr is the block's
        }
        // step 3: top-p cut among the top-k survivors
        if (top_p < 1.0f) {
            u64 own = 0ull, kept = 0ull;
            for (int i = threadIdx.x; i < V; i += NT) {
                const float l = row(i);
                if (order_key(l) >= thr) own += mass_of(l, best, beta);
            }
            block_exclusive_scan<NT>(own, &kept, sw);
            const u64 inside = kept;
            if (partial && top_k <= 0) kept = row_mass;
            double want = ceil((double)top_p * (double)kept);
            const u64 need = want < 1.0 ? 1ull : (want >= (double)kept ? kept : (u64)want);
            const unsigned thr_p = radix_threshold<true>(row, V, thr, need, best, beta, hist, &sel_digit, &sel_need);
            if (partial && top_k <= 0 && (need > inside || thr_p <= outside_key)) return -2;  // uniform
            thr = thr_p > thr ? thr_p : thr;
        }
        // step 4: inverse CDF in index order; thread t owns the indices [t*C, (t+1)*C)
        const int chunk = (V + NT - 1) / NT;
        const int lo = min(V, (int)threadIdx.x * chunk), hi = min(V, lo + chunk);
        u64 own = 0ull, total = 0ull;
        for (int i = lo; i < hi; ++i) {
            const float l = row(i);
            if (order_key(l) >= thr) own += mass_of(l, best, beta);
        }
        const u64 before = block_exclusive_scan<NT>(own, &total, sw);
        if (total > 0ull) {  // always (the argmax weighs 2^MASS_BITS and survives both cuts)
            const Philox4 rnd = philox4x32_10(Philox4{(unsigned)step, 0u, 0u, 0u}, seed_lo, seed_hi);
            u64 r = (u64)(uniform53(rnd.x, rnd.y) * (double)total);
            if (r >= total) r = total - 1ull;
            if (threadIdx.x == 0) chosen = token;
            __syncthreads();
            if (before <= r && r < before + own) {  // exactly one thread's chunk holds r
                u64 cum = before;
                for (int i = lo; i < hi; ++i) {
                    const float l = row(i);
                    if (order_key(l) >= thr) cum += mass_of(l, best, beta);
                    if (r < cum) {
                        chosen = i;
                        break;
                    }
                }
            }
            __syncthreads();
            token = chosen;
        }
    }
    return token;
}

// One sequence's token by the whole block of NT threads: row [V] (last dim contiguous),
// fparams [2] = (beta, top_p), iparams [4] = (top_k, seed lo, seed hi, step: advanced by one),
// the id (or -1) to *out. CG: read the logits through L2 only (__ldcg), for logits other blocks
// of the same kernel wrote (the megakernel); else plain loads.
template <typename T, int NT, bool CG>
__device__ void sample_row(const T* __restrict__ row, int V, const float* __restrict__ fparams,
                           int* __restrict__ iparams, int* __restrict__ out, SampleSmem<NT>& sm) {
    const int step = iparams[3];
    const int token = sample_draw<NT>(RowSrc<T, CG>{row}, V, fparams[0], fparams[1], iparams[0],
                                      (unsigned)iparams[1], (unsigned)iparams[2], step, sm);
    if (threadIdx.x == 0) {
        *out = token;
        iparams[3] = step + 1;  // every thread read step at the top
    }
}
