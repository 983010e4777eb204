// sm90.cuh: building blocks of the Hopper kernels over ptx_sm90.cuh (plain C++, no inline PTX, so
// the CPU emulator runs this file as it is and checks it against its own PTX ISA decoding):
//   smem_desc(p, lbo, sbo, swizzle)   a wgmma shared-memory matrix descriptor (layouts: ptx_sm90.cuh)
//   mbar_wait(bar, parity)            block until the phase of that parity has completed
//   StageRing<STAGES>                 a producer/consumer ring of shared-memory stages over two
//                                     mbarriers per stage (full: the TMA bytes landed; empty: every
//                                     consumer is done with the slot) and a phase bit
#pragma once
#include "ptx_sm90.cuh"

// Swizzle field of a matrix descriptor (PTX ISA 9.7.15.5.1.2.2), and the width in bytes it swizzles.
enum SmemSwizzle { SWIZZLE_NONE = 0, SWIZZLE_128B = 1, SWIZZLE_64B = 2, SWIZZLE_32B = 3 };

// Descriptor of a matrix starting at shared address p (16-byte aligned); lbo / sbo in bytes
// (multiples of 16). Base offset 0: the swizzled buffers start on a pattern boundary (1 KB for 128 B).
__device__ __forceinline__ unsigned long long smem_desc(const void* p, unsigned lbo, unsigned sbo, SmemSwizzle sw) {
    const unsigned long long enc_start = (smem_u32(p) & 0x3FFFFu) >> 4;
    const unsigned long long enc_lbo = (lbo & 0x3FFFFu) >> 4, enc_sbo = (sbo & 0x3FFFFu) >> 4;
    return enc_start | (enc_lbo << 16) | (enc_sbo << 32) | ((unsigned long long)sw << 62);
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// The stage ring. Each side (producer, consumer) keeps its own copy of `stage` and `phase` and
// walks the slots in the same order. Phase parity: full[s] completes once per round, so in round r
// a consumer waits for parity r % 2; a producer first waits on empty[s] for parity (r % 2) ^ 1,
// which a fresh barrier reports as complete (its "previous" phase), so the first round needs no
// release.
//   producer: acquire(); commit(bytes); issue the TMA copies with full_bar(); advance()
//   consumer: wait(); read slot `stage`; release(stage) once every read of it has completed; advance()
template <int STAGES>
struct StageRing {
    unsigned long long* full;   // [STAGES] count 1: the producer's arrive.expect_tx + the TMA bytes
    unsigned long long* empty;  // [STAGES] count = consumers: one arrival each when done with a slot
    int stage = 0;
    unsigned phase = 0;

    __device__ StageRing(unsigned long long* full_bars, unsigned long long* empty_bars)
        : full(full_bars), empty(empty_bars) {}
    // One thread, before a __syncthreads that publishes the barriers to the block.
    __device__ void init(unsigned consumers) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], consumers);
        }
        mbar_fence_init();
    }
    __device__ unsigned long long* full_bar() { return &full[stage]; }
    __device__ void acquire() { mbar_wait(&empty[stage], phase ^ 1u); }
    __device__ void commit(unsigned bytes) { mbar_arrive_expect_tx(&full[stage], bytes); }
    __device__ void wait() { mbar_wait(&full[stage], phase); }
    __device__ void release(int s) { mbar_arrive(&empty[s]); }
    __device__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
        }
    }
};
