// emu_runtime.h: just enough of the CUDA C execution model to run SIMT kernels on the CPU, for
// testing kernel logic on machines without a GPU (tests/emu/README.md). Each CUDA thread is a
// fiber on one OS thread; 1 to 4 blocks are in flight at once under a seeded adversarial schedule
// (emu_launch; more while all of them wait for another block), each with its own static
// `__shared__` arena (fakecupy rewrites the declarations), dynamic shared memory, poisoned per
// block, and view of global memory (emu_memory.h). __syncthreads, warp shuffles, ldmatrix and mma are
// rendezvous points; a thread that returns drops out of them, as an exited thread does on the GPU.
// The kernels' inline PTX lives in kernels_cu/ptx.cuh only, which the emulator swaps for
// emu_ptx.h (the same functions in C++); any other inline PTX is refused.
#pragma once
#include <atomic>
#include <functional>
#include <random>
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
#define __shared__ EMU_SHARED_DECLARATION_NOT_TRANSLATED_BY_FAKECUPY
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...) EMU_LAUNCH_BOUNDS_NOT_TRANSLATED_BY_FAKECUPY
#define __constant__ static
#define __grid_constant__  // a by-value kernel parameter (emu_arg copies it into the fiber)

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// --- fibers: every CUDA thread of a block is a fiber (its own stack) on one OS thread ------------
// A switch saves the callee-saved registers on the current stack and continues on another (what
// a call would preserve is all there is to save: a switch is a function call). On x86-64 that is
// 14 instructions (emu_switch_x86), without the pointer mangling and cancellation-handler
// unwinding of glibc's _setjmp/_longjmp, used before. Elsewhere: ucontext.
#if defined(__x86_64__)
struct EmuCtx { void* sp = nullptr; };
// save the registers on this stack, *save = its pointer; continue on the stack at `to`. The
// x87 and MXCSR control words are callee-saved too but never changed by a fiber: not saved.
// noipa: callers must assume it reads and writes any memory (other fibers run meanwhile).
static __attribute__((naked, noinline, noipa)) void emu_switch_x86(void** /*save*/, void* /*to*/) {
    __asm__("pushq %rbp\n\t" "pushq %rbx\n\t" "pushq %r12\n\t" "pushq %r13\n\t" "pushq %r14\n\t"
            "pushq %r15\n\t" "movq %rsp, (%rdi)\n\t" "movq %rsi, %rsp\n\t" "popq %r15\n\t"
            "popq %r14\n\t" "popq %r13\n\t" "popq %r12\n\t" "popq %rbx\n\t" "popq %rbp\n\t" "ret\n\t");
}
inline void emu_ctx_switch(EmuCtx& from, const EmuCtx& to) { emu_switch_x86(&from.sp, to.sp); }
// A fresh fiber's stack as a switch away from it would leave it: six registers, then `entry` as
// the return address, and below the 16-byte aligned top a null one (entry never returns), so
// entry starts with the stack aligned as after a call.
inline void emu_ctx_init(EmuCtx& c, char* stack, size_t size, void (*entry)()) {
    void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(entry);
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
    c.sp = sp;
}
#else
struct EmuCtx { ucontext_t uc; };
inline void emu_ctx_switch(EmuCtx& from, const EmuCtx& to) { swapcontext(&from.uc, &to.uc); }
inline void emu_ctx_init(EmuCtx& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;  // entry never returns
    makecontext(&c.uc, entry, 0);
}
#endif
// A fiber runs until it reaches a barrier (__syncthreads, a warp rendezvous, a condition such as
// an mbarrier phase) or returns; the scheduler resumes waiting fibers once every live member has
// arrived. A thread that returns stops counting, as an exited thread does on the GPU. A block in
// which no fiber can move is a deadlock.
enum EmuState { EMU_RUN, EMU_WAIT_BLOCK, EMU_WAIT_WARP, EMU_WAIT_COND, EMU_DONE };
// ---- hook for tests/emu/emu_ptx_sm90.h (Hopper): a fiber in EMU_WAIT_COND waits until
// `ready()` holds (an mbarrier phase, a warpgroup rendezvous); the scheduler polls it from its own
// stack, and a deadlock report says what() each such fiber waits for.
struct EmuWaitable {
    virtual bool ready() = 0;
    virtual std::string what() const = 0;
    virtual bool global() const { return false; }  // waits for another block (emu_memory.h)
};
// A cp.async copy in flight (emu_ptx.h): delivered at a moment the schedule picks between its
// issue and the cp.async.wait_group that retires its group (`due`: a scheduling tick, or never
// before the wait).
struct EmuCopy { unsigned char* dst; const unsigned char* src; int bytes, src_bytes, group; unsigned long long due; };
#include "emu_hb.h"  // happens-before inside a block: EmuKnow, emu_hb_meet, ...
struct EmuFiber {
    EmuCtx ctx; EmuState state; unsigned gen; uint3 tid;
    std::vector<EmuCopy> pending;  // cp.async copies not yet delivered
    int committed = 0;             // cp.async groups committed so far
    EmuWaitable* waiting_on = nullptr;  // EMU_WAIT_COND: what it waits for (lives on its stack)
    unsigned lag = 0;              // > 0: held back (emu_lag)
    EmuKnow kn;                    // what it knows of the block's sources (beyond the block's floor)
    unsigned epoch = 0;            // its own events' epoch (a source's)
    bool source = false;           // it has made an event the block orders
};
// A warp's rendezvous (shuffles, __syncwarp, ldmatrix, mma): the lanes named in the mask meet at
// one call site (`site`: a source line, or an instruction's name) with one mask.
// The exchanges among them (a shuffle's values, ldmatrix's row addresses, mma's fragments) go
// through two buffers, xchg[gen & 1]: each lane writes its part, the lanes meet, each reads the
// others'. xgen tags a lane's part with the rendezvous it wrote it for (a lane that did not take
// part has an older tag), and a lane about to write a buffer that lanes of the exchange two
// rendezvous back have still to read waits for them (emu_xchg_begin): one meeting per exchange.
struct EmuWarp {
    int live = 0, arrived = 0; unsigned gen = 0, live_mask = 0, arrived_mask = 0, mask = 0;
    long site = 0; const char* what = "";
    unsigned xchg[2][32][16], xgen[2][32];
    int xleft[2] = {0, 0};         // lanes of the buffer's exchange that have yet to read it
    unsigned xuser[2] = {0, 0};    // the rendezvous that exchange belongs to
};
constexpr unsigned long long EMU_NEVER = ~0ull;
struct EmuSched {                  // one block in flight (a slot of the launch)
    EmuCtx main;                   // the scheduler's resume point
    std::vector<EmuFiber> f;
    std::vector<EmuWarp> warps;
    int cur = 0, live = 0, block_arrived = 0, slot = 0;
    unsigned block_gen = 0;
    uint3 block;
    int red[3] = {0, 0, 0};        // __syncthreads_count/or/and tallies, one slot per barrier mod 3
    unsigned long long next_due = EMU_NEVER;  // earliest tick a cp.async of this block may land early
    int lagging = 0;               // emu_lag: fibers held back
    int sources = 0;               // fibers that have made an event the block orders (EmuKnow)
    EmuKnow floor;                 // what every thread of the block knows (the last __syncthreads)
    bool stalled = false;          // its last pass moved nothing, and some thread waits for another block:
    unsigned long long stall_gen = 0;  // it may move again once emu_gm.gen has changed since
    std::function<void()> call;
    bool failed = false;
    std::string msg;
};
// The emulator's state lives in its runtime library (emu_runtime.cpp, built once; a kernel build
// links to it): one copy in the process, whichever kernel modules are loaded.
extern EmuSched* emu_s;
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
extern int emu_lane, emu_warp;
extern unsigned char* emu_dyn_smem;
constexpr int warpSize = 32;
// ---- the adversarial schedule (tests/emu/README.md): one seeded generator per launch makes every
// choice (block order and concurrency, fiber order, warp skew, when async copies land), so a seed
// reproduces a run. `emu_tick` counts the launch's scheduling points (fiber steps).
extern std::mt19937_64 emu_rng;
extern unsigned long long emu_tick;
inline unsigned emu_pick(unsigned n) { return (unsigned)(emu_rng() % n); }
// When an asynchronous operation issued now completes: 0 = at issue, EMU_NEVER = at the wait that
// guarantees it (the latest legal moment), else a scheduling tick in between.
inline unsigned long long emu_async_due() {
    switch (emu_pick(3)) {
        case 0: return 0;
        case 1: return EMU_NEVER;
        default: return emu_tick + 1 + emu_pick(96);
    }
}
// 1 to EMU_START_SLOTS blocks start in flight; more start while every block in flight waits for
// another block (a persistent kernel's co-resident blocks), up to the launch's resident capacity.
constexpr int EMU_START_SLOTS = 4, EMU_MAX_SLOTS = 160;
extern size_t emu_dyn_smem_bytes;  // the launch's dynamic shared memory (shared_mem=)
extern int emu_slot;               // the slot of the block now running
// ---- hooks for tests/emu/emu_ptx_sm90.h: per-block state of the Hopper emulation is
// reset when a block starts; at its end, a non-empty string is the block's error (async work
// issued and never waited for, a barrier left mid-phase). `tick` runs after every fiber
// step: asynchronous work whose due tick has come lands there.
// A module whose source includes that header sets its build's own hooks (emu_module_hooks);
// emu_launch hands them to the launch, which runs them: a launch of any other module runs none.
// `smem_store`: the launch tracks the generic stores to dynamic shared memory (emu_runtime.cpp finds
// them by write-protecting the block's buffer) and hands each, with the thread that made it, to the
// module (emu_ptx_sm90.h: the async proxy's view).
struct EmuHooks {
    void (*block_begin)(int threads) = nullptr;
    std::string (*block_end)() = nullptr;
    void (*tick)() = nullptr;
    void (*smem_store)(size_t offset, size_t bytes, int thread) = nullptr;
};
static EmuHooks emu_module_hooks;  // this build's (internal linkage: one per kernel module)
extern EmuHooks emu_hooks;         // the running launch's

inline void emu_yield(EmuState st, unsigned gen) {
    EmuFiber& me = emu_s->f[emu_s->cur];
    me.state = st; me.gen = gen;
    emu_ctx_switch(me.ctx, emu_s->main);
}
// Independent thread scheduling (Volta and later): the lanes of a warp are not in step between its
// synchronising points. A thread about to publish something (a fence.proxy.async, a plain
// mbarrier arrival: emu_ptx_sm90.h) steps aside first, so the scheduler may run other lanes in
// between.
inline void emu_interleave() { emu_yield(EMU_RUN, 0); }

// The stores the running thread made to tracked dynamic shared memory since it last switched out
// are handed to the module (EmuHooks::smem_store) before it synchronises, so they carry the epoch
// they were made in (emu_runtime.cpp).
extern int emu_smem_ndirty, emu_smem_nhot;  // pages that faulted since the last hand-off; writable ones
void emu_smem_flush(int thread);
inline void emu_hb_flush() {
    if (emu_smem_ndirty | emu_smem_nhot) emu_smem_flush(emu_s->cur);
}
inline void emu_block_arrive_check() {
    EmuSched& S = *emu_s;
    if (S.live > 0 && S.block_arrived == S.live) {
        S.block_arrived = 0;
        ++S.block_gen;
        S.red[S.block_gen % 3] = 0;  // the tally of the next barrier (its last readers passed this one)
        if (S.sources)               // __syncthreads: every live thread released, every one acquires
            for (size_t t = 0; t < S.f.size(); ++t)
                if (S.f[t].state != EMU_DONE) {
                    emu_hb_give(S, (int)t, S.floor);
                    S.f[t].kn.clear();
                }
    }
}
// A warp rendezvous completes when every live lane named in the mask has arrived (which lanes took
// part, for the exchanges: EmuWarp::xgen); they synchronise (emu_hb_meet).
inline void emu_warp_arrive_check(EmuWarp& w) {
    if (w.arrived > 0 && (w.arrived_mask & w.live_mask) == (w.mask & w.live_mask)) {
        if (emu_s->sources) {
            const int lo = 32 * (int)(&w - emu_s->warps.data());
            emu_hb_meet(*emu_s, lo, std::min(lo + 32, (int)emu_s->f.size()), w.arrived_mask & w.live_mask);
        }
        w.arrived = 0; w.arrived_mask = 0; ++w.gen;
    }
}
// ---- hook: block the current fiber until w.ready() (checked first, then by the scheduler).
inline void emu_wait_until(EmuWaitable& w) {
    if (w.ready()) return;
    EmuFiber& me = emu_s->f[emu_s->cur];
    me.waiting_on = &w;
    emu_yield(EMU_WAIT_COND, 0);
    me.waiting_on = nullptr;
}
// Hold the current thread back: it goes on only when no other thread of its block can (the held
// ones then go on one at a time, in an order the seed picks), so a thread that has just released
// a resource (an mbarrier arrival) lags while its block's other threads, the producer refilling
// that slot included, run as far as they can. A release-early bug then shows on every run, not by
// chance.
inline void emu_lag() {
    EmuSched& S = *emu_s;
    EmuFiber& me = S.f[S.cur];
    me.lag = 1;
    ++S.lagging;
    emu_yield(EMU_RUN, 0);
}
inline void __syncthreads() {
    emu_hb_flush();
    EmuSched& S = *emu_s;
    unsigned g = S.block_gen;
    ++S.block_arrived;
    emu_block_arrive_check();
    if (S.block_gen == g) emu_yield(EMU_WAIT_BLOCK, g);
}
inline std::string emu_site_name(long site, const char* what) {
    return site > 0 ? std::string(what) + " at source line " + std::to_string(site) : std::string(what);
}
// The lanes named in `mask` meet here. Each must be in its own mask, and all must meet at the same
// call site with the same mask (PTX ISA: .sync instructions by lanes outside the mask, or by
// lanes of one mask at different instructions, are undefined or hang).
inline void emu_warp_barrier(unsigned mask, long site, const char* what) {
    emu_hb_flush();
    EmuWarp& w = emu_s->warps[emu_warp];
    const unsigned bit = 1u << emu_lane;
    if (!(mask & bit)) {
        char m[16];
        std::snprintf(m, sizeof m, "0x%08x", mask);
        throw std::runtime_error(emu_site_name(site, what) + ": lane " + std::to_string(emu_lane) + " of warp " +
                                 std::to_string(emu_warp) + " is not in its own mask " + m);
    }
    if (w.arrived == 0) { w.mask = mask; w.site = site; w.what = what; }
    else if (w.mask != mask || w.site != site) {
        char m[40];
        std::snprintf(m, sizeof m, " (masks 0x%08x and 0x%08x)", w.mask, mask);
        throw std::runtime_error("lanes of warp " + std::to_string(emu_warp) + " meet at different warp-synchronous "
                                 "points: " + emu_site_name(w.site, w.what) + " and " + emu_site_name(site, what) + m);
    }
    const unsigned g = w.gen;
    ++w.arrived;
    w.arrived_mask |= bit;
    emu_warp_arrive_check(w);
    if (w.gen == g) emu_yield(EMU_WAIT_WARP, g);
}
// The exchange buffer (EmuWarp::xchg) of the rendezvous the calling lane is about to join, once
// no lane of the exchange that last used it has still to read it; the lane's part is tagged.
// After the meeting, each lane reads and calls emu_xchg_end. (xuser[b] is the rendezvous's
// generation from here until the last reader is done: the readers compare tags with it.)
struct EmuXchgFree : EmuWaitable {
    const EmuWarp* w; unsigned g;
    EmuXchgFree(const EmuWarp* w_, unsigned g_) : w(w_), g(g_) {}
    // free, or taken by a lane of the same rendezvous that waited here too
    bool ready() override { return w->xleft[g & 1] == 0 || w->xuser[g & 1] == g; }
    std::string what() const override { return "a warp exchange buffer that lanes two rendezvous back still read"; }
};
inline unsigned emu_xchg_begin(EmuWarp& w) {
    const unsigned g = w.gen, b = g & 1;
    EmuXchgFree free_(&w, g);
    emu_wait_until(free_);
    w.xuser[b] = g;
    ++w.xleft[b];
    w.xgen[b][emu_lane] = g;
    return b;
}
inline void emu_xchg_end(EmuWarp& w, unsigned b) { --w.xleft[b]; }
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
inline void __syncwarp(unsigned mask = 0xffffffffu, int line = __builtin_LINE()) {
    emu_warp_barrier(mask, line, "__syncwarp");
}
#include "emu_memory.h"  // global memory across blocks: views, fences, atomics

template <typename T> T emu_shfl(unsigned mask, T v, int kind, int arg, int width, int line) {
    static_assert(sizeof(T) <= 8, "shuffle of a type larger than 8 bytes");
    static const char* names[] = {"__shfl_xor_sync", "__shfl_sync", "__shfl_down_sync", "__shfl_up_sync"};
    if (width < 1 || width > 32 || (width & (width - 1)))
        throw std::runtime_error(emu_site_name(line, names[kind]) + ": width " + std::to_string(width) +
                                 " is not a power of 2 in [1, 32]");
    EmuWarp& w = emu_s->warps[emu_warp];
    const unsigned b = emu_xchg_begin(w);
    std::memcpy(w.xchg[b][emu_lane], &v, sizeof(T));
    emu_warp_barrier(mask, line, names[kind]);
    int base = emu_lane & ~(width - 1), lane = emu_lane - base, src = lane;
    if (kind == 0) src = lane ^ arg;                                   // xor
    else if (kind == 1) src = arg % width;                             // idx
    else if (kind == 2) src = lane + arg < width ? lane + arg : lane;  // down
    else src = lane - arg >= 0 ? lane - arg : lane;                    // up
    const int from = base + (src < width ? src : lane);
    T r;
    if (w.xgen[b][from] == w.xuser[b]) std::memcpy(&r, w.xchg[b][from], sizeof(T));
    else std::memset(&r, 0xFF, sizeof(T));  // a lane that did not take part: undefined, here poison
    emu_xchg_end(w, b);
    return r;
}
template <typename T> T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32, int line = __builtin_LINE()) {
    return emu_shfl(mask, v, 0, m, width, line);
}
template <typename T> T __shfl_sync(unsigned mask, T v, int s, int width = 32, int line = __builtin_LINE()) {
    return emu_shfl(mask, v, 1, s, width, line);
}
template <typename T> T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32, int line = __builtin_LINE()) {
    return emu_shfl(mask, v, 2, (int)d, width, line);
}
template <typename T> T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32, int line = __builtin_LINE()) {
    return emu_shfl(mask, v, 3, (int)d, width, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, int line = __builtin_LINE()) {
    EmuWarp& w = emu_s->warps[emu_warp];
    const unsigned b = emu_xchg_begin(w);
    w.xchg[b][emu_lane][0] = pred != 0;
    emu_warp_barrier(mask, line, "__ballot_sync");
    unsigned r = 0;
    for (int o = 0; o < 32; ++o) r |= (unsigned)(w.xgen[b][o] == w.xuser[b] && w.xchg[b][o][0]) << o;
    emu_xchg_end(w, b);
    return r;
}
inline int __any_sync(unsigned m, int p, int line = __builtin_LINE()) { return __ballot_sync(m, p, line) != 0; }
inline int __all_sync(unsigned m, int p, int line = __builtin_LINE()) { return (__ballot_sync(m, !p, line) & m) == 0; }

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
// Shared memory (the static arenas, the dynamic buffers) lives in the runtime library's .bss, so
// a 32-bit offset from one origin addresses all of it, as a .shared address does on the GPU. Each
// block in flight (slot) has its own: static `__shared__` variables are placed in the slot's arena
// (fakecupy turns each declaration into an emu_static_smem call), poisoned when a block starts.
constexpr size_t EMU_DYN_SMEM = 228 * 1024, EMU_STATIC_SMEM = 48 * 1024;
extern unsigned char emu_shared_origin[128];
extern unsigned char emu_dyn_smem_buf[EMU_MAX_SLOTS][EMU_DYN_SMEM];
extern unsigned char emu_static_smem_buf[EMU_MAX_SLOTS][EMU_STATIC_SMEM];
// The slot's copy of the static __shared__ variable `name` whose declaration owns `tag`.
void* emu_static_smem(const void* tag, size_t size, size_t align, const char* name);
// A shared address as the kernel's source names it: `name[i]` of a static __shared__ array of
// `elem`-byte elements, or a byte of the dynamic shared memory.
std::string emu_smem_name(unsigned addr, unsigned elem);
// A kernel's __launch_bounds__(max threads): fakecupy moves it to the kernel body's first
// statement, so every thread of a launch the driver would refuse stops before it does anything.
inline void emu_check_launch_bounds(long long max_threads) {
    const long long n = (long long)blockDim.x * blockDim.y * blockDim.z;
    if (n > max_threads)
        throw std::runtime_error("launch refused (CUDA_ERROR_INVALID_VALUE, as the driver refuses it): " +
                                 std::to_string(n) + " threads per block exceed the kernel's __launch_bounds__(" +
                                 std::to_string(max_threads) + ")");
}
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
    else if constexpr (std::is_class_v<A>) {  // a struct by value (TmaMap): i points at its bytes
        A v;
        std::memcpy(&v, reinterpret_cast<const void*>((uintptr_t)i), sizeof(A));
        return v;
    }
    else if constexpr (std::is_floating_point_v<A>) return (A)d;
    else return (A)i;
}
template <typename A> constexpr int emu_kind() {
    return std::is_pointer_v<A> ? 'p' : std::is_floating_point_v<A> ? 'f' : std::is_same_v<A, bool> ? 'b'
         : std::is_class_v<A> ? 's' : 'i';
}

template <typename... A, size_t... I>
void emu_call(void (*k)(A...), const long long* iv, const double* dv, std::index_sequence<I...>) {
    k(emu_arg<std::remove_cv_t<A>>(iv[I], dv[I])...);
}

// Blocks run 1 to EMU_START_SLOTS at a time (each with its own fibers, shared memory, Hopper state
// and view of global memory), their passes interleaved in a seeded order; blocks start in grid
// order, reversed, or shuffled. While every block in flight waits for another block (a counter
// that block has to signal), one more starts, up to `capacity` resident blocks (fakecupy: the
// emulated device's SMs, one block each); past it, the launch is a deadlock and says so.
// `regions`: (address, bytes) pairs of the global memory the memory model tracks (emu_memory.h);
// `paged`: their pages hold nothing else (found by mprotect, else by comparing them whole).
// The launch itself, for any kernel: `run(kernel)` runs one thread's kernel body (emu_launch below
// binds the kernel and its arguments). Not a template, and in the runtime library
// (emu_runtime.cpp): kernel builds do not compile the scheduler.
int emu_launch_erased(void (*run)(const void*), const void* kernel, dim3 g, dim3 b, size_t smem,
                      char* err, int errlen, unsigned long long seed, const unsigned long long* regions,
                      int nregions, int paged, int capacity, const EmuHooks& hooks);

template <typename... A>
int emu_launch(void (*k)(A...), dim3 g, dim3 b, size_t smem, const long long* iv, const double* dv,
               char* err, int errlen, unsigned long long seed, const unsigned long long* regions, int nregions,
               int paged, int capacity) {
    struct Bound { void (*k)(A...); const long long* iv; const double* dv; } bound{k, iv, dv};
    auto run = [](const void* p) {
        const Bound& c = *static_cast<const Bound*>(p);
        emu_call(c.k, c.iv, c.dv, std::index_sequence_for<A...>{});
    };
    return emu_launch_erased(run, &bound, g, b, smem, err, errlen, seed, regions, nregions, paged, capacity,
                             emu_module_hooks);
}

// Each parameter's kind, size, and (pointers) whether it points to const: fakecupy checks the
// arguments against them and takes the memory model's regions from the non-const pointers.
template <typename A> constexpr char emu_points_to_const() {
    if constexpr (std::is_pointer_v<A>) return std::is_const_v<std::remove_pointer_t<A>>;
    else return 0;
}
template <typename... A> int emu_params(void (*)(A...), char* kinds, int* sizes, char* consts) {
    const char k[] = {(char)emu_kind<std::remove_cv_t<A>>()..., 0};
    const int s[] = {(int)sizeof(A)..., 0};
    const char c[] = {emu_points_to_const<std::remove_cv_t<A>>()..., 0};
    for (size_t i = 0; i < sizeof...(A); ++i) { kinds[i] = k[i]; sizes[i] = s[i]; consts[i] = c[i]; }
    return (int)sizeof...(A);
}
