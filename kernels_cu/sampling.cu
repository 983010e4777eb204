// sampling.cu: next-token sampling on the device (spec "sampling", cupyattn/sampling.py).
//
//   kernel             idea
//   sample_kernel<T>   one block per sequence over its logits row [V]. Greedy (1/temperature =
//                      +inf): block argmax, ties to the smallest id (as numpy.argmax). Otherwise the
//                      softmax of logits / temperature, cut by top-k and top-p, sampled by
//                      inverse CDF in token-id order with a Philox-4x32-10 uniform. Both cuts are
//                      exact thresholds on the logits found by 8-bit radix selection (token
//                      counts for top-k, fixed-point probability masses for top-p): no sort, and
//                      every sum is over 64-bit integers, so the token depends only on the
//                      logits, the settings, the seed and the step, never on thread timing or
//                      the launch shape.
//   philox_kernel      raw Philox-4x32-10 blocks for given counters and keys (tests hold it to
//                      the Random123 known-answer vectors).
//
// Settings are read from device arrays, so a captured CUDA graph uses the values of the moment
// it is replayed: fparams float32 [B, 2] = (beta = 1/temperature, top_p), where the host wrote
// beta = +inf for greedy and beta = 0 for the uniform limit (cupyattn/sampling.py,
// inverse_temperature); iparams int32 [B, 4] = (top_k, seed bits 0-31, seed bits 32-63, step).
// The kernel advances step by one per call.
//
// Semantics (cupyattn/sampling.py documents them for users, cupyattn/reference.py models them):
//   candidates: the tokens whose logit is neither NaN nor -inf. A row without one yields -1.
//   probability mass of candidate i: m_i = floor(exp((l_i - l_max) * beta) * 2^MASS_BITS), so
//     the most likely token weighs exactly 2^MASS_BITS; masses below 1 (p_i / p_max <
//     2^-MASS_BITS) are 0; when l_max is +inf only the +inf logits weigh (l_i - l_max = -inf);
//     beta = 0 gives every candidate the same mass, even where l_i - l_max overflows float32.
//     NaN and -inf weigh 0 and never win the argmax.
//   top-k (0 < k < V): keep tokens whose logit >= the k-th largest logit (ties at the k-th value
//     are all kept, so more than k tokens may remain).
//   top-p (p < 1): among those, keep tokens whose logit >= the largest threshold t with
//     mass(logit >= t) >= ceil(p * mass(kept)): the smallest most-likely set reaching p, with
//     ties at the cut kept whole.
//   draw: u = 53-bit uniform from Philox-4x32-10(counter = (step, 0, 0, 0), key = (seed lo,
//     seed hi)); r = floor(u * W) with W = the kept mass; the token is the first id whose
//     cumulative kept mass (ids ascending) exceeds r.
//
// Launch constants from cupyattn/config.py as -D options: SAMPLING_THREADS (block size, a
// multiple of 32, at most 1024) and SAMPLING_MASS_BITS.
#include "common.cuh"
#if !defined(SAMPLING_THREADS) || !defined(SAMPLING_MASS_BITS)
#error "compile with the -D options of cupyattn/config.py (the sampling KernelSpec passes them)"
#endif

#define SAMPLING_WARPS (SAMPLING_THREADS / 32)
#define RADIX_BINS 256
#define FULL_MASK 0xffffffffu

typedef unsigned long long u64;

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

// --- block reductions (blockDim.x == SAMPLING_THREADS) -------------------------------------------
__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// (max, smallest index holding it) over the block; every thread gets the result.
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
    for (int w = 1; w < SAMPLING_WARPS; ++w)
        if (arg_better(sv[w], si[w], v, i)) {
            v = sv[w];
            i = si[w];
        }
    __syncthreads();  // sv/si may be reused right after
}

// Exclusive prefix sum of x over threads in index order; *total gets the block's sum.
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
    for (int w = 0; w < SAMPLING_WARPS; ++w) {
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
template <typename T, bool MASS>
__device__ unsigned radix_threshold(const T* row, int V, unsigned floor_key, u64 need, float lmax,
                                    float beta, u64* hist, unsigned* sel_digit, u64* sel_need) {
    const int lane = threadIdx.x & 31;
    unsigned prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < RADIX_BINS; j += blockDim.x) hist[j] = 0ull;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float l = to_float(row[i]);
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
template <typename T>
__global__ void __launch_bounds__(SAMPLING_THREADS, 1) sample_kernel(
    const T* __restrict__ logits,         // [B, V], row b at b * ld, last dim contiguous
    const float* __restrict__ fparams,    // [B, 2]: beta = 1/temperature (+inf: greedy), top_p
    int* __restrict__ iparams,            // [B, 4]: top_k, seed lo, seed hi, step (advanced here)
    int* __restrict__ out,                // [B] sampled token ids
    int V, long long ld) {
    __shared__ u64 hist[RADIX_BINS];
    __shared__ u64 sw[SAMPLING_WARPS];
    __shared__ float sv[SAMPLING_WARPS];
    __shared__ int si[SAMPLING_WARPS];
    __shared__ unsigned sel_digit;
    __shared__ u64 sel_need;
    __shared__ int chosen;
    const int b = blockIdx.x;
    const T* row = logits + b * ld;
    const float beta = fparams[2 * b], top_p = fparams[2 * b + 1];
    const int top_k = iparams[4 * b], step = iparams[4 * b + 3];
    const unsigned seed_lo = (unsigned)iparams[4 * b + 1], seed_hi = (unsigned)iparams[4 * b + 2];

    // step 1: max logit and its smallest index (the greedy answer; l_max for the masses)
    float best = -CUDART_INF_F;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float l = to_float(row[i]);
        const float v = l != l ? -CUDART_INF_F : l;  // NaN never wins
        if (arg_better(v, i, best, best_i)) {
            best = v;
            best_i = i;
        }
    }
    block_argmax(best, best_i, sv, si);
    // no candidate (every logit NaN or -inf): -1, documented; the host side reports it
    int token = best > -CUDART_INF_F ? best_i : -1;

    if (token >= 0 && beta < CUDART_INF_F) {
        // step 2: top-k cut, the k-th largest key (ties kept)
        unsigned thr = 0u;
        if (top_k > 0 && top_k < V)
            thr = radix_threshold<T, false>(row, V, 0u, (u64)top_k, best, beta, hist, &sel_digit, &sel_need);
        // step 3: top-p cut among the top-k survivors
        if (top_p < 1.0f) {
            u64 own = 0ull, kept = 0ull;
            for (int i = threadIdx.x; i < V; i += blockDim.x) {
                const float l = to_float(row[i]);
                if (order_key(l) >= thr) own += mass_of(l, best, beta);
            }
            block_exclusive_scan(own, &kept, sw);
            double want = ceil((double)top_p * (double)kept);
            const u64 need = want < 1.0 ? 1ull : (want >= (double)kept ? kept : (u64)want);
            const unsigned thr_p = radix_threshold<T, true>(row, V, thr, need, best, beta, hist, &sel_digit,
                                                            &sel_need);
            thr = thr_p > thr ? thr_p : thr;
        }
        // step 4: inverse CDF in id order; thread t owns the ids [t*C, (t+1)*C)
        const int chunk = (V + SAMPLING_THREADS - 1) / SAMPLING_THREADS;
        const int lo = min(V, (int)threadIdx.x * chunk), hi = min(V, lo + chunk);
        u64 own = 0ull, total = 0ull;
        for (int i = lo; i < hi; ++i) {
            const float l = to_float(row[i]);
            if (order_key(l) >= thr) own += mass_of(l, best, beta);
        }
        const u64 before = block_exclusive_scan(own, &total, sw);
        if (total > 0ull) {  // always (the argmax weighs 2^MASS_BITS and survives both cuts)
            const Philox4 rnd = philox4x32_10(Philox4{(unsigned)step, 0u, 0u, 0u}, seed_lo, seed_hi);
            u64 r = (u64)(uniform53(rnd.x, rnd.y) * (double)total);
            if (r >= total) r = total - 1ull;
            if (threadIdx.x == 0) chosen = token;
            __syncthreads();
            if (before <= r && r < before + own) {  // exactly one thread's chunk holds r
                u64 cum = before;
                for (int i = lo; i < hi; ++i) {
                    const float l = to_float(row[i]);
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
    if (threadIdx.x == 0) {
        out[b] = token;
        iparams[4 * b + 3] = step + 1;  // every thread read step at the top
    }
}

// --- raw generator (tests) ---------------------------------------------------------------------
// ctr: [n, 4], key: [n, 2], out: [n, 4] uint32, C-contiguous. One thread per block of output.
__global__ void philox_kernel(const unsigned* __restrict__ ctr, const unsigned* __restrict__ key,
                              unsigned* __restrict__ out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const Philox4 r = philox4x32_10(Philox4{ctr[4 * i], ctr[4 * i + 1], ctr[4 * i + 2], ctr[4 * i + 3]},
                                        key[2 * i], key[2 * i + 1]);
        out[4 * i] = r.x;
        out[4 * i + 1] = r.y;
        out[4 * i + 2] = r.z;
        out[4 * i + 3] = r.w;
    }
}
