"""Prefill as a CUDA graph replay (GPU backend): the same kernels as the eager prefill, launched
by one ``Graph.launch`` instead of ~300 Python launch paths.

Why: a 128-token prefill of SmolLM2-135M is about 300 kernels (10 per layer: the QKV, O,
gate|up and down GEMMs, RoPE + cache append, flash attention, the head merge, two residual +
RMSNorm, SwiGLU; plus the embedding, the first norm, the last-row gather and the logits). Each
goes through its op's Python checks and CuPy's launch path, tens of microseconds on the host,
while the kernels themselves are a few microseconds each on an H100: the time to first token is
the host's. A replay costs the host one call.

What a capture needs is a forward with no host input and no allocation (tests/emu/fakecupy.py
refuses anything else during a capture). So a prompt batch [B, T] is right-padded to a length
bucket ``Tp`` (``prefill_bucket``: the next power of two, at least PREFILL_MIN_BUCKET, at most
the state's max_seq) and run by ``Transformer._run`` into a ``PrefillBuffers`` of that bucket:

- the ids, and the flat row of each sequence's last real token, are device buffers set before
  the replay (two small host-to-device copies);
- every sequence appends all Tp tokens (a uniform append: no per-sequence counts from the host)
  and attends causally with no key lengths. A real token t < T_b sees keys 0..t only, which are
  all real, so right padding changes nothing it computes; the padding rows are computed and
  dropped. After the replay the cache lengths are set to the real lengths (``_set_lengths``),
  so the padded K/V rows lie past each sequence's end, where nothing reads them and the next
  decode steps overwrite them.

A state keeps the buffers and graph of its latest bucket only (a prompt of another bucket frees
them and captures anew), so its prefill memory is one padded prompt's activations, what
``tinylm.generate.sequence_bytes`` counts. The first prefill of a bucket runs this padded forward
eagerly (it compiles and loads every kernel, which a capture must not do) and then captures it;
later prefills of the bucket replay.
Eager and replayed padded prefills run the same launches on the same buffers, so they give the
same logits bit for bit (tests/tinylm/test_prefill.py); against the unpadded eager prefill the logits
differ only where a GEMM of another row count sums in another order (tokens equal on the tests'
models). Prompts longer than PREFILL_CHUNK keep the chunked eager prefill (tinylm.generate).
"""
from __future__ import annotations

import numpy as np

from .model import RunState, Transformer

PREFILL_MIN_BUCKET = 16  # shortest padded length: no GEMM here computes fewer rows per block


def prefill_bucket(t: int, max_seq: int) -> int:
    """Padded length of a T-token prompt: the next power of two >= T (at least
    PREFILL_MIN_BUCKET), capped at max_seq (T itself always fits)."""
    return min(max(PREFILL_MIN_BUCKET, 1 << (int(t) - 1).bit_length()), int(max_seq))


class PrefillBuffers:
    """Inputs, activations and outputs of one padded prefill [B, Tp], allocated once per bucket
    (names as ``Transformer._run`` asks for them), and its captured graph."""

    def __init__(self, args, ops, batch: int, tp: int):
        a, b, e = args, batch, ops.empty
        qd, kvd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.tp = tp
        self.ids = ops.ids(np.zeros((b, tp), dtype=np.int64))  # [B, Tp] int32, right-padded with 0
        self.last = ops.ids(np.arange(b) * tp + tp - 1)  # [B] flat row b * Tp + T_b - 1
        self.x = e((b, tp, a.dim))  # residual stream
        self.h = e((b, tp, a.dim))  # rmsnorm output
        self.qkv = e((b, tp, qd + 2 * kvd))  # [q | k | v] projections
        self.q_rot = e((b, a.n_heads, tp, a.head_dim))  # q after rope
        self.att = e((b, a.n_heads, tp, a.head_dim))  # attention output, heads first
        self.att_rows = e((b, tp, qd))  # the same, heads merged: the O projection's input
        self.proj = e((b, tp, a.dim))  # output of wo / w_down before the residual add
        self.gate_up = e((b, tp, 2 * a.ffn_dim))
        self.ffn = e((b, tp, a.ffn_dim))  # silu(gate) * up
        self.h_last = e((b, 1, a.dim))  # each sequence's last real row
        self.logits = e((b, 1, a.vocab_size))
        self.graph = None


def _set_lengths(cache, counts) -> None:
    """Every layer's cached length of sequence b := counts[b], on the device and in the host
    mirror (after a padded prefill appended Tp tokens per sequence; the rows past counts[b]
    are padding that nothing reads)."""
    lengths = np.broadcast_to(np.asarray(counts, dtype=np.int64), cache.host_lengths.shape)
    cache.lengths.set(lengths.astype(np.int32))
    cache.host_lengths[...] = lengths


def prefill_graphed(model: Transformer, state: RunState, ids, num_new=None, use_graphs: bool = True):
    """Reset the state and prefill ``ids`` [B, T] (host ints, right-padded rows of ``num_new``
    real tokens; None: all T) padded to its bucket; returns the logits of each sequence's last
    real token, [B, vocab] (a view of the bucket's buffer: use it before the next prefill).

    ``use_graphs``: replay the bucket's captured graph (captured after the bucket's first,
    eager, run); False runs the same padded forward eagerly every time.
    """
    ops, cache = model.ops, state.cache
    ids = np.asarray(ids)
    b, t = ids.shape
    if b != state.batch:
        raise ValueError(f"ids have batch {b} but the state was made for batch {state.batch}")
    counts = np.full(b, t, dtype=np.int64) if num_new is None else np.asarray(num_new, dtype=np.int64).reshape(-1)
    if counts.shape != (b,) or (counts < 1).any() or (counts > t).any():
        raise ValueError(f"num_new must be {b} ints in [1, T={t}], got {num_new!r}")
    if t > state.max_seq:
        raise ValueError(f"sequence of {t} tokens does not fit max_seq={state.max_seq}")
    tp = prefill_bucket(t, state.max_seq)
    with ops.stream():
        pb = state.prefill_buffers.get(tp)
        if pb is None:  # one bucket's buffers per state: free the last one's before allocating
            state.prefill_buffers.clear()
            pb = state.prefill_buffers[tp] = PrefillBuffers(model.args, ops, b, tp)
        padded = np.zeros((b, tp), dtype=np.int32)
        padded[:, :t] = ids
        ops.set_tokens(pb.ids, padded)
        ops.set_tokens(pb.last, np.arange(b) * tp + counts - 1)
        cache.reset()
        fix = (counts != tp).any()  # the appends leave every length at Tp
        if use_graphs and pb.graph is not None:
            cache.check_room(tp, "prefill_graphed")
            pb.graph.launch(ops.stream())
            cache.record_advance(tp)  # what the replayed appends did on the device
        else:
            _body(model, state, pb)
            if use_graphs:
                cache.reset()  # the captured appends check their room against an empty mirror
                _capture(model, state, pb)
                fix = True
        if fix:
            _set_lengths(cache, counts)
        return pb.logits[:, -1]


def _body(model, state, pb):
    """The padded forward: every sequence appends Tp tokens, causal attention, no key lengths."""
    model._run(pb.ids, state, pb, None, 0, None, pb.last)


def _capture(model, state, pb):
    """Record the padded forward into ``pb.graph`` (runs nothing; the host mirror of the cache
    lengths, which the captured appends move, is restored)."""
    stream = model.ops.stream()
    saved = state.cache.host_lengths.copy()
    stream.begin_capture()
    try:
        _body(model, state, pb)
    finally:
        pb.graph = stream.end_capture()
        state.cache.host_lengths[...] = saved
