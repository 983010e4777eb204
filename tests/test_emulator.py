"""CPU tier: the CPU emulator of the GPU tier (tests/emu) catches what it claims to catch.

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = Path(__file__).parent / "emu"

SCRIPT = r'''
import sys
sys.path.insert(0, {emu!r})
import fakecupy
fakecupy.install()
import cupy
import numpy as np

def module(src, *exprs):
    m = cupy.RawModule(code=src, name_expressions=exprs)
    m.compile()
    return [m.get_function(e) for e in exprs]

def expect(fn, text):
    try:
        fn()
    except (RuntimeError, TypeError) as e:
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
__global__ void divergent(float* y) {  // half a warp at a block barrier, half in a shuffle
    float v = 1.0f;
    if (threadIdx.x < 16) __syncthreads(); else v = __shfl_xor_sync(0xffffffffu, v, 1);
    y[threadIdx.x] = v;
}
// D[16x8] = A[16x16] B[16x8]: fragments loaded per the PTX ISA layout (g = lane/4, t = lane%4)
__global__ void mma(const __half* a, const __half* b, float* d) {
    int l = threadIdx.x, g = l / 4, t = l % 4;
    __shared__ __half sa[16 * 16], sbt[8 * 16];  // A row-major; B stored as B^T (col-major B)
    for (int i = l; i < 256; i += 32) sa[i] = a[i];
    for (int i = l; i < 128; i += 32) sbt[i] = b[(i % 16) * 8 + i / 16];
    __syncthreads();
    unsigned ra[4], rb[2];
    // ldmatrix x4 of A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
    const __half* p = sa + (l % 8 + 8 * ((l / 8) % 2)) * 16 + 8 * (l / 16);
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(ra[0]), "=r"(ra[1]), "=r"(ra[2]), "=r"(ra[3]) : "r"(addr));
    rb[0] = *(const unsigned*)(sbt + g * 16 + 2 * t);
    rb[1] = *(const unsigned*)(sbt + g * 16 + 2 * t + 8);
    float c[4] = {0, 0, 0, 0};
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb[0]), "r"(rb[1]));
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = c[i];
}
"""
warp_sum, block_rev, oob, divergent, mma = module(SRC, "warp_sum", "block_rev", "oob", "divergent", "mma")
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

rng = np.random.default_rng(1)
a, b = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)
d = cupy.empty((16, 8), dtype=np.float32)
mma((1,), (32,), (cupy.asarray(a), cupy.asarray(b), d))
np.testing.assert_allclose(cupy.asnumpy(d), a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
print("EMULATOR-OK")
'''


def test_emulator_runs_kernels_and_catches_bugs(tmp_path):
    script = tmp_path / "emu_selftest.py"
    script.write_text(SCRIPT.replace("{emu!r}", repr(str(EMU))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "EMULATOR-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
