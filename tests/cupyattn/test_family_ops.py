"""The kernels the model families added (cupyattn.layers: bias_add, geglu, softcap, head_rmsnorm;
KVCache.append_qkv's rope_freq_div) against the float64 reference, every dtype, odd sizes,
outliers, outputs poisoned; and their argument checks."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, assert_close, nan_like, rand_with_outliers, to_device, to_host
from cupyattn import reference as ref

pytestmark = pytest.mark.gpu


@pytest.fixture
def rng():
    return np.random.default_rng(61)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1), (17, 97), (3, 256)])
def test_bias_add_on_rows_of_a_wider_buffer(rng, dtype, rows, n):
    import cupy

    from cupyattn import layers as L

    buf, buf64 = to_device(rand_with_outliers(rng, (rows, n + 13)), dtype)
    bias, bias64 = to_device(rng.standard_normal(n), dtype)
    x = buf[:, 5:5 + n]  # rows n + 13 apart: the q|k|v columns of a packed projection
    assert L.bias_add(x, bias) is x
    want = buf64.copy()
    want[:, 5:5 + n] += bias64
    assert_close(buf, want, dtype)
    with pytest.raises(ValueError, match=r"bias_add\(\): bias must be C-contiguous of shape"):
        L.bias_add(x, bias[:-1] if n > 1 else cupy.zeros(2, bias.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 97), (2, 3, 256)])
def test_geglu_against_reference(rng, dtype, shape):
    from cupyattn import layers as L

    gu, gu64 = to_device(rand_with_outliers(rng, shape[:-1] + (2 * shape[-1],), outlier_value=12.0), dtype)
    f = shape[-1]
    out = nan_like(shape, dtype)
    L.geglu(gu[..., :f], gu[..., f:], out=out)
    assert_close(out, ref.geglu(gu64[..., :f], gu64[..., f:]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,cap", [(1, 30.0), (1000, 0.8), (4097, 50.0)])
def test_softcap_against_reference(rng, dtype, n, cap):
    from cupyattn import layers as L

    x, x64 = to_device(rand_with_outliers(rng, (n,), scale=cap, outlier_value=1e4), dtype)
    L.softcap(x, cap)
    assert_close(x, ref.softcap(x64, cap), dtype)
    with pytest.raises(ValueError, match=r"softcap\(\): cap"):
        L.softcap(x, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,hq,hkv,d", [(1, 7, 1, 32), (17, 4, 2, 64), (3, 2, 1, 256)])
def test_head_rmsnorm_on_a_packed_projection(rng, dtype, n, hq, hkv, d):
    from cupyattn import layers as L

    qkv, qkv64 = to_device(rand_with_outliers(rng, (n, (hq + 2 * hkv) * d)), dtype)
    wq, wq64 = to_device(1 + 0.3 * rng.standard_normal(d), dtype)
    wk, wk64 = to_device(1 + 0.3 * rng.standard_normal(d), dtype)
    heads = qkv.reshape(n, hq + 2 * hkv, d)
    L.head_rmsnorm(heads[:, :hq], wq, 1e-6)
    L.head_rmsnorm(heads[:, hq:hq + hkv], wk, 1e-6)
    want = qkv64.reshape(n, hq + 2 * hkv, d).copy()
    want[:, :hq] = ref.rmsnorm(want[:, :hq], wq64, 1e-6)
    want[:, hq:hq + hkv] = ref.rmsnorm(want[:, hq:hq + hkv], wk64, 1e-6)
    assert_close(heads, want, dtype)  # the value heads are left as they were
    with pytest.raises(ValueError, match=r"head_rmsnorm\(\): x must have element strides"):
        L.head_rmsnorm(heads[:, :, ::2], wq[: d // 2], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_append_qkv_with_frequency_divisors(rng, dtype, style):
    """RoPE + append with Llama 3's per-pair divisors: q and the cached k as the reference rotates
    them, at positions after what the cache holds."""
    import cupy

    import cupyattn

    b, t, hq, hkv, d, start = 2, 5, 4, 2, 32, 3
    cache = cupyattn.KVCache(1, b, hkv, 16, d, np.dtype(np.float32) if dtype == "float32" else
                             (np.dtype(np.float16) if dtype == "float16" else cupyattn.bfloat16))
    cache.append(0, *(cupy.zeros((b, hkv, start, d), cache.dtype) for _ in range(2)))
    qkv, qkv64 = to_device(rng.standard_normal((b, t, (hq + 2 * hkv) * d)), dtype)
    div = np.exp(rng.uniform(0, 3, d // 2)).astype(np.float32)
    q = cache.append_qkv(0, qkv, hq, rope_base=5e5, rope_style=style, rope_freq_div=cupy.asarray(div))
    heads = qkv64.reshape(b, t, hq + 2 * hkv, d).transpose(0, 2, 1, 3)
    pos = np.broadcast_to(np.arange(start, start + t), (b, t))
    assert_close(q, ref.rope(heads[:, :hq], pos, 5e5, style, freq_div=div), dtype)
    assert_close(cache.k[0][:, :, start:start + t], ref.rope(heads[:, hq:hq + hkv], pos, 5e5, style, freq_div=div),
                 dtype)
    with pytest.raises(ValueError, match=r"rope_freq_div must be C-contiguous of shape \(16,\)"):
        cache.append_qkv(0, qkv, hq, rope_freq_div=cupy.asarray(div[:8]))
    with pytest.raises(TypeError, match="rope_freq_div"):
        cache.append_qkv(0, qkv, hq, rope_freq_div=cupy.asarray(div.astype(np.float16)))
    assert to_host(cache.lengths).tolist() == [[start + t] * b]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norm_qkv_rope_append_with_frequency_divisors(rng, dtype):
    """The fused decode step's first kernel with Llama 3's divisors: q and the cached k as the
    float64 reference rotates rmsnorm(x) Wqkv^T at each sequence's position."""
    import cupy

    import cupyattn
    from cupyattn import fused
    from conftest import np_dtype

    b, hq, hkv, d, k = 3, 4, 2, 32, 64
    cache = cupyattn.KVCache(1, b, hkv, 16, d, np_dtype(dtype))
    cache.append(0, *(cupy.zeros((b, hkv, 5, d), cache.dtype) for _ in range(2)))
    x, x64 = to_device(rand_with_outliers(rng, (b, 1, k)), dtype)
    nw, nw64 = to_device(1 + 0.2 * rng.standard_normal(k), dtype)
    w, w64 = to_device(rng.standard_normal(((hq + 2 * hkv) * d, k)) / 8, dtype)
    div = np.exp(rng.uniform(0, 3, d // 2)).astype(np.float32)
    q = fused.rmsnorm_qkv_rope_append(x, nw, w, cache, 0, hq, 1e-5, 5e5, "adjacent", rope_freq_div=cupy.asarray(div))
    qkv = (ref.rmsnorm(x64, nw64, 1e-5) @ w64.T).reshape(b, 1, hq + 2 * hkv, d).transpose(0, 2, 1, 3)
    pos = np.full((b, 1), 5)
    assert_close(q, ref.rope(qkv[:, :hq], pos, 5e5, freq_div=div), dtype)
    assert_close(cache.k[0][:, :, 5:6], ref.rope(qkv[:, hq:hq + hkv], pos, 5e5, freq_div=div), dtype)
