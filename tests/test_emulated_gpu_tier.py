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

    def __init__(self):
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
        return (f"[emulated GPU tier] {done} tests done: {c.get('.', 0)} passed, {c.get('s', 0)} skipped"
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


@pytest.mark.skipif(EMULATE or HAS_GPU, reason="already emulating, or a real GPU runs the GPU tier")
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")
def test_gpu_tier_passes_on_the_cpu_emulator(capsys):
    workers = os.cpu_count() or 1
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu and not emu_slow", "-p", "no:cacheprovider",
           "--maxfail=1", *parallel, str(ROOT / "tests")]
    out, prog = [], _Progress()
    with capsys.disabled():
        print(f"\n[emulated GPU tier] {' '.join(cmd[3:])}  (CUPYATTN_EMULATE=1; about 6 minutes on 2 cores)",
              flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "CUPYATTN_EMULATE": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        _stream(proc, prog, out)
        rc = proc.wait(timeout=1800)
        print(prog.line(), flush=True)
    text = "".join(out)
    tail = text[-6000:]
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    if last:
        EMULATED_TIER.update({k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)",
                                                                 last[-1])})
        EMULATED_TIER["seconds"] = time.monotonic() - prog.t0
    assert rc == 0, f"emulated GPU tier failed:\n{tail}"
    assert last and " passed" in last[-1], tail


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
