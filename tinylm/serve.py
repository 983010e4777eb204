"""Continuous batching: more prompts than decode slots, each slot taking the next prompt as soon
as its sequence ends (greedy only; opt-in with ``tinylm --max-batch N``).

A fixed number of slots decode together, one step for all of them at a time. When a sequence
finishes (a stop id or its max new tokens), its slot is freed and the next prompt is prefilled
into it at once, outside the decode step: the prompt runs alone through a batch-1 scratch state
(the ordinary prefill, so its first token is exactly the one it gets alone), and its keys and
values are copied into the slot. The other slots' caches are untouched, so their next steps are
the same as before. Idle slots (no prompt left) keep decoding with the others; their tokens are
dropped, and they are freed again after each step (no pages held past the step).

Backends:

- ``cupy``: the slots' cache is a :class:`cupyattn.PagedKVCache` (pages of PAGE_SIZE tokens).
  A finished slot's pages go back to the free list (``free``) before the next prompt takes new
  ones; decode steps are CUDA graph replays over the fixed slots (tinylm.graphs.DecodeRunner:
  ``check_room(1)`` before each replay, ``record_advance(1)`` after), lengths on the device.
  Where it has run on a GPU: docs/ran-where.md.
- ``numpy``: the same scheduler over the contiguous NumpyCache (a slot is freed by setting its
  length to 0); decode steps are eager.

Memory: each slot holds a KV cache of the longest prompt + max new tokens - 1 positions, and the
batch-1 scratch state the prompts are prefilled in holds one more with the prefill's activations
(``slot_bytes``). At most MEMORY_SHARE of the memory free at the start is used, like the batches
of ``Generator.batches``: more slots than fit are not made (``serve`` runs the ones that fit),
and if not even one fits, ``serve`` raises one RuntimeError line saying what one slot needs.

Greedy tokens of every prompt equal its run alone (tests/tinylm/test_continuous_batching.py).
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from .generate import (MEMORY_SHARE, GenerationResult, check_sampled, decode_one, host_sample, prefill,
                       sequence_bytes, state_capacity)
from .graphs import DecodeRunner
from .model import RunState, Transformer
from .sampling import Sampler

PAGE_SIZE = 16  # tokens per page of the slots' paged cache (cupy backend)


class _PagedOps:
    """The backend's ops with ``new_cache`` making the slots' PagedKVCache (for RunState)."""

    def __init__(self, ops, page_size: int, pages_per_seq: int):
        self._ops, self._ps, self._mpp = ops, page_size, pages_per_seq

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def new_cache(self, n_layers, batch, n_kv_heads, max_seq, head_dim):
        import cupyattn

        return cupyattn.PagedKVCache(n_layers, batch, n_kv_heads, head_dim, num_pages=batch * self._mpp,
                                     page_size=self._ps, dtype=self._ops.dtype, max_pages_per_seq=self._mpp)


def slot_state(model: Transformer, slots: int, positions: int) -> RunState:
    """The decode state of ``slots`` slots of ``positions`` cache positions each: paged on a
    backend that replays CUDA graphs (cupy), contiguous otherwise. Every slot can hold
    ``positions`` tokens at once (an idle slot takes one position per step and is freed after it)."""
    if not getattr(model.ops, "graphs", False):
        return model.new_state(slots, positions)
    mpp = -(-positions // PAGE_SIZE)
    with model.ops.stream():
        return RunState(model.args, _PagedOps(model.ops, PAGE_SIZE, mpp), slots, mpp * PAGE_SIZE)


def slot_bytes(model: Transformer, longest: int, positions: int) -> tuple:
    """(bytes per slot, bytes of the scratch state) of continuous batching over prompts of at
    most ``longest`` tokens needing ``positions`` cache positions: a slot is a KV cache of
    ``positions`` (whole pages on a paged backend) and one decode token's activations and logits
    (``sequence_bytes`` of a 1-token prompt); the scratch is one sequence of ``sequence_bytes``
    (its cache and the longest prompt's prefill activations)."""
    args, ops = model.args, model.ops
    kv, act = sequence_bytes(args, ops, 1, positions)
    cap = state_capacity(args, positions)  # what sequence_bytes counted the cache at
    held = -(-positions // PAGE_SIZE) * PAGE_SIZE if getattr(ops, "graphs", False) else positions
    scratch = sum(sequence_bytes(args, ops, longest, positions))
    return kv // cap * max(cap, held) + act, scratch


def slots_that_fit(model: Transformer, slots: int, longest: int, positions: int, free_bytes,
                   fn: str = "tinylm.serve") -> int:
    """``slots``, or fewer: as many as MEMORY_SHARE of ``free_bytes`` holds beside the scratch
    state (None: unknown, no limit). RuntimeError naming ``fn`` when not even one fits."""
    if free_bytes is None:
        return slots
    per_slot, scratch = slot_bytes(model, longest, positions)
    fit = (int(free_bytes * MEMORY_SHARE) - scratch) // per_slot
    if fit < 1:
        gib = 2.0 ** 30
        raise RuntimeError(f"{fn}(): one decode slot ({positions} cache positions) needs {per_slot / gib:.2f} GiB "
                           f"on the {model.ops.name} backend beside the {scratch / gib:.2f} GiB that prefilling "
                           f"a prompt of {longest} tokens takes; {free_bytes / gib:.2f} GiB are free, of which "
                           f"{MEMORY_SHARE:.0%} is used: 0 slots fit")
    return min(slots, fit)


def free_slot(cache, slot: int) -> None:
    """Give a slot's pages back (paged cache) and set its lengths to 0."""
    if hasattr(cache, "free"):
        cache.free(slot)
    else:
        cache.lengths[:, slot] = 0


def load_slot(cache, slot: int, src, n: int) -> None:
    """Copy the first ``n`` cached positions of sequence 0 of the contiguous cache ``src``
    (K/V [L, B, Hkv, S, D]) into slot ``slot`` of ``cache`` (freed first) and set its lengths to n."""
    free_slot(cache, slot)
    if not hasattr(cache, "free"):
        cache.k[:, slot, :, :n] = src.k[:, 0, :, :n]
        cache.v[:, slot, :, :n] = src.v[:, 0, :, :n]
        cache.lengths[:, slot] = n
        return
    counts = np.zeros(cache.batch, dtype=np.int64)
    counts[slot] = n
    cache.check_room(counts, "tinylm.serve")  # takes the slot's pages, writes its table row
    ps = cache.page_size
    for j, page in enumerate(cache.pages_of(slot)):
        a, m = j * ps, min(ps, n - j * ps)
        if cache.layout == "HND":  # pages [L, N, Hkv, page, D]
            cache.k[:, page, :, :m] = src.k[:, 0, :, a:a + m]
            cache.v[:, page, :, :m] = src.v[:, 0, :, a:a + m]
        else:                      # pages [L, N, page, Hkv, D]
            cache.k[:, page, :m] = src.k[:, 0, :, a:a + m].transpose(0, 2, 1, 3)
            cache.v[:, page, :m] = src.v[:, 0, :, a:a + m].transpose(0, 2, 1, 3)
    cache.lengths[:, slot] = n
    cache.record_advance(counts)


class Scheduler:
    """Greedy continuous batching of ``prompts`` (lists of ids) over ``slots`` decode slots.

    ``run()`` yields ``(index, GenerationResult)`` as each prompt finishes (not in input order).
    Extra per result: ``slot``, ``continuous`` (True), and the run's ``decode_steps``,
    ``graph_replays``, ``batch`` (slots); ``batch_*`` totals are filled on the last result.
    """

    def __init__(self, model: Transformer, prompts, max_new_tokens: int, slots: int, positions: int,
                 stop_ids=frozenset(), graphs: bool = True, prefill_graphs: bool = False):
        if getattr(model, "fused", False) or getattr(model, "megakernel", False):
            raise ValueError("continuous batching decodes through a paged cache: the fused decode step "
                             "and the megakernel take contiguous caches only (load without them)")
        self.model, self.prompts, self.max_new = model, [list(p) for p in prompts], max_new_tokens
        self.slots, self.stop_ids, self.prefill_graphs = slots, frozenset(stop_ids), prefill_graphs
        self.state = slot_state(model, slots, positions)
        self.scratch = model.new_state(1, positions)
        self.device = self.state.sampling is not None
        self.runner = DecodeRunner(model, self.state, graphs) if self.device else None
        self.steps, self._admitted = 0, False
        self.graphs = graphs

    def _first_token(self, logits) -> int:
        ops, s = self.model.ops, self.scratch
        if s.sampling is None:
            return host_sample(Sampler(0.0, 0, 1.0, 0), logits[0])
        with ops.stream():
            s.sampling.set(0.0, 0, 1.0, 0)
            ops.sample(logits, s.sampling, out=s.tokens)
            return int(ops.read_tokens(s.tokens)[0])

    def _admit(self, slot: int, index: int, cur) -> dict:
        """Prefill prompt ``index`` alone, copy its cache into ``slot``; its first token."""
        t0 = time.perf_counter()
        ids = self.prompts[index]
        logits = prefill(self.model, self.scratch, [ids], graphs=self.prefill_graphs)
        tok = check_sampled(self._first_token(logits), "tinylm.serve", f"prompt {index}", 1)
        with self.model.ops.stream():
            load_slot(self.state.cache, slot, self.scratch.cache, len(ids))
        cur[slot] = tok
        self._admitted = True
        now = time.perf_counter()
        return {"index": index, "out": [tok], "t0": t0, "t1": now, "ttft": now - t0}

    def _done(self, seq) -> str | None:
        if seq["out"][-1] in self.stop_ids:
            return "eos"
        return "length" if len(seq["out"]) >= self.max_new else None

    def _result(self, seq, stop, now) -> GenerationResult:
        m, nd = self.model, len(seq["out"]) - 1
        dec_s = now - seq["t1"]
        return GenerationResult(
            prompt_ids=self.prompts[seq["index"]], generated_ids=seq["out"], ttft_ms=seq["ttft"] * 1e3,
            decode_tokens_per_s=nd / dec_s if nd > 0 and dec_s > 0 else 0.0,
            prefill_tokens_per_s=len(self.prompts[seq["index"]]) / seq["ttft"] if seq["ttft"] > 0 else 0.0,
            weight_bytes=m.weight_bytes, backend=m.backend, dtype=m.dtype, stop_reason=stop,
            decode_ms=dec_s * 1e3, extra={"slot": seq["slot"], "continuous": True, "batch": self.slots,
                                          "batch_index": 0, "batch_offset": 0})

    def _step(self, cur) -> list:
        ops, state = self.model.ops, self.state
        self.steps += 1
        if self.runner is None:
            logits = decode_one(self.model, state, cur)
            greedy = Sampler(0.0, 0, 1.0, 0)
            return [host_sample(greedy, logits[i]) for i in range(self.slots)]
        if self._admitted:  # the device ids are last step's samples: a new prompt's first id goes in
            with ops.stream():
                ops.set_tokens(state.tokens, np.asarray(cur, dtype=np.int64))
            self._admitted = False
        return [int(t) for t in self.runner.step()]

    def run(self):
        queue, live = deque(range(len(self.prompts))), [None] * self.slots
        cur = [0] * self.slots
        if self.device:
            with self.model.ops.stream():
                self.state.sampling.set(0.0, 0, 1.0, 0)
        self.t_start, self.n_dec = time.perf_counter(), 0
        finished = []

        def fill(slot):  # admit prompts into the slot until one does not finish at its first token
            while queue:
                seq = self._admit(slot, queue.popleft(), cur)
                seq["slot"] = slot
                stop = self._done(seq) if self.max_new > 0 else "length"
                if stop is None:
                    live[slot] = seq
                    return
                if self.max_new <= 0:
                    seq["out"] = []
                finished.append((seq["index"], self._result(seq, stop, time.perf_counter())))
            live[slot] = None
            free_slot(self.state.cache, slot)

        for slot in range(self.slots):
            fill(slot)
        yield from self._drain(finished)
        while any(s is not None for s in live):
            toks = self._step(cur)
            now = time.perf_counter()
            for slot, tok in enumerate(toks):
                seq = live[slot]
                cur[slot] = tok
                if seq is None:  # idle: drop its token, give back what the step took
                    free_slot(self.state.cache, slot)
                    continue
                seq["out"].append(check_sampled(tok, "tinylm.serve", f"prompt {seq['index']}", len(seq["out"]) + 1))
                self.n_dec += 1
                stop = self._done(seq)
                if stop is not None:
                    finished.append((seq["index"], self._result(seq, stop, now)))
                    fill(slot)
            yield from self._drain(finished)

    def _drain(self, finished):
        """Yield the finished results, each with the run's totals so far (the last: the run's)."""
        while finished:
            i, res = finished.pop(0)
            dec_s = time.perf_counter() - self.t_start
            res.extra.update(decode_steps=self.steps, graph_replays=self.runner.replays if self.runner else 0,
                             graphs=bool(self.runner is not None and self.graphs), batch_decode_s=dec_s,
                             batch_decode_tokens=self.n_dec,
                             batch_decode_tokens_per_s=self.n_dec / dec_s if dec_s > 0 else 0.0)
            yield i, res


def serve(gen, prompts, max_new_tokens: int, max_batch: int, ignore_eos: bool = False):
    """Greedy continuous batching for a :class:`tinylm.Generator`: ``prompts`` (lists of ids)
    over ``max_batch`` slots, or as many as fit in memory if fewer (``slots_that_fit``; the
    results' ``extra["batch"]`` says how many ran); yields ``(index, GenerationResult)`` as each
    prompt finishes (``text`` decoded when a tokenizer is known). Arguments and memory are
    checked before anything runs (RuntimeError if not even one slot fits). Decode steps take the
    unfused kernels whatever ``gen``'s setting (the fused step, the cupy backend's default, and
    the megakernel write contiguous caches only); ``gen`` is left as it was."""
    from .generate import _check_max_new

    fn = "tinylm.serve"
    max_new_tokens = _check_max_new(max_new_tokens)
    if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
        raise ValueError(f"{fn}(): max_batch must be an integer >= 1, got {max_batch!r}")
    prompts = [gen._ids(fn, f"prompts[{n}]", p) for n, p in enumerate(prompts)]
    if not prompts:
        return
    longest = max(len(p) for p in prompts)
    positions = gen.positions(fn, longest, max_new_tokens)
    gen._state = None  # the Generator's own state is not used here: free it first
    slots = slots_that_fit(gen.model, int(max_batch), longest, positions, gen.model.ops.free_memory(), fn)
    fused, mega = gen.model.fused, gen.model.megakernel
    gen.model.set_fused(False)
    gen.model.set_megakernel(False)
    try:
        sched = Scheduler(gen.model, prompts, max_new_tokens, slots, positions,
                          frozenset() if ignore_eos else gen.stop_ids, gen.graphs, gen.prefill_graphs)
        for i, res in sched.run():
            if gen.tokenizer is not None:
                res.text = gen.decode(res.generated_ids)
            yield i, res
    finally:
        gen.model.set_fused(fused)
        gen.model.set_megakernel(mega)
