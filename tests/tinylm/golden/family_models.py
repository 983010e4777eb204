"""Tiny GGUF files of every family tinylm runs, written with the ``gguf`` package's writer.

One file per family (2-3 layers, random weights, a vocabulary of ~300 tokens, the family's
quirks all switched on: biases, QK norms, GQA 7:1, head_dim 256, sliding windows that bite on a
12-token prompt, softcaps that bite, Llama 3 RoPE divisors, linear RoPE scaling, tied and untied
output), laid out as llama.cpp's converter lays out the real files (llama's Q/K rows permuted
for adjacent-pair RoPE, Gemma's norm weights stored as 1 + w). The weights are deterministic in
the seed, so the tests write the files at run time and check them against the content hash
that the goldens (tests/tinylm/golden/families_golden.json, made by make_family_goldens.py with HF
transformers) were made from:

    python tests/tinylm/golden/family_models.py OUT_DIR        # writes OUT_DIR/<family>.gguf
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

# family -> (general.architecture, general.name, shapes and quirks); see SPECS' comments
SPECS = {
    # Llama 3.2-style: GQA 2, tied, Llama 3's rope_freqs divisors, BPE with header tokens
    "llama3": dict(arch="llama", name="tiny-llama3", dim=96, layers=2, heads=4, kv=2, hd=32, ffn=160,
                   base=500000.0, eps=1e-5, tied=True, rope_freqs=(8.0, 1.0, 4.0, 64), tok="llama3"),
    # Mistral: llama arch (llama.cpp writes Mistral so),
    # untied, a sliding window of 5 keys
    "mistral": dict(arch="llama", name="tiny-mistral", dim=64, layers=2, heads=4, kv=1, hd=32, ffn=128,
                    base=1000000.0, eps=1e-5, tied=False, window=5, tok="spm-mistral"),
    # Qwen2.5-0.5B-style: 7 query heads over 1 kv head (dim = heads x head_dim, as llama.cpp's qwen2
    # requires), Q/K/V biases, tied
    "qwen2": dict(arch="qwen2", name="tiny-qwen2.5", dim=224, layers=2, heads=7, kv=1, hd=32, ffn=160,
                  base=1000000.0, eps=1e-6, tied=True, bias=True, tok="qwen"),
    # Qwen3: per-head QK norm, head_dim 64 with dim / heads = 24, untied
    "qwen3": dict(arch="qwen3", name="tiny-qwen3", dim=96, layers=2, heads=4, kv=2, hd=64, ffn=128,
                  base=1000000.0, eps=1e-6, tied=False, qk_norm=True, tok="qwen"),
    # Gemma 2: head_dim 256, GeGLU, post-norms, softcaps that bite, every other layer local
    "gemma2": dict(arch="gemma2", name="tiny-gemma2", dim=64, layers=2, heads=2, kv=1, hd=256, ffn=128,
                   base=10000.0, eps=1e-6, tied=True, window=4, softcaps=(2.0, 0.8), tok="gemma"),
    # Gemma 3: QK norm, local base 10000 vs global 1e6 with linear scaling 2, 2 local layers of 3
    "gemma3": dict(arch="gemma3", name="tiny-gemma3", dim=64, layers=3, heads=2, kv=1, hd=128, ffn=128,
                   base=1000000.0, eps=1e-6, tied=True, window=4, pattern=3, qk_norm=True, linear=2.0,
                   tok="gemma"),
    # Phi-3-medium-style: GQA 2, untied, Q|K|V in one attn_qkv tensor and gate|up in ffn_up, a
    # sliding window in the metadata that llama.cpp (and so tinylm and the goldens) runs without
    "phi3": dict(arch="phi3", name="tiny-phi3", dim=128, layers=2, heads=4, kv=2, hd=32, ffn=160,
                 base=10000.0, eps=1e-5, tied=False, window=4, fused=True, tok="spm-phi3"),
    # SmolLM3: llama's layout (Q/K rows permuted for adjacent pairs), every 4th layer without RoPE
    # (llama.cpp's fixed step: layer 3 of 4 here), tied
    "smollm3": dict(arch="smollm3", name="tiny-smollm3", dim=128, layers=4, heads=4, kv=2, hd=32, ffn=160,
                    base=5000000.0, eps=1e-6, tied=True, tok="llama3"),
    # Phi-3.5-mini-style LongRoPE: short and long per-pair divisors, an original context of 256 in a
    # context of 512 (llama.cpp and tinylm take the long table at a context above 256, the short one
    # at 256), its attention factor sqrt(1 + ln(512 / 256) / ln(256)) as llama.cpp's converter writes it
    "phi3-long": dict(arch="phi3", name="tiny-phi3.5", dim=128, layers=2, heads=4, kv=4, hd=32, ffn=160,
                      base=10000.0, eps=1e-5, tied=False, fused=True, tok="spm-phi3", ctx=512, longrope=256),
    # Phi-4-mini-style: RoPE over the first 3/4 of each head (NeoX pairs (i, i + 12) of 24 dims in
    # 32, rope.dimension_count as llama.cpp's converter writes it), LongRoPE tables of 12 pairs,
    # tied, a byte-level BPE vocabulary with the gpt-4o pre-tokenizer and Phi-4's chat tokens
    "phi4-mini": dict(arch="phi3", name="tiny-phi4-mini", dim=128, layers=2, heads=4, kv=2, hd=32, rope_dims=24,
                      ffn=160, base=10000.0, eps=1e-5, tied=True, fused=True, tok="phi4", ctx=512, longrope=256),
    # Qwen3 with YaRN (as the 128K Qwen3 files carry it): factor 4 over an original context of 64 in a
    # context of 256, the ramp over pairs 0-6 of 32; its cos/sin scale 1 + 0.1 ln 4 in the QK norms
    "qwen3-yarn": dict(arch="qwen3", name="tiny-qwen3-yarn", dim=96, layers=2, heads=4, kv=2, hd=64, ffn=128,
                       base=1000000.0, eps=1e-6, tied=False, qk_norm=True, tok="qwen", yarn=(4.0, 64)),
    # Granite 3.x: llama's layout, its four scales (embedding 12, attention 1/32 for head_dim 32,
    # residual 0.22, logits divided by 2); untied here (the real files are tied: at this size a tied
    # table then decides every greedy token by itself)
    "granite": dict(arch="granite", name="tiny-granite", dim=128, layers=2, heads=4, kv=2, hd=32, ffn=160,
                    base=10000.0, eps=1e-5, tied=False, tok="llama3", granite=(12.0, 0.03125, 0.22, 2.0)),
}
PROMPT = [5, 17, 260, 42, 99, 3, 281, 7, 150, 12, 64, 200]  # token ids of the goldens' prompt


def llama3_rope_freqs(hd: int, base: float, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1+ RoPE scaling: per pair,
    the divisor of its frequency (1 for short wavelengths, ``factor`` for long ones, smooth in
    between)."""
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    div = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return div.astype(np.float32)


def _gpt2_bytes() -> list:
    """GPT-2's printable stand-ins for the 256 byte values (written out here, so the maker does
    not import tinylm): printable Latin-1 bytes stand for themselves, the rest shift to U+0100+."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    out, shifted = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def vocabulary(kind: str):
    """(tokens, token types, merges or scores, metadata) of a small vocabulary of ``kind``."""
    words = ["the", "and", "ing", "hello", "world", "is", "of", "to", "in", "it", "at", "on", "an", "er"]
    if kind in ("llama3", "qwen", "phi4"):
        byte_toks = _gpt2_bytes()
        merges, toks = [], list(byte_toks)
        for w in words:  # merge each word left to right, and its space-prefixed form
            for word in (w, "Ġ" + w):
                cur = word[0]
                for c in word[1:]:
                    if cur + c not in toks:
                        merges.append(f"{cur} {c}")
                        toks.append(cur + c)
                    cur += c
        specials = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                               "<|eot_id|>"],
                    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    "phi4": ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]}[kind]
        types = [1] * len(toks) + [3] * len(specials)
        toks += specials
        meta = {"tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": {"llama3": "llama-bpe", "qwen": "qwen2", "phi4": "gpt-4o"}[kind]}
        if kind == "phi4":  # Phi-4-mini: <|endoftext|> begins (not added) and ends a text
            end = toks.index("<|endoftext|>")
            meta.update({"tokenizer.ggml.bos_token_id": end, "tokenizer.ggml.eos_token_id": end,
                         "tokenizer.ggml.padding_token_id": end, "tokenizer.ggml.add_bos_token": False})
        elif kind == "llama3":
            meta.update({"tokenizer.ggml.bos_token_id": toks.index("<|begin_of_text|>"),
                         "tokenizer.ggml.eos_token_id": toks.index("<|eot_id|>"), "tokenizer.ggml.add_bos_token": True})
        else:
            meta.update({"tokenizer.ggml.eos_token_id": toks.index("<|im_end|>"),
                         "tokenizer.ggml.padding_token_id": toks.index("<|endoftext|>"),
                         "tokenizer.ggml.add_bos_token": False})
        return toks, types, merges, meta
    # SentencePiece-style ("llama" model): specials, byte fallback pieces, then scored pieces
    specials = (["<unk>", "<s>", "</s>"] if kind in ("spm-mistral", "spm-phi3")
                else ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"])
    toks = list(specials) + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(specials) + [6] * 256
    if kind in ("spm-mistral", "spm-phi3"):
        types[0] = 2
    else:
        types[3] = 2
    pieces = []
    for w in words:
        for word in (w, "▁" + w):
            for i in range(1, len(word) + 1):
                if word[:i] not in pieces:
                    pieces.append(word[:i])
    pieces += [c for c in "▁abcdefghijklmnopqrstuvwxyz" if c not in pieces]
    scores = [0.0] * len(toks) + [-float(i) for i in range(len(pieces))]
    types += [1] * len(pieces)
    toks += pieces
    if kind == "spm-phi3":  # Phi-3's added tokens after the pieces, as its file has them (control)
        added = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
        toks, types, scores = toks + added, types + [3] * len(added), scores + [0.0] * len(added)
        meta = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": toks.index("<|endoftext|>"),
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": False}
    elif kind == "spm-mistral":
        meta = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    else:
        meta = {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
                "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
                "tokenizer.ggml.add_bos_token": True,
                "tokenizer.ggml.add_space_prefix": False}  # llama.cpp's converter writes it for Gemma
    meta["tokenizer.ggml.model"] = "llama"
    return toks, types, scores, meta


CHAT_TEMPLATES = {  # the shapes of the real files' templates, shortened
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "qwen": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
             "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
             "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
              "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
              "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
              "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + "
              "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "spm-phi3": ("{% for message in messages %}{% if message['role'] == 'system' %}"
                 "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'user' %}"
                 "{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'assistant' %}"
                 "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"),
    "phi4": ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"),
    "spm-mistral": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}"
                    "{% endif %}{% endfor %}"),
}


def write(family: str, path, seed: int = 0) -> Path:
    """Write ``family``'s tiny GGUF file to ``path`` (deterministic in ``seed``)."""
    import gguf

    s = SPECS[family]
    rng = np.random.default_rng([seed, list(SPECS).index(family)])
    d, hd, hq, hkv, f, n_layers = s["dim"], s["hd"], s["heads"], s["kv"], s["ffn"], s["layers"]
    toks, types, merges_or_scores, tmeta = vocabulary(s["tok"])
    vocab = len(toks)
    w = gguf.GGUFWriter(str(path), s["arch"])
    arch = s["arch"]
    w.add_name(s["name"])
    w.add_block_count(n_layers)
    w.add_context_length(s.get("ctx", 256))
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(hq)
    w.add_head_count_kv(hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(s.get("rope_dims", hd))
    w.add_rope_freq_base(s["base"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(vocab)
    if "window" in s:
        w.add_sliding_window(s["window"])
    if "pattern" in s:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", s["pattern"])
    if "softcaps" in s:
        w.add_float32(f"{arch}.attn_logit_softcapping", s["softcaps"][0])
        w.add_float32(f"{arch}.final_logit_softcapping", s["softcaps"][1])
    if "granite" in s:  # llama.cpp's Granite keys
        for key, value in zip(("embedding_scale", "attention.scale", "residual_scale", "logit_scale"), s["granite"]):
            w.add_float32(f"{arch}.{key}", value)
    if "yarn" in s:  # llama.cpp's converter: the type, the factor, the original context
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", s["yarn"][0])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", s["yarn"][1])
    if "linear" in s:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", s["linear"])
    w.add_string("tokenizer.ggml.model", tmeta.pop("tokenizer.ggml.model"))
    if "tokenizer.ggml.pre" in tmeta:
        w.add_string("tokenizer.ggml.pre", tmeta.pop("tokenizer.ggml.pre"))
    w.add_token_list(toks)
    w.add_token_types(types)
    if s["tok"] in ("llama3", "qwen", "phi4"):
        w.add_token_merges(merges_or_scores)
    else:
        w.add_token_scores(merges_or_scores)
    for key, value in tmeta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    w.add_chat_template(CHAT_TEMPLATES[s["tok"]])

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(n):  # Gemma files store 1 + w (llama.cpp's converter); the weights near 1 either way
        return (1.0 + 0.2 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def permute(wm, heads):  # llama.cpp's converter: HF's half-split rows -> adjacent pairs
        return wm.reshape(heads, 2, hd // 2, -1).swapaxes(1, 2).reshape(wm.shape)

    # a tied table small against the blocks' outputs: else each token's own logit (|e|^2) wins
    # and greedy decoding repeats the last prompt token
    # and greedy decoding repeats the last prompt token (Gemma scales the rows by sqrt(dim) = 8 and
    # norms the blocks' outputs to about 1: smaller still)
    w.add_tensor("token_embd.weight", normal((vocab, d), 1.0 if not s["tied"] else 0.03 if arch.startswith("gemma")
                                             else 0.15))
    w.add_tensor("output_norm.weight", norm(d))
    if not s["tied"]:
        w.add_tensor("output.weight", normal((vocab, d), 1.0))
    if "longrope" in s:  # llama.cpp's Phi-3 converter: the original context, attn_factor, both tables
        orig = s["longrope"]
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{arch}.rope.scaling.attn_factor", float(np.sqrt(1 + np.log(s["ctx"] / orig) / np.log(orig))))
        half = s.get("rope_dims", hd) // 2
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.5 * rng.random(half)).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", (1.0 + 40.0 * rng.random(half) ** 2).astype(np.float32))
    if "rope_freqs" in s:
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(hd, s["base"], *s["rope_freqs"][:3],
                                                            orig=s["rope_freqs"][3]))
    for i in range(n_layers):
        p = f"blk.{i}."
        wq, wk = normal((hq * hd, d), d ** -0.5), normal((hkv * hd, d), d ** -0.5)
        if s["arch"] in ("llama", "smollm3", "granite"):
            wq, wk = permute(wq, hq), permute(wk, hkv)
        w.add_tensor(p + "attn_norm.weight", norm(d))
        wv = normal((hkv * hd, d), d ** -0.5)
        if s.get("fused"):  # llama.cpp's Phi-3 layout: HF's qkv_proj rows [q; k; v] as they are
            w.add_tensor(p + "attn_qkv.weight", np.concatenate([wq, wk, wv]))
        else:
            w.add_tensor(p + "attn_q.weight", wq)
            w.add_tensor(p + "attn_k.weight", wk)
            w.add_tensor(p + "attn_v.weight", wv)
        if s.get("bias"):
            for x, n in (("q", hq), ("k", hkv), ("v", hkv)):
                w.add_tensor(p + f"attn_{x}.bias", normal((n * hd,), 0.5))
        if s.get("qk_norm"):
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        w.add_tensor(p + "attn_output.weight", normal((d, hq * hd), 4 * (hq * hd) ** -0.5))
        if s["arch"].startswith("gemma"):
            w.add_tensor(p + "post_attention_norm.weight", norm(d))
        w.add_tensor(p + "ffn_norm.weight", norm(d))
        gate, up = normal((f, d), d ** -0.5), normal((f, d), d ** -0.5)
        if s.get("fused"):  # ffn_up holds HF's gate_up_proj: rows [gate; up]
            w.add_tensor(p + "ffn_up.weight", np.concatenate([gate, up]))
        else:
            w.add_tensor(p + "ffn_gate.weight", gate)
            w.add_tensor(p + "ffn_up.weight", up)
        w.add_tensor(p + "ffn_down.weight", normal((d, f), 4 * f ** -0.5))
        if s["arch"].startswith("gemma"):
            w.add_tensor(p + "post_ffw_norm.weight", norm(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def content_hash(path) -> str:
    """sha256 of what a GGUF file says (metadata keys and values, tensor names, types, shapes and
    bytes, as gguf's reader reads them), not of its container layout: the same model written by
    another gguf version hashes the same."""
    import gguf

    r = gguf.GGUFReader(str(path))
    h = hashlib.sha256()
    for key, fld in sorted(r.fields.items()):
        if key.startswith("GGUF."):
            continue
        h.update(key.encode())
        h.update(repr(fld.contents()).encode())
    for t in sorted(r.tensors, key=lambda t: t.name):
        h.update(f"{t.name}|{int(t.tensor_type)}|{list(map(int, t.shape))}".encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for fam in SPECS:
        p = write(fam, out / f"{fam}.gguf")
        print(fam, p, p.stat().st_size, content_hash(p))
