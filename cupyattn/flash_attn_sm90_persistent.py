"""``impl="wgmma_persistent"``: the Hopper attention kernel (:mod:`cupyattn.flash_attn_sm90`,
``kernels_cu/flash_attn_sm90.cu``) under its persistent scheduler.

The same mainloop and epilogue as ``impl="wgmma"``; one block per SM takes tile after tile in the
scheduler's order (heads in L2 sections, heaviest query tiles first), from a counter in global
memory where tiles are unequal (causal, windows, key lengths, packed and paged sequences), by a
static stride where they are equal. It reads packed sequences (``attention_varlen``) and paged keys
(``attention_paged``), and implements ``window`` and ``softcap``. ``impl="wgmma_persistent"`` of
``attention``, ``attention_varlen`` and ``attention_paged``; impl=None takes it on sm_90 where an
H100 run (2026-11-27) measured it faster than the previous default (config.ATTN_AUTO_PERSISTENT:
packed and paged sequences, causal attention at D = 256) and TMA can read the operands
(cupyattn/options.py lists what it implements).

Inputs as ``impl="wgmma"`` takes them (float16 / bfloat16, D of 64, 128 or 256, what TMA can read:
16-byte aligned base and strides that are positive multiples of 16 bytes: no broadcast or reversed
view); pages of at least ``config.ATTN_WGMMA_MIN_PAGE`` (8) tokens, a power of two, in the NHD
layout ``[num_pages, page_size, Hkv, D]``; ``attention_paged(layout="HND")`` is refused here
(cupyattn/options.py) and served by impl=None. Offsets, lengths and page ids read from device
memory are clamped in the kernel to the arrays passed (rows of q / out / lse, of k / v, pages, the
block table's width): a wrong one gives a wrong result for its sequence, never an access past them.

The dynamic schedule's counter is one uint32 per (device, stream), allocated on the stream's
first call and left at 0 by every launch (the kernel's last claim resets it): calls stay
graph-capturable (warm the stream up before capturing). A graph holds the counter of the stream
it was captured on: do not replay it concurrently with uncaptured calls of this kernel on that
stream.
"""
from __future__ import annotations

import numpy as np

from . import _checks, device
from . import config as C
from . import flash_attn_sm90 as W
from .config import INT32_MAX, MMA_DTYPES
from .flash_attn_sm90 import dense_operand, max_tiles, operand_problem, packed_operand, paged_operand  # noqa: F401

IMPL = "wgmma_persistent"
SPEC = W.SPEC


def _sm_count() -> int:
    """Streaming multiprocessors of the current device: the persistent grid's size (tests and the
    sanitizer script shrink it to give each block several tiles)."""
    return device.sm_count()


def _tile(head_dim: int, causal_or_window: bool = True) -> C.AttnWgmmaTile:
    return W.tile_for(IMPL, head_dim, W.PERSIST, causal_or_window)


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


def check_pages(fn: str, impl: str, page_size: int) -> None:
    """Pages of fewer than ATTN_WGMMA_MIN_PAGE tokens: a TMA copy per 1-4 rows, refused."""
    if page_size < C.ATTN_WGMMA_MIN_PAGE:
        raise ValueError(f"{fn}(): impl={impl!r} needs page_size >= {C.ATTN_WGMMA_MIN_PAGE} (one TMA copy per "
                         f"page of a key tile), got {page_size} (impl='flash_mma' takes any page size)")


# --- attention(): dense [B, H, S, D] ---------------------------------------------------------------
def dense_ops(q, k, v, tile=None):
    return W.dense_ops(q, k, v, tile or _tile(q.shape[3]))


def check_dense(fn: str, impl: str, q, k, v) -> None:
    """attention()'s checks for this kernel, after the generic ones: dtype, D, device, TMA, tiles."""
    check(fn, impl, q, q.shape[3])
    if q.size == 0 or k.shape[2] == 0:
        return  # nothing is launched
    check_launch(fn, impl, dense_ops(q, k, v), q, q.shape[0])


def run_dense(q, k, v, causal, scale, kl, out, lse, mask=None, mshape=None, window=(-1, -1), softcap=0.0,
              tile=None):
    """attention() on this kernel (checked: :func:`check_dense`). ``window``: as
    flash_attn.check_window_softcap returns it, or (-1, -1); causal is folded in (right = 0).
    Equal tiles (no causal, window or key lengths) take the static order, others the counter.
    ``tile`` overrides the config entry (benchmarks.tune); its instantiation must be built."""
    W.run_dense("attention", IMPL, q, k, v, causal, scale, kl, out, lse, sched=W.PERSIST, sms=_sm_count(),
                mask=mask, mshape=mshape, window=window, softcap=softcap, tile=tile,
                spec=None if tile is None else W.tuning_spec())


# --- attention_varlen(): packed [total, H, D] ------------------------------------------------------
def varlen_ops(q, k, v):
    t = _tile(q.shape[2])
    return [packed_operand("q", q, t.block_m), packed_operand("k", k, t.block_n), packed_operand("v", v, t.block_n)]


def run_varlen(q, k, v, cu_q, cu_k, b, max_k, scale, window, softcap, out, lse):
    """attention_varlen() on this kernel (checked: :func:`check` and :func:`check_launch` of
    :func:`varlen_ops`); cu_q / cu_k int32 device offsets [B + 1] (clamped in the kernel to
    total_q = q.shape[0] and total_k = k.shape[0]); ``max_k``: the longest key sequence (the L2
    section size only)."""
    (tq, hq, d), (tk, hkv) = q.shape, k.shape[:2]
    W.launch("attention_varlen", q, varlen_ops(q, k, v), out, lse, sched=W.PERSIST, tile=_tile(d), b=b, hq=hq,
             hkv=hkv, sq_arg=tq, sk_arg=tk, heads=W.section(hq, hkv, 2 * max_k * d * q.itemsize), sms=_sm_count(),
             scale=scale, window=window, softcap=softcap, cu_q=cu_q, cu_k=cu_k)


# --- attention_paged(): keys and values in pages [N, P, Hkv, D] --------------------------------------
def paged_ops(q, k_pages, v_pages):
    """q [B, Hq, Sq, D] or packed [total_q, Hq, D]; pages [N, P, Hkv, D] (C-contiguous)."""
    t = _tile(q.shape[-1])
    rows = min(k_pages.shape[1], t.block_n)
    qop = dense_operand("q", q, t.block_m) if q.ndim == 4 else packed_operand("q", q, t.block_m)
    return [qop, paged_operand("k_pages", k_pages, rows), paged_operand("v_pages", v_pages, rows)]


def run_paged(q, k_pages, v_pages, block_table, seq_lens, cu_q, b, longest, scale, window, softcap, out, lse):
    """attention_paged() on this kernel (checked: :func:`check`, :func:`check_pages` and
    :func:`check_launch` of :func:`paged_ops`). ``longest``: an upper bound of seq_lens (the L2
    section size only); seq_lens are clamped in the kernel to the block table's width in keys."""
    hq, d = q.shape[1], q.shape[-1]
    n, ps, hkv = k_pages.shape[:3]
    W.launch("attention_paged", q, paged_ops(q, k_pages, v_pages), out, lse, sched=W.PERSIST, tile=_tile(d), b=b,
             hq=hq, hkv=hkv, sq_arg=q.shape[2] if q.ndim == 4 else q.shape[0], sk_arg=0,
             heads=W.section(hq, hkv, 2 * longest * d * q.itemsize), sms=_sm_count(), scale=scale, window=window,
             softcap=softcap, kv_lens=seq_lens, cu_q=cu_q, block_table=block_table, log2_page=ps.bit_length() - 1,
             num_pages=n)
