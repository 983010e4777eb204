"""CPU tier: the CPU emulator of the GPU tier (tests/emu) catches what it claims to catch: out
of bounds writes, barrier deadlocks, wrong argument sizes, reads of a cp.async stage before its
wait, misaligned cp.async, inline PTX it does not emulate, and launches a GPU refuses. (Its PTX
functions are checked against NumPy by tests/cupyattn/test_ptx.py, on the emulator and on a GPU.)

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = Path(__file__).resolve().parent  # the emulator beside its tests

SCRIPT = r'''
import sys
sys.path.insert(0, {root!r})  # this checkout's cupyattn, whatever is installed
sys.path.insert(0, {emu!r})
import fakecupy
fakecupy.install()
import cupy
import numpy as np
from cupyattn import _loader

def module(src, *exprs):
    m = cupy.RawModule(code=src, name_expressions=exprs)
    m.compile()
    return [m.get_function(e) for e in exprs]

def expect(fn, text):
    try:
        fn()
    except (RuntimeError, TypeError, ValueError, cupy.cuda.compiler.CompileException) as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError("no error, expected: " + text)

SRC = r"""
#include <cuda_fp16.h>
__global__ void warp_sum(const float* x, float* y) {
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    y[threadIdx.x] = v;
}
__global__ void block_rev(const float* x, float* y, int n) {
    __shared__ float s[256];
    s[threadIdx.x] = x[blockIdx.x * n + threadIdx.x];
    __syncthreads();
    y[blockIdx.x * n + threadIdx.x] = s[n - 1 - threadIdx.x];
}
__global__ void oob(float* y, int n) { y[n] = 1.0f; }
// __syncthreads_count after plain barriers: each count is of its own barrier only (y = 128, 64)
__global__ void counts(int* y) {
    const int a = __syncthreads_count(1);
    __syncthreads();
    __syncthreads();
    const int b = __syncthreads_count(threadIdx.x % 2 == 0);
    if (threadIdx.x == 0) { y[0] = a; y[1] = b; }
}
__global__ void divergent(float* y) {  // half a warp at a block barrier, half in a shuffle
    float v = 1.0f;
    if (threadIdx.x < 16) __syncthreads(); else v = __shfl_xor_sync(0xffffffffu, v, 1);
    y[threadIdx.x] = v;
}
"""
ASM_SRC = """__global__ void raw_asm(float* y) { asm volatile("membar.gl;"); y[0] = 1.0f; }"""
# ptx.cuh kernels go through the loader's inlining, as the op modules' kernels do
PTX_SRC = _loader.inline_source(r"""
#include "ptx.cuh"
// reads its stage before waiting for the cp.async group: stale data on the emulator (and,
// timing permitting, on a GPU)
__global__ void no_wait(const float* x, float* y) {
    __shared__ __align__(16) float s[128];
    s[threadIdx.x * 4] = -1.0f;
    __syncthreads();
    cp_async<16>(s + threadIdx.x * 4, x + threadIdx.x * 4);
    cp_async_commit();
    __syncthreads();                       // a barrier is not a wait: the copy may be in flight
    y[threadIdx.x] = s[((threadIdx.x + 1) % 32) * 4];
    __syncthreads();
    cp_async_wait<0>();
}
__global__ void waits(const float* x, float* y) {
    __shared__ __align__(16) float s[128];
    cp_async<16>(s + threadIdx.x * 4, x + threadIdx.x * 4);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    y[threadIdx.x] = s[((threadIdx.x + 1) % 32) * 4];
}
__global__ void misaligned(const float* x, float* y) {
    __shared__ __align__(16) float s[128];
    cp_async<16>(s + 1, x);
    cp_async_commit();
    cp_async_wait<0>();
    y[0] = s[1];
}
""")
warp_sum, block_rev, oob, divergent, counts = module(SRC, "warp_sum", "block_rev", "oob", "divergent", "counts")
yc = cupy.zeros(2, dtype=np.int32)
counts((1,), (128,), (yc,))
assert cupy.asnumpy(yc).tolist() == [128, 64], cupy.asnumpy(yc)
x = cupy.asarray(np.arange(32, dtype=np.float32))
y = cupy.empty(32, dtype=np.float32)
warp_sum((1,), (32,), (x, y))
assert np.all(cupy.asnumpy(y) == 496.0)

x = cupy.asarray(np.random.default_rng(0).standard_normal((3, 97)).astype(np.float32))
y = cupy.empty((3, 97), dtype=np.float32)
block_rev((3,), (97,), (x, y, np.int32(97)))
assert np.array_equal(cupy.asnumpy(y), cupy.asnumpy(x)[:, ::-1])

expect(lambda: block_rev((3,), (97,), (x, y, 97)), "passed i64 but the kernel takes i32")
expect(lambda: oob((1,), (1,), (y, np.int32(y.size))), "wrote outside an allocation")
expect(lambda: divergent((1,), (32,), (y,)), "deadlock")

# inline PTX outside kernels_cu/ptx_insn.cuh is refused at build time, not silently mis-emulated
expect(lambda: module(ASM_SRC, "raw_asm"), "inline PTX outside kernels_cu/ptx_insn.cuh")

no_wait, waits, misaligned = module(PTX_SRC, "no_wait", "waits", "misaligned")
x = cupy.asarray(np.arange(128, dtype=np.float32))
y = cupy.empty(32, dtype=np.float32)
waits((1,), (32,), (x, y))
assert np.array_equal(cupy.asnumpy(y), (np.arange(32) + 1) % 32 * 4.0)
right = (np.arange(32) + 1) % 32 * 4.0
wrong = 0
for _ in range(8):  # each launch under another schedule: the copy lands at issue, later, or at the wait
    no_wait((1,), (32,), (x, y))
    wrong += not np.array_equal(cupy.asnumpy(y), right)
assert wrong > 0, "a read before cp.async.wait_group must not reliably see the copied data"
expect(lambda: misaligned((1,), (1,), (x, y)), "not aligned to 16 bytes")

# launches a GPU refuses
expect(lambda: warp_sum((1, 65536), (32,), (x, y)), "grid dimension y=65536 exceeds")
expect(lambda: warp_sum((0,), (32,), (x, y)), "empty or negative launch grid")
expect(lambda: warp_sum((1,), (1025,), (x, y)), "block dimension x=1025 exceeds")
expect(lambda: warp_sum((1,), (64, 32), (x, y)), "2048 threads per block exceed 1024")
expect(lambda: warp_sum((1,), (32,), (x, y), shared_mem=64 * 1024), "max_dynamic_shared_size_bytes raised")
warp_sum.max_dynamic_shared_size_bytes = 64 * 1024
warp_sum((1,), (32,), (x, y), shared_mem=64 * 1024)  # allowed once the attribute is raised
def too_much():
    warp_sum.max_dynamic_shared_size_bytes = 300 * 1024
expect(too_much, "opt-in limit")
print("EMULATOR-OK")
'''


def test_emulator_runs_kernels_and_catches_bugs(tmp_path):
    script = tmp_path / "emu_selftest.py"
    script.write_text(SCRIPT.replace("{emu!r}", repr(str(EMU))).replace("{root!r}", repr(str(EMU.resolve().parent.parent))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "EMULATOR-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
