"""Records and their outputs: the fixed record schema, table, JSON/CSV, plots, --record files.

A run is ``{"schema", "meta", "ceilings", "records"}``; each record is one (case, impl) with
exactly the fields of :data:`FIELDS` (missing values are None). The same dict goes to --json and
to ``benchmarks/results/<date>-<gpu>.json``; CSV holds the records only.
"""
from __future__ import annotations

import csv
import datetime
import hashlib
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

SCHEMA = "cupyattn-bench/1"
ROOT = Path(__file__).resolve().parent.parent  # the checkout (for git); site-packages when installed
# --record's default: benchmarks/results/ of a checkout; installed (no results/ beside this
# file), ./cupyattn-results in the working directory, never inside site-packages
RESULTS_DIR = Path(__file__).resolve().parent / "results"
if not RESULTS_DIR.is_dir():
    RESULTS_DIR = Path("cupyattn-results")

# field -> type used to decode CSV text (JSON keeps native types)
FIELD_TYPES = {
    "op": str, "case": str, "impl": str, "kind": str, "shape": str, "dtype": str,
    "sweep": str, "group": str, "x": float, "status": str,
    "median_ms": float, "min_ms": float, "max_ms": float, "reps": int,
    "tflops": float, "gbps": float, "pct_ceiling": float, "bound": str, "peak_mb": float,
    "max_abs_err": float, "rel_err": float, "err_ref": str,
    "peer": str, "peer_ms": float, "speedup": float, "speedups": dict,
    "ttft_ms": float, "decode_tok_s": float, "prefill_tok_s": float, "note": str,
    "launches_per_step": int, "prefill_launches": int, "ms_per_step": float,
}
FIELDS = tuple(FIELD_TYPES)


def new_record(case, impl: str, kind: str) -> dict:
    """A record with every schema field; case fields filled, measurements None."""
    rec = dict.fromkeys(FIELDS)
    rec.update(op=case.op, case=case.name, impl=impl, kind=kind, shape=case.shape,
               dtype=case.dtype, sweep=case.sweep or None, group=case.group or None,
               x=case.x, status="ok", speedups={})
    return rec


def fill_timing(rec: dict, timing, flops, nbytes, ceilings: dict) -> dict:
    """Median/min/max, TFLOP/s, GB/s and % of the nearer measured ceiling."""
    from .specs import rates, roofline_pct

    rec.update(median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms,
               reps=timing.reps)
    rec["tflops"], rec["gbps"] = rates(flops, nbytes, timing.median_ms)
    rec["pct_ceiling"], bound = roofline_pct(rec["tflops"], rec["gbps"], ceilings)
    rec["bound"] = bound or None
    return rec


def add_speedups(records: list[dict], primary: tuple = ()) -> None:
    """For each `ours` record: time ratio over every peer of its case, and over our `naive`.

    ``speedups[name] = peer_ms / ours_ms`` (> 1: ours is faster). ``peer``/``peer_ms``/``speedup``
    name the first available of ``primary`` (else the first peer that ran).
    """
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    for recs in by_case.values():
        ok = {r["impl"]: r for r in recs if r["status"] == "ok" and r["median_ms"]}
        peers = [r for r in recs if r["kind"] == "peer" and r["impl"] in ok]
        for r in recs:
            if r["kind"] != "ours" or r["impl"] not in ok:
                continue
            others = peers + ([ok["naive"]] if "naive" in ok and r["impl"] != "naive" else [])
            r["speedups"] = {o["impl"]: o["median_ms"] / r["median_ms"] for o in others}
            chosen = next((ok[p] for p in primary if p in ok and ok[p]["kind"] == "peer"),
                          peers[0] if peers else None)
            if chosen is not None:
                r.update(peer=chosen["impl"], peer_ms=chosen["median_ms"],
                         speedup=chosen["median_ms"] / r["median_ms"])


# --- table ------------------------------------------------------------------------------------
def _f(v, fmt):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _num(v) -> str:
    """Rates: one decimal from 100 up, three significant digits below."""
    return "" if v is None else (f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}")


def table_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and text rows of the summary table (pure, unit-tested).

    A case's name is printed on its first row only; long statuses are cut to 60 characters.
    """
    head = ["case", "impl", "ms (min-max)", "TFLOP/s", "GB/s", "% ceil", "vs peers", "peak MB",
            "rel err", "status"]
    rows = []
    last_case = None
    for r in records:
        if r["op"] == "model" and r["status"] == "ok":
            ms = f"TTFT {_f(r['ttft_ms'], '.1f')} | {_f(r['decode_tok_s'], '.1f')} tok/s"
            if r.get("launches_per_step"):
                ms += f" | {r['launches_per_step']} kernels/step"
            if r.get("prefill_launches"):
                ms += f" | prefill {r['prefill_launches']} kernels"
            if r.get("ms_per_step"):
                ms += f" | {r['ms_per_step']:.3g} ms/step"
        elif r["median_ms"] is not None:
            ms = f"{r['median_ms']:.4g} ({r['min_ms']:.4g}-{r['max_ms']:.4g})"
        else:
            ms = ""
        vs = " ".join(f"{k} {v:.3g}x" for k, v in (r.get("speedups") or {}).items())
        pct = _f(r["pct_ceiling"], ".1f") + (f" {r['bound'][0]}" if r.get("bound") else "")
        peak = _f(r["peak_mb"], ".0f")
        status = r["status"] or ""
        rows.append(["" if r["case"] == last_case else r["case"], r["impl"], ms, _num(r["tflops"]),
                     _num(r["gbps"]), pct, vs, peak, _f(r["rel_err"], ".1e"),
                     status if len(status) <= 60 else status[:57] + "..."])
        last_case = r["case"]
    return head, rows


def format_table(records: list[dict], ceilings: dict | None = None) -> str:
    from tabulate import tabulate

    head, rows = table_rows(records)
    text = tabulate(rows, headers=head, tablefmt="simple", disable_numparse=True)
    if ceilings:
        text = (f"ceilings: copy {ceilings.get('copy_gbps', 0):.0f} GB/s, cuBLAS fp16 "
                f"{ceilings.get('gemm_tflops', 0):.1f} TFLOP/s  (% ceil: c=compute, m=memory)\n"
                + text)
    return text


# --- JSON / CSV ---------------------------------------------------------------------------------
def run_dict(meta: dict, ceilings: dict, records: list[dict]) -> dict:
    return {"schema": SCHEMA, "meta": meta, "ceilings": ceilings,
            "records": [{k: r.get(k) for k in FIELDS} for r in records]}


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


def write_json(path, run: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: (_clean(v) if k != "records" else [{f: _clean(x) for f, x in r.items()} for r in v])
             for k, v in run.items()}
    path.write_text(json.dumps(clean, indent=1, sort_keys=False) + "\n")
    return path


def read_json(path) -> dict:
    run = json.loads(Path(path).read_text())
    if run.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {run.get('schema')!r}, expected {SCHEMA!r}")
    return run


def _encode(v) -> str:
    if v is None:
        return ""
    if isinstance(v, dict):
        return ";".join(f"{k}={x!r}" for k, x in v.items())
    return repr(v) if isinstance(v, float) else str(v)


def _decode(text: str, typ):
    if text == "":
        return {} if typ is dict else None
    if typ is dict:
        return {k: float(x) for k, x in (kv.split("=", 1) for kv in text.split(";"))}
    return typ(text)


def write_csv(path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in records:
            w.writerow([_encode(r.get(k)) for k in FIELDS])
    return path


def read_csv(path) -> list[dict]:
    with Path(path).open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows or tuple(rows[0]) != FIELDS:
        raise ValueError(f"{path}: header does not match the record schema")
    return [{k: _decode(t, FIELD_TYPES[k]) for k, t in zip(FIELDS, row)} for row in rows[1:]]


# --- run metadata and --record ------------------------------------------------------------------
def combine_hashes(hashes: dict[str, str]) -> str:
    """sha256 of ``name + "\\n" + file sha256 + "\\n"`` over {name: file sha256} sorted by name:
    DESIGN.md's recipe for kernels_sha256."""
    return hashlib.sha256("".join(f"{n}\n{h}\n" for n, h in sorted(hashes.items())).encode()).hexdigest()


def _files_sha256(files) -> str:
    """:func:`combine_hashes` over (name, path) pairs."""
    return combine_hashes({name: hashlib.sha256(Path(path).read_bytes()).hexdigest() for name, path in files})


def _kernel_files(kernels_dir, prefix=""):
    root = Path(kernels_dir)
    return [(prefix + p.relative_to(root).as_posix(), p) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.relative_to(root).parts]


def kernels_sha256(kernels_dir) -> str:
    """Hash of the kernel sources, as DESIGN.md defines it.

    Every file under ``kernels_dir`` (recursive, relative POSIX paths, sorted) contributes
    ``path + "\\n" + sha256(bytes).hexdigest() + "\\n"``; the value is the sha256 of that text.
    Python bytecode caches (``__pycache__/``) are not sources and are left out, so the hash does
    not change with the interpreter that imported ``kernels_cu``.
    """
    return combine_hashes(kernel_file_hashes(kernels_dir))


def kernel_file_hashes(kernels_dir) -> dict[str, str]:
    """{relative POSIX path: sha256} of every kernel source file (kernels_sha256's parts)."""
    return {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in _kernel_files(kernels_dir)}


def dispatch_files(kernels_dir, package_dir):
    """(name, path) of every file that decides which kernel runs with which parameters: the kernel
    sources (named ``kernels_cu/<path>``) and the package's Python modules (``cupyattn/<file>``:
    config.py's tile tables and constants, the loader's options, the op modules that pick kernels
    and launch shapes; reference.py and the checks come along, which only makes the hash change
    more often than strictly needed, never less)."""
    pkg = Path(package_dir)
    return _kernel_files(kernels_dir, "kernels_cu/") + [(f"cupyattn/{p.name}", p) for p in pkg.glob("*.py")]


def dispatch_sha256(kernels_dir, package_dir) -> str:
    """kernels_sha256's recipe over :func:`dispatch_files`: two runs with the same value ran the
    same kernels with the same tiles, split rules and launch shapes."""
    return _files_sha256(dispatch_files(kernels_dir, package_dir))


def git_commit(root=ROOT) -> dict:
    """{'commit': sha or None, 'dirty': bool or None}.

    $CUPYATTN_GIT_COMMIT, when set, wins: the caller sets it from the checkout it copied to the
    GPU machine, whose copy may carry no .git or a stale one (the device tool's copy held the
    session's first commit, so git called a later commit's tree "dirty"). Else git; else None.
    """
    fallback = {"commit": os.environ.get("CUPYATTN_GIT_COMMIT") or None, "dirty": None}
    if fallback["commit"]:
        return fallback
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return fallback
        st = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                            text=True, timeout=10)
        return {"commit": sha.stdout.strip(), "dirty": bool(st.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return fallback


def _ver(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def device_meta() -> dict:
    """GPU name, driver/CUDA/NVRTC/CuPy versions of the current device (needs a device)."""
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    meta = {"gpu": name, "compute_capability": dev.compute_capability,
            "sm_count": props.get("multiProcessorCount"),
            "l2_bytes": props.get("l2CacheSize"), "memory_bytes": props.get("totalGlobalMem"),
            "driver": _ver(cupy.cuda.runtime.driverGetVersion()),
            "cuda_runtime": _ver(cupy.cuda.runtime.runtimeGetVersion()),
            "cupy": cupy.__version__}
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        meta["nvrtc"] = f"{major}.{minor}"
    except Exception:
        meta["nvrtc"] = None
    return meta


def run_meta(argv, device: dict | None = None) -> dict:
    import numpy

    import cupyattn
    from cupyattn._loader import KERNELS_DIR  # the sources the kernels were compiled from

    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "python -m benchmarks " + " ".join(argv),
            "python": platform.python_version(), "numpy": numpy.__version__,
            "kernels_sha256": kernels_sha256(KERNELS_DIR),
            "dispatch_sha256": dispatch_sha256(KERNELS_DIR, Path(cupyattn.__file__).parent)}
    meta.update(git_commit())
    from importlib import metadata

    for dist in ("torch", "transformers"):  # peers' versions, without importing them
        try:
            meta[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            meta[dist] = None
    meta.update(device or {})
    return meta


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def record_path(gpu: str, date: str, results_dir=RESULTS_DIR) -> Path:
    """``<date>-<gpu>.json``; a second run the same day gets ``-2``, ``-3``... (never overwrite)."""
    base = Path(results_dir) / f"{date}-{slug(gpu)}"
    path, n = base.with_suffix(".json"), 2
    while path.exists():
        path, n = Path(f"{base}-{n}.json"), n + 1
    return path


# --- plots ------------------------------------------------------------------------------------
def sweep_axis(records: list[dict]) -> tuple[str, str, str]:
    """(record key, axis label, ceiling key) a sweep is plotted on: TFLOP/s when some point is
    compute-bound, else GB/s (decode and softmax move bytes: their TFLOP/s sit near zero)."""
    if any(r.get("bound") == "compute" and r.get("tflops") is not None for r in records):
        return "tflops", "TFLOP/s", "gemm_tflops"
    return "gbps", "GB/s", "copy_gbps"


def plot_sweep(records: list[dict], ceilings: dict, path, title: str, xlabel: str) -> Path | None:
    """TFLOP/s or GB/s (sweep_axis) vs x, one subplot per group, one line per impl, ceiling dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    recs = [r for r in records if r["status"] == "ok" and r["x"] is not None]
    key, ylabel, ceil_key = sweep_axis(recs)
    ceil = ceilings.get(ceil_key)
    groups = list(dict.fromkeys(r["group"] for r in recs)) or [None]
    ncol = min(2, len(groups))
    nrow = -(-len(groups) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.2 * nrow), squeeze=False)
    for ax, g in zip(axes.flat, groups):
        sub = [r for r in recs if r["group"] == g]
        for impl in dict.fromkeys(r["impl"] for r in sub):
            pts = sorted((r["x"], r[key]) for r in sub if r["impl"] == impl and r[key] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        if ceil:
            ax.axhline(ceil, color="gray", linestyle="--",
                       label=f"measured ceiling {ceil:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title} {g or ''}".strip())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
