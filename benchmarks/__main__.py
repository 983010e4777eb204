"""cupyattn-bench: time our kernels against cuBLAS, naive CuPy, torch and HF in one run.

    python -m benchmarks attention --B 4 --H 16 --Sq 4096 --D 128 --causal --dtype float16
    python -m benchmarks attention --sweep attention-seqlen --plot attn.png --json attn.json
    python -m benchmarks all --record            # default cases of every op -> benchmarks/results/
    python -m benchmarks compare NEW.json        # against the newest earlier run on that GPU model

Every run first measures the device's two ceilings (D2D copy GB/s, cuBLAS fp16 TFLOP/s) and
reports each case against them. A bad flag: one line naming it, exit status 2 (before any device).
No device: one line, exit status 1. A GPU another process uses: refused, exit status 3, unless
--allow-shared (gpu_guard.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import cli_args, specs
from .report import RESULTS_DIR

SUBCOMMANDS = ("gemm", "softmax", "attention", "decode", "varlen", "paged", "model", "all", "compare")

SERVE_SLOTS = (8, 32, 64)  # model --serve: the slot counts timed


def _prog() -> str:
    """The command the user typed: the console script, or ``python -m benchmarks`` (checkout) /
    ``python -m cupyattn_benchmarks`` (installed)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "cupyattn-bench" if name.startswith("cupyattn-bench") else f"python -m {__package__ or 'benchmarks'}"


def _parser() -> argparse.ArgumentParser:
    """The CLI's parser: every flag typed and range-checked here (cli_args), so a bad value is one
    line naming the flag and exit 2 before anything touches a device."""
    from cupyattn.config import DECODE_MAX_SPLITS, PAGED_MAX_PAGE_SIZE as MAX_PAGE_SIZE  # the kernels' limits

    pos, nonneg, seed, path = cli_args.positive, cli_args.nonneg, cli_args.seed, cli_args.path
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("run options")
    g.add_argument("--dtype", choices=specs.DTYPES, help="element type (default: per case; sweeps float16)")
    g.add_argument("--impl", type=cli_args.name_list, metavar="IMPL[,IMPL...]",
                   help="comma-separated impls to run (ours and peers); default: all but the opt-in ones")
    g.add_argument("--reps", type=pos, default=30, help="timed repetitions per impl (median reported)")
    g.add_argument("--warmup", type=nonneg, default=3, help="untimed calls before timing (0: none but the "
                   "first, checked call and the one that sizes the reps)")
    g.add_argument("--budget-ms", type=cli_args.positive_float, default=1000.0,
                   help="cap on timed reps per impl, in ms (at least 5 reps run)")
    g.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed reps")
    g.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    g.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    g.add_argument("--allow-shared", action="store_true",
                   help="run even when another process uses the GPU (the idle-GPU guard: gpu_guard.py); the "
                   "results are marked shared and kept out of the README table")
    g.add_argument("--debug", action="store_true", help="print tracebacks of failing impls")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    o = common.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", type=path, help="write the run (meta, ceilings, records) as JSON")
    o.add_argument("--csv", metavar="PATH", type=path, help="write the records as CSV")
    o.add_argument("--plot", metavar="PATH.png", type=path, help="plot sweeps (needs matplotlib); several "
                   "sweeps give PATH-<sweep>.png")
    o.add_argument("--record", action="store_true",
                   help="write benchmarks/results/<date>-<gpu>.json (only for real runs)")
    o.add_argument("--results-dir", type=path, default=str(RESULTS_DIR), help=argparse.SUPPRESS)
    m = argparse.ArgumentParser(add_help=False)
    mg = m.add_argument_group("model options")
    mg.add_argument("--preset", type=cli_args.preset, default="llama2-7b-4layers", help="synthetic tinylm preset")
    mg.add_argument("--model-dtype", choices=specs.DTYPES, help="tinylm/HF dtype (default float16)")
    mg.add_argument("--model-reps", type=pos, default=3, help="generations per model impl")
    mg.add_argument("--prompt-len", type=pos, default=128, help="prompt tokens")
    mg.add_argument("--new-tokens", type=cli_args.int_in(2), default=128,
                    help="tokens generated per prompt (at least 2: decode speed needs a decode step)")
    mg.add_argument("--batch", type=cli_args.int_list, default=None, metavar="B[,B...]",
                    help="model batch sizes, comma-separated (default: 1 and 8 for smollm2, 1 otherwise); "
                    "with --serve the slot counts (default 8,32,64)")
    mg.add_argument("--serve", action="store_true",
                    help="tinylm continuous batching (tinylm-serve: 2 x slots prompts over the slots, "
                    "paged cache) beside HF's batched generate (batches of slots): tokens/s and ms per step")
    # For the CPU tests of this CLI only: tinylm backend and HF device of the model cases.
    mg.add_argument("--model-backend", default="cupy", choices=("cupy", "numpy"), help=argparse.SUPPRESS)
    mg.add_argument("--hf-device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)

    ap = cli_args.OneLineParser(prog=_prog(), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="sweeps: " + ", ".join(specs.SWEEPS))
    sub = ap.add_subparsers(dest="op", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")

    def add(name, help_, parents=(common,)):
        return sub.add_parser(name, help=help_, parents=list(parents), description=help_)

    def sweep_arg(p, op):
        p.add_argument("--sweep", choices=specs.sweeps_for(op), help="run a predefined sweep")

    def dims(p, keys, helps=None):
        for k in keys:
            p.add_argument(f"--{k}", type=pos, help=(helps or {}).get(k))

    p = add("gemm", "C = A B^T (nt) or A B (nn) vs cuBLAS")
    dims(p, "MNK")
    p.add_argument("--layout", choices=("nt", "nn"))
    sweep_arg(p, "gemm")
    p = add("softmax", "row softmax vs CuPy ops and torch")
    dims(p, ("rows", "cols"))
    sweep_arg(p, "softmax")
    p = add("attention", "attention [B,H,S,D] (flash, naive) vs naive CuPy and torch SDPA")
    dims(p, ("B", "H", "Hkv", "Sq", "Sk", "D"))
    p.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned")
    sweep_arg(p, "attention")
    p = add("decode", "one-token decode over a KV cache (split-KV, unsplit, naive, paged with 16 / 1 / 256-token "
                      "pages; the opt-in split rule, staged page ids and HND pages)")
    dims(p, ("B", "H", "Hkv", "Sk", "D"), {"Sk": "cached length"})
    p.add_argument("--ragged", type=seed, metavar="SEED",
                   help="cached lengths 128 .. Sk per sequence, drawn from SEED (a continuous-batching step)")
    p.add_argument("--splits", type=cli_args.split_counts(DECODE_MAX_SPLITS), metavar="N[,N...]",
                   help=f"split-kv at these split counts (1 to {DECODE_MAX_SPLITS}, or auto: decode.choose_num_splits), "
                   "one case each; a case with a fixed count runs split-kv only (the count is split-kv's)")
    sweep_arg(p, "decode")
    p = add("varlen", "ragged packed batches: attention_varlen vs the dense kernel and torch SDPA on the padded batch")
    dims(p, ("B", "H", "Hkv", "D"))
    p.add_argument("--lo", type=pos, help="shortest sequence (lengths uniform in [lo, hi]; default 64)")
    p.add_argument("--hi", type=pos, help="longest sequence (default 4096)")
    p.add_argument("--seed-lens", type=seed, dest="seed_lens", help="seed of the lengths (NumPy default_rng; default 0)")
    p.add_argument("--causal", action="store_true", help="causal mask per sequence")
    p = add("paged", "chunked prefill over a paged KV cache vs the same keys contiguous and torch SDPA")
    dims(p, ("B", "H", "Hkv", "Sq", "Sk", "D"), {"Sk": "cached keys per sequence, the Sq new ones last"})
    p.add_argument("--page", type=cli_args.power_of_two(1, MAX_PAGE_SIZE),
                   help=f"tokens per page (a power of two, 1 to {MAX_PAGE_SIZE}; default 64)")
    p.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned")
    sweep_arg(p, "paged")
    mg.add_argument("--model", type=cli_args.model_list,
                    help="comma-separated: 'smollm2', a tinylm preset, 'families' (the shapes of "
                    "Llama 3.2-1B, Mistral-7B (4 layers), Qwen2.5-0.5B, Qwen3-0.6B, Gemma-2-2B, Gemma-3-1B, Phi-3-mini and "
                    "Phi-4-mini (4 layers), SmolLM3-3B and Granite-3.3-2B (8 layers)) "
                    "or a GGUF file's path (default: both smollm2 and --preset)")
    p = add("model", "tinylm end to end (TTFT, decode tok/s) vs HF transformers", (common, m))
    p = add("all", "default cases of every op (and model)", (common, m))
    p.add_argument("--with-sweeps", action="store_true", help="also run every predefined sweep")
    p.add_argument("--skip-model", action="store_true", help="leave out the model cases")
    p = sub.add_parser("compare", help="compare a results JSON with the newest earlier run on the same GPU model",
                       description="compare NEW.json with OLD.json (default: the newest earlier run on the same GPU "
                       "model in benchmarks/results/): ratio per case, flags for > 10% slower and max/min "
                       "spread > 1.5")
    p.add_argument("new", type=path, metavar="NEW.json")
    p.add_argument("old", type=path, metavar="OLD.json", nargs="?", default=None)
    p.add_argument("--results-dir", type=path, default=str(RESULTS_DIR), help=argparse.SUPPRESS)
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
            if a.model is not None:
                pairs = [(m, b) for m in a.model for b in batches or [1]]
            if serve:  # continuous batching at 8, 32 and 64 slots unless --batch says
                pairs = [(m, b) for m in dict.fromkeys(m for m, _ in pairs) for b in batches or SERVE_SLOTS]
            elif batches:
                pairs = list(dict.fromkeys((m, b) for m, _ in pairs for b in batches))
            cases = [specs.model_case(m, a.prompt_len, a.new_tokens, b, serve) for m, b in pairs]
        return cases

    batches = getattr(a, "batch", None) or []  # (a list of positive ints, or None: not given)

    if a.op == "all":
        out = []
        for op in ("gemm", "softmax", "attention", "decode", "varlen", "paged"):
            out += defaults(op)
        if a.with_sweeps:
            for name in specs.SWEEPS:
                out += specs.sweep_cases(name, "float16" if a.dtype is None else a.dtype)
        if not a.skip_model:
            out += defaults("model")
        return out
    if a.op == "model":
        return defaults("model")
    if getattr(a, "sweep", None):
        return specs.sweep_cases(a.sweep, "float16" if a.dtype is None else a.dtype)
    if a.op == "decode" and a.splits is not None:  # one case per split count (None: automatic)
        return [specs.cli_case("decode", argparse.Namespace(**{**vars(a), "splits": n})) for n in a.splits]
    one = specs.cli_case(a.op, a)
    return [one] if one is not None else defaults(a.op)


def requested_impls(op: str, impl_arg) -> list[str]:
    """The impls ``--impl`` names (a list, or None: all but the opt-in ones, cases.OPT_IN); a
    ValueError naming ``--impl`` for one ``op`` does not have (pure: no device)."""
    from . import cases

    known = cases.impl_names(op)
    names = [n for n in known if n not in cases.OPT_IN.get(op, ())] if impl_arg is None else list(impl_arg)
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"argument --impl: unknown impl {', '.join(bad)} for {op}; choose from {', '.join(known)}")
    return names


def select_impls(op: str, impl_arg, skip) -> list[str]:
    """Requested impls of ``op`` (:func:`requested_impls`), with missing peers skipped by ``skip``."""
    from . import peers

    names = requested_impls(op, impl_arg)
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
    ragged = case.op == "decode" and case.p.get("ragged") is not None
    if case.op == "model":
        from .serve_bench import SERVE_IMPLS

        if case.p.get("serve"):
            return [n for n in impls if n in SERVE_IMPLS + ("hf-transformers",)]
        return [n for n in impls if n not in SERVE_IMPLS]
    if case.op == "decode" and case.p.get("splits") is not None:
        return [n for n in impls if n == "split-kv"]
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
    a = _parser().parse_args(argv)  # (a bad flag: one line and exit 2, here)
    if a.op == "compare":
        from . import compare

        return compare.main(a, _prog())
    bad = cli_args.check_combinations(a)
    if bad:
        return cli_args.fail(f"{_prog()} {a.op}", bad)
    try:
        cases_ = plan(a)
        for op in dict.fromkeys(c.op for c in cases_):  # unknown --impl names, before the device
            requested_impls(op, a.impl if a.op != "all" else None)
    except ValueError as e:
        return cli_args.fail(f"{_prog()} {a.op}", str(e))

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

    impls = {op: select_impls(op, a.impl if a.op != "all" else None, log)
             for op in dict.fromkeys(c.op for c in cases_)}  # (names checked in main)
    import cupy

    from .gpu_guard import Guard

    cupy.random.seed(a.seed)
    a.check = not a.no_check
    a.model_reps = getattr(a, "model_reps", 1)
    a.model_dtype = getattr(a, "model_dtype", None)
    cupy.zeros(1)  # this process's CUDA context exists before the guard lists the GPU's processes
    meta = report.run_meta(argv, report.device_meta())
    guard = Guard(a.allow_shared, _pci_bus_id())
    refusal = guard.start()
    meta["gpu_guard"] = guard.meta
    if refusal:
        print(f"{_prog()}: {refusal}", file=sys.stderr)
        return 3
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
    late = guard.finish() and not guard.allow  # another process came while we timed
    if late:
        a.record = False
        log(f"{_prog()}: the GPU was shared during the run ({'; '.join(guard.meta['reasons'])}): the "
            "results below are marked shared and not recorded (--allow-shared records them)")
    print(report.format_table(records, ceilings))
    _outputs(a, argv, records, ceilings, meta, log)
    return 3 if late else 0


def _pci_bus_id() -> str | None:
    """The current device's PCI bus id (how NVML finds the same GPU whatever the device order)."""
    try:
        import cupy

        return cupy.cuda.Device().pci_bus_id
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
