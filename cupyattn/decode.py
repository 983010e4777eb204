"""Single-token decode attention over a :class:`~cupyattn.kvcache.KVCache`, with split-KV.

One CUDA block handles one (sequence, kv head, split) and every query head of that kv head (up
to 8 per block; larger groups take several head tiles), so each K/V element is read from
global memory once per kv head. With ``num_splits == 1`` the block writes the output itself;
otherwise each split writes a float32 partial O and log-sum-exp to a workspace and a combine
kernel merges them (flash-decoding): ``O = sum_c exp(lse_c - lse) O_c``.

Sequence b's live length ``len_b`` is split into chunks of ``ceil(len_b / num_splits)`` keys, as
``reference.decode_split_partials`` does, so results do not depend on ``max_seq``.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from ._checks import check_array, check_last_contiguous, check_out, check_same_dtype
from ._loader import KernelSpec, get_function
from .config import (DECODE_COMBINE_THREADS, DECODE_HEAD_TILE, DECODE_MAX_AUTO_SPLITS,
                     DECODE_MAX_SPLITS, DECODE_MIN_KEYS_PER_SPLIT, DECODE_THREADS, DECODE_WAVES,
                     DTYPES, HEAD_DIMS, MAX_GRID_YZ, ctype)
from .kvcache import KVCache


def _decode_expr(dtype, d: int) -> str:
    return f"decode_kernel<{ctype(dtype)}, {d}, {DECODE_THREADS}, {DECODE_HEAD_TILE}>"


def _combine_expr(dtype) -> str:
    return f"decode_combine_kernel<{ctype(dtype)}, {DECODE_MAX_SPLITS}, {DECODE_COMBINE_THREADS}>"


SPEC = KernelSpec(
    "decode", "decode.cu",
    tuple(_decode_expr(t, d) for t in DTYPES for d in HEAD_DIMS) + tuple(_combine_expr(t) for t in DTYPES))

_SM_COUNT: dict[int, int] = {}


def choose_num_splits(batch: int, kv_heads: int, max_len: int, sm_count: int) -> int:
    """Split count for a decode step: enough blocks (``batch * kv_heads * splits``) to fill
    about ``DECODE_WAVES`` blocks per SM, but at least ``DECODE_MIN_KEYS_PER_SPLIT`` keys per
    split and at most ``DECODE_MAX_AUTO_SPLITS`` splits (cupyattn.config). ``max_len`` is the longest *live* length (not max_seq);
    ``kv_heads`` counts blocks per sequence and split (kv heads times head tiles)."""
    blocks = max(1, batch * kv_heads)
    by_fill = -(-DECODE_WAVES * max(1, sm_count) // blocks)          # ceil
    by_len = max(1, max_len // DECODE_MIN_KEYS_PER_SPLIT)
    return max(1, min(by_fill, by_len, DECODE_MAX_AUTO_SPLITS))


def _sm_count() -> int:
    dev = cupy.cuda.Device()
    n = _SM_COUNT.get(dev.id)
    if n is None:
        n = _SM_COUNT[dev.id] = int(dev.attributes["MultiProcessorCount"])
    return n


def _check_args(fn, q, cache, layer, scale, num_splits, out):
    """Validate everything; return (layer, B, Hq, D, scale, num_splits or None)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{fn}(): cache must be a cupyattn.KVCache, got {type(cache).__name__}")
    layer = cache.check_layer(fn, layer)
    check_array(fn, "q", q, ndim=4)
    check_same_dtype(fn, "q", q, "the cache", cache.k)
    b, hq, one, d = q.shape
    if b != cache.batch or one != 1 or d != cache.head_dim:
        raise ValueError(f"{fn}(): q has shape {tuple(q.shape)}, expected [batch={cache.batch}, Hq, 1, "
                         f"head_dim={cache.head_dim}]")
    if hq % cache.num_kv_heads:
        raise ValueError(f"{fn}(): q has {hq} heads, not a multiple of the cache's "
                         f"{cache.num_kv_heads} kv heads")
    if d not in HEAD_DIMS:
        raise ValueError(f"{fn}(): head_dim {d} is not supported; expected one of {HEAD_DIMS}")
    check_last_contiguous(fn, "q", q)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale):
        raise ValueError(f"{fn}(): scale must be a finite number, got {scale!r}")
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
                or not 1 <= num_splits <= DECODE_MAX_SPLITS:
            raise ValueError(f"{fn}(): num_splits must be None or an integer in [1, {DECODE_MAX_SPLITS}], "
                             f"got {num_splits!r}")
        num_splits = int(num_splits)
    if cache.num_kv_heads * -(-(hq // cache.num_kv_heads) // DECODE_HEAD_TILE) > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"{fn}(): batch {b} x {hq} heads exceed one launch's grid ({MAX_GRID_YZ} blocks in y, z)")
    if out is not None:
        check_out(fn, out, (b, hq, 1, d), q.dtype)
    return layer, b, hq, d, float(scale), num_splits


def _launch(q, cache, layer, scale, num_splits, out, workspace=None, combine=True):
    """Run the decode kernel, and the combine kernel when split (``combine=False`` keeps only the
    split partials in ``workspace``, for tests)."""
    b, hq, _, d = q.shape
    hkv = cache.num_kv_heads
    n_ht = -(-(hq // hkv) // DECODE_HEAD_TILE)
    split = num_splits > 1 or not combine
    if split:
        o_part, lse_part = workspace if workspace is not None else (
            cupy.empty((num_splits, b, hq, d), dtype=np.float32), cupy.empty((num_splits, b, hq), dtype=np.float32))
        out_arg = o_part            # the kernel writes only the partials: any pointer will do
    else:
        out_arg = o_part = lse_part = out  # the kernel writes only out
    i32, i64 = np.int32, np.int64
    kern = get_function(SPEC, _decode_expr(cache.dtype, d))
    kern((num_splits, hkv * n_ht, b), (DECODE_THREADS,),
         (q, cache.k[layer], cache.v[layer], cache.lengths[layer], out_arg, o_part, lse_part,
          i64(q.strides[0] // q.itemsize), i64(q.strides[1] // q.itemsize),
          i32(b), i32(hq), i32(hkv), i32(cache.max_seq), i32(num_splits),
          np.float32(scale * math.log2(math.e)), i32(1 if split else 0)))
    if split and combine:
        merge = get_function(SPEC, _combine_expr(cache.dtype))
        merge((b * hq,), (DECODE_COMBINE_THREADS,), (o_part, lse_part, out, i32(num_splits), i32(b * hq), i32(d)))
    return out


def decode_attention(q, cache, layer, scale=None, num_splits=None, out=None, workspace=None):
    """Attention of one new query token per sequence over the cached keys/values of ``layer``.

    Parameters
    ----------
    q : cupy.ndarray [B, Hq, 1, D], the cache's dtype (float32, float16 or bfloat16)
        Last dim contiguous. ``Hq`` must be a multiple of the cache's kv heads (GQA/MQA: query
        head h reads kv head ``h // (Hq // Hkv)``). D in ``cupyattn.config.HEAD_DIMS``.
    cache : KVCache
        Keys ``[0, lengths[layer, b])`` of sequence b are attended (append the new token's K/V
        first if it should see itself). Lengths may differ across the batch; a sequence of
        length 0 gets zeros.
    layer : int
    scale : float, optional
        Softmax scale, default ``1/sqrt(D)``.
    num_splits : int, optional
        Key-range splits per sequence (1 = unsplit, up to 256). None picks it from the longest
        live length and the SM count (:func:`choose_num_splits`), with no device sync.
    out : cupy.ndarray [B, Hq, 1, D], optional
        C-contiguous, q's dtype.
    workspace : (o_part, lse_part), optional
        Preallocated split-KV partials, float32 C-contiguous ``[S, B, Hq, D]`` and ``[S, B, Hq]``
        with ``S >= num_splits``: with ``out`` given the call allocates nothing, so it can be
        captured in a CUDA graph. Without it a split call allocates them.

    Returns
    -------
    cupy.ndarray [B, Hq, 1, D] in q's dtype; accumulation is float32.

    Examples
    --------
    >>> cache.append(layer, k_tok, v_tok)                 # [B, Hkv, 1, D]
    >>> o = decode_attention(q_tok, cache, layer)         # [B, Hq, 1, D]
    """
    fn = "decode_attention"
    layer, b, hq, d, scale, num_splits = _check_args(fn, q, cache, layer, scale, num_splits, out)
    if num_splits is None:
        n_ht = -(-(hq // cache.num_kv_heads) // DECODE_HEAD_TILE)
        num_splits = choose_num_splits(b, cache.num_kv_heads * n_ht,
                                       int(cache.host_lengths[layer].max()), _sm_count())
    if workspace is not None:
        _check_workspace(fn, workspace, num_splits, b, hq, d)
    if out is None:
        out = cupy.empty((b, hq, 1, d), dtype=q.dtype)
    return _launch(q, cache, layer, scale, num_splits, out, workspace)


def _check_workspace(fn, workspace, num_splits, b, hq, d):
    if not isinstance(workspace, tuple) or len(workspace) != 2:
        raise TypeError(f"{fn}(): workspace must be a tuple (o_part, lse_part), got {type(workspace).__name__}")
    o_part, lse_part = workspace
    for name, x, tail in (("workspace[0]", o_part, (b, hq, d)), ("workspace[1]", lse_part, (b, hq))):
        check_array(fn, name, x, dtypes=(np.dtype(np.float32),), ndim=len(tail) + 1)
        if tuple(x.shape[1:]) != tail or x.shape[0] < num_splits or not x.flags.c_contiguous:
            raise ValueError(f"{fn}(): {name} must be C-contiguous float32 of shape [S >= {num_splits}, "
                             f"{', '.join(map(str, tail))}], got {tuple(x.shape)}")


def decode_split_partials(q, cache, layer, num_splits, scale=None):
    """The split kernel's workspace, for tests: (o_part float32 [splits, B, Hq, D], lse_part
    float32 [splits, B, Hq], natural log, -inf for empty chunks), as
    ``reference.decode_split_partials`` (whose arrays carry an extra length-1 query axis)."""
    fn = "decode_split_partials"
    layer, b, hq, d, scale, num_splits = _check_args(fn, q, cache, layer, scale, num_splits, None)
    if num_splits is None:
        raise ValueError(f"{fn}(): num_splits is required")
    o_part = cupy.empty((num_splits, b, hq, d), dtype=np.float32)
    lse_part = cupy.empty((num_splits, b, hq), dtype=np.float32)
    _launch(q, cache, layer, scale, num_splits, None, (o_part, lse_part), combine=False)
    return o_part, lse_part


__all__ = ["decode_attention", "choose_num_splits", "KVCache"]
