"""Make tests/tinylm/golden/llamacpp_golden.json: llama.cpp's tokens for the goldens' texts and chats
on the tiny GGUF file of each family (tests/tinylm/golden/family_models.py), the second peer
beside HF transformers (families_golden.json), and the reference for tokenization: llama.cpp
reads the GGUF files the way their users run them.

Run once, in a virtual environment of its own (llama-cpp-python builds llama.cpp from source,
about 5 minutes on 2 cores):

    python3 -m venv /tmp/venv-llama && . /tmp/venv-llama/bin/activate
    pip install llama-cpp-python numpy jinja2 gguf
    python tests/tinylm/golden/make_llamacpp_goldens.py

For each family: the texts encoded as plain text (``tokenize(special=False)``, no BOS), and each
chat rendered by the file's own template (Jinja, as HF renders it) and encoded with control tokens
parsed (``tokenize(special=True)``; BOS comes from the template); then, as a check of the two
peers against each other, llama.cpp's greedy tokens after the goldens' prompt and its largest
logit error against HF's goldens (relative to each row's largest logit). A file llama.cpp cannot
load is recorded with the reason.
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


def render(template: str, system, user, bos: str, eos: str) -> str:
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = ([] if system is None else [{"role": "system", "content": system}]) + [{"role": "user", "content": user}]
    return env.from_string(template).render(messages=msgs, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def main():
    import importlib.metadata as md

    from llama_cpp import Llama

    hf = json.loads((HERE / "families_golden.json").read_text())
    out = {"command": "python tests/tinylm/golden/make_llamacpp_goldens.py",
           "versions": {"llama_cpp_python": md.version("llama-cpp-python"), "gguf": md.version("gguf")},
           "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in fm.SPECS:
            path = fm.write(family, Path(tmp) / f"{family}.gguf")
            entry = {"hash": fm.content_hash(path)}
            try:
                llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
            except ValueError as e:
                entry["error"] = str(e).replace(str(path), f"{family}.gguf")
                out["families"][family] = entry
                print(family, entry["error"])
                continue
            entry["tokenizer"] = {t: llm.tokenize(t.encode(), add_bos=False, special=False) for t in TEXTS}
            special = lambda i: llm.detokenize([i], special=True).decode() if i >= 0 else ""  # noqa: E731
            template = llm.metadata["tokenizer.chat_template"]
            entry["chat"] = [{"system": s, "user": u,
                              "ids": llm.tokenize(render(template, s, u, special(llm.token_bos()),
                                                         special(llm.token_eos())).encode(), add_bos=False,
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
            out["families"][family] = entry
            print(family, "greedy as HF" if entry["greedy"] == g["tokens"] else "greedy differs from HF",
                  f"logits {err.max():.1e} from HF's")
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
