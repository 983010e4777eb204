// emu_runtime.h: just enough of the CUDA C execution model to run SIMT kernels on the CPU, for
// testing kernel logic on machines without a GPU (tests/emu/README.md). Each CUDA thread is an OS
// thread; blocks run one after another, so `__shared__` (mapped to `static`) is per block.
// __syncthreads and warp shuffles are barriers; a thread that returns drops out of them, as an
// exited thread does on the GPU. The kernels' inline PTX lives in kernels_cu/ptx.cuh only, which
// the emulator swaps for emu_ptx.h (the same functions in C++); any other inline PTX is refused.
#pragma once
#include <atomic>
#include <functional>
#include <random>
#include <setjmp.h>
#include <ucontext.h>
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
#define __align__(n) __attribute__((aligned(n)))
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

// --- fibers: every CUDA thread of a block is a ucontext fiber on one OS thread -----------------
// A fiber runs until it reaches a barrier (__syncthreads, or the warp barrier inside a shuffle)
// or returns; the scheduler resumes waiting fibers once every live member has arrived. A thread
// that returns stops counting, as an exited thread does on the GPU. No progress = deadlock.
enum EmuState { EMU_RUN, EMU_WAIT_BLOCK, EMU_WAIT_WARP, EMU_DONE };
// A cp.async copy in flight: issued by the fiber, delivered at the cp.async.wait_group that
// retires its group (emu_ptx.h), the latest moment the PTX memory model allows.
struct EmuCopy { unsigned char* dst; const unsigned char* src; int bytes, src_bytes, group; };
struct EmuFiber {
    ucontext_t ctx; EmuState state; unsigned gen; uint3 tid;
    jmp_buf jb; bool started;      // after its first start a fiber is switched by _setjmp/_longjmp
    std::vector<EmuCopy> pending;  // cp.async copies not yet delivered
    int committed = 0;             // cp.async groups committed so far
};
struct EmuWarp { int live, arrived; unsigned gen; alignas(8) unsigned char slot[32][8]; unsigned xchg[32][16]; };
struct EmuSched {
    ucontext_t main;
    jmp_buf main_jb;               // the scheduler's resume point
    std::vector<EmuFiber> f;
    std::vector<EmuWarp> warps;
    int cur = 0, live = 0, block_arrived = 0;
    unsigned block_gen = 0;
    int red[3] = {0, 0, 0};        // __syncthreads_count/or/and tallies, one slot per barrier mod 3
    std::function<void()> call;
    bool failed = false;
    std::string msg;
};
inline EmuSched* emu_s = nullptr;
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline int emu_lane = 0, emu_warp = 0;
inline unsigned char* emu_dyn_smem = nullptr;
constexpr int warpSize = 32;

inline void emu_yield(EmuState st, unsigned gen) {
    EmuFiber& me = emu_s->f[emu_s->cur];
    me.state = st; me.gen = gen;
    // _setjmp/_longjmp save no signal mask: no system call per switch (swapcontext makes one)
    if (!_setjmp(me.jb)) _longjmp(emu_s->main_jb, 1);
}
inline void emu_block_arrive_check() {
    EmuSched& S = *emu_s;
    if (S.live > 0 && S.block_arrived == S.live) {
        S.block_arrived = 0;
        ++S.block_gen;
        S.red[S.block_gen % 3] = 0;  // the tally of the next barrier (its last readers passed this one)
    }
}
inline void emu_warp_arrive_check(EmuWarp& w) {
    if (w.live > 0 && w.arrived == w.live) { w.arrived = 0; ++w.gen; }
}
inline void __syncthreads() {
    EmuSched& S = *emu_s;
    unsigned g = S.block_gen;
    ++S.block_arrived;
    emu_block_arrive_check();
    if (S.block_gen == g) emu_yield(EMU_WAIT_BLOCK, g);
}
inline void emu_warp_barrier() {
    EmuWarp& w = emu_s->warps[emu_warp];
    unsigned g = w.gen;
    ++w.arrived;
    emu_warp_arrive_check(w);
    if (w.gen == g) emu_yield(EMU_WAIT_WARP, g);
}
// __syncthreads_count/or/and: a barrier that also tallies a predicate. Barrier g uses slot g % 3,
// cleared when barrier g - 1 completed (any barrier, plain ones too): the readers of its previous
// use, barrier g - 3, read it on waking, before they could arrive at barrier g - 1.
inline int emu_sync_count(int pred) {
    EmuSched& S = *emu_s;
    const unsigned g = S.block_gen;
    S.red[g % 3] += pred != 0;
    __syncthreads();
    return S.red[g % 3];
}
inline int __syncthreads_count(int pred) { return emu_sync_count(pred); }
inline int __syncthreads_or(int pred) { return emu_sync_count(pred) != 0; }
inline int __syncthreads_and(int pred) { return emu_sync_count(!pred) == 0; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier(); }
inline void __threadfence() {}
inline void __threadfence_block() {}
// Cache-hinted loads (ld.global.cg: L2 only, for data other blocks wrote during this kernel).
template <typename T> T __ldcg(const T* p) { return *p; }

template <typename T> T emu_shfl(T v, int src_of_lane_fn_kind, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffle of a type larger than 8 bytes");
    EmuWarp& w = emu_s->warps[emu_warp];
    std::memcpy(w.slot[emu_lane], &v, sizeof(T));
    emu_warp_barrier();
    int base = emu_lane & ~(width - 1), lane = emu_lane - base, src = lane;
    if (src_of_lane_fn_kind == 0) src = lane ^ arg;                           // xor
    else if (src_of_lane_fn_kind == 1) src = arg % width;                     // idx
    else if (src_of_lane_fn_kind == 2) src = lane + arg < width ? lane + arg : lane;  // down
    else src = lane - arg >= 0 ? lane - arg : lane;                           // up
    T r;
    std::memcpy(&r, w.slot[base + (src < width ? src : lane)], sizeof(T));
    emu_warp_barrier();
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
template <typename T> T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <typename T> T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }

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
inline void sincospif(float x, float* s, float* c) { *s = (float)std::sin(M_PI * x); *c = (float)std::cos(M_PI * x); }
inline float sinpif(float x) { return (float)std::sin(M_PI * x); }
inline float cospif(float x) { return (float)std::cos(M_PI * x); }
inline void sincos(double x, double* s, double* c) { *s = std::sin(x); *c = std::cos(x); }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
inline long long min(long long a, int b) { return a < b ? a : b; }
inline long long max(long long a, int b) { return a > b ? a : b; }
// Shared memory (static locals, the dynamic buffer) lives in this library's .bss, so a 32-bit
// offset from one origin addresses all of it, as a .shared address does on the GPU.
alignas(128) inline unsigned char emu_shared_origin[128];
alignas(128) inline unsigned char emu_dyn_smem_buf[228 * 1024];
inline size_t __cvta_generic_to_shared(const void* p) {
    return (size_t)(unsigned)((const unsigned char*)p - emu_shared_origin);
}
inline unsigned char* emu_shared_ptr(unsigned addr) { return emu_shared_origin + (int)addr; }

#define CUDART_INF_F __int_as_float(0x7f800000)
#define CUDART_NAN_F __int_as_float(0x7fffffff)
#define CUDART_INF (1.0 / 0.0)
#define CUDART_PI_F 3.141592654f


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

inline void emu_fiber_entry() {
    EmuSched& S = *emu_s;
    try {
        S.call();
    } catch (const std::exception& e) {
        if (!S.failed) { S.failed = true; S.msg = e.what(); }
    }
    // leave the block and the warp: barriers now wait for one thread fewer
    S.f[S.cur].state = EMU_DONE;
    --S.live;
    emu_block_arrive_check();
    EmuWarp& w = S.warps[emu_warp];
    --w.live;
    emu_warp_arrive_check(w);
    _longjmp(S.main_jb, 1);  // back to the scheduler; this fiber is never resumed
}

constexpr size_t EMU_STACK = 256 * 1024;
inline std::vector<char*> emu_stacks;  // reused by every launch; pages are touched lazily

template <typename... A>
int emu_launch(void (*k)(A...), dim3 g, dim3 b, size_t smem, const long long* iv, const double* dv,
               char* err, int errlen) {
    gridDim = g; blockDim = b;
    const int n = (int)(b.x * b.y * b.z);
    if (smem > sizeof(emu_dyn_smem_buf)) {
        std::snprintf(err, errlen, "dynamic shared memory %zu B exceeds 228 KB", smem);
        return 1;
    }
    emu_dyn_smem = emu_dyn_smem_buf;
    // Poison the whole dynamic buffer: a read of shared memory nobody wrote sees NaN / -1, and a
    // write past the `smem` bytes the host launched with is reported after the launch.
    std::memset(emu_dyn_smem_buf, 0xFF, sizeof(emu_dyn_smem_buf));
    while ((int)emu_stacks.size() < n) emu_stacks.push_back((char*)std::malloc(EMU_STACK));
    EmuSched S;
    S.f.resize(n);
    S.warps.resize((n + 31) / 32);
    S.call = [&] { emu_call(k, iv, dv, std::index_sequence_for<A...>{}); };
    emu_s = &S;
    // Fibers run in a seeded random order between barriers, so a missing __syncthreads that
    // lets one thread read shared data before another wrote it can show up as a wrong result.
    std::vector<int> order(n);
    for (int t = 0; t < n; ++t) order[t] = t;
    std::mt19937 rng(12345u + g.x * 7u + b.x);
    for (unsigned bz = 0; bz < g.z && !S.failed; ++bz)
    for (unsigned by = 0; by < g.y && !S.failed; ++by)
    for (unsigned bx = 0; bx < g.x && !S.failed; ++bx) {
        blockIdx = {bx, by, bz};
        S.live = n; S.block_arrived = 0;
        S.red[0] = S.red[1] = S.red[2] = 0;
        for (size_t w = 0; w < S.warps.size(); ++w) S.warps[w] = {std::min(32, n - (int)w * 32), 0, 0, {}, {}};
        for (int t = 0; t < n; ++t) {
            EmuFiber& f = S.f[t];
            f.tid = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
            f.state = EMU_RUN;
            f.pending.clear();
            f.committed = 0;
            f.started = false;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = emu_stacks[t];
            f.ctx.uc_stack.ss_size = EMU_STACK;
            f.ctx.uc_link = nullptr;  // emu_fiber_entry never returns
            makecontext(&f.ctx, emu_fiber_entry, 0);
        }
        while (S.live > 0) {
            bool progress = false;
            std::shuffle(order.begin(), order.end(), rng);  // a fresh interleaving every pass
            for (int t : order) {
                EmuFiber& f = S.f[t];
                bool ready = f.state == EMU_RUN ||
                             (f.state == EMU_WAIT_BLOCK && f.gen != S.block_gen) ||
                             (f.state == EMU_WAIT_WARP && f.gen != S.warps[t / 32].gen);
                if (!ready) continue;
                progress = true;
                f.state = EMU_RUN;
                S.cur = t; threadIdx = f.tid; emu_lane = t % 32; emu_warp = t / 32;
                if (!_setjmp(S.main_jb)) {
                    if (!f.started) { f.started = true; swapcontext(&S.main, &f.ctx); }
                    else _longjmp(f.jb, 1);
                }
            }
            if (!progress) {
                std::snprintf(err, errlen, "deadlock in block (%u,%u,%u): threads wait at a barrier that "
                              "other threads of the block or warp never reach", bx, by, bz);
                emu_s = nullptr;
                return 1;
            }
        }
    }
    emu_s = nullptr;
    if (S.failed) { std::snprintf(err, errlen, "%s", S.msg.c_str()); return 1; }
    for (size_t i = smem; i < sizeof(emu_dyn_smem_buf); ++i)
        if (emu_dyn_smem_buf[i] != 0xFF) {
            std::snprintf(err, errlen, "wrote dynamic shared memory at byte %zu, past the %zu B the launch "
                          "asked for (shared_mem=)", i, smem);
            return 1;
        }
    return 0;
}

template <typename... A> int emu_params(void (*)(A...), char* kinds, int* sizes) {
    const char k[] = {(char)emu_kind<std::remove_cv_t<A>>()..., 0};
    const int s[] = {(int)sizeof(A)..., 0};
    for (size_t i = 0; i < sizeof...(A); ++i) { kinds[i] = k[i]; sizes[i] = s[i]; }
    return (int)sizeof...(A);
}
