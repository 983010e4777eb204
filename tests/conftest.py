"""Shared test helpers: the `gpu` marker, the compile-report fixture, inputs and tolerances.

Tests that need device arrays (kernel runs and the argument checks, which take CuPy arrays) are
marked `gpu`: they run on a CUDA device, or on the CPU emulator (CUPYATTN_EMULATE=1, tests/emu),
which a session without a GPU runs in child processes beside its CPU tests, together with the
compile gate (tests/tiers.py: the background work, the status lines, the summary of what ran where).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# One BLAS thread per process. The session keeps every core busy with its own work (tests/tiers.py:
# the compile gate, the emulated runs, the CPU tests side by side), and OpenBLAS threads that spin
# on a busy machine cost several times the CPU: tinylm's golden greedy test took 57 s of CPU with
# 2 threads against 13 s with 1 on this project's loaded 2-core machine. The variables reach the
# child processes; numpy is already imported here, so threadpoolctl limits this process.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
try:
    from threadpoolctl import threadpool_limits

    threadpool_limits(int(os.environ["OPENBLAS_NUM_THREADS"]))
except ImportError:  # a test extra; without it this process keeps BLAS's default
    pass

# Tests that run the benchmark CLI share the GPU by design (pytest-xdist's workers, the GPU tier beside
# the sanitizers): its idle-GPU guard (benchmarks/gpu_guard.py) records them as shared instead of refusing.
os.environ.setdefault("CUPYATTN_BENCH_ALLOW_SHARED", "1")

EMULATE = os.environ.get("CUPYATTN_EMULATE") == "1"
if EMULATE:  # run the GPU tier on CPU threads (tests/emu/README.md); must precede any cupy import
    sys.path.insert(0, str(Path(__file__).parent / "emu"))
    import fakecupy

    fakecupy.install()

import tiers  # noqa: E402
from cupyattn import config  # noqa: E402


def _has_gpu() -> bool:
    if EMULATE:
        return True
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()
SESSION = tiers.SESSION  # the background work of this test session and its progress lines


def pytest_configure(config):
    if EMULATE:
        config.pluginmanager.register(tiers.EmuSlowCounter(), "emu-slow-counter")


def _in_xdist(config) -> bool:
    return hasattr(config, "workerinput") or bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Start the background work (the compile gate, the emulated runs) and the status lines."""
    config = session.config
    if EMULATE and not _in_xdist(config) and not config.option.collectonly:
        print(f"\n{len(session.items)} tests collected", flush=True)  # an emulated run's total, for the outer session
    if config.option.collectonly or EMULATE or _in_xdist(config):
        return
    SESSION.total = len(session.items)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        SESSION.attach(tr)
    SESSION.start_background()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """An emulated run's total, for the outer session's status lines (tests/tiers.py reads it)."""
    if EMULATE and not SESSION.total:
        SESSION.total = len(ids)
        print(f"\n{len(ids)} tests collected", flush=True)


def pytest_runtest_logstart(nodeid, location):
    import time

    SESSION.current = (nodeid, time.monotonic())


CPU_PROFILE = os.environ.get("CUPYATTN_CPU_PROFILE")  # a file: each test's CPU seconds are appended there

if CPU_PROFILE:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Append ``where<TAB>test id<TAB>CPU s<TAB>wall s`` for each test: CPU time (user + sys) of
        this thread (the outer process, whose other threads run the compile gate) or this process
        (an emulated run's worker) and of its reaped subprocesses (g++, the CLIs), which unlike wall
        time does not grow with the machine's load. The outer process leaves out the emulated runs
        it reaps meanwhile (tests/tiers.py counts them)."""
        import resource
        import time

        def cpu():
            me = resource.getrusage(resource.RUSAGE_SELF)
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            own = me.ru_utime + me.ru_stime if EMULATE else time.thread_time()
            return own + kids.ru_utime + kids.ru_stime - sum(r.cpu_s for r in SESSION.runs)

        c0, t0 = cpu(), time.monotonic()
        yield
        where = f"sm_{os.environ.get('CUPYATTN_EMU_ARCH', '90')}" if EMULATE else "cpu"
        with open(CPU_PROFILE, "a") as f:
            f.write(f"{where}\t{item.nodeid}\t{cpu() - c0:.2f}\t{time.monotonic() - t0:.2f}\n")


def pytest_runtest_logfinish(nodeid, location):
    SESSION.done += 1
    SESSION.current = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    SESSION.stop()


def pytest_terminal_summary(terminalreporter):
    """Say what ran where (this process, the compile gate, the emulator), and count it in the last line."""
    SESSION.summarize(terminalreporter)


# Under the emulator, a `gpu` test whose first run took under EXTRA_SCHEDULES_BELOW_S runs again
# under EXTRA_SCHEDULES more schedules (seed bases "<test id>#schedule1", ...), until this process
# has spent EXTRA_SCHEDULES_BUDGET_S on reruns (8x that under CUPYATTN_FULL=1; the chosen subsets
# as sm_75 / sm_100 set CUPYATTN_EMU_RERUN_BUDGET_S=0): several schedules where they are cheap,
# within the test command's time. CUPYATTN_EMU_SCHEDULES=n (n >= 1) runs every `gpu` test under
# n schedules instead.
EXTRA_SCHEDULES, EXTRA_SCHEDULES_BELOW_S = 2, 0.25
EXTRA_SCHEDULES_BUDGET_S = float(os.environ.get("CUPYATTN_EMU_RERUN_BUDGET_S", 15.0 * (8 if tiers.FULL else 1)))
_extra_spent = [0.0]

if EMULATE:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(pyfuncitem):
        """Rerun a cheap `gpu` test under more schedules (above); the first failure fails it."""
        import time

        forced = int(os.environ.get("CUPYATTN_EMU_SCHEDULES", "0") or 0)
        t0 = time.perf_counter()
        outcome = yield
        took = time.perf_counter() - t0
        if outcome.excinfo is not None or "gpu" not in pyfuncitem.keywords:
            return
        if forced:
            rounds = forced - 1
        elif took < EXTRA_SCHEDULES_BELOW_S and _extra_spent[0] < EXTRA_SCHEDULES_BUDGET_S:
            rounds = EXTRA_SCHEDULES
        else:
            return
        args = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
        t1 = time.perf_counter()
        try:
            for fakecupy.schedule.round in range(1, rounds + 1):
                if "monkeypatch" in args:  # each run starts from the unpatched modules
                    args["monkeypatch"].undo()
                pyfuncitem.obj(**args)
        finally:  # the round stays set on a failure, for the report; teardown resets it
            _extra_spent[0] += time.perf_counter() - t1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        """A failing test under the emulator names its schedule (the seeds derive from its id)."""
        outcome = yield
        rep = outcome.get_result()
        if rep.failed and (fakecupy.schedule.key or "").startswith(item.nodeid):
            rep.sections.append(("emulator schedule", fakecupy.schedule.describe()))
        if call.when == "teardown":
            fakecupy.schedule.round = 0


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: plan for what will run
def pytest_collection_modifyitems(config, items):
    """Under the emulator: skip the `no_emu` cases. In the outer run: plan the background work.

    Without a GPU, when the session holds the emulated tier's checks (``emulated_run`` marks) and
    g++ is there, the `gpu` tests are taken out of this process (the emulated runs run them) and
    those runs start as soon as the tests are collected; otherwise the `gpu` tests are skipped,
    saying how to run them on the emulator. When the session reads the whole compile gate
    (``whole_compile_gate``), the gate starts in the background too. Tests that wait for
    background work go last, so the CPU tests run meanwhile.
    """
    if EMULATE:  # very large cases would take hours on the CPU emulator
        skip_emu = pytest.mark.skip(reason="too large for the CPU emulator (no_emu)")
        for item in items:
            if "no_emu" in item.keywords:
                item.add_marker(skip_emu)
        dropped = []
        if os.environ.get(tiers.PAIRWISE_ENV) == "1":  # the default run: all pairs of each grid
            keep = tiers.pairwise_subset(items)
            kept = set(map(id, keep))
            dropped = [i for i in items if id(i) not in kept]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = keep
        items.sort(key=tiers.emulated_order)
        tiers.write_run_report(config, pairwise_dropped=len(dropped))
        return
    background = not _in_xdist(config) and not config.option.collectonly
    wanted = {m.args[0] for item in items for m in item.iter_markers("emulated_run")}
    if not HAS_GPU:
        if wanted and background and tiers.gxx_available():
            SESSION.runs = [r for r in tiers.emulated_runs() if r.label in wanted]
            SESSION.moved_gpu = sum("gpu" in item.keywords for item in items)
            items[:] = [item for item in items if "gpu" not in item.keywords]
        else:
            skip = pytest.mark.skip(reason="no CUDA device on this machine (CUPYATTN_EMULATE=1 python -m pytest "
                                           "-m gpu runs them on the CPU emulator)")
            for item in items:
                if "gpu" in item.keywords:
                    item.add_marker(skip)
    if background and any(item.get_closest_marker("whole_compile_gate") for item in items):
        from cupyattn._compile_check import check_arches

        SESSION.gate = tiers.BackgroundGate(check_arches())

    def waits(item):
        return (2 if item.get_closest_marker("emulated_run") else
                1 if "compile_report" in getattr(item, "fixturenames", ()) else 0)

    if background and (SESSION.gate is not None or SESSION.runs):
        items.sort(key=waits)  # stable: the order within each group is pytest's


@pytest.fixture(scope="session")
def compile_report():
    """``compile_report(spec_name=None) -> (reports, errors)``: the offline NVRTC compile check
    (_compile_check.check_arches(): every arch of ARCHES the installed NVRTC knows, or those of
    CUPYATTN_CHECK_ARCHES) of one spec, or of all, run at most once per spec per test session.
    Unless CUPYATTN_FULL=1, of each kernel template's instantiations it builds an all-pairs subset
    of the template arguments (_compile_check.gate_exprs); tests that read one instantiation's
    report use :func:`gate_built` to skip those it left out."""
    import cupyattn
    from cupyattn._compile_check import check_arches, gate_pairs, run_check

    done: dict = {}

    def get(spec_name=None):
        if spec_name is None:
            parts = [get(s.name) for s in cupyattn.all_specs()]
            return [r for p in parts for r in p[0]], [e for p in parts for e in p[1]]
        if spec_name not in done:
            res = SESSION.gate.result(spec_name) if SESSION.gate is not None else None
            if res is None:  # no background gate in this session: compile now, progress in the status line
                def note(reports, n, total):
                    SESSION.note = f"compiling {spec_name}: {n}/{total} NVRTC jobs"

                res = run_check(spec_name, check_arches(), on_reports=note, pairs=gate_pairs())
                SESSION.note = None
            done[spec_name] = res
        return done[spec_name]

    return get


def expected_builds(spec, exprs=None):
    """Sorted (name expression, arch) pairs the compile gate builds for ``spec`` (optionally only
    those of ``exprs``): per gate arch, what a device of that compute capability can run (unless
    CUPYATTN_FULL=1, its all-pairs subset: _compile_check.gate_exprs)."""
    from cupyattn._compile_check import check_arches, gate_exprs, gate_pairs

    keep = None if exprs is None else set(exprs)
    return sorted((e, f"sm_{a}a" if spec.sm90a else f"sm_{a}") for a in check_arches()
                  for e in gate_exprs(spec, a, gate_pairs()) if keep is None or e in keep)


def gate_built(reports, exprs, arch="sm_90"):
    """``{expr: report}`` for those of ``exprs`` the gate built for ``arch``: every one under
    CUPYATTN_FULL=1, else the all-pairs subset (at least one, or the selection is broken)."""
    from cupyattn._compile_check import gate_pairs

    exprs = list(exprs)
    by_kernel = {r.kernel: r for r in reports if r.arch == arch}
    got = {e: by_kernel[e] for e in exprs if e in by_kernel}
    assert got, f"the compile gate built none of {len(exprs)} instantiations for {arch}"
    missing = [e for e in exprs if e not in got]
    assert gate_pairs() or not missing, f"the full compile gate did not build {missing[:5]}"
    return got


DTYPES = ("float32", "float16", "bfloat16")
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def np_dtype(name: str):
    return np.dtype(config.BFLOAT16 if name == "bfloat16" else name)


def device_cannot_run(op: str, impl: str, dtype, head_dim: int | None = None) -> str | None:
    """Why the device cannot run an explicit ``impl`` of ``op`` for ``dtype`` inputs at
    ``head_dim``, or None when it can: the compute capability the dispatch sees (a real device,
    lowered by CUPYATTN_ARCH, or the emulator's CUPYATTN_EMU_ARCH) is below what config.IMPL_MIN_CC
    (and IMPL_MIN_CC_BY_HEAD_DIM) ask. That such a call raises ComputeCapabilityError before any
    launch is tests/cupyattn/test_gpu_families.py's to check."""
    from cupyattn import device

    dt = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    cc = device.compute_capability()
    if config.impl_runs_on(op, impl, dt, cc, head_dim):
        return None
    need = config.impl_min_cc(op, impl, dt, head_dim)
    at = f" at D={head_dim}" if head_dim is not None else ""
    return (f"{op} impl={impl!r} with {dt}{at} needs compute capability {need // 10}.{need % 10}"
            f"{' exactly' if impl == 'wgmma' else ''}; this device dispatches as {cc // 10}.{cc % 10}")


def skip_unless_device_runs(op: str, impl: str, dtype, head_dim: int | None = None) -> None:
    """Skip the calling GPU test with :func:`device_cannot_run`'s reason, if there is one."""
    why = device_cannot_run(op, impl, dtype, head_dim)
    if why:
        pytest.skip(why)


def rand_with_outliers(rng, shape, scale=1.0, outliers=3, outlier_value=30.0):
    """Normal(0, scale) with a few large entries, so a wrong max-subtraction shows."""
    x = rng.standard_normal(shape) * scale
    if x.size:
        idx = rng.integers(0, x.size, size=min(outliers, x.size))
        x.reshape(-1)[idx] = outlier_value * np.sign(rng.standard_normal(len(idx)) + 1e-9)
    return x


def to_device(x, dtype: str):
    """float64 NumPy -> CuPy array of ``dtype`` (bfloat16 via ml_dtypes), plus the rounded
    float64 copy the reference should see (so input rounding is not counted as kernel error)."""
    import cupy

    xd = np.asarray(x).astype(np_dtype(dtype))
    return cupy.asarray(xd), xd.astype(np.float64)


def to_host(x):
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def nan_like(shape, dtype: str):
    import cupy

    return cupy.full(shape, np.nan, dtype=np_dtype(dtype))


ROW_FACTOR = 8  # an element may be off by this many times the dtype's tolerance (see assert_close)


def assert_close(out, ref, dtype: str, tol: float | None = None):
    """``out`` equals the float64 ``ref`` within the dtype's tolerance, on the whole and element by
    element, and has no NaN anywhere.

    - The whole: relative Frobenius error within ``tol`` (plus what rounding the exact result to
      the dtype costs).
    - Each element, judged against its row (the last axis): ``|out - ref| <= ROW_FACTOR * tol *
      (|ref| + s) + |round(ref) - ref|``, where ``s`` is the row's RMS, but never below the
      whole's RMS / sqrt(row length): a row that is small by cancellation is judged at the
      tensor's scale, a row small by nature (softmax over 10^6 columns) at its own. One wrong row
      among 10^4 fails here, though the error of the whole would hide it.
    """
    out = to_host(out) if not isinstance(out, np.ndarray) else np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not np.isnan(out).any(), "output has NaN (unwritten or invalid elements)"
    if ref.size == 0:
        return
    tol = TOL[dtype] if tol is None else tol
    # what rounding the exact result to the output dtype costs: fp16 outputs under 6.1e-5 are
    # subnormal (softmax over 1e6 columns gives ~1e-6, 2^-24 apart), which no kernel can beat
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = np.asarray(ref.astype(np_dtype(dtype)), dtype=np.float64)
    finite = np.isfinite(ref) & np.isfinite(rounded)
    rounding = np.where(finite, np.abs(rounded - ref), 0.0)
    denom = max(np.linalg.norm(ref), 1e-30)
    err = np.linalg.norm(out - ref) / denom
    floor = np.linalg.norm(rounding) / denom
    assert err <= tol + floor, f"relative error {err:.3e} > {tol:.1e} + {floor:.1e} rounding ({dtype})"
    rows = ref.reshape(-1, ref.shape[-1] if ref.ndim else 1)
    o, r, rnd = out.reshape(rows.shape), rows, rounding.reshape(rows.shape)
    fin = np.isfinite(r)
    whole = np.sqrt(np.mean(np.where(fin, r, 0.0) ** 2))
    s = np.maximum(np.sqrt(np.mean(np.where(fin, r, 0.0) ** 2, axis=1, keepdims=True)),
                   whole / np.sqrt(r.shape[1]))
    bound = ROW_FACTOR * tol * (np.abs(r) + s) + rnd
    with np.errstate(invalid="ignore"):
        bad = np.where(fin, np.abs(o - r) > bound, o != r)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        n_rows = int(bad.any(axis=1).sum())
        raise AssertionError(
            f"{int(bad.sum())} elements in {n_rows} of {len(r)} rows are off by more than {ROW_FACTOR} x {tol:.1e} of "
            f"their row's scale ({dtype}); first: row {i}, column {j}: {o[i, j]!r} vs reference {r[i, j]!r} "
            f"(bound {bound[i, j]:.3e}, row scale {s[i, 0]:.3e})")
