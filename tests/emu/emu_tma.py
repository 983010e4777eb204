"""The CPU emulator's stand-in for the driver's ``cuTensorMapEncodeTiled``: the same arguments (enum
values of cuda.h), the driver's documented requirements checked independently of cupyattn/tma.py
(which validates first; a case it lets through that the driver refuses fails here as it would on a
GPU, with the driver's error name), and a 128-byte map in this emulator's own format, which
emu_ptx_sm90.h decodes (struct EmuTmaDesc there; keep the two in step).
"""
from __future__ import annotations

import struct

MAGIC = 0x4D544D45  # "EMTM", EMU_TMA_MAGIC
# CUtensorMapDataType -> element bytes (the types cupyattn uses and their integer peers)
ELEMENT_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}  # CU_TENSOR_MAP_SWIZZLE_NONE, _32B, _64B, _128B
_LAYOUT = "<I5B7xQ5Q4Q5H5B"  # EmuTmaDesc


class DriverError(RuntimeError):
    """What cuTensorMapEncodeTiled returns for arguments it refuses."""


def _refuse(why: str):
    raise DriverError(f"cuTensorMapEncodeTiled: CUDA_ERROR_INVALID_VALUE ({why})")


def encode_tiled(dtype: int, rank: int, address: int, dims, strides, box, element_strides,
                 interleave: int, swizzle: int, l2_promotion: int, oob_fill: int) -> bytes:
    """The 128-byte map, after the requirements of cuda.h's cuTensorMapEncodeTiled documentation."""
    if dtype not in ELEMENT_BYTES:
        _refuse(f"tensorDataType {dtype} is not emulated")
    esize = ELEMENT_BYTES[dtype]
    if not 1 <= rank <= 5:
        _refuse("tensorRank must be 1..5")
    if not (len(dims) == len(box) == len(element_strides) == rank and len(strides) == rank - 1):
        _refuse("array lengths do not match tensorRank")
    if address % 16:
        _refuse("globalAddress must be 16-byte aligned")
    if any(not 1 <= d <= 2**32 for d in dims):
        _refuse("globalDim must be in [1, 2^32]")
    if any(s % 16 or not 0 < s < 2**40 for s in strides):
        _refuse("globalStrides must be multiples of 16 below 2^40")
    if any(not 1 <= b <= 256 for b in box) or (box[0] * esize) % 16:
        _refuse("boxDim must be in [1, 256] with boxDim[0] * element size a multiple of 16")
    if any(not 1 <= e <= 8 for e in element_strides):
        _refuse("elementStrides must be in [1, 8]")
    if interleave != 0 or oob_fill != 0:
        _refuse("interleaved layouts and NaN fill are not emulated")
    if swizzle not in SWIZZLE_BYTES:
        _refuse(f"swizzle {swizzle} is not emulated")
    if SWIZZLE_BYTES[swizzle] and box[0] * esize > SWIZZLE_BYTES[swizzle]:
        _refuse("the box's inner dimension exceeds the swizzle span")
    if not 0 <= l2_promotion <= 3:
        _refuse("l2Promotion")
    pad = lambda xs, n, v: list(xs) + [v] * (n - len(xs))  # noqa: E731
    body = struct.pack(_LAYOUT, MAGIC, rank, esize, SWIZZLE_BYTES[swizzle] // 16, 0, 0, address,
                       *pad(dims, 5, 1), *pad(strides, 4, 0), *pad(box, 5, 1), *pad(element_strides, 5, 1))
    return body + bytes(128 - len(body))
