"""The test session's background work, its progress lines and its last line (tests/conftest.py
wires this in; nothing here is collected as a test).

On a machine without a GPU, ``python -m pytest`` runs three things at once so that every core
stays busy:

- the CPU tests, in this process, one at a time;
- the offline compile gate (``cupyattn._compile_check``: every instantiation of every kernel spec
  the loader knows, for the gate's arches) on threads of this process, started as soon as the
  tests are collected; the ``compile_report`` fixture hands each test its spec's reports;
- the `gpu`-marked tests on the CPU emulator (tests/emu), in child pytest processes on every
  core (pytest-xdist): as an sm_90 device (of each parameter grid, the pairs of kernel parameters,
  :func:`pairwise_subset`), and beside it chosen subsets as sm_75, sm_80 and sm_100
  (:func:`emulated_runs`).
  The `gpu` tests are then taken out of this process's run (they run there, not here), and
  tests/test_emulated_gpu_tier.py checks each child's result.

Tests that wait for background work (the gate's readers, the emulated tier's checks) are moved
to the end, so the CPU tests run while the background work does. While anything runs, a status
line with totals is printed whenever the terminal was quiet for :data:`QUIET_S` seconds and at
least every :data:`STATUS_EVERY_S`; at the end a section says what ran where, and the last line
counts it (``... N passed on the CPU emulator, M skipped on the CPU emulator ...``).

``CUPYATTN_FULL=1`` adds what the default leaves out (:data:`FULL`): the compile gate for every
GPU family NVRTC knows, every parameter combination and the `emu_slow` cases on the emulator,
more schedule reruns (tests/conftest.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FULL = os.environ.get("CUPYATTN_FULL", "").strip() not in ("", "0")
QUIET_S = 20.0         # a status line once the terminal has been quiet this long
STATUS_EVERY_S = 60.0  # and at least this often while background work runs
PROGRESS = set(".sFExX")  # the characters of pytest -q's progress rows


def _fmt_s(s: float) -> str:
    return f"{int(s) // 60}m{int(s) % 60:02d}s"


# --- the emulated runs ---------------------------------------------------------------------------
# The default paths on an emulated Turing GPU: compute capability 7.5, 64 KB of shared
# memory per block, kernels built with __CUDA_ARCH__ 750, so ptx.cuh's Turing branches (plain
# copies for cp.async, two m16n8k8 per m16n8k16) and the dispatch's fallbacks (SIMT for bf16,
# 2-stage rings and tiles for 64 KB) run. A chosen subset of shapes keeps it small; explicit
# impls the device cannot run skip there (conftest.skip_unless_device_runs) and are covered by
# test_gpu_families.py's error tests. The *_FILES below are paths under tests/.
SM75_FILES = ("cupyattn/test_ptx.py", "cupyattn/test_gpu_families.py", "cupyattn/test_attention.py",
              "cupyattn/test_decode.py", "cupyattn/test_gemm.py", "cupyattn/test_softmax.py", "cupyattn/test_layers.py",
              "tinylm/test_cupy_backend.py", "cupyattn/test_options_matrix.py", "cupyattn/test_dispatch.py")
SM75_SELECT = " or ".join((
    "test_impl_none_is_the_tables_choice",  # impl=None of every entry point: the options table's row
    "test_ldmatrix", "test_mma_m16n8k16", "test_cp_async", "test_gpu_families",
    # every path x option: what the dispatch and an explicit impl= run on Turing
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
# An emulated B200 (compute capability 10.0, kernels built with __CUDA_ARCH__ 1000): the
# flash_mma tile its family runs in place of the main one (config.FLASH_MMA_FAMILY_TILES, D = 64),
# plain, causal and serving, and the attention default there.
# An emulated A100 (compute capability 8.0, 163 KB per block): the paths x options matrix
# only (every other sm_80 path is sm_90's minus wgmma, which the sm_90 run covers), so the family
# between Turing's fallbacks and Hopper's wgmma dispatch meets every option too.
SM80_FILES = ("cupyattn/test_options_matrix.py", "cupyattn/test_dispatch.py")
SM80_SELECT = "test_every_option_on_every_path or test_impl_none_is_the_tables_choice"
SM100_FILES = ("cupyattn/test_gpu_families.py", "cupyattn/test_attention.py", "cupyattn/test_dispatch.py")
SM100_SELECT = ("test_flash_mma_launches_the_family_tile or (test_gpu_flash_mma_every_tile_entry and 64)"
                " or test_default_attention_is_what_the_table_says or test_impl_none_is_the_tables_choice")
GPU_MARK = "gpu" if FULL else "gpu and not emu_slow"
EMU_ARGS_ENV = "CUPYATTN_EMU_PYTEST_ARGS"  # more arguments for every emulated run (``--durations=30``)
EMU_LOG_ENV = "CUPYATTN_EMU_LOG"  # a folder: each emulated run's whole output lands in <label>.log there


@dataclass
class EmulatedRun:
    """One child ``python -m pytest`` under CUPYATTN_EMULATE=1 on every core (pytest-xdist)."""

    label: str
    args: list
    env: dict
    what: str
    parallel: bool = True  # on every core (xdist); a small run takes one process beside the others
    rc: int | None = None
    started: float | None = None
    seconds: float = 0.0
    cpu_s: float = 0.0                              # user + sys of the child and its descendants
    counts: dict = field(default_factory=dict)      # passed / failed / skipped / deselected / errors
    skips: dict = field(default_factory=dict)       # reason -> count
    out: list = field(default_factory=list)
    prog: "_Progress | None" = None
    proc: "subprocess.Popen | None" = None
    left_out: dict = field(default_factory=dict)    # {"emu_slow": n, "pairwise_dropped": n} from its workers
    done: threading.Event = field(default_factory=threading.Event)

    def command(self) -> list:
        workers = (os.cpu_count() or 1) if self.parallel else 1
        # worksteal: a worker that runs out takes tests queued on the other, so a few long tests
        # at the end of the collection do not leave a core idle
        parallel = (["-n", str(workers), "--dist", "worksteal"]
                    if workers > 1 and importlib.util.find_spec("xdist") else [])
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=1",
                "-o", "console_output_style=count", "-rs", *parallel, *self.args,
                *shlex.split(os.environ.get(EMU_ARGS_ENV, ""))]

    def run(self) -> None:
        """Run to the end (called on a background thread); the result lands in the fields."""
        import tempfile

        self.prog, self.started = _Progress(self.label), time.monotonic()
        report = Path(tempfile.gettempdir()) / f"cupyattn-emu-run-{os.getpid()}-{self.label}.json"
        report.unlink(missing_ok=True)
        try:
            self.proc = proc = subprocess.Popen(self.command(), cwd=ROOT, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT,
                                                env={**os.environ, "CUPYATTN_EMULATE": "1", REPORT_ENV: str(report),
                                                     **self.env})
            _stream(proc, self.prog, self.out)
            # wait4, not wait: the child's CPU time, its xdist workers' and g++'s included (they
            # are its reaped descendants), for the summary's accounting
            _, status, usage = os.wait4(proc.pid, 0)
            self.rc = proc.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_s = usage.ru_utime + usage.ru_stime
        except Exception as e:  # noqa: BLE001  (reported by the test that checks this run)
            self.out.append(f"\n{type(e).__name__}: {e}\n")
            self.rc = -1
        finally:
            self.seconds = time.monotonic() - self.started
            text = "".join(self.out)
            if os.environ.get(EMU_LOG_ENV):  # the whole output, e.g. with --durations in EMU_ARGS_ENV
                Path(os.environ[EMU_LOG_ENV], f"{self.label}.log").write_text(text)
            last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
            if last:
                self.counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in
                               re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", last[-1])}
            for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:\n]+(?::\d+)?: (.*)$", text, re.M):
                self.skips[reason] = self.skips.get(reason, 0) + int(n)
            try:
                self.left_out = json.loads(report.read_text())
                report.unlink()
            except (OSError, ValueError):
                self.left_out = {}
            self.done.set()

    def status(self) -> str:
        if self.started is None:
            return f"{self.label} queued"
        if self.done.is_set():
            return f"{self.label} {'done' if self.rc == 0 else 'FAILED'}"
        return f"{self.label} {self.prog.short()}"

    def tail(self) -> str:
        return "".join(self.out)[-6000:]


def emulated_runs() -> list:
    """The emulated runs of a session without a GPU, in the order they start. The sm_90 run takes
    every `gpu` test in tests/ (a new test file is in it by its marker alone); each other family
    runs a chosen subset, once, in one process beside the sm_90 run: no schedule reruns
    (CUPYATTN_EMU_RERUN_BUDGET_S, tests/conftest.py) and no xdist start-up for a few dozen tests.
    tests/test_emulated_gpu_tier.py checks every run listed here."""
    tests = str(ROOT / "tests")

    def subset(arch: str, files, select: str, what: str) -> EmulatedRun:
        return EmulatedRun(f"sm_{arch}", ["-m", GPU_MARK, "-k", select, *(f"{tests}/{f}" for f in files)],
                           {"CUPYATTN_EMU_ARCH": arch, "CUPYATTN_EMU_RERUN_BUDGET_S": "0"},
                           what + ", a chosen subset", parallel=False)

    return [
        EmulatedRun("sm_90", ["-m", GPU_MARK, tests], {} if FULL else {PAIRWISE_ENV: "1"},
                    "every `gpu` test, as an H100 (sm_90)" + ("" if FULL else "; of a test's parameter grid, "
                                                               "every value, and every pair of values of "
                                                               "its dtype, impl, head dim, layout, causal")),
        subset("75", SM75_FILES, SM75_SELECT, "the default paths as a T4 (sm_75, 64 KB per block)"),
        subset("80", SM80_FILES, SM80_SELECT, "every path x option as an A100 (sm_80)"),
        subset("100", SM100_FILES, SM100_SELECT, "the B200's own D = 64 attention tile (sm_100)"),
    ]


class _Progress:
    """Counts the progress characters of a child's pytest -q output as it streams in, and reads
    the total from the ``[ n/total]`` that ends each row (console_output_style=count)."""

    def __init__(self, label: str = "emulated GPU tier"):
        self.label = label
        self.counts, self.line_is_progress, self.t0, self.last = {}, True, time.monotonic(), 0.0
        self.at_line_start, self.over, self.total, self._row = True, False, None, ""

    def feed(self, text: str):
        for ch in text:
            if self.over:
                return
            if self.at_line_start and ch in "=_":
                self.over = True
                return
            self.at_line_start = ch == "\n"
            self._row = "" if ch == "\n" else self._row + ch
            if (m := re.search(r"\[\s*\d+/(\d+)\]$|^(\d+) tests collected$", self._row)):
                self.total = int(m.group(1) or m.group(2))
            if ch == "\n":
                self.line_is_progress = True
            elif self.line_is_progress and ch in PROGRESS:
                self.counts[ch] = self.counts.get(ch, 0) + 1
            elif not ch.isspace():
                self.line_is_progress = False

    def short(self) -> str:
        c = self.counts
        done, bad = sum(c.values()), c.get("F", 0) + c.get("E", 0)
        return f"{done}/{self.total or '?'}" + (f" ({bad} FAILED)" if bad else "")

    def line(self) -> str:
        c = self.counts
        done = sum(c.values())
        bad = c.get("F", 0) + c.get("E", 0)
        return (f"[{self.label}] {done}/{self.total or '?'} tests done: {c.get('.', 0)} passed, "
                f"{c.get('s', 0)} skipped" + (f", {bad} FAILED" if bad else "") +
                f" ({time.monotonic() - self.t0:.0f} s)")


def _stream(proc, prog: _Progress, out: list, every_s: float | None = None, show=None):
    """Collect proc's output unbuffered (dots arrive one by one); with ``show``, call it with
    prog's line at least every ``every_s`` seconds, also while the child is silent."""
    fd = proc.stdout.fileno()
    while True:
        if select.select([fd], [], [], every_s or 1.0)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            text = chunk.decode(errors="replace")
            out.append(text)
            prog.feed(text)
        if show is not None and time.monotonic() - prog.last >= every_s:
            prog.last = time.monotonic()
            show(prog.line())


# --- all pairs of parameter values (the default emulated run) -------------------------------------
PAIRWISE_ENV = "CUPYATTN_EMU_PAIRWISE"  # set on the sm_90 emulated run unless CUPYATTN_FULL=1
# An emulated run starts with these files' tests (5 to 30 CPU-s each there: whole tinylm decode
# loops, the 1024-thread sampler over many rows): a run ends when its last test does, and one of
# them last would keep a core idle meanwhile. In file order otherwise (module fixtures stay shared).
# By file name: names are unique across tests/'s folders (pytest's import mode needs them so).
EMU_LONG_FILES = ("test_cupy_backend.py", "test_megakernel_tinylm.py", "test_fused_ops.py",
                  "test_continuous_batching.py")


def emulated_order(item) -> int:
    """Sort key of an emulated run's tests (stable: pytest's order within each group)."""
    return 0 if item.path.name in EMU_LONG_FILES else 1


# The parameters that choose the kernel instantiation a test runs (its dtype, impl, head dim,
# GEMM layout, causal mask; the options matrix's entry): their pairs are kept; a shape or flag runs
# each of its values once.
KERNEL_PARAMS = frozenset({"dtype", "impl", "d", "layout", "causal", "entry"})


def pairwise_subset(items) -> list:
    """The items to keep so that, for every parametrized test function, every value of each
    parameter still runs at least once and every pair of values of two kernel parameters
    (:data:`KERNEL_PARAMS`) too: the instantiations run, their shapes and flags once each (a
    greedy covering array in collection order, _compile_check.all_pairs); unparametrized tests
    are all kept. Every combination runs under CUPYATTN_FULL=1."""
    from cupyattn._compile_check import all_pairs

    groups: dict = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        groups.setdefault(key if spec is not None else item.nodeid, []).append(item)
    keep = set()
    for group in groups.values():
        if getattr(group[0], "callspec", None) is None or len(group) == 1:
            keep.update(map(id, group))
            continue
        keep.update(map(id, all_pairs(group, lambda i: [(n, repr(v)) for n, v in i.callspec.params.items()],
                                      paired=KERNEL_PARAMS.__contains__)))
    return [i for i in items if id(i) in keep]


REPORT_ENV = "CUPYATTN_EMU_REPORT"  # a file where an emulated run's workers say what they left out
RUN_REPORT: dict = {}


class EmuSlowCounter:
    """Registered in an emulated run: counts its `emu_slow` tests before -m leaves them out."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        RUN_REPORT["emu_slow"] = sum("gpu" in i.keywords and "emu_slow" in i.keywords for i in items)


def write_run_report(config, **counts) -> None:
    """In an emulated run's worker: what it left out, for the outer session's summary (every worker
    writes the same)."""
    path = os.environ.get(REPORT_ENV)
    if path and not config.option.collectonly:
        Path(path).write_text(json.dumps({**RUN_REPORT, **counts}))


# --- the compile gate in the background ---------------------------------------------------------
class BackgroundGate:
    """``_compile_check.run_check`` of every spec for ``arches``, spec after spec on a thread (each
    on a thread per core), so the fixture can hand out a spec's reports as soon as it is done."""

    def __init__(self, arches):
        import cupyattn  # noqa: F401  (registers every spec)
        from cupyattn._compile_check import gate_exprs, gate_pairs
        from cupyattn._loader import all_specs

        self.arches, self.specs, self.pairs = tuple(arches), all_specs(), gate_pairs()
        self.total = sum(len(gate_exprs(s, a, self.pairs)) for s in self.specs for a in self.arches)
        self.every = sum(len(s.exprs_for(int(a))) for s in self.specs for a in self.arches)
        self.built, self.results, self.t0, self.seconds = 0, {}, None, 0.0
        self.events = {s.name: threading.Event() for s in self.specs}
        self.thread = threading.Thread(target=self._run, name="compile-gate", daemon=True)

    def start(self):
        self.t0 = time.monotonic()
        self.thread.start()

    def _run(self):
        from cupyattn._compile_check import run_check

        def count(reports, done, total):
            self.built += len(reports)

        for spec in self.specs:
            try:
                self.results[spec.name] = run_check(spec.name, self.arches, on_reports=count, pairs=self.pairs)
            except Exception as e:  # noqa: BLE001  (the test that reads this spec reports it)
                self.results[spec.name] = ([], [f"the compile gate failed for {spec.name}: {type(e).__name__}: {e}"])
            self.events[spec.name].set()
        self.seconds = time.monotonic() - self.t0

    def result(self, spec_name: str):
        ev = self.events.get(spec_name)
        if ev is None:
            return None
        ev.wait()
        return self.results[spec_name]

    def running(self) -> bool:
        return self.t0 is not None and self.thread.is_alive()

    def status(self) -> str:
        if self.t0 is None:
            return "compile gate not started"
        if not self.thread.is_alive():
            return f"compile gate done ({self.built} builds)"
        return f"compile gate {self.built}/{self.total} builds"

    def summary(self) -> str:
        reports = [r for rs, _ in self.results.values() for r in rs]
        errors = sum(len(e) for _, e in self.results.values())
        spills = sum(r.spills and r.hot for r in reports)
        arches = sorted({r.arch for r in reports}, key=lambda a: (len(a), a))
        return (f"compile gate (NVRTC, {', '.join(arches) or 'no arch'}): {len(reports)} kernel builds"
                + (f" (all pairs of template arguments of {self.every} instantiations)" if self.pairs else "")
                + f", {errors} errors, {spills} hot kernels with spills in {self.seconds:.0f} s"
                + ("" if FULL else " (CUPYATTN_FULL=1: every instantiation, every GPU family)"))


# --- the session: what runs where, progress lines ------------------------------------------------
class Session:
    """The outer pytest process's view: its own tests, the gate, the emulated runs, the status
    lines; one per session (``SESSION``)."""

    def __init__(self):
        self.gate: BackgroundGate | None = None
        self.runs: list[EmulatedRun] = []
        self.tr = None
        self.lock = threading.RLock()
        self.last_output = time.monotonic()
        self.last_status = 0.0
        self.t0 = time.monotonic()
        self.total = 0
        self.done = 0
        self.current: tuple | None = None   # (nodeid, start)
        self.moved_gpu = 0
        self.note: str | None = None        # what a test compiling in the foreground is at
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread = None

    # Terminal output shared with pytest's own writer: one lock, the time of the last write, and
    # each write flushed (so a status line written beside it cannot overtake buffered dots).
    # During a test, pytest's fd capture points fd 1 at a file; a status line written then goes to
    # the terminal's own fd, which the capture saved (FDCapture.targetfd_save).
    def attach(self, terminalreporter) -> None:
        self.tr = terminalreporter
        tw = terminalreporter._tw
        write = tw.write

        def locked_write(msg, **kw):
            with self.lock:
                self.last_output = time.monotonic()
                out = write(msg, **kw)
                tw.flush()
                return out

        tw.write = locked_write
        capman = terminalreporter.config.pluginmanager.getplugin("capturemanager")
        out = getattr(getattr(capman, "_global_capturing", None), "out", None)
        self._fd = getattr(out, "targetfd_save", None)

    def start_background(self) -> None:
        """The gate and the emulated runs, if planned; the status lines in any case (a long test
        in the foreground gets them too)."""
        self.last_status = time.monotonic()
        if self.gate is not None:
            self.gate.start()
        if self.runs:
            threading.Thread(target=self._run_emulated, name="emulated-tiers", daemon=True).start()
        if self.tr is not None:
            self._thread = threading.Thread(target=self._heartbeat, name="status-lines", daemon=True)
            self._thread.start()

    def _run_emulated(self) -> None:
        """The parallel runs one after another on this thread; the one-process runs on another
        thread meanwhile."""
        small = [r for r in self.runs if not r.parallel]
        if small:
            threading.Thread(target=lambda: [r.run() for r in small], name="emulated-subsets", daemon=True).start()
        for run in self.runs:
            if run.parallel:
                run.run()

    def emulated(self, label: str) -> EmulatedRun | None:
        run = next((r for r in self.runs if r.label == label), None)
        if run is not None:
            run.done.wait()
        return run

    def busy(self) -> bool:
        return (self.gate is not None and self.gate.running()) or any(not r.done.is_set() for r in self.runs)

    def status_line(self) -> str:
        parts = [f"CPU {self.done}/{self.total}"]
        if self.current is not None:
            nodeid, start = self.current
            took = time.monotonic() - start
            if took >= 5:
                parts[0] += f" ({nodeid}: {took:.0f} s)"
        if self.note:
            parts.append(self.note)
        if self.gate is not None:
            parts.append(self.gate.status())
        if self.runs:
            parts.append("emulator " + ", ".join(r.status() for r in self.runs))
        return f"[{_fmt_s(time.monotonic() - self.t0)}] " + " | ".join(parts)

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            if now - self.last_output >= QUIET_S or (self.busy() and now - self.last_status >= STATUS_EVERY_S):
                self.print_status()

    def print_status(self) -> None:
        with self.lock:
            tw = self.tr._tw
            text = ("\n" if tw.width_of_current_line else "") + self.status_line() + "\n"
            if self._fd is None:
                tw.write(text, flush=True)
            else:
                os.write(self._fd, text.encode())
                tw._current_line = ""  # the status line ended the row pytest was writing
            self.last_status = self.last_output = time.monotonic()

    def stop(self) -> None:
        """No more status lines; a child still running (the session ended early) is stopped."""
        self._stop.set()
        for run in self.runs:
            if run.proc is not None and run.proc.poll() is None:
                run.proc.kill()

    def cpu_accounting(self) -> str:
        """CPU seconds (user + sys) by part, which is what a machine's cores bound, unlike wall time
        on a shared machine. Called on the main thread, which ran the CPU tests; the compile gate is
        this process's other threads (with the status lines, a few seconds); the CPU tests'
        subprocesses are the reaped children that are not emulated runs."""
        import resource

        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        main = time.thread_time()
        own, children = me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime
        emulated = sum(r.cpu_s for r in self.runs)
        parts = [f"CPU tests {main + children - emulated:.0f} (their subprocesses {children - emulated:.0f})"]
        if self.gate is not None:
            parts.append(f"compile gate {own - main:.0f}")
        parts += [f"emulator {r.label} {r.cpu_s:.0f}" for r in self.runs]
        return (f"CPU time (user + sys, s): " + ", ".join(parts) +
                f"; {own + children:.0f} in all over {time.monotonic() - self.t0:.0f} s of wall time")

    # the end: what ran where
    def summarize(self, terminalreporter) -> None:
        if not (self.gate or self.runs or self.moved_gpu):
            return
        tr = terminalreporter
        tr.write_sep("-", "where the tests ran")
        cpu = {k: sum(getattr(r, "count_towards_summary", True) for r in tr.stats.get(k, []))
               for k in ("passed", "failed", "skipped", "error")}
        tr.write_line("CPU, this process: " + ", ".join(f"{n} {k}" for k, n in cpu.items() if n))
        if self.gate is not None:
            tr.write_line(self.gate.summary())
        left = {"emu_slow": 0, "pairwise_dropped": 0}
        for run in self.runs:
            c = {k: n for k, n in run.counts.items() if k != "deselected"}
            head = ", ".join(f"{n} {k}" for k, n in c.items()) or "no result"
            tr.write_line(f"CPU emulator as {run.label} ({run.what}): {head} in {run.seconds:.0f} s "
                          f"({run.cpu_s:.0f} CPU-s)")
            for reason, n in sorted(run.skips.items(), key=lambda kv: -kv[1])[:6]:
                tr.write_line(f"    {n} skipped: {reason}")
            if run.label == "sm_90":
                left = {k: run.left_out.get(k, 0) for k in left}
            for k, label in (("passed", "passed on the CPU emulator"), ("skipped", "skipped on the CPU emulator"),
                             ("failed", "failed on the CPU emulator"), ("error", "errors on the CPU emulator")):
                if c.get(k):
                    tr.stats.setdefault(label, []).extend(_Counted() for _ in range(c[k]))
        if not FULL and (left["emu_slow"] or left["pairwise_dropped"]):
            tr.write_line(f"Not run (CUPYATTN_FULL=1 runs them on the emulator): {left['emu_slow']} `emu_slow` "
                          f"tests, and {left['pairwise_dropped']} parameter combinations beyond the pairs of "
                          "kernel parameters")
            tr.stats.setdefault("not run (CUPYATTN_FULL=1 runs them)", []).extend(
                _Counted() for _ in range(left["emu_slow"] + left["pairwise_dropped"]))
        tr.write_line(self.cpu_accounting())
        tr.write_line("The emulator runs the real kernel sources on CPU threads: evidence about kernel logic, "
                      "not GPU results. Without a GPU nothing here ran on one.")


class _Counted:
    count_towards_summary = True


SESSION = Session()


def gxx_available() -> bool:
    return shutil.which("g++") is not None
