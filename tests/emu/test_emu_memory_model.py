"""CPU tier: the CPU emulator's memory model (tests/emu/README.md, "The memory model").
Blocks that hand data to each other through global memory must release and acquire it as the
PTX ISA's memory consistency model says; a missing release, a missing acquire, a signal sent
before the data is written, a non-coherent load (__ldg) of another block's output fail here on
every run, whatever the schedule, and the right versions
pass under every schedule. Blocks that wait for each other run interleaved and start while
others wait, up to the device's resident blocks (CUPYATTN_EMU_SMS); past that the launch is a
deadlock that says so. The Hopper kernels' bug classes (a stage released before the wgmma
reading it retired, a missing fence.proxy.async) are checked on the real kernels by
tests/emu/test_emu_mutants.py.

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = Path(__file__).resolve().parent  # the emulator beside its tests
SEEDS = 6  # launches per kernel, each under its own schedule

SCRIPT = r'''
import os, sys
sys.path.insert(0, {root!r})  # this checkout's cupyattn, whatever is installed
sys.path.insert(0, {emu!r})
import fakecupy
fakecupy.install()
import cupy
import numpy as np
from cupyattn import _loader

SEEDS = {seeds}
SRC = r"""
#include "ptx.cuh"
// relay: block b waits for block b - 1's counter, reads its 32 values, writes them + 1 and
// signals its own counter; the grid's order is the schedule's (a block may start before the one
// it waits for). MODE 0: signal_release / wait_acquire; 1: the signal is a relaxed add (no
// release); 2: the wait is a relaxed spin (no acquire); 3: a relaxed spin, then fence.acq_rel
// (an acquire pattern); 4: fence.acq_rel, then a relaxed add (a release pattern); 5: the signal
// goes before the data is written; 6: as 0, but the data read with __ldg (ld.global.nc: another
// block's store of the launch may be a stale line there, acquired or not); 7: as 0, and each block
// reads back its own stores with __ldg (its own: right).
template <int MODE>
__global__ void relay(float* data, unsigned* ready) {
    const int b = blockIdx.x, t = threadIdx.x;
    float prev = 0.0f;
    if (b > 0) {
        if (t == 0) {
            if (MODE == 2 || MODE == 3) {
                while (atomic_add_relaxed(&ready[b - 1], 0u) < 1u) __nanosleep(32);
                if (MODE == 3) fence_acq_rel_gpu();
            } else {
                wait_acquire(&ready[b - 1], 1u);
            }
        }
        __syncthreads();
        prev = MODE == 6 ? __ldg(&data[(b - 1) * 32 + t]) : data[(b - 1) * 32 + t];
    }
    if (MODE == 5) {
        __syncthreads();
        if (t == 0) signal_release(&ready[b], 1u);
    }
    data[b * 32 + t] = prev + 1.0f;
    __syncthreads();
    if (MODE == 7) {
        const float mine = __ldg(&data[b * 32 + (t + 1) % 32]);
        __syncthreads();
        data[b * 32 + t] = mine;
        __syncthreads();
    }
    if (t == 0 && MODE == 1) atomic_add_relaxed(&ready[b], 1u);
    if (t == 0 && MODE == 4) { fence_acq_rel_gpu(); atomic_add_relaxed(&ready[b], 1u); }
    if (t == 0 && (MODE == 0 || MODE == 2 || MODE == 3 || MODE >= 6)) signal_release(&ready[b], 1u);
}
// ticket: every block writes its 32 values and takes a ticket; the last one sums all blocks'.
// MODE 0: __threadfence before the ticket and after it (decode.cu's combine); 1: none before (no
// release); 2: none after (no acquire); 3: the ticket is atomic_add_acq_rel, no fence.
template <int MODE>
__global__ void ticket(float* part, unsigned* count, float* total) {
    __shared__ bool last;
    part[blockIdx.x * 32 + threadIdx.x] = blockIdx.x + 1.0f;
    if (MODE == 0 || MODE == 2) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = (MODE == 3 ? atomic_add_acq_rel(count, 1u) : atomicAdd(count, 1u)) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (MODE == 0 || MODE == 1) __threadfence();
    float s = 0.0f;
    for (int b = 0; b < (int)gridDim.x; ++b) s += part[b * 32 + threadIdx.x];
    total[threadIdx.x] = s;
}
// Every block arrives, then waits for all: right only if the whole grid is resident at once.
__global__ void grid_barrier(unsigned* count, float* y) {
    if (threadIdx.x == 0) {
        signal_release(count, 1u);
        wait_acquire(count, gridDim.x);
    }
    __syncthreads();
    y[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}
// A counter helper on memory the launch passes only as const (so the model does not track it).
__global__ void untracked(const unsigned* c, float* y) {
    signal_release(const_cast<unsigned*>(c), 1u);
    y[threadIdx.x] = 1.0f;
}
"""
names = [f"relay<{m}>" for m in range(8)] + [f"ticket<{m}>" for m in range(4)] + ["grid_barrier", "untracked"]
mod = cupy.RawModule(code=_loader.inline_source(SRC), name_expressions=names)
k = {n: mod.get_function(n) for n in names}

def runs(name, grid, args, reset, check):
    """How many of SEEDS launches (each its own schedule) gave the right result."""
    right = 0
    for _ in range(SEEDS):
        reset()
        try:
            k[name]((grid,), (32,), args)
        except RuntimeError as e:
            assert "deadlock" not in str(e), str(e)
            continue
        right += bool(check())
    return right

n = 6
data, ready = cupy.empty(n * 32, dtype=np.float32), cupy.zeros(n, dtype=np.uint32)
def reset_relay():
    data[...] = np.nan
    ready[...] = 0
want = np.repeat(np.arange(1, n + 1, dtype=np.float32), 32)
relay = {m: runs(f"relay<{m}>", n, (data, ready), reset_relay, lambda: np.array_equal(cupy.asnumpy(data), want))
         for m in range(8)}
assert relay[0] == relay[3] == relay[4] == relay[7] == SEEDS, ("a right release/acquire failed", relay)
assert relay[1] == relay[2] == relay[5] == relay[6] == 0, \
    ("a missing release, a missing acquire, an early signal or a non-coherent load passed", relay)

part, count, total = cupy.empty(n * 32, dtype=np.float32), cupy.zeros(1, dtype=np.uint32), cupy.empty(32, dtype=np.float32)
def reset_ticket():
    part[...] = np.nan
    total[...] = np.nan
    count[...] = 0
ticket = {m: runs(f"ticket<{m}>", n, (part, count, total), reset_ticket,
                  lambda: (cupy.asnumpy(total) == n * (n + 1) / 2).all()) for m in range(4)}
assert ticket[0] == ticket[3] == SEEDS, ("a right ticket failed", ticket)
assert ticket[1] == ticket[2] == 0, ("a ticket without its release or acquire passed", ticket)

# co-residency: 4 blocks that wait for each other run on 4 SMs, and on 3 they are a deadlock
count, y = cupy.zeros(1, dtype=np.uint32), cupy.zeros(4 * 32, dtype=np.float32)
for sms in ("4", "3"):
    os.environ["CUPYATTN_EMU_SMS"] = sms
    for _ in range(3):
        count[...] = 0
        y[...] = 0
        try:
            k["grid_barrier"]((4,), (32,), (count, y))
            assert sms == "4" and (cupy.asnumpy(y) == 1).all()
        except RuntimeError as e:
            assert sms == "3", str(e)
            for text in ("deadlock: every block in flight waits", "wait_acquire: a counter holds 3, waits for 4",
                         "the grid's other 1 blocks cannot start", "holds 3 resident blocks", "CUPYATTN_EMU_SMS"):
                assert text in str(e), (text, str(e))
del os.environ["CUPYATTN_EMU_SMS"]
try:
    k["untracked"]((1,), (32,), (count, y))
    raise AssertionError("a counter outside the tracked arrays went unseen")
except RuntimeError as e:
    assert "not inside an array the launch passes as a non-const pointer argument" in str(e), str(e)
print("MEMORY-MODEL-OK")
'''


def test_release_acquire_between_blocks_and_co_residency(tmp_path):
    script = tmp_path / "emu_memory_model.py"
    script.write_text(SCRIPT.replace("{emu!r}", repr(str(EMU))).replace("{root!r}", repr(str(EMU.resolve().parent.parent))).replace("{seeds}", str(SEEDS)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "MEMORY-MODEL-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
