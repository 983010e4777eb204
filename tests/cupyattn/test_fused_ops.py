"""The fused decoder ops and device sampling: add_rmsnorm, swiglu on packed gate|up halves,
KVCache.append_qkv (RoPE + append + length advance), cupyattn.sample (greedy / temperature /
top-k / top-p with a Philox-4x32-10 generator).

CPU tier: the references themselves (Philox against the Random123 known answers, the sampler's
cut semantics), host-array rejection, the offline compile check. GPU tier (also run on the CPU
emulator): every kernel against its float64 reference with NaN-poisoned outputs, and the device
sampler against the exact host model of its choice and, in distribution, against the host
Sampler of tinylm.
"""
import numpy as np
import pytest

from conftest import DTYPES, EMULATE, assert_close, nan_like, np_dtype, rand_with_outliers, to_device, to_host
from cupyattn import layers as L
from cupyattn import reference as ref
from cupyattn import sampling as S
from cupyattn.kvcache import KVCache


@pytest.fixture
def rng():
    return np.random.default_rng(2468)


# --- CPU: references -----------------------------------------------------------------------------
def test_reference_philox_known_answers():
    """Random123's tests/kat_vectors, "philox4x32 10" lines (counter, key -> output)."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
           ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
           ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
            (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for ctr, key, want in kat:
        assert tuple(int(w) for w in ref.philox4x32(ctr, key)) == want
    u = [ref.sampling_uniform(7, s) for s in range(2000)]
    assert 0.0 <= min(u) and max(u) < 1.0 and abs(np.mean(u) - 0.5) < 0.02


def test_reference_sampling_cuts():
    """The cuts by hand: ties at the k-th value kept; top-p keeps the smallest most-likely set;
    greedy is the first argmax."""
    z = np.array([3.0, 1.0, 2.0, 2.0, 0.5])
    assert set(np.flatnonzero(ref.sampling_probs(z, 1.0, top_k=2))) == {0, 2, 3}
    share = np.exp(z - 3.0) / np.exp(z - 3.0).sum()  # token 0 holds 0.512, tokens 2 and 3 0.188 each
    assert 0.51 < share[0] < 0.52 and set(np.flatnonzero(ref.sampling_probs(z, 1.0, top_p=0.5))) == {0}
    assert set(np.flatnonzero(ref.sampling_probs(z, 1.0, top_p=0.6))) == {0, 2, 3}  # the tie kept whole
    assert ref.sampling_probs(z, 0.0).tolist() == [1, 0, 0, 0, 0]
    assert ref.sample_token(np.array([1.0, 5.0, 5.0]), 0.0) == 1  # greedy: first of the tie


def test_reference_fused_ops_compose_the_unfused_ones(rng):
    x, r, w = rng.standard_normal((3, 8)), rng.standard_normal((3, 8)), rng.standard_normal(8)
    s, h = ref.add_rmsnorm(x, r, w, 1e-5)
    np.testing.assert_allclose(h, ref.rmsnorm(x + r, w, 1e-5))
    b, t, hq, hkv, d = 2, 3, 4, 2, 8
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d))
    kc, vc = np.zeros((b, hkv, 16, d)), np.zeros((b, hkv, 16, d))
    q, k2, v2, lens = ref.qkv_rope_append(qkv, kc, vc, [5, 0], hq, 1e4, "neox", num_new=[3, 1])
    heads = qkv.reshape(b, t, hq + 2 * hkv, d).transpose(0, 2, 1, 3)
    pos = np.array([[5, 6, 7], [0, 1, 2]])
    np.testing.assert_allclose(q, ref.rope(heads[:, :hq], pos, 1e4, "neox"))
    np.testing.assert_allclose(k2[0, :, 5:8], ref.rope(heads[:, hq:hq + hkv], pos, 1e4, "neox")[0])
    np.testing.assert_allclose(v2[1, :, :1], heads[1, hq + hkv:, :1])
    assert lens.tolist() == [8, 1] and not k2[1, :, 1:].any()


def test_rejects_host_arrays():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match=r"add_rmsnorm\(\): x must be a cupy.ndarray"):
        L.add_rmsnorm(x, x, np.ones(8, np.float32))
    with pytest.raises(TypeError, match=r"sample\(\): logits must be a cupy.ndarray"):
        S.sample(x)


@pytest.mark.parametrize("spec", ["kvcache", "sampling"])
def test_compile_check_no_errors_no_spills(compile_report, spec):
    reports, errors = compile_report(spec)
    assert not errors, errors
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]


# --- GPU: argument checks ------------------------------------------------------------------------
def _z(shape, dtype=np.float32):
    import cupy

    return cupy.zeros(shape, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: L.add_rmsnorm(_z((2, 8)), _z((2, 9)), _z(8)), ValueError, r"r has shape \(2, 9\) but x has \(2, 8\)"),
    (lambda: L.add_rmsnorm(_z((2, 8)), _z((2, 8), np.float16), _z(8)), TypeError, "r has dtype float16"),
    (lambda: L.add_rmsnorm(_z((8, 2)).T, _z((2, 8)), _z(8)), ValueError, "x is updated in place"),
    (lambda: (lambda x: L.add_rmsnorm(x, _z((2, 8)), _z(8), out=x))(_z((2, 8))), ValueError, "out overlaps x"),
    (lambda: S.sample(_z((2, 5)), S.SamplingParams(3)), ValueError, "params are for 3 sequences but logits have 2"),
    (lambda: S.sample(_z((2, 5)), out=_z(2)), TypeError, "out has dtype float32"),
    (lambda: S.sample(_z((2, 5)), out=_z(3, np.int32)), ValueError, "out must be a C-contiguous int32 array of 2"),
    (lambda: S.sample(_z((2, 0))), ValueError, "must have 1 to"),
    (lambda: S.SamplingParams(2, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (lambda: S.SamplingParams(2, top_k=-1), ValueError, "top_k must be in"),
    (lambda: S.SamplingParams(2, temperature=float("inf")), ValueError, "temperature must be finite"),
    (lambda: S.SamplingParams(2, seed=-1), ValueError, "seed must be an int"),
    (lambda: S.SamplingParams(2, top_k=[1, 2, 3]), ValueError, "top_k must be a number or 2 numbers"),
])
def test_argument_checks(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.gpu
def test_append_qkv_checks_write_nothing():
    import cupy

    cache = KVCache(2, 2, 2, 8, 16, np.float32)
    cache.append(0, _z((2, 2, 7, 16)), _z((2, 2, 7, 16)))
    before = cupy.asnumpy(cache.lengths).copy()
    qkv = cupy.ones((2, 2, (4 + 4) * 16), dtype=np.float32)
    for call, exc, pattern in [
        (lambda: cache.append_qkv(0, qkv, 4), ValueError, "cache is full: sequence 0 of layer 0 holds 7"),
        (lambda: cache.append_qkv(0, qkv, 3), ValueError, r"expected \[batch=2, T, \(num_heads"),
        (lambda: cache.append_qkv(1, qkv.astype(np.float16), 4), TypeError, "qkv has dtype float16"),
        (lambda: cache.append_qkv(1, qkv, 4, rope_style="gptj"), ValueError, "rope_style='gptj'"),
        (lambda: cache.append_qkv(1, qkv, 4, rope_base=0), ValueError, "rope_base must be finite and > 0"),
        (lambda: cache.append_qkv(1, qkv, 4, num_new=[1, 3]), ValueError, r"num_new\[1\]=3 is outside"),
        (lambda: cache.append_qkv(1, qkv, 4, q_out=_z((2, 4, 2, 15))), ValueError, "q_out has shape"),
        (lambda: cache.check_room([1, 2]), ValueError, "sequence 1 of layer 0 holds 7"),
        (lambda: cache.record_advance(2), ValueError, "cache is full"),
    ]:
        with pytest.raises(exc, match=pattern):
            call()
    assert np.array_equal(cupy.asnumpy(cache.lengths), before)
    assert cache.host_lengths.tolist() == [[7, 7], [0, 0]]
    cache.record_advance([1, 0])  # the host mirror only: nothing is launched
    assert cache.host_lengths.tolist() == [[8, 7], [1, 0]] and np.array_equal(cupy.asnumpy(cache.lengths), before)


# --- GPU: add_rmsnorm, swiglu on packed halves ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 17, 64, 97, 576, 1000, 1500])
@pytest.mark.parametrize("rows", [1, 7])
def test_gpu_add_rmsnorm(rng, dtype, d, rows):
    import cupy

    x, xr = to_device(rand_with_outliers(rng, (rows, d)), dtype)
    r, rr = to_device(rand_with_outliers(rng, (rows, d)), dtype)
    w, wr = to_device(rng.standard_normal(d), dtype)
    # the unfused pair, for a bit-exact comparison: add (rounded to dtype), then rmsnorm
    want_x = L.add(x, r)
    for impl in ("auto", "block"):
        want_h = L.rmsnorm(want_x, w, 1e-5, impl=impl)
        xi = x.copy()
        out = nan_like((rows, d), dtype)
        got_x, got_h = L.add_rmsnorm(xi, r, w, 1e-5, out=out, impl=impl)
        assert got_x is xi and got_h is out
        s, h = ref.add_rmsnorm(xr, rr, wr, 1e-5)
        assert_close(got_x, s, dtype)
        assert_close(got_h, h, dtype)
        assert cupy.array_equal(got_x, want_x) and cupy.array_equal(got_h, want_h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1, 17, 64, 96])
def test_gpu_swiglu_on_packed_halves_reads_in_place(rng, dtype, f):
    gu, gur = to_device(rand_with_outliers(rng, (3, 1, 2 * f), 3.0, outlier_value=8.0), dtype)
    out = nan_like((3, 1, f), dtype)
    if EMULATE:
        import fakecupy

        fakecupy.reset_counters()
    assert L.swiglu(gu[..., :f], gu[..., f:], out=out) is out
    assert_close(out, ref.swiglu(gur[..., :f], gur[..., f:]), dtype)
    if EMULATE:  # one kernel, no copy of either half
        assert fakecupy.counters["kernels"] == 1 and fakecupy.counters["cupy_ops"] == 0
    t = gu.reshape(3, 2 * f)[:, ::-1]  # reversed rows cannot be read as rows: copied first
    assert_close(L.swiglu(t[:, :f], t[:, f:]), ref.swiglu(gur.reshape(3, 2 * f)[:, ::-1][:, :f],
                                                          gur.reshape(3, 2 * f)[:, ::-1][:, f:]), dtype)


# --- GPU: fused rope + append ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
@pytest.mark.parametrize("t,counts,start", [
    (1, None, [0, 5, 60]),         # decode: one block per sequence advances its own length
    (17, [17, 5, 0], [0, 0, 0]),   # ragged prefill (right padding)
    (40, None, [3, 3, 3]),         # two token tiles per sequence: the separate advance kernel
])
def test_gpu_append_qkv(rng, dtype, style, t, counts, start):
    import cupy

    b, hq, hkv, d, max_seq = 3, 4, 2, 32, 64
    cache = KVCache(2, b, hkv, max_seq, d, np_dtype(dtype))
    pre, prer = to_device(rand_with_outliers(rng, (b, hkv, max(start) or 1, d)), dtype)
    if max(start):
        cache.append(1, pre, pre, num_new=start)
    k0, v0 = to_host(cache.k[1]), to_host(cache.v[1])
    qkv, qkvr = to_device(rand_with_outliers(rng, (b, t, (hq + 2 * hkv) * d)), dtype)
    q_out = nan_like((b, hq, t, d), dtype)
    assert cache.append_qkv(1, qkv, hq, rope_base=1e5, rope_style=style, num_new=counts, q_out=q_out) is q_out
    q, kc, vc, lens = ref.qkv_rope_append(qkvr, k0, v0, start, hq, 1e5, style, counts)
    assert_close(q_out, q, dtype)
    assert_close(cache.k[1], kc, dtype)
    assert_close(cache.v[1], vc, dtype)
    assert cupy.asnumpy(cache.lengths[1]).tolist() == lens.tolist() == cache.host_lengths[1].tolist()
    assert not cache.host_lengths[0].any() and not cupy.asnumpy(cache.lengths[0]).any()


# --- GPU: sampling ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_philox_known_answers():
    ctr = np.array([[0, 0, 0, 0], [0xffffffff] * 4, [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344]],
                   dtype=np.uint32)
    key = np.array([[0, 0], [0xffffffff] * 2, [0xa4093822, 0x299f31d0]], dtype=np.uint32)
    got = to_host(S.philox4x32(ctr, key)).astype(np.uint64)
    assert np.array_equal(got, ref.philox4x32(ctr, key))
    assert int(got[0, 0]) == 0x6627e8d5 and int(got[2, 3]) == 0x24126ea1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 17, 1000, 5000])
def test_gpu_greedy_is_argmax_exactly(rng, dtype, v):
    import cupy

    z = np.round(rng.standard_normal((5, v)) * 4) / 4  # coarse values: ties, kept exact in bf16
    z[1, :] = 1.0  # all tied: id 0
    z[2, v // 2] = z[2].max() + 1
    z[3, -1] = z[3].max() + 1
    zd, zr = to_device(z, dtype)
    zr[4, 0] = np.nan  # NaN is never the argmax
    zd[4, 0] = np.nan
    out = cupy.full(5, -7, dtype=cupy.int32)
    params = S.SamplingParams(5, temperature=0.0, top_k=3, seed=1)
    assert S.sample(zd, params, out=out) is out
    safe = np.where(np.isnan(zr), -np.inf, zr)
    want = np.where(safe.max(axis=1) > -np.inf, np.argmax(safe, axis=1), -1)  # V = 1: row 4 is one NaN
    assert to_host(out).astype(int).tolist() == want.tolist()
    assert to_host(params.iparams)[:, 3].tolist() == [1] * 5  # every sequence's step advanced


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sample_equals_its_exact_host_model(rng, dtype):
    """Every draw equals reference.sample_token (the kernel's integer algorithm on the host):
    cuts, fixed-point masses, Philox uniform and inverse CDF, for each setting and seed."""
    import cupy

    b, v = 24, 300
    z, zr = to_device(rng.standard_normal((b, v)) * 3, dtype)
    z[:, :-1:7], zr[:, :-1:7] = z[:, 1::7], zr[:, 1::7]  # a few ties
    for temp, k, p in [(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.8), (0.8, 10, 0.5), (2.0, 299, 0.99)]:
        params = S.SamplingParams(b, temperature=temp, top_k=k, top_p=p, seed=2**40 + 11)
        for step in range(2):  # the second call draws at step 1
            got = to_host(S.sample(z[:, None], params)).astype(int)
            want = [ref.sample_token(zr[i], temp, k, p, seed=2**40 + 11 + i, step=step) for i in range(b)]
            assert got.tolist() == want, (temp, k, p, step)
            allowed = [set(np.flatnonzero(ref.sampling_probs(zr[i], temp, k, p))) for i in range(b)]
            assert all(g in a for g, a in zip(got, allowed))
    tokens = cupy.empty((b, 1), dtype=cupy.int32)  # the same seed and step reproduce the draw
    first = to_host(S.sample(z, S.SamplingParams(b, 1.0, seed=5), out=tokens)).ravel().tolist()
    assert to_host(S.sample(z, S.SamplingParams(b, 1.0, seed=5))).tolist() == first


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temp", [0.0, 1e-50, 0.7, 1e39])
def test_gpu_sample_rows_with_nothing_to_draw_and_infinities(dtype, temp):
    """All NaN, NaN beside -inf, all -inf -> -1; +inf logits share the mass (greedy: the first);
    one finite value among NaN and -inf is always drawn. Expected ids written by hand."""
    import cupy

    nan, inf = np.nan, np.inf
    z = np.array([[nan] * 6, [nan, -inf, nan, -inf, nan, -inf], [-inf] * 6,
                  [1.0, inf, 3.0, inf, nan, -inf], [nan, -inf, nan, 2.5, -inf, nan]])
    zd, _ = to_device(z, dtype)
    for step in range(4):
        out = cupy.full(5, -7, dtype=cupy.int32)
        S.sample(zd, S.SamplingParams(5, temperature=temp, top_k=[0, 2, 0, 3, 1], top_p=0.9, seed=step), out=out)
        got = to_host(out).astype(int).tolist()
        greedy = temp == 0.0 or temp == 1e-50
        assert got[:3] == [-1, -1, -1] and got[4] == 3
        assert got[3] == 1 if greedy else got[3] in (1, 3), got


@pytest.mark.gpu
@pytest.mark.parametrize("temp", [1e39, 8e37])
def test_gpu_sample_logits_further_apart_than_float32(temp):
    """l - l_max overflows float32 (2e38 - -1.5e38): the far token still weighs exp((l - l_max)
    / T) (in the uniform limit as much as any other). 600 rows, seeds s + b: the device
    frequencies follow reference.sampling_probs (tests/tinylm/test_sampling.py holds it to first
    principles)."""
    from test_ops_on_random_shapes import assert_frequencies

    n = 600
    z = np.array([2e38, -1.5e38, 1.0, np.nan, -np.inf, -1.5e38], dtype=np.float32)
    zd, _ = to_device(np.broadcast_to(z, (n, z.size)).astype(np.float64), "float32")
    probs = ref.sampling_probs(z, temp)
    assert probs[1] > 1e-3 and probs[1] == probs[5]
    assert_frequencies(to_host(S.sample(zd, S.SamplingParams(n, temp, seed=77))).astype(int), probs, temp)


@pytest.mark.gpu
@pytest.mark.parametrize("temp,k,p", [(1.0, 0, 1.0), (0.7, 6, 0.9),
                                      pytest.param(1e39, 0, 0.5, marks=pytest.mark.emu_slow)])  # uniform limit
def test_gpu_sample_distribution_matches_host_sampler(temp, k, p):
    """N = 1500 rows of the same logits, seeds s + b: the device frequencies and those of
    tinylm's host Sampler (N draws) both match the float64 distribution within 4.5 standard
    errors per token (fixed seeds: the outcome is deterministic)."""
    from tinylm.sampling import Sampler

    n, v = 1500, 16
    z = np.linspace(-2.0, 2.5, v)[np.random.default_rng(9).permutation(v)].astype(np.float32)
    probs = ref.sampling_probs(z, temp, k, p)
    zd, _ = to_device(np.broadcast_to(z, (n, v)), "float32")
    dev = to_host(S.sample(zd, S.SamplingParams(n, temp, k, p, seed=1234))).astype(int)
    host_sampler = Sampler(temp, k, p, seed=1234)
    host = np.array([host_sampler(z) for _ in range(n)])
    band = 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-9
    for draws in (dev, host):
        freq = np.bincount(draws, minlength=v) / n
        assert (np.abs(freq - probs) <= band).all(), (freq, probs)
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(probs))
