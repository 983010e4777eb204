// fused_decode.cu: the projections of a Llama-style decode step with their neighbours fused in
// (cupyattn/fused.py). Each is the skinny GEMM of skinny.cuh (M <= 16 rows of activations times a
// weight W [N, K] streamed once), with a prologue and an epilogue:
//
//   kernel                          prologue   C = A W^T, then                       replaces
//   norm_qkv_rope_append_kernel     RMSNorm    RoPE on q, k; q -> q_out, k, v ->     rmsnorm, gemm,
//                                              cache row lengths[b]; the last block   append_qkv
//                                              advances lengths
//   gemm_residual_kernel            -          x += C (the residual add)             gemm, add
//   norm_gate_up_swiglu_kernel      RMSNorm    silu(C_gate) * C_up                   rmsnorm, gemm,
//                                                                                    swiglu
//   norm_gemm_kernel                RMSNorm    store C (the logits)                  rmsnorm, gemm
//
// Every rounding of the unfused ops is kept: A' = T(a * inv_rms * w) as rmsnorm writes it, C is
// rounded to T before RoPE / the residual add / SwiGLU as gemm_nt's output is, and each
// epilogue computes in float32 as its unfused kernel does.
//
// Column ownership: a block owns NR = 8 * S_NT outputs as S_NT groups of 8 weight rows
// (skinny_tile's brow). Where an epilogue combines two outputs, the block owns both:
//   SwiGLU:  groups 0 .. S_NT/2-1 are gate rows j0 .., the rest the up rows F + j0 .. (W = [Wg; Wu]);
//   RoPE:    (S_NT = 2) the 8 rotation pairs i = 8j .. 8j+7 of one head: adjacent style rows
//            h*D + 16j .. +15 (pairs (2i, 2i+1)), NeoX rows h*D + 8j .. +7 and h*D + D/2 + 8j .. +7.
// So W needs no repacking: the same weight serves the unfused path and prefill.
//
// Layouts (row-major, last dim contiguous): x, A [M, K] (row stride lda); W [N, K] contiguous;
// out [M, N'] contiguous; cache (one layer) k, v [B, Hkv, max_seq, D], lengths int32 [B].
// Grid (tiles_m * tiles_n), S_WARPS * 32 threads, static smem only (red: S_WARPS * 16 * NR floats).
// PDL: each kernel waits (pdl_wait) before its first read and lets the next kernel start
// (pdl_launch_dependents) after its main loop; both are no-ops unless launched with PDL.
#include "common.cuh"
#include "ptx.cuh"
#include "rope.cuh"
#include "skinny.cuh"

// --- helpers -----------------------------------------------------------------------------------
// Block coordinates: first row m0 of A / C and the column tile index.
struct SkinnyBlock {
    int m0, tile_n;
    __device__ SkinnyBlock(int tiles_n) : m0((blockIdx.x / tiles_n) * 16), tile_n(blockIdx.x % tiles_n) {}
};

// The norm prologue + main loop, shared by the three RMSNorm kernels (barrier before red is read).
template <typename T, int S_WARPS, int S_NT, int S_CH>
__device__ __forceinline__ void norm_tile(const T* x, int M, long long ldx, int m0, const T* norm_w, float eps,
                                          const T* w, const int (&brow)[S_NT], const int (&bend)[S_NT], int K,
                                          bool vec, float (&red)[S_WARPS][16][8 * S_NT]) {
    __shared__ float inv_rms[16];
    pdl_wait();
    skinny_rms_rows<T, S_WARPS>(x, M, ldx, m0, K, eps, inv_rms);
    __syncthreads();
    skinny_tile<T, S_WARPS, S_NT, S_CH, true>(x, M, ldx, m0, w, K, brow, bend, K, vec, norm_w, inv_rms, red);
    pdl_launch_dependents();
    __syncthreads();
}

// --- RMSNorm + QKV projection + RoPE + KV-cache append -----------------------------------------
// x [B, K] (one token per sequence, row stride ldx), w [(Hq + 2 Hkv) D, K] rows of Wq | Wk | Wv.
// Token b sits at position p = lengths[b]: its q heads turn by p into q_out [B, Hq, D], its k heads
// turn by p into k_cache row p, its v heads are copied to v_cache row p. Every block reads
// lengths[b] before it takes a ticket; the block that takes the last ticket (all others have read
// them) advances lengths[b] by one and resets the ticket to 0 for the next launch or graph replay.
// The host has checked lengths[b] + 1 <= max_seq on its mirror; a device length outside [0, max_seq)
// (the caller's array, corrupted) writes no cache row. tiles_n = (Hq + 2 Hkv) * D / 16.
template <typename T, bool NEOX, int S_WARPS, int S_NT, int S_CH>
__global__ void __launch_bounds__(S_WARPS * 32, 1) norm_qkv_rope_append_kernel(
    const T* __restrict__ x, const T* __restrict__ norm_w, const T* __restrict__ w,
    T* __restrict__ q_out,              // [B, Hq, D] contiguous
    T* __restrict__ k_cache,            // [B, Hkv, max_seq, D] (one layer), contiguous
    T* __restrict__ v_cache,            // [B, Hkv, max_seq, D]
    int* __restrict__ lengths,          // [B] tokens cached before this token (advanced by one)
    unsigned* __restrict__ ticket,      // [1], 0 between launches
    int B, int K, long long ldx, int Hq, int Hkv, int D, int max_seq, int tiles_n, float eps,
    double freq_scale,
    const float* __restrict__ freq_div,  // [D/2] per-pair frequency divisors (Llama 3's rope_freqs), or null
    int vec_ok) {
    static_assert(S_NT == 2, "a block owns the 8 rotation pairs of two 8-row groups");
    constexpr int NR = 8 * S_NT, NT = S_WARPS * 32;
    __shared__ float red[S_WARPS][16][NR];
    const SkinnyBlock blk(tiles_n);
    const int half = D / 2, tiles_head = D / 16;
    const int h = blk.tile_n / tiles_head, j = blk.tile_n - h * tiles_head;  // head, pair group
    int brow[S_NT], bend[S_NT];
    brow[0] = h * D + (NEOX ? 8 * j : 16 * j);
    brow[1] = NEOX ? h * D + half + 8 * j : brow[0] + 8;
    bend[0] = bend[1] = (Hq + 2 * Hkv) * D;
    norm_tile<T, S_WARPS, S_NT, S_CH>(x, B, ldx, blk.m0, norm_w, eps, w, brow, bend, K, vec_ok & 1, red);

    // epilogue: item (m, p), rotation pair i = 8j + p of head h for token b = m0 + m
    for (int it = threadIdx.x; it < 16 * 8; it += NT) {
        const int m = it / 8, p = it % 8, b = blk.m0 + m;
        if (b >= B) continue;
        const int c0 = NEOX ? p : 2 * p, c1 = NEOX ? p + 8 : 2 * p + 1;  // the pair's tile columns
        const float x0 = to_float(from_float<T>(skinny_sum(red, m, c0)));  // as gemm_nt rounds qkv
        const float x1 = to_float(from_float<T>(skinny_sum(red, m, c1)));
        int ia, ib;
        const int i = 8 * j + p;
        rope_pair<NEOX>(i, half, &ia, &ib);
        const int pos = lengths[b];
        T* dst;
        if (h < Hq) {
            dst = q_out + ((long long)b * Hq + h) * D;
        } else {
            if ((unsigned)pos >= (unsigned)max_seq) continue;  // corrupt lengths: no cache row to write
            const int hk = h < Hq + Hkv ? h - Hq : h - Hq - Hkv;
            dst = (h < Hq + Hkv ? k_cache : v_cache) + (((size_t)b * Hkv + hk) * (size_t)max_seq + pos) * D;
        }
        float y0 = x0, y1 = x1;
        if (h < Hq + Hkv) {  // q and k turn by the position; v is copied
            float s, c;
            rope_sincos(pos, rope_inv_freq(i, freq_scale, freq_div), &s, &c);
            rope_rotate(x0, x1, s, c, &y0, &y1);
        }
        dst[ia] = from_float<T>(y0);
        dst[ib] = from_float<T>(y1);
    }

    // the last block to finish advances the lengths (every block has read them by its ticket)
    if (last_block_ticket(ticket, gridDim.x))
        for (int b = threadIdx.x; b < B; b += NT) lengths[b] += 1;
}

// --- projection + residual add -----------------------------------------------------------------
// x [M, N] (contiguous) += T(a [M, K] @ w [N, K]^T), rounded as add(x, gemm_nt(a, w)): x is read
// and written by the one thread that owns the element.
template <typename T, int S_WARPS, int S_NT, int S_CH>
__global__ void SKINNY_LAUNCH_BOUNDS(T, S_WARPS) gemm_residual_kernel(
    const T* __restrict__ a, const T* __restrict__ w, T* __restrict__ x,
    int M, int N, int K, long long lda, int tiles_n, int vec_ok) {
    constexpr int NR = 8 * S_NT, NT = S_WARPS * 32;
    __shared__ float red[S_WARPS][16][NR];
    const SkinnyBlock blk(tiles_n);
    const int n0 = blk.tile_n * NR;
    int brow[S_NT], bend[S_NT];
    skinny_rows(n0, N, brow, bend);
    pdl_wait();
    skinny_tile<T, S_WARPS, S_NT, S_CH, false>(a, M, lda, blk.m0, w, K, brow, bend, K, vec_ok & 1, nullptr,
                                               nullptr, red);
    pdl_launch_dependents();
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * NR; i += NT) {
        const int m = i / NR, n = i - m * NR;
        if (blk.m0 + m < M && n0 + n < N) {
            T* xe = x + (long long)(blk.m0 + m) * N + n0 + n;
            const float c = to_float(from_float<T>(skinny_sum(red, m, n)));
            *xe = from_float<T>(to_float(*xe) + c);
        }
    }
}

// --- RMSNorm + gate|up projection + SwiGLU -----------------------------------------------------
// out [M, F] = silu(C[:, :F]) * C[:, F:], C = rmsnorm(x) @ w^T, w [2F, K] = rows of Wgate, Wup.
// The block owns gate columns j0 .. j0 + NR/2 - 1 and the same up columns. tiles_n = ceil(F / (NR/2)).
template <typename T, int S_WARPS, int S_NT, int S_CH>
__global__ void SKINNY_LAUNCH_BOUNDS(T, S_WARPS) norm_gate_up_swiglu_kernel(
    const T* __restrict__ x, const T* __restrict__ norm_w, const T* __restrict__ w, T* __restrict__ out,
    int M, int F, int K, long long ldx, int tiles_n, float eps, int vec_ok) {
    static_assert(S_NT % 2 == 0, "the block owns as many gate groups as up groups");
    constexpr int NR = 8 * S_NT, NH = NR / 2, NT = S_WARPS * 32;
    __shared__ float red[S_WARPS][16][NR];
    const SkinnyBlock blk(tiles_n);
    const int j0 = blk.tile_n * NH;
    int brow[S_NT], bend[S_NT];
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) {
        const bool up = nt >= S_NT / 2;
        brow[nt] = (up ? F : 0) + j0 + 8 * (nt % (S_NT / 2));
        bend[nt] = up ? 2 * F : F;
    }
    norm_tile<T, S_WARPS, S_NT, S_CH>(x, M, ldx, blk.m0, norm_w, eps, w, brow, bend, K, vec_ok & 1, red);
    for (int i = threadIdx.x; i < 16 * NH; i += NT) {
        const int m = i / NH, c = i - m * NH;
        if (blk.m0 + m < M && j0 + c < F) {
            const float g = to_float(from_float<T>(skinny_sum(red, m, c)));
            const float u = to_float(from_float<T>(skinny_sum(red, m, c + NH)));
            // silu(g) * u as swiglu_kernel: g / (1 + e^-g) goes to -0 for g -> -inf, never NaN
            out[(long long)(blk.m0 + m) * F + j0 + c] = from_float<T>(g / (1.0f + expf(-g)) * u);
        }
    }
}

// --- RMSNorm + projection ----------------------------------------------------------------------
// out [M, N] = rmsnorm(x) @ w^T (the output norm and the logits). tiles_n = ceil(N / NR).
template <typename T, int S_WARPS, int S_NT, int S_CH>
__global__ void SKINNY_LAUNCH_BOUNDS(T, S_WARPS) norm_gemm_kernel(
    const T* __restrict__ x, const T* __restrict__ norm_w, const T* __restrict__ w, T* __restrict__ out,
    int M, int N, int K, long long ldx, int tiles_n, float eps, int vec_ok) {
    constexpr int NR = 8 * S_NT, NT = S_WARPS * 32;
    __shared__ float red[S_WARPS][16][NR];
    const SkinnyBlock blk(tiles_n);
    const int n0 = blk.tile_n * NR;
    int brow[S_NT], bend[S_NT];
    skinny_rows(n0, N, brow, bend);
    norm_tile<T, S_WARPS, S_NT, S_CH>(x, M, ldx, blk.m0, norm_w, eps, w, brow, bend, K, vec_ok & 1, red);
    for (int i = threadIdx.x; i < 16 * NR; i += NT) {
        const int m = i / NR, n = i - m * NR;
        if (blk.m0 + m < M && n0 + n < N) out[(long long)(blk.m0 + m) * N + n0 + n] = from_float<T>(skinny_sum(red, m, n));
    }
}
