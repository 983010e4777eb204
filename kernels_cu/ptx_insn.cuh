// ptx_insn.cuh: one wrapper per PTX instruction the kernels use, each refusing to compile for a
// target the PTX ISA does not allow it on. Kernels call ptx.cuh (the arch-aware helpers built on
// these), not this header.
//
//   wrapper                                  PTX instruction (ISA section)              target
//   smem_u32(p)                              cvta generic -> .shared                    any
//   globaltimer_ns()                         mov.u64 from %globaltimer (special regs.)  any
//   cp_async_sm80<B>(smem, gmem, n)          cp.async.{ca,cg}.shared.global (9.7.9.25)  sm_80+
//   cp_async_commit_sm80(), _wait_sm80<N>()  cp.async.commit_group / .wait_group        sm_80+
//   ldmatrix<N, TRANS>(r, smem)              ldmatrix.sync.aligned.m8n8 (9.7.14.5.15)   sm_75+
//   mma_m16n8k8<T>(d, a, b)                  mma.sync.aligned.m16n8k8.row.col (9.7.14)  f16 sm_75+,
//                                                                                       bf16 sm_80+
//   mma_m16n8k16_sm80<T>(d, a, b)            mma.sync.aligned.m16n8k16.row.col          sm_80+
//   griddepcontrol_wait(), _launch_dependents()  griddepcontrol (9.7.12.20)             sm_90+
//   signal_release(counter, inc)             red.release.gpu.global.add.u32             sm_70+
//   load_acquire(p) -> value                 ld.acquire.gpu.global.u32                  sm_70+
//   wait_acquire(counter, target, max_ns)    load_acquire poll (+ __nanosleep backoff)  sm_70+
//   atomic_add_relaxed(p, v) -> old          atom.relaxed.gpu.global.add.u32            sm_70+
//   atomic_add_acq_rel(p, v) -> old          atom.acq_rel.gpu.global.add.u32            sm_70+
//   fence_acq_rel_gpu()                      fence.acq_rel.gpu                          sm_70+
//
// PTX_SM is the target these wrappers check: __CUDA_ARCH__, or CUPYATTN_TARGET_SM when the loader
// compiles for an older family than the device's (CUPYATTN_ARCH, tests: a newer GPU runs the
// Turing branches of ptx.cuh). Each check is a static_assert that depends on a template parameter,
// so it fires only where a kernel instantiation actually uses the instruction: NVRTC then stops
// with "... requires sm_80 or higher" instead of ptxas' "Feature ... requires .target sm_80".
//
// The CPU emulator of the GPU tests (tests/emu) swaps this header for tests/emu/emu_ptx.h (the same
// functions from the ISA's definitions, with the same target checks); ptx.cuh stays as it is, so
// its Turing branches run there too. Inline PTX anywhere else is refused by the emulator.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(CUPYATTN_TARGET_SM)
#define PTX_SM CUPYATTN_TARGET_SM
#elif defined(__CUDA_ARCH__)
#define PTX_SM __CUDA_ARCH__
#else
#error "ptx_insn.cuh is device code: __CUDA_ARCH__ is not defined"
#endif

// true at instantiation time only: `static_assert(ptx_sm_at_least<800, X>(), ...)` with X a
// template parameter of the caller checks the target where the caller is instantiated
template <int NEED, typename Dep>
__device__ __forceinline__ constexpr bool ptx_sm_at_least() { return PTX_SM >= NEED && sizeof(Dep) > 0; }

// element type of a 16-bit mma (NVRTC has no <type_traits> without extra headers)
template <typename T> struct ptx_mma_type { enum { f16 = 0, bf16 = 0 }; };
template <> struct ptx_mma_type<__half> { enum { f16 = 1, bf16 = 0 }; };
template <> struct ptx_mma_type<__nv_bfloat16> { enum { f16 = 0, bf16 = 1 }; };

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// --- %globaltimer: nanoseconds of a global clock, the same on every SM (profiling only) -----------
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;\n" : "=l"(t));
    return t;
}

// --- cp.async (sm_80+) -------------------------------------------------------------------------
// B bytes global -> shared, reading only the first n <= B (the rest zero-filled; n = 0 reads
// nothing). 16 bytes go .cg (L1 bypass), 4 and 8 .ca (.cg takes 16 only).
template <int BYTES>
__device__ __forceinline__ void cp_async_sm80(void* smem, const void* gmem, int src_bytes) {
    static_assert(ptx_sm_at_least<800, char[BYTES]>(), "cp.async requires sm_80 or higher");
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     ::"r"(smem_u32(smem)), "l"(gmem), "n"(BYTES), "r"(src_bytes));
}

template <int DUMMY = 0>
__device__ __forceinline__ void cp_async_commit_sm80() {
    static_assert(ptx_sm_at_least<800, char[DUMMY + 1]>(), "cp.async.commit_group requires sm_80 or higher");
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void cp_async_wait_sm80() {
    static_assert(ptx_sm_at_least<800, char[N + 1]>(), "cp.async.wait_group requires sm_80 or higher");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// --- ldmatrix (sm_75+) -------------------------------------------------------------------------
template <int NUM, bool TRANS = false>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[NUM], const void* smem) {
    static_assert(ptx_sm_at_least<750, char[NUM]>(), "ldmatrix requires sm_75 or higher");
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
    const unsigned a = smem_u32(smem);
    if constexpr (NUM == 1 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else if constexpr (NUM == 1)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else if constexpr (NUM == 2 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (NUM == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// --- mma.sync, fp32 accumulators ---------------------------------------------------------------
// m16n8k8 (g = lane/4, t = lane%4): a[0] (row g, k 2t..2t+1), a[1] (row g+8, same k);
// b[0] (k 2t..2t+1, col g); d as m16n8k16. f16 from sm_75, bf16 from sm_80.
template <typename T>
__device__ __forceinline__ void mma_m16n8k8(float (&d)[4], const unsigned (&a)[2], const unsigned (&b)[1]) {
    static_assert(ptx_mma_type<T>::f16 || ptx_mma_type<T>::bf16, "mma: f16 or bf16 inputs");
    if constexpr (ptx_mma_type<T>::f16) {
        static_assert(ptx_sm_at_least<750, T>(), "mma.sync.m16n8k8.f16 requires sm_75 or higher");
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b[0]));
    } else {
        static_assert(ptx_sm_at_least<800, T>(), "mma.sync with bf16 inputs requires sm_80 or higher");
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b[0]));
    }
}

// m16n8k16: fragments as in ptx.cuh's table. sm_80+ for both input types.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16_sm80(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    static_assert(ptx_mma_type<T>::f16 || ptx_mma_type<T>::bf16, "mma: f16 or bf16 inputs");
    static_assert(ptx_sm_at_least<800, T>(), "mma.sync.m16n8k16 requires sm_80 or higher");
    if constexpr (ptx_mma_type<T>::f16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// --- griddepcontrol (sm_90+) -------------------------------------------------------------------
template <int DUMMY = 0>
__device__ __forceinline__ void griddepcontrol_wait() {
    static_assert(ptx_sm_at_least<900, char[DUMMY + 1]>(), "griddepcontrol requires sm_90 or higher");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

template <int DUMMY = 0>
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
    static_assert(ptx_sm_at_least<900, char[DUMMY + 1]>(), "griddepcontrol requires sm_90 or higher");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// --- counters between blocks: device-scope release / acquire (sm_70+) ----------------------------
// For kernels whose blocks wait on each other (persistent kernels, "last block" tickets): a
// producer block writes its data, then one thread (after a __syncthreads that orders the block's
// other stores before it) releases a counter; a consumer thread acquires it, then a __syncthreads
// hands the data to its block. PTX ISA, Memory Consistency Model:
//   - "Release and Acquire Patterns": a .release operation, or fence.acq_rel/fence.sc followed by
//     a strong write, is a release; a .acquire operation, or a strong read followed by
//     fence.acq_rel/fence.sc, is an acquire. When the acquire reads the value the release wrote
//     (or a later value of the same chain of atomic read-modify-writes), the release
//     synchronizes with it ("Memory synchronization"; "Causality order": cumulative, so it also
//     covers the stores other threads ordered before the release with bar.sync);
//   - "Scope": .gpu, so blocks on any SM take part; "Morally strong operations": the counter is
//     read and written only by these (strong, same scope) operations, never by plain ones;
//   - plain loads and stores (and __ldcg, ld.global.cg) are weak: they order nothing.
// wait_acquire's target compares modulo 2^32 ((int)(value - target) >= 0), so a counter that only
// grows may wrap. The CPU emulator (tests/emu/emu_ptx.h, emu_memory.h) models exactly this: a
// store another block has not released and this block has not acquired reads as poison there.
// Why these are the narrowest correct forms (a hand-off is on the critical path of every
// dependent instruction of a persistent kernel):
//   - release: one .release RMW at .gpu scope (ptxas: MEMBAR.GPU + RED.STRONG.GPU). The same
//     pattern from a fence (fence.acq_rel.gpu + a relaxed add) is the same membar; fence.sc and
//     .sys scope are wider; a plain (weak) store would not be a release at all.
//   - acquire: the poll itself is ld.acquire.gpu (LDG.STRONG.GPU + an L1 invalidation, CCTL.IVALL).
//     Polling relaxed and acquiring once after (a second ld.acquire, or fence.acq_rel) would move
//     the invalidation off the failing polls but add a dependent L2 trip after the successful one,
//     which is the trip every consumer waits for; one thread per counter polls, the others sleep
//     at the block barrier, so the failed polls' invalidations cost nothing the block needs (its
//     operands live in shared memory and registers, its L2 reads bypass L1).
//   - the sleep between polls: max_ns caps the backoff (32 ns doubling). A long cap oversleeps a
//     counter that arrives just after a poll by up to the cap (1024 ns: about half a microsecond
//     on average per hand-off); 0 polls without sleeping, costing L2 traffic one poll per L2
//     round trip per waiting block.
__device__ __forceinline__ void signal_release(unsigned* counter, unsigned inc) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(counter), "r"(inc) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Poll until *counter reaches target, sleeping 32 ns, 64 ns, ... up to max_ns between polls (0:
// no sleep); the backoff keeps long waits off the memory system.
__device__ __forceinline__ void wait_acquire(const unsigned* counter, unsigned target, unsigned max_ns = 1024u) {
    unsigned ns = max_ns < 32u ? max_ns : 32u;
    while ((int)(load_acquire(counter) - target) < 0) {
        if (ns != 0u) {
            __nanosleep(ns);
            ns = ns < max_ns / 2u ? 2u * ns : max_ns;
        }
    }
}

// A tile counter (relaxed: it hands out indices, it publishes no data); returns the old value.
__device__ __forceinline__ unsigned atomic_add_relaxed(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Release this thread's (and its block's, after a __syncthreads) stores and acquire what the
// counter's earlier adds released: a "last block" ticket in one instruction. Returns the old value.
__device__ __forceinline__ unsigned atomic_add_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
