"""The Hopper attention kernel (``kernels_cu/flash_attn_sm90.cu``): its instantiations, tensor maps,
L2 section size and launch; and ``attention(..., impl="wgmma")``.

One kernel, FlashAttention-3's split: a mainloop shared by every case (a TMA loader warp, two
``wgmma`` consumer warpgroups), one epilogue (dense and packed outputs, lse) and a tile scheduler as
a template parameter: the grid (one block per tile, ``impl="wgmma"``) or the persistent scheduler
(one block per SM, ``impl="wgmma_persistent"``, :mod:`cupyattn.flash_attn_sm90_persistent`). Both
take tiles in one order, sequence by sequence, heads in L2 sections, heaviest query tiles first
when causal; the section size comes from the K/V traffic model (:mod:`cupyattn.kv_traffic`) for
dense calls.

``impl="wgmma"``: float16 / bfloat16, head dims ``config.ATTN_WGMMA_TILES`` (64, 128, 256), causal
(bottom-right), GQA/MQA, ``key_lengths``, additive masks, ``scale``, ``return_lse``, ``out=``; not
``window`` or ``softcap`` (cupyattn/options.py refuses them for this impl; the persistent impl takes
both). It needs an sm_90 device and q, k, v that TMA can read: 16-byte-aligned base pointers and
batch / head / row strides that are positive multiples of 16 bytes (a contiguous tensor always
qualifies: D is 64, 128 or 256; a broadcast or reversed view never does).

``impl=None`` takes it on sm_90 for the (dtype, head dim) pairs measured faster than ``flash_mma``
(``config.ATTN_AUTO_WGMMA``) wherever it can launch (:func:`launch_problem`; cupyattn/options.py DEFAULTS), tinylm's prefill included.
Variants (``config.ATTN_SM90_*``, opt-in until a GPU run decides): the persistent scheduler for
``impl="wgmma"``, 128 x 176 tiles at D = 128 without causal, the overlap switched, a fixed section.
:mod:`cupyattn.flash_attn` calls :func:`check` from its argument checks and :func:`run` to launch.
"""
from __future__ import annotations

import dataclasses
import math
import threading

import cupy
import numpy as np

from . import _checks, _loader, device
from . import config as C
from . import kv_traffic, tma
from ._loader import KernelSpec, cbool, ctype, get_function, ptr_or_null
from .config import INT32_MAX, MMA_DTYPES
from .gemm import _filled

_FN = "attention"
GRID, PERSIST = 0, 1   # the kernel's SCHED template argument (flash_attn_sm90_sched.cuh)
SMEM_LIMIT = 227 * 1024


def smem_bytes(tile: C.AttnWgmmaTile, head_dim: int, sched: int) -> int:
    """Dynamic shared memory of one block (kernels_cu/flash_attn_sm90.cuh Fa3Smem::BYTES): Q slots
    (two for a persistent block where they fit), STAGES K and V slots, 1 KB of alignment."""
    q, kv = tile.block_m * head_dim * 2, tile.block_n * head_dim * 2
    q_slots = 2 if sched == PERSIST and 2 * q + 2 * tile.stages * kv + 1024 <= SMEM_LIMIT else 1
    return q_slots * q + 2 * tile.stages * kv + 1024


def _expr(dtype, head_dim: int, tile: C.AttnWgmmaTile, sched: int) -> str:
    """Template name expression of the kernel for a dtype, head dim, tile and scheduler."""
    rp, rc = C.ATTN_WGMMA_REGS
    return (f"flash_attn_sm90<{ctype(dtype)}, {head_dim}, {tile.block_n}, {tile.stages}, {cbool(tile.overlap)}, "
            f"{cbool(tile.pingpong)}, {sched}, {rp}, {rc}>")


def _flip(t: C.AttnWgmmaTile) -> C.AttnWgmmaTile:
    return dataclasses.replace(t, overlap=not t.overlap, reason=t.reason + " (overlap switched: variant)")


def instantiations() -> list[tuple[str, int, C.AttnWgmmaTile, int]]:
    """(dtype, head dim, tile, scheduler) of every instantiation a call can launch: each scheduler's
    tile table, the overlap switched at D = 128 (config.ATTN_SM90_OVERLAP) and for the persistent
    D = 256 tile, and the grid's wide D = 128 tile (config.ATTN_SM90_WIDE_N)."""
    out = []
    for dt in MMA_DTYPES:
        for d in C.ATTN_WGMMA_TILES:
            for sched, table in ((GRID, C.ATTN_WGMMA_TILES), (PERSIST, C.ATTN_WGMMA_PERSISTENT_TILES)):
                out.append((dt, d, table[d], sched))
                if d == 128 or (d == 256 and sched == PERSIST):
                    out.append((dt, d, _flip(table[d]), sched))
            out += [(dt, 128, C.ATTN_SM90_WIDE_TILE, GRID)] if d == 128 else []
    return out


SPEC = KernelSpec("flash_attn_sm90", "flash_attn_sm90.cu",
                  tuple(dict.fromkeys(_expr(dt, d, t, s) for dt, d, t, s in instantiations())), sm90a=True)


def tile_for(impl: str, head_dim: int, sched: int, causal_or_window: bool) -> C.AttnWgmmaTile:
    """The tile a call launches: the impl's table entry, or a variant the config asks for
    (config.ATTN_SM90_WIDE_N, config.ATTN_SM90_OVERLAP) where one is built."""
    table = C.ATTN_WGMMA_TILES if impl == "wgmma" else C.ATTN_WGMMA_PERSISTENT_TILES
    t = table[head_dim]
    if impl == "wgmma" and sched == GRID and head_dim == 128 and C.ATTN_SM90_WIDE_N and not causal_or_window:
        return C.ATTN_SM90_WIDE_TILE
    if C.ATTN_SM90_OVERLAP is not None and C.ATTN_SM90_OVERLAP != t.overlap:
        flipped = _flip(t)
        if _expr(np.float16, head_dim, flipped, sched) in SPEC.name_expressions:
            return flipped
    return t


# --- tensor maps ---------------------------------------------------------------------------------
# An operand: (name, ptr, dims, byte strides of dims 1.., box, dim names), one 4-D map {D, row, head,
# outer} innermost first, boxes of 64 elements x ``rows``. A dimension of extent 1 gets a packed
# stand-in stride (gemm._filled); every other keeps its own, so a broadcast (0) or reversed
# (negative) view is refused by :func:`cupyattn.tma.problem`, naming the dimension, not rewritten.
def _operand(name: str, x, dims, strides, rows: int, names):
    return (name, x.data.ptr, tuple(int(d) for d in dims), [int(s) for s in _filled(strides, dims, x.itemsize)],
            (64, rows, 1, 1), names)


def dense_operand(name, x, rows):
    """x [B, H, S, D] -> map {D, S, H, B}."""
    b, h, s, d = x.shape
    return _operand(name, x, (d, s, h, b), (x.strides[2], x.strides[1], x.strides[0]), rows, ("D", "S", "H", "B"))


def packed_operand(name, x, rows):
    """x [total, H, D] -> map {D, total, H, 1}."""
    t, h, d = x.shape
    return _operand(name, x, (d, t, h, 1), (x.strides[0], x.strides[1], 0), rows, ("D", "total", "H", "-"))


def paged_operand(name, x, rows):
    """pages [N, P, Hkv, D] -> map {D, P, Hkv, N}; ``rows`` = min(P, BLOCK_N) per copy."""
    n, p, h, d = x.shape
    return _operand(name, x, (d, p, h, n), (x.strides[1], x.strides[2], x.strides[0]), rows,
                    ("D", "page_size", "Hkv", "num_pages"))


def operand_problem(ops, dtype) -> str | None:
    """Why TMA cannot read one of ``ops`` (naming it and the dimension), or None."""
    for name, ptr, dims, strides, box, names in ops:
        why = tma.problem(ptr, dtype, dims, strides, box, names=names)
        if why is not None:
            return f"{name}: {why}"
    return None


def dense_ops(q, k, v, tile: C.AttnWgmmaTile):
    return [dense_operand("q", q, tile.block_m), dense_operand("k", k, tile.block_n),
            dense_operand("v", v, tile.block_n)]


def max_tiles(q, b: int) -> int:
    """Tiles of a launch: q dense [B, Hq, Sq, D] B Hq ceil(Sq / 128) exactly; packed [total_q, Hq, D]
    at most Hq (ceil(total_q / 128) + B) (each sequence's last query tile may be partial)."""
    bm = C.ATTN_WGMMA_TILES[q.shape[-1]].block_m   # the kernel's FA3_BLOCK_M
    if q.ndim == 4:
        return q.shape[0] * q.shape[1] * -(-q.shape[2] // bm)
    return q.shape[1] * (-(-q.shape[0] // bm) + b)


# --- the counter, the L2 section ---------------------------------------------------------


_COUNTERS: dict = {}
_COUNTER_LOCK = threading.Lock()


def counter():
    """The dynamic schedule's tile counter of the current (device, stream): 0 between launches."""
    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, stream.ptr)
    with _COUNTER_LOCK:
        c = _COUNTERS.get(key)
        if c is None:
            c = _COUNTERS[key] = cupy.zeros(1, dtype=np.uint32)
    return c


MODEL_MAX_READS = 300_000   # key-tile reads past which the traffic model is not run (about 1 s)


def section(hq: int, hkv: int, kv_bytes_per_head: int, *, dense=None, policy: str = "greedy", grid: bool = False) -> int:
    """Query heads per L2 section. Under config.ATTN_SM90_ORDER = "v3" (the default): for a dense
    launch of the grid scheduler (``grid``) the order of the kernel before the schedulers were split
    out (hq when causal, else 1: :func:`run_dense`), else the L2-share rule
    (config.attn_wgmma_heads_per_section).
    Under "sections": config.ATTN_SM90_SECTION when set (whole GQA groups, at most hq);
    else for a dense launch (``dense`` = (B, Sq, Sk, D, itemsize, causal, block_n)) the traffic
    model's best (kv_traffic.best_section, memoised per shape), and otherwise or for launches too
    large to model cheaply the L2-share rule (config.attn_wgmma_heads_per_section)."""
    group = hq // hkv
    if C.ATTN_SM90_ORDER == "v3":
        # the orders measured on 2026-11-27: a dense grid launch head after head (sections of one),
        # or with causal ranks across all its heads (one section; run_dense folds the batch into
        # the heads where it can, as v3's grid did); the L2-share rule otherwise
        if dense is not None and grid:
            return hq if dense[5] else 1
        return C.attn_wgmma_heads_per_section(device.l2_bytes(), kv_bytes_per_head, group, hq)
    if C.ATTN_SM90_SECTION is not None:
        return max(group, min(hq, int(C.ATTN_SM90_SECTION) // group * group))
    sms, l2 = device.sm_count(), device.l2_bytes()
    if dense is not None:
        b, sq, sk, d, itemsize, causal, block_n = dense
        reads = b * hq * -(-sq // 128) * -(-sk // block_n)
        if reads <= MODEL_MAX_READS:
            return kv_traffic.best_section(b, hq, hkv, sq, sk, d, itemsize, causal, block_n=block_n, sms=sms,
                                           l2_bytes=l2, policy=policy)
    return C.attn_wgmma_heads_per_section(l2, kv_bytes_per_head, group, hq)


# --- launch ----------------------------------------------------------------------------------------
def launch(fn, q, ops, out, lse, *, sched: int, tile: C.AttnWgmmaTile, b, hq, hkv, sq_arg, sk_arg, heads, sms,
           scale, window=(-1, -1), softcap=0.0, kv_lens=None, mask=None, mstrides=(0, 0, 0, 0), cu_q=None,
           cu_k=None, block_table=None, log2_page=0, num_pages=0, dynamic=True, spec: KernelSpec | None = None):
    """One launch (arguments checked by the callers). ``ops``: the q, k, v operands (dense_operand
    and friends); ``sq_arg`` / ``sk_arg``: the kernel's Sq / Sk (the rows of q / out / lse and of k / v
    when packed: the extents every offset read from device memory is clamped to); ``heads``: query
    heads per L2 section (:func:`section`). The grid: FA3_GRID one block per tile (:func:`max_tiles`;
    blocks past a packed launch's tiles only see the end), FA3_PERSIST one per SM (``sms``), at most
    one per tile."""
    d = q.shape[-1]
    maps = [tma.tensor_map(ptr, q.dtype, dims, st, box, fn=fn, what=name) for name, ptr, dims, st, box, _ in ops]
    tiles = max_tiles(q, b)
    grid = tiles if sched == GRID else min(sms, tiles)
    if grid == 0:
        return
    smem = smem_bytes(tile, d, sched)
    kern = get_function(spec or SPEC, _expr(q.dtype, d, tile, sched), dynamic_smem=smem)
    i32, i64 = np.int32, np.int64
    bt = block_table
    kern((grid, 1, 1), (128 * 3, 1, 1),
         (*maps, out, ptr_or_null(lse), ptr_or_null(kv_lens), ptr_or_null(mask), *map(i64, mstrides),
          ptr_or_null(cu_q), ptr_or_null(cu_k), ptr_or_null(bt), i32(bt.shape[1] if bt is not None else 0),
          i32(log2_page), i32(num_pages), counter() if sched == PERSIST and dynamic else _loader.NULL,
          i32(b), i32(hq), i32(hkv), i32(sq_arg), i32(sk_arg), i32(heads), i32(window[0]), i32(window[1]),
          np.float32(softcap * math.log2(math.e)), np.float32(scale * math.log2(math.e)),
          i32(1 if out.data.ptr % 4 == 0 else 0)),
         shared_mem=smem)


def mask_arg(mask, mshape):
    """(mask, element strides [b, h, q, k]) as the kernel reads it: 0 on broadcast dims, the key
    stride 0 or 1 (a strided key dim is copied, at the mask's own, un-broadcast size)."""
    if mask is None:
        return None, [0, 0, 0, 0]
    mask = mask.reshape(mshape)  # leading 1s: a view
    if mshape[3] != 1 and mask.strides[3] != mask.itemsize:
        mask = cupy.ascontiguousarray(mask)
    return mask, [0 if n == 1 else st // mask.itemsize for n, st in zip(mshape, mask.strides)]


def run_dense(fn, impl, q, k, v, causal, scale, kl, out, lse, *, sched, sms, mask=None, mshape=None,
              window=(-1, -1), softcap=0.0, tile=None, dynamic=None, spec=None):
    """attention() on the kernel with scheduler ``sched`` (checked by the caller). ``window``: as
    flash_attn.check_window_softcap returns it, or (-1, -1); causal is folded in here (right = 0).
    The persistent scheduler takes the static stride when tiles are equal (no causal, window or
    key lengths; config.ATTN_WGMMA_STATIC_WHEN_EQUAL), the counter otherwise."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if causal:
        window = (window[0], 0 if window[1] < 0 else min(window[1], 0))
    t = tile or tile_for(impl, d, sched, window != (-1, -1))
    mask, mstr = mask_arg(mask, mshape)
    if dynamic is None:
        dynamic = kl is not None or window != (-1, -1) or not C.ATTN_WGMMA_STATIC_WHEN_EQUAL
    modelled = window in ((-1, -1), (-1, 0))   # the model knows no windows
    heads = section(hq, hkv, 2 * sk * d * q.itemsize,
                    dense=(b, sq, sk, d, q.itemsize, window == (-1, 0), t.block_n) if modelled else None,
                    policy="greedy" if sched == GRID or dynamic else "stride", grid=sched == GRID)
    if sched == GRID and C.ATTN_SM90_ORDER == "v3" and window == (-1, 0) and kl is None and mask is None:
        folded = _fold_batch(q, k, v, out, lse)
        if folded is not None:   # v3's causal order: rank r of every (sequence, head) side by side
            q, k, v, out, lse = folded
            b, hq, hkv, heads = 1, b * hq, b * hkv, b * hq
    launch(fn, q, dense_ops(q, k, v, t), out, lse, sched=sched, tile=t, b=b, hq=hq, hkv=hkv, sq_arg=sq, sk_arg=sk,
           heads=heads, sms=sms, scale=scale, window=window, softcap=softcap, kv_lens=kl, mask=mask, mstrides=mstr,
           dynamic=dynamic, spec=spec)


def _fold_batch(q, k, v, out, lse):
    """q, k, v, out [B, H, S, D] and lse [B, H, S] (or None) as views of B = 1 and B H heads, where
    each one's batch stride is H times its head stride (a view, no copy); else None. Head h of
    sequence b becomes head b H + h, and its K/V head b Hkv + h / group is the same K/V head: the
    kernel's one section of all heads then takes v3's causal order across the batch."""
    arrays = [x for x in (q, k, v, out, lse) if x is not None]
    if any(x.shape[0] > 1 and x.strides[0] != x.shape[1] * x.strides[1] for x in arrays):
        return None
    folded = tuple(None if x is None else x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])
                   for x in (q, k, v, out, lse))
    if any(f is not None and f.data.ptr != x.data.ptr for f, x in zip(folded, (q, k, v, out, lse))):
        return None   # a copy, not a view (the strides above rule it out; out must be written in place)
    return folded


# --- attention(impl="wgmma") ------------------------------------------------------------------------
def _sched() -> int:
    """impl="wgmma"'s scheduler: the grid, or the persistent one (config.ATTN_SM90_DENSE_SCHEDULER)."""
    return PERSIST if C.ATTN_SM90_DENSE_SCHEDULER == "persistent" else GRID


def launch_problem(q, k, v) -> str | None:
    """Why the kernel cannot take these (TMA-readable q, k, v; the grid size), or None: what
    impl=None's TMA condition asks (cupyattn/options.py DEFAULTS) and :func:`check` refuses."""
    b, hq, sq, d = q.shape
    if q.size == 0 or k.shape[2] == 0:
        return None  # nothing is launched
    why = operand_problem(dense_ops(q, k, v, C.ATTN_WGMMA_TILES[d]), q.dtype)
    if why is not None:
        return f"needs q, k, v that TMA can read: {why} (use impl='flash_mma')"
    if max_tiles(q, b) > INT32_MAX:
        return "launches one block per 128 queries of each head: B*Hq*ceil(Sq/128) is over 2^31-1"
    return None


def check(q, k, v) -> None:
    """impl="wgmma"'s own checks, after attention()'s generic ones and before anything is
    allocated: dtype, head dim, an sm_90 device, that TMA can read q, k and v, the grid size."""
    if np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{_FN}(): impl='wgmma' needs float16 or bfloat16 inputs, got {np.dtype(q.dtype)} "
                        f"(use impl='flash')")
    d = q.shape[3]
    if d not in C.ATTN_WGMMA_TILES:
        raise ValueError(f"{_FN}(): head_dim D={d} is not supported by impl='wgmma'; supported: "
                         f"{', '.join(map(str, C.ATTN_WGMMA_TILES))} (impl='flash_mma' takes the others)")
    _checks.require_impl(_FN, "attention", "wgmma", q.dtype)
    why = launch_problem(q, k, v)
    if why is not None:
        raise ValueError(f"{_FN}(): impl='wgmma' {why}")


def run(q, k, v, causal: bool, scale: float, kl, out, lse, mask=None, mshape=None,
        tile: C.AttnWgmmaTile | None = None) -> None:
    """Launch impl="wgmma" (arguments checked by :func:`check`; ``kl``: int32 device key lengths or
    None; ``mask``: float32, broadcastable to ``mshape`` = (B or 1, Hq or 1, Sq or 1, Sk or 1)).
    ``tile`` overrides the config entry (benchmarks.tune); its instantiation must be built."""
    sched = _sched()
    run_dense(_FN, "wgmma", q, k, v, causal, scale, kl, out, lse, sched=sched, sms=device.sm_count(), mask=mask,
              mshape=mshape, tile=tile, spec=None if tile is None else tuning_spec())


# --- tuning candidates (benchmarks.tune) ---------------------------------------------------------------
def tuning_tiles(head_dim: int) -> list[C.AttnWgmmaTile]:
    """Candidate tiles benchmarks.tune measures: key block 64 / 128 (wgmma N) x the stage choices
    that fit 227 KB, with overlap and ping-pong both on; then the configured tile with each of
    the two switched off and with both off. For the registers of one head dim (O and S must leave
    room: D=256 keeps 64 keys)."""
    widths = (64,) if head_dim == 256 else (64, 128)
    out = [C.AttnWgmmaTile(bn, st, "tuning candidate") for bn in widths for st in C.ATTN_WGMMA_STAGE_CHOICES]
    base = C.ATTN_WGMMA_TILES[head_dim]
    out += [C.AttnWgmmaTile(base.block_n, base.stages, "tuning candidate", overlap=ov, pingpong=pp)
            for ov, pp in ((False, True), (True, False), (False, False))]
    return [t for t in out if smem_bytes(t, head_dim, GRID) <= SMEM_LIMIT]


_TUNING_SPEC = None


def tuning_spec() -> KernelSpec:
    """A spec holding every tuning candidate under both schedulers (not registered with the offline
    check's default list until asked for: the candidates are many and only the tuner launches them)."""
    global _TUNING_SPEC
    if _TUNING_SPEC is None:
        exprs = tuple(dict.fromkeys(_expr(dt, d, t, s) for dt in MMA_DTYPES for d in C.ATTN_WGMMA_TILES
                                    for t in tuning_tiles(d) for s in (GRID, PERSIST)
                                    if smem_bytes(t, d, s) <= SMEM_LIMIT))
        _TUNING_SPEC = KernelSpec("flash_attn_sm90_tune", "flash_attn_sm90.cu", exprs, sm90a=True)
    return _TUNING_SPEC
