"""End-to-end model cases: tinylm on the cupy backend vs HF transformers on the same weights.

Each side generates ``new_tokens`` greedy tokens after ``batch`` prompts of ``prompt_len``
tokens (different text, one batch), EOS ignored. ``tinylm`` replays the prefill (padded to its
length bucket, tinylm.prefill) and each decode step as CUDA graphs, ``tinylm-fused`` replays the
fused prefill and the fused decode step (cupyattn.fused: 7 kernels per layer instead of 10 in
the prefill, whose time is the TTFT, and 5 instead of 9 per decode step, whose time is the
decode rate; measured here beside the unfused ones: what decided ``tinylm.config.FUSED_PREFILL``
and ``config.TINYLM_FUSED_DECODE``, and keeps checking them), ``tinylm-eager`` launches
every kernel of both from Python (the TTFT without the prefill graph), ``tinylm-mega`` replays
each decode step as one persistent kernel launch (cupyattn.megakernel, sampling inside; the fused
prefill; what would decide ``config.TINYLM_MEGAKERNEL``), the ``tinylm-mega-*`` impls
(``MEGA_VARIANTS``, run only when named) the same with its plan's knobs changed (the A/B of
``benchmarks/gpu_run.sh mega``; each record's note has a profiled step beside the cost model's
prediction) and
``tinylm-fused-pdl`` is ``tinylm-fused`` with its kernels launched with programmatic dependent
launch (``config.FUSED_DECODE_PDL``; skipped below sm_90 or without cuda-bindings); all run one
warm-up generation of the full length first (it compiles the kernels and captures the graphs of
every context bucket the timed runs meet, as gpt-fast compiles before timing), then ``reps``
generations, keeping the medians of TTFT and decode tokens/s (aggregate over the batch). The
peers: ``hf-transformers`` (eager, dynamic cache) and ``hf-compiled`` (static cache +
``torch.compile(mode="reduce-overhead")``, compiled in its warm-up; skipped with the reason where
torch.compile cannot run). ``median_ms`` of a model record is the time per decode token
(1000 / tok/s), so speedups compare decode throughput; GB/s is the achieved weight bandwidth,
weight bytes x decode steps/s (each step streams all weights once for the whole batch), and
``pct_ceiling`` its share of the measured copy bandwidth: the share of the weight-read limit,
``weight_limit_tok_s`` = copy GB/s / weight bytes x batch tokens/s. ``launches_per_step`` counts
the kernel nodes of a captured decode step, ``prefill_launches`` those of the captured prefill
(the note gives them per layer). Correctness: the first-step logits of the first
prompt against tinylm's NumPy float32 backend (``rel_err``, for ours and for HF), and how many
greedy tokens agree with HF's.
"""
from __future__ import annotations

import statistics
import traceback

import numpy as np

from . import hf_peer, peers
from .cases import OURS
from .report import new_record
from .specs import roofline_pct

# The megakernel's A/B (cupyattn.megakernel_llama.MegaKnobs fields changed from config's defaults,
# today's measured plan): "new" is every knob on (NEW_PLAN), "auto" the set the cost model predicts
# fastest for the case's model, batch and mean context (megakernel_llama.cheapest_knobs), the
# others one change each.
MEGA_VARIANTS = {"tinylm-mega": {}, "tinylm-mega-new": "NEW_PLAN", "tinylm-mega-auto": "AUTO",
                 "tinylm-mega-ring": {"attn": "ring", "attn_share": 0.5},
                 "tinylm-mega-fine": {"deps": "fine"}, "tinylm-mega-fine-fit": {"deps": "fine", "down": "fit"},
                 "tinylm-mega-gu16": {"gate_up_rows": 16},
                 "tinylm-mega-spin64": {"spin_ns": 64},
                 "tinylm-mega-spin0": {"spin_ns": 0}, "tinylm-mega-sample2": {"sample": "two_level"}}

# Sampled twins ("<impl>-topp"): the impl generating with temperature 0.8 and top-p 0.9 (no top-k)
# instead of greedily, for the samplers' cost (the megakernel's two-level draw against one block's).
SAMPLED_SUFFIX, SAMPLED = "-topp", dict(temperature=0.8, top_p=0.9, seed=0)


def split_sampled(name: str):
    """(the impl ``name`` runs, its generation's sampling settings: {} for greedy)."""
    if name.endswith(SAMPLED_SUFFIX):
        return name[:-len(SAMPLED_SUFFIX)], dict(SAMPLED)
    return name, {}


SMOLLM2_PROMPT = ("The history of computing is a story of machines that became faster, smaller "
                  "and cheaper every decade, from vacuum tubes to transistors to chips. ")


def _one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def load_model(name: str, seed: int = 0):
    """(args, weights, tokenizer or None, source) for 'smollm2', a GGUF file's path (e.g. a copy
    reduced by ``python -m tinylm.reduce_gguf``) or a synthetic tinylm preset."""
    import tinylm

    if name == "smollm2" or name.endswith(".gguf"):
        path = tinylm.default_model_path() if name == "smollm2" else name
        args, weights, meta = tinylm.load_gguf(path)
        return args, weights, tinylm.Tokenizer.from_gguf_metadata(meta), str(path)
    from tinylm.config import PRESETS

    if name not in PRESETS:
        raise ValueError(f"unknown tinylm preset {name!r}; choose from smollm2, {', '.join(PRESETS)}")
    return PRESETS[name], tinylm.synthetic(PRESETS[name], seed), None, name


def prompt_ids(tokenizer, vocab_size: int, n: int, seed: int = 0, index: int = 0) -> list[int]:
    """``n`` prompt ids: repeated English text (starting ``7 * index`` tokens in, so the prompts
    of a batch differ) for a real tokenizer, random ids otherwise."""
    if tokenizer is None:
        return [int(i) for i in np.random.default_rng((seed, index)).integers(0, vocab_size, n)]
    ids = tokenizer.encode(SMOLLM2_PROMPT)
    start = 7 * index
    return (ids * ((start + n) // max(len(ids), 1) + 1))[start:start + n]


def _fill(rec, ttfts, toks, prefills, weight_bytes, ceilings, batch=1):
    if not toks or min(toks) <= 0:
        raise ValueError("no decode throughput (fewer than 2 new tokens?)")
    tok_s = statistics.median(toks)
    rec.update(ttft_ms=statistics.median(ttfts), decode_tok_s=tok_s,
               prefill_tok_s=statistics.median(prefills) if prefills else None,
               median_ms=1e3 / tok_s, min_ms=1e3 / max(toks), max_ms=1e3 / min(toks),
               reps=len(toks), gbps=weight_bytes * tok_s / batch / 1e9)
    rec["pct_ceiling"], bound = roofline_pct(None, rec["gbps"], ceilings)
    rec["bound"] = bound or None
    if ceilings.get("copy_gbps"):  # every step reads every weight once: the decode rate's upper limit
        rec["weight_limit_tok_s"] = ceilings["copy_gbps"] * 1e9 / weight_bytes * batch


def record_error(rec, label, e, opts, log):
    """An impl's failure as its record's status (PeerUnavailable: skipped; out of memory: oom) and
    one log line (with the traceback under --debug)."""
    if isinstance(e, peers.PeerUnavailable):
        rec["status"] = f"skipped: {e}"
        log(f"{label}: skipped ({e})")
        return
    rec["status"] = "oom" if "OutOfMemory" in type(e).__name__ else f"error: {_one_line(e)}"
    log(f"{label}: {rec['status']}")
    if opts.debug:
        log(traceback.format_exc())


def _errors(logits, ref):
    d = np.asarray(logits, dtype=np.float64) - ref
    return float(np.abs(d).max()), float(np.linalg.norm(d) / max(np.linalg.norm(ref), 1e-300))


def _run_tinylm(rec, gen, prompts, n, opts, ceilings, sampling=None):
    """Warm-up, timed generations (greedy, or with ``sampling``: generate_batch's settings) and the
    record of one tinylm impl; returns seq 0's ids."""
    from .timing import PeakPool

    kw = dict(max_new_tokens=n, ignore_eos=True, **(sampling or {}))
    gen.generate_batch(prompts, **kw)  # compile, capture every bucket
    with PeakPool() as pk:
        runs = [gen.generate_batch(prompts, **kw)]
    runs += [gen.generate_batch(prompts, **kw) for _ in range(opts.model_reps - 1)]
    rec["peak_mb"] = pk.peak / 2**20
    _fill(rec, [r[0].ttft_ms for r in runs], [r[0].extra["batch_decode_tokens_per_s"] for r in runs],
          [r[0].prefill_tokens_per_s for r in runs], gen.weight_bytes, ceilings, len(prompts))
    from tinylm.graphs import graph_kernel_count

    state = gen._state
    graphs = state.graphs if state is not None else {}
    if graphs:
        rec["launches_per_step"] = graph_kernel_count(graphs[max(graphs)])
    prefill_graphs = [pb.graph for pb in (state.prefill_buffers.values() if state is not None else ())
                      if pb.graph is not None]
    prefill_note = "eager prefill"
    if prefill_graphs:
        n_pf = rec["prefill_launches"] = graph_kernel_count(prefill_graphs[0])
        prefill_note = (f"prefill graph of {n_pf} kernels ({n_pf / gen.args.n_layers:.1f} per layer)"
                        if n_pf else "prefill graph")
    rec["note"] = (f"backend {gen.backend}, weights {gen.weight_bytes / 2**20:.0f} MiB, batch {len(prompts)}, "
                   + (f"{runs[0][0].extra['graph_replays']} graph replays/run" if gen.graphs and graphs
                      else "eager launches") + f", {prefill_note}"
                   + (", sampled ({})".format(", ".join(f"{k} {v}" for k, v in sampling.items())) if sampling else ""))
    return [list(r.generated_ids) for r in runs[0]]


def _cannot_run(name, model):
    """Why impl ``name`` cannot run on ``model``'s backend and device (None: it can)."""
    name = split_sampled(name)[0]
    if name not in ("tinylm", "tinylm-eager") and not getattr(model.ops, "fused_decode", False):
        return f"the {model.backend} backend has no fused decode step"
    if name in MEGA_VARIANTS:
        return model.megakernel_problem()
    if name == "tinylm-fused-pdl":
        import importlib.util

        from cupyattn import device

        if device.compute_capability() < 90:
            return "programmatic dependent launch needs sm_90 or newer"
        if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
            return "programmatic dependent launch needs the cuda-bindings package"
    return None


def mega_knobs(name: str, args=None, batch: int = 1, keys: int = 256):
    """config's MEGAKERNEL_* knobs set to impl ``name``'s (MEGA_VARIANTS) for the block, then
    restored; nothing for any other impl. "auto" chooses for ``args`` (the model's ModelArgs),
    ``batch`` and ``keys`` on this device's blocks."""
    from cupyattn import config, device
    from cupyattn.megakernel_llama import NEW_PLAN, MegaKnobs, cheapest_knobs

    change = MEGA_VARIANTS.get(name, {})
    if change == "AUTO":
        knobs = cheapest_knobs(args, batch, keys, config.MEGAKERNEL_BLOCKS or device.sm_count())[0]
    else:
        knobs = NEW_PLAN if change == "NEW_PLAN" else MegaKnobs.from_config().with_(**change)
    return config.override(**knobs.as_config())


def _pdl(on: bool):
    """config.FUSED_DECODE_PDL on for the block when ``on`` (else as it was), then restored."""
    from cupyattn import config

    return config.override(FUSED_DECODE_PDL=on or config.FUSED_DECODE_PDL)


def _first_step_logits(gen, prompt, name):
    """Logits at the prompt's last token. tinylm-mega: the prompt but its last token prefilled,
    then one megakernel decode step (the full recompute would measure the prefill kernels)."""
    if name not in MEGA_VARIANTS or len(prompt) < 2:
        return gen.logits(prompt)[-1]
    gen.prefill(prompt[:-1], max_new_tokens=2)
    return gen.decode_one(prompt[-1])


def _mega_note(rec, gen):
    """Instructions per decode step and blocks of the megakernel (the last plan it ran), and one
    more step of that plan profiled (cupyattn.megakernel.LlamaStep.profile): its span, the busiest
    block's work, and per op kind the median work / wait of an instruction in microseconds, each
    beside the cost model's prediction (in brackets); the whole profile in ``rec["profile"]``."""
    state = gen._state
    mega = getattr(state, "mega", None) if state is not None else None
    if mega is None or not mega.plans:
        return
    (splits, _), dplan = list(mega.plans.items())[-1]
    rec["note"] += f", megakernel: {len(dplan.plan.instructions)} instructions on {mega.step.blocks} blocks"
    if (state.cache.host_lengths + 1 > state.max_seq).any():
        return
    with gen.model.ops.stream():
        prof = mega.step.profile(dplan, splits)
    per_op = ", ".join(f"{k} {v['work_us']:.1f}/{v['wait_us']:.1f} [{v['model_work_us']:.1f}/{v['model_wait_us']:.1f}]"
                       for k, v in prof["ops"].items())
    rec["profile"] = prof
    rec["note"] += (f"; knobs {mega.knobs}; profiled step {prof['step_us']:.0f} us "
                    f"[model {prof['model_step_us']:.0f}], "
                    f"busiest block {prof['busiest_block_work_us']:.0f} us of work; median work/wait us per "
                    f"instruction [model]: {per_op}")


def start_case(case, impls, opts, log):
    """(a record per impl of a model case, its model as load_model gives it); the model None when
    it cannot be loaded, every record then skipped with the reason."""
    recs = {n: new_record(case, n, "peer" if n in peers.PEERS["model"] else "ours") for n in impls}
    try:
        return recs, load_model(case.p["model"], opts.seed)
    except Exception as e:
        for r in recs.values():
            r["status"] = f"skipped: {_one_line(e)}"
        log(f"skipping model {case.p['model']}: {_one_line(e)}")
        return recs, None


def run_model_case(case, impls, opts, ceilings, log) -> list[dict]:
    import cupy

    p = case.p
    batch = p.get("batch", 1)
    recs, loaded = start_case(case, impls, opts, log)
    if loaded is None:
        return list(recs.values())
    args, weights, tok, source = loaded
    prompts = [prompt_ids(tok, args.vocab_size, p["prompt_len"], opts.seed, i) for i in range(batch)]
    n = p["new_tokens"]
    ours_ids = None
    ref_logits = None  # NumPy float32 first-step logits of prompt 0: the correctness reference
    try:
        import tinylm

        ref_logits = tinylm.Transformer(args, weights, "numpy").logits(prompts[0])[-1].astype(np.float64)
    except Exception as e:
        log(f"{case.name}: no NumPy reference logits ({_one_line(e)})")
    ours = [name for name in OURS["model"] if name in recs]
    model = None
    if ours:
        try:
            import tinylm

            backend = getattr(opts, "model_backend", "cupy")
            model = tinylm.Transformer(args, weights, backend, opts.model_dtype)
        except Exception as e:
            for name in ours:
                recs[name]["status"] = "oom" if "OutOfMemory" in type(e).__name__ else f"error: {_one_line(e)}"
            log(f"{case.name} / tinylm: {_one_line(e)}")
    for impl in ours if model is not None else ():
        rec = recs[impl]
        why = _cannot_run(impl, model)
        if why:
            rec["status"] = f"skipped: {why}"
            continue
        name, sampling = split_sampled(impl)
        mega = name in MEGA_VARIANTS
        fused = name in ("tinylm-fused", "tinylm-fused-pdl") or mega
        try:
            model.set_fused(fused)
            model.set_fused_prefill(fused)
            model.set_megakernel(mega)
            gen = tinylm.Generator(model, tok, source, graphs=name != "tinylm-eager")
            rec["dtype"] = gen.dtype
            with _pdl(name == "tinylm-fused-pdl"), mega_knobs(name, args, batch, p["prompt_len"] + n // 2):
                ids = _run_tinylm(rec, gen, prompts, n, opts, ceilings, sampling)
                if mega:
                    _mega_note(rec, gen)
                if ref_logits is not None:
                    rec["max_abs_err"], rec["rel_err"] = _errors(_first_step_logits(gen, prompts[0], name), ref_logits)
                    rec["err_ref"] = "tinylm numpy float32 first-step logits"
            ours_ids = ours_ids or (None if sampling else ids)  # HF's greedy tokens are compared with greedy ones
            del gen
        except Exception as e:
            rec["status"] = "oom" if "OutOfMemory" in type(e).__name__ else f"error: {_one_line(e)}"
            log(f"{case.name} / {impl}: {rec['status']}")
            if opts.debug:
                log(traceback.format_exc())
    del model
    cupy.get_default_memory_pool().free_all_blocks()
    for name in ("hf-transformers", "hf-compiled"):
        if name in recs:
            _run_hf(recs, name, case, args, weights, prompts, n, ours_ids, ref_logits, opts, ceilings, log)
    return list(recs.values())


def _hf_timed_runs(name, model, prompts, n, reps, torch, device):
    """Warm-up then ``reps`` timed generations of one HF peer (``hf-compiled`` compiles in its
    warm-up, at the timed length, so the timed runs meet no new shape)."""
    if name == "hf-compiled":
        try:
            hf_peer.compile_static(model)
            hf_peer.hf_generate_compiled_timed(model, prompts, n)
        except Exception as e:
            raise peers.PeerUnavailable(f"torch.compile cannot run here ({_one_line(e)})") from None
        timed = hf_peer.hf_generate_compiled_timed
    else:
        hf_peer.hf_generate_timed(model, prompts, min(n, 8))
        timed = hf_peer.hf_generate_timed
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return [timed(model, prompts, n) for _ in range(reps)]


def _run_hf(recs, name, case, args, weights, prompts, n, ours_ids, ref_logits, opts, ceilings, log):
    rec = recs[name]
    dt = next((r["dtype"] for r in recs.values() if r["kind"] == "ours" and r["dtype"] in
               ("float16", "bfloat16", "float32")), None)
    if dt is None:  # no tinylm record ran: --model-dtype, else float16
        dt = "float16" if opts.model_dtype is None else opts.model_dtype
    rec["dtype"] = dt
    model = None
    try:
        torch = peers.get_torch()
        device = getattr(opts, "hf_device", "cuda")
        model = hf_peer.build_hf_llama(args, weights, dt, device)
        runs = _hf_timed_runs(name, model, prompts, n, opts.model_reps, torch, device)
        if device == "cuda":
            rec["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        _fill(rec, [r["ttft_ms"] for r in runs], [r["decode_tok_s"] for r in runs],
              [r["prefill_tok_s"] for r in runs], runs[0]["weight_bytes"], ceilings, len(prompts))
        if ref_logits is not None:
            rec["max_abs_err"], rec["rel_err"] = _errors(hf_peer.hf_logits(model, prompts[0])[-1], ref_logits)
            rec["err_ref"] = "tinylm numpy float32 first-step logits"
        if ours_ids is not None:
            theirs = runs[0]["all_generated_ids"]
            same = 0  # greedy runs of sequence 0 agree up to the first differing token
            for a, b in zip(ours_ids[0], theirs[0]):
                if a != b:
                    break
                same += 1
            equal = sum(a == b for a, b in zip(ours_ids, theirs))
            rec["note"] = (f"first {same}/{n} greedy tokens equal to tinylm's"
                           + (f"; {equal}/{len(theirs)} sequences identical" if len(theirs) > 1 else ""))
    except Exception as e:  # an impl failing must not end the run
        record_error(rec, f"{case.name} / {name}", e, opts, log)
    finally:
        del model
        t = peers.get_torch() if "torch" in __import__("sys").modules else None
        if t is not None and t.cuda.is_initialized():
            t.cuda.empty_cache()
