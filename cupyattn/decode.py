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

``impl="auto"`` takes ``mma`` for fp16/bf16 when a kv head serves at least
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

import dataclasses
import functools
import math

import cupy
import numpy as np

from . import _checks, _loader
from ._checks import check_array, check_choice, check_last_contiguous, check_out, check_same_dtype
from ._loader import NULL, KernelSpec, get_function
from . import config
from .config import (DECODE_COMBINE_THREADS, DECODE_HEAD_TILE, DECODE_IMPLS, DECODE_MAX_SPLITS,
                     DECODE_MIN_KEYS_PER_SPLIT, DECODE_MMA_MAX_MTILES, DECODE_MMA_MIN_GROUP, DECODE_MMA_ROWS,
                     DECODE_MMA_SMALL_SMEM_TILES, DECODE_MMA_TILES, DECODE_SIMT_TILES,
                     DECODE_SPLIT_BLOCKS_PER_SM, DECODE_SMALL_SMEM_STAGES, DECODE_SPLIT_OVERHEAD_KEYS, DTYPES,
                     HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES, MMA_MIN_CC, DecodeTile, a_family_has_less, ctype,
                     impl_runs_on)
from .kvcache import KVCache


# The kernel variants of each tile: plain, serving (paged / window / softcap), and the serving
# variant with staged page ids (decode.cu STAGED; config.DECODE_PAGE_STAGING).
VARIANTS = ((False, False), (True, False), (True, True))   # (serving, staged)


def _tail(serving: bool, staged: bool) -> str:
    return ", true, true" if staged else (", true" if serving else "")


def _simt_expr(dtype, d: int, t: DecodeTile | None = None, serving: bool = False, staged: bool = False) -> str:
    t = t or DECODE_SIMT_TILES[(d, np.dtype(dtype).itemsize)]
    return (f"decode_kernel<{ctype(dtype)}, {d}, {t.threads}, {DECODE_HEAD_TILE}, {t.block_n}, "
            f"{t.stages}, {t.pitch}, {t.blocks_per_sm}{_tail(serving, staged)}>")


def _mma_expr(dtype, d: int, m_tiles: int, t: DecodeTile | None = None, serving: bool = False,
              staged: bool = False) -> str:
    t = t or DECODE_MMA_TILES[(d, m_tiles)]
    return (f"decode_mma_kernel<{ctype(dtype)}, {d}, {m_tiles}, {t.warps}, {t.block_n}, {t.stages}, "
            f"{t.pitch}, {t.blocks_per_sm}{_tail(serving, staged)}>")


# --- devices with less shared memory per block (config "GPU families": Turing 64 KB, 99 KB parts) ---
def _small(t: DecodeTile) -> DecodeTile:
    """``t`` with a DECODE_SMALL_SMEM_STAGES-deep ring: a third less shared memory, one tile fewer
    in flight."""
    return dataclasses.replace(t, stages=DECODE_SMALL_SMEM_STAGES)


def page_window_bytes(t: DecodeTile) -> int:
    """Shared memory of a STAGED kernel's page-id window (decode.cu KvStream::PW_CAP, two buffers
    of int32): page ids for the ring's tiles in flight at page size 1, plus 32."""
    return 2 * ((t.stages - 1) * t.block_n + 32) * 4


def static_smem_bytes(impl: str, d: int, itemsize: int, t: DecodeTile, m_tiles: int = 1, staged: bool = False) -> int:
    """An upper bound of the decode kernel's static ``__shared__`` bytes (decode.cu: simt q_s,
    p_s, alpha_s, m_fin, l_fin and a flag; mma q_s and the per-slice m_s, l_s; STAGED: the page
    window), checked against ptxas' numbers in tests/test_gpu_families.py."""
    extra = page_window_bytes(t) if staged else 0
    if impl == "mma":
        rows = DECODE_MMA_ROWS * m_tiles
        return rows * (d + 8) * itemsize + 2 * (t.warps // m_tiles) * rows * 4 + 16 + extra
    return DECODE_HEAD_TILE * (d + t.block_n + 3) * 4 + 16 + extra


def _fit(impl: str, dtype, d: int, t: DecodeTile, m_tiles: int, limit: int | None,
         explicit: bool = False, staged: bool = False) -> DecodeTile | None:
    """The tile to launch under a per-block shared-memory ``limit`` (None: no limit): ``t``, its
    shallower-ring variant, for an ``explicit`` impl="mma" the compact tile of
    config.DECODE_MMA_SMALL_SMEM_TILES, or None when none fits (``staged``: with the page window)."""
    compact = DECODE_MMA_SMALL_SMEM_TILES.get((d, m_tiles)) if impl == "mma" and explicit else None
    for cand in (t, _small(t)) + ((compact,) if compact else ()):
        if limit is None or _smem(impl, dtype, d, cand, m_tiles, staged) <= limit:
            return cand
    return None


def _combine_expr(dtype) -> str:
    return f"decode_combine_kernel<{ctype(dtype)}, {DECODE_MAX_SPLITS}, {DECODE_COMBINE_THREADS}>"


def _tiles_and_small(t: DecodeTile) -> tuple[DecodeTile, ...]:
    return tuple(dict.fromkeys((t, _small(t))))


def mma_tiles(dtype, d: int, m_tiles: int) -> tuple[DecodeTile, ...]:
    """Every impl="mma" tile the spec instantiates for (dtype, D, m-tiles): the configured one, its
    shallower ring, and the compact tile where a family that runs ``dtype`` has too little shared
    memory per block for both (fp16 on Turing)."""
    tiles = _tiles_and_small(DECODE_MMA_TILES[(d, m_tiles)])
    compact = DECODE_MMA_SMALL_SMEM_TILES.get((d, m_tiles))
    if compact and a_family_has_less(_smem("mma", dtype, d, tiles[-1], m_tiles), MMA_MIN_CC[np.dtype(dtype)]):
        tiles += (compact,)
    return tiles


def _smem(impl: str, dtype, d: int, t: DecodeTile, m_tiles: int = 1, staged: bool = False) -> int:
    return t.ring_bytes + static_smem_bytes(impl, d, np.dtype(dtype).itemsize, t, m_tiles, staged)


# every decode instantiation: each tile as configured, with the shallower ring and compact (_fit)
# and in its serving variants (paged caches, window, softcap: cupyattn/paged.py, window= / softcap=;
# staged page ids)
_SIMT_NEEDS = tuple((_simt_expr(t, d, tile, sv, st), 0, _smem("simt", t, d, tile, 1, st)) for sv, st in VARIANTS
                    for t in DTYPES for d in HEAD_DIMS
                    for tile in _tiles_and_small(DECODE_SIMT_TILES[(d, t.itemsize)]))
_MMA_NEEDS = tuple((_mma_expr(t, d, m, tile, sv, st), MMA_MIN_CC[t], _smem("mma", t, d, tile, m, st))
                   for sv, st in VARIANTS
                   for t in MMA_DTYPES for d in HEAD_DIMS for m in range(1, DECODE_MMA_MAX_MTILES + 1)
                   for tile in mma_tiles(t, d, m))
SPEC = KernelSpec(
    "decode", "decode.cu",
    tuple(e for e, _, _ in _SIMT_NEEDS + _MMA_NEEDS) + tuple(_combine_expr(t) for t in DTYPES),
    needs=_SIMT_NEEDS + _MMA_NEEDS)

_SM_COUNT: dict[int, int] = {}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which kernel a decode call launches and how its grid covers the heads."""
    impl: str
    expr: str
    tile: DecodeTile
    head_tiles: int   # blocks per kv head (and split)


@dataclasses.dataclass(frozen=True)
class Serving:
    """The serving arguments of a decode launch (kernels_cu/decode.cu DECODE_SERVING_PARAMS): a
    block table over pages (None: the contiguous cache) in ``layout`` "NHD" or "HND", the
    window's left bound (-1: none) and the softcap (0: off). ``max_seq`` of a paged launch is
    max_pages * page_size."""
    block_table: object = None
    log2_page: int = 0
    num_pages: int = 0
    win_left: int = -1
    softcap: float = 0.0
    layout: str = "NHD"

    @property
    def active(self) -> bool:
        return self.block_table is not None or self.win_left >= 0 or self.softcap > 0

    def args(self):
        bt = self.block_table
        return (bt if bt is not None else NULL, np.int32(bt.shape[1] if bt is not None else 0),
                np.int32(self.log2_page), np.int32(self.num_pages), np.int32(self.layout == "HND"),
                np.int32(self.win_left), np.float32(self.softcap * math.log2(math.e)))


def _plan(impl: str, dtype, d: int, group: int, cc: int | None = None, smem_limit: int | None = None,
          serving: bool = False, staged: bool = False) -> _Plan:
    """The kernel and tile of a call. ``cc`` / ``smem_limit``: the device's compute capability and
    per-block shared memory (None: any, the full tiles); impl="auto" takes mma only where the
    device has its instructions and one of its tiles fits, and each tile falls back to a
    shallower ring where it does not fit (an explicit impl="mma" then to its compact tile).
    ``serving``: the paged / window / softcap variant; ``staged``: its staged page ids (a
    block table only)."""
    explicit = impl == "mma"
    if impl == "auto":
        mma_ok = (np.dtype(dtype) in MMA_DTYPES and group >= DECODE_MMA_MIN_GROUP
                  and (cc is None or impl_runs_on("decode", "mma", dtype, cc)))
        m_tiles = min(-(-group // DECODE_MMA_ROWS), DECODE_MMA_MAX_MTILES)
        if mma_ok and _fit("mma", dtype, d, DECODE_MMA_TILES[(d, m_tiles)], m_tiles, smem_limit,
                           staged=staged) is None:
            mma_ok = False
        impl = "mma" if mma_ok else "simt"
    if impl == "mma":
        m_tiles = min(-(-group // DECODE_MMA_ROWS), DECODE_MMA_MAX_MTILES)
        rows = DECODE_MMA_ROWS * m_tiles
        base = DECODE_MMA_TILES[(d, m_tiles)]
        t = _fit(impl, dtype, d, base, m_tiles, smem_limit, explicit, staged) or base  # else the loader says so
        return _Plan(impl, _mma_expr(dtype, d, m_tiles, t, serving, staged), t, -(-group // rows))
    base = DECODE_SIMT_TILES[(d, np.dtype(dtype).itemsize)]
    t = _fit(impl, dtype, d, base, 1, smem_limit, staged=staged) or base
    return _Plan(impl, _simt_expr(dtype, d, t, serving, staged), t, -(-group // DECODE_HEAD_TILE))


def _device_plan(fn: str, impl: str, dtype, d: int, group: int, serving: bool = False,
                 staged: bool = False) -> _Plan:
    """:func:`_plan` for the current device (ComputeCapabilityError for an impl it cannot run)."""
    if impl == "mma":
        cc = _checks.require_impl(fn, "decode", impl, dtype)
    else:
        cc = _loader.device_compute_capability()
    return _plan(impl, dtype, d, group, cc, _loader.device_smem_optin(), serving, staged)


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, kv_heads: int, max_len: int, sm_count: int, blocks_per_sm: int = 1) -> int:
    """Split count for a decode step, from the live length, the SM count and wave quantisation.

    A launch of ``blocks = batch * kv_heads`` blocks per split (``kv_heads`` counts blocks per
    sequence: kv heads times head tiles) runs ``slots = sm_count * blocks_per_sm`` blocks at a
    time, so ``s`` splits take ``ceil(blocks * s / slots)`` waves, each as long as one split's
    work, ``ceil(max_len / s) + DECODE_SPLIT_OVERHEAD_KEYS`` key-times. The result is the ``s`` in
    ``[1, s_max]`` of least cost (the fewest splits among equals), where ``s_max =
    min(DECODE_MAX_SPLITS, max_len // DECODE_MIN_KEYS_PER_SPLIT)`` (at least 1). There is no
    other cap: a single sequence with one kv head (MQA, batch 1) gets enough splits to fill every
    SM when its length allows. ``max_len`` is the longest *live* length (not ``max_seq``).

    Pure and cheap: it visits one candidate per wave count (the fewest splits that reach the
    wave's best per-split length) and stops once no later wave can beat the best found.
    """
    blocks, slots, n = max(1, batch * kv_heads), max(1, sm_count * blocks_per_sm), max(0, max_len)
    s_max = max(1, min(DECODE_MAX_SPLITS, n // DECODE_MIN_KEYS_PER_SPLIT))
    over = DECODE_SPLIT_OVERHEAD_KEYS
    best, best_cost = 1, -(-blocks // slots) * (n + over)
    w = 1
    while (w - 1) * slots // blocks + 1 <= s_max:
        s_lo, s_hi = (w - 1) * slots // blocks + 1, min(s_max, w * slots // blocks)
        if s_hi >= s_lo:  # every s in [s_lo, s_hi] runs in exactly w waves
            k = -(-n // s_hi)                           # least keys per split in this wave count
            s = max(s_lo, -(-n // k) if k else s_lo)    # fewest splits with that many keys
            if w * (k + over) < best_cost:
                best, best_cost = s, w * (k + over)
        w += 1
        if n * blocks / slots + w * over >= best_cost:  # a lower bound on every later wave count
            break
    return best


def wave_splits(lengths, blocks_per_seq: int, sm_count: int, blocks_per_sm: int = 1) -> tuple[int, int]:
    """(num_splits, split_keys) of the "waves" rule for sequences of ``lengths`` live keys, each
    taking ``blocks_per_seq`` blocks per split (kv heads times head tiles), on ``sm_count`` SMs
    running ``blocks_per_sm`` blocks each (``slots``).

    FlashAttention-3's rule (hopper/heuristics.h): for each candidate count ``s`` in ``[1,
    s_max]`` (``s_max = min(DECODE_WAVE_MAX_SPLITS, longest // DECODE_MIN_KEYS_PER_SPLIT)``, at
    least 1) the chunk is ``K = ceil(longest / s)`` keys and sequence b takes ``max(1, ceil(len_b
    / K))`` splits (decode.cu SeqSplit, split_keys = K); its wave efficiency is the useful work over
    the waves it occupies, ``blocks_per_seq * sum(len_b) / (K * ceil(items / slots) * slots)``
    (FA3's ``n_waves / ceil(n_waves)`` when every length is the same). The answer is the smallest
    ``s`` whose efficiency is at least DECODE_WAVE_EFFICIENCY of the best. FA3 returns 1 split
    whenever the blocks fill 80% of the SMs; that shortcut is left out, since in a ragged batch
    the longest sequences then run alone at the end (the efficiency term sees that). Pure.
    """
    return _wave_splits(tuple(max(0, int(n)) for n in lengths), max(1, blocks_per_seq),
                        max(1, sm_count * blocks_per_sm))


@functools.lru_cache(maxsize=1024)
def _wave_splits(lengths: tuple, bps: int, slots: int) -> tuple[int, int]:
    lens = np.asarray(lengths, dtype=np.int64)
    longest = int(lens.max()) if lens.size else 0
    if longest == 0:
        return 1, 1
    s = np.arange(1, max(1, min(config.DECODE_WAVE_MAX_SPLITS, longest // DECODE_MIN_KEYS_PER_SPLIT)) + 1)
    keys = -(-longest // s)                                                 # K per candidate
    items = bps * np.maximum(1, -(-lens[None, :] // keys[:, None])).sum(axis=1)
    eff = bps * int(lens.sum()) / (keys * (-(-items // slots)) * slots)
    pick = int(np.argmax(eff >= config.DECODE_WAVE_EFFICIENCY * eff.max()))
    return int(s[pick]), int(keys[pick])


def check_split_rule(fn: str, split_rule) -> str:
    """``split_rule`` (None: config.DECODE_SPLIT_RULE) as one of config.DECODE_SPLIT_RULES."""
    if split_rule is None:
        return config.DECODE_SPLIT_RULE
    check_choice(fn, "split_rule", split_rule, config.DECODE_SPLIT_RULES)
    return split_rule


def schedule(rule: str, plan, batch: int, num_kv_heads: int, lengths, num_splits=None,
             win_left: int = -1) -> tuple[int, int]:
    """(num_splits, split_keys) of a launch under split rule ``rule``: ``lengths`` the sequences'
    cached lengths as known on the host (a bound for each where only that is known),
    ``win_left`` the window's left bound (a query sees at most win_left + 1 keys). "cost":
    ``num_splits`` or :func:`choose_num_splits` on the longest, uniform chunks (split_keys 0);
    "waves": ``num_splits`` (chunks of ceil(longest / num_splits) keys per sequence) or
    :func:`wave_splits`."""
    live = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if win_left >= 0:
        live = np.minimum(live, win_left + 1)
    longest = int(live.max()) if live.size else 0
    bps = num_kv_heads * plan.head_tiles
    if rule == "cost":
        if num_splits is None:
            num_splits = choose_num_splits(batch, bps, longest, _sm_count(), DECODE_SPLIT_BLOCKS_PER_SM)
        return num_splits, 0
    if num_splits is None:
        return wave_splits(live, bps, _sm_count(), DECODE_SPLIT_BLOCKS_PER_SM)
    return num_splits, max(1, -(-longest // num_splits))


def auto_num_splits(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, max_len: int,
                    impl: str = "auto", split_rule=None) -> int:
    """The split count ``decode_attention(num_splits=None, impl=impl, split_rule=split_rule)``
    picks on the current device for these shapes when every sequence holds ``max_len`` keys; for
    callers that fix the count in advance (a CUDA graph captured per range of context lengths)."""
    rule = check_split_rule("auto_num_splits", split_rule)
    plan = _device_plan("auto_num_splits", impl, dtype, head_dim, num_heads // num_kv_heads)
    return schedule(rule, plan, batch, num_kv_heads, [max_len] * batch)[0]


def _sm_count() -> int:
    dev = cupy.cuda.Device()
    n = _SM_COUNT.get(dev.id)
    if n is None:
        n = _SM_COUNT[dev.id] = int(dev.attributes["MultiProcessorCount"])
    return n


def _check_args(fn, q, cache, layer, scale, num_splits, out, impl):
    """Validate everything; return (layer, B, Hq, D, scale, num_splits or None, plan)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{fn}(): cache must be a cupyattn.KVCache, got {type(cache).__name__}")
    if hasattr(cache, "block_table"):
        raise TypeError(f"{fn}(): cache is a PagedKVCache: use cache.decode(q[:, :, 0], layer) "
                        f"(decode_attention_paged)")
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
    scale = 1.0 / math.sqrt(d) if scale is None else _checks.check_real(fn, "scale", scale)
    if num_splits is not None:
        num_splits = _checks.check_int(fn, "num_splits", num_splits, 1, DECODE_MAX_SPLITS)
    check_choice(fn, "impl", impl, DECODE_IMPLS)
    if impl == "mma" and np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{fn}(): impl='mma' needs float16 or bfloat16, got {np.dtype(q.dtype)} "
                        f"(use impl='simt' or 'auto')")
    plan = _device_plan(fn, impl, q.dtype, d, hq // cache.num_kv_heads)
    _checks.check_grid_yz(fn, "the batch (q.shape[0])", b)  # grid z (a paged call's batch is q's own)
    if cache.num_kv_heads * plan.head_tiles > MAX_GRID_YZ:
        raise ValueError(f"{fn}(): {hq} query heads need {cache.num_kv_heads * plan.head_tiles} blocks in "
                         f"a launch's grid y, more than {MAX_GRID_YZ}")
    if out is not None:
        check_out(fn, out, (b, hq, 1, d), q.dtype)
        _checks.check_no_overlap(fn, out, {"q": q, **cache.device_arrays()})
    return layer, b, hq, d, float(scale), num_splits, plan


def _launch(q, cache, layer, scale, num_splits, out, plan, workspace=None, combine=True, fused_combine=False,
            sv=None, split_keys=0):
    """Run the decode kernel, and the combine kernel when split (``combine=False`` keeps only the
    split partials in ``workspace``, for tests; ``fused_combine``: the decode kernel's last split
    block merges, counted on ``workspace[2]``, and nothing else is launched). ``sv``: Serving
    arguments (the plan must be a serving one); ``split_keys``: 0 for uniform chunks, else the
    per-sequence chunk length (schedule; a serving plan only, serving_plan(per_sequence=True)).
    ``cache`` may be any object with the KVCache
    attributes used here (cupyattn.paged passes its pages that way)."""
    b, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    hkv = cache.num_kv_heads
    split = num_splits > 1 or not combine
    counters = NULL
    if split:
        o_part, lse_part = workspace[:2] if workspace is not None else (
            cupy.empty((num_splits, b, hq, d), dtype=np.float32), cupy.empty((num_splits, b, hq), dtype=np.float32))
        if fused_combine and combine:
            counters = workspace[2] if workspace is not None and len(workspace) > 2 else \
                cupy.zeros((b, hq), dtype=np.uint32)
        # without the fused combine the kernel writes only the partials (and, per sequence, the
        # rows of one split): the out pointer is read only then
        out_arg = out if counters is not NULL or split_keys else o_part
    else:
        out_arg = o_part = lse_part = out  # the kernel writes only out
    i32, i64 = np.int32, np.int64
    sv = sv or Serving()
    smem = plan.tile.ring_bytes
    kern = get_function(SPEC, plan.expr, dynamic_smem=smem)
    kern((num_splits, hkv * plan.head_tiles, b), (plan.tile.threads,),
         (q, cache.k[layer], cache.v[layer], cache.lengths[layer], out_arg, o_part, lse_part, counters,
          i64(q.strides[0] // q.itemsize), i64(q.strides[1] // q.itemsize),
          i32(b), i32(hq), i32(hkv), i32(cache.max_seq), i32(num_splits),
          np.float32(scale * math.log2(math.e)), i32(1 if split else 0), i32(split_keys), *sv.args()),
         shared_mem=smem)
    if split and combine and counters is NULL:
        merge = get_function(SPEC, _combine_expr(cache.dtype))
        merge((b * hq,), (DECODE_COMBINE_THREADS,),
              (o_part, lse_part, out, i32(num_splits), i32(b * hq), i32(d), cache.lengths[layer], i32(hq),
               i32(cache.max_seq), i32(sv.win_left), i32(split_keys)))
    return out


def decode_attention(q, cache, layer, scale=None, num_splits=None, out=None, workspace=None, impl="auto",
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
    impl : {"auto", "simt", "mma"}
        Kernel (module docstring): "auto" is tensor cores for fp16/bf16 with a GQA group of 4 or
        more, SIMT otherwise; "mma" needs fp16/bf16.
    fused_combine : bool, optional
        Merge the splits inside the decode kernel (the last split block of each head tile to
        finish merges, found by an atomic counter) instead of a second kernel: one launch per
        call (tinylm's fused decode step uses it: config.TINYLM_FUSED_DECODE). None: True under
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
    layer, b, hq, d, scale, num_splits, plan = _check_args(fn, q, cache, layer, scale, num_splits, out, impl)
    rule = check_split_rule(fn, split_rule)
    fused_combine = rule == "waves" if fused_combine is None else _checks.check_bool(fn, "fused_combine", fused_combine)
    sv, plan = serving_plan(fn, window, softcap, impl, q.dtype, d, hq // cache.num_kv_heads, plan,
                            per_sequence=rule == "waves")
    num_splits, split_keys = schedule(rule, plan, b, cache.num_kv_heads, cache.host_lengths[layer], num_splits,
                                      sv.win_left if sv else -1)
    if workspace is not None:
        _check_workspace(fn, workspace, num_splits, b, hq, d, {"q": q, "out": out, **cache.device_arrays()},
                         fused_combine)
    if out is None:
        out = cupy.empty((b, hq, 1, d), dtype=q.dtype)
    if hq == 0:
        return out  # no query heads: nothing to compute (and no empty grid to launch)
    return _launch(q, cache, layer, scale, num_splits, out, plan, workspace, fused_combine=fused_combine, sv=sv,
                   split_keys=split_keys)


def serving_plan(fn, window, softcap, impl, dtype, d, group, plan, per_sequence=False, **paged):
    """Window / softcap / paging -> (Serving or None, the plan to launch). ``paged``: Serving's
    block-table fields; with a block table and config.DECODE_PAGE_STAGING the staged variant.
    ``per_sequence`` (the "waves" rule): the serving variant in any case, since only the serving
    kernels split per sequence (decode.cu SeqSplit); the plain ones stay as measured."""
    from .flash_attn import check_window_softcap

    (left, _), cap = check_window_softcap(fn, window, softcap, False)
    sv = Serving(win_left=left, softcap=cap, **paged)
    if not sv.active and not per_sequence:
        return None, plan
    staged = sv.block_table is not None and bool(config.DECODE_PAGE_STAGING)
    if isinstance(plan, _Plan):  # the device's choice (impl, tile fitted to its shared memory), serving variant
        return sv, _device_plan(fn, plan.impl, dtype, d, group, serving=True, staged=staged)
    return sv, _plan(impl, dtype, d, group, serving=True, staged=staged)


def _check_workspace(fn, workspace, num_splits, b, hq, d, inputs, fused_combine=False):
    """The caller's split-KV workspace: types, shapes, and no overlap with ``inputs`` (every other
    array of the call, {name: array or None}: q, out, the cache's arrays or pages, tables and
    lengths) nor with each other."""
    n = 3 if fused_combine else 2
    if not isinstance(workspace, tuple) or len(workspace) not in (n, 3):
        want = "(o_part, lse_part, counters)" if fused_combine else "(o_part, lse_part[, counters])"
        got = f"{len(workspace)} items" if isinstance(workspace, tuple) else type(workspace).__name__
        raise TypeError(f"{fn}(): workspace must be a tuple {want}, got {got}")
    o_part, lse_part = workspace[:2]
    for name, x, tail in (("workspace[0]", o_part, (b, hq, d)), ("workspace[1]", lse_part, (b, hq))):
        check_array(fn, name, x, dtypes=(np.dtype(np.float32),), ndim=len(tail) + 1)
        if tuple(x.shape[1:]) != tail or x.shape[0] < num_splits or not x.flags.c_contiguous:
            raise ValueError(f"{fn}(): {name} must be C-contiguous float32 of shape [S >= {num_splits}, "
                             f"{', '.join(map(str, tail))}], got {tuple(x.shape)}")
        _checks.check_no_overlap(fn, x, inputs, out_name=name)
    _checks.check_no_overlap(fn, o_part, {"workspace[1]": lse_part}, out_name="workspace[0]")
    if len(workspace) == 3:
        counters = workspace[2]
        check_array(fn, "workspace[2]", counters, dtypes=(np.dtype(np.uint32),), ndim=2)
        if tuple(counters.shape) != (b, hq) or not counters.flags.c_contiguous:
            raise ValueError(f"{fn}(): workspace[2] (the fused combine's counters) must be C-contiguous "
                             f"uint32 of shape [{b}, {hq}], got {tuple(counters.shape)}")
        _checks.check_no_overlap(fn, counters, {**inputs, "workspace[0]": o_part, "workspace[1]": lse_part},
                                 out_name="workspace[2]")


def decode_split_partials(q, cache, layer, num_splits, scale=None, impl="auto"):
    """The split kernel's workspace, for tests: (o_part float32 [splits, B, Hq, D], lse_part
    float32 [splits, B, Hq], natural log, -inf for empty chunks), as
    ``reference.decode_split_partials`` (whose arrays carry an extra length-1 query axis)."""
    fn = "decode_split_partials"
    layer, b, hq, d, scale, num_splits, plan = _check_args(fn, q, cache, layer, scale, num_splits, None, impl)
    if num_splits is None:
        raise ValueError(f"{fn}(): num_splits is required")
    o_part = cupy.empty((num_splits, b, hq, d), dtype=np.float32)
    lse_part = cupy.empty((num_splits, b, hq), dtype=np.float32)
    _launch(q, cache, layer, scale, num_splits, None, plan, (o_part, lse_part), combine=False)
    return o_part, lse_part


__all__ = ["decode_attention", "choose_num_splits", "auto_num_splits", "KVCache"]
