"""CPU tier: the GPU tier of the kernel tests, run on the CPU emulator (tests/emu/README.md).

CI has no GPU, so this is how every kernel (including the tensor-core variants, through the
emulated mma.sync / ldmatrix / cp.async) meets the float64 reference on each CI run. It is
evidence about index math, tails, masking and launch arguments, not about speed. On a machine
with a GPU the real GPU tier runs instead and this test is skipped.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EMULATE, HAS_GPU

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["test_gemm.py", "test_softmax.py", "test_attention.py", "test_decode.py", "test_layers.py",
                "test_tinylm_gpu.py"]


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_gpu_tier_passes_on_the_cpu_emulator():
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu and not emu_slow", "-p", "no:cacheprovider", "-x",
           *(str(ROOT / "tests" / t) for t in KERNEL_TESTS)]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "CUPYATTN_EMULATE": "1"},
                       capture_output=True, text=True, timeout=1500)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"emulated GPU tier failed:\n{tail}"
    assert " passed" in r.stdout.splitlines()[-1], tail
