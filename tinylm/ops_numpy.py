"""Float32 NumPy backend for tinylm: every op the Transformer needs, on the CPU.

Speed comes from three choices: projections are single 2-D float32 BLAS calls (``x @ W^T``
with W kept in its [N, K] layout), the KV cache is preallocated once and written in place,
and RoPE reads cos/sin from tables built once per (head_dim, base). Attention handles GQA by
folding the query heads of one KV group into the row dimension, so K and V are never repeated.

Threads: NumPy's BLAS picks its own thread count (all cores). A decode step is many short
matmuls, and on a machine whose cores are busy with other work, BLAS threads waiting on each
other can make it several times slower than one thread: there, set OPENBLAS_NUM_THREADS=1
(or OMP_NUM_THREADS=1) before starting Python.
"""
from __future__ import annotations

import numpy as np

F32 = np.dtype(np.float32)


class NumpyCache:
    """Preallocated KV cache for the NumPy backend.

    k, v: float32 [n_layers, B, n_kv_heads, max_seq, head_dim]
    lengths: int64 [n_layers] live length per layer (every sequence of the batch is as long)
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        shape = (n_layers, batch, n_kv_heads, max_seq, head_dim)
        self.k = np.zeros(shape, dtype=F32)
        self.v = np.zeros(shape, dtype=F32)
        self.lengths = np.zeros(n_layers, dtype=np.int64)
        self.max_seq = max_seq

    def reset(self):
        self.lengths[:] = 0  # stale K/V past the length are never read


class NumpyOps:
    """The ops interface (see tinylm.model) over NumPy float32 arrays."""

    name = "numpy"
    xp = np

    def __init__(self, dtype="float32"):
        if np.dtype(dtype) != F32:
            raise ValueError(f"the numpy backend computes in float32 only, not {np.dtype(dtype).name}"
                             " (use --backend cupy for float16/bfloat16)")
        self.dtype = F32
        self._rope_tables = {}
        self._rope_last = None  # (positions, dim, base, (cos, sin)) of the last rope call

    # --- weights, cache, host transfers ---------------------------------------------------
    def upload(self, a):
        return np.ascontiguousarray(a, dtype=F32)

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        return NumpyCache(n_layers, batch, n_kv_heads, max_seq, head_dim)

    def empty(self, shape):
        return np.empty(shape, dtype=F32)

    def ids(self, ids):
        return np.ascontiguousarray(ids, dtype=np.int64)

    def token_ids(self, batch, token):
        """[B, 1] ids filled with one host integer (the token just sampled)."""
        return np.full((batch, 1), token, dtype=np.int64)

    def positions(self, batch, start, count):
        return np.broadcast_to(np.arange(start, start + count, dtype=np.int64), (batch, count))

    def to_numpy(self, x):
        """A float32 copy (never a view of a scratch buffer the next step overwrites)."""
        return np.array(x, dtype=F32, copy=True)

    def synchronize(self):
        pass

    # --- layer ops ------------------------------------------------------------------------
    def embedding(self, ids, table, out=None):
        """ids [B, T] -> table rows [B, T, dim]."""
        return np.take(table, ids, axis=0, out=out)

    def matmul(self, x, w, out=None):
        """``x @ w^T``: x [..., K], w [N, K] -> [..., N]; one 2-D sgemm over all rows."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        o2 = None if out is None else out.reshape(-1, w.shape[0])
        r = np.matmul(x2, w.T, out=o2)
        return r.reshape(*lead, w.shape[0]) if out is None else out

    def rmsnorm(self, x, weight, eps, out=None):
        """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (float32 throughout)."""
        ms = np.einsum("...d,...d->...", x, x)[..., None] * np.float32(1.0 / x.shape[-1])
        inv = np.float32(1.0) / np.sqrt(ms + np.float32(eps))
        out = np.multiply(x, inv, out=out)
        return np.multiply(out, weight, out=out)

    def _tables(self, dim, base, upto):
        """cos/sin float32 [n, dim/2] with angle ``pos * base^(-2i/dim)``, grown on demand."""
        key = (dim, float(base))
        cs = self._rope_tables.get(key)
        if cs is None or cs[0].shape[0] < upto:
            n = max(upto, 256)
            inv = float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
            ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
            cs = (np.cos(ang).astype(F32), np.sin(ang).astype(F32))
            self._rope_tables[key] = cs
        return cs

    def rope(self, x, positions, base, style, out=None):
        """Rotary embedding of x [B, H, T, D] at positions [B, T].

        ``adjacent`` turns pairs (x[2i], x[2i+1]) (GGUF layout), ``neox`` pairs (x[i], x[i+D/2]).
        """
        d = x.shape[-1]
        key = (positions, d, float(base))
        if self._rope_last is not None and self._rope_last[0] is positions and self._rope_last[1:3] == key[1:]:
            c, s = self._rope_last[3]  # same positions as the previous call (q then k, every layer)
        else:
            cos_t, sin_t = self._tables(d, base, int(positions.max()) + 1)
            c = cos_t[positions][:, None]  # [B, 1, T, D/2]
            s = sin_t[positions][:, None]
            self._rope_last = (*key, (c, s))  # holds `positions`, so its id cannot be reused
        if out is None:
            out = np.empty_like(x)
        if style == "adjacent":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            o0, o1 = out[..., 0::2], out[..., 1::2]
        elif style == "neox":
            x0, x1 = x[..., : d // 2], x[..., d // 2:]
            o0, o1 = out[..., : d // 2], out[..., d // 2:]
        else:
            raise ValueError(f"unknown rope style {style!r}")
        if out is x:  # in place: keep the inputs before they are overwritten
            x0, x1 = x0.copy(), x1.copy()
        np.subtract(x0 * c, x1 * s, out=o0)
        np.add(x0 * s, x1 * c, out=o1)
        return out

    def cache_append(self, cache, layer, k, v):
        """Write k/v [B, Hkv, T, D] at the layer's live length, then advance it."""
        t = k.shape[2]
        pos = int(cache.lengths[layer])
        if pos + t > cache.max_seq:
            raise ValueError(f"KV cache is full (max_seq={cache.max_seq}), cannot append {t} token(s)"
                             f" at position {pos}")
        cache.k[layer, :, :, pos:pos + t] = k
        cache.v[layer, :, :, pos:pos + t] = v
        cache.lengths[layer] = pos + t

    def _attend(self, q, k, v, start, out=None):
        """softmax(q k^T / sqrt(D)) v, causal with the queries at positions start..start+T-1.

        q [B, Hq, T, D], k/v [B, Hkv, S, D] with S = start + T -> [B, Hq, T, D].
        GQA: the g = Hq/Hkv query heads sharing one KV head become g*T rows of one matmul.
        """
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        g = hq // hkv
        qg = q.reshape(b, hkv, g * t, d)
        scores = np.matmul(qg, k.transpose(0, 1, 3, 2))  # [B, Hkv, g*T, S]
        scores *= np.float32(1.0 / np.sqrt(d))
        if t > 1:
            # query row r is token r % T at position start + r % T; it sees keys j <= that
            qpos = start + np.tile(np.arange(t), g)
            scores[..., np.arange(s)[None, :] > qpos[:, None]] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, v)  # [B, Hkv, g*T, D]
        o = o.reshape(b, hq, t, d)
        if out is None:
            return o
        out[...] = o
        return out

    def attend_prefill(self, q, k_new, v_new, cache, layer, start, out=None):
        """Causal attention of q [B, Hq, T, D] over the cached keys 0..start+T-1."""
        if start == 0:  # the cache holds exactly k_new/v_new: skip the strided view
            return self._attend(q, k_new, v_new, 0, out)
        s = start + q.shape[2]
        return self._attend(q, cache.k[layer, :, :, :s], cache.v[layer, :, :, :s], start, out)

    def attend_decode(self, q, cache, layer, out=None):
        """One query per sequence, q [B, Hq, 1, D], over the layer's whole live cache."""
        s = int(cache.lengths[layer])
        return self._attend(q, cache.k[layer, :, :, :s], cache.v[layer, :, :, :s], s - 1, out)

    def swiglu(self, gate, up, out=None):
        """``silu(gate) * up`` with sigmoid(g) = (1 + tanh(g/2)) / 2, which cannot overflow."""
        sig = np.multiply(gate, np.float32(0.5))
        np.tanh(sig, out=sig)
        sig += np.float32(1.0)
        sig *= np.float32(0.5)
        out = np.multiply(gate, up, out=out)
        return np.multiply(out, sig, out=out)

    def add(self, x, y, out=None):
        return np.add(x, y, out=out)

    def contiguous(self, x):
        return np.ascontiguousarray(x)
