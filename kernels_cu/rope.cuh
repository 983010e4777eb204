// rope.cuh: the rotary-embedding angle, pairs and rotation, shared by rope_kernel (layers.cu), the fused
// qkv_rope_append_kernel (kvcache.cu), the fused decode step (fused_decode.cu) and the megakernel's QKV
// epilogue (megakernel_gemv.cuh), so all of them rotate by exactly the same sin/cos.
//
// Pair i (0 <= i < half = D/2) at position pos turns by pos * base^(-i/half) / div[i] (div: per-pair
// frequency divisors, as Llama 3's rope_freqs, or null for none). freq_scale is -log2(base) / half
// (from the host), so inv_freq = exp2(i * freq_scale).
//
// Precision: an all-float32 angle (powf inv_freq ~1 ulp off, product rounded to a float near
// 32767 whose ulp is 2^-9) is off by up to ~2e-3 rad at pos 32767, i.e. ~2e-4 relative output
// error (20x the fp32 tolerance; modelled in tests/test_layers.py). Forming the angle in double
// and reducing it to [-pi, pi] there leaves one float rounding of a/pi in [-1, 1] for sincospif:
// angle error ~1e-7 rad (plus pos * 1e-16 from the double product) at any position.
#pragma once

// 2*pi as hi + lo doubles (~106 bits): reducing k turns costs no accuracy even for k ~ 3e8 (pos 2^31).
#define ROPE_TWO_PI_HI 6.283185307179586
#define ROPE_TWO_PI_LO 2.4492935982947064e-16
#define ROPE_INV_TWO_PI 0.15915494309189535
#define ROPE_INV_PI 0.3183098861837907

// base^(-i/half) for pair i, in double (formed once per pair and reused over rows where possible).
__device__ __forceinline__ double rope_inv_freq(int i, double freq_scale) {
    return exp2((double)i * freq_scale);
}

// The same divided by div[row + i], the pair's frequency divisor, where a table is given (div null: none;
// row: where the table's row starts, as the megakernel's one row per layer).
__device__ __forceinline__ double rope_inv_freq(int i, double freq_scale, const float* div, size_t row = 0) {
    const double inv_freq = rope_inv_freq(i, freq_scale);
    return div ? inv_freq / (double)div[row + i] : inv_freq;
}

// sin and cos of pos * inv_freq: angle in double, reduced mod 2pi (a - k*2pi, k = rint(a / 2pi)),
// then sincospif on (reduced angle)/pi in [-1, 1], which needs no range reduction of its own.
__device__ __forceinline__ void rope_sincos(long long pos, double inv_freq, float* s, float* c) {
    double a = (double)pos * inv_freq;
    const double k = rint(a * ROPE_INV_TWO_PI);
    a = fma(-k, ROPE_TWO_PI_HI, a);
    a = fma(-k, ROPE_TWO_PI_LO, a);
    sincospif((float)(a * ROPE_INV_PI), s, c);
}

// The two elements of pair i: (2i, 2i+1) adjacent (GGUF / llama.cpp), (i, i + half) NeoX.
template <bool NEOX>
__device__ __forceinline__ void rope_pair(int i, int half, int* ia, int* ib) {
    *ia = NEOX ? i : 2 * i;
    *ib = NEOX ? i + half : 2 * i + 1;
}

// (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), in float32.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float s, float c, float* y0, float* y1) {
    *y0 = x0 * c - x1 * s;
    *y1 = x0 * s + x1 * c;
}
