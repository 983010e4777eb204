"""Scaled dot-product attention over CuPy arrays: fused FlashAttention-2 kernels (SIMT for every
dtype, tensor-core mma.sync for fp16/bf16) and a split (naive) pipeline built from cupyattn's GEMM
and softmax.

Layout ``[B, H, S, D]``; K/V may have fewer heads than Q (GQA/MQA); causal masks with Sq != Sk
are aligned bottom-right. See ``kernels_cu/flash_attn.cu`` for the kernel and its tile table;
``impl="wgmma"`` (Hopper) lives in :mod:`cupyattn.flash_attn_sm90`, ``impl="wgmma_persistent"``
(Hopper; impl=None takes it for causal fp16 at D = 256) in :mod:`cupyattn.flash_attn_sm90_persistent`.
"""
from __future__ import annotations

import dataclasses
import math

import cupy
import numpy as np

from . import _checks, options
from . import flash_attn_sm90 as _sm90
from . import flash_attn_sm90_persistent as _sm90p
from ._checks import check_array, check_choice, check_last_contiguous, check_out, check_same_dtype
from . import _loader
from ._loader import KernelSpec, get_function, ptr_or_null
from .config import (DTYPES, FLASH_MMA_K_STAGES, FLASH_MMA_PAD, FLASH_MMA_SMALL_SMEM_TILES, FLASH_MMA_TILES,
                     FLASH_SIMT_TILES, HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES, a_family_has_less, cbool, ctype,
                     FLASH_MMA_FAMILY_TILES, GPU_FAMILIES, defines, flash_mma_main_tile, flash_mma_min_cc,
                     flash_mma_smem_bytes, flash_mma_tile, impl_runs_on)
from .gemm import gemm_nn, gemm_nt
from .row_softmax import softmax

IMPLS = ("flash", "flash_mma", "naive")
# sm_90 only: "wgmma" (impl=None takes it where config.ATTN_AUTO_WGMMA says; flash_attn_sm90.py) and
# its persistent variant (explicit impl only; flash_attn_sm90_persistent.py)
HOPPER_IMPLS = ("wgmma", "wgmma_persistent")
# What impl=None runs for each dtype on a GPU that has every instruction and enough shared memory
# (sm_80 and newer): the fastest correct kernel (tensor cores where they apply). default_impl()
# says what it runs on the current device.
DEFAULT_IMPL = {d: "flash_mma" if d in MMA_DTYPES else "flash" for d in DTYPES}
_FN = "attention"


def default_impl(dtype, head_dim: int) -> str:
    """What ``impl=None`` runs on the current device: DEFAULT_IMPL, except "flash" (SIMT) where the
    device lacks the tensor-core instructions for ``dtype`` (bf16 below sm_80, config.IMPL_MIN_CC)
    or registers for ``head_dim`` (config.IMPL_MIN_CC_BY_HEAD_DIM: D = 256 below sm_80), or where the
    flash_mma tile does not fit its shared memory per block (Turing's 64 KB at D = 96, 128: the
    32-key tiles of FLASH_MMA_SMALL_SMEM_TILES serve an explicit impl="flash_mma" there, and stay
    off the default until they have run on a GPU)."""
    impl = DEFAULT_IMPL[np.dtype(dtype)]
    if impl != "flash_mma":
        return impl
    cc = _loader.device_compute_capability()
    if not impl_runs_on("attention", impl, dtype, cc, head_dim):
        return "flash"
    if (head_dim in FLASH_MMA_TILES
            and flash_mma_smem_bytes(head_dim, flash_mma_main_tile(head_dim, cc)) > _loader.device_smem_optin()):
        return "flash"
    return impl


def _tile(impl: str, dtype, head_dim: int, smem_limit: int | None = None, cc: int | None = None):
    """The config tile of a fused impl ("flash" or "flash_mma") for a dtype and head dim; for
    flash_mma the one a device of compute capability ``cc`` runs within ``smem_limit`` bytes per
    block (None, None: FLASH_MMA_TILES' entry)."""
    if impl == "flash_mma":
        return flash_mma_tile(head_dim, smem_limit, cc) or flash_mma_main_tile(head_dim, cc)
    return FLASH_SIMT_TILES[(head_dim, np.dtype(dtype).itemsize)]


def _expr(impl: str, dtype, head_dim: int, causal: bool, serving: bool = False, tile=None) -> str:
    """Template name expression of the fused kernel that ``impl`` launches (with ``tile``, default
    the main one). ``serving``: the instantiation with packed / paged sequences, windows and
    softcap (causal then rides in the window, so it is only instantiated with ``causal=False``)."""
    t = tile or _tile(impl, dtype, head_dim)
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
_MMA_NEEDS = tuple((_expr("flash_mma", dt, d, c, sv, t), max(flash_mma_min_cc(dt, d), f), flash_mma_smem_bytes(d, t))
                   for dt in MMA_DTYPES for d in HEAD_DIMS
                   for f, t in [(0, t) for t in mma_tiles(dt, d)] + list(family_tiles(d).items())
                   for c, sv in _VARIANTS)
# a family tile runs on its family only, the main tile it replaces everywhere else
_FAMILIES = tuple(
    (_expr("flash_mma", dt, d, c, sv, t), fams)
    for dt in MMA_DTYPES for d in HEAD_DIMS if family_tiles(d)
    for t, fams in [(FLASH_MMA_TILES[d], tuple(f for f in GPU_FAMILIES if f not in family_tiles(d)))]
    + [(t, (f,)) for f, t in family_tiles(d).items()]
    for c, sv in _VARIANTS)
SPEC = KernelSpec(
    "flash_attn", "flash_attn.cu",
    tuple(_expr("flash", dt, d, c) for dt in DTYPES for d in HEAD_DIMS for c in (False, True))
    + tuple(_expr("flash_mma", dt, d, c) for dt in MMA_DTYPES for d in HEAD_DIMS for c in (False, True))
    # serving variants (varlen, paged, window, softcap: causal folded into the window)
    + tuple(_expr("flash", dt, d, False, True) for dt in DTYPES for d in HEAD_DIMS)
    + tuple(_expr("flash_mma", dt, d, False, True) for dt in MMA_DTYPES for d in HEAD_DIMS)
    # the 32-key flash_mma tiles of 64 KB devices
    + tuple(_expr("flash_mma", dt, d, c, sv, t) for dt in MMA_DTYPES for d in HEAD_DIMS
            for t in mma_tiles(dt, d)[1:] for c, sv in _VARIANTS)
    # the tiles of families where the main one spills (config.FLASH_MMA_FAMILY_TILES)
    + tuple(_expr("flash_mma", dt, d, c, sv, t) for dt in MMA_DTYPES for d in HEAD_DIMS
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


# --- argument checks ------------------------------------------------------------------------
def check_flash_mma_device(fn: str, dtype, head_dim: int) -> None:
    """ComputeCapabilityError before any launch when the current device cannot run flash_mma for
    ``dtype`` at ``head_dim``: instructions or registers (config.impl_min_cc), or no tile within
    its shared memory per block (config.flash_mma_tile)."""
    _checks.require_impl(fn, "attention", "flash_mma", dtype, head_dim)
    limit = _loader.device_smem_optin()
    if flash_mma_tile(head_dim, limit, _loader.device_compute_capability()) is None:
        raise _checks.ComputeCapabilityError(
            f"{fn}(): impl='flash_mma' at head_dim D={head_dim} needs {flash_mma_smem_bytes(head_dim)} B of "
            f"shared memory per block; this device allows {limit} B (use impl='flash')")


def _check_mask(mask, target):
    """Additive float mask broadcastable to ``target`` = (B, Hq, Sq, Sk) -> 4-D shape it has."""
    check_array(_FN, "mask", mask, min_ndim=0)
    if mask.ndim > 4:
        raise ValueError(f"{_FN}(): mask must have at most 4 dimensions, got shape {tuple(mask.shape)}")
    shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
    if any(s not in (1, t) for s, t in zip(shape, target)):
        raise ValueError(f"{_FN}(): mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"[B, Hq, Sq, Sk] = {list(target)}")
    return shape


def _check_key_lengths(key_lengths, b: int, sk: int):
    """-> ('device', array) or ('host', int32 NumPy array with values checked in [0, Sk])."""
    if _checks.is_device_array(key_lengths):
        kl = key_lengths
        _checks.check_device(_FN, "key_lengths", kl)
        where = "device"
    else:
        try:
            kl = np.asarray(key_lengths)
        except Exception as e:  # pragma: no cover - exotic objects
            raise TypeError(f"{_FN}(): key_lengths must be an integer array of shape [B], got "
                            f"{type(key_lengths).__name__}") from e
        where = "host"
    if kl.dtype.kind not in "iu":
        raise TypeError(f"{_FN}(): key_lengths must have an integer dtype, got {kl.dtype}")
    if tuple(kl.shape) != (b,):
        raise ValueError(f"{_FN}(): key_lengths must have shape [B] = ({b},), got {tuple(kl.shape)}")
    if where == "host" and kl.size and (kl.min() < 0 or kl.max() > sk):
        raise ValueError(f"{_FN}(): key_lengths values must lie in [0, Sk={sk}], "
                         f"got min {int(kl.min())}, max {int(kl.max())}")
    return where, kl


def _check_args(q, k, v, causal, scale, mask, key_lengths, impl, return_lse, out, window=None, softcap=None):
    """Every check of attention(), before anything is allocated or launched -> (impl, scale,
    mask shape, key lengths, Serving or None)."""
    _checks.check_bool(_FN, "causal", causal)
    _checks.check_bool(_FN, "return_lse", return_lse)
    win, cap = check_window_softcap(_FN, window, softcap, causal)
    sv = Serving(window=win, softcap=cap) if window is not None or cap > 0 else None
    if impl is not None:
        check_choice(_FN, "impl", impl, IMPLS + HOPPER_IMPLS)
    check_array(_FN, "q", q, ndim=4)
    check_array(_FN, "k", k, ndim=4)
    check_array(_FN, "v", v, ndim=4)
    check_same_dtype(_FN, "k", k, "q", q)
    check_same_dtype(_FN, "v", v, "q", q)
    auto = impl is None
    b, hq, sq, d = q.shape
    if impl is None:
        impl = default_impl(q.dtype, d)
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{_FN}(): k has shape {tuple(k.shape)}, expected [B={b}, Hkv, Sk, D={d}] "
                         f"to match q {tuple(q.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{_FN}(): v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    hkv, sk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{_FN}(): q heads Hq={hq} must be a multiple of k/v heads Hkv={hkv}")
    for what, n in (("B", b), ("Hq", hq), ("Hkv", hkv), ("Sq", sq), ("Sk", sk), ("D", d)):
        _checks.check_int32(_FN, what, n)
    if -(-b * hq // MAX_GRID_YZ) > MAX_GRID_YZ:
        raise ValueError(f"{_FN}(): B*Hq = {b * hq} (batch x query heads) is more than one launch's grid "
                         f"holds ({MAX_GRID_YZ}^2)")
    if impl != "naive" and d not in HEAD_DIMS:
        raise ValueError(f"{_FN}(): head_dim D={d} is not supported by impl={impl!r}; supported: "
                         f"{', '.join(map(str, HEAD_DIMS))} (impl='naive' takes any D)")
    if impl == "flash_mma" and np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{_FN}(): impl='flash_mma' needs float16 or bfloat16 inputs, got float32 "
                        f"(use impl='flash')")
    if impl == "flash_mma":
        check_flash_mma_device(_FN, q.dtype, d)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_last_contiguous(_FN, name, x)
    scale = (1.0 / math.sqrt(d) if d else 1.0) if scale is None else _checks.check_real(_FN, "scale", scale)
    mshape = _check_mask(mask, (b, hq, sq, sk)) if mask is not None else None
    kl = _check_key_lengths(key_lengths, b, sk) if key_lengths is not None else None
    # the call options an impl may lack (cupyattn/options.py: the table the docs are made from)
    window_used = window is not None and win != ((-1, 0) if causal else (-1, -1))
    used = [o for o, on in (("causal", causal), ("window", window_used), ("softcap", cap > 0),
                            ("mask", mask is not None), ("key_lengths", key_lengths is not None),
                            ("scale", scale is not None), ("return_lse", return_lse), ("out", out is not None)) if on]
    # impl=None takes a Hopper kernel where measured faster (config.ATTN_AUTO_PERSISTENT: causal
    # calls; ATTN_AUTO_WGMMA), for the options it has and operands TMA can read
    if (auto and causal and q.size and sk and options.supports(_FN, "wgmma_persistent", used)
            and _sm90p.auto_takes(_FN, q, lambda: _sm90p.dense_ops(q, k, v), b)):
        impl = "wgmma_persistent"
    elif auto and options.supports(_FN, "wgmma", used) and _sm90.auto_takes(q, k, v):
        impl = "wgmma"
    options.check(_FN, _FN, impl, used)
    if impl == "wgmma":
        _sm90.check(q, k, v)
    elif impl == "wgmma_persistent":
        _sm90p.check_dense(_FN, impl, q, k, v)
    if out is not None:
        check_out(_FN, out, (b, hq, sq, d), q.dtype)
        _checks.check_no_overlap(_FN, out, {"q": q, "k": k, "v": v, "mask": mask,
                                            "key_lengths": key_lengths})
    return impl, scale, mshape, kl, sv


# --- public op ------------------------------------------------------------------------------
def attention(q, k, v, causal=False, scale=None, mask=None, key_lengths=None, impl=None,
              return_lse=False, out=None, window=None, softcap=None):
    """Scaled dot-product attention ``softmax(q k^T * scale + bias) v``.

    Parameters
    ----------
    q : cupy.ndarray [B, Hq, Sq, D]
        Queries, float32 / float16 / bfloat16. Any strides, but the last dim must be contiguous.
    k, v : cupy.ndarray [B, Hkv, Sk, D]
        Keys and values, same dtype as ``q``; ``Hq % Hkv == 0`` (GQA/MQA: query head ``h`` uses
        kv head ``h // (Hq // Hkv)``; K/V are never copied or repeated).
    causal : bool
        Query ``i`` sees keys ``j <= i + Sk - Sq`` (bottom-right aligned, as FlashAttention-2).
        Flags must be bools: ``causal="False"`` is a TypeError, not a true value.
    scale : float, optional
        Multiplies ``q k^T``; default ``1 / sqrt(D)``.
    mask : cupy.ndarray, optional
        Additive float mask broadcastable to [B, Hq, Sq, Sk] (``-inf`` hides a key). The flash
        kernels read float32 through strides (0 on broadcast dims); a float16/bfloat16 mask is
        first converted to float32, and for ``flash_mma`` a mask whose key dim is strided is
        made contiguous (each a copy of the mask's own, un-broadcast size).
    key_lengths : int array [B], optional
        Keys ``j >= key_lengths[b]`` are hidden. Host values (list / NumPy) are checked to lie in
        [0, Sk]; a CuPy array is used as is (not read back: the flash kernel clamps it to [0, Sk]).
    impl : {None, "flash", "flash_mma", "naive", "wgmma", "wgmma_persistent"}
        None (default): the fastest correct kernel for the dtype on this GPU,
        ``default_impl(q.dtype, D)`` (``DEFAULT_IMPL[q.dtype]`` from sm_80 on; see docs/gpus.md).
        ``"flash"``: one fused FlashAttention-2 kernel launch (SIMT, fp32 FMA); S is
        never written to memory and only ``out`` (and ``lse``, and a B-element int32 copy of
        host key_lengths) are allocated. D must be one of
        ``cupyattn.config.HEAD_DIMS`` = (32, 64, 80, 96, 128, 256).
        ``"flash_mma"``: FlashAttention-2 on tensor cores (mma.sync m16n8k16, fp32
        accumulation, P rounded to the input dtype before P V; K/V staged by cp.async);
        float16/bfloat16 only (float16 from compute capability 7.5, bfloat16 from 8.0:
        ``ComputeCapabilityError`` below), and their default. Inputs whose base or strides are not
        16-byte aligned (e.g. ``x[..., 3:67]``) take a slower element-wise staging path.
        ``"naive"``: ``S = gemm_nt(q, k)`` [B, Hq, Sq, Sk] in memory, softmax, ``gemm_nn(P, v)``;
        any D. S is in the input dtype; for float16/bfloat16 q is first multiplied by the
        power-of-two part of ``scale`` (exactly), so S holds scaled logits and |q.k| beyond
        float16's range does not overflow. With a mask, key_lengths or return_lse, S is taken
        to float32 for the softmax.
        ``"wgmma"``: Hopper only (sm_90, H100/H200; impl=None takes it for the (dtype, D)
        pairs of config.ATTN_AUTO_WGMMA, measured faster on an H100): TMA + wgmma,
        warp-specialised (cupyattn/flash_attn_sm90.py); float16/bfloat16, D of 64, 128 or 256,
        q/k/v that TMA can read (16-byte-aligned base and strides, no broadcast or reversed
        view, else a ValueError naming the tensor and the stride); masks as ``flash_mma`` takes
        them; no window or softcap (ValueError; impl=None takes flash_mma for them).
        ``"wgmma_persistent"``: its persistent variant (cupyattn/flash_attn_sm90_persistent.py:
        one block per SM, tiles longest first in L2-sized head sections), the same inputs and
        options, window and softcap included; impl=None takes it for causal calls of the
        (dtype, D) pairs of config.ATTN_AUTO_PERSISTENT["attention"] (fp16 at D = 256, measured
        faster than wgmma on an H100; wgmma stays faster elsewhere).
    return_lse : bool
        Also return the row log-sum-exp of the scaled, masked scores.
    out : cupy.ndarray [B, Hq, Sq, D], optional
        C-contiguous, dtype of ``q``; written and returned. It must not overlap q, k, v, mask or
        key_lengths in memory (ValueError).
    window : (left, right), optional
        Sliding window (flash-attention's ``window_size``): query ``i`` sees keys ``j`` with
        ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1 leaves a side unbounded; with
        ``causal`` the right side is at most 0. Not in "naive", nor yet in "wgmma" (an
        explicit impl refuses it; impl=None takes flash_mma): ``cupyattn.options``, the table of
        every impl's options (docs/options.md).
    softcap : float, optional
        Scores become ``softcap * tanh(scale * q.k / softcap)`` before masking (Gemma 2); 0 or
        None: off, else within ``[config.SOFTCAP_MIN, config.SOFTCAP_MAX]`` (about 2.4e-38 to
        1.3e30; ValueError outside).

    Returns
    -------
    out : cupy.ndarray [B, Hq, Sq, D], dtype of ``q`` (float32 accumulation inside).
    lse : cupy.ndarray [B, Hq, Sq] float32, natural log (only with ``return_lse=True``).

    A row that sees no key at all (causal with Sq > Sk, key_lengths 0, a mask of -inf) is
    **zeros** in ``out`` (not NaN) and ``-inf`` in ``lse``.

    Examples
    --------
    >>> q = cupy.random.randn(2, 8, 1000, 64).astype(cupy.float16)
    >>> kv = cupy.random.randn(2, 2, 1000, 64).astype(cupy.float16)   # 4 query heads per kv head
    >>> o = attention(q, kv, kv, causal=True)                        # [2, 8, 1000, 64] float16
    >>> o, lse = attention(q, kv, kv, key_lengths=[1000, 17], return_lse=True)
    """
    impl, scale, mshape, kl, sv = _check_args(q, k, v, causal, scale, mask, key_lengths, impl, return_lse, out,
                                              window, softcap)
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    if out is None:
        out = cupy.empty((b, hq, sq, d), dtype=q.dtype)
    lse = cupy.empty((b, hq, sq), dtype=cupy.float32) if return_lse else None
    if out.size == 0 or sk == 0:  # empty batch, or no key for anyone -> zeros / -inf
        out.fill(0)
        if lse is not None:
            lse.fill(-np.inf)
        return (out, lse) if return_lse else out
    if kl is not None:
        where, arr = kl
        # int32 and contiguous, as the kernel reads key_lengths[b] (a no-op for the usual input)
        kl = cupy.asarray(arr, dtype=cupy.int32) if where == "host" else \
            cupy.ascontiguousarray(arr, dtype=cupy.int32)
    if mask is not None and mask.dtype != cupy.float32:
        mask = mask.astype(cupy.float32)
    if impl == "naive":
        _naive(q, k, v, causal, scale, mask, mshape, kl, out, lse)
    elif impl == "wgmma":
        _sm90.run(q, k, v, causal, scale, kl, out, lse, mask, mshape)
    elif impl == "wgmma_persistent":
        win, cap = (sv.window, sv.softcap) if sv is not None else ((-1, -1), 0.0)
        _sm90p.run_dense(q, k, v, causal, scale, kl, out, lse, mask, mshape, win, cap)
    else:
        _flash(impl, q, k, v, causal, scale, mask, mshape, kl, out, lse, sv)
    return (out, lse) if return_lse else out


# --- impl="flash" / "flash_mma": one kernel launch -----------------------------------------
def _elem_strides(x):
    return [s // x.itemsize for s in x.strides]


def _vec_flags(q, k, v, out) -> int:
    """flash_mma's ``vec`` bits: 1 q, 2 k, 4 v can be staged by 16-byte cp.async (base 16-byte
    aligned, every stride a multiple of 8 elements, so every row starts 16-byte aligned); 8 out
    takes 16-byte stores. A clear bit makes the kernel take its element-by-element path (views
    such as ``x[..., 3:67]`` of a wider array)."""
    flags = 0
    for bit, x in ((1, q), (2, k), (4, v)):
        if x.data.ptr % 16 == 0 and all(s % 8 == 0 for s in _elem_strides(x)[:-1]):
            flags |= bit
    return flags | (8 if out.data.ptr % 16 == 0 else 0)


def _flash(impl, q, k, v, causal, scale, mask, mshape, kl, out, lse, sv=None, shape=None, strides=None):
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
    tile = _tile(impl, q.dtype, d, _loader.device_smem_optin(), _loader.device_compute_capability())
    bm = tile.block_m
    if mask is not None:
        mask = mask.reshape(mshape)  # leading 1s: a view
        if impl == "flash_mma" and mshape[3] != 1 and mask.strides[3] not in (0, mask.itemsize):
            mask = cupy.ascontiguousarray(mask)  # v2 reads a mask row as one run of keys (or one)
        mstr = [0 if n == 1 else s for n, s in zip(mshape, _elem_strides(mask))]
    else:
        mstr = [0, 0, 0, 0]
    bh = b * hq
    grid = ((sq + bm - 1) // bm, min(bh, MAX_GRID_YZ), (bh + MAX_GRID_YZ - 1) // MAX_GRID_YZ)
    i64 = np.int64
    qs, ks, vs = strides if strides is not None else (_elem_strides(x)[:3] for x in (q, k, v))
    args = (q, k, v, out, ptr_or_null(lse), ptr_or_null(mask), ptr_or_null(kl),
            np.int32(b), np.int32(hq), np.int32(hkv), np.int32(sq_arg), np.int32(sk),
            *map(i64, qs), *map(i64, ks), *map(i64, vs), *map(i64, mstr),
            np.float32(scale * math.log2(math.e)))
    serving = (Serving() if sv is None else sv).args()
    expr = _expr(impl, q.dtype, d, causal and sv is None, sv is not None, tile)
    if impl == "flash_mma":
        smem = flash_mma_smem_bytes(d, tile)
        kern = get_function(SPEC, expr, dynamic_smem=smem)
        kern(grid, (tile.warps * 32,), args + (np.int32(_vec_flags(q, k, v, out)),) + serving, shared_mem=smem)
    else:
        get_function(SPEC, expr)(grid, (tile.warps * 32,), args + serving)


# --- impl="naive": gemm_nt -> softmax -> gemm_nn, S in memory -------------------------------
def _pow2_part(scale: float) -> float:
    """The power of two 2**e with 1 <= |scale| / 2**e < 2 (1.0 for scale 0)."""
    return 1.0 if scale == 0 else 2.0 ** (math.frexp(scale)[1] - 1)


def _naive(q, k, v, causal, scale, mask, mshape, kl, out, lse):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    # S is written in the input dtype: unscaled, |q.k| can pass float16's 65504 (-> inf -> NaN)
    # while the scaled logits are ordinary. So q first takes the power-of-two part of the scale
    # (exact: only exponents change) and the softmax the rest, a factor in [1, 2).
    p2 = _pow2_part(scale)
    if q.dtype != cupy.float32 and p2 != 1.0:
        q = (q.astype(cupy.float32) * np.float32(p2)).astype(q.dtype)
        scale /= p2
    # GQA without K/V copies: query heads h = hk*g .. hk*g+g-1 share kv head hk, so q viewed as
    # [B, Hkv, g*Sq, D] (a view when q is contiguous) multiplies k [B, Hkv, Sk, D] directly.
    qg = q.reshape(b, hkv, g * sq, d)
    s = gemm_nt(qg, cupy.ascontiguousarray(k)).reshape(b, hq, sq, sk)
    if mask is None and kl is None and lse is None:
        p = softmax(s, axis=-1, scale=scale, causal=causal)
    else:
        ninf = np.float32(-np.inf)
        s32 = s.astype(cupy.float32) * np.float32(scale)
        if mask is not None:  # a -inf mask entry hides its key whatever the score (NaN too)
            m4 = mask.reshape(mshape)
            s32 = cupy.where(m4 == ninf, ninf, s32 + m4)
        if kl is not None:
            j = cupy.arange(sk, dtype=cupy.int32)
            s32 = cupy.where(j[None, None, None, :] < kl[:, None, None, None], s32, ninf)
            # keys past key_lengths never contribute, whatever V holds there (0 * NaN is NaN)
            v = cupy.where(j[None, None, :, None] < kl[:, None, None, None], v, 0).astype(v.dtype, copy=False)
        if lse is not None:
            t = s32
            if causal:
                i = cupy.arange(sq)[:, None]
                t = cupy.where(cupy.arange(sk)[None, :] <= i + (sk - sq), s32, ninf)
            mx = t.max(axis=-1, keepdims=True)  # NaN for a row with a NaN score
            mx = cupy.where(mx == ninf, 0, mx)
            tot = cupy.exp(t - mx).sum(axis=-1)
            lse[...] = cupy.where(tot > 0, mx[..., 0] + cupy.log(cupy.where(tot > 0, tot, 1)),
                                  cupy.where(cupy.isnan(tot), np.float32(np.nan), ninf))
        p = softmax(s32, axis=-1, causal=causal).astype(q.dtype, copy=False)
    # out is C-contiguous, so its [B, Hkv, g*Sq, D] reshape is a view gemm_nn writes through.
    gemm_nn(p.reshape(b, hkv, g * sq, sk), cupy.ascontiguousarray(v), out=out.reshape(b, hkv, g * sq, d))
