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

import contextlib

import numpy as np

F32 = np.dtype(np.float32)


class NumpyCache:
    """Preallocated KV cache for the NumPy backend.

    k, v: float32 [n_layers, B, n_kv_heads, max_seq, head_dim]
    lengths: int64 [n_layers, B] live length per layer and sequence
    """

    def __init__(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        shape = (n_layers, batch, n_kv_heads, max_seq, head_dim)
        self.k = np.zeros(shape, dtype=F32)
        self.v = np.zeros(shape, dtype=F32)
        self.lengths = np.zeros((n_layers, batch), dtype=np.int64)
        self.host_lengths = self.lengths  # the same array: NumPy lengths live on the host
        self.max_seq = max_seq
        self.batch = batch

    def reset(self):
        self.lengths[:] = 0  # stale K/V past the length are never read

    def check_room(self, num_new=1, fn="cache", layer=None):
        """Counts int64 [B] (an int or B ints); ValueError if a sequence of ``layer`` (None: of
        any layer) would pass max_seq."""
        counts = np.broadcast_to(np.asarray(num_new, dtype=np.int64).reshape(-1), (self.batch,))
        lengths = self.lengths if layer is None else self.lengths[layer:layer + 1]
        over = np.argwhere(lengths + counts[None, :] > self.max_seq)
        if over.size:
            row, i = (int(v) for v in over[0])
            raise ValueError(f"{fn}: KV cache is full (max_seq={self.max_seq}), cannot append "
                             f"{int(counts[i])} token(s) at position {int(lengths[row, i])} "
                             f"(sequence {i})")
        return counts


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

    # --- memory (tinylm.generate sizes its batches with these) ---------------------------
    @staticmethod
    def free_memory():
        """Bytes of host memory available now (Linux MemAvailable), or None if unknown."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            import os

            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None

    @staticmethod
    def attention_scratch_bytes(n_heads, t, s):
        """Bytes of one sequence's prefill attention temporaries for t queries over s keys: the
        float32 score matrix and the matmul's copy of it (``_attend`` materialises them)."""
        return 2 * n_heads * t * s * F32.itemsize

    # --- weights, cache, host transfers ---------------------------------------------------
    def upload(self, a):
        return np.ascontiguousarray(a, dtype=F32)

    upload_f32 = upload  # tables that stay float32 whatever the compute dtype (RoPE divisors)

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        return NumpyCache(n_layers, batch, n_kv_heads, max_seq, head_dim)

    def empty(self, shape):
        return np.empty(shape, dtype=F32)

    def ids(self, ids):
        return np.ascontiguousarray(ids, dtype=np.int64)

    def token_buffer(self, batch):
        """[B, 1] ids: the next decode step's input tokens."""
        return np.zeros((batch, 1), dtype=np.int64)

    def set_tokens(self, buf, ids):
        buf[:, 0] = np.asarray(ids, dtype=np.int64).reshape(-1)

    def read_tokens(self, buf):
        return np.array(buf, dtype=np.int64).reshape(-1)

    def to_numpy(self, x):
        """A float32 copy (never a view of a scratch buffer the next step overwrites)."""
        return np.array(x, dtype=F32, copy=True)

    def synchronize(self):
        pass

    def stream(self):
        """Context in which the backend's work runs (nothing to enter on the CPU)."""
        return contextlib.nullcontext()

    def decode_workspace(self, batch, n_heads, head_dim):
        return None

    def decode_splits(self, batch, n_heads, n_kv_heads, head_dim, length):
        return None

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

    def add_rmsnorm(self, x, r, weight, eps, out=None):
        """Residual add in place, then rmsnorm: ``x += r; out = rmsnorm(x)`` -> (x, out)."""
        np.add(x, r, out=x)
        return x, self.rmsnorm(x, weight, eps, out=out)

    def _tables(self, dim, base, upto, factors=None):
        """cos/sin float32 [n, dim/2] with angle ``pos * base^(-2i/dim) / factors[i]``, grown on
        demand (``factors``: None, or dim/2 per-pair divisors, Llama 3's rope_freqs)."""
        fkey = None if factors is None else tuple(np.asarray(factors, dtype=np.float64).tolist())
        key = (dim, float(base), fkey)
        cs = self._rope_tables.get(key)
        if cs is None or cs[0].shape[0] < upto:
            n = max(upto, 256)
            inv = float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
            if fkey is not None:
                inv = inv / np.asarray(fkey)
            ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
            cs = (np.cos(ang).astype(F32), np.sin(ang).astype(F32))
            self._rope_tables[key] = cs
        return cs

    def _rotate(self, x, c, s, style, out=None):
        """Turn pairs of x [B, H, T, D] by angles with cos c / sin s [B, 1, T, D/2]."""
        d = x.shape[-1]
        if out is None:
            out = np.empty(x.shape, dtype=F32)
        if style == "adjacent":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            o0, o1 = out[..., 0::2], out[..., 1::2]
        elif style == "neox":
            x0, x1 = x[..., : d // 2], x[..., d // 2:]
            o0, o1 = out[..., : d // 2], out[..., d // 2:]
        else:
            raise ValueError(f"unknown rope style {style!r}")
        if np.shares_memory(out, x):  # in place: keep the inputs before they are overwritten
            x0, x1 = x0.copy(), x1.copy()
        np.subtract(x0 * c, x1 * s, out=o0)
        np.add(x0 * s, x1 * c, out=o1)
        return out

    def rope(self, x, positions, base, style, out=None, factors=None):
        """Rotary embedding of x [B, H, T, D] at positions [B, T].

        ``adjacent`` turns pairs (x[2i], x[2i+1]) (GGUF layout), ``neox`` pairs (x[i], x[i+D/2]).
        """
        positions = np.asarray(positions)
        cos_t, sin_t = self._tables(x.shape[-1], base, int(positions.max()) + 1, factors)
        return self._rotate(x, cos_t[positions][:, None], sin_t[positions][:, None], style, out)

    def qkv_rope_append(self, qkv, cache, layer, n_heads, base, style, num_new=None, out=None, factors=None):
        """The step after the packed QKV projection qkv [B, T, (Hq + 2 Hkv) D]: q and k rotated
        at positions lengths[layer, b] + t, k and v appended for t < num_new[b] (default all T),
        lengths advanced. Returns q [B, Hq, T, D] (in ``out`` when given)."""
        b, t, _ = qkv.shape
        hkv, d = cache.k.shape[2], cache.k.shape[4]
        counts = cache.check_room(t if num_new is None else num_new, "qkv_rope_append", layer)
        heads = qkv.reshape(b, t, n_heads + 2 * hkv, d).transpose(0, 2, 1, 3)  # [B, heads, T, D]
        start = cache.lengths[layer].copy()
        pos = start[:, None] + np.arange(t)[None, :]
        cos_t, sin_t = self._tables(d, base, int(pos.max()) + 1, factors)
        c, s = cos_t[pos][:, None], sin_t[pos][:, None]  # [B, 1, T, D/2], shared by q and k
        q = self._rotate(heads[:, :n_heads], c, s, style, out)
        k = self._rotate(heads[:, n_heads:n_heads + hkv], c, s, style)
        v = heads[:, n_heads + hkv:]
        for i in range(b):
            p0, n = int(start[i]), int(counts[i])
            cache.k[layer, i, :, p0:p0 + n] = k[i, :, :n]
            cache.v[layer, i, :, p0:p0 + n] = v[i, :, :n]
        cache.lengths[layer] = start + counts
        return q

    def _attend(self, q, k, v, start, out=None, scale=None, window=None, softcap=0.0):
        """softmax(q k^T * scale) v, causal with the queries at positions start..start+T-1.

        q [B, Hq, T, D], k/v [B, Hkv, S, D] with S = start + T -> [B, Hq, T, D].
        GQA: the g = Hq/Hkv query heads sharing one KV head become g*T rows of one matmul.
        scale: None = 1/sqrt(D); window (left, 0): a query at p sees keys j >= p - left only;
        softcap c > 0: scores become c * tanh(scores / c) before the mask (Gemma 2).
        """
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        g = hq // hkv
        qg = q.reshape(b, hkv, g * t, d)
        scores = np.matmul(qg, k.transpose(0, 1, 3, 2))  # [B, Hkv, g*T, S]
        scores *= np.float32(1.0 / np.sqrt(d) if scale is None else scale)
        if softcap:
            scores /= np.float32(softcap)
            np.tanh(scores, out=scores)
            scores *= np.float32(softcap)
        # query row r is token r % T at position start + r % T; it sees keys j <= that (and,
        # in a window, j >= that - left). One token without a window sees every key: no mask.
        if t > 1 or window is not None:
            qpos = start + np.tile(np.arange(t), g)
            keys = np.arange(s)[None, :]
            hidden = keys > qpos[:, None]
            if window is not None:
                hidden |= keys < qpos[:, None] - window[0]
            if hidden.any():
                scores[..., hidden] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, v)  # [B, Hkv, g*T, D]
        o = o.reshape(b, hq, t, d)
        if out is None:
            return o
        out[...] = o
        return out

    def attend_prefill(self, q, cache, layer, start, key_lengths=None, out=None, scale=None, window=None,
                       softcap=0.0):
        """Causal attention of q [B, Hq, T, D] (positions start..start+T-1) over the cached keys.

        key_lengths [B] (host ints): sequence b sees keys j < key_lengths[b] only, and its query
        rows t >= key_lengths[b] - start (right padding) are zeros. Each such sequence is
        computed alone, with exactly the shapes a batch of one would have. ``out`` is ignored
        (the NumPy backend allocates; the argument is for the ops interface). scale, window,
        softcap: as ``_attend``.
        """
        t = q.shape[2]
        k, v = cache.k[layer], cache.v[layer]
        kw = dict(scale=scale, window=window, softcap=softcap)
        if key_lengths is None or all(int(n) == start + t for n in key_lengths):
            return self._attend(q, k[:, :, :start + t], v[:, :, :start + t], start, **kw)
        out = np.zeros(q.shape, dtype=F32)
        for i, kl in enumerate(int(n) for n in key_lengths):
            n = kl - start
            if n > 0:
                out[i:i + 1, :, :n] = self._attend(q[i:i + 1, :, :n], k[i:i + 1, :, :kl], v[i:i + 1, :, :kl], start,
                                                   **kw)
        return out

    def attend_decode(self, q, cache, layer, out=None, workspace=None, num_splits=None, scale=None, window=None,
                      softcap=0.0):
        """One query per sequence, q [B, Hq, 1, D], over each sequence's whole live cache
        (sequences of different lengths are computed one by one)."""
        lens = cache.lengths[layer]
        k, v = cache.k[layer], cache.v[layer]
        kw = dict(scale=scale, window=window, softcap=softcap)
        if (lens == lens[0]).all():
            s = int(lens[0])
            return self._attend(q, k[:, :, :s], v[:, :, :s], s - 1, out, **kw)
        if out is None:
            out = np.empty(q.shape, dtype=F32)
        for i, s in enumerate(int(n) for n in lens):
            self._attend(q[i:i + 1], k[i:i + 1, :, :s], v[i:i + 1, :, :s], s - 1, out[i:i + 1], **kw)
        return out

    # --- a family's extra ops (tinylm.config.ModelArgs) ------------------------------------
    def add_bias(self, x, bias):
        """x [..., N] += bias [N], in place (Qwen2's Q/K/V biases on the packed projection)."""
        x += bias
        return x

    def head_rmsnorm(self, qkv, q_weight, k_weight, n_heads, n_kv_heads, eps):
        """RMSNorm of every query head (weight q_weight [D]) and key head (k_weight) of a packed
        projection qkv [B, T, (Hq + 2 Hkv) D], in place; the value heads are left alone."""
        b, t, w = qkv.shape
        d = q_weight.shape[0]
        heads = qkv.reshape(b, t, w // d, d)
        for lo, hi, weight in ((0, n_heads, q_weight), (n_heads, n_heads + n_kv_heads, k_weight)):
            part = heads[:, :, lo:hi]
            part[...] = self.rmsnorm(part, weight, eps)
        return qkv

    def geglu(self, gate, up, out=None):
        """``gelu_tanh(gate) * up`` (Gemma's gate): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))."""
        g = np.asarray(gate, dtype=F32)
        inner = g * g
        inner *= np.float32(0.044715)
        inner += np.float32(1.0)
        inner *= g
        inner *= np.float32(np.sqrt(2.0 / np.pi))
        np.tanh(inner, out=inner)
        inner += np.float32(1.0)
        inner *= np.float32(0.5)
        inner *= g
        return np.multiply(inner, up, out=out)

    def softcap(self, x, cap):
        """x = cap * tanh(x / cap), in place (Gemma 2's final logits)."""
        x /= np.float32(cap)
        np.tanh(x, out=x)
        x *= np.float32(cap)
        return x

    def swiglu(self, gate, up, out=None):
        """``silu(gate) * up`` with sigmoid(g) = (1 + tanh(g/2)) / 2, which cannot overflow."""
        sig = np.multiply(gate, np.float32(0.5))
        np.tanh(sig, out=sig)
        sig += np.float32(1.0)
        sig *= np.float32(0.5)
        out = np.multiply(gate, up, out=out)
        return np.multiply(out, sig, out=out)

    def gather_rows(self, x, idx, out=None):
        """x [B, T, D], idx [B] host ints -> rows x[b, idx[b]] as [B, 1, D]."""
        return np.ascontiguousarray(x[np.arange(x.shape[0]), np.asarray(idx)][:, None])

    def merge_heads(self, o, out=None):
        """o [B, H, T, D] -> [B, T, H * D] C-contiguous."""
        b, h, t, d = o.shape
        return np.ascontiguousarray(o.transpose(0, 2, 1, 3)).reshape(b, t, h * d)

    def contiguous(self, x):
        return np.ascontiguousarray(x)
