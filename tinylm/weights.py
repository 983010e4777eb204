"""Weights of a Llama-style decoder as NumPy arrays, and random weights for tests/benchmarks.

Every projection is stored in PyTorch ``nn.Linear`` orientation, ``[out_features, in_features]``,
so a layer computes ``y = x @ W.T``. Loading from GGUF lives in ``tinylm.gguf_io``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from .config import ModelArgs


@dataclass
class LayerWeights:
    """One transformer block (shapes for ModelArgs a, hd = a.head_dim)."""

    attn_norm: np.ndarray  # [dim]
    wq: np.ndarray  # [n_heads * hd, dim]
    wk: np.ndarray  # [n_kv_heads * hd, dim]
    wv: np.ndarray  # [n_kv_heads * hd, dim]
    wo: np.ndarray  # [dim, n_heads * hd]
    ffn_norm: np.ndarray  # [dim]
    w_gate: np.ndarray  # [ffn_dim, dim]
    w_up: np.ndarray  # [ffn_dim, dim]
    w_down: np.ndarray  # [dim, ffn_dim]
    # a family's extras (None where ModelArgs says it has none)
    bq: np.ndarray | None = None  # [n_heads * hd] (qkv_bias)
    bk: np.ndarray | None = None  # [n_kv_heads * hd]
    bv: np.ndarray | None = None  # [n_kv_heads * hd]
    q_norm: np.ndarray | None = None  # [hd] (qk_norm: one weight shared by every query head)
    k_norm: np.ndarray | None = None  # [hd]
    post_attn_norm: np.ndarray | None = None  # [dim] (post_norms)
    post_ffn_norm: np.ndarray | None = None  # [dim]


ALL_LAYER_FIELDS = tuple(f.name for f in fields(LayerWeights))
LAYER_FIELDS = ALL_LAYER_FIELDS[:9]  # every family has these
EXTRA_FIELDS = ALL_LAYER_FIELDS[9:]


def layer_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The shape every LayerWeights field ``args`` uses must have (the extras only where on)."""
    d, f, hd = args.dim, args.ffn_dim, args.head_dim
    shapes = {"attn_norm": (d,), "wq": (args.q_dim, d), "wk": (args.kv_dim, d),
              "wv": (args.kv_dim, d), "wo": (d, args.q_dim), "ffn_norm": (d,),
              "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
    if args.qkv_bias:
        shapes.update(bq=(args.q_dim,), bk=(args.kv_dim,), bv=(args.kv_dim,))
    if args.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    if args.post_norms:
        shapes.update(post_attn_norm=(d,), post_ffn_norm=(d,))
    return shapes


def rope_order(args: ModelArgs):
    """The order tinylm keeps a query/key head's dims in, as indices of the model's own order,
    or None when it is the model's own.

    RoPE over only the first ``r = args.rotary_dims`` of ``d = head_dim`` dims with NeoX pairs
    (i, i + r/2) (Phi-4-mini: 96 of 128) is not a pairing the RoPE kernels know; their NeoX pairs
    are (i, i + d/2). Reordered as [turned first halves, unturned, turned second halves,
    unturned] the model's pairs become the kernels' pairs i < r/2, and the unturned dims the pairs
    that ``ModelArgs.rope`` gives no turn. Scores are sums over a head's dims, so the same order of
    queries and keys leaves them as they were (the values are not reordered). Adjacent pairs need
    no reorder: the first r/2 are the turned ones already."""
    r, d = args.rotary_dims, args.head_dim
    if r == d or args.rope_style != "neox":
        return None
    h, p = r // 2, (d - r) // 2
    return np.concatenate([np.arange(h), r + np.arange(p), h + np.arange(h), r + p + np.arange(p)])


def in_tinylm_layout(args: ModelArgs, layer: LayerWeights) -> LayerWeights:
    """``layer`` as a GGUF file holds it (each head's dims in the model's own order) made into
    what tinylm runs: the query and key rows (projections, biases, QK norms) in ``rope_order``,
    the dims RoPE turns scaled by ``args.rope_mscale`` (LongRoPE's and YaRN's attention factor,
    by which the model scales cos and sin: the turned queries and keys, not the others), in the
    QK norm weights when the model has them, else in the projection rows and biases; wo and
    w_down times ``args.residual_scale`` (Granite). Itself when none applies."""
    if args.residual_scale != 1.0:
        r = args.residual_scale
        layer = replace(layer, wo=(layer.wo * r).astype(layer.wo.dtype),
                        w_down=(layer.w_down * r).astype(layer.w_down.dtype))
    order, m = rope_order(args), args.rope_mscale
    if order is None and m == 1.0:
        return layer
    hd = args.head_dim
    scale = np.where(np.arange(hd) < args.rotary_dims, m, 1.0)

    def rows(a, heads, scaled):
        if a is None:
            return None
        h = a.reshape((heads, hd) + a.shape[1:])
        if scaled and m != 1.0:
            h = (h * scale.reshape((hd,) + (1,) * (a.ndim - 1))).astype(a.dtype)
        if order is not None:
            h = h[:, order]
        return np.ascontiguousarray(h.reshape(a.shape))

    proj = layer.q_norm is None  # where the factor goes: the projections, or the norms after them
    return replace(layer, wq=rows(layer.wq, args.n_heads, proj), wk=rows(layer.wk, args.n_kv_heads, proj),
                   bq=rows(layer.bq, args.n_heads, proj), bk=rows(layer.bk, args.n_kv_heads, proj),
                   q_norm=rows(layer.q_norm, 1, not proj), k_norm=rows(layer.k_norm, 1, not proj))


@dataclass
class Weights:
    """All weights of the model; ``output is tok_embd`` when the embedding is tied."""

    tok_embd: np.ndarray  # [vocab, dim]
    output_norm: np.ndarray  # [dim]
    output: np.ndarray  # [vocab, dim] (the same object as tok_embd when tied)
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def tied(self) -> bool:
        return self.output is self.tok_embd

    def arrays(self):
        """Yield (name, array) for every distinct array (a tied output is not repeated)."""
        yield "tok_embd", self.tok_embd
        yield "output_norm", self.output_norm
        if not self.tied:
            yield "output", self.output
        for i, layer in enumerate(self.layers):
            for name in ALL_LAYER_FIELDS:
                if getattr(layer, name) is not None:
                    yield f"layers.{i}.{name}", getattr(layer, name)

    def nbytes(self) -> int:
        """Bytes of all distinct arrays: what one decode step streams through memory."""
        return sum(a.nbytes for _, a in self.arrays())

    def astype(self, dtype) -> "Weights":
        """A copy with every array cast to ``dtype`` (tying kept)."""
        def cast(a):
            return np.asarray(a, dtype=dtype)
        emb = cast(self.tok_embd)
        out = emb if self.tied else cast(self.output)
        layers = [LayerWeights(**{n: None if getattr(l, n) is None else cast(getattr(l, n))
                                  for n in ALL_LAYER_FIELDS}) for l in self.layers]
        return Weights(tok_embd=emb, output_norm=cast(self.output_norm), output=out, layers=layers)

    def check(self, args: ModelArgs) -> None:
        """Raise ValueError naming the first array whose shape does not fit ``args``."""
        want = {"tok_embd": (args.vocab_size, args.dim), "output_norm": (args.dim,),
                "output": (args.vocab_size, args.dim)}
        if len(self.layers) != args.n_layers:
            raise ValueError(f"Weights: {len(self.layers)} layers but args.n_layers = {args.n_layers}")
        if self.tied != args.tie_embeddings:
            raise ValueError(f"Weights: tied={self.tied} but args.tie_embeddings={args.tie_embeddings}")
        per_layer = layer_shapes(args)
        for i, layer in enumerate(self.layers):
            have = {n for n in ALL_LAYER_FIELDS if getattr(layer, n) is not None}
            if have != set(per_layer):
                raise ValueError(f"Weights: layer {i} has {sorted(have ^ set(per_layer))} against args "
                                 f"(quirks {args.quirks()})")
        for name, a in self.arrays():
            key = name.rsplit(".", 1)[-1]
            shape = want.get(key) or per_layer[key]
            if a.shape != shape:
                raise ValueError(f"Weights: {name} has shape {a.shape}, expected {shape}")


def synthetic(args: ModelArgs, seed: int = 0, dtype=np.float32) -> Weights:
    """Random weights for ``args`` (no file), deterministic in ``seed``.

    Projections and embeddings are N(0, 0.02) (GPT-2's init); the projections that write into
    the residual stream (wo, w_down) are scaled by 1/sqrt(2 * n_layers) so the stream stays
    O(1) however deep the model; norm weights are 1 + N(0, 0.1), near one but not all equal,
    so a norm that ignores its weight is caught.
    """
    rng = np.random.default_rng(seed)
    std, out_std = 0.02, 0.02 / np.sqrt(2 * args.n_layers)

    def normal(shape, scale):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(scale)
        return a.astype(dtype, copy=False)

    def norm_weight():
        return (1.0 + 0.1 * rng.standard_normal(args.dim, dtype=np.float32)).astype(dtype)

    shapes = layer_shapes(args)
    layers = []
    for _ in range(args.n_layers):
        arrays = {}
        for name in LAYER_FIELDS:
            if name.endswith("norm"):
                arrays[name] = norm_weight()
            else:
                arrays[name] = normal(shapes[name], out_std if name in ("wo", "w_down") else std)
        for name in (n for n in EXTRA_FIELDS if n in shapes):  # a family's extras, drawn after
            n = shapes[name][0]
            arrays[name] = (normal((n,), 0.5) if name.startswith("b")
                            else (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(dtype))
        layers.append(LayerWeights(**arrays))
    tok_embd = normal((args.vocab_size, args.dim), std)
    output_norm = norm_weight()
    output = tok_embd if args.tie_embeddings else normal((args.vocab_size, args.dim), std)
    return Weights(tok_embd=tok_embd, output_norm=output_norm, output=output, layers=layers)
