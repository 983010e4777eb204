"""kernels_cu/ptx_insn.cuh's counters between blocks: signal_release, wait_acquire,
load_acquire, atomic_add_relaxed, atomic_add_acq_rel, fence_acq_rel_gpu, used as a persistent
kernel uses them (GPU tier: on a real device this checks the PTX wrappers; on the CPU emulator
the twins in tests/emu/emu_ptx.h under its memory model, where a missing release or acquire
reads poison, tests/emu/test_emu_memory_model.py).

The kernel hands out tiles from a relaxed counter; tile t waits for tile t - 1's flag, adds to its
values and publishes its own; the last block to finish (an acq_rel ticket) sums every tile. The
expected values are closed forms, not the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupyattn import _loader

pytestmark = pytest.mark.gpu

SRC = r'''
#include "ptx.cuh"

// Blocks take tiles t = 0, 1, ... from `next` until `tiles` are gone. Tile t waits until tile
// t - 1 is published, reads its 32 values and writes vals[t] = vals[t - 1] + (t + 1), then publishes
// itself. Tiles go out in increasing order, so tile t - 1 belongs to a block already running: no
// block waits for one that has not started (the grid is a few blocks, all resident).
// FENCES false: signal_release / wait_acquire; true: the patterns the PTX ISA builds from a fence
// (fence.acq_rel then a relaxed add is a release; a relaxed read then fence.acq_rel an acquire).
// The last block to finish (an atomic_add_acq_rel ticket) writes total[l] = sum over t of
// vals[t][l], and total[32] = the ticket count load_acquire reads.
template <bool FENCES>
__global__ void chain(unsigned* next, unsigned* flags, float* vals, unsigned* done, float* total, int tiles) {
    __shared__ unsigned tile;
    __shared__ bool last;
    const int l = threadIdx.x;
    for (;;) {
        if (l == 0) tile = atomic_add_relaxed(next, 1u);
        __syncthreads();
        const unsigned t = tile;
        if (t >= (unsigned)tiles) break;
        if (l == 0 && t > 0) {
            if (FENCES) {
                while (atomic_add_relaxed(&flags[t - 1], 0u) == 0u) __nanosleep(64);
                fence_acq_rel_gpu();
            } else {
                wait_acquire(&flags[t - 1], 1u);
            }
        }
        __syncthreads();  // thread 0's acquire, then every thread's reads (bar.sync orders them)
        vals[t * 32 + l] = (t > 0 ? vals[(t - 1) * 32 + l] : 0.0f) + (float)(t + 1);
        __syncthreads();  // every thread's stores, then thread 0's release (cumulative through bar.sync)
        if (l == 0) {
            if (FENCES) {
                fence_acq_rel_gpu();
                atomic_add_relaxed(&flags[t], 1u);
            } else {
                signal_release(&flags[t], 1u);
            }
        }
    }
    if (l == 0) last = atomic_add_acq_rel(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    float s = 0.0f;
    for (int t = 0; t < tiles; ++t) s += vals[t * 32 + l];
    total[l] = s;
    if (l == 0) total[32] = (float)load_acquire(done);
}
'''


@pytest.fixture(scope="module")
def chain():
    import cupy

    exprs = ["chain<false>", "chain<true>"]
    mod = cupy.RawModule(code=_loader.inline_source(SRC), options=_loader.BASE_OPTIONS, name_expressions=exprs)
    return {e: mod.get_function(e) for e in exprs}


@pytest.mark.parametrize("fences", [False, True])
@pytest.mark.parametrize("grid, tiles", [(1, 5), (3, 13)])
def test_counters_chain_tiles_across_blocks(chain, fences, grid, tiles):
    import cupy

    t = np.arange(tiles, dtype=np.float64)
    want_vals = np.repeat(((t + 1) * (t + 2) / 2)[:, None], 32, axis=1)
    for _ in range(3):  # three launches: on the emulator, three schedules
        nxt, flags, done = (cupy.zeros(n, dtype=np.uint32) for n in (1, tiles, 1))
        vals, total = cupy.full(tiles * 32, np.nan, dtype=np.float32), cupy.full(33, np.nan, dtype=np.float32)
        chain[f"chain<{str(fences).lower()}>"]((grid,), (32,), (nxt, flags, vals, done, total, np.int32(tiles)))
        np.testing.assert_array_equal(cupy.asnumpy(vals).reshape(tiles, 32), want_vals)
        np.testing.assert_array_equal(cupy.asnumpy(total)[:32], want_vals.sum(axis=0))
        assert cupy.asnumpy(total)[32] == grid
        assert cupy.asnumpy(nxt)[0] == tiles + grid  # each block took one ticket past the end
        np.testing.assert_array_equal(cupy.asnumpy(flags), np.ones(tiles, dtype=np.uint32))
