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
