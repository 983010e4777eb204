"""Tensor maps for Hopper's Tensor Memory Accelerator (TMA): build, validate, cache.

A tensor map (CUDA's ``CUtensorMap``, 128 opaque bytes) describes a strided tensor in global
memory and the box one ``cp.async.bulk.tensor`` copy moves between it and shared memory. A kernel
takes it by value (``const __grid_constant__ TmaMap``, kernels_cu/ptx_sm90.cuh); on the host it is
a NumPy structured scalar of 128 bytes, which CuPy passes by value.

Dimensions are listed innermost first (TMA's order): a row-major ``[rows, cols]`` matrix is
``dims=(cols, rows)``, ``strides=(row_stride_bytes,)``. What TMA cannot take (cuda.h,
``cuTensorMapEncodeTiled``): a base address that is not 16-byte aligned, a stride that is not a
positive multiple of 16 bytes (or reaches 2^40), more than 2^32 elements along a dimension, a box
side outside 1..256, an inner box row that is not a multiple of 16 bytes. This module also asks a
swizzled box's inner row to be exactly one swizzle span (32, 64 or 128 bytes), the layout the
kernels' wgmma descriptors assume. :func:`problem` says which rule an input breaks (callers take
another kernel for it, or raise); :func:`tensor_map` validates, then encodes through the driver
(NVIDIA's ``cuda-bindings`` package, a dependency of cupyattn) on a GPU, or through the encoder
of the tests' CPU emulator, and caches the result per (device, address, dtype, shape, strides,
box, swizzle): a map holds no reference to the memory, so a cached one is right for any array
at that address with that layout.

Two rules the driver cannot check, measured on an H100 (2026-11-26): a copy's innermost start
coordinate must lie on a 16-byte boundary (else an illegal instruction), and a TMA store bounds
the innermost dimension only at its extent rounded up to 16 bytes (it writes up to 15 bytes past
a row whose extent is not a multiple of 16 bytes; loads zero-fill from the extent). The kernels
only load, at multiples of 64 elements.

>>> m = tensor_map(a.data.ptr, a.dtype, dims=(K, M), strides=(a.strides[0],), box=(64, 128))
"""
from __future__ import annotations

import collections
import threading

import cupy
import numpy as np

from .config import BFLOAT16, FLOAT16, FLOAT32

# CUtensorMapDataType of the dtypes the kernels move
DTYPE_ENUM = {FLOAT16: 6, BFLOAT16: 9, FLOAT32: 7}
SWIZZLE_ENUM = {0: 0, 32: 1, 64: 2, 128: 3}      # CU_TENSOR_MAP_SWIZZLE_NONE / _32B / _64B / _128B
L2_PROMOTION_256B = 3                             # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
MAP_DTYPE = np.dtype([("opaque", np.uint64, (16,))])  # 128 bytes, by value
CACHE_SIZE = 512

_CACHE: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def problem(ptr: int, dtype, dims, strides, box, swizzle: int = 128, names=None) -> str | None:
    """The first TMA rule the tensor breaks, in words, or None if a map can be built.

    ``dims`` (elements) and ``box`` innermost first; ``strides`` in bytes for dims 1..rank-1;
    ``names``: what the caller calls each dim (innermost first), for the message. A stride of 0
    on a dimension of more than one entry (a broadcast view) or a negative one (a reversed view)
    cannot be described: the message says which."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPE_ENUM:
        return f"dtype {dtype} has no TMA element type here (float16, bfloat16, float32)"
    rank, esize = len(dims), dtype.itemsize
    if not 1 <= rank <= 5 or len(box) != rank or len(strides) != rank - 1:
        return f"rank {rank} with {len(strides)} strides and a {len(box)}-d box (TMA: 1 to 5 dimensions)"
    if ptr % 16:
        return f"its base address is {ptr % 16} bytes past a 16-byte boundary (TMA needs 16-byte alignment)"
    for i, s in enumerate(strides):
        if s <= 0 or s % 16 or s >= 2**40:
            where = f"along {names[i + 1]}" if names else f"along dimension {i + 1} (innermost first)"
            view = (f" (a broadcast view: {dims[i + 1]} entries at one address)" if s == 0 else
                    " (a reversed view)" if s < 0 else "")
            return f"its stride of {s} bytes {where}{view} is not a positive multiple of 16 below 2^40"
    for i, d in enumerate(dims):
        if not 1 <= d <= 2**32:
            return f"dimension {i} has {d} elements (TMA: 1 to 2^32)"
    if any(not 1 <= b <= 256 for b in box) or (box[0] * esize) % 16:
        return f"box {tuple(box)} (each side 1..256, the inner row a multiple of 16 bytes)"
    if swizzle not in SWIZZLE_ENUM:
        return f"swizzle {swizzle} (0, 32, 64 or 128 bytes)"
    if swizzle and box[0] * esize != swizzle:
        return f"a {swizzle}-byte swizzle with an inner box row of {box[0] * esize} bytes (must be equal)"
    return None


def tensor_map(ptr: int, dtype, dims, strides, box, swizzle: int = 128, *, fn: str = "tensor_map",
               what: str = "tensor") -> np.void:
    """The tensor map of a tensor at device address ``ptr`` (see the module docstring for the
    argument order), as a 128-byte NumPy scalar to pass to a kernel. ValueError naming ``fn`` and
    ``what`` if TMA cannot take it (:func:`problem`)."""
    dims, strides, box = tuple(int(d) for d in dims), tuple(int(s) for s in strides), tuple(int(b) for b in box)
    why = problem(ptr, dtype, dims, strides, box, swizzle)
    if why is not None:
        raise ValueError(f"{fn}(): {what} cannot be read by TMA: {why}")
    dtype = np.dtype(dtype)
    key = (cupy.cuda.Device().id, ptr, dtype, dims, strides, box, swizzle)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    raw = _encoder()(DTYPE_ENUM[dtype], len(dims), ptr, dims, strides, box, (1,) * len(dims), 0,
                     SWIZZLE_ENUM[swizzle], L2_PROMOTION_256B, 0)
    value = np.frombuffer(raw, dtype=MAP_DTYPE)[0]
    with _LOCK:
        _CACHE[key] = value
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return value


def _encoder():
    """cuTensorMapEncodeTiled with cuda.h's argument order and enum values, returning 128 bytes:
    the CPU emulator's own (tests/emu/emu_tma.py) when the tests run on it, else the driver's."""
    return getattr(cupy, "_cupyattn_emulator_encode_tiled", None) or _driver_encode_tiled


def _driver_module():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6 named it so
        except ImportError:
            raise RuntimeError("tensor maps need NVIDIA's cuda-bindings package (CuPy has no "
                               "cuTensorMapEncodeTiled): pip install 'cuda-bindings>=12.8'") from None
    return driver


def _driver_encode_tiled(dtype, rank, ptr, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
    d = _driver_module()
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    err, tmap = d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType(dtype), rank, ptr, [u64(x) for x in dims], [u64(x) for x in strides],
        [u32(x) for x in box], [u32(x) for x in element_strides], d.CUtensorMapInterleave(interleave),
        d.CUtensorMapSwizzle(swizzle), d.CUtensorMapL2promotion(l2), d.CUtensorMapFloatOOBfill(oob))
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused dims={dims} strides={strides} box={box}: {err}")
    return np.array([int(x) for x in tmap.opaque], dtype=np.uint64).tobytes()
