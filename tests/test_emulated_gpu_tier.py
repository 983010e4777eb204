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


def _run_emulated(label: str, args: list[str], env: dict, capsys) -> None:
    """``python -m pytest -q <args>`` under CUPYATTN_EMULATE=1 (+ ``env``) on every core, its
    progress rows echoed; fails with the run's tail unless it passed."""
    workers = os.cpu_count() or 1
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=1", *parallel, *args]
    lines = []
    with capsys.disabled():
        print(f"\n[{label}] {' '.join(cmd[3:])}  (CUPYATTN_EMULATE=1 {' '.join(f'{k}={v}' for k, v in env.items())})",
              flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "CUPYATTN_EMULATE": "1", **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append(line)
            if line.strip() and line.lstrip()[0] in ".sFEx":  # progress rows of -q
                print(f"[{label}] {line.rstrip()}", flush=True)
        rc = proc.wait(timeout=1800)
    tail = "".join(lines)[-6000:]
    assert rc == 0, f"{label} failed:\n{tail}"
    assert " passed" in lines[-1], tail


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_gpu_tier_passes_on_the_cpu_emulator(capsys):
    _run_emulated("emulated GPU tier", ["-m", "gpu and not emu_slow", str(ROOT / "tests")], {}, capsys)


# (issue 24) The default paths on an emulated Turing GPU: compute capability 7.5, 64 KB of shared
# memory per block, kernels built with __CUDA_ARCH__ 750, so ptx.cuh's Turing branches (plain
# copies for cp.async, two m16n8k8 per m16n8k16) and the dispatch's fallbacks (SIMT for bf16,
# 2-stage rings and tiles for 64 KB) run. A chosen subset of shapes keeps it small; explicit
# tensor-core impls the device cannot run are covered by test_gpu_families.py's error tests.
SM75_FILES = ("test_ptx.py", "test_gpu_families.py", "test_attention.py", "test_decode.py", "test_gemm.py",
              "test_softmax.py", "test_layers.py", "test_tinylm_gpu.py")
SM75_SELECT = " or ".join((
    "test_ldmatrix", "test_mma_m16n8k16", "test_cp_async", "test_gpu_families",
    # fp16 flash_mma on two m16n8k8 per k-step, every tile that fits 64 KB; the SIMT kernel
    "(test_gpu_flash_mma_every_tile_entry and float16 and not bfloat16 and not float16-96 and not float16-128)",
    "(test_gpu_sizes and not 4096 and not flash_mma and not naive)",
    # decode: SIMT (2-deep rings at D 64, 128), fp16 mma where it fits; what auto picks
    "(test_decode_head_dims and (simt or (mma-float16 and not float16-128 and not float16-256)))",
    "test_auto_impl_and_head_tiles",
    # GEMM impl="auto": skinny (M <= 16), the 2-stage mma tile, bf16 and fp32 simt
    "(test_matches_reference and auto and (1x17x97 or 17x33x300 or 97x128x17 or 1000x17x97))",
    "(test_rows_match_reference and (17-float16 or 1000-float16 or 1025-float16))",
    "test_gpu_rmsnorm_in_place_misaligned_and_nd",
    "(test_cupy_float32_greedy_tokens_equal_numpy and False)",   # tinylm's default (unfused) backend
    "(test_half_precision_logits_within_tolerance and False)",
))

@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_default_paths_pass_on_an_emulated_sm75(capsys):
    _run_emulated("emulated sm_75", ["-m", "gpu and not emu_slow", "-k", SM75_SELECT,
                                     *(str(ROOT / "tests" / f) for f in SM75_FILES)],
                  {"CUPYATTN_EMU_ARCH": "75"}, capsys)
