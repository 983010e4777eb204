"""tinylm's prefill: the kernels it launches, its captured CUDA graph (tinylm.prefill) and the
fused prefill (Transformer(fused_prefill=True)).

CPU tier: the padding buckets and the defaults. GPU tier (also run on the CPU emulator): the
kernel budget of one prefill (counted launches and graph nodes), a replay equal bit for bit to
the eager padded prefill and reading the current inputs, cache lengths and K/V rows as the
eager prefill leaves them, greedy tokens and logits equal to the NumPy backend's (ragged
batches), and bad arguments raising before anything runs. The real model's tokens through the
default (graphed) prefill: tests/tinylm/test_cupy_backend.py, which loads through tinylm.load.
"""
import numpy as np
import pytest

from conftest import EMULATE

# The budget: 10 kernels per layer (QKV GEMM, RoPE + append, flash attention, head merge, O GEMM,
# residual + norm, gate|up GEMM, SwiGLU, down GEMM, residual + norm) + 4 (embedding, first norm,
# last-row gather, logits); fused: 7 per layer (norm+QKV, RoPE + append, attention, head merge,
# O + residual, norm+gate|up+SwiGLU, down + residual) + 3 (embedding, gather, norm+logits).
# A prompt longer than one RoPE + append block holds (KV_ROPE_APPEND_ITEMS_PER_BLOCK items) adds
# the length-advance kernel per layer (the tiny preset: past 32 tokens; SmolLM2-135M: past 8).
PREFILL_KERNELS = {False: (10, 4), True: (7, 3)}


# --- CPU -----------------------------------------------------------------------------------------
def test_prefill_bucket():
    from tinylm.prefill import PREFILL_MIN_BUCKET, prefill_bucket

    assert PREFILL_MIN_BUCKET == 16
    got = [prefill_bucket(t, 4096) for t in (1, 15, 16, 17, 97, 128, 129, 512)]
    assert got == [16, 16, 16, 32, 128, 128, 256, 512]
    assert prefill_bucket(97, 100) == 100 and prefill_bucket(1, 8) == 8  # capped at max_seq


def test_fused_and_captured_prefill_are_defaults():
    """Both measured on an H100 (tinylm/config.py cites the run): the fused prefill's time to the
    first token was lower than the unfused one's in the same run."""
    from tinylm import config

    assert config.FUSED_PREFILL is True and config.PREFILL_GRAPHS is True


def test_numpy_backend_prefills_eagerly():
    from tinylm import load

    g = load("tiny", backend="numpy")
    assert g.prefill_graphs is False and g.model.fused_prefill is False
    with pytest.raises(ValueError, match="fused prefill needs the cupy backend"):
        load("tiny", backend="numpy", fused_prefill=True)


def test_cli_fused_prefill_needs_the_cupy_backend():
    import contextlib
    import io

    from tinylm.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["hi", "--fused-prefill", "--backend", "numpy"])
    assert rc == 2 and err.getvalue().strip() == "tinylm: error: --fused-prefill needs the cupy backend (a CUDA device)"


# --- GPU -----------------------------------------------------------------------------------------
PROMPTS = [[10, 20, 30, 40, 50], [7], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6]]


@pytest.fixture(scope="module")
def tiny():
    """cupy float32 generators of the tiny preset, unfused and fused prefill, and the NumPy one."""
    from tinylm import load

    gens = {f: load("tiny", backend="cupy", dtype="float32", max_seq=64, fused_prefill=f) for f in (False, True)}
    return gens, load("tiny", backend="numpy", max_seq=64)


def _padded(prompts):
    ids = np.zeros((len(prompts), max(map(len, prompts))), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return ids, [len(p) for p in prompts]


@pytest.mark.gpu
@pytest.mark.parametrize("fused,longest,bucket", [
    (False, 11, 16), (True, 11, 16), (False, 40, 64),
    pytest.param(True, 40, 64, marks=pytest.mark.emu_slow)])  # 35 s on the emulator: left out of the CPU tier
def test_gpu_prefill_kernel_budget(tiny, fused, longest, bucket):
    """An eager prefill's launches (emulator), and the nodes of the captured one, stay within the
    budget; a replay launches nothing else but the graph (and the cache-length reset)."""
    from cupyattn.config import KV_ROPE_APPEND_ITEMS_PER_BLOCK
    from tinylm.generate import prefill
    from tinylm.graphs import graph_kernel_count

    g = tiny[0][fused]
    m = g.model
    a = m.args
    per_layer, extra = PREFILL_KERNELS[fused]
    one_block = KV_ROPE_APPEND_ITEMS_PER_BLOCK // ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim // 2)
    assert one_block == 32  # the tiny preset: 11 tokens take one block, 40 (and their bucket) two
    budget = (per_layer + (longest > one_block)) * a.n_layers + extra
    ids, lens = _padded([list(range(1, longest + 1))] + PROMPTS[:2])
    state = m.new_state(3, 64)
    prefill(m, state, ids, num_new=lens, graphs=True)  # eager, then captured
    pb = state.prefill_buffers[bucket]
    assert graph_kernel_count(pb.graph) <= budget
    if EMULATE:
        import fakecupy

        fakecupy.reset_counters()
        prefill(m, m.new_state(3, 64), ids, num_new=lens)  # the eager prefill
        assert fakecupy.counters["kernels"] <= budget
        fakecupy.reset_counters()
        prefill(m, state, ids, num_new=lens, graphs=True)
        assert fakecupy.counters["kernels"] == 0 and fakecupy.counters["graph_launches"] == 1
        assert fakecupy.counters["graph_nodes"] <= budget and fakecupy.counters["cupy_ops"] <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_prefill_replay_equals_eager_padded_prefill(tiny, fused):
    """The replay reads the current ids (other prompts of the same bucket than the capture's)
    and gives the eager padded prefill's logits bit for bit; lengths (device and host mirror)
    are the real prompt lengths, and the cached K/V rows under them are the eager ones."""
    import cupy

    from tinylm.prefill import prefill_graphed

    m = tiny[0][fused].model
    graphed, eager = m.new_state(3, 64), m.new_state(3, 64)
    prefill_graphed(m, graphed, *_padded([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2], [9]]))  # captures
    assert graphed.prefill_buffers[16].graph is not None
    for prompts in (PROMPTS, [[5] * 16, [6, 7], [255] * 9]):
        ids, lens = _padded(prompts)
        got = cupy.asnumpy(prefill_graphed(m, graphed, ids, lens)).copy()
        want = cupy.asnumpy(prefill_graphed(m, eager, ids, lens, use_graphs=False))
        assert np.array_equal(got, want) and np.isfinite(got).all()
        for st in (graphed, eager):
            assert st.cache.host_lengths.tolist() == cupy.asnumpy(st.cache.lengths).tolist() == [lens] * m.args.n_layers
        for b, n in enumerate(lens):
            for c in ("k", "v"):
                rows = lambda st: cupy.asnumpy(getattr(st.cache, c)[:, b, :, :n])  # noqa: E731
                assert np.array_equal(rows(graphed), rows(eager))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_prefill_tokens_and_logits_equal_numpy(tiny, fused):
    """Greedy tokens of a ragged batch (graphed prefill, then decode) equal the NumPy backend's,
    and the prefill logits of each prompt are close to NumPy's (float32)."""
    import cupy

    from tinylm.prefill import prefill_graphed

    gens, ref = tiny
    g = gens[fused]
    assert g.prefill_graphs and g.model.fused_prefill == fused
    for _ in range(2):  # eager + capture, then a replay
        got = [r.generated_ids for r in g.generate_batch(PROMPTS, 6, ignore_eos=True)]
        assert got == [ref.generate(p, 6, ignore_eos=True).generated_ids for p in PROMPTS]
    m = g.model
    logits = cupy.asnumpy(prefill_graphed(m, m.new_state(3, 64), *_padded(PROMPTS)))
    for row, p in zip(logits, PROMPTS):
        want = ref.logits(p)[-1]
        assert np.abs(row - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    if fused:  # the fused prefill's all-position logits (Transformer.logits, eager, unpadded)
        want = ref.logits(PROMPTS[2])
        assert np.abs(m.logits(PROMPTS[2]) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.mark.gpu
def test_gpu_prefill_bad_arguments_raise_before_anything_runs(tiny):
    import cupy

    from tinylm.prefill import prefill_graphed

    m = tiny[0][False].model
    state = m.new_state(2, 8)
    for args, pattern in [(([[1, 2]], None), "ids have batch 1 but the state was made for batch 2"),
                          (([[1, 2], [3, 4]], [2, 3]), r"num_new must be 2 ints in \[1, T=2\]"),
                          (([[1, 2], [3, 4]], [0, 2]), r"num_new must be 2 ints in \[1, T=2\]"),
                          ((np.ones((2, 9), dtype=np.int64), None), "sequence of 9 tokens does not fit max_seq=8")]:
        with pytest.raises(ValueError, match=pattern):
            prefill_graphed(m, state, *args)
    assert not state.prefill_buffers and cupy.asnumpy(state.cache.lengths).tolist() == [[0, 0]] * m.args.n_layers
