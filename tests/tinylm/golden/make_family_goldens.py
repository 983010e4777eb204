"""Make tests/tinylm/golden/families_golden.json: Hugging Face transformers' logits and greedy tokens on
the tiny GGUF file of each family (tests/tinylm/golden/family_models.py), the peer tinylm is held to.

Run once, in a virtual environment of its own (transformers and torch are not CI dependencies):

    python3 -m venv /tmp/venv-peer && . /tmp/venv-peer/bin/activate
    pip install torch transformers accelerate gguf numpy sentencepiece jinja2 tokenizers
    python tests/tinylm/golden/make_family_goldens.py [FAMILY ...]

Named families are made again and merged into the JSON already there (the others kept as they
are; an entry made with other versions than the file's records its own); none named: all anew.

For each family: the file is written, loaded with ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=..., config=...)`` on CPU in float32 with eager attention, greedy-decoded for GREEDY
tokens after the prompt (family_models.PROMPT), and run once more over the prompt and those tokens
to record the logits of every position. HF's GGUF loader does not read everything a file says
(DESIGN.md, "The real model"): the config values it misses are set by hand from what the file
says, in OVERRIDES below, and listed in the JSON under each family's "config_set_by_hand".
The tokenizer check encodes a few texts, and a few chat turns through the file's chat template
(``apply_chat_template``), with HF's tokenizer built from the same file.
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

GREEDY = 8
OUT = HERE / "families_golden.json"
TEXTS = ["hello world", "the end, and 42 things!", "  in it\non  at", "héllo ünïcode ☃"]
CHATS = [(None, "hello world"), ("the end", "is it on?")]  # (system, user) turns for apply_chat_template


def overrides(family: str, path=None) -> dict:
    """Config values HF's GGUF loader would get wrong for this file, set from the file's own values."""
    s = fm.SPECS[family]
    if "longrope" in s:  # the loader reads no LongRoPE: the file's tables and attention factor;
        # HF takes the long table for sequences past original_max_position_embeddings, llama.cpp and
        # tinylm for a context past it (512 > 256 here): 8 makes HF take it for every sequence of the
        # goldens (all past 8 tokens), as the other two do at their context of 512. Nor does it read
        # rope.dimension_count (Phi-4-mini: partial_rotary_factor) or a missing output.weight (tied)
        import gguf

        t = {x.name: [float(v) for v in np.array(x.data).reshape(-1)] for x in gguf.GGUFReader(str(path)).tensors
             if x.name.startswith("rope_factors_")}
        factor = float(np.float32(np.sqrt(1 + np.log(s["ctx"] / s["longrope"]) / np.log(s["longrope"]))))
        return {"sliding_window": None, "pad_token_id": None, "max_position_embeddings": s["ctx"],
                "original_max_position_embeddings": 8, "tie_word_embeddings": s["tied"],
                "rope_parameters": {"rope_type": "longrope", "rope_theta": s["base"],
                                    "short_factor": t["rope_factors_short.weight"],
                                    "long_factor": t["rope_factors_long.weight"],
                                    "partial_rotary_factor": s.get("rope_dims", s["hd"]) / s["hd"],
                                    "original_max_position_embeddings": 8, "attention_factor": factor}}
    if family == "llama3":  # the loader ignores rope_freqs.weight: the Llama 3 scaling it encodes
        factor, low, high, orig = s["rope_freqs"]
        return {"rope_parameters": {"rope_type": "llama3", "rope_theta": s["base"], "factor": factor,
                                    "low_freq_factor": low, "high_freq_factor": high,
                                    "original_max_position_embeddings": orig}}
    if family == "mistral":  # llama arch: the loader reads no sliding window (see as_mistral)
        return {"sliding_window": s["window"]}
    if family == "qwen3-yarn":  # as qwen3, and the loader reads no YaRN
        return {"head_dim": s["hd"], "max_position_embeddings": s.get("ctx", 256),
                "rope_parameters": {"rope_type": "yarn", "rope_theta": s["base"], "factor": s["yarn"][0],
                                    "original_max_position_embeddings": s["yarn"][1]}}
    if family in ("qwen2", "qwen3"):  # the loader takes dim / heads (qwen2) or 128 (qwen3) as head_dim
        return {"head_dim": s["hd"]}
    if family == "gemma2":  # the loader uses 50 / 30 and query_pre_attn_scalar 256 whatever the file says
        return {"attn_logit_softcapping": s["softcaps"][0], "final_logit_softcapping": s["softcaps"][1],
                "query_pre_attn_scalar": s["hd"]}
    if family == "phi3":  # the loader reads no window either (set so: llama.cpp runs Phi-3 without one);
        # Phi3Config's default pad id 32000 is past this file's vocabulary, which has none
        return {"sliding_window": None, "pad_token_id": None}
    if family == "gemma3":  # query scale, local/global layer pattern, linear scaling of the global layers
        return {"query_pre_attn_scalar": s["hd"],
                "layer_types": ["sliding_attention" if i % s["pattern"] < s["pattern"] - 1 else "full_attention"
                                for i in range(s["layers"])],
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": s["linear"],
                                                       "rope_theta": s["base"]},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    return {}


def as_mistral(llama, window: int):
    """HF's Mistral with the weights HF's GGUF loader read into a Llama. A llama-arch file is
    Mistral to that loader only when general.name is exactly "mistral", and then it fails (gguf-py
    0.19 has no "mistral" architecture): so the file loads as Llama, and MistralForCausalLM, which
    has the same parameter names, takes its state dict with the file's window."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = llama.config.to_dict()
    for key in ("architectures", "model_type", "transformers_version"):
        cfg.pop(key, None)
    cfg["sliding_window"] = window
    model = MistralForCausalLM(MistralConfig(**cfg))
    model.config._attn_implementation = "eager"
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.float()


def by_hand(path, family):
    """HF's model of ``family`` holding the weights of its tiny file, built by hand where HF's GGUF
    loader has no such architecture: SmolLM3 (every 4th layer without RoPE is SmolLM3Config's own
    default) and Granite (its four multipliers from the file's scales). The file's Q/K rows are
    llama.cpp's adjacent-pair layout, turned back into HF's half split."""
    import gguf
    import torch
    import transformers

    s = fm.SPECS[family]
    hd = s["hd"]
    r = gguf.GGUFReader(str(path))
    t = {x.name: np.array(x.data).reshape([int(n) for n in reversed(x.shape)]) for x in r.tensors}
    vocab = t["token_embd.weight"].shape[0]
    common = dict(vocab_size=vocab, hidden_size=s["dim"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv"], rms_norm_eps=s["eps"],
                  tie_word_embeddings=s["tied"], max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": s["base"]},
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "smollm3":
        cfg = transformers.SmolLM3Config(**common, no_rope_layer_interval=4, use_sliding_window=False)
        cls = transformers.SmolLM3ForCausalLM
    else:
        emb, att, res, logit = s["granite"]
        cfg = transformers.GraniteConfig(**common, embedding_multiplier=emb, attention_multiplier=att,
                                         residual_multiplier=res, logits_scaling=logit)
        cls = transformers.GraniteForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()

    def unpermute(w, heads):
        return w.reshape(heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    sd = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
    if not s["tied"]:
        sd["lm_head.weight"] = t["output.weight"]
    for i in range(s["layers"]):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        sd.update({m + "input_layernorm.weight": t[b + "attn_norm.weight"],
                   m + "self_attn.q_proj.weight": unpermute(t[b + "attn_q.weight"], s["heads"]),
                   m + "self_attn.k_proj.weight": unpermute(t[b + "attn_k.weight"], s["kv"]),
                   m + "self_attn.v_proj.weight": t[b + "attn_v.weight"],
                   m + "self_attn.o_proj.weight": t[b + "attn_output.weight"],
                   m + "post_attention_layernorm.weight": t[b + "ffn_norm.weight"],
                   m + "mlp.gate_proj.weight": t[b + "ffn_gate.weight"],
                   m + "mlp.up_proj.weight": t[b + "ffn_up.weight"],
                   m + "mlp.down_proj.weight": t[b + "ffn_down.weight"]})
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
                                                 for k, v in sd.items()}, strict=False)
    assert not unexpected and all((k == "lm_head.weight" and s["tied"]) or "rotary" in k for k in missing), \
        (missing, unexpected)
    model.tie_weights()
    if family == "smollm3":
        assert model.config.no_rope_layers == [int((i + 1) % 4 != 0) for i in range(s["layers"])]
    return model


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def main():
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    only = sys.argv[1:] or list(fm.SPECS)
    if set(only) - set(fm.SPECS):
        raise SystemExit(f"unknown families {sorted(set(only) - set(fm.SPECS))}; known: {list(fm.SPECS)}")
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": __import__("importlib.metadata").metadata.version("gguf"), "numpy": np.__version__}
    out = {"command": "python tests/tinylm/golden/make_family_goldens.py", "versions": versions,
           "prompt": fm.PROMPT, "greedy_tokens": GREEDY, "families": {}}
    if sys.argv[1:]:
        out = json.loads(OUT.read_text())
        assert out["prompt"] == fm.PROMPT and out["greedy_tokens"] == GREEDY, "remake every family"
    with tempfile.TemporaryDirectory() as tmp:
        for family in only:
            path = fm.write(family, Path(tmp) / f"{family}.gguf")
            hand = overrides(family, path)
            if family in ("smollm3", "granite"):
                model = by_hand(path, family)
            else:
                config = AutoConfig.from_pretrained(tmp, gguf_file=path.name)
                for key, value in hand.items():
                    setattr(config, key, value)
                model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, config=config,
                                                             dtype=torch.float32, attn_implementation="eager")
            if family == "mistral":
                model = as_mistral(model, hand["sliding_window"])
            model.eval()
            ids = list(fm.PROMPT)
            with torch.no_grad():
                for _ in range(GREEDY):  # greedy, one full forward per token (no cache to trust)
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
                logits = model(torch.tensor([ids])).logits[0].float().numpy()
            entry = {"hash": fm.content_hash(path), "model_class": type(model).__name__,
                     "config_set_by_hand": hand, "tokens": ids[len(fm.PROMPT):],
                     "logits_shape": list(logits.shape), "logits_f32_b64": b64(logits)}
            try:
                tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
                entry["tokenizer"] = {t: tok.encode(t, add_special_tokens=False) for t in TEXTS}
                chats = []
                for system, user in CHATS:
                    msgs = ([] if system is None else [{"role": "system", "content": system}]) + \
                        [{"role": "user", "content": user}]
                    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                    chats.append({"system": system, "user": user, "ids": list(map(int, ids))})
                entry["chat"] = chats
            except Exception as e:  # noqa: BLE001 - recorded: the test then has no tokenizer golden
                entry["tokenizer_error"] = f"{type(e).__name__}: {e}"[:200]
            if versions != out["versions"]:
                entry["versions"] = versions
            out["families"][family] = entry
            print(family, type(model).__name__, entry["tokens"], entry.get("tokenizer_error", "tokenizer ok"))
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
