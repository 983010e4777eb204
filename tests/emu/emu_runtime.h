// emu_runtime.h: just enough of the CUDA C execution model to run SIMT kernels on the CPU, for
// testing kernel logic on machines without a GPU (tests/emu/README.md). Each CUDA thread is an OS
// thread; blocks run one after another, so `__shared__` (mapped to `static`) is per block.
// __syncthreads and warp shuffles are barriers; a thread that returns drops out of them, as an
// exited thread does on the GPU. Inline PTX is replaced by a call that aborts (not emulated).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <math.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define __constant__ static

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// --- per-thread identity and the barriers of the running block ------------------------------
struct EmuWarp {
    std::barrier<>* bar;
    alignas(8) unsigned char slot[32][8];
};
struct EmuBlock {
    std::barrier<>* bar;
    std::vector<EmuWarp>* warps;
};
inline thread_local uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline thread_local EmuBlock* emu_block = nullptr;
inline thread_local int emu_lane = 0, emu_warp = 0;
inline unsigned char* emu_dyn_smem = nullptr;
constexpr int warpSize = 32;

inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { (*emu_block->warps)[emu_warp].bar->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T> T emu_shfl(T v, int src_of_lane_fn_kind, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffle of a type larger than 8 bytes");
    EmuWarp& w = (*emu_block->warps)[emu_warp];
    std::memcpy(w.slot[emu_lane], &v, sizeof(T));
    w.bar->arrive_and_wait();
    int base = emu_lane & ~(width - 1), lane = emu_lane - base, src = lane;
    if (src_of_lane_fn_kind == 0) src = lane ^ arg;                           // xor
    else if (src_of_lane_fn_kind == 1) src = arg % width;                     // idx
    else if (src_of_lane_fn_kind == 2) src = lane + arg < width ? lane + arg : lane;  // down
    else src = lane - arg >= 0 ? lane - arg : lane;                           // up
    T r;
    std::memcpy(&r, w.slot[base + (src < width ? src : lane)], sizeof(T));
    w.bar->arrive_and_wait();
    return r;
}
template <typename T> T __shfl_xor_sync(unsigned, T v, int m, int width = 32) { return emu_shfl(v, 0, m, width); }
template <typename T> T __shfl_sync(unsigned, T v, int s, int width = 32) { return emu_shfl(v, 1, s, width); }
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned d, int width = 32) { return emu_shfl(v, 2, (int)d, width); }
template <typename T> T __shfl_up_sync(unsigned, T v, unsigned d, int width = 32) { return emu_shfl(v, 3, (int)d, width); }
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned r = 0;
    for (int o = 0; o < 32; ++o) r |= (unsigned)(__shfl_sync(0xffffffffu, pred ? 1 : 0, o) != 0) << o;
    return r;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return __ballot_sync(m, p) == 0xffffffffu; }

// --- atomics ---------------------------------------------------------------------------------
template <typename T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p); T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
template <typename T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }

// --- math intrinsics -------------------------------------------------------------------------
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return std::min(1.0f, std::max(0.0f, x)); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void sincos(double x, double* s, double* c) { *s = std::sin(x); *c = std::cos(x); }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
inline long long min(long long a, int b) { return a < b ? a : b; }
inline long long max(long long a, int b) { return a > b ? a : b; }
inline unsigned __cvta_generic_to_shared(const void* p) { return (unsigned)(uintptr_t)p; }

#define CUDART_INF_F __int_as_float(0x7f800000)
#define CUDART_NAN_F __int_as_float(0x7fffffff)
#define CUDART_INF (1.0 / 0.0)
#define CUDART_PI_F 3.141592654f

[[noreturn]] inline void emu_unsupported_asm(const char* where) {
    throw std::runtime_error(std::string("inline PTX is not emulated: ") + where);
}

// --- half and bfloat16 (storage types; arithmetic goes through float as in the kernels) -----
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
struct alignas(4) __half2 { __half x, y; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float x) { _Float16 f = (_Float16)x; __half h; std::memcpy(&h.x, &f, 2); return h; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float __bfloat162float(__nv_bfloat16 b) { unsigned u = (unsigned)b.x << 16; return __uint_as_float(u); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return {(uint16_t)(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __half __ushort_as_half(unsigned short s) { return {s}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short s) { return {s}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }

// --- launching -------------------------------------------------------------------------------
// Arguments arrive as int64 / double slots and are converted to the kernel's parameter types.
template <typename A> A emu_arg(long long i, double d) {
    if constexpr (std::is_pointer_v<A>) return reinterpret_cast<A>((uintptr_t)i);
    else if constexpr (std::is_floating_point_v<A>) return (A)d;
    else return (A)i;
}
template <typename A> constexpr int emu_kind() {
    return std::is_pointer_v<A> ? 'p' : std::is_floating_point_v<A> ? 'f' : std::is_same_v<A, bool> ? 'b' : 'i';
}

template <typename... A, size_t... I>
void emu_call(void (*k)(A...), const long long* iv, const double* dv, std::index_sequence<I...>) {
    k(emu_arg<std::remove_cv_t<A>>(iv[I], dv[I])...);
}

template <typename... A>
int emu_launch(void (*k)(A...), dim3 g, dim3 b, size_t smem, const long long* iv, const double* dv,
               char* err, int errlen) {
    gridDim = g; blockDim = b;
    const int nthreads = (int)(b.x * b.y * b.z);
    std::vector<unsigned char> dyn(smem + 16);
    emu_dyn_smem = dyn.data();
    std::atomic<bool> failed{false};
    std::string msg;
    std::mutex mu;
    for (unsigned bz = 0; bz < g.z && !failed; ++bz)
    for (unsigned by = 0; by < g.y && !failed; ++by)
    for (unsigned bx = 0; bx < g.x && !failed; ++bx) {
        std::barrier<> block_bar(nthreads);
        std::vector<EmuWarp> warps((nthreads + 31) / 32);
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (size_t w = 0; w < warps.size(); ++w) {
            wb.emplace_back(new std::barrier<>(std::min(32, nthreads - (int)w * 32)));
            warps[w].bar = wb.back().get();
        }
        EmuBlock blk{&block_bar, &warps};
        std::vector<std::thread> th;
        th.reserve(nthreads);
        for (int t = 0; t < nthreads; ++t) {
            th.emplace_back([&, t] {
                threadIdx = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
                blockIdx = {bx, by, bz};
                emu_block = &blk; emu_lane = t % 32; emu_warp = t / 32;
                try {
                    emu_call(k, iv, dv, std::index_sequence_for<A...>{});
                } catch (const std::exception& e) {
                    std::lock_guard<std::mutex> l(mu);
                    failed = true; msg = e.what();
                }  // the thread leaves its barriers below, so the others finish (with garbage)
                warps[emu_warp].bar->arrive_and_drop();
                block_bar.arrive_and_drop();
            });
        }
        for (auto& x : th) x.join();
    }
    if (failed) { std::snprintf(err, errlen, "%s", msg.c_str()); return 1; }
    return 0;
}

template <typename... A> int emu_params(void (*)(A...), char* kinds, int* sizes) {
    const char k[] = {(char)emu_kind<std::remove_cv_t<A>>()..., 0};
    const int s[] = {(int)sizeof(A)..., 0};
    for (size_t i = 0; i < sizeof...(A); ++i) { kinds[i] = k[i]; sizes[i] = s[i]; }
    return (int)sizeof...(A);
}
