"""layers (rmsnorm, rope, swiglu, add, embedding): CPU tier (host-array rejection, reference
sanity, the rope angle scheme, compile check) and GPU tier (argument checks on device arrays,
every op against the float64 reference; also run on the CPU emulator, tests/emu)."""
import math

import numpy as np
import pytest

from conftest import expected_builds, DTYPES, TOL, assert_close, nan_like, rand_with_outliers, to_device, to_host
from cupyattn import config
from cupyattn import layers as L
from cupyattn import reference as ref


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def _positions(rng, b, t, maxpos=32767):
    pos = rng.integers(0, maxpos + 1, size=(b, t))
    pos.reshape(-1)[0] = maxpos  # the largest position is always present
    return pos


# --- CPU: references ---------------------------------------------------------------------------
@pytest.mark.parametrize("d", [2, 8, 64])
def test_reference_rope_adjacent_is_permuted_neox(rng, d):
    """adjacent rope of x == re-interleave(neox rope of de-interleave(x)): one rotation, two layouts."""
    x = rng.standard_normal((2, 3, 5, d))
    pos = _positions(rng, 2, 5)
    deint = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # x[2i] -> i, x[2i+1] -> i + D/2
    inv = np.argsort(deint)
    got = ref.rope(x[..., deint], pos, base=1e5, style="neox")[..., inv]
    np.testing.assert_allclose(ref.rope(x, pos, base=1e5, style="adjacent"), got, rtol=1e-12, atol=1e-12)
    # a rotation keeps each pair's length; position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(ref.rope(x, pos), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(ref.rope(x, np.zeros((2, 5), np.int64), style="neox"), x)


def test_reference_rope_over_part_of_the_head_is_hf_partial_rotary(rng):
    """The reference's rotary_dim is HF's partial rotary (Phi-4-mini, GPT-NeoX): the first R dims
    turn by base**(-2i/R) with NeoX pairs (i, i + R/2), the rest pass; written out here."""
    d, r = 16, 10
    x = rng.standard_normal((1, 2, 5, d))
    pos = _positions(rng, 1, 5)
    ang = pos[:, None, :, None] * 1e4 ** (-np.arange(0, r, 2) / r)
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., : r // 2], x[..., r // 2:r]
    want = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s, x[..., r:]], axis=-1)
    np.testing.assert_allclose(ref.rope(x, pos, 1e4, "neox", rotary_dim=r), want, rtol=1e-12, atol=1e-12)


def test_rope_angle_scheme_is_accurate_at_large_positions():
    """NumPy model of rope_kernel's angle: double pos*inv_freq, reduced mod 2pi in double, then
    a/pi rounded to float. A float32 angle (powf inv_freq, float product) would miss fp32 tolerance."""
    d, base = 64, 1e5
    pos = np.arange(32000, 32768, dtype=np.float64)[:, None]
    i = np.arange(d // 2)
    want = pos * base ** (-2.0 * i / d)
    inv = np.exp2(i * (-math.log2(base) / (d // 2)))  # the kernel's exp2(i * freq_scale)
    a = pos * inv
    k = np.rint(a * (0.5 / math.pi))
    a = a - k * 2 * math.pi
    got = np.float64(np.float32(a / math.pi)) * math.pi
    f32 = np.float32(pos) * np.power(np.float32(base), np.float32(-2.0 * i / d))

    def rot_err(ang):
        return np.sqrt((np.abs(np.exp(1j * ang) - np.exp(1j * want)) ** 2).mean())

    assert rot_err(got) < 1e-6
    assert rot_err(f32.astype(np.float64)) > TOL["float32"]


# --- CPU: host arrays are rejected -------------------------------------------------------------
def test_rejects_host_arrays():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match=r"rmsnorm\(\): x must be a cupy.ndarray"):
        L.rmsnorm(x, np.ones(8, np.float32))
    with pytest.raises(TypeError, match=r"rope\(\): x must be a cupy.ndarray"):
        L.rope(np.zeros((1, 1, 2, 8), np.float32), np.zeros((1, 2), np.int32))
    with pytest.raises(TypeError, match=r"swiglu\(\): gate must be a cupy.ndarray"):
        L.swiglu(x, x)
    with pytest.raises(TypeError, match=r"add\(\): x must be a cupy.ndarray"):
        L.add(x, x)
    with pytest.raises(TypeError, match=r"embedding\(\): ids must be a cupy.ndarray"):
        L.embedding(np.zeros(3, np.int32), x)


# --- GPU: argument checks (device arrays; nothing is launched) ---------------------------------
F32, F16, BF16 = np.float32, np.float16, config.BFLOAT16


def _z(shape, dtype=np.float64):
    """cupy.zeros, called when a case runs (the cases are built at collection, with no device)."""
    import cupy

    return cupy.zeros(shape, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(8, BF16)), TypeError, "weight has dtype bfloat16; expected float16"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F16)), TypeError, "weight has dtype float16"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(7, F16)), ValueError, r"weight has shape \(7,\)"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z((1, 8), F16)), ValueError, "weight must have 1 dim"),
    (lambda: L.rmsnorm(_z((2, 8), np.float64), _z(8)), TypeError, "x has dtype float64"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F32), eps=-1.0), ValueError, "eps must be finite and >= 0"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F32), out=_z((2, 9), F32)), ValueError, r"out has shape \(2, 9\)"),
    (lambda: L.rmsnorm(_z((2, 8), F16), _z(8, F32), out=_z((2, 8), F32)), TypeError, "out has dtype float32"),
    (lambda: L.rmsnorm(_z((2, 8), F32), _z(8, F32), impl="fast"), ValueError, "impl='fast' is not supported"),
    (lambda: L.rope(_z((1, 2, 3, 7), F32), _z((1, 3), np.int32)), ValueError, r"D=7\) must be even"),
    (lambda: L.rope(_z((2, 3, 8), F32), _z((2, 3), np.int32)), ValueError, "x must have 4 dim"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((3, 2), np.int32)), ValueError, r"positions has shape \(3, 2\), expected \(2, 3\)"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z(3, np.int32)), ValueError, "positions must have 2 dim"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), F32)), TypeError, "positions has dtype float32"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), style="gptj"), ValueError, "style='gptj' is not supported"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), base=0.0), ValueError, "base must be finite and > 0"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), out=_z((2, 1, 3, 8), F16)), TypeError, "out has dtype float16"),
    (lambda: L.rope(_z((2, 1, 3, 8), F32), _z((2, 3), np.int32), out=_z((2, 3, 1, 8), F32)), ValueError, "out has shape"),
    (lambda: L.swiglu(_z(8, F16), _z(8, BF16)), TypeError, "up has dtype bfloat16 but gate has float16"),
    (lambda: L.swiglu(_z(8, F16), _z(9, F16)), ValueError, r"up has shape \(9,\) but gate has \(8,\)"),
    (lambda: L.swiglu(_z(8, F16), _z(8, F16), out=_z(8, F32)), TypeError, "out has dtype float32"),
    (lambda: L.add(_z((2, 8), F32), _z((8,), F32)), ValueError, r"y has shape \(8,\) but x has \(2, 8\)"),
    (lambda: L.add(_z((2, 8), F32), _z((2, 8), F32), out=_z((4, 8), F32)[::2]), ValueError, "out must be C-contiguous"),
    (lambda: L.embedding(_z(3, F32), _z((5, 8), F32)), TypeError, "ids has dtype float32, expected one of int32, int64"),
    (lambda: L.embedding(_z(3, np.int32), _z(8, F32)), ValueError, "table must have 2 dim"),
    (lambda: L.embedding(_z(3, np.int32), _z((5, 8), F32)[:, ::2]), ValueError, "table must be contiguous in its last"),
    (lambda: L.embedding(_z((2, 3), np.int64), _z((5, 8), F16), out=_z((6, 8), F16)), ValueError, r"expected \(2, 3, 8\)"),
])
def test_argument_checks(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.gpu
def test_rope_in_place_needs_contiguous_last_dim():
    import cupy

    x = _z((1, 2, 3, 16), F32)[..., ::2]
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        L.rope(x, _z((1, 3), np.int32), out=x)
    b = cupy.broadcast_to(_z((1, 1, 3, 8), F32), (1, 2, 3, 8))
    with pytest.raises(ValueError, match="broadcast"):
        L.rope(b, _z((1, 3), np.int32), out=b)


# --- CPU: compile check ------------------------------------------------------------------------
def test_compile_check_layers_no_errors_no_spills(compile_report):
    reports, errors = compile_report("layers")
    assert not errors, errors
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]
    assert sorted((r.kernel, r.arch) for r in reports) == expected_builds(L.SPEC)


# --- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 17, 97, 576, 1000, 4096, pytest.param(16384, marks=pytest.mark.no_emu)])
@pytest.mark.parametrize("impl", ["auto", "warp", "block"])
@pytest.mark.parametrize("rows", [1, 97])
def test_gpu_rmsnorm(rng, dtype, d, impl, rows):
    x, xr = to_device(rand_with_outliers(rng, (rows, d)), dtype)
    for wdt in {dtype, "float32"}:
        w, wr = to_device(rng.standard_normal(d), wdt)
        out = nan_like((rows, d), dtype)
        assert L.rmsnorm(x, w, 1e-5, out=out, impl=impl) is out
        assert_close(out, ref.rmsnorm(xr, wr), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rmsnorm_in_place_misaligned_and_nd(rng, dtype):
    import cupy

    x, xr = to_device(rand_with_outliers(rng, (2, 17, 576)), dtype)
    w, wr = to_device(rng.standard_normal(576), dtype)
    assert L.rmsnorm(x, w, eps=1e-6, out=x) is x
    assert_close(x, ref.rmsnorm(xr, wr, eps=1e-6), dtype)
    buf, bufr = to_device(rand_with_outliers(rng, 1 + 3 * 64), dtype)  # rows start 1 element off
    x, xr = buf[1:].reshape(3, 64), bufr[1:].reshape(3, 64)
    assert_close(L.rmsnorm(x, w[:64].copy()), ref.rmsnorm(xr, wr[:64]), dtype)
    xt, xtr = to_device(rand_with_outliers(rng, (64, 5)), dtype)  # non-contiguous: copied first
    assert_close(L.rmsnorm(xt.T, w[:64].copy()), ref.rmsnorm(xtr.T, wr[:64]), dtype)
    assert L.rmsnorm(cupy.empty((0, 64), x.dtype), w[:64].copy()).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("t", [1, 17, 97])
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope(rng, dtype, d, t, style):
    import cupy

    x, xr = to_device(rand_with_outliers(rng, (2, 3, t, d)), dtype)
    pos = _positions(rng, 2, t)
    out = nan_like(x.shape, dtype)
    assert L.rope(x, cupy.asarray(pos, dtype=cupy.int32), style=style, out=out) is out
    assert_close(out, ref.rope(xr, pos, style=style), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope_large_positions_fp32(rng, style):
    """Positions 32000..32767, base 1e4 and 1e5: fp32 tolerance holds (angle formed in double)."""
    import cupy

    x, xr = to_device(rng.standard_normal((1, 4, 768, 128)), "float32")
    pos = np.arange(32000, 32768)[None]
    for base in (1e4, 1e5):
        got = L.rope(x, cupy.asarray(pos), base=base, style=style)  # int64 positions accepted
        assert_close(got, ref.rope(xr, pos, base=base, style=style), "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_gpu_rope_in_place_on_fused_qkv_views(rng, dtype, style):
    import cupy

    b, t, h, d = 2, 17, 3, 64
    qkv, qkvr = to_device(rand_with_outliers(rng, (b, t, 3, h, d)), dtype)
    untouched = qkv[:, :, 2].copy()
    pos = _positions(rng, b, t)
    for j in (0, 1):  # q and k: [B, H, T, D] views with strides (T*3*H*D, D, 3*H*D, 1)
        view = qkv[:, :, j].transpose(0, 2, 1, 3)
        assert L.rope(view, cupy.asarray(pos, dtype=cupy.int32), base=1e5, style=style, out=view) is view
        assert_close(view, ref.rope(qkvr[:, :, j].transpose(0, 2, 1, 3), pos, base=1e5, style=style), dtype)
    assert cupy.array_equal(qkv[:, :, 2], untouched)
    # a view 1 element off: adjacent pairs fall back to scalar loads
    buf, bufr = to_device(rand_with_outliers(rng, 1 + 2 * 3 * 5 * 32), dtype)
    x, xr = buf[1:].reshape(2, 3, 5, 32), bufr[1:].reshape(2, 3, 5, 32)
    pos = _positions(rng, 2, 5)
    assert_close(L.rope(x, cupy.asarray(pos), style=style), ref.rope(xr, pos, style=style), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
@pytest.mark.parametrize("d,r", [(64, 48), (128, 96), (96, 2), (32, 32)])
def test_gpu_rope_part_of_the_head_with_divisors(rng, dtype, style, d, r):
    """RoPE over the first rotary_dim dims (pairs (i, i + R/2) for NeoX) with per-pair frequency
    divisors, one of them float32's largest (that pair does not turn), at positions up to 40,000:
    out of place (the dims past R copied bit for bit) and in place on a strided view (left as
    they were), against the float64 reference."""
    import cupy

    t = 17
    x, xr = to_device(rand_with_outliers(rng, (2, 3, t, d)), dtype)
    pos = rng.integers(0, 40000, (2, t))
    div = (0.5 + 40.0 * rng.random(r // 2) ** 2).astype(np.float32)
    div[-1] = np.finfo(np.float32).max
    want = ref.rope(xr, pos, 1e4, style, freq_div=div.astype(np.float64), rotary_dim=r)
    dpos, ddiv = cupy.asarray(pos), cupy.asarray(div)
    out = nan_like(x.shape, dtype)
    assert L.rope(x, dpos, 1e4, style, out=out, freq_div=ddiv, rotary_dim=r) is out
    assert_close(out, want, dtype)
    assert cupy.array_equal(out[..., r:], x[..., r:])
    buf = cupy.zeros((2, t, 2, 3, d), dtype=x.dtype)  # q of a fused [B, T, 2, H, D] buffer, as [B, H, T, D]
    view = buf[:, :, 0].transpose(0, 2, 1, 3)
    view[...] = x
    assert L.rope(view, dpos, 1e4, style, out=view, freq_div=ddiv, rotary_dim=r) is view
    assert_close(view, want, dtype)
    assert cupy.array_equal(view[..., r:], x[..., r:]) and not buf[:, :, 1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 97, 128, 1000, 4096])
def test_gpu_swiglu_and_add(rng, dtype, n):
    # gate outliers at +-8: silu(-30) ~ -3e-12 is not representable in fp16/bf16 output
    g, gr = to_device(rand_with_outliers(rng, (3, n), 3.0, outlier_value=8.0), dtype)
    u, ur = to_device(rand_with_outliers(rng, (3, n)), dtype)
    out = nan_like((3, n), dtype)
    assert L.swiglu(g, u, out=out) is out
    assert_close(out, ref.swiglu(gr, ur), dtype)
    out = nan_like((3, n), dtype)
    assert L.add(g, u, out=out) is out
    assert_close(out, gr + ur, dtype)
    assert L.swiglu(g, u, out=u) is u  # in place on up
    assert_close(u, ref.swiglu(gr, ur), dtype)
    assert L.add(g, g[::-1].copy(), out=g) is g  # residual add in place
    assert_close(g, gr + gr[::-1], dtype)
    odd, oddr = to_device(rand_with_outliers(rng, 1 + n), dtype)  # misaligned: scalar path
    assert_close(L.add(odd[1:], odd[:-1]), oddr[1:] + oddr[:-1], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
@pytest.mark.parametrize("d", [1, 17, 64, 576])
def test_gpu_embedding(rng, dtype, ids_dtype, d):
    import cupy

    vocab = 97
    table, tr = to_device(rand_with_outliers(rng, (vocab, d + 3)), dtype)
    ids = rng.integers(0, vocab, size=(2, 17))
    ids[0, 0], ids[1, -1] = 0, vocab - 1
    for tab, tabr in ((table[:, :d].copy(), tr[:, :d]), (table[:, :d], tr[:, :d])):  # dense, strided rows
        out = nan_like((2, 17, d), dtype)
        assert L.embedding(cupy.asarray(ids, dtype=ids_dtype), tab, out=out) is out
        assert np.array_equal(to_host(out), ref.embedding(ids, tabr))
    bad = cupy.asarray([5, -1, vocab, vocab - 1], dtype=ids_dtype)
    got = to_host(L.embedding(bad, table[:, :d]))
    assert (got[[1, 2]] == 0).all() and np.array_equal(got[[0, 3]], tr[[5, vocab - 1], :d])
