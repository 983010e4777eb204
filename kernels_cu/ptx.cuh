// ptx.cuh: the tensor-core and async-copy helpers every kernel calls, the same on each GPU family
// from Turing (sm_75) up; ptx_insn.cuh holds the PTX instructions they are built from.
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
//   last_block_ticket(counter, n)        whole block: whether it takes the last of n tickets on
//                                        *counter (atom.acq_rel.gpu); that block resets it to 0
//
// Per target (PTX ISA "Target ISA Notes" of each instruction; PTX_SM: see ptx_insn.cuh):
//   helper          sm_80+                         sm_75                          sm_70
//   cp_async*       cp.async                       ld.global + st.shared, now     as sm_75
//   commit / wait   cp.async.{commit,wait}_group   nothing to wait for: no-ops    as sm_75
//   ldmatrix        ldmatrix                       ldmatrix                       compile error
//   mma f16         m16n8k16                       two m16n8k8 (k 0-7, k 8-15)    compile error
//   mma bf16        m16n8k16                       compile error                  compile error
//   pdl_*           griddepcontrol from sm_90      no-ops                         no-ops
// A plain copy is one of the behaviours cp.async allows (its data may land any time between issue
// and the wait), so a kernel correct with cp.async is correct with it: readers still need the wait
// and the barrier after it, which stay in the kernels. The m16n8k8 fragments are the m16n8k16 ones
// split in k: a[0], a[1] and b[0] are the k 0-7 half, a[2], a[3] and b[1] the k 8-15 half, and
// both accumulate into the same d (fp32 sums in k order, as the emulator's model).
//
// The CPU emulator (tests/emu) swaps ptx_insn.cuh for its own C++ instructions and keeps this
// file, so these branches run there as written; tests/test_ptx.py checks every helper against
// NumPy, on the emulator (as sm_90 and as sm_75) and on a real GPU.
#pragma once
#include "ptx_insn.cuh"

// --- cp.async ----------------------------------------------------------------------------------
template <int BYTES> struct ptx_vec;   // one B-byte register value (the sm_75 copy's unit)
template <> struct ptx_vec<4> { using type = unsigned; };
template <> struct ptx_vec<8> { using type = uint2; };
template <> struct ptx_vec<16> { using type = uint4; };

template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(void* smem, const void* gmem, int src_bytes) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
#if PTX_SM >= 800
    cp_async_sm80<BYTES>(smem, gmem, src_bytes);
#else
    // the same bytes, synchronously: B-byte vector when whole, bytes then zeros when partial
    using V = typename ptx_vec<BYTES>::type;
    if (src_bytes >= BYTES) {
        *static_cast<V*>(smem) = *static_cast<const V*>(gmem);
    } else {
        unsigned char* d = static_cast<unsigned char*>(smem);
        const unsigned char* g = static_cast<const unsigned char*>(gmem);
        for (int i = 0; i < BYTES; ++i) d[i] = i < src_bytes ? g[i] : (unsigned char)0;
    }
#endif
}

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) { cp_async_zfill<BYTES>(smem, gmem, BYTES); }

__device__ __forceinline__ void cp_async_commit() {
#if PTX_SM >= 800
    cp_async_commit_sm80();
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if PTX_SM >= 800
    cp_async_wait_sm80<N>();
#endif
}

// --- mma.sync ----------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if PTX_SM >= 800
    mma_m16n8k16_sm80<T>(d, a, b);
#else
    static_assert(ptx_mma_type<T>::f16, "tensor-core bf16 (mma.sync .bf16) requires sm_80 or higher: "
                                        "bf16 inputs take the SIMT kernels below sm_80");
    const unsigned a_lo[2] = {a[0], a[1]}, a_hi[2] = {a[2], a[3]}, b_lo[1] = {b[0]}, b_hi[1] = {b[1]};
    mma_m16n8k8<T>(d, a_lo, b_lo);   // k 0-7
    mma_m16n8k8<T>(d, a_hi, b_hi);   // k 8-15
#endif
}

// --- programmatic dependent launch (griddepcontrol, sm_90+) -------------------------------------
// A kernel launched with the programmatic-stream-serialization attribute (cupyattn/_loader.py
// launch(..., pdl=True)) may start while the previous kernel in the stream still runs.
// pdl_wait() blocks until that kernel has completed and its memory is visible: nothing written by
// it may be read before. pdl_launch_dependents() lets the next kernel start early. Without the
// attribute both return at once, and before sm_90 they compile to nothing.
__device__ __forceinline__ void pdl_wait() {
#if PTX_SM >= 900
    griddepcontrol_wait();
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if PTX_SM >= 900
    griddepcontrol_launch_dependents();
#endif
}

// --- the last of n blocks (a ticket on a global counter) -------------------------------------------
// Whether this block takes the last of `n` tickets on *counter: the n blocks that each wrote one
// piece of a result (the split-KV combine, decode.cu) or read something the last one then changes
// (fused_decode.cu's lengths, megakernel.cu's end of step). The whole block calls it. Memory order
// (PTX ISA, "Memory Consistency Model"): the barrier orders every thread's earlier accesses before
// thread 0's atom.acq_rel.gpu (atomic_add_acq_rel, ptx_insn.cuh), whose release half publishes
// them. The tickets are one chain of RMWs, so the last ticket's acquire half synchronizes with
// every earlier ticket's release; the barrier after it orders the block's following accesses after
// that acquire. The last block resets the counter to 0 with a plain store for the next launch or
// graph replay (no other block of this launch touches it again; the kernel boundary publishes it).
__device__ __forceinline__ bool last_block_ticket(unsigned* counter, unsigned n) {
    __shared__ bool last;
    __syncthreads();  // every thread's earlier accesses precede the ticket's release
    if (threadIdx.x == 0) {
        last = atomic_add_acq_rel(counter, 1u) == n - 1u;
        if (last) *counter = 0u;
    }
    __syncthreads();  // the ticket's acquire precedes every thread's later accesses
    return last;
}
