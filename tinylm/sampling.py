"""Token sampling with an explicit seed: greedy, temperature, top-k, top-p (nucleus).

The Sampler works on NumPy or CuPy logits alike (``xp = get_array_module(logits)``): every
step of the selection runs where the logits are, and only the chosen token id crosses to the
host (one transfer per token). The randomness is one uniform number per token drawn from a
host ``numpy.random.Generator`` seeded by ``seed``, so a seed gives the same tokens on both
backends whenever their logits agree.
"""
from __future__ import annotations

import math
import numbers

import numpy as np


def _xp(a):
    """numpy for host arrays (NumPy's own classes), else cupy."""
    if isinstance(a, np.ndarray) and type(a).__module__.startswith("numpy"):
        return np
    import cupy

    return cupy


class Sampler:
    """Pick the next token from a row of logits.

    Parameters
    ----------
    temperature : 0 -> greedy argmax; otherwise logits are divided by it (finite, >= 0).
    top_k : keep only the k most likely tokens (0 = all).
    top_p : keep the smallest set of most likely tokens whose probability reaches p (1.0 = all).
    seed : seeds the host RNG; the same seed reproduces the same tokens.

    Example
    -------
    >>> s = Sampler(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    >>> tok = s(logits_row)          # logits_row: [vocab] numpy or cupy array -> int
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        self.temperature = _real("temperature", temperature, "finite and >= 0 (0 = greedy)",
                                 lambda v: math.isfinite(v) and v >= 0)
        self.top_p = _real("top_p", top_p, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        self.top_k = _integer("top_k", top_k, "an integer in [0, 2^31) (0 = all tokens)", 0, 2**31 - 1)
        self.seed = _integer("seed", seed, "an integer in [0, 2^64)", 0, 2**64 - 1)
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def __call__(self, logits) -> int:
        return self.sample(logits)

    def sample(self, logits) -> int:
        """logits [vocab] (any float dtype, NumPy or CuPy) -> token id (host int)."""
        xp = _xp(logits)
        logits = logits.reshape(-1).astype(xp.float32, copy=False)  # reductions on bf16 vary
        if self.greedy:
            return int(xp.argmax(logits))
        u = self.rng.random()  # one uniform per token, drawn whatever the backend
        return int(self.sample_index(xp, logits, u))

    def sample_index(self, xp, logits, u: float):
        """The token at quantile u in [0, 1) of the filtered, renormalised distribution.

        Stays on the device: returns a 0-d array (no host transfer here).
        """
        z = logits / np.float32(self.temperature)
        v = z.shape[0]
        cand = None  # candidate token ids, most likely first (None: all tokens in id order)
        if 0 < self.top_k < v:
            cand = xp.argpartition(-z, self.top_k - 1)[: self.top_k]
            cand = cand[xp.argsort(-z[cand])]
            z = z[cand]
        elif self.top_p < 1.0:
            cand = xp.argsort(-z)
            z = z[cand]
        p = xp.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            # keep token i while the mass before it is below top_p (the first is always kept)
            before = xp.cumsum(p) - p
            p = xp.where(before < np.float32(self.top_p), p, np.float32(0.0))
        cdf = xp.cumsum(p)
        idx = xp.searchsorted(cdf, cdf[-1:] * np.float32(u), side="right")[0]
        # u * total can round up to total: clamp to the last token with nonzero mass
        last = xp.max(xp.where(p > 0, xp.arange(p.size), 0))
        idx = xp.minimum(idx, last)
        return idx if cand is None else cand[idx]


def _real(name: str, value, want: str, ok) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"Sampler(): {name} must be a real number {want}, got {value!r}")
    if not ok(float(value)):
        raise ValueError(f"Sampler(): {name} must be {want}, got {value!r}")
    return float(value)


def _integer(name: str, value, want: str, lo: int, hi: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Sampler(): {name} must be {want}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"Sampler(): {name} must be {want}, got {value!r}")
    return int(value)


def allowed_tokens(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> set:
    """The set of ids a Sampler with these settings may return (float64 NumPy, for tests).

    Ties at the top-k boundary are resolved as by stable ordering of -logits.
    """
    z = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < z.size:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_p < 1.0:
        before = np.cumsum(p) - p
        order = order[before < top_p]
    return set(int(i) for i in order)
