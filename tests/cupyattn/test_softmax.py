"""softmax: GPU tier against the float64 reference (both kernels, causal, masked rows, axes) and
argument checks on device arrays; CPU tier for host-array rejection, the kernel choice and the
offline compile check."""
import os

import numpy as np
import pytest

from cupyattn import config
from cupyattn import reference as ref
from cupyattn import row_softmax as S  # the op module (cupyattn.softmax is the function)
from conftest import expected_builds, DTYPES, TOL, assert_close, nan_like, np_dtype, rand_with_outliers, to_device


# --- GPU tier -------------------------------------------------------------------------------
# Row lengths: warp kernel (1 .. 1024, every VPT bucket edge) and block kernel (1025 .. 1M).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 32, 33, 97, 128, 1000, 1024,  # warp kernel
                               1025, 2048, 2049, 4096, 8192, 12289, 16384,  # block, row in registers
                               16385, pytest.param(1_000_000, marks=pytest.mark.no_emu)])  # block, 2 passes
def test_rows_match_reference(dtype, n):
    rows = 3 if n < 1_000_000 else 1
    rng = np.random.default_rng(n)
    x, x64 = to_device(rand_with_outliers(rng, (rows, n), scale=3.0), dtype)
    for scale in (1.0, 0.125):
        out = nan_like(x.shape, dtype)
        got = S.softmax(x, scale=scale, out=out)
        assert got is out
        assert_close(got, ref.softmax(x64, scale=scale), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (97, 1000), (128, 128), (5, 1500), (1000, 1000),
                                   (40, 17), (3, 2000), (4, 17000)])
def test_causal_bottom_right(dtype, sq, sk):
    # sq > sk leaves the top sq - sk rows with no visible key: they must be zeros, not NaN.
    rng = np.random.default_rng(sq * 31 + sk)
    x, x64 = to_device(rand_with_outliers(rng, (2, 2, sq, sk)), dtype)
    expect = ref.softmax(x64, scale=0.5, causal=True)
    got = S.softmax(x, scale=0.5, causal=True, out=nan_like(x.shape, dtype))
    assert_close(got, expect, dtype)
    if sq > sk:
        assert float(abs(got[..., : sq - sk, :].astype("float32")).max()) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [17, 3000, 20000])
def test_fully_masked_rows_are_zero(dtype, n):
    import cupy

    rng = np.random.default_rng(0)
    x64 = rand_with_outliers(rng, (3, n))
    x64[1] = -np.inf  # a row of all -inf (e.g. an additive mask hid every key)
    x64[2, ::2] = -np.inf
    x, x64 = to_device(x64, dtype)
    got = S.softmax(x, out=nan_like(x.shape, dtype))
    assert_close(got, ref.softmax(x64), dtype)
    assert float(cupy.abs(got[1].astype(cupy.float32)).max()) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [33, 1500, 20000])  # warp kernel, block kernels (registers, 2 passes)
def test_nan_and_inf_follow_the_reference(dtype, n):
    """A NaN (or +inf) among a row's visible scores makes its visible outputs NaN and leaves the
    other rows alone; a NaN at a causally hidden position changes nothing (the block kernel used
    to drop a NaN that came first in a thread's slice)."""
    from conftest import to_host

    rng = np.random.default_rng(n)
    x64 = rand_with_outliers(rng, (2, 6, n))  # [B, Sq, Sk]: causal rows see n - 5 + i keys
    x64[0, 5, 0] = np.nan                     # first element: visible to every row
    x64[0, 2, n - 1] = np.nan                 # hidden from row 2 (sees keys < n - 3)
    x64[1, 3, 7] = np.inf                     # +inf visible
    x64[1, 1, :] = -np.inf                    # nothing visible
    x64[1, 1, 4] = np.nan                     # ... but a NaN: NaN, not zeros
    x, x64 = to_device(x64, dtype)
    for causal in (False, True):
        want = ref.softmax(x64, causal=causal)
        got = to_host(S.softmax(x, causal=causal, out=nan_like(x.shape, dtype)))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        fin = ~np.isnan(want)
        np.testing.assert_allclose(got[fin], want[fin], atol=2 * TOL[dtype])
        assert np.isnan(want[0, 5]).all() and np.isnan(want[1, 1]).sum() == (n if not causal else n - 4)
        assert np.isnan(want[0, 2]).all() != causal


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_axes_layouts_and_in_place(dtype):
    rng = np.random.default_rng(2)
    x, x64 = to_device(rand_with_outliers(rng, (5, 1000, 7)), dtype)
    for axis in (0, 1, -1, -2):
        got = S.softmax(x, axis=axis, out=nan_like(x.shape, dtype))
        assert_close(got, ref.softmax(x64, axis=axis), dtype)
    # non-contiguous input (copied), leading dims batched
    xt, xt64 = x.transpose(2, 0, 1), x64.transpose(2, 0, 1)
    assert_close(S.softmax(xt), ref.softmax(xt64), dtype)
    # in place, both kernels
    for n in (100, 2000):
        y, y64 = to_device(rand_with_outliers(rng, (4, n)), dtype)
        assert S.softmax(y, out=y) is y
        assert_close(y, ref.softmax(y64), dtype)


@pytest.mark.gpu
def test_empty():
    import cupy

    for shape in [(0, 5), (3, 0), (0,)]:
        assert S.softmax(cupy.zeros(shape, cupy.float32)).shape == shape


# --- GPU tier: argument checks (device arrays; nothing is launched) --------------------------
@pytest.mark.gpu
def test_argument_checks():
    import cupy

    x = cupy.zeros((2, 3, 4), cupy.float32)
    with pytest.raises(TypeError, match=r"softmax\(\): x has dtype float64"):
        S.softmax(x.astype(cupy.float64))
    with pytest.raises(ValueError, match=r"softmax\(\): x must have at least 1 dimensions"):
        S.softmax(cupy.zeros((), cupy.float32))
    with pytest.raises(ValueError, match=r"softmax\(\): axis=3 is out of range for x of shape \(2, 3, 4\)"):
        S.softmax(x, axis=3)
    with pytest.raises(TypeError, match=r"softmax\(\): axis must be an integer, got 1.5"):
        S.softmax(x, axis=1.5)
    with pytest.raises(ValueError, match=r"softmax\(\): scale must be finite, got nan"):
        S.softmax(x, scale=float("nan"))
    with pytest.raises(TypeError, match=r"softmax\(\): scale must be a real number, got '2'"):
        S.softmax(x, scale="2")
    with pytest.raises(TypeError, match=r"softmax\(\): causal must be True or False, got 'False'"):
        S.softmax(x, causal="False")
    with pytest.raises(ValueError, match=r"softmax\(\): causal=True needs axis=-1"):
        S.softmax(x, axis=1, causal=True)
    with pytest.raises(ValueError, match=r"softmax\(\): causal=True needs x of shape \[..., Sq, Sk\]"):
        S.softmax(cupy.zeros(4, cupy.float32), causal=True)
    with pytest.raises(ValueError, match=r"softmax\(\): out has shape \(2, 3\), expected \(2, 3, 4\)"):
        S.softmax(x, out=cupy.zeros((2, 3), cupy.float32))
    with pytest.raises(TypeError, match=r"softmax\(\): out has dtype float16, expected float32"):
        S.softmax(x, out=cupy.zeros((2, 3, 4), cupy.float16))
    bf16 = np_dtype("bfloat16")
    with pytest.raises(TypeError, match=r"softmax\(\): out has dtype float32, expected bfloat16"):
        S.softmax(x.astype(bf16), out=x)


# --- CPU tier -------------------------------------------------------------------------------
def test_numpy_input_is_a_type_error():
    with pytest.raises(TypeError, match=r"softmax\(\): x must be a cupy.ndarray"):
        S.softmax(np.zeros((2, 3), np.float32))


def test_kernel_choice_covers_every_row_length():
    # every n <= 1024 has a warp bucket holding it, every n up to SOFTMAX_REG_MAX a block-reg
    # bucket; longer rows use the two-pass block kernel
    for n in range(1, config.SOFTMAX_WARP_MAX + 1):
        assert any(32 * v >= n for v in config.SOFTMAX_VPTS)
    assert config.SOFTMAX_WARP_MAX == 1024
    assert config.SOFTMAX_REG_MAX == config.SOFTMAX_BLOCK * max(config.SOFTMAX_REG_TILES) > 1024
    assert min(config.SOFTMAX_REG_TILES) * config.SOFTMAX_BLOCK >= config.SOFTMAX_WARP_MAX
    assert list(config.SOFTMAX_REG_TILES) == sorted(config.SOFTMAX_REG_TILES)  # first fit = smallest
    assert set(S.SPEC.name_expressions) >= {S._block_reg_expr(t, v) for t in config.DTYPES
                                            for v in config.SOFTMAX_REG_TILES}
    assert set(S.SPEC.name_expressions) >= {S._warp_expr(t, v) for t in config.DTYPES for v in config.SOFTMAX_VPTS}
    assert set(S.SPEC.name_expressions) >= {S._block_expr(t) for t in config.DTYPES}


@pytest.mark.skipif(os.environ.get("CUPYATTN_EMULATE") == "1",
                    reason="the offline compile check needs the real CuPy and NVRTC")
def test_compile_check_no_spills(compile_report):
    reports, errors = compile_report("row_softmax")
    assert not errors, errors
    assert sorted((r.kernel, r.arch) for r in reports) == expected_builds(S.SPEC)
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]
