"""CPU tier: the GPU tier (every test marked `gpu`, in every file), run on the CPU emulator
(tests/emu/README.md).

CI has no GPU, so this is how every kernel (including the tensor-core variants, through the
emulated mma.sync / ldmatrix / cp.async) meets the float64 reference on each CI run, and how the
argument checks, which take device arrays, run at all. It is evidence about index math, tails,
masking, pipelining waits and launch arguments, not about speed. Tests marked `emu_slow` are
left out here (run them with ``CUPYATTN_EMULATE=1 python -m pytest -m gpu``); `no_emu` ones are
skipped under the emulator. On a machine with a GPU the real GPU tier runs instead and this test
is skipped. Progress is printed to the terminal while it runs (a few minutes).
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EMULATE, HAS_GPU

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_gpu_tier_passes_on_the_cpu_emulator(capsys):
    workers = os.cpu_count() or 1
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu and not emu_slow", "-p", "no:cacheprovider",
           "--maxfail=1", *parallel, str(ROOT / "tests")]
    lines = []
    with capsys.disabled():
        print(f"\n[emulated GPU tier] {' '.join(cmd[3:])}  (CUPYATTN_EMULATE=1)", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "CUPYATTN_EMULATE": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append(line)
            if line.strip() and line.lstrip()[0] in ".sFEx":  # progress rows of -q
                print(f"[emulated GPU tier] {line.rstrip()}", flush=True)
        rc = proc.wait(timeout=1800)
    tail = "".join(lines)[-6000:]
    assert rc == 0, f"emulated GPU tier failed:\n{tail}"
    assert " passed" in lines[-1], tail
