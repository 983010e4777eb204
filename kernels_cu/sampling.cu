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
// multiple of 32, at most 1024) and SAMPLING_MASS_BITS. The device code lives in sampling.cuh
// (shared with the megakernel's sampling instruction).
#include "common.cuh"
#if !defined(SAMPLING_THREADS) || !defined(SAMPLING_MASS_BITS)
#error "compile with the -D options of cupyattn/config.py (the sampling KernelSpec passes them)"
#endif
#include "sampling.cuh"

// --- the sampler ---------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(SAMPLING_THREADS, 1) sample_kernel(
    const T* __restrict__ logits,         // [B, V], row b at b * ld, last dim contiguous
    const float* __restrict__ fparams,    // [B, 2]: beta = 1/temperature (+inf: greedy), top_p
    int* __restrict__ iparams,            // [B, 4]: top_k, seed lo, seed hi, step (advanced here)
    int* __restrict__ out,                // [B] sampled token ids
    int V, long long ld) {
    __shared__ SampleSmem<SAMPLING_THREADS> sm;
    const int b = blockIdx.x;
    sample_row<T, SAMPLING_THREADS, false>(logits + b * ld, V, fparams + 2 * b, iparams + 4 * b, out + b, sm);
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
