"""The Llama-style Transformer of tinylm: one forward pass written once over an ops backend.

    x = embed(ids)
    per layer:  h = rmsnorm(x, attn_norm)
                q, k, v = h Wq^T, h Wk^T, h Wv^T           -> [B, H, T, hd] each (one matmul)
                q, k = rope(q), rope(k) at positions cache_len + t
                append k, v to the KV cache
                o = attention(q, cached K/V)                prefill: causal; decode: one query
                x = x + o Wo^T
                h = rmsnorm(x, ffn_norm)
                x = x + (silu(h Wgate^T) * h Wup^T) Wdown^T
    logits = rmsnorm(x, output_norm) Wout^T

The backends (tinylm.ops_numpy.NumpyOps, tinylm.ops_cupy.CupyOps) implement the ops interface
below; the model never looks at which one it has. Weights live in `Params` (uploaded once, in
the backend's dtype); everything that changes while generating lives in `RunState`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

# The ops interface. Every `out=` is optional; given, the op writes there and returns it.
#   name, dtype, xp                      backend name, compute dtype, array module
#   upload(a) -> array                   host float32 -> backend array of `dtype`
#   new_cache(L, B, Hkv, S, hd)          preallocated KV cache with .reset()
#   empty(shape) / ids(np ints) / token_ids(B, tok) / positions(B, start, T)
#   embedding(ids [B,T], table [V,D])    -> [B, T, D]
#   matmul(x [..., K], w [N, K])         -> [..., N]   (x @ w^T)
#   rmsnorm(x, w, eps) / swiglu(g, u) / add(x, y)
#   rope(x [B,H,T,hd], positions [B,T], base, style)
#   cache_append(cache, layer, k, v)     k/v [B, Hkv, T, hd] at the layer's live length
#   attend_prefill(q, k, v, cache, layer, start)   causal over cached positions 0..start+T-1
#   attend_decode(q [B,Hq,1,hd], cache, layer)     over the layer's whole live cache
#   contiguous(x), to_numpy(x) -> float32 np.ndarray, synchronize()


def has_cuda_device() -> bool:
    """True when CuPy can see at least one CUDA device (False on any error)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_backend(backend: str = "auto") -> str:
    """"auto" -> "cupy" when a CUDA device is present, else "numpy"."""
    if backend == "auto":
        return "cupy" if has_cuda_device() else "numpy"
    if backend not in ("numpy", "cupy"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, numpy or cupy)")
    return backend


DEFAULT_DTYPE = {"numpy": "float32", "cupy": "float16"}


def make_ops(backend: str = "auto", dtype: str | None = None):
    """The ops object for a backend name ("auto" resolved) and dtype (None: its default)."""
    backend = resolve_backend(backend)
    dtype = dtype or DEFAULT_DTYPE[backend]
    if backend == "numpy":
        from .ops_numpy import NumpyOps

        return NumpyOps(dtype)
    if not has_cuda_device():
        raise RuntimeError("backend 'cupy' needs a CUDA device, and none was found")
    from .ops_cupy import CupyOps

    return CupyOps(dtype)


# --- weights on the backend -----------------------------------------------------------------
@dataclass
class LayerParams:
    """One block's weights on the backend (y = x @ W^T orientation, as tinylm.weights).

    Q, K and V are stacked into one matrix, and so are gate and up: a decode step then makes 4
    weight-streaming matmuls per layer instead of 7 (same bytes, fewer launches/BLAS calls).
    """

    attn_norm: object  # [dim]
    wqkv: object  # [(n_heads + 2 * n_kv_heads) * head_dim, dim] = rows of wq, wk, wv
    wo: object  # [dim, n_heads * head_dim]
    ffn_norm: object  # [dim]
    w_gate_up: object  # [2 * ffn_dim, dim] = rows of w_gate, w_up
    w_down: object  # [dim, ffn_dim]


@dataclass
class Params:
    tok_embd: object  # [vocab, dim]
    output_norm: object  # [dim]
    output: object  # [vocab, dim]; the same array as tok_embd when the embeddings are tied
    layers: list

    @classmethod
    def upload(cls, weights, ops) -> "Params":
        """Copy host weights to the backend once, in its dtype; keeps the embedding tie."""
        up = ops.upload
        layers = [LayerParams(attn_norm=up(lw.attn_norm), wqkv=up(np.concatenate([lw.wq, lw.wk, lw.wv])),
                              wo=up(lw.wo), ffn_norm=up(lw.ffn_norm),
                              w_gate_up=up(np.concatenate([lw.w_gate, lw.w_up])), w_down=up(lw.w_down))
                  for lw in weights.layers]
        tok = ops.upload(weights.tok_embd)
        out = tok if weights.output is weights.tok_embd else ops.upload(weights.output)
        return cls(tok, ops.upload(weights.output_norm), out, layers)

    def nbytes(self) -> int:
        """Bytes of distinct weight arrays: what one decode step streams from memory."""
        seen, total = set(), 0
        arrays = [self.tok_embd, self.output_norm, self.output]
        arrays += [getattr(lp, f.name) for lp in self.layers for f in fields(LayerParams)]
        for a in arrays:
            if id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes
        return total


# --- run state ------------------------------------------------------------------------------
class RunState:
    """KV cache and decode scratch, allocated once per (batch, max_seq) and reused.

    Prefill (T > 1 tokens) allocates its temporaries; a decode step (T = 1) writes only into
    the buffers below, so the steady state allocates nothing but the op's own temporaries.
    """

    def __init__(self, args, ops, batch: int = 1, max_seq: int | None = None):
        a, b = args, batch
        self.batch = b
        self.max_seq = int(max_seq or a.max_seq)
        qd, kvd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        # k, v: [n_layers, B, n_kv_heads, max_seq, head_dim] (backend dtype)
        self.cache = ops.new_cache(a.n_layers, b, a.n_kv_heads, self.max_seq, a.head_dim)
        self.length = 0  # tokens in the cache; every sequence of the batch is as long
        e = ops.empty
        self.x = e((b, 1, a.dim))  # residual stream
        self.h = e((b, 1, a.dim))  # rmsnorm output
        self.qkv = e((b, 1, qd + 2 * kvd))  # [q | k | v] projections, heads packed
        self.q_rot = e((b, a.n_heads, 1, a.head_dim))  # q after rope, [B, Hq, 1, hd]
        self.k_rot = e((b, a.n_kv_heads, 1, a.head_dim))  # k after rope, [B, Hkv, 1, hd]
        self.att = e((b, a.n_heads, 1, a.head_dim))  # attention output, [B, Hq, 1, hd]
        self.proj = e((b, 1, a.dim))  # output of wo / w_down before the residual add
        self.gate_up = e((b, 1, 2 * a.ffn_dim))  # [h Wgate^T | h Wup^T]
        self.ffn = e((b, 1, a.ffn_dim))  # silu(gate) * up
        self.logits = e((b, 1, a.vocab_size))  # last position's logits

    def reset(self):
        self.cache.reset()
        self.length = 0


# --- the model ------------------------------------------------------------------------------
class Transformer:
    """Llama-style decoder over an ops backend.

    Parameters
    ----------
    args : tinylm.config.ModelArgs
    weights : tinylm.weights.Weights (host float32)
    backend : "auto" | "numpy" | "cupy", or an ops object
    dtype : compute/storage dtype name; None = the backend's default (float32 / float16)
    """

    def __init__(self, args, weights, backend="auto", dtype=None):
        self.args = args
        self.ops = make_ops(backend, dtype) if isinstance(backend, str) else backend
        self.backend = self.ops.name
        self.dtype = np.dtype(self.ops.dtype).name
        self.params = Params.upload(weights, self.ops)
        self.weight_bytes = self.params.nbytes()

    def new_state(self, batch: int = 1, max_seq: int | None = None) -> RunState:
        if max_seq is not None and max_seq > self.args.max_seq:
            raise ValueError(f"max_seq={max_seq} exceeds the model's max_seq={self.args.max_seq}")
        return RunState(self.args, self.ops, batch, max_seq)

    def _split_heads(self, x, n_heads):
        """[B, T, n_heads * hd] -> contiguous [B, n_heads, T, hd]."""
        b, t, _ = x.shape
        return self.ops.contiguous(x.reshape(b, t, n_heads, self.args.head_dim).transpose(0, 2, 1, 3))

    def forward(self, ids, state: RunState, all_logits: bool = False):
        """Run ids [B, T] (backend ints) after the state's cached tokens.

        Returns logits [B, T, vocab] when all_logits, else those of the last position
        [B, 1, vocab] (in state.logits for a decode step: copy before the next call).
        """
        a, ops, p = self.args, self.ops, self.params
        b, t = ids.shape
        start = state.length
        if b != state.batch:
            raise ValueError(f"ids have batch {b} but the state was made for batch {state.batch}")
        if start + t > state.max_seq:
            raise ValueError(f"sequence of {start + t} tokens does not fit max_seq={state.max_seq}")
        scratch = state if t == 1 else None

        def buf(name):  # decode writes into RunState's buffers, prefill allocates
            return getattr(scratch, name) if scratch is not None else None

        qd, kvd, f = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.ffn_dim
        pos = ops.positions(b, start, t)
        x = ops.embedding(ids, p.tok_embd, out=buf("x"))
        for i, lp in enumerate(p.layers):
            # attention block
            h = ops.rmsnorm(x, lp.attn_norm, a.norm_eps, out=buf("h"))
            qkv = ops.matmul(h, lp.wqkv, out=buf("qkv"))
            q = self._split_heads(qkv[..., :qd], a.n_heads)
            k = self._split_heads(qkv[..., qd:qd + kvd], a.n_kv_heads)
            v = self._split_heads(qkv[..., qd + kvd:], a.n_kv_heads)
            q = ops.rope(q, pos, a.rope_base, a.rope_style, out=buf("q_rot"))
            k = ops.rope(k, pos, a.rope_base, a.rope_style, out=buf("k_rot"))
            ops.cache_append(state.cache, i, k, v)
            if t == 1:
                o = ops.attend_decode(q, state.cache, i, out=buf("att"))
            else:
                o = ops.attend_prefill(q, k, v, state.cache, i, start)
            o = ops.contiguous(o.transpose(0, 2, 1, 3).reshape(b, t, a.n_heads * a.head_dim))
            x = ops.add(x, ops.matmul(o, lp.wo, out=buf("proj")), out=x)
            # feed-forward block (SwiGLU)
            h = ops.rmsnorm(x, lp.ffn_norm, a.norm_eps, out=buf("h"))
            gu = ops.matmul(h, lp.w_gate_up, out=buf("gate_up"))
            y = ops.swiglu(gu[..., :f], gu[..., f:], out=buf("ffn"))
            x = ops.add(x, ops.matmul(y, lp.w_down, out=buf("proj")), out=x)
        state.length = start + t
        if not all_logits and t > 1:
            x = ops.contiguous(x[:, -1:])
        h = ops.rmsnorm(x, p.output_norm, a.norm_eps, out=buf("h"))
        return ops.matmul(h, p.output, out=buf("logits"))

    def logits(self, ids) -> np.ndarray:
        """Full recompute (fresh cache) of float32 logits: ids [T] -> [T, V], [B, T] -> [B, T, V]."""
        ids = np.asarray(ids)
        squeeze = ids.ndim == 1
        ids2 = ids.reshape(1, -1) if squeeze else ids
        state = self.new_state(ids2.shape[0], max(ids2.shape[1], 1))
        out = self.ops.to_numpy(self.forward(self.ops.ids(ids2), state, all_logits=True))
        return out[0] if squeeze else out
