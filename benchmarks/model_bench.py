"""End-to-end model cases: tinylm on the cupy backend vs HF transformers on the same weights.

Each side generates ``new_tokens`` greedy tokens after a ``prompt_len`` prompt, EOS ignored;
after one short warm-up, ``reps`` generations are run and the medians of TTFT and decode
tokens/s kept. ``median_ms`` of a model record is the time per decode token (1000 / tok/s), so
speedups compare decode throughput; GB/s is weight bytes x tok/s (each decode step streams all
weights once). Correctness: ours vs HF last-position logits of the prompt, and how many greedy
tokens agree.
"""
from __future__ import annotations

import statistics
import traceback

import numpy as np

from . import hf_peer, peers
from .report import new_record
from .specs import roofline_pct

SMOLLM2_PROMPT = ("The history of computing is a story of machines that became faster, smaller "
                  "and cheaper every decade, from vacuum tubes to transistors to chips. ")


def _one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def load_model(name: str, seed: int = 0):
    """(args, weights, tokenizer or None, source) for 'smollm2' or a synthetic tinylm preset."""
    import tinylm

    if name == "smollm2":
        path = tinylm.default_model_path()
        args, weights, meta = tinylm.load_gguf(path)
        return args, weights, tinylm.Tokenizer.from_gguf_metadata(meta), str(path)
    from tinylm.config import PRESETS

    if name not in PRESETS:
        raise ValueError(f"unknown tinylm preset {name!r}; choose from smollm2, {', '.join(PRESETS)}")
    return PRESETS[name], tinylm.synthetic(PRESETS[name], seed), None, name


def prompt_ids(tokenizer, vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """``n`` prompt ids: repeated English text for a real tokenizer, random ids otherwise."""
    if tokenizer is None:
        return [int(i) for i in np.random.default_rng(seed).integers(0, vocab_size, n)]
    ids = tokenizer.encode(SMOLLM2_PROMPT)
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def _fill(rec, ttfts, toks, prefills, weight_bytes, ceilings):
    if not toks or min(toks) <= 0:
        raise ValueError("no decode throughput (fewer than 2 new tokens?)")
    tok_s = statistics.median(toks)
    rec.update(ttft_ms=statistics.median(ttfts), decode_tok_s=tok_s,
               prefill_tok_s=statistics.median(prefills) if prefills else None,
               median_ms=1e3 / tok_s, min_ms=1e3 / max(toks), max_ms=1e3 / min(toks),
               reps=len(toks), gbps=weight_bytes * tok_s / 1e9)
    rec["pct_ceiling"], bound = roofline_pct(None, rec["gbps"], ceilings)
    rec["bound"] = bound or None


def run_model_case(case, impls, opts, ceilings, log) -> list[dict]:
    import cupy

    from .timing import PeakPool

    p = case.p
    recs = {n: new_record(case, n, "peer" if n in peers.PEERS["model"] else "ours") for n in impls}
    try:
        args, weights, tok, source = load_model(p["model"], opts.seed)
    except Exception as e:
        for r in recs.values():
            r["status"] = f"skipped: {_one_line(e)}"
        log(f"skipping model {p['model']}: {_one_line(e)}")
        return list(recs.values())
    ids = prompt_ids(tok, args.vocab_size, p["prompt_len"], opts.seed)
    n = p["new_tokens"]
    ours_logits = ours_ids = None
    if "tinylm" in recs:
        rec = recs["tinylm"]
        try:
            import tinylm

            backend = getattr(opts, "model_backend", "cupy")
            gen = tinylm.Generator(tinylm.Transformer(args, weights, backend, opts.model_dtype), tok, source)
            rec["dtype"] = gen.dtype
            gen.generate(ids, max_new_tokens=min(n, 8), ignore_eos=True)  # warm-up: compile kernels
            with PeakPool() as pk:
                runs = [gen.generate(ids, max_new_tokens=n, ignore_eos=True)]
            runs += [gen.generate(ids, max_new_tokens=n, ignore_eos=True) for _ in range(opts.model_reps - 1)]
            rec["peak_mb"] = pk.peak / 2**20
            _fill(rec, [r.ttft_ms for r in runs], [r.decode_tokens_per_s for r in runs],
                  [r.prefill_tokens_per_s for r in runs], gen.weight_bytes, ceilings)
            ours_ids = list(runs[0].generated_ids)
            ours_logits = np.asarray(gen.logits(ids), dtype=np.float32).reshape(len(ids), -1)[-1]
            rec["note"] = f"backend {gen.backend}, weights {gen.weight_bytes / 2**20:.0f} MiB"
            del gen
        except Exception as e:
            rec["status"] = "oom" if "OutOfMemory" in type(e).__name__ else f"error: {_one_line(e)}"
            log(f"{case.name} / tinylm: {rec['status']}")
            if opts.debug:
                log(traceback.format_exc())
        cupy.get_default_memory_pool().free_all_blocks()
    if "hf-transformers" in recs:
        rec = recs["hf-transformers"]
        dt = recs.get("tinylm", {}).get("dtype")
        dt = dt if dt in ("float16", "bfloat16", "float32") else (opts.model_dtype or "float16")
        rec["dtype"] = dt
        model = None
        try:
            torch = peers.get_torch()
            device = getattr(opts, "hf_device", "cuda")
            model = hf_peer.build_hf_llama(args, weights, dt, device)
            hf_peer.hf_generate_timed(model, ids, min(n, 8))  # warm-up
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs = [hf_peer.hf_generate_timed(model, ids, n) for _ in range(opts.model_reps)]
            if device == "cuda":
                rec["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            _fill(rec, [r["ttft_ms"] for r in runs], [r["decode_tok_s"] for r in runs],
                  [r["prefill_tok_s"] for r in runs], runs[0]["weight_bytes"], ceilings)
            if ours_logits is not None:
                ref = hf_peer.hf_logits(model, ids)[-1].astype(np.float64)
                d = ours_logits.astype(np.float64) - ref
                mx, rel = float(np.abs(d).max()), float(np.linalg.norm(d) / max(np.linalg.norm(ref), 1e-300))
                same = 0  # greedy runs agree up to the first differing token
                for a, b in zip(ours_ids, runs[0]["generated_ids"]):
                    if a != b:
                        break
                    same += 1
                for r in recs.values():
                    r.update(max_abs_err=mx, rel_err=rel, err_ref="tinylm vs HF last logits")
                rec["note"] = f"first {same}/{n} greedy tokens equal to tinylm's"
        except peers.PeerUnavailable as e:
            rec["status"] = f"skipped: {e}"
            log(f"{case.name} / hf-transformers: skipped ({e})")
        except Exception as e:
            rec["status"] = "oom" if "OutOfMemory" in type(e).__name__ else f"error: {_one_line(e)}"
            log(f"{case.name} / hf-transformers: {rec['status']}")
            if opts.debug:
                log(traceback.format_exc())
        finally:
            del model
            t = peers.get_torch() if "torch" in __import__("sys").modules else None
            if t is not None and t.cuda.is_initialized():
                t.cuda.empty_cache()
    return list(recs.values())
