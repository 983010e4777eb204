"""Property tests (hypothesis): every op on random small shapes against its float64 reference.

Each test draws a case (sizes, GQA ratio, masks, lengths, splits, strides, dtype, impl, ...) from
a named strategy, builds inputs with outliers from the case's seed, poisons the outputs with NaN,
runs the op and holds it to ``cupyattn.reference`` with the tolerances of ``conftest.TOL``
(relative Frobenius, never a NaN where the reference has none). Head dims, dtypes and impls are
drawn from the sets the deterministic tests already build, so on the CPU emulator the runs add
few kernel builds; hypothesis varies everything that is a run-time argument.

Profile: ``PROFILE`` below, derandomised (the same examples on every run, no example database),
no deadline (the emulator is slow). Every test is ``gpu``: it runs on the CPU emulator in the CPU
tier (tests/test_emulated_gpu_tier.py) and on a GPU elsewhere. The ``emu_slow`` variants at the
end draw every head dim and larger sizes.

Non-finite values follow the reference module's semantics: K/V rows hidden by ``key_lengths``
(attention, fused impls) and cache rows at or past a sequence's length (decode) hold NaN or inf
here, and must never change the output.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DTYPES, EMULATE, TOL, assert_close, nan_like, np_dtype, rand_with_outliers, to_device, to_host
from cupyattn import config
from cupyattn import reference as ref

PROFILE = settings(max_examples=200, derandomize=True, deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MMA_DTYPES = tuple(d for d in DTYPES if np_dtype(d) in config.MMA_DTYPES)
CI_HEAD_DIMS = (32, 64)    # what the CI variants draw for the fused kernels (test_attention builds them)
LSE_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}

seeds = st.integers(0, 2**32 - 1)
scales = st.one_of(st.none(), st.floats(-1.0, 1.0, width=32))


# --- helpers ------------------------------------------------------------------------------
def _relayout(x, how: str):
    """The values of device array ``x`` in another memory layout of the same shape: "contig" (x
    itself); "offset" (C-contiguous, base one element past an aligned address: no 16-byte vector
    loads); "padded" / "ragged" (each last-dim row inside a row 8 / 3 elements wider: strided
    rows, 16-byte aligned or not)."""
    import cupy

    if how == "contig":
        return x
    if how == "offset":
        buf = cupy.empty(x.size + 1, dtype=x.dtype)
        buf[1:] = x.reshape(-1)
        return buf[1:].reshape(x.shape)
    n = x.shape[-1]
    buf = cupy.empty(x.shape[:-1] + (n + (8 if how == "padded" else 3),), dtype=x.dtype)
    buf[..., :n] = x
    return buf[..., :n]


def _out(shape, dtype, offset=False):
    """A NaN-poisoned C-contiguous output, optionally one element past an aligned address."""
    if not offset:
        return nan_like(shape, dtype)
    return nan_like((int(np.prod(shape)) + 1,), dtype)[1:].reshape(shape)


def _assert_matches(out, want, dtype):
    """``conftest.assert_close`` (relative Frobenius within TOL, no stray NaN), with NaN exactly
    where the reference has NaN (non-finite inputs, e.g. -inf * 0 or 0 / 0, as it defines them)."""
    got = to_host(out)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN exactly where the reference has NaN"
    assert_close(np.where(nan, 0.0, got), np.where(nan, 0.0, want), dtype)


def _rand(rng, shape, dtype, **kw):
    """(device array, the float64 values it holds) of normals with outliers."""
    return to_device(rand_with_outliers(rng, shape, **kw), dtype)


# --- attention ----------------------------------------------------------------------------
@st.composite
def attention_cases(draw, head_dims=CI_HEAD_DIMS, max_s=70):
    impl = draw(st.sampled_from(("flash", "flash_mma", "naive")))
    dtype = draw(st.sampled_from(MMA_DTYPES if impl == "flash_mma" else DTYPES))
    if impl == "naive":  # any D; no head-dim instantiation
        d = draw(st.one_of(st.sampled_from(head_dims), st.integers(1, 72)))
    else:
        d = draw(st.sampled_from(head_dims))
    # tensor-core tiles cost the emulator most (a 128-row tile per (batch, head)): fewer of them
    cap = 4 if impl == "flash_mma" or (impl == "naive" and dtype != "float32") else 12
    group = draw(st.integers(1, min(cap, 8)))  # GQA ratio Hq / Hkv
    hkv = draw(st.integers(1, max(1, min(2, cap // group))))
    b = draw(st.integers(1, max(1, min(3, cap // (group * hkv)))))
    sq, sk = draw(st.integers(1, max_s)), draw(st.integers(0, max_s))
    mask = None
    if draw(st.booleans()):
        ndim = draw(st.integers(0, 4))
        full = (b, hkv * group, sq, sk)[4 - ndim:]
        mask = dict(shape=tuple(n if draw(st.booleans()) else 1 for n in full),
                    dtype=draw(st.sampled_from(DTYPES)),
                    hidden=draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),  # share of -inf entries
                    key_stride2=draw(st.booleans()))
    where = draw(st.sampled_from([None, "host", "device"]))
    key_lengths = None
    if where is not None:  # device values are not checked: the kernels clamp them to [0, Sk]
        lo, hi = (0, sk) if where == "host" else (-2, sk + 2)
        key_lengths = draw(st.lists(st.integers(lo, hi), min_size=b, max_size=b))
    return dict(impl=impl, dtype=dtype, b=b, hq=hkv * group, hkv=hkv, sq=sq, sk=sk, d=d,
                causal=draw(st.booleans()), scale=draw(scales), mask=mask, kl_where=where,
                key_lengths=key_lengths, return_lse=draw(st.booleans()),
                layout=draw(st.sampled_from(["contig", "bshd", "offset", "padded", "ragged"])),
                out_offset=draw(st.booleans()), garbage=draw(st.sampled_from([np.nan, np.inf, -np.inf])),
                seed=draw(seeds))


def _attention_mask(rng, m):
    """(device float mask, float64 values) for a drawn mask spec; its key dim may be strided."""
    import cupy

    shape = m["shape"]
    vals = np.where(rng.random(shape) < m["hidden"], -np.inf, rng.standard_normal(shape) * 2)
    dev, host = to_device(vals, m["dtype"])
    if m["key_stride2"] and shape and shape[-1] > 1:
        wide = cupy.zeros(shape[:-1] + (2 * shape[-1],), dtype=dev.dtype)
        wide[..., ::2] = dev
        dev = wide[..., ::2]
    return dev, host


def _naive_tol(c, qr, kr):
    """impl="naive" writes the logits S = q k^T in the input dtype (flash_attn._naive): each scaled
    logit carries a rounding error up to |scale * S| * u (u = 2^-11 fp16, 2^-8 bf16), which moves
    the probabilities by up to twice that, relatively (found on the H100, 2026-11-26: fp16, D=64,
    scale 1, logits near 30). None (the dtype's tolerance) for the fused impls and float32."""
    if c["impl"] != "naive" or c["dtype"] == "float32" or c["sk"] == 0:
        return None
    g = c["hq"] // c["hkv"]
    s = np.einsum("bhgqd,bhkd->bhgqk", qr.reshape(c["b"], c["hkv"], g, c["sq"], c["d"]), kr)
    u = 2.0 ** -11 if c["dtype"] == "float16" else 2.0 ** -8
    scale = c["d"] ** -0.5 if c["scale"] is None else abs(c["scale"])
    return TOL[c["dtype"]] + 2 * u * float(np.abs(s).max()) * scale


def _check_attention(c):
    import cupy

    from cupyattn import flash_attn as FA

    rng = np.random.default_rng(c["seed"])
    b, hq, hkv, sq, sk, d, dtype = (c[n] for n in ("b", "hq", "hkv", "sq", "sk", "d", "dtype"))
    q, qr = _rand(rng, (b, hq, sq, d), dtype)
    k, kr = _rand(rng, (b, hkv, sk, d), dtype)
    v, vr = _rand(rng, (b, hkv, sk, d), dtype)
    kl = None if c["key_lengths"] is None else np.clip(c["key_lengths"], 0, sk)
    if kl is not None and c["impl"] != "naive":
        # keys past key_lengths hold garbage (an unwritten cache): the fused kernels never weigh
        # them nor multiply them in; the reference below sees the clean values
        for i, n in enumerate(kl):
            k[i, :, n:] = c["garbage"]
            v[i, :, n:] = c["garbage"]
    if c["layout"] == "bshd":  # views of [B, S, H, D] buffers, as a fused QKV projection gives
        q, k, v = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
    else:
        q, k, v = (_relayout(x, c["layout"]) for x in (q, k, v))
    mask, mask_r = _attention_mask(rng, c["mask"]) if c["mask"] else (None, None)
    kl_arg = None
    if c["kl_where"] == "host":
        kl_arg = list(c["key_lengths"])
    elif c["kl_where"] == "device":
        kl_arg = cupy.asarray(np.array(c["key_lengths"], dtype=np.int32))
    out = _out((b, hq, sq, d), dtype, c["out_offset"])
    res = FA.attention(q, k, v, causal=c["causal"], scale=c["scale"], mask=mask, key_lengths=kl_arg,
                       impl=c["impl"], return_lse=c["return_lse"], out=out)
    if sk == 0:  # no key for anyone: zeros, lse -inf (the reference cannot reduce over 0 keys)
        want, want_lse = np.zeros((b, hq, sq, d)), np.full((b, hq, sq), -np.inf)
    else:
        want, want_lse = ref.attention(qr, kr, vr, causal=c["causal"], scale=c["scale"], mask=mask_r,
                                       key_lengths=kl, return_lse=True)
    got = res[0] if c["return_lse"] else res
    assert got is out
    assert_close(got, want, dtype, _naive_tol(c, qr, kr))
    assert np.all(to_host(got)[~np.isfinite(want_lse)] == 0.0), "a row that sees no key is zeros"
    if c["return_lse"]:
        lse = to_host(res[1])
        seen = np.isfinite(want_lse)
        assert np.array_equal(np.isfinite(lse), seen) and np.all(lse[~seen] == -np.inf)
        np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


@pytest.mark.gpu
@settings(PROFILE, max_examples=300)  # three impls share this op's examples
@given(case=attention_cases())
def test_attention(case):
    _check_attention(case)


# --- KV cache append + decode ---------------------------------------------------------------
@st.composite
def decode_cases(draw, head_dims=CI_HEAD_DIMS, max_seq=80):
    dtype = draw(st.sampled_from(DTYPES))
    impl = draw(st.sampled_from(("auto", "simt", "mma") if dtype in MMA_DTYPES else ("auto", "simt")))
    b = draw(st.integers(1, 3))
    seq = draw(st.integers(1, max_seq))
    # groups 1-9; 12, 17, 33, 40: several SIMT head tiles, two mma m-tiles, several mma blocks
    group = draw(st.one_of(st.integers(1, 9), st.sampled_from([12, 17, 33, 40])))
    return dict(impl=impl, dtype=dtype, b=b, hkv=draw(st.integers(1, 2)), group=group,
                d=draw(st.sampled_from(head_dims)), max_seq=seq,
                lengths=draw(st.lists(st.integers(0, seq), min_size=b, max_size=b)),
                appends=draw(st.integers(1, 3)), strided_new=draw(st.booleans()),
                splits=draw(st.sampled_from([3, 1, 2, 4, 5, 7, 9, 17, 33, None])),
                scale=draw(scales), strided_q=draw(st.booleans()),
                garbage=draw(st.sampled_from([np.nan, np.inf])), seed=draw(seeds))


def _fill_cache(rng, c):
    """A 2-layer cache whose layer 1 reaches ``c["lengths"]`` through ``c["appends"]`` ragged
    appends (checked exactly after each); returns (cache, k, v) float64 [B, Hkv, max_seq, D]
    with the cached values (zeros past each length)."""
    import cupy

    from cupyattn.kvcache import KVCache

    b, hkv, d, seq, dtype = c["b"], c["hkv"], c["d"], c["max_seq"], c["dtype"]
    lengths = np.array(c["lengths"])
    cache = KVCache(2, b, hkv, seq, d, np_dtype(dtype))
    k_all, kf = _rand(rng, (b, hkv, seq, d), dtype)
    v_all, vf = to_device(rng.standard_normal((b, hkv, seq, d)), dtype)
    # random chunk boundaries per sequence: appends of different counts (ragged prefill)
    cuts = np.sort(np.stack([rng.integers(0, n + 1, c["appends"] - 1) for n in lengths]), axis=1)
    bounds = np.concatenate([np.zeros((b, 1), int), cuts, lengths[:, None]], axis=1)
    for a in range(c["appends"]):
        lo, cnt = bounds[:, a], bounds[:, a + 1] - bounds[:, a]
        t = max(int(cnt.max()), 1)
        kn = cupy.zeros((b, t, hkv, d) if c["strided_new"] else (b, hkv, t, d), dtype=k_all.dtype)
        vn = cupy.zeros_like(kn)
        for i in range(b):
            src = (slice(None), slice(lo[i], lo[i] + cnt[i]))
            if c["strided_new"]:
                kn[i, :cnt[i]] = k_all[i][src].transpose(1, 0, 2)
                vn[i, :cnt[i]] = v_all[i][src].transpose(1, 0, 2)
            else:
                kn[i, :, :cnt[i]] = k_all[i][src]
                vn[i, :, :cnt[i]] = v_all[i][src]
        if c["strided_new"]:  # [B, Hkv, T, D] views of [B, T, Hkv, D] buffers
            kn, vn = kn.transpose(0, 2, 1, 3), vn.transpose(0, 2, 1, 3)
        uniform = bool(np.all(cnt == t))
        cache.append(1, kn, vn, num_new=None if uniform else cnt.tolist())
    live = np.arange(seq)[None, None, :, None] < lengths[:, None, None, None]
    kf, vf = np.where(live, kf, 0.0), np.where(live, vf, 0.0)
    assert np.array_equal(to_host(cache.k[1]) * live, kf) and np.array_equal(to_host(cache.v[1]) * live, vf)
    assert to_host(cache.lengths).tolist() == [[0] * b, lengths.tolist()]
    assert cache.host_lengths.tolist() == [[0] * b, lengths.tolist()]
    assert not to_host(cache.k[0]).any() and not to_host(cache.v[0]).any()
    for i, n in enumerate(lengths):  # rows at or past a length are never read: garbage there
        cache.k[1, i, :, n:] = c["garbage"]
        cache.v[1, i, :, n:] = c["garbage"]
    return cache, kf, vf


def _check_decode(c):
    import cupy

    from cupyattn.decode import decode_attention

    rng = np.random.default_rng(c["seed"])
    cache, kf, vf = _fill_cache(rng, c)
    b, hq, d, dtype = c["b"], c["hkv"] * c["group"], c["d"], c["dtype"]
    q, qr = _rand(rng, (b, hq, 1, d), dtype)
    if c["strided_q"]:  # [B, Hq, 1, D] view of a [B, 1, Hq, D] buffer
        q = cupy.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    out = nan_like((b, hq, 1, d), dtype)
    assert decode_attention(q, cache, 1, scale=c["scale"], num_splits=c["splits"], out=out, impl=c["impl"]) is out
    want = ref.decode_attention(qr, kf, vf, c["lengths"], scale=c["scale"])
    assert_close(out, want, dtype)
    got = to_host(out)
    for i, n in enumerate(c["lengths"]):
        if n == 0:
            assert np.all(got[i] == 0.0), "an empty sequence gives zeros"


@pytest.mark.gpu
@PROFILE
@given(case=decode_cases())
def test_kvcache_append_and_decode(case):
    _check_decode(case)


# --- fused RoPE + KV-cache append ------------------------------------------------------------
@st.composite
def append_qkv_cases(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    start = draw(st.lists(st.integers(0, 20), min_size=b, max_size=b))
    ragged = draw(st.booleans())
    return dict(dtype=draw(st.sampled_from(DTYPES)), style=draw(st.sampled_from(["adjacent", "neox"])),
                base=draw(st.one_of(st.sampled_from([1e4, 1e5]), st.floats(1.5, 1e6))),
                b=b, t=t, hkv=draw(st.integers(1, 2)), group=draw(st.integers(1, 3)),
                d=draw(st.integers(1, 36).map(lambda n: 2 * n)),  # any even D: D is a run-time argument
                start=start, extra=draw(st.integers(0, 5)),
                num_new=draw(st.lists(st.integers(0, t), min_size=b, max_size=b)) if ragged else None,
                layout=draw(st.sampled_from(["contig", "padded", "ragged", "offset"])),
                q_out=draw(st.booleans()), seed=draw(seeds))


def _check_append_qkv(c):
    import cupy

    from cupyattn.kvcache import KVCache

    rng = np.random.default_rng(c["seed"])
    b, t, hkv, d, dtype = c["b"], c["t"], c["hkv"], c["d"], c["dtype"]
    hq = hkv * c["group"]
    cache = KVCache(2, b, hkv, max(c["start"]) + t + c["extra"], d, np_dtype(dtype))
    if max(c["start"]):
        pre, _ = _rand(rng, (b, hkv, max(c["start"]), d), dtype)
        cache.append(1, pre, pre, num_new=c["start"])
    k0, v0 = to_host(cache.k[1]), to_host(cache.v[1])
    qkv, qkvr = _rand(rng, (b, t, (hq + 2 * hkv) * d), dtype)
    qkv = _relayout(qkv, c["layout"])  # batch and token strides are free
    q_out = nan_like((b, hq, t, d), dtype) if c["q_out"] else None
    got = cache.append_qkv(1, qkv, hq, rope_base=c["base"], rope_style=c["style"], num_new=c["num_new"],
                           q_out=q_out)
    assert q_out is None or got is q_out
    q, kc, vc, lens = ref.qkv_rope_append(qkvr, k0, v0, c["start"], hq, c["base"], c["style"], c["num_new"])
    assert_close(got, q, dtype)
    assert_close(cache.k[1], kc, dtype)
    assert_close(cache.v[1], vc, dtype)
    assert cupy.asnumpy(cache.lengths[1]).tolist() == lens.tolist() == cache.host_lengths[1].tolist()
    assert not cache.host_lengths[0].any() and not to_host(cache.lengths[0]).any()


@pytest.mark.gpu
@PROFILE
@given(case=append_qkv_cases())
def test_append_qkv(case):
    _check_append_qkv(case)


# --- GEMM -----------------------------------------------------------------------------------
@st.composite
def gemm_cases(draw, nt: bool):
    impl = draw(st.sampled_from(("auto", "simt", "mma", "skinny") if nt else ("auto", "simt", "mma")))
    dtype = draw(st.sampled_from(MMA_DTYPES if impl == "mma" else DTYPES))
    # a batch shape, and per operand the trailing part of it it has, some dims broadcast (1)
    batch = [draw(st.integers(1, 3)) for _ in range(draw(st.sampled_from([2, 1, 0])))]
    if impl == "mma" or (impl == "auto" and dtype != "float32"):
        batch = [min(n, 2) for n in batch]  # tensor-core tiles cost the emulator most

    def operand_batch():
        lead = batch[draw(st.integers(0, len(batch))):]
        return [1 if draw(st.booleans()) else n for n in lead]

    return dict(nt=nt, impl=impl, dtype=dtype, m=draw(st.integers(1, 33 if impl == "skinny" else 70)),
                n=draw(st.integers(1, 70)), k=draw(st.integers(0, 70)),
                a_batch=operand_batch(), b_batch=operand_batch(),
                a_layout=draw(st.sampled_from(["contig", "offset", "padded", "ragged", "batch_step"])),
                b_layout=draw(st.sampled_from(["contig", "offset", "padded", "ragged", "batch_step"])),
                out_offset=draw(st.booleans()), seed=draw(seeds))


def _gemm_operand(rng, shape, dtype, layout):
    """Device operand of ``shape`` in a drawn layout ("batch_step": every other entry of a twice
    as long leading dim), and its float64 values."""
    x, xr = _rand(rng, shape, dtype)
    if layout == "batch_step" and len(shape) > 2:
        import cupy

        wide = cupy.zeros((2 * shape[0],) + tuple(shape[1:]), dtype=x.dtype)
        wide[::2] = x
        return wide[::2], xr
    return _relayout(x, "contig" if layout == "batch_step" else layout), xr


def _check_gemm(c):
    from cupyattn import gemm as G

    rng = np.random.default_rng(c["seed"])
    m, n, k, dtype = c["m"], c["n"], c["k"], c["dtype"]
    a, ar = _gemm_operand(rng, tuple(c["a_batch"]) + (m, k), dtype, c["a_layout"])
    b_shape = tuple(c["b_batch"]) + ((n, k) if c["nt"] else (k, n))
    b, br = _gemm_operand(rng, b_shape, dtype, c["b_layout"])
    fn, ref_fn = (G.gemm_nt, ref.gemm_nt) if c["nt"] else (G.gemm_nn, ref.gemm_nn)
    want = ref_fn(ar, br)
    out = _out(want.shape, dtype, c["out_offset"])
    assert fn(a, b, out=out, impl=c["impl"]) is out
    assert_close(out, want, dtype)


@pytest.mark.gpu
@PROFILE
@given(case=gemm_cases(nt=True))
def test_gemm_nt(case):
    _check_gemm(case)


@pytest.mark.gpu
@PROFILE
@given(case=gemm_cases(nt=False))
def test_gemm_nn(case):
    _check_gemm(case)


# --- softmax ----------------------------------------------------------------------------------
@st.composite
def softmax_cases(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim - 1)] + [draw(st.integers(1, 70))]
    if ndim >= 2 and draw(st.booleans()):
        shape[-2] = draw(st.integers(1, 40))  # [.., Sq, Sk] score-like
    if draw(st.integers(0, 9)) == 0:  # a long row: the block-per-row kernel
        shape = [1] * (ndim - 1) + [draw(st.integers(config.SOFTMAX_WARP_MAX + 1, 1100))]
    axis = draw(st.integers(-ndim, ndim - 1))
    causal = ndim >= 2 and axis in (-1, ndim - 1) and draw(st.booleans())
    return dict(dtype=draw(st.sampled_from(DTYPES)), shape=tuple(shape), axis=axis, causal=causal,
                scale=draw(st.floats(-2.0, 2.0, width=32)),
                hidden=draw(st.sampled_from([0.0, 0.3, 1.0])),  # share of -inf entries
                layout=draw(st.sampled_from(["contig", "transposed", "offset", "in_place"])),
                seed=draw(seeds))


def _check_softmax(c):
    import cupy

    from cupyattn import row_softmax as S

    rng = np.random.default_rng(c["seed"])
    shape, dtype = c["shape"], c["dtype"]
    vals = rand_with_outliers(rng, shape, scale=3.0)
    vals[rng.random(shape) < c["hidden"] * rng.random()] = -np.inf
    if vals.ndim >= 2 and rng.random() < 0.5:
        vals.reshape(-1, shape[-1])[rng.integers(0, vals.size // shape[-1])] = -np.inf  # a masked row
    x, xr = to_device(vals, dtype)
    out = nan_like(shape, dtype)
    if c["layout"] == "transposed":  # not C-contiguous: the op copies it first
        x = cupy.ascontiguousarray(x.T).T
    elif c["layout"] == "offset":
        x = _relayout(x, "offset")
    elif c["layout"] == "in_place":
        out = x
    got = S.softmax(x, axis=c["axis"], scale=c["scale"], causal=c["causal"], out=out)
    assert got is out
    with np.errstate(invalid="ignore"):  # -inf * 0 = NaN, -inf * -1 = inf: NaN rows, as defined
        want = ref.softmax(xr, axis=c["axis"], scale=c["scale"], causal=c["causal"])
    _assert_matches(got, want, dtype)
    assert np.all(to_host(got)[want == 0.0] == 0.0), "hidden positions and masked rows are exactly 0"


@pytest.mark.gpu
@PROFILE
@given(case=softmax_cases())
def test_softmax(case):
    _check_softmax(case)


# --- rmsnorm, add_rmsnorm ---------------------------------------------------------------------
@st.composite
def norm_cases(draw):
    rows = draw(st.lists(st.integers(1, 5), max_size=2))
    d = draw(st.one_of(st.integers(1, 160), st.integers(config.RMSNORM_WARP_MAX_D - 8, 1100)))
    dtype = draw(st.sampled_from(DTYPES))
    return dict(dtype=dtype, shape=tuple(rows) + (d,), impl=draw(st.sampled_from(config.RMSNORM_IMPLS)),
                weight_dtype=draw(st.sampled_from(sorted({dtype, "float32"}))),
                eps=draw(st.sampled_from([1e-5, 1e-6, 0.0])),
                layout=draw(st.sampled_from(["contig", "offset", "padded", "transposed"])),
                in_place=draw(st.booleans()), seed=draw(seeds))


def _norm_inputs(rng, c):
    x, xr = _rand(rng, c["shape"], c["dtype"])
    w, wr = to_device(rng.standard_normal(c["shape"][-1]), c["weight_dtype"])
    return x, xr, w, wr


def _check_rmsnorm(c):
    import cupy

    from cupyattn import layers as L

    rng = np.random.default_rng(c["seed"])
    x, xr, w, wr = _norm_inputs(rng, c)
    if c["layout"] == "transposed" and x.ndim >= 2:  # not C-contiguous: copied first
        x = cupy.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    else:
        x = _relayout(x, "contig" if c["layout"] == "transposed" else c["layout"])
    out = x if c["in_place"] and x.flags.c_contiguous else nan_like(c["shape"], c["dtype"])
    assert L.rmsnorm(x, w, c["eps"], out=out, impl=c["impl"]) is out
    with np.errstate(invalid="ignore"):  # eps = 0 and a row of zeros: 0 / 0
        want = ref.rmsnorm(xr, wr, c["eps"])
    _assert_matches(out, want, c["dtype"])


@pytest.mark.gpu
@PROFILE
@given(case=norm_cases())
def test_rmsnorm(case):
    _check_rmsnorm(case)


def _check_add_rmsnorm(c):
    import cupy

    from cupyattn import layers as L

    rng = np.random.default_rng(c["seed"])
    x, xr, w, wr = _norm_inputs(rng, c)
    r, rr = _rand(rng, c["shape"], c["dtype"])
    if c["layout"] == "transposed" and r.ndim >= 2:  # r may be any layout (copied first)
        r = cupy.ascontiguousarray(r.swapaxes(-1, -2)).swapaxes(-1, -2)
    elif c["layout"] != "transposed":
        r = _relayout(r, c["layout"])
    x_layout = "offset" if c["layout"] == "offset" else "contig"  # x is updated in place: C-contiguous
    x = _relayout(x, x_layout)
    # the unfused pair on a copy in the same layout, for a bit-exact comparison: add (rounded to
    # the dtype), then rmsnorm (alignment sets the vector width and so the order of the sum)
    want_x = _relayout(x.copy(), x_layout)
    L.add(want_x, r, out=want_x)
    want_h = L.rmsnorm(want_x, w, c["eps"], impl=c["impl"])
    out = nan_like(c["shape"], c["dtype"])
    got_x, got_h = L.add_rmsnorm(x, r, w, c["eps"], out=out, impl=c["impl"])
    assert got_x is x and got_h is out
    with np.errstate(invalid="ignore"):  # eps = 0 and x + r = 0 (outliers +-30): 0 / 0
        s, h = ref.add_rmsnorm(xr, rr, wr, c["eps"])
    _assert_matches(got_x, s, c["dtype"])
    _assert_matches(got_h, h, c["dtype"])
    assert cupy.array_equal(got_x, want_x) and cupy.array_equal(got_h, want_h, equal_nan=True)


@pytest.mark.gpu
@PROFILE
@given(case=norm_cases())
def test_add_rmsnorm(case):
    _check_add_rmsnorm(case)


# --- rope -------------------------------------------------------------------------------------
@st.composite
def rope_cases(draw):
    return dict(dtype=draw(st.sampled_from(DTYPES)), style=draw(st.sampled_from(["adjacent", "neox"])),
                shape=(draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 40)),
                       2 * draw(st.integers(1, 40))),
                base=draw(st.one_of(st.sampled_from([1e4, 1e5]), st.floats(1.5, 1e6))),
                pos_span=draw(st.sampled_from([100, 70000, 2**31 - 1])),  # negative positions too
                pos_dtype=draw(st.sampled_from(["int32", "int64"])),
                layout=draw(st.sampled_from(["contig", "qkv_view", "offset", "ragged", "strided_d"])),
                in_place=draw(st.booleans()), seed=draw(seeds))


def _check_rope(c):
    import cupy

    from cupyattn import layers as L

    rng = np.random.default_rng(c["seed"])
    b, h, t, d = c["shape"]
    x, xr = _rand(rng, c["shape"], c["dtype"])
    if c["layout"] == "qkv_view":  # the q part of a [B, T, 3, H, D] buffer, as [B, H, T, D]
        buf = cupy.zeros((b, t, 3, h, d), dtype=x.dtype)
        buf[:, :, 0] = x.transpose(0, 2, 1, 3)
        x = buf[:, :, 0].transpose(0, 2, 1, 3)
    elif c["layout"] == "strided_d":  # last dim strided: copied first (not for in place)
        buf = cupy.zeros(c["shape"][:3] + (2 * d,), dtype=x.dtype)
        buf[..., ::2] = x
        x = buf[..., ::2]
    else:
        x = _relayout(x, c["layout"])
    pos = rng.integers(-c["pos_span"], c["pos_span"] + 1, size=(b, t))
    in_place = c["in_place"] and c["layout"] != "strided_d"
    out = x if in_place else nan_like(c["shape"], c["dtype"])
    got = L.rope(x, cupy.asarray(pos.astype(c["pos_dtype"])), base=c["base"], style=c["style"], out=out)
    assert got is out
    assert_close(got, ref.rope(xr, pos, base=c["base"], style=c["style"]), c["dtype"])


@pytest.mark.gpu
@PROFILE
@given(case=rope_cases())
def test_rope(case):
    _check_rope(case)


# --- swiglu, add ------------------------------------------------------------------------------
@st.composite
def elementwise_cases(draw):
    return dict(dtype=draw(st.sampled_from(DTYPES)),
                shape=tuple(draw(st.lists(st.integers(1, 5), max_size=2))) + (draw(st.integers(1, 300)),),
                layout=draw(st.sampled_from(["contig", "packed", "offset", "reversed"])),
                in_place=draw(st.sampled_from([None, 0, 1])), seed=draw(seeds))


def _two_inputs(rng, c, **kw):
    """Two device inputs of c["shape"] in the drawn layout, and their float64 values: "packed"
    are the two halves of one [..., 2F] buffer (a fused gate|up projection), "reversed" views
    whose rows cannot be read as rows (copied first)."""
    import cupy

    shape = c["shape"]
    f = shape[-1]
    both, bothr = _rand(rng, shape[:-1] + (2 * f,), c["dtype"], **kw)
    if c["layout"] == "packed":
        return (both[..., :f], both[..., f:]), (bothr[..., :f], bothr[..., f:])
    if c["layout"] == "reversed":
        flip = (slice(None, None, -1),) * len(shape)
        return ((both[..., :f][flip], both[..., f:][flip]),
                (bothr[..., :f][flip], bothr[..., f:][flip]))
    pair = [cupy.ascontiguousarray(both[..., :f]), cupy.ascontiguousarray(both[..., f:])]
    return [_relayout(p, c["layout"]) for p in pair], (bothr[..., :f], bothr[..., f:])


def _check_elementwise(c, op):
    from cupyattn import layers as L

    rng = np.random.default_rng(c["seed"])
    # swiglu's gate outliers at +-8: silu(-30) ~ -3e-12 has no fp16/bf16 neighbour to round to
    (a, b), (ar, br) = _two_inputs(rng, c, **(dict(scale=3.0, outlier_value=8.0) if op == "swiglu" else {}))
    fn, want = (L.swiglu, ref.swiglu(ar, br)) if op == "swiglu" else (L.add, ar + br)
    target = (a, b)[c["in_place"]] if c["in_place"] is not None else None
    out = target if target is not None and target.flags.c_contiguous else nan_like(c["shape"], c["dtype"])
    assert fn(a, b, out=out) is out
    assert_close(out, want, c["dtype"])


@pytest.mark.gpu
@PROFILE
@given(case=elementwise_cases())
def test_swiglu(case):
    _check_elementwise(case, "swiglu")


@pytest.mark.gpu
@PROFILE
@given(case=elementwise_cases())
def test_add(case):
    _check_elementwise(case, "add")


# --- embedding --------------------------------------------------------------------------------
@st.composite
def embedding_cases(draw):
    return dict(dtype=draw(st.sampled_from(DTYPES)), ids_dtype=draw(st.sampled_from(["int32", "int64"])),
                ids_shape=tuple(draw(st.lists(st.integers(1, 9), max_size=3))),
                vocab=draw(st.integers(1, 70)), d=draw(st.integers(1, 70)),
                out_of_range=draw(st.sampled_from([0.0, 0.2])),  # share of ids outside [0, V)
                layout=draw(st.sampled_from(["contig", "offset", "padded", "ragged"])),
                out_offset=draw(st.booleans()), seed=draw(seeds))


def _check_embedding(c):
    import cupy

    from cupyattn import layers as L

    rng = np.random.default_rng(c["seed"])
    v, d = c["vocab"], c["d"]
    table, tr = _rand(rng, (v, d), c["dtype"])
    table = _relayout(table, c["layout"])
    ids = rng.integers(0, v, size=c["ids_shape"])
    bad = rng.random(c["ids_shape"]) < c["out_of_range"]
    ids = np.where(bad, rng.choice([-1, v, -v - 1, v + 1000, 2**31 - 1], size=c["ids_shape"]), ids)
    out = _out(c["ids_shape"] + (d,), c["dtype"], c["out_offset"])
    assert L.embedding(cupy.asarray(ids.astype(c["ids_dtype"])), table, out=out) is out
    want = np.where(bad[..., None], 0.0, ref.embedding(np.where(bad, 0, ids), tr))  # bad ids: zero rows
    assert np.array_equal(to_host(out), want)


@pytest.mark.gpu
@PROFILE
@given(case=embedding_cases())
def test_embedding(case):
    _check_embedding(case)


# --- sampling ---------------------------------------------------------------------------------
# Temperatures: greedy, ordinary float32 values, and both ends of the range: 1/T overflowing
# float32 (greedy), 1/T subnormal in float32 (the uniform limit), and values around both edges.
TEMPERATURES = st.one_of(
    st.just(0.0), st.floats(0.0, 3.0, width=32), st.floats(0.0, 3.0, width=32),
    st.sampled_from([1e-300, 1e-50, 1e-40, 2.9e-39, 3e-39, 1.2e-38, 1e-30, 1e30, 8e37, 8.6e37, 1e39, 1e300]),
    st.floats(1e-320, 1e300).filter(lambda t: t > 0))


@st.composite
def sample_cases(draw):
    """Rows of logits with ties, NaN / +-inf mixed in, rows with nothing to draw, tiny and huge
    magnitudes, and per-row settings over every valid temperature, top_k and top_p."""
    rows = draw(st.integers(1, 4))
    v = draw(st.one_of(st.integers(1, 70), st.integers(1000, 1100)))
    per_row = st.tuples(TEMPERATURES,
                        st.one_of(st.just(0), st.integers(1, v + 1)),                   # top_k
                        st.one_of(st.just(1.0), st.floats(0.01, 1.0)))                  # top_p
    return dict(dtype=draw(st.sampled_from(DTYPES)), rows=rows, v=v,
                settings=draw(st.lists(per_row, min_size=rows, max_size=rows)),
                scale=draw(st.sampled_from([3.0, 3.0, 1e-30, 1e30, 1e38])),  # logit magnitudes
                coarse=draw(st.booleans()),  # values on a 1/4 grid (times scale): many ties
                special=draw(st.sampled_from([0.0, 0.05, 1.0])),  # share of NaN / +-inf logits
                # row 0 made of: nothing to draw (NaN, NaN and -inf, -inf) or one finite value left
                blank=draw(st.sampled_from([None, None, "nan", "nan-inf", "-inf", "one-left"])),
                seed=draw(st.integers(0, 2**64 - 1)), step=draw(st.integers(0, 2**31 - 2)),
                layout=draw(st.sampled_from(["2d", "3d", "padded"])), seed_rng=draw(seeds))


def sample_logits(c) -> np.ndarray:
    """float64 [rows, v] logits of a ``sample_cases`` case."""
    rng = np.random.default_rng(c["seed_rng"])
    z = rng.standard_normal((c["rows"], c["v"])) * 3
    if c["coarse"]:
        z = np.round(z * 4) / 4
    z *= c["scale"] / 3
    special = rng.random(z.shape) < c["special"]
    z[special] = rng.choice([np.nan, np.inf, -np.inf], size=int(special.sum()))  # mixed in a row
    fill = {"nan": [np.nan], "nan-inf": [np.nan, -np.inf], "-inf": [-np.inf], "one-left": [np.nan, -np.inf]}
    if c["blank"] is not None:
        z[0] = rng.choice(fill[c["blank"]], size=c["v"])
        if c["blank"] == "one-left":
            z[0, rng.integers(c["v"])] = rng.standard_normal() * c["scale"]
    return z


def _check_sample(c):
    import cupy

    from cupyattn import sampling as S

    rows, dtype = c["rows"], c["dtype"]
    with np.errstate(over="ignore"):  # huge logits round to inf in float16 by design
        zd, zr = to_device(sample_logits(c), dtype)
    if c["layout"] == "3d":
        zd = zd[:, None]
    elif c["layout"] == "padded":
        zd = _relayout(zd, "ragged")
    temp, top_k, top_p = (list(x) for x in zip(*c["settings"]))
    params = S.SamplingParams(rows, temperature=temp, top_k=top_k, top_p=top_p, seed=c["seed"], step=c["step"])
    out = cupy.full(rows, -7, dtype=cupy.int32)
    assert S.sample(zd, params, out=out) is out
    got = to_host(out).astype(int).tolist()
    for i in range(rows):
        seed = (c["seed"] + i) % 2**64
        want = ref.sample_token(zr[i], temp[i], top_k[i], top_p[i], seed=seed, step=c["step"])
        assert got[i] == want, (i, temp[i], top_k[i], top_p[i])
        drawable = ~np.isnan(zr[i]) & (zr[i] > -np.inf)
        if not drawable.any():  # nothing to draw: -1, whatever the settings
            assert got[i] == -1
        else:  # never a NaN or -inf logit; greedy (1/T overflows float32) is the first argmax
            assert drawable[got[i]], (i, zr[i][got[i]])
            if ref.sampling_beta(temp[i]) == np.inf:
                assert got[i] == int(np.argmax(np.where(drawable, zr[i], -np.inf)))
    assert to_host(params.iparams)[:, 3].tolist() == [c["step"] + 1] * rows  # each row's step advanced


@pytest.mark.gpu
@PROFILE
@given(case=sample_cases())
def test_sample(case):
    _check_sample(case)



# One row drawn value by value from the edges (NaN, +-inf, ties, float32's largest and smallest
# magnitudes, so that l - l_max overflows float32), for frequency tests of a sampler against
# the reference's distribution: N draws of the row (seeds seed + b on the device).
EDGE_LOGITS = st.one_of(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1.0, 1.0, -1.0, 2.5, 3e38, -3e38,
                                         -1.7e38, 1e-30, -1e-30, 1e30]),
                        st.floats(-4.0, 4.0, width=32))


@st.composite
def distribution_cases(draw):
    v = draw(st.integers(1, 12))
    return dict(row=draw(st.lists(EDGE_LOGITS, min_size=v, max_size=v)), temperature=draw(TEMPERATURES),
                top_k=draw(st.one_of(st.just(0), st.integers(1, v + 1))),
                top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))), seed=draw(st.integers(0, 2**63)))


def assert_frequencies(draws, probs, what=""):
    """``draws`` (token ids, -1 for none) follow ``probs``: no draw outside its support, -1 only
    (and always) when it is empty, and each token's frequency within 4.5 standard errors."""
    draws = np.asarray(draws)
    if not probs.any():
        assert (draws == -1).all(), what
        return
    assert (draws >= 0).all() and (probs[draws] > 0).all(), (what, sorted(set(draws.tolist())), probs)
    n = draws.size
    freq = np.bincount(draws, minlength=probs.size) / n
    band = 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-9
    assert (np.abs(freq - probs) <= band).all(), (what, freq, probs)


@pytest.mark.gpu
@settings(PROFILE, max_examples=6 if EMULATE else 60)  # each example: N blocks of 1024 emulated threads
@given(case=distribution_cases())
def test_sample_distribution(case):
    """The device sampler's frequencies over N rows of one edge-case row (float32) against the
    float64 distribution of ``reference.sampling_probs``, the top_p cut taken exactly there."""
    from cupyattn import sampling as S

    n = 300 if EMULATE else 4000
    z = np.array(case["row"], dtype=np.float32)
    zd, _ = to_device(np.broadcast_to(z, (n, z.size)).astype(np.float64), "float32")
    t, k, p = case["temperature"], case["top_k"], float(np.float32(case["top_p"]))  # the device's top_p
    params = S.SamplingParams(n, temperature=t, top_k=k, top_p=p, seed=case["seed"])
    probs = ref.sampling_probs(z, t, k, p)
    assert_frequencies(to_host(S.sample(zd, params)).astype(int), probs, (t, k, p))

# --- wider variants: every head dim, larger sizes (minutes on the emulator) -------------------
@pytest.mark.gpu
@pytest.mark.emu_slow
@settings(PROFILE, max_examples=300)
@given(case=attention_cases(head_dims=config.HEAD_DIMS, max_s=160))
def test_attention_every_head_dim(case):
    _check_attention(case)


@pytest.mark.gpu
@pytest.mark.emu_slow
@settings(PROFILE, max_examples=300)
@given(case=decode_cases(head_dims=config.HEAD_DIMS, max_seq=400))
def test_kvcache_append_and_decode_every_head_dim(case):
    _check_decode(case)


# --- found by the properties above (fixed in the reference) ------------------------------------
def test_reference_attention_with_no_keys():
    """Sk = 0: every row sees no key, so zeros and lse -inf, as attention() gives."""
    q, k = np.ones((1, 1, 2, 4)), np.ones((1, 1, 0, 4))
    out, lse = ref.attention(q, k, k, return_lse=True)
    assert np.array_equal(out, np.zeros((1, 1, 2, 4))) and np.all(lse == -np.inf)
