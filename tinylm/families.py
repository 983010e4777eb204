"""The model families tinylm runs, read from a GGUF file's ``{arch}.*`` metadata into ModelArgs.

    arch      models                                     what differs from Llama (ModelArgs fields)
    llama     Llama 2 / 3.x, SmolLM2, Mistral 7B         rope_factors (Llama 3.1+'s rope_freqs tensor),
                                                         sliding_window when the file has one
    mistral   Mistral (the name Hugging Face uses)       as llama
    qwen2     Qwen2 / Qwen2.5                            neox RoPE, qkv_bias
    qwen3     Qwen3 (dense)                              neox RoPE, qk_norm, head_dim from key_length
    gemma2    Gemma 2                                    neox RoPE, GeGLU, embed_scale, post_norms,
                                                         attn/final softcap, every other layer local
    gemma3    Gemma 3 (text)                             neox RoPE, GeGLU, embed_scale, post_norms,
                                                         qk_norm, 5 local layers of 6 (local RoPE base)
    smollm3   SmolLM3                                    every 4th layer without RoPE (nope_layers)
    phi3      Phi-3 (mini, medium; 4k and 128k), 3.5,   neox RoPE; Q|K|V in one tensor (attn_qkv, when
              Phi-4-mini                                 the file has it) and gate|up in ffn_up, split
                                                         at load; no sliding window (as llama.cpp);
                                                         LongRoPE (rope_factors_short / _long: the long
                                                         table for a context past the original one,
                                                         as llama.cpp; cos and sin times attn_factor);
                                                         Phi-4-mini: RoPE over 96 of 128 head dims
                                                         (rope_dims), tied embeddings
    granite   Granite 3.x (dense)                        llama's layout; embed_scale, attn_scale,
                                                         residual_scale, logit_scale from its
                                                         *_scale keys (llama.cpp's: absent or 0 = none)

Any family's file may turn RoPE over part of each head (``rope.dimension_count`` below the head
dim): ModelArgs.rope_dims, whose tables have rope_dims / 2 pairs.

The values follow llama.cpp, whose converter wrote the files: its RoPE layout per architecture
(llama's Q/K rows permuted for adjacent pairs, the others as Hugging Face stores them, NeoX
pairs), its defaults where a key is absent (Gemma 2's softcaps 50 and 30, Gemma 3's local base
10000), its attention scale (1/sqrt(head_dim), 1/sqrt(dim / n_heads) for the 27B Gemmas), its
local-layer patterns, its tensor layout (Phi-3's fused projections: rows [q; k; v] and
[gate; up]). llama.cpp runs Phi-3 files without their sliding window (2047 keys in the 4k models;
it disabled Phi SWA, llama.cpp PR 13676), and so does tinylm. Gemma's norm weights are stored
with the 1 of its ``(1 + w)`` already added, so every family's RMSNorm is ``x / rms(x) * w`` here.

RoPE scaling: linear (``rope.scaling.factor``), YaRN (``rope.scaling.type yarn``: per-pair divisors
and a cos/sin scale as llama.cpp's rope_yarn computes them, ``yarn_factors``; the 128K Qwen3
files), Llama 3's ``rope_freqs`` tensor and Phi-3's LongRoPE, each as ModelArgs.rope_factors (and
rope_mscale).

Anything else in a file (another architecture, other RoPE scaling, biases on other
projections, experts, a tensor no family reads) is refused with one line naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelArgs
from .errors import GGUFError


@dataclass(frozen=True)
class Family:
    arch: str
    models: str
    rope_style: str = "neox"
    gemma: bool = False  # GeGLU, sqrt(dim) embedding scale, post-norms
    local_pattern: int = 0  # layer i is local when i % pattern < pattern - 1 (0: every layer)
    swa: bool = True  # reads {arch}.attention.sliding_window (False: runs without it, as llama.cpp)
    # fused tensors (name after "blk.N.", the LayerWeights fields its rows hold in order), each
    # read in place of its fields' own tensors when the file has it
    fused: tuple = ()
    nope_step: int = 0  # layer i turns no RoPE when (i + 1) % nope_step == 0 (llama.cpp's fixed step)


FAMILIES = {f.arch: f for f in (
    Family("llama", "Llama 2/3.x, SmolLM2, Mistral", rope_style="adjacent"),
    Family("mistral", "Mistral", rope_style="adjacent"),
    Family("qwen2", "Qwen2, Qwen2.5"),
    Family("qwen3", "Qwen3"),
    Family("gemma2", "Gemma 2", gemma=True, local_pattern=2),
    Family("gemma3", "Gemma 3", gemma=True, local_pattern=6),
    Family("smollm3", "SmolLM3", rope_style="adjacent", nope_step=4),
    Family("phi3", "Phi-3, Phi-3.5, Phi-4-mini", swa=False,
           fused=(("attn_qkv.weight", ("wq", "wk", "wv")), ("ffn_up.weight", ("w_gate", "w_up")))),
    Family("granite", "Granite 3.x", rope_style="adjacent"),
)}

# llama.cpp tensor name (after "blk.N.") -> tinylm.weights.LayerWeights field
LAYER_TENSORS = {"attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
                 "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
                 "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
                 "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
                 "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
                 "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_ffn_norm"}
ROPE_FREQS = "rope_freqs.weight"
LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE tables


def supported() -> str:
    """'llama, mistral, qwen2, qwen3, gemma2, gemma3, smollm3, phi3, granite' (for messages)."""
    return ", ".join(FAMILIES)


def family_of(meta: dict, path="<gguf>") -> Family:
    """The Family of a file's ``general.architecture``, else a one-line GGUFError naming it and
    the architectures tinylm runs."""
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (tinylm runs {supported()})")
    return FAMILIES[arch]


def _num(meta, key, path, default, positive=True) -> float:
    """A finite float metadata value (> 0 when ``positive``), as the shortest decimal of its
    float32 (1e-05, not 9.99e-06); ``default`` when absent."""
    import numpy as np

    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value < float("inf") \
            or not (value > 0 if positive else value >= 0):
        raise GGUFError(f"{path}: metadata {key!r} must be a {'positive' if positive else 'non-negative'} "
                        f"finite number, got {value!r}")
    return float(str(np.float32(value)))


def _int(meta, key, path, default=None, limit=2**31 - 1, minimum=1):
    """An integer metadata value in [minimum, limit], or ``default`` when absent."""
    if key not in meta:
        if default is not None:
            return default
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= limit:
        raise GGUFError(f"{path}: metadata {key!r} must be an integer in [{minimum}, {limit}], got {value!r}")
    return value


def args_from_metadata(meta: dict, tensor_names=(), path="<gguf>", rope_freqs=None, longrope=None) -> ModelArgs:
    """ModelArgs of a GGUF file from its metadata and tensor names.

    ``rope_freqs``: the values of a ``rope_freqs.weight`` tensor (Llama 3.1+: each rotation pair's
    frequency is divided by its entry), None when the file has none. ``longrope``: the values of
    Phi-3's (short, long) LongRoPE tables (LONGROPE), None when the file has neither. ``output.weight`` absent
    means tied embeddings. Raises GGUFError naming the key for a missing or bad value, and for
    what tinylm does not implement (another architecture, RoPE scaling other than linear and YaRN, value
    heads of another size, experts). RoPE over part of the head (``rope.dimension_count``, Phi-4-mini)
    is ModelArgs.rope_dims.
    """
    fam = family_of(meta, path)
    p = fam.arch + "."
    names = set(tensor_names)
    dim = _int(meta, p + "embedding_length", path)
    n_heads = _int(meta, p + "attention.head_count", path)
    head_dim = _int(meta, p + "attention.key_length", path, default=max(dim // n_heads, 1))
    rope_dims = _int(meta, p + "rope.dimension_count", path, default=head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{path}: {p}rope.dimension_count must be an even number of at most the head dim "
                        f"({head_dim}), got {rope_dims}")
    pairs = rope_dims // 2
    if _int(meta, p + "attention.value_length", path, default=head_dim) != head_dim:
        raise GGUFError(f"{path}: value heads of another size than key heads are not supported")
    experts = meta.get(p + "expert_count")
    if experts:
        raise GGUFError(f"{path}: a mixture of experts ({p}expert_count = {experts!r}) is not implemented by tinylm")
    tokens = meta.get("tokenizer.ggml.tokens", ())
    n_vocab = _int(meta, p + "vocab_size", path, default=len(tokens) if isinstance(tokens, list) else 0)
    if not n_vocab:
        raise GGUFError(f"{path}: cannot tell the vocabulary size (no {p}vocab_size, no tokens)")
    n_layers = _int(meta, p + "block_count", path, limit=4096)

    # RoPE scaling: linear (every pair's frequency / factor) and Llama 3.1's per-pair table
    factors, yarn = None, {}
    kind = meta.get(p + "rope.scaling.type")
    if kind == "longrope" and longrope is None:
        raise GGUFError(f"{path}: RoPE scaling ({p}rope.scaling.type 'longrope') without both LongRoPE tables "
                        f"({', '.join(LONGROPE)}) is not implemented by tinylm")
    if kind not in (None, "none", "linear", "yarn", "longrope"):
        raise GGUFError(f"{path}: RoPE scaling ({p}rope.scaling.type {kind!r}) is not implemented by tinylm "
                        f"(linear, YaRN, Llama 3's rope_freqs tensor and Phi-3's LongRoPE are)")
    key = next((p + k for k in ("rope.scaling.factor", "rope.scale_linear") if p + k in meta), None)
    factor = _num(meta, key, path, 1.0) if key else 1.0  # a factor without a type is linear (llama.cpp)
    if kind == "yarn":
        factors, mscale = yarn_factors(meta, p, path, factor, rope_dims)
        yarn = dict(rope_mscale=mscale)
    elif factor != 1.0:
        factors = [factor] * pairs
    if rope_freqs is not None:
        import numpy as np

        rf = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
        if rf.shape != (pairs,) or not (np.isfinite(rf).all() and (rf > 0).all()):
            raise GGUFError(f"{path}: tensor {ROPE_FREQS!r} must hold rope dims / 2 = {pairs} positive "
                            f"numbers, got shape {rf.shape}")
        factors = [float(a) * float(b) for a, b in zip(rf, factors or [1.0] * len(rf))]

    long = {}
    if longrope is not None:  # llama.cpp's Phi-3: both tables, the original context, the attention factor
        import numpy as np

        tables = []
        for name, values in zip(LONGROPE, longrope):
            t = np.asarray(values, dtype=np.float64).reshape(-1)
            if t.shape != (pairs,) or not (np.isfinite(t).all() and (t > 0).all()):
                raise GGUFError(f"{path}: tensor {name!r} must hold rope dims / 2 = {pairs} positive "
                                f"numbers, got shape {t.shape}")
            tables.append(tuple(float(x) for x in t))
        if factors or yarn:
            raise GGUFError(f"{path}: LongRoPE tables together with other RoPE scaling are not implemented by tinylm")
        factors = tables[0]
        long = dict(rope_factors_long=tables[1], rope_mscale=_num(meta, p + "rope.scaling.attn_factor", path, 1.0),
                    rope_orig_ctx=_int(meta, p + "rope.scaling.original_context_length", path))

    window = _int(meta, p + "attention.sliding_window", path, default=0, minimum=0) if fam.swa else 0
    pattern = _int(meta, p + "attention.sliding_window_pattern", path, default=fam.local_pattern, minimum=0)
    # pattern 0: every layer local (ModelArgs: empty local_layers); else layer i is local when
    # i % pattern < pattern - 1 (a pattern of 1: none, so no window at all)
    local = tuple(i for i in range(n_layers) if i % pattern < pattern - 1) if window and pattern else ()
    if window and pattern and not local:
        window = 0

    extras = {}
    if fam.gemma:
        big = n_layers in (46, 62)  # the 27B Gemmas (llama.cpp's LLM_TYPE_27B): scale by dim / n_heads
        extras.update(act="gelu_tanh", embed_scale=float(dim) ** 0.5, post_norms=True,
                      attn_scale=(dim / n_heads) ** -0.5 if big else None)
    if fam.arch == "gemma2":
        extras.update(attn_softcap=_num(meta, p + "attn_logit_softcapping", path, 50.0),
                      final_softcap=_num(meta, p + "final_logit_softcapping", path, 30.0))
    if fam.arch == "gemma3":
        extras.update(rope_local_base=_num(meta, p + "rope.freq_base_swa", path, 10000.0))
    if fam.arch == "granite":  # llama.cpp: logit_scale required, the others optional, 0 = none
        if p + "logit_scale" not in meta:
            raise GGUFError(f"{path}: metadata {p + 'logit_scale'!r} is missing (Granite's logits are divided by it)")
        scales = {name: _num(meta, p + key, path, 0.0, positive=False) or None for name, key in (
            ("embed_scale", "embedding_scale"), ("attn_scale", "attention.scale"),
            ("residual_scale", "residual_scale"), ("logit_scale", "logit_scale"))}
        extras.update({k: v for k, v in scales.items() if v is not None})
    bias = [f"blk.0.attn_{x}.bias" in names for x in "qkv"]
    if any(bias) and not all(bias):
        raise GGUFError(f"{path}: a bias on only some of the Q, K, V projections is not implemented by tinylm")
    norms = ["blk.0.attn_q_norm.weight" in names, "blk.0.attn_k_norm.weight" in names]
    if any(norms) and not all(norms):
        raise GGUFError(f"{path}: a norm on only one of the Q, K heads is not implemented by tinylm")
    try:
        return ModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=_int(meta, p + "attention.head_count_kv", path, default=n_heads),
            head_dim=head_dim, ffn_dim=_int(meta, p + "feed_forward_length", path),
            vocab_size=n_vocab,
            norm_eps=_num(meta, p + "attention.layer_norm_rms_epsilon", path, 1e-5),
            rope_base=_num(meta, p + "rope.freq_base", path, 10000.0),
            rope_style=fam.rope_style,
            max_seq=_int(meta, p + "context_length", path, default=2048),
            tie_embeddings="output.weight" not in names, arch=fam.arch,
            qkv_bias=all(bias), qk_norm=all(norms), sliding_window=window, local_layers=local,
            nope_layers=tuple(i for i in range(n_layers) if fam.nope_step and (i + 1) % fam.nope_step == 0),
            rope_factors=tuple(factors or ()), rope_dims=0 if rope_dims == head_dim else rope_dims,
            **long, **yarn, **extras)
    except ValueError as e:
        raise GGUFError(f"{path}: inconsistent hyper-parameters: {e}") from e


def yarn_factors(meta: dict, p: str, path, factor: float, dims: int):
    """(per-pair frequency divisors, cos/sin scale) of YaRN scaling by ``factor`` over ``dims``
    turned dims, as llama.cpp's rope_yarn computes them (and HF's "yarn" rope type): each pair's
    angle mixes the interpolated one (divided by ``factor``) and the original one by a ramp that
    is 1 (original) below the correction dim of ``yarn_beta_fast`` rotations over the original
    context and 0 (interpolated) past the one of ``yarn_beta_slow``; cos and sin are scaled by
    ``yarn_attn_factor * (1 + 0.1 ln factor)`` when ``yarn_ext_factor`` (default 1) is not 0."""
    import math

    orig = _int(meta, p + "rope.scaling.original_context_length", path,
                default=_int(meta, p + "context_length", path, default=2048))
    ext = meta.get(p + "rope.scaling.yarn_ext_factor", -1.0)
    ext = 1.0 if isinstance(ext, (int, float)) and not isinstance(ext, bool) and ext < 0 else \
        _num(meta, p + "rope.scaling.yarn_ext_factor", path, 1.0, positive=False)
    attn = _num(meta, p + "rope.scaling.yarn_attn_factor", path, 1.0)
    fast = _num(meta, p + "rope.scaling.yarn_beta_fast", path, 32.0)
    slow = _num(meta, p + "rope.scaling.yarn_beta_slow", path, 1.0)
    if meta.get(p + "rope.scaling.yarn_log_multiplier", 0.0):
        raise GGUFError(f"{path}: YaRN with {p}rope.scaling.yarn_log_multiplier (DeepSeek's) is not implemented "
                        f"by tinylm")
    base = _num(meta, p + "rope.freq_base", path, 10000.0)

    def corr(rotations):
        return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0.0, math.floor(corr(fast))), min(dims - 1.0, math.ceil(corr(slow)))
    out = []
    for i in range(dims // 2):
        mix = (1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))) * ext
        out.append(1.0 / (mix + (1.0 - mix) / factor))
    return out, attn * (1.0 + 0.1 * math.log(factor)) if ext else attn


def layer_tensors(args: ModelArgs, tensor_names) -> list:
    """[(name after "blk.N.", (LayerWeights fields))] that a layer of the model of ``args`` is read
    from: the family's fused tensors the file has (by layer 0's names), each field's own tensor
    for the rest; a fused tensor's rows hold its fields' rows in order."""
    from .weights import layer_shapes

    names = set(tensor_names)
    fields = set(layer_shapes(args))
    out, taken = [], set()
    for name, parts in FAMILIES[args.arch].fused if args.arch in FAMILIES else ():
        if f"blk.0.{name}" in names and set(parts) <= fields:
            out.append((name, parts))
            taken.update(parts)
    return out + [(name, (field,)) for name, field in LAYER_TENSORS.items() if field in fields - taken]


def expected_tensors(args: ModelArgs, tensor_names=()) -> set:
    """Every tensor name the model of ``args`` reads from a file of ``tensor_names``
    (rope_freqs.weight is read into args)."""
    per_layer = [name for name, _ in layer_tensors(args, tensor_names)]
    used = {"token_embd.weight", "output_norm.weight", ROPE_FREQS}
    if args.rope_factors_long:
        used.update(LONGROPE)
    if not args.tie_embeddings:
        used.add("output.weight")
    return used | {f"blk.{i}.{n}" for i in range(args.n_layers) for n in per_layer}


def refuse_unread(args: ModelArgs, tensor_names, path) -> None:
    """GGUFError naming the first tensor of the file the model would not read (biases of other
    projections, experts, anything else): running without it would give wrong logits."""
    used = expected_tensors(args, tensor_names)
    for name in tensor_names:
        if name in used:
            continue
        if name in LONGROPE:
            what = f"both LongRoPE tables ({', '.join(LONGROPE)}) and its original context; it has {name!r} only"
        elif name.endswith(".bias"):
            what = f"biases (tensor {name!r})"
        elif "_exps" in name or "ffn_gate_inp" in name:
            what = f"a mixture of experts (tensor {name!r})"
        else:
            what = f"tensor {name!r}, which tinylm's {args.arch} does not read"
        raise GGUFError(f"{path}: the model needs {what}; tinylm does not implement it")
