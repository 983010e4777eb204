"""CPU tier: the closeness helper every kernel test uses (conftest.assert_close) fails on one
wrong row among many, judges small rows at their own scale, and passes an output that is the
exact result rounded to its dtype. The expected verdicts follow from the numbers written here,
not from the helper.
"""
import numpy as np
import pytest

from conftest import TOL, assert_close, np_dtype


def _rounded(x, dtype):
    return x.astype(np_dtype(dtype)).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_exact_result_rounded_to_its_dtype_passes(dtype):
    ref = np.random.default_rng(1).standard_normal((1000, 97)) * 3
    ref[5, 7] = 1e-6  # tiny and subnormal-ish elements beside large ones
    assert_close(_rounded(ref, dtype), ref, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_wrong_row_among_20000_fails(dtype):
    ref = np.random.default_rng(2).standard_normal((20000, 64))
    out = _rounded(ref, dtype)
    out[12345] *= 1.25  # one row 25 % too large (e.g. a wrong rescale of one tile row)
    whole = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert whole < TOL[dtype], "the error of the whole must hide this row, else the test proves nothing"
    with pytest.raises(AssertionError, match=r"in 1 of 20000 rows.*row 12345"):
        assert_close(out, ref, dtype)


def test_a_stale_row_copied_from_its_neighbour_fails():
    ref = np.random.default_rng(3).standard_normal((40000, 128))
    out = ref.copy()
    out[777] = ref[776]  # a tile row read from the wrong buffer
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL["bfloat16"]
    with pytest.raises(AssertionError, match="row 777"):
        assert_close(out, ref, "bfloat16")


def test_small_rows_are_judged_at_their_own_scale():
    # softmax-like rows: row 0 holds almost all of its mass in one column, rows 1..99 are spread
    # over 10^5 columns (each element ~1e-5); doubling one spread row must fail
    n = 100_000
    ref = np.full((100, n), 1.0 / n)
    ref[0] = 1e-9
    ref[0, 0] = 1.0 - 1e-9 * (n - 1)
    out = ref.copy()
    out[42] *= 2.0
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL["bfloat16"]
    with pytest.raises(AssertionError, match="row 42"):
        assert_close(out, ref, "bfloat16")


def test_a_row_small_by_cancellation_is_judged_at_the_tensor_scale():
    # one-column rows (a GEMM with N = 1): a value near 0 by cancellation may carry the absolute
    # error of its neighbours (1e-6 of the scale here), not a relative error of its own
    ref = np.random.default_rng(4).standard_normal((500, 1))
    ref[10, 0] = 1e-9
    out = ref.copy()
    out[10, 0] += 1e-6
    assert_close(out, ref, "float32")
    out[10, 0] += 0.1  # but not an error of 10 % of the tensor's scale (bfloat16: 1e-2 on the whole)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < TOL["bfloat16"]
    with pytest.raises(AssertionError, match="row 10"):
        assert_close(out, ref, "bfloat16")


def test_nan_anywhere_fails():
    ref = np.ones((4, 4))
    out = ref.copy()
    out[3, 3] = np.nan
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(out, ref, "float32")
