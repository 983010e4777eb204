"""CPU tier: every GGUF tensor type through tinylm's loader, and what it refuses to run.

Three kinds of evidence, none computed by the code under test:

- types ``gguf.quants`` can quantize (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 BF16 MXFP4 TQ1_0 TQ2_0, F16,
  F32): a model written by gguf's writer from float32 weights loads back within the error a
  quantizer of that many levels makes (the ternary TQ types: weights on their grid, exactly);
- the K-quants Q2_K Q4_K Q5_K Q6_K, which gguf 0.19 can only dequantize: blocks packed here by
  hand from llama.cpp's block layouts (ggml-common.h) load as the values chosen;
- the other dequantize-only types (Q3_K, the IQ types, NVFP4): random blocks through load_gguf
  equal ``gguf.quants.dequantize`` of the same bytes row by row (the loader's reshape and
  orientation), and blocks of zero bytes decode to zeros.

Then the refusals: RoPE scaling metadata, a ``rope_freqs`` tensor, biases, experts, an unknown
tensor, a pre-tokenizer other than SmolLM2's: one GGUFError line each (the CLI prints it).
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from test_gguf import TINY, write_llama_gguf  # noqa: E402

from tinylm.config import ModelArgs  # noqa: E402
from tinylm.gguf_io import GGUFError, dequantize, load_gguf, supported_types  # noqa: E402

QT = gguf.GGMLQuantizationType
# Rows of 256 and 512 weights: whole blocks of every type (K-quants and TQ: 256, NVFP4: 64)
WIDE = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                 vocab_size=256, max_seq=64)
# Relative Frobenius error bounds on N(0, 1) weights: about 1.5x the rms error of a quantizer
# whose step is the block's absmax (~2.5 sigma) over its levels, / sqrt(12)
BOUND = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 0.01, "Q5_0": 0.07, "Q5_1": 0.07,
         "Q4_0": 0.13, "Q4_1": 0.13, "MXFP4": 0.17}
RANDOM_ONLY = ["Q3_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M",
               "NVFP4"]


def _matrices(weights):
    """{GGUF name: loaded float32 matrix} of a one-layer model."""
    lw = weights.layers[0]
    names = {"attn_q": lw.wq, "attn_k": lw.wk, "attn_v": lw.wv, "attn_output": lw.wo, "ffn_gate": lw.w_gate,
             "ffn_up": lw.w_up, "ffn_down": lw.w_down}
    return {"token_embd.weight": weights.tok_embd, **{f"blk.0.{k}.weight": v for k, v in names.items()}}


def test_supported_types_cover_what_people_download():
    assert {"Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ2_XXS", "BF16", "MXFP4", "Q8_0", "Q4_1"} <= \
        set(supported_types())


@pytest.mark.parametrize("kind", list(BOUND))
def test_quantized_model_loads_within_the_types_error(tmp_path, kind):
    """Every matrix written in ``kind`` loads back within BOUND[kind] of the float32 weights."""
    path = tmp_path / f"{kind}.gguf"
    expected = write_llama_gguf(path, args=WIDE, kinds=(kind,), seed=3)
    _, w, _ = load_gguf(path)
    for name, got in _matrices(w).items():
        assert expected[name][0] == kind and got.dtype == np.float32
        want = expected[name][2]
        assert np.linalg.norm(got - want) <= BOUND[kind] * np.linalg.norm(want), name


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0"])
def test_ternary_model_on_its_grid_loads_exactly(tmp_path, kind):
    """Weights d * {-1, 0, +1} per 256-block (d a float16 number, each block holding a +-d):
    what the ternary types represent exactly."""
    rng = np.random.default_rng(7)
    args, tensors = WIDE, {}
    for name, shape in [("token_embd.weight", (args.vocab_size, args.dim)),
                        ("blk.0.attn_q.weight", (args.dim, args.dim)), ("blk.0.ffn_down.weight", (args.dim, 512))]:
        t = rng.integers(-1, 2, size=shape).astype(np.float32)
        t[:, ::256] = 1.0
        d = np.float16(rng.choice([0.25, 0.75, 3.0])).astype(np.float32)
        tensors[name] = t * d
    override = {n: (gguf.quants.quantize(x, QT[kind]), QT[kind]) for n, x in tensors.items()}
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, args=args, kinds=("F32",), override=override)
    got = _matrices(load_gguf(path)[1])
    for name, x in tensors.items():
        np.testing.assert_array_equal(got[name], x, err_msg=name)


# --- K-quant blocks packed by hand (llama.cpp ggml-common.h layouts) ---------------------------
def _f16(*v) -> np.ndarray:
    return np.array(v, dtype=np.float16).view(np.uint8)


def _pack_scales_k4(sc, m) -> np.ndarray:
    """12 bytes of 8 six-bit scales and 8 six-bit mins (Q4_K / Q5_K): sub-blocks 0-3 in the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their high 2
    bits in the top 2 bits of bytes 0-7."""
    out = np.zeros(12, dtype=np.uint8)
    for j in range(4):
        out[j] = sc[j] | (sc[j + 4] >> 4) << 6
        out[j + 4] = m[j] | (m[j + 4] >> 4) << 6
        out[j + 8] = (sc[j + 4] & 15) | (m[j + 4] & 15) << 4
    return out


def _q4_k(rng, high_bit=False):
    """(block bytes, weights) of one Q4_K block (Q5_K with ``high_bit``): weight i of sub-block
    j = i // 32 is d * sc[j] * q[i] - dmin * m[j]."""
    d, dmin = rng.choice([0.5, 0.25, 2.0]), rng.choice([0.125, 1.0])
    sc, m = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 32 if high_bit else 16, 256)
    qs, qh = np.zeros(128, np.uint8), np.zeros(32, np.uint8)
    for g in range(4):  # 64 weights: low nibbles are weights 64g + l, high nibbles 64g + 32 + l
        lo, hi = q[64 * g:64 * g + 32], q[64 * g + 32:64 * g + 64]
        qs[32 * g:32 * g + 32] = (lo & 15) | (hi & 15) << 4
        qh |= ((lo >> 4) << (2 * g) | (hi >> 4) << (2 * g + 1)).astype(np.uint8)
    head = np.concatenate([_f16(d, dmin), _pack_scales_k4(sc, m)])
    raw = np.concatenate([head, qh, qs] if high_bit else [head, qs])
    return raw, d * np.repeat(sc, 32) * q - dmin * np.repeat(m, 32)


def _q6_k(rng):
    """Q6_K: weight = d * sc[k] * (q - 32), q six bits (low 4 in ql, high 2 in qh), 16 int8 scales
    of 16 weights; each half of 128 weights packs q[l + 32k] for k = 0..3 around l < 32."""
    d = rng.choice([0.5, 0.0625])
    sc = rng.integers(-128, 128, 16)
    q = rng.integers(0, 64, 256)
    ql, qh, scale_of = np.zeros(128, np.uint8), np.zeros(64, np.uint8), np.zeros(256, int)
    for h in range(2):
        b = q[128 * h:128 * h + 128]
        for l in range(32):
            ql[64 * h + l] = (b[l] & 15) | (b[l + 64] & 15) << 4
            ql[64 * h + l + 32] = (b[l + 32] & 15) | (b[l + 96] & 15) << 4
            qh[32 * h + l] = b[l] >> 4 | (b[l + 32] >> 4) << 2 | (b[l + 64] >> 4) << 4 | (b[l + 96] >> 4) << 6
            for k in range(4):
                scale_of[128 * h + l + 32 * k] = 8 * h + l // 16 + 2 * k
    raw = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)])
    return raw, d * sc[scale_of] * (q - 32)


def _q2_k(rng):
    """Q2_K: 16 scale bytes (low nibble scale, high nibble min) of 16 weights; weight 128h + 32j
    + m has the two bits 2j of qs[32h + m] and scale byte 8h + 2j + (m >= 16)."""
    d, dmin = rng.choice([0.5, 2.0]), rng.choice([0.25, 1.0])
    scales = rng.integers(0, 256, 16)
    q = rng.integers(0, 4, 256)
    qs, scale_of = np.zeros(64, np.uint8), np.zeros(256, int)
    for h in range(2):
        for j in range(4):
            for m in range(32):
                i = 128 * h + 32 * j + m
                qs[32 * h + m] |= q[i] << (2 * j)
                scale_of[i] = 8 * h + 2 * j + (m >= 16)
    raw = np.concatenate([scales.astype(np.uint8), qs, _f16(d, dmin)])
    s = scales[scale_of]
    return raw, d * (s & 15) * q - dmin * (s >> 4)


PACKERS = {"Q4_K": _q4_k, "Q5_K": lambda rng: _q4_k(rng, high_bit=True), "Q6_K": _q6_k, "Q2_K": _q2_k}


@pytest.mark.parametrize("kind", list(PACKERS))
def test_k_quant_blocks_packed_by_hand(tmp_path, kind):
    """Rows of hand-packed blocks decode to the chosen weights, alone and inside a model file."""
    rng = np.random.default_rng(11)
    blocks = [PACKERS[kind](rng) for _ in range(6)]
    raw = np.stack([b for b, _ in blocks]).reshape(3, -1)  # 3 rows of 512 weights
    want = np.concatenate([w for _, w in blocks]).reshape(3, 512)
    assert raw.shape[1] == 2 * gguf.GGML_QUANT_SIZES[QT[kind]][1]
    np.testing.assert_array_equal(dequantize(raw, QT[kind], (3, 512)), want)
    big = [PACKERS[kind](rng) for _ in range(WIDE.dim * 2)]  # ffn_down: [256, 512]
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, args=WIDE, kinds=("F16",),
                     override={"blk.0.ffn_down.weight": (np.stack([b for b, _ in big]).reshape(WIDE.dim, -1), QT[kind])})
    got = load_gguf(path)[1].layers[0].w_down
    np.testing.assert_array_equal(got, np.concatenate([w for _, w in big]).reshape(WIDE.dim, 512))


@pytest.mark.parametrize("kind", RANDOM_ONLY)
def test_dequantize_only_types_through_the_loader(tmp_path, kind):
    """Random blocks (finite float16 scales where the block starts with one) in a model file load
    as gguf.quants decodes the same bytes row by row; zero bytes decode to zeros."""
    rng = np.random.default_rng(13)
    block, nbytes = gguf.GGML_QUANT_SIZES[QT[kind]]
    rows, cols = WIDE.dim, WIDE.ffn_dim  # ffn_down [256, 512]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    if kind not in ("IQ1_M", "NVFP4"):  # these keep their scales elsewhere in the block
        raw[:, :, :2] = (rng.standard_normal((rows, cols // block, 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    path = tmp_path / f"{kind}.gguf"
    write_llama_gguf(path, args=WIDE, kinds=("F16",), override={"blk.0.ffn_down.weight": (raw, QT[kind])})
    got = load_gguf(path)[1].layers[0].w_down
    want = np.stack([gguf.quants.dequantize(raw[r:r + 1], QT[kind]).reshape(-1) for r in range(0, rows, 37)])
    np.testing.assert_array_equal(got[::37], want)
    assert not dequantize(np.zeros(nbytes * 2, np.uint8), QT[kind], (2 * block,)).any()


# --- what tinylm refuses to run -----------------------------------------------------------------
def _kv(key, value):
    def edit(w):
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    return edit


@pytest.mark.parametrize("extra,edit,message", [
    (None, _kv("llama.rope.scaling.type", "dynamic"), r"RoPE scaling \(llama.rope.scaling.type 'dynamic'\)"),
    (None, _kv("llama.rope.scaling.type", "longrope"), r"RoPE scaling \(llama.rope.scaling.type 'longrope'\) "
                                                          r"without both LongRoPE tables"),
    (None, _kv("llama.expert_count", 8), r"a mixture of experts \(llama.expert_count = 8\)"),
    ({"blk.0.attn_q.bias": np.zeros(TINY.dim)}, None, r"a bias on only some of the Q, K, V projections"),
    ({"blk.0.attn_output.bias": np.zeros(TINY.dim)}, None, r"biases \(tensor 'blk.0.attn_output.bias'\)"),
    ({"blk.1.ffn_gate_inp.weight": np.zeros((4, TINY.dim))}, None, r"a mixture of experts \(tensor 'blk.1.ffn_gate_inp"),
    ({"blk.0.attn_rot_embd": np.zeros(8)}, None, r"tensor 'blk.0.attn_rot_embd', which tinylm's llama does not read"),
], ids=["rope-dynamic", "rope-longrope-no-tables", "experts", "bias-q-only", "bias-output", "moe-tensor", "unknown"])
def test_unimplemented_features_are_refused(tmp_path, extra, edit, message):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, extra=extra, edit=edit)
    with pytest.raises(GGUFError, match=rf"m.gguf: .*{message}") as e:
        load_gguf(path)
    assert "\n" not in str(e.value) and ("tinylm does not implement it" in str(e.value)
                                         or "is not implemented by tinylm" in str(e.value))


@pytest.mark.parametrize("extra,edit,factors", [
    (None, _kv("llama.rope.scaling.type", "linear"), None),  # a type without a factor: 1, nothing to do
    (None, _kv("llama.rope.scaling.factor", 8.0), (8.0,) * 16),  # a factor without a type is linear
    (None, _kv("llama.rope.scale_linear", 2.0), (2.0,) * 16),
    ({"rope_freqs.weight": np.arange(1, 17)}, None, tuple(float(i) for i in range(1, 17))),  # Llama 3.1+
], ids=["linear-no-factor", "factor", "scale-linear", "rope-freqs"])
def test_rope_scaling_becomes_frequency_divisors(tmp_path, extra, edit, factors):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, extra=extra, edit=edit)
    assert load_gguf(path)[0].rope_factors == (factors or ())


def test_rope_scaling_none_still_loads(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, edit=lambda w: (w.add_string("llama.rope.scaling.type", "none"),
                                           w.add_float32("llama.rope.scaling.factor", 1.0)))
    assert load_gguf(path)[0].n_layers == TINY.n_layers


def test_cli_refuses_an_unimplemented_model_in_one_line(tmp_path, capsys):
    from tinylm.__main__ import main

    path = tmp_path / "dynamic.gguf"
    write_llama_gguf(path, edit=_kv("llama.rope.scaling.type", "dynamic"))
    assert main(["hi", "--model", str(path), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'dynamic'" in err and "is not implemented by tinylm" in err


def test_other_pre_tokenizers_are_refused():
    from tinylm.tokenizer import Tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.pre is 'deepseek-llm'; tinylm implements the "
                                        r"pre-tokenizers smollm, starcoder, .*deepseek-v3$"):
        Tokenizer.from_gguf_metadata(meta, "x.gguf")
