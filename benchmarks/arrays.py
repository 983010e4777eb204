"""Device array helpers shared by the runners and the CuPy peers: dtypes, casts, inputs.

bfloat16 goes through its bits (round-to-nearest-even from float32, shift back to float32), so
these helpers work whatever bfloat16 casts the installed CuPy offers.
"""
from __future__ import annotations


def _bf16():
    from cupyattn import bfloat16

    return bfloat16


def np_dtype(name: str):
    import numpy as np

    return _bf16() if name == "bfloat16" else np.dtype(name)


def from_f32(x32, dtype: str):
    """float32 CuPy array -> dtype; bfloat16 by round-to-nearest-even on the bits (no reliance on
    CuPy's bfloat16 casts)."""
    import cupy

    dtype = str(dtype)
    if dtype != "bfloat16":
        return x32.astype(dtype, copy=False)
    bits = x32.view(cupy.uint32)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return r.astype(cupy.uint16).view(_bf16())


def to_f32(x):
    """CuPy array of a float dtype -> float32 (bfloat16 through its bits)."""
    import cupy

    if x.dtype == _bf16():
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32, copy=False)


def to_f64(x):
    """CuPy array or torch tensor (any float dtype) -> float64 CuPy array."""
    import cupy

    if not isinstance(x, cupy.ndarray):  # torch tensor from a peer
        x = cupy.from_dlpack(x.float().contiguous())
    return to_f32(x).astype(cupy.float64)


def rand(shape, dtype: str, scale: float = 1.0):
    import cupy

    return from_f32(cupy.random.standard_normal(shape, dtype=cupy.float32) * scale, dtype)
