"""Paged KV caches: decode and chunked-prefill attention over pages, and :class:`PagedKVCache`.

Layouts (``layout=``, config.PAGED_LAYOUTS): ``"NHD"`` (flash-attention's
``flash_attn_with_kvcache`` and vLLM's; the default of every function here) keeps keys and
values in pages ``[num_pages, page_size, Hkv, D]``; ``"HND"`` (FlashInfer's) in pages
``[num_pages, Hkv, page_size, D]``, where one head's rows of a page are contiguous. An int32
``block_table [B, max_pages]`` lists each sequence's pages in order, so position ``p`` of
sequence ``b`` is row ``p % page_size`` of page ``block_table[b, p // page_size]``; int32
``seq_lens [B]`` says how many positions are live. Pages may be anywhere and in any order;
entries past a sequence's length are never read. ``page_size`` is a power of two from 1 to 256
(the kernels split a position with a shift).

The kernels are the serving variants of the contiguous ones (``SERVING = true``): decode is
``kernels_cu/decode.cu`` (split-KV, GQA packing, tensor cores) with K/V rows looked up through
the table once per 16-byte load, or, with config.DECODE_PAGE_STAGING, with each split's page ids
staged in shared memory ahead of its K/V ring (``STAGED``); chunked prefill is
``kernels_cu/flash_attn.cu``, or on sm_90 ``impl="wgmma_persistent"`` (the persistent Hopper
kernel, NHD pages of at least 8 tokens; impl=None takes it for fp16 at D = 128, measured faster
on an H100: config.ATTN_AUTO_PERSISTENT); appends are ``kernels_cu/kvcache.cu``. Those ran on an
H100 (2026-11-26, 2026-11-27: GPU tier); the HND layout and the staged page ids have been
compiled and emulated and passed the GPU tier of 2026-11-27, but have not been timed: opt-in.
"""
from __future__ import annotations

import math
import weakref

import cupy
import numpy as np

from . import _checks, config, options
from . import flash_attn_sm90_persistent as _sm90p
from ._checks import check_array, check_choice, check_out
from . import decode_launch as DL
from .config import PAGED_LAYOUTS, PAGED_MAX_PAGE_SIZE
from .splits import check_split_rule, schedule
from .flash_launch import Serving, check_window_softcap, choose, elem_strides, launch
from .kvcache import KVCache
from .varlen import (IMPLS, call_options, check_grid, check_impl, check_max_seqlen, check_offsets, check_packed,
                     offsets_batch)

MAX_PAGE_SIZE = PAGED_MAX_PAGE_SIZE


def check_layout(fn: str, layout) -> str:
    """``layout`` as one of config.PAGED_LAYOUTS ("NHD", "HND")."""
    check_choice(fn, "layout", layout, PAGED_LAYOUTS)
    return layout


# Every live PagedKVCache, so that a call handed raw pages can tell whose they are and read them in
# their cache's layout (HND pages [N, Hkv, P, D] of 2 heads and pages of 4 would pass the NHD
# shape checks and be read wrong).
_CACHES = weakref.WeakSet()


def _owner(pages):
    """The live PagedKVCache whose k or v holds ``pages`` (a view into it), or None."""
    span = _checks.byte_span(pages) if _checks.is_device_array(pages) else None
    if span is None:
        return None
    for cache in list(_CACHES):
        for whole in (cache.k, cache.v):
            s = _checks.byte_span(whole)
            if s is not None and s[0] <= span[0] and span[1] <= s[1]:
                return cache
    return None


def _pages_of(fn, k_pages, v_pages, block_table, seq_lens, layout):
    """The paged entry points' key/value arguments -> (k_pages, v_pages, block_table, seq_lens,
    layout, host lengths or None). ``k_pages`` a PagedKVCache: its pages of layer ``v_pages``, its
    table, lengths (host mirror too) and layout. Raw pages: ``layout`` None takes the layout of the
    PagedKVCache they belong to (NHD for pages of no cache); a layout that contradicts it is
    refused, naming ``layout``."""
    if isinstance(k_pages, PagedKVCache):
        cache = k_pages
        layer = cache.check_layer(fn, v_pages)
        if block_table is not None or seq_lens is not None:
            raise TypeError(f"{fn}(): block_table and seq_lens come from the PagedKVCache passed as k_pages "
                            f"(called as {fn}(q, cache, layer)); pass neither")
        if layout is not None and check_layout(fn, layout) != cache.layout:
            raise ValueError(f"{fn}(): layout={layout!r} but the PagedKVCache passed holds {cache.layout} pages; "
                             f"leave layout out (the cache says it)")
        return (cache.k[layer], cache.v[layer], cache.block_table, cache.lengths[layer], cache.layout,
                cache.host_lengths[layer])
    for name, x in (("v_pages", v_pages), ("block_table", block_table), ("seq_lens", seq_lens)):
        if x is None:
            raise TypeError(f"{fn}(): {name} is required with raw pages (or pass the PagedKVCache itself: "
                            f"{fn}(q, cache, layer))")
    owners = {id(o): o for o in (_owner(k_pages), _owner(v_pages)) if o is not None}
    for owner in owners.values():
        if layout is None:
            layout = owner.layout
        elif check_layout(fn, layout) != owner.layout:
            raise ValueError(f"{fn}(): k_pages / v_pages belong to a PagedKVCache(layout={owner.layout!r}) but "
                             f"layout={layout!r}: pass layout={owner.layout!r} (or leave it out, or pass the "
                             f"cache itself: {fn}(q, cache, layer))")
    return k_pages, v_pages, block_table, seq_lens, check_layout(fn, "NHD" if layout is None else layout), None


def _nhd(x):
    """HND pages [N, Hkv, P, D] seen as [N, P, Hkv, D] (a view), for the checks that read shapes."""
    return x.transpose(0, 2, 1, 3)


def _check_pages(fn, q, k_pages, v_pages, block_table, seq_lens, b, layout="NHD", host_lens=None):
    """q [*, Hq, D]; pages [N, P, Hkv, D] (NHD) or [N, Hkv, P, D] (HND), C-contiguous; table
    int32 [B, max_pages] on the device, seq_lens [B] -> (Hq, Hkv, D, page_size, host seq_lens
    or None, device seq_lens). ``host_lens``: the host's copy of device ``seq_lens`` (a
    PagedKVCache's mirror)."""
    shape = "[num_pages, page_size, Hkv, D]" if layout == "NHD" else "[num_pages, Hkv, page_size, D]"
    kn, vn = k_pages, v_pages
    if layout == "HND":  # the shape checks below read [N, P, Hkv, D]
        for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
            check_array(fn, name, x, ndim=4)
        kn, vn = _nhd(k_pages), _nhd(v_pages)
    hq, hkv, d = check_packed(fn, q, kn, vn, "k_pages", "v_pages")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_array(fn, name, x, ndim=4)
        if not x.flags.c_contiguous:
            raise ValueError(f"{fn}(): {name} must be C-contiguous {shape} (layout={layout!r})")
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(f"{fn}(): v_pages has shape {tuple(v_pages.shape)} but k_pages has {tuple(k_pages.shape)}")
    n_pages, ps = kn.shape[0], kn.shape[1]
    if not (1 <= ps <= MAX_PAGE_SIZE and ps & (ps - 1) == 0):
        axis = 1 if layout == "NHD" else 2
        raise ValueError(f"{fn}(): page_size (k_pages.shape[{axis}]) must be a power of two in [1, {MAX_PAGE_SIZE}], "
                         f"got {ps}")
    if n_pages == 0:
        raise ValueError(f"{fn}(): k_pages holds no page")
    check_array(fn, "block_table", block_table, dtypes=(np.dtype(np.int32),), ndim=2)
    if block_table.shape[0] != b:
        raise ValueError(f"{fn}(): block_table has {block_table.shape[0]} rows, expected one per sequence ({b})")
    if block_table.strides[1] != 4:
        raise ValueError(f"{fn}(): block_table rows must be contiguous (int32 stride 1)")
    lens, host = check_offsets(fn, "seq_lens", seq_lens, b, None)
    host = host_lens if host is None else host
    cap = block_table.shape[1] * ps
    if host is not None and len(host) and host.max() > cap:
        raise ValueError(f"{fn}(): seq_lens max {int(host.max())} exceeds the block table's capacity "
                         f"{block_table.shape[1]} pages x {ps} = {cap}")
    _checks.check_int32(fn, "max_pages x page_size", cap)
    return hq, hkv, d, ps, host, lens


def decode_attention_paged(q, k_pages, v_pages=None, block_table=None, seq_lens=None, scale=None, window=None,
                           softcap=None, num_splits=None, out=None, impl=None, max_seq_len=None, workspace=None,
                           layout=None, split_rule=None, fused_combine=None):
    """One query token per sequence over a paged KV cache (``flash_attn_with_kvcache`` layout).

    Parameters
    ----------
    q : cupy.ndarray [B, Hq, D]
        float32 / float16 / bfloat16, last dim contiguous; ``Hq % Hkv == 0`` (GQA/MQA).
    k_pages, v_pages : cupy.ndarray, C-contiguous, q's dtype; or a PagedKVCache and a layer
        ``[num_pages, page_size, Hkv, D]`` (layout "NHD") or ``[num_pages, Hkv, page_size, D]``
        ("HND"); ``page_size`` a power of two in [1, 256]. ``decode_attention_paged(q, cache,
        layer)`` reads a :class:`PagedKVCache`'s pages of ``layer`` with its block table, lengths
        (and their host mirror, for the split rule) and layout; block_table and seq_lens are then
        left out.
    block_table : cupy.ndarray int32 [B, max_pages]
        Page ids (< num_pages; an out-of-range id is clamped, never read past the pages).
    seq_lens : int32 [B]
        Keys per sequence (the new token's included if it should see itself). A CuPy array is
        read only by the kernel (graph-safe; values are clamped to [0, the table's capacity]);
        host values are checked against the table.
    scale, window, softcap :
        As :func:`cupyattn.decode_attention` (window left bound only matters in decode).
    num_splits : int, optional
        Split-KV count (1 to 512); None: the split rule's choice on the host ``seq_lens``, or on
        ``max_seq_len`` when given, else on the table's capacity. Fix it for CUDA graphs.
    out : cupy.ndarray [B, Hq, D], optional
    impl : {None, "simt", "mma"} ("auto": None)
        As decode_attention.
    max_seq_len : int or B host ints, optional
        Upper bound of seq_lens for the split rule when they are on the device (one for all, or
        one per sequence: the "waves" rule sizes each sequence's splits by its own).
    workspace : (o_part, lse_part) or (o_part, lse_part, counters), optional
        Split-KV partials (and the fused combine's counters) as :func:`cupyattn.decode_attention`
        takes them (float32 ``[S, B, Hq, D]`` and ``[S, B, Hq]``, ``S >= num_splits``; uint32
        ``[B, Hq]`` zeros): with ``out`` and a fixed ``num_splits`` the call allocates nothing
        and can be captured in a CUDA graph.
    layout : {"NHD", "HND"}, optional
        Which of the two page layouts k_pages and v_pages hold. None: the layout of the
        PagedKVCache the pages belong to (views of its ``k`` / ``v``), else "NHD"; a layout that
        contradicts their cache's is a ValueError.
    split_rule, fused_combine : as :func:`cupyattn.decode_attention` ("waves" and the fused
        combine by default under it).

    Returns
    -------
    cupy.ndarray [B, Hq, D]; a sequence of length 0 (or whose window hides every key) gives
    zeros. Where it has run on a GPU: docs/ran-where.md.

    Examples
    --------
    >>> o = decode_attention_paged(q, cache, layer)      # a PagedKVCache: its pages, table and lengths
    >>> o = decode_attention_paged(q, cache.k[layer], cache.v[layer], cache.block_table, cache.lengths[layer])
    """
    return _decode_paged("decode_attention_paged", q, k_pages, v_pages, block_table, seq_lens, scale, window,
                         softcap, num_splits, out, impl, max_seq_len, workspace, layout, split_rule, fused_combine)


def _decode_paged(fn, q, k_pages, v_pages, block_table, seq_lens, scale, window, softcap, num_splits, out, impl,
                  max_seq_len, workspace, layout, split_rule, fused_combine):
    """decode_attention_paged (a PagedKVCache's host mirror of its lengths, from _pages_of, feeds
    the split rule)."""
    check_choice(fn, "impl", impl, DL.IMPLS)  # decode's impls, before the attention checks
    k_pages, v_pages, block_table, seq_lens, layout, mirror = _pages_of(fn, k_pages, v_pages, block_table, seq_lens,
                                                                        layout)
    check_array(fn, "q", q, ndim=3)
    b = q.shape[0]
    hq, hkv, d, ps, host, lens = _check_pages(fn, q, k_pages, v_pages, block_table, seq_lens, b, layout)
    kv = DL.KvView(k_pages, v_pages, lens, hkv, d, b, block_table.shape[1] * ps, np.dtype(k_pages.dtype),
                   {"k_pages": k_pages, "v_pages": v_pages, "block_table": block_table, "seq_lens": seq_lens})
    _, _, _, scale, num_splits, plan = DL.check(fn, q[:, :, None], kv, scale, num_splits, None, impl)
    rule = check_split_rule(fn, split_rule)
    fused_combine = rule == "waves" if fused_combine is None else _checks.check_bool(fn, "fused_combine", fused_combine)
    inputs = {"q": q, **kv.arrays}
    if out is not None:
        check_out(fn, out, (b, hq, d), q.dtype)
        _checks.check_no_overlap(fn, out, inputs)
    # the split rule's lengths: host seq_lens, else the caller's bounds, else the capacity
    if host is None:
        host = mirror if mirror is not None else _bounds(fn, max_seq_len, b, kv.max_seq)
    sv, plan = DL.serving_plan(fn, window, softcap, impl, q.dtype, d, hq // hkv, plan, block_table=block_table,
                               log2_page=ps.bit_length() - 1, num_pages=k_pages.shape[0], layout=layout)
    num_splits, split_keys = schedule(rule, plan, b, hkv, host, num_splits, sv.win_left)
    if workspace is not None:
        DL.check_workspace(fn, workspace, num_splits, b, hq, d, {**inputs, "out": out}, fused_combine)
    out = cupy.empty((b, hq, d), dtype=q.dtype) if out is None else out
    if b == 0 or hq == 0:
        return out
    DL.launch(q, kv, scale, num_splits, out, plan, workspace, fused_combine=fused_combine, sv=sv,
              split_keys=split_keys)
    return out


def _bounds(fn, max_seq_len, b, capacity):
    """max_seq_len (None: the capacity; an int; or b host ints >= 0) as b lengths for the split rule."""
    if max_seq_len is None:
        return [capacity] * b
    if isinstance(max_seq_len, (list, tuple, np.ndarray)):
        if len(max_seq_len) != b:
            raise ValueError(f"{fn}(): max_seq_len has {len(max_seq_len)} entries, expected one per sequence ({b})")
        return [_checks.check_int(fn, f"max_seq_len[{i}]", n, 0) for i, n in enumerate(max_seq_len)]
    return [_checks.check_int(fn, "max_seq_len", max_seq_len, 0)] * b


def attention_paged(q, k_pages, v_pages=None, block_table=None, seq_lens=None, cu_seqlens_q=None, max_seqlen_q=None,
                    causal=False, scale=None, window=None, softcap=None, return_lse=False, out=None, impl=None,
                    layout=None):
    """Attention of new queries over paged keys/values that already hold them (chunked prefill).

    Sequence b has ``seq_lens[b]`` keys in its pages, its new tokens last (append them first,
    e.g. with :meth:`PagedKVCache.append_qkv`), so causal masks and windows are aligned
    bottom-right: its query i of Sq sits at position ``seq_lens[b] - Sq + i``.

    Parameters
    ----------
    q : cupy.ndarray [B, Hq, Sq, D] (every sequence adds Sq tokens) or [total_q, Hq, D] packed
        by ``cu_seqlens_q`` (int32 [B + 1], as attention_varlen) with ``max_seqlen_q``.
    k_pages, v_pages, block_table, seq_lens, layout : as :func:`decode_attention_paged`
        (``attention_paged(q, cache, layer, ...)`` reads a PagedKVCache).
    causal, scale, window, softcap, return_lse, impl : as :func:`cupyattn.attention_varlen`
        (lse is [B, Hq, Sq] for 4-D q, [Hq, total_q] for packed q). impl="wgmma_persistent"
        (the persistent Hopper kernel) reads each key tile's pages by TMA, one copy per page of
        the tile, the tile's page ids read once by its loader warp; it needs page_size >= 8
        (``config.ATTN_WGMMA_MIN_PAGE``: smaller pages would take a copy per 1-4 rows) and NHD
        pages; flash_mma takes any page size and layout. impl=None takes wgmma_persistent on sm_90
        for fp16 at D = 128 with NHD pages of 8 tokens or more (config.ATTN_AUTO_PERSISTENT),
        else flash_mma (fp16/bf16) or flash.
    out : cupy.ndarray shaped like q, optional
    """
    fn = "attention_paged"
    k_pages, v_pages, block_table, seq_lens, layout, mirror = _pages_of(fn, k_pages, v_pages, block_table, seq_lens,
                                                                        layout)
    _checks.check_bool(fn, "causal", causal)
    _checks.check_bool(fn, "return_lse", return_lse)
    if cu_seqlens_q is None:
        check_array(fn, "q", q, ndim=4)
        b, hq, sq, d = q.shape
        q3 = q
    else:
        check_array(fn, "q", q, ndim=3)
        b = offsets_batch(fn, "cu_seqlens_q", cu_seqlens_q)
        (tq, hq, d), q3 = q.shape, q
    if q3.ndim == 4:  # the checks take [*, Hq, D]
        q3 = q[:, :, 0] if sq else cupy.empty((b, hq, d), dtype=q.dtype)
    auto = impl is None
    if impl is not None:
        check_choice(fn, "impl", impl, IMPLS)
    hq, hkv, d, ps, host, lens = _check_pages(fn, q3, k_pages, v_pages, block_table, seq_lens, b, layout, mirror)
    if not auto:
        check_impl(fn, impl, q3, d)
    check_grid(fn, b, hq)
    used = call_options(causal, window, softcap, scale, return_lse, out) + (["hnd_pages"] if layout == "HND" else [])
    if auto:  # options.DEFAULTS["attention_paged"]
        impl = choose(fn, q, d, used=used, causal=causal, launches=bool(q.size), page_size=ps,
                      problem=lambda i: _sm90p.launch_problem(fn, i, _sm90p.paged_ops(q, k_pages, v_pages), q, b))
        check_impl(fn, impl, q3, d)
    elif impl == _sm90p.IMPL:
        options.check(fn, fn, impl, ["hnd_pages"] if layout == "HND" else [])
        _sm90p.check_pages(fn, impl, ps)
        if q.size:  # (nothing is launched otherwise)
            _sm90p.check_launch(fn, impl, _sm90p.paged_ops(q, k_pages, v_pages), q, b)
    if cu_seqlens_q is None:
        shape, out_shape, lse_shape, sq_arg = (b, hq, sq, hkv, sq, 0), (b, hq, sq, d), (b, hq, sq), sq
        cu_q, qs = None, elem_strides(q)[:3]
        if host is not None and len(host) and host.min() < sq:
            raise ValueError(f"{fn}(): seq_lens must be >= Sq={sq} (the new tokens are cached), got min {int(host.min())}")
    else:
        cu_q, hcq = check_offsets(fn, "cu_seqlens_q", cu_seqlens_q, b + 1, tq)
        if max_seqlen_q is None:
            raise ValueError(f"{fn}(): max_seqlen_q is required with cu_seqlens_q")
        sq = check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, hcq)
        shape, out_shape, lse_shape, sq_arg = (b, hq, sq, hkv, tq, 0), (tq, hq, d), (hq, tq), tq
        qs = [0, elem_strides(q)[1], elem_strides(q)[0]]
        if host is not None and hcq is not None and b and (np.diff(hcq) > host).any():
            raise ValueError(f"{fn}(): a sequence has more new queries than cached keys (seq_lens)")
    win, cap = check_window_softcap(fn, window, softcap, causal)
    scale = 1.0 / math.sqrt(d) if scale is None else _checks.check_real(fn, "scale", scale)
    if out is not None:
        check_out(fn, out, out_shape, q.dtype)
        _checks.check_no_overlap(fn, out, {"q": q, "k_pages": k_pages, "v_pages": v_pages, "block_table": block_table,
                                           "seq_lens": seq_lens, "cu_seqlens_q": cu_seqlens_q})
    out = cupy.empty(out_shape, dtype=q.dtype) if out is None else out
    lse = cupy.empty(lse_shape, dtype=cupy.float32) if return_lse else None
    if out.size == 0 or sq == 0:
        return (out, lse) if return_lse else out
    if impl == _sm90p.IMPL:
        longest = int(host.max()) if host is not None and len(host) else block_table.shape[1] * ps
        _sm90p.run_paged(q, k_pages, v_pages, block_table, lens, cu_q, b, longest, scale, win, cap, out, lse)
        return (out, lse) if return_lse else out
    es = elem_strides(k_pages)
    ks = [0, es[2], es[1]] if layout == "NHD" else [0, es[1], es[2]]  # head, token (row) strides in a page
    sv = Serving(cu_q=cu_q, cu_k=lens, block_table=block_table, log2_page=ps.bit_length() - 1,
                 num_pages=k_pages.shape[0], window=win, softcap=cap)
    launch(impl, q, k_pages, v_pages, False, scale, None, None, None, out, lse, sv, shape=shape[:4] + (sq_arg, 0),
           strides=(qs, ks, ks))
    return (out, lse) if return_lse else out


class PagedKVCache(KVCache):
    """A paged K/V cache for ``max_batch`` sequence slots: pages on the device, the page allocator
    on the host, block tables and lengths on the device.

    Parameters
    ----------
    num_layers, max_batch, num_kv_heads, head_dim : int
    num_pages : int
        Pages per layer (every layer uses the same page ids, so one block table serves all).
    page_size : int
        Tokens per page, a power of two in [1, 256].
    dtype : float32, float16 or bfloat16
    max_pages_per_seq : int, optional
        Columns of the block table (default: num_pages); a slot holds at most
        ``max_pages_per_seq * page_size`` tokens (``max_seq``).
    layout : {"NHD", "HND"}, optional
        Page layout (module docstring); None: config.PAGED_DEFAULT_LAYOUT ("NHD"); "HND" is opt-in
        (its GPU runs: docs/ran-where.md). ``decode``, ``append`` and ``append_qkv`` follow it, and so
        do :func:`attention_paged` / :func:`decode_attention_paged` given the cache itself
        (``f(q, cache, layer)``) or its pages (views of ``k`` / ``v``: their layout is looked up).

    Attributes
    ----------
    k, v : cupy.ndarray [num_layers, num_pages, page_size, num_kv_heads, head_dim] (NHD) or
        [num_layers, num_pages, num_kv_heads, page_size, head_dim] (HND)
        ``k[layer]`` is the pages argument of :func:`decode_attention_paged`.
    layout : str
    block_table : cupy.ndarray int32 [max_batch, max_pages_per_seq]   page ids per slot
    lengths : cupy.ndarray int32 [num_layers, max_batch]; host_lengths its int64 host mirror
    host_table : numpy int32 copy of block_table; ``pages_of(slot)`` the slot's pages

    Everything :class:`KVCache` offers works the same way (``append``, ``append_qkv`` with RoPE
    fused and the one-launch decode step, ``check_room``, ``record_advance``, ``seq_lengths``):
    a call that needs more pages takes them from the free list (on the host, and the slot's
    table row is copied to the device) only after every check that can refuse it has passed
    (arguments, capacity, free pages, launch limits, kernel builds), or raises ValueError ("out
    of pages", naming the slot) with nothing taken or written; if a launch itself raises, the
    pages go back and the table rows are restored before the error propagates. :meth:`free` gives a finished slot's pages back and sets
    its lengths to 0, so the next prompt can take the slot at once (continuous batching).

    CUDA graphs: the table and lengths arrays never move, so a captured decode step (append_qkv
    + decode_attention_paged with a fixed ``num_splits``) replays correctly as long as, before
    each replay, ``check_room(1)`` reserves the pages the step will write (it allocates when a
    slot crosses a page boundary and updates the table in place), and ``record_advance(1)``
    follows it, as with KVCache. Slots that are idle can be given length 0 (``free``): they
    compute nothing and their output rows are zeros. The fused decode step (``cupyattn.fused``)
    takes contiguous caches only.
    """

    _EXPR_TAIL = ", true"

    def __init__(self, num_layers, max_batch, num_kv_heads, head_dim, num_pages, page_size, dtype,
                 max_pages_per_seq=None, layout=None):
        fn = "PagedKVCache"
        self.layout = check_layout(fn, config.PAGED_DEFAULT_LAYOUT if layout is None else layout)
        num_pages = _checks.check_positive_int(fn, "num_pages", num_pages)
        page_size = _checks.check_positive_int(fn, "page_size", page_size)
        if page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
            raise ValueError(f"{fn}(): page_size must be a power of two in [1, {MAX_PAGE_SIZE}], got {page_size}")
        mpp = num_pages if max_pages_per_seq is None else _checks.check_positive_int(
            fn, "max_pages_per_seq", max_pages_per_seq)
        _checks.check_int32(fn, "num_pages x page_size", num_pages * page_size)
        self.num_layers = _checks.check_positive_int(fn, "num_layers", num_layers)
        self.batch = _checks.check_positive_int(fn, "max_batch", max_batch)
        self.num_kv_heads = _checks.check_positive_int(fn, "num_kv_heads", num_kv_heads)
        for name, n in (("max_batch", self.batch), ("num_kv_heads", self.num_kv_heads)):
            _checks.check_grid_yz(fn, name, n)  # a grid row each in the append and decode launches
        self.head_dim = _checks.check_positive_int(fn, "head_dim", head_dim)
        self.max_seq = _checks.check_int32(fn, "max_pages_per_seq x page_size", mpp * page_size)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        from .config import DTYPES
        if dt not in DTYPES:
            raise TypeError(f"{fn}(): dtype {dtype!r} is not supported; expected one of {', '.join(map(str, DTYPES))}")
        self.dtype, self.num_pages, self.page_size, self.max_pages_per_seq = dt, num_pages, page_size, mpp
        shape = ((self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim) if self.layout == "NHD"
                 else (self.num_layers, num_pages, self.num_kv_heads, page_size, self.head_dim))
        with _checks.no_gpu_explained(fn):
            self.k = cupy.zeros(shape, dtype=dt)
            self.v = cupy.zeros(shape, dtype=dt)
            self.lengths = cupy.zeros((self.num_layers, self.batch), dtype=np.int32)
            self.block_table = cupy.zeros((self.batch, mpp), dtype=np.int32)
            self.ticket = cupy.zeros(1, dtype=np.uint32)
        self.host_lengths = np.zeros((self.num_layers, self.batch), dtype=np.int64)
        self.host_table = np.zeros((self.batch, mpp), dtype=np.int32)
        self._pages: list[list[int]] = [[] for _ in range(self.batch)]
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        _CACHES.add(self)  # its pages' layout is found from the pages (_owner)

    def __repr__(self):
        return (f"PagedKVCache(num_layers={self.num_layers}, max_batch={self.batch}, num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}, num_pages={self.num_pages}, page_size="
                f"{self.page_size}, dtype={self.dtype}, layout={self.layout!r}, free pages={len(self._free)})")

    def device_arrays(self) -> dict:
        return {**super().device_arrays(), "the cache's block table": self.block_table}

    def _layout_args(self):
        return (self.block_table, np.int32(self.max_pages_per_seq), np.int32(self.page_size.bit_length() - 1),
                np.int32(self.num_pages), np.int32(self.layout == "HND"))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_of(self, slot) -> list:
        """The page ids slot ``slot`` holds, in position order (a copy)."""
        return list(self._pages[self._slot("PagedKVCache.pages_of", slot)])

    def _slot(self, fn, slot) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"{fn}(): slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.batch:
            raise IndexError(f"{fn}(): slot {slot} is out of range for {self.batch} slots")
        return int(slot)

    def _shortfall(self, counts, layers):
        """Pages each slot still needs for ``counts`` more tokens in ``layers`` (int64 [batch])."""
        need = -(-(self.host_lengths[layers].max(axis=0) + counts) // self.page_size)
        return np.maximum(need - np.array([len(p) for p in self._pages]), 0)

    def _check_capacity(self, fn: str, counts, layers) -> None:
        """KVCache's check (max_seq), then enough free pages for every slot's new length. Only
        checks: the pages are taken by :meth:`_reserve`, after every other check of the call."""
        super()._check_capacity(fn, counts, layers)
        short = self._shortfall(counts, layers)
        total = int(short.sum())
        if total > len(self._free):
            i = int(np.argmax(short > 0))
            raise ValueError(f"{fn}(): out of pages: slot {i} needs {int(short[i])} more page(s) of "
                             f"{self.page_size} tokens, the cache has {len(self._free)} free of "
                             f"{self.num_pages} ({total} needed in all)")

    def _reserve(self, counts, layers):
        """Take the pages :meth:`_check_capacity` counted from the free list and write them to the
        slots' table rows (host, then device); returns (rows, their old host rows, pages per row)
        for :meth:`_release`."""
        short = self._shortfall(counts, layers)
        rows = np.flatnonzero(short)
        if not rows.size:
            return None
        taken = (rows, self.host_table[rows].copy(), [int(short[i]) for i in rows])
        for i, n in zip(rows, taken[2]):
            for _ in range(n):
                self.host_table[i, len(self._pages[i])] = page = self._free.pop()
                self._pages[i].append(page)
        try:
            self.block_table[rows] = cupy.asarray(self.host_table[rows])
        except BaseException:
            self._release(taken)
            raise
        return taken

    def _release(self, taken) -> None:
        """Give back what :meth:`_reserve` took, in reverse, so that the free list, each slot's
        pages and both tables are as they were."""
        if taken is None:
            return
        rows, old, counts = taken
        for i, n in zip(rows[::-1], counts[::-1]):
            for _ in range(n):
                self._free.append(self._pages[i].pop())
        self.host_table[rows] = old
        self.block_table[rows] = cupy.asarray(old)

    def free(self, slot) -> None:
        """Give slot ``slot``'s pages back to the free list and set its lengths (every layer) to 0."""
        slot = self._slot("PagedKVCache.free", slot)
        self._free.extend(reversed(self._pages[slot]))
        self._pages[slot] = []
        self.host_lengths[:, slot] = 0
        self.lengths[:, slot] = 0

    def reset(self) -> None:
        """Free every slot."""
        for slot in range(self.batch):
            self.free(slot)

    def decode(self, q, layer, scale=None, num_splits=None, out=None, workspace=None, impl=None, fused_combine=None,
               window=None, softcap=None, split_rule=None):
        """:func:`decode_attention_paged` of ``q`` over ``layer``, in this cache's layout (split
        count from the host lengths unless ``num_splits`` is given): q [max_batch, Hq, D] or
        [max_batch, Hq, 1, D], the result (and ``out``) shaped like q, as :meth:`KVCache.decode`."""
        fn = "PagedKVCache.decode"
        four = _checks.is_device_array(q) and q.ndim == 4
        if four:  # [B, Hq, 1, D] (KVCache.decode's shape) as the [B, Hq, D] the paged kernels read
            check_array(fn, "q", q, ndim=4)
            if q.shape[2] != 1:
                raise ValueError(f"{fn}(): q has shape {tuple(q.shape)}, expected [batch, Hq, 1, D] or [batch, Hq, D]")
            if out is not None:
                check_out(fn, out, q.shape, q.dtype)
        # the cache itself, as decode_attention_paged(q, cache, layer) takes it: its pages, table,
        # lengths, their host mirror and its layout, with no search for the pages' owner
        o = _decode_paged(fn, q[:, :, 0] if four else q, self, layer, None, None, scale, window, softcap, num_splits,
                          out[:, :, 0] if four and out is not None else out, impl, None, workspace, None,
                          split_rule, fused_combine)
        return (out if out is not None else o[:, :, None]) if four else o
