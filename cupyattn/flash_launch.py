"""The fused attention kernels' launch (``kernels_cu/flash_attn.cu``): tiles, instantiations,
the serving arguments and the one launch every attention entry point shares.

:mod:`cupyattn.flash_attn` (dense), :mod:`cupyattn.varlen` (packed) and :mod:`cupyattn.paged`
(paged) check their own arguments, pick the impl (:func:`cupyattn.options.choose`) and call
:func:`launch` here with their sequences' addressing (:class:`Serving`, shapes and strides).

Why the kernels (these and decode.cu's) take scalar parameters, not a params struct as
FlashAttention's ``Flash_fwd_params``: under NVRTC 12.9 every struct layout tried grew the
registers of some instantiations, with no spills but past the rule that no kernel's count may
grow (offline compile check, all seven arches, 645 flash and 1658 decode pairs; 2026-11-28):
everything in a ``const __grid_constant__`` struct, up to +35 (pointers in a struct lose
``__restrict__``: NVVM honours it only on kernel parameters, so ``ld.global.nc`` went from 117 to
1 in the worst kernel); pointers as parameters and the rest in the struct, up to +34 (fields read
after the kernel's first branch go through a register copy of the struct's address, which ptxas
keeps live across the key loop instead of using constant-bank operands); that plus the hot
scalars (Hq, Sq, masks' extents, scales, vec) as parameters, +1..+7 on 86 of 645 pairs; decode
in the same hybrid, up to +48 and two new 4-byte spills on sm_100. CuPy passes a structured NumPy
scalar (``np.dtype(..., align=True)``) by value and the emulator defines ``__grid_constant__``
away, so a later NVRTC can be tried with the host side unchanged.
"""
from __future__ import annotations

import dataclasses
import math

import cupy
import numpy as np

from . import _checks, config, device, options
from ._loader import KernelSpec, cbool, ctype, defines, get_function, ptr_or_null
from .config import (DTYPES, FLASH_MMA_FAMILY_TILES, FLASH_MMA_K_STAGES, FLASH_MMA_PAD, FLASH_MMA_SMALL_SMEM_TILES,
                     FLASH_MMA_TILES, FLASH_SIMT_TILES, GPU_FAMILIES, HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES,
                     a_family_has_less, flash_mma_main_tile, flash_mma_min_cc,
                     flash_mma_smem_bytes, flash_mma_tile)


# --- tiles and instantiations ---------------------------------------------------------------
def tile_for(impl: str, dtype, head_dim: int, smem_limit: int | None = None, cc: int | None = None):
    """The config tile of a fused impl ("flash" or "flash_mma") for a dtype and head dim; for
    flash_mma the one a device of compute capability ``cc`` runs within ``smem_limit`` bytes per
    block (None, None: FLASH_MMA_TILES' entry)."""
    if impl == "flash_mma":
        return flash_mma_tile(head_dim, smem_limit, cc) or flash_mma_main_tile(head_dim, cc)
    return FLASH_SIMT_TILES[(head_dim, np.dtype(dtype).itemsize)]


def expr(impl: str, dtype, head_dim: int, causal: bool, serving: bool = False, tile=None) -> str:
    """Template name expression of the fused kernel that ``impl`` launches (with ``tile``, default
    the main one). ``serving``: the instantiation with packed / paged sequences, windows and
    softcap (causal then rides in the window, so it is only instantiated with ``causal=False``)."""
    t = tile or tile_for(impl, dtype, head_dim)
    name = "flash_attn_mma" if impl == "flash_mma" else "flash_attn_fwd"
    tail = ", true" if serving else ""
    return f"{name}<{ctype(dtype)}, {head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {cbool(causal)}{tail}>"


def mma_tiles(dtype, head_dim: int) -> tuple:
    """Every flash_mma tile the spec instantiates for (dtype, D): the main one, and the 32-key tile
    where a family that runs this dtype at this D allows less shared memory per block (fp16 on
    Turing at D = 96, 128)."""
    small = FLASH_MMA_SMALL_SMEM_TILES.get(head_dim)
    need = a_family_has_less(flash_mma_smem_bytes(head_dim), flash_mma_min_cc(dtype, head_dim))
    return (FLASH_MMA_TILES[head_dim],) + ((small,) if small and need else ())


def family_tiles(head_dim: int) -> dict:
    """{GPU_FAMILIES key: tile} of the families that run their own flash_mma tile at ``head_dim``
    in place of FLASH_MMA_TILES' (config.FLASH_MMA_FAMILY_TILES)."""
    return {f: tiles[head_dim] for f, tiles in FLASH_MMA_FAMILY_TILES.items() if head_dim in tiles}


_VARIANTS = ((False, False), (True, False), (False, True))   # (causal, serving) of each tile
_MMA_NEEDS = tuple((expr("flash_mma", dt, d, c, sv, t), max(flash_mma_min_cc(dt, d), f), flash_mma_smem_bytes(d, t))
                   for dt in MMA_DTYPES for d in HEAD_DIMS
                   for f, t in [(0, t) for t in mma_tiles(dt, d)] + list(family_tiles(d).items())
                   for c, sv in _VARIANTS)
# a family tile runs on its family only, the main tile it replaces everywhere else
_FAMILIES = tuple(
    (expr("flash_mma", dt, d, c, sv, t), fams)
    for dt in MMA_DTYPES for d in HEAD_DIMS if family_tiles(d)
    for t, fams in [(FLASH_MMA_TILES[d], tuple(f for f in GPU_FAMILIES if f not in family_tiles(d)))]
    + [(t, (f,)) for f, t in family_tiles(d).items()]
    for c, sv in _VARIANTS)
SPEC = KernelSpec(
    "flash_attn", "flash_attn.cu",
    tuple(expr("flash", dt, d, c) for dt in DTYPES for d in HEAD_DIMS for c in (False, True))
    + tuple(expr("flash_mma", dt, d, c) for dt in MMA_DTYPES for d in HEAD_DIMS for c in (False, True))
    # serving variants (varlen, paged, window, softcap: causal folded into the window)
    + tuple(expr("flash", dt, d, False, True) for dt in DTYPES for d in HEAD_DIMS)
    + tuple(expr("flash_mma", dt, d, False, True) for dt in MMA_DTYPES for d in HEAD_DIMS)
    # the 32-key flash_mma tiles of 64 KB devices
    + tuple(expr("flash_mma", dt, d, c, sv, t) for dt in MMA_DTYPES for d in HEAD_DIMS
            for t in mma_tiles(dt, d)[1:] for c, sv in _VARIANTS)
    # the tiles of families where the main one spills (config.FLASH_MMA_FAMILY_TILES)
    + tuple(expr("flash_mma", dt, d, c, sv, t) for dt in MMA_DTYPES for d in HEAD_DIMS
            for t in family_tiles(d).values() for c, sv in _VARIANTS),
    defines(FLASH_MMA_PAD=FLASH_MMA_PAD, FLASH_MMA_K_STAGES=FLASH_MMA_K_STAGES),
    needs=_MMA_NEEDS, families=_FAMILIES)


@dataclasses.dataclass(frozen=True)
class Serving:
    """The serving arguments of one fused launch (kernels_cu/flash_attn.cu FLASH_SERVING_PARAMS):
    packed query / key offsets, a block table, window (-1: unbounded; causal folded in as
    right = 0) and softcap (0: off). ``Serving()`` is a plain call."""
    cu_q: object = None
    cu_k: object = None
    block_table: object = None
    log2_page: int = 0
    num_pages: int = 0
    window: tuple = (-1, -1)
    softcap: float = 0.0

    @property
    def active(self) -> bool:
        return (self.cu_q is not None or self.cu_k is not None or self.block_table is not None
                or self.window != (-1, -1) or self.softcap > 0)

    def args(self):
        bt = self.block_table
        return (ptr_or_null(self.cu_q), ptr_or_null(self.cu_k), ptr_or_null(bt),
                np.int32(bt.shape[1] if bt is not None else 0), np.int32(self.log2_page),
                np.int32(self.num_pages), np.int32(self.window[0]), np.int32(self.window[1]),
                np.float32(self.softcap * math.log2(math.e)))


def check_window_softcap(fn: str, window, softcap, causal: bool):
    """``window`` (None or (left, right), ints >= -1) and ``softcap`` (None, 0 or a real in
    config's [SOFTCAP_MIN, SOFTCAP_MAX]: _checks.check_softcap) -> (left, right) with causal
    folded in as right = 0 (``right`` = min(right, 0)), and the softcap as a float (0 = off).
    Bounds above 2**30 mean unbounded (-1)."""
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"{fn}(): window must be None or a pair (left, right) of ints >= -1, got {window!r}")
        left, right = (_checks.check_int(fn, f"window[{i}]", w, -1) for i, w in enumerate(window))
    if causal:
        right = 0 if right < 0 else min(right, 0)
    left, right = (-1 if w > 2**30 else w for w in (left, right))
    return (left, right), _checks.check_softcap(fn, softcap)


def check_flash_mma_device(fn: str, dtype, head_dim: int) -> None:
    """ComputeCapabilityError before any launch when the current device cannot run flash_mma for
    ``dtype`` at ``head_dim``: instructions or registers (config.impl_min_cc), or no tile within
    its shared memory per block (config.flash_mma_tile)."""
    _checks.require_impl(fn, "attention", "flash_mma", dtype, head_dim)
    limit = device.smem_optin()
    if flash_mma_tile(head_dim, limit, device.compute_capability()) is None:
        raise _checks.ComputeCapabilityError(
            f"{fn}(): impl='flash_mma' at head_dim D={head_dim} needs {flash_mma_smem_bytes(head_dim)} B of "
            f"shared memory per block; this device allows {limit} B (use impl='flash')")


# --- head dims the kernels lack: zero-padded copies --------------------------------------------
def fused_dims(impl: str | None) -> tuple:
    """The head dims ``impl`` (None: the fused kernels impl=None picks from) has kernels for; a dense
    or packed call of another D up to the largest runs on copies zero-padded to the next one
    (config.padded_head_dim), as FlashAttention-2 pads to its kernels' head dims."""
    if impl == "wgmma":
        return tuple(config.ATTN_WGMMA_TILES)
    if impl == "wgmma_persistent":
        return tuple(config.ATTN_WGMMA_PERSISTENT_TILES)
    return HEAD_DIMS


def padded_copy(x, dk: int, launches: bool = True):
    """A C-contiguous copy of ``x`` [..., D] zero-padded to [..., dk]: q.k is unchanged and the first
    D columns of P V are (zeros add nothing). Where nothing is launched, a view of one zero of that
    shape (no memory: only its shape is read)."""
    if not launches:
        return cupy.broadcast_to(cupy.zeros((), dtype=x.dtype), x.shape[:-1] + (dk,))
    y = cupy.zeros(x.shape[:-1] + (dk,), dtype=x.dtype)
    y[..., :x.shape[-1]] = x
    return y


# --- the launch -------------------------------------------------------------------------------
def elem_strides(x):
    return [s // x.itemsize for s in x.strides]


def vec_flags(q, k, v, out) -> int:
    """flash_mma's ``vec`` bits: 1 q, 2 k, 4 v can be staged by 16-byte cp.async (base 16-byte
    aligned, every stride a multiple of 8 elements, so every row starts 16-byte aligned); 8 out
    takes 16-byte stores. A clear bit makes the kernel take its element-by-element path (views
    such as ``x[..., 3:67]`` of a wider array)."""
    flags = 0
    for bit, x in ((1, q), (2, k), (4, v)):
        if x.data.ptr % 16 == 0 and all(s % 8 == 0 for s in elem_strides(x)[:-1]):
            flags |= bit
    return flags | (8 if out.data.ptr % 16 == 0 else 0)


def launch(impl, q, k, v, causal, scale, mask, mshape, kl, out, lse, sv=None, shape=None, strides=None):
    """The one launch of the fused kernel (v1 SIMT or v2 tensor cores). ``sv``: Serving
    arguments (then the serving instantiation runs, causal given as the window); ``shape``
    (B, Hq, Sq rows per grid column, Hkv, Sq argument, Sk argument) and ``strides`` ((sb, sh, ss)
    in elements for q, k, v) for packed or paged calls, whose arrays are not [B, H, S, D]."""
    sv = sv if sv is not None and sv.active else None
    if shape is None:
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        sq_arg = sq
    else:
        b, hq, sq, hkv, sq_arg, sk = shape
        d = q.shape[-1]
    tile = tile_for(impl, q.dtype, d, device.smem_optin(), device.compute_capability())
    bm = tile.block_m
    if mask is not None:
        mask = mask.reshape(mshape)  # leading 1s: a view
        if impl == "flash_mma" and mshape[3] != 1 and mask.strides[3] not in (0, mask.itemsize):
            mask = cupy.ascontiguousarray(mask)  # v2 reads a mask row as one run of keys (or one)
        mstr = [0 if n == 1 else s for n, s in zip(mshape, elem_strides(mask))]
    else:
        mstr = [0, 0, 0, 0]
    bh = b * hq
    grid = ((sq + bm - 1) // bm, min(bh, MAX_GRID_YZ), (bh + MAX_GRID_YZ - 1) // MAX_GRID_YZ)
    i64 = np.int64
    qs, ks, vs = strides if strides is not None else (elem_strides(x)[:3] for x in (q, k, v))
    args = (q, k, v, out, ptr_or_null(lse), ptr_or_null(mask), ptr_or_null(kl),
            np.int32(b), np.int32(hq), np.int32(hkv), np.int32(sq_arg), np.int32(sk),
            *map(i64, qs), *map(i64, ks), *map(i64, vs), *map(i64, mstr),
            np.float32(scale * math.log2(math.e)))
    serving = (Serving() if sv is None else sv).args()
    name = expr(impl, q.dtype, d, causal and sv is None, sv is not None, tile)
    if impl == "flash_mma":
        smem = flash_mma_smem_bytes(d, tile)
        kern = get_function(SPEC, name, dynamic_smem=smem)
        kern(grid, (tile.warps * 32,), args + (np.int32(vec_flags(q, k, v, out)),) + serving, shared_mem=smem)
    else:
        get_function(SPEC, name)(grid, (tile.warps * 32,), args + serving)




# --- impl=None ---------------------------------------------------------------------------------
def choose(entry: str, q, head_dim: int, *, used=(), causal: bool = False, launches: bool = True,
           page_size: int = 0, problem=None) -> str:
    """What ``impl=None`` of attention entry point ``entry`` runs for this call on the current device:
    options.DEFAULTS[entry]'s first row whose conditions hold. ``problem(impl)``: why TMA cannot read
    the call's operands for a Hopper ``impl`` (None: no Hopper row applies)."""
    return options.choose(options.Call(entry, q.dtype, head_dim, device.compute_capability(),
                                       device.smem_optin(), tuple(used), causal, launches, page_size,
                                       problem=problem))
