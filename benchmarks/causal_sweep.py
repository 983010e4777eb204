"""The Hopper attention decision run: every variant of kernels_cu/flash_attn_sm90.cu beside the
defaults and torch SDPA, in one process, then Nsight Compute on the headline case.

    python -m benchmarks.causal_sweep --out DIR [--quick] [--no-ncu]      (benchmarks/gpu_run.sh causal)

Cases (fp16 and bf16): B=4 H=32 S=4096 at D = 64, 128, 256, causal and not; GQA 32/8 (D=128);
attention_varlen over the same tokens (4 x 4096, D=128); ragged varlen (B=16, lengths 64..4096 of
benchmarks.specs' fixed seed, D=128); paged prefill (B=4, 1024 queries over 4096 cached keys in
pages of 64, H=32/8, D=128). Causal everywhere but the dense "full" rows.
Variants of the dense cases: ``default`` (impl=None), ``wgmma`` (the grid scheduler in v3's order, the
default), ``-sections`` (the traffic model's order, config.ATTN_SM90_ORDER), ``wgmma+persist``
(impl="wgmma" under the persistent scheduler, config.ATTN_SM90_DENSE_SCHEDULER), ``wgmma_persistent``,
the overlap switched where built (config.ATTN_SM90_OVERLAP), the 128 x 176 tile at D=128 without
causal (config.ATTN_SM90_WIDE_N), fixed section sizes at the headline case (config.ATTN_SM90_SECTION),
``flash_mma`` and ``torch-sdpa``. Each row: median ms of 10 reps (CUDA events, L2 flushed before
each), TFLOP/s, the relative error against SDPA's output, and for our dense rows the K/V traffic
model's DRAM bytes of that launch's order (cupyattn/kv_traffic.py) and the floor they give at the
measured copy bandwidth. Then ncu (--clock-control none) on the two fastest of ours and on the
default at fp16 D=128 causal: dram__bytes_read.sum, DRAM throughput %, tensor pipe active %, warp
stalls (no_instruction, barrier, long_scoreboard). Everything in one JSON ($OUT/causal-sweep.json)
and a table ($OUT/causal-sweep.txt). About 3 minutes on an H100 (NVRTC builds in parallel first).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HEADLINE = ("float16", 128, True)
# What ncu measures (the first of each tuple this ncu knows: `ncu --query-metrics` names the bases)
NCU_WANTED = (("dram__bytes_read.sum",),
              ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",),
              ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"),
              ("smsp__warp_issue_stalled_no_instruction_per_warp_active.pct",
               "smsp__average_warp_latency_issue_stalled_no_instruction.ratio"),
              ("smsp__warp_issue_stalled_barrier_per_warp_active.pct",
               "smsp__average_warp_latency_issue_stalled_barrier.ratio"),
              ("smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
               "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio"))
NCU_MINIMAL = ("dram__bytes_read.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")


def ncu_metrics(exe: str = "ncu") -> tuple:
    """The metrics of NCU_WANTED this ncu knows (its --query-metrics output); NCU_MINIMAL when the
    query fails."""
    try:
        res = subprocess.run([exe, "--query-metrics"], capture_output=True, text=True, timeout=60)
        known = {ln.split()[0] for ln in res.stdout.splitlines() if ln.strip() and "__" in ln.split()[0]}
    except (OSError, subprocess.TimeoutExpired):
        return NCU_MINIMAL
    got = tuple(next((m for m in alts if m.split(".")[0] in known), None) for alts in NCU_WANTED)
    return tuple(m for m in got if m) or NCU_MINIMAL


def cases(quick: bool):
    """(name, kind, dtype, params) of every case; ``quick``: tiny shapes (a smoke test of the script)."""
    s, b, h = (256, 1, 4) if quick else (4096, 4, 32)
    out = []
    for dt in ("float16", "bfloat16"):
        for d in (64, 128, 256):
            for causal in (True, False):
                out.append((f"dense D{d} {'causal' if causal else 'full'}", "dense", dt,
                            dict(B=b, H=h, Hkv=h, S=s, D=d, causal=causal)))
        out.append(("dense GQA D128 causal", "dense", dt, dict(B=b, H=h, Hkv=h // 4, S=s, D=128, causal=True)))
        out.append(("varlen same tokens D128 causal", "varlen", dt, dict(B=b, H=h, Hkv=h, S=s, D=128)))
    out.append(("varlen ragged D128 causal", "ragged", "float16", dict(B=4 if quick else 16, H=h, D=128,
                                                                      lo=64, hi=s)))
    out.append(("paged prefill D128 causal", "paged", "float16", dict(B=b, H=h, Hkv=h // 4, Sq=s // 4, L=s,
                                                                       D=128, page=64)))
    return out


def knobs(**kw):
    """config.ATTN_SM90_* set for the duration (the variants)."""
    from cupyattn import config

    return config.override(**kw)


def dense_variants(dt, d, causal, headline):
    """(name, impl, knobs) of the dense rows."""
    sec = {"ATTN_SM90_ORDER": "sections"}   # the traffic model's order (the default keeps v3's)
    v = [("default", None, {}), ("wgmma", "wgmma", {}), ("wgmma-sections", "wgmma", sec),
         ("wgmma+persist", "wgmma", {**sec, "ATTN_SM90_DENSE_SCHEDULER": "persistent"}),
         ("wgmma_persistent", "wgmma_persistent", {}), ("wgmma_persistent-sections", "wgmma_persistent", sec),
         ("flash_mma", "flash_mma", {})]
    if d == 128:
        v += [("wgmma-overlap-off", "wgmma", {"ATTN_SM90_OVERLAP": False}),
              ("wgmma-sections-overlap-off", "wgmma", {**sec, "ATTN_SM90_OVERLAP": False}),
              ("wgmma+persist-overlap-off", "wgmma", {**sec, "ATTN_SM90_DENSE_SCHEDULER": "persistent",
                                                       "ATTN_SM90_OVERLAP": False})]
        if not causal:
            v.append(("wgmma-wide176", "wgmma", {"ATTN_SM90_WIDE_N": True}))
    if d == 256:
        v.append(("wgmma_persistent-overlap-on", "wgmma_persistent", {"ATTN_SM90_OVERLAP": True}))
    if headline:
        v += [(f"wgmma-sec{n}", "wgmma", {**sec, "ATTN_SM90_SECTION": n}) for n in (4, 8, 32)]
    return v


def config_order() -> str:
    from cupyattn import config

    return config.ATTN_SM90_ORDER


def precompile():
    """Every instantiation of the kernel (and flash_mma's) through NVRTC on threads, into CuPy's disk
    cache, so the timed loop never waits for a build."""
    import cupy
    from concurrent.futures import ThreadPoolExecutor

    from cupyattn import flash_attn, flash_attn_sm90

    arch = "".join(map(str, cupy.cuda.Device().compute_capability))
    jobs = [(flash_attn_sm90.SPEC, e) for e in flash_attn_sm90.SPEC.name_expressions]
    jobs += [(flash_attn.SPEC, e) for e in flash_attn.SPEC.name_expressions if "flash_mma" in e]

    def build(job):
        spec, e = job
        try:
            cupy.RawModule(code=spec.code(), options=spec.options_for(arch), name_expressions=(e,)).compile()
            return None
        except Exception as ex:  # reported, the run goes on (that variant's row records the error)
            return f"{e}: {type(ex).__name__}: {str(ex)[:200]}"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        return [m for m in pool.map(build, jobs) if m]


def _rel(out, ref) -> float:
    import cupy

    a, b = out.astype(cupy.float32), ref.astype(cupy.float32)
    return float(cupy.linalg.norm(a - b) / max(float(cupy.linalg.norm(b)), 1e-30))


def run_case(name, kind, dt, p, ceil_gbps, rows, log, reps):
    import cupy
    import numpy as np

    import cupyattn
    from cupyattn import device, kv_traffic
    from cupyattn import flash_attn_sm90 as W

    from . import peers, specs, timing
    from .arrays import rand

    flusher = timing.L2Flusher()
    d = p["D"]

    def time_it(fn):
        return timing.time_fn(fn, warmup=2, reps=reps, budget_ms=400.0, flusher=flusher).median_ms

    def add(variant, fn, ref, flops, traffic=None, **extra):
        row = dict(case=name, kind=kind, dtype=dt, variant=variant, **p, **extra)
        try:
            out = fn()
            row["rel_err"] = None if ref is None else _rel(out, ref)
            row["ms"] = time_it(fn)
            row["tflops"] = flops / row["ms"] / 1e9
            if traffic is not None:
                row["model_kv_gb"] = traffic / 1e9
                row["model_floor_ms"] = traffic / (ceil_gbps * 1e6)
        except Exception as e:  # a variant that fails is a finding: recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        log(row)
        return row

    if kind == "dense":
        b, h, hkv, s, causal = p["B"], p["H"], p["Hkv"], p["S"], p["causal"]
        q = rand((b, h, s, d), dt)
        k, v = rand((b, hkv, s, d), dt), rand((b, hkv, s, d), dt)
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        ref = peer(log, lambda: peers.torch_sdpa(q, k, v, causal), lambda: cupyattn.attention(
            q, k, v, causal=causal, impl="flash_mma"), "torch-sdpa", add, flops)
        sms, l2 = device.sm_count(), device.l2_bytes()
        headline = (dt, d, causal) == HEADLINE and hkv == h
        for variant, impl, kw in dense_variants(dt, d, causal, headline):
            with knobs(**kw):
                traffic = None
                which = _default_impl(q, k, v, causal) if impl is None else impl
                if which in ("wgmma", "wgmma_persistent"):
                    sched = W.PERSIST if which == "wgmma_persistent" or kw.get("ATTN_SM90_DENSE_SCHEDULER") else W.GRID
                    t = W.tile_for(which, d, sched, causal)
                    dyn = causal or sched == W.GRID
                    sec = W.section(h, hkv, 2 * s * d * q.itemsize, dense=(b, s, s, d, q.itemsize, causal, t.block_n),
                                    policy="greedy" if dyn else "stride", grid=sched == W.GRID)
                    v3 = sched == W.GRID and config_order() == "v3"
                    order = {"order": "v3"} if v3 else {"section": sec}   # v3: the grid order measured on 2026-11-27
                    traffic = kv_traffic.dense_traffic(b, h, hkv, s, s, d, q.itemsize, causal, block_n=t.block_n,
                                                       sms=sms, l2_bytes=l2, policy="greedy" if dyn else "stride",
                                                       **order)["kv_read"]
                add(variant, lambda: cupyattn.attention(q, k, v, causal=causal, impl=impl), ref, flops, traffic)
    elif kind in ("varlen", "ragged"):
        h, hkv = p["H"], p.get("Hkv", p["H"])
        lens = [p["S"]] * p["B"] if kind == "varlen" else specs.varlen_lengths(p["B"], p["lo"], p["hi"], 0)
        cu = cupy.asarray(np.cumsum([0] + lens), dtype=cupy.int32)
        tot, mx = sum(lens), max(lens)
        q, k, v = (rand((tot, hh, d), dt) for hh in (h, hkv, hkv))
        flops = sum(2 * h * n * n * d for n in lens)
        pad = lambda x: cupy.stack([cupy.pad(x[int(cu[i]):int(cu[i + 1])], ((0, mx - n), (0, 0), (0, 0)))  # noqa: E731
                                    for i, n in enumerate(lens)]).transpose(0, 2, 1, 3)
        qp, kp, vp = (cupy.ascontiguousarray(pad(x)) for x in (q, k, v))
        refp = peer(log, lambda: peers.torch_sdpa(qp, kp, vp, True), lambda: cupyattn.attention(
            qp, kp, vp, causal=True, impl="flash_mma"), "torch-sdpa (padded)", add, flops)
        ref = cupy.concatenate([refp[i, :, :n].transpose(1, 0, 2) for i, n in enumerate(lens)])
        for variant, impl, kw in (("default", None, {}), ("wgmma_persistent", "wgmma_persistent", {}),
                                  ("wgmma_persistent-overlap-off", "wgmma_persistent", {"ATTN_SM90_OVERLAP": False}),
                                  ("flash_mma", "flash_mma", {})):
            with knobs(**kw):
                add(variant, lambda: cupyattn.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True, impl=impl),
                    ref, flops)
    elif kind == "paged":
        b, h, hkv, sq, L, page = p["B"], p["H"], p["Hkv"], p["Sq"], p["L"], p["page"]
        q = rand((b, h, sq, d), dt)
        k, v = rand((b, hkv, L, d), dt), rand((b, hkv, L, d), dt)
        n_pages = b * L // page
        perm = cupy.asarray(np.random.default_rng(0).permutation(n_pages).astype(np.int32))   # shuffled pages
        table = perm.reshape(b, L // page)
        kp = cupy.empty((n_pages, page, hkv, d), dtype=q.dtype)
        vp = cupy.empty_like(kp)
        kp[table.ravel()] = k.transpose(0, 2, 1, 3).reshape(b * L // page, page, hkv, d)
        vp[table.ravel()] = v.transpose(0, 2, 1, 3).reshape(b * L // page, page, hkv, d)
        lens = cupy.full((b,), L, dtype=cupy.int32)
        flops = sum(4 * h * d * (L - sq + i + 1) for i in range(sq)) * b
        ref = peer(log, lambda: peers.torch_sdpa(q, k, v, True), lambda: cupyattn.attention(
            q, k, v, causal=True, impl="flash_mma"), "torch-sdpa (contiguous)", add, flops)
        for variant, impl in (("default", None), ("wgmma_persistent", "wgmma_persistent"), ("flash_mma", "flash_mma")):
            add(variant, lambda: cupyattn.attention_paged(q, kp, vp, table, lens, causal=True, impl=impl), ref, flops)
    del flusher
    cupy.get_default_memory_pool().free_all_blocks()


def _default_impl(q, k, v, causal) -> str:
    """What impl=None of attention() runs for this call: the dispatch's own choice (options table,
    device, the launch checks), not a guess from the config tables."""
    from cupyattn import flash_attn

    return flash_attn._check_args(q, k, v, causal, None, None, None, None, False, None)[0]


def peer(log, make_sdpa, fallback, name, add, flops):
    """torch SDPA's row and output (the reference of the case's rows); without torch, flash_mma's
    output stands in as the reference (said once in the log)."""
    from . import peers

    try:
        sdpa = make_sdpa()
    except peers.PeerUnavailable as e:
        log(f"{name}: unavailable ({e}); flash_mma's output is the reference")
        return fallback()
    out = sdpa()
    add(name, sdpa, None, flops)
    return out


def _variant_call(variant: str):
    """A child of ncu: one headline-case call of ``variant`` (then a second, the one profiled)."""
    import cupyattn

    from .arrays import rand

    dt, d, causal = HEADLINE
    b, h, s = 4, 32, 4096
    q, k, v = (rand((b, h, s, d), dt) for _ in range(3))
    impl, kw = {name: (i, kv) for name, i, kv in dense_variants(dt, d, causal, True)}[variant]
    with knobs(**kw):
        for _ in range(2):
            cupyattn.attention(q, k, v, causal=causal, impl=impl)
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def ncu(variant: str, out_dir: str, metrics=NCU_MINIMAL, timeout=120) -> dict:
    """ncu's metrics of the second attention launch of ``variant`` at the headline case."""
    exe = "ncu"
    cmd = [exe, "--clock-control", "none", "--kernel-name", "regex:flash_attn|attention", "--launch-skip", "1",
           "--launch-count", "1", "--csv", "--page", "raw", "--metrics", ",".join(metrics),
           sys.executable, "-m", f"{__package__}.causal_sweep", "--one", variant]   # installed or checkout
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env=dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ".")))
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"variant": variant, "error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out_dir, f"ncu-{variant}.log"), "w") as f:
        f.write(res.stdout + "\n--- stderr\n" + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    if res.returncode != 0 or len(lines) < 2:
        if metrics != NCU_MINIMAL:
            return ncu(variant, out_dir, NCU_MINIMAL, timeout)
        return {"variant": variant, "error": f"ncu exit {res.returncode}: {res.stderr.strip()[-300:]}"}
    import csv

    head, *body = list(csv.reader(lines))
    vals = dict(zip(head, body[-1]))   # units row (if any) skipped: the last row is the kernel's
    got = {"variant": variant, "kernel": vals.get("Kernel Name", "")[:120]}
    for m in metrics:
        got[m] = vals.get(m)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.causal_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of the JSON, table and ncu logs")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test of this script")
    ap.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute step")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--one", help=argparse.SUPPRESS)   # the child ncu profiles
    a = ap.parse_args(argv)
    if a.one:
        _variant_call(a.one)
        return 0
    from . import report, timing

    timing.require_device()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    txt = open(os.path.join(a.out, "causal-sweep.txt"), "w")

    def log(row):
        if isinstance(row, str):
            line = row
        else:
            cols = [f"{row['case']:<32}", f"{row['dtype']:<9}", f"{row['variant']:<30}"]
            if "error" in row:
                cols.append("ERROR " + row["error"])
            else:
                if "ms" in row:
                    cols.append(f"{row['ms']:8.3f} ms {row.get('tflops', 0):6.0f} TF/s")
                if row.get("rel_err") is not None:
                    cols.append(f"err {row['rel_err']:.1e}")
                if "model_kv_gb" in row:
                    cols.append(f"model K/V {row['model_kv_gb']:.2f} GB floor {row['model_floor_ms']:.2f} ms")
            line = " ".join(cols)
        print(line, flush=True)
        txt.write(line + "\n")
        txt.flush()

    ceil = timing.measure_ceilings(copy_mib=1024, gemm_n=8192, reps=10)
    log(f"ceilings: {ceil}")
    errs = precompile()
    log(f"precompiled in {time.perf_counter() - t0:.0f} s; {len(errs)} failed" + "".join(f"\n  {e}" for e in errs))
    rows: list[dict] = []
    for name, kind, dt, p in cases(a.quick):
        run_case(name, kind, dt, p, ceil["copy_gbps"], rows, log, a.reps)
    log(f"timed in {time.perf_counter() - t0:.0f} s")
    profiles = []
    if not a.no_ncu and not a.quick:
        ours = [r for r in rows if r["case"] == "dense D128 causal" and r["dtype"] == HEADLINE[0] and "ms" in r
                and r["variant"] not in ("torch-sdpa", "flash_mma")]
        best = [r["variant"] for r in sorted(ours, key=lambda r: r["ms"])[:2]]
        metrics = ncu_metrics()
        log(f"ncu metrics: {', '.join(metrics)}")
        for variant in dict.fromkeys(best + ["default"]):
            profiles.append(ncu(variant, a.out, metrics))
            log(f"ncu {variant}: {json.dumps(profiles[-1])}")
    meta = report.run_meta(["causal_sweep"] + (argv or sys.argv[1:]))
    run = report.run_dict(meta, ceil, rows)
    run["ncu"] = profiles
    run["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out, "causal-sweep.json"), "w") as f:
        json.dump(run, f, indent=1, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    log(f"done in {run['seconds']} s -> {os.path.join(a.out, 'causal-sweep.json')}")
    txt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
