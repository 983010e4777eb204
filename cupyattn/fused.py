"""The fused decode step: projections with their neighbouring ops fused in, for a few rows of
activations (one token per sequence, batch <= 16 is what they are built for).

Kernels in ``kernels_cu/fused_decode.cu``; each is the skinny GEMM (``gemm_nt(impl="skinny")``'s
main loop, ``kernels_cu/skinny.cuh``) with a prologue and an epilogue:

==============================  ==============================================  ===================
op                              computes                                        replaces
==============================  ==============================================  ===================
rmsnorm_qkv_rope_append         q = rope(rmsnorm(x) Wq^T) -> q_out;             rmsnorm, gemm_nt,
                                rope(rmsnorm(x) Wk^T), rmsnorm(x) Wv^T ->       KVCache.append_qkv
                                the cache at each sequence's length, which
                                advances by one
gemm_residual                   x += a W^T                                      gemm_nt, add
rmsnorm_gate_up_swiglu          silu(h Wg^T) * (h Wu^T), h = rmsnorm(x)         rmsnorm, gemm_nt,
                                                                                swiglu
rmsnorm_gemm                    rmsnorm(x) W^T                                  rmsnorm, gemm_nt
==============================  ==============================================  ===================

With ``decode_attention(..., fused_combine=True)`` a Llama-style layer's decode step is 5
kernels (tinylm's fused step, ``tinylm.Transformer(fused=True)``). Every rounding of the unfused
ops is kept (the normalised activations, the projection output before RoPE, the residual add or
SwiGLU are each rounded to the dtype where the unfused op writes them), so the fused ops agree
with the unfused ones to float32 summation order. The weights are the unfused ones, unchanged:
a block reads the rows its epilogue needs (the matching gate and up rows, both rows of a RoPE
pair) wherever they are.

Passed the GPU tier and the sanitizers on an H100 (2026-11-26) and is tinylm's default decode
step there (``tinylm.config.TINYLM_FUSED_DECODE``; benchmarks/results/2026-11-26-h100/README.md). With
``config.FUSED_DECODE_PDL`` the kernels are launched with programmatic dependent launch (needs
cuda-bindings; not timed on a GPU yet, so off).

Shapes: ``x`` [..., K] with evenly strided rows (M = the product of the leading dims), last dim
contiguous; weights [N, K] C-contiguous, all of x's dtype (float32, float16 or bfloat16); norm
weights [K]. None of the ops synchronises or allocates when ``out`` is given, so a decode step
made of them can be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks as C
from . import device, config
from ._loader import VEC16, KernelSpec, cbool, ctype, get_function, launch, ptr_or_null
from .config import DTYPES, FUSED_SKINNY, INT32_MAX, MMA_DTYPES
from .kvcache import ROPE_STYLES, KVCache

_S = FUSED_SKINNY
_TILE = f"{_S.warps}, {_S.n_tiles}, {_S.chunks}"
_NR = 8 * _S.n_tiles  # outputs per block


def _expr(kernel: str, dtype, neox=None) -> str:
    extra = "" if neox is None else f"{cbool(neox)}, "
    return f"{kernel}<{ctype(dtype)}, {extra}{_TILE}>"


def _exprs(t) -> tuple[str, ...]:
    return (tuple(_expr("norm_qkv_rope_append_kernel", t, neox) for neox in (False, True))
            + tuple(_expr(k, t) for k in ("gemm_residual_kernel", "norm_gate_up_swiglu_kernel", "norm_gemm_kernel")))


SPEC = KernelSpec(
    "fused_decode", "fused_decode.cu", tuple(e for t in DTYPES for e in _exprs(t)),
    # fp16 / bf16: the projections are skinny mma tiles (config.IMPL_MIN_CC["fused", "skinny"])
    needs=tuple((e, config.impl_min_cc("fused", "skinny", t), 0) for t in MMA_DTYPES for e in _exprs(t)))


def _pdl() -> bool:
    """PDL launches: config.FUSED_DECODE_PDL, on sm_90 and newer (griddepcontrol; below, the
    kernels' pdl_wait / pdl_launch_dependents compile to nothing and the attribute is not set)."""
    return bool(config.FUSED_DECODE_PDL) and device.compute_capability() >= 90


# --- checks --------------------------------------------------------------------------------------
def _rows(fn, name, x):
    """(M, row stride) of x [..., K] seen as M rows; ValueError unless the rows are evenly strided
    with the last dim contiguous."""
    C.check_array(fn, name, x, min_ndim=1)
    k = x.shape[-1]
    if k > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{fn}(): {name} must have a contiguous last dim, got strides {x.strides}")
    dims = [(n, st // x.itemsize) for n, st in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    rows, ld = (1, k) if not dims else dims[-1]
    for n, st in reversed(dims[:-1]):
        if st != ld * rows:
            raise ValueError(f"{fn}(): the leading dims of {name} {tuple(x.shape)} must collapse to one "
                             f"row stride (strides {x.strides})")
        rows *= n
    return int(np.prod(x.shape[:-1], dtype=np.int64)), ld


def _weights(fn, x, norm_weight, w, w_name, n_rows=None, x_name="x", norm=True):
    """Common checks of x, the norm weight (``norm``: the op has one, so None is an error naming
    it) and the weight matrix w [N, K]."""
    m, ldx = _rows(fn, x_name, x)
    C.require_impl(fn, "fused", "skinny", x.dtype)   # bf16 below sm_80: no kernel, a clear error
    k = x.shape[-1]
    C.check_array(fn, w_name, w, ndim=2)
    C.check_same_dtype(fn, w_name, w, x_name, x)
    if w.shape[1] != k or (n_rows is not None and w.shape[0] != n_rows) or not w.flags.c_contiguous:
        want = f"[{n_rows if n_rows is not None else 'N'}, K={k}]"
        raise ValueError(f"{fn}(): {w_name} must be C-contiguous of shape {want}, got {tuple(w.shape)}")
    if norm:
        C.check_array(fn, "norm_weight", norm_weight, ndim=1)
        C.check_same_dtype(fn, "norm_weight", norm_weight, x_name, x)
        if norm_weight.shape[0] != k or not norm_weight.flags.c_contiguous:
            raise ValueError(f"{fn}(): norm_weight must be contiguous of shape ({k},), got "
                             f"{tuple(norm_weight.shape)}")
    for name, v in ((f"M (rows of {x_name})", m), ("K", k), (f"N ({w_name}.shape[0])", w.shape[0])):
        C.check_int32(fn, name, v)
    return m, ldx, k


def _vec_ok(x, ldx, *arrays) -> int:
    """1 when every operand starts 16-byte aligned and x's row stride is a whole chunk."""
    v = VEC16[ctype(x.dtype)]
    return int(ldx % v == 0 and all(a.data.ptr % 16 == 0 for a in (x,) + arrays))


def _grid(fn, m, n_tiles):
    blocks = -(-m // 16) * n_tiles
    if blocks > INT32_MAX:
        raise ValueError(f"{fn}(): {m} rows x {n_tiles} column tiles need more than 2^31-1 blocks")
    return (blocks,), (32 * _S.warps,)


def _out(fn, out, shape, dtype, inputs, name="out"):
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    C.check_out(fn, out, shape, dtype, name=name)
    C.check_no_overlap(fn, out, inputs, out_name=name)
    return out


def _eps(fn, eps):
    return np.float32(C.check_real(fn, "eps", eps, minimum=0.0))


# --- ops -----------------------------------------------------------------------------------------
def rmsnorm_qkv_rope_append(x, norm_weight, wqkv, cache, layer, num_heads, eps=1e-5, rope_base=10000.0,
                            rope_style="adjacent", q_out=None, rope_freq_div=None):
    """One decode token per sequence: RMSNorm, the packed QKV projection, RoPE and the cache
    append, in one kernel; the layer's lengths advance by one.

    Equivalent to ``cache.append_qkv(layer, gemm_nt(rmsnorm(x, norm_weight, eps), wqkv),
    num_heads, rope_base, rope_style)``: token b sits at position ``p = lengths[layer, b]`` (read
    on the device), its q heads turn by p into ``q_out``, its k heads turn by p into cache row p
    and its v heads go to cache row p.

    Parameters
    ----------
    x : cupy.ndarray [batch, 1, K]
        The residual stream (one token per sequence), the cache's dtype.
    norm_weight : cupy.ndarray [K]
    wqkv : cupy.ndarray [(num_heads + 2 * num_kv_heads) * head_dim, K]
        Rows of Wq, Wk, Wv (y = x @ W^T orientation), C-contiguous. head_dim must be a multiple
        of 16 (a block owns 8 rotation pairs of one head).
    cache : KVCache
    layer, num_heads : int
    eps : float
        RMSNorm epsilon, >= 0.
    rope_base, rope_style
        As :meth:`KVCache.append_qkv`.
    q_out : cupy.ndarray [batch, num_heads, 1, head_dim], optional
        C-contiguous, the cache's dtype.
    rope_freq_div : cupy.ndarray [head_dim / 2], float32, optional
        As :meth:`KVCache.append_qkv`: pair i's frequency divided by ``rope_freq_div[i]``.

    Returns
    -------
    q_out : [batch, num_heads, 1, head_dim], the rotated queries.

    Raises
    ------
    ValueError
        If a sequence's cache is full: nothing is launched or written.
    """
    fn = "rmsnorm_qkv_rope_append"
    if not isinstance(cache, KVCache) or hasattr(cache, "block_table"):  # PagedKVCache: another layout
        raise TypeError(f"{fn}(): cache must be a cupyattn.KVCache (contiguous), got {type(cache).__name__}")
    layer = cache.check_layer(fn, layer)
    hq = C.check_positive_int(fn, "num_heads", num_heads)
    b, d, hkv = cache.batch, cache.head_dim, cache.num_kv_heads
    C.check_array(fn, "x", x, ndim=3)
    C.check_same_dtype(fn, "x", x, "the cache", cache.k)
    if x.shape[:2] != (b, 1):
        raise ValueError(f"{fn}(): x has shape {tuple(x.shape)}, expected [batch={b}, 1, K]")
    if d % 16:
        raise ValueError(f"{fn}(): the cache's head_dim {d} is not a multiple of 16")
    n = (hq + 2 * hkv) * d
    _, ldx, k = _weights(fn, x, norm_weight, wqkv, "wqkv", n)
    eps = _eps(fn, eps)
    base = C.check_real(fn, "rope_base", rope_base, minimum=0.0, strict=True)
    C.check_choice(fn, "rope_style", rope_style, ROPE_STYLES)
    cached = cache.device_arrays()
    C.check_no_overlap(fn, x, cached, out_name="x")
    q_out = _out(fn, q_out, (b, hq, 1, d), x.dtype, {"x": x, "norm_weight": norm_weight, "wqkv": wqkv, **cached},
                 name="q_out")
    C.check_freq_div(fn, rope_freq_div, d)
    cache._check_capacity(fn, np.ones(b, dtype=np.int64), [layer])
    kern = get_function(SPEC, _expr("norm_qkv_rope_append_kernel", x.dtype, rope_style == "neox"))
    i32 = np.int32
    grid, block = _grid(fn, b, n // 16)
    launch(kern, grid, block,
           (x, norm_weight, wqkv, q_out, cache.k[layer], cache.v[layer], cache.lengths[layer], cache.ticket,
            i32(b), i32(k), np.int64(ldx), i32(hq), i32(hkv), i32(d), i32(cache.max_seq), i32(n // 16), eps,
            np.float64(-math.log2(base) / (d // 2)), ptr_or_null(rope_freq_div), i32(_vec_ok(x, ldx, norm_weight, wqkv))),
           pdl=_pdl())
    cache.host_lengths[layer] += 1
    return q_out


def gemm_residual(x, a, w):
    """``x += a @ w^T`` in one kernel (a projection and the residual add after it), in place.

    Parameters
    ----------
    x : cupy.ndarray [..., N], C-contiguous
        The residual stream; updated in place: each element becomes ``x + T(a w^T)`` rounded to
        the dtype, as ``add(x, gemm_nt(a, w))``.
    a : cupy.ndarray [..., K], same leading dims as x
        Evenly strided rows, last dim contiguous; must not overlap x.
    w : cupy.ndarray [N, K], C-contiguous

    Returns
    -------
    x
    """
    fn = "gemm_residual"
    m, lda, k = _weights(fn, a, None, w, "w", x_name="a", norm=False)
    C.check_array(fn, "x", x, min_ndim=1)
    if tuple(x.shape) != tuple(a.shape[:-1]) + (w.shape[0],):
        raise ValueError(f"{fn}(): x has shape {tuple(x.shape)}, expected {tuple(a.shape[:-1]) + (w.shape[0],)} "
                         f"(a's leading dims, w's rows)")
    C.check_out(fn, x, x.shape, a.dtype, name="x")
    C.check_no_overlap(fn, x, {"a": a, "w": w}, out_name="x")
    n = w.shape[0]
    if m == 0 or n == 0:
        return x
    kern = get_function(SPEC, _expr("gemm_residual_kernel", x.dtype))
    grid, block = _grid(fn, m, -(-n // _NR))
    i32 = np.int32
    launch(kern, grid, block, (a, w, x, i32(m), i32(n), i32(k), np.int64(lda), i32(-(-n // _NR)),
                               i32(_vec_ok(a, lda, w))), pdl=_pdl())
    return x


def rmsnorm_gate_up_swiglu(x, norm_weight, w_gate_up, eps=1e-5, out=None):
    """``silu(h @ Wg^T) * (h @ Wu^T)`` with ``h = rmsnorm(x, norm_weight, eps)``, in one kernel.

    Parameters
    ----------
    x : cupy.ndarray [..., K]
    norm_weight : cupy.ndarray [K]
    w_gate_up : cupy.ndarray [2F, K], C-contiguous
        Rows of Wgate then Wup (the packed projection of ``layers.swiglu``'s docstring).
    eps : float
    out : cupy.ndarray [..., F], optional
        C-contiguous; must not overlap the inputs.

    Returns
    -------
    cupy.ndarray [..., F]
    """
    fn = "rmsnorm_gate_up_swiglu"
    m, ldx, k = _weights(fn, x, norm_weight, w_gate_up, "w_gate_up")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"{fn}(): w_gate_up has {w_gate_up.shape[0]} rows, expected 2F (gate rows, then up rows)")
    f = w_gate_up.shape[0] // 2
    eps = _eps(fn, eps)
    out = _out(fn, out, tuple(x.shape[:-1]) + (f,), x.dtype, {"x": x, "norm_weight": norm_weight, "w_gate_up": w_gate_up})
    if m == 0 or f == 0:
        return out
    return _launch_norm_op(fn, "norm_gate_up_swiglu_kernel", x, ldx, norm_weight, w_gate_up, out, m, f, k,
                           -(-f // (_NR // 2)), eps)


def rmsnorm_gemm(x, norm_weight, w, eps=1e-5, out=None):
    """``rmsnorm(x, norm_weight, eps) @ w^T`` in one kernel (the output norm and the logits).

    Parameters
    ----------
    x : cupy.ndarray [..., K]
    norm_weight : cupy.ndarray [K]
    w : cupy.ndarray [N, K], C-contiguous
    eps : float
    out : cupy.ndarray [..., N], optional
        C-contiguous; must not overlap the inputs.

    Returns
    -------
    cupy.ndarray [..., N]
    """
    fn = "rmsnorm_gemm"
    m, ldx, k = _weights(fn, x, norm_weight, w, "w")
    eps = _eps(fn, eps)
    n = w.shape[0]
    out = _out(fn, out, tuple(x.shape[:-1]) + (n,), x.dtype, {"x": x, "norm_weight": norm_weight, "w": w})
    if m == 0 or n == 0:
        return out
    return _launch_norm_op(fn, "norm_gemm_kernel", x, ldx, norm_weight, w, out, m, n, k, -(-n // _NR), eps)


def _launch_norm_op(fn, kernel, x, ldx, norm_weight, w, out, m, n_out, k, tiles, eps):
    """The launch shared by the two RMSNorm-prologue ops whose output is [M, n_out]."""
    kern = get_function(SPEC, _expr(kernel, x.dtype))
    grid, block = _grid(fn, m, tiles)
    i32 = np.int32
    launch(kern, grid, block, (x, norm_weight, w, out, i32(m), i32(n_out), i32(k), np.int64(ldx), i32(tiles), eps,
                               i32(_vec_ok(x, ldx, norm_weight, w))), pdl=_pdl())
    return out


__all__ = ["rmsnorm_qkv_rope_append", "gemm_residual", "rmsnorm_gate_up_swiglu", "rmsnorm_gemm"]
