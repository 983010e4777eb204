"""Every model family on the cupy backend (cupyattn kernels; the CPU emulator without a GPU)
against Hugging Face transformers' goldens, on the tiny files of tests/tinylm/test_families.py.

float32, so the goldens' 1e-3 holds: the unfused prefill and decode steps give the logits of the
prompt's positions and of STEPS decode steps; greedy generation through CUDA graphs (decode and padded prefill), the path the
defaults pick (fused where the family allows it), and continuous batching (tinylm.serve) give
HF's tokens. A path that cannot run a family is refused by name when the model is made.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_families import FAMILIES, GOLDEN, check_logits, files, step_logits  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu
STEPS = 4  # decode steps checked here (of the goldens' 8: the emulator runs every thread on the CPU)


@pytest.mark.parametrize("fam", FAMILIES)
def test_cupy_backend_matches_hf(files, fam):  # noqa: F811
    """Every position's logits (eager unfused prefill, then decode steps), and greedy tokens
    through CUDA graphs (the padded prefill and the decode steps)."""
    from tinylm.generate import load

    g = GOLDEN["families"][fam]
    prompt, want = GOLDEN["prompt"], g["tokens"][:STEPS]
    gen = load(files[fam], backend="cupy", dtype="float32", fused=False, fused_prefill=False)
    check_logits(fam, step_logits(gen.model, prompt + want))
    gen.graphs = gen.prefill_graphs = True
    assert gen.generate(prompt, len(want)).generated_ids == want


# one family per kind of path choice: fused decode on (llama3's RoPE divisors inside it; phi3's
# NeoX pairs; phi3-long's LongRoPE table and attention factor; phi4-mini's RoPE over part of each
# head; smollm3's layers without RoPE; granite's attention scale, its other scales in the weights),
# fused prefill only (qwen3's head norms between its kernels), neither (gemma2)
@pytest.mark.parametrize("fam", ["llama3", "phi3", "phi3-long", "phi4-mini", "smollm3", "granite", "qwen3", "gemma2"])
def test_cupy_default_paths_batches_and_serving(files, fam):  # noqa: F811
    """The paths the defaults pick (fused where the family allows it) give HF's logits at every
    position; a ragged batch (each row as if alone) and continuous batching (paged cache, unfused
    decode) give HF's tokens."""
    from tinylm.generate import load
    from tinylm.serve import serve

    prompt, want = GOLDEN["prompt"], GOLDEN["families"][fam]["tokens"][:STEPS]
    gen = load(files[fam], backend="cupy", dtype="float32")
    m = gen.model
    assert (m.fused, m.fused_prefill) == {"llama3": (True, True), "phi3": (True, True), "phi3-long": (True, True),
                                          "phi4-mini": (True, True), "smollm3": (True, True), "granite": (True, True),
                                          "qwen3": (False, True),
                                          "gemma2": (False, False)}[fam]
    check_logits(fam, step_logits(m, prompt + want))
    rows = gen.generate_batch([prompt, prompt[:5]], len(want))
    assert rows[0].generated_ids == want
    out = dict(serve(gen, [prompt[:7], prompt], len(want), max_batch=1, ignore_eos=True))
    assert out[1].generated_ids == want


@pytest.mark.parametrize("fam", FAMILIES)
def test_paths_that_cannot_run_a_family_refuse_it(files, fam):  # noqa: F811
    from tinylm.generate import load
    from tinylm.gguf_io import GGUFModel

    from tinylm.model import MEGAKERNEL_QUIRKS

    args = GGUFModel(files[fam]).args
    quirks = args.quirks()
    lacks = [q for q in quirks if q not in MEGAKERNEL_QUIRKS]
    if not lacks:  # Llama's step once loaded (phi3: its fused tensors split; RoPE divisors): no path refuses it
        assert load(files[fam], backend="cupy", dtype="float32", megakernel=True).model.megakernel
        return
    with pytest.raises(ValueError, match=f"megakernel=True: the megakernel's op list is Llama's; this "
                                         f"{args.arch} model needs {lacks[0]}"):
        load(files[fam], backend="cupy", dtype="float32", megakernel=True)
    decode_lacks = [q for q in ("post_norms", "act=gelu_tanh", "qkv_bias", "qk_norm") if q in quirks]
    if decode_lacks:
        with pytest.raises(ValueError, match=f"fused decode does not implement {decode_lacks[0]}"):
            load(files[fam], backend="cupy", dtype="float32", fused=True, fused_prefill=False)
    prefill_lacks = [q for q in ("post_norms", "act=gelu_tanh") if q in quirks]
    if prefill_lacks:
        with pytest.raises(ValueError, match=f"fused prefill does not implement {prefill_lacks[0]}"):
            load(files[fam], backend="cupy", dtype="float32", fused=False, fused_prefill=True)


@pytest.mark.parametrize("fam", ["phi3", "llama3", "phi3-long", "phi4-mini", "smollm3", "granite"])
def test_megakernel_runs_the_family_as_hf(files, fam, monkeypatch):  # noqa: F811
    """Each is Llama's step once loaded: Phi-3 with NeoX pairs (its fused tensors split), and with
    the megakernel's per-layer RoPE divisors (ModelArgs.rope_divisors) Llama 3's rope_freqs,
    LongRoPE (its attention factor in the weights), Phi-4-mini's RoPE over part of each head and
    SmolLM3's layers without RoPE; Granite with its softmax scale (its other scales in the
    weights): the megakernel (one block on the emulator) gives HF's logits at each decode step
    and decodes HF's greedy tokens."""
    from cupyattn import config
    from conftest import EMULATE
    from tinylm.generate import load

    if EMULATE:
        monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", 1)
    prompt, want = GOLDEN["prompt"], GOLDEN["families"][fam]["tokens"][:STEPS]
    gen = load(files[fam], backend="cupy", dtype="float32", megakernel=True)
    assert gen.model.megakernel and bool(gen.model.args.rope_divisors) == (fam not in ("phi3", "granite"))
    check_logits(fam, step_logits(gen.model, prompt + want))  # the decode steps: megakernel launches
    assert gen.generate(prompt, len(want)).generated_ids == want


def test_head_dim_the_kernels_do_not_take_is_refused_at_load():
    """A head_dim no attention kernel takes (16) fails when the model is made, naming it, not at
    the first prompt."""
    from tinylm.config import PRESETS
    from tinylm.model import Transformer
    from tinylm.weights import synthetic

    args = PRESETS["tiny"].with_(head_dim=16)
    for kw in ({}, {"megakernel": True}, {"fused": True}):
        with pytest.raises(ValueError, match="backend='cupy': head_dim 16 is not one the attention kernels take"):
            Transformer(args, synthetic(args), backend="cupy", dtype="float32", **kw)
    assert np.isfinite(Transformer(args, synthetic(args), backend="numpy").logits([1, 2, 3])).all()


def test_fused_step_the_device_cannot_run_is_refused_at_load(monkeypatch):
    """bfloat16's fused kernels need sm_80: asked for on a Turing device (dispatched as one), the
    fused step is refused when the model is made, naming the compute capability; the default
    leaves it off."""
    from cupyattn import config
    from tinylm.config import PRESETS
    from tinylm.model import Transformer
    from tinylm.weights import synthetic

    monkeypatch.setenv("CUPYATTN_ARCH", "75")
    need = config.impl_min_cc("fused", "skinny", config.BFLOAT16)
    assert need > 75
    w = synthetic(PRESETS["tiny"])
    with pytest.raises(ValueError, match=rf"fused decode needs compute capability {need // 10}.{need % 10} for "
                                         r"bfloat16, this device is 7.5"):
        Transformer(PRESETS["tiny"], w, backend="cupy", dtype="bfloat16", fused=True, fused_prefill=False)
    m = Transformer(PRESETS["tiny"], w, backend="cupy", dtype="bfloat16")
    assert (m.fused, m.fused_prefill) == (False, False)
