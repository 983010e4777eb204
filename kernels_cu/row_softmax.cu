// row_softmax.cu: y = softmax(x * scale) over contiguous rows, optional bottom-right causal mask.
//
//   variant      idea                                                               rows
//   v1 warp-row  one warp per row, 4 rows per 128-thread block, the row held in     n <= 1024
//                registers (VPT values per lane), max and sum by warp shuffles
//   v3 block-reg one 512-thread block per row, the row held in registers (VPT     1024 < n
//                values per thread): one read and one write of the row; max and   <= 512 * 32
//                sum by warp shuffles, then across warps through shared memory
//   v2 block-row one 512-thread block per row, looping over the row: pass 1 keeps   longer
//                an online (max m, sum l) per thread, merged across the block by
//                shuffles + smem; pass 2 writes exp(x - m) / l (reads the row twice)
//
// Math in float32; out dtype = in dtype. Causal: rows are [..., Sq, Sk] flattened, query
// q = row % Sq sees keys j <= q + Sk - Sq (FlashAttention-2 bottom-right alignment); masked keys
// and rows with no visible key (all -inf) are written as 0. A NaN or +inf among a row's visible
// scores makes its visible outputs NaN (masked ones stay 0): fmaxf would skip a NaN, so each
// kernel carries an explicit "bad" flag (cupyattn/reference.py states the semantics).
//
// Launch shapes (VPT list, rows per warp-row block, block-row threads) and their reasons:
// cupyattn/config.py SOFTMAX_*; they arrive here as template arguments. The host picks the
// smallest VPT with 32 * VPT >= n (v1) or BLOCK * VPT >= n (v3): at most 32 values per thread.
#include "common.cuh"

// Keys of this row the mask lets through: n, or min(n, q + n - sq + 1) clamped at 0 if causal.
__device__ __forceinline__ int visible_keys(long long row, int n, int sq, int causal) {
    if (!causal) return n;
    const long long kv = row % sq + n - sq + 1;  // 64-bit: q + n may pass 2^31
    return static_cast<int>(kv < 0 ? 0 : (kv > n ? n : kv));
}

// A score that poisons its row: NaN, or +inf (exp(inf - inf) has no value).
__device__ __forceinline__ bool bad_score(float s) { return s != s || s == CUDART_INF_F; }

// --- a row held in registers (v1, v3): element j = first + STRIDE * i lives in v[i] ----------
// v[i] = x_j * scale (masked or past the row: -inf); returns this thread's max, ORs "bad".
template <int VPT, int STRIDE, typename T>
__device__ __forceinline__ float row_load(const T* xr, int first, int kv, float scale, float (&v)[VPT],
                                          bool& bad) {
    float m = -CUDART_INF_F;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int j = first + STRIDE * i;
        v[i] = j < kv ? to_float(xr[j]) * scale : -CUDART_INF_F;
        bad |= bad_score(v[i]);
        m = fmaxf(m, v[i]);
    }
    return m;
}

// A row with a NaN / +inf among its visible scores: NaN there; nothing visible: a zero row (not
// exp(-inf - -inf) = NaN). Masked positions are 0 either way.
template <int VPT, int STRIDE, typename T>
__device__ __forceinline__ void row_fill(T* yr, int first, int n, int kv, bool any_bad, float m) {
    const float fill = m == -CUDART_INF_F && !any_bad ? 0.f : CUDART_NAN_F;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int j = first + STRIDE * i;
        if (j < n) yr[j] = from_float<T>(j < kv ? fill : 0.f);
    }
}

// v[i] = exp(v[i] - m) (masked: exp(-inf) = 0); returns this thread's sum.
template <int VPT>
__device__ __forceinline__ float row_exp(float (&v)[VPT], float m) {
    float l = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        v[i] = expf(v[i] - m);
        l += v[i];
    }
    return l;
}

template <int VPT, int STRIDE, typename T>
__device__ __forceinline__ void row_store(T* yr, int first, int n, const float (&v)[VPT], float inv_l) {
#pragma unroll
    for (int i = 0; i < VPT; ++i)
        if (first + STRIDE * i < n) yr[first + STRIDE * i] = from_float<T>(v[i] * inv_l);
}

// --- v1: warp per row ------------------------------------------------------------------------
// x, y: [rows, n] contiguous, n <= 32 * VPT. grid = ceil(rows / ROWS), block = 32 * ROWS.
template <typename T, int VPT, int ROWS>
__global__ void __launch_bounds__(32 * ROWS)
softmax_warp_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int n, int sq,
                    float scale, int causal) {
    const long long row = static_cast<long long>(blockIdx.x) * ROWS + (threadIdx.x >> 5);
    if (row >= rows) return;  // the whole warp leaves together: shuffles stay full-warp
    const int lane = threadIdx.x & 31;
    const int kv = visible_keys(row, n, sq, causal);
    const T* xr = x + row * n;
    T* yr = y + row * n;

    // s_j = x_j * scale (masked: -inf); m = max_j s_j; y_j = exp(s_j - m) / sum_j exp(s_j - m)
    float v[VPT];
    bool bad = false;
    const float m = warp_reduce_max(row_load<VPT, 32>(xr, lane, kv, scale, v, bad));
    const bool any_bad = __any_sync(0xffffffffu, bad);
    if (any_bad || m == -CUDART_INF_F) {
        row_fill<VPT, 32>(yr, lane, n, kv, any_bad, m);
        return;
    }
    const float inv_l = 1.f / warp_reduce_sum(row_exp(v, m));
    row_store<VPT, 32>(yr, lane, n, v, inv_l);
}

// --- v3: block per row, row in registers -----------------------------------------------------
// x, y: [rows, n] contiguous, n <= BLOCK * VPT. grid = rows, block = BLOCK. Element j = tid +
// BLOCK * i lives in v[i] (coalesced loads, all VPT in flight before any use). Each warp reduces
// its values, writes one partial, and after the barrier every warp reduces all NW partials itself
// (no second broadcast barrier); max and sum use separate slots, so no barrier between them.
template <typename T, int BLOCK, int VPT, int MIN_BLOCKS>
__global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
softmax_block_reg_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int n, int sq,
                         float scale, int causal) {
    constexpr int NW = BLOCK / 32;
    static_assert(NW <= 32, "one warp reduces the partials");
    __shared__ float red_m[NW], red_l[NW];
    const long long row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kv = visible_keys(row, n, sq, causal);
    const T* xr = x + row * n;
    T* yr = y + row * n;

    float v[VPT];
    bool bad = false;
    float m = warp_reduce_max(row_load<VPT, BLOCK>(xr, tid, kv, scale, v, bad));
    if (lane == 0) red_m[warp] = m;
    const bool any_bad = __syncthreads_or(bad);  // also the barrier before red_m is read
    m = warp_reduce_max(lane < NW ? red_m[lane] : -CUDART_INF_F);
    if (any_bad || m == -CUDART_INF_F) {  // the same for the whole block
        row_fill<VPT, BLOCK>(yr, tid, n, kv, any_bad, m);
        return;
    }
    const float l = warp_reduce_sum(row_exp(v, m));
    if (lane == 0) red_l[warp] = l;
    __syncthreads();
    row_store<VPT, BLOCK>(yr, tid, n, v, 1.f / warp_reduce_sum(lane < NW ? red_l[lane] : 0.f));
}

// --- v2: block per row -----------------------------------------------------------------------
// Merge two partial (max, sum-of-exp) pairs: l = l1 exp(m1 - m) + l2 exp(m2 - m), m = max.
__device__ __forceinline__ void ml_merge(float& m, float& l, float m2, float l2) {
    const float mn = fmaxf(m, m2);
    if (mn == -CUDART_INF_F) return;  // both empty
    l = l * expf(m - mn) + l2 * expf(m2 - mn);
    m = mn;
}

// x, y: [rows, n] contiguous. grid = rows, block = BLOCK.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_block_kernel(const T* __restrict__ x, T* __restrict__ y, long long rows, int n, int sq,
                     float scale, int causal) {
    constexpr int NW = BLOCK / 32;
    __shared__ float red_m[NW], red_l[NW];
    __shared__ float row_m, row_l;
    const long long row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kv = visible_keys(row, n, sq, causal);
    const T* xr = x + row * n;
    T* yr = y + row * n;

    // Pass 1: online softmax statistics of this thread's strided slice of the visible keys;
    // the running sum is rescaled by exp(m_old - m_new) only when the max grows. A NaN / +inf
    // score only raises the row's "bad" flag (reduced with the barrier below).
    float m = -CUDART_INF_F, l = 0.f;
    bool bad = false;
    for (int j = tid; j < kv; j += BLOCK) {
        const float s = to_float(xr[j]) * scale;
        if (bad_score(s)) {
            bad = true;
        } else if (s > m) {
            l = l * expf(m - s) + 1.f;
            m = s;
        } else if (m != -CUDART_INF_F) {
            l += expf(s - m);
        }
    }
    // Block reduction of (m, l): butterfly inside each warp, then warp 0 over the NW partials.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
        ml_merge(m, l, m2, l2);
    }
    if (lane == 0) { red_m[warp] = m; red_l[warp] = l; }
    bad = __syncthreads_or(bad);  // also the barrier before warp 0 reads red_m / red_l
    if (warp == 0) {
        m = lane < NW ? red_m[lane] : -CUDART_INF_F;
        l = lane < NW ? red_l[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
            ml_merge(m, l, m2, l2);
        }
        if (lane == 0) { row_m = m; row_l = l; }
    }
    __syncthreads();
    m = row_m;
    // Fully masked row: m = -inf -> zeros. Else y_j = exp(s_j - m) / l for visible j, 0 after;
    // a bad row is NaN at its visible positions.
    const float inv_l = m == -CUDART_INF_F ? 0.f : 1.f / row_l;
    for (int j = tid; j < n; j += BLOCK) {
        float p = 0.f;
        if (j < kv && bad) p = CUDART_NAN_F;
        else if (j < kv && m != -CUDART_INF_F) p = expf(to_float(xr[j]) * scale - m) * inv_l;
        yr[j] = from_float<T>(p);
    }
}
