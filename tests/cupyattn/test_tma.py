"""cupyattn/tma.py: the TMA rules (CPU tier: no device needed), the driver encoder's marshalling
through a stand-in of cuda-bindings (the real one needs a driver), and the cache (GPU tier: on the
emulator its own encoder, on a GPU the driver's)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from cupyattn import device, tma

F16 = np.dtype(np.float16)


@pytest.mark.parametrize("args,why", [
    ((0, F16, (64, 32), (128,), (64, 16)), None),
    ((0, F16, (64, 32, 3, 2), (128, 4096, 12288), (64, 16, 1, 1)), None),
    ((0, np.float64, (8, 8), (64,), (8, 8)), "has no TMA element type"),
    ((8, F16, (64, 32), (128,), (64, 16)), "base address is 8 bytes past a 16-byte boundary"),
    ((0, F16, (63, 32), (126,), (64, 16)), "stride of 126 bytes along dimension 1"),
    ((0, F16, (64, 32), (0,), (64, 16)), "stride of 0 bytes"),
    ((0, F16, (64, 32), (2**40,), (64, 16)), "below 2^40"),
    ((0, F16, (64, 2**32 + 1), (128,), (64, 16)), "dimension 1 has 4294967297 elements"),
    ((0, F16, (64, 32), (128,), (64, 257)), "each side 1..256"),
    ((0, F16, (64, 32), (128,), (12, 16), 0), "the inner row a multiple of 16 bytes"),
    ((0, F16, (64, 32), (128,), (32, 16)), "a 128-byte swizzle with an inner box row of 64 bytes"),
    ((0, F16, (64, 32), (128,), (32, 16), 48), "swizzle 48"),
    ((0, F16, (64,) * 6, (128,) * 5, (64,) * 6), "TMA: 1 to 5 dimensions"),
])
def test_problem_names_the_rule(args, why):
    got = tma.problem(*args)
    assert (got is None) if why is None else (why in got), got


def test_driver_encoder_marshals_cuda_h_arguments(monkeypatch):
    """What reaches cuTensorMapEncodeTiled through cuda-bindings: cuuint64/32 wrappers (plain ints
    are refused by cuda-bindings 12.9 for the arrays), enum types, and 128 bytes back."""
    calls = []

    class Wrap(int):
        pass

    class Enum:
        def __init__(self, v):
            self.v = v

    def encode(*args):
        calls.append(args)
        return fake.CUresult.CUDA_SUCCESS, types.SimpleNamespace(opaque=list(range(16)))

    fake = types.SimpleNamespace(
        cuuint64_t=type("cuuint64_t", (Wrap,), {}), cuuint32_t=type("cuuint32_t", (Wrap,), {}),
        CUtensorMapDataType=Enum, CUtensorMapInterleave=Enum, CUtensorMapSwizzle=Enum,
        CUtensorMapL2promotion=Enum, CUtensorMapFloatOOBfill=Enum,
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), cuTensorMapEncodeTiled=encode)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    monkeypatch.setitem(sys.modules, "cuda.bindings", types.SimpleNamespace(driver=fake))
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(bindings=types.SimpleNamespace(driver=fake)))
    raw = tma._driver_encode_tiled(6, 2, 4096, (64, 32), (128,), (64, 16), (1, 1), 0, 3, 3, 0)
    assert raw == np.arange(16, dtype=np.uint64).tobytes()
    (dt, rank, ptr, dims, strides, box, est, il, sw, l2, oob), = calls
    assert (dt.v, rank, ptr, il.v, sw.v, l2.v, oob.v) == (6, 2, 4096, 0, 3, 3, 0)
    assert [type(x).__name__ for x in dims + strides] == ["cuuint64_t"] * 3
    assert [type(x).__name__ for x in box + est] == ["cuuint32_t"] * 4
    assert (dims, strides, box, est) == ([64, 32], [128], [64, 16], [1, 1])
    monkeypatch.setattr(fake, "cuTensorMapEncodeTiled", lambda *a: ("CUDA_ERROR_INVALID_VALUE", None))
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled refused .*CUDA_ERROR_INVALID_VALUE"):
        tma._driver_encode_tiled(6, 2, 4096, (64, 32), (128,), (64, 16), (1, 1), 0, 3, 3, 0)


@pytest.mark.gpu
def test_tensor_map_validates_then_caches():
    import cupy

    if device.compute_capability() < 90:
        pytest.skip("tensor maps need an sm_90 device")
    x = cupy.zeros((32, 64), dtype=np.float16)
    m1 = tma.tensor_map(x.data.ptr, x.dtype, (64, 32), (128,), (64, 16))
    assert m1.dtype == tma.MAP_DTYPE and m1.dtype.itemsize == 128
    assert tma.tensor_map(x.data.ptr, x.dtype, (64, 32), (128,), (64, 16)) is m1       # cached
    assert tma.tensor_map(x.data.ptr, x.dtype, (64, 32), (128,), (64, 8)) is not m1    # another box
    with pytest.raises(ValueError, match=r"gemm_nt\(\): b cannot be read by TMA: its base address is 2 bytes"):
        tma.tensor_map(x.data.ptr + 2, x.dtype, (63, 32), (128,), (64, 16), fn="gemm_nt", what="b")
