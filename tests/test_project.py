"""CPU tier: project wiring that users and CI depend on."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) >= 2, "README must start with the install+run and the test commands"
    ci_lines = [l.strip() for l in (ROOT / ".ci/run").read_text().splitlines()]
    assert commands[1].strip() in ci_lines
    assert "tinylm" in commands[0]


def test_install_has_project_specific_names(tmp_path):
    """Run setuptools on a copy of the package sources as pip does for a wheel (``build_py``
    copies packages and package data into the install tree, ``egg_info`` writes the entry points;
    only setuptools is needed, no network), then use that tree from a directory holding decoy
    ``benchmarks/`` and ``kernels_cu/`` folders: its top-level names are cupyattn, tinylm and
    cupyattn_benchmarks only; every kernel source and header of the checkout is in
    cupyattn/kernels_cu/, where the loader finds it; every benchmark module is in
    cupyattn_benchmarks; the cupyattn-bench entry point and ``python -m cupyattn_benchmarks`` run.
    (Checked by hand too: pip install of the wheel and pip install -e into fresh venvs.)"""
    import os
    import shutil
    import subprocess
    import sys

    import pytest

    pytest.importorskip("setuptools")
    src, site, meta = tmp_path / "src", tmp_path / "site", tmp_path / "meta"
    skip = shutil.ignore_patterns("__pycache__", "results", "*.egg-info", "build")
    for d in ("cupyattn", "kernels_cu", "tinylm", "benchmarks"):
        shutil.copytree(ROOT / d, src / d, ignore=skip)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    meta.mkdir()
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", "from setuptools import setup; setup()", "-q",
                        "egg_info", "--egg-base", str(meta), "build_py", "--build-lib", str(site)],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in site.iterdir()) == ["cupyattn", "cupyattn_benchmarks", "tinylm"]
    kernels = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sorted(p.name for p in (site / "cupyattn" / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")) == kernels
    bench = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert sorted(p.name for p in (site / "cupyattn_benchmarks").glob("*.py")) == bench
    entry = (meta / "cupyattn.egg-info" / "entry_points.txt").read_text()
    assert "cupyattn-bench = cupyattn_benchmarks.__main__:main" in entry and "tinylm = tinylm.__main__:main" in entry

    decoy = tmp_path / "work"
    (decoy / "benchmarks").mkdir(parents=True)
    (decoy / "benchmarks" / "__main__.py").write_text("raise SystemExit('the decoy ran')\n")
    (decoy / "kernels_cu").mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import sys, cupyattn._loader as L, cupyattn_benchmarks.__main__ as B; "
            "print(L.KERNELS_DIR); print(len(L.inline_source((L.KERNELS_DIR / 'sampling.cu').read_text())) > 0); "
            "sys.argv = ['cupyattn-bench', '--help']; B.main()")
    r = subprocess.run([sys.executable, "-c", code], cwd=decoy, env=env, capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == str(site / "cupyattn" / "kernels_cu") and lines[1] == "True", r.stderr
    assert lines[2].startswith("usage: cupyattn-bench "), r.stdout
    r = subprocess.run([sys.executable, "-m", "cupyattn_benchmarks", "--help"], cwd=decoy, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m cupyattn_benchmarks "), r.stderr


def test_benchmarks_import_each_other_relatively():
    """The benchmark package is installed as cupyattn_benchmarks: no module may import itself or
    a sibling by the checkout's name ``benchmarks`` (nor run ``-m benchmarks.x`` in a subprocess)."""
    for f in (ROOT / "benchmarks").glob("*.py"):
        text = f.read_text()
        assert not re.search(r"^\s*(from|import)\s+benchmarks\b", text, re.M), f.name
        assert '"-m", "benchmarks' not in text, f.name


def test_no_generated_files_in_git_and_build_outputs_ignored():
    """Nothing that pip, pytest or the benchmarks generate is committed, and .gitignore keeps the
    outputs of the README's commands out of `git status`."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    generated = [f for f in tracked if ".egg-info/" in f or f.startswith(("build/", "dist/"))
                 or "__pycache__/" in f or f.endswith(".pyc") or f.startswith((".pytest_cache/", ".hypothesis/"))]
    assert generated == []
    outputs = ["build/lib/cupyattn/config.py", "cupyattn.egg-info/PKG-INFO", "tests/__pycache__/x.cpython-311.pyc",
               ".pytest_cache/v/cache/lastfailed", ".hypothesis/examples/x", "dist/cupyattn-0.1.0.tar.gz",
               "gpu-out/env.txt"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True, text=True)
    assert sorted(r.stdout.split()) == sorted(outputs)


# --- the README and docs/ ------------------------------------------------------------------------
DOCS = ("api.md", "options.md", "serving.md", "hopper.md", "gpus.md", "tinylm.md", "benchmarks.md", "testing.md",
        "CHANGELOG.md")


def test_readme_results_table_is_generated_from_the_newest_results_json():
    """Regenerate the table from the newest benchmarks/results/*.json and compare: a hand edit,
    or a newer results file without `python -m benchmarks.readme_table --write`, fails here."""
    from benchmarks import readme_table as rt

    text = (ROOT / "README.md").read_text()
    newest = rt.newest()
    block = rt.table(newest)
    assert block in text, ("README.md's results table is not the one generated from "
                           f"{newest.name}: run python -m benchmarks.readme_table --write")
    assert newest.name in block and block.count("\n| ") >= 5  # header + at least a few cases


def test_readme_is_a_front_page():
    """At most about 150 lines; no commit ids or log file names outside the generated table;
    every relative link resolves; every page of docs/ is linked."""
    from benchmarks import readme_table as rt

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    i, j = text.index(rt.BEGIN), text.index(rt.END)
    prose = text[:i] + text[j:]
    assert not re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", prose), "a commit id in the README"
    assert not re.findall(r"[\w.-]+\.(?:log|txt)\b", prose), "a log file name in the README"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert [l for l in links if not l.startswith("http") and not (ROOT / l).exists()] == []
    assert {f"docs/{d}" for d in DOCS} <= set(links)


def test_docs_pages_exist_and_their_links_and_results_files_resolve():
    """Each page of docs/ is there; its relative links resolve; every results file a page (or the
    README) names exists, so each figure can be traced to what measured it."""
    for name in DOCS:
        assert (ROOT / "docs" / name).is_file(), name
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name}: broken link {link}"
        for path in re.findall(r"benchmarks/results/[\w./-]+", text):
            path = path.rstrip(".")
            if "<" not in path:
                assert (ROOT / path).exists(), f"{page.name} names {path}, which is not committed"
    assert "](options.md)" in (ROOT / "docs" / "api.md").read_text()


def test_tinylm_docs_list_every_cli_option():
    """docs/tinylm.md's option summary names every option `tinylm --help` lists."""
    from tinylm.__main__ import build_parser

    text = (ROOT / "docs" / "tinylm.md").read_text()
    options = [o for a in build_parser()._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert [o for o in options if not re.search(re.escape(o) + r"\b", text)] == []


def test_code_carries_no_issue_numbers():
    """Issue numbers belong to the tracker and the changelog, not to code: a comment says why, in
    words a reader without the tracker can follow."""
    exts = {".py", ".cu", ".cuh", ".h", ".cpp", ".sh", ".toml"}
    marker = re.compile(r"\bissues? \d+\b", re.I)
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(ROOT.rglob("*"))
             if p.suffix in exts and p.is_file() and not {".git", "build", ".carry"} & set(p.relative_to(ROOT).parts)
             and "egg-info" not in str(p) for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if marker.search(line)]
    assert found == []


# tests/: a folder per package, and at the top only what concerns the whole project
TEST_FOLDERS = {"cupyattn", "tinylm", "emu", "benchmarks"}
TOP_LEVEL = {"conftest.py", "tiers.py",  # the session's helpers and its background work
             "test_project.py", "test_docs.py", "test_bad_inputs.py",  # every package's wiring, docs, inputs
             "test_emulated_gpu_tier.py", "test_assert_close.py"}  # the tiers' checks, conftest's closeness


def test_tests_sit_in_a_folder_per_package():
    """Op and kernel tests in tests/cupyattn, the model's in tests/tinylm, the CPU emulator's own
    beside its sources in tests/emu, the benchmark tools' in tests/benchmarks; nothing loose at the
    top but the project-wide files. No folder is a package and no two test files share a name:
    pytest's default import mode imports each by its name from its folder, and pyproject's
    pythonpath lists every folder so that a test imports another folder's helpers by name. Every
    file the emulated runs name (tests/tiers.py) exists."""
    import tiers

    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("*.py") if p.name not in TOP_LEVEL)
    assert not loose, f"put these in the folder of the package they test ({sorted(TEST_FOLDERS)}): {loose}"
    assert {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"} == TEST_FOLDERS
    files = sorted(tests.rglob("test_*.py"))
    names = [p.name for p in files]
    assert len(files) > 50 and len(set(names)) == len(names), sorted({n for n in names if names.count(n) > 1})
    assert not list(tests.rglob("__init__.py"))
    pythonpath = re.search(r"^pythonpath = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert set(re.findall(r'"([^"]+)"', pythonpath)) >= {"tests", *(f"tests/{d}" for d in TEST_FOLDERS)}
    for path in tiers.SM75_FILES + tiers.SM80_FILES + tiers.SM100_FILES:
        assert (tests / path).is_file(), path
    assert set(tiers.EMU_LONG_FILES) <= set(names)
