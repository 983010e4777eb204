"""The model peer: HF transformers LlamaForCausalLM built from tinylm's ModelArgs and Weights.

Both sides run the same weights: tinylm's float32 NumPy ``Weights`` (nn.Linear orientation,
y = x @ W^T) are copied into a LlamaForCausalLM of the same config. HF rotates Q/K in the NeoX
("half split") style; GGUF stores Q/K rows for rotating adjacent pairs. Reordering each head's
rows as [0, 2, 4, ..., 1, 3, 5, ...] turns one into the other: pair (2i, 2i+1) lands on
(i, i + D/2) with the same angle, and q.k is unchanged because q and k move alike.
"""
from __future__ import annotations

import time

import numpy as np

from .hf_family_peer import build_hf_family, neox_row_order, put_param
from .peers import get_torch, get_transformers


def hf_config(args, torch_dtype=None):
    """A LlamaConfig with tinylm's ModelArgs (works with transformers 4.x and 5.x)."""
    tf = get_transformers()
    return tf.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
        rope_theta=float(args.rope_base), max_position_embeddings=args.max_seq,
        tie_word_embeddings=bool(args.tie_embeddings), attention_bias=False, mlp_bias=False,
        hidden_act="silu")


def build_hf_llama(args, weights, dtype: str = "float16", device: str = "cuda"):
    """LlamaForCausalLM on ``device`` holding tinylm ``weights`` (``dtype`` a torch dtype name);
    another family (``args.quirks()``), its own HF class (hf_family_peer)."""
    if getattr(args, "arch", "llama") != "llama" or args.quirks():
        return build_hf_family(args, weights, dtype, device)
    torch = get_torch()
    tf = get_transformers()
    tdtype = getattr(torch, dtype)
    cfg = hf_config(args)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg)
    model = model.to(dtype=tdtype).eval()
    if getattr(args, "rope_style", "adjacent") == "adjacent":
        perm_q, perm_k = neox_row_order(args.n_heads, args.head_dim), neox_row_order(args.n_kv_heads, args.head_dim)
    elif args.rope_style == "neox":
        perm_q = perm_k = None
    else:
        raise ValueError(f"unknown rope_style {args.rope_style!r}")

    put = put_param
    with torch.no_grad():
        m = model.model
        put(m.embed_tokens.weight, weights.tok_embd)
        put(m.norm.weight, weights.output_norm)
        if not cfg.tie_word_embeddings:
            put(model.lm_head.weight, weights.output)
        for layer, lw in zip(m.layers, weights.layers):
            at, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm.weight, lw.attn_norm)
            put(layer.post_attention_layernorm.weight, lw.ffn_norm)
            put(at.q_proj.weight, lw.wq, perm_q)
            put(at.k_proj.weight, lw.wk, perm_k)
            put(at.v_proj.weight, lw.wv)
            put(at.o_proj.weight, lw.wo)
            put(mlp.gate_proj.weight, lw.w_gate)
            put(mlp.up_proj.weight, lw.w_up)
            put(mlp.down_proj.weight, lw.w_down)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """float32 logits [T, V] of one prompt (full forward, no cache)."""
    torch = get_torch()
    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)], device=dev), use_cache=False)
    return out.logits[0].float().cpu().numpy()


def hf_generate_timed(model, prompt_ids, new_tokens: int) -> dict:
    """Greedy generation with the KV cache, timed like tinylm: TTFT and decode tokens/s.

    prompt_ids: one prompt (ids) or a batch of prompts of equal length (no padding needed).
    TTFT covers the prompt forward and choosing the first tokens; decode tokens/s counts the
    remaining ``new_tokens - 1`` single-token steps of every sequence (aggregate over the batch).
    Synchronizes around each region.
    """
    torch = get_torch()
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = [list(p) for p in prompt_ids] if np.ndim(prompt_ids[0]) else [list(prompt_ids)]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("hf_generate_timed: batched prompts must have equal lengths")
    ids = torch.tensor(rows, device=dev)
    steps = []
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        first = tok.cpu()  # waits for the tokens, as a user would
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(tok)
        sync()
        t2 = time.perf_counter()
    gen = torch.cat([first.to(dev)] + steps, dim=1).cpu().tolist()  # [B, new_tokens]
    n_dec = max(new_tokens - 1, 0) * len(rows)
    return {"ttft_ms": (t1 - t0) * 1e3,
            "decode_tok_s": n_dec / (t2 - t1) if n_dec and t2 > t1 else None,
            "prefill_tok_s": len(rows) * len(rows[0]) / (t1 - t0) if t1 > t0 else None,
            "generated_ids": gen[0], "all_generated_ids": gen,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


# --- the compiled peer: static KV cache + torch.compile(mode="reduce-overhead") -----------------
def compile_static(model):
    """HF's own fast decode path, in place: generate() with a static (preallocated) KV cache,
    the forward compiled with ``mode="reduce-overhead"`` (CUDA graphs), as gpt-fast and HF's
    "optimizing inference" guide do. Compilation itself happens in the first generate calls."""
    torch = get_torch()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model


def hf_generate_compiled_timed(model, prompt_ids, new_tokens: int) -> dict:
    """Greedy generate() of a compiled static-cache model, timed like hf_generate_timed.

    generate() runs prefill and decode in one call, so the prefill (TTFT) is timed as its own
    ``max_new_tokens=1`` call and the decode rate is ``(new_tokens - 1) * B`` tokens over the
    full call's time minus that TTFT. EOS cannot stop a run early (``min_new_tokens``).
    """
    torch = get_torch()
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = [list(p) for p in prompt_ids] if np.ndim(prompt_ids[0]) else [list(prompt_ids)]
    ids = torch.tensor(rows, device=dev)
    times, outs = [], []
    with torch.inference_mode():
        for n in (1, new_tokens):
            sync()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
            out.cpu()
            times.append(time.perf_counter() - t0)
            outs.append(out)
    gen = outs[1][:, ids.shape[1]:].cpu().tolist()
    ttft, total = times
    n_dec = max(new_tokens - 1, 0) * len(rows)
    return {"ttft_ms": ttft * 1e3, "decode_tok_s": n_dec / (total - ttft) if n_dec and total > ttft else None,
            "prefill_tok_s": len(rows) * len(rows[0]) / ttft, "generated_ids": gen[0], "all_generated_ids": gen,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
