"""Next-token sampling on the device: greedy, temperature, top-k and top-p (kernels_cu/sampling.cu).

One kernel launch samples one token per row of ``logits`` [B, V] and writes the ids to an int32
device array: a decoder can feed them straight into the next step's embedding, and the host
reads back B ids per step (for EOS and streaming), nothing else. Settings live in device memory
(:class:`SamplingParams`), so a CUDA graph that captured the launch samples with the settings
of the moment it is replayed, and the kernel advances each sequence's RNG step itself.

Seed semantics (reproducible on the same backend, independent of launch shape and batch
composition): sequence b of a call draws from Philox-4x32-10 with key ``seed_b`` (64 bits) and
counter ``(step_b, 0, 0, 0)``; a scalar ``seed`` gives ``seed_b = seed + b``, so prompt b of a
batch samples exactly like that prompt alone with seed ``seed + b`` (same logits assumed), and
``step_b`` counts the tokens that sequence has sampled. The host sampler of tinylm's NumPy
backend (tinylm.sampling.Sampler) draws from the same distribution with a different generator:
the two backends do not give the same tokens for one seed, each reproduces its own.

Distribution (``cupyattn.reference.sampling_probs`` is its float64 model): softmax of
``logits / temperature`` restricted to the top-k logits (ties at the k-th value all kept) and
then to the smallest most-likely set whose probability reaches top_p (ties at the cut kept
whole). Probabilities are 40-bit fixed point relative to the most likely token, so tokens less
likely than 2^-40 of it are never drawn.

Edges (the same on tinylm's host Sampler and in the reference):

- **NaN and -inf logits are never drawn**, greedy or sampled. A row with no other logit (all
  NaN, all -inf, or a mix) yields the id **-1**: a kernel cannot raise, so the caller checks
  (tinylm raises; the host Sampler raises ValueError on such a row).
- **+inf logits** are infinitely more likely than finite ones: a row holding any is sampled
  uniformly among its +inf entries (greedy takes the first).
- **Temperature** ``T`` is used as ``beta = 1/T`` rounded to float32 (:func:`inverse_temperature`).
  ``T == 0``, and any ``T`` so small that ``1/T`` overflows float32 (below about 2.9e-39), is
  **greedy**: the first index of the largest logit, as ``numpy.argmax``. Any other ``T``
  samples, tied maxima sharing the mass equally. ``T`` so large that ``1/T`` falls below
  float32's normal range (above about 8.5e37) is the **uniform** limit: every candidate equally
  likely (the top-k and top-p cuts still rank tokens by logit, so top-p keeps about a share p
  of them). Logits further apart than float32's range (``l - l_max`` overflows, e.g. 3e38 and
  -3e38) keep their weight ``exp((l - l_max) * beta)``: the kernel halves both before
  subtracting.
- Subnormal float32 logits (below 1.2e-38 in magnitude, possible in bfloat16 too) may count as
  0 on a GPU (kernels are compiled with ``-ftz=true``).

Example
-------
>>> params = SamplingParams(batch=2, temperature=0.8, top_k=40, top_p=0.95, seed=1)
>>> tokens = cupy.empty(2, dtype=cupy.int32)
>>> sample(logits, params, out=tokens)        # logits [2, V]; tokens[b] is an id in [0, V)
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks as C
from ._loader import KernelSpec, ctype, defines, get_function
from .config import DTYPES, MAX_GRID_X, SAMPLING_MASS_BITS, SAMPLING_MAX_VOCAB, SAMPLING_THREADS
from .layers import _rows

SPEC = KernelSpec(
    "sampling", "sampling.cu",
    tuple(f"sample_kernel<{ctype(t)}>" for t in DTYPES) + ("philox_kernel",),
    options=defines(SAMPLING_THREADS=SAMPLING_THREADS, SAMPLING_MASS_BITS=SAMPLING_MASS_BITS))

_I32 = np.dtype(np.int32)
_U32 = np.dtype(np.uint32)


class SamplingParams:
    """Per-sequence sampling settings and RNG step of ``batch`` sequences, in device memory.

    Parameters
    ----------
    batch : int
    temperature, top_k, top_p, seed, step
        See :meth:`set`.

    Attributes
    ----------
    fparams : cupy.ndarray float32 [batch, 2]   (1/temperature as :func:`inverse_temperature`, top_p)
    iparams : cupy.ndarray int32 [batch, 4]     (top_k, seed bits 0-31, seed bits 32-63, step)
    """

    def __init__(self, batch, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0):
        self.batch = C.check_positive_int("SamplingParams", "batch", batch)
        with C.no_gpu_explained("SamplingParams"):
            self.fparams = cupy.zeros((self.batch, 2), dtype=np.float32)
            self.iparams = cupy.zeros((self.batch, 4), dtype=np.int32)
        self.set(temperature, top_k, top_p, seed, step)

    def _per_seq(self, name, value, dtype):
        a = np.asarray(value)
        if C.is_device_array(value) or a.ndim > 1 or a.size not in (1, self.batch):
            raise ValueError(f"SamplingParams.set(): {name} must be a number or {self.batch} numbers "
                             f"(one per sequence), got {value!r}")
        if dtype.kind == "i" and a.size and not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"SamplingParams.set(): {name} must be integers, got {value!r}")
        if a.dtype.kind not in "iuf":  # not a string, a bool or an object that converts
            raise TypeError(f"SamplingParams.set(): {name} must be numbers, got {value!r}")
        return np.broadcast_to(a.reshape(-1), (self.batch,)).astype(dtype)

    def set(self, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0):
        """Write the settings (host -> device copies: call it before a capture or replay, not
        inside one). Each is one value for every sequence or one per sequence.

        temperature : 0 for greedy, else logits are divided by it (finite, >= 0; see the
            module docstring for the limits at both ends).
        top_k : 0 (off) or the number of most likely tokens to keep (>= 0).
        top_p : in (0, 1]; 1 is off.
        seed : int in [0, 2^64); a scalar gives sequence b the seed ``seed + b`` (mod 2^64).
        step : the RNG counter to start from (>= 0); the kernel advances it per call.
        """
        fn = "SamplingParams.set"
        t = self._per_seq("temperature", temperature, np.dtype(np.float64))
        p = self._per_seq("top_p", top_p, np.dtype(np.float64))
        k = self._per_seq("top_k", top_k, np.dtype(np.int64))
        st = self._per_seq("step", step, np.dtype(np.int64))
        if not (np.isfinite(t) & (t >= 0)).all():
            raise ValueError(f"{fn}(): temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
        if not ((p > 0) & (p <= 1)).all():
            raise ValueError(f"{fn}(): top_p must be in (0, 1], got {top_p!r}")
        if (k < 0).any() or (k > np.iinfo(np.int32).max).any():
            raise ValueError(f"{fn}(): top_k must be in [0, 2^31), got {top_k!r}")
        if (st < 0).any() or (st > np.iinfo(np.int32).max).any():
            raise ValueError(f"{fn}(): step must be in [0, 2^31), got {step!r}")
        seeds = self._seeds(fn, seed)
        f = np.stack([inverse_temperature(t), p.astype(np.float32)], axis=1)
        u64 = np.uint64
        i = np.stack([k.astype(u64), seeds & u64(0xFFFFFFFF), seeds >> u64(32), st.astype(u64)], axis=1)
        self.fparams.set(np.ascontiguousarray(f))
        self.iparams.set(np.ascontiguousarray(i.astype(np.uint32).view(np.int32)))
        self.host = {"temperature": t, "top_k": k, "top_p": p, "seed": seeds}
        return self

    def _seeds(self, fn, seed) -> np.ndarray:
        """uint64 [batch]: scalar seed -> seed + b; a list is taken as is."""
        vals = [seed] if np.ndim(seed) == 0 else list(np.asarray(seed).reshape(-1))
        if len(vals) not in (1, self.batch) or any(
                isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2**64
                for v in vals):
            raise ValueError(f"{fn}(): seed must be an int in [0, 2^64) or {self.batch} of them, got {seed!r}")
        if len(vals) == 1:
            vals = [(int(vals[0]) + b) % 2**64 for b in range(self.batch)]
        return np.array([int(v) for v in vals], dtype=np.uint64)


def inverse_temperature(temperature) -> np.ndarray:
    """float32 ``1/temperature`` as the sampler uses it (array in, array out): +inf (greedy) for
    0 and wherever ``1/T`` overflows float32; 0 (uniform) wherever ``1/T`` is below float32's
    normal range, so the device never meets a subnormal (it flushes them, the emulator would not)."""
    t = np.asarray(temperature, dtype=np.float64)
    with np.errstate(divide="ignore", over="ignore"):
        beta = (1.0 / t).astype(np.float32)  # t == 0 -> inf; overflow -> inf
    return np.where(beta < np.finfo(np.float32).tiny, np.float32(0.0), beta).astype(np.float32)


def _check_args(fn, logits, params, out):
    C.check_array(fn, "logits", logits, min_ndim=1)
    v = logits.shape[-1]
    if not 1 <= v <= SAMPLING_MAX_VOCAB:
        raise ValueError(f"{fn}(): the vocabulary (last dim of logits) must have 1 to "
                         f"{SAMPLING_MAX_VOCAB} entries, got {v}")
    rows = logits.size // v
    if rows > MAX_GRID_X:
        raise ValueError(f"{fn}(): {rows} rows exceed one launch's grid")
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{fn}(): params must be a cupyattn.sampling.SamplingParams, got "
                            f"{type(params).__name__}")
        if params.batch != rows:
            raise ValueError(f"{fn}(): params are for {params.batch} sequences but logits have {rows} rows")
    if out is not None:
        C.check_array(fn, "out", out, dtypes=(_I32,))
        if out.size != rows or not out.flags.c_contiguous:
            raise ValueError(f"{fn}(): out must be a C-contiguous int32 array of {rows} elements "
                             f"(one per row), got shape {tuple(out.shape)}")
        extra = {} if params is None else {"params.fparams": params.fparams, "params.iparams": params.iparams}
        C.check_no_overlap(fn, out, {"logits": logits, **extra})
    return rows, v


def sample(logits, params=None, *, temperature=0.0, top_k=0, top_p=1.0, seed=0, out=None):
    """Sample one token id per row of ``logits`` on the device.

    Parameters
    ----------
    logits : cupy.ndarray [..., V], float32 / float16 / bfloat16
        Rows are the leading dims (e.g. [B, V] or [B, 1, V]); last dim contiguous. Strided rows
        are read in place when the leading dims collapse to one row stride, else copied.
    params : SamplingParams, optional
        Settings and RNG step per row (advanced by one per call): with ``out`` given the call
        allocates nothing and can be captured in a CUDA graph. Without it, a SamplingParams is
        made from the keyword settings (step 0) for this one call.
    temperature, top_k, top_p, seed
        Used only when ``params`` is None (see :meth:`SamplingParams.set`).
    out : cupy.ndarray int32 with one element per row, optional
        C-contiguous (e.g. [B] or [B, 1]).

    Returns
    -------
    cupy.ndarray int32: the sampled ids (``out`` when given, else shape [rows]); -1 for a row
    whose logits are all NaN or -inf (nothing can be drawn; see the module docstring).

    Example
    -------
    >>> tok = sample(logits[:, -1], temperature=0.7, top_p=0.9, seed=3)   # [B] int32
    """
    fn = "sample"
    rows, v = _check_args(fn, logits, params, out)
    if params is None:
        params = SamplingParams(rows, temperature, top_k, top_p, seed)
    if out is None:
        out = cupy.empty(rows, dtype=np.int32)
    geo = _rows(logits)
    if geo is None:
        logits = cupy.ascontiguousarray(logits)
        geo = _rows(logits)
    kern = get_function(SPEC, f"sample_kernel<{ctype(logits.dtype)}>")
    kern((rows,), (SAMPLING_THREADS,), (logits, params.fparams, params.iparams, out, np.int32(v),
                                        np.int64(geo[1])))
    return out


def philox4x32(counters, keys):
    """Raw Philox-4x32-10 blocks on the device: counters uint32 [n, 4], keys uint32 [n, 2] (host
    or device) -> uint32 [n, 4] (device). The generator behind :func:`sample`; tests compare it
    with the Random123 known-answer vectors and ``cupyattn.reference.philox4x32``."""
    ctr = cupy.asarray(np.ascontiguousarray(cupy.asnumpy(counters), dtype=_U32))
    key = cupy.asarray(np.ascontiguousarray(cupy.asnumpy(keys), dtype=_U32))
    if ctr.ndim != 2 or ctr.shape[1] != 4 or key.shape != (ctr.shape[0], 2):
        raise ValueError(f"philox4x32(): counters must be [n, 4] and keys [n, 2], got "
                         f"{tuple(ctr.shape)} and {tuple(key.shape)}")
    out = cupy.empty_like(ctr)
    n = ctr.shape[0]
    if n:
        kern = get_function(SPEC, "philox_kernel")
        kern((min(math.ceil(n / 128), 1024),), (128,), (ctr, key, out, np.int32(n)))
    return out


__all__ = ["SamplingParams", "sample", "philox4x32", "inverse_temperature"]
