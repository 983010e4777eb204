"""GPU backend for tinylm on cupyattn kernels.

Weights are uploaded once in the chosen dtype (float16 / bfloat16 / float32) and every op runs
on the current CuPy stream: projections are cupyattn.gemm_nt (x @ W^T with W shared by the
batch), prefill attention is cupyattn.attention(impl="flash", causal=True), decode appends to a
cupyattn.KVCache and reads it with cupyattn.decode_attention, and the small ops come from
cupyattn.layers. Nothing here moves data to the host except `to_numpy` (tests, logits()).
"""
from __future__ import annotations

import numpy as np

from cupyattn._checks import BFLOAT16

_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


class CupyOps:
    """The ops interface (see tinylm.model) over CuPy arrays and cupyattn kernels."""

    name = "cupy"

    def __init__(self, dtype="float16"):
        import cupy

        from cupyattn import layers
        from cupyattn.attention_op import attention
        from cupyattn.decode import decode_attention
        from cupyattn.gemm import gemm_nt
        from cupyattn.kvcache import KVCache

        key = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if key not in _DTYPES or _DTYPES[key] is None:
            raise ValueError(f"the cupy backend supports float32, float16 and bfloat16, not {dtype!r}")
        self.dtype = _DTYPES[key]
        self.xp = cupy
        self._cp = cupy
        self._layers = layers
        self._attention = attention
        self._decode = decode_attention
        self._gemm_nt = gemm_nt
        self._KVCache = KVCache

    # --- weights, cache, host transfers ---------------------------------------------------
    def upload(self, a):
        """Host array -> device array of the compute dtype (rounded on the host, copied once)."""
        return self._cp.asarray(np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(self.dtype)))

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        return self._KVCache(n_layers, batch, n_kv_heads, max_seq, head_dim, self.dtype)

    def empty(self, shape):
        return self._cp.empty(shape, dtype=self.dtype)

    def ids(self, ids):
        return self._cp.asarray(np.ascontiguousarray(ids, dtype=np.int32))

    def token_ids(self, batch, token):
        """[B, 1] int32 filled on the device from a host scalar (no copy from host memory)."""
        return self._cp.full((batch, 1), token, dtype=self._cp.int32)

    def positions(self, batch, start, count):
        cp = self._cp
        if count == 1:
            return cp.full((batch, 1), start, dtype=cp.int32)
        return cp.ascontiguousarray(cp.broadcast_to(cp.arange(start, start + count, dtype=cp.int32),
                                                    (batch, count)))

    def to_numpy(self, x):
        return self._cp.asnumpy(x).astype(np.float32)

    def synchronize(self):
        self._cp.cuda.get_current_stream().synchronize()

    def contiguous(self, x):
        return self._cp.ascontiguousarray(x)

    # --- layer ops ------------------------------------------------------------------------
    def embedding(self, ids, table, out=None):
        return self._layers.embedding(ids, table, out=out)

    def matmul(self, x, w, out=None):
        """x [..., K] @ w^T, w [N, K] -> [..., N] (w broadcast over the leading dims)."""
        return self._gemm_nt(x, w, out=out)

    def rmsnorm(self, x, weight, eps, out=None):
        return self._layers.rmsnorm(x, weight, eps=eps, out=out)

    def rope(self, x, positions, base, style, out=None):
        return self._layers.rope(x, positions, base=base, style=style, out=out)

    def cache_append(self, cache, layer, k, v):
        cache.append(layer, k, v)

    def attend_prefill(self, q, k_new, v_new, cache, layer, start, out=None):
        """Causal flash attention of q [B, Hq, T, D] over cached keys 0..start+T-1.

        With an empty cache before this call the keys are exactly k_new/v_new; otherwise they
        are the cache's first start+T rows, read in place (attention takes strided K/V).
        """
        if start > 0:
            s = start + q.shape[2]
            k_new, v_new = cache.k[layer, :, :, :s], cache.v[layer, :, :, :s]
        return self._attention(q, k_new, v_new, causal=True, impl="flash", out=out)

    def attend_decode(self, q, cache, layer, out=None):
        return self._decode(q, cache, layer, out=out)

    def swiglu(self, gate, up, out=None):
        return self._layers.swiglu(gate, up, out=out)

    def add(self, x, y, out=None):
        return self._layers.add(x, y, out=out)
