"""Shared test helpers: the `gpu` marker, the compile-report fixture, inputs and tolerances.

Tests that need device arrays (kernel runs and the argument checks, which take CuPy arrays) are
marked `gpu`: they run on a CUDA device, or on the CPU emulator (CUPYATTN_EMULATE=1, tests/emu),
which the CPU tier drives in a subprocess (tests/test_emulated_gpu_tier.py).
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

EMULATE = os.environ.get("CUPYATTN_EMULATE") == "1"
if EMULATE:  # run the GPU tier on CPU threads (tests/emu/README.md); must precede any cupy import
    sys.path.insert(0, str(Path(__file__).parent / "emu"))
    import fakecupy

    fakecupy.install()

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
# The counts of each emulated run tests/test_emulated_gpu_tier.py made in this session (label ->
# {"passed": n, "skipped": n, ..., "seconds": s}): they join the summary line printed last.
EMULATED_TIER: dict = {}


def pytest_terminal_summary(terminalreporter):
    """Say what the emulated runs ran, and put their counts into pytest's last line."""
    if not EMULATED_TIER:
        return
    terminalreporter.write_sep("-", "emulated GPU tests (CUPYATTN_EMULATE=1, tests/emu)")
    for label, run in EMULATED_TIER.items():
        counts = {k: v for k, v in run.items() if k != "seconds"}
        terminalreporter.write_line(f"{label}: " + ", ".join(f"{n} {k}" for k, n in counts.items())
                                    + f" in {run['seconds']:.0f} s")
        for k in ("passed", "skipped", "failed"):
            if counts.get(k):
                terminalreporter.stats.setdefault(f"emulated {k}", []).extend(
                    types.SimpleNamespace(count_towards_summary=True) for _ in range(counts[k]))
    terminalreporter.write_line("The `gpu` tests skipped above ran there, on the CPU emulator: evidence about "
                                "kernel logic, not GPU results.")


# Under the emulator, a `gpu` test whose first run took under EXTRA_SCHEDULES_BELOW_S runs again
# under EXTRA_SCHEDULES more schedules (seed bases "<test id>#schedule1", ...), until this process
# has spent EXTRA_SCHEDULES_BUDGET_S on reruns: several schedules where they are cheap, within CI's
# time. CUPYATTN_EMU_SCHEDULES=n (n >= 1) runs every `gpu` test under n schedules instead.
EXTRA_SCHEDULES, EXTRA_SCHEDULES_BELOW_S, EXTRA_SCHEDULES_BUDGET_S = 2, 0.25, 60.0
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


def pytest_collection_modifyitems(config, items):
    if EMULATE:  # very large cases would take hours on the CPU emulator
        skip_emu = pytest.mark.skip(reason="not run under CUPYATTN_EMULATE (too large for the CPU emulator)")
        for item in items:
            if "no_emu" in item.keywords:
                item.add_marker(skip_emu)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_report():
    """``compile_report(spec_name=None) -> (reports, errors)``: the offline NVRTC compile check
    (_compile_check.check_arches(): every arch of ARCHES the installed NVRTC knows, or those of
    CUPYATTN_CHECK_ARCHES) of one spec, or of all, run at most once per spec per test session."""
    import cupyattn
    from cupyattn._compile_check import check_arches, run_check

    done: dict = {}

    def get(spec_name=None):
        if spec_name is None:
            parts = [get(s.name) for s in cupyattn.all_specs()]
            return [r for p in parts for r in p[0]], [e for p in parts for e in p[1]]
        if spec_name not in done:
            done[spec_name] = run_check(spec_name, check_arches())
        return done[spec_name]

    return get


def expected_builds(spec, exprs=None):
    """Sorted (name expression, arch) pairs the compile gate builds for ``spec`` (optionally only
    those of ``exprs``): per gate arch, what a device of that compute capability can run."""
    from cupyattn._compile_check import check_arches

    keep = None if exprs is None else set(exprs)
    return sorted((e, f"sm_{a}a" if spec.sm90a else f"sm_{a}") for a in check_arches()
                  for e in spec.exprs_for(int(a)) if keep is None or e in keep)


DTYPES = ("float32", "float16", "bfloat16")
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def np_dtype(name: str):
    return np.dtype(config.BFLOAT16 if name == "bfloat16" else name)


def device_cannot_run(op: str, impl: str, dtype, head_dim: int | None = None) -> str | None:
    """Why the device cannot run an explicit ``impl`` of ``op`` for ``dtype`` inputs at
    ``head_dim``, or None when it can: the compute capability the dispatch sees (a real device,
    lowered by CUPYATTN_ARCH, or the emulator's CUPYATTN_EMU_ARCH) is below what config.IMPL_MIN_CC
    (and IMPL_MIN_CC_BY_HEAD_DIM) ask. That such a call raises ComputeCapabilityError before any
    launch is tests/test_gpu_families.py's to check."""
    from cupyattn import _loader

    dt = np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    cc = _loader.device_compute_capability()
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
