"""Model hyper-parameters (``ModelArgs``) and named presets.

A GGUF file fills ``ModelArgs`` from its metadata (see ``tinylm.gguf_io``); the presets describe
shapes for synthetic weights (``tinylm.weights.synthetic``), used by tests and benchmarks that
need no file.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

ROPE_STYLES = ("adjacent", "neox")
# The per-pair frequency divisor of a layer without RoPE (ModelArgs.nope_layers): float32's
# largest finite value, so every path's RoPE (tables, kernels, the fused steps) turns by an angle
# of at most pos * 3e-39, below float32's resolution of cos and sin at 1 and 0: no turn.
NOPE_FACTORS = (3.4028234663852886e38,)
ACTIVATIONS = ("silu", "gelu_tanh")  # the FFN gate: SwiGLU (Llama, Qwen, Mistral), GeGLU (Gemma)

# Prefill (tinylm.prefill). PREFILL_GRAPHS: a prompt of up to PREFILL_CHUNK tokens is padded to
# a length bucket and its forward pass replayed as a CUDA graph captured per (batch, bucket),
# on the cupy backend wherever decode steps are graph replays: the same kernels as the eager
# prefill, launched without ~300 Python launch paths (tests/tinylm/test_prefill.py: same tokens on the
# emulator). FUSED_PREFILL: the fused projections of cupyattn.fused in the prefill too (7
# kernels per layer instead of 10); H100, 2026-11-26: time to first token 2.6 ms against 3.4 ms
# unfused in the same run (SmolLM2-135M's shapes, fp16, batch 1; benchmarks/results/2026-11-26-h100).
PREFILL_GRAPHS = True
FUSED_PREFILL = True
# The default decode step on the cupy backend: the fused step (cupyattn.fused: 5 kernels per layer
# against 9 unfused), measured faster on an H100 with its GPU tests passing (2026-11-26:
# benchmarks/results/2026-11-26-h100/README.md).
TINYLM_FUSED_DECODE = True
# The decode step through the megakernel (cupyattn.megakernel) instead of the fused step: off until
# a GPU run shows it faster (H100, 2026-11-27: correct, slower than the fused step, 484 against 872
# tokens/s). TINYLM_MEGAKERNEL=1 in the environment turns it on.
TINYLM_MEGAKERNEL = os.environ.get("TINYLM_MEGAKERNEL", "") == "1"


@functools.lru_cache(maxsize=64)
def _partial_divisors(base: float, factors: tuple, r: int, d: int) -> tuple:
    """ModelArgs.rope's head_dim / 2 divisors for RoPE over the first ``r`` of ``d`` dims (its
    docstring), made once per (base, factors, r, d): every layer of every step asks for them."""
    turned = tuple(float(f) * base ** (2 * i / r - 2 * i / d) for i, f in enumerate(factors or (1.0,) * (r // 2)))
    return turned + NOPE_FACTORS * ((d - r) // 2)


@dataclass
class ModelArgs:
    """Shape and numerics of a Llama-style decoder.

    ``rope_style`` says which channel pairs RoPE rotates: "adjacent" rotates (x[2i], x[2i+1])
    (llama.cpp's "normal" layout, what GGUF files store), "neox" rotates (x[i], x[i + D/2])
    (the Hugging Face layout). ``n_heads * head_dim`` need not equal ``dim``.

    The fields after ``tie_embeddings`` say how a family departs from Llama (the defaults are
    Llama's; ``tinylm.families`` fills them from a GGUF file's ``{arch}.*`` keys):

    - ``qkv_bias``: the Q, K, V projections add a bias (Qwen2).
    - ``qk_norm``: each query and key head is RMS-normed over head_dim before RoPE (Qwen3, Gemma 3).
    - ``post_norms``: each block's output is RMS-normed before the residual add (Gemma 2/3's
      post_attention_norm and post_ffw_norm).
    - ``act``: the FFN gate, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    - ``embed_scale``: the embedding rows are multiplied by it (Gemma: sqrt(dim)).
    - ``attn_scale``: softmax scale, None = 1/sqrt(head_dim).
    - ``attn_softcap`` / ``final_softcap``: scores / logits become ``c * tanh(s / c)`` (Gemma 2);
      0 = off.
    - ``sliding_window``: a local layer's query sees this many keys, itself included (0 = none);
      ``local_layers`` lists which layers are local (empty: every layer when a window is set).
    - ``rope_local_base``: RoPE base of the local layers (Gemma 3), 0 = ``rope_base``.
    - ``rope_factors``: per rotation pair, the global layers' frequency is divided by it (Llama
      3.1+'s ``rope_freqs`` tensor; linear RoPE scaling is all pairs equal); () = none.
    - ``residual_scale``: each block's output is multiplied by it before its residual add
      (Granite's residual_multiplier); ``logit_scale``: the logits are divided by it (Granite's
      logits_scaling). The loader puts both in the weights (wo and w_down, output_norm); the model
      never applies them.
    - ``rope_dims``: RoPE turns only the first this many dims of each head, by frequencies of
      ``rope_base ** (-2i / rope_dims)`` (Phi-4-mini: 96 of 128; the rest pass unturned); 0 = all.
      The RoPE tables (and ``rope_factors``) then have rope_dims / 2 pairs; ``rope()`` maps them
      onto the head's pairs (see ``rope()``).
    """

    dim: int  # residual width
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA when < n_heads)
    head_dim: int
    ffn_dim: int  # SwiGLU hidden width
    vocab_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_style: str = "adjacent"
    max_seq: int = 2048  # longest sequence the model supports (KV-cache capacity by default)
    tie_embeddings: bool = True  # logits use tok_embd when True
    arch: str = "llama"  # the GGUF architecture it came from (general.architecture)
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    act: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    sliding_window: int = 0
    local_layers: tuple = ()
    rope_local_base: float = 0.0
    rope_factors: tuple = ()
    nope_layers: tuple = ()  # layers whose queries and keys are not rotated (SmolLM3's every 4th)
    # LongRoPE (Phi-3 128k, Phi-3.5): rope_factors holds the short table; the long one replaces it
    # when the model's context (max_seq) exceeds rope_orig_ctx, as llama.cpp picks by its context
    # size; rope_mscale (LongRoPE's and YaRN's attention factor) scales cos and sin on every layer, so
    # the turned dims of queries and keys: the loader puts it in their weights
    # (tinylm.weights.in_tinylm_layout), the model never applies it
    rope_factors_long: tuple = ()
    rope_orig_ctx: int = 0
    rope_mscale: float = 1.0
    rope_dims: int = 0  # head dims RoPE turns (the first ones), 0 = head_dim
    residual_scale: float = 1.0
    logit_scale: float = 1.0

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                     "vocab_size", "max_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelArgs: {name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelArgs: n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs: RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"ModelArgs: rope_style must be one of {ROPE_STYLES}, "
                             f"got {self.rope_style!r}")
        if not self.norm_eps > 0 or not self.rope_base > 0:
            raise ValueError("ModelArgs: norm_eps and rope_base must be positive")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"ModelArgs: act must be one of {ACTIVATIONS}, got {self.act!r}")
        for name in ("embed_scale", "attn_softcap", "final_softcap", "rope_local_base"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"ModelArgs: {name} must be a finite number >= 0, got {v!r}")
        if self.embed_scale == 0:
            raise ValueError("ModelArgs: embed_scale must be positive")
        for name in ("residual_scale", "logit_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"ModelArgs: {name} must be a positive finite number, got {v!r}")
        if self.attn_scale is not None and not 0 < self.attn_scale < float("inf"):
            raise ValueError(f"ModelArgs: attn_scale must be None or positive, got {self.attn_scale!r}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                or self.sliding_window < 0:
            raise ValueError(f"ModelArgs: sliding_window must be an int >= 0, got {self.sliding_window!r}")
        self.local_layers = tuple(int(i) for i in self.local_layers)
        self.nope_layers = tuple(int(i) for i in self.nope_layers)
        for name in ("local_layers", "nope_layers"):
            if any(not 0 <= i < self.n_layers for i in getattr(self, name)):
                raise ValueError(f"ModelArgs: {name} must be layer indices in [0, {self.n_layers})")
        if isinstance(self.rope_dims, bool) or not isinstance(self.rope_dims, int) or self.rope_dims % 2 \
                or not 0 <= self.rope_dims <= self.head_dim:
            raise ValueError(f"ModelArgs: rope_dims must be an even int in [0, head_dim = {self.head_dim}] "
                             f"(0: all), got {self.rope_dims!r}")
        pairs = self.rotary_dims // 2
        for name in ("rope_factors", "rope_factors_long"):
            table = tuple(float(f) for f in getattr(self, name))
            setattr(self, name, table)
            if table and (len(table) != pairs or not all(0 < f < float("inf") for f in table)):
                raise ValueError(f"ModelArgs: {name} must be rope_dims / 2 = {pairs} "
                                 f"positive numbers, got {len(table)}")
        if self.rope_factors_long and not (self.rope_factors and self.rope_orig_ctx >= 1):
            raise ValueError("ModelArgs: rope_factors_long needs the short table (rope_factors) and rope_orig_ctx >= 1")
        if isinstance(self.rope_mscale, bool) or not 0 < self.rope_mscale < float("inf"):
            raise ValueError(f"ModelArgs: rope_mscale must be positive, got {self.rope_mscale!r}")

    # --- per-layer attention ------------------------------------------------------------------
    @property
    def scale(self) -> float:
        """The softmax scale: attn_scale, or 1/sqrt(head_dim)."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def active_rope_factors(self) -> tuple:
        """The per-pair divisors every RoPE layer turns by: LongRoPE's long table when the context
        exceeds the original one, else rope_factors."""
        if self.rope_factors_long and self.max_seq > self.rope_orig_ctx:
            return self.rope_factors_long
        return self.rope_factors

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        return self.sliding_window > 0 and (not self.local_layers or layer in self.local_layers)

    def window(self, layer: int):
        """``(left, 0)`` keys before the query that ``layer`` sees (cupyattn's ``window=``), or
        None for a global layer."""
        return (self.sliding_window - 1, 0) if self.is_local(layer) else None

    @property
    def rotary_dims(self) -> int:
        """The head dims RoPE turns (rope_dims, or all of head_dim)."""
        return self.rope_dims or self.head_dim

    def rope(self, layer: int):
        """``(base, factors)`` of ``layer``'s RoPE: a local layer of a model with a local base
        (Gemma 3) turns by that base, unscaled; a layer of ``nope_layers`` by NOPE_FACTORS (no
        turn at all); every other layer by rope_base and rope_factors.

        ``factors`` holds head_dim / 2 divisors of the frequencies ``base ** (-2i / head_dim)`` of
        every path's RoPE, or () for none. With ``rope_dims`` < head_dim the model's pair i < rope_dims / 2
        turns at ``base ** (-2i / rope_dims) / rope_factors[i]``: its divisor is that ratio; the
        other pairs get NOPE_FACTORS (no turn). Adjacent pairs are then the model's own; NeoX
        pairs are once the Q/K rows are in ``tinylm.weights.rope_order``."""
        if layer in self.nope_layers:
            return self.rope_base, NOPE_FACTORS * (self.head_dim // 2)
        if self.rope_local_base and self.is_local(layer):
            base, factors = self.rope_local_base, ()
        else:
            base, factors = self.rope_base, self.active_rope_factors
        r, d = self.rotary_dims, self.head_dim
        return base, factors if r == d else _partial_divisors(float(base), factors, r, d)

    @property
    def rope_divisors(self) -> tuple:
        """Per layer, the divisors of ``rope(layer)`` (all 1 for a layer without), or () when no
        layer has any: the megakernel's one table for every layer (cupyattn.megakernel_llama's
        LlamaShape), which turns every layer by rope_base."""
        rows = [self.rope(i)[1] for i in range(self.n_layers)]
        if not any(rows):
            return ()
        return tuple(r or (1.0,) * (self.head_dim // 2) for r in rows)

    def quirks(self) -> list:
        """Names of what differs from Llama, for messages and docs (empty for a plain Llama)."""
        on = [name for name, flag in (
            ("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm), ("post_norms", self.post_norms),
            ("act=gelu_tanh", self.act == "gelu_tanh"), ("embed_scale", self.embed_scale != 1.0),
            ("attn_scale", self.attn_scale is not None), ("attn_softcap", self.attn_softcap > 0),
            ("final_softcap", self.final_softcap > 0), ("sliding_window", self.sliding_window > 0),
            ("rope_local_base", self.rope_local_base > 0), ("rope_factors", bool(self.rope_factors)),
            ("nope_layers", bool(self.nope_layers)), ("longrope", bool(self.rope_factors_long)),
            ("rope_mscale", self.rope_mscale != 1.0), ("rope_dims", self.rotary_dims < self.head_dim),
            ("residual_scale", self.residual_scale != 1.0), ("logit_scale", self.logit_scale != 1.0))
            if flag]
        return on

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each key/value projection output, n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def n_params(self) -> int:
        """Number of weights (the tied embedding counted once)."""
        per_layer = (2 * self.dim  # attn_norm, ffn_norm
                     + 2 * self.q_dim * self.dim + 2 * self.kv_dim * self.dim  # q, o, k, v
                     + 3 * self.ffn_dim * self.dim)  # gate, up, down
        per_layer += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        per_layer += 2 * self.dim * self.post_norms
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + self.dim

    def with_(self, **changes) -> "ModelArgs":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def llama3_rope_factors(head_dim: int, base: float, factor: float, low: float, high: float, orig: int) -> tuple:
    """Llama 3.1+'s per-pair RoPE frequency divisors (what its GGUF's ``rope_freqs`` tensor holds):
    1 for wavelengths under ``orig / high``, ``factor`` over ``orig / low``, smooth between."""
    out = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * base ** (2 * i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(float(factor))
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


PRESETS: dict[str, ModelArgs] = {
    # Fast tests: head_dim 32 is the smallest the GPU attention kernels take; GQA group of 2.
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256,
                      vocab_size=256, max_seq=256),
    # Llama-2-7B's layer shapes (multi-head, untied output), cut to 4 layers for benchmarks.
    "llama2-7b-4layers": ModelArgs(dim=4096, n_layers=4, n_heads=32, n_kv_heads=32, head_dim=128,
                                   ffn_dim=11008, vocab_size=32000, norm_eps=1e-5,
                                   rope_base=10000.0, max_seq=4096, tie_embeddings=False),
    # SmolLM2-135M-Instruct's shapes, as read from its GGUF file (see DESIGN.md).
    "smollm2-135m-shape": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                    ffn_dim=1536, vocab_size=49152, norm_eps=1e-5,
                                    rope_base=100000.0, max_seq=8192, tie_embeddings=True),
    # The families' small models, as their GGUF files describe them (benchmarks: `model --model NAME`)
    "llama3.2-1b-shape": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                                   vocab_size=128256, rope_base=500000.0, max_seq=8192,
                                   rope_factors=llama3_rope_factors(64, 500000.0, 32.0, 1.0, 4.0, 8192)),
    "mistral-7b-4layers": ModelArgs(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                                    vocab_size=32000, rope_base=10000.0, max_seq=8192, tie_embeddings=False,
                                    arch="mistral", sliding_window=4096),  # v0.1: a 4096-key window
    "qwen2.5-0.5b-shape": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864,
                                    vocab_size=151936, norm_eps=1e-6, rope_base=1000000.0, rope_style="neox",
                                    max_seq=8192, arch="qwen2", qkv_bias=True),
    "qwen3-0.6b-shape": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                                  vocab_size=151936, norm_eps=1e-6, rope_base=1000000.0, rope_style="neox",
                                  max_seq=8192, arch="qwen3", qk_norm=True),
    "gemma2-2b-shape": ModelArgs(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=9216,
                                 vocab_size=256000, norm_eps=1e-6, rope_base=10000.0, rope_style="neox",
                                 max_seq=8192, arch="gemma2", act="gelu_tanh", embed_scale=2304 ** 0.5,
                                 post_norms=True, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
                                 local_layers=tuple(range(0, 26, 2))),
    "gemma3-1b-shape": ModelArgs(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                                 vocab_size=262144, norm_eps=1e-6, rope_base=1000000.0, rope_style="neox",
                                 max_seq=8192, arch="gemma3", act="gelu_tanh", embed_scale=1152 ** 0.5,
                                 post_norms=True, qk_norm=True, sliding_window=512, rope_local_base=10000.0,
                                 local_layers=tuple(i for i in range(26) if i % 6 < 5)),
    # Phi-3-mini-4k's shapes (multi-head, head_dim 96, untied), cut to 4 layers; no window (as llama.cpp)
    "phi3-mini-4layers": ModelArgs(dim=3072, n_layers=4, n_heads=32, n_kv_heads=32, head_dim=96, ffn_dim=8192,
                                   vocab_size=32064, rope_base=10000.0, rope_style="neox", max_seq=4096,
                                   tie_embeddings=False, arch="phi3"),
    # Phi-4-mini's layer shapes: RoPE over 96 of 128 head dims, tied (its LongRoPE tables left out:
    # their values do not change the time, and HF switches them by sequence length)
    "phi4-mini-4layers": ModelArgs(dim=3072, n_layers=4, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                                   vocab_size=200064, rope_base=10000.0, rope_style="neox", max_seq=4096,
                                   tie_embeddings=True, arch="phi3", rope_dims=96),
    # Granite-3.3-2B's shapes (GQA 4, tied, its four scales), cut to 8 layers
    "granite3-2b-8layers": ModelArgs(dim=2048, n_layers=8, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                                     vocab_size=49159, rope_base=10000000.0, max_seq=8192, arch="granite",
                                     embed_scale=12.0, attn_scale=0.015625, residual_scale=0.22, logit_scale=8.0),
    # SmolLM3-3B's shapes (GQA 4, tied), cut to 8 layers; layers 3 and 7 without RoPE
    "smollm3-3b-8layers": ModelArgs(dim=2048, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=128, ffn_dim=11008,
                                    vocab_size=128256, norm_eps=1e-6, rope_base=5000000.0, max_seq=8192,
                                    arch="smollm3", nope_layers=(3, 7)),
}
FAMILY_PRESETS = ("llama3.2-1b-shape", "mistral-7b-4layers", "qwen2.5-0.5b-shape", "qwen3-0.6b-shape",
                  "gemma2-2b-shape", "gemma3-1b-shape", "phi3-mini-4layers", "phi4-mini-4layers",
                  "smollm3-3b-8layers", "granite3-2b-8layers")
