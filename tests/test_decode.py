"""KV cache + decode attention (split-KV).

CPU tier: reference split/merge identities, the split-count rule, the offline compile check of
the decode and kvcache specs.

GPU tier (`gpu` marker): argument checks on a real KVCache and device arrays, append and decode
against the float64 reference, plus long caches; all but the longest also run on the CPU
emulator (tests/emu).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TOL, assert_close, np_dtype, rand_with_outliers
from cupyattn import config, decode, kvcache
from cupyattn import reference as ref
from cupyattn.decode import choose_num_splits, decode_attention
from cupyattn.kvcache import KVCache

DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


# --- CPU tier: references -------------------------------------------------------------------
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 16])
def test_reference_split_merge_equals_decode(rng, splits):
    b, hq, hkv, s, d = 4, 6, 2, 40, 16
    lengths = np.array([0, 1, 5, 37])  # empty sequence; chunks past the end are empty
    q = rand_with_outliers(rng, (b, hq, 1, d))
    k = rand_with_outliers(rng, (b, hkv, s, d))
    v = rng.standard_normal((b, hkv, s, d))
    o_parts, lse_parts = ref.decode_split_partials(q, k, v, lengths, splits)
    assert o_parts.shape == (splits, b, hq, 1, d) and lse_parts.shape == (splits, b, hq, 1)
    assert np.all(np.isneginf(lse_parts[:, 0]))  # length 0: every chunk empty
    merged, lse = ref.merge_partials(o_parts, lse_parts)
    want, want_lse = ref.attention(q, k, v, key_lengths=lengths, return_lse=True)
    np.testing.assert_allclose(merged, ref.decode_attention(q, k, v, lengths), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged, want, rtol=1e-12, atol=1e-12)
    assert np.all(merged[0] == 0.0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-12)


def test_reference_split_chunks_cover_each_key_once():
    """chunk = ceil(len / splits): with len 5 and 4 splits the chunks are 2, 2, 1, 0 keys."""
    d = 4
    q = np.zeros((1, 1, 1, d))  # all scores equal: O_c = mean of V over chunk c
    v = np.arange(8, dtype=np.float64).reshape(1, 1, 8, 1) * np.ones((1, 1, 8, d))
    o, lse = ref.decode_split_partials(q, np.zeros_like(v), v, [5], 4)
    np.testing.assert_allclose(o[:, 0, 0, 0, 0], [0.5, 2.5, 4.0, 0.0])
    np.testing.assert_allclose(np.exp(lse[:3, 0, 0, 0]), [2, 2, 1])
    assert np.isneginf(lse[3, 0, 0, 0])


# --- CPU tier: split-count rule -------------------------------------------------------------
def test_choose_num_splits_rule():
    sm = 132
    assert choose_num_splits(1, 8, 0, sm) == 1
    assert choose_num_splits(1, 8, 255, sm) == 1              # too short to split
    assert choose_num_splits(1, 8, 1024, sm) == 4             # >= 256 keys per split
    # long: enough blocks for ~2 waves of SMs (batch * kv_heads * splits >= 2 * sm)
    s = choose_num_splits(1, 8, 32768, sm)
    assert 8 * s >= 2 * sm and 8 * (s - 1) < 2 * sm
    assert choose_num_splits(1, 1, 10**6, sm) == config.DECODE_MAX_AUTO_SPLITS  # capped
    assert choose_num_splits(64, 32, 10**6, sm) == 1          # the batch already fills the GPU
    for batch, heads, length, sms in [(1, 1, 1, 1), (3, 5, 999, 7), (2, 8, 4096, 132), (1, 2, 10**7, 200)]:
        n = choose_num_splits(batch, heads, length, sms)
        assert 1 <= n <= config.DECODE_MAX_AUTO_SPLITS
        assert n == 1 or length // n >= config.DECODE_MIN_KEYS_PER_SPLIT
    # monotone in the live length, never in max_seq (which it does not take)
    seq = [choose_num_splits(2, 4, n, 108) for n in range(0, 40000, 777)]
    assert seq == sorted(seq)


@pytest.mark.gpu
def test_auto_splits_follow_live_length_not_max_seq(monkeypatch):
    import cupy

    seen = []
    monkeypatch.setattr(decode, "_sm_count", lambda: 132)
    monkeypatch.setattr(decode, "_launch", lambda q, cache, layer, scale, n, out: seen.append(n))
    for max_seq in (4096, 65536):
        cache = KVCache(1, 1, 2, max_seq, 64, np.float16)
        cache.host_lengths[0] = 3000  # the host mirror is all the split rule reads
        decode_attention(cupy.zeros((1, 4, 1, 64), dtype=cupy.float16), cache, 0)
    assert seen[0] == seen[1] == choose_num_splits(1, 2, 3000, 132)


# --- GPU tier: argument checks (a real KVCache; a failing call launches nothing) --------------
@pytest.mark.gpu
def test_kvcache_constructor_checks():
    import cupy

    c = KVCache(2, 3, 4, 16, 8, np.float32)
    assert isinstance(c.k, cupy.ndarray) and isinstance(c.lengths, cupy.ndarray)
    assert c.k.shape == c.v.shape == (2, 3, 4, 16, 8) and c.k.flags.c_contiguous
    assert c.lengths.dtype == np.int32 and c.lengths.shape == (2, 3)
    assert c.host_lengths.dtype == np.int64 and not c.host_lengths.any()
    with pytest.raises(TypeError, match="dtype"):
        KVCache(1, 1, 1, 8, 8, np.int32)
    with pytest.raises(ValueError, match="max_seq"):
        KVCache(1, 1, 1, 0, 8, np.float32)
    with pytest.raises(ValueError, match="num_layers"):
        KVCache(0, 1, 1, 8, 8, np.float32)


@pytest.mark.gpu
def test_append_checks_write_nothing():
    import cupy

    c = KVCache(2, 2, 2, 8, 32, np.float16)
    c.host_lengths[1] = [6, 3]
    c.lengths[1] = cupy.asarray([6, 3], dtype=cupy.int32)
    k = cupy.ones((2, 2, 3, 32), dtype=cupy.float16)
    nc = cupy.ones((2, 2, 3, 64), dtype=cupy.float16)[..., ::2]  # right shape, last dim strided
    before = (cupy.asnumpy(c.k), cupy.asnumpy(c.v), cupy.asnumpy(c.lengths), c.host_lengths.copy())
    cases = [
        (dict(layer=2), IndexError, "layer 2 is out of range"),
        (dict(layer=-1), IndexError, "out of range"),
        (dict(layer=1.0), TypeError, "layer must be an int"),
        (dict(k_new=k.astype(cupy.float32)), TypeError, "k_new has dtype float32"),
        (dict(v_new=k[:1]), ValueError, "v_new has shape"),
        (dict(k_new=k[:, :1], v_new=k[:, :1]), ValueError, "k_new has shape"),
        (dict(k_new=k[..., :16], v_new=k[..., :16]), ValueError, "head_dim=32"),
        (dict(k_new=nc, v_new=nc), ValueError, "k_new must be contiguous in its last dimension"),
        (dict(num_new=[1]), ValueError, "2 integers"),
        (dict(num_new=[4, 0]), ValueError, r"num_new\[0\]=4 is outside \[0, T=3\]"),
        (dict(num_new=[0, -1]), ValueError, "outside"),
        (dict(num_new=[1.5, 1]), ValueError, "integers"),
        # sequence 0 of layer 1 holds 6 of 8: 3 more would pass max_seq
        (dict(), ValueError, r"sequence 0 of layer 1 holds 6 tokens, appending 3 .*max_seq=8"),
        (dict(k_new=[k]), TypeError, "k_new must be a cupy.ndarray"),
    ]
    for kw, exc, msg in cases:
        args = dict(layer=1, k_new=k, v_new=k, num_new=None) | kw
        with pytest.raises(exc, match=msg):
            c.append(**args)
    after = (cupy.asnumpy(c.k), cupy.asnumpy(c.v), cupy.asnumpy(c.lengths), c.host_lengths)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_decode_checks():
    import cupy

    c = KVCache(2, 2, 2, 8, 64, np.float16)
    q = cupy.zeros((2, 6, 1, 64), dtype=cupy.float16)
    f16, f32 = cupy.float16, cupy.float32
    cases = [
        (dict(cache="cache"), TypeError, "must be a cupyattn.KVCache"),
        (dict(layer=5), IndexError, "layer 5"),
        (dict(q=q.astype(f32)), TypeError, "q has dtype float32 but the cache has float16"),
        (dict(q=q[:1]), ValueError, "batch=2"),
        (dict(q=cupy.zeros((2, 6, 2, 64), dtype=f16)), ValueError, "q has shape"),
        (dict(q=cupy.zeros((2, 6, 1, 32), dtype=f16)), ValueError, "head_dim=64"),
        (dict(q=cupy.zeros((2, 5, 1, 64), dtype=f16)), ValueError, "not a multiple"),
        (dict(q=cupy.zeros((2, 6, 1, 128), dtype=f16)[..., ::2]), ValueError, "contiguous"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(num_splits=257), ValueError, "num_splits"),
        (dict(num_splits=2.0), ValueError, "num_splits"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(out=cupy.zeros((2, 6, 1, 64), dtype=f32)), TypeError, "out has dtype"),
        (dict(out=cupy.zeros((2, 6, 64), dtype=f16)), ValueError, "out has shape"),
        (dict(out=cupy.zeros((2, 6, 1, 128), dtype=f16)[..., ::2]), ValueError, "C-contiguous"),
    ]
    for kw, exc, msg in cases:
        args = dict(q=q, cache=c, layer=1) | kw
        with pytest.raises(exc, match=msg):
            decode_attention(**args)
    c96 = KVCache(1, 1, 1, 8, 48, np.float32)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        decode_attention(cupy.zeros((1, 1, 1, 48), dtype=f32), c96, 0)


# --- CPU tier: compile check ----------------------------------------------------------------
def test_decode_spec_compiles_without_spills(compile_report):
    """The decode kernels and the KV-cache append kernels they read from."""
    for spec in (decode.SPEC, kvcache.SPEC):
        reports, errors = compile_report(spec.name)
        assert not errors, errors
        assert sorted((r.kernel, r.arch) for r in reports) == sorted(
            (e, a) for e in spec.name_expressions for a in ("sm_80", "sm_90"))
        assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]
        assert all(r.smem_bytes <= config.STATIC_SMEM_BYTES for r in reports)  # no opt-in needed


# --- GPU tier helpers (the CPU emulator, tests/emu, runs these too) ---------------------------
class _Backend:
    @staticmethod
    def asarray(x):
        import cupy

        return cupy.asarray(x)

    @staticmethod
    def host(x):
        import cupy

        return cupy.asnumpy(x)

    def nan(self, shape, dtype):
        return self.asarray(np.full(shape, np.nan, dtype=np_dtype(dtype)))


@pytest.fixture(params=[pytest.param("gpu", marks=pytest.mark.gpu)])
def backend(request):
    return _Backend()


def _filled_cache(be, rng, dtype, lengths, hkv, d, max_seq=None, chunks=2):
    """A cache whose layer 1 holds ``lengths`` tokens, appended in ``chunks`` ragged appends;
    returns (cache, k_ref, v_ref) with the float64 values the cache holds."""
    b = len(lengths)
    max_seq = max_seq or max(max(lengths), 1) + 3
    cache = KVCache(2, b, hkv, max_seq, d, np_dtype(dtype))
    k_all = rand_with_outliers(rng, (b, hkv, max(max(lengths), 1), d)).astype(np_dtype(dtype))
    v_all = rng.standard_normal(k_all.shape).astype(np_dtype(dtype))
    done = np.zeros(b, dtype=np.int64)
    for c in range(chunks):
        target = np.array([(n * (c + 1)) // chunks for n in lengths])
        cnt = target - done
        t = max(int(cnt.max()), 1)
        kn = np.zeros((b, hkv, t, d), np_dtype(dtype))
        vn = np.zeros_like(kn)
        for i in range(b):
            kn[i, :, : cnt[i]] = k_all[i, :, done[i]: target[i]]
            vn[i, :, : cnt[i]] = v_all[i, :, done[i]: target[i]]
        cache.append(1, be.asarray(kn), be.asarray(vn), num_new=cnt.tolist())
        done = target
    kf = np.zeros((b, hkv, max_seq, d))
    vf = np.zeros_like(kf)
    for i, n in enumerate(lengths):
        kf[i, :, :n] = k_all[i, :, :n].astype(np.float64)
        vf[i, :, :n] = v_all[i, :, :n].astype(np.float64)
    return cache, kf, vf


# --- append ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_matches_numpy(backend, rng, dtype):
    be = backend
    b, hkv, d, max_seq = 3, 2, 32, 12
    cache = KVCache(2, b, hkv, max_seq, d, np_dtype(dtype))
    want_k = np.zeros((2, b, hkv, max_seq, d))
    want_v = np.zeros_like(want_k)
    lens = np.zeros(b, dtype=np.int64)
    # uniform append; ragged append from a strided [B, T, Hkv, D] buffer; single tokens
    for t, counts, strided in [(4, None, False), (5, [5, 0, 2], True), (1, None, False), (1, [0, 1, 1], False)]:
        kn = rng.standard_normal((b, t, hkv, d)).astype(np_dtype(dtype))
        vn = rng.standard_normal((b, t, hkv, d)).astype(np_dtype(dtype))
        if strided:
            kd, vd = be.asarray(kn).transpose(0, 2, 1, 3), be.asarray(vn).transpose(0, 2, 1, 3)
        else:
            kd, vd = be.asarray(kn.transpose(0, 2, 1, 3)), be.asarray(vn.transpose(0, 2, 1, 3))
        cache.append(1, kd, vd, num_new=counts)
        cnt = [t] * b if counts is None else counts
        for i in range(b):
            want_k[1, i, :, lens[i]: lens[i] + cnt[i]] = kn[i, : cnt[i]].transpose(1, 0, 2)
            want_v[1, i, :, lens[i]: lens[i] + cnt[i]] = vn[i, : cnt[i]].transpose(1, 0, 2)
            lens[i] += cnt[i]
    np.testing.assert_array_equal(be.host(cache.k).astype(np.float64), want_k)
    np.testing.assert_array_equal(be.host(cache.v).astype(np.float64), want_v)
    np.testing.assert_array_equal(be.host(cache.lengths), [[0] * b, lens])
    np.testing.assert_array_equal(cache.host_lengths, [[0] * b, lens])
    np.testing.assert_array_equal(cache.seq_lengths(1), lens)
    cache.reset()
    assert not be.host(cache.lengths).any() and not cache.host_lengths.any()


def test_append_overflow_leaves_cache_unchanged(backend, rng):
    be = backend
    cache = KVCache(1, 2, 1, 8, 64, np.float32)
    cache.append(0, be.asarray(np.ones((2, 1, 6, 64), np.float32)), be.asarray(np.ones((2, 1, 6, 64), np.float32)),
                 num_new=[6, 2])
    before = [be.host(a) for a in (cache.k, cache.v, cache.lengths)] + [cache.host_lengths.copy()]
    kn = be.asarray(np.full((2, 1, 3, 64), 7, np.float32))
    with pytest.raises(ValueError, match=r"sequence 0 of layer 0 holds 6 tokens, appending 3.*max_seq=8"):
        cache.append(0, kn, kn)
    with pytest.raises(ValueError, match="max_seq=8"):
        cache.append(0, kn, kn, num_new=[3, 0])
    after = [be.host(a) for a in (cache.k, cache.v, cache.lengths)] + [cache.host_lengths]
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    cache.append(0, kn, kn, num_new=[2, 3])  # exactly full is fine
    np.testing.assert_array_equal(be.host(cache.lengths)[0], [8, 5])


# --- decode ------------------------------------------------------------------
def _check_decode(be, rng, dtype, lengths, hkv, group, d, splits, tol=None, max_seq=None):
    cache, kf, vf = _filled_cache(be, rng, dtype, lengths, hkv, d, max_seq=max_seq)
    hq = hkv * group
    q64 = rand_with_outliers(rng, (len(lengths), hq, 1, d)).astype(np_dtype(dtype))
    q = be.asarray(q64)
    out = be.nan((len(lengths), hq, 1, d), dtype)
    res = decode_attention(q, cache, 1, num_splits=splits, out=out)
    assert res is out
    want = ref.decode_attention(q64.astype(np.float64), kf, vf, lengths)
    tol = tol or (1e-5 if dtype == "float32" else TOL[dtype])
    assert_close(be.host(out), want, dtype, tol)
    for i, n in enumerate(lengths):
        if n == 0:
            assert np.all(be.host(out)[i] == 0)
    return cache, q, be.host(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_small(backend, rng, dtype, splits):
    """Lengths 1, 17, 0 and 70 (a tail tile) in one batch, GQA group 3."""
    _check_decode(backend, rng, dtype, [1, 17, 0, 70], hkv=2, group=3, d=64, splits=splits)


def test_decode_with_preallocated_workspace(backend, rng):
    """workspace= gives the same output as the call's own partials, and bad ones are refused."""
    import cupy

    cache, q, want = _check_decode(backend, rng, "float16", [40, 3, 0], hkv=2, group=4, d=64, splits=3)
    ws = (cupy.full((5, 3, 8, 64), np.nan, dtype=cupy.float32), cupy.full((5, 3, 8), np.nan, dtype=cupy.float32))
    out = backend.nan((3, 8, 1, 64), "float16")
    decode_attention(q, cache, 1, num_splits=3, out=out, workspace=ws)
    np.testing.assert_array_equal(backend.host(out), want)
    for bad, exc, msg in [((ws[0],), TypeError, "workspace must be a tuple"),
                          ((ws[0][:2], ws[1][:2]), ValueError, r"workspace\[0\] must be .* \[S >= 3, 3, 8, 64\]"),
                          ((ws[0], ws[1].astype(cupy.float16)), TypeError, r"workspace\[1\] has dtype float16"),
                          ((ws[0], ws[1][:, :, :4]), ValueError, r"workspace\[1\] must be")]:
        before = backend.host(out).copy()
        with pytest.raises(exc, match=msg):
            decode_attention(q, cache, 1, num_splits=3, out=out, workspace=bad)
        np.testing.assert_array_equal(backend.host(out), before)


@pytest.mark.parametrize("d", config.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_head_dims(backend, rng, dtype, d):
    _check_decode(backend, rng, dtype, [33, 5], hkv=1, group=4, d=d, splits=3)


@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])  # 12: two head tiles (8 + 4)
def test_decode_gqa(backend, rng, group):
    _check_decode(backend, rng, "float32", [40, 9], hkv=2, group=group, d=128, splits=2)


@pytest.mark.parametrize("splits", [1, 4, 9, None])
def test_decode_1000_and_split_equals_unsplit(backend, rng, splits):
    lengths = [1000, 333, 1]
    cache, q, out = _check_decode(backend, rng, "float32", lengths, hkv=1, group=2, d=128, splits=splits)
    ref_out = backend.host(decode_attention(q, cache, 1, num_splits=1))
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)


def test_decode_scale_and_strided_q(backend, rng):
    be = backend
    cache, kf, vf = _filled_cache(be, rng, "float32", [50, 7], 2, 64)
    q4 = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)   # [B, 1, Hq, D] buffer
    q = be.asarray(q4).transpose(0, 2, 1, 3)                       # [B, Hq, 1, D] view, strided
    out = decode_attention(q, cache, 1, scale=0.3, num_splits=2)
    want = ref.decode_attention(q4.transpose(0, 2, 1, 3).astype(np.float64), kf, vf, [50, 7], scale=0.3)
    assert_close(be.host(out), want, "float32")


def test_decode_split_partials_match_reference(backend, rng):
    be = backend
    lengths = [45, 3, 0]
    cache, kf, vf = _filled_cache(be, rng, "float32", lengths, 1, 32)
    q64 = rng.standard_normal((3, 3, 1, 32)).astype(np.float32)
    o, lse = decode.decode_split_partials(be.asarray(q64), cache, 1, 4)
    o_ref, lse_ref = ref.decode_split_partials(q64.astype(np.float64), kf, vf, lengths, 4)
    o, lse = be.host(o), be.host(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref[..., 0]))
    fin = np.isfinite(lse_ref[..., 0])
    np.testing.assert_allclose(lse[fin], lse_ref[..., 0][fin], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, o_ref[..., 0, :], rtol=1e-5, atol=1e-5)


# --- GPU only: long caches ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.no_emu  # too large for the CPU emulator of the GPU tier (CUPYATTN_EMULATE=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_32768_gpu(rng, dtype, splits):
    be = _Backend()
    _check_decode(be, rng, dtype, [32768, 20000], hkv=1, group=4, d=128, splits=splits,
                  tol=1e-4 if dtype == "float32" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_gqa_every_dtype_gpu(rng, dtype, group):
    be = _Backend()
    _check_decode(be, rng, dtype, [1, 17, 1000, 0], hkv=2, group=group, d=128, splits=None,
                  max_seq=4096)


@pytest.mark.gpu
def test_decode_auto_splits_independent_of_max_seq_gpu(rng):
    be = _Backend()
    outs = []
    for max_seq in (3000, 40000):
        r = np.random.default_rng(7)
        cache, q, out = _check_decode(be, r, "float32", [2999, 1500], 2, 4, 64, None, max_seq=max_seq)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
