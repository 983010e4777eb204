"""Token sampling with an explicit seed: greedy, temperature, top-k, top-p (nucleus).

The Sampler works on NumPy or CuPy logits alike (``xp = get_array_module(logits)``): every
step of the selection runs where the logits are, and only the chosen token id crosses to the
host (one transfer per token). The randomness is one uniform number per token drawn from a
host ``numpy.random.Generator`` seeded by ``seed``, so a seed gives the same tokens on both
backends whenever their logits agree.

The distribution is the device sampler's (``cupyattn.sample``; ``cupyattn.reference.
sampling_probs`` is the float64 model both are tested against), edges included:

- NaN and -inf logits are never drawn; a row with nothing else raises ValueError (the device
  sampler, which cannot raise, returns -1 there).
- +inf logits, if any, take all the mass (shared equally; greedy takes the first).
- temperature T acts as beta = float32(1/T): T = 0, or T so small that 1/T overflows float32
  (below about 2.9e-39), is greedy (first argmax); T so large that 1/T falls below float32's
  normal range (above about 8.5e37) makes every candidate equally likely. Tied maxima share
  the mass for any other T.
- top-k keeps every logit tied with the k-th largest; top-p keeps the smallest most-likely set
  whose probability reaches p, ties at the cut kept whole.
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


FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32


class NothingToDraw(ValueError):
    """Raised by :meth:`Sampler.sample` for a row whose logits are all NaN or -inf (a ValueError;
    the device sampler returns -1 there instead)."""


def inverse_temperature(temperature: float) -> float:
    """beta = 1/T as float32 would hold it: inf (greedy) for 0 or an overflowing 1/T, 0 (uniform)
    for a 1/T below float32's normal range."""
    if temperature == 0.0:
        return math.inf
    with np.errstate(over="ignore"):
        beta = float(np.float32(1.0 / temperature))
    return 0.0 if beta < FLOAT32_TINY else beta


class Sampler:
    """Pick the next token from a row of logits.

    Parameters
    ----------
    temperature : 0 -> greedy argmax; otherwise logits are divided by it (finite, >= 0; the
        limits at both ends are in the module docstring).
    top_k : keep only the k most likely tokens (0 = all; ties with the k-th are kept).
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
        self.beta = inverse_temperature(self.temperature)
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.beta == math.inf

    def __call__(self, logits) -> int:
        return self.sample(logits)

    def sample(self, logits) -> int:
        """logits [vocab] (any float dtype, NumPy or CuPy) -> token id (host int).

        Raises NothingToDraw (a ValueError) when no logit can be drawn (all NaN or -inf)."""
        xp = _xp(logits)
        z = logits.reshape(-1).astype(xp.float32, copy=False)  # reductions on bf16 vary
        z = xp.where(xp.isnan(z), xp.float32(-xp.inf), z)  # NaN is never drawn, like -inf
        best = int(xp.argmax(z))
        if not float(z[best]) > -math.inf:
            raise NothingToDraw("Sampler.sample(): logits has no value that can be drawn (every logit is NaN "
                             "or -inf)")
        if self.greedy:
            return best
        u = self.rng.random()  # one uniform per token, drawn whatever the backend
        return int(self.sample_index(xp, z, u))

    def weights(self, xp, z):
        """Unnormalised float64 probabilities of ``z`` (float32 logits, NaN already -inf):
        exp((z - max) * beta); 0 for -inf; only the +inf entries weigh when there are any."""
        top = z.max()
        if float(top) == math.inf:
            return (z == top).astype(xp.float64)
        d = z.astype(xp.float64) - float(top)
        live = d > -xp.inf
        return xp.where(live, xp.exp(xp.where(live, d, 0.0) * self.beta), 0.0)

    def sample_index(self, xp, z, u: float):
        """The token at quantile u in [0, 1) of the filtered, renormalised distribution of
        float32 logits ``z`` (NaN already mapped to -inf, at least one entry above -inf).

        Stays on the device: returns a 0-d array (no host transfer here).
        """
        w = self.weights(xp, z)
        if 0 < self.top_k < z.size:  # keep logits >= the k-th largest (ties with it kept)
            kth = -xp.partition(-z, self.top_k - 1)[self.top_k - 1]
            w = xp.where(z >= kth, w, 0.0)
        if self.top_p < 1.0:  # the smallest most-likely set reaching top_p, ties at the cut kept
            order = xp.argsort(-z)  # the order within a tie does not move the cut's value
            cum = xp.cumsum(w[order])
            cut = xp.minimum(xp.searchsorted(cum, cum[-1] * self.top_p, side="left"), z.size - 1)
            w = xp.where(z >= z[order[cut]], w, 0.0)
        cdf = xp.cumsum(w)
        idx = xp.searchsorted(cdf, cdf[-1] * u, side="right")
        # u * total can round up to total: clamp to the last token with nonzero mass
        last = xp.max(xp.where(w > 0, xp.arange(w.size), 0))
        return xp.minimum(idx, last)


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
