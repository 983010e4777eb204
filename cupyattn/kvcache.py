"""A preallocated KV cache for incremental decoding, and its append kernels (kernels_cu/kvcache.cu).

Memory layout: ``k`` and ``v`` are ``[num_layers, batch, num_kv_heads, max_seq, head_dim]``,
C-contiguous. Every (layer, sequence, kv head) owns one contiguous ``[max_seq, head_dim]`` slab,
so the decode kernel streams a kv head's keys as one contiguous run of memory, and an append of
T tokens writes T consecutive rows per head. ``cache.k[layer]`` is the ``[B, Hkv, S, D]`` view
the kernels take.

Lengths live twice, updated in lockstep: ``lengths`` (int32 on the device) is what the kernels
read, so decode never needs the host; ``host_lengths`` (int64 NumPy) is the host's mirror, used
for bounds checks and the auto split count with no device synchronisation (the host knows what
it appends). Change lengths only through :meth:`append` and :meth:`reset`.

Append design: ``kv_append_kernel`` reads the write position ``lengths[layer, b] + t`` from the
device lengths and never writes them (other blocks of the same sequence are still reading);
``kv_advance_lengths_kernel`` then adds the counts, launched right after on the same stream, so
stream order makes every copy finish before a length moves. Capacity is checked on the host
mirror before either launch: an append that would pass ``max_seq`` raises and writes nothing.
"""
from __future__ import annotations

import cupy
import numpy as np

from . import _checks
from ._checks import check_array, check_last_contiguous, check_same_dtype
from ._loader import KernelSpec, get_function
from .config import (DTYPES, KV_ADVANCE_THREADS, KV_APPEND_ELEMS_PER_BLOCK, KV_APPEND_THREADS,
                     ctype)

SPEC = KernelSpec(
    "kvcache", "kvcache.cu",
    tuple(f"kv_append_kernel<{ctype(t)}>" for t in DTYPES) + ("kv_advance_lengths_kernel",))


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
        if self.max_seq >= 2**31:
            raise ValueError(f"{fn}(): max_seq={self.max_seq} does not fit the int32 lengths")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt not in DTYPES:
            raise TypeError(f"{fn}(): dtype {dtype!r} is not supported; expected one of "
                            f"{', '.join(map(str, DTYPES))}")
        self.dtype = dt
        shape = (self.num_layers, self.batch, self.num_kv_heads, self.max_seq, self.head_dim)
        self.k = cupy.zeros(shape, dtype=dt)
        self.v = cupy.zeros(shape, dtype=dt)
        self.lengths = cupy.zeros((self.num_layers, self.batch), dtype=np.int32)
        self.host_lengths = np.zeros((self.num_layers, self.batch), dtype=np.int64)

    def __repr__(self):
        return (f"KVCache(num_layers={self.num_layers}, batch={self.batch}, num_kv_heads="
                f"{self.num_kv_heads}, max_seq={self.max_seq}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, max live length={int(self.host_lengths.max())})")

    # --- lengths ----------------------------------------------------------------------------
    def check_layer(self, fn: str, layer) -> int:
        """``layer`` as an int in [0, num_layers), else IndexError/TypeError naming ``fn``."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"{fn}(): layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"{fn}(): layer {layer} is out of range for a cache of {self.num_layers} layers")
        return int(layer)

    def seq_lengths(self, layer) -> np.ndarray:
        """Host copy (int64 [batch]) of the cached lengths of ``layer``; no device sync."""
        return self.host_lengths[self.check_layer("KVCache.seq_lengths", layer)].copy()

    def reset(self) -> None:
        """Forget every cached token (lengths -> 0). K/V contents are left as they are: rows at
        or past a sequence's length are never read."""
        self.lengths.fill(0)
        self.host_lengths[...] = 0

    # --- append -----------------------------------------------------------------------------
    def _counts(self, fn: str, num_new, t: int) -> np.ndarray:
        """Per-sequence counts as int64 [batch], each in [0, T]."""
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
        bad = np.flatnonzero((counts < 0) | (counts > t))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{fn}(): num_new[{i}]={int(counts[i])} is outside [0, T={t}]")
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
        fn = "KVCache.append"
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
        counts = self._counts(fn, num_new, t)
        new_len = self.host_lengths[layer] + counts
        over = np.flatnonzero(new_len > self.max_seq)
        if over.size:
            i = int(over[0])
            raise ValueError(f"{fn}(): cache is full: sequence {i} of layer {layer} holds "
                             f"{int(self.host_lengths[layer, i])} tokens, appending {int(counts[i])} "
                             f"would exceed the cache capacity max_seq={self.max_seq}")
        if not counts.any():
            return
        self._launch(layer, k_new, v_new, counts, t)
        self.host_lengths[layer] = new_len

    def _launch(self, layer, k_new, v_new, counts, t):
        uniform = bool(np.all(counts == counts[0]))
        lengths = self.lengths[layer]                     # int32 [B] view
        dev_counts = lengths if uniform else cupy.asarray(counts.astype(np.int32))  # dummy if uniform
        d = self.head_dim
        tok_per_block = max(1, KV_APPEND_ELEMS_PER_BLOCK // d)
        n_max = int(counts.max())
        grid = ((n_max + tok_per_block - 1) // tok_per_block, self.num_kv_heads, self.batch)
        ks = [s // k_new.itemsize for s in k_new.strides[:3]]
        vs = [s // v_new.itemsize for s in v_new.strides[:3]]
        i32, i64 = np.int32, np.int64
        use_counts = i32(0 if uniform else 1)
        n_uniform = i32(counts[0])
        append = get_function(SPEC, f"kv_append_kernel<{ctype(self.dtype)}>")
        append(grid, (KV_APPEND_THREADS,),
               (self.k[layer], self.v[layer], k_new, v_new, lengths, dev_counts,
                *map(i64, ks), *map(i64, vs),
                i32(self.num_kv_heads), i32(self.max_seq), i32(d), i32(tok_per_block),
                n_uniform, use_counts))
        advance = get_function(SPEC, "kv_advance_lengths_kernel")
        advance((-(-self.batch // KV_ADVANCE_THREADS),), (KV_ADVANCE_THREADS,),
                (lengths, dev_counts, i32(self.batch), n_uniform, use_counts))
