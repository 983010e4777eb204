"""Single-token decode attention over a :class:`~cupyattn.kvcache.KVCache`, with split-KV.

One CUDA block handles one (sequence, kv head, head tile, split), so each K/V element is read
from global memory once per kv head (and split): every query head of the tile is scored against
the same staged keys. K/V tiles stream through a cp.async ring of a few stages (config
``DECODE_*_TILES``) so that the next tiles load while one is computed. Two kernels
(``kernels_cu/decode.cu``), chosen by ``impl``:

=====  ======================================================================  =============
impl   kernel                                                                  dtypes
=====  ======================================================================  =============
simt   v1: float FMAs; up to 8 query heads per block                           f32 f16 bf16
mma    v2: tensor cores; the group's heads are the rows of a 16- or 32-row     f16 bf16
       mma A tile, S = Q K^T and O += P V by mma.sync
=====  ======================================================================  =============

``impl=None`` (or its alias ``"auto"``) takes ``mma`` for fp16/bf16 when a kv head serves at least
``DECODE_MMA_MIN_GROUP`` (4) query heads, as FlashInfer does: below that most of the 16 rows of
an A tile would be padding, and the SIMT kernel's FMAs keep up with memory anyway.

With ``num_splits == 1`` a block writes the output itself; otherwise each split writes a float32
partial O and log-sum-exp to a workspace and a combine kernel merges them (flash-decoding):
``O = sum_c exp(lse_c - lse) O_c``; with ``fused_combine=True`` the last split block of each head
tile to finish (an atomic counter per tile, reset by that block) merges instead, so a split call
is one launch. Results do not depend on ``max_seq``. Two split rules (``split_rule``,
config.DECODE_SPLIT_RULES):

- ``"cost"`` (the default): sequence b's live length ``len_b`` is split into ``num_splits``
  chunks of ``ceil(len_b / num_splits)`` keys, as ``reference.decode_split_partials`` does; the
  automatic count is :func:`choose_num_splits`.
- ``"waves"`` (opt-in; its GPU runs: docs/ran-where.md): FlashAttention-3's wave-efficiency count
  (:func:`wave_splits`) over the SMs, each sequence split into chunks of about ``split_keys``
  keys (at most ``num_splits`` of them: a short sequence of a ragged batch takes few blocks, a
  long one many) and the combine fused into the decode kernel by default.
"""
from __future__ import annotations

import cupy
import numpy as np

from . import decode_launch as L
from .decode_launch import KvView
from .kvcache import KVCache
from .splits import check_split_rule, choose_num_splits, schedule, wave_splits

# the launch module's names that tests and benchmarks read here
from .decode_launch import (SPEC, VARIANTS, _fit, _mma_expr, _simt_expr, _small, _tiles_and_small,  # noqa: F401
                            mma_tiles, static_smem_bytes)
from .decode_launch import make_plan as _plan  # noqa: F401


def _view(fn, cache, layer):
    """(layer, KvView of it) of a contiguous KVCache; TypeError for anything else."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{fn}(): cache must be a cupyattn.KVCache, got {type(cache).__name__}")
    if hasattr(cache, "block_table"):
        raise TypeError(f"{fn}(): cache is a PagedKVCache: use cache.decode(q, layer) or "
                        f"decode_attention_paged(q[:, :, 0], cache, layer)")
    layer = cache.check_layer(fn, layer)
    return layer, cache.view(layer)


def decode_attention(q, cache, layer, scale=None, num_splits=None, out=None, workspace=None, impl=None,
                     fused_combine=None, window=None, softcap=None, split_rule=None):
    """Attention of one new query token per sequence over the cached keys/values of ``layer``.

    Parameters
    ----------
    q : cupy.ndarray [B, Hq, 1, D], the cache's dtype (float32, float16 or bfloat16)
        Last dim contiguous. ``Hq`` must be a multiple of the cache's kv heads (GQA/MQA: query
        head h reads kv head ``h // (Hq // Hkv)``). D in ``cupyattn.config.HEAD_DIMS``.
    cache : KVCache
        Keys ``[0, lengths[layer, b])`` of sequence b are attended (append the new token's K/V
        first if it should see itself). Lengths may differ across the batch; a sequence of
        length 0 gets zeros. Cache rows at or past a sequence's length are never read.
    layer : int
    scale : float, optional
        Softmax scale, default ``1/sqrt(D)``.
    num_splits : int, optional
        Key-range splits per sequence (1 = unsplit, up to ``DECODE_MAX_SPLITS`` = 512; with
        split_rule="waves" the most any sequence takes). None picks it from the live lengths, the
        SM count and wave quantisation (:func:`choose_num_splits` or :func:`wave_splits`), with
        no device sync.
    out : cupy.ndarray [B, Hq, 1, D], optional
        C-contiguous, q's dtype.
    workspace : (o_part, lse_part) or (o_part, lse_part, counters), optional
        Preallocated split-KV partials, float32 C-contiguous ``[S, B, Hq, D]`` and ``[S, B, Hq]``
        with ``S >= num_splits``, and for ``fused_combine`` the counters, uint32 ``[B, Hq]``, all
        zero before the first call (every call leaves them zero): with ``out`` given the call
        allocates nothing, so it can be captured in a CUDA graph. Without it a split call
        allocates them.
    impl : {None, "simt", "mma"} ("auto": None)
        Kernel (module docstring): None is options.DEFAULTS' choice, tensor cores for fp16/bf16
        with a GQA group of 4 or more where the device has them, SIMT otherwise; "mma" needs
        fp16/bf16.
    fused_combine : bool, optional
        Merge the splits inside the decode kernel (the last split block of each head tile to
        finish merges, found by an atomic counter) instead of a second kernel: one launch per
        call (tinylm's fused decode step uses it: tinylm.config.TINYLM_FUSED_DECODE). None: True under
        split_rule="waves", else False.
    window : (left, right), optional
        Sliding window: the query (at position len - 1) sees keys ``j >= len - 1 - left``
        (-1: unbounded); ``right`` cannot hide anything in decode. Serving kernel variant.
    softcap : float, optional
        Scores become ``softcap * tanh(scale * q.k / softcap)``; 0 / None: off, else within
        ``[config.SOFTCAP_MIN, config.SOFTCAP_MAX]`` (about 2.4e-38 to 1.3e30; ValueError
        outside). Same variant.
    split_rule : {"cost", "waves"}, optional
        How the keys are split (module docstring); None: config.DECODE_SPLIT_RULE ("cost").
        "waves" is opt-in (its GPU runs: docs/ran-where.md).

    Returns
    -------
    cupy.ndarray [B, Hq, 1, D] in q's dtype; accumulation is float32.

    Examples
    --------
    >>> cache.append(layer, k_tok, v_tok)                 # [B, Hkv, 1, D]
    >>> o = decode_attention(q_tok, cache, layer)         # [B, Hq, 1, D]
    """
    fn = "decode_attention"
    layer, kv = _view(fn, cache, layer)
    return L.decode(fn, q, kv, cache.host_lengths[layer], scale, num_splits, out, workspace, impl, fused_combine,
                    window, softcap, split_rule)


def auto_num_splits(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, max_len: int,
                    impl=None, split_rule=None) -> int:
    """The split count ``decode_attention(num_splits=None, impl=impl, split_rule=split_rule)``
    picks on the current device for these shapes when every sequence holds ``max_len`` keys; for
    callers that fix the count in advance (a CUDA graph captured per range of context lengths)."""
    rule = check_split_rule("auto_num_splits", split_rule)
    plan = L.device_plan("auto_num_splits", impl, dtype, head_dim, num_heads // num_kv_heads)
    return schedule(rule, plan, batch, num_kv_heads, [max_len] * batch)[0]


def decode_split_partials(q, cache, layer, num_splits, scale=None, impl=None):
    """The split kernel's workspace, for tests: (o_part float32 [splits, B, Hq, D], lse_part
    float32 [splits, B, Hq], natural log, -inf for empty chunks), as
    ``reference.decode_split_partials`` (whose arrays carry an extra length-1 query axis)."""
    fn = "decode_split_partials"
    layer, kv = _view(fn, cache, layer)
    b, hq, d, scale, num_splits, plan = L.check(fn, q, kv, scale, num_splits, None, impl)
    if num_splits is None:
        raise ValueError(f"{fn}(): num_splits is required")
    o_part = cupy.empty((num_splits, b, hq, d), dtype=np.float32)
    lse_part = cupy.empty((num_splits, b, hq), dtype=np.float32)
    L.launch(q, kv, scale, num_splits, None, plan, (o_part, lse_part), combine=False)
    return o_part, lse_part


__all__ = ["decode_attention", "choose_num_splits", "wave_splits", "auto_num_splits", "KVCache", "KvView"]
