// common.cuh: element conversions, math constants and warp reductions shared by every kernel file.
// Inlined into each .cu by cupyattn/_loader.py (so CuPy's cache sees header edits).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

// --- constants -------------------------------------------------------------------------------
#define LOG2E_F 1.4426950408889634f   // log2(e): exp(x) = exp2(x * LOG2E_F)
#define LN2_F 0.6931471805599453f     // ln(2): log(x) = log2(x) * LN2_F

// --- element <-> float ---------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Raw 16 bits of a 16-bit element, and two floats rounded to T packed in one 32-bit register
// (lo in the low half), the layout of an mma.sync A/B fragment register.
__device__ __forceinline__ unsigned short bits16(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return (unsigned)bits16(from_float<T>(lo)) | ((unsigned)bits16(from_float<T>(hi)) << 16);
}

// --- the end of an online softmax (cupyattn/reference.py states the semantics) ----------------
// 1 / l_i for the final O_i / l_i: 0 for a row that saw no key (l = 0); NaN for a row whose l is
// NaN (a NaN or +inf visible score: fmaxf skipped it in the max, exp2 did not).
__device__ __forceinline__ float row_scale(float l) {
    return l > 0.0f ? 1.0f / l : (l == l ? 0.0f : CUDART_NAN_F);
}
// L_i = m_i + log(l_i) (natural log; m in log2 units): -inf for no key, NaN for a NaN row.
__device__ __forceinline__ float row_lse(float m_log2, float l) {
    return l > 0.0f ? m_log2 * LN2_F + logf(l) : (l == l ? -CUDART_INF_F : CUDART_NAN_F);
}

// --- mma.sync fragments ------------------------------------------------------------------------
// Max / sum over the 4 lanes of a quad (the lanes that share a row of an m16n8 C fragment).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// The C fragments of two adjacent m16n8 tiles (keys 0-7 and 8-15 of P), rounded to T, as the A
// fragment of an m16n8k16 product (P V): FlashAttention-2's "P stays in registers".
template <typename T>
__device__ __forceinline__ void c_pair_to_a(const float (&c0)[4], const float (&c1)[4], unsigned (&a)[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// --- warp reductions (full 32-lane warp) ---------------------------------------------------
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
