"""CPU tier: the float64 references against NumPy's own ops and against each other."""
import numpy as np
import pytest

from cupyattn import reference as ref
from conftest import rand_with_outliers


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_gemm_against_einsum(rng):
    a = rng.standard_normal((2, 3, 17, 5))
    b = rng.standard_normal((2, 3, 9, 5))
    c = rng.standard_normal((5, 9))
    np.testing.assert_allclose(ref.gemm_nt(a, b), np.einsum("...mk,...nk->...mn", a, b), rtol=1e-12)
    np.testing.assert_allclose(ref.gemm_nn(a, c), np.einsum("...mk,kn->...mn", a, c), rtol=1e-12)


@pytest.mark.parametrize("n", [1, 17, 1000])
def test_softmax_matches_direct_formula(rng, n):
    x = rand_with_outliers(rng, (3, n))
    got = ref.softmax(x, scale=0.5)
    e = np.exp(0.5 * x - np.max(0.5 * x, axis=-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-12)


def test_softmax_causal_bottom_right_and_fully_masked_rows(rng):
    x = rng.standard_normal((2, 5, 3))  # Sq=5 > Sk=3: the first two query rows see no key
    p = ref.softmax(x, causal=True)
    assert np.all(p[:, :2] == 0.0)
    # query i sees keys j <= i + Sk - Sq = i - 2
    for i in range(2, 5):
        np.testing.assert_allclose(p[:, i, i - 1:], 0.0)
        np.testing.assert_allclose(p[:, i].sum(-1), 1.0)
    assert ref.causal_allowed(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def _attention_loop(q, k, v, scale, allowed):
    """Per-row, per-head loop written independently of reference.attention."""
    b, hq, sq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            for i in range(sq):
                keys = np.nonzero(allowed[bi, i])[0]
                if len(keys) == 0:
                    continue
                s = np.array([q[bi, h, i] @ k[bi, h // g, j] * scale for j in keys])
                w = np.exp(s - s.max())
                out[bi, h, i] = (w / w.sum()) @ v[bi, h // g, keys]
    return out


@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (3, 9, True), (9, 4, True), (5, 6, False)])
def test_attention_gqa_causal_and_key_lengths(rng, sq, sk, causal):
    q = rand_with_outliers(rng, (2, 6, sq, 8))
    k = rand_with_outliers(rng, (2, 2, sk, 8))
    v = rng.standard_normal((2, 2, sk, 8))
    kl = np.array([sk, max(sk - 2, 0)])
    allowed = np.broadcast_to(ref.causal_allowed(sq, sk) if causal else np.ones((sq, sk), bool), (2, sq, sk))
    allowed = allowed & (np.arange(sk)[None, None, :] < kl[:, None, None])
    got, lse = ref.attention(q, k, v, causal=causal, scale=0.3, key_lengths=kl, return_lse=True)
    np.testing.assert_allclose(got, _attention_loop(q, k, v, 0.3, allowed), rtol=1e-10, atol=1e-12)
    assert np.all(np.isneginf(lse[~np.broadcast_to(allowed.any(-1)[:, None], lse.shape)]))


def test_attention_additive_mask_equals_minus_inf_mask(rng):
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    mask = np.where(rng.random((4, 4)) < 0.3, -np.inf, 0.0)
    mask[:, 0] = 0.0
    allowed = np.broadcast_to(np.isfinite(mask), (1, 4, 4))
    np.testing.assert_allclose(ref.attention(q, k, v, mask=mask), _attention_loop(q, k, v, 8 ** -0.5, allowed),
                               rtol=1e-10)


@pytest.mark.parametrize("bm,bn", [(1, 1), (16, 16), (64, 32), (7, 13)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,hkv", [(1, 1, 2), (17, 17, 1), (33, 97, 2), (40, 9, 4)])
def test_flash_tiled_equals_naive(rng, bm, bn, causal, sq, sk, hkv):
    q = rand_with_outliers(rng, (2, 4, sq, 16))
    k = rand_with_outliers(rng, (2, hkv, sk, 16))
    v = rng.standard_normal((2, hkv, sk, 16))
    mask = rng.standard_normal((1, 4, sq, sk))
    kl = np.array([sk, sk // 2])
    want, want_lse = ref.attention(q, k, v, causal, None, mask, kl, return_lse=True)
    got, lse = ref.flash_attention_tiled(q, k, v, causal, None, mask, kl, bm, bn, return_lse=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-12)


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_split_kv_merge_equals_unsplit(rng, splits):
    q = rand_with_outliers(rng, (3, 4, 1, 8))
    kc = rand_with_outliers(rng, (3, 2, 20, 8))
    vc = rng.standard_normal((3, 2, 20, 8))
    lengths = np.array([20, 5, 0])  # a short sequence has empty chunks; length 0 -> zeros
    o, lse = ref.decode_split_partials(q, kc, vc, lengths, splits)
    merged, merged_lse = ref.merge_partials(o, lse)
    want, want_lse = ref.attention(q, kc, vc, key_lengths=lengths, return_lse=True)
    np.testing.assert_allclose(merged, want, rtol=1e-10, atol=1e-12)
    assert np.all(merged[2] == 0.0) and np.all(np.isneginf(merged_lse[2]))
    np.testing.assert_allclose(merged_lse[:2], want_lse[:2], rtol=1e-12)


def test_rmsnorm_swiglu_embedding(rng):
    x = rng.standard_normal((3, 7))
    w = rng.standard_normal(7)
    np.testing.assert_allclose(ref.rmsnorm(x, w, 1e-5),
                               x * w / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5), rtol=1e-12)
    g, u = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
    np.testing.assert_allclose(ref.swiglu(g, u), g * u / (1 + np.exp(-g)), rtol=1e-12)
    table = rng.standard_normal((10, 4))
    np.testing.assert_array_equal(ref.embedding(np.array([[3, 0], [9, 3]]), table)[1, 0], table[9])


def test_rope_rotation_properties(rng):
    x = rng.standard_normal((1, 2, 5, 8))
    pos = np.arange(5)[None, :] + 3
    for style in ("adjacent", "neox"):
        y = ref.rope(x, pos, base=100.0, style=style)
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
        np.testing.assert_allclose(ref.rope(x, np.zeros((1, 5)), style=style), x)
    # relative-position property: <rope(q, m), rope(k, n)> depends only on m - n
    q, k = rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8))
    dots = [np.sum(ref.rope(q, [[m + 4]]) * ref.rope(k, [[m]])) for m in (0, 7, 100)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-9)
    # adjacent pair i turns by pos * base^(-2i/D): check pair 1 at position 2 by hand
    y = ref.rope(x, np.full((1, 5), 2), base=100.0)
    ang = 2 * 100.0 ** (-2 / 8)
    np.testing.assert_allclose(y[..., 2], x[..., 2] * np.cos(ang) - x[..., 3] * np.sin(ang), rtol=1e-12)


# --- non-finite inputs: the semantics every kernel follows (docs/api.md "Non-finite values") ------
def test_softmax_nan_propagates_to_visible_and_hidden_positions_stay_zero():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 5, 7))
    clean = ref.softmax(x, causal=True)
    x[0, 4, 2] = np.nan                      # visible to row 4 (sq = 5, sk = 7: row 4 sees keys 0..6)
    x[1, 0, 6] = np.nan                      # hidden from row 0 (it sees keys 0..2)
    y = ref.softmax(x, causal=True)
    assert np.isnan(y[0, 4]).all()           # the whole visible row
    np.testing.assert_array_equal(np.delete(y[0], 4, axis=0), np.delete(clean[0], 4, axis=0))
    np.testing.assert_array_equal(y[1], clean[1])  # a hidden NaN changes nothing
    assert np.all(y[2] == clean[2])
    m = np.zeros((5, 7))
    m[3, 1] = -np.inf                        # a -inf mask hides a NaN score too
    x2 = rng.standard_normal((5, 7))
    x2[3, 1] = np.nan
    y2 = ref.softmax(x2, mask=m)
    assert np.isfinite(y2).all() and y2[3, 1] == 0.0
    np.testing.assert_allclose(y2.sum(-1), 1.0)
    inf_row = ref.softmax(np.array([[np.inf, 1.0, 2.0]]))
    assert np.isnan(inf_row).all()           # exp(inf - inf) is undefined: NaN, as on the device


@pytest.mark.parametrize("tiled", [False, True])
def test_attention_hidden_keys_never_contribute_and_visible_nan_propagates(tiled):
    rng = np.random.default_rng(12)
    b, hq, hkv, sq, sk, d = 2, 4, 2, 6, 9, 8
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    kl = np.array([9, 5])

    def run(q, k, v, **kw):
        f = ref.flash_attention_tiled if tiled else ref.attention
        extra = dict(block_m=4, block_n=3) if tiled else {}
        return f(q, k, v, return_lse=True, **kw, **extra)

    clean, clean_lse = run(q, k, v, causal=True, key_lengths=kl)
    k2, v2 = k.copy(), v.copy()
    k2[1, :, 5:] = np.nan                    # keys past key_lengths[1]: K and V garbage, NaN
    v2[1, :, 5:] = np.nan
    k2[0, :, 8] = np.nan                     # key 8 of batch 0: causally hidden from rows < 5 ...
    out, lse = run(q, k2, v2, causal=True, key_lengths=kl)
    np.testing.assert_array_equal(out[1], clean[1])
    np.testing.assert_array_equal(lse[1], clean_lse[1])
    # ... and visible to row 5 (sq = 6, sk = 9: row i sees j <= i + 3): its NaN score -> NaN row
    assert np.isnan(out[0, :, 5]).all() and np.isnan(lse[0, :, 5]).all()
    np.testing.assert_array_equal(out[0, :, :5], clean[0, :, :5])
    q2 = q.copy()
    q2[0, 1, 2, 3] = np.nan                  # a NaN query touches only its own row
    out, lse = run(q2, k, v, causal=True, key_lengths=kl)
    assert np.isnan(out[0, 1, 2]).all() and np.isnan(lse[0, 1, 2])
    nan_rows = np.zeros(out.shape[:3], dtype=bool)
    nan_rows[0, 1, 2] = True
    np.testing.assert_array_equal(out[~nan_rows], clean[~nan_rows])
