"""The decode kernels' launch (``kernels_cu/decode.cu``): tiles, instantiations, plans and the one
launch every decode entry point shares.

:func:`cupyattn.decode_attention`, :meth:`KVCache.decode`, :func:`cupyattn.decode_attention_paged`
and :meth:`PagedKVCache.decode` hand a layer's keys and values here as a :class:`KvView` (the
contiguous cache, or pages through a block table with :class:`Serving`); :func:`decode` is the
whole call, :func:`check`, :func:`serving_plan`, :func:`check_workspace` and :func:`launch` its steps.
The split count comes from :mod:`cupyattn.splits`, impl=None's kernel from cupyattn/options.py.
"""
from __future__ import annotations

import dataclasses
import math

import cupy
import numpy as np

from . import _checks, device, options
from ._checks import check_array, check_choice, check_last_contiguous, check_out, check_same_dtype
from ._loader import NULL, KernelSpec, ctype, get_function
from . import config
from .config import (DECODE_COMBINE_THREADS, DECODE_HEAD_TILE, DECODE_IMPLS, DECODE_MAX_SPLITS, DECODE_MMA_MAX_MTILES,
                     DECODE_MMA_ROWS, DECODE_MMA_SMALL_SMEM_TILES, DECODE_MMA_TILES, DECODE_SIMT_TILES,
                     DECODE_SMALL_SMEM_STAGES, DTYPES, HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES, MMA_MIN_CC, DecodeTile,
                     a_family_has_less)
from .flash_launch import check_window_softcap
from .splits import check_split_rule, schedule

# impl= of the decode entry points: None (the default, options.DEFAULTS) or one of config.DECODE_IMPLS
# ("auto" is None's alias)
IMPLS = (None,) + DECODE_IMPLS


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
    window), checked against ptxas' numbers in tests/cupyattn/test_gpu_families.py."""
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


# --- plans: which kernel and tile a call launches ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
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


def make_plan(impl, dtype, d: int, group: int, cc: int | None = None, smem_limit: int | None = None,
              serving: bool = False, staged: bool = False) -> Plan:
    """The kernel and tile of a call. ``cc`` / ``smem_limit``: the device's compute capability and
    per-block shared memory (None: any, the full tiles); impl=None ("auto") is options.DEFAULTS'
    choice (mma only where the device has its instructions and one of its tiles fits), and each tile falls back to a
    shallower ring where it does not fit (an explicit impl="mma" then to its compact tile).
    ``serving``: the paged / window / softcap variant; ``staged``: its staged page ids (a
    block table only)."""
    explicit = impl == "mma"
    if options.is_default(impl):  # options.DEFAULTS["decode_attention"]: mma where a tile of it fits
        m = min(-(-group // DECODE_MMA_ROWS), DECODE_MMA_MAX_MTILES)
        impl = options.choose(options.Call(
            "decode_attention", dtype, d, cc, smem_limit, group=group,
            fits=lambda i: _fit(i, dtype, d, DECODE_MMA_TILES[(d, m)], m, smem_limit, staged=staged) is not None))
    if impl == "mma":
        m_tiles = min(-(-group // DECODE_MMA_ROWS), DECODE_MMA_MAX_MTILES)
        rows = DECODE_MMA_ROWS * m_tiles
        base = DECODE_MMA_TILES[(d, m_tiles)]
        t = _fit(impl, dtype, d, base, m_tiles, smem_limit, explicit, staged) or base  # else the loader says so
        return Plan(impl, _mma_expr(dtype, d, m_tiles, t, serving, staged), t, -(-group // rows))
    base = DECODE_SIMT_TILES[(d, np.dtype(dtype).itemsize)]
    t = _fit(impl, dtype, d, base, 1, smem_limit, staged=staged) or base
    return Plan(impl, _simt_expr(dtype, d, t, serving, staged), t, -(-group // DECODE_HEAD_TILE))


def device_plan(fn: str, impl, dtype, d: int, group: int, serving: bool = False,
                staged: bool = False) -> Plan:
    """:func:`make_plan` for the current device (ComputeCapabilityError for an impl it cannot run)."""
    if impl == "mma":
        cc = _checks.require_impl(fn, "decode", impl, dtype)
    else:
        cc = device.compute_capability()
    return make_plan(impl, dtype, d, group, cc, device.smem_optin(), serving, staged)


def serving_plan(fn, window, softcap, impl, dtype, d, group, plan, per_sequence=False, **paged):
    """Window / softcap / paging -> (Serving or None, the plan to launch). ``paged``: Serving's
    block-table fields; with a block table and config.DECODE_PAGE_STAGING the staged variant.
    ``per_sequence`` (the "waves" rule): the serving variant in any case, since only the serving
    kernels split per sequence (decode.cu SeqSplit); the plain ones stay as measured."""
    (left, _), cap = check_window_softcap(fn, window, softcap, False)
    sv = Serving(win_left=left, softcap=cap, **paged)
    if not sv.active and not per_sequence:
        return None, plan
    staged = sv.block_table is not None and bool(config.DECODE_PAGE_STAGING)
    if isinstance(plan, Plan):  # the device's choice (impl, tile fitted to its shared memory), serving variant
        return sv, device_plan(fn, plan.impl, dtype, d, group, serving=True, staged=staged)
    return sv, make_plan(impl, dtype, d, group, serving=True, staged=staged)


@dataclasses.dataclass(frozen=True)
class KvView:
    """One layer's keys and values as the decode kernels read them: a KVCache's layer, or pages
    (with a Serving's block table)."""
    k: object               # [B, Hkv, max_seq, D] C-contiguous, or pages [N, P, Hkv, D] / [N, Hkv, P, D]
    v: object
    lengths: object         # int32 [B] on the device (the kernels clamp them to [0, max_seq])
    num_kv_heads: int
    head_dim: int
    batch: int
    max_seq: int            # keys a sequence may hold (paged: the block table's capacity)
    dtype: object
    arrays: dict            # every device array of its source, by the name errors use


def check(fn, q, kv: "KvView", scale, num_splits, out, impl):
    """Every check of a decode call of q [B, Hq, 1, D] over ``kv``, before anything is allocated
    or launched -> (B, Hq, D, scale, num_splits or None, plan)."""
    check_array(fn, "q", q, ndim=4)
    check_same_dtype(fn, "q", q, "the cache", kv.k)
    b, hq, one, d = q.shape
    if b != kv.batch or one != 1 or d != kv.head_dim:
        raise ValueError(f"{fn}(): q has shape {tuple(q.shape)}, expected [batch={kv.batch}, Hq, 1, "
                         f"head_dim={kv.head_dim}]")
    if hq % kv.num_kv_heads:
        raise ValueError(f"{fn}(): q has {hq} heads, not a multiple of the cache's "
                         f"{kv.num_kv_heads} kv heads")
    if d not in HEAD_DIMS:
        raise ValueError(f"{fn}(): head_dim {d} is not supported; expected one of {HEAD_DIMS}")
    check_last_contiguous(fn, "q", q)
    scale = 1.0 / math.sqrt(d) if scale is None else _checks.check_real(fn, "scale", scale)
    if num_splits is not None:
        num_splits = _checks.check_int(fn, "num_splits", num_splits, 1, DECODE_MAX_SPLITS)
    check_choice(fn, "impl", impl, IMPLS)
    if impl == "mma" and np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{fn}(): impl='mma' needs float16 or bfloat16, got {np.dtype(q.dtype)} "
                        f"(use impl='simt' or impl=None)")
    plan = device_plan(fn, impl, q.dtype, d, hq // kv.num_kv_heads)
    _checks.check_grid_yz(fn, "the batch (q.shape[0])", b)  # grid z (a paged call's batch is q's own)
    if kv.num_kv_heads * plan.head_tiles > MAX_GRID_YZ:
        raise ValueError(f"{fn}(): {hq} query heads need {kv.num_kv_heads * plan.head_tiles} blocks in "
                         f"a launch's grid y, more than {MAX_GRID_YZ}")
    if out is not None:
        check_out(fn, out, (b, hq, 1, d), q.dtype)
        _checks.check_no_overlap(fn, out, {"q": q, **kv.arrays})
    return b, hq, d, float(scale), num_splits, plan


def launch(q, kv: KvView, scale, num_splits, out, plan, workspace=None, combine=True, fused_combine=False,
           sv=None, split_keys=0):
    """Run the decode kernel, and the combine kernel when split (``combine=False`` keeps only the
    split partials in ``workspace``, for tests; ``fused_combine``: the decode kernel's last split
    block merges, counted on ``workspace[2]``, and nothing else is launched). ``sv``: Serving
    arguments (the plan must be a serving one); ``split_keys``: 0 for uniform chunks, else the
    per-sequence chunk length (schedule; a serving plan only, serving_plan(per_sequence=True))."""
    b, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    hkv = kv.num_kv_heads
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
         (q, kv.k, kv.v, kv.lengths, out_arg, o_part, lse_part, counters,
          i64(q.strides[0] // q.itemsize), i64(q.strides[1] // q.itemsize),
          i32(b), i32(hq), i32(hkv), i32(kv.max_seq), i32(num_splits),
          np.float32(scale * math.log2(math.e)), i32(1 if split else 0), i32(split_keys), *sv.args()),
         shared_mem=smem)
    if split and combine and counters is NULL:
        merge = get_function(SPEC, _combine_expr(kv.dtype))
        merge((b * hq,), (DECODE_COMBINE_THREADS,),
              (o_part, lse_part, out, i32(num_splits), i32(b * hq), i32(d), kv.lengths, i32(hq),
               i32(kv.max_seq), i32(sv.win_left), i32(split_keys)))
    return out


def check_workspace(fn, workspace, num_splits, b, hq, d, inputs, fused_combine=False):
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




def decode(fn, q, kv: KvView, host_lengths, scale=None, num_splits=None, out=None, workspace=None, impl=None,
           fused_combine=None, window=None, softcap=None, split_rule=None):
    """A whole decode call of q [B, Hq, 1, D] over ``kv`` (decode_attention, KVCache.decode):
    checks, plan, split schedule on ``host_lengths`` (the host's copy of kv.lengths), launch."""
    b, hq, d, scale, num_splits, plan = check(fn, q, kv, scale, num_splits, out, impl)
    rule = check_split_rule(fn, split_rule)
    fused_combine = rule == "waves" if fused_combine is None else _checks.check_bool(fn, "fused_combine", fused_combine)
    sv, plan = serving_plan(fn, window, softcap, impl, q.dtype, d, hq // kv.num_kv_heads, plan,
                            per_sequence=rule == "waves")
    num_splits, split_keys = schedule(rule, plan, b, kv.num_kv_heads, host_lengths, num_splits,
                                      sv.win_left if sv else -1)
    if workspace is not None:
        check_workspace(fn, workspace, num_splits, b, hq, d, {"q": q, "out": out, **kv.arrays}, fused_combine)
    if out is None:
        out = cupy.empty((b, hq, 1, d), dtype=q.dtype)
    if hq == 0:
        return out  # no query heads: nothing to compute (and no empty grid to launch)
    return launch(q, kv, scale, num_splits, out, plan, workspace, fused_combine=fused_combine, sv=sv,
                  split_keys=split_keys)
