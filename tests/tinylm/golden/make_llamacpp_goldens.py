"""Make tests/tinylm/golden/llamacpp_golden.json: llama.cpp's tokens for the goldens' texts and chats
on the tiny GGUF file of each family (tests/tinylm/golden/family_models.py), the second peer
beside HF transformers (families_golden.json), and the reference for tokenization: llama.cpp
reads the GGUF files the way their users run them.

Run once, in a virtual environment of its own (llama-cpp-python builds llama.cpp from source,
about 5 minutes on 2 cores):

    python3 -m venv /tmp/venv-llama && . /tmp/venv-llama/bin/activate
    pip install llama-cpp-python numpy jinja2 gguf
    python tests/tinylm/golden/make_llamacpp_goldens.py [SmolLM2-135M-Instruct.Q4_1.gguf] [FAMILY ...]

Named families are made again and merged into the JSON already there (the rest of it kept as it
is); none named: all anew.

For each family, and for the real SmolLM2 file when its path is given (its tokenizer only): FUZZ
random texts (pieces of many scripts, digits, whitespace runs, code, emoji, control-token text)
encoded as plain text, and FUZZ_SPECIAL with control tokens between them encoded with control
tokens parsed (``tokenize(special=True)``), the texts stored beside the ids. For every byte-level
pre-tokenizer name tinylm implements: the first PRE_TEXTS plain fuzz texts through a 3,000-token
byte-level BPE vocabulary trained here on them (its merges cross every split, so each
pre-tokenizer's splits show in the ids; stored in the JSON) and through the tiny Llama 3
vocabulary (whose whole words show whether the name ignores merges). For each family: the texts
encoded as plain text (``tokenize(special=False)``, no BOS), and each chat rendered by the file's
own template (Jinja, as HF renders it) and encoded with control tokens parsed
(``tokenize(special=True)``; BOS comes from the template); then, as a check of the two
peers against each other, llama.cpp's greedy tokens after the goldens' prompt and its largest
logit error against HF's goldens (relative to each row's largest logit). A file llama.cpp cannot
load is recorded with the reason. Every file runs at its own context (n_ctx 0); the LongRoPE one
also at its original context, whose logits (the short table) are recorded too.
"""
from __future__ import annotations

import base64
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import family_models as fm  # noqa: E402
from make_family_goldens import CHATS, TEXTS  # noqa: E402

OUT = HERE / "llamacpp_golden.json"
FUZZ, FUZZ_SPECIAL = 150, 60
PRE_TEXTS = 100  # of the plain fuzz texts, through each pre-tokenizer
_POOL = [" ", "  ", "\n", "\n\n", "\t", "a", "The", " the", "hello", "world", "123", "4567", "3.14", "-", "'s", "'re",
         "don't", "é", "ü", "日本語", "中文", "😀", "👍🏽", "ß", "Ω", "ﬁ", "\u00a0", "\u200b", "\r\n", "x=1;", "def f(x):",
         "    return", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "http://a.b/c?d=e", "UPPER", "MiXeD", "!!!", "...",
         "$100", "#tag", "@user", "ÀÉÎ", "ॐ", "한국어", "Привет", "مرحبا", "\\", '"quoted"', "(paren)", "[br]", "{cb}",
         "1,000,000", "2026-11-28"]
_CONTROL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>",
            "<start_of_turn>", "<end_of_turn>", "<|eot_id|>", "<|start_header_id|>", "<bos>", "<eos>"]


def fuzz_texts(seed: int = 1):
    """(plain texts, texts with control-token text between them), deterministic in ``seed``."""
    import random

    rng = random.Random(seed)
    plain = ["", " ", "  ", "\n", " hello", "hello ", "a  b", "   leading", "trailing   "]
    plain += ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 12))) for _ in range(FUZZ - len(plain))]
    special = []
    for t in plain[:FUZZ_SPECIAL]:
        mid = len(t) // 2
        special.append(t[:mid] + rng.choice(_CONTROL) + rng.choice(["", "\n", " ", "  x", "\n\nhi", "\u00a0y"])
                       + t[mid:] + rng.choice(_CONTROL))
    return plain, special


def fuzz(llm, plain, special) -> dict:
    return {"plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in plain],
            "special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in special]}


def render(template: str, system, user, bos: str, eos: str) -> str:
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": user}]
    return env.from_string(template).render(messages=msgs, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def trained_vocabulary(texts):
    """(tokens, merges) of a byte-level BPE trained on ``texts`` with no split at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    extra = ["The quick brown fox's tail isn't 1234567 meters long.\nIt's 3.14159!",
             "def foo(x):\n    return x ** 2  # square", "Ça coûte 12,50 € — très cher.",
             "日本語のテキストと中文字符 123", "HTTP/1.1 200 OK\r\nContent-Length: 42"] * 50
    tok.train_from_iterator(texts + extra, trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]))
    d = json.loads(tok.to_str())
    tokens = sorted(d["model"]["vocab"], key=d["model"]["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]


def pre_tokenizer_ids(tmp, plain):
    """{"vocab": trained tokens and merges, "ids": {pre: {"trained": ids, "tiny": ids}}}."""
    import gguf
    from llama_cpp import Llama

    sys.path.insert(0, str(HERE.parents[2]))
    from tinylm.tokenizer import PRE_TOKENIZERS

    tiny_tokens, _, tiny_merges, _ = fm.vocabulary("llama3")
    tokens, merges = trained_vocabulary(plain)
    out = {"vocab": {"tokens": tokens, "merges": merges}, "ids": {}}
    for pre in PRE_TOKENIZERS:
        out["ids"][pre] = {}
        for which, (toks, mrg) in (("trained", (tokens, merges)), ("tiny", (tiny_tokens, tiny_merges))):
            path = Path(tmp) / f"pre-{pre}-{which}.gguf"
            w = gguf.GGUFWriter(str(path), "llama")
            w.add_block_count(1)
            w.add_context_length(64)
            w.add_embedding_length(32)
            w.add_feed_forward_length(32)
            w.add_head_count(1)
            w.add_layer_norm_rms_eps(1e-5)
            w.add_string("tokenizer.ggml.model", "gpt2")
            w.add_string("tokenizer.ggml.pre", pre)
            w.add_token_list(toks)
            w.add_token_types([1] * len(toks))
            w.add_token_merges(mrg)
            w.add_bool("tokenizer.ggml.add_bos_token", False)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            llm = Llama(str(path), vocab_only=True, verbose=False)
            out["ids"][pre][which] = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in plain]
    return out


def main():
    import importlib.metadata as md

    from llama_cpp import Llama

    hf = json.loads((HERE / "families_golden.json").read_text())
    plain, special = fuzz_texts()
    only = [a for a in sys.argv[1:] if a in fm.SPECS]
    paths = [a for a in sys.argv[1:] if a not in fm.SPECS]
    versions = {"llama_cpp_python": md.version("llama-cpp-python"), "gguf": md.version("gguf")}
    out = {"command": "python tests/tinylm/golden/make_llamacpp_goldens.py [SmolLM2 path] [FAMILY ...]",
           "versions": versions, "fuzz_texts": {"plain": plain, "special": special}, "families": {}}
    if only:
        out = json.loads(OUT.read_text())
        assert out["fuzz_texts"] == {"plain": plain, "special": special}, "the fuzz texts changed: remake all"
        assert out["versions"] == versions, f"made with {out['versions']}: remake all with one version"
    if paths:  # the real model's tokenizer (vocab only)
        import hashlib

        real = Path(paths[0])
        llm = Llama(str(real), vocab_only=True, verbose=False)
        out["smollm2"] = {"file": real.name, "sha256": hashlib.sha256(real.read_bytes()).hexdigest(),
                          "fuzz": fuzz(llm, plain, special)}
    with tempfile.TemporaryDirectory() as tmp:
        if not only:
            out["pre_tokenizers"] = pre_tokenizer_ids(tmp, plain[:PRE_TEXTS])
        for family in only or fm.SPECS:
            path = fm.write(family, Path(tmp) / f"{family}.gguf")
            entry = {"hash": fm.content_hash(path)}
            try:
                # the file's own context (n_ctx 0), as tinylm runs a file by default
                llm = Llama(str(path), n_ctx=0, logits_all=True, verbose=False, n_threads=2)
            except ValueError as e:
                entry["error"] = str(e).replace(str(path), f"{family}.gguf")
                out["families"][family] = entry
                print(family, entry["error"])
                continue
            entry["tokenizer"] = {t: llm.tokenize(t.encode(), add_bos=False, special=False) for t in TEXTS}
            entry["fuzz"] = fuzz(llm, plain, special)
            text_of = lambda i: llm.detokenize([i], special=True).decode() if i >= 0 else ""  # noqa: E731
            template = llm.metadata["tokenizer.chat_template"]
            entry["chat"] = [{"system": s, "user": u,
                              "ids": llm.tokenize(render(template, s, u, text_of(llm.token_bos()),
                                                         text_of(llm.token_eos())).encode(), add_bos=False,
                                                  special=True)} for s, u in CHATS]
            g = hf["families"][family]
            ids = list(hf["prompt"])
            llm.eval(ids)
            for _ in range(len(g["tokens"])):
                ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval(ids[-1:])
            logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
            want = np.frombuffer(base64.b64decode(g["logits_f32_b64"]), dtype="<f4").reshape(g["logits_shape"])
            rows = min(len(logits), len(want))
            err = np.abs(logits[:rows] - want[:rows]).max(-1) / np.abs(want[:rows]).max(-1)
            entry.update(greedy=ids[len(hf["prompt"]):], logits_err_vs_hf=float(err.max()))
            if "longrope" in fm.SPECS[family]:  # at a context of the original one: the short table
                short = Llama(str(path), n_ctx=fm.SPECS[family]["longrope"], logits_all=True, verbose=False,
                              n_threads=2)
                short.eval(ids)
                entry["short_context"] = fm.SPECS[family]["longrope"]
                entry["short_logits_f32_b64"] = base64.b64encode(
                    np.array(short.scores[:len(ids)], dtype="<f4").tobytes()).decode()
            out["families"][family] = entry
            print(family, "greedy as HF" if entry["greedy"] == g["tokens"] else "greedy differs from HF",
                  f"logits {err.max():.1e} from HF's")
    OUT.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")  # compact: ids, mostly
    print("wrote", OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
