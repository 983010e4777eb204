"""CPU tier: the CPU emulator's adversarial schedule (tests/emu/README.md) shows the races that
only a GPU's timing shows otherwise. Each racy kernel here must give a wrong result (or an error)
under at least one of a few seeds, its race-free twin the right result under every one of them;
the limits a GPU enforces (__launch_bounds__, shuffle masks and call sites) are refused; a seed
reproduces a schedule and is named in the error.

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = Path(__file__).resolve().parent  # the emulator beside its tests
SEEDS = 8  # launches per kernel, each under its own schedule

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

def module(src, *exprs):
    m = cupy.RawModule(code=_loader.inline_source(src), name_expressions=exprs)
    m.compile()
    return [m.get_function(e) for e in exprs]

def outcomes(kernel, grid, block, args, out, want):
    """How many of SEEDS launches (each its own schedule) wrote exactly `want`."""
    right = 0
    for _ in range(SEEDS):
        out[...] = np.nan
        try:
            kernel(grid, block, args)
        except RuntimeError:
            continue
        right += bool(np.array_equal(cupy.asnumpy(out), want))
    return right

def expect(fn, text):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        assert text in str(e), (text, str(e))
        return str(e)
    raise AssertionError("no error, expected: " + text)

SRC = r"""
#include "ptx.cuh"
// A two-stage cp.async ring over 64 threads: stage it % 2 holds tile it; every thread reads its
// neighbour's element. The refill of stage (it + 1) % 2 at the top of iteration it is safe only
// after the barrier that retires the readers of that stage (iteration it - 1's); without RETIRE
// that barrier is gone (a write-after-read race on any GPU).
template <bool RETIRE>
__global__ void ring(const float* x, float* y, int tiles) {
    __shared__ __align__(16) float s[2][64 * 4];
    const int t = threadIdx.x;
    cp_async<16>(&s[0][t * 4], x + t * 4);
    cp_async_commit();
    for (int it = 0; it < tiles; ++it) {
        if (it + 1 < tiles) cp_async<16>(&s[(it + 1) % 2][t * 4], x + (it + 1) * 256 + t * 4);
        cp_async_commit();
        cp_async_wait<1>();  // tile it has landed (all groups but the newest)
        __syncthreads();
        y[it * 64 + t] = s[it % 2][((t + 1) % 64) * 4];
        if (RETIRE) __syncthreads();
    }
    cp_async_wait<0>();
}
// Warp 0 fills a buffer, warp 1 reads it: without the barrier, only lockstep warps get it right.
template <bool BARRIER>
__global__ void handoff(float* y) {
    __shared__ float s[32];
    if (threadIdx.x < 32) s[threadIdx.x] = threadIdx.x + 1.0f;
    if (BARRIER) __syncthreads();
    if (threadIdx.x >= 32) y[threadIdx.x - 32] = s[threadIdx.x - 32];
}
// Each block adds its id to the previous block's output: assumes blocks run in grid order.
__global__ void chain(float* y) {
    if (threadIdx.x == 0) y[blockIdx.x] = (blockIdx.x ? y[blockIdx.x - 1] : 0.0f) + 1.0f;
}
// Block 0 clears the accumulator and every block uses it: static shared memory is per block and
// starts undefined (poisoned here), so only block 0 is right unless each block clears its own.
template <bool EACH_BLOCK>
__global__ void stale_static(float* y) {
    __shared__ float acc;
    if (threadIdx.x == 0 && (EACH_BLOCK || blockIdx.x == 0)) acc = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) { for (int i = 0; i < 4; ++i) acc += 1.0f; y[blockIdx.x] = acc; }
}
__global__ void __launch_bounds__(64) bounded(float* y) { y[threadIdx.x] = 1.0f; }
template <unsigned MASK>
__global__ void warp_sum(float* y) {
    float v = 1.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MASK, v, o);
    y[threadIdx.x] = v;
}
__global__ void two_sites(float* y) {  // half the warp shuffles at one line, half at another
    float v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else v = __shfl_xor_sync(0xffffffffu, v, 2);
    y[threadIdx.x] = v;
}
__global__ void half_warp(float* y) {  // a partial mask used as intended: only its lanes take part
    float v = 1.0f;
    if (threadIdx.x < 16) v += __shfl_xor_sync(0x0000ffffu, v, 1);
    y[threadIdx.x] = v;
}
// Half the warp goes on shuffling while the other half may not have read the last whole-warp
// shuffle yet: the emulator's exchange buffers (EmuWarp::xchg) must not hand it a newer value.
__global__ void relay(float* y) {
    float v = threadIdx.x;
    v = __shfl_xor_sync(0xffffffffu, v, 1);
    if (threadIdx.x < 16)
        for (int o = 1; o < 16; o <<= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
    y[threadIdx.x] = v;
}
"""
names = ("ring<false>", "ring<true>", "handoff<false>", "handoff<true>", "chain", "stale_static<false>",
         "stale_static<true>", "bounded", "warp_sum<0xffffffffu>", "warp_sum<0x0000ffffu>", "two_sites",
         "half_warp", "relay")
(ring_early, ring_ok, handoff_racy, handoff_ok, chain, stale, stale_ok, bounded, warp_full, warp_half,
 two_sites, half_warp, relay) = module(SRC, *names)

tiles = 6
x = cupy.asarray(np.arange(tiles * 256, dtype=np.float32))
y = cupy.empty(tiles * 64, dtype=np.float32)
want = np.concatenate([np.arange(it * 256, it * 256 + 256, dtype=np.float32)[((np.arange(64) + 1) % 64) * 4]
                       for it in range(tiles)])
assert outcomes(ring_ok, (1,), (64,), (x, y, np.int32(tiles)), y, want) == SEEDS, "race-free ring failed"
assert outcomes(ring_early, (1,), (64,), (x, y, np.int32(tiles)), y, want) < SEEDS, \
    "a ring refill before the barrier that retires its readers went unseen"

y = cupy.empty(32, dtype=np.float32)
want = np.arange(1, 33, dtype=np.float32)
assert outcomes(handoff_ok, (1,), (64,), (y,), y, want) == SEEDS
assert outcomes(handoff_racy, (1,), (64,), (y,), y, want) < SEEDS, "a missing barrier between warps went unseen"

y = cupy.empty(16, dtype=np.float32)
assert outcomes(chain, (16,), (32,), (y,), y, np.arange(1, 17, dtype=np.float32)) < SEEDS, \
    "a kernel that assumes block order went unseen"

y = cupy.empty(8, dtype=np.float32)
assert outcomes(stale_ok, (8,), (32,), (y,), y, np.full(8, 4.0, np.float32)) == SEEDS
assert outcomes(stale, (8,), (32,), (y,), y, np.full(8, 4.0, np.float32)) == 0, \
    "static shared memory must start undefined in every block"

# launch limits and warp-synchronous rules, refused before anything is written
y = cupy.empty(128, dtype=np.float32)
expect(lambda: bounded((1,), (128,), (y,)), "128 threads per block exceed the kernel's __launch_bounds__(64)")
assert np.isnan(cupy.asnumpy(y)).all(), "a refused launch wrote its output"
bounded((2,), (64,), (y,))
assert (cupy.asnumpy(y)[:64] == 1).all()
y = cupy.empty(32, dtype=np.float32)
warp_full((1,), (32,), (y,))
assert (cupy.asnumpy(y) == 32).all()
expect(lambda: warp_half((1,), (32,), (y,)), "is not in its own mask 0x0000ffff")
expect(lambda: two_sites((1,), (32,), (y,)), "meet at different warp-synchronous points")
half_warp((1,), (32,), (y,))
assert (cupy.asnumpy(y) == np.r_[np.full(16, 2.0), np.ones(16)]).all()
lane = np.arange(32)
v = (lane ^ 1).astype(np.float32)
for o in (1, 2, 4, 8):
    v[:16] = v[:16] + v[:16][lane[:16] ^ o]
assert outcomes(relay, (1,), (32,), (y,), y, v) == SEEDS, "a shuffle read another exchange's value"

# a seed reproduces a schedule, and an error names it
y = cupy.empty(tiles * 64, dtype=np.float32)
os.environ["CUPYATTN_EMU_SEED"] = "fixed"
runs = []
for _ in range(2):
    fakecupy.schedule.key = None  # launch 1 of the same base again
    y[...] = 0.0
    ring_early((1,), (64,), (x, y, np.int32(tiles)))
    runs.append(cupy.asnumpy(y).copy())
assert np.array_equal(runs[0], runs[1], equal_nan=True), "the same seed gave another schedule"
msg = expect(lambda: bounded((1,), (128,), (y,)), "schedule seed base 'fixed'")
assert "CUPYATTN_EMU_SEED" in msg
print("SCHEDULES-OK")
'''


def test_adversarial_schedules_show_races_and_refuse_what_a_gpu_refuses(tmp_path):
    script = tmp_path / "emu_schedules.py"
    script.write_text(SCRIPT.replace("{emu!r}", repr(str(EMU))).replace("{root!r}", repr(str(EMU.resolve().parent.parent))).replace("{seeds}", str(SEEDS)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "SCHEDULES-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
