"""layers (rmsnorm, rope, swiglu, add, embedding): CPU tier (argument checks, reference sanity,
the rope angle scheme, compile check, and layers.cu itself run on the host under a thread
emulation of CUDA, driven by the real Python dispatch with NumPy arrays in place of CuPy ones)
and GPU tier (every op against the float64 reference)."""
import ctypes
import hashlib
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import DTYPES, TOL, assert_close, nan_like, np_dtype, rand_with_outliers, to_device, to_host
from cupyattn import _checks, _loader
from cupyattn import layers as L
from cupyattn import reference as ref


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def _positions(rng, b, t, maxpos=32767):
    pos = rng.integers(0, maxpos + 1, size=(b, t))
    pos.reshape(-1)[0] = maxpos  # the largest position is always present
    return pos


# --- CPU: references ---------------------------------------------------------------------------
@pytest.mark.parametrize("d", [2, 8, 64])
def test_reference_rope_adjacent_is_permuted_neox(rng, d):
    """adjacent rope of x == re-interleave(neox rope of de-interleave(x)): one rotation, two layouts."""
    x = rng.standard_normal((2, 3, 5, d))
    pos = _positions(rng, 2, 5)
    deint = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # x[2i] -> i, x[2i+1] -> i + D/2
    inv = np.argsort(deint)
    got = ref.rope(x[..., deint], pos, base=1e5, style="neox")[..., inv]
    np.testing.assert_allclose(ref.rope(x, pos, base=1e5, style="adjacent"), got, rtol=1e-12, atol=1e-12)
    # a rotation keeps each pair's length; position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(ref.rope(x, pos), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(ref.rope(x, np.zeros((2, 5), np.int64), style="neox"), x)


def test_rope_angle_scheme_is_accurate_at_large_positions():
    """NumPy model of rope_kernel's angle: double pos*inv_freq, reduced mod 2pi in double, then
    a/pi rounded to float. A float32 angle (powf inv_freq, float product) would miss fp32 tolerance."""
    d, base = 64, 1e5
    pos = np.arange(32000, 32768, dtype=np.float64)[:, None]
    i = np.arange(d // 2)
    want = pos * base ** (-2.0 * i / d)
    inv = np.exp2(i * (-math.log2(base) / (d // 2)))  # the kernel's exp2(i * freq_scale)
    a = pos * inv
    k = np.rint(a * (0.5 / math.pi))
    a = a - k * 2 * math.pi
    got = np.float64(np.float32(a / math.pi)) * math.pi
    f32 = np.float32(pos) * np.power(np.float32(base), np.float32(-2.0 * i / d))

    def rot_err(ang):
        return np.sqrt((np.abs(np.exp(1j * ang) - np.exp(1j * want)) ** 2).mean())

    assert rot_err(got) < 1e-6
    assert rot_err(f32.astype(np.float64)) > TOL["float32"]


# --- CPU: argument checks ----------------------------------------------------------------------
def test_rejects_host_arrays():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match=r"rmsnorm\(\): x must be a cupy.ndarray"):
        L.rmsnorm(x, np.ones(8, np.float32))
    with pytest.raises(TypeError, match=r"rope\(\): x must be a cupy.ndarray"):
        L.rope(np.zeros((1, 1, 2, 8), np.float32), np.zeros((1, 2), np.int32))
    with pytest.raises(TypeError, match=r"swiglu\(\): gate must be a cupy.ndarray"):
        L.swiglu(x, x)
    with pytest.raises(TypeError, match=r"add\(\): x must be a cupy.ndarray"):
        L.add(x, x)
    with pytest.raises(TypeError, match=r"embedding\(\): ids must be a cupy.ndarray"):
        L.embedding(np.zeros(3, np.int32), x)


F32, F16, BF16 = np.float32, np.float16, _checks.BFLOAT16
_z = np.zeros


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(8, BF16)), TypeError, "weight has dtype bfloat16; expected float16"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F16)), TypeError, "weight has dtype float16"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(7, F16)), ValueError, r"weight has shape \(7,\)"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z((1, 8), F16)), ValueError, "weight must have 1 dim"),
    (lambda: L.rmsnorm(_z((2, 8), np.float64), _z(8)), TypeError, "x has dtype float64"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F32), eps=-1.0), ValueError, "eps must be finite and >= 0"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F32), out=_z((2, 9), F32)), ValueError, r"out has shape \(2, 9\)"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(8, F32), out=_z((2, 8), F32)), TypeError, "out has dtype float32"),
    (lambda: L.rope(_z((1, 2, 3, 7), F32), _z((1, 3), np.int32)), ValueError, r"D=7\) must be even"),
    (lambda: L.rope(_z((2, 3, 8), F32), _z((2, 3), np.int32)), ValueError, "x must have 4 dim"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((3, 2), np.int32)), ValueError, r"positions has shape \(3, 2\), expected \(2, 3\)"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z(3, np.int32)), ValueError, "positions must have 2 dim"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), F32)), TypeError, "positions has dtype float32"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), style="gptj"), ValueError, "style='gptj' is not supported"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), base=0.0), ValueError, "base must be finite and > 0"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), out=_z((2, 1, 3, 8), F16)), TypeError, "out has dtype float16"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), out=_z((2, 3, 1, 8), F32)), ValueError, "out has shape"),
    (lambda: L.swiglu(_z(8, F16), _z(8, BF16)), TypeError, "up has dtype bfloat16 but gate has float16"),
    (lambda: L.swiglu(_z(8, F16), _z(9, F16)), ValueError, r"up has shape \(9,\) but gate has \(8,\)"),
    (lambda: L.swiglu(_z(8, F16), _z(8, F16), out=_z(8, F32)), TypeError, "out has dtype float32"),
    (lambda: L.add(_z((2, 8), F32), _z((8,), F32)), ValueError, r"y has shape \(8,\) but x has \(2, 8\)"),
    (lambda: L.add(_z((2, 8), F32), _z((2, 8), F32), out=_z((4, 8), F32)[::2]), ValueError, "out must be C-contiguous"),
    (lambda: L.embedding(_z(3, F32), _z((5, 8), F32)), TypeError, "ids has dtype float32, expected one of int32, int64"),
    (lambda: L.embedding(_z(3, np.int32), _z(8, F32)), ValueError, "table must have 2 dim"),
    (lambda: L.embedding(_z(3, np.int32), _z((5, 8), F32)[:, ::2]), ValueError, "table must be contiguous in its last"),
    (lambda: L.embedding(_z((2, 3), np.int64), _z((5, 8), F16), out=_z((6, 8), F16)), ValueError, r"expected \(2, 3, 8\)"),
])
def test_argument_checks(fake_device, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_rope_in_place_needs_contiguous_last_dim(fake_device):
    x = _z((1, 2, 3, 16), F32)[..., ::2]
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        L.rope(x, _z((1, 3), np.int32), out=x)
    b = np.broadcast_to(_z((1, 1, 3, 8), F32), (1, 2, 3, 8))
    with pytest.raises(ValueError, match="broadcast"):
        L.rope(b, _z((1, 3), np.int32), out=b)


# --- CPU: compile check ------------------------------------------------------------------------
def test_compile_check_layers_no_errors_no_spills():
    from cupyattn import _compile_check as cc

    reports, errors = cc.run_check(only="layers")
    assert not errors, errors
    assert not [r for r in reports if r.spills]
    assert {(r.kernel, r.arch) for r in reports} == {(e, f"sm_{a}") for e in L.SPEC.name_expressions
                                                   for a in cc.ARCHES}


def test_python_constants_match_kernel_file():
    src = (_loader.KERNELS_DIR / "layers.cu").read_text()
    assert f"constexpr int RMS_WARPS = {L._RMS_WARPS};" in src
    assert f"__launch_bounds__(32 * RMS_WARPS)" in src and L._THREADS == 256
    assert src.count("__launch_bounds__(256)") == 4  # rope, swiglu, add, embedding: _THREADS


# --- CPU: layers.cu on the host --------------------------------------------------------------------
# g++ compiles the real source under a small CUDA emulation: one std::thread per CUDA thread,
# blocks one after another, __syncthreads a block barrier, __shfl_xor_sync a warp exchange through
# a buffer between two warp barriers, __shared__ -> static. Vector loads/stores abort when
# misaligned. The Python dispatch runs unchanged on NumPy arrays (a stand-in `cupy` module); its
# outputs live inside NaN-filled guard zones, so any stray write or read shows. _MAX_BLOCKS is
# patched to 3 so every grid-strided loop runs more than once.
_EMU_PRELUDE = r"""
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
using std::exp2; using std::rint; using std::fma;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
inline void sincospif(float x, float* s, float* c) {
    const double a = (double)x * 3.14159265358979323846; *s = (float)std::sin(a); *c = (float)std::cos(a); }
struct EmuBlock {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warp;
    std::vector<float> lane_val;
    int n;
};
thread_local EmuBlock* emu_block;
inline int emu_tid() { return threadIdx.x + threadIdx.y * blockDim.x; }
inline void __syncthreads() { emu_block->all->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int t = emu_tid(), w = t / 32;
    if (32 * (w + 1) > emu_block->n) { fprintf(stderr, "shuffle in a partial warp\n"); abort(); }
    emu_block->lane_val[t] = v;
    emu_block->warp[w]->arrive_and_wait();
    const float r = emu_block->lane_val[w * 32 + ((t % 32) ^ o)];
    emu_block->warp[w]->arrive_and_wait();
    return r;
}
inline void emu_align(const void* p, size_t n) {
    if ((uintptr_t)p % n) { fprintf(stderr, "misaligned %zu-byte vector access\n", n); abort(); }
}
template <typename A> int emu_kind() {  // argument kind: 1 pointer, 2xx float of size xx, 3xx int
    using B = std::remove_cv_t<A>;
    return std::is_pointer_v<B> ? 1 : (std::is_floating_point_v<B> ? 200 : 300) + (int)sizeof(B);
}
template <typename... A> int emu_sig(void (*)(A...), int* out) {
    int i = 0; ((out[i++] = emu_kind<A>()), ...); return i; }
template <typename... A, std::size_t... I>
void emu_call(void (*k)(A...), void** a, std::index_sequence<I...>) { k(*static_cast<A*>(a[I])...); }
template <typename... A>
void emu_launch(void (*k)(A...), unsigned gx, unsigned bx, unsigned by, void** args) {
    gridDim = {gx, 1, 1}; blockDim = {bx, by, 1};
    const int n = bx * by;
    for (unsigned b = 0; b < gx; ++b) {
        EmuBlock blk; blk.n = n; blk.lane_val.assign(n, 0.f);
        blk.all = std::make_unique<std::barrier<>>(n);
        for (int w = 0; w * 32 < n; ++w) blk.warp.push_back(std::make_unique<std::barrier<>>(std::min(32, n - 32 * w)));
        std::vector<std::thread> th;
        for (unsigned y = 0; y < by; ++y) for (unsigned x = 0; x < bx; ++x)
            th.emplace_back([&, x, y, b] {
                threadIdx = {x, y, 0}; blockIdx = {b, 0, 0}; emu_block = &blk;
                emu_call(k, args, std::index_sequence_for<A...>{});
            });
        for (auto& t : th) t.join();
    }
}
"""
_EMU_HEADERS = {
    "cuda_fp16.h": "#pragma once\nstruct __half { _Float16 v; };\n"
                   "inline float __half2float(__half h) { return (float)h.v; }\n"
                   "inline __half __float2half_rn(float f) { return {(_Float16)f}; }\n",
    "cuda_bf16.h": "#pragma once\nstruct __nv_bfloat16 { uint16_t b; };\n"
                   "inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.b << 16;"
                   " float f; memcpy(&f, &u, 4); return f; }\n"
                   "inline __nv_bfloat16 __float2bfloat16_rn(float f) { uint32_t u; memcpy(&u, &f, 4);\n"
                   "  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};\n"
                   "  u += 0x7fffu + ((u >> 16) & 1u); return {(uint16_t)(u >> 16)}; }\n",
    "math_constants.h": "#pragma once\n",
}
_GUARD = 64  # elements of NaN (or -7 for integers) on each side of every emulated allocation


class _EmuDevice:
    """Stand-in `cupy` module + kernel launcher over the g++-built library."""

    def __init__(self, lib):
        self.lib, self.guards, self.launches = lib, [], []
        self.index = {e: n for n, e in enumerate(L.SPEC.name_expressions)}
        self.int32, self.ndarray = np.int32, np.ndarray

    def buffer(self, shape, dtype, offset=0):
        """A view inside a guard-filled buffer; ``offset`` elements shift it (misalignment)."""
        dtype = np.dtype(dtype)
        n = math.prod(shape)
        fill = np.nan if dtype.kind == "f" else -7
        buf = np.full(n + 2 * _GUARD + offset, fill, dtype=dtype)
        lo = _GUARD + offset
        self.guards.append((buf, lo, lo + n))
        return buf[lo:lo + n].reshape(shape)

    def put(self, x, dtype, offset=0):
        v = self.buffer(np.shape(x), dtype, offset)
        v[...] = np.asarray(x).astype(v.dtype)
        return v

    def check_guards(self):
        for buf, lo, hi in self.guards:
            for part in (buf[:lo], buf[hi:]):
                p = part.astype(np.float64)
                assert (np.isnan(p) | (p == -7)).all(), "a kernel wrote outside its array"
        self.guards.clear()

    # the parts of cupy that layers.py uses
    def empty(self, shape, dtype=np.float32):
        return self.buffer(tuple(shape), dtype)

    @staticmethod
    def ascontiguousarray(a, dtype=None):
        return np.ascontiguousarray(a, dtype=dtype)

    def kernel(self, spec, expr):
        assert spec is L.SPEC and expr in self.index, expr
        return lambda grid, block, args: self._launch(expr, grid, block, args)

    def _launch(self, expr, grid, block, args):
        n_expr = self.index[expr]
        sig = (ctypes.c_int * 32)()
        n = getattr(self.lib, f"sig_{n_expr}")(sig)
        assert n == len(args), f"{expr}: {len(args)} args for {n} parameters"
        kinds = {np.int32: (304, ctypes.c_int32), np.int64: (308, ctypes.c_int64),
                 np.float32: (204, ctypes.c_float), np.float64: (208, ctypes.c_double)}
        vals = []
        for k, a in zip(sig[:n], args):
            if isinstance(a, np.ndarray):
                assert k == 1, f"{expr}: array passed for a non-pointer parameter"
                vals.append(ctypes.c_void_p(a.ctypes.data))
            else:
                want, ct = kinds[type(a)]
                assert k == want, f"{expr}: {type(a).__name__} passed for parameter kind {k}"
                vals.append(ct(a.item()))
        (gx, *gr), (bx, *br) = grid, block
        assert gr in ([], [1]) and len(br) <= 1 and 1 <= bx * (br or [1])[0] <= 1024
        self.launches.append(expr)
        ptrs = (ctypes.c_void_p * n)(*[ctypes.addressof(v) for v in vals])
        getattr(self.lib, f"run_{n_expr}")(ctypes.c_uint(gx), ctypes.c_uint(bx),
                                            ctypes.c_uint((br or [1])[0]), ptrs)


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulation of layers.cu")
    work = tmp_path_factory.mktemp("layers_emu")
    for name, text in _EMU_HEADERS.items():
        (work / name).write_text(text)
    (work / "emu_prelude.h").write_text(_EMU_PRELUDE)
    code = _loader.inline_headers("layers.cu")
    for fn in ("load_vec(const T* p) {\n", "store_vec(T* p, const Vec<T, N>& a) {\n"):
        assert code.count(fn) == 1
        code = code.replace(fn, fn + "    emu_align(p, sizeof(T) * N);\n")
    src = ['#include "emu_prelude.h"', code]
    for n, e in enumerate(L.SPEC.name_expressions):
        src.append(f'extern "C" void run_{n}(unsigned gx, unsigned bx, unsigned by, void** a) '
                   f'{{ emu_launch(&{e}, gx, bx, by, a); }}\n'
                   f'extern "C" int sig_{n}(int* o) {{ return emu_sig(&{e}, o); }}')
    text = "\n".join(src)
    cpp = work / f"layers_{hashlib.sha1(text.encode()).hexdigest()[:10]}.cpp"
    cpp.write_text(text)
    so = cpp.with_suffix(".so")
    r = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-w", f"-I{work}",
                        str(cpp), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(str(so))


@pytest.fixture
def emu(emu_lib, monkeypatch):
    dev = _EmuDevice(emu_lib)
    monkeypatch.setitem(sys.modules, "cupy", dev)
    monkeypatch.setattr(_checks, "is_device_array", lambda x: isinstance(x, np.ndarray))
    monkeypatch.setattr(_checks, "check_device", lambda fn, name, x: None)
    monkeypatch.setattr(L, "get_function", dev.kernel)
    monkeypatch.setattr(L, "_ptr", lambda a: a.ctypes.data)
    monkeypatch.setattr(L, "_MAX_BLOCKS", 3)
    return dev


def _emu_close(emu, out, want, dtype, tol=None):
    assert_close(np.asarray(out).astype(np.float64), want, dtype, tol)
    emu.check_guards()


# (dtype, D, rows, variant, weight dtype, misalign): D 1..4096, both kernels, scalar + vector paths
@pytest.mark.parametrize("case", [
    ("float32", 1, 3, "auto", "same", 0), ("float16", 17, 5, "warp", "float32", 1),
    ("bfloat16", 576, 6, "auto", "same", 0), ("float32", 1000, 2, "block", "same", 1),
    ("float16", 4096, 2, "auto", "float32", 0), ("bfloat16", 1100, 1, "block", "float32", 0),
    ("float32", 64, 9, "warp", "same", 0), ("float16", 2048, 1, "warp", "same", 0),
    ("bfloat16", 40, 3, "block", "same", 1),
], ids=str)
def test_emu_rmsnorm(emu, rng, case):
    dtype, d, rows, variant, wdt, off = case
    x = emu.put(rand_with_outliers(rng, (rows, d)), np_dtype(dtype), off)
    w = emu.put(rng.standard_normal(d), np_dtype(dtype if wdt == "same" else "float32"))
    out = emu.buffer((rows, d), np_dtype(dtype))
    L._rmsnorm(x, w, 1e-5, out, variant)
    _emu_close(emu, out, ref.rmsnorm(x.astype(np.float64), w.astype(np.float64)), dtype)
    assert emu.launches[0].startswith(f"rmsnorm_{'block' if variant == 'block' or d > 1024 and variant == 'auto' else 'warp'}")


def test_emu_rmsnorm_in_place(emu, rng):
    x = emu.put(rand_with_outliers(rng, (2, 3, 576)), np.float16)
    w = emu.put(rng.standard_normal(576), np.float16)
    want = ref.rmsnorm(x.astype(np.float64), w.astype(np.float64))
    assert L.rmsnorm(x, w, out=x) is x
    _emu_close(emu, x, want, "float16")


# (dtype, B, H, T, D, style, layout, positions dtype)
@pytest.mark.parametrize("case", [
    ("float32", 1, 3, 17, 64, "adjacent", "new", np.int32), ("float32", 2, 2, 9, 32, "neox", "new", np.int64),
    ("float16", 2, 3, 5, 128, "adjacent", "inplace", np.int32), ("bfloat16", 1, 2, 7, 64, "neox", "inplace", np.int32),
    ("float32", 2, 3, 4, 64, "adjacent", "fused", np.int32), ("float16", 2, 3, 4, 32, "neox", "fused", np.int64),
    ("bfloat16", 1, 2, 5, 32, "adjacent", "misaligned", np.int32), ("float32", 1, 2, 97, 2, "adjacent", "new", np.int32),
    ("float32", 2, 1, 3, 6, "neox", "misaligned", np.int32), ("float32", 1, 1, 1, 256, "adjacent", "new", np.int32),
], ids=str)
def test_emu_rope(emu, rng, case):
    dtype, b, h, t, d, style, layout, pdt = case
    dt = np_dtype(dtype)
    if layout == "fused":  # q of a fused [B, T, 3, H, D] projection, rotated in place
        big = emu.put(rand_with_outliers(rng, (b, t, 3, h, d)), dt)
        x = big[:, :, 1].transpose(0, 2, 1, 3)
        others = big[:, :, 0::2].copy()
    else:
        x = emu.put(rand_with_outliers(rng, (b, h, t, d)), dt, 1 if layout == "misaligned" else 0)
    before = x.astype(np.float64)
    pos = _positions(rng, b, t)
    want = ref.rope(before, pos, base=1e5, style=style)
    out = x if layout in ("inplace", "fused") else emu.buffer((b, h, t, d), dt)
    assert L.rope(x, emu.put(pos, pdt), base=1e5, style=style, out=out) is out
    if layout == "fused":
        assert np.array_equal(big[:, :, 0::2], others)  # k and v parts of the buffer untouched
    _emu_close(emu, out, want, dtype)


@pytest.mark.parametrize("dtype,n,off", [("float32", 1, 0), ("float16", 17, 0), ("bfloat16", 97, 1),
                                         ("float32", 1000, 0), ("float16", 4096, 1), ("bfloat16", 8200, 0),
                                         ("float32", 20000, 1)])
def test_emu_swiglu_add(emu, rng, dtype, n, off):
    dt = np_dtype(dtype)
    g, u = emu.put(rand_with_outliers(rng, (n,), 3.0, outlier_value=8.0), dt, off), emu.put(rand_with_outliers(rng, (n,)), dt)
    _emu_close(emu, L.swiglu(g, u), ref.swiglu(g.astype(np.float64), u.astype(np.float64)), dtype)
    a, b = emu.put(rand_with_outliers(rng, (3, n)), dt), emu.put(rand_with_outliers(rng, (3, n)), dt)
    want = a.astype(np.float64) + b.astype(np.float64)
    assert L.add(a, b, out=a) is a
    _emu_close(emu, a, want, dtype)


@pytest.mark.parametrize("dtype,idt,d,vocab,off,ldpad", [
    ("float32", np.int32, 64, 100, 0, 0), ("float16", np.int64, 17, 5, 0, 0), ("bfloat16", np.int32, 576, 7, 0, 8),
    ("float32", np.int64, 1, 1, 1, 0), ("float16", np.int32, 64, 9, 1, 3)])
def test_emu_embedding(emu, rng, dtype, idt, d, vocab, off, ldpad):
    full = emu.put(rand_with_outliers(rng, (vocab, d + ldpad)), np_dtype(dtype), off)
    table = full[:, :d]
    ids = rng.integers(0, vocab, size=(2, 7))
    ids[0, 0], ids[1, -1] = 0, vocab - 1
    _emu_close(emu, L.embedding(emu.put(ids, idt), table), ref.embedding(ids, table.astype(np.float64)), dtype, 0.0)


def test_emu_embedding_out_of_range_ids_give_zero_rows(emu, rng):
    table = emu.put(rng.standard_normal((10, 64)), np.float16)
    ids = np.array([3, -1, 10, 2**40, 9, -2**40])
    out = L.embedding(emu.put(ids, np.int64), table).astype(np.float64)
    assert (out[[1, 2, 3, 5]] == 0).all() and np.array_equal(out[[0, 4]], table[[3, 9]].astype(np.float64))
    out = L.embedding(emu.put(np.array([-5, 10, 0]), np.int32), table).astype(np.float64)
    assert (out[:2] == 0).all() and np.array_equal(out[2], table[0].astype(np.float64))
    emu.check_guards()


# --- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 17, 97, 576, 1000, 4096, pytest.param(16384, marks=pytest.mark.no_emu)])
@pytest.mark.parametrize("variant", ["auto", "warp", "block"])
@pytest.mark.parametrize("rows", [1, 97])
def test_gpu_rmsnorm(rng, dtype, d, variant, rows):
    x, xr = to_device(rand_with_outliers(rng, (rows, d)), dtype)
    for wdt in {dtype, "float32"}:
        w, wr = to_device(rng.standard_normal(d), wdt)
        out = nan_like((rows, d), dtype)
        assert L._rmsnorm(x, w, 1e-5, out, variant) is out
        assert_close(out, ref.rmsnorm(xr, wr), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rmsnorm_in_place_misaligned_and_nd(rng, dtype):
    import cupy

    x, xr = to_device(rand_with_outliers(rng, (2, 17, 576)), dtype)
    w, wr = to_device(rng.standard_normal(576), dtype)
    assert L.rmsnorm(x, w, eps=1e-6, out=x) is x
    assert_close(x, ref.rmsnorm(xr, wr, eps=1e-6), dtype)
    buf, bufr = to_device(rand_with_outliers(rng, 1 + 3 * 64), dtype)  # rows start 1 element off
    x, xr = buf[1:].reshape(3, 64), bufr[1:].reshape(3, 64)
    assert_close(L.rmsnorm(x, w[:64].copy()), ref.rmsnorm(xr, wr[:64]), dtype)
    xt, xtr = to_device(rand_with_outliers(rng, (64, 5)), dtype)  # non-contiguous: copied first
    assert_close(L.rmsnorm(xt.T, w[:64].copy()), ref.rmsnorm(xtr.T, wr[:64]), dtype)
    assert L.rmsnorm(cupy.empty((0, 64), x.dtype), w[:64].copy()).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("t", [1, 17, 97])
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope(rng, dtype, d, t, style):
    import cupy

    x, xr = to_device(rand_with_outliers(rng, (2, 3, t, d)), dtype)
    pos = _positions(rng, 2, t)
    out = nan_like(x.shape, dtype)
    assert L.rope(x, cupy.asarray(pos, dtype=cupy.int32), style=style, out=out) is out
    assert_close(out, ref.rope(xr, pos, style=style), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope_large_positions_fp32(rng, style):
    """Positions 32000..32767, base 1e4 and 1e5: fp32 tolerance holds (angle formed in double)."""
    import cupy

    x, xr = to_device(rng.standard_normal((1, 4, 768, 128)), "float32")
    pos = np.arange(32000, 32768)[None]
    for base in (1e4, 1e5):
        got = L.rope(x, cupy.asarray(pos), base=base, style=style)  # int64 positions accepted
        assert_close(got, ref.rope(xr, pos, base=base, style=style), "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope_in_place_on_fused_qkv_views(rng, dtype, style):
    import cupy

    b, t, h, d = 2, 17, 3, 64
    qkv, qkvr = to_device(rand_with_outliers(rng, (b, t, 3, h, d)), dtype)
    untouched = qkv[:, :, 2].copy()
    pos = _positions(rng, b, t)
    for j in (0, 1):  # q and k: [B, H, T, D] views with strides (T*3*H*D, D, 3*H*D, 1)
        view = qkv[:, :, j].transpose(0, 2, 1, 3)
        assert L.rope(view, cupy.asarray(pos, dtype=cupy.int32), base=1e5, style=style, out=view) is view
        assert_close(view, ref.rope(qkvr[:, :, j].transpose(0, 2, 1, 3), pos, base=1e5, style=style), dtype)
    assert cupy.array_equal(qkv[:, :, 2], untouched)
    # a view 1 element off: adjacent pairs fall back to scalar loads
    buf, bufr = to_device(rand_with_outliers(rng, 1 + 2 * 3 * 5 * 32), dtype)
    x, xr = buf[1:].reshape(2, 3, 5, 32), bufr[1:].reshape(2, 3, 5, 32)
    pos = _positions(rng, 2, 5)
    assert_close(L.rope(x, cupy.asarray(pos), style=style), ref.rope(xr, pos, style=style), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 97, 128, 1000, 4096])
def test_gpu_swiglu_and_add(rng, dtype, n):
    # gate outliers at +-8: silu(-30) ~ -3e-12 is not representable in fp16/bf16 output
    g, gr = to_device(rand_with_outliers(rng, (3, n), 3.0, outlier_value=8.0), dtype)
    u, ur = to_device(rand_with_outliers(rng, (3, n)), dtype)
    out = nan_like((3, n), dtype)
    assert L.swiglu(g, u, out=out) is out
    assert_close(out, ref.swiglu(gr, ur), dtype)
    out = nan_like((3, n), dtype)
    assert L.add(g, u, out=out) is out
    assert_close(out, gr + ur, dtype)
    assert L.swiglu(g, u, out=u) is u  # in place on up
    assert_close(u, ref.swiglu(gr, ur), dtype)
    assert L.add(g, g[::-1].copy(), out=g) is g  # residual add in place
    assert_close(g, gr + gr[::-1], dtype)
    odd, oddr = to_device(rand_with_outliers(rng, 1 + n), dtype)  # misaligned: scalar path
    assert_close(L.add(odd[1:], odd[:-1]), oddr[1:] + oddr[:-1], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("d", [1, 17, 64, 576])
def test_gpu_embedding(rng, dtype, ids_dtype, d):
    import cupy

    vocab = 97
    table, tr = to_device(rand_with_outliers(rng, (vocab, d + 3)), dtype)
    ids = rng.integers(0, vocab, size=(2, 17))
    ids[0, 0], ids[1, -1] = 0, vocab - 1
    for tab, tabr in ((table[:, :d].copy(), tr[:, :d]), (table[:, :d], tr[:, :d])):  # dense, strided rows
        out = nan_like((2, 17, d), dtype)
        assert L.embedding(cupy.asarray(ids, dtype=ids_dtype), tab, out=out) is out
        assert np.array_equal(to_host(out), ref.embedding(ids, tabr))
    bad = cupy.asarray([5, -1, vocab, vocab - 1], dtype=ids_dtype)
    got = to_host(L.embedding(bad, table[:, :d]))
    assert (got[[1, 2]] == 0).all() and np.array_equal(got[[0, 3]], tr[[5, vocab - 1], :d])
