"""A preallocated KV cache for incremental decoding, and its append kernels (kernels_cu/kvcache.cu).

Memory layout: ``k`` and ``v`` are ``[num_layers, batch, num_kv_heads, max_seq, head_dim]``,
C-contiguous. Every (layer, sequence, kv head) owns one contiguous ``[max_seq, head_dim]`` slab,
so the decode kernel streams a kv head's keys as one contiguous run of memory, and an append of
T tokens writes T consecutive rows per head. ``cache.k[layer]`` is the ``[B, Hkv, S, D]`` view
the kernels take.

Lengths live twice, updated in lockstep: ``lengths`` (int32 on the device) is what the kernels
read, so decode never needs the host; ``host_lengths`` (int64 NumPy) is the host's mirror, used
for bounds checks and the auto split count with no device synchronisation (the host knows what
it appends). Change lengths only through :meth:`append`, :meth:`append_qkv` and :meth:`reset`;
when a replayed CUDA graph advances the device lengths (its captured appends run again with no
Python involved), tell the mirror with :meth:`record_advance`, after checking room with
:meth:`check_room` before the replay.

Append design: ``kv_append_kernel`` reads the write position ``lengths[layer, b] + t`` from the
device lengths and never writes them (other blocks of the same sequence are still reading);
``kv_advance_lengths_kernel`` then adds the counts, launched right after on the same stream, so
stream order makes every copy finish before a length moves. Capacity is checked on the host
mirror before either launch: an append that would pass ``max_seq`` raises and writes nothing.

:meth:`append_qkv` is the fused decoder step after the packed QKV projection
(``qkv_rope_append_kernel``): RoPE on q and k at positions ``lengths[b] + t`` read on the
device, k and v written to the cache, q to its own buffer. When the whole sequence fits one
block (every decode step), that block advances the length itself: a single launch per layer,
which needs no position or length input from the host and so can be captured and replayed.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks
from ._checks import check_array, check_last_contiguous, check_same_dtype
from ._loader import NULL, KernelSpec, cbool, ctype, defines, get_function, ptr_or_null
from .decode_launch import KvView
from .decode_launch import decode as _decode
from .config import (ROPE_STYLES, DTYPES, KV_ADVANCE_THREADS, KV_APPEND_ELEMS_PER_BLOCK, KV_APPEND_THREADS,
                     KV_ROPE_APPEND_ITEMS_PER_BLOCK, KV_ROPE_APPEND_THREADS)



def _as_4d(fn, q, out):
    """A cache's ``decode`` takes q [B, Hq, D] or [B, Hq, 1, D]: (q, out) as the 4-D views the
    decode kernels read (a 3-D out must be shaped like the 3-D q)."""
    if _checks.is_device_array(q) and q.ndim == 3:
        if out is not None:
            _checks.check_out(fn, out, q.shape, q.dtype)
        return q[:, :, None], None if out is None else out[:, :, None]
    return q, out

SPEC = KernelSpec(
    "kvcache", "kvcache.cu",
    tuple(f"kv_append_kernel<{ctype(t)}>" for t in DTYPES) + ("kv_advance_lengths_kernel",)
    + tuple(f"qkv_rope_append_kernel<{ctype(t)}, {cbool(neox)}>" for t in DTYPES for neox in (False, True))
    # paged variants (cupyattn.paged.PagedKVCache)
    + tuple(f"kv_append_kernel<{ctype(t)}, true>" for t in DTYPES)
    + tuple(f"qkv_rope_append_kernel<{ctype(t)}, {cbool(neox)}, true>" for t in DTYPES for neox in (False, True)),
    options=defines(KV_ROPE_APPEND_THREADS=KV_ROPE_APPEND_THREADS))


class KVCache:
    """K/V cache of ``num_layers`` layers for ``batch`` sequences of up to ``max_seq`` tokens.

    Parameters
    ----------
    num_layers, batch, num_kv_heads, max_seq, head_dim : int
        Sizes (all >= 1; ``max_seq`` < 2**31 since lengths are int32 on the device).
    dtype : float32, float16 or bfloat16
        Element type of ``k`` and ``v``; appended tensors and decode queries must match it.

    Attributes
    ----------
    k, v : cupy.ndarray [num_layers, batch, num_kv_heads, max_seq, head_dim]
    lengths : cupy.ndarray int32 [num_layers, batch]   tokens cached per layer and sequence
    host_lengths : numpy.ndarray int64 [num_layers, batch]   host mirror of ``lengths``

    Failures: every check (capacity on the host mirror, launch limits and kernel builds
    included) runs before anything is launched or taken, so a failed call changes neither the
    cache nor its lengths (nor a PagedKVCache's pages and tables). The host mirror moves
    only after all of a call's launches were issued without error; if a launch raises, the
    device lengths were not advanced either (the advance comes last, in stream order). A kernel
    fault reported later by CUDA (an asynchronous error at a later sync) leaves the CUDA context
    unusable: make a new cache in a new process.

    Examples
    --------
    >>> cache = KVCache(2, 1, 4, 1024, 64, cupy.float16)
    >>> cache.append(0, k_new, v_new)          # k_new, v_new [1, 4, T, 64]
    >>> cache.seq_lengths(0)
    array([T])
    """

    def __init__(self, num_layers, batch, num_kv_heads, max_seq, head_dim, dtype):
        fn = "KVCache"
        self.num_layers = _checks.check_positive_int(fn, "num_layers", num_layers)
        self.batch = _checks.check_positive_int(fn, "batch", batch)
        self.num_kv_heads = _checks.check_positive_int(fn, "num_kv_heads", num_kv_heads)
        self.max_seq = _checks.check_positive_int(fn, "max_seq", max_seq)
        self.head_dim = _checks.check_positive_int(fn, "head_dim", head_dim)
        _checks.check_int32(fn, "max_seq (lengths are int32 on the device)", self.max_seq)
        _checks.check_int32(fn, "head_dim", self.head_dim)
        for name, n in (("batch", self.batch), ("num_kv_heads", self.num_kv_heads)):
            _checks.check_grid_yz(fn, name, n)  # the append and decode launches give each one a grid row
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt not in DTYPES:
            raise TypeError(f"{fn}(): dtype {dtype!r} is not supported; expected one of "
                            f"{', '.join(map(str, DTYPES))}")
        self.dtype = dt
        shape = (self.num_layers, self.batch, self.num_kv_heads, self.max_seq, self.head_dim)
        with _checks.no_gpu_explained(fn):
            self.k = cupy.zeros(shape, dtype=dt)
            self.v = cupy.zeros(shape, dtype=dt)
            self.lengths = cupy.zeros((self.num_layers, self.batch), dtype=np.int32)
            # The fused decode step's QKV kernel (cupyattn.fused) has many blocks: the last to
            # finish, found by this ticket, advances the lengths and sets it back to 0.
            self.ticket = cupy.zeros(1, dtype=np.uint32)
        self.host_lengths = np.zeros((self.num_layers, self.batch), dtype=np.int64)

    def device_arrays(self) -> dict:
        """Every device array of the cache a kernel reads or writes, by the name errors use: what
        a caller's ``out=``, ``q_out=``, ``workspace=`` or input may not overlap (the
        integer lengths, ticket and block table included)."""
        return {"the cache's keys": self.k, "the cache's values": self.v, "the cache's lengths": self.lengths,
                "the cache's ticket": self.ticket}

    # Where append kernels write: the contiguous layout here; PagedKVCache overrides both.
    _EXPR_TAIL = ""

    def _layout_args(self):
        """The append kernels' KV_PAGED_PARAMS: no block table."""
        return (NULL, np.int32(0), np.int32(0), np.int32(0), np.int32(0))

    def view(self, layer: int):
        """Layer ``layer`` (an int in range) as the decode kernels read it (decode_launch.KvView)."""
        return KvView(self.k[layer], self.v[layer], self.lengths[layer], self.num_kv_heads, self.head_dim,
                      self.batch, self.max_seq, self.dtype, self.device_arrays())

    def decode(self, q, layer, scale=None, num_splits=None, out=None, workspace=None, impl=None, fused_combine=None,
               window=None, softcap=None, split_rule=None):
        """:func:`cupyattn.decode_attention` of ``q`` over ``layer``: one query token per sequence,
        q [batch, Hq, 1, D] or [batch, Hq, D], the result (and ``out``) shaped like q. The same
        method on a :class:`~cupyattn.PagedKVCache` reads its pages, so a caller decodes either
        cache with ``cache.decode(q, layer, ...)``."""
        fn = f"{type(self).__name__}.decode"
        layer = self.check_layer(fn, layer)
        q4, out4 = _as_4d(fn, q, out)
        o = _decode(fn, q4, self.view(layer), self.host_lengths[layer], scale, num_splits, out4, workspace, impl,
                    fused_combine, window, softcap, split_rule)
        return o if q4 is q else (out if out is not None else o[:, :, 0])

    def __repr__(self):
        return (f"KVCache(num_layers={self.num_layers}, batch={self.batch}, num_kv_heads="
                f"{self.num_kv_heads}, max_seq={self.max_seq}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, max live length={int(self.host_lengths.max())})")

    # --- lengths ----------------------------------------------------------------------------
    def check_layer(self, fn: str, layer, device: bool = True) -> int:
        """``layer`` as an int in [0, num_layers), else IndexError/TypeError naming ``fn``; with
        ``device`` (a call that launches), the cache on the current device, else ValueError."""
        if device:
            _checks.check_device(fn, "the cache", self.k)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"{fn}(): layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"{fn}(): layer {layer} is out of range for a cache of {self.num_layers} layers")
        return int(layer)

    def seq_lengths(self, layer) -> np.ndarray:
        """Host copy (int64 [batch]) of the cached lengths of ``layer``; no device sync."""
        return self.host_lengths[self.check_layer(f"{type(self).__name__}.seq_lengths", layer, device=False)].copy()

    def reset(self) -> None:
        """Forget every cached token (lengths -> 0). K/V contents are left as they are: rows at
        or past a sequence's length are never read."""
        self.lengths.fill(0)
        self.host_lengths[...] = 0

    def check_room(self, num_new=1, fn: str = "KVCache.check_room") -> np.ndarray:
        """Raise ValueError (naming ``fn``) unless every layer can take ``num_new`` more tokens
        per sequence (an int, or ``batch`` host ints); returns the counts as int64 [batch].
        Call it before replaying a graph that appends, so that a replay never overflows."""
        counts = self._counts(fn, num_new, None)
        self._check_capacity(fn, counts, slice(None))
        self._reserve(counts, slice(None))
        return counts

    def _check_capacity(self, fn: str, counts, layers) -> None:
        """ValueError naming the first (layer, sequence) that ``counts`` would overfill. Only
        checks: :meth:`_reserve` takes the room once every check of the call has passed."""
        over = self.host_lengths[layers] + counts > self.max_seq  # [len(layers), batch], one pass
        if over.any():
            li, i = (int(x) for x in np.argwhere(over)[0])
            layer = int(np.arange(self.num_layers)[layers][li])
            raise ValueError(f"{fn}(): cache is full: sequence {i} of layer {layer} holds "
                             f"{int(self.host_lengths[layer, i])} tokens, appending {int(counts[i])} "
                             f"would exceed the cache capacity max_seq={self.max_seq}")

    def record_advance(self, num_new=1, layers=None) -> None:
        """Record on the host mirror that device kernels advanced ``lengths`` by ``num_new``
        tokens per sequence (int or ``batch`` host ints) in ``layers`` (None: all): what a
        replayed CUDA graph of :meth:`append_qkv` calls did on the device. Launches nothing.
        Raises ValueError, changing nothing, if that would pass ``max_seq``: check with
        :meth:`check_room` before the replay, since the device has already moved by then."""
        fn = f"{type(self).__name__}.record_advance"
        counts = self._counts(fn, num_new, None)
        sel = slice(None) if layers is None else [self.check_layer(fn, i, device=False) for i in layers]
        self._check_capacity(fn, counts, sel)
        self._reserve(counts, sel)
        self.host_lengths[sel] += counts

    # --- taking room: after every check of a call -----------------------------------
    def _reserve(self, counts, layers):
        """Make room for ``counts`` more tokens per sequence in ``layers``, once every check of the
        call (launch limits and kernel builds included) has passed; returns what :meth:`_release`
        needs to undo it. The contiguous layout has its room already: nothing to take."""
        return None

    def _release(self, taken) -> None:
        """Undo :meth:`_reserve` (its return value) when a launch after it raised."""

    def _commit(self, layer, counts, launches) -> None:
        """The last step of an append, after every check: take the room, run ``launches`` (a
        callable issuing the kernels), then move the host mirror. If a launch raises, the room
        goes back first, so a failed call leaves the allocator, the tables and the lengths (host
        and device: the device advance is the last launch) as they were."""
        taken = self._reserve(counts, [layer])
        try:
            launches()
        except BaseException:
            self._release(taken)
            raise
        self.host_lengths[layer] += counts

    # --- append -----------------------------------------------------------------------------
    def _counts(self, fn: str, num_new, t) -> np.ndarray:
        """Per-sequence counts as int64 [batch], each in [0, T] (T None: any count >= 0)."""
        if num_new is None:
            return np.full(self.batch, t, dtype=np.int64)
        if _checks.is_device_array(num_new):
            raise TypeError(f"{fn}(): num_new must be host integers (list or NumPy array), "
                            "not a device array: the host checks capacity without a sync")
        counts = np.asarray(num_new)
        if counts.ndim == 0:
            counts = np.full(self.batch, counts)
        if counts.shape != (self.batch,) or (counts.size and not np.issubdtype(counts.dtype, np.integer)):
            raise ValueError(f"{fn}(): num_new must be {self.batch} integers (one per sequence), "
                             f"got {num_new!r}")
        counts = counts.astype(np.int64)
        bad = np.flatnonzero((counts < 0) | (counts > (t if t is not None else np.inf)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{fn}(): num_new[{i}]={int(counts[i])} is outside [0, T={t}]"
                             if t is not None else f"{fn}(): num_new[{i}]={int(counts[i])} is negative")
        return counts

    def append(self, layer, k_new, v_new, num_new=None) -> None:
        """Write new tokens of ``layer`` and advance its lengths.

        Parameters
        ----------
        layer : int
        k_new, v_new : cupy.ndarray [batch, num_kv_heads, T, head_dim], the cache's dtype
            Last dim contiguous; other strides are free (read through stride arguments, no copy).
        num_new : None or sequence of ``batch`` host ints in [0, T]
            Tokens to take from each sequence (ragged prefill): token t < num_new[b] of sequence
            b goes to position ``lengths[layer, b] + t``. None takes all T.

        Raises
        ------
        ValueError
            If a sequence would pass ``max_seq``; nothing is written and lengths stay as they were.
        """
        fn = f"{type(self).__name__}.append"
        layer = self.check_layer(fn, layer)
        check_array(fn, "k_new", k_new, ndim=4)
        check_array(fn, "v_new", v_new, ndim=4)
        check_same_dtype(fn, "k_new", k_new, "the cache", self.k)
        check_same_dtype(fn, "v_new", v_new, "the cache", self.k)
        t = k_new.shape[2]
        want = (self.batch, self.num_kv_heads, t, self.head_dim)
        if tuple(k_new.shape) != want:
            raise ValueError(f"{fn}(): k_new has shape {tuple(k_new.shape)}, expected "
                             f"[batch={self.batch}, num_kv_heads={self.num_kv_heads}, T, head_dim={self.head_dim}]")
        if tuple(v_new.shape) != tuple(k_new.shape):
            raise ValueError(f"{fn}(): v_new has shape {tuple(v_new.shape)} but k_new has {tuple(k_new.shape)}")
        check_last_contiguous(fn, "k_new", k_new)
        check_last_contiguous(fn, "v_new", v_new)
        _checks.check_int32(fn, "T (k_new.shape[2])", t)
        for name, x in (("k_new", k_new), ("v_new", v_new)):  # an input the append's writes would change
            _checks.check_no_overlap(fn, x, self.device_arrays(), out_name=name)
        counts = self._counts(fn, num_new, t)
        self._check_capacity(fn, counts, [layer])
        if not counts.any():
            return
        self._commit(layer, counts, self._append_launches(fn, layer, k_new, v_new, counts, t))

    def _device_counts(self, layer, counts):
        """(lengths view, per-sequence counts on the device, uniform): a uniform append passes
        counts[0] by value, and the lengths view stands in as an unread counts pointer."""
        uniform = bool(np.all(counts == counts[0]))
        lengths = self.lengths[layer]                     # int32 [B] view
        return lengths, (lengths if uniform else cupy.asarray(counts.astype(np.int32))), uniform

    def _append_launches(self, fn, layer, k_new, v_new, counts, t):
        """Check the launch (grid limits) and build its kernels, then return the launches as a
        callable for :meth:`_commit`: nothing here takes room or writes."""
        d = self.head_dim
        tok_per_block = max(1, KV_APPEND_ELEMS_PER_BLOCK // d)
        n_max = int(counts.max())
        grid = ((n_max + tok_per_block - 1) // tok_per_block, self.num_kv_heads, self.batch)
        _checks.check_grid(fn, "the append kernel", grid)
        append = get_function(SPEC, f"kv_append_kernel<{ctype(self.dtype)}{self._EXPR_TAIL}>")
        advance = self._advance_launch(fn)
        ks = [s // k_new.itemsize for s in k_new.strides[:3]]
        vs = [s // v_new.itemsize for s in v_new.strides[:3]]
        i32, i64 = np.int32, np.int64

        def launches():
            lengths, dev_counts, uniform = self._device_counts(layer, counts)
            append(grid, (KV_APPEND_THREADS,),
                   (self.k[layer], self.v[layer], k_new, v_new, lengths, dev_counts,
                    *map(i64, ks), *map(i64, vs),
                    i32(self.num_kv_heads), i32(self.max_seq), i32(d), i32(tok_per_block),
                    i32(counts[0]), i32(0 if uniform else 1), *self._layout_args()))
            advance(lengths, dev_counts, counts, uniform)
        return launches

    # --- fused rope + append ------------------------------------------------------------------
    def append_qkv(self, layer, qkv, num_heads, rope_base=10000.0, rope_style="adjacent",
                   num_new=None, q_out=None, rope_freq_div=None):
        """RoPE and cache append straight from a packed QKV projection, in one kernel.

        Token t of sequence b is at position ``p = lengths[layer, b] + t`` (read on the device):
        its q heads turn by p (``rope_style`` as :func:`cupyattn.rope`) into ``q_out``, its k
        heads turn by p into cache row p, its v heads are copied to cache row p; then the
        layer's lengths advance by the counts. Equivalent to splitting the heads, ``rope`` on q
        and k at those positions and :meth:`append`, without the copies or the position input.

        Parameters
        ----------
        layer : int
        qkv : cupy.ndarray [batch, T, (num_heads + 2 * num_kv_heads) * head_dim], cache dtype
            Heads packed as q | k | v (the output of one x @ [Wq; Wk; Wv]^T). Last dim
            contiguous; batch and token strides are free.
        num_heads : int
            Query heads in ``qkv``.
        rope_base : float
            > 0 (10000 for Llama 2, 100000 for SmolLM2).
        rope_style : {"adjacent", "neox"}
            Pairs (x[2i], x[2i+1]) (GGUF) or (x[i], x[i + D/2]).
        num_new : None or ``batch`` host ints in [0, T]
            Tokens of each sequence to append (right-padded ragged batch); None: all T. Queries
            of padding tokens are still rotated (at the positions they would have).
        q_out : cupy.ndarray [batch, num_heads, T, head_dim], optional
            C-contiguous, cache dtype.
        rope_freq_div : cupy.ndarray [head_dim / 2], float32, optional
            Pair i's frequency ``rope_base**(-2i/head_dim)`` is divided by ``rope_freq_div[i]``
            (Llama 3.1+'s ``rope_freqs`` table; linear RoPE scaling is every entry equal to its
            factor). C-contiguous; its values are used as they are.

        Returns
        -------
        q_out : [batch, num_heads, T, head_dim], rotated queries.

        Raises
        ------
        ValueError
            If a sequence would pass ``max_seq``: nothing is launched or written.
        """
        fn = f"{type(self).__name__}.append_qkv"
        layer = self.check_layer(fn, layer)
        check_array(fn, "qkv", qkv, ndim=3)
        check_same_dtype(fn, "qkv", qkv, "the cache", self.k)
        hq = _checks.check_positive_int(fn, "num_heads", num_heads)
        b, t, width = qkv.shape
        d, hkv = self.head_dim, self.num_kv_heads
        if b != self.batch or width != (hq + 2 * hkv) * d:
            raise ValueError(f"{fn}(): qkv has shape {tuple(qkv.shape)}, expected [batch={self.batch}, T, "
                             f"(num_heads + 2 * num_kv_heads) * head_dim = {(hq + 2 * hkv) * d}]")
        if d % 2:
            raise ValueError(f"{fn}(): RoPE needs an even head_dim, the cache has {d}")
        check_last_contiguous(fn, "qkv", qkv)
        _checks.check_int32(fn, "T (qkv.shape[1])", t)
        _checks.check_int32(fn, "the packed width (qkv.shape[2])", width)
        base = _checks.check_real(fn, "rope_base", rope_base, minimum=0.0, strict=True)
        _checks.check_choice(fn, "rope_style", rope_style, ROPE_STYLES)
        cache = self.device_arrays()
        _checks.check_no_overlap(fn, qkv, cache, out_name="qkv")
        if q_out is not None:
            _checks.check_out(fn, q_out, (b, hq, t, d), self.dtype, name="q_out")
            _checks.check_no_overlap(fn, q_out, {"qkv": qkv, **cache}, out_name="q_out")
        _checks.check_freq_div(fn, rope_freq_div, d)
        counts = self._counts(fn, num_new, t)
        self._check_capacity(fn, counts, [layer])
        half = d // 2
        tok_per_block = max(1, KV_ROPE_APPEND_ITEMS_PER_BLOCK // ((hq + 2 * hkv) * half))
        n_tiles = -(-t // tok_per_block)
        if t == 0:
            return cupy.empty((b, hq, t, d), dtype=self.dtype) if q_out is None else q_out
        advance_here = n_tiles == 1  # one block per sequence: it can move its own length
        _checks.check_grid(fn, "the RoPE + append kernel", (n_tiles, b, 1))
        kern = get_function(SPEC, f"qkv_rope_append_kernel<{ctype(self.dtype)}, {cbool(rope_style == 'neox')}"
                                  f"{self._EXPR_TAIL}>")
        advance = None if advance_here else self._advance_launch(fn)
        if q_out is None:
            q_out = cupy.empty((b, hq, t, d), dtype=self.dtype)
        i32, i64 = np.int32, np.int64

        def launches():
            lengths, dev_counts, uniform = self._device_counts(layer, counts)
            kern((n_tiles, b), (KV_ROPE_APPEND_THREADS,),
                 (qkv, q_out, self.k[layer], self.v[layer], lengths, dev_counts,
                  i64(qkv.strides[0] // qkv.itemsize), i64(qkv.strides[1] // qkv.itemsize),
                  i32(t), i32(hq), i32(hkv), i32(d), i32(self.max_seq), i32(tok_per_block),
                  i32(counts[0]), i32(0 if uniform else 1), np.float64(-math.log2(base) / half),
                  ptr_or_null(rope_freq_div), i32(1 if advance_here else 0), *self._layout_args()))
            if advance is not None:
                advance(lengths, dev_counts, counts, uniform)
        self._commit(layer, counts, launches)
        return q_out

    def _advance_launch(self, fn):
        """The launch of lengths[b] += counts[b] on the device, after the kernels that read them
        (stream order), checked and built now: a callable (lengths, dev_counts, counts, uniform)."""
        grid = (-(-self.batch // KV_ADVANCE_THREADS), 1, 1)
        _checks.check_grid(fn, "the length advance kernel", grid)
        advance = get_function(SPEC, "kv_advance_lengths_kernel")

        def run(lengths, dev_counts, counts, uniform):
            advance(grid, (KV_ADVANCE_THREADS,),
                    (lengths, dev_counts, np.int32(self.batch), np.int32(counts[0]), np.int32(0 if uniform else 1)))
        return run
