"""What the current device is: its compute capability (CUPYATTN_ARCH applied), shared memory per
block, SM count and L2, and whether there is a usable GPU at all.

A leaf of the package: it reads CuPy and the GPU families' data (:mod:`cupyattn.gpus`), nothing
else of cupyattn, so the loader, the checks and the op modules can all ask it. Attributes are read
once per device (a ``Device.attributes`` call reads every attribute the driver has).
"""
from __future__ import annotations

import contextlib
import os

import cupy

from . import gpus

# --- is there a GPU at all? -----------------------------------------------------------------
WITHOUT_GPU = ("without one, cupyattn.reference (NumPy versions of every op), tinylm --backend numpy and "
               "python -m cupyattn check still work")


def _no_gpu_here(reason: str) -> str:
    return f"this machine has no usable CUDA GPU: {reason} (cupyattn.gpu_unavailable_reason()); {WITHOUT_GPU}"


def gpu_unavailable_reason() -> str | None:
    """None when CuPy can use a CUDA device, else one plain sentence saying what is missing."""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        import ctypes

        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "no NVIDIA GPU driver was found (libcuda.so.1 cannot be loaded)"
        if getattr(e, "status", None) == 35:  # cudaErrorInsufficientDriver
            v = cupy.cuda.runtime.runtimeGetVersion()
            return (f"the NVIDIA driver is older than the CUDA {v // 1000}.{v % 1000 // 10} runtime "
                    f"this CuPy was built for ({e})")
        return f"no usable NVIDIA GPU was found ({e})"
    if n < 1:
        return "no NVIDIA GPU was found (the driver reports 0 devices)"
    return None


class GPUUnavailableError(RuntimeError):
    """No usable CUDA device (a RuntimeError, as callers catch it); an outer
    :func:`no_gpu_explained` renames it after its own function."""


def _needs_gpu(fn: str, reason: str) -> RuntimeError:
    who = fn if " " in fn else f"{fn}()"  # a function name, or words such as "cupyattn kernel launch"
    return GPUUnavailableError(f"{who} needs a CUDA GPU: {reason} (cupyattn.gpu_unavailable_reason()); {WITHOUT_GPU}")


def require_gpu(fn: str) -> None:
    """RuntimeError naming ``fn`` when no CUDA device can be used, before CuPy fails deeper."""
    reason = gpu_unavailable_reason()
    if reason:
        raise _needs_gpu(fn, reason)


@contextlib.contextmanager
def no_gpu_explained(fn: str):
    """Around a first device allocation or query: a CUDA runtime error on a machine without a
    usable GPU becomes :func:`require_gpu`'s RuntimeError naming ``fn`` and what still works, one
    message with CuPy's own error out of the traceback (``from None``: CuPy's chain says the same
    in 30 lines)."""
    try:
        yield
    except (cupy.cuda.runtime.CUDARuntimeError, GPUUnavailableError):  # also from an inner guard
        reason = gpu_unavailable_reason()
        if reason is None:
            raise
    else:
        return
    raise _needs_gpu(fn, reason) from None


class ComputeCapabilityError(ValueError):
    """An explicit ``impl=`` that the current device's compute capability cannot run."""



# --- the current device ------------------------------------------------------------------------
ARCH_ENV = "CUPYATTN_ARCH"


def arch_override() -> int | None:
    """CUPYATTN_ARCH=75 (tests, benchmarks): dispatch as a compute capability 7.5 device and build
    the kernels' ptx.cuh branches for it; it may only lower the device's own (a T4's kernels run on
    an H100, not the reverse)."""
    v = os.environ.get(ARCH_ENV, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) not in gpus.GPU_FAMILIES:
        raise ValueError(f"{ARCH_ENV}={v!r}: expected one of {', '.join(map(str, gpus.GPU_FAMILIES))}")
    return int(v)


def device_arch() -> tuple[int, str]:
    """(device id, compute capability as CuPy writes it, e.g. "90") of the current device."""
    with no_gpu_explained("cupyattn kernel launch"):
        dev = cupy.cuda.Device()
        return dev.id, dev.compute_capability


def compute_capability() -> int:
    """The current device's compute capability as an int (75 for a T4, 90 for an H100), or the
    CUPYATTN_ARCH override when it is lower; what every impl choice reads."""
    _, arch = device_arch()
    cc, target = int(arch), arch_override()
    return cc if target is None else min(cc, target)


_ATTRIBUTES: dict = {}   # device id -> the attributes read from it


def _attribute(name: str) -> int:
    with no_gpu_explained("cupyattn kernel launch"):
        dev = cupy.cuda.Device()
        got = _ATTRIBUTES.get(dev.id)
        if got is None:
            a = dev.attributes
            got = _ATTRIBUTES[dev.id] = {k: int(a[k]) for k in
                                         ("MaxSharedMemoryPerBlockOptin", "MultiProcessorCount", "L2CacheSize")}
        return got[name]


def smem_optin() -> int:
    """Shared memory per block with the opt-in attribute on the current device (the family's limit
    under a CUPYATTN_ARCH override): what decides whether an auto choice's tile fits."""
    limit = _attribute("MaxSharedMemoryPerBlockOptin")
    if arch_override() is not None:
        limit = min(limit, gpus.gpu_family(compute_capability()).smem_optin)
    return limit


def sm_count() -> int:
    """Streaming multiprocessors of the current device (persistent grids, split-KV waves)."""
    return _attribute("MultiProcessorCount")


def l2_bytes() -> int:
    """L2 cache bytes of the current device."""
    return _attribute("L2CacheSize")
