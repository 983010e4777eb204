"""The sampling semantics at the edges, on the host: tinylm's Sampler and the float64 reference.

The device sampler (cupyattn.sample) is held to the same cases in tests/test_properties.py
(``test_sample``, on a GPU or the CPU emulator); here the host Sampler meets them with no device:
over any logits (NaN, +-inf, rows with nothing to draw, ties, tiny and huge magnitudes) and any
valid temperature / top_k / top_p it returns a token of ``cupyattn.reference.sampling_probs``'s
support, raises ValueError exactly when that support is empty, is greedy exactly when 1/T
overflows float32, and draws with the reference's frequencies. The three implementations of the
temperature rule (host, device parameters, reference) are held to hand-checked values.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from test_properties import PROFILE, sample_cases, sample_logits

from conftest import np_dtype
from cupyattn import reference as ref
from cupyattn.sampling import inverse_temperature
from tinylm import Sampler

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("t,beta", [
    (0.0, math.inf), (1e-320, math.inf), (1e-50, math.inf),
    (2.9e-39, math.inf),             # 1/T = 3.45e38 > float32 max (3.40e38): overflows
    (3e-39, float(np.float32(1 / 3e-39))),  # 3.33e38 still fits
    (1.0, 1.0), (0.5, 2.0), (1e37, float(np.float32(1e-37))),
    (8e37, float(np.float32(1.25e-38))),   # float32's smallest normal is 1.1755e-38
    (8.6e37, 0.0), (1e39, 0.0), (1e300, 0.0),  # 1/T subnormal in float32: the uniform limit
])
def test_inverse_temperature_at_both_ends(t, beta):
    assert Sampler(t).beta == beta
    assert float(ref.sampling_beta(t)) == beta
    assert float(inverse_temperature(t)) == beta
    assert (beta == math.inf) == Sampler(t).greedy
    assert beta == math.inf or beta == 0.0 or 1.1754943e-38 <= beta <= F32_MAX


@pytest.mark.parametrize("row", [[np.nan] * 5, [np.nan, -np.inf, np.nan], [-np.inf] * 3, [np.nan]])
@pytest.mark.parametrize("t", [0.0, 1e-50, 0.7, 1e39])
def test_a_row_with_nothing_to_draw(row, t):
    """All NaN, NaN beside -inf, all -inf: the host raises, the reference says -1 / no mass."""
    z = np.array(row, dtype=np.float32)
    with pytest.raises(ValueError, match=r"Sampler.sample\(\): logits has no value that can be drawn"):
        Sampler(t, top_k=2, top_p=0.9)(z)
    assert ref.sample_token(z, t, 2, 0.9, seed=1) == -1
    assert not ref.sampling_probs(z, t, 2, 0.9).any()


def test_nan_and_minus_inf_are_never_drawn_beside_one_finite_logit():
    z = np.array([np.nan, -np.inf, 2.5, np.nan, -np.inf], dtype=np.float32)
    for t in (0.0, 1e-50, 1.0, 1e39):
        s = Sampler(t, seed=4)
        assert {s(z) for _ in range(50)} == {2}
        assert ref.sampling_probs(z, t).tolist() == [0, 0, 1, 0, 0]


@pytest.mark.parametrize("z,t,k,p,want", [
    # +inf logits take all the mass, shared equally (greedy: the first)
    ([1.0, np.inf, 3.0, np.inf, np.nan], 1.0, 0, 1.0, [0, 0.5, 0, 0.5, 0]),
    ([1.0, np.inf, 3.0, np.inf], 0.0, 0, 1.0, [0, 1, 0, 0]),
    # T so small that 1/T overflows float32: greedy, the first of tied maxima
    ([1.0, 3.0, 3.0, -np.inf], 1e-50, 0, 1.0, [0, 1, 0, 0]),
    # T tiny but 1/T finite: the tied maxima share the mass
    ([1.0, 3.0, 3.0, -np.inf], 1e-38, 0, 1.0, [0, 0.5, 0.5, 0]),
    # T huge: uniform over the candidates; top-k and top-p still rank by logit
    ([1.0, 3.0, -5.0, -np.inf, np.nan], 1e39, 0, 1.0, [1 / 3, 1 / 3, 1 / 3, 0, 0]),
    ([1.0, 3.0, -5.0, 2.0], 1e39, 2, 1.0, [0, 0.5, 0, 0.5]),
    ([1.0, 3.0, -5.0, 2.0], 1e39, 0, 0.5, [0, 0.5, 0, 0.5]),
    # ties at the k-th value are kept whole
    ([2.0, 1.0, 2.0, 2.0], 1.0, 1, 1.0, [1 / 3, 0, 1 / 3, 1 / 3]),
])
def test_edge_distributions(z, t, k, p, want):
    """The reference's distribution by hand, and the host Sampler's frequencies over 3000 draws
    within 4.5 standard errors of it (fixed seed: deterministic)."""
    z = np.array(z, dtype=np.float32)
    probs = ref.sampling_probs(z, t, k, p)
    np.testing.assert_allclose(probs, want, atol=1e-12)
    n, s = 3000, Sampler(t, k, p, seed=11)
    freq = np.bincount([s(z) for _ in range(n)], minlength=z.size) / n
    band = 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert (np.abs(freq - probs) <= band).all(), (freq, probs)


@PROFILE
@given(case=sample_cases())
def test_host_sampler_over_any_logits(case):
    """Every row of a device property case through the host Sampler: a token of the reference's
    support (top_p widened by 1e-9 for the float64 cut at the boundary), ValueError exactly when
    there is nothing to draw, the first argmax when greedy, and never a floating-point warning."""
    with np.errstate(over="ignore"):  # huge logits round to inf in float16 by design
        z = sample_logits(case).astype(np_dtype(case["dtype"]))
    for i, (t, k, p) in enumerate(case["settings"]):
        row = z[i]
        zr = row.astype(np.float64)
        support = ref.sampling_probs(zr, t, k, min(1.0, p + 1e-9)) > 0
        s = Sampler(t, k, p, seed=case["seed"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if not support.any():
                with pytest.raises(ValueError, match="no value that can be drawn"):
                    s(row)
                continue
            got = s(row)
        assert support[got], (i, t, k, p, zr[got])
        if s.greedy:
            assert got == int(np.argmax(np.where(np.isnan(zr), -np.inf, zr)))
