"""CPU tier: the docs cannot drift from the code or the recorded results.

- the generated parts (the README's results table, docs/ran-where.md, the dispatch in docs/api.md)
  are current (benchmarks/docs.py);
- every signature a page shows in backticks equals the code's (``inspect.signature``);
- every subcommand, sweep and impl the benchmark CLI accepts is in docs/benchmarks.md's table,
  and every name there is one the CLI accepts;
- every timing and test count on a page stands beside the results file (or session folder) it
  comes from and is found there;
- "has not run on a GPU" and the like appear only where ran_where.py writes them.
"""
import inspect
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("ran-where.md", "options.md")  # written by code: their claims are the generators'
HISTORY = ("CHANGELOG.md",)  # dated entries: "at the time" statements are history, not status


def _pages(skip=()):
    return [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in skip]


def _prose(page: Path) -> str:
    """A page without the README's generated results table (its own test checks it)."""
    from benchmarks import readme_table as rt

    text = page.read_text()
    if rt.BEGIN in text:
        text = text[:text.index(rt.BEGIN)] + text[text.index(rt.END) + len(rt.END):]
    return text


def _paragraphs(text: str):
    return re.split(r"\n\s*\n", text)


# --- generated parts -------------------------------------------------------------------------------
def test_generated_parts_of_the_docs_are_current():
    """`python -m benchmarks.docs --write` would change nothing (ran-where.md reads test files at
    the recorded commits with git: a clone without them cannot regenerate it)."""
    from benchmarks import docs

    try:
        stale = docs.stale()
    except RuntimeError as e:
        pytest.skip(str(e))
    assert stale == [], f"{stale}: run python -m benchmarks.docs --write"


def test_ran_where_lists_every_options_row_and_reads_failures_by_file():
    from benchmarks import ran_where
    from cupyattn import options

    labels = [r[0] for r in ran_where.rows()]
    for entry, impls in options.ENTRY_IMPLS.items():
        for impl in impls:
            assert f"{entry} impl={impl!r}" in labels
    log = ("....F\n= FAILURES =\n___ test_a[x] ___\n\n    def test_a():\n>       assert 0\n"
           "tests/pkg/test_k.py:9: AssertionError\n"
           "___ test_b ___\ntests/helpers.py:3: in f\ntests/pkg/test_k.py:20: AssertionError\n"
           "= short test summary info =\n1 failed, 4 passed\n")
    assert ran_where.failures(log) == {"tests/pkg/test_k.py": ["test_a[x]"], "tests/helpers.py": ["test_b"]}
    k, m = "tests/pkg/test_k.py", "tests/pkg/test_m.py"
    argv = ["python3", "-m", "pytest", "-m", "gpu", "-q", "--ignore", m, "--junitxml", "x.xml"]
    assert ran_where._selected(argv, [k, m]) == [k]
    assert ran_where._selected(argv[:5] + [m], [k, m]) == [m]
    assert ran_where._selected(argv[:5] + ["-k", "x"], [k]) is None
    assert ran_where._selected(["python3", "-m", "pytest", k], [k]) is None


def test_ran_where_reads_sessions_of_the_flat_test_layout():
    """A session recorded before tests/ took folders names flat paths (``tests/test_serving.py``)
    and its commit holds the files there: both are read as today's files."""
    from benchmarks import ran_where

    assert ran_where.current_test_path("tests/test_serving.py") == "tests/cupyattn/test_varlen_paged.py"
    assert ran_where.current_test_path("tests/test_gguf.py") == "tests/tinylm/test_gguf.py"
    assert ran_where.current_test_path("tests/test_docs.py") == "tests/test_docs.py"  # project-wide: stayed
    assert ran_where.current_test_path("tests/test_gone.py") == "tests/test_gone.py"
    for old in ran_where.RENAMED_TESTS:
        assert (ROOT / ran_where.current_test_path(f"tests/{old}")).is_file(), old
    before = min(ran_where.sessions(), key=lambda s: s["date"])["commit"]  # recorded in the flat layout
    if _git_show(before, "tests/test_serving.py") is None:
        pytest.skip("no git history")
    text = ran_where._test_file_at(before, "tests/cupyattn/test_varlen_paged.py")
    assert text is not None and text == _git_show(before, "tests/test_serving.py")


def test_ran_where_names_the_kernels_changed_since_a_tests_run(tmp_path, monkeypatch):
    """A GPU-test result covers the kernel sources of its commit only: a kernel file those tests
    launch whose text differs now is named beside the result, one that does not is not."""
    from benchmarks import ran_where, settle

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("no git history")
    kernels = tmp_path / "kernels_cu"
    kernels.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", head, "kernels_cu/"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    for path in names:  # the kernels as committed at HEAD
        (tmp_path / path).write_text(_git_show(head, path))
    (kernels / "gemm.cu").write_text("// edited\n" + (kernels / "gemm.cu").read_text())
    monkeypatch.setattr(ran_where, "ROOT", tmp_path)
    monkeypatch.setattr(ran_where, "at_commit", lambda c, path: _git_show(head, path))
    assert ran_where.kernels_changed(head, ["tests/cupyattn/test_gemm.py"]) == ["gemm.cu"]
    assert ran_where.kernels_changed(head, ["tests/cupyattn/test_decode.py"]) == []
    assert "gemm.cu" in settle.COVER and ran_where.shared_changed(head) == []


def _git_show(commit, path):
    r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True)
    return r.stdout.decode(errors="replace") if r.returncode == 0 else None


# --- signatures ------------------------------------------------------------------------------------
SIGNATURE = re.compile(r"`((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^`()]*)\)`")


def _resolve(name: str):
    """The callable a page names: a public name of cupyattn or tinylm, or a dotted path from one."""
    import cupyattn
    import tinylm

    head, *rest = name.split(".")
    if head in ("cupyattn", "tinylm"):
        head, rest = (rest[0], rest[1:]) if rest else (None, [])
    roots = [m for m in (cupyattn, tinylm) if head in getattr(m, "__all__", ())]
    if not roots:
        return None
    obj = getattr(roots[0], head)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def test_every_signature_a_page_shows_is_the_codes():
    """`name(a, b, c)` in backticks (bare parameter names, shapes in brackets allowed, `...` for the
    rest) lists the function's parameters in order, all of them unless it ends with `...`."""
    bad, checked = [], 0
    for page in _pages():
        for m in SIGNATURE.finditer(page.read_text()):
            items = [a.strip() for a in re.sub(r"\[[^\]]*\]", "", m.group(2)).split(",") if a.strip()]
            if not items or not all(re.fullmatch(r"[A-Za-z_]\w*|\.\.\.|\*\*kw", a) for a in items):
                continue  # a call with values (an example), not a signature
            obj = _resolve(m.group(1))
            if obj is None or not callable(obj):
                continue
            params = [p for p in inspect.signature(obj).parameters if p != "self"]
            ok = items == params or (items[-1] == "..." and params[:len(items) - 1] == items[:-1])
            checked += 1
            if not ok:
                bad.append(f"{page.name}: {m.group(1)}({', '.join(items)}) but the code has ({', '.join(params)})")
    assert bad == [] and checked >= 20, bad


# --- the benchmark CLI's names -----------------------------------------------------------------------
def _table(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_benchmarks_doc_names_what_the_cli_accepts_and_nothing_else():
    from benchmarks import cases, peers, specs
    from benchmarks.__main__ import SUBCOMMANDS

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = _table(text, "| subcommand | ours | peers |")
    names = lambda cell: re.findall(r"`([\w.-]+)`", cell)  # noqa: E731
    doc_ops = [names(r[0])[0] for r in rows]
    assert doc_ops == list(SUBCOMMANDS)
    for r in rows:
        op = names(r[0])[0]
        if op not in specs.OPS:
            continue
        ours = set(cases.ours_names(op)) - set(cases.OPT_IN.get(op, ()))
        assert set(names(r[1])) == ours, op
        assert set(names(r[2])) == set(peers.PEERS[op]), op
        assert set(names(r[3])) == set(cases.OPT_IN.get(op, ())), op
        assert set(names(r[4])) == set(specs.sweeps_for(op)), op
    assert sorted(n for r in rows for n in names(r[4])) == sorted(specs.SWEEPS)
    usage = re.search(r"cupyattn-bench \{([\w,]+)\}", text).group(1).split(",")
    assert usage == [s for s in SUBCOMMANDS if s != "compare"] and "cupyattn-bench compare NEW.json" in text


# --- figures and counts ------------------------------------------------------------------------------
FIGURE = re.compile(r"(?<![\w.])((?:\d+(?:\.\d+)? / )*\d+(?:\.\d+)?) (ms|tokens/s|GB/s|TFLOP/s)\b")
MEASURED = {"ms": ("median_ms", "ttft_ms"), "tokens/s": ("decode_tok_s",), "GB/s": ("gbps",),
            "TFLOP/s": ("tflops",)}
COUNT = re.compile(r"\b(\d+) (passed|failed)\b")


def test_every_figure_names_its_results_file_and_is_in_it():
    """Each timing on a page (README prose included) stands in a paragraph naming a results JSON
    and equals, at the precision shown, a measured field of one of its records."""
    bad, checked = [], 0
    for page in _pages(skip=GENERATED):
        for para in _paragraphs(_prose(page)):
            figures = [(f, unit) for fs, unit in FIGURE.findall(para) for f in fs.split(" / ")]
            if not figures:
                continue
            files = re.findall(r"benchmarks/results/[\w./-]+\.json", para)
            if not files:
                bad.append(f"{page.name}: {figures} in a paragraph that names no results JSON")
                continue
            records = [r for f in files for r in json.loads((ROOT / f).read_text())["records"]]
            for f, unit in figures:
                digits = len(f.split(".")[1]) if "." in f else 0
                values = [r[k] for r in records for k in MEASURED[unit] if isinstance(r.get(k), (int, float))]
                checked += 1
                if not any(round(v, digits) == float(f) for v in values):
                    bad.append(f"{page.name}: {f} {unit} is in none of {files}")
    assert bad == [] and checked >= 20, bad


def test_every_test_count_names_its_session_and_is_in_its_logs():
    """"49 passed", "2 failed": the paragraph names the session folder whose logs say so."""
    bad, checked = [], 0
    for page in _pages(skip=GENERATED):
        for para in _paragraphs(_prose(page)):
            counts = COUNT.findall(para)
            if not counts:
                continue
            dirs = [d for d in re.findall(r"benchmarks/results/([\w.-]+)", para) if (ROOT / "benchmarks/results" / d).is_dir()]
            logs = "".join(p.read_text(errors="replace") for d in dirs
                           for p in (ROOT / "benchmarks/results" / d).iterdir() if p.suffix in (".log", ".txt", ".md"))
            for n, word in counts:
                checked += 1
                if not re.search(rf"\b{n} {word}\b", logs):
                    bad.append(f"{page.name}: '{n} {word}' is in no log of {dirs or 'a named session folder'}")
    assert bad == [] and checked >= 2, bad


# --- what has run on a GPU: only from the generator ---------------------------------------------------
NOT_RUN = re.compile(r"not (yet )?(been )?run on an? (GPU|H100|H200)|ha(s|ve)(n't| not) (yet )?(been )?run on|"
                     r"never (been )?run on an? GPU|not yet timed|yet to run on", re.I)
CLAIM = re.compile(r"\b(passed|failed|ran|correct|timed)\b[^.\n|]{0,40}?\bon an? (H100|H200|GPU)\b", re.I)


def _help_texts() -> list[tuple[str, str]]:
    import cupyattn
    import tinylm
    from benchmarks.__main__ import _parser
    from tinylm.__main__ import build_parser

    out = [("tinylm --help", build_parser().format_help())]
    bench = _parser()
    out.append(("benchmarks --help", bench.format_help()))
    (sub,) = [a for a in bench._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    out += [(f"benchmarks {name} --help", p.format_help()) for name, p in sub.choices.items()]
    for mod in (cupyattn, tinylm):
        for name in mod.__all__:
            obj = getattr(mod, name)
            out.append((f"{mod.__name__}.{name}", inspect.getdoc(obj) or ""))
            for attr, member in inspect.getmembers(obj, callable) if inspect.isclass(obj) else ():
                if not attr.startswith("_"):
                    out.append((f"{mod.__name__}.{name}.{attr}", inspect.getdoc(member) or ""))
    return out


def test_gpu_status_sentences_come_only_from_the_generated_table():
    """"Not yet run on a GPU" (and "passed on an H100" without a results file beside it) goes stale
    the day a GPU runs it: only docs/ran-where.md, generated from the logs, may say either; the
    help texts and public docstrings point to it instead."""
    bad = []
    for page in _pages(skip=GENERATED + HISTORY):
        for para in _paragraphs(_prose(page)):
            bad += [f"{page.name}: {m.group(0)!r}" for m in NOT_RUN.finditer(para)]
            if "benchmarks/results/" not in para and "ran-where.md" not in para:
                bad += [f"{page.name}: {m.group(0)!r} with no results file or ran-where.md" for m in CLAIM.finditer(para)]
    for where, text in _help_texts():
        bad += [f"{where}: {m.group(0)!r}" for m in NOT_RUN.finditer(text)]
    assert bad == []
