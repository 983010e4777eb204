"""Continuous-batching model cases (``model --serve``): tinylm.serve over S slots beside HF's
batched generate, on the same 2 x S prompts.

- ``tinylm-serve``: :func:`tinylm.serve.serve` with ``max_batch=S`` (the cupy backend: a
  PagedKVCache, each decode step a CUDA graph replay, each prompt prefilled alone when it takes a
  slot), the defaults of config.py; ``tinylm-serve-opt-in``: the same with the opt-in paged / split paths
  that are not yet the defaults (HND pages, staged page ids, the "waves" split rule with its fused
  combine), set for the whole run. **Neither has run on a GPU yet.**
- ``hf-transformers``: the prompts in batches of S, each through ``hf_generate_timed`` (the
  prompt forward, then ``new_tokens - 1`` cached single-token steps).

Every prompt has ``prompt_len`` tokens (different text) and gets ``new_tokens`` greedy tokens
(EOS ignored), so both sides do the same work. One warm-up run of the whole workload (kernels
compiled, graphs captured), then ``model_reps`` timed runs; medians kept. Per run:
``decode_tok_s`` = generated tokens / wall time (prefills included: end to end), ``ms_per_step``
= wall time / decode steps (steps of all S slots at once; HF: its batches' steps), ``ttft_ms`` the
median time to a prompt's first token (from its admission for tinylm, its batch's start for HF),
``median_ms`` = 1000 / decode_tok_s, ``gbps`` the weights streamed per step x steps/s. The note
says how many prompts' greedy tokens equal HF's.
"""
from __future__ import annotations

import statistics
import time

from . import hf_peer, peers
from .cases import free_memory
from .model_bench import prompt_ids, record_error, start_case
from .specs import roofline_pct

SERVE_IMPLS = ("tinylm-serve", "tinylm-serve-opt-in")
# config.py switches of the opt-in run (their defaults stay until a GPU run measures them)
OPT_IN = {"PAGED_DEFAULT_LAYOUT": "HND", "DECODE_PAGE_STAGING": True, "DECODE_SPLIT_RULE": "waves"}


def _fill(rec, runs, weight_bytes, ceilings):
    """runs: dicts of tokens, seconds, steps, ttfts (one per timed run)."""
    tok_s = statistics.median(r["tokens"] / r["seconds"] for r in runs)
    ms_step = statistics.median(1e3 * r["seconds"] / max(r["steps"], 1) for r in runs)
    rec.update(decode_tok_s=tok_s, median_ms=1e3 / tok_s, ms_per_step=ms_step, reps=len(runs),
               min_ms=min(1e3 * r["seconds"] / r["tokens"] for r in runs),
               max_ms=max(1e3 * r["seconds"] / r["tokens"] for r in runs),
               ttft_ms=statistics.median(t for r in runs for t in r["ttfts"]),
               gbps=weight_bytes / (ms_step * 1e-3) / 1e9)
    rec["pct_ceiling"], bound = roofline_pct(None, rec["gbps"], ceilings)
    rec["bound"] = bound or None


def _tinylm_run(gen, prompts, n, slots):
    from tinylm.serve import serve

    t0 = time.perf_counter()
    got = dict(serve(gen, prompts, n, slots, ignore_eos=True))
    seconds = time.perf_counter() - t0
    last = max(got.values(), key=lambda r: r.extra.get("decode_steps", 0))
    return ({"tokens": sum(len(r.generated_ids) for r in got.values()), "seconds": seconds,
             "steps": last.extra["decode_steps"], "ttfts": [r.ttft_ms for r in got.values()],
             "slots": last.extra["batch"]}, [got[i].generated_ids for i in range(len(prompts))])


def _run_tinylm(rec, name, args, weights, tok, source, prompts, n, slots, opts, ceilings):
    import tinylm
    from cupyattn import config

    with config.override(**(OPT_IN if name == "tinylm-serve-opt-in" else {})):
        model = tinylm.Transformer(args, weights, getattr(opts, "model_backend", "cupy"), opts.model_dtype)
        gen = tinylm.Generator(model, tok, source)
        rec["dtype"] = gen.dtype
        _tinylm_run(gen, prompts, n, slots)  # warm-up: compile, capture the decode graphs
        runs, ids = [], None
        for _ in range(opts.model_reps):
            run, got = _tinylm_run(gen, prompts, n, slots)
            runs.append(run)
            ids = ids or got
        _fill(rec, runs, gen.weight_bytes, ceilings)
        rec["note"] = (f"backend {gen.backend}, {runs[0]['slots']} slots, {len(prompts)} prompts, "
                       f"{runs[0]['steps']} decode steps/run" + ("; HND pages, staged page ids, waves split rule"
                                                                 if name == "tinylm-serve-opt-in" else ""))
        return ids


def _run_hf(rec, args, weights, prompts, n, slots, ours_ids, opts, ceilings):
    torch = peers.get_torch()
    device = getattr(opts, "hf_device", "cuda")
    dt = "float16" if opts.model_dtype is None else opts.model_dtype
    rec["dtype"] = dt
    model = hf_peer.build_hf_llama(args, weights, dt, device)
    batches = [prompts[i:i + slots] for i in range(0, len(prompts), slots)]

    def one():
        t0 = time.perf_counter()
        outs = [hf_peer.hf_generate_timed(model, b, n) for b in batches]
        seconds = time.perf_counter() - t0
        return ({"tokens": n * len(prompts), "seconds": seconds, "steps": len(batches) * max(n - 1, 1),
                 "ttfts": [o["ttft_ms"] for o in outs]}, [ids for o in outs for ids in o["all_generated_ids"]],
                outs[0]["weight_bytes"])

    one()  # warm-up
    runs = [one() for _ in range(opts.model_reps)]
    _fill(rec, [r for r, _, _ in runs], runs[0][2], ceilings)
    if device == "cuda":
        rec["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    theirs = runs[0][1]
    if ours_ids is not None:
        same = sum(a == b for a, b in zip(ours_ids, theirs))
        rec["note"] = f"{same}/{len(theirs)} prompts' greedy tokens equal to tinylm-serve's; batches of {slots}"


def run_serve_case(case, impls, opts, ceilings, log) -> list[dict]:
    """Records of one serve case (``case.p['batch']`` slots) for ``impls`` (SERVE_IMPLS and the HF peer)."""
    p = case.p
    slots, n = p["batch"], p["new_tokens"]
    recs, loaded = start_case(case, impls, opts, log)
    if loaded is None:
        return list(recs.values())
    args, weights, tok, source = loaded
    prompts = [prompt_ids(tok, args.vocab_size, p["prompt_len"], opts.seed, i) for i in range(2 * slots)]
    ours_ids = None
    for name in impls:
        rec = recs[name]
        try:
            if name in SERVE_IMPLS:
                ids = _run_tinylm(rec, name, args, weights, tok, source, prompts, n, slots, opts, ceilings)
                ours_ids = ours_ids or ids
            else:
                _run_hf(rec, args, weights, prompts, n, slots, ours_ids, opts, ceilings)
        except Exception as e:  # an impl failing must not end the run
            record_error(rec, f"{case.name} / {name}", e, opts, log)
        finally:
            free_memory()
    return list(recs.values())
