"""Model hyper-parameters (``ModelArgs``) and named presets.

A GGUF file fills ``ModelArgs`` from its metadata (see ``tinylm.gguf_io``); the presets describe
shapes for synthetic weights (``tinylm.weights.synthetic``), used by tests and benchmarks that
need no file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

ROPE_STYLES = ("adjacent", "neox")

# Prefill (tinylm.prefill). PREFILL_GRAPHS: a prompt of up to PREFILL_CHUNK tokens is padded to
# a length bucket and its forward pass replayed as a CUDA graph captured per (batch, bucket),
# on the cupy backend wherever decode steps are graph replays: the same kernels as the eager
# prefill, launched without ~300 Python launch paths (tests/test_prefill.py: same tokens on the
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
# a GPU run shows it correct and faster (not yet run on a GPU). TINYLM_MEGAKERNEL=1 in the
# environment turns it on.
TINYLM_MEGAKERNEL = os.environ.get("TINYLM_MEGAKERNEL", "") == "1"


@dataclass
class ModelArgs:
    """Shape and numerics of a Llama-style decoder.

    ``rope_style`` says which channel pairs RoPE rotates: "adjacent" rotates (x[2i], x[2i+1])
    (llama.cpp's "normal" layout, what GGUF files store), "neox" rotates (x[i], x[i + D/2])
    (the Hugging Face layout). ``n_heads * head_dim`` need not equal ``dim``.
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
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embed + self.dim

    def with_(self, **changes) -> "ModelArgs":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


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
}
