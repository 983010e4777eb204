"""GGUF fuzzing (CPU tier): 600 seeded mutations of a small Llama GGUF written with gguf's writer
(header, metadata values and types, tensor infos, offsets, truncation). Each file must either
load, or fail with the loader's own error (tinylm.gguf_io.GGUFError, one line naming the file),
within a time limit, and never allocate more than the address-space limit the fuzz process runs
under: no traceback from inside gguf, NumPy or tokenizers, no hang, no huge allocation.

"The loader" is what `python -m tinylm --model FILE` runs before generating: load_gguf (header,
metadata, tensors, dequantization) and the tokenizer built from the metadata.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("gguf")

N_BYTE_CASES = 450       # byte-level: flips, extreme counts, truncation
N_META_CASES = 150       # writer-level: metadata values of the wrong type / range, missing keys
TIME_LIMIT_S = 5.0       # per file
ADDRESS_SPACE = 3 << 30  # RLIMIT_AS of the fuzz process: a huge allocation fails there

SCRIPT = r'''
import json, os, random, resource, struct, sys, time, traceback
from pathlib import Path
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
sys.path.insert(0, {tests!r})
import gguf
from test_gguf import TINY, write_llama_gguf
from tinylm.gguf_io import GGUFError, load_gguf
from tinylm.tokenizer import Tokenizer

out = Path({out!r})
tokens = [chr(c) for c in range(33, 122)] + ["ab"]  # byte-level symbols '!'..'y' and one merge
tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<extra{{i}}>" for i in range(3)]
assert len(tokens) == TINY.vocab_size
merges = ["a b"]
types = [1] * 90 + [3, 3, 3, 1, 1, 1]

def tokenizer_kv(w, changes):
    kv = {{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": 92,
          "tokenizer.chat_template": "{{% for m in messages %}}x{{% endfor %}}"}}
    kv.update(changes)
    for k, v in kv.items():
        if v is None:
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            (w.add_int64 if v < 0 or v > 2**32 - 1 else w.add_uint32)(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)

def write(path, llama_changes=None, tok_changes=None):
    """write_llama_gguf plus tokenizer metadata; llama_changes replace llama.* values."""
    orig = gguf.GGUFWriter.write_header_to_file
    def hook(self, *a, **k):
        tokenizer_kv(self, tok_changes or {{}})
        for key, v in (llama_changes or {{}}).items():
            for kvd in self.kv_data:
                kvd.pop(key, None)
            if v is not None:
                tokenizer_kv(self, {{key: v}})
        return orig(self, *a, **k)
    gguf.GGUFWriter.write_header_to_file = hook
    try:
        write_llama_gguf(path)
    finally:
        gguf.GGUFWriter.write_header_to_file = orig

def load(path):
    args, weights, meta = load_gguf(path)
    Tokenizer.from_gguf_metadata(meta, path)
    return args

base = out / "base.gguf"
write(base)
assert load(base).n_layers == 2
raw = base.read_bytes()
rng = random.Random(20261123)
results = {{"ok": 0, "error": 0, "bad": [], "slowest": 0.0}}

def check(path, what):
    t = time.perf_counter()
    try:
        load(path)
        results["ok"] += 1
    except GGUFError as e:
        msg = str(e)
        if "\n" in msg or str(path) not in msg:
            results["bad"].append((what, "unclear GGUFError: " + msg[:300]))
        results["error"] += 1
    except BaseException as e:
        results["bad"].append((what, f"{{type(e).__name__}}: {{str(e)[:200]}} | " +
                               traceback.format_exc().splitlines()[-3][:200]))
    dt = time.perf_counter() - t
    results["slowest"] = max(results["slowest"], dt)
    if dt > {time_limit}:
        results["bad"].append((what, f"took {{dt:.1f}} s"))

# the data section is aligned to 32 bytes after the tensor infos; mutate mostly before it
data_guess = raw.rfind(b"blk.1.ffn_down.weight") + 64
extremes = [0, 1, 2, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**64 - 1]
path = out / "m.gguf"
for i in range({n_bytes}):
    b = bytearray(raw)
    kind = i % 3
    if kind == 0:  # flip 1-4 bytes in the header, metadata or tensor infos
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(4, data_guess)
            b[p] ^= rng.randrange(1, 256)
        what = f"flip #{{i}}"
    elif kind == 1:  # an extreme 8- or 4-byte value at a random position (counts, lengths, dims, offsets)
        p = rng.randrange(4, data_guess - 8)
        v = rng.choice(extremes)
        n = rng.choice((4, 8))
        b[p:p + n] = (v % (1 << (8 * n))).to_bytes(n, "little")
        what = f"extreme {{v}} at {{p}} #{{i}}"
    else:  # truncation anywhere
        b = b[:rng.randrange(0, len(raw))]
        what = f"truncate to {{len(b)}} #{{i}}"
    path.write_bytes(bytes(b))
    check(path, what)

bad_values = [0, -1, 2**31, 2**40, 1.5, float("nan"), float("inf"), -3.0, "text", True, [1, 2], None]
llama_keys = ["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
              "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
              "llama.attention.value_length", "llama.rope.dimension_count", "llama.rope.freq_base",
              "llama.attention.layer_norm_rms_epsilon", "llama.context_length", "llama.vocab_size",
              "general.architecture"]
tok_keys = ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
tok_bad = bad_values + [["a"] * 3, [7] * 96, ["zz yy"], [[1]], [-5] * 96, 10**6, ["a" for _ in range(96)]]
for i in range({n_meta}):
    if i % 2 == 0:
        key, v = rng.choice(llama_keys), rng.choice(bad_values)
        write(path, llama_changes={{key: v}})
    else:
        key, v = rng.choice(tok_keys), rng.choice(tok_bad)
        write(path, tok_changes={{key: v}})
    check(path, f"{{key}}={{v!r:.40}} #{{i}}")
json.dump(results, open(out / "results.json", "w"))
print("FUZZ-DONE")
'''


def test_gguf_fuzz(tmp_path):
    script = SCRIPT.format(limit=ADDRESS_SPACE, tests=str(Path(__file__).parent), out=str(tmp_path),
                           time_limit=TIME_LIMIT_S, n_bytes=N_BYTE_CASES, n_meta=N_META_CASES)
    (tmp_path / "fuzz.py").write_text(script)
    r = subprocess.run([sys.executable, str(tmp_path / "fuzz.py")], capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "FUZZ-DONE" in r.stdout, (r.stdout + r.stderr)[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["bad"] == [], textwrap.shorten(json.dumps(res["bad"][:20]), 3000)
    assert res["ok"] + res["error"] == N_BYTE_CASES + N_META_CASES
    assert res["error"] > N_BYTE_CASES // 2  # the mutations really break files
