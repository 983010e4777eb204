// ptx_sm90.cuh: every Hopper (sm_90a) instruction the kernels use, each written once, with its
// operand layout and the PTX ISA section it comes from. Kernels that include it compile only for
// sm_90a (KernelSpec(sm90a=True)); sm_90a code runs on H100/H200 only.
//
//   TmaMap                                   the 128-byte CUtensorMap, passed to a kernel by value
//                                            as `const __grid_constant__ TmaMap` (cupyattn/tma.py)
// mbarrier (9.7.13.15): a 64-bit object in shared memory with an expected arrival count, a pending
// count, a transaction byte count (tx-count) and a phase bit. A phase completes when the pending
// arrivals reach 0 and tx-count is 0; then the phase flips and pending is reset to the count.
//   mbar_init(bar, count)                    count = arrivals that complete a phase
//   mbar_fence_init()                        make inits visible to the async proxy (TMA), before
//                                            the __syncthreads that publishes them
//   mbar_arrive(bar)                         one arrival
//   mbar_arrive_expect_tx(bar, bytes)        tx-count += bytes, then one arrival (the producer,
//                                            before issuing the TMA copies that complete_tx them)
//   mbar_try_wait(bar, parity) -> bool       true once the phase of parity `parity` has completed
//                                            (the current phase has the other parity); may block
//                                            for a while first (try_wait, not test_wait)
// Tensor copies (9.7.9.25.5, cp.async.bulk.tensor), coordinates innermost first, in elements:
//   tma_load<R>(dst, map, bar, {c0..})       box of `map` at c -> shared dst (128-byte aligned),
//                                            out-of-bounds elements zero-filled, written in the
//                                            map's swizzle; complete_tx(box bytes) on bar. R = 2..5
//   tma_store<R>(map, src, {c0..})           shared src -> the box at c (out-of-bounds skipped)
//   Both: c0 * element size must be a multiple of 16 bytes (at 100 and 120 bytes the H100 stopped
//   with an illegal instruction, 2026-11-26); the kernels' c0 are multiples of 64 elements.
//   bulk_commit_group(), bulk_wait_group_read<N>(), bulk_wait_group<N>()   store groups: wait until
//                                            at most N are pending (.read: their sources were read)
//   fence_proxy_async_shared()               generic-proxy shared writes (st.shared, stmatrix)
//                                            become visible to the async proxy (TMA store, wgmma)
// Warpgroup MMA (9.7.15): 128 threads (4 consecutive warps, first warp a multiple of 4) issue it
// together. D [64 x N] fp32 += A [64 x 16] B [16 x N]. The accumulator fragment (9.7.15.5.1.1.1):
// warp w of the warpgroup holds rows 16w..16w+15; with g = lane/4, t = lane%4, register
// d[4j + i] (j < N/8) holds row 16w + g + 8 (i/2), column 8j + 2t + (i%2).
// A from registers (RS): 4 registers of two 16-bit values, as mma.m16n8k16's A per warp:
// a[0] (row g, k 2t..2t+1), a[1] (row g+8, same k), a[2] (row g, k 2t+8..), a[3] (row g+8, k 2t+8..)
// of the warp's 16 rows. A and B from shared memory through 64-bit matrix descriptors
// (9.7.15.5.1.2.2, encoded by smem_desc in sm90.cuh): bits 0-13 start address >> 4, 16-29 leading
// byte offset (LBO) >> 4, 32-45 stride byte offset (SBO) >> 4, 49-51 base offset, 62-63 swizzle
// (0 none, 1 128 B, 2 64 B, 3 32 B). Layouts (9.7.15.5.1.2, "swizzle atoms" of 8 rows x W bytes,
// W = swizzle width, 16 for none; addresses before the swizzle, in bytes):
//   K-major (TRANS = 0): (mn, k) at start + (mn%8) W + (mn/8) SBO + (kB/W) LBO + kB%W, kB = k * 2
//                        (swizzled modes: one k16 step is 32 B of a row; LBO unused)
//   MN-major (TRANS = 1), swizzled: (mn, k) at start + (k%8) W + (k/8) SBO + (mB/W) LBO + mB%W
//                        mB = mn * 2; no swizzle: start + (k%8) 16 + (k/8) LBO + (mB/16) SBO + mB%16
// The swizzle XORs address bits [4, 4+b) with bits [7, 7+b), b = log2(W/16): for 128 B, the 16-byte
// chunk (bits 4-6) of a 128-byte row with the row's index mod 8 (bits 7-9), repeating every 1 KB.
// It acts on the shared address itself, as TMA's does, so a TMA box written with the same mode
// at a 1 KB-aligned address is read back in order (base offset 0).
//   wgmma_fence()                            before the first wgmma that reads registers written
//                                            by other instructions (accumulators, A fragments)
//   wgmma_ss<T, N, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d)  A, B in shared memory
//   wgmma_rs<T, N, TRANS_B>(d, a, desc_b, scale_d)                A in registers
//                                            scale_d = 0: D = A B (d is not read), 1: D += A B.
//                                            T = __half or __nv_bfloat16; N = 16, 32, 64, 128, 176, 256
//   wgmma_commit_group(), wgmma_wait_group<N>()  close a group; wait until at most N groups are
//                                            pending. d and a must not be touched in between.
//   wgmma_fence_acc(d)                       compiler-only: d is read and written here, so its
//                                            uses are not moved across a wgmma_wait_group
//   wgmma_fence_frag(a)                      compiler-only, for RS A fragments a[R][4]: they stay
//                                            live (unchanged) up to here, after the wait_group that
//                                            retires the wgmma reading them
//   keep_before(x)                           scheduling only: x is computed before this point
//                                            (and before a wgmma_wait_group that follows it)
// Others:
//   setmaxnreg_inc<R>(), setmaxnreg_dec<R>() (9.7.19.6) a warpgroup's per-thread register budget;
//                                            needs __launch_bounds__(threads, 1) (else ptxas
//                                            warns C7508 and ignores it); R in 24..256, step 8
//   stmatrix<NUM, TRANS>(smem, r)            (9.7.14.5.16) the inverse of ldmatrix: lane l gives
//                                            the address of row l % 8 of matrix l / 8 and holds
//                                            (row l/4, cols 2(l%4), 2(l%4)+1) of matrix i in r[i]
//   named_bar_sync(id, n), named_bar_arrive(id, n)   (9.7.13.1, bar.sync / bar.arrive) barrier
//                                            `id` (1..15; 0 is __syncthreads') completes when n
//                                            threads (a multiple of 32) have arrived; sync waits
//                                            for that, arrive does not (a producer / consumer
//                                            hand-off between warpgroups)
//
// The CPU emulator of the GPU tests replaces this whole header with tests/emu/emu_ptx_sm90.h (the
// same functions from the PTX ISA's definitions); tests/test_ptx_sm90.py checks each against NumPy,
// on the emulator and on a GPU.
#pragma once
#include "ptx.cuh"

struct alignas(64) TmaMap { unsigned long long opaque[16]; };  // CUtensorMap (cuda.h)

// --- mbarrier --------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n"
                 ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}

// --- tensor copies (TMA) ------------------------------------------------------------------------
template <int R>
__device__ __forceinline__ void tma_load(void* dst, const TmaMap* map, unsigned long long* bar, const int (&c)[R]) {
    static_assert(R >= 2 && R <= 5, "tma_load: 2 to 5 dimensions");
    const unsigned d = smem_u32(dst), b = smem_u32(bar);
    if constexpr (R == 2)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];\n"
                     ::"r"(d), "l"(map), "r"(c[0]), "r"(c[1]), "r"(b) : "memory");
    else if constexpr (R == 3)
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4}], [%5];\n"
                     ::"r"(d), "l"(map), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(b) : "memory");
    else if constexpr (R == 4)
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                     ::"r"(d), "l"(map), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(b) : "memory");
    else
        asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                     ::"r"(d), "l"(map), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]), "r"(b)
                     : "memory");
}

template <int R>
__device__ __forceinline__ void tma_store(const TmaMap* map, const void* src, const int (&c)[R]) {
    static_assert(R >= 2 && R <= 5, "tma_store: 2 to 5 dimensions");
    const unsigned s = smem_u32(src);
    if constexpr (R == 2)
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
                     ::"l"(map), "r"(s), "r"(c[0]), "r"(c[1]) : "memory");
    else if constexpr (R == 3)
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                     ::"l"(map), "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2]) : "memory");
    else if constexpr (R == 4)
        asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                     ::"l"(map), "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]) : "memory");
    else
        asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                     ::"l"(map), "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]) : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_group() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// --- warpgroup MMA ------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void wgmma_fence_frag(unsigned (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// A branch on x that ptxas cannot remove (x is never the signalling NaN 0x7f800001: arithmetic only
// makes quiet NaNs, so the trap never runs): whatever computes x stays ahead of it, and so ahead of
// a wgmma_wait_group placed after it, which ptxas otherwise hoists into the first latency gap it
// finds (it treats the wait as free to move up). fa3_key_step keeps the softmax's exp2s before the
// P V wait with it.
__device__ __forceinline__ void keep_before(float x) {
    if (__float_as_uint(x) == 0x7f800001u) asm volatile("trap;\n");
}

// Operand lists: the N/2 accumulators are %0 .. %(N/2 - 1), eight at a time.
#define WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define WG_R1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define WG_R3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define WG_R5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define WG_R6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define WG_R7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define WG_R9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define WG_R10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define WG_R11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define WG_R12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define WG_R13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define WG_R14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define WG_R15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define WG_D16 "{" WG_R0 "}"
#define WG_D32 "{" WG_R0 ", " WG_R1 "}"
#define WG_D64 "{" WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 "}"
#define WG_D128 "{" WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5 ", " WG_R6 ", " WG_R7 "}"
#define WG_D176 "{" WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5 ", " WG_R6 ", " WG_R7 ", " \
    WG_R8 ", " WG_R9 ", " WG_R10 "}"
#define WG_D256 "{" WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5 ", " WG_R6 ", " WG_R7 ", " \
    WG_R8 ", " WG_R9 ", " WG_R10 ", " WG_R11 ", " WG_R12 ", " WG_R13 ", " WG_R14 ", " WG_R15 "}"
#define WG_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_F16 WG_F8(0)
#define WG_F32 WG_F8(0), WG_F8(8)
#define WG_F64 WG_F32, WG_F8(16), WG_F8(24)
#define WG_F128 WG_F64, WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56)
#define WG_F176 WG_F128, WG_F8(64), WG_F8(72), WG_F8(80)
#define WG_F256 WG_F128, WG_F8(64), WG_F8(72), WG_F8(80), WG_F8(88), WG_F8(96), WG_F8(104), WG_F8(112), WG_F8(120)

template <typename T> struct WgmmaType;
template <> struct WgmmaType<__half> { static constexpr bool bf16 = false; };
template <> struct WgmmaType<__nv_bfloat16> { static constexpr bool bf16 = true; };

// One function per N: X is the first operand index after the accumulators (N/2), as a string.
// SS operands: d..., desc_a (%X), desc_b, scale_d, trans_a, trans_b. RS: d..., a0..a3 (%X),
// desc_b, scale_d, trans_b. scale-a and scale-b are 1 (no negation).
#define WG_SS(TY, N, X, XB, XS, XTA, XTB)                                                         \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" XS ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
    "." TY " " WG_D##N ", %" X ", %" XB ", p, 1, 1, %" XTA ", %" XTB ";\n}\n"
#define WG_RS(TY, N, X, X1, X2, X3, XB, XS, XTB)                                                   \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" XS ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
    "." TY " " WG_D##N ", {%" X ", %" X1 ", %" X2 ", %" X3 "}, %" XB ", p, 1, 1, %" XTB ";\n}\n"
#define WG_DEFINE_N(N, X, X1, X2, X3, X4, X5, X6)                                                  \
    template <typename T, int TA, int TB>                                                         \
    __device__ __forceinline__ void wgmma_ss_n##N(float (&d)[N / 2], unsigned long long da,        \
                                                  unsigned long long db, int scale_d) {           \
        if constexpr (WgmmaType<T>::bf16)                                                         \
            asm volatile(WG_SS("bf16", N, X, X1, X2, X3, X4)                                      \
                         : WG_F##N : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB) : "memory"); \
        else                                                                                       \
            asm volatile(WG_SS("f16", N, X, X1, X2, X3, X4)                                       \
                         : WG_F##N : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB) : "memory"); \
    }                                                                                              \
    template <typename T, int TB>                                                                  \
    __device__ __forceinline__ void wgmma_rs_n##N(float (&d)[N / 2], const unsigned (&a)[4],      \
                                                  unsigned long long db, int scale_d) {           \
        if constexpr (WgmmaType<T>::bf16)                                                         \
            asm volatile(WG_RS("bf16", N, X, X1, X2, X3, X4, X5, X6)                              \
                         : WG_F##N : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db),          \
                           "r"(scale_d), "n"(TB) : "memory");                                      \
        else                                                                                       \
            asm volatile(WG_RS("f16", N, X, X1, X2, X3, X4, X5, X6)                               \
                         : WG_F##N : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db),          \
                           "r"(scale_d), "n"(TB) : "memory");                                      \
    }
WG_DEFINE_N(16, "8", "9", "10", "11", "12", "13", "14")
WG_DEFINE_N(32, "16", "17", "18", "19", "20", "21", "22")
WG_DEFINE_N(64, "32", "33", "34", "35", "36", "37", "38")
WG_DEFINE_N(128, "64", "65", "66", "67", "68", "69", "70")
WG_DEFINE_N(176, "88", "89", "90", "91", "92", "93", "94")
WG_DEFINE_N(256, "128", "129", "130", "131", "132", "133", "134")

template <typename T, int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long desc_a, unsigned long long desc_b,
                                         int scale_d) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128 || N == 176 || N == 256,
                  "wgmma_ss: N = 16, 32, 64, 128, 176 or 256");
    if constexpr (N == 16) wgmma_ss_n16<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 32) wgmma_ss_n32<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 64) wgmma_ss_n64<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 128) wgmma_ss_n128<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 176) wgmma_ss_n176<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else wgmma_ss_n256<T, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
}

template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc_b,
                                         int scale_d) {
    static_assert(N == 16 || N == 32 || N == 64 || N == 128 || N == 176 || N == 256,
                  "wgmma_rs: N = 16, 32, 64, 128, 176 or 256");
    if constexpr (N == 16) wgmma_rs_n16<T, TRANS_B>(d, a, desc_b, scale_d);
    else if constexpr (N == 32) wgmma_rs_n32<T, TRANS_B>(d, a, desc_b, scale_d);
    else if constexpr (N == 64) wgmma_rs_n64<T, TRANS_B>(d, a, desc_b, scale_d);
    else if constexpr (N == 128) wgmma_rs_n128<T, TRANS_B>(d, a, desc_b, scale_d);
    else if constexpr (N == 176) wgmma_rs_n176<T, TRANS_B>(d, a, desc_b, scale_d);
    else wgmma_rs_n256<T, TRANS_B>(d, a, desc_b, scale_d);
}

// --- registers, stmatrix ------------------------------------------------------------------------
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 in steps of 8");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int NUM, bool TRANS = false>
__device__ __forceinline__ void stmatrix(void* smem, const unsigned (&r)[NUM]) {
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "stmatrix stores 1, 2 or 4 matrices");
    const unsigned a = smem_u32(smem);
    if constexpr (NUM == 1 && !TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" ::"r"(a), "r"(r[0]) : "memory");
    else if constexpr (NUM == 1)
        asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};\n" ::"r"(a), "r"(r[0]) : "memory");
    else if constexpr (NUM == 2 && !TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n"
                     ::"r"(a), "r"(r[0]), "r"(r[1]) : "memory");
    else if constexpr (NUM == 2)
        asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n"
                     ::"r"(a), "r"(r[0]), "r"(r[1]) : "memory");
    else if constexpr (!TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
