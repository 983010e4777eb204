"""CUDA graph capture and replay through CuPy's API (Stream.begin_capture / end_capture,
Graph.launch), as tinylm.graphs uses it: on a GPU with real CuPy, and on the CPU emulator's
stand-in (tests/emu/fakecupy.py), which must record the launches, replay them in order with the
buffers' contents at replay time, and refuse what a capture cannot hold."""
import numpy as np
import pytest

from conftest import EMULATE
from cupyattn import layers as L

pytestmark = pytest.mark.gpu


def _capture(stream, fn):
    with stream:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


def test_capture_records_and_replay_reads_current_buffers():
    import cupy

    from tinylm.graphs import graph_kernel_count

    x = cupy.asarray(np.arange(8, dtype=np.float32))
    y = cupy.ones(8, dtype=np.float32)
    out = cupy.zeros(8, dtype=np.float32)
    stream = cupy.cuda.Stream()
    graph = _capture(stream, lambda: (L.add(x, y, out=out), L.add(out, y, out=out)))
    stream.synchronize()
    assert not cupy.asnumpy(out).any()  # capturing ran nothing
    graph.launch(stream)
    stream.synchronize()
    assert cupy.asnumpy(out).tolist() == (np.arange(8) + 2).tolist()
    with stream:
        x.set(np.full(8, 10, dtype=np.float32))  # inputs written between replays are read
    graph.launch(stream)
    stream.synchronize()
    assert cupy.asnumpy(out).tolist() == [12.0] * 8
    assert graph_kernel_count(graph) == 2


@pytest.mark.skipif(not EMULATE, reason="the emulator's refusals (a GPU fails differently or silently)")
def test_emulator_refuses_what_a_capture_cannot_hold():
    import cupy
    import fakecupy

    x = cupy.zeros(8, dtype=np.float32)
    stream = cupy.cuda.Stream()
    for what, fn in [("allocating", lambda: cupy.empty(4, dtype=np.float32)),
                     ("cupy.arange", lambda: cupy.arange(3)),
                     ("array operation add", lambda: x + x),
                     ("ndarray.fill", lambda: x.fill(1)),
                     ("assignment", lambda: x.__setitem__(0, 1)),
                     ("device-to-host", lambda: cupy.asnumpy(x)),
                     ("host-to-device", lambda: x.set(np.ones(8, dtype=np.float32))),
                     ("synchronizing", lambda: stream.synchronize()),
                     ("another stream", lambda: _on_other_stream(lambda: L.add(x, x, out=x)))]:
        with stream:
            stream.begin_capture()
            with pytest.raises(fakecupy.NotCapturable, match=what):
                fn()
            stream.end_capture()
    with pytest.raises(RuntimeError, match="null stream"):
        cupy.cuda.Stream.null.begin_capture()


def _on_other_stream(fn):
    import cupy

    with cupy.cuda.Stream():
        fn()


@pytest.mark.skipif(not EMULATE, reason="on a GPU a freed buffer is silently reused")
def test_emulator_replay_refuses_freed_buffers():
    import cupy

    y = cupy.ones(8, dtype=np.float32)
    out = cupy.zeros(8, dtype=np.float32)
    x = cupy.ones(8, dtype=np.float32)
    stream = cupy.cuda.Stream()
    graph = _capture(stream, lambda: L.add(x, y, out=out))
    view = out[2:]  # a view keeps its buffer alive: replay is still fine
    del out
    graph.launch(stream)
    assert cupy.asnumpy(view).tolist() == [2.0] * 6
    del x
    with pytest.raises(RuntimeError, match="freed after the capture"):
        graph.launch(stream)


def test_tinylm_prefill_is_not_capturable_but_decode_is():
    """A prefill forward allocates its temporaries (it must never be captured; the emulator
    says so); a decode step captures and replays to the eager result."""
    import cupy

    from tinylm import load
    from tinylm.generate import prefill
    from tinylm.graphs import decode_step

    g = load("tiny", backend="cupy", dtype="float32")
    m = g.model
    ops = m.ops
    states = [m.new_state(1, 32) for _ in range(2)]
    for st in states:
        with ops.stream():
            st.sampling.set()
        prefill(m, st, [1, 2, 3])
        decode_step(m, st)  # eager: compiles and loads every kernel of the step
    eager, replayed = states
    if EMULATE:
        import fakecupy

        with pytest.raises(fakecupy.NotCapturable):
            _capture(ops.stream(), lambda: m.forward(ops.ids(np.array([[1, 2]])), replayed))
    saved = replayed.cache.host_lengths.copy()
    graph = _capture(ops.stream(), lambda: decode_step(m, replayed))
    replayed.cache.host_lengths[...] = saved
    for _ in range(3):
        decode_step(m, eager)
        graph.launch(ops.stream())
        replayed.cache.record_advance(1)
    with ops.stream():
        assert cupy.array_equal(eager.logits, replayed.logits)
        assert ops.read_tokens(eager.tokens).tolist() == ops.read_tokens(replayed.tokens).tolist()
    assert cupy.asnumpy(replayed.cache.lengths).tolist() == replayed.cache.host_lengths.tolist() == [[7]] * 2
