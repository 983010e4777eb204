// ptx.cuh: every inline PTX instruction the kernels use, each written once (sm_80+).
//
//   smem_u32(p)                          generic -> 32-bit .shared address
//   cp_async<B>(smem, gmem)              B = 4, 8 (.ca) or 16 (.cg, L1 bypass) bytes global -> shared
//   cp_async_zfill<B>(smem, gmem, n)     the same, reading only n <= B bytes and zero-filling the rest
//                                        (n = 0 reads nothing)
//   cp_async_commit(), cp_async_wait<N>() close a group; wait until at most N groups are pending
//   ldmatrix<N, TRANS>(r, smem)          N = 1, 2, 4 8x8 b16 matrices; lane l gives the address of
//                                        row l % 8 of matrix l / 8 (lanes 0-15 for N = 2, 0-7 for
//                                        N = 1); lane l receives in r[i] (row l/4, cols 2(l%4),
//                                        2(l%4)+1) of matrix i, or with TRANS (rows 2(l%4), 2(l%4)+1,
//                                        col l/4) of the matrix as addressed; low 16 bits first
//   mma_m16n8k16<T>(d, a, b)             d[16x8] += a[16x16] b[16x8], T = __half or __nv_bfloat16,
//                                        fp32 accumulators. Fragments (g = lane/4, t = lane%4):
//                                        a[0] (row g, k 2t..2t+1), a[1] (row g+8, k 2t..),
//                                        a[2] (row g, k 2t+8..), a[3] (row g+8, k 2t+8..);
//                                        b[0] (k 2t..2t+1, col g), b[1] (k 2t+8..2t+9, col g);
//                                        d[0..1] (row g, cols 2t, 2t+1), d[2..3] (row g+8, same)
//   pdl_wait(), pdl_launch_dependents()  programmatic dependent launch (sm_90+; no-ops below):
//                                        griddepcontrol.wait / .launch_dependents
//
// The CPU emulator of the GPU tests (tests/emu) replaces this whole header with a C++
// implementation of the same functions (tests/emu/emu_ptx.h); inline PTX anywhere else is
// refused there. Keep the two in step: tests/test_emulator.py checks each function against
// NumPy on the emulator, and the same test runs on a real GPU in the gpu tier.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// --- cp.async --------------------------------------------------------------------------------
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "n"(BYTES));
}

template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* smem, const void* gmem, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                     ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     ::"r"(smem_u32(smem)), "l"(gmem), "n"(BYTES), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// --- ldmatrix ----------------------------------------------------------------------------------
template <int NUM, bool TRANS = false>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[NUM], const void* smem) {
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

// --- mma.sync ----------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                            const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// --- programmatic dependent launch (griddepcontrol, sm_90+) -------------------------------------
// A kernel launched with the programmatic-stream-serialization attribute (cupyattn/_loader.py
// launch(..., pdl=True)) may start while the previous kernel in the stream still runs.
// pdl_wait() blocks until that kernel has completed and its memory is visible: nothing written by
// it may be read before. pdl_launch_dependents() lets the next kernel start early. Without the
// attribute both return at once, and before sm_90 they compile to nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
