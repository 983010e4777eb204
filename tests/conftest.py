"""Shared test helpers: the `gpu` marker, the compile-report fixture, inputs and tolerances.

Tests that need device arrays (kernel runs and the argument checks, which take CuPy arrays) are
marked `gpu`: they run on a CUDA device, or on the CPU emulator (CUPYATTN_EMULATE=1, tests/emu),
which the CPU tier drives in a subprocess (tests/test_emulated_gpu_tier.py).
"""
from __future__ import annotations

import os
import sys
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
    (every arch of _compile_check.ARCHES the installed NVRTC knows) of one spec, or of all, run at
    most once per spec per test session."""
    import cupyattn
    from cupyattn._compile_check import run_check

    done: dict = {}

    def get(spec_name=None):
        if spec_name is None:
            parts = [get(s.name) for s in cupyattn.all_specs()]
            return [r for p in parts for r in p[0]], [e for p in parts for e in p[1]]
        if spec_name not in done:
            done[spec_name] = run_check(spec_name)
        return done[spec_name]

    return get


DTYPES = ("float32", "float16", "bfloat16")
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def np_dtype(name: str):
    return np.dtype(config.BFLOAT16 if name == "bfloat16" else name)


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


def assert_close(out, ref, dtype: str, tol: float | None = None):
    """Relative Frobenius error within the dtype's tolerance, and no NaN anywhere."""
    out = to_host(out) if not isinstance(out, np.ndarray) else np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not np.isnan(out).any(), "output has NaN (unwritten or invalid elements)"
    tol = TOL[dtype] if tol is None else tol
    denom = max(np.linalg.norm(ref), 1e-30)
    err = np.linalg.norm(out - ref) / denom
    # plus what rounding the exact result to the output dtype costs: fp16 outputs under 6.1e-5
    # are subnormal (softmax over 1e6 columns gives ~1e-6, 2^-24 apart), which no kernel can beat
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = np.asarray(ref.astype(np_dtype(dtype)), dtype=np.float64)
    finite = np.isfinite(ref) & np.isfinite(rounded)
    floor = np.linalg.norm(np.where(finite, rounded - ref, 0.0)) / denom
    assert err <= tol + floor, f"relative error {err:.3e} > {tol:.1e} + {floor:.1e} rounding ({dtype})"
