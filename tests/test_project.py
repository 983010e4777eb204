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


def test_kernel_sources_ship_as_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'kernels_cu\s*=\s*\[[^\]]*"\*\.cu"', text) and '"*.cuh"' in text


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
