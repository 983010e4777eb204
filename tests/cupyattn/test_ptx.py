"""kernels_cu/ptx.cuh, each function against NumPy (GPU tier: on a real device this checks the
PTX wrappers; on the CPU emulator it checks tests/emu/emu_ptx.h, which replaces ptx.cuh there,
against the same NumPy model of the PTX ISA, so the two are held to one definition).

The expected fragments are built here from the PTX ISA text ("Matrix Fragments for mma.m16n8k16
with floating point type", "Warp-level matrix load instruction: ldmatrix"), not from the code
under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import np_dtype
from cupyattn import _loader

pytestmark = pytest.mark.gpu

SRC = r'''
#include "common.cuh"
#include "ptx.cuh"

// out[32][4]: what lane l received in r[i] from ldmatrix<NUM, TRANS> on four 8x8 matrices of u16
// m (matrix i, row r, col c at m[(i * 8 + r) * 8 + c]); lane l addresses row l % 8 of matrix l / 8.
template <int NUM, bool TRANS>
__global__ void ldm(const unsigned short* m, unsigned* out) {
    __shared__ __align__(16) unsigned short s[4 * 64];
    const int l = threadIdx.x;
    for (int i = l; i < 4 * 64; i += 32) s[i] = m[i];
    __syncthreads();
    unsigned r[NUM];
    ldmatrix<NUM, TRANS>(r, s + ((l / 8) % NUM * 8 + l % 8) * 8);
    for (int i = 0; i < 4; ++i) out[l * 4 + i] = i < NUM ? r[i] : 0u;
}

// d[16x8] = a[16x16] b[16x8] + c, fragments loaded per the PTX ISA table (no ldmatrix).
template <typename T>
__global__ void mma(const T* a, const T* b, const float* c, float* d) {
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    auto pair = [](const T* p0, const T* p1) {
        return (unsigned)bits16(*p0) | ((unsigned)bits16(*p1) << 16);
    };
    const unsigned ra[4] = {pair(a + g * 16 + 2 * t, a + g * 16 + 2 * t + 1),
                            pair(a + (g + 8) * 16 + 2 * t, a + (g + 8) * 16 + 2 * t + 1),
                            pair(a + g * 16 + 2 * t + 8, a + g * 16 + 2 * t + 9),
                            pair(a + (g + 8) * 16 + 2 * t + 8, a + (g + 8) * 16 + 2 * t + 9)};
    const unsigned rb[2] = {pair(b + (2 * t) * 8 + g, b + (2 * t + 1) * 8 + g),
                            pair(b + (2 * t + 8) * 8 + g, b + (2 * t + 9) * 8 + g)};
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
    mma_m16n8k16<T>(acc, ra, rb);
    for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = acc[i];
}

// Each of 32 threads copies 16 bytes of src into shared memory in two groups (first half of the
// threads' chunks in group 0, then group 1) with cp.async<BYTES> pieces, waits for both, and
// writes shared memory back; zf threads use cp_async_zfill with src_bytes = nz (rest zero).
template <int BYTES>
__global__ void copy(const unsigned char* src, unsigned char* dst, int nz) {
    __shared__ __align__(16) unsigned char s[32 * 16];
    const int l = threadIdx.x;
    for (int i = l; i < 32 * 16; i += 32) s[i] = 0xAB;
    __syncthreads();
    for (int grp = 0; grp < 2; ++grp) {
        for (int o = grp * 8; o < grp * 8 + 8; o += BYTES < 8 ? BYTES : 8) {
            if (o % BYTES) continue;
            const int off = l * 16 + o;
            if (l % 2) cp_async_zfill<BYTES>(s + off, src + off, nz < BYTES ? nz : BYTES);
            else cp_async<BYTES>(s + off, src + off);
        }
        cp_async_commit();
    }
    cp_async_wait<1>();   // group 0 has landed (group 1 may still be in flight)
    cp_async_wait<0>();   // everything has landed
    __syncthreads();
    for (int i = l; i < 32 * 16; i += 32) dst[i] = s[i];
}
'''

EXPRS = [f"ldm<{n}, {t}>" for n in (1, 2, 4) for t in ("false", "true")] + \
    ["mma<__half>", "mma<__nv_bfloat16>", "copy<4>", "copy<8>", "copy<16>"]


def _cc() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


@pytest.fixture(scope="module")
def kernels():
    """Every helper the device has (no bf16 mma below sm_80: ptx.cuh refuses it at compile time).
    On sm_75 ptx.cuh's Turing branches run: plain copies for cp.async, two m16n8k8 per m16n8k16."""
    import cupy

    exprs = [e for e in EXPRS if _cc() >= 80 or e != "mma<__nv_bfloat16>"]
    mod = cupy.RawModule(code=_loader.inline_source(SRC), options=_loader.BASE_OPTIONS,
                         name_expressions=exprs)
    return {e: mod.get_function(e) for e in exprs}


def test_bf16_mma_does_not_compile_below_sm80():
    """A kernel that reaches the bf16 tensor-core helper fails to build for sm_75 (NVRTC's
    static_assert on a GPU, the same assert in the emulator), naming the minimum."""
    import cupy

    if _cc() >= 80:
        pytest.skip("the device has bf16 mma (sm_80+)")
    mod = cupy.RawModule(code=_loader.inline_source(SRC), options=_loader.BASE_OPTIONS,
                         name_expressions=["mma<__nv_bfloat16>"])
    with pytest.raises(Exception, match="requires sm_80 or higher"):
        mod.get_function("mma<__nv_bfloat16>")


def _expected_ldmatrix(m: np.ndarray, num: int, trans: bool) -> np.ndarray:
    """[32, 4] uint32: lane l, register i (PTX ISA: thread l holds row l // 4, elements
    2 (l % 4) and 2 (l % 4) + 1 of matrix i; .trans delivers the transposed matrix)."""
    out = np.zeros((32, 4), dtype=np.uint32)
    for l in range(32):
        for i in range(num):
            mat = m[i].T if trans else m[i]
            lo, hi = mat[l // 4, 2 * (l % 4)], mat[l // 4, 2 * (l % 4) + 1]
            out[l, i] = np.uint32(lo) | (np.uint32(hi) << 16)
    return out


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
def test_ldmatrix(kernels, num, trans):
    import cupy

    m = np.random.default_rng(num * 2 + trans).integers(0, 2**16, (4, 8, 8), dtype=np.uint16)
    out = cupy.full((32, 4), 0xFFFFFFFF, dtype=np.uint32)
    kernels[f"ldm<{num}, {'true' if trans else 'false'}>"]((1,), (32,), (cupy.asarray(m), out))
    np.testing.assert_array_equal(cupy.asnumpy(out), _expected_ldmatrix(m, num, trans))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_m16n8k16(kernels, dtype):
    import cupy

    if dtype == "bfloat16" and _cc() < 80:
        pytest.skip("bf16 mma needs sm_80 (test_bf16_mma_does_not_compile_below_sm80)")
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 16)).astype(np_dtype(dtype))
    b = rng.standard_normal((16, 8)).astype(np_dtype(dtype))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = cupy.full((16, 8), np.nan, dtype=np.float32)
    ct = "__half" if dtype == "float16" else "__nv_bfloat16"
    kernels[f"mma<{ct}>"]((1,), (32,), (cupy.asarray(a), cupy.asarray(b), cupy.asarray(c), d))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    # products of 16-bit inputs are exact in float32; 16 float32 additions round a little
    np.testing.assert_allclose(cupy.asnumpy(d), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nbytes", [4, 8, 16])
@pytest.mark.parametrize("nz", [0, 3, 16])
def test_cp_async_and_zero_fill(kernels, nbytes, nz):
    import cupy

    src = np.random.default_rng(nbytes).integers(1, 255, 32 * 16, dtype=np.uint8)
    dst = cupy.zeros(32 * 16, dtype=np.uint8)
    kernels[f"copy<{nbytes}>"]((1,), (32,), (cupy.asarray(src), dst, np.int32(nz)))
    want = src.copy().reshape(32, 16)
    keep = min(nz, nbytes)
    for lane in range(1, 32, 2):  # odd lanes copied only `keep` bytes of each piece, zero-filled
        for o in range(0, 16, nbytes):
            want[lane, o + keep:o + nbytes] = 0
    np.testing.assert_array_equal(cupy.asnumpy(dst).reshape(32, 16), want)
