"""``python -m benchmarks compare NEW.json [OLD.json]``: a results JSON against the run before it.

For every (case, impl) timed in both runs: the ratio of the medians (new / old, above 1: slower)
and the new run's spread (max / min over its reps). A record is flagged when

- it is more than :data:`SLOWER` (10%) slower than in the old run (``slower``),
- its max / min over the timed reps is above :data:`SPREAD` (1.5) (``spread``: the reps do not
  agree with each other, so the median is not a measurement of the kernel alone),
- it is the default dispatch (impl ``ours``) and the explicit impl that runs the same kernel
  (:func:`twin`) took more than :data:`SPREAD` times as long or as short (``twin``), or
- the run shared its GPU with another process (``shared``: the idle-GPU guard's verdict,
  ``meta.gpu_guard``).

OLD defaults to the newest earlier run on the same GPU model (``meta.gpu``) among the recorded
runs (``benchmarks/results/*.json``), leaving out runs that shared their GPU. Where that model has
no such run (the first run on an H200 after H100 runs), OLD is the newest earlier run on a model
the new one should never be slower than (:func:`kin`: the same compute capability, SM count and L2,
and the new run's own measured ceilings, copy GB/s and GEMM TFLOP/s, at least
:data:`CEILING_FLOOR` of the old run's), so that "slower" still means a finding. The README's table
(readme_table.py) leaves out the cases this flags; ``gpu_run.sh`` prints the flags of each
recorded run before anything else.
"""
from __future__ import annotations

import json
from pathlib import Path

SLOWER = 1.10   # new / old median above this: flagged
SPREAD = 1.5    # max / min of a record's timed reps above this: flagged (also the twin rule's bound)
CEILING_FLOOR = 0.95  # kin(): the new run's ceilings at least this fraction of the old run's (their noise: ~2%)


def load(path) -> dict:
    """A results JSON (any schema version that has ``meta`` and ``records``)."""
    run = json.loads(Path(path).read_text())
    if not isinstance(run, dict) or "records" not in run or "meta" not in run:
        raise ValueError(f"{path}: not a benchmark results JSON (no meta / records)")
    return run


def shared(run: dict) -> bool:
    """Whether the run may have shared its GPU: the idle-GPU guard found another process, or did
    not check (``--allow-shared`` without NVML). False for runs recorded before the guard existed
    (their records are judged by the other flags alone)."""
    guard = run["meta"].get("gpu_guard")
    return guard is not None and guard.get("shared") is not False


def kin(new: dict, old: dict) -> bool:
    """Whether ``old`` ran on another GPU model that ``new``'s should never be slower than: the
    same compute capability, SM count and L2 size (the same die and cut, as an H200 and an H100
    SXM), and ``new``'s measured ceilings (copy GB/s, GEMM TFLOP/s) each at least CEILING_FLOOR of
    ``old``'s, so its memory and clocks are no slower. False where either lacks one of these."""
    nm, om = new["meta"], old["meta"]
    if nm.get("gpu") == om.get("gpu"):
        return False
    same = ("compute_capability", "sm_count", "l2_bytes")
    if any(nm.get(k) is None or nm.get(k) != om.get(k) for k in same):
        return False
    nc, oc = new.get("ceilings") or {}, old.get("ceilings") or {}
    return all(nc.get(k) and oc.get(k) and nc[k] >= CEILING_FLOOR * oc[k] for k in ("copy_gbps", "gemm_tflops"))


def baseline(new_path, results_dir) -> Path | None:
    """The newest run in ``results_dir`` (top level) that started before ``new_path``'s run, did
    not share its GPU and ran on the same GPU model; where there is none, the newest such run on a
    :func:`kin` model; None when there is neither."""
    new = load(new_path)
    gpu, date = new["meta"].get("gpu"), new["meta"].get("date_utc", "")
    best = {True: None, False: None}  # same model -> (date, path)
    for p in sorted(Path(results_dir).glob("*.json")):
        if p.resolve() == Path(new_path).resolve():
            continue
        try:
            run = load(p)
        except (ValueError, json.JSONDecodeError):
            continue
        d, same = run["meta"].get("date_utc", ""), run["meta"].get("gpu") == gpu
        if d >= date or shared(run) or not (same or kin(new, run)):
            continue
        if best[same] is None or d > best[same][0]:
            best[same] = (d, p)
    found = best[True] or best[False]
    return found[1] if found else None


def _timed(r) -> bool:
    return r.get("status") == "ok" and bool(r.get("median_ms"))


def spread(r) -> float | None:
    """max / min of a record's timed reps (None without both)."""
    lo, hi = r.get("min_ms"), r.get("max_ms")
    return hi / lo if lo and hi and lo > 0 else None


def twin(rec: dict, meta: dict) -> str | None:
    """The explicit impl that runs the same kernel as the default dispatch's record ``ours`` of a
    GEMM case, by cupyattn.gemm's rule (config.GEMM_SKINNY_MAX_M, config.GEMM_AUTO_WGMMA on
    sm_90, else mma for 16-bit types and simt for float32); None where there is no such pair."""
    if rec.get("op") != "gemm" or rec.get("impl") != "ours":
        return None
    import re

    import numpy as np

    from cupyattn import config

    m = re.search(r"M(\d+) N(\d+) K(\d+) (nt|nn)", rec.get("shape") or "")
    if m is None:
        return None
    M, N, K, layout = int(m[1]), int(m[2]), int(m[3]), m[4]
    if layout == "nt" and M <= config.GEMM_SKINNY_MAX_M:
        return "ours-skinny"
    if rec.get("dtype") == "float32":
        return "ours-simt"
    least = {np.dtype(k).name: v for k, v in config.GEMM_AUTO_WGMMA.items()}.get(rec.get("dtype"))
    if str(meta.get("compute_capability")) == "90" and least is not None and min(M, N, K) >= least:
        return "ours-wgmma"
    return "ours-mma"


def key(r) -> tuple:
    """What makes two records the same measurement: op, shape, dtype and impl (not the case's
    label: a sweep's point and a default case of the same shape are one problem)."""
    return r.get("op"), r.get("shape"), r.get("dtype"), r.get("impl")


def compare(new: dict, old: dict | None) -> list[dict]:
    """One row per timed record of ``new``: case, impl, old and new medians, ratio, spread, reps
    and ``flags`` (a list of short reasons; empty when clean)."""
    before = {key(r): r for r in (old or {}).get("records", []) if _timed(r)}
    by_case: dict[str, dict] = {}
    for r in new["records"]:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    rows = []
    for r in new["records"]:
        if not _timed(r):
            continue
        o = before.get(key(r))
        ratio = r["median_ms"] / o["median_ms"] if o else None
        sp = spread(r)
        flags = []
        if ratio is not None and ratio > SLOWER:
            flags.append(f"slower: {ratio:.2f}x the old median")
        if sp is not None and sp > SPREAD:
            flags.append(f"spread: max/min {sp:.2f} over {r.get('reps')} reps")
        t = by_case[r["case"]].get(twin(r, new["meta"]) or "")
        if t is not None and _timed(t):
            q = t["median_ms"] / r["median_ms"]
            if not 1 / SPREAD <= q <= SPREAD:
                flags.append(f"twin: {t['impl']} (the same kernel) took {q:.2f}x as long")
        if shared(new):
            flags.append("shared: the idle-GPU guard found the GPU shared, or could not check")
        rows.append({"case": r["case"], "impl": r["impl"], "kind": r.get("kind"), "old_ms": o["median_ms"] if o else None,
                     "new_ms": r["median_ms"], "ratio": ratio, "min_ms": r.get("min_ms"), "max_ms": r.get("max_ms"),
                     "reps": r.get("reps"), "spread": sp, "flags": flags})
    return rows


def flagged_cases(rows: list[dict]) -> dict[str, list[str]]:
    """case -> the flags of its records ("impl: reason"), for every case with at least one."""
    out: dict[str, list[str]] = {}
    for row in rows:
        for f in row["flags"]:
            out.setdefault(row["case"], []).append(f"{row['impl']}: {f}")
    return out


def _ms(v) -> str:
    return "" if v is None else f"{v:.4g}"


def report(new_path, old_path, rows: list[dict], new: dict, old: dict | None) -> str:
    """The text ``compare`` prints: the flags first, then every row."""
    from tabulate import tabulate

    nm = new["meta"]
    head = [f"new: {new_path} ({nm.get('gpu')}, {nm.get('date_utc')}, commit {(nm.get('commit') or '?')[:7]})"]
    if old is None:
        head.append("old: none (no earlier run on this GPU model or a kin one): spread and twin flags only")
    else:
        om = old["meta"]
        same = "same" if om.get("kernels_sha256") == nm.get("kernels_sha256") else "different"
        head.append(f"old: {old_path} ({om.get('date_utc')}, commit {(om.get('commit') or '?')[:7]}); "
                    f"kernel sources: {same} (kernels_sha256)")
        if om.get("gpu") != nm.get("gpu"):
            nc, oc = new.get("ceilings") or {}, old.get("ceilings") or {}
            ratios = ", ".join(f"{k} {nc[k] / oc[k]:.2f}x" for k in ("copy_gbps", "gemm_tflops") if nc.get(k) and oc.get(k))
            if kin(new, old):
                head.append(f"     another GPU model ({om.get('gpu')}) with the same compute capability, SMs and L2 and "
                            f"ceilings this run matches ({ratios} here): 'slower' is a finding; memory-bound cases "
                            f"should gain up to the copy ratio")
            else:
                head.append(f"     another GPU model ({om.get('gpu')}), not one this should match (ceilings {ratios} "
                            f"here, or another compute capability, SM count or L2): read the ratios as a comparison "
                            f"of two GPUs, not as findings")
    flagged = [r for r in rows if r["flags"]]
    lines = head + [f"flags: {len(flagged)} of {len(rows)} timed records"]
    lines += [f"  FLAG {r['case']} / {r['impl']}: {'; '.join(r['flags'])}" for r in flagged]
    table = [[r["case"], r["impl"], _ms(r["old_ms"]), _ms(r["new_ms"]),
              "" if r["ratio"] is None else f"{r['ratio']:.2f}",
              f"{_ms(r['min_ms'])}-{_ms(r['max_ms'])} ({r['reps']})", "" if r["spread"] is None else f"{r['spread']:.2f}",
              "FLAG" if r["flags"] else ""] for r in rows]
    lines += ["", tabulate(table, headers=["case", "impl", "old ms", "new ms", "new/old", "new min-max (reps)",
                                           "max/min", ""], tablefmt="simple", disable_numparse=True)]
    return "\n".join(lines)


def main(a, prog: str) -> int:
    """The ``compare`` subcommand (``a.new``, ``a.old``, ``a.results_dir``); exit 0 with or without
    flags (they are findings, printed first), 2 when a file cannot be read."""
    import sys

    try:
        new = load(a.new)
        old_path = a.old if a.old is not None else baseline(a.new, a.results_dir)
        old = load(old_path) if old_path is not None else None
    except (OSError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        print(f"{prog} compare: error: {e}", file=sys.stderr)
        return 2
    print(report(a.new, old_path, compare(new, old), new, old))
    return 0
