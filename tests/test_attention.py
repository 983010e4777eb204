"""attention(): CPU tier (tiled reference, tile table, argument checks, compile check, and the
flash kernel's own source run on the host under a fiber emulation of CUDA threads) and GPU tier
(both impls against the float64 reference)."""
import ctypes
import hashlib
import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from conftest import (DTYPES, assert_close, nan_like, np_dtype, rand_with_outliers, to_device,
                      to_host)
from cupyattn import _loader
from cupyattn import attention as A
from cupyattn import reference as ref

IMPLS = ("flash", "flash_mma", "naive")
# flash_mma is fp16/bf16 only: fp32 cases pair it with float16 instead
IMPL_DTYPE_F32 = [("flash", "float32"), ("naive", "float32"), ("flash_mma", "float16")]


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def _qkv(rng, b, hq, hkv, sq, sk, d):
    return (rand_with_outliers(rng, (b, hq, sq, d)), rand_with_outliers(rng, (b, hkv, sk, d)),
            rand_with_outliers(rng, (b, hkv, sk, d)))


def _assert_lse(lse, want, tol=1e-4):
    lse = np.asarray(lse, dtype=np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(lse), fin), "lse is -inf exactly where no key is seen"
    assert np.all(lse[~fin] == -np.inf)
    if fin.any():
        np.testing.assert_allclose(lse[fin], want[fin], rtol=tol, atol=tol)


# --- CPU: the tiled algorithm the kernel follows ---------------------------------------------
@pytest.mark.parametrize("bm,bn", [(64, 64), (16, 32), (7, 5), (1, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(2, 2, 33, 33), (6, 2, 20, 45), (4, 1, 45, 20), (3, 3, 1, 9)])
def test_tiled_reference_matches_attention(rng, bm, bn, causal, hq, hkv, sq, sk):
    q, k, v = _qkv(rng, 2, hq, hkv, sq, sk, 16)
    mask = np.where(rng.random((1, hq, sq, sk)) < 0.2, -np.inf, rng.standard_normal((1, hq, sq, sk)))
    kl = np.array([sk, max(sk - 7, 0)])
    for kw in ({}, {"mask": mask}, {"key_lengths": kl}, {"mask": mask, "key_lengths": [0, sk]}):
        want, wl = ref.attention(q, k, v, causal=causal, return_lse=True, **kw)
        got, gl = ref.flash_attention_tiled(q, k, v, causal=causal, block_m=bm, block_n=bn,
                                            return_lse=True, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        _assert_lse(gl, wl, 1e-10)
        if "key_lengths" in kw and kw["key_lengths"][0] == 0:
            assert np.all(got[0] == 0.0)  # a sequence with no keys gives zeros, not NaN


# --- CPU: tile table and instantiations -------------------------------------------------------
def test_tile_table_matches_kernel_file_and_fits_static_smem():
    text = (_loader.KERNELS_DIR / "flash_attn.cu").read_text()
    rows = re.findall(r"^//\s+(16|32)b\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+) KB", text, re.M)
    table = {(int(d), int(bits) // 8): (int(bm), int(bn), int(nw)) for bits, d, bm, bn, nw, _ in rows}
    assert table == A._TILES
    for bits, d, bm, bn, nw, kb in rows:
        d, bm, bn, es = int(d), int(bm), int(bn), int(bits) // 8
        smem = (bm * d + bn * (d + (1 if es == 4 else 2))) * es + bm * bn * 4
        assert smem <= 48 * 1024 and abs(smem / 1024 - float(kb)) < 0.06, (d, es, smem)
        assert bm % int(nw) == 0 and bn % 32 == 0
    mma = re.findall(r"^//\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+) KB", text, re.M)
    assert {int(d): (int(bn), int(nw)) for d, _, bn, nw, _ in mma} == A._MMA_TILES
    for d, bm, bn, nw, kb in mma:
        smem = (int(bm) + int(bn)) * (int(d) + 8) * 2
        assert int(bm) == 16 * int(nw) and smem <= 48 * 1024 and abs(smem / 1024 - float(kb)) < 0.06
    exprs = set(A.FLASH_SPEC.name_expressions)
    assert len(exprs) == 36 + 24
    for d in A.SUPPORTED_HEAD_DIMS:
        for c in (False, True):
            for ct in ("float", "__half", "__nv_bfloat16"):
                assert A._flash_expr(ct, d, c) in exprs
            for ct in ("__half", "__nv_bfloat16"):
                assert A._mma_expr(ct, d, c) in exprs


def test_compile_check_flash_attn_no_errors_no_spills():
    from cupyattn._compile_check import run_check

    reports, errors = run_check("flash_attn")
    assert not errors, errors
    assert len(reports) == 2 * len(A.FLASH_SPEC.name_expressions)  # sm_80 and sm_90
    assert not [f"{r.kernel} sm_{r.arch}" for r in reports if r.spills]
    assert all(r.smem_bytes <= 48 * 1024 for r in reports)


# --- CPU: argument checks ---------------------------------------------------------------------
def _np(shape, dtype=np.float16):
    return np.zeros(shape, dtype=dtype)


def test_rejects_host_arrays():
    q = _np((1, 2, 4, 64))
    with pytest.raises(TypeError, match=r"attention\(\): q must be a cupy.ndarray"):
        A.attention(q, q, q)


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(impl="fast"), ValueError, r"impl='fast'"),
    (dict(q=_np((1, 2, 4, 64), np.float32), k=_np((1, 2, 5, 64), np.float32), v=_np((1, 2, 5, 64), np.float32),
          impl="flash_mma"), TypeError, r"impl='flash_mma' needs float16 or bfloat16"),
    (dict(q=_np((1, 2, 4, 40)), k=_np((1, 2, 5, 40)), v=_np((1, 2, 5, 40)), impl="flash_mma"), ValueError,
     r"D=40 is not supported by impl='flash_mma'"),
    (dict(q=_np((2, 4, 64))), ValueError, r"q must have 4 dimensions"),
    (dict(k=_np((1, 2, 5, 64), np.float32)), TypeError, r"k has dtype float32 but q has float16"),
    (dict(q=_np((1, 2, 4, 64), np.int32)), TypeError, r"q has dtype int32"),
    (dict(k=_np((2, 2, 5, 64))), ValueError, r"k has shape \(2, 2, 5, 64\)"),
    (dict(k=_np((1, 2, 5, 32))), ValueError, r"k has shape"),
    (dict(v=_np((1, 2, 6, 64))), ValueError, r"v has shape \(1, 2, 6, 64\) but k"),
    (dict(k=_np((1, 3, 5, 64)), v=_np((1, 3, 5, 64))), ValueError, r"Hq=2 .* Hkv=3"),
    (dict(q=_np((1, 2, 4, 48)), k=_np((1, 2, 5, 48)), v=_np((1, 2, 5, 48))), ValueError,
     r"head_dim D=48 .* 32, 64, 80, 96, 128, 256"),
    (dict(q=_np((1, 2, 4, 128))[..., ::2]), ValueError, r"q must be contiguous in its last"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(scale="x"), TypeError, r"scale must be a real number"),
    (dict(mask=_np((4, 6), np.float32)), ValueError, r"mask of shape \(4, 6\) does not broadcast"),
    (dict(mask=_np((1, 1, 1, 4, 5), np.float32)), ValueError, r"mask must have at most 4"),
    (dict(mask=_np((4, 5), np.int32)), TypeError, r"mask has dtype int32"),
    (dict(key_lengths=[5, 5]), ValueError, r"key_lengths must have shape \[B\] = \(1,\)"),
    (dict(key_lengths=[6]), ValueError, r"key_lengths values must lie in \[0, Sk=5\]"),
    (dict(key_lengths=[-1]), ValueError, r"key_lengths values must lie in"),
    (dict(key_lengths=[2.5]), TypeError, r"key_lengths must have an integer dtype"),
    (dict(out=_np((1, 2, 4, 32))), ValueError, r"out has shape"),
    (dict(out=_np((1, 2, 4, 64), np.float32)), TypeError, r"out has dtype float32"),
    (dict(out=_np((1, 4, 2, 64)).transpose(0, 2, 1, 3)), ValueError, r"out must be C-contiguous"),
])
def test_argument_checks(fake_device, change, exc, pattern):
    kw = dict(q=_np((1, 2, 4, 64)), k=_np((1, 2, 5, 64)), v=_np((1, 2, 5, 64)))
    kw.update(change)
    with pytest.raises(exc, match=pattern) as e:
        A.attention(**kw)
    assert str(e.value).startswith("attention(): ")


def test_naive_accepts_any_head_dim_in_checks(fake_device):
    q = _np((1, 2, 4, 48))
    scale, mshape, kl = A._check_args(q, q, q, None, None, None, "naive", None)
    assert scale == pytest.approx(1 / math.sqrt(48)) and mshape is None and kl is None


# --- CPU: the kernel source itself, run on the host ------------------------------------------
# The .cu is compiled with g++ under a small emulation of the CUDA features it uses: each CUDA
# thread is a fiber (ucontext), __syncthreads waits for the block, __shfl_xor_sync for the warp;
# __shared__ becomes static. _flash_launch builds the same (grid, block, args) as on a GPU.
_PRELUDE = r"""
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>
#include <ucontext.h>
using std::min; using std::max;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
struct emu_dim3 { unsigned x, y, z; };
namespace emu {
struct Fiber { ucontext_t ctx; int wait = 0; bool done = false; unsigned tid = 0; };
inline ucontext_t sched;
inline Fiber* cur = nullptr;
inline emu_dim3 block_idx, grid_dim, thread_idx;
inline float slots[1024];
inline std::function<void()>* body = nullptr;
inline void sync(int kind) {  // 1: block barrier, 2: warp barrier
    cur->wait = kind; swapcontext(&cur->ctx, &sched); thread_idx = {cur->tid, 0, 0};
}
inline float shfl_xor(float v, int o) {
    slots[cur->tid] = v; sync(2); float r = slots[cur->tid ^ o]; sync(2); return r;
}
inline void entry() { (*body)(); cur->done = true; swapcontext(&cur->ctx, &sched); }
inline void run_block(int n, std::function<void()> f) {
    std::vector<Fiber> fs(n);
    std::vector<std::vector<char>> stacks(n, std::vector<char>(1 << 18));
    body = &f;
    for (int t = 0; t < n; ++t) {
        fs[t].tid = t; getcontext(&fs[t].ctx);
        fs[t].ctx.uc_stack.ss_sp = stacks[t].data(); fs[t].ctx.uc_stack.ss_size = stacks[t].size();
        fs[t].ctx.uc_link = nullptr; makecontext(&fs[t].ctx, entry, 0);
    }
    for (;;) {
        bool any = false;
        for (auto& fb : fs) if (!fb.done && fb.wait == 0) {
            cur = &fb; thread_idx = {fb.tid, 0, 0}; swapcontext(&sched, &fb.ctx); any = true;
        }
        int alive = 0, at_block = 0;
        for (auto& fb : fs) if (!fb.done) { ++alive; at_block += fb.wait == 1; }
        if (!alive) break;
        if (at_block == alive) { for (auto& fb : fs) fb.wait = 0; continue; }
        for (int w = 0; w * 32 < n; ++w) {
            int c = 0;
            for (int l = 0; l < 32; ++l) c += !fs[w * 32 + l].done && fs[w * 32 + l].wait == 2;
            if (c == 32) { for (int l = 0; l < 32; ++l) fs[w * 32 + l].wait = 0; any = true; }
        }
        if (!any) { fprintf(stderr, "emulation deadlock (divergent barrier)\n"); abort(); }
    }
}
}  // namespace emu
#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)
inline void __syncthreads() { emu::sync(1); }
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu::shfl_xor(v, o); }
"""
_HEADERS = {
    "cuda_fp16.h": """#pragma once
struct __half { _Float16 v; };
struct __half2 { __half x, y; };
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { return {(_Float16)f}; }
inline float2 __half22float2(__half2 h) { return {(float)h.x.v, (float)h.y.v}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
""",
    "cuda_bf16.h": """#pragma once
struct __nv_bfloat16 { uint16_t b; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.b << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u); return {(uint16_t)(u >> 16)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return {__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
""",
    "math_constants.h": "#pragma once\n#define CUDART_INF_F INFINITY\n",
}
# mma.sync m16n8k16 for one warp, written from the PTX ISA fragment tables (independently of
# the kernel's comments): every lane posts its registers, then computes its own D elements.
_MMA_EMU = r"""
namespace emu { inline unsigned frag[1024][6]; }
template <typename T> float emu_elem(unsigned reg, int hi) {
    unsigned short bits = hi ? (unsigned short)(reg >> 16) : (unsigned short)(reg & 0xffffu);
    T x; memcpy(&x, &bits, 2); return to_float(x);
}
template <typename T>
void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    const unsigned tid = emu::cur->tid, w0 = tid & ~31u, lane = tid & 31u;
    for (int i = 0; i < 4; ++i) emu::frag[tid][i] = a[i];
    emu::frag[tid][4] = b[0]; emu::frag[tid][5] = b[1];
    emu::sync(2);
    float A[16][16], Bm[16][8];
    for (unsigned L = 0; L < 32; ++L) {
        const int g = L >> 2, t = L % 4;
        for (int i = 0; i < 8; ++i) {  // a_i: row g for i<2 or 4<=i<6 else g+8; col 2t+(i&1) (+8 for i>=4)
            const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = emu_elem<T>(emu::frag[w0 + L][i / 2], i & 1);
        }
        for (int i = 0; i < 4; ++i)  // b_i: row 2t+(i&1) (+8 for i>=2), col g
            Bm[t * 2 + (i & 1) + (i >= 2 ? 8 : 0)][g] = emu_elem<T>(emu::frag[w0 + L][4 + i / 2], i & 1);
    }
    emu::sync(2);
    const int g = lane >> 2, t = lane % 4;
    for (int i = 0; i < 4; ++i) {  // c_i: row g for i<2 else g+8, col 2t+(i&1)
        const int row = i < 2 ? g : g + 8, col = t * 2 + (i & 1);
        float acc = 0.0f;
        for (int kk = 0; kk < 16; ++kk) acc += A[row][kk] * Bm[kk][col];
        d[i] += acc;
    }
}
"""
_PARAMS = ("const void* q, const void* k, const void* v, void* out, float* lse, const float* mask, "
           "const int* kl, int B, int Hq, int Hkv, int Sq, int Sk, "
           + ", ".join(f"long long s{i}" for i in range(13)) + ", float sl2")
_ARGS = ("(const T*)q, (const T*)k, (const T*)v, (T*)out, lse, mask, kl, B, Hq, Hkv, Sq, Sk, "
         + ", ".join(f"s{i}" for i in range(13)) + ", sl2")

# (impl, dtype, D, causal, B, Hq, Hkv, Sq, Sk, extra): every head_dim; GQA; Sq != Sk both
# ways; masks with broadcast dims; key_lengths incl. 0; strided q/k; tails at 1, 17, 97.
_EMU_CASES = [
    ("flash", "float32", 32, False, 2, 2, 2, 97, 97, ""), ("flash", "float16", 32, True, 1, 4, 1, 17, 70, "lse"),
    ("flash", "float32", 64, True, 2, 2, 1, 70, 37, "lse"), ("flash", "bfloat16", 64, False, 1, 3, 1, 1, 97, "mask"),
    ("flash", "float16", 80, True, 1, 3, 1, 20, 90, "keylen"), ("flash", "float32", 80, False, 1, 2, 2, 65, 33, "mask"),
    ("flash", "bfloat16", 96, True, 1, 4, 2, 33, 33, "stride"), ("flash", "float32", 96, True, 2, 2, 2, 40, 70, "keylen"),
    ("flash", "float16", 128, False, 2, 2, 1, 17, 40, "mask"), ("flash", "float32", 128, True, 1, 2, 1, 97, 17, "lse"),
    ("flash", "float16", 256, True, 1, 2, 2, 40, 40, "keylen"), ("flash", "float32", 256, False, 1, 2, 1, 17, 9, "mask"),
    ("flash_mma", "float16", 32, False, 1, 2, 1, 97, 97, "lse"), ("flash_mma", "bfloat16", 32, True, 2, 2, 2, 17, 70, "keylen"),
    ("flash_mma", "float16", 64, True, 1, 3, 1, 70, 37, "lse"), ("flash_mma", "bfloat16", 64, False, 1, 2, 2, 1, 97, "mask"),
    ("flash_mma", "float16", 80, True, 1, 2, 1, 20, 90, "mask"), ("flash_mma", "bfloat16", 96, True, 1, 4, 2, 33, 33, "stride"),
    ("flash_mma", "float16", 128, True, 2, 2, 1, 80, 130, "keylen"), ("flash_mma", "bfloat16", 128, False, 1, 2, 2, 17, 40, ""),
    ("flash_mma", "float16", 256, True, 1, 2, 2, 40, 40, "lse"), ("flash_mma", "bfloat16", 256, False, 1, 2, 1, 17, 9, "mask"),
]


def _emu_expr(case):
    impl, dtype, d, causal = case[:4]
    make = A._mma_expr if impl == "flash_mma" else A._flash_expr
    return make(A._checks.ctype(np_dtype(dtype)), d, causal)


@pytest.fixture(scope="module")
def emu_kernels(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the host emulation of the kernel")
    work = tmp_path_factory.mktemp("flash_emu")
    for name, text in _HEADERS.items():
        (work / name).write_text(text)
    (work / "emu_prelude.h").write_text(_PRELUDE)
    exprs = sorted({_emu_expr(c) for c in _EMU_CASES})
    src = ['#include "emu_prelude.h"', _loader.inline_headers("flash_attn.cu"), _MMA_EMU]
    for n, e in enumerate(exprs):
        kname, targs = e[:e.index("<")], e[e.index("<") + 1:-1]
        src.append(f'extern "C" void run_{n}(unsigned gx, unsigned gy, unsigned gz, int threads, {_PARAMS}) {{\n'
                   f'  using T = {targs.split(",")[0]};\n  emu::grid_dim = {{gx, gy, gz}};\n'
                   f'  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y)\n'
                   f'    for (unsigned x = 0; x < gx; ++x) {{\n      emu::block_idx = {{x, y, z}};\n'
                   f'      emu::run_block(threads, [&] {{ {kname}<{targs}>({_ARGS}); }});\n    }}\n}}')
    code = "\n".join(src)
    cpp = work / f"flash_{hashlib.sha1(code.encode()).hexdigest()[:10]}.cpp"
    cpp.write_text(code)
    so = cpp.with_suffix(".so")
    r = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-w", f"-I{work}", str(cpp),
                        "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    return {e: getattr(lib, f"run_{n}") for n, e in enumerate(exprs)}


def _emu_launch(fn, grid, block, args):
    conv = [ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(grid[2]), ctypes.c_int(block[0])]
    for a in args:
        if a is None or isinstance(a, np.ndarray):
            conv.append(ctypes.c_void_p(None if a is None else a.ctypes.data))
        else:
            conv.append({np.int32: ctypes.c_int, np.int64: ctypes.c_longlong,
                         np.float32: ctypes.c_float}[type(a)](a.item()))
    fn(*conv)


@pytest.mark.parametrize("case", _EMU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_source_on_host_emulation(emu_kernels, rng, case):
    impl, dtype, d, causal, b, hq, hkv, sq, sk, extra = case
    dt = np_dtype(dtype)
    q, k, v = (x.astype(dt) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    if extra == "stride":  # q, k as views of [B, S, H, D] buffers: head and seq strides swapped
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    mask = kl = None
    if extra == "mask":  # [Hq, 1, Sk]: broadcast over B and Sq, some keys hidden
        mask = np.where(rng.random((hq, 1, sk)) < 0.3, -np.inf, rng.standard_normal((hq, 1, sk)))
        mask[0, 0, :] = -np.inf  # head 0 sees nothing: zeros
        mask = mask.astype(np.float32)
    if extra == "keylen":  # B=2: a sequence with no keys and a short one; B=1, D=256: no keys
        kl = np.array([0, sk // 3 + 1] if b == 2 else [0 if d == 256 else sk // 3 + 1], np.int32)
    scale = 0.7 / math.sqrt(d)
    out = np.full((b, hq, sq, d), np.nan, dtype=dt)
    lse = np.full((b, hq, sq), np.nan, dtype=np.float32)
    mshape = None if mask is None else (1,) * (4 - mask.ndim) + mask.shape
    expr, grid, block, args = A._flash_launch(q, k, v, causal, scale, mask, mshape, kl, out, lse,
                                              mma=impl == "flash_mma")
    assert expr == _emu_expr(case)
    _emu_launch(emu_kernels[expr], grid, block, args)
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    want, wl = ref.attention(f64(q), f64(k), f64(v), causal=causal, scale=scale, mask=mask,
                             key_lengths=kl, return_lse=True)
    assert_close(f64(out), want, dtype, tol={"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype])
    assert np.all(f64(out)[~np.isfinite(wl)] == 0.0)  # rows that see no key are zeros
    _assert_lse(lse, wl, 1e-4)


# --- GPU: both impls against the float64 reference -------------------------------------------
def _run(rng, dtype, b, hq, hkv, sq, sk, d, impl, causal=False, mask=None, key_lengths=None,
         return_lse=False, scale=None, layout="bhsd"):
    """Inputs with outliers on the device, NaN-poisoned out; checks out (and lse) vs reference."""
    import cupy

    qh, kh, vh = _qkv(rng, b, hq, hkv, sq, sk, d)
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in (qh, kh, vh))
    if layout == "bshd":  # views of [B, S, H, D] buffers (what a fused QKV projection gives)
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    out = nan_like((b, hq, sq, d), dtype)
    mask_h = None if mask is None else to_host(mask)
    res = A.attention(q, k, v, causal=causal, scale=scale, mask=mask, key_lengths=key_lengths,
                      impl=impl, return_lse=return_lse, out=out)
    want = ref.attention(qr, kr, vr, causal=causal, scale=scale, mask=mask_h,
                         key_lengths=None if key_lengths is None else to_host(cupy.asarray(key_lengths)),
                         return_lse=True)
    got = res[0] if return_lse else res
    assert got is out
    assert_close(got, want[0], dtype)
    assert np.all(to_host(got)[~np.isfinite(want[1])] == 0.0)
    if return_lse:
        assert res[1].dtype == np.float32 and res[1].shape == (b, hq, sq)
        _assert_lse(to_host(res[1]), want[1], {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[dtype])
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", A.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("impl,dtype", [("flash", dt) for dt in DTYPES]
                         + [("flash_mma", "float16"), ("flash_mma", "bfloat16")])
def test_gpu_flash_every_head_dim_and_dtype(rng, impl, dtype, d, causal):
    _run(rng, dtype, 2, 4, 2, 97, 97, d, impl, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_naive_dtypes(rng, dtype, d, causal):
    _run(rng, dtype, 2, 4, 2, 97, 97, d, "naive", causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 17, 97, 1000, 4096])
def test_gpu_sizes(rng, s, causal, impl):
    _run(rng, "float16", 1, 2, 2, s, s, 64, impl, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32[:2] + [(i, "bfloat16") for i in IMPLS])
def test_gpu_size_1000_other_dtypes(rng, impl, dtype):
    _run(rng, dtype, 1, 2, 1, 1000, 1000, 128, impl, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
def test_gpu_gqa(rng, ratio, impl):
    _run(rng, "bfloat16", 2, 2 * ratio, 2, 97, 97, 64, impl, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 100), (100, 17), (1, 1000), (1000, 1), (64, 97)])
def test_gpu_sq_ne_sk(rng, sq, sk, causal, impl, dtype):
    _run(rng, dtype, 1, 4, 2, sq, sk, 64, impl, causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask_shape,mask_dtype", [((97, 120), "float32"), ((2, 1, 97, 120), "float16"),
                                                   ((1, 4, 1, 120), "float32"), ((4, 97, 1), "bfloat16")])
def test_gpu_mask(rng, mask_shape, mask_dtype, impl):
    import cupy

    m = rng.standard_normal(mask_shape) * 2
    m = np.where(rng.random(mask_shape) < 0.25, -np.inf, m)
    m.reshape(-1, mask_shape[-1])[0] = -np.inf  # some row (or head / batch) sees nothing
    mask = cupy.asarray(m.astype(np_dtype(mask_dtype)))
    _run(rng, "float16", 2, 4, 2, 97, 120, 64, impl, causal=True, mask=mask, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("on_device", [False, True])
def test_gpu_key_lengths_with_zero_length(rng, on_device, impl):
    import cupy

    kl = np.array([0, 1, 50, 1000], dtype=np.int32)
    got = _run(rng, "bfloat16", 4, 2, 1, 17, 1000, 64, impl,
               key_lengths=cupy.asarray(kl) if on_device else kl.tolist(), return_lse=True)
    assert np.all(to_host(got)[0] == 0.0)  # a sequence with no keys gives zeros


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32)
def test_gpu_mask_key_lengths_causal_together(rng, impl, dtype):
    import cupy

    mask = cupy.asarray(np.where(rng.random((1, 1, 40, 70)) < 0.3, -np.inf, 0.5).astype(np.float32))
    _run(rng, dtype, 3, 6, 2, 40, 70, 96, impl, causal=True, mask=mask,
         key_lengths=[70, 33, 0], return_lse=True, scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_strided_bshd_inputs(rng, impl):
    _run(rng, "float16", 2, 8, 2, 97, 97, 128, impl, causal=True, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_empty_and_default_out(impl):
    import cupy

    q = cupy.zeros((0, 2, 5, 64), dtype=cupy.float16)
    o, lse = A.attention(q, q, q, impl=impl, return_lse=True)
    assert o.shape == (0, 2, 5, 64) and lse.shape == (0, 2, 5)
    q = cupy.ones((1, 2, 5, 64), dtype=cupy.float16)
    k = cupy.ones((1, 2, 0, 64), dtype=cupy.float16)
    o, lse = A.attention(q, k, k, impl=impl, return_lse=True)  # no keys at all: zeros, -inf
    assert float(cupy.abs(o).max()) == 0.0 and bool(cupy.all(lse == -cupy.inf))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash", "flash_mma"])
def test_gpu_flash_memory_is_linear_in_sequence_length(impl):
    """Causal S=32768, B*H=8, D=64 fp16: naive S would be 8*32768^2*2 B = 16 GiB in fp16
    (32 GiB in fp32); flash allocates only out (32 MiB)."""
    import cupy

    b, h, s, d = 1, 8, 32768, 64
    rng = np.random.default_rng(7)
    q, k, v = (cupy.asarray(rng.standard_normal((b, h, s, d)).astype(np.float16)) for _ in range(3))
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out = A.attention(q, k, v, causal=True, impl=impl)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    assert grown <= out.nbytes + (1 << 20), f"flash grew the pool by {grown} bytes"
    assert grown < (1 << 30)  # far below the 16-32 GiB of a materialised S
    # spot-check rows against float64 NumPy (row i sees keys 0..i)
    qh, kh, vh, oh = (cupy.asnumpy(x[0]).astype(np.float64) for x in (q, k, v, out))
    for hh, i in [(0, 0), (3, 12345), (7, s - 1)]:
        sc = kh[hh, :i + 1] @ qh[hh, i] / math.sqrt(d)
        p = np.exp(sc - sc.max())
        want = (p / p.sum()) @ vh[hh, :i + 1]
        assert np.linalg.norm(oh[hh, i] - want) <= 2e-3 * np.linalg.norm(want)
