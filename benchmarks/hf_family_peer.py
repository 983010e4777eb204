"""The model peer for every tinylm family: HF transformers' own model class of the family, built
from tinylm's ModelArgs and Weights (hf_peer.build_hf_llama hands families other than plain Llama
here), and the weight carry-over both builders share (neox_row_order, put_param).

    arch (tinylm)          HF class                  what is carried over
    llama (+ window)       Llama (Mistral)           Q/K rows to NeoX order; RoPE divisors into inv_freq
    mistral                Mistral                   as llama
    qwen2                  Qwen2                     Q/K/V biases
    qwen3                  Qwen3                     head_dim, q_norm / k_norm
    gemma2                 Gemma2                    norms as w - 1 (HF computes x * (1 + w)), softcaps,
                                                     query scale, local layers
    gemma3                 Gemma3 (text)             as gemma2, QK norms, local RoPE base, linear scaling
    smollm3                SmolLM3                   Q/K rows to NeoX order; no RoPE in every 4th layer
    phi3                   Phi3                      Q|K|V and gate|up rows into qkv_proj / gate_up_proj;
                                                     no sliding window (as tinylm and llama.cpp run it);
                                                     RoPE over part of each head (Phi-4-mini): the Q/K
                                                     rows back from tinylm's rope_order
    granite                Granite                   its four multipliers; wo, w_down and output_norm
                                                     back from tinylm's folded residual and logit scales

The benchmark compares the peer's first-step logits with tinylm's (model_bench), so a peer built
wrong shows in the results as a logits error, not as a silent speed number.
"""
from __future__ import annotations

import numpy as np

from .peers import get_torch, get_transformers


def neox_row_order(n_heads: int, head_dim: int) -> np.ndarray:
    """Row permutation of a [n_heads*head_dim, dim] Q/K weight: adjacent-pair -> NeoX layout."""
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(n_heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)


def model_row_order(args, n_heads: int):
    """Row permutation of a [n_heads*head_dim, dim] Q/K weight: tinylm's rope_order (RoPE over
    part of a NeoX head) -> the model's own order; None when they are the same."""
    from tinylm.weights import rope_order

    order = rope_order(args)
    if order is None:
        return None
    return (np.arange(n_heads)[:, None] * args.head_dim + np.argsort(order)[None, :]).reshape(-1)


def put_param(param, arr, perm=None, shift: float = 0.0) -> None:
    """Copy tinylm weight ``arr`` (rows reordered by ``perm``, ``shift`` added) into HF ``param``,
    in place, after checking the shapes agree."""
    torch = get_torch()
    a = np.asarray(arr, dtype=np.float32)
    if perm is not None:
        a = a[perm]
    if shift:
        a = a + shift
    if tuple(param.shape) != a.shape:
        raise ValueError(f"HF parameter shape {tuple(param.shape)} != tinylm weight {a.shape}")
    param.copy_(torch.from_numpy(np.ascontiguousarray(a)).to(device=param.device, dtype=param.dtype))


def _layer_types(args):
    return ["sliding_attention" if args.is_local(i) else "full_attention" for i in range(args.n_layers)]


def hf_family_config(args):
    """(HF model class, its config) for tinylm ``args``."""
    tf = get_transformers()
    common = dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                  num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                  num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, rms_norm_eps=args.norm_eps,
                  max_position_embeddings=args.max_seq, tie_word_embeddings=bool(args.tie_embeddings))
    rope = {"rope_type": "default", "rope_theta": float(args.rope_base)}
    if args.rotary_dims < args.head_dim:
        if args.arch != "phi3" or args.rope_mscale != 1.0:
            raise ValueError(f"no HF peer here for RoPE over part of the head in {args.arch} "
                             f"(or with an attention factor)")
        rope["partial_rotary_factor"] = args.rotary_dims / args.head_dim
    if args.arch in ("llama", "mistral"):
        if args.sliding_window:
            return tf.MistralForCausalLM, tf.MistralConfig(**common, rope_parameters=rope,
                                                           sliding_window=args.sliding_window)
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common, rope_parameters=rope, attention_bias=False)
    if args.arch == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if args.arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, rope_parameters=rope, use_sliding_window=False)
    if args.arch == "smollm3":
        nope = [int(i not in args.nope_layers) for i in range(args.n_layers)]
        return tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**common, rope_parameters=rope, no_rope_layers=nope,
                                                       use_sliding_window=False, pad_token_id=None, bos_token_id=None,
                                                       eos_token_id=None)  # 128000/1: past a small vocab
    if args.arch == "granite":
        return tf.GraniteForCausalLM, tf.GraniteConfig(
            **common, rope_parameters=rope, embedding_multiplier=float(args.embed_scale),
            attention_multiplier=float(args.scale), residual_multiplier=float(args.residual_scale),
            logits_scaling=float(args.logit_scale), pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if args.arch == "phi3":
        if args.rope_factors_long:
            raise ValueError("no HF peer for Phi-3's LongRoPE here (HF switches its tables by sequence length)")
        return tf.Phi3ForCausalLM, tf.Phi3Config(**common, rope_parameters=rope, sliding_window=None,
                                                 pad_token_id=None, eos_token_id=None)  # 32000: past a small vocab
    qpas = args.scale ** -2  # HF's query scale is query_pre_attn_scalar ** -0.5 (an int in its config)
    gemma = dict(common, query_pre_attn_scalar=int(round(qpas)) if abs(qpas - round(qpas)) < 1e-6 else qpas, sliding_window=args.sliding_window or None,
                 layer_types=_layer_types(args), hidden_activation="gelu_pytorch_tanh")
    if args.arch == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(
            **gemma, rope_parameters=rope, attn_logit_softcapping=args.attn_softcap or None,
            final_logit_softcapping=args.final_softcap or None)
    if args.arch == "gemma3":
        full = dict(rope)
        if args.rope_factors:
            full.update(rope_type="linear", factor=float(args.rope_factors[0]))
        local = {"rope_type": "default", "rope_theta": float(args.rope_local_base or args.rope_base)}
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **gemma, rope_parameters={"full_attention": full, "sliding_attention": local})
    raise ValueError(f"no HF peer for tinylm architecture {args.arch!r}")


def build_hf_family(args, weights, dtype: str = "float16", device: str = "cuda"):
    """HF's model of ``args.arch`` on ``device`` holding tinylm ``weights`` (``dtype`` a torch
    dtype name)."""
    torch = get_torch()
    cls, cfg = hf_family_config(args)
    if args.arch == "gemma3" and args.rope_factors and len(set(args.rope_factors)) > 1:
        raise ValueError("no HF peer for Gemma 3 with per-pair RoPE divisors (HF scales it linearly)")
    cfg._attn_implementation = "eager" if args.arch.startswith("gemma") else "sdpa"
    with torch.device(device):
        model = cls(cfg)
    model = model.to(dtype=getattr(torch, dtype)).eval()
    gemma = args.arch.startswith("gemma")
    adjacent = args.rope_style == "adjacent"
    perm_q = neox_row_order(args.n_heads, args.head_dim) if adjacent else model_row_order(args, args.n_heads)
    perm_k = neox_row_order(args.n_kv_heads, args.head_dim) if adjacent else model_row_order(args, args.n_kv_heads)

    def put(param, arr, perm=None, norm=False):
        # Gemma's norms: tinylm (and the GGUF file) store 1 + w; HF multiplies by 1 + w itself
        put_param(param, arr, perm, shift=-1.0 if norm and gemma else 0.0)

    # Granite: tinylm's weights hold the residual scale (wo, w_down) and the logit scale
    # (output_norm), which HF applies itself
    res, logit = float(args.residual_scale), float(args.logit_scale)
    with torch.no_grad():
        m = model.model
        put(m.embed_tokens.weight, weights.tok_embd)
        put(m.norm.weight, weights.output_norm if logit == 1.0 else weights.output_norm * np.float32(logit), norm=True)
        if not cfg.tie_word_embeddings:
            put(model.lm_head.weight, weights.output)
        for layer, lw in zip(m.layers, weights.layers):
            at, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm.weight, lw.attn_norm, norm=True)
            if gemma:
                put(layer.post_attention_layernorm.weight, lw.post_attn_norm, norm=True)
                put(layer.pre_feedforward_layernorm.weight, lw.ffn_norm, norm=True)
                put(layer.post_feedforward_layernorm.weight, lw.post_ffn_norm, norm=True)
            else:
                put(layer.post_attention_layernorm.weight, lw.ffn_norm)
            if args.arch == "phi3":  # fused projections: rows [q; k; v] and [gate; up]
                put(at.qkv_proj.weight, np.concatenate([lw.wq if perm_q is None else lw.wq[perm_q],
                                                        lw.wk if perm_k is None else lw.wk[perm_k], lw.wv]))
                put(mlp.gate_up_proj.weight, np.concatenate([lw.w_gate, lw.w_up]))
            else:
                put(at.q_proj.weight, lw.wq, perm_q)
                put(at.k_proj.weight, lw.wk, perm_k)
                put(at.v_proj.weight, lw.wv)
                put(mlp.gate_proj.weight, lw.w_gate)
                put(mlp.up_proj.weight, lw.w_up)
            put(at.o_proj.weight, lw.wo if res == 1.0 else lw.wo / np.float32(res))
            if lw.bq is not None:
                put(at.q_proj.bias, lw.bq, perm_q)
                put(at.k_proj.bias, lw.bk, perm_k)
                put(at.v_proj.bias, lw.bv)
            if lw.q_norm is not None:
                put(at.q_norm.weight, lw.q_norm, norm=True)
                put(at.k_norm.weight, lw.k_norm, norm=True)
            put(mlp.down_proj.weight, lw.w_down if res == 1.0 else lw.w_down / np.float32(res))
        if args.rope_factors and args.arch != "gemma3":  # Llama 3's divisors, straight into inv_freq
            rot = m.rotary_emb
            r = args.rotary_dims
            inv = args.rope_base ** (-np.arange(0, r, 2, dtype=np.float64) / r)
            inv = torch.from_numpy(inv / np.asarray(args.rope_factors)).to(device=rot.inv_freq.device,
                                                                          dtype=rot.inv_freq.dtype)
            rot.inv_freq.copy_(inv)
            if hasattr(rot, "original_inv_freq"):
                rot.original_inv_freq = inv.clone()
    return model
