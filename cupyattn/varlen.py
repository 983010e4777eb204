"""Attention over packed variable-length sequences (flash-attention's ``flash_attn_varlen_func``).

A batch of sequences of different lengths is stored without padding: queries ``[total_q, Hq,
D]`` and keys/values ``[total_k, Hkv, D]`` hold the sequences one after another, and int32
offsets ``cu_seqlens`` of length B+1 say where each starts (``cu_seqlens[0] = 0``,
``cu_seqlens[B] = total``). The serving instantiation of the fused kernels
(``kernels_cu/flash_attn.cu``, ``SERVING = true``) reads each sequence in place: no padding,
no copies (except at a head dim the kernels lack: flash_launch.padded_copy). Causal masks and
windows are aligned bottom-right per sequence.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks
from . import flash_attn_sm90_persistent as _sm90p
from ._checks import check_array, check_choice, check_last_contiguous, check_out, check_same_dtype
from .config import HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES, padded_head_dim
from .flash_launch import (Serving, check_flash_mma_device, check_window_softcap, choose, elem_strides, fused_dims,
                           launch, padded_copy)

FUSED_IMPLS = ("flash", "flash_mma")
# Hopper: the persistent wgmma kernel (packed and paged addressing; v3, attention()'s "wgmma", has
# neither). impl=None takes it where cupyattn/options.py DEFAULTS says.
IMPLS = FUSED_IMPLS + (_sm90p.IMPL,)


def check_offsets(fn: str, name: str, x, n: int, total: int | None):
    """``x``: int32 offsets or lengths of length ``n``. A CuPy array is used as it is (not read
    back, so a call can sit in a CUDA graph; its values are the caller's contract). Host values
    (list / NumPy) are checked: with ``total`` given they must be offsets (start at 0, never
    decrease, end at ``total``), else lengths >= 0. Returns (device int32 array, host values or
    None)."""
    if _checks.is_device_array(x):
        _checks.check_device(fn, name, x)
        if x.dtype != np.int32:
            raise TypeError(f"{fn}(): {name} must be int32, got {x.dtype}")
        if x.ndim != 1 or x.shape[0] != n:
            raise ValueError(f"{fn}(): {name} must have shape ({n},), got {tuple(x.shape)}")
        return cupy.ascontiguousarray(x), None
    try:
        h = None if x is None else np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"{fn}(): {name} must be an int32 array, got {type(x).__name__}") from e
    if h is None or h.ndim == 0:
        raise TypeError(f"{fn}(): {name} must be a 1-D int32 array of {n} entries (CuPy, NumPy or a list), "
                        f"got {type(x).__name__} {x!r}")
    if h.dtype.kind not in "iu":
        raise TypeError(f"{fn}(): {name} must have an integer dtype, got {h.dtype}")
    if h.ndim != 1 or h.shape[0] != n:
        raise ValueError(f"{fn}(): {name} must have shape ({n},), got {tuple(h.shape)}")
    h = h.astype(np.int64)
    if total is not None:
        if n and (h[0] != 0 or h[-1] != total or (np.diff(h) < 0).any()):
            raise ValueError(f"{fn}(): {name} must start at 0, never decrease and end at {total} "
                             f"(the packed length), got {h.tolist() if n <= 16 else h}")
    elif n and h.min() < 0:
        raise ValueError(f"{fn}(): {name} must be >= 0, got min {int(h.min())}")
    if n and h.max() >= 2**31:
        raise ValueError(f"{fn}(): {name} values must fit int32, got max {int(h.max())}")
    return cupy.asarray(h.astype(np.int32)), h


def offsets_batch(fn: str, name: str, x) -> int:
    """B from offsets ``x`` of B + 1 entries (a CuPy or NumPy array or a list), before anything
    else reads it: TypeError / ValueError naming ``name`` for None, a scalar, a 0-d or 2-d array,
    or no entry at all."""
    want = "a 1-D int32 array of B + 1 offsets (CuPy, NumPy or a list)"
    if x is None or isinstance(x, (bool, int, float, np.generic, str, bytes)):
        raise TypeError(f"{fn}(): {name} must be {want}, got {type(x).__name__} {x!r}")
    try:
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    except Exception as e:  # pragma: no cover - ragged or exotic objects
        raise TypeError(f"{fn}(): {name} must be {want}, got {type(x).__name__}") from e
    if len(shape) != 1:
        raise ValueError(f"{fn}(): {name} must be {want}, got shape {shape}")
    if shape[0] == 0:
        raise ValueError(f"{fn}(): {name} must have B + 1 >= 1 entries (0 first), got none")
    return shape[0] - 1


def check_packed(fn, q, k, v, kn="k", vn="v", padded=False):
    """q [total_q, Hq, D], k/v [*, Hkv, D] (3-D, or pages [N, P, Hkv, D], named ``kn``, ``vn``
    in errors): -> Hq, Hkv, D. D is one of HEAD_DIMS, or with ``padded`` (the caller runs
    zero-padded copies) any D up to the largest."""
    check_array(fn, "q", q, ndim=3)
    check_array(fn, kn, k, min_ndim=3)
    check_array(fn, vn, v, min_ndim=3)
    check_same_dtype(fn, kn, k, "q", q)
    check_same_dtype(fn, vn, v, "q", q)
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[-2]
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{fn}(): {vn} has shape {tuple(v.shape)} but {kn} has {tuple(k.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"{fn}(): {kn} has head dim {k.shape[-1]} but q has {d}")
    if hkv == 0:
        raise ValueError(f"{fn}(): {kn} and {vn} have no heads (Hkv=0, shape {tuple(k.shape)}); they need at least one")
    if hq % hkv:
        raise ValueError(f"{fn}(): q heads Hq={hq} must be a multiple of {kn}/{vn} heads Hkv={hkv}")
    if padded and padded_head_dim(d) is None:
        raise ValueError(f"{fn}(): head_dim D={d} is not supported: the fused kernels take D up to {max(HEAD_DIMS)} "
                         f"(a D not in {', '.join(map(str, HEAD_DIMS))} zero-padded to the next)")
    if not padded and d not in HEAD_DIMS:
        raise ValueError(f"{fn}(): head_dim D={d} is not supported; supported: {', '.join(map(str, HEAD_DIMS))}")
    for name, x in (("q", q), (kn, k), (vn, v)):
        check_last_contiguous(fn, name, x)
        for n in x.shape:
            _checks.check_int32(fn, f"{name} size", n)
    return hq, hkv, d


def check_impl(fn, impl, q, d):
    """``impl`` of the packed entry points (attention_varlen, attention_paged) for q's dtype and
    head dim ``d`` on this device: dtype, instructions, shared memory."""
    check_choice(fn, "impl", impl, IMPLS)
    if impl == "flash_mma" and np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{fn}(): impl='flash_mma' needs float16 or bfloat16 inputs, got float32 (use impl='flash')")
    if impl == "flash_mma":
        check_flash_mma_device(fn, q.dtype, d)
    if impl == _sm90p.IMPL:
        _sm90p.check(fn, impl, q, d)


def call_options(causal, window, softcap, scale, return_lse, out) -> list:
    """The call options (cupyattn/options.py) a packed call uses, for impl=None's IMPLEMENTS."""
    return [o for o, on in (("causal", causal), ("window", window is not None), ("softcap", bool(softcap)),
                            ("scale", scale is not None), ("return_lse", return_lse), ("out", out is not None)) if on]


def check_grid(fn, b, hq):
    if -(-b * hq // MAX_GRID_YZ) > MAX_GRID_YZ:
        raise ValueError(f"{fn}(): B*Hq = {b * hq} is more than one launch's grid holds ({MAX_GRID_YZ}^2)")


def check_max_seqlen(fn, name, value, host_cu):
    value = _checks.check_int(fn, name, value, 0, 2**31 - 1)
    if host_cu is not None and len(host_cu) > 1 and value < int(np.diff(host_cu).max()):
        raise ValueError(f"{fn}(): {name}={value} is less than the longest sequence "
                         f"({int(np.diff(host_cu).max())})")
    return value


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                     window=None, softcap=None, return_lse=False, out=None, impl=None):
    """Attention of B packed sequences at once (``flash_attn_varlen_func``'s convention).

    Parameters
    ----------
    q : cupy.ndarray [total_q, Hq, D]
        Queries of all sequences, one after another; float32 / float16 / bfloat16, last dim
        contiguous (any other strides). D up to 256: a D outside ``config.HEAD_DIMS`` (the
        persistent kernel's 64, 128, 256 for it) runs on copies of q, k, v zero-padded to the next
        one, and ``out`` gets the first D columns (as attention()).
    k, v : cupy.ndarray [total_k, Hkv, D]
        Keys and values, same dtype; ``Hq % Hkv == 0`` (GQA/MQA).
    cu_seqlens_q, cu_seqlens_k : int32 [B + 1]
        Offsets: sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` and
        ``k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``. Host arrays (list / NumPy) are checked (start
        at 0, non-decreasing, end at total); CuPy int32 arrays are used as they are, unchecked.
    max_seqlen_q, max_seqlen_k : int
        The longest query / key sequence (the grid covers ``max_seqlen_q`` rows per sequence;
        checked against host offsets).
    causal : bool
        Query i of a sequence with Sq queries and Sk keys sees keys ``j <= i + Sk - Sq``.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    window : (left, right), optional
        ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1: unbounded.
    softcap : float, optional
        Scores become ``softcap * tanh(scale * q.k / softcap)`` before masking; 0 / None: off,
        else within ``[config.SOFTCAP_MIN, config.SOFTCAP_MAX]`` (ValueError outside).
    return_lse : bool
        Also return the log-sum-exp, float32 ``[Hq, total_q]`` (flash-attention's layout).
    out : cupy.ndarray [total_q, Hq, D], optional
        C-contiguous, q's dtype, not overlapping the inputs.
    impl : {None, "flash", "flash_mma", "wgmma_persistent"}
        None: "wgmma_persistent" on sm_90 for fp16 at D of 64, 128 and 256 and bf16 at D = 128
        (config.ATTN_AUTO_PERSISTENT, measured faster on an H100) when TMA can read q, k, v; else
        tensor cores for fp16/bf16 (flash_mma), SIMT for float32.
        "wgmma_persistent": the persistent Hopper kernel (cupyattn/flash_attn_sm90_persistent.py;
        sm_90, fp16/bf16, D up to 256 (kernels at 64, 128, 256), q, k, v that TMA can read: no broadcast or
        reversed view), per-sequence tile bounds, causal and window tiles skipped per sequence.

    Rows that see no key (an empty key sequence, a window that hides every key) are zeros with
    lse -inf, as in attention().

    Examples
    --------
    >>> cu = cupy.asarray([0, 17, 114], dtype=cupy.int32)        # two sequences: 17 and 97 tokens
    >>> q = cupy.random.randn(114, 8, 64).astype(cupy.float16)
    >>> kv = cupy.random.randn(114, 2, 64).astype(cupy.float16)
    >>> o = attention_varlen(q, kv, kv, cu, cu, 97, 97, causal=True)   # [114, 8, 64]
    """
    fn = "attention_varlen"
    _checks.check_bool(fn, "causal", causal)
    _checks.check_bool(fn, "return_lse", return_lse)
    if impl is not None:
        check_choice(fn, "impl", impl, IMPLS)
    hq, hkv, d = check_packed(fn, q, k, v, padded=True)
    dk = padded_head_dim(d, fused_dims(impl))   # D, or the head dim q, k, v are zero-padded to
    if impl is not None:
        check_impl(fn, impl, q, dk)
    if k.ndim != 3:
        raise ValueError(f"{fn}(): k must be [total_k, Hkv, D], got shape {tuple(k.shape)}")
    tq, tk = q.shape[0], k.shape[0]
    b = offsets_batch(fn, "cu_seqlens_q", cu_seqlens_q)
    cu_q, hcq = check_offsets(fn, "cu_seqlens_q", cu_seqlens_q, b + 1, tq)
    cu_k, hck = check_offsets(fn, "cu_seqlens_k", cu_seqlens_k, b + 1, tk)
    max_q = check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, hcq)
    max_k = check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, hck)
    check_grid(fn, b, hq)
    win, cap = check_window_softcap(fn, window, softcap, causal)
    scale = 1.0 / math.sqrt(d) if scale is None else _checks.check_real(fn, "scale", scale)
    if out is not None:
        check_out(fn, out, (tq, hq, d), q.dtype)
        _checks.check_no_overlap(fn, out, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                           "cu_seqlens_k": cu_seqlens_k})
    launches = bool(q.size and k.size)
    # at a D the kernels lack, they read copies zero-padded to dk (after every check the caller's
    # arguments can fail; TMA reads a C-contiguous copy)
    qk, kk, vk = (q, k, v) if dk == d else (padded_copy(x, dk, launches) for x in (q, k, v))
    if impl is None:  # options.DEFAULTS["attention_varlen"]
        impl = choose(fn, q, d, used=call_options(causal, window, softcap, scale, return_lse, out),
                      causal=causal, launches=launches,
                      problem=lambda i: _sm90p.launch_problem(fn, i, _sm90p.varlen_ops(qk, kk, vk), qk, b))
        check_impl(fn, impl, q, dk)
    elif impl == _sm90p.IMPL and launches:  # (nothing is launched otherwise)
        _sm90p.check_launch(fn, impl, _sm90p.varlen_ops(qk, kk, vk), qk, b)
    out = cupy.empty((tq, hq, d), dtype=q.dtype) if out is None else out
    lse = cupy.empty((hq, tq), dtype=cupy.float32) if return_lse else None
    if tq == 0 or b == 0 or max_q == 0 or hq == 0:
        return (out, lse) if return_lse else out
    if tk == 0:  # no key for anyone
        out.fill(0)
        if lse is not None:
            lse.fill(-np.inf)
        return (out, lse) if return_lse else out
    o = out if dk == d else cupy.empty((tq, hq, dk), dtype=q.dtype)   # the kernel writes dk columns
    if impl == _sm90p.IMPL:
        _sm90p.run_varlen(qk, kk, vk, cu_q, cu_k, b, max_k, scale, win, cap, o, lse)
    else:
        qs, ks, vs = ([0, st[1], st[0]] for st in map(elem_strides, (qk, kk, vk)))
        sv = Serving(cu_q=cu_q, cu_k=cu_k, window=win, softcap=cap)
        launch(impl, qk, kk, vk, False, scale, None, None, None, o, lse, sv, shape=(b, hq, max_q, hkv, tq, tk),
               strides=(qs, ks, vs))
    if o is not out:
        out[...] = o[..., :d]
    return (out, lse) if return_lse else out


__all__ = ["attention_varlen"]
