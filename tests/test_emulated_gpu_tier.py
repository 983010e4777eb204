"""CPU tier: the GPU tier (every test marked `gpu`, in every file), run on the CPU emulator
(tests/emu/README.md).

CI has no GPU, so this is how every kernel (including the tensor-core variants, through the
emulated mma.sync / ldmatrix / cp.async / wgmma / TMA) meets the float64 reference on each CI run,
under the emulator's adversarial schedules, and how the argument checks, which take device arrays,
run at all. It is evidence about index math, tails, masking, pipelining waits, races between
barriers and launch arguments, not about speed. Tests marked `emu_slow` are left out here (run
them with ``CUPYATTN_EMULATE=1 python -m pytest -m gpu``); `no_emu` ones are skipped under the
emulator. On a machine with a GPU the real GPU tier runs instead and this test is skipped.

While it runs (minutes) it prints its progress every few seconds; its counts join the summary
line the outer pytest prints last ("... 1203 emulated passed, 40 emulated skipped").
"""
import importlib.util
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EMULATE, EMULATED_TIER, HAS_GPU

ROOT = Path(__file__).resolve().parent.parent
PROGRESS = set(".sFExX")  # the characters of pytest -q's progress rows
REPORT_EVERY_S = 10


class _Progress:
    """Counts the progress characters of pytest -q output as it streams in."""

    def __init__(self, label: str = "emulated GPU tier"):
        self.label = label
        self.counts, self.line_is_progress, self.t0, self.last = {}, True, time.monotonic(), 0.0
        self.at_line_start, self.over = True, False  # over: a "===" / "___" section began

    def feed(self, text: str):
        for ch in text:
            if self.over:
                return
            if self.at_line_start and ch in "=_":
                self.over = True
                return
            self.at_line_start = ch == "\n"
            if ch == "\n":
                self.line_is_progress = True
            elif self.line_is_progress and ch in PROGRESS:
                self.counts[ch] = self.counts.get(ch, 0) + 1
            elif not ch.isspace():
                self.line_is_progress = False

    def line(self) -> str:
        c = self.counts
        done = sum(c.values())
        bad = c.get("F", 0) + c.get("E", 0)
        return (f"[{self.label}] {done} tests done: {c.get('.', 0)} passed, {c.get('s', 0)} skipped"
                + (f", {bad} FAILED" if bad else "") + f" ({time.monotonic() - self.t0:.0f} s)")


def _stream(proc, prog: _Progress, out: list, every_s: float | None = None):
    """Collect proc's output unbuffered (dots arrive one by one), printing prog's line at least
    every `every_s` seconds, also while the child is silent."""
    every_s = REPORT_EVERY_S if every_s is None else every_s
    fd = proc.stdout.fileno()
    while True:
        if select.select([fd], [], [], every_s)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            text = chunk.decode(errors="replace")
            out.append(text)
            prog.feed(text)
        if time.monotonic() - prog.last >= every_s:
            prog.last = time.monotonic()
            print(prog.line(), flush=True)


def _run_emulated(label: str, args: list[str], env: dict, capsys) -> None:
    """``python -m pytest -q <args>`` under CUPYATTN_EMULATE=1 (+ ``env``) on every core, with a
    progress line every REPORT_EVERY_S; its counts go to EMULATED_TIER[label] (the final summary);
    fails with the run's tail unless it passed."""
    workers = os.cpu_count() or 1
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=1", *parallel, *args]
    out, prog = [], _Progress(label)
    with capsys.disabled():
        print(f"\n[{label}] {' '.join(cmd[3:])}  (CUPYATTN_EMULATE=1 {' '.join(f'{k}={v}' for k, v in env.items())})",
              flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "CUPYATTN_EMULATE": "1", **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        _stream(proc, prog, out)
        rc = proc.wait(timeout=1800)
        print(prog.line(), flush=True)
    text = "".join(out)
    tail = text[-6000:]
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    if last:
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", last[-1])}
        EMULATED_TIER[label] = {**counts, "seconds": time.monotonic() - prog.t0}
    assert rc == 0, f"{label} failed:\n{tail}"
    assert last and " passed" in last[-1], tail


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_gpu_tier_passes_on_the_cpu_emulator(capsys):
    _run_emulated("emulated GPU tier", ["-m", "gpu and not emu_slow", str(ROOT / "tests")], {}, capsys)


# (issue 24) The default paths on an emulated Turing GPU: compute capability 7.5, 64 KB of shared
# memory per block, kernels built with __CUDA_ARCH__ 750, so ptx.cuh's Turing branches (plain
# copies for cp.async, two m16n8k8 per m16n8k16) and the dispatch's fallbacks (SIMT for bf16,
# 2-stage rings and tiles for 64 KB) run. A chosen subset of shapes keeps it small; explicit
# impls the device cannot run skip there (conftest.skip_unless_device_runs) and are covered by
# test_gpu_families.py's error tests.
SM75_FILES = ("test_ptx.py", "test_gpu_families.py", "test_attention.py", "test_decode.py", "test_gemm.py",
              "test_softmax.py", "test_layers.py", "test_tinylm_gpu.py", "test_options_matrix.py")
SM75_SELECT = " or ".join((
    "test_ldmatrix", "test_mma_m16n8k16", "test_cp_async", "test_gpu_families",
    # every path x option (issue 42): what the dispatch and an explicit impl= run on Turing
    "test_every_option_on_every_path",
    # fp16 flash_mma on two m16n8k8 per k-step, every tile sm_75 takes (config: the 32-key tiles at
    # D = 96, 128; D = 256 skips, naming its minimum); the SIMT kernel
    "(test_gpu_flash_mma_every_tile_entry and float16 and not bfloat16)",
    "(test_gpu_sizes and not 4096 and not flash_mma and not naive)",
    # decode: SIMT (2-deep rings at D 64, 128), fp16 mma at every head dim (the compact tiles at
    # D 128, 256, also with two m-tiles); what auto picks
    "(test_decode_head_dims and (simt or mma-float16))",
    "(test_decode_gqa and mma and (g4-kv2 or g40-kv1))",
    "test_auto_impl_and_head_tiles",
    # GEMM impl="auto": skinny (M <= 16), the 2-stage mma tile, bf16 and fp32 simt
    "(test_matches_reference and auto and (1x17x97 or 17x33x300 or 97x128x17 or 1000x17x97))",
    "test_shared_weight_batch_is_one_gemm",
    "(test_rows_match_reference and (17-float16 or 1000-float16 or 1025-float16))",
    "test_gpu_rmsnorm_in_place_misaligned_and_nd",
    # tinylm's default cupy backend: the fused step ([True]; the unfused one runs in the sm_90 tier)
    "(test_cupy_float32_greedy_tokens_equal_numpy and True)",
    "(test_half_precision_logits_within_tolerance and False)",
))

@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_default_paths_pass_on_an_emulated_sm75(capsys):
    _run_emulated("emulated sm_75", ["-m", "gpu and not emu_slow", "-k", SM75_SELECT,
                                     *(str(ROOT / "tests" / f) for f in SM75_FILES)],
                  {"CUPYATTN_EMU_ARCH": "75"}, capsys)


# (issue 42) An emulated A100 (compute capability 8.0, 163 KB per block): the paths x options matrix
# only (every other sm_80 path is sm_90's minus wgmma, which the emulated GPU tier runs), so the
# family between Turing's fallbacks and Hopper's wgmma dispatch meets every option too.
@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_options_matrix_passes_on_an_emulated_sm80(capsys):
    _run_emulated("emulated sm_80", ["-m", "gpu and not emu_slow", "-k", "test_every_option_on_every_path",
                                     str(ROOT / "tests" / "test_options_matrix.py")],
                  {"CUPYATTN_EMU_ARCH": "80"}, capsys)


# (issue 24) An emulated B200 (compute capability 10.0, kernels built with __CUDA_ARCH__ 1000): the
# flash_mma tile its family runs in place of the main one (config.FLASH_MMA_FAMILY_TILES, D = 64),
# plain, causal and serving, and the attention default there.
SM100_SELECT = ("test_flash_mma_launches_the_family_tile or (test_gpu_flash_mma_every_tile_entry and 64)"
                " or test_default_attention_is_what_the_table_says")


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_family_tiles_pass_on_an_emulated_sm100(capsys):
    _run_emulated("emulated sm_100", ["-m", "gpu and not emu_slow", "-k", SM100_SELECT,
                                      *(str(ROOT / "tests" / f) for f in ("test_gpu_families.py", "test_attention.py"))],
                  {"CUPYATTN_EMU_ARCH": "100"}, capsys)


def test_progress_counts_only_progress_rows():
    p = _Progress()
    p.feed("....s.")
    p.feed("F.   [ 4%]\n.....sss\n")
    p.feed("=== FAILURES ===\nE   assert 1.0 == 2.0 ...\n___ test_x ___\n..")
    assert p.counts == {".": 11, "s": 4, "F": 1}
    assert p.line().startswith("[emulated GPU tier] 16 tests done: 11 passed, 4 skipped, 1 FAILED (")


def test_progress_is_printed_while_the_child_is_silent(capsys):
    child = "import time; print('..s', end='', flush=True); time.sleep(2.6); print('.  [100%]')"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    prog, out = _Progress(), []
    _stream(proc, prog, out, every_s=1.0)
    proc.wait(timeout=30)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3, lines  # at least one during each silent second
    assert lines[0].startswith("[emulated GPU tier] 3 tests done: 2 passed, 1 skipped")
    assert "".join(out) == "..s.  [100%]\n" and prog.counts == {".": 3, "s": 1}
