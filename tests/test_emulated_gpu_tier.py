"""CPU tier: the GPU tier (every test marked `gpu`, in every file), run on the CPU emulator
(tests/emu/README.md).

CI has no GPU, so this is how every kernel (including the tensor-core variants, through the
emulated mma.sync / ldmatrix / cp.async / wgmma / TMA) meets the float64 reference on each CI run,
under the emulator's adversarial schedules, and how the argument checks, which take device arrays,
run at all. It is evidence about index math, tails, masking, pipelining waits, races between
barriers and launch arguments, not about speed. Tests marked `emu_slow` are left out unless
CUPYATTN_FULL=1 (or run them with ``CUPYATTN_EMULATE=1 python -m pytest -m gpu``); `no_emu` ones
are skipped under the emulator. On a machine with a GPU the real GPU tier runs instead and these
tests are skipped.

The runs (tests/tiers.py's emulated_runs(): as sm_90, then chosen subsets as sm_75, sm_80 and
sm_100) start in the background as soon as the session's tests are collected; each case here
waits for its run and fails with the run's tail unless it passed. Run alone, a case starts its
run itself.
"""
import shutil
import subprocess
import sys

import pytest
import tiers
from conftest import EMULATE, HAS_GPU


def _why_not() -> str | None:
    if EMULATE or HAS_GPU:
        return "already emulating, or a real GPU runs the GPU tier"
    if shutil.which("g++") is None:
        return "the CPU emulator needs g++"
    return None


needs_emulator = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _check(label: str) -> None:
    run = tiers.SESSION.emulated(label)
    if run is None:  # not started by the session (xdist, or the `gpu` tests were not collected)
        run = next(r for r in tiers.emulated_runs() if r.label == label)
        run.run()
    assert run.rc == 0, f"the emulated run as {label} failed:\n{run.tail()}"
    assert run.counts.get("passed"), run.tail()


@needs_emulator
@pytest.mark.parametrize("label", [pytest.param(r.label, marks=pytest.mark.emulated_run(r.label))
                                   for r in tiers.emulated_runs()])
def test_gpu_tests_pass_on_the_cpu_emulator(label):
    """One case per run of tiers.emulated_runs() (the whole `gpu` tier as sm_90, the chosen
    subsets as other families): a run added there is checked here."""
    _check(label)


def test_progress_counts_only_progress_rows():
    p = tiers._Progress()
    p.feed("....s.")
    p.feed("F.   [ 8/20]\n.....sss\n")
    p.feed("=== FAILURES ===\nE   assert 1.0 == 2.0 ...\n___ test_x ___\n..")
    assert p.counts == {".": 11, "s": 4, "F": 1} and p.total == 20
    assert p.line().startswith("[emulated GPU tier] 16/20 tests done: 11 passed, 4 skipped, 1 FAILED (")
    assert p.short() == "16/20 (1 FAILED)"


def test_progress_is_printed_while_the_child_is_silent():
    child = "import time; print('..s', end='', flush=True); time.sleep(2.6); print('.  [4/4]')"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    prog, out, shown = tiers._Progress(), [], []
    tiers._stream(proc, prog, out, every_s=1.0, show=shown.append)
    proc.wait(timeout=30)
    assert len(shown) >= 3, shown  # at least one during each silent second
    assert shown[0].startswith("[emulated GPU tier] 3/? tests done: 2 passed, 1 skipped")
    assert "".join(out) == "..s.  [4/4]\n" and prog.counts == {".": 3, "s": 1} and prog.total == 4
