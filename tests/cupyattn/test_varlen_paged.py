"""Serving attention: packed variable-length batches, sliding windows and softcap,
paged KV caches (decode, append, chunked prefill) and PagedKVCache.

CPU tier: the float64 references against independent formulations (plain loops over one query
at a time). GPU tier (also on the CPU emulator, tests/emu): every kernel against those
references on fresh random inputs with outliers, odd lengths (1, 17, 97), shuffled pages, every
dtype, outputs NaN-poisoned before the call; bad inputs raise before anything is written.
"""
import math

import numpy as np
import pytest

from conftest import (DTYPES, assert_close, device_cannot_run, nan_like, np_dtype, rand_with_outliers, to_device,
                      to_host)
from cupyattn import reference as ref

HEAD_DIM = 32  # emulated runs: the smallest head dim keeps the CPU emulator quick


@pytest.fixture
def rng():
    return np.random.default_rng(25)


def _loop_attention(q, k, v, scale, window=(-1, -1), causal=False, softcap=None):
    """One query row at a time, straight from the definitions (independent of reference.py's
    vectorised masks): q [Sq, D], k/v [Sk, D] -> [Sq, D], zeros for a row that sees nothing."""
    sq, sk = len(q), len(k)
    out = np.zeros((sq, v.shape[1]))
    for i in range(sq):
        pos = i + sk - sq  # bottom-right aligned position of query i
        keys = [j for j in range(sk)
                if (not causal or j <= pos) and (window[0] < 0 or j >= pos - window[0])
                and (window[1] < 0 or j <= pos + window[1])]
        if not keys:
            continue
        s = np.array([float(q[i] @ k[j]) * scale for j in keys])
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max())
        out[i] = (p / p.sum()) @ v[keys]
    return out


# --- CPU tier: references ----------------------------------------------------------------------
@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (0, 0), (5, 2), (-1, 4), (2, -1), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_reference_window_softcap_matches_loop(rng, window, causal, softcap):
    q, k, v = (rand_with_outliers(rng, (1, 1, n, 8)) for n in (7, 11, 11))
    got = ref.attention(q, k, v, causal=causal, scale=0.7, window=window, softcap=softcap)[0, 0]
    want = _loop_attention(q[0, 0], k[0, 0], v[0, 0], 0.7, window, causal, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_reference_varlen_and_paged_match_per_sequence_loops(rng):
    lens_q, lens_k, hq, hkv, d, ps = [1, 17, 0, 5], [3, 17, 4, 9], 4, 2, 8, 4
    cq, ck = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q = rand_with_outliers(rng, (cq[-1], hq, d))
    k, v = rand_with_outliers(rng, (ck[-1], hkv, d)), rand_with_outliers(rng, (ck[-1], hkv, d))
    got, lse = ref.attention_varlen(q, k, v, cq, ck, causal=True, window=(4, -1), softcap=3.0, return_lse=True)
    for b in range(4):
        for h in range(hq):
            want = _loop_attention(q[cq[b]:cq[b + 1], h], k[ck[b]:ck[b + 1], h // 2], v[ck[b]:ck[b + 1], h // 2],
                                   1 / math.sqrt(d), (4, -1), True, 3.0)
            np.testing.assert_allclose(got[cq[b]:cq[b + 1], h], want, rtol=1e-10, atol=1e-12)
    assert lse.shape == (hq, cq[-1])
    # the same keys scattered over shuffled pages give the same attention
    pages_per = [-(-n // ps) for n in lens_k]
    perm = rng.permutation(sum(pages_per) + 3)
    table = np.zeros((4, max(pages_per)), dtype=np.int32)
    kp, vp = np.full((len(perm), ps, hkv, d), np.nan), np.full((len(perm), ps, hkv, d), np.nan)
    n = 0
    for b, cnt in enumerate(pages_per):
        for i in range(cnt):
            table[b, i] = perm[n]
            n += 1
        for p in range(lens_k[b]):
            kp[table[b, p // ps], p % ps] = k[ck[b] + p]
            vp[table[b, p // ps], p % ps] = v[ck[b] + p]
    got_p = ref.attention_paged(q, cq, kp, vp, table, lens_k, causal=True, window=(4, -1), softcap=3.0)
    np.testing.assert_allclose(got_p, got, rtol=1e-12, atol=1e-12)


def test_reference_paged_append_writes_rope_rows_at_each_position(rng):
    b, t, hq, hkv, d, ps = 2, 3, 2, 1, 8, 2
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d))
    table = np.array([[3, 0, 5], [1, 4, 2]], dtype=np.int32)
    kp, vp = np.zeros((6, ps, hkv, d)), np.zeros((6, ps, hkv, d))
    q, kp2, vp2, lens = ref.paged_append_qkv(qkv, kp, vp, table, [1, 2], hq, num_new=[3, 1])
    assert lens.tolist() == [4, 3]
    heads = qkv.reshape(b, t, hq + 2 * hkv, d)
    # sequence 0 token 2 is position 3: page table[0, 1] = 0, row 1; v copied as it is
    np.testing.assert_array_equal(vp2[0, 1, 0], heads[0, 2, hq + hkv])
    want_k = ref.rope(heads[0, 2, hq][None, None, None], np.array([[3]]))[0, 0, 0]
    np.testing.assert_allclose(kp2[0, 1, 0], want_k, rtol=1e-12)
    # sequence 1 appends one token (position 2: page 4, row 0); its padding token is not written
    np.testing.assert_array_equal(vp2[4, 0, 0], heads[1, 0, hq + hkv])
    assert np.count_nonzero(np.abs(vp2).sum(axis=(2, 3))) == 4
    np.testing.assert_allclose(q[1, :, 2], ref.rope(heads[1, 2, :hq][None, :, None], np.array([[4]]))[0, :, 0])


def test_window_folding_and_decode_split_rule_input(monkeypatch):
    """causal folds into the window's right side; the decode split rule sees only the keys a
    window leaves (left + 1); plain calls keep the plain kernel, a block table with
    config.DECODE_PAGE_STAGING takes the staged one."""
    from cupyattn import config, decode, splits
    from cupyattn.decode_launch import serving_plan
    from cupyattn.flash_attn import check_window_softcap

    assert check_window_softcap("f", None, None, False) == ((-1, -1), 0.0)
    assert check_window_softcap("f", None, None, True) == ((-1, 0), 0.0)
    assert check_window_softcap("f", (7, 3), 2, True) == ((7, 0), 2.0)
    assert check_window_softcap("f", [2**31, -1], None, False) == ((-1, -1), 0.0)  # beyond any length
    for bad, exc in (((-2, 0), ValueError), ((1,), TypeError), ((1.5, 0), TypeError)):
        with pytest.raises(exc, match="f\\(\\): window"):
            check_window_softcap("f", bad, None, False)
    with pytest.raises(ValueError, match="f\\(\\): softcap must be finite"):
        check_window_softcap("f", None, float("inf"), False)
    sv, plan = serving_plan("f", None, None, "auto", np.float16, 64, 4, "plain-plan")
    assert sv is None and plan == "plain-plan"
    sv, plan = serving_plan("f", (99, -1), None, "auto", np.float16, 64, 4, "plain-plan")
    assert sv.win_left == 99 and plan.expr.endswith(", true>") and plan.impl == "mma"
    monkeypatch.setattr(splits, "sm_count", lambda: 132)
    assert decode.schedule("cost", plan, 1, 2, [5000], None, sv.win_left) == \
        (decode.choose_num_splits(1, 2, 100, 132, config.DECODE_SPLIT_BLOCKS_PER_SM), 0)
    sv, plan = serving_plan("f", None, 30.0, "simt", np.float32, 64, 1, None)
    assert sv.softcap == 30.0 and plan.expr.startswith("decode_kernel<float, 64")
    for staging, tail in ((False, ", true>"), (True, ", true, true>")):
        monkeypatch.setattr(config, "DECODE_PAGE_STAGING", staging)
        sv, plan = serving_plan("f", None, None, "simt", np.float16, 64, 1, None, block_table=np.zeros((2, 3), np.int32),
                                log2_page=4, num_pages=9, layout="HND")
        assert plan.expr.endswith(tail) and sv.layout == "HND" and sv.args()[4] == 1  # page_hnd


def test_softcap_range_is_what_the_kernels_compute():
    """softcap: the kernels cap with C = softcap * log2(e) in float32 (C tanh(s / C),
    -ftz): accepted values give a normal, finite C, and at the largest one only scores below
    2^-25 can flush to 0 in s / C; None and 0 mean off; 1e39 (C = inf: NaN everywhere), 1e-50
    (C subnormal: flushed to 0, the cap silently off) and the rest are refused naming the range."""
    from cupyattn import config
    from cupyattn._checks import check_softcap

    tiny, log2e = np.finfo(np.float32).tiny, math.log2(math.e)
    for v in (config.SOFTCAP_MIN, 1e-30, 0.5, 30, 50.0, np.float32(1e20), config.SOFTCAP_MAX):
        assert check_softcap("f", v) == float(v)
        c = np.float32(float(v) * log2e)
        assert np.isfinite(c) and c >= tiny, v  # a normal float32
    assert float(np.float32(config.SOFTCAP_MAX * log2e)) * float(tiny) < 2.0 ** -25
    assert check_softcap("f", None) == check_softcap("f", 0) == check_softcap("f", 0.0) == 0.0
    for v in (1e39, 1e-50, -1.0, -30, float("nan"), float("inf"), -float("inf"),
              math.nextafter(config.SOFTCAP_MIN, 0), math.nextafter(config.SOFTCAP_MAX, math.inf)):
        with pytest.raises(ValueError, match=r"f\(\): softcap must be finite and in \[2.35e-38, 1.27e\+30\] "
                                             r"\(0 or None: off\), got .*softcap \* log2\(e\) as a normal float32"):
            check_softcap("f", v)
    for v in ("30", True, [30.0]):
        with pytest.raises(TypeError, match=r"f\(\): softcap must be a real number"):
            check_softcap("f", v)


# --- GPU tier: attention(window=, softcap=) and attention_varlen ------------------------------
def _impls(dtype):
    """The fused attention impls to compare: flash, and flash_mma for 16-bit inputs where the device
    runs it at HEAD_DIM (bf16 from sm_80: conftest.device_cannot_run)."""
    mma = dtype != "float32" and not device_cannot_run("attention", "flash_mma", dtype, HEAD_DIM)
    return ["flash"] + (["flash_mma"] if mma else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window,softcap,sq,sk", [
    (False, (5, 3), None, 17, 97), (True, (16, -1), None, 97, 97), (True, (-1, -1), 30.0, 17, 17),
    (False, (0, 0), 5.0, 1, 17), (True, (2, 0), None, 17, 1), (False, (-1, -1), 0.5, 97, 17)])
def test_attention_window_softcap(rng, dtype, causal, window, softcap, sq, sk):
    import cupyattn

    b, hq, hkv, d = 2, 4, 2, HEAD_DIM
    q, k, v = (rand_with_outliers(rng, s) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    if softcap:  # huge scores: the cap, not the max subtraction, has to keep them finite
        q = q * 40.0
    qd, qh = to_device(q, dtype)
    kd, kh = to_device(k, dtype)
    vd, vh = to_device(v, dtype)
    want, wlse = ref.attention(qh, kh, vh, causal=causal, window=window, softcap=softcap, return_lse=True)
    for impl in _impls(dtype):
        out = nan_like((b, hq, sq, d), dtype)
        got, lse = cupyattn.attention(qd, kd, vd, causal=causal, window=window, softcap=softcap, impl=impl,
                                      out=out, return_lse=True)
        assert got is out
        assert_close(got, want, dtype)
        lse = to_host(lse)
        assert np.array_equal(np.isfinite(lse), np.isfinite(wlse)), impl
        np.testing.assert_allclose(lse[np.isfinite(wlse)], wlse[np.isfinite(wlse)], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_that_hides_every_key_gives_zeros(rng, dtype):
    import cupyattn

    # left = 0, right = 0 and Sq > Sk: the first queries' positions are negative, no key there
    q, k, v = (rand_with_outliers(rng, s) for s in ((1, 2, 17, HEAD_DIM), (1, 1, 5, HEAD_DIM), (1, 1, 5, HEAD_DIM)))
    qd, qh = to_device(q, dtype)
    kd, kh = to_device(k, dtype)
    vd, vh = to_device(v, dtype)
    for impl in _impls(dtype):
        got, lse = cupyattn.attention(qd, kd, vd, window=(0, 0), impl=impl, out=nan_like(q.shape, dtype),
                                      return_lse=True)
        got, lse = to_host(got), to_host(lse)
        assert np.all(got[:, :, :12] == 0) and np.all(lse[:, :, :12] == -np.inf), impl
        assert_close(got, ref.attention(qh, kh, vh, window=(0, 0)), dtype)


def _packed(rng, lens_q, lens_k, hq, hkv, d, dtype):
    cq, ck = np.cumsum([0] + lens_q).astype(np.int32), np.cumsum([0] + lens_k).astype(np.int32)
    q, qh = to_device(rand_with_outliers(rng, (int(cq[-1]), hq, d)), dtype)
    k, kh = to_device(rand_with_outliers(rng, (int(ck[-1]), hkv, d)), dtype)
    v, vh = to_device(rand_with_outliers(rng, (int(ck[-1]), hkv, d)), dtype)
    return (q, k, v), (qh, kh, vh), cq, ck


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("causal,window,softcap", [(False, None, None), (True, None, None), (True, (7, -1), 20.0),
                                                   (False, (3, 9), None)])
def test_attention_varlen(rng, dtype, hq, hkv, causal, window, softcap):
    import cupy

    import cupyattn

    lens_q, lens_k = [17, 1, 0, 97, 5], [17, 30, 4, 97, 1]
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens_q, lens_k, hq, hkv, HEAD_DIM, dtype)
    want, wlse = ref.attention_varlen(qh, kh, vh, cq, ck, causal, window=window, softcap=softcap, return_lse=True)
    # host-checked offsets for the first impl, device offsets (used unchecked) for the other, or
    # both when there is one impl
    impls = _impls(dtype)
    runs = [(impls[0], (cq, ck)), (impls[-1], (cupy.asarray(cq), cupy.asarray(ck)))]
    for impl, cu in runs:
        out = nan_like(q.shape, dtype)
        got, lse = cupyattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k), causal=causal,
                                             window=window, softcap=softcap, return_lse=True, out=out,
                                             impl=impl)
        assert got is out
        assert_close(got, want, dtype)
        lse = to_host(lse)
        assert np.array_equal(np.isfinite(lse), np.isfinite(wlse))
        np.testing.assert_allclose(lse[np.isfinite(wlse)], wlse[np.isfinite(wlse)], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1, 40, 111])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_varlen_at_a_head_dim_the_kernels_lack(rng, dtype, d):
    """A D outside HEAD_DIMS runs on copies of q, k, v zero-padded to the next head dim: every fused
    impl, causal with a window and softcap, GQA, lse, out poisoned (exactly its D columns written),
    host and device offsets; q, k, v are read, never written."""
    import cupy

    import cupyattn
    from cupyattn import config

    lens_q, lens_k = [17, 1, 0, 9], [17, 30, 4, 9]
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens_q, lens_k, 4, 2, d, dtype)
    before = [to_host(x).copy() for x in (q, k, v)]
    want, wlse = ref.attention_varlen(qh, kh, vh, cq, ck, True, window=(7, -1), softcap=20.0, return_lse=True)
    mma = dtype != "float32" and not device_cannot_run("attention", "flash_mma", dtype, config.padded_head_dim(d))
    for impl, cu in [(None, (cq, ck)), ("flash", (cupy.asarray(cq), cupy.asarray(ck)))] + \
            ([("flash_mma", (cq, ck))] if mma else []):
        out = nan_like(q.shape, dtype)
        got, lse = cupyattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k), causal=True, window=(7, -1),
                                             softcap=20.0, return_lse=True, out=out, impl=impl)
        assert got is out
        assert_close(got, want, dtype)
        lse = to_host(lse)
        assert np.array_equal(np.isfinite(lse), np.isfinite(wlse))
        np.testing.assert_allclose(lse[np.isfinite(wlse)], wlse[np.isfinite(wlse)], rtol=1e-4, atol=1e-4)
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(to_host(x), x0)


@pytest.mark.gpu
def test_attention_varlen_bad_inputs_raise_before_writing(rng):
    import cupy

    import cupyattn

    (q, k, v), _, cq, ck = _packed(rng, [3, 4], [3, 4], 2, 1, HEAD_DIM, "float16")
    out = nan_like(q.shape, "float16")
    f = cupyattn.attention_varlen
    cases = [
        (TypeError, "cu_seqlens_q must be int32", lambda: f(q, k, v, cupy.asarray(cq, dtype=cupy.int64), ck, 4, 4, out=out)),
        (ValueError, "cu_seqlens_k must start at 0", lambda: f(q, k, v, cq, [0, 3, 6], 4, 4, out=out)),
        (ValueError, "cu_seqlens_q must start at 0", lambda: f(q, k, v, [0, 4, 3, 7], [0, 1, 2, 7], 4, 4, out=out)),
        (ValueError, "max_seqlen_q=3 is less than", lambda: f(q, k, v, cq, ck, 3, 4, out=out)),
        (ValueError, r"window\[0\] must be", lambda: f(q, k, v, cq, ck, 4, 4, window=(-2, 0), out=out)),
        (TypeError, "window must be None or a pair", lambda: f(q, k, v, cq, ck, 4, 4, window=5, out=out)),
        (ValueError, "softcap must be", lambda: f(q, k, v, cq, ck, 4, 4, softcap=-1.0, out=out)),
        (ValueError, "q heads Hq=2 must be a multiple", lambda: f(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1),
                                                                  cq, ck, 4, 4, out=out)),
        (ValueError, "k must be", lambda: f(q, k[None], v[None], cq, ck, 4, 4, out=out)),
        (ValueError, r"k and v have no heads \(Hkv=0", lambda: f(q, k[:, :0], v[:, :0], cq, ck, 4, 4, out=out)),
        (TypeError, "impl='flash_mma' needs", lambda: f(q.astype(cupy.float32), k.astype(cupy.float32),
                                                        v.astype(cupy.float32), cq, ck, 4, 4, impl="flash_mma")),
        (ValueError, "impl", lambda: f(q, k, v, cq, ck, 4, 4, impl="naive", out=out)),
        (ValueError, "out", lambda: f(q, k, v, cq, ck, 4, 4, out=q)),
        (ValueError, r"head_dim D=300 is not supported: the fused kernels take D up to 256",
         lambda: f(*(cupy.zeros((7, 2, 300), q.dtype) for _ in "qkv"), cq, ck, 4, 4)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert bool(cupy.isnan(out).all())  # nothing was written
    with pytest.raises(ValueError, match="attention\\(\\): impl='naive' does not implement softcap= "):
        cupyattn.attention(q[None], k[None], v[None], impl="naive", softcap=1.0)


# --- GPU tier: decode over pages, and window / softcap on both decode paths -------------------
def _shuffled_pages(rng, lens, page_size, hkv, d, dtype, spare=3, layout="NHD"):
    """Pages holding each sequence's keys/values at shuffled page ids (spare pages NaN-filled,
    as are rows past a sequence's length): -> (k_pages, v_pages, table) on the device in
    ``layout`` ("HND": [N, Hkv, page, D]), and the rounded float64 host copies for the reference
    (always NHD [N, page, Hkv, D], the reference's layout)."""
    import cupy

    per = [max(1, -(-n // page_size)) for n in lens]
    n_pages = sum(per) + spare
    perm = rng.permutation(n_pages).astype(np.int32)
    table = np.zeros((len(lens), max(per) + 1), dtype=np.int32)  # one unused column
    kh, vh = np.full((n_pages, page_size, hkv, d), np.nan), np.full((n_pages, page_size, hkv, d), np.nan)
    at = 0
    for b, n in enumerate(lens):
        table[b, :per[b]] = perm[at:at + per[b]]
        at += per[b]
        for p in range(n):
            kh[table[b, p // page_size], p % page_size] = rand_with_outliers(rng, (hkv, d), outliers=1)
            vh[table[b, p // page_size], p % page_size] = rand_with_outliers(rng, (hkv, d), outliers=1)
    table[:, -1] = perm[-1]  # a spare (NaN) page: past every length, so never read
    kd, vd = (cupy.asarray(x.astype(np_dtype(dtype))) for x in (kh, vh))
    kr, vr = to_host(kd), to_host(vd)
    if layout == "HND":
        kd, vd = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kd, vd))
    return kd, vd, cupy.asarray(table), kr, vr, table


def _decode_impls(dtype, group):
    """The decode impls to compare: simt, and mma for 16-bit inputs where the device runs it (bf16
    from sm_80: conftest.device_cannot_run)."""
    return ["simt"] + (["mma"] if dtype != "float32" and not device_cannot_run("decode", "mma", dtype) else [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 1)])
def test_decode_attention_paged(rng, dtype, page_size, hq, hkv):
    import cupy

    import cupyattn

    lens = [17, 1, 0, 97]
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, page_size, hkv, HEAD_DIM, dtype)
    q, qh = to_device(rand_with_outliers(rng, (len(lens), hq, HEAD_DIM)), dtype)
    for window, softcap in [(None, None), ((5, -1), None), ((-1, 0), 3.0)]:
        want = ref.decode_attention_paged(qh, kh, vh, th, lens, window=window, softcap=softcap)
        for impl in _decode_impls(dtype, hq // hkv):
            for splits, sl in [(1, lens), (3, cupy.asarray(lens, dtype=cupy.int32)), (None, lens)]:
                out = nan_like((len(lens), hq, HEAD_DIM), dtype)
                got = cupyattn.decode_attention_paged(q, kd, vd, table, sl, window=window, softcap=softcap,
                                                      num_splits=splits, impl=impl, out=out)
                assert got is out
                assert_close(got, want, dtype)
                assert np.all(to_host(got)[2] == 0)  # the empty sequence


@pytest.fixture
def staging(monkeypatch):
    """Sets config.DECODE_PAGE_STAGING (the staged page-id kernels) for one test."""
    from cupyattn import config

    return lambda on: monkeypatch.setattr(config, "DECODE_PAGE_STAGING", on)


def _layout_cases():
    """(dtype, page size, layout): fp16 (both kernels) at pages 1, 16, 256 in both layouts and one
    case of each other dtype; the rest (and page 4) in the emu_slow set."""
    fast = {("float32", 16, "HND"), ("bfloat16", 256, "NHD")}
    for layout in ("NHD", "HND"):
        for ps in (1, 4, 16, 256):
            for dt in DTYPES:
                slow = (dt, ps, layout) not in fast and (dt != "float16" or ps == 4)
                yield pytest.param(dt, ps, layout, marks=[pytest.mark.emu_slow] if slow else [])


def _check_paged_decode_runs(staging, runs, q, qh, k, v, table, lens, dtype, layout):
    """Each (staged, window, softcap, keyword arguments) run of decode_attention_paged, through
    every decode impl of the group, against the float64 reference; sequence 2 is empty (zeros).
    k, v, table: (device, host) pairs."""
    import cupyattn

    hq, hkv = q.shape[1], k[1].shape[2]  # (the host copies are NHD)
    for staged, window, softcap, kw in runs:
        staging(staged)
        want = ref.decode_attention_paged(qh, k[1], v[1], table[1], lens, window=window, softcap=softcap)
        for impl in _decode_impls(dtype, hq // hkv):
            out = nan_like((len(lens), hq, HEAD_DIM), dtype)
            got = cupyattn.decode_attention_paged(q, k[0], v[0], table[0], lens, window=window, softcap=softcap,
                                                  impl=impl, out=out, layout=layout, **kw)
            assert got is out
            assert_close(got, want, dtype)
            assert np.all(to_host(got)[2] == 0)  # the empty sequence


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,page_size,layout", list(_layout_cases()))
def test_decode_paged_layouts_staged_and_waves(rng, staging, dtype, page_size, layout):
    """Both page layouts over shuffled pages, the page ids looked up per row and staged in shared
    memory (decode.cu STAGED), the "cost" and "waves" split rules, fused and separate combines.
    At pages 1 and 4, 1300 keys in one split take 10 and 3 page-id windows (a window holds
    ring-depth x tile keys' pages), so windows are refreshed while the ring runs."""
    lens = [1300, 17, 0, 300] if page_size <= 4 else [300, 17, 0, 97]
    hq, hkv = 8, 2
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, page_size, hkv, HEAD_DIM, dtype, layout=layout)
    q, qh = to_device(rand_with_outliers(rng, (len(lens), hq, HEAD_DIM)), dtype)
    runs = [  # (staged, window, softcap, keyword arguments)
        (False, None, None, dict(num_splits=3)),
        (True, None, None, dict(num_splits=1)),
        (True, (300, -1), 2.0, dict(num_splits=3)),
        (True, None, None, dict(split_rule="waves", num_splits=4, fused_combine=False)),
        (True, (400, -1), None, dict(split_rule="waves")),
    ]
    _check_paged_decode_runs(staging, runs, q, qh, (kd, kh), (vd, vh), (table, th), lens, dtype, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_paged_mqa_staged_and_waves(rng, staging, layout, page_size):
    """MQA (16 query heads on one kv head: the mma kernel serves the whole group from each K/V
    tile) over shuffled pages in either layout, fp16, both kernels: page ids staged under the
    "waves" rule's own count (the 530-key sequence split, the others one block each), a fixed
    count with a window, softcap and the separate combine, and per-row page ids with softcap."""
    lens, hq, hkv, dt = [530, 17, 0, 97], 16, 1, "float16"
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, page_size, hkv, HEAD_DIM, dt, layout=layout)
    q, qh = to_device(rand_with_outliers(rng, (len(lens), hq, HEAD_DIM)), dt)
    runs = [  # (staged, window, softcap, keyword arguments)
        (True, None, None, dict(split_rule="waves")),
        (True, (200, -1), 3.0, dict(split_rule="waves", num_splits=3, fused_combine=False)),
        (False, None, 2.0, dict(split_rule="waves", num_splits=2)),
    ]
    _check_paged_decode_runs(staging, runs, q, qh, (kd, kh), (vd, vh), (table, th), lens, dt, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_window_softcap_contiguous_cache(rng, dtype):
    import cupyattn

    b, hq, hkv, lens = 3, 8, 2, [97, 1, 40]
    cache = cupyattn.KVCache(1, b, hkv, 128, HEAD_DIM, np_dtype(dtype))
    k, kh = to_device(rand_with_outliers(rng, (b, hkv, 97, HEAD_DIM)), dtype)
    v, vh = to_device(rand_with_outliers(rng, (b, hkv, 97, HEAD_DIM)), dtype)
    cache.append(0, k, v, num_new=lens)
    q, qh = to_device(rand_with_outliers(rng, (b, hq, 1, HEAD_DIM)) * 20.0, dtype)  # huge scores
    for window, softcap in [((0, -1), None), ((30, 5), 2.0), (None, 50.0)]:
        want = ref.attention(qh, kh, vh, key_lengths=lens, window=None, softcap=softcap,
                             mask=_left_window_mask(lens, 97, window))
        for impl in _decode_impls(dtype, hq // hkv):
            for splits in (1, 4):
                out = nan_like((b, hq, 1, HEAD_DIM), dtype)
                got = cupyattn.decode_attention(q, cache, 0, num_splits=splits, impl=impl, out=out,
                                                window=window, softcap=softcap)
                assert_close(got, want, dtype)


def _left_window_mask(lens, sk, window):
    """Additive mask [B, 1, 1, Sk]: the decode query of sequence b (position lens[b] - 1) sees
    keys j >= lens[b] - 1 - left."""
    m = np.zeros((len(lens), 1, 1, sk))
    if window is not None and window[0] >= 0:
        for b, n in enumerate(lens):
            m[b, ..., :max(n - 1 - window[0], 0)] = -np.inf
    return m


# --- GPU tier: PagedKVCache and chunked prefill over pages --------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,page_size,layout", [
    pytest.param(dt, ps, lay, marks=[pytest.mark.emu_slow] if lay == "HND" and (dt, ps) != ("float16", 16) else [])
    for lay in ("NHD", "HND") for ps in (1, 16) for dt in DTYPES])
def test_paged_cache_prefill_decode_free_reuse(rng, dtype, page_size, layout):
    """Chunked prefill (two chunks, ragged), then decode steps, against the reference of every
    step; then a slot is freed and a new prompt reuses its pages. Both page layouts (the
    appends with RoPE, the prefill and the decode kernels all follow the cache's)."""
    import cupy

    import cupyattn

    b, hq, hkv, d = 3, 4, 2, HEAD_DIM
    cache = cupyattn.PagedKVCache(2, b, hkv, d, num_pages=64, page_size=page_size, dtype=np_dtype(dtype),
                                  max_pages_per_seq=128 // page_size, layout=layout)
    as_nhd = (lambda x: x) if layout == "NHD" else (lambda x: x.transpose(0, 2, 1, 3))
    kh = np.zeros((64, page_size, hkv, d))
    vh = np.zeros_like(kh)
    lens = np.zeros(b, dtype=np.int64)
    for chunk in ([17, 1, 5], [4, 0, 9], [1, 1, 1], [1, 1, 1]):
        t = max(chunk)
        qkv, qkvh = to_device(rand_with_outliers(rng, (b, t, (hq + 2 * hkv) * d)), dtype)
        q = cache.append_qkv(1, qkv, hq, rope_base=100.0, num_new=chunk)
        th = cache.host_table.copy()
        qw, kh, vh, lens = ref.paged_append_qkv(qkvh, kh, vh, th, lens, hq, base=100.0, num_new=chunk)
        assert_close(as_nhd(cache.k[1]), np.where(np.isnan(kh), 0, kh), dtype)
        assert_close(as_nhd(cache.v[1]), np.where(np.isnan(vh), 0, vh), dtype)
        # chunked prefill over the pages: each sequence's new queries, packed
        cu = np.cumsum([0] + chunk).astype(np.int32)
        packed = cupy.concatenate([q[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(chunk)])
        packed_h = np.concatenate([qw[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(chunk)])
        want = ref.attention_paged(_rounded(packed_h, dtype), cu, kh, vh, th, lens, causal=True)
        for impl in _impls(dtype):
            out = nan_like(packed.shape, dtype)
            got = cupyattn.attention_paged(packed, cache.k[1], cache.v[1], cache.block_table, cache.lengths[1],
                                           cu_seqlens_q=cu, max_seqlen_q=t, causal=True, impl=impl, out=out,
                                           layout=cache.layout)
            assert_close(got, want, dtype)
        if t == 1:  # a decode step: the paged decode kernel on the same cache
            got = cache.decode(q[:, :, 0], 1, num_splits=2)
            want = ref.decode_attention_paged(_rounded(qw[:, :, 0], dtype), kh, vh, th, lens)
            assert_close(got, want, dtype)
    assert cache.seq_lengths(1).tolist() == lens.tolist() and cache.seq_lengths(0).tolist() == [0, 0, 0]
    used = sum(len(cache.pages_of(i)) for i in range(b))
    assert used == sum(-(-int(n) // page_size) for n in lens) and cache.free_pages == 64 - used
    freed = cache.pages_of(0)
    cache.free(0)
    assert cache.seq_lengths(1)[0] == 0 and int(cache.lengths[1, 0]) == 0 and cache.free_pages == 64 - used + len(freed)
    qkv, _ = to_device(rng.standard_normal((b, 1, (hq + 2 * hkv) * d)), dtype)
    cache.append_qkv(1, qkv, hq, num_new=[1, 0, 0])
    assert cache.pages_of(0)[0] in freed  # the new prompt took a freed page


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_paged_dense_queries(rng, dtype, layout):
    """q [B, Hq, Sq, D] (every sequence added Sq tokens, the last of its seq_lens keys) over
    shuffled pages of 4 tokens in either layout, with a window and softcap; lse [B, Hq, Sq]."""
    import cupyattn

    lens, sq, hq, hkv = [17, 5, 40], 5, 6, 3
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, 4, hkv, HEAD_DIM, dtype, layout=layout)
    q, qh = to_device(rand_with_outliers(rng, (3, hq, sq, HEAD_DIM)), dtype)
    cu = np.arange(4) * sq
    want, wlse = ref.attention_paged(qh.transpose(0, 2, 1, 3).reshape(-1, hq, HEAD_DIM), cu, kh, vh, th, lens,
                                     causal=True, window=(6, -1), softcap=4.0, return_lse=True)
    want = want.reshape(3, sq, hq, HEAD_DIM).transpose(0, 2, 1, 3)
    wlse = wlse.reshape(hq, 3, sq).transpose(1, 0, 2)
    for impl in _impls(dtype):
        out = nan_like(q.shape, dtype)
        got, lse = cupyattn.attention_paged(q, kd, vd, table, lens, causal=True, window=(6, -1), softcap=4.0,
                                            return_lse=True, out=out, impl=impl, layout=layout)
        assert got is out
        assert_close(got, want, dtype)
        np.testing.assert_allclose(to_host(lse), wlse, rtol=1e-4, atol=1e-4)


def _rounded(x, dtype):
    return np.asarray(np.asarray(x).astype(np_dtype(dtype)), dtype=np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_cache_out_of_pages_writes_nothing(rng, layout):
    import cupy

    import cupyattn

    cache = cupyattn.PagedKVCache(1, 2, 2, HEAD_DIM, num_pages=3, page_size=4, dtype=np.float16, layout=layout)
    assert cache.k.shape == ((1, 3, 4, 2, HEAD_DIM) if layout == "NHD" else (1, 3, 2, 4, HEAD_DIM))
    k, kh = to_device(rng.standard_normal((2, 2, 5, HEAD_DIM)), "float16")
    v, vh = to_device(rng.standard_normal((2, 2, 5, HEAD_DIM)), "float16")
    cache.append(0, k, v, num_new=[5, 0])  # two pages for slot 0: positions 0-3, then 4
    pages = cache.pages_of(0)
    assert len(pages) == 2 and cache.seq_lengths(0).tolist() == [5, 0]
    for p in range(5):  # each position's row of its page, through the device table
        page = int(cache.block_table[0, p // 4])
        assert page == pages[p // 4]
        for h in range(2):
            at = (0, page, p % 4, h) if layout == "NHD" else (0, page, h, p % 4)
            np.testing.assert_array_equal(to_host(cache.k[at]), kh[0, h, p])
            np.testing.assert_array_equal(to_host(cache.v[at]), vh[0, h, p])
    before = cache.k.copy(), cache.lengths.copy(), cache.host_table.copy()
    with pytest.raises(ValueError, match="out of pages: slot 1 needs 2 more page"):
        cache.append(0, k, k, num_new=[0, 5])
    assert bool((cache.k == before[0]).all()) and bool((cache.lengths == before[1]).all())
    assert (cache.host_table == before[2]).all() and cache.free_pages == 1
    with pytest.raises(ValueError, match="cache is full"):
        cupyattn.PagedKVCache(1, 1, 1, HEAD_DIM, 4, 4, np.float16, max_pages_per_seq=1).check_room(5)


def _cache_state(cache):
    """Everything a refused append must leave byte for byte as it was: the lengths (host and
    device) and, for a PagedKVCache, the allocator (free list, pages per slot) and both tables."""
    state = [cache.host_lengths.tobytes(), to_host(cache.lengths).tobytes()]
    if hasattr(cache, "block_table"):
        state += [list(cache._free), [list(p) for p in cache._pages], cache.host_table.tobytes(),
                  to_host(cache.block_table).tobytes()]
    return state


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("method", ["append", "append_qkv"])
def test_refusal_at_every_stage_takes_nothing(rng, monkeypatch, paged, method):
    """Allocation after validation: a refusal injected at each stage of an
    append (arguments, capacity, free pages, launch limits, kernel build, the launch, the length
    advance's launch) leaves the lengths, the page allocator and the block tables byte for byte
    as they were; the same call then succeeds and takes exactly the pages it needs."""
    import cupy

    import cupyattn
    from cupyattn import _checks, kvcache

    b, hq, hkv, d, ps = 2, 4, 2, HEAD_DIM, 4
    if paged:  # 5 pages of 4 tokens, at most 4 per slot; slot 0 holds 5 tokens (2 pages): 3 free
        cache = cupyattn.PagedKVCache(1, b, hkv, d, num_pages=5, page_size=ps, dtype=np.float16, max_pages_per_seq=4)
    else:
        cache = cupyattn.KVCache(1, b, hkv, 16, d, np.float16)
    first, _ = to_device(rng.standard_normal((b, hkv, 5, d)), "float16")
    cache.append(0, first, first, num_new=[5, 0])
    t, counts = 12, [4, 5]  # the call under test: slot 0 -> 9 tokens (+1 page), slot 1 -> 5 (+2 pages)
    kv, _ = to_device(rng.standard_normal((b, hkv, t, d)), "float16")
    qkv, _ = to_device(rng.standard_normal((b, t, (hq + 2 * hkv) * d)), "float16")

    def call(num_new=counts, dtype=None):
        if method == "append":
            x = kv if dtype is None else kv.astype(dtype)
            return cache.append(0, x, kv, num_new=num_new)
        x = qkv if dtype is None else qkv.astype(dtype)
        return cache.append_qkv(0, x, hq, num_new=num_new)

    def raising(what):
        def f(*a, **k):
            raise RuntimeError(f"injected {what}")
        return f

    real = kvcache.get_function
    stages = [("arguments", TypeError, "has dtype float32", {"dtype": np.float32}, None),
              ("capacity", ValueError, "cache is full", {"num_new": [12, 0]}, None)]
    if paged:
        stages.append(("pages", ValueError, "out of pages: slot 0 needs 2 more", {"num_new": [11, 12]}, None))
    stages += [("launch limits", ValueError, "would need a grid y of 2 blocks, outside \\[1, 1\\]", {},
                lambda m: m.setattr(_checks, "MAX_GRID_YZ", 1)),
               ("kernel build", RuntimeError, "injected build", {},
                lambda m: m.setattr(kvcache, "get_function", raising("build"))),
               ("launch", RuntimeError, "injected launch", {},
                lambda m: m.setattr(kvcache, "get_function", lambda *a, **k: raising("launch")))]
    if method == "append":  # the append kernel ran, its length advance's launch fails
        stages.append(("advance launch", RuntimeError, "injected advance", {}, lambda m: m.setattr(
            kvcache, "get_function",
            lambda spec, expr, **k: raising("advance") if expr == "kv_advance_lengths_kernel" else real(spec, expr, **k))))
    before = _cache_state(cache)
    for stage, exc, msg, kw, inject in stages:
        with monkeypatch.context() as m:
            if inject:
                inject(m)
            with pytest.raises(exc, match=msg):
                call(**kw)
        assert _cache_state(cache) == before, f"a refusal at the {stage} stage changed the cache"
    call()
    assert cache.seq_lengths(0).tolist() == [9, 5] and to_host(cache.lengths).tolist() == [[9, 5]]
    if paged:
        pages = [cache.pages_of(0), cache.pages_of(1)]
        assert [len(p) for p in pages] == [3, 2] and cache.free_pages == 0
        assert sorted(pages[0] + pages[1]) == list(range(5))
        assert to_host(cache.block_table)[:, :3].tolist() == cache.host_table[:, :3].tolist()


@pytest.mark.gpu
def test_paged_bad_inputs_raise_before_writing(rng):
    import cupy

    import cupyattn

    kd, vd, table, *_ = _shuffled_pages(rng, [5, 9], 4, 2, HEAD_DIM, "float16")
    q = cupy.zeros((2, 4, HEAD_DIM), dtype=cupy.float16)
    out = nan_like((2, 4, HEAD_DIM), "float16")
    f = cupyattn.decode_attention_paged
    cases = [
        (ValueError, "page_size .* power of two", lambda: f(q, kd[:, :3].copy(), vd[:, :3].copy(), table, [5, 9], out=out)),
        (TypeError, "block_table", lambda: f(q, kd, vd, table.astype(cupy.int64), [5, 9], out=out)),
        (ValueError, "block_table has 1 rows", lambda: f(q, kd, vd, table[:1], [5, 9], out=out)),
        (ValueError, "seq_lens max 99 exceeds", lambda: f(q, kd, vd, table, [5, 99], out=out)),
        (ValueError, "seq_lens must be >= 0", lambda: f(q, kd, vd, table, [5, -1], out=out)),
        (ValueError, "seq_lens must have shape", lambda: f(q, kd, vd, table, [5], out=out)),
        (TypeError, "k_pages has dtype", lambda: f(q, kd.astype(cupy.float32), vd, table, [5, 9], out=out)),
        (ValueError, "q heads Hq=3", lambda: f(q[:, :3], kd, vd, table, [5, 9])),
        (ValueError, "C-contiguous", lambda: f(q, kd[:, ::2], vd[:, ::2], table, [5, 9], out=out)),
        (ValueError, "num_splits", lambda: f(q, kd, vd, table, [5, 9], num_splits=0, out=out)),
        (ValueError, r"window\[0\]", lambda: f(q, kd, vd, table, [5, 9], window=(-3, 0), out=out)),
        (ValueError, "out", lambda: f(q, kd, vd, table, [5, 9], out=q[:, :, :8])),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert bool(cupy.isnan(out).all())
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        cupyattn.PagedKVCache(1, 1, 1, HEAD_DIM, 4, 3, np.float16)
    with pytest.raises(ValueError, match="seq_lens must be >= Sq=4"):
        cupyattn.attention_paged(q[:, :, None].repeat(4, axis=2), kd, vd, table, [5, 3])
    paged = cupyattn.PagedKVCache(1, 2, 2, HEAD_DIM, 4, 4, np.float16)
    with pytest.raises(TypeError, match="decode_attention\\(\\): cache is a PagedKVCache"):
        cupyattn.decode_attention(q[:, :, None], paged, 0)
    with pytest.raises(TypeError, match="rmsnorm_qkv_rope_append\\(\\): cache must be a cupyattn.KVCache \\(contiguous\\)"):
        cupyattn.fused.rmsnorm_qkv_rope_append(cupy.zeros((2, 64), cupy.float16), cupy.ones(64, cupy.float16),
                                               cupy.zeros((8 * HEAD_DIM, 64), cupy.float16), paged, 0, 4)
    with pytest.raises(IndexError, match="slot 5 is out of range"):
        cupyattn.PagedKVCache(1, 2, 1, HEAD_DIM, 4, 4, np.float16).free(5)


# --- benchmark rows (the CLI end to end on a tiny case) -----------------------------------------
@pytest.mark.gpu
def test_benchmark_rows_paged_decode_and_varlen(tmp_path, monkeypatch, capsys):
    import conftest
    from benchmarks import report, timing
    from benchmarks.__main__ import main

    if conftest.EMULATE:  # the ceilings are GB-sized copies and GEMMs
        monkeypatch.setattr(timing, "measure_ceilings", lambda **kw: {"copy_gbps": 1.0, "gemm_tflops": 1.0})
    for argv, impls in ((["decode", "--B", "2", "--H", "8", "--Hkv", "2", "--Sk", "256", "--D", "32"],
                         ("split-kv", "paged-16", "paged-1", "paged-256")),
                        # a ragged batch (lengths 128 .. 256 from seed 5) through the opt-in paths
                        (["decode", "--B", "3", "--H", "8", "--Hkv", "2", "--Sk", "256", "--D", "32", "--ragged", "5"],
                         ("split-kv-waves", "naive", "paged-staged-16", "paged-hnd-1", "paged-hnd-waves-16")),
                        (["attention", "--B", "2", "--H", "4", "--Hkv", "2", "--Sq", "33", "--D", "32", "--causal"],
                         ("flash", "varlen"))):
        out = tmp_path / f"{argv[0]}.json"
        rc = main(argv + ["--impl", ",".join(impls), "--reps", "2", "--warmup", "1", "--no-progress",
                          "--json", str(out)])
        assert rc == 0, capsys.readouterr().err[-3000:]
        by = {x["impl"]: x for x in report.read_json(out)["records"]}
        for impl in impls:
            assert by[impl]["status"] == "ok" and by[impl]["rel_err"] < 1e-2, by[impl]


# --- GPU tier: property tests (hypothesis, derandomised as tests/cupyattn/test_ops_on_random_shapes.py) -------------
def _property_settings(n):
    from hypothesis import HealthCheck, settings

    return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _serving_case():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "seed": st.integers(0, 2**32 - 1),
        "dtype": st.sampled_from(DTYPES),
        "mma": st.booleans(),
        "lens_q": st.lists(st.integers(0, 40), min_size=1, max_size=4),
        "extra_k": st.lists(st.integers(0, 30), min_size=4, max_size=4),
        "heads": st.sampled_from([(1, 1), (4, 2), (6, 1), (3, 3)]),
        "causal": st.booleans(),
        "window": st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))),
        "softcap": st.one_of(st.none(), st.floats(0.5, 50.0)),
        "page": st.sampled_from([1, 2, 4, 16, 256]),
    })


@pytest.mark.gpu
def test_property_varlen_and_paged_prefill():
    """Random packed batches: attention_varlen over packed keys, and attention_paged over the
    same keys in shuffled pages, both equal to the reference (rows past every key: zeros)."""
    from hypothesis import given

    @_property_settings(25)
    @given(_serving_case())
    def run(c):
        import cupyattn

        rng = np.random.default_rng(c["seed"])
        dt = c["dtype"]
        impl = "flash_mma" if c["mma"] and dt != "float32" and not device_cannot_run("attention", "flash_mma", dt, HEAD_DIM) \
            else "flash"
        hq, hkv = c["heads"]
        lens_q = c["lens_q"]
        lens_k = [n + e for n, e in zip(lens_q, c["extra_k"])]  # the new queries are the last keys
        (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens_q, lens_k, hq, hkv, HEAD_DIM, dt)
        kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
        want = ref.attention_varlen(qh, kh, vh, cq, ck, **kw)
        out = nan_like(q.shape, dt)
        cupyattn.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), out=out, impl=impl, **kw)
        if want.size:
            assert_close(out, want, dt)
        kd, vd, table, kph, vph, th = _shuffled_pages(rng, lens_k, c["page"], hkv, HEAD_DIM, dt)
        want = ref.attention_paged(qh, cq, kph, vph, th, lens_k, **kw)
        out = nan_like(q.shape, dt)
        cupyattn.attention_paged(q, kd, vd, table, lens_k, cu_seqlens_q=cq, max_seqlen_q=max(lens_q), out=out,
                                 impl=impl, **kw)
        if want.size:
            assert_close(out, want, dt)

    run()


@pytest.mark.gpu
def test_property_paged_decode():
    """Random paged decode: lengths 0 to 70, page sizes 1 to 256, splits, windows, softcap, both
    page layouts, page ids per row or staged, both split rules."""
    from hypothesis import given
    from hypothesis import strategies as st

    from cupyattn import config

    @_property_settings(40)
    @given(_serving_case(), st.sampled_from([None, 1, 2, 5]), st.sampled_from(["NHD", "HND"]), st.booleans(),
           st.sampled_from(["cost", "waves"]))
    def run(c, splits, layout, staged, rule):
        import cupyattn

        rng = np.random.default_rng(c["seed"])
        dt = c["dtype"]
        impl = "mma" if c["mma"] and dt != "float32" and not device_cannot_run("decode", "mma", dt) else "simt"
        hq, hkv = c["heads"]
        lens = [n + e for n, e in zip(c["lens_q"], c["extra_k"])]
        kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, c["page"], hkv, HEAD_DIM, dt, layout=layout)
        q, qh = to_device(rand_with_outliers(rng, (len(lens), hq, HEAD_DIM)), dt)
        want = ref.decode_attention_paged(qh, kh, vh, th, lens, window=c["window"], softcap=c["softcap"])
        out = nan_like(q.shape, dt)
        before, config.DECODE_PAGE_STAGING = config.DECODE_PAGE_STAGING, staged
        try:
            cupyattn.decode_attention_paged(q, kd, vd, table, lens, window=c["window"], softcap=c["softcap"],
                                            num_splits=splits, impl=impl, out=out, layout=layout, split_rule=rule)
        finally:
            config.DECODE_PAGE_STAGING = before
        assert_close(out, want, dt)

    run()


# --- GPU tier: a captured decode step over a PagedKVCache (how tinylm would use it) --------------
@pytest.mark.gpu
@pytest.mark.parametrize("opt_in", [False, True], ids=["defaults", "hnd-staged-waves"])
def test_paged_decode_step_replays_from_a_cuda_graph(rng, staging, opt_in):
    """append_qkv (one token per slot, lengths advanced in the kernel) + decode_attention_paged
    (fixed splits, a workspace) captured once, replayed for 6 steps: check_room(1) before each
    replay takes a new page when a slot crosses a page boundary (the table changes in place),
    record_advance(1) after. Each step equals the reference chain. opt_in: the HND layout, staged
    page ids and the "waves" rule (per-sequence chunks fixed at capture, the fused combine's
    counters in the workspace), the paths that are not yet the defaults."""
    import cupy

    import cupyattn

    b, hq, hkv, d, ps, dt = 2, 4, 2, HEAD_DIM, 4, "float16"
    staging(opt_in)
    cache = cupyattn.PagedKVCache(1, b, hkv, d, num_pages=16, page_size=ps, dtype=np.float16,
                                  layout="HND" if opt_in else "NHD")
    prompt, _ = to_device(rng.standard_normal((b, 3, (hq + 2 * hkv) * d)), dt)
    cache.append_qkv(0, prompt, hq, num_new=[3, 2])  # slot 1 starts one token shorter
    kh = np.zeros((16, ps, hkv, d))
    vh = np.zeros_like(kh)
    _, kh, vh, lens = ref.paged_append_qkv(to_host(prompt), kh, vh, cache.host_table.copy(), [0, 0], hq,
                                           num_new=[3, 2])
    qkv = cupy.zeros((b, 1, (hq + 2 * hkv) * d), dtype=cupy.float16)
    q_buf = cupy.empty((b, hq, 1, d), dtype=cupy.float16)
    out = cupy.empty((b, hq, d), dtype=cupy.float16)
    ws = (cupy.zeros((2, b, hq, d), dtype=cupy.float32), cupy.zeros((2, b, hq), dtype=cupy.float32),
          cupy.zeros((b, hq), dtype=cupy.uint32))
    cache.check_room(1)
    mirror = cache.host_lengths.copy()
    stream = cupy.cuda.Stream()
    with stream:
        stream.begin_capture()
        cache.append_qkv(0, qkv, hq, q_out=q_buf)
        cupyattn.decode_attention_paged(q_buf[:, :, 0], cache.k[0], cache.v[0], cache.block_table, cache.lengths[0],
                                        num_splits=2, out=out, workspace=ws, layout=cache.layout,
                                        split_rule="waves" if opt_in else "cost")
        graph = stream.end_capture()
    cache.host_lengths[...] = mirror  # capturing ran nothing on the device
    for step in range(6):
        new = rng.standard_normal(qkv.shape)
        with stream:
            qkv.set(new.astype(np.float16))
        cache.check_room(1)
        graph.launch(stream)
        stream.synchronize()
        cache.record_advance(1)
        qw, kh, vh, lens = ref.paged_append_qkv(_rounded(new, dt), kh, vh, cache.host_table.copy(), lens, hq)
        assert cache.seq_lengths(0).tolist() == lens.tolist() == [4 + step, 3 + step]
        want = ref.decode_attention_paged(_rounded(qw[:, :, 0], dt), kh, vh, cache.host_table, lens)
        assert_close(out, want, dt)
    assert [len(cache.pages_of(i)) for i in range(b)] == [3, 2]  # 9 and 8 tokens in pages of 4
    assert not to_host(ws[2]).any()  # the fused combine leaves its counters at zero
