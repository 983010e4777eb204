"""What has run on a GPU, per path: generated from the recorded results and GPU-tier logs.

    python -m benchmarks.ran_where            # print docs/ran-where.md
    python -m benchmarks.ran_where --write    # rewrite it (python -m benchmarks.docs --write does too)

Two kinds of evidence, both read from ``benchmarks/results/``:

- **GPU tests**: a session folder's ``steps.log`` names each pytest step's command and log; the
  log's FAILURES section names what failed. A test file counts for a path when the step's command
  selected it (``-m gpu`` over tests/, minus ``--ignore``, or the files it names), the file existed
  at the session's commit and held the path's tests then (a pattern, read with ``git show``), and
  the step ended with pytest's own summary line (a step killed at its cap proves nothing).
- **Timed**: a results JSON record of one of the path's benchmark impls with status ``ok`` (timed,
  and checked against the float64 reference unless ``--no-check``).

A path with neither says so; that sentence is the only "not run on a GPU" the docs may carry
(tests/test_docs.py). The rows are the options table's (``cupyattn.options.ENTRY_IMPLS``) plus
the opt-in switches, the GEMM impls and tinylm's paths (:data:`EXTRA`).
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .report import RESULTS_DIR

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ran-where.md"
NEVER = "not run on a GPU"

# options-table row (entry point, impl) -> GPU test files (file, pattern the file held at the run's
# commit: the path's tests existed) and benchmark impls (op, impl) that run it by name
ENTRY_EVIDENCE = {
    ("attention", "flash"): ((("tests/cupyattn/test_attention.py", r'"flash"'),), (("attention", "flash"),)),
    ("attention", "flash_mma"): ((("tests/cupyattn/test_attention.py", r'"flash_mma"'),), (("attention", "flash_mma"),)),
    ("attention", "naive"): ((("tests/cupyattn/test_attention.py", r'"naive"'),), (("attention", "naive"),)),
    ("attention", "wgmma"): ((("tests/cupyattn/test_attention_wgmma.py", r"wgmma"),), (("attention", "wgmma"),)),
    ("attention", "wgmma_persistent"): ((("tests/cupyattn/test_attention_wgmma_persistent.py", r"attention\("),),
                                        (("attention", "wgmma_persistent"), ("paged", "contiguous-wgmma"))),
    ("attention_varlen", "flash"): ((("tests/cupyattn/test_varlen_paged.py", r"attention_varlen"),), ()),
    ("attention_varlen", "flash_mma"): ((("tests/cupyattn/test_varlen_paged.py", r"attention_varlen"),), ()),
    ("attention_varlen", "wgmma_persistent"): (
        (("tests/cupyattn/test_attention_wgmma_persistent.py", r"attention_varlen"),),
        (("attention", "varlen-wgmma"), ("varlen", "varlen-wgmma"))),
    ("attention_paged", "flash"): ((("tests/cupyattn/test_varlen_paged.py", r"attention_paged"),), ()),
    ("attention_paged", "flash_mma"): ((("tests/cupyattn/test_varlen_paged.py", r"attention_paged"),), ()),
    ("attention_paged", "wgmma_persistent"): (
        (("tests/cupyattn/test_attention_wgmma_persistent.py", r"attention_paged"),),
        (("paged", "paged-wgmma"),)),
    ("decode_attention", "simt"): ((("tests/cupyattn/test_decode.py", r'"simt"'),), ()),
    ("decode_attention", "mma"): ((("tests/cupyattn/test_decode.py", r'"mma"'),), ()),
    ("decode_attention_paged", "simt"): ((("tests/cupyattn/test_varlen_paged.py", r"decode_attention_paged"),), ()),
    ("decode_attention_paged", "mma"): ((("tests/cupyattn/test_varlen_paged.py", r"decode_attention_paged"),), ()),
}
_PAGED = ("paged-16", "paged-1", "paged-256")
# further paths: (label, GPU test files with patterns, benchmark impls)
EXTRA = (
    ("decode_attention, impl='auto', the automatic split count",
     (("tests/cupyattn/test_decode.py", r"decode_attention"),),
     (("decode", "split-kv"), ("decode", "unsplit"))),
    ('decode_attention split_rule="waves"', (("tests/cupyattn/test_decode.py", r"waves"),),
     (("decode", "split-kv-waves"),)),
    ("decode_attention fused_combine=True", (("tests/cupyattn/test_fused_decode.py", r"fused_combine"),), ()),
    ("decode_attention_paged, NHD pages (the default)",
     (("tests/cupyattn/test_varlen_paged.py", r"decode_attention_paged"),),
     tuple(("decode", i) for i in _PAGED)),
    ("decode_attention_paged, staged page ids (config.DECODE_PAGE_STAGING)",
     (("tests/cupyattn/test_varlen_paged.py", r"stag"),),
     tuple(("decode", i.replace("paged", "paged-staged")) for i in _PAGED)),
    ('decode_attention_paged layout="HND"', (("tests/cupyattn/test_varlen_paged.py", r"HND"),),
     tuple(("decode", i.replace("paged", "paged-hnd")) for i in _PAGED)),
    ('decode_attention_paged layout="HND", split_rule="waves"', (("tests/cupyattn/test_varlen_paged.py", r"waves"),),
     (("decode", "paged-hnd-waves-16"),)),
    ('gemm impl="auto"', (("tests/cupyattn/test_gemm.py", r"gemm_nt"),), (("gemm", "ours"),)),
    *((f'gemm impl="{i}"', (("tests/cupyattn/test_gemm.py", rf'"{i}"'),), (("gemm", f"ours-{i}"),))
      for i in ("simt", "mma", "skinny", "wgmma")),
    ("softmax", (("tests/cupyattn/test_softmax.py", r"softmax"),), (("softmax", "ours"),)),
    ("layers (rmsnorm, add_rmsnorm, rope, swiglu, add, embedding)", (("tests/cupyattn/test_layers.py", r"rmsnorm"),), ()),
    ("sample (device sampling)", (("tests/cupyattn/test_fused_ops.py", r"sample"),), ()),
    ("tinylm cupy backend, CUDA graphs", (("tests/tinylm/test_cupy_backend.py", r"def test_"),), (("model", "tinylm"),)),
    ("tinylm cupy backend, eager", (("tests/tinylm/test_cupy_backend.py", r"graphs=False|no-graph"),),
     (("model", "tinylm-eager"),)),
    ("tinylm fused decode step and prefill", (("tests/cupyattn/test_fused_decode.py", r"fused_greedy"),),
     (("model", "tinylm-fused"),)),
    ("tinylm fused step with PDL (config.FUSED_DECODE_PDL)", (("tests/cupyattn/test_fused_decode.py", r"pdl"),
                                                              ("tests/tinylm/test_megakernel_tinylm.py", r"fused-pdl")),
     (("model", "tinylm-fused-pdl"),)),
    ("tinylm megakernel (--megakernel)", (("tests/cupyattn/test_megakernel.py", r"def test_gpu"),
                                          ("tests/tinylm/test_megakernel_tinylm.py", r"def test_gpu")),
     (("model", "tinylm-mega"),)),
    ("tinylm continuous batching (--max-batch)", (("tests/tinylm/test_continuous_batching.py", r"mark\.gpu"),),
     (("model", "tinylm-serve"),)),
    ("tinylm continuous batching, opt-in decode paths", (), (("model", "tinylm-serve-opt-in"),)),
)


# tests/ was one flat folder until it took a folder per package (tests/cupyattn, tests/tinylm,
# tests/emu, tests/benchmarks); these files were renamed then (old name -> new). A session recorded
# before names the flat paths in its commands and failures, and its commit holds the files there:
# :func:`current_test_path` reads such a path as today's, :func:`_test_file_at` reads today's at an
# older commit by its flat path.
RENAMED_TESTS = {
    "test_serving.py": "test_varlen_paged.py", "test_properties.py": "test_ops_on_random_shapes.py",
    "test_emu_long_launches.py": "test_persistent_long_launches.py", "test_tinylm.py": "test_numpy_backend.py",
    "test_tinylm_gpu.py": "test_cupy_backend.py", "test_benchmarks.py": "test_bench_cli.py",
    "test_closeness.py": "test_assert_close.py", "test_emulator.py": "test_emu_checks.py",
    "test_emulator_sm90.py": "test_emu_checks_sm90.py",
}


def current_test_path(path: str) -> str:
    """``tests/test_<x>.py`` of a flat-layout session as the test file is now (test file names are
    unique across tests/'s folders); any other path as it is."""
    if not re.fullmatch(r"tests/test_\w+\.py", path) or (ROOT / path).is_file():
        return path
    name = RENAMED_TESTS.get(Path(path).name, Path(path).name)
    found = [p for p in (ROOT / "tests" / name, *(ROOT / "tests").glob(f"*/{name}")) if p.is_file()]
    return found[0].relative_to(ROOT).as_posix() if len(found) == 1 else path


def _test_file_at(commit: str, path: str) -> str | None:
    """Test file ``path``'s text at ``commit``: at its flat path for a commit before the folders."""
    text = at_commit(commit, path)
    name = Path(path).name
    flat = "tests/" + next((old for old, new in RENAMED_TESTS.items() if new == name), name)
    return at_commit(commit, flat) if text is None and path.startswith("tests/") and flat != path else text


def rows() -> list[tuple[str, tuple, tuple]]:
    """(label, GPU test files with patterns, benchmark impls) per path: the options table's
    (entry point, impl) rows first, then :data:`EXTRA`."""
    from cupyattn import options

    out = []
    for entry, impls in options.ENTRY_IMPLS.items():
        for impl in impls:
            files, timed = ENTRY_EVIDENCE.get((entry, impl), ((), ()))
            out.append((f"{entry} impl={impl!r}", files, timed))
    return out + [tuple(r) for r in EXTRA]


# --- sessions and their GPU-tier steps ------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def at_commit(commit: str, path: str) -> str | None:
    """``path``'s text at ``commit`` (git), None where it did not exist. RuntimeError when git
    cannot read the commit (a shallow clone): the page cannot be generated there."""
    r = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"git cannot read commit {commit} (a shallow clone?)")
    r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True)
    return r.stdout.decode(errors="replace") if r.returncode == 0 else None


def failures(log_text: str) -> dict[str, list[str]]:
    """test file -> names of its failed tests, from pytest's FAILURES section (each failure's
    header line, then the first ``tests/<file>.py:<line>:`` location under it)."""
    out: dict[str, list[str]] = {}
    if "= FAILURES =" not in log_text:
        return out
    body = log_text.split("= FAILURES =", 1)[1].split("short test summary info", 1)[0]
    parts = re.split(r"\n_{3,} (\S.*?) _{3,}\n", "\n" + body)
    for name, text in zip(parts[1::2], parts[2::2]):
        m = re.search(r"^(tests/[\w/]+\.py):\d+: ", text, re.M)
        out.setdefault(m.group(1) if m else "?", []).append(name)
    return out


def _selected(argv: list[str], files: list[str]) -> list[str]:
    """The test files a ``pytest -m gpu`` command line selects among ``files`` (None: not a GPU
    tier command, or filtered by -k / ::node ids we cannot follow)."""
    if not any(argv[i:i + 2] == ["-m", "gpu"] for i in range(len(argv))) or "-k" in argv:
        return None
    if any("::" in a for a in argv):
        return None
    ignored = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--ignore"}
    named = [a for i, a in enumerate(argv) if a.startswith("tests/") and a.endswith(".py") and argv[i - 1] != "--ignore"]
    base = named if named else files
    return [f for f in base if f not in ignored]


def sessions(results_dir=RESULTS_DIR) -> list[dict]:
    """Every session folder with a steps.log: its commit, date, GPU and GPU-test steps (command,
    log, exit, whether pytest finished, failures by file)."""
    out = []
    for d in sorted(p for p in Path(results_dir).iterdir() if p.is_dir() and (p / "steps.log").is_file()):
        text = "".join(f.read_text() for f in sorted(d.glob("summary*.txt")))
        commit = re.search(r"^commit: (\S+)", text, re.M)
        date = re.search(r"^summary written: (\S+)", text, re.M)
        env = (d / "env.txt").read_text() if (d / "env.txt").is_file() else ""
        gpu = re.search(r"(NVIDIA [^|]*?)\s{2,}", env)
        steps, cmds = [], {}
        for line in (d / "steps.log").read_text().splitlines():
            m = re.match(r"=== (.+?): exit (\d+) after \d+ s.*\(log: (.+)\)$", line)
            if m and m.group(1) in cmds and (d / Path(m.group(3)).name).is_file():
                log = d / Path(m.group(3)).name
                ltext = log.read_text(errors="replace")
                finished = re.search(r"^=*\s*\d+ (passed|failed)", ltext.splitlines()[-1] if ltext.strip() else "")
                argv = [current_test_path(a) if a.startswith("tests/") else a for a in cmds[m.group(1)]]
                steps.append({"step": m.group(1), "argv": argv, "log": log, "exit": int(m.group(2)),
                              "finished": bool(finished),
                              "failures": {current_test_path(f): n for f, n in failures(ltext).items()}})
                continue
            m = re.match(r"=== (.+?): (\S+ -m pytest .*)$", line)
            if m:
                cmds[m.group(1)] = shlex.split(re.sub(r" \(cap \d+ s\)$", "", m.group(2)))
        if commit and steps:
            out.append({"dir": d, "commit": commit.group(1), "date": (date.group(1) if date else "")[:10],
                        "gpu": gpu.group(1).strip() if gpu else "a GPU", "steps": steps})
    return out


def timed_runs(results_dir=RESULTS_DIR) -> list[dict]:
    """Every results JSON (recorded runs and session folders) with meta and records."""
    out = []
    for p in sorted(Path(results_dir).rglob("*.json")):
        try:
            run = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(run, dict) and "records" in run and "meta" in run:
            out.append({"path": p, "meta": run["meta"], "records": run["records"]})
    return out


# --- evidence per path ----------------------------------------------------------------------------
def _rel(p: Path) -> str:
    return p.resolve().relative_to(ROOT).as_posix()


def test_evidence(files, sess: list[dict]) -> str:
    """The newest session whose GPU-test steps ran ``files`` (with their patterns), with every
    failure in those files, as a table cell."""
    if not files:
        return "no GPU tests"
    for s in sorted(sess, key=lambda s: s["date"], reverse=True):
        hits, failed, logs = set(), [], []
        for st in s["steps"]:
            chosen = _selected(st["argv"], sorted({f for f, _ in files} | set(st["failures"])))
            ran = [f for f, pat in files if st["finished"] and chosen and f in chosen
                   and re.search(pat, _test_file_at(s["commit"], f) or "(?!)") is not None]
            if ran:
                hits.update(ran)
                failed += [n for f in ran for n in st["failures"].get(f, [])]
                logs.append(f"`{_rel(st['log'])}`")
        if hits:
            result = f"**{len(failed)} failed**: {', '.join(failed)}" if failed else "passed"
            changed = kernels_changed(s["commit"], hits)
            since = f"; since then changed: {', '.join(f'`{k}`' for k in changed)}" if changed else ""
            return f"{s['date']}, {s['gpu']}, {s['commit'][:7]}: {result} ({', '.join(logs)}){since}"
    return NEVER


def _kernel_text_now(name: str) -> str | None:
    p = ROOT / "kernels_cu" / name
    return p.read_text(errors="replace") if p.is_file() else None


def kernels_changed(commit: str, test_files) -> list[str]:
    """The kernels_cu/ files (benchmarks.settle.COVER: the kernels those GPU test files launch) whose
    text differs between ``commit`` and the working tree, or that exist in only one of them: a
    result of that commit's tests says nothing about what changed. Headers every kernel includes
    are listed once on the page (:func:`shared_changed`), not per path."""
    from .settle import COVER, SHARED

    tests = set(test_files)
    names = sorted(k for k, cover in COVER.items() if cover != SHARED and tests & set(cover[0]))
    names += sorted(n for n in _kernel_files(commit) if n.endswith(".cu") and n not in COVER)  # new or removed files
    return [n for n in dict.fromkeys(names) if at_commit(commit, f"kernels_cu/{n}") != _kernel_text_now(n)]


def _kernel_files(commit: str) -> set[str]:
    """kernels_cu/ file names at ``commit`` and in the working tree."""
    r = subprocess.run(["git", "ls-tree", "--name-only", commit, "kernels_cu/"], cwd=ROOT, capture_output=True, text=True)
    then = {Path(x).name for x in r.stdout.split()}
    return then | {p.name for p in (ROOT / "kernels_cu").iterdir() if p.is_file()}


def shared_changed(commit: str) -> list[str]:
    """Headers every kernel includes (settle.COVER's shared ones) changed since ``commit``."""
    from .settle import COVER, SHARED

    return [k for k, cover in COVER.items() if cover == SHARED and k.endswith(".cuh")
            and at_commit(commit, f"kernels_cu/{k}") != _kernel_text_now(k)]


def timing_evidence(pairs, runs: list[dict]) -> str:
    """The newest results JSON with an ``ok`` record of one of ``pairs``, as a table cell."""
    if not pairs:
        return "no benchmark impl"
    for run in sorted(runs, key=lambda r: r["meta"].get("date_utc", ""), reverse=True):
        ok = sorted({r["impl"] for r in run["records"] if (r.get("op"), r.get("impl")) in set(pairs)
                     and r.get("status") == "ok" and r.get("median_ms")})
        if ok:
            m = run["meta"]
            return (f"{m.get('date_utc', '')[:10]}, {m.get('gpu')}, {(m.get('commit') or '?')[:7]}: "
                    f"{', '.join(ok)} (`{_rel(run['path'])}`)")
    return "not timed on a GPU"


def families(runs: list[dict]) -> list[str]:
    """Markdown rows: per GPU family (config.GPU_FAMILIES), the GPUs of that compute capability
    that recorded runs used, with the newest run's date and file."""
    from cupyattn.config import GPU_FAMILIES

    out = []
    for cc, fam in GPU_FAMILIES.items():
        seen = {}
        for run in sorted(runs, key=lambda r: r["meta"].get("date_utc", "")):
            if str(run["meta"].get("compute_capability")) == str(cc):
                seen[run["meta"].get("gpu")] = run
        cell = "; ".join(f"{gpu}, newest {r['meta'].get('date_utc', '')[:10]} (`{_rel(r['path'])}`)"
                         for gpu, r in seen.items()) or f"{NEVER} of this family"
        out.append(f"| sm_{cc} {fam.name} | {cell} |")
    return out


def markdown(results_dir=RESULTS_DIR) -> str:
    sess, runs = sessions(results_dir), timed_runs(results_dir)
    lines = ["# Where each path has run on a GPU", "",
             "Generated by `python -m benchmarks.ran_where --write` from the GPU-test logs and results JSONs in",
             "`benchmarks/results/` (do not edit; tests/test_docs.py checks it is current). Per path: the newest",
             "GPU session whose GPU-test step ran its tests, with their result at that commit, and the newest",
             "recorded benchmark that timed it. \"Since then changed\" names the kernels_cu/ files those tests launch",
             "whose source differs from that session's commit: its result does not cover them. The CPU emulator's",
             "runs are not listed: they are not GPU runs.", "",
             "## Paths", "", "| path | GPU tests (newest run) | timed (newest run) |", "|---|---|---|"]
    for label, files, pairs in rows():
        lines.append(f"| `{label}` | {test_evidence(files, sess)} | {timing_evidence(pairs, runs)} |")
    if sess:
        newest = max(sess, key=lambda s: s["date"])
        shared = shared_changed(newest["commit"])
        if shared:
            lines += ["", f"Headers every kernel includes changed since the newest session ({newest['date']}, "
                      f"{newest['commit'][:7]}): {', '.join(f'`{k}`' for k in shared)}; every path's kernel source "
                      "differs from what that session ran, by those at least."]
    lines += ["", "## GPU families", "", "Recorded benchmark runs by the compute capability of their GPU.", "",
              "| family | GPUs (newest recorded run) |", "|---|---|", *families(runs)]
    lines += ["", "GPU sessions read: " + "; ".join(
        f"`{_rel(s['dir'])}` ({s['gpu']}, {s['date']}, commit {s['commit'][:7]}: "
        + ", ".join(f"{st['step']} exit {st['exit']}" for st in s["steps"]) + ")" for s in sess) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ran_where", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {_rel(PAGE)}")
    a = ap.parse_args(argv)
    text = markdown()
    if a.write:
        PAGE.write_text(text)
        print(f"wrote {PAGE}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
