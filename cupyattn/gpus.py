"""What the GPU families are: hardware limits, each family's shared memory and what its
instructions allow (the minimum compute capability of each kernel).

Data only (NumPy dtypes, no CuPy, no other cupyattn module): the device module
(:mod:`cupyattn.device`, the current device) and the loader read it; :mod:`cupyattn.config`
re-exports these names for the op modules and the tile tables beside them. Sources: the CUDA C
Programming Guide ("Technical Specifications per Compute Capability") for the limits, the PTX
ISA's target notes for the instruction minimums (kernels_cu/ptx.cuh's table).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# the element types the minimums are stated for (cupyattn.config.DTYPES; NumPy dtypes compare by value)
_F32, _F16, _BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)

# --- hardware and indexing limits -----------------------------------------------------------
INT32_MAX = 2**31 - 1
MAX_GRID_X = 2**31 - 1      # gridDim.x
MAX_GRID_YZ = 65535         # gridDim.y and gridDim.z
MAX_BLOCK_THREADS = 1024
STATIC_SMEM_BYTES = 48 * 1024   # static + dynamic shared memory per block without the opt-in attribute
SMEM_PER_SM_BY_ARCH = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}  # shared memory per SM (A100, H100) ...
SMEM_PER_SM = SMEM_PER_SM_BY_ARCH["sm_90"]
SMEM_PER_BLOCK_RESERVED = 1024  # ... of which the driver reserves 1 KB per resident block


# --- GPU families: which kernel each compute capability gets ---------------------------------
# What runs where. An op's impl=None takes the fastest impl (cupyattn/options.py DEFAULTS) whose
# instructions the device has (IMPL_MIN_CC) and whose shared memory fits its per-block limit; an
# explicit impl= the device cannot run raises ComputeCapabilityError (naming the impl,
# the device's compute capability and the minimum) before anything is launched. Instruction
# minimums follow the PTX ISA's target notes (kernels_cu/ptx.cuh's table): ldmatrix and
# mma.m16n8k8.f16 from sm_75, cp.async, mma.m16n8k16 and every bf16 mma from sm_80, wgmma sm_90a.


@dataclass(frozen=True)
class GpuFamily:
    name: str
    smem_optin: int   # shared memory per block with the opt-in attribute (CUDA C Programming Guide,
                      # "Technical Specifications per Compute Capability")
    kernels: str      # what the defaults dispatch to there (docs/gpus.md)
    smem_per_sm: int  # shared memory per SM (same table): how many blocks of a tile can be resident,
                      # so what a __launch_bounds__ minimum may ask for there (-DCUPYATTN_SMEM_PER_SM)


MIN_COMPUTE_CAPABILITY = 70   # Volta: the SIMT kernels (cp.async helpers become plain copies)
GPU_FAMILIES = {
    70: GpuFamily("Volta (V100)", 96 * 1024, "SIMT kernels only: no ldmatrix / mma.m16n8k8 before sm_75",
                  96 * 1024),
    75: GpuFamily("Turing (T4, RTX 20)", 64 * 1024,
                  "fp16 tensor cores as two mma.m16n8k8 per m16n8k16, cp.async as plain copies; bf16 and "
                  "fp32 SIMT; tiles over 64 KB of shared memory fall back (GEMM takes a 2-stage tile)",
                  64 * 1024),
    80: GpuFamily("Ampere (A100)", 163 * 1024, "every mma.sync kernel, fp16 and bf16, cp.async pipelines",
                  164 * 1024),
    86: GpuFamily("Ampere (RTX 30, A10, A40)", 99 * 1024, "as sm_80; tiles over 99 KB fall back", 100 * 1024),
    89: GpuFamily("Ada (RTX 40, L4, L40)", 99 * 1024, "as sm_86", 100 * 1024),
    90: GpuFamily("Hopper (H100, H200)", 227 * 1024, "as sm_80, and the wgmma kernels (sm_90a) where an H100 run "
                  "measured them faster: attention fp16 D 64/128/256 and bf16 D 128, GEMM fp16/bf16 M, N, K >= 4096; "
                  "opt-in: PDL", 228 * 1024),
    100: GpuFamily("Blackwell (B200)", 227 * 1024, "as sm_90 without the sm_90a kernels", 228 * 1024),
    120: GpuFamily("Blackwell (RTX 50)", 99 * 1024, "as sm_86", 100 * 1024),
}


def a_family_has_less(smem_bytes: int, min_cc: int) -> bool:
    """Whether some family that runs code of compute capability ``min_cc`` allows fewer than
    ``smem_bytes`` of shared memory per block: where a smaller-smem tile variant is instantiated."""
    return any(f.smem_optin < smem_bytes for c, f in GPU_FAMILIES.items() if c >= min_cc)


def gpu_family_key(cc: int) -> int:
    """The GPU_FAMILIES key of compute capability ``cc`` (e.g. 87 -> 86: the newest at or below)."""
    known = [c for c in GPU_FAMILIES if c <= cc]
    if not known:
        raise ValueError(f"compute capability {cc // 10}.{cc % 10} is below the minimum "
                         f"{MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10} (sm_{MIN_COMPUTE_CAPABILITY})")
    return max(known)


def gpu_family(cc: int) -> GpuFamily:
    """The family of compute capability ``cc`` (e.g. 87 -> the sm_86 row: the newest at or below)."""
    return GPU_FAMILIES[gpu_family_key(cc)]


# tensor-core (mma.sync) kernels by input type: the minimum and why
MMA_MIN_CC = {_F16: 75, _BF16: 80}
MMA_MIN_CC_REASON = {_F16: "ldmatrix and mma.sync.m16n8k8.f16 exist from sm_75",
                     _BF16: "mma.sync with bf16 inputs exists from sm_80"}
# (op, impl) -> {dtype: minimum compute capability}; an impl not listed runs from MIN_COMPUTE_CAPABILITY
IMPL_MIN_CC = {
    ("attention", "flash_mma"): MMA_MIN_CC,
    ("decode", "mma"): MMA_MIN_CC,
    ("gemm", "mma"): MMA_MIN_CC,
    ("gemm", "skinny"): MMA_MIN_CC,                 # fp32 skinny is FMA-only
    ("gemm", "wgmma"): {_F16: 90, _BF16: 90},  # sm_90a: H100 / H200 only
    ("attention", "wgmma"): {_F16: 90, _BF16: 90},  # sm_90a (kernels_cu/flash_attn_sm90.cu)
    ("attention", "wgmma_persistent"): {_F16: 90, _BF16: 90},  # sm_90a (flash_attn_sm90.cu, persistent)
    ("fused", "skinny"): MMA_MIN_CC,                # the fused decode step's projections
    # the megakernel: its weight ring is cp.async (below sm_80 plain copies would serialise it)
    ("megakernel", "persistent"): {_F32: 80, _F16: 80, _BF16: 80},
}


# head dims at which an impl needs more than IMPL_MIN_CC says, and why. flash_mma: below sm_80 each
# m16n8k16 is two m16n8k8, and the D=256 tile (Q 64 + O 128 registers per lane) then spills 48 B on
# sm_75 (ptxas, NVRTC 12.9): sm_75 takes the SIMT flash kernel there.
IMPL_MIN_CC_BY_HEAD_DIM = {("attention", "flash_mma"): {256: 80}}
IMPL_MIN_CC_BY_HEAD_DIM_REASON = {("attention", "flash_mma"): "its registers do not fit two m16n8k8 per k-step"}


def impl_min_cc(op: str, impl: str, dtype, head_dim: int | None = None) -> int:
    """Minimum compute capability of ``impl`` of ``op`` for ``dtype`` inputs (at ``head_dim``)."""
    need = IMPL_MIN_CC.get((op, impl), {}).get(np.dtype(dtype), MIN_COMPUTE_CAPABILITY)
    return max(need, IMPL_MIN_CC_BY_HEAD_DIM.get((op, impl), {}).get(head_dim, 0))


def impl_runs_on(op: str, impl: str, dtype, cc: int, head_dim: int | None = None) -> bool:
    """Whether a device of compute capability ``cc`` has the instructions (and registers) ``impl``
    needs for ``dtype`` inputs at ``head_dim`` (None: any head dim the impl takes somewhere)."""
    need = impl_min_cc(op, impl, dtype, head_dim)
    return cc >= need and not (need == 90 and impl.startswith("wgmma") and cc != 90)  # sm_90a code: 9.0 only
