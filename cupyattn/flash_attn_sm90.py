"""attention(..., impl="wgmma"): the Hopper kernel (``kernels_cu/flash_attn_sm90.cu``).

FlashAttention-2's algorithm in FlashAttention-3's shape: a producer warp loads Q, K and V by TMA
into mbarrier-tracked stage rings, two consumer warpgroups compute ``S = Q K^T`` and ``O += P V``
with ``wgmma``. float16 / bfloat16, head dims ``config.ATTN_WGMMA_TILES`` (64, 128, 256), causal
(bottom-right), GQA/MQA, ``key_lengths``, additive masks, ``scale``, ``return_lse``, ``out=``;
not ``window`` or ``softcap`` (cupyattn/options.py REFUSED: an explicit impl="wgmma" raises,
impl=None takes flash_mma for them; the persistent variant, impl="wgmma_persistent" in
:mod:`cupyattn.flash_attn_sm90_persistent`, implements both). It needs an sm_90 device and
q, k, v that TMA can read: 16-byte-aligned base pointers and batch / head / row strides that are
positive multiples of 16 bytes (a contiguous tensor always qualifies: D is 64, 128 or 256; a
broadcast or reversed view never does).

It passed the GPU tier and the sanitizers on an H100 (2026-11-26), and ``impl=None`` takes it on
sm_90 for the (dtype, head dim) pairs measured faster than ``flash_mma`` there
(``config.ATTN_AUTO_WGMMA``: fp16 D = 64, 128, 256, bf16 D = 128) wherever it can launch
(:func:`auto_takes`), tinylm's prefill included; other pairs keep ``flash_mma`` until timed.
:mod:`cupyattn.flash_attn` calls :func:`check` from its argument checks and :func:`run` to launch.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks, _loader
from . import config as C
from . import tma
from ._loader import KernelSpec, get_function, ptr_or_null
from .config import INT32_MAX, MMA_DTYPES, cbool, ctype
from .gemm import _filled

_FN = "attention"


def _expr(dtype, head_dim: int, causal: bool, tile: C.AttnWgmmaTile | None = None) -> str:
    """Template name expression of the kernel for a dtype, head dim and causal flag."""
    t = tile or C.ATTN_WGMMA_TILES[head_dim]
    rp, rc = C.ATTN_WGMMA_REGS
    return (f"flash_attn_wgmma<{ctype(dtype)}, {head_dim}, {t.block_n}, {t.stages}, {cbool(t.overlap)}, "
            f"{cbool(t.pingpong)}, {cbool(causal)}, {rp}, {rc}>")


SPEC = KernelSpec(
    "flash_attn_sm90", "flash_attn_sm90.cu",
    tuple(_expr(dt, d, c) for dt in MMA_DTYPES for d in C.ATTN_WGMMA_TILES for c in (False, True)),
    sm90a=True,
)


def _operand(name: str, x, rows: int):
    """(name, ptr, dims, byte strides, box) of a [B, H, S, D] tensor as the kernel's 4-D TMA box
    {D, S, H, B} (innermost first) of 64 elements x ``rows`` positions. A dimension of size 1 has
    no stride TMA would use; it gets a packed stand-in (TMA still wants a multiple of 16). Every
    other stride is x's own: a 0 (broadcast) or negative one stays, for tma.problem to refuse."""
    b, h, s, d = x.shape
    st = [x.strides[i] for i in (2, 1, 0)]
    return name, x.data.ptr, (d, s, h, b), _filled(st, (d, s, h, b), x.itemsize), (64, rows, 1, 1)


def _operands(q, k, v, head_dim: int, tile: C.AttnWgmmaTile | None = None):
    t = tile or C.ATTN_WGMMA_TILES[head_dim]
    return [_operand("q", q, t.block_m), _operand("k", k, t.block_n), _operand("v", v, t.block_n)]


def _launch_problem(q, k, v) -> str | None:
    """Why the kernel cannot take these (TMA-readable q, k, v; the grid size), or None."""
    b, hq, sq, d = q.shape
    if q.size == 0 or k.shape[2] == 0:
        return None  # nothing is launched
    for name, ptr, dims, strides, box in _operands(q, k, v, d):
        why = tma.problem(ptr, q.dtype, dims, strides, box, names=("D", "S", "H", "B"))
        if why is not None:
            return f"needs q, k, v that TMA can read: {name}: {why} (use impl='flash_mma')"
    if -(-sq // C.ATTN_WGMMA_TILES[d].block_m) * b * hq > INT32_MAX:
        return "launches one block per 128 queries of each head: B*Hq*ceil(Sq/128) is over 2^31-1"
    return None


launch_problem = _launch_problem  # what impl=None's TMA condition asks (cupyattn/options.py DEFAULTS)


def check(q, k, v) -> None:
    """impl="wgmma"'s own checks, after attention()'s generic ones and before anything is
    allocated: dtype, head dim, an sm_90 device, that TMA can read q, k and v, the grid size."""
    if np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{_FN}(): impl='wgmma' needs float16 or bfloat16 inputs, got {np.dtype(q.dtype)} "
                        f"(use impl='flash')")
    d = q.shape[3]
    if d not in C.ATTN_WGMMA_TILES:
        raise ValueError(f"{_FN}(): head_dim D={d} is not supported by impl='wgmma'; supported: "
                         f"{', '.join(map(str, C.ATTN_WGMMA_TILES))} (impl='flash_mma' takes the others)")
    _checks.require_impl(_FN, "attention", "wgmma", q.dtype)
    why = _launch_problem(q, k, v)
    if why is not None:
        raise ValueError(f"{_FN}(): impl='wgmma' {why}")


def auto_takes(q, k, v) -> bool:
    """Whether impl=None runs this kernel: on sm_90, for the (dtype, head dim) pairs of
    config.ATTN_AUTO_WGMMA (measured faster on a GPU), inputs it can launch on."""
    if (np.dtype(q.dtype), q.shape[3]) not in C.ATTN_AUTO_WGMMA or q.shape[3] not in C.ATTN_WGMMA_TILES:
        return False
    return (C.impl_runs_on("attention", "wgmma", q.dtype, _loader.device_compute_capability())
            and _launch_problem(q, k, v) is None)


def _mask_arg(mask, mshape):
    """(mask, element strides [b, h, q, k]) as the kernel reads it: 0 on broadcast dims, the key
    stride 0 or 1 (a strided key dim is copied, at the mask's own, un-broadcast size)."""
    if mask is None:
        return None, [0, 0, 0, 0]
    mask = mask.reshape(mshape)  # leading 1s: a view
    if mshape[3] != 1 and mask.strides[3] != mask.itemsize:
        mask = cupy.ascontiguousarray(mask)
    return mask, [0 if n == 1 else st // mask.itemsize for n, st in zip(mshape, mask.strides)]


def run(q, k, v, causal: bool, scale: float, kl, out, lse, mask=None, mshape=None,
        tile: C.AttnWgmmaTile | None = None) -> None:
    """Launch the kernel (arguments checked by :func:`check`; ``kl``: int32 device key lengths or
    None; ``mask``: float32, broadcastable to ``mshape`` = (B or 1, Hq or 1, Sq or 1, Sk or 1)).
    ``tile`` overrides the config entry (benchmarks.tune); its instantiation must be built."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    t = tile or C.ATTN_WGMMA_TILES[d]
    maps = [tma.tensor_map(ptr, q.dtype, dims, st, box, fn=_FN, what=name)
            for name, ptr, dims, st, box in _operands(q, k, v, d, t)]
    m_tiles = -(-sq // t.block_m)
    smem = t.smem_bytes(d)
    expr = _expr(q.dtype, d, causal, t)
    kern = get_function(SPEC if tile is None else tuning_spec(), expr, dynamic_smem=smem)
    flags = 1 if out.data.ptr % 4 == 0 else 0
    mask, mstr = _mask_arg(mask, mshape)
    i32 = np.int32
    kern((m_tiles * b * hq, 1, 1), (128 * 3, 1, 1),
         (*maps, out, ptr_or_null(lse), ptr_or_null(kl), ptr_or_null(mask), *map(np.int64, mstr),
          i32(hq), i32(hkv), i32(sq), i32(sk), i32(m_tiles), np.float32(scale * math.log2(math.e)), i32(flags)),
         shared_mem=smem)


def tuning_tiles(head_dim: int) -> list[C.AttnWgmmaTile]:
    """Candidate tiles benchmarks.tune measures: key block 64 / 128 (wgmma N) x the stage choices
    that fit 227 KB, with overlap and ping-pong both on; then the configured tile with each of
    the two switched off and with both off. For the registers of one head dim (O and S must leave
    room: D=256 keeps 64 keys)."""
    widths = (64,) if head_dim == 256 else (64, 128)
    out = [C.AttnWgmmaTile(bn, st, "tuning candidate") for bn in widths for st in C.ATTN_WGMMA_STAGE_CHOICES]
    base = C.ATTN_WGMMA_TILES[head_dim]
    out += [C.AttnWgmmaTile(base.block_n, base.stages, "tuning candidate", overlap=ov, pingpong=pp)
            for ov, pp in ((False, True), (True, False), (False, False))]
    return [t for t in out if t.smem_bytes(head_dim) <= 227 * 1024]


_TUNING_SPEC = None


def tuning_spec() -> KernelSpec:
    """A spec holding every tuning candidate (not registered with the offline check's default
    list until asked for: the candidates are many and only the tuner launches them)."""
    global _TUNING_SPEC
    if _TUNING_SPEC is None:
        exprs = tuple(dict.fromkeys(_expr(dt, d, c, t) for dt in MMA_DTYPES for d in C.ATTN_WGMMA_TILES
                                    for c in (False, True) for t in tuning_tiles(d)))
        _TUNING_SPEC = KernelSpec("flash_attn_sm90_tune", "flash_attn_sm90.cu", exprs, sm90a=True)
    return _TUNING_SPEC
