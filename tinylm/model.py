"""The Llama-style Transformer of tinylm: one forward pass written once over an ops backend.

    x = embed(ids); h = rmsnorm(x, attn_norm of layer 0)
    per layer:  qkv = h [Wq; Wk; Wv]^T                       packed heads, one matmul
                q = rope(q), append rope(k), v to the KV cache at positions cache_len[b] + t
                                                            (one fused op; lengths advance)
                o = attention(q, cached K/V)                prefill: causal; decode: one query
                x = x + o Wo^T;  h = rmsnorm(x, ffn_norm)   (one fused op)
                x = x + (silu(h Wgate^T) * h Wup^T) Wdown^T; h = rmsnorm(x, next norm)
    logits = h Wout^T                                       (the last "next norm" is output_norm)

A family's own steps (tinylm.config.ModelArgs, read by tinylm.families) sit in that loop where the
family has them: the Q/K/V bias and the per-head Q/K norms between the QKV projection and RoPE
(``_qkv_tail``; RoPE with the layer's base and frequency divisors), the attention's scale, window
and softcap per layer (``_attn_options``), a norm of each block's output before its residual add
(Gemma's post-norms), GeGLU for SwiGLU, and a softcap of the logits. The embedding scale is
folded into the uploaded table (``Params.upload``). The fused steps and the megakernel take only
the families their kernels implement; ``fused_problem`` / ``megakernel_problem`` say why not.

Every sequence of a batch has its own cache length: a prompt batch is right-padded, with the
real token count of each sequence given as ``num_new`` (its logits are taken at its last real
token), and decode steps place each sequence's token at its own position. A decode step (T = 1)
writes only into RunState's buffers and reads its input ids from ``state.tokens``, so it can be
captured in a CUDA graph and replayed (tinylm.graphs).

The fused decode step (``Transformer(fused=True)``, cupy backend; ``_decode_fused``) computes the
same thing in 5 kernels per layer instead of 9, each norm folded into the projection after it:

    x = embed(ids)
    per layer:  q = rope(rmsnorm(x) Wq^T); rope(rmsnorm(x) Wk^T), rmsnorm(x) Wv^T -> cache   (1)
                o = attention(q, cached K/V), split-KV combine inside                    (2)
                x = x + o Wo^T                                                           (3)
                y = silu(rmsnorm(x) Wgate^T) * rmsnorm(x) Wup^T                          (4)
                x = x + y Wdown^T                                                        (5)
    logits = rmsnorm(x) Wout^T

The megakernel step (``Transformer(megakernel=True)``, cupy backend; ``_decode_mega``, not yet
run on a GPU, so opt-in) runs the same decode step, sampling included, as one persistent kernel
launch (cupyattn.megakernel; the Llama op list and the binding: cupyattn.megakernel_llama).

A prefill (T > 1) runs the layer loop above over all prompt tokens: 10 kernels per layer on the
cupy backend (the head merge after attention is one of them), which tinylm.prefill pads to a
length bucket and replays as a CUDA graph. ``Transformer(fused_prefill=True)`` runs it through
the fused projections instead (``_prefill_fused``: the steps (3) to (5) above, RMSNorm + QKV
projection, then the same RoPE + append and flash attention as the unfused prefill: 7 kernels
per layer).

The backends (tinylm.ops_numpy.NumpyOps, tinylm.ops_cupy.CupyOps) implement the ops interface
below; the model never looks at which one it has. Weights live in `Params` (uploaded once, in
the backend's dtype); everything that changes while generating lives in `RunState`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

# The ops interface. Every `out=` is optional; given, the op writes there and returns it.
#   name, dtype, xp                      backend name, compute dtype, array module
#   stream()                             context the backend's work runs in (CUDA stream / none)
#   upload(a) -> array                   host float32 -> backend array of `dtype`
#   new_cache(L, B, Hkv, S, hd)          KV cache: .reset(), .check_room(n), .host_lengths [L, B]
#   empty(shape) / ids(np ints)
#   token_buffer(B) / set_tokens(buf, ids) / read_tokens(buf)   the [B, 1] decode input ids
#   decode_workspace(B, Hq, hd), decode_splits(B, Hq, Hkv, hd, length)   split-KV partials / count
#   embedding(ids [B,T], table [V,D])    -> [B, T, D]
#   matmul(x [..., K], w [N, K])         -> [..., N]   (x @ w^T)
#   rmsnorm(x, w, eps) / add_rmsnorm(x, r, w, eps) -> (x += r, rmsnorm) / swiglu(g, u)
#   qkv_rope_append(qkv [B,T,(Hq+2Hkv)hd], cache, layer, Hq, base, style, num_new) -> q [B,Hq,T,hd]
#   attend_prefill(q, cache, layer, start, key_lengths, out)   causal over cached positions
#   attend_decode(q [B,Hq,1,hd], cache, layer, workspace, num_splits)   whole live cache per seq
#   merge_heads(o [B,Hq,T,hd], out) -> [B, T, Hq*hd] contiguous (T = 1: a view)
#   gather_rows(x [B,T,D], idx [B], out) -> [B, 1, D]   (idx: host ints, or device flat rows)
#   fused decode step (optional, ``fused_decode = True``): norm_qkv_rope_append(x, norm, wqkv, cache,
#     layer, Hq, eps, base, style, out), attend_decode(..., fused_combine=True),
#     matmul_residual(x, a, w) (x += a w^T), norm_gate_up_swiglu(x, norm, w_gate_up, eps, out),
#     norm_matmul(x, norm, w, eps, out)
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
# What the megakernel takes of a family's quirks (ModelArgs.quirks): everything its per-layer RoPE
# divisor table (ModelArgs.rope_divisors) expresses once the weights are in tinylm's layout, the
# softmax scale, and the scales folded into the weights (by the loader; embed_scale by Params)
MEGAKERNEL_QUIRKS = ("rope_factors", "nope_layers", "longrope", "rope_mscale", "rope_dims", "residual_scale",
                     "logit_scale", "attn_scale", "embed_scale")


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
    # a family's extras (None where it has none: tinylm.config.ModelArgs)
    bqkv: object = None  # [(n_heads + 2 * n_kv_heads) * head_dim] = bq | bk | bv
    q_norm: object = None  # [head_dim]
    k_norm: object = None  # [head_dim]
    post_attn_norm: object = None  # [dim]
    post_ffn_norm: object = None  # [dim]


@dataclass
class Params:
    tok_embd: object  # [vocab, dim]
    output_norm: object  # [dim]
    output: object  # [vocab, dim]; the same array as tok_embd when the embeddings are tied
    layers: list
    # the per-pair frequency divisor tables the layers turn by (ModelArgs.rope: Llama 3's, LongRoPE's,
    # NOPE_FACTORS), each float32 [head_dim / 2] on the backend, keyed by the table's values
    rope_tables: dict = field(default_factory=dict)

    @classmethod
    def upload(cls, weights, ops, args=None) -> "Params":
        """Copy host weights to the backend once, in its dtype; keeps the embedding tie.

        A model whose embeddings are scaled (``args.embed_scale``, Gemma's sqrt(dim)) gets its
        table scaled here once, in float32 as the reference scales each row, so that every path
        (fused steps, graphs) embeds with the plain gather; a tied output then sees the scaled
        table, and the output norm's weight is divided by the scale to give the same logits.
        """
        up = ops.upload
        opt = lambda a: None if a is None else up(a)  # noqa: E731

        def layer(lw):
            bqkv = None if lw.bq is None else up(np.concatenate([lw.bq, lw.bk, lw.bv]))
            return LayerParams(attn_norm=up(lw.attn_norm), wqkv=up(np.concatenate([lw.wq, lw.wk, lw.wv])),
                               wo=up(lw.wo), ffn_norm=up(lw.ffn_norm),
                               w_gate_up=up(np.concatenate([lw.w_gate, lw.w_up])), w_down=up(lw.w_down),
                               bqkv=bqkv, q_norm=opt(lw.q_norm), k_norm=opt(lw.k_norm),
                               post_attn_norm=opt(lw.post_attn_norm), post_ffn_norm=opt(lw.post_ffn_norm))

        layers = [layer(lw) for lw in weights.layers]
        scale = 1.0 if args is None else float(args.embed_scale)
        tied = weights.output is weights.tok_embd
        table, norm = weights.tok_embd, weights.output_norm
        if scale != 1.0:
            table = np.asarray(table, dtype=np.float32) * np.float32(scale)
            if tied:
                norm = np.asarray(norm, dtype=np.float32) / np.float32(scale)
        tok = ops.upload(table)
        out = tok if tied else ops.upload(weights.output)
        tables = {args.rope(i)[1] for i in range(args.n_layers)} - {()} if args is not None else set()
        return cls(tok, ops.upload(norm), out, layers,
                   {t: ops.upload_f32(np.asarray(t, dtype=np.float32)) for t in tables})

    def nbytes(self) -> int:
        """Bytes of distinct weight arrays: what one decode step streams from memory."""
        seen, total = set(), 0
        arrays = [self.tok_embd, self.output_norm, self.output]
        arrays += [getattr(lp, f.name) for lp in self.layers for f in fields(LayerParams)]
        for a in arrays:
            if a is not None and id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes
        return total


# --- run state ------------------------------------------------------------------------------
class RunState:
    """KV cache and decode scratch, allocated once per (batch, max_seq) and reused.

    Prefill (T > 1 tokens) allocates its temporaries; a decode step (T = 1) reads its ids from
    ``tokens`` and writes only into the buffers below, so it allocates nothing and can be
    captured in a CUDA graph (``graphs`` holds them, one per context-length bucket).
    """

    def __init__(self, args, ops, batch: int = 1, max_seq: int | None = None):
        a, b = args, batch
        self.batch = b
        self.max_seq = int(max_seq or a.max_seq)
        qd, kvd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        # k, v: [n_layers, B, n_kv_heads, max_seq, head_dim] (backend dtype); lengths [n_layers, B]
        self.cache = ops.new_cache(a.n_layers, b, a.n_kv_heads, self.max_seq, a.head_dim)
        e = ops.empty
        self.tokens = ops.token_buffer(b)  # [B, 1] ids of the next decode step (sampled into)
        self.x = e((b, 1, a.dim))  # residual stream
        self.h = e((b, 1, a.dim))  # rmsnorm output
        self.qkv = e((b, 1, qd + 2 * kvd))  # [q | k | v] projections, heads packed
        self.q_rot = e((b, a.n_heads, 1, a.head_dim))  # q after rope, [B, Hq, 1, hd]
        self.att = e((b, a.n_heads, 1, a.head_dim))  # attention output, [B, Hq, 1, hd]
        self.proj = e((b, 1, a.dim))  # output of wo / w_down before the residual add
        self.gate_up = e((b, 1, 2 * a.ffn_dim))  # [h Wgate^T | h Wup^T]
        self.ffn = e((b, 1, a.ffn_dim))  # silu(gate) * up
        self.logits = e((b, 1, a.vocab_size))  # last position's logits
        self.workspace = ops.decode_workspace(b, a.n_heads, a.head_dim)  # split-KV partials or None
        self.sampling = ops.sampling_params(b) if hasattr(ops, "sampling_params") else None
        self.graphs = {}  # context bucket -> captured decode step (tinylm.graphs)
        self.mega = None  # cupyattn.megakernel_llama.LlamaDecoder, made by the first megakernel step
        self.prefill_buffers = {}  # padded prompt length -> tinylm.prefill.PrefillBuffers (+ graph)
        self.warm = set()  # buckets whose kernels an eager step has loaded

    @property
    def lengths(self):
        """Host int64 [B]: tokens cached per sequence."""
        return self.cache.host_lengths[0].copy()

    @property
    def length(self) -> int:
        """Tokens in the cache of the longest sequence."""
        return int(self.cache.host_lengths[0].max())

    def reset(self):
        self.cache.reset()


def context_bucket(length: int) -> int:
    """Bucket of a decode step whose longest sequence holds ``length`` keys: lengths in
    [2^(k-1), 2^k) share bucket k, its split-KV count and its captured graph."""
    return int(length).bit_length()


# --- the model ------------------------------------------------------------------------------
class Transformer:
    """Llama-style decoder over an ops backend.

    Parameters
    ----------
    args : tinylm.config.ModelArgs
    weights : tinylm.weights.Weights (host float32)
    backend : "auto" | "numpy" | "cupy", or an ops object
    dtype : compute/storage dtype name; None = the backend's default (float32 / float16)
    fused : decode steps through the fused kernels (5 per layer instead of 9); None =
        ``tinylm.config.TINYLM_FUSED_DECODE`` where the backend has them (cupy), else False.
        True on a backend without them is a ValueError.
    fused_prefill : multi-token forwards (prefill) through the same fused projections (7 kernels
        per layer instead of 10); None = ``tinylm.config.FUSED_PREFILL`` (on: measured faster on an
        H100). Same backend and head_dim rules as ``fused``.
    megakernel : decode steps as one persistent kernel launch each (cupyattn.megakernel, sampling
        inside; batch <= 8). Opt-in (docs/ran-where.md), so None = ``tinylm.config.TINYLM_MEGAKERNEL``
        (off unless TINYLM_MEGAKERNEL=1) where the backend, model and device take it; True where
        they do not is a ValueError saying why.
    """

    def __init__(self, args, weights, backend="auto", dtype=None, fused=None, fused_prefill=None,
                 megakernel=None):
        self.args = args
        self.ops = make_ops(backend, dtype) if isinstance(backend, str) else backend
        self.backend = self.ops.name
        self.dtype = np.dtype(self.ops.dtype).name
        self.fused = self._resolve_fused(fused)
        self.fused_prefill = self._resolve_fused(fused_prefill, prefill=True)
        self.megakernel = self._resolve_megakernel(megakernel)
        self._check_kernels()  # after the options: an option asked for is named first
        with self.ops.stream():
            self.params = Params.upload(weights, self.ops, args)
        self.weight_bytes = self.params.nbytes()

    def set_fused(self, fused) -> None:
        """Switch decode steps between the fused and the unfused kernels (states made before keep
        the graphs they captured: use a new RunState)."""
        self.fused = self._resolve_fused(fused)

    def set_fused_prefill(self, fused_prefill) -> None:
        """Switch prefill between the fused and the unfused kernels (states made before keep the
        prefill graphs they captured: use a new RunState)."""
        self.fused_prefill = self._resolve_fused(fused_prefill, prefill=True)

    def set_megakernel(self, megakernel) -> None:
        """Switch decode steps to (True) or from the megakernel (states made before keep the graphs
        they captured: use a new RunState)."""
        self.megakernel = self._resolve_megakernel(megakernel)

    def _resolve_megakernel(self, flag) -> bool:
        """Whether decode steps run as one megakernel launch (see the class docstring)."""
        from . import config as tinylm_config

        if flag is None:
            return bool(tinylm_config.TINYLM_MEGAKERNEL) and self.megakernel_problem() is None
        why = self.megakernel_problem() if flag else None
        if why:
            raise ValueError(f"megakernel=True: {why}")
        return bool(flag)

    def megakernel_problem(self) -> str | None:
        """Why this model and backend cannot take the megakernel (None: they can): the cupy backend,
        then what cupyattn.megakernel_llama.llama_problem says of the model and the device."""
        if not getattr(self.ops, "fused_decode", False):
            return f"the megakernel needs the cupy backend, not {self.backend!r}"
        a = self.args
        lacks = [q for q in a.quirks() if q not in MEGAKERNEL_QUIRKS]
        if lacks:  # its op list (cupyattn.megakernel_llama) is Llama's decode step and nothing else
            return (f"the megakernel's op list is Llama's; this {a.arch} model needs {', '.join(lacks)} "
                    f"(use the fused or unfused decode step)")
        from cupyattn import device
        from cupyattn.megakernel_llama import llama_problem

        return llama_problem(self.args, self.ops.dtype, cc=device.compute_capability())

    def fused_problem(self, prefill: bool = False) -> str | None:
        """Why the fused decode step (``prefill``: the fused prefill) cannot run this model on this
        backend (None: it can). Its kernels fold the norms into the projections and the residual
        adds into the projections after them, with SiLU and, in decode, plain RoPE: a family that
        needs a step between those (Gemma's post-norms, GeGLU; in decode, Qwen's bias and head
        norms) runs the unfused path, which has each step."""
        a = self.args
        what = "fused prefill" if prefill else "fused decode"
        if not getattr(self.ops, "fused_decode", False):
            return f"{what} needs the cupy backend, not {self.backend!r}"
        if a.head_dim % 16:
            return f"{what} needs a head_dim that is a multiple of 16, got {a.head_dim}"
        lacks = [name for name, on in (("post_norms", a.post_norms), ("act=gelu_tanh", a.act != "silu"),
                                       ("qkv_bias", a.qkv_bias and not prefill),
                                       ("qk_norm", a.qk_norm and not prefill)) if on]
        if lacks:
            return f"{what} does not implement {', '.join(lacks)} of this {a.arch} model (the unfused path does)"
        return None

    def _resolve_fused(self, fused, prefill=False) -> bool:
        why = self.fused_problem(prefill)
        if fused is None:
            if why is not None:
                return False
            if prefill:
                from .config import FUSED_PREFILL as default
            else:
                from .config import TINYLM_FUSED_DECODE as default
            return bool(default and self._device_runs_fused())
        if fused and why:
            raise ValueError(why)
        if fused and not self._device_runs_fused():  # refused here, not by the first prompt's launch
            from cupyattn import device
            from cupyattn.config import impl_min_cc

            need, cc = impl_min_cc("fused", "skinny", self.ops.dtype), device.compute_capability()
            raise ValueError(f"{'fused prefill' if prefill else 'fused decode'} needs compute capability "
                             f"{need // 10}.{need % 10} for {self.dtype}, this device is {cc // 10}.{cc % 10}")
        return bool(fused)

    def _check_kernels(self) -> None:
        """ValueError at load, naming the option, when a kernel the cupy backend will launch for
        this model cannot take it: every prefill and decode attention kernel takes the head dims
        of cupyattn.config.HEAD_DIMS only."""
        from cupyattn.config import HEAD_DIMS

        if self.ops.name == "cupy" and self.args.head_dim not in HEAD_DIMS:
            raise ValueError(f"backend='cupy': head_dim {self.args.head_dim} is not one the attention kernels "
                             f"take ({', '.join(map(str, HEAD_DIMS))}); use backend='numpy'")

    def _device_runs_fused(self) -> bool:
        """Whether this device has the fused step's instructions for the model's dtype (bf16 needs
        sm_80: below it the default is the unfused step; an explicit fused=True raises there)."""
        from cupyattn import device
        from cupyattn.config import impl_runs_on

        return impl_runs_on("fused", "skinny", self.ops.dtype, device.compute_capability())

    def new_state(self, batch: int = 1, max_seq: int | None = None) -> RunState:
        if max_seq is not None and max_seq > self.args.max_seq:
            raise ValueError(f"max_seq={max_seq} exceeds the model's max_seq={self.args.max_seq}")
        if self.megakernel:
            from cupyattn.config import MEGAKERNEL_MAX_BATCH

            if batch > MEGAKERNEL_MAX_BATCH:
                raise ValueError(f"the megakernel decodes at most {MEGAKERNEL_MAX_BATCH} sequences at once, "
                                 f"got batch={batch}")
        with self.ops.stream():
            return RunState(self.args, self.ops, batch, max_seq)

    def decode_splits(self, state: RunState, length: int):
        """Split-KV count of a decode step (None: the backend has none): chosen for the lower end
        of the context bucket, so an eager step and a graph replay of that bucket agree."""
        a = self.args
        return self.ops.decode_splits(state.batch, a.n_heads, a.n_kv_heads, a.head_dim,
                                      1 << (context_bucket(length) - 1))

    def forward(self, ids, state: RunState, all_logits: bool = False, num_new=None):
        """Run ids [B, T] (backend ints) after each sequence's cached tokens.

        num_new: None, or B host ints in [1, T]: sequence b's real tokens are ids[b, :num_new[b]]
        (right padding after them is not cached, and its logits are meaningless). T > 1 needs
        every sequence at the same cache length (a fresh or uniformly filled cache).

        Returns logits [B, T, vocab] when all_logits, else those of each sequence's last real
        position [B, 1, vocab] (in state.logits for a decode step: copy before the next call).
        """
        with self.ops.stream():
            return self._forward(ids, state, all_logits, num_new)

    def _forward(self, ids, state, all_logits, num_new):
        b, t = ids.shape
        if b != state.batch:
            raise ValueError(f"ids have batch {b} but the state was made for batch {state.batch}")
        counts = None
        if num_new is not None:
            counts = np.asarray(num_new, dtype=np.int64).reshape(-1)
            if counts.shape != (b,) or (counts < 1).any() or (counts > t).any():
                raise ValueError(f"num_new must be {b} ints in [1, T={t}], got {num_new!r}")
            if (counts == t).all():
                counts = None
        lengths = state.cache.host_lengths[0]
        start = int(lengths[0])
        if t > 1 and (lengths != start).any():
            raise ValueError("a multi-token forward needs every sequence at the same cache length")
        need = lengths + (t if counts is None else counts)
        if need.max() > state.max_seq:
            raise ValueError(f"sequence of {int(need.max())} tokens does not fit max_seq={state.max_seq}")
        decode = t == 1
        if decode and self.megakernel:
            if ids is not state.tokens:
                state.tokens[...] = ids
            self._decode_mega(state, sample=False)
            return state.logits
        splits = self.decode_splits(state, int(need.max())) if decode else None
        if decode and self.fused:
            return self._decode_fused(ids, state, splits)
        last = None if all_logits or t == 1 else (np.full(b, t) if counts is None else counts) - 1
        return self._run(ids, state, state if decode else None, counts, start,
                         None if counts is None else (start + counts).tolist(), last, splits)

    def _run(self, ids, state, scratch, counts, start, key_lengths, last, splits=None):
        """The forward pass after the checks (``forward``), also the body of a captured prefill
        (tinylm.prefill): ``scratch`` (None: allocate) holds the outputs by name, ``counts`` the
        tokens each sequence appends (None: all T), ``key_lengths`` the keys each sees (None:
        all), ``last`` the row per sequence whose logits are returned (None: every row; host
        ints, or a device array on the cupy backend)."""
        a, ops, p, cache = self.args, self.ops, self.params, state.cache
        b, t = ids.shape
        decode = t == 1

        def buf(name):  # decode and a captured prefill write into preallocated buffers
            return getattr(scratch, name, None)

        if not decode and self.fused_prefill:
            return self._prefill_fused(ids, state, buf, counts, start, key_lengths, last)
        f = a.ffn_dim
        x = ops.embedding(ids, p.tok_embd, out=buf("x"))
        h = ops.rmsnorm(x, p.layers[0].attn_norm, a.norm_eps, out=buf("h"))
        for i, lp in enumerate(p.layers):
            # attention block: projection, rope + cache append, attention, residual + next norm
            qkv = ops.matmul(h, lp.wqkv, out=buf("qkv"))
            q = self._qkv_tail(qkv, cache, i, lp, counts, buf("q_rot"))
            if decode:
                o = ops.attend_decode(q, cache, i, out=buf("att"), workspace=state.workspace, num_splits=splits,
                                      **self._attn_options(i))
            else:
                o = ops.attend_prefill(q, cache, i, start, key_lengths, out=buf("att"), **self._attn_options(i))
            o = ops.merge_heads(o, out=buf("att_rows"))
            x, h = ops.add_rmsnorm(x, self._post_norm(ops.matmul(o, lp.wo, out=buf("proj")), lp.post_attn_norm),
                                   lp.ffn_norm, a.norm_eps, out=buf("h"))
            # feed-forward block (SwiGLU / GeGLU) and the next block's (or the output's) norm
            gu = ops.matmul(h, lp.w_gate_up, out=buf("gate_up"))
            gate = ops.geglu if a.act == "gelu_tanh" else ops.swiglu
            y = gate(gu[..., :f], gu[..., f:], out=buf("ffn"))
            nxt = p.layers[i + 1].attn_norm if i + 1 < len(p.layers) else p.output_norm
            x, h = ops.add_rmsnorm(x, self._post_norm(ops.matmul(y, lp.w_down, out=buf("proj")), lp.post_ffn_norm),
                                   nxt, a.norm_eps, out=buf("h"))
        if last is not None:
            h = ops.gather_rows(h, last, out=buf("h_last"))
        return self._softcap(ops.matmul(h, p.output, out=buf("logits")))

    # --- a family's extra steps (ModelArgs says which are on) ------------------------------
    def _qkv_tail(self, qkv, cache, layer, lp, counts, out):
        """From the packed QKV projection to the rotated queries: the bias (Qwen2), the per-head
        norms (Qwen3, Gemma 3), then RoPE (the layer's base and frequency divisors) with the
        cache append."""
        a, ops = self.args, self.ops
        if lp.bqkv is not None:
            ops.add_bias(qkv, lp.bqkv)
        if lp.q_norm is not None:
            ops.head_rmsnorm(qkv, lp.q_norm, lp.k_norm, a.n_heads, a.n_kv_heads, a.norm_eps)
        base, factors = self._rope(layer)
        return ops.qkv_rope_append(qkv, cache, layer, a.n_heads, base, a.rope_style, num_new=counts, out=out,
                                   factors=factors)

    def _rope(self, layer):
        """(base, the backend's divisor table or None) of ``layer``'s RoPE (ModelArgs.rope)."""
        base, factors = self.args.rope(layer)
        return base, self.params.rope_tables[factors] if factors else None

    def _attn_options(self, layer) -> dict:
        """The attention options of ``layer`` that differ from the defaults (scale, window,
        softcap), as keyword arguments of attend_prefill / attend_decode."""
        a, kw = self.args, {}
        if a.attn_scale is not None:
            kw["scale"] = a.scale
        if a.window(layer) is not None:
            kw["window"] = a.window(layer)
        if a.attn_softcap:
            kw["softcap"] = a.attn_softcap
        return kw

    def _post_norm(self, y, weight):
        """Gemma's norm of a block's output before the residual add (in place); y itself else."""
        return y if weight is None else self.ops.rmsnorm(y, weight, self.args.norm_eps, out=y)

    def _softcap(self, logits):
        """Gemma 2's final logit softcap, in place (logits unchanged without one)."""
        return self.ops.softcap(logits, self.args.final_softcap) if self.args.final_softcap else logits

    def _prefill_fused(self, ids, state, buf, counts, start, key_lengths, last):
        """A multi-token forward in 7 kernels per layer (``fused_prefill``): each norm folded into
        the projection after it and each residual add into the projection before it, as the
        fused decode step does; the QKV output goes through the same RoPE + append kernel and
        the same flash attention as the unfused prefill."""
        a, ops, p, cache = self.args, self.ops, self.params, state.cache
        x = ops.embedding(ids, p.tok_embd, out=buf("x"))  # the residual stream, updated in place
        for i, lp in enumerate(p.layers):
            qkv = ops.norm_matmul(x, lp.attn_norm, lp.wqkv, a.norm_eps, out=buf("qkv"))
            q = self._qkv_tail(qkv, cache, i, lp, counts, buf("q_rot"))
            o = ops.merge_heads(ops.attend_prefill(q, cache, i, start, key_lengths, out=buf("att"),
                                                   **self._attn_options(i)), out=buf("att_rows"))
            ops.matmul_residual(x, o, lp.wo)
            y = ops.norm_gate_up_swiglu(x, lp.ffn_norm, lp.w_gate_up, a.norm_eps, out=buf("ffn"))
            ops.matmul_residual(x, y, lp.w_down)
        if last is not None:
            x = ops.gather_rows(x, last, out=buf("h_last"))
        return self._softcap(ops.norm_matmul(x, p.output_norm, p.output, a.norm_eps, out=buf("logits")))

    def _decode_fused(self, ids, state, splits):
        """A decode step in 5 kernels per layer (module docstring), into RunState's buffers."""
        a, ops, p, cache = self.args, self.ops, self.params, state.cache
        b = ids.shape[0]
        x = ops.embedding(ids, p.tok_embd, out=state.x)  # the residual stream, updated in place
        for i, lp in enumerate(p.layers):
            base, factors = self._rope(i)
            q = ops.norm_qkv_rope_append(x, lp.attn_norm, lp.wqkv, cache, i, a.n_heads, a.norm_eps, base,
                                         a.rope_style, out=state.q_rot, factors=factors)
            o = ops.attend_decode(q, cache, i, out=state.att, workspace=state.workspace, num_splits=splits,
                                  fused_combine=True, **self._attn_options(i))
            ops.matmul_residual(x, o.reshape(b, 1, a.n_heads * a.head_dim), lp.wo)
            y = ops.norm_gate_up_swiglu(x, lp.ffn_norm, lp.w_gate_up, a.norm_eps, out=state.ffn)
            ops.matmul_residual(x, y, lp.w_down)
        return self._softcap(ops.norm_matmul(x, p.output_norm, p.output, a.norm_eps, out=state.logits))

    def _decode_mega(self, state, sample: bool) -> None:
        """A decode step as one megakernel launch (cupyattn.megakernel_llama.LlamaDecoder of the
        model's weights and this state): logits of state.tokens into state.logits and, with
        ``sample``, the next ids into state.tokens (state.sampling's settings); every layer's cache
        lengths advance by one. Its split count follows the context bucket's lower end, as the
        other decode steps' does."""
        if state.mega is None:
            from cupyattn.megakernel_llama import LlamaDecoder

            state.mega = LlamaDecoder(self.params, self.args, state)
        state.mega.run(1 << (context_bucket(state.length + 1) - 1), sample)

    def decode_and_sample(self, state) -> None:
        """The megakernel's decode step with sampling inside (tinylm.graphs.decode_step)."""
        with self.ops.stream():
            self._decode_mega(state, sample=True)

    def logits(self, ids) -> np.ndarray:
        """Full recompute (fresh cache) of float32 logits: ids [T] -> [T, V], [B, T] -> [B, T, V]."""
        ids = np.asarray(ids)
        squeeze = ids.ndim == 1
        ids2 = ids.reshape(1, -1) if squeeze else ids
        state = self.new_state(ids2.shape[0], max(ids2.shape[1], 1))
        with self.ops.stream():
            out = self.ops.to_numpy(self.forward(self.ops.ids(ids2), state, all_logits=True))
        return out[0] if squeeze else out
