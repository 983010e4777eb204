// layers.cu: the per-token layer ops of a Llama-style decoder (spec "layers", cupyattn/layers.py).
//
//   kernel                      idea
//   rmsnorm_warp_kernel<T,W,V,ADD>  one warp per row (4 rows per 128-thread block): sum of
//                               squares over lane-strided V-vectors, butterfly shuffle reduction,
//                               second pass scales by 1/sqrt(mean + eps) * weight. For D <= 1024.
//                               ADD: the residual add x += r is done in the pass that sums the
//                               squares (add_rmsnorm), one launch instead of two and x read once.
//   rmsnorm_block_kernel<T,W,V,ADD> one block per row: per-warp shuffle reduction, warp partials
//                               through 32 floats of smem, then every warp reduces them. D > 1024.
//   rope_kernel<T,NEOX,PV,I>    one thread per rotation pair (positions of type I: int or long
//                               long, so an int64 position is never narrowed); rows grid-strided, so a thread
//                               forms its pair's base^(-i/half) (double exp2) once and reuses it
//                               for many rows. Angle pos*inv_freq made and reduced mod 2pi in
//                               double, sincospif on (reduced angle)/pi in float (rope.cuh). Any [B,H,T]
//                               strides, in place ok. NEOX pairs (i, i+D/2); adjacent pairs
//                               (2i, 2i+1), PV: the pair moves as one 2-element vector.
//   swiglu_kernel<T,V>          grid-strided silu(gate) * up over V-vectors of [rows, cols] with
//                               a row stride per operand: gate and up may be the two halves of a
//                               packed [.., 2F] gate|up projection, read in place (no copies).
//   geglu_kernel<T,V>           swiglu_kernel with GELU (tanh form) for silu (Gemma's gate).
//   bias_add_kernel<T>          x += bias over rows of a strided [rows, n] view, in place (Qwen2).
//   softcap_kernel<T>           x = cap * tanh(x / cap), in place (Gemma 2's final logits).
//   head_rmsnorm_kernel<T>      one warp per head: RMSNorm over D of x [N, H, D] with a row stride,
//                               in place (Qwen3 / Gemma 3's QK norm on a packed projection).
//   add_kernel<T,V>             grid-strided elementwise x + y over V-vectors (residual add).
//   embedding_kernel<T,I,V>     one row of threads per token id (I = int or long long); an id
//                               outside [0, vocab) writes a zero row instead of reading.
//
// T is the element type (float, __half, __nv_bfloat16); math is float32 (rope's angle: double).
// V is the vector width in elements: 16 bytes / sizeof(T) when the host has checked alignment and
// divisibility, else 1 (the host picks; kernels never see a partial vector).
// Launch constants come from cupyattn/config.py as -D options: RMSNORM_WARPS (rows per block of
// the warp-per-row rmsnorm) and LAYERS_THREADS (block size of the grid-strided kernels). Pointers
// that may alias (out = x in place) are not __restrict__: no thread ever reads an element another
// thread has written.
#include "common.cuh"
#include "rope.cuh"
#if !defined(RMSNORM_WARPS) || !defined(LAYERS_THREADS)
#error "compile with the -D options of cupyattn/config.py (the layers KernelSpec passes them)"
#endif

// --- helpers ------------------------------------------------------------------------------------
// N consecutive elements moved as one aligned load/store (ld.global.v4 for 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& a) {
    *reinterpret_cast<Vec<T, N>*>(p) = a;
}

// --- rmsnorm --------------------------------------------------------------------------------------
// y = x / sqrt(mean(x^2) + eps) * w, row by row.
// x: [rows, D] C-contiguous; w: [D] (W = T or float); y: [rows, D] C-contiguous, may be x.
// ADD: x is the residual stream, r [rows, D] the branch output: x <- x + r (rounded to T, as the
// unfused add writes it), then y = rmsnorm(new x) * w; y must then not alias x or r.

template <typename T, typename W, int V>
__device__ __forceinline__ void rmsnorm_write(const T* xr, const W* __restrict__ w, T* yr, int nv,
                                              int first, int step, float inv_rms) {
    for (int j = first; j < nv; j += step) {
        const Vec<T, V> a = load_vec<T, V>(xr + (long long)j * V);
        const Vec<W, V> g = load_vec<W, V>(w + (long long)j * V);
        Vec<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(to_float(a.v[k]) * inv_rms * to_float(g.v[k]));
        store_vec<T, V>(yr + (long long)j * V, o);
    }
}

// Sum of squares of this thread's vectors j = first, first + step, ... of row xr. With ADD the
// vectors are first replaced by x + r (stored back to xr): rmsnorm_write then reads back only what
// this same thread wrote (same j sequence), so no barrier is needed between the two passes.
template <typename T, int V, bool ADD>
__device__ __forceinline__ float sum_squares(T* xr, const T* rr, int nv, int first, int step) {
    float ss = 0.f;
    for (int j = first; j < nv; j += step) {
        Vec<T, V> a = load_vec<T, V>(xr + (long long)j * V);
        if (ADD) {
            const Vec<T, V> b = load_vec<T, V>(rr + (long long)j * V);
#pragma unroll
            for (int k = 0; k < V; ++k) a.v[k] = from_float<T>(to_float(a.v[k]) + to_float(b.v[k]));
            store_vec<T, V>(xr + (long long)j * V, a);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const float f = to_float(a.v[k]);
            ss = fmaf(f, f, ss);
        }
    }
    return ss;
}

template <typename T, typename W, int V, bool ADD>
__global__ void __launch_bounds__(32 * RMSNORM_WARPS) rmsnorm_warp_kernel(
    T* x,                       // [rows, D] (written only when ADD)
    const T* r,                 // [rows, D] residual branch (ADD), else unused
    const W* __restrict__ w,    // [D]
    T* y,                       // [rows, D]
    long long rows, int D, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * RMSNORM_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warp leaves together: the shuffles below stay full-warp
    const int nv = D / V;
    T* xr = x + row * D;
    T* yr = y + row * D;
    // step 1: (residual add and) mean of squares over the row (lane j sums vectors j, j+32, ...)
    const float ss = warp_reduce_sum(sum_squares<T, V, ADD>(xr, r + (ADD ? row * D : 0), nv, lane, 32));
    // step 2: scale; every lane holds the same total after the butterfly
    const float inv_rms = 1.0f / sqrtf(ss / (float)D + eps);
    rmsnorm_write<T, W, V>(xr, w, yr, nv, lane, 32, inv_rms);
}

template <typename T, typename W, int V, bool ADD>
__global__ void __launch_bounds__(1024) rmsnorm_block_kernel(
    T* x,                       // [rows, D] (written only when ADD)
    const T* r,                 // [rows, D] residual branch (ADD), else unused
    const W* __restrict__ w,    // [D]
    T* y,                       // [rows, D]
    long long rows, int D, float eps) {
    __shared__ float partial[32];  // one sum per warp (blockDim.x <= 1024, a multiple of 32)
    const long long row = blockIdx.x;
    const int nv = D / V;
    T* xr = x + row * D;
    T* yr = y + row * D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    // step 1: (residual add and) per-thread, then per-warp sums of squares
    float ss = warp_reduce_sum(
        sum_squares<T, V, ADD>(xr, r + (ADD ? row * D : 0), nv, threadIdx.x, blockDim.x));
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    // step 2: every warp reduces the warp partials itself (no second barrier needed)
    ss = warp_reduce_sum(lane < nwarps ? partial[lane] : 0.f);
    const float inv_rms = 1.0f / sqrtf(ss / (float)D + eps);
    rmsnorm_write<T, W, V>(xr, w, yr, nv, threadIdx.x, blockDim.x, inv_rms);
}

// --- rope -----------------------------------------------------------------------------------------
// Pair i (0 <= i < half) of row (b, h, t) turns by angle pos[b, t] * base^(-i/half) / freq_div[i]
// (freq_div null: 1). half = rotary_dim / 2: the pairs are those of the first rotary_dim dims
// (NeoX: (i, i + half)); the dims past them are the host's to copy. x: [B, H, seq, D] with element
// strides (xsb, xsh, xst, 1); y: same shape, strides (ysb, ysh, yst, 1), may be x; pos: [B, seq]
// int32 C-contiguous. Block (bx, by): bx threads over pairs, by rows; rows = B*H*seq < 2^31
// (host-checked). freq_scale = -log2(base) / half; the angle and its precision: rope.cuh.
template <typename T, bool NEOX, bool PV, typename I>
__global__ void __launch_bounds__(LAYERS_THREADS) rope_kernel(
    const T* x, T* y, const I* __restrict__ pos,  // pos: int or long long, used as 64-bit
    const float* __restrict__ freq_div,          // [half] per-pair frequency divisors, or null
    int rows, int H, int seq, int half,
    long long xsb, long long xsh, long long xst,
    long long ysb, long long ysh, long long yst, double freq_scale) {
    const long long row_step = (long long)gridDim.x * blockDim.y;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double inv_freq = rope_inv_freq(i, freq_scale, freq_div);  // base^(-2i/rotary_dim) / freq_div[i]
        int ia, ib;                                             // the pair's two elements
        rope_pair<NEOX>(i, half, &ia, &ib);
        for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += row_step) {
            const int ri = (int)r;  // r < rows < 2^31
            const int t = ri % seq, bh = ri / seq;
            const int h = bh % H, b = bh / H;
            const T* xr = x + b * xsb + h * xsh + t * xst;
            T* yr = y + b * ysb + h * ysh + t * yst;
            float s, c;
            rope_sincos((long long)pos[(long long)b * seq + t], inv_freq, &s, &c);
            float x0, x1;
            if (PV) {
                const Vec<T, 2> p = load_vec<T, 2>(xr + ia);
                x0 = to_float(p.v[0]);
                x1 = to_float(p.v[1]);
            } else {
                x0 = to_float(xr[ia]);
                x1 = to_float(xr[ib]);
            }
            float r0, r1;
            rope_rotate(x0, x1, s, c, &r0, &r1);
            const T y0 = from_float<T>(r0), y1 = from_float<T>(r1);
            if (PV) {
                Vec<T, 2> o;
                o.v[0] = y0;
                o.v[1] = y1;
                store_vec<T, 2>(yr + ia, o);
            } else {
                yr[ia] = y0;
                yr[ib] = y1;
            }
        }
    }
}

// --- elementwise: swiglu, add ---------------------------------------------------------------------
// swiglu / geglu: gate, up, y are [rows, nvc * V] with row strides ldg, ldu, ldy (elements,
// multiples of V), last dim contiguous; a C-contiguous array is one row. y may be gate or up (same
// strides). y = act(gate) * up, act one of the two functors below.
struct Silu {  // silu(g) = g / (1 + e^-g); for g -> -inf the quotient goes to -0, never NaN
    __device__ __forceinline__ float operator()(float g) const { return g / (1.0f + expf(-g)); }
};
struct GeluTanh {  // Gemma's gate: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))); tanhf saturates
    __device__ __forceinline__ float operator()(float g) const {
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    }
};

template <typename T, int V, typename Act>
__device__ __forceinline__ void gated_rows(const T* gate, const T* up, T* y, long long rows, long long nvc,
                                           long long ldg, long long ldu, long long ldy) {
    const long long step = (long long)gridDim.x * blockDim.x;
    const long long nv = rows * nvc;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < nv; j += step) {
        const long long r = j / nvc, c = (j - r * nvc) * V;
        const Vec<T, V> g = load_vec<T, V>(gate + r * ldg + c);
        const Vec<T, V> u = load_vec<T, V>(up + r * ldu + c);
        Vec<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(Act()(to_float(g.v[k])) * to_float(u.v[k]));
        store_vec<T, V>(y + r * ldy + c, o);
    }
}

template <typename T, int V>
__global__ void __launch_bounds__(LAYERS_THREADS) swiglu_kernel(
    const T* gate, const T* up, T* y, long long rows, long long nvc,
    long long ldg, long long ldu, long long ldy) {
    gated_rows<T, V, Silu>(gate, up, y, rows, nvc, ldg, ldu, ldy);
}

template <typename T, int V>
__global__ void __launch_bounds__(LAYERS_THREADS) geglu_kernel(
    const T* gate, const T* up, T* y, long long rows, long long nvc,
    long long ldg, long long ldu, long long ldy) {
    gated_rows<T, V, GeluTanh>(gate, up, y, rows, nvc, ldg, ldu, ldy);
}

// bias_add: x [rows, n] with row stride ld (elements), last dim contiguous, in place: x += bias [n].
template <typename T>
__global__ void __launch_bounds__(LAYERS_THREADS) bias_add_kernel(T* x, const T* __restrict__ bias,
                                                                  long long rows, long long n, long long ld) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < rows * n; j += step) {
        const long long r = j / n, c = j - r * n;
        x[r * ld + c] = from_float<T>(to_float(x[r * ld + c]) + to_float(bias[c]));
    }
}

// softcap: x [n] C-contiguous, in place: x = cap * tanh(x / cap) (Gemma 2's final logits).
template <typename T>
__global__ void __launch_bounds__(LAYERS_THREADS) softcap_kernel(T* x, long long n, float cap) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += step)
        x[j] = from_float<T>(cap * tanhf(to_float(x[j]) / cap));
}

// head_rmsnorm: RMSNorm over each head of x [N, H, D] (element strides ld, D, 1), in place, one
// warp per head row (RMSNORM_WARPS rows per block); w [D] shared by every head (Qwen3 / Gemma 3's
// q_norm and k_norm on the heads of a packed QKV projection).
template <typename T>
__global__ void __launch_bounds__(32 * RMSNORM_WARPS) head_rmsnorm_kernel(
    T* x, const T* __restrict__ w, long long rows, int H, int D, long long ld, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * RMSNORM_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warp leaves together
    T* xr = x + (row / H) * ld + (row % H) * (long long)D;
    float ss = 0.f;
    for (int j = lane; j < D; j += 32) {
        const float f = to_float(xr[j]);
        ss = fmaf(f, f, ss);
    }
    ss = warp_reduce_sum(ss);
    const float inv_rms = 1.0f / sqrtf(ss / (float)D + eps);
    for (int j = lane; j < D; j += 32) xr[j] = from_float<T>(to_float(xr[j]) * inv_rms * to_float(w[j]));
}

// add: all arrays [n] C-contiguous, n = nv * V; y may be any of the inputs.
template <typename T, int V>
__global__ void __launch_bounds__(LAYERS_THREADS) add_kernel(const T* a, const T* b, T* y, long long nv) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < nv; j += step) {
        const Vec<T, V> p = load_vec<T, V>(a + j * V);
        const Vec<T, V> q = load_vec<T, V>(b + j * V);
        Vec<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(to_float(p.v[k]) + to_float(q.v[k]));
        store_vec<T, V>(y + j * V, o);
    }
}

// --- embedding ------------------------------------------------------------------------------------
// ids: [n] (I = int or long long), C-contiguous; table: [vocab, D], row stride ld elements, last
// dim contiguous; y: [n, D] C-contiguous. Block (bx, by): bx threads over a row's vectors, by
// tokens; tokens grid-strided. An id outside [0, vocab) gives a zero row (no read, no host sync).
template <typename T, typename I, int V>
__global__ void __launch_bounds__(LAYERS_THREADS) embedding_kernel(
    const I* __restrict__ ids, const T* __restrict__ table, T* __restrict__ y,
    long long n, int D, long long vocab, long long ld) {
    const int nv = D / V;
    const long long step = (long long)gridDim.x * blockDim.y;
    for (long long r = (long long)blockIdx.x * blockDim.y + threadIdx.y; r < n; r += step) {
        const long long id = (long long)ids[r];
        const bool valid = id >= 0 && id < vocab;
        const T* src = table + (valid ? id : 0) * ld;
        T* dst = y + r * D;
        for (int j = threadIdx.x; j < nv; j += blockDim.x) {
            Vec<T, V> o;
            if (valid) {
                o = load_vec<T, V>(src + (long long)j * V);
            } else {
#pragma unroll
                for (int k = 0; k < V; ++k) o.v[k] = from_float<T>(0.f);
            }
            store_vec<T, V>(dst + (long long)j * V, o);
        }
    }
}
