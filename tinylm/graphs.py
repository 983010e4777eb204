"""Decode steps as CUDA graph replays (GPU backend).

One decode step is: embedding of ``state.tokens`` through every layer to the logits, then
device sampling back into ``state.tokens`` (``decode_step``). Nothing in it allocates, reads
the host or needs a host input: positions come from the device cache lengths, which the fused
rope + append kernels advance; the RNG step lives with the sampling settings in device memory;
the sampled ids feed the next step directly. So the step is captured once with CuPy stream
capture (``Stream.begin_capture`` / ``end_capture``) and replayed per token with one
``Graph.launch``, instead of ~300 Python-wrapped kernel launches.

What a capture fixes is the split-KV count of decode attention: steps are bucketed by context
length (``tinylm.model.context_bucket``: lengths in [2^(k-1), 2^k)), every step of a bucket uses
the count chosen for its lower end (eager steps too, so eager and graph runs give the same
tokens), and each bucket gets its own graph, built lazily. The first step of a bucket runs
eagerly (it compiles and loads any kernel the bucket needs, which a capture must not do); the
second captures the graph and replays it, as do all later ones.

The host keeps its mirror of the cache lengths (``KVCache.host_lengths``) right without a sync:
room for one more token is checked before each replay (``check_room``), and the replay's
advance is recorded after it (``record_advance``); the capture itself changes nothing, so the
mirror is restored after it.
"""
from __future__ import annotations

import re

from .model import RunState, Transformer, context_bucket


def decode_step(model: Transformer, state: RunState) -> None:
    """One decode step on the device: logits of ``state.tokens`` [B, 1], then the sampled ids
    written back into ``state.tokens`` (settings and RNG step in ``state.sampling``); with the
    megakernel both in its one launch."""
    if model.megakernel:
        model.decode_and_sample(state)
        return
    logits = model.forward(state.tokens, state)
    model.ops.sample(logits, state.sampling, out=state.tokens)


def graph_kernel_count(graph) -> int | None:
    """Kernel nodes of a captured graph, counted from its DOT dump (every node of a tinylm decode
    graph is a kernel); None if the dump has no recognisable node names."""
    try:
        dot = graph.debug_dot_str()
    except Exception:
        return None
    return len(set(re.findall(r"graph_\d+_node_\d+", dot))) or None


class DecodeRunner:
    """Runs decode steps of one RunState, as graph replays (``use_graphs``) or eagerly."""

    def __init__(self, model: Transformer, state: RunState, use_graphs: bool = True):
        if state.sampling is None:
            raise ValueError(f"the {model.backend} backend has no device sampling: it decodes eagerly "
                             "on the host (tinylm.generate)")
        self.model, self.state, self.use_graphs = model, state, use_graphs
        self.replays = 0

    def step(self):
        """One decode step for every sequence; returns the sampled ids (host int64 [B])."""
        model, state, ops = self.model, self.state, self.model.ops
        cache = state.cache
        cache.check_room(1, "DecodeRunner.step")  # before the replay: a replay cannot fail later
        bucket = context_bucket(state.length + 1)
        with ops.stream():
            if self.use_graphs and bucket in state.warm:
                graph = state.graphs.get(bucket) or self._capture(bucket)
                graph.launch(ops.stream())
                cache.record_advance(1)  # what the replayed appends did on the device
                self.replays += 1
            else:
                decode_step(model, state)
                state.warm.add(bucket)
            return ops.read_tokens(state.tokens)

    def _capture(self, bucket: int):
        state, stream = self.state, self.model.ops.stream()
        saved = state.cache.host_lengths.copy()
        stream.begin_capture()
        try:
            decode_step(self.model, state)
        finally:
            graph = stream.end_capture()
            state.cache.host_lengths[...] = saved  # the capture ran nothing on the device
        state.graphs[bucket] = graph
        return graph
