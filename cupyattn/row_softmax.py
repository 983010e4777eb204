"""Row softmax over CuPy arrays: ``softmax(x, axis=-1, scale=1.0, causal=False, out=None)``.

Kernels live in ``kernels_cu/row_softmax.cu``: a warp-per-row kernel (row kept in registers) for rows
of up to 1024 elements, a block-per-row kernel with the row in registers up to 16384 elements, and
a block-per-row kernel (online max/sum, two passes over the row) for longer rows, 1,000,000
elements and beyond.
"""
from __future__ import annotations

import cupy
import numpy as np

from . import _checks
from ._loader import KernelSpec, ctype, get_function
from .config import (DTYPES, MAX_GRID_X, SOFTMAX_BLOCK, SOFTMAX_REG_MAX, SOFTMAX_REG_TILES,
                     SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_VPTS, SOFTMAX_WARP_MAX)


def _warp_expr(dtype, vpt: int) -> str:
    return f"softmax_warp_kernel<{ctype(dtype)}, {vpt}, {SOFTMAX_ROWS_PER_BLOCK}>"


def _block_reg_expr(dtype, vpt: int) -> str:
    return f"softmax_block_reg_kernel<{ctype(dtype)}, {SOFTMAX_BLOCK}, {vpt}, {SOFTMAX_REG_TILES[vpt]}>"


def _block_expr(dtype) -> str:
    return f"softmax_block_kernel<{ctype(dtype)}, {SOFTMAX_BLOCK}>"


SPEC = KernelSpec(
    name="row_softmax",
    source="row_softmax.cu",
    name_expressions=tuple(_warp_expr(t, v) for t in DTYPES for v in SOFTMAX_VPTS)
    + tuple(_block_reg_expr(t, v) for t in DTYPES for v in SOFTMAX_REG_TILES)
    + tuple(_block_expr(t) for t in DTYPES),
)


def _check_args(fn, x, axis, scale, causal, out):
    _checks.check_array(fn, "x", x, min_ndim=1)
    axis = _checks.check_int(fn, "axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}(): axis={axis} is out of range for x of shape {tuple(x.shape)}")
    axis %= x.ndim
    scale = _checks.check_real(fn, "scale", scale)
    causal = _checks.check_bool(fn, "causal", causal)
    if causal:
        if axis != x.ndim - 1:
            raise ValueError(f"{fn}(): causal=True needs axis=-1 (the key axis of [..., Sq, Sk]), got axis={axis}")
        if x.ndim < 2:
            raise ValueError(f"{fn}(): causal=True needs x of shape [..., Sq, Sk], got shape {tuple(x.shape)}")
        _checks.check_int32(fn, "Sq (x.shape[-2])", x.shape[-2])
    n = x.shape[axis]
    _checks.check_int32(fn, f"the row length (x.shape[{axis}])", n)
    rows = x.size // n if n else 0
    grid = rows if n > SOFTMAX_WARP_MAX else -(-rows // SOFTMAX_ROWS_PER_BLOCK)
    if grid > MAX_GRID_X:
        raise ValueError(f"{fn}(): {rows} rows of {n} need {grid} blocks, more than one launch's "
                         f"grid holds ({MAX_GRID_X})")
    if out is not None:
        _checks.check_out(fn, out, x.shape, x.dtype)
        _checks.check_no_overlap(fn, out, {"x": x}, in_place=("x",))
    return axis, scale, causal


def _launch(x, y, causal, scale):
    """x, y: C-contiguous, same shape; softmax over the last dim."""
    n = x.shape[-1]
    rows = x.size // n
    sq = x.shape[-2] if causal else 1
    args = (x, y, np.int64(rows), np.int32(n), np.int32(sq), np.float32(scale), np.int32(bool(causal)))
    if n <= SOFTMAX_WARP_MAX:
        vpt = next(v for v in SOFTMAX_VPTS if 32 * v >= n)
        kern = get_function(SPEC, _warp_expr(x.dtype, vpt))
        grid = -(-rows // SOFTMAX_ROWS_PER_BLOCK)
        kern((grid, 1, 1), (32 * SOFTMAX_ROWS_PER_BLOCK, 1, 1), args)
    else:
        if n <= SOFTMAX_REG_MAX:
            vpt = next(v for v in SOFTMAX_REG_TILES if SOFTMAX_BLOCK * v >= n)
            kern = get_function(SPEC, _block_reg_expr(x.dtype, vpt))
        else:
            kern = get_function(SPEC, _block_expr(x.dtype))
        kern((rows, 1, 1), (SOFTMAX_BLOCK, 1, 1), args)


def softmax(x, axis=-1, scale=1.0, causal=False, out=None):
    """``softmax(x * scale)`` along ``axis``, max-subtracted, computed in float32.

    Parameters
    ----------
    x : cupy.ndarray, shape [...]
        float32, float16 or bfloat16. A non-C-contiguous ``x`` is copied to a contiguous array
        first; so is ``x`` for a non-last ``axis`` (moved to the end, then moved back).
    axis : int
        Axis to normalise over (default -1).
    scale : float
        Multiplies ``x`` before the softmax (e.g. 1/sqrt(D) for attention scores).
    causal : bool
        Treat the last two dims as [..., Sq, Sk] scores and hide key j from query i unless
        ``j <= i + Sk - Sq`` (bottom-right aligned, as FlashAttention-2). Needs ``axis=-1``.
        Rows that see no key (Sq > Sk, top rows) are all zeros, as are rows of all ``-inf``.
    out : cupy.ndarray, optional
        C-contiguous, shape and dtype of ``x``; may be ``x`` itself (in place), but must not
        otherwise overlap ``x`` in memory (ValueError).

    Returns
    -------
    cupy.ndarray, same shape and dtype as ``x``

    Examples
    --------
    >>> s = cupy.random.standard_normal((2, 8, 100, 128)).astype(cupy.float16)  # [B, H, Sq, Sk]
    >>> p = softmax(s, scale=0.125, causal=True)
    >>> bool(cupy.allclose(p.astype(cupy.float32).sum(-1), 1, atol=1e-2))
    True
    """
    fn = "softmax"
    axis, scale, causal = _check_args(fn, x, axis, scale, causal, out)
    if out is None:
        out = cupy.empty(x.shape, dtype=x.dtype)
    if x.size == 0:
        return out
    if axis != x.ndim - 1:
        xm = cupy.ascontiguousarray(cupy.moveaxis(x, axis, -1))
        ym = cupy.empty_like(xm)
        _launch(xm, ym, False, scale)
        out[...] = cupy.moveaxis(ym, -1, axis)
        return out
    _launch(cupy.ascontiguousarray(x), out, causal, scale)
    return out
