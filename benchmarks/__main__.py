"""cupyattn-bench: time our kernels against cuBLAS, naive CuPy, torch and HF in one run.

    python -m benchmarks attention --B 4 --H 16 --Sq 4096 --D 128 --causal --dtype float16
    python -m benchmarks attention --sweep attention-seqlen --plot attn.png --json attn.json
    python -m benchmarks all --record            # default cases of every op -> benchmarks/results/

Every run first measures the device's two ceilings (D2D copy GB/s, cuBLAS fp16 TFLOP/s) and
reports each case against them. No device: one line on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import specs
from .report import RESULTS_DIR

SERVE_SLOTS = (8, 32, 64)  # model --serve: the slot counts of issue 39


def _prog() -> str:
    """The command the user typed: the console script, or ``python -m benchmarks`` (checkout) /
    ``python -m cupyattn_benchmarks`` (installed)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "cupyattn-bench" if name.startswith("cupyattn-bench") else f"python -m {__package__ or 'benchmarks'}"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("run options")
    g.add_argument("--dtype", choices=specs.DTYPES, help="element type (default: per case; sweeps float16)")
    g.add_argument("--impl", help="comma-separated impls to run (ours and peers); default: all "
                   "(`all` runs every impl)")
    g.add_argument("--reps", type=int, default=30, help="timed repetitions per impl (median reported)")
    g.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    g.add_argument("--budget-ms", type=float, default=1000.0, help="cap on timed reps per impl, in ms")
    g.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed reps")
    g.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--debug", action="store_true", help="print tracebacks of failing impls")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    o = common.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the run (meta, ceilings, records) as JSON")
    o.add_argument("--csv", metavar="PATH", help="write the records as CSV")
    o.add_argument("--plot", metavar="PATH.png", help="plot sweeps (needs matplotlib); several "
                   "sweeps give PATH-<sweep>.png")
    o.add_argument("--record", action="store_true",
                   help="write benchmarks/results/<date>-<gpu>.json (only for real runs)")
    o.add_argument("--results-dir", default=str(RESULTS_DIR), help=argparse.SUPPRESS)
    m = argparse.ArgumentParser(add_help=False)
    mg = m.add_argument_group("model options")
    mg.add_argument("--preset", default="llama2-7b-4layers", help="synthetic tinylm preset")
    mg.add_argument("--model-dtype", choices=specs.DTYPES, help="tinylm/HF dtype (default float16)")
    mg.add_argument("--model-reps", type=int, default=3, help="generations per model impl")
    mg.add_argument("--prompt-len", type=int, default=128)
    mg.add_argument("--new-tokens", type=int, default=128)
    mg.add_argument("--batch", default=None, metavar="B[,B...]",
                    help="model batch sizes, comma-separated (default: 1 and 8 for smollm2, 1 otherwise); "
                    "with --serve the slot counts (default 8,32,64)")
    mg.add_argument("--serve", action="store_true",
                    help="tinylm continuous batching (tinylm-serve: 2 x slots prompts over the slots, "
                    "paged cache) beside HF's batched generate (batches of slots): tokens/s and ms per step")
    # For the CPU tests of this CLI only: tinylm backend and HF device of the model cases.
    mg.add_argument("--model-backend", default="cupy", help=argparse.SUPPRESS)
    mg.add_argument("--hf-device", default="cuda", help=argparse.SUPPRESS)

    ap = argparse.ArgumentParser(prog=_prog(), description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="sweeps: " + ", ".join(specs.SWEEPS))
    sub = ap.add_subparsers(dest="op", required=True, metavar="{gemm,softmax,attention,decode,varlen,paged,model,all}")

    def add(name, help_, parents=(common,)):
        return sub.add_parser(name, help=help_, parents=list(parents), description=help_)

    def sweep_arg(p, op):
        p.add_argument("--sweep", choices=specs.sweeps_for(op), help="run a predefined sweep")

    p = add("gemm", "C = A B^T (nt) or A B (nn) vs cuBLAS")
    for k in "MNK":
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--layout", choices=("nt", "nn"))
    sweep_arg(p, "gemm")
    p = add("softmax", "row softmax vs CuPy ops and torch")
    p.add_argument("--rows", type=int)
    p.add_argument("--cols", type=int)
    sweep_arg(p, "softmax")
    for name, help_ in (("attention", "attention [B,H,S,D] (flash, naive) vs naive CuPy and torch SDPA"),
                        ("decode", "one-token decode over a KV cache (split-KV, unsplit, naive, paged with 16 / 1 / 256-token "
                                   "pages; the opt-in split rule, staged page ids and HND pages)")):
        p = add(name, help_)
        for k in ("B", "H", "Hkv", "Sq", "Sk", "D"):
            p.add_argument(f"--{k}", type=int, help="cached length" if (name, k) == ("decode", "Sk") else None)
        if name == "decode":
            p.add_argument("--ragged", type=int, metavar="SEED",
                           help="cached lengths 128 .. Sk per sequence, drawn from SEED (a continuous-batching step)")
            p.add_argument("--splits", type=int, metavar="N",
                           help="split-kv's split count (default: the automatic choice, decode.choose_num_splits)")
        p.add_argument("--causal", action="store_true",
                       help="causal mask, bottom-right aligned" if name == "attention"
                       else "ignored: a decode query sees its whole cache")
        sweep_arg(p, name)
    p = add("varlen", "ragged packed batches: attention_varlen vs the dense kernel and torch SDPA on the padded batch")
    for k in ("B", "H", "Hkv", "D"):
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--lo", type=int, help="shortest sequence (lengths uniform in [lo, hi])")
    p.add_argument("--hi", type=int, help="longest sequence")
    p.add_argument("--seed-lens", type=int, dest="seed_lens", help="seed of the lengths (NumPy default_rng)")
    p.add_argument("--causal", action="store_true", help="causal mask per sequence")
    p = add("paged", "chunked prefill over a paged KV cache vs the same keys contiguous and torch SDPA")
    for k in ("B", "H", "Hkv", "Sq", "Sk", "D"):
        p.add_argument(f"--{k}", type=int, help="cached keys per sequence, the Sq new ones last" if k == "Sk" else None)
    p.add_argument("--page", type=int, help="tokens per page (a power of two)")
    p.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned")
    sweep_arg(p, "paged")
    mg.add_argument("--model", help="comma-separated: 'smollm2', a tinylm preset, 'families' (the shapes of "
                    "Llama 3.2-1B, Mistral-7B (4 layers), Qwen2.5-0.5B, Qwen3-0.6B, Gemma-2-2B, Gemma-3-1B) "
                    "or a GGUF file's path (default: both smollm2 and --preset)")
    p = add("model", "tinylm end to end (TTFT, decode tok/s) vs HF transformers", (common, m))
    p = add("all", "default cases of every op (and model)", (common, m))
    p.add_argument("--with-sweeps", action="store_true", help="also run every predefined sweep")
    p.add_argument("--skip-model", action="store_true", help="leave out the model cases")
    return ap


def plan(a) -> list:
    """The cases a parsed command line asks for (pure: no device needed)."""
    def defaults(op):
        cases = specs.default_cases(op, a.preset) if op == "model" else specs.default_cases(op)
        if a.dtype and op != "model":
            cases = list(dict.fromkeys(specs.make_case(op, a.dtype, **c.p) for c in cases))
        if op == "model":
            pairs = [(c.p["model"], c.p["batch"]) for c in cases]
            serve = bool(getattr(a, "serve", False))
            if a.model:
                from tinylm.config import FAMILY_PRESETS  # "families": each family's small model's shapes

                names = [n for m in a.model.split(",") for n in (FAMILY_PRESETS if m == "families" else [m])]
                pairs = [(m, b) for m in names for b in batches or [1]]
            if serve:  # continuous batching at 8, 32 and 64 slots unless --batch says
                pairs = [(m, b) for m in dict.fromkeys(m for m, _ in pairs) for b in batches or SERVE_SLOTS]
            elif batches:
                pairs = list(dict.fromkeys((m, b) for m, _ in pairs for b in batches))
            cases = [specs.model_case(m, a.prompt_len, a.new_tokens, b, serve) for m, b in pairs]
        return cases

    batches = _batches(getattr(a, "batch", None))

    if a.op == "all":
        out = []
        for op in ("gemm", "softmax", "attention", "decode", "varlen", "paged"):
            out += defaults(op)
        if a.with_sweeps:
            for name in specs.SWEEPS:
                out += specs.sweep_cases(name, a.dtype or "float16")
        if not a.skip_model:
            out += defaults("model")
        return out
    if a.op == "model":
        return defaults("model")
    if getattr(a, "sweep", None):
        return specs.sweep_cases(a.sweep, a.dtype or "float16")
    one = specs.cli_case(a.op, a)
    return [one] if one is not None else defaults(a.op)


def _batches(text) -> list[int]:
    """``--batch 1,8`` -> [1, 8] (ValueError for anything but positive ints)."""
    if not text:
        return []
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--batch must be positive integers separated by commas, got {text!r}")
    return out


def select_impls(op: str, impl_arg: str | None, skip) -> list[str]:
    """Requested impls of ``op`` (by default all but the opt-in ones, cases.OPT_IN), with missing
    peers skipped by ``skip``."""
    from . import cases, peers

    known = cases.impl_names(op)
    default = [n for n in known if n not in cases.OPT_IN.get(op, ())]
    names = default if not impl_arg else [s.strip() for s in impl_arg.split(",") if s.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown impl {', '.join(bad)} for {op}; choose from {', '.join(known)}")
    ok_peers = set(peers.available(op, [n for n in names if n in peers.PEERS[op]], skip))
    return [n for n in names if n not in peers.PEERS[op] or n in ok_peers]


def impls_for_case(case, impls: list[str]) -> list[str]:
    """Drop impls that do not apply to a case: TF32 is a float32 mode; our tensor-core
    ("mma", "wgmma") variants take 16-bit inputs only; "skinny" is a gemm_nt kernel for small M;
    "cupy-naive" attention needs CuPy's batched matmul, which has no bfloat16 (CuPy 14.2 on the
    H100: "TypeError: data type 'E' not understood"), and has no key-length mask (a ragged decode
    case); a continuous-batching model case (serve) runs the tinylm-serve impls beside
    hf-transformers only, the other model cases every impl but those."""
    from cupyattn.config import GEMM_SKINNY_MAX_M

    fp32 = case.dtype == "float32"
    skinny = case.op == "gemm" and case.p["layout"] == "nt" and case.p["M"] <= GEMM_SKINNY_MAX_M
    no_batched_bf16 = case.op in ("attention", "decode") and case.dtype == "bfloat16"
    ragged = case.op == "decode" and bool(case.p.get("ragged"))
    if case.op == "model":
        from .serve_bench import SERVE_IMPLS

        if case.p.get("serve"):
            return [n for n in impls if n in SERVE_IMPLS + ("hf-transformers",)]
        return [n for n in impls if n not in SERVE_IMPLS]
    return [n for n in impls if not ((n == "cublas-tf32" and not fp32) or ("mma" in n and fp32)
                                     or ("skinny" in n and not skinny)
                                     or (n == "cupy-naive" and (no_batched_bf16 or ragged)))]


def _outputs(a, argv, records, ceilings, meta, log) -> None:
    from . import report

    run = report.run_dict(meta, ceilings, records)
    if a.json:
        log(f"wrote {report.write_json(a.json, run)}")
    if a.csv:
        log(f"wrote {report.write_csv(a.csv, records)}")
    if a.plot:
        sweeps = list(dict.fromkeys(r["sweep"] for r in records if r["sweep"]))
        if not sweeps:
            log("--plot: no sweep in this run, nothing to plot")
        for name in sweeps:
            path = Path(a.plot) if len(sweeps) == 1 else Path(a.plot).with_name(
                f"{Path(a.plot).stem}-{name}{Path(a.plot).suffix or '.png'}")
            _, _, xlabel = specs.SWEEPS[name]
            recs = [r for r in records if r["sweep"] == name]
            done = report.plot_sweep(recs, ceilings, path, f"{name} {recs[0]['dtype']}", xlabel)
            log(f"wrote {done}" if done else "--plot: matplotlib is not installed, plot skipped")
    if a.record:
        path = report.record_path(meta.get("gpu", "gpu"), meta["date_utc"][:10], a.results_dir)
        log(f"recorded {report.write_json(path, run)}")


def main(argv=None) -> int:
    os.environ.setdefault("CUPY_TF32", "0")  # float32 cuBLAS peers in full precision by default
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    try:
        cases_ = plan(a)
    except ValueError as e:
        print(f"{_prog()}: {e}", file=sys.stderr)
        return 2

    from .timing import NoDevice, require_device

    try:
        require_device()
    except NoDevice as e:
        print(f"{_prog()}: {e}", file=sys.stderr)
        return 1
    return _run(a, argv, cases_)


def _run(a, argv, cases_) -> int:
    from tqdm import tqdm

    from . import cases, model_bench, peers, report, serve_bench, timing

    seen = set()

    def log(msg):
        if msg not in seen:
            seen.add(msg)
            tqdm.write(msg, file=sys.stderr)

    try:
        impls = {op: select_impls(op, a.impl if a.op != "all" else None, log)
                 for op in dict.fromkeys(c.op for c in cases_)}
    except ValueError as e:
        print(f"{_prog()}: {e}", file=sys.stderr)
        return 2
    import cupy

    cupy.random.seed(a.seed)
    a.check = not a.no_check
    a.model_reps = max(1, getattr(a, "model_reps", 1))
    a.model_dtype = getattr(a, "model_dtype", None)
    meta = report.run_meta(argv, report.device_meta())
    log(f"{meta['gpu']} (sm_{meta['compute_capability']}), driver {meta['driver']}, "
        f"CUDA {meta['cuda_runtime']}, CuPy {meta['cupy']}; measuring ceilings...")
    ceilings = timing.measure_ceilings()
    flusher = None if a.no_flush else timing.L2Flusher()
    meta["l2_flush"] = flusher is not None
    records = []
    bar = tqdm(cases_, disable=a.no_progress or len(cases_) < 2, file=sys.stderr, unit="case")
    for case in bar:
        bar.set_postfix_str(case.name[:48])
        names = impls_for_case(case, impls[case.op])
        if case.op == "model" and case.p.get("serve"):
            recs = serve_bench.run_serve_case(case, names, a, ceilings, log)
        elif case.op == "model":
            recs = model_bench.run_model_case(case, names, a, ceilings, log)
        else:
            recs = cases.run_case(case, names, a, ceilings, flusher, log)
        report.add_speedups(recs, peers.PRIMARY[case.op])
        records += recs
    bar.close()
    print(report.format_table(records, ceilings))
    _outputs(a, argv, records, ceilings, meta, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
