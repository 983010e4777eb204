"""Layer ops of a Llama-style decoder: RMSNorm (alone or fused with the residual add before
it), rotary embedding, SwiGLU, residual add, token embedding. Kernels in
``kernels_cu/layers.cu`` (spec ``"layers"``).

Every op takes CuPy arrays on the current device, checks them (naming the argument) before it
allocates or launches anything, computes in float32 whatever the element dtype, writes into
``out`` when given (else a new C-contiguous array) and runs on the current CuPy stream. None of
them synchronises with the host.

Example
-------
>>> h = embedding(ids, tok_embd)                        # ids [B, T] -> [B, T, dim]
>>> a = rmsnorm(h, attn_norm)                           # [B, T, dim]
>>> h, a = add_rmsnorm(h, attn_out, ffn_norm, out=a)    # h += attn_out; a = rmsnorm(h)
>>> q = rope(q, positions, base=1e5, out=q)             # q [B, H, T, hd], in place
>>> h = add(h, attn_out, out=h)                         # residual, in place
>>> f = swiglu(gu[..., :F], gu[..., F:])                # silu(gate) * up, halves read in place
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks as C
from . import options
from ._loader import CTYPES, INDEX_CTYPES, VEC16, KernelSpec, cbool, ctype, defines, get_function, ptr_or_null

# rmsnorm weight types: the activation's own, or float32 next to fp16/bf16 activations
RMSNORM_WEIGHT_CTYPES = {c: tuple(dict.fromkeys((c, CTYPES[np.dtype(np.float32)]))) for c in CTYPES.values()}
from .config import (ROPE_STYLES, DTYPES, INT32_MAX, LAYERS_MAX_BLOCKS, LAYERS_THREADS, MAX_GRID_X,
                     RMSNORM_IMPLS, RMSNORM_WARPS)


# --- kernel spec: every instantiation the dispatch below can ask for -----------------------------
def _exprs():
    cts = [ctype(d) for d in DTYPES]
    out = []
    for kind in ("rmsnorm_warp_kernel", "rmsnorm_block_kernel"):
        out += [f"{kind}<{t}, {w}, {v}, {cbool(add)}>" for t in cts for w in RMSNORM_WEIGHT_CTYPES[t]
                for v in (1, VEC16[t]) for add in (False, True)]
    for t in cts:
        out += [f"rope_kernel<{t}, {cbool(neox)}, {cbool(pv)}, {i}>" for neox, pv in
                ((False, False), (False, True), (True, False)) for i in INDEX_CTYPES.values()]
    for kind in ("swiglu_kernel", "geglu_kernel", "add_kernel"):
        out += [f"{kind}<{t}, {v}>" for t in cts for v in (1, VEC16[t])]
    out += [f"{kind}<{t}>" for kind in ("bias_add_kernel", "softcap_kernel", "head_rmsnorm_kernel") for t in cts]
    out += [f"embedding_kernel<{t}, {i}, {v}>" for t in cts for i in INDEX_CTYPES.values()
            for v in (1, VEC16[t])]
    return tuple(out)


SPEC = KernelSpec("layers", "layers.cu", _exprs(),
                  options=defines(RMSNORM_WARPS=RMSNORM_WARPS, LAYERS_THREADS=LAYERS_THREADS))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _ptr(a) -> int:
    return a.data.ptr


def _aligned(nbytes: int, *arrays) -> bool:
    return all(_ptr(a) % nbytes == 0 for a in arrays)


def _vec_width(ct: str, n: int, *arrays) -> int:
    """16-byte vectors when ``n`` elements split evenly and every array starts 16-byte aligned."""
    v = VEC16[ct]
    return v if n % v == 0 and _aligned(16, *arrays) else 1


def _row_block(nvec: int) -> tuple[int, int]:
    """(threads over a row's ``nvec`` work items, rows per block) for 256-thread 2-D blocks."""
    bx = min(_pow2_at_least(max(nvec, 1)), LAYERS_THREADS)
    return bx, LAYERS_THREADS // bx


def _new_or_out(fn, out, shape, dtype, inputs=None, in_place=()):
    """A new array, or ``out`` checked: shape, dtype, C-contiguous, and no memory shared with
    ``inputs`` ({name: array}) unless it is exactly one of the ``in_place`` ones."""
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    C.check_out(fn, out, shape, dtype)
    if inputs:
        C.check_no_overlap(fn, out, inputs, in_place=in_place)
    return out


# --- rmsnorm ---------------------------------------------------------------------------------------
def rmsnorm(x, weight, eps=1e-5, out=None, impl=None):
    """Root-mean-square norm over the last dimension, ``x / sqrt(mean(x**2) + eps) * weight``.

    Parameters
    ----------
    x : cupy.ndarray [..., D]
        float32, float16 or bfloat16, any D >= 1. A non-C-contiguous x is copied first.
    weight : cupy.ndarray [D]
        Same dtype as ``x``, or float32 (then fp16/bf16 activations are scaled by the unrounded
        float32 weight).
    eps : float
        Added to the mean of squares; >= 0.
    out : cupy.ndarray [..., D], optional
        C-contiguous, dtype of ``x``; may be ``x`` itself (in place), must not otherwise
        overlap ``x`` or ``weight`` (ValueError).
    impl : {None, "warp", "block"} ("auto": None)
        Which kernel: one warp per row, or one block per row; None takes the warp kernel for
        D <= 1024 (options.DEFAULTS["rmsnorm"]).

    Returns
    -------
    cupy.ndarray [..., D] of x's dtype. Sum of squares, scale and product are float32.
    """
    fn = "rmsnorm"
    _check_norm(fn, x, weight, impl)
    eps = C.check_real(fn, "eps", eps, minimum=0.0)
    out = _new_or_out(fn, out, x.shape, x.dtype, {"x": x, "weight": weight}, in_place=("x",))
    _launch_norm(x, None, weight, out, eps, impl)
    return out


def add_rmsnorm(x, r, weight, eps=1e-5, out=None, impl=None):
    """Residual add then RMSNorm in one kernel: ``x += r; out = rmsnorm(x, weight, eps)``.

    The pre-norm block boundary of a Llama-style decoder (``x = x + branch; h = norm(x)``): one
    launch instead of two, and the residual stream is read once. The sum is rounded to x's dtype
    and stored in ``x`` before it is normalised, so the results equal :func:`add` followed by
    :func:`rmsnorm` with the same ``impl`` bit for bit (the norm reads the rounded sum, as the
    two-op sequence does).

    Parameters
    ----------
    x : cupy.ndarray [..., D], C-contiguous
        The residual stream, updated in place. float32, float16 or bfloat16.
    r : cupy.ndarray [..., D]
        The branch output added to ``x``; same shape and dtype (copied first if not C-contiguous).
    weight, eps, impl
        As for :func:`rmsnorm`.
    out : cupy.ndarray [..., D], optional
        C-contiguous, dtype of ``x``; must not overlap ``x`` or ``r``.

    Returns
    -------
    (x, out) : the updated residual stream and the normalised rows.

    Example
    -------
    >>> x, h = add_rmsnorm(x, attn_out, ffn_norm, eps=1e-5, out=h)   # x [B, T, dim]
    """
    fn = "add_rmsnorm"
    _check_norm(fn, x, weight, impl)
    C.check_array(fn, "r", r)
    C.check_same_dtype(fn, "r", r, "x", x)
    if tuple(r.shape) != tuple(x.shape):
        raise ValueError(f"{fn}(): r has shape {tuple(r.shape)} but x has {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{fn}(): x is updated in place and must be C-contiguous")
    eps = C.check_real(fn, "eps", eps, minimum=0.0)
    C.check_no_overlap(fn, x, {"r": r, "weight": weight}, in_place=("r",), out_name="x")
    out = _new_or_out(fn, out, x.shape, x.dtype, {"x": x, "r": r, "weight": weight})
    _launch_norm(x, cupy.ascontiguousarray(r), weight, out, eps, impl)
    return x, out


def _check_norm(fn, x, weight, impl):
    C.check_array(fn, "x", x, min_ndim=1)
    C.check_array(fn, "weight", weight, ndim=1)
    d = x.shape[-1]
    if weight.shape[0] != d:
        raise ValueError(f"{fn}(): weight has shape {tuple(weight.shape)}, expected ({d},) (last dim of x)")
    if np.dtype(weight.dtype) not in (np.dtype(x.dtype), np.dtype(np.float32)):
        also = "" if np.dtype(x.dtype) == np.float32 else " or float32"
        raise TypeError(f"{fn}(): weight has dtype {C.dtype_name(weight.dtype)}; expected "
                        f"{C.dtype_name(x.dtype)} (as x){also}")
    C.check_choice(fn, "impl", impl, (None,) + RMSNORM_IMPLS)
    C.check_int32(fn, "D (x.shape[-1])", d)
    rows = x.size // d if d else 0
    if rows > MAX_GRID_X:  # the block kernel takes one block per row
        raise ValueError(f"{fn}(): {rows} rows are more than one launch's grid holds ({MAX_GRID_X})")


def _launch_norm(x, r, weight, out, eps, impl):
    """rmsnorm (r None) or add + rmsnorm (r: the residual branch, x updated in place)."""
    d = x.shape[-1]
    rows = x.size // d if d else 0
    if rows == 0 or d == 0:
        return
    x = cupy.ascontiguousarray(x)
    weight = cupy.ascontiguousarray(weight)
    t, w = ctype(x.dtype), ctype(weight.dtype)
    v = VEC16[t]
    vec_arrays = (x, out) if r is None else (x, r, out)
    if not (d % v == 0 and _aligned(16, *vec_arrays) and _aligned(weight.itemsize * v, weight)):
        v = 1
    if options.is_default(impl):  # options.DEFAULTS["rmsnorm"]
        impl = options.choose(options.Call("rmsnorm", x.dtype, d))
    add = cbool(r is not None)
    args = (x, ptr_or_null(r), weight, out, np.int64(rows), np.int32(d), np.float32(eps))
    if impl == "warp":
        kern = get_function(SPEC, f"rmsnorm_warp_kernel<{t}, {w}, {v}, {add}>")
        kern(((rows + RMSNORM_WARPS - 1) // RMSNORM_WARPS,), (32 * RMSNORM_WARPS,), args)
    else:
        threads = min(1024, max(64, _pow2_at_least(-(-(d // v) // 4))))
        kern = get_function(SPEC, f"rmsnorm_block_kernel<{t}, {w}, {v}, {add}>")
        kern((rows,), (threads,), args)


# --- rope ------------------------------------------------------------------------------------------


def rope(x, positions, base=10000.0, style="adjacent", out=None, freq_div=None, rotary_dim=None):
    """Rotary position embedding of ``x`` [B, H, T, D] at integer ``positions`` [B, T].

    Pair i of each row turns by ``positions[b, t] * base**(-2i/R) / freq_div[i]``, R = rotary_dim
    (D by default). ``style="adjacent"`` pairs (x[2i], x[2i+1]) (GGUF / llama.cpp "normal" rope);
    ``"neox"`` pairs (x[i], x[i+R/2]). With R < D only the first R dims of each row turn (GPT-NeoX,
    Phi-4-mini: RoPE over part of the head, as flash-attn's ``apply_rotary_emb`` with cos/sin of
    R/2 columns and HF's ``partial_rotary_factor``); the others are copied as they are.

    Parameters
    ----------
    x : cupy.ndarray [B, H, T, D]
        float32/float16/bfloat16, D even. Any strides in B, H, T (q/k views of a fused
        projection are fine); the last dim must be contiguous when ``out is x``, otherwise such
        an x is copied first.
    positions : cupy.ndarray [B, T]
        int32 or int64, read as they are (an int64 position past 2^31 is not narrowed).
        Negative positions rotate backwards.
    base : float
        > 0 (10000 for Llama 2, 100000 for SmolLM2).
    out : cupy.ndarray [B, H, T, D], optional
        ``x`` itself (in place, x's strides kept) or a C-contiguous array of x's dtype that does
        not overlap ``x``, ``positions`` or ``freq_div`` (ValueError).
    freq_div : cupy.ndarray [R/2] float32, optional
        Per-pair frequency divisors (Llama 3.1+'s ``rope_freqs``, linear scaling, LongRoPE's
        tables; float32's largest value turns a pair not at all), read as they are (positive).
    rotary_dim : int, optional
        R, even, 2 <= R <= D (None: D).

    The angle is formed and reduced modulo 2*pi in double precision, then rotated in float32,
    so positions in the tens of thousands lose no accuracy (see rope_kernel in layers.cu).
    """
    fn = "rope"
    C.check_array(fn, "x", x, ndim=4)
    b, h, t, d = x.shape
    if d % 2 or d == 0:
        raise ValueError(f"{fn}(): the last dim of x (D={d}) must be even and > 0")
    C.check_array(fn, "positions", positions, dtypes=tuple(INDEX_CTYPES), ndim=2)
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"{fn}(): positions has shape {tuple(positions.shape)}, "
                         f"expected ({b}, {t}) = [B, T] of x")
    base = C.check_real(fn, "base", base, minimum=0.0, strict=True)
    C.check_choice(fn, "style", style, ROPE_STYLES)
    rot = d if rotary_dim is None else C.check_int(fn, "rotary_dim", rotary_dim, minimum=2, maximum=d)
    if rot % 2:
        raise ValueError(f"{fn}(): rotary_dim must be even (pairs of dims turn), got {rot}")
    C.check_freq_div(fn, freq_div, rot, name="freq_div", what="rotary_dim")
    if b * h * t > INT32_MAX:
        raise ValueError(f"{fn}(): B*H*T = {b * h * t} rows is more than this kernel indexes (2^31 - 1)")
    read = {"positions": positions} | ({} if freq_div is None else {"freq_div": freq_div})
    if out is x:
        C.check_last_contiguous(fn, "x (rotated in place)", x)
        if any(s == 0 and n > 1 for s, n in zip(x.strides, x.shape)):
            raise ValueError(f"{fn}(): x has a broadcast (stride 0) dimension and cannot be rotated in place")
        if freq_div is not None:
            C.check_no_overlap(fn, x, {"freq_div": freq_div}, out_name="x")
    else:
        out = _new_or_out(fn, out, x.shape, x.dtype, {"x": x, **read})
    if x.size == 0:
        return out
    if x.strides[-1] != x.itemsize:
        x = cupy.ascontiguousarray(x)
    pos = cupy.ascontiguousarray(positions)
    half = rot // 2
    ct = ctype(x.dtype)
    xs = [s // x.itemsize for s in x.strides[:3]]
    ys = [s // out.itemsize for s in out.strides[:3]]
    neox = style == "neox"
    # adjacent pairs load as one 2-element vector when every row start is 2-element aligned
    pv = (not neox and _aligned(2 * x.itemsize, x, out)
          and all(s % 2 == 0 for s, n in zip(xs + ys, (b, h, t) * 2) if n > 1))
    kern = get_function(SPEC, f"rope_kernel<{ct}, {cbool(neox)}, {cbool(pv)}, "
                              f"{INDEX_CTYPES[np.dtype(pos.dtype)]}>")
    rows = b * h * t
    bx, by = _row_block(half)
    grid = min(-(-rows // by), LAYERS_MAX_BLOCKS)
    if rot < d and out is not x:  # the dims past R are copied as they are
        out[..., rot:] = x[..., rot:]
    kern((grid,), (bx, by), (x, out, pos, ptr_or_null(freq_div), np.int32(rows), np.int32(h), np.int32(t),
                             np.int32(half),
                             *(np.int64(s) for s in xs), *(np.int64(s) for s in ys),
                             np.float64(-math.log2(base) / half)))
    return out


# --- elementwise -----------------------------------------------------------------------------------
def _check_pair(fn, a_name, a, b_name, b, out):
    """Two same-shape, same-dtype inputs; returns the output array (given or new). ``out`` may
    be exactly ``a`` or ``b`` (elementwise: each thread reads an element, then writes it), but
    must not otherwise overlap them."""
    C.check_array(fn, a_name, a)
    C.check_array(fn, b_name, b)
    C.check_same_dtype(fn, b_name, b, a_name, a)
    if tuple(b.shape) != tuple(a.shape):
        raise ValueError(f"{fn}(): {b_name} has shape {tuple(b.shape)} but {a_name} has {tuple(a.shape)}")
    return _new_or_out(fn, out, a.shape, a.dtype, {a_name: a, b_name: b}, in_place=(a_name, b_name))


def _rows(x):
    """(rows, ld): x [..., C] seen as rows of C contiguous elements ``ld`` apart, or None when
    its leading dims do not collapse to one row stride (then the caller copies it)."""
    c = x.shape[-1]
    if c > 1 and x.strides[-1] != x.itemsize:
        return None
    dims = [(n, st // x.itemsize) for n, st in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    if not dims:
        return 1, c
    rows, ld = dims[-1]
    for n, st in reversed(dims[:-1]):
        if st != ld * rows:
            return None
        rows *= n
    return (rows, ld) if ld >= c else None


def swiglu(gate, up, out=None):
    """``silu(gate) * up`` elementwise (the SwiGLU FFN's gate), float32 math.

    gate, up: cupy arrays of one shape [..., F] and dtype (float32/float16/bfloat16). Rows may
    be strided: views whose leading dims collapse to one row stride, such as the two halves
    ``gu[..., :F]``, ``gu[..., F:]`` of a packed gate|up projection, are read in place (no copy,
    no allocation); other layouts are copied first. out: C-contiguous, same shape/dtype; may be
    gate or up when those are C-contiguous.
    """
    return _gated("swiglu", "swiglu_kernel", gate, up, out)


def geglu(gate, up, out=None):
    """``gelu(gate) * up`` with GELU's tanh form (Gemma's FFN gate), float32 math; arguments as
    :func:`swiglu`."""
    return _gated("geglu", "geglu_kernel", gate, up, out)


def _gated(fn, kernel, gate, up, out):
    out = _check_pair(fn, "gate", gate, "up", up, out)
    if out.size == 0:
        return out
    ct = ctype(gate.dtype)
    if gate.flags.c_contiguous and up.flags.c_contiguous:
        geo = [(1, gate.size)] * 3  # one row of n: the widest vectors
        cols = gate.size
    else:
        geo = [_rows(gate), _rows(up)]
        if geo[0] is None:
            gate = cupy.ascontiguousarray(gate)
            geo[0] = _rows(gate)
        if geo[1] is None:
            up = cupy.ascontiguousarray(up)
            geo[1] = _rows(up)
        cols = gate.shape[-1]
        geo.append((out.size // cols, cols))
    rows = geo[0][0]
    lds = [g[1] for g in geo]
    v = VEC16[ct]
    if not (cols % v == 0 and all(ld % v == 0 for ld in lds) and _aligned(16, gate, up, out)):
        v = 1
    nv = rows * (cols // v)
    kern = get_function(SPEC, f"{kernel}<{ct}, {v}>")
    kern((min(-(-nv // LAYERS_THREADS), LAYERS_MAX_BLOCKS * 8),), (LAYERS_THREADS,),
         (gate, up, out, np.int64(rows), np.int64(cols // v), *map(np.int64, lds)))
    return out


def add(x, y, out=None):
    """Residual add ``x + y`` (same shape and dtype, float32 math, rounded once).

    out: C-contiguous, same shape/dtype; may be x (``add(h, r, out=h)`` in place) or y.
    """
    fn = "add"
    out = _check_pair(fn, "x", x, "y", y, out)
    n = x.size
    if n == 0:
        return out
    x, y = cupy.ascontiguousarray(x), cupy.ascontiguousarray(y)
    ct = ctype(x.dtype)
    v = _vec_width(ct, n, x, y, out)
    nv = n // v
    kern = get_function(SPEC, f"add_kernel<{ct}, {v}>")
    kern((min(-(-nv // LAYERS_THREADS), LAYERS_MAX_BLOCKS * 8),), (LAYERS_THREADS,), (x, y, out, np.int64(nv)))
    return out


# --- embedding -------------------------------------------------------------------------------------
def embedding(ids, table, out=None):
    """Rows of ``table`` [V, D] picked by ``ids`` [...] -> [..., D] (table's dtype).

    ids: int32 or int64 cupy array of any shape. An id outside [0, V) -- negative ids included,
    there is no Python-style wrap-around -- yields a row of zeros: checking ids on the host would
    need a device sync, so the kernel guards the read instead. table: float32/float16/bfloat16,
    last dim contiguous (rows may be strided). out: C-contiguous [..., D] of table's dtype.
    """
    fn = "embedding"
    C.check_array(fn, "ids", ids, dtypes=tuple(INDEX_CTYPES))
    C.check_array(fn, "table", table, ndim=2)
    C.check_last_contiguous(fn, "table", table)
    vocab, d = table.shape
    C.check_int32(fn, "D (table.shape[1])", d)
    out = _new_or_out(fn, out, tuple(ids.shape) + (d,), table.dtype, {"ids": ids, "table": table})
    n = ids.size
    if n == 0 or d == 0:
        return out
    ids = cupy.ascontiguousarray(ids)
    ct, it = ctype(table.dtype), INDEX_CTYPES[np.dtype(ids.dtype)]
    ld = table.strides[0] // table.itemsize
    v = VEC16[ct]
    if not (d % v == 0 and (ld % v == 0 or vocab == 1) and _aligned(16, table, out)):
        v = 1
    bx, by = _row_block(d // v)
    kern = get_function(SPEC, f"embedding_kernel<{ct}, {it}, {v}>")
    kern((min(-(-n // by), LAYERS_MAX_BLOCKS),), (bx, by),
         (ids, table, out, np.int64(n), np.int32(d), np.int64(vocab), np.int64(ld)))
    return out


# --- a model family's extras (tinylm: Qwen2's biases, Qwen3 / Gemma 3's QK norm, Gemma 2's softcap) --
def bias_add(x, bias):
    """``x += bias`` over the last dim, in place: x [..., N] whose leading dims collapse to one
    row stride (a C-contiguous array, or rows of a wider buffer); bias [N] of x's dtype."""
    fn = "bias_add"
    C.check_array(fn, "x", x, min_ndim=1)
    C.check_array(fn, "bias", bias, ndim=1)
    C.check_same_dtype(fn, "bias", bias, "x", x)
    n = x.shape[-1]
    if bias.shape[0] != n or not bias.flags.c_contiguous:
        raise ValueError(f"{fn}(): bias must be C-contiguous of shape ({n},) (last dim of x), got {tuple(bias.shape)}")
    geo = _rows(x)
    if geo is None:
        raise ValueError(f"{fn}(): x is updated in place and its leading dims must collapse to one row stride")
    C.check_no_overlap(fn, x, {"bias": bias}, out_name="x")
    rows = x.size // n if n else 0
    if rows == 0:
        return x
    kern = get_function(SPEC, f"bias_add_kernel<{ctype(x.dtype)}>")
    kern((min(-(-(rows * n) // LAYERS_THREADS), LAYERS_MAX_BLOCKS * 8),), (LAYERS_THREADS,),
         (x, bias, np.int64(rows), np.int64(n), np.int64(geo[1])))
    return x


def softcap(x, cap):
    """``x = cap * tanh(x / cap)`` elementwise, in place (x C-contiguous); cap > 0."""
    fn = "softcap"
    C.check_array(fn, "x", x)
    cap = C.check_real(fn, "cap", cap, minimum=0.0, strict=True)
    if not x.flags.c_contiguous:
        raise ValueError(f"{fn}(): x is updated in place and must be C-contiguous")
    if x.size:
        kern = get_function(SPEC, f"softcap_kernel<{ctype(x.dtype)}>")
        kern((min(-(-x.size // LAYERS_THREADS), LAYERS_MAX_BLOCKS * 8),), (LAYERS_THREADS,),
             (x, np.int64(x.size), np.float32(cap)))
    return x


def head_rmsnorm(x, weight, eps=1e-6):
    """RMSNorm over the last dim of every head of x [N, H, D], in place, with one weight [D]
    for all heads: x's strides must be (ld, D, 1) in elements, e.g. the query heads
    ``qkv.reshape(N, Hq + 2 * Hkv, D)[:, :Hq]`` of a packed projection."""
    fn = "head_rmsnorm"
    C.check_array(fn, "x", x, ndim=3)
    C.check_array(fn, "weight", weight, ndim=1)
    C.check_same_dtype(fn, "weight", weight, "x", x)
    n, h, d = x.shape
    if weight.shape[0] != d or not weight.flags.c_contiguous:
        raise ValueError(f"{fn}(): weight must be C-contiguous of shape ({d},) (last dim of x), got {tuple(weight.shape)}")
    es = [st // x.itemsize for st in x.strides]
    if (es[2] != 1 and d > 1) or (es[1] != d and h > 1) or (es[0] < h * d and n > 1):
        raise ValueError(f"{fn}(): x must have element strides (ld >= H*D, D, 1), got {tuple(es)}")
    eps = C.check_real(fn, "eps", eps, minimum=0.0)
    rows = n * h
    if rows:
        kern = get_function(SPEC, f"head_rmsnorm_kernel<{ctype(x.dtype)}>")
        kern((-(-rows // RMSNORM_WARPS),), (32 * RMSNORM_WARPS,),
             (x, weight, np.int64(rows), np.int32(h), np.int32(d), np.int64(es[0] if n > 1 else h * d),
              np.float32(eps)))
    return x
