"""The persistent Hopper attention kernel (``kernels_cu/flash_attn_sm90_persistent.cu``, v4).

v3's TMA + wgmma pipeline (:mod:`cupyattn.flash_attn_sm90`) with a tile scheduler: one block per
SM takes tile after tile, longest first within L2-sized head sections
(:func:`cupyattn.config.attn_wgmma_heads_per_section`), from a counter in global memory where
tiles are unequal (causal, windows, key lengths, packed and paged sequences). It also reads
packed sequences (``attention_varlen``) and paged keys (``attention_paged``), and implements
``window`` and ``softcap``. ``impl="wgmma_persistent"`` of ``attention``, ``attention_varlen``
and ``attention_paged``; impl=None takes it on sm_90 where an H100 run (2026-11-27) measured it
faster than the previous default (config.ATTN_AUTO_PERSISTENT: packed and paged sequences, causal
attention at D = 256) and TMA can read the operands (cupyattn/options.py lists what it implements).

Inputs as v3 takes them (float16 / bfloat16, D of 64, 128 or 256, what TMA can read: 16-byte
aligned base and strides that are positive multiples of 16 bytes: no broadcast or reversed
view); pages of at least ``config.ATTN_WGMMA_MIN_PAGE`` (8) tokens, a power of two, in the
NHD layout ``[num_pages, page_size, Hkv, D]``; ``attention_paged(layout="HND")`` is refused here
(cupyattn/options.py) and served by impl=None.

The dynamic schedule's counter is one uint32 per (device, stream), allocated on the stream's
first call and left at 0 by every launch (the kernel's last claim resets it): calls stay
graph-capturable (warm the stream up before capturing). A graph holds the counter of the stream
it was captured on: do not replay it concurrently with uncaptured calls of this kernel on that
stream.
"""
from __future__ import annotations

import math
import threading

import cupy
import numpy as np

from . import _checks, _loader
from . import config as C
from . import tma
from ._loader import KernelSpec, get_function, ptr_or_null
from .config import INT32_MAX, MMA_DTYPES, cbool, ctype
from .flash_attn_sm90 import _mask_arg, tuning_tiles
from .gemm import _filled

IMPL = "wgmma_persistent"


def _expr(dtype, head_dim: int, tile: C.AttnWgmmaTile | None = None) -> str:
    t = tile or C.ATTN_WGMMA_PERSISTENT_TILES[head_dim]
    rp, rc = C.ATTN_WGMMA_REGS
    return (f"flash_attn_wgmma_persistent<{ctype(dtype)}, {head_dim}, {t.block_n}, {t.stages}, "
            f"{cbool(t.overlap)}, {cbool(t.pingpong)}, {rp}, {rc}>")


SPEC = KernelSpec("flash_attn_sm90_persistent", "flash_attn_sm90_persistent.cu",
                  tuple(_expr(dt, d) for dt in MMA_DTYPES for d in C.ATTN_WGMMA_PERSISTENT_TILES), sm90a=True)


# --- tensor maps -------------------------------------------------------------------------------
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


# --- checks (before anything is allocated) ---------------------------------------------------------
def check(fn: str, impl: str, q, head_dim: int) -> None:
    """dtype, head dim and an sm_90 device."""
    if np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{fn}(): impl={impl!r} needs float16 or bfloat16 inputs, got {np.dtype(q.dtype)} "
                        f"(use impl='flash')")
    if head_dim not in C.ATTN_WGMMA_PERSISTENT_TILES:
        raise ValueError(f"{fn}(): head_dim D={head_dim} is not supported by impl={impl!r}; supported: "
                         f"{', '.join(map(str, C.ATTN_WGMMA_PERSISTENT_TILES))} (impl='flash_mma' takes the others)")
    _checks.require_impl(fn, "attention", impl, q.dtype)


def max_tiles(q, b: int) -> int:
    """Tiles of a launch: q dense [B, Hq, Sq, D] B Hq ceil(Sq / 128) exactly; packed [total_q, Hq, D]
    at most Hq (ceil(total_q / 128) + B) (each sequence's last query tile may be partial)."""
    bm = C.ATTN_WGMMA_PERSISTENT_TILES[q.shape[-1]].block_m   # the kernel's FA3_BLOCK_M
    if q.ndim == 4:
        return q.shape[0] * q.shape[1] * -(-q.shape[2] // bm)
    return q.shape[1] * (-(-q.shape[0] // bm) + b)


def launch_problem(fn: str, impl: str, ops, q, b: int) -> str | None:
    """Why this launch cannot run (the message check_launch raises), or None: TMA can read every
    operand of ``ops``, and the launch's tiles (:func:`max_tiles`, over ``b`` sequences) fit the
    kernel's int32 tile indices."""
    why = operand_problem(ops, q.dtype)
    if why is not None:
        return f"{fn}(): impl={impl!r} needs q, k, v that TMA can read: {why} (use impl='flash_mma')"
    if max_tiles(q, b) > INT32_MAX:
        return (f"{fn}(): impl={impl!r} counts its tiles (128 queries of one head) in int32: "
                f"{max_tiles(q, b)} is over 2^31-1")
    return None


def check_launch(fn: str, impl: str, ops, q, b: int) -> None:
    """Before anything is allocated: ValueError with :func:`launch_problem`'s reason, if any."""
    why = launch_problem(fn, impl, ops, q, b)
    if why is not None:
        raise ValueError(why)


def auto_takes(fn: str, q, ops, b: int) -> bool:
    """Whether impl=None of entry point ``fn`` runs this kernel: on sm_90, for the (dtype, head
    dim) pairs of config.ATTN_AUTO_PERSISTENT[fn] (measured faster on a GPU), when
    :func:`launch_problem` finds none (``ops()``: dense_ops, varlen_ops or paged_ops of the call,
    built only for such a pair); else the previous default runs, refusing nothing."""
    d = q.shape[-1]
    if (np.dtype(q.dtype), d) not in C.ATTN_AUTO_PERSISTENT.get(fn, ()) or d not in C.ATTN_WGMMA_PERSISTENT_TILES:
        return False
    if not C.impl_runs_on("attention", IMPL, q.dtype, _loader.device_compute_capability()):
        return False
    return launch_problem(fn, IMPL, ops(), q, b) is None


def check_pages(fn: str, impl: str, page_size: int) -> None:
    """Pages of fewer than ATTN_WGMMA_MIN_PAGE tokens: a TMA copy per 1-4 rows, refused."""
    if page_size < C.ATTN_WGMMA_MIN_PAGE:
        raise ValueError(f"{fn}(): impl={impl!r} needs page_size >= {C.ATTN_WGMMA_MIN_PAGE} (one TMA copy per "
                         f"page of a key tile), got {page_size} (impl='flash_mma' takes any page size)")


# --- launch --------------------------------------------------------------------------------------
_DEVICE: dict = {}   # device id -> (SMs, L2 bytes): read once (Device.attributes reads them all)


def _device() -> tuple[int, int]:
    dev = cupy.cuda.Device()
    got = _DEVICE.get(dev.id)
    if got is None:
        a = dev.attributes
        got = _DEVICE[dev.id] = (int(a["MultiProcessorCount"]), int(a["L2CacheSize"]))
    return got


def _sm_count() -> int:
    """Streaming multiprocessors of the current device: the persistent grid's size."""
    return _device()[0]


def _l2_bytes() -> int:
    return _device()[1]


_COUNTERS: dict = {}
_COUNTER_LOCK = threading.Lock()


def _counter():
    """The dynamic schedule's tile counter of the current (device, stream): 0 between launches."""
    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, stream.ptr)
    with _COUNTER_LOCK:
        c = _COUNTERS.get(key)
        if c is None:
            c = _COUNTERS[key] = cupy.zeros(1, dtype=np.uint32)
    return c


def launch(fn, q, ops, out, lse, *, b, hq, hkv, sq_arg, sk_arg, kv_bytes_per_head, scale, window=(-1, -1),
           softcap=0.0, kv_lens=None, mask=None, mstrides=(0, 0, 0, 0), cu_q=None, cu_k=None, block_table=None,
           log2_page=0, num_pages=0, dynamic=True, tile=None):
    """One launch of the kernel (arguments checked by the callers: :func:`check`,
    :func:`check_launch`). ``ops``: the q, k, v operands (:func:`dense_operand` and friends);
    ``sq_arg`` / ``sk_arg``: the kernel's Sq / Sk (its header). The grid: one block per SM, at most
    one per tile (:func:`max_tiles`: blocks past the tiles would only publish the end). ``tile``
    overrides the config entry (benchmarks.tune); its instantiation must be built."""
    d = q.shape[-1]
    t = tile or C.ATTN_WGMMA_PERSISTENT_TILES[d]
    maps = [tma.tensor_map(ptr, q.dtype, dims, st, box, fn=fn, what=name) for name, ptr, dims, st, box, _ in ops]
    grid = min(_sm_count(), max_tiles(q, b))
    if grid == 0:
        return
    sec = C.attn_wgmma_heads_per_section(_l2_bytes(), kv_bytes_per_head, hq // hkv, hq)
    smem = t.smem_bytes(d)
    kern = get_function(SPEC if tile is None else tuning_spec(), _expr(q.dtype, d, t), dynamic_smem=smem)
    i32, i64 = np.int32, np.int64
    bt = block_table
    kern((grid, 1, 1), (128 * 3, 1, 1),
         (*maps, out, ptr_or_null(lse), ptr_or_null(kv_lens), ptr_or_null(mask), *map(i64, mstrides),
          ptr_or_null(cu_q), ptr_or_null(cu_k), ptr_or_null(bt), i32(bt.shape[1] if bt is not None else 0),
          i32(log2_page), i32(num_pages), _counter() if dynamic else _loader.NULL,
          i32(b), i32(hq), i32(hkv), i32(sq_arg), i32(sk_arg), i32(sec), i32(window[0]), i32(window[1]),
          np.float32(softcap * math.log2(math.e)), np.float32(scale * math.log2(math.e)),
          i32(1 if out.data.ptr % 4 == 0 else 0)),
         shared_mem=smem)


# --- attention(): dense [B, H, S, D] ---------------------------------------------------------------
def dense_ops(q, k, v, tile=None):
    t = tile or C.ATTN_WGMMA_PERSISTENT_TILES[q.shape[3]]
    return [dense_operand("q", q, t.block_m), dense_operand("k", k, t.block_n), dense_operand("v", v, t.block_n)]


def check_dense(fn: str, impl: str, q, k, v) -> None:
    """attention()'s checks for this kernel, after the generic ones: dtype, D, device, TMA, tiles."""
    check(fn, impl, q, q.shape[3])
    if q.size == 0 or k.shape[2] == 0:
        return  # nothing is launched
    check_launch(fn, impl, dense_ops(q, k, v), q, q.shape[0])


def run_dense(q, k, v, causal, scale, kl, out, lse, mask=None, mshape=None, window=(-1, -1), softcap=0.0,
              tile=None):
    """attention() on this kernel (checked: :func:`check_dense`). ``window``: as
    flash_attn.check_window_softcap returns it, or (-1, -1); causal is folded in here (right = 0).
    Equal tiles (no causal, window or key lengths) take the static order, others the counter."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if causal:
        window = (window[0], 0 if window[1] < 0 else min(window[1], 0))
    mask, mstr = _mask_arg(mask, mshape)
    dynamic = kl is not None or window != (-1, -1) or not C.ATTN_WGMMA_STATIC_WHEN_EQUAL
    launch("attention", q, dense_ops(q, k, v, tile), out, lse, b=b, hq=hq, hkv=hkv, sq_arg=sq, sk_arg=sk,
           kv_bytes_per_head=2 * sk * d * q.itemsize, scale=scale, window=window,
           softcap=softcap, kv_lens=kl, mask=mask, mstrides=mstr, dynamic=dynamic, tile=tile)


# --- attention_varlen(): packed [total, H, D] ------------------------------------------------------
def varlen_ops(q, k, v):
    t = C.ATTN_WGMMA_PERSISTENT_TILES[q.shape[2]]
    return [packed_operand("q", q, t.block_m), packed_operand("k", k, t.block_n), packed_operand("v", v, t.block_n)]


def run_varlen(q, k, v, cu_q, cu_k, b, max_k, scale, window, softcap, out, lse):
    """attention_varlen() on this kernel (checked: :func:`check` and :func:`check_launch` of
    :func:`varlen_ops`); cu_q / cu_k int32 device offsets [B + 1]; ``max_k``: the longest key
    sequence (the L2 section size only)."""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    launch("attention_varlen", q, varlen_ops(q, k, v), out, lse, b=b, hq=hq, hkv=hkv, sq_arg=tq, sk_arg=tk,
           kv_bytes_per_head=2 * max_k * d * q.itemsize, scale=scale, window=window,
           softcap=softcap, cu_q=cu_q, cu_k=cu_k)


# --- attention_paged(): keys and values in pages [N, P, Hkv, D] --------------------------------------
def paged_ops(q, k_pages, v_pages):
    """q [B, Hq, Sq, D] or packed [total_q, Hq, D]; pages [N, P, Hkv, D] (C-contiguous)."""
    t = C.ATTN_WGMMA_PERSISTENT_TILES[q.shape[-1]]
    rows = min(k_pages.shape[1], t.block_n)
    qop = dense_operand("q", q, t.block_m) if q.ndim == 4 else packed_operand("q", q, t.block_m)
    return [qop, paged_operand("k_pages", k_pages, rows), paged_operand("v_pages", v_pages, rows)]


def run_paged(q, k_pages, v_pages, block_table, seq_lens, cu_q, b, longest, scale, window, softcap, out, lse):
    """attention_paged() on this kernel (checked: :func:`check`, :func:`check_pages` and
    :func:`check_launch` of :func:`paged_ops`). ``longest``: an upper bound of seq_lens (the L2
    section size only)."""
    hq, d = q.shape[1], q.shape[-1]
    n, ps, hkv = k_pages.shape[:3]
    launch("attention_paged", q, paged_ops(q, k_pages, v_pages), out, lse, b=b, hq=hq, hkv=hkv,
           sq_arg=q.shape[2] if q.ndim == 4 else q.shape[0], sk_arg=0, kv_bytes_per_head=2 * longest * d * q.itemsize,
           scale=scale, window=window, softcap=softcap, kv_lens=seq_lens, cu_q=cu_q, block_table=block_table,
           log2_page=ps.bit_length() - 1, num_pages=n)


def tuning_spec() -> KernelSpec:
    """Every tuning candidate of v3 (flash_attn_sm90.tuning_tiles) as a persistent instantiation."""
    global _TUNING_SPEC
    if _TUNING_SPEC is None:
        exprs = tuple(dict.fromkeys(_expr(dt, d, t) for dt in MMA_DTYPES for d in C.ATTN_WGMMA_TILES
                                    for t in tuning_tiles(d)))
        _TUNING_SPEC = KernelSpec("flash_attn_sm90_persistent_tune", "flash_attn_sm90_persistent.cu", exprs,
                                  sm90a=True)
    return _TUNING_SPEC


_TUNING_SPEC = None
