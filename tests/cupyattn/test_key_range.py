"""The key range of a query tile (kernels_cu/flash_attn.cu key_range, shared by the SIMT and
tensor-core kernels) at its edge: a window whose left side, at a tile's first row, lies at or past
the last key the tile may see (key lengths, or a packed sequence with more queries than keys).
Such a tile sees no key: its rows are zeros with lse -inf, and the other tiles are unchanged,
against the float64 reference, for every impl that takes windows.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_close, device_cannot_run, nan_like, rand_with_outliers, to_device, to_host
from cupyattn import reference as ref

SETUP = {"flash": ("float32", 32), "flash_mma": ("float16", 32), "wgmma_persistent": ("float16", 64)}


def _lse_close(got, want):
    got = to_host(got)
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), "rows that see no key differ"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", list(SETUP))
def test_window_starting_past_the_last_visible_key(impl):
    import cupyattn

    dtype, d = SETUP[impl]
    if why := device_cannot_run("attention", impl, dtype, d):
        pytest.skip(why)
    rng = np.random.default_rng(58)
    # 150 queries: two or three query tiles; sequence 0 sees keys [0, 5) only, so from row 7 on its
    # window (left 2) starts past them: whole tiles with an empty key range
    s, window = 150, (2, 0)
    q, qh = to_device(rand_with_outliers(rng, (2, 2, s, d)), dtype)
    k, kh = to_device(rand_with_outliers(rng, (2, 1, s, d)), dtype)
    v, vh = to_device(rng.standard_normal((2, 1, s, d)), dtype)
    out = nan_like((2, 2, s, d), dtype)
    o, lse = cupyattn.attention(q, k, v, causal=True, window=window, key_lengths=[5, s], impl=impl,
                                return_lse=True, out=out)
    want, want_lse = ref.attention(qh, kh, vh, causal=True, window=window, key_lengths=[5, s], return_lse=True)
    assert not np.isfinite(want_lse[0, :, 7:]).any() and np.isfinite(want_lse[1]).all()
    assert_close(o, want, dtype)
    _lse_close(lse, want_lse)

    # packed: the second sequence has 140 queries and 6 keys (bottom-right: its first 134 rows see none)
    lq, lk = [10, 140], [30, 6]
    cq, ck = np.cumsum([0] + lq).astype(np.int32), np.cumsum([0] + lk).astype(np.int32)
    qv, qvh = to_device(rand_with_outliers(rng, (sum(lq), 2, d)), dtype)
    kv, kvh = to_device(rand_with_outliers(rng, (sum(lk), 1, d)), dtype)
    vv, vvh = to_device(rng.standard_normal((sum(lk), 1, d)), dtype)
    o, lse = cupyattn.attention_varlen(qv, kv, vv, cq, ck, max(lq), max(lk), causal=True, window=(3, 0), impl=impl,
                                       return_lse=True, out=nan_like(qv.shape, dtype))
    want, want_lse = ref.attention_varlen(qvh, kvh, vvh, cq, ck, True, None, (3, 0), None, True)
    assert_close(o, want, dtype)
    _lse_close(lse, want_lse)
