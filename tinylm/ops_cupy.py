"""GPU backend for tinylm on cupyattn kernels.

Weights are uploaded once in the chosen dtype (float16 / bfloat16 / float32) and every op runs
on the current CuPy stream: projections are cupyattn.gemm_nt (x @ W^T with W shared by the
batch), prefill attention is cupyattn.attention(causal=True) with the dtype's default kernel, decode appends to a
cupyattn.KVCache and reads it with cupyattn.decode_attention, and the small ops come from
cupyattn.layers. Nothing here moves data to the host except `to_numpy` (tests, logits()).
"""
from __future__ import annotations

import cupy
import numpy as np

import cupyattn
from cupyattn import layers

_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": cupyattn.bfloat16}


class CupyOps:
    """The ops interface (see tinylm.model) over CuPy arrays and cupyattn kernels."""

    name = "cupy"
    xp = cupy

    def __init__(self, dtype="float16"):
        key = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if key not in _DTYPES:
            raise ValueError(f"the cupy backend supports float32, float16 and bfloat16, not {dtype!r}")
        self.dtype = _DTYPES[key]

    # --- weights, cache, host transfers ---------------------------------------------------
    def upload(self, a):
        """Host array -> device array of the compute dtype (rounded on the host, copied once)."""
        return cupy.asarray(np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(self.dtype)))

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        return cupyattn.KVCache(n_layers, batch, n_kv_heads, max_seq, head_dim, self.dtype)

    def empty(self, shape):
        return cupy.empty(shape, dtype=self.dtype)

    def ids(self, ids):
        return cupy.asarray(np.ascontiguousarray(ids, dtype=np.int32))

    def token_ids(self, batch, token):
        """[B, 1] int32 filled on the device from a host scalar (no copy from host memory)."""
        return cupy.full((batch, 1), token, dtype=cupy.int32)

    def positions(self, batch, start, count):
        if count == 1:
            return cupy.full((batch, 1), start, dtype=cupy.int32)
        return cupy.ascontiguousarray(cupy.broadcast_to(cupy.arange(start, start + count, dtype=cupy.int32),
                                                    (batch, count)))

    def to_numpy(self, x):
        return cupy.asnumpy(x).astype(np.float32)

    def synchronize(self):
        cupy.cuda.get_current_stream().synchronize()

    def contiguous(self, x):
        return cupy.ascontiguousarray(x)

    # --- layer ops ------------------------------------------------------------------------
    def embedding(self, ids, table, out=None):
        return layers.embedding(ids, table, out=out)

    def matmul(self, x, w, out=None):
        """x [..., K] @ w^T, w [N, K] -> [..., N] (w broadcast over the leading dims)."""
        return cupyattn.gemm_nt(x, w, out=out)

    def rmsnorm(self, x, weight, eps, out=None):
        return layers.rmsnorm(x, weight, eps=eps, out=out)

    def rope(self, x, positions, base, style, out=None):
        return layers.rope(x, positions, base=base, style=style, out=out)

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
        return cupyattn.attention(q, k_new, v_new, causal=True, out=out)

    def attend_decode(self, q, cache, layer, out=None):
        return cupyattn.decode_attention(q, cache, layer, out=out)

    def swiglu(self, gate, up, out=None):
        return layers.swiglu(gate, up, out=out)

    def add(self, x, y, out=None):
        return layers.add(x, y, out=out)
