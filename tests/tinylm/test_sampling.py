"""The sampling semantics at the edges, on the host: tinylm's Sampler and the float64 reference.

The device sampler (cupyattn.sample) is held to the same cases in tests/cupyattn/test_ops_on_random_shapes.py
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
from hypothesis import given, settings
from test_ops_on_random_shapes import PROFILE, assert_frequencies, distribution_cases, sample_cases, sample_logits

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


@pytest.mark.parametrize("t", [1e39, 1e300, 8e37, 5e37])
def test_logit_differences_beyond_float32(t):
    """l - l_max overflows float32 (3e38 - -3e38): the weights are still exp((l - l_max) * beta)
    with beta = float32(1/T), worked out here in float64 from first principles; the uniform
    limit (1/T subnormal) weighs every candidate alike. The kernel's integer model (what
    cupyattn.sample draws from, held to it token for token in tests/cupyattn/test_ops_on_random_shapes.py) and the
    host Sampler's frequencies agree with it."""
    big = float(np.float32(3e38))  # the float32 value the samplers see
    z = np.array([big, -big, np.nan, 1.0, -np.inf], dtype=np.float32)
    beta = float(np.float32(1 / t)) if 1 / t >= 1.1754943508222875e-38 else 0.0
    w = np.array([1.0, math.exp(-2 * big * beta), 0.0, math.exp(-(big - 1.0) * beta), 0.0])
    want = w / w.sum()
    assert want[1] > 1e-6  # the token past float32's range of differences does weigh
    np.testing.assert_allclose(ref.sampling_probs(z, t), want, rtol=1e-12, atol=0)
    mass = ref.sampling_masses(z, t).astype(float)
    np.testing.assert_allclose(mass / mass.sum(), want, rtol=1e-5, atol=2.0 ** -40)
    s = Sampler(t, seed=8)
    assert_frequencies([s(z) for _ in range(3000)], want, t)


def _kept_distribution(z, t, k, p):
    """The kernel model's distribution (integer masses, normalised) beside the reference's at top_p
    p, and at p -+ 1e-6 (where the two put a top-p cut on either side of a near-tie)."""
    mass = ref.sampling_masses(z, t, k, p).astype(float)
    near = [ref.sampling_probs(z, t, k, min(1.0, q)) for q in (p, p - 1e-6, p + 1e-6)]
    return (mass / mass.sum() if mass.any() else mass), near


@PROFILE
@given(case=sample_cases())
def test_kernel_model_draws_from_the_reference_distribution(case):
    """``reference.sampling_masses`` (the device sampler's integer algorithm; the device equals
    it token for token in test_ops_on_random_shapes.test_sample) over any logits and settings: total
    variation distance from ``sampling_probs`` under 1e-5 (float32 exponent rounding and the
    2^-40 floor), the empty row included. Catches a token the kernel weighs 0 (or wrongly) where
    the float64 distribution does not."""
    with np.errstate(over="ignore"):  # huge logits round to inf in float16 by design
        z = sample_logits(case).astype(np_dtype(case["dtype"])).astype(np.float64)
    for i, (t, k, p) in enumerate(case["settings"]):
        got, near = _kept_distribution(z[i], t, k, float(np.float32(p)))
        tv = min(np.abs(got - q).sum() for q in near)
        assert tv < 1e-5, (i, t, k, p, got, near[0])


@settings(PROFILE, max_examples=300)
@given(case=distribution_cases())
def test_both_samplers_follow_the_reference_on_edge_rows(case):
    """Rows drawn value by value from the edges (NaN, +-inf, ties, +-3e38, 1e-30): the host
    Sampler's frequencies over 400 draws, and the kernel model's exact distribution, against
    ``sampling_probs``. (The device's own frequencies: test_ops_on_random_shapes.test_sample_distribution.)"""
    z = np.array(case["row"], dtype=np.float32)
    t, k, p = case["temperature"], case["top_k"], case["top_p"]
    probs = ref.sampling_probs(z, t, k, p)
    s = Sampler(t, k, p, seed=case["seed"] % 2**64)
    if not probs.any():
        with pytest.raises(ValueError, match="no value that can be drawn"):
            s(z)
    else:
        assert_frequencies([s(z) for _ in range(400)], probs, (t, k, p))
    got, near = _kept_distribution(z.astype(np.float64), t, k, float(np.float32(p)))
    assert min(np.abs(got - q).sum() for q in near) < 1e-5, (t, k, p, got, probs)
