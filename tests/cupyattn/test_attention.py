"""attention(): CPU tier (tiled reference, instantiations, compile check, host-array rejection)
and GPU tier (argument checks on device arrays, every impl against the float64 reference; also
run on the CPU emulator, tests/emu)."""
import math

import numpy as np
import pytest

from conftest import (expected_builds, DTYPES, assert_close, nan_like, np_dtype, rand_with_outliers,
                      skip_unless_device_runs, to_device, to_host)
from cupyattn import config
from cupyattn import flash_attn as FA
from cupyattn import reference as ref

IMPLS = FA.IMPLS  # ("flash", "flash_mma", "naive")
ARCHES = ("sm_80", "sm_90")
# flash_mma is fp16/bf16 only: fp32 cases pair it with float16 instead
IMPL_DTYPE_F32 = [("flash", "float32"), ("naive", "float32"), ("flash_mma", "float16")]


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def _qkv(rng, b, hq, hkv, sq, sk, d):
    return (rand_with_outliers(rng, (b, hq, sq, d)), rand_with_outliers(rng, (b, hkv, sk, d)),
            rand_with_outliers(rng, (b, hkv, sk, d)))


def _assert_lse(lse, want, tol=1e-4):
    lse = np.asarray(lse, dtype=np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(lse), fin), "lse is -inf exactly where no key is seen"
    assert np.all(lse[~fin] == -np.inf)
    if fin.any():
        np.testing.assert_allclose(lse[fin], want[fin], rtol=tol, atol=tol)


# --- CPU: the tiled algorithm the kernel follows ---------------------------------------------
@pytest.mark.parametrize("bm,bn", [(64, 64), (16, 32), (7, 5), (1, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(2, 2, 33, 33), (6, 2, 20, 45), (4, 1, 45, 20), (3, 3, 1, 9)])
def test_tiled_reference_matches_attention(rng, bm, bn, causal, hq, hkv, sq, sk):
    q, k, v = _qkv(rng, 2, hq, hkv, sq, sk, 16)
    mask = np.where(rng.random((1, hq, sq, sk)) < 0.2, -np.inf, rng.standard_normal((1, hq, sq, sk)))
    kl = np.array([sk, max(sk - 7, 0)])
    for kw in ({}, {"mask": mask}, {"key_lengths": kl}, {"mask": mask, "key_lengths": [0, sk]}):
        want, wl = ref.attention(q, k, v, causal=causal, return_lse=True, **kw)
        got, gl = ref.flash_attention_tiled(q, k, v, causal=causal, block_m=bm, block_n=bn,
                                            return_lse=True, **kw)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        _assert_lse(gl, wl, 1e-10)
        if "key_lengths" in kw and kw["key_lengths"][0] == 0:
            assert np.all(got[0] == 0.0)  # a sequence with no keys gives zeros, not NaN


# --- CPU: instantiations and the compile check -------------------------------------------------
def _config_exprs():
    """Name expressions of every (impl, dtype, head dim, causal) that config says is built."""
    return ([FA._expr("flash", dt, d, c) for dt in config.DTYPES for d in config.HEAD_DIMS
             for c in (False, True)]
            + [FA._expr("flash_mma", dt, d, c) for dt in config.MMA_DTYPES for d in config.HEAD_DIMS
               for c in (False, True)]
            # the serving instantiations (varlen, paged, window, softcap), causal=False
            + [FA._expr("flash", dt, d, False, True) for dt in config.DTYPES for d in config.HEAD_DIMS]
            + [FA._expr("flash_mma", dt, d, False, True) for dt in config.MMA_DTYPES for d in config.HEAD_DIMS]
            # the 32-key flash_mma tiles of 64 KB devices: fp16 only (bf16 mma needs sm_80, whose
            # families all have 99 KB or more), each causal, not, and serving
            + [FA._expr("flash_mma", config.FLOAT16, d, c, sv, t) for d, t in config.FLASH_MMA_SMALL_SMEM_TILES.items()
               for c, sv in ((False, False), (True, False), (False, True))]
            # the tiles a family runs in place of the main one (sm_100 at D = 64), every variant
            + [FA._expr("flash_mma", dt, d, c, sv, t) for dt in config.MMA_DTYPES
               for tiles in config.FLASH_MMA_FAMILY_TILES.values() for d, t in tiles.items()
               for c, sv in ((False, False), (True, False), (False, True))])


def _assert_one_report_per_build(reports, exprs):
    assert sorted((r.kernel, r.arch) for r in reports) == expected_builds(FA.SPEC, exprs)


def test_spec_builds_every_config_instantiation_within_static_smem(compile_report):
    # every tile the kernels can be asked for exists and has a shape the kernels take
    assert set(config.FLASH_SIMT_TILES) == {(d, dt.itemsize) for d in config.HEAD_DIMS for dt in config.DTYPES}
    assert set(config.FLASH_MMA_TILES) == set(config.HEAD_DIMS)
    for t in config.FLASH_SIMT_TILES.values():
        assert t.block_m % t.warps == 0 and t.block_n % 32 == 0, t
    family = [(d, t) for tiles in config.FLASH_MMA_FAMILY_TILES.values() for d, t in tiles.items()]
    for d, t in list(config.FLASH_MMA_TILES.items()) + family:
        # warps own whole m16 tiles; each K/V row gets the same number of staging threads
        assert t.block_m // t.warps in (16, 32) and t.block_m % t.warps == 0, t
        assert (32 * t.warps) % t.block_m == 0 and (32 * t.warps) % t.block_n == 0, t
        assert t.block_n % 16 == 0 and d % 16 == 0, t
        assert config.flash_mma_smem_bytes(d, t) <= 163 * 1024, t  # an A100's opt-in limit per block
    want = _config_exprs()
    assert len(set(want)) == len(want) == 3 * len(config.HEAD_DIMS) * (len(config.DTYPES) + len(config.MMA_DTYPES)) \
        + 3 * len(config.FLASH_MMA_SMALL_SMEM_TILES) + 3 * len(config.MMA_DTYPES) * len(family)
    for d, t in config.FLASH_MMA_SMALL_SMEM_TILES.items():   # each fits a T4's 64 KB, the main tile does not
        assert config.flash_mma_smem_bytes(d, t) <= 64 * 1024 < config.flash_mma_smem_bytes(d), d
        assert t.block_m // t.warps == 16 and (32 * t.warps) % t.block_n == 0 and t.block_n % 16 == 0
    assert sorted(FA.SPEC.name_expressions) == sorted(want)
    reports, errors = compile_report("flash_attn")
    assert not errors, errors
    _assert_one_report_per_build(reports, want)
    over = [(r.kernel, r.arch, r.smem_bytes) for r in reports if r.smem_bytes > config.STATIC_SMEM_BYTES]
    assert not over, f"static shared memory over {config.STATIC_SMEM_BYTES} B: {over}"


def test_compile_check_flash_attn_no_errors_no_spills(compile_report):
    reports, errors = compile_report("flash_attn")
    assert not errors, errors
    _assert_one_report_per_build(reports, FA.SPEC.name_expressions)  # per gate arch
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]
    assert all(r.smem_bytes <= config.STATIC_SMEM_BYTES for r in reports)


def test_default_impl_is_tensor_cores_for_16_bit_dtypes():
    assert FA.DEFAULT_IMPL == {config.FLOAT32: "flash", config.FLOAT16: "flash_mma",
                               config.BFLOAT16: "flash_mma"}


@pytest.mark.parametrize("scale,p2", [(0.125, 0.125), (1 / math.sqrt(128), 0.0625), (1.0, 1.0),
                                      (3.0, 2.0), (-0.3, 0.25), (0.0, 1.0), (1e-30, 2.0 ** -100)])
def test_naive_scale_split_is_a_power_of_two(scale, p2):
    assert FA._pow2_part(scale) == p2
    assert scale == 0 or 1 <= abs(scale) / p2 < 2


def test_benchmark_defaults_hold_the_goal_shapes_with_their_peers():
    from benchmarks import cases, specs

    shapes = {(c.dtype, c.p["B"], c.p["H"], c.p["Hkv"], c.p["Sq"], c.p["Sk"], c.p["D"], c.p["causal"])
              for c in specs.default_cases("attention")}
    for d in (128, 64):
        for causal in (False, True):
            assert ("float16", 4, 32, 32, 4096, 4096, d, causal) in shapes
    assert {"flash", "flash_mma", "naive", "cupy-naive", "torch-sdpa"} <= set(cases.impl_names("attention"))


# --- CPU: host arrays are rejected --------------------------------------------------------------
def test_rejects_host_arrays():
    q = np.zeros((1, 2, 4, 64), dtype=np.float16)
    with pytest.raises(TypeError, match=r"attention\(\): q must be a cupy.ndarray"):
        FA.attention(q, q, q)


# --- GPU: argument checks (device arrays; nothing is launched) -------------------------------------
class _Dev:
    """A device array made when the test runs, not at collection (where there may be no device):
    zeros of ``shape`` and ``dtype``, then ``view`` (a strided or transposed view) applied."""

    def __init__(self, shape, dtype=np.float16, view=None):
        self.shape, self.dtype, self.view = shape, dtype, view

    def make(self):
        import cupy

        x = cupy.zeros(self.shape, dtype=self.dtype)
        return x if self.view is None else self.view(x)


@pytest.mark.gpu
@pytest.mark.parametrize("change,exc,pattern", [
    (dict(impl="fast"), ValueError, r"impl='fast'"),
    (dict(q=_Dev((1, 2, 4, 64), np.float32), k=_Dev((1, 2, 5, 64), np.float32), v=_Dev((1, 2, 5, 64), np.float32),
          impl="flash_mma"), TypeError, r"impl='flash_mma' needs float16 or bfloat16"),
    (dict(q=_Dev((1, 2, 4, 300)), k=_Dev((1, 2, 5, 300)), v=_Dev((1, 2, 5, 300)), impl="flash_mma"), ValueError,
     r"D=300 is not supported by impl='flash_mma': the fused kernels take D up to 256 "
     r"\(a D not in 32, 64, 80, 96, 128, 256 zero-padded to the next\) \(impl='naive' takes any D\)"),
    (dict(q=_Dev((2, 4, 64))), ValueError, r"q must have 4 dimensions"),
    (dict(k=_Dev((1, 2, 5, 64), np.float32)), TypeError, r"k has dtype float32 but q has float16"),
    (dict(q=_Dev((1, 2, 4, 64), np.int32)), TypeError, r"q has dtype int32"),
    (dict(k=_Dev((2, 2, 5, 64))), ValueError, r"k has shape \(2, 2, 5, 64\)"),
    (dict(k=_Dev((1, 2, 5, 32))), ValueError, r"k has shape"),
    (dict(v=_Dev((1, 2, 6, 64))), ValueError, r"v has shape \(1, 2, 6, 64\) but k"),
    (dict(k=_Dev((1, 3, 5, 64)), v=_Dev((1, 3, 5, 64))), ValueError, r"Hq=2 .* Hkv=3"),
    (dict(q=_Dev((1, 2, 4, 257)), k=_Dev((1, 2, 5, 257)), v=_Dev((1, 2, 5, 257)), impl="flash"), ValueError,
     r"head_dim D=257 is not supported by impl='flash': the fused kernels take D up to 256 .* "
     r"\(impl='naive' takes any D\)"),
    (dict(q=_Dev((1, 2, 4, 257)), k=_Dev((1, 2, 5, 257)), v=_Dev((1, 2, 5, 257)), window=(2, 2)), ValueError,
     r"head_dim D=257 is not supported by the fused kernels: .* \(impl='naive' takes any D but has no window\)"),
    (dict(q=_Dev((1, 2, 4, 300)), k=_Dev((1, 2, 5, 300)), v=_Dev((1, 2, 5, 300)), softcap=30.0), ValueError,
     r"D=300 .* has no softcap"),
    (dict(q=_Dev((1, 2, 4, 40), np.float32), k=_Dev((1, 2, 5, 40), np.float32), v=_Dev((1, 2, 5, 40), np.float32),
          impl="flash_mma"), TypeError, r"impl='flash_mma' needs float16 or bfloat16 inputs, got float32"),
    (dict(q=_Dev((1, 2, 4, 128), view=lambda x: x[..., ::2])), ValueError, r"q must be contiguous in its last"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(scale="x"), TypeError, r"scale must be a real number"),
    (dict(mask=_Dev((4, 6), np.float32)), ValueError, r"mask of shape \(4, 6\) does not broadcast"),
    (dict(mask=_Dev((1, 1, 1, 4, 5), np.float32)), ValueError, r"mask must have at most 4"),
    (dict(mask=_Dev((4, 5), np.int32)), TypeError, r"mask has dtype int32"),
    (dict(key_lengths=[5, 5]), ValueError, r"key_lengths must have shape \[B\] = \(1,\)"),
    (dict(key_lengths=[6]), ValueError, r"key_lengths values must lie in \[0, Sk=5\]"),
    (dict(key_lengths=[-1]), ValueError, r"key_lengths values must lie in"),
    (dict(key_lengths=[2.5]), TypeError, r"key_lengths must have an integer dtype"),
    (dict(out=_Dev((1, 2, 4, 32))), ValueError, r"out has shape"),
    (dict(out=_Dev((1, 2, 4, 64), np.float32)), TypeError, r"out has dtype float32"),
    (dict(out=_Dev((1, 4, 2, 64), view=lambda x: x.transpose(0, 2, 1, 3))), ValueError, r"out must be C-contiguous"),
])
def test_argument_checks(change, exc, pattern):
    kw = dict(q=_Dev((1, 2, 4, 64)), k=_Dev((1, 2, 5, 64)), v=_Dev((1, 2, 5, 64)))
    kw.update(change)
    kw = {name: x.make() if isinstance(x, _Dev) else x for name, x in kw.items()}
    with pytest.raises(exc, match=pattern) as e:
        FA.attention(**kw)
    assert str(e.value).startswith("attention(): ")


@pytest.mark.gpu
def test_naive_accepts_any_head_dim_in_checks():
    import cupy

    q = cupy.zeros((1, 2, 4, 48), dtype=cupy.float16)
    impl, scale, mshape, kl, sv, ops = FA._check_args(q, q, q, False, None, None, None, "naive", False, None)
    assert impl == "naive" and all(x is q for x in ops)   # the split pipeline reads D = 48 as it is
    assert scale == pytest.approx(1 / math.sqrt(48)) and mshape is None and kl is None and sv is None


# --- GPU: both impls against the float64 reference -------------------------------------------
def _misaligned(x, how: str):
    """The values of x [B, H, S, D] as a view cp.async cannot take: "offset", base 6 bytes past an
    aligned address (``big[..., 3:3 + D]``); "stride", rows D + 4 elements apart (not 16 B)."""
    import cupy

    lo, extra = (3, 8) if how == "offset" else (0, 4)
    big = cupy.zeros(x.shape[:3] + (x.shape[3] + extra,), dtype=x.dtype)
    big[..., lo:lo + x.shape[3]] = x
    return big[..., lo:lo + x.shape[3]]


def _run(rng, dtype, b, hq, hkv, sq, sk, d, impl, causal=False, mask=None, key_lengths=None,
         return_lse=False, scale=None, layout="bhsd", misaligned=None):
    """Inputs with outliers on the device, NaN-poisoned out; checks out (and lse) vs reference.
    ``misaligned``: {"q" | "k" | "v": "offset" | "stride", "out": "offset"} views to pass instead."""
    import cupy

    skip_unless_device_runs("attention", impl, dtype, d)
    qh, kh, vh = _qkv(rng, b, hq, hkv, sq, sk, d)
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in (qh, kh, vh))
    if layout == "bshd":  # views of [B, S, H, D] buffers (what a fused QKV projection gives)
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    misaligned = misaligned or {}
    q, k, v = (_misaligned(x, misaligned[n]) if n in misaligned else x for n, x in zip("qkv", (q, k, v)))
    out = nan_like((b, hq, sq, d), dtype)
    if "out" in misaligned:  # C-contiguous, one element past an aligned address
        out = nan_like((out.size + 1,), dtype)[1:].reshape(out.shape)
    mask_h = None if mask is None else to_host(mask)
    res = FA.attention(q, k, v, causal=causal, scale=scale, mask=mask, key_lengths=key_lengths,
                      impl=impl, return_lse=return_lse, out=out)
    want = ref.attention(qr, kr, vr, causal=causal, scale=scale, mask=mask_h,
                         key_lengths=None if key_lengths is None else to_host(cupy.asarray(key_lengths)),
                         return_lse=True)
    got = res[0] if return_lse else res
    assert got is out
    assert_close(got, want[0], dtype)
    assert np.all(to_host(got)[~np.isfinite(want[1])] == 0.0)
    if return_lse:
        assert res[1].dtype == np.float32 and res[1].shape == (b, hq, sq)
        _assert_lse(to_host(res[1]), want[1], {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[dtype])
    return got


# --- a D the fused kernels lack: q, k, v zero-padded to the next of HEAD_DIMS (as FlashAttention-2) ---
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [1, 40, 59, 111, 200, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_default_at_a_head_dim_no_fused_kernel_has(rng, dtype, d, causal):
    """impl=None at a D outside config.HEAD_DIMS runs a fused kernel on q, k, v zero-padded to the
    next head dim up to 256, the split pipeline (any D) past it, rather than refusing: odd sizes,
    GQA, Sq != Sk, lse, out poisoned."""
    got = FA.default_impl(np_dtype(dtype), d)
    assert (got == "naive") == (d > 256), got
    _run(rng, dtype, 2, 4, 2, 17, 33, d, None, causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [1, 40, 111])
@pytest.mark.parametrize("impl,dtype", [("flash", "float32"), ("flash", "bfloat16"), ("flash_mma", "float16"),
                                        ("flash_mma", "bfloat16"), (None, "float16")])
def test_gpu_a_padded_head_dim_takes_every_option(rng, impl, dtype, d, causal):
    """At a padded D the fused kernels keep every option: window, softcap, mask, key_lengths,
    scale, lse, the caller's out (poisoned: exactly its D columns are written) and GQA; q, k, v are
    read, never written (the kernel runs on copies)."""
    skip_unless_device_runs("attention", impl or "flash", dtype, config.padded_head_dim(d))
    padded_every_option(rng, impl, dtype, d, causal)


def padded_every_option(rng, impl, dtype, d, causal, serving=True, kv_view=None):
    """attention() at head dim ``d`` with mask, key_lengths, scale, lse and a poisoned out, and with
    ``serving`` a window and softcap too, against the reference; q, k, v unchanged afterwards.
    ``kv_view``: k and v passed as this view of themselves (a layout only the copies make
    readable)."""
    import cupy

    b, hq, hkv, sq, sk = 2, 4, 2, 17, 45
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    if kv_view is not None:
        (k, kr), (v, vr) = ((kv_view(x), kv_view(cupy.asarray(xr)).get()) for x, xr in ((k, kr), (v, vr)))
    before = [to_host(x).copy() for x in (q, k, v)]
    mask_h = rand_with_outliers(rng, (1, hq, sq, sk), 0.5).astype(np.float32)
    mask_h[0, 1, 3, :] = -np.inf   # a row that sees no key
    kl, scale = [45, 20], 0.3
    window, cap = ((9, 0 if causal else 3), 5.0) if serving else (None, None)
    out = nan_like((b, hq, sq, d), dtype)
    got, lse = FA.attention(q, k, v, causal=causal, scale=scale, mask=cupy.asarray(mask_h), key_lengths=kl,
                            impl=impl, return_lse=True, out=out, window=window, softcap=cap)
    want, wl = ref.attention(qr, kr, vr, causal=causal, scale=scale, mask=mask_h, key_lengths=np.array(kl),
                             return_lse=True, window=window, softcap=cap)
    assert got is out
    assert_close(got, want, dtype)
    _assert_lse(to_host(lse), wl, {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}[dtype])
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(to_host(x), x0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", config.HEAD_DIMS)
@pytest.mark.parametrize("impl,dtype", [("flash", dt) for dt in DTYPES]
                         + [("flash_mma", "float16"), ("flash_mma", "bfloat16")])
def test_gpu_flash_every_head_dim_and_dtype(rng, impl, dtype, d, causal):
    _run(rng, dtype, 2, 4, 2, 97, 97, d, impl, causal=causal)


def _mma_size(d: int) -> int:
    """Sq = Sk for head dim d's flash_mma tile: 1.5 query tiles plus an odd tail, so a grid of
    several query tiles (causal: heaviest first), key tiles with and without masking, and partial
    last tiles of queries and keys."""
    bm = config.FLASH_MMA_TILES[d].block_m
    return bm + bm // 2 + 7


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", config.HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_flash_mma_every_tile_entry(rng, dtype, d, causal):
    s = _mma_size(d)
    _run(rng, dtype, 1, 2, 1, s, s, d, "flash_mma", causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(150, 333), (333, 150)])
def test_gpu_flash_mma_causal_multi_tile_sq_ne_sk(rng, sq, sk):
    _run(rng, "bfloat16", 1, 2, 1, sq, sk, 64, "flash_mma", causal=True, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,misaligned", [
    ("flash_mma", {"q": "offset"}), ("flash_mma", {"k": "stride"}), ("flash_mma", {"v": "offset"}),
    ("flash_mma", {"v": "stride"}), ("flash_mma", {"out": "offset"}),
    *[(i, {"q": "stride", "k": "offset", "v": "stride", "out": "offset"}) for i in IMPLS]])
def test_gpu_unaligned_views(rng, impl, misaligned):
    """Views whose base or row stride is not 16-byte aligned take the element-wise staging path
    (a cp.async from them would fault; the emulator refuses it too)."""
    _run(rng, "float16", 1, 4, 2, 77, 150, 64, impl, causal=True, misaligned=misaligned)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_hidden_keys_never_contribute_whatever_they_hold(rng, impl, dtype):
    """K/V rows past key_lengths hold NaN / inf (an unwritten cache): no impl weighs them (P = 0)
    or multiplies them in (0 * NaN), so out matches the clean reference."""
    import cupy

    b, hq, hkv, sq, sk, d = 3, 4, 2, 70, 150, 64
    kl = np.array([sk, 61, 0])
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    want, wl = ref.attention(qr, kr, vr, key_lengths=kl, return_lse=True)
    for bb in range(b):
        k[bb, :, kl[bb]:] = np.nan
        v[bb, :, kl[bb]:] = np.inf if bb == 1 else np.nan
    out, lse = FA.attention(q, k, v, key_lengths=cupy.asarray(kl), impl=impl, return_lse=True,
                            out=nan_like((b, hq, sq, d), dtype))
    assert_close(out, want, dtype)
    _assert_lse(to_host(lse), wl, 2e-2)
    assert np.all(to_host(out)[2] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32)
def test_gpu_nan_semantics_follow_the_reference(rng, impl, dtype):
    """A NaN score behind a -inf mask entry is hidden; a NaN query poisons only its own row
    (out and lse NaN), even when every other key of that row is masked out."""
    import cupy

    b, hq, hkv, sq, sk, d = 2, 2, 1, 20, 37, 64
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    mask = np.zeros((b, hq, sq, sk), np.float32)
    mask[0, :, :, 5] = -np.inf        # key 5 of batch 0 is hidden from everyone ...
    kr[0, :, 5] = np.nan              # ... so its NaN key must not matter
    k[0, :, 5] = np.nan
    qr[1, 1, 3, 7] = np.nan           # a NaN query: row (1, 1, 3) is NaN, nothing else
    q[1, 1, 3, 7] = np.nan
    mask[1, 1, 3, 1:] = -np.inf       # that row sees only key 0 (m would be finite without NaN)
    want, wl = ref.attention(qr, kr, vr, causal=True, mask=mask, return_lse=True)
    out, lse = FA.attention(q, k, v, causal=True, mask=cupy.asarray(mask), impl=impl, return_lse=True,
                            out=nan_like((b, hq, sq, d), dtype))
    got, gl = to_host(out), to_host(lse)
    assert np.isnan(want[1, 1, 3]).all() and np.isnan(wl[1, 1, 3])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(gl), np.isnan(wl))
    fin = ~np.isnan(want[..., 0])
    assert_close(got[fin], want[fin], dtype)
    _assert_lse(gl[fin], wl[fin], 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_gpu_negative_and_zero_scale(rng, impl, scale):
    """A negative scale reverses which key is the row max: flash_mma masks (scales S explicitly)
    on every tile then, as its unmasked path takes the max of unscaled S."""
    _run(rng, "float16", 1, 2, 2, 150, 150, 64, impl, causal=True, scale=scale, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_mask_with_strided_key_dim(rng, impl):
    import cupy

    m = np.where(rng.random((4, 97, 240)) < 0.2, -np.inf, rng.standard_normal((4, 97, 240)))
    mask = cupy.asarray(m.astype(np.float32))[..., ::2]  # key stride 2 elements
    _run(rng, "float16", 2, 4, 2, 97, 120, 64, impl, mask=mask, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_fp16_scores_beyond_fp16_range(rng, impl, return_lse):
    """Each query equals one key of +-60 entries: q.k = 64 * 3600 = 230400 > 65504 (fp16's max),
    the scaled logit 28800 is fine. An unscaled fp16 S (the old naive path) gives inf -> NaN."""
    b, h, sq, sk, d = 1, 2, 17, 33, 64
    kh = 60.0 * np.sign(rng.standard_normal((b, h, sk, d)) + 1e-9)
    qh = kh[:, :, rng.integers(0, sk, size=sq)]
    (q, qr), (k, kr), (v, vr) = (to_device(x, "float16") for x in (qh, kh, rand_with_outliers(rng, kh.shape)))
    want, wl = ref.attention(qr, kr, vr, return_lse=True)
    res = FA.attention(q, k, v, impl=impl, return_lse=return_lse, out=nan_like((b, h, sq, d), "float16"))
    assert_close(res[0] if return_lse else res, want, "float16")
    if return_lse:
        _assert_lse(to_host(res[1]), wl, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_naive_dtypes(rng, dtype, d, causal):
    _run(rng, dtype, 2, 4, 2, 97, 97, d, "naive", causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 17, 97, pytest.param(1000, marks=pytest.mark.emu_slow),
                               pytest.param(4096, marks=pytest.mark.no_emu)])
def test_gpu_sizes(rng, s, causal, impl):
    _run(rng, "float16", 1, 2, 2, s, s, 64, impl, causal=causal)


@pytest.mark.gpu
@pytest.mark.emu_slow
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32[:2] + [(i, "bfloat16") for i in IMPLS])
def test_gpu_size_1000_other_dtypes(rng, impl, dtype):
    _run(rng, dtype, 1, 2, 1, 1000, 1000, 128, impl, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
def test_gpu_gqa(rng, ratio, impl):
    _run(rng, "bfloat16", 2, 2 * ratio, 2, 97, 97, 64, impl, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 100), (100, 17), (1, 1000), (1000, 1), (64, 97)])
def test_gpu_sq_ne_sk(rng, sq, sk, causal, impl, dtype):
    _run(rng, dtype, 1, 4, 2, sq, sk, 64, impl, causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mask_shape,mask_dtype", [((97, 120), "float32"), ((2, 1, 97, 120), "float16"),
                                                   ((1, 4, 1, 120), "float32"), ((4, 97, 1), "bfloat16")])
def test_gpu_mask(rng, mask_shape, mask_dtype, impl):
    import cupy

    m = rng.standard_normal(mask_shape) * 2
    m = np.where(rng.random(mask_shape) < 0.25, -np.inf, m)
    m.reshape(-1, mask_shape[-1])[0] = -np.inf  # some row (or head / batch) sees nothing
    mask = cupy.asarray(m.astype(np_dtype(mask_dtype)))
    _run(rng, "float16", 2, 4, 2, 97, 120, 64, impl, causal=True, mask=mask, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS + (None, "wgmma_persistent"))
@pytest.mark.parametrize("mask_shape", [(97, 120), (2, 1, 97, 120), (4, 1, 120)])
def test_gpu_bool_mask_as_torch_sdpa(rng, mask_shape, impl):
    """A bool mask is torch SDPA's: True lets the key take part, False hides it (the reference gets
    the additive 0 / -inf twin); a row, head or batch entry with no True gives zeros, lse -inf.
    impl=None at fp16 D = 64 is wgmma on sm_90."""
    import cupy

    skip_unless_device_runs("attention", impl or "flash", "float16", 64)
    keep = rng.random(mask_shape) < 0.7
    keep.reshape(-1, mask_shape[-1])[0] = False
    b, hq, hkv, sq, sk, d = 2, 4, 2, 97, 120, 64
    (q, qr), (k, kr), (v, vr) = (to_device(x, "float16") for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    out = nan_like((b, hq, sq, d), "float16")
    got, lse = FA.attention(q, k, v, causal=True, mask=cupy.asarray(keep), impl=impl, return_lse=True, out=out)
    want, wl = ref.attention(qr, kr, vr, causal=True, mask=np.where(keep, 0.0, -np.inf), return_lse=True)
    assert got is out
    assert_close(got, want, "float16")
    _assert_lse(to_host(lse), wl, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("on_device", [False, True])
def test_gpu_key_lengths_with_zero_length(rng, on_device, impl):
    import cupy

    kl = np.array([0, 1, 50, 1000], dtype=np.int32)
    got = _run(rng, "bfloat16", 4, 2, 1, 17, 1000, 64, impl,
               key_lengths=cupy.asarray(kl) if on_device else kl.tolist(), return_lse=True)
    assert np.all(to_host(got)[0] == 0.0)  # a sequence with no keys gives zeros


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype", IMPL_DTYPE_F32)
def test_gpu_mask_key_lengths_causal_together(rng, impl, dtype):
    import cupy

    mask = cupy.asarray(np.where(rng.random((1, 1, 40, 70)) < 0.3, -np.inf, 0.5).astype(np.float32))
    _run(rng, dtype, 3, 6, 2, 40, 70, 96, impl, causal=True, mask=mask,
         key_lengths=[70, 33, 0], return_lse=True, scale=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_strided_bshd_inputs(rng, impl):
    _run(rng, "float16", 2, 8, 2, 97, 97, 128, impl, causal=True, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_empty_and_default_out(impl):
    import cupy

    q = cupy.zeros((0, 2, 5, 64), dtype=cupy.float16)
    o, lse = FA.attention(q, q, q, impl=impl, return_lse=True)
    assert o.shape == (0, 2, 5, 64) and lse.shape == (0, 2, 5)
    q = cupy.ones((1, 2, 5, 64), dtype=cupy.float16)
    k = cupy.ones((1, 2, 0, 64), dtype=cupy.float16)
    o, lse = FA.attention(q, k, k, impl=impl, return_lse=True)  # no keys at all: zeros, -inf
    assert float(cupy.abs(o).max()) == 0.0 and bool(cupy.all(lse == -cupy.inf))


@pytest.mark.gpu
@pytest.mark.no_emu  # S = 32768: far too large for the CPU emulator
@pytest.mark.parametrize("impl", ["flash", "flash_mma"])
def test_gpu_flash_memory_is_linear_in_sequence_length(impl):
    """Causal S=32768, B*H=8, D=64 fp16: naive S would be 8*32768^2*2 B = 16 GiB in fp16
    (32 GiB in fp32); flash allocates only out (32 MiB)."""
    import cupy

    b, h, s, d = 1, 8, 32768, 64
    rng = np.random.default_rng(7)
    q, k, v = (cupy.asarray(rng.standard_normal((b, h, s, d)).astype(np.float16)) for _ in range(3))
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    out = FA.attention(q, k, v, causal=True, impl=impl)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    assert grown <= out.nbytes + (1 << 20), f"flash grew the pool by {grown} bytes"
    assert grown < (1 << 30)  # far below the 16-32 GiB of a materialised S
    # spot-check rows against float64 NumPy (row i sees keys 0..i)
    qh, kh, vh, oh = (cupy.asnumpy(x[0]).astype(np.float64) for x in (q, k, v, out))
    for hh, i in [(0, 0), (3, 12345), (7, s - 1)]:
        sc = kh[hh, :i + 1] @ qh[hh, i] / math.sqrt(d)
        p = np.exp(sc - sc.max())
        want = (p / p.sum()) @ vh[hh, :i + 1]
        assert np.linalg.norm(oh[hh, i] - want) <= 2e-3 * np.linalg.norm(want)
