"""Input checks shared by every op. Each error names the function, the argument, what it got
and what was expected, and is raised before anything is allocated, launched or written.
Every op module calls them from one function of its own, ``_check_args``.
"""
from __future__ import annotations

import math
import numbers

import cupy
import numpy as np

from . import device as _device
from . import gpus
from .config import DTYPES as FLOAT_DTYPES
from .config import SOFTCAP_MAX, SOFTCAP_MIN
# whether there is a GPU at all, and the error of an impl it cannot run: cupyattn/device.py (the
# names the op modules read here)
from .device import (WITHOUT_GPU, ComputeCapabilityError, GPUUnavailableError, _no_gpu_here,  # noqa: F401
                     gpu_unavailable_reason, no_gpu_explained, require_gpu)
from .gpus import INT32_MAX, MAX_GRID_X, MAX_GRID_YZ


def dtype_name(dtype) -> str:
    return str(np.dtype(dtype))


def _names(dtypes) -> str:
    return ", ".join(dtype_name(d) for d in dtypes)


def is_device_array(x) -> bool:
    return isinstance(x, cupy.ndarray)


def check_device(fn: str, name: str, x) -> None:
    cur = cupy.cuda.Device().id
    if x.device.id != cur:
        raise ValueError(f"{fn}(): {name} is on device {x.device.id} but the current device is {cur}")


def check_array(fn: str, name: str, x, *, dtypes=FLOAT_DTYPES, ndim=None, min_ndim=None):
    """A CuPy array on the current device, with a supported dtype and rank."""
    if not is_device_array(x):
        kind = "a NumPy array" if isinstance(x, np.ndarray) else type(x).__name__
        hint = ""
        if isinstance(x, np.ndarray):  # cupy.asarray is the fix only where there is a GPU to move it to
            why = gpu_unavailable_reason()
            hint = f" (move it with cupy.asarray)" if why is None else f"; {_no_gpu_here(why)}"
        raise TypeError(f"{fn}(): {name} must be a cupy.ndarray on the current device, got {kind}{hint}")
    check_device(fn, name, x)
    if dtypes is not None and np.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{fn}(): {name} has dtype {dtype_name(x.dtype)}, expected one of {_names(dtypes)}")
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{fn}(): {name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{fn}(): {name} must have at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_same_dtype(fn: str, name: str, x, ref_name: str, ref) -> None:
    if np.dtype(x.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{fn}(): {name} has dtype {dtype_name(x.dtype)} but {ref_name} has {dtype_name(ref.dtype)}")


def check_freq_div(fn: str, value, d: int, name: str = "rope_freq_div", what: str = "head_dim") -> None:
    """``value`` (RoPE frequency divisors, as Llama 3's rope_freqs, one per rotation pair of ``d``
    turned dims): None, or float32 [d // 2] C-contiguous on the device; else an error naming
    ``name`` (and ``what`` d is)."""
    if value is None:
        return
    check_array(fn, name, value, dtypes=(np.dtype(np.float32),), ndim=1)
    if value.shape[0] != d // 2 or not value.flags.c_contiguous:
        raise ValueError(f"{fn}(): {name} must be C-contiguous of shape ({d // 2},) ({what} / 2), "
                         f"got {tuple(value.shape)}")


def check_last_contiguous(fn: str, name: str, x) -> None:
    """The kernels read rows as contiguous vectors: last dimension must have unit stride."""
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:  # empty arrays have any strides
        raise ValueError(f"{fn}(): {name} must be contiguous in its last dimension "
                         f"(stride {x.strides[-1] // x.itemsize} elements); pass x.copy() or cupy.ascontiguousarray(x)")


def check_out(fn: str, out, shape, dtype, name: str = "out"):
    """A caller-supplied output: right shape and dtype, C-contiguous, on the current device."""
    check_array(fn, name, out, dtypes=None)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}(): {name} has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{fn}(): {name} has dtype {dtype_name(out.dtype)}, expected {dtype_name(dtype)}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{fn}(): {name} must be C-contiguous")
    return out


def check_choice(fn: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{fn}(): {name}={value!r} is not supported; expected one of {', '.join(map(repr, choices))}")


def check_positive_int(fn: str, name: str, value, minimum: int = 1) -> int:
    return check_int(fn, name, value, minimum)


def check_int(fn: str, name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (Python or NumPy, not bool) in [minimum, maximum] -> int; TypeError / ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}(): {name} must be an integer, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}"
        raise ValueError(f"{fn}(): {name} must be an integer {' and '.join(x for x in (lo, hi) if x)}, "
                         f"got {value!r}")
    return int(value)


def check_bool(fn: str, name: str, value) -> bool:
    """A bool (Python or NumPy): a string such as "False" is an error, not a true value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}(): {name} must be True or False, got {value!r}")
    return bool(value)


def check_real(fn: str, name: str, value, *, minimum: float | None = None, strict: bool = False,
               finite: bool = True) -> float:
    """A real number (not bool, not a string), finite, and >= (> with strict) ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{fn}(): {name} must be a real number, got {value!r}")
    v = float(value)
    if finite and not math.isfinite(v):
        raise ValueError(f"{fn}(): {name} must be finite, got {value!r}")
    if minimum is not None and (v < minimum or (strict and v == minimum) or math.isnan(v)):
        raise ValueError(f"{fn}(): {name} must be finite and {'>' if strict else '>='} {minimum:g}, "
                         f"got {value!r}")
    return v


def check_softcap(fn: str, softcap) -> float:
    """``softcap`` of every attention and decode entry point -> float (0.0: off). None and 0 turn
    the cap off; any other value must be a real in [SOFTCAP_MIN, SOFTCAP_MAX] (config: the range
    whose ``softcap * log2(e)`` the kernels take as a normal float32 without overflow or a score
    flushed to 0), else ValueError naming ``softcap`` and the range (TypeError for a non-real)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{fn}(): softcap must be a real number (or None: off), got {softcap!r}")
    v = float(softcap)
    if v == 0.0:
        return 0.0
    if not SOFTCAP_MIN <= v <= SOFTCAP_MAX:  # NaN and +-inf fail here too
        raise ValueError(f"{fn}(): softcap must be finite and in [{SOFTCAP_MIN:.3g}, {SOFTCAP_MAX:.3g}] "
                         f"(0 or None: off), got {softcap!r}: the kernels cap scores with softcap * log2(e) "
                         f"as a normal float32")
    return v


def check_grid_yz(fn: str, what: str, n: int) -> int:
    """A count that becomes a launch's grid y or z dimension (a KV cache's batch, a decode call's
    batch, kv heads): ValueError naming it and the hardware limit, before anything is taken or
    launched."""
    if n > MAX_GRID_YZ:
        raise ValueError(f"{fn}(): {what} = {n} is more than a launch's grid dimension holds ({MAX_GRID_YZ}); "
                         f"split the work into calls of at most {MAX_GRID_YZ}")
    return n


def check_grid(fn: str, what: str, grid) -> None:
    """A launch's grid (x, y, z) within the hardware's limits (2^31 - 1, 65535, 65535), checked
    before anything is taken or written (a refused launch would leave a half-done call behind):
    ValueError naming the kernel and the dimension."""
    for axis, n, limit in zip("xyz", grid, (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)):
        if not 1 <= n <= limit:
            raise ValueError(f"{fn}(): {what} would need a grid {axis} of {n} blocks, outside [1, {limit}]")


def check_int32(fn: str, what: str, value: int) -> int:
    """A size or position the kernels take as int32 (ValueError naming it when it does not fit)."""
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{fn}(): {what} = {value} does not fit the kernels' 32-bit integers "
                         f"(at most {INT32_MAX})")
    return value


# --- output aliasing ---------------------------------------------------------------------------
def byte_span(x) -> tuple[int, int] | None:
    """[first, last) device bytes an array's elements occupy, or None when it is empty."""
    if x.size == 0:
        return None
    lo = hi = x.data.ptr
    for n, st in zip(x.shape, x.strides):
        ext = (n - 1) * st
        lo, hi = (lo + ext, hi) if ext < 0 else (lo, hi + ext)
    return lo, hi + x.itemsize


def same_view(a, b) -> bool:
    return (a.data.ptr == b.data.ptr and tuple(a.shape) == tuple(b.shape)
            and tuple(a.strides) == tuple(b.strides) and np.dtype(a.dtype) == np.dtype(b.dtype))


def check_no_overlap(fn: str, out, inputs: dict, in_place: tuple = (), out_name: str = "out") -> None:
    """``out`` must not share memory with any of ``inputs`` ({name: array or None}), judged by
    the byte ranges they span; it may be exactly one of the ``in_place`` inputs (same pointer,
    shape, strides and dtype), where the op documents in-place support."""
    span = byte_span(out)
    if span is None:
        return
    for name, x in inputs.items():
        if x is None or not is_device_array(x):
            continue
        other = byte_span(x)
        if other is None or other[1] <= span[0] or span[1] <= other[0]:
            continue
        if name in in_place and same_view(out, x):
            continue
        allowed = f" (exactly {out_name}={' or '.join(in_place)} is allowed: in place)" if in_place else ""
        raise ValueError(f"{fn}(): {out_name} overlaps {name} in memory; the kernel would read "
                         f"what it already overwrote: pass a separate {out_name}{allowed}")


# --- can this device run that kernel? (gpus.IMPL_MIN_CC) -------------------------------------
def _picks(op: str) -> str:
    """The alternative a refusal of an explicit impl= offers: impl=None, on the ops that take it."""
    return "; impl=None picks a kernel this device runs" if op in ("attention", "decode", "gemm") else ""


def require_impl(fn: str, op: str, impl: str, dtype, head_dim: int | None = None) -> int:
    """The device's compute capability (CUPYATTN_ARCH respected); ComputeCapabilityError naming
    ``impl``, the device and the minimum when ``impl`` of ``op`` cannot run there with ``dtype``
    inputs (at ``head_dim``), before anything is allocated or launched."""
    with no_gpu_explained(f"{fn}"):
        cc = _device.compute_capability()
    if gpus.impl_runs_on(op, impl, dtype, cc, head_dim):
        return cc
    device = f"this device ({gpus.gpu_family(cc).name}) is {cc // 10}.{cc % 10}"
    need = gpus.impl_min_cc(op, impl, dtype)
    if gpus.impl_runs_on(op, impl, dtype, cc):   # the head dim's own minimum binds
        need = gpus.impl_min_cc(op, impl, dtype, head_dim)
        why = gpus.IMPL_MIN_CC_BY_HEAD_DIM_REASON.get((op, impl), "")
        raise ComputeCapabilityError(
            f"{fn}(): impl={impl!r} at head_dim D={head_dim} needs compute capability {need // 10}.{need % 10}"
            f"{' (' + why + ')' if why else ''}; {device}{_picks(op)}")
    why = gpus.MMA_MIN_CC_REASON.get(np.dtype(dtype), "") if need in (75, 80) else ""
    if impl.startswith("wgmma"):
        why = "sm_90a code: wgmma and TMA, H100 / H200 only"
    exact = " exactly" if impl.startswith("wgmma") else ""
    raise ComputeCapabilityError(
        f"{fn}(): impl={impl!r} with {np.dtype(dtype)} inputs needs compute capability "
        f"{need // 10}.{need % 10}{exact}{' (' + why + ')' if why else ''}; {device}{_picks(op)}")
