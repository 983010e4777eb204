"""Batched GEMM over CuPy arrays: ``gemm_nt`` (a @ b^T) and ``gemm_nn`` (a @ b).

Kernels live in ``kernels_cu/gemm.cu`` (variants side by side):

=======  =====================================================================  ================
impl     kernel                                                                 dtypes
=======  =====================================================================  ================
simt     v1: smem-tiled 128x64x16, 8x4 register micro-tile per thread           f32, f16, bf16
mma      v2: tensor cores (mma.sync m16n8k16, ldmatrix), 128x128x32, 4-stage    f16, bf16
         cp.async ring with one barrier per k-tile
skinny   v3: M <= 16, gemm_nt only: streams each row of b once with 16-byte     f32, f16, bf16
         loads straight into registers (mma.sync for f16/bf16), split-K
wgmma    v4 (kernels_cu/gemm_sm90.cu, H100/H200 only): TMA loads into a          f16, bf16
         multi-stage mbarrier ring, warp-specialised (a producer warp, two
         consumer warpgroups on wgmma.m64nNk16), persistent; 128x256 or 128x128
=======  =====================================================================  ================

``impl=None`` (the default; ``"auto"`` is the same; cupyattn/options.py DEFAULTS) picks ``skinny`` for ``gemm_nt`` when M (after folding, below) is at
most ``GEMM_SKINNY_MAX_M`` = 16: a decode projection reads a whole weight for a few rows of x,
so it is bound by reading the weight, which skinny does once at full width while a 128-row tile
leaves most of its work idle and too few blocks to keep memory busy. Otherwise ``mma`` for
float16/bfloat16 and ``simt`` for float32 (the tensor-core path has no float32-exact input type;
TF32 would miss the 1e-5 contract). ``wgmma`` (Hopper: passed the GPU tier and sanitizers on an
H100, 2026-11-26) is what auto takes on sm_90 where ``config.GEMM_AUTO_WGMMA`` says it was measured
faster (fp16 and bf16 with M, N, K >= 4096: 2.4-2.5x mma there); it needs operands TMA can read (16-byte aligned
base pointers, row and batch strides positive multiples of 16 bytes, cupyattn/tma.py), and says
which rule an input breaks otherwise; auto keeps such inputs on ``mma``.

Batching: leading dims broadcast NumPy-style and are handed to the kernel as at most two
collapsed (size, stride) batch dims per operand, stride 0 for broadcast dims, so broadcast and
strided (non-contiguous) batches are read in place. When one ``b`` serves the whole batch (a 2-D
weight, ``x [B, T, K] @ W^T``) and a's rows over (batch, M) are evenly strided, the batch is
folded into M: one GEMM of ``B*T`` rows that reads W once, not B GEMMs that stream it B times.
Only when the batch dims cannot be collapsed to two (e.g. three non-mergeable strided batch
dims) are both operands copied to contiguous broadcast arrays first. Rows may have any stride;
the last dim must be contiguous. With ``out`` given, a call allocates nothing (outside that
copy fallback) and never synchronises, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import cupy
import numpy as np

from . import _checks, device, options, tma
from ._loader import KernelSpec, cbool, ctype, get_function
from . import config as C
from .config import (DTYPES, GEMM_GROUP_M, GEMM_IMPLS, GEMM_MMA_PAD, GEMM_SKINNY,
                     GEMM_TILES, INT32_MAX, MAX_GRID_YZ, MMA_DTYPES, gemm_mma_smem_bytes)


def _expr(impl: str, dtype, nt: bool, bn: int = 256, tile: C.GemmTile | None = None) -> str:
    if impl == "wgmma":
        t, (rp, rc) = C.GEMM_WGMMA_TILES[bn], C.GEMM_WGMMA_REGS
        return (f"gemm_wgmma_kernel<{ctype(dtype)}, {cbool(nt)}, {t.bn}, {t.stages}, {C.GEMM_WGMMA_GROUP_M}, "
                f"{rp}, {rc}>")
    if impl == "skinny":
        s = GEMM_SKINNY
        return f"gemm_skinny_kernel<{ctype(dtype)}, {s.warps}, {s.n_tiles}, {s.chunks}>"
    t = tile or GEMM_TILES[impl]
    extra = f", {GEMM_MMA_PAD}, {t.stages}, {t.min_blocks[0 if nt else 1]}, {GEMM_GROUP_M}" if impl == "mma" else ""
    return f"gemm_{impl}_kernel<{ctype(dtype)}, {cbool(nt)}, {t.bm}, {t.bn}, {t.bk}, {t.threads}{extra}>"


# the mma kernel with its main tile, and with the 2-stage tile for 64 KB devices (_mma_tile)
_MMA_NEEDS = tuple((_expr("mma", d, nt, tile=t), C.MMA_MIN_CC[d], gemm_mma_smem_bytes(t, nt))
                   for d in MMA_DTYPES for nt in (True, False) for t in (GEMM_TILES["mma"], C.GEMM_MMA_SMALL_SMEM))
SPEC = KernelSpec(
    name="gemm",
    source="gemm.cu",
    name_expressions=tuple(_expr("simt", d, nt) for d in DTYPES for nt in (True, False))
    + tuple(e for e, _, _ in _MMA_NEEDS) + tuple(_expr("skinny", d, True) for d in DTYPES),
    needs=_MMA_NEEDS + tuple((_expr("skinny", d, True), C.MMA_MIN_CC[d], 0) for d in MMA_DTYPES),
)
SPEC_SM90 = KernelSpec(
    name="gemm_sm90",
    source="gemm_sm90.cu",
    name_expressions=tuple(_expr("wgmma", d, nt, bn) for d in MMA_DTYPES for nt in (True, False)
                           for bn in C.GEMM_WGMMA_TILES),
    sm90a=True,
)


def _batch_strides(x, batch) -> list[int]:
    """Element strides of x's leading dims aligned to the broadcast ``batch`` (0 = broadcast)."""
    pad = len(batch) - (x.ndim - 2)
    out = []
    for i in range(len(batch)):
        j = i - pad
        out.append(0 if j < 0 or x.shape[j] == 1 else x.strides[j] // x.itemsize)
    return out


def _collapse(batch, sa, sb) -> list[tuple[int, int, int]]:
    """Drop size-1 dims, merge adjacent dims whose strides nest for both operands."""
    dims: list[tuple[int, int, int]] = []
    for n, a_st, b_st in zip(batch, sa, sb):
        if n == 1:
            continue
        if dims and dims[-1][1] == a_st * n and dims[-1][2] == b_st * n:
            dims[-1] = (dims[-1][0] * n, a_st, b_st)
        else:
            dims.append((n, a_st, b_st))
    return dims


def _tile_rows(impl: str) -> tuple[int, int]:
    """(rows of C, columns of C) one block of ``impl`` computes."""
    if impl == "skinny":
        return 16, 8 * GEMM_SKINNY.n_tiles
    return GEMM_TILES[impl].bm, GEMM_TILES[impl].bn


def _n_tiles(impl: str, m: int, n: int) -> int:
    """Thread blocks of a launch (wgmma: persistent, one per SM at most, so 1 for the limit)."""
    if impl == "wgmma":
        return 1
    rows_m, rows_n = _tile_rows(impl)
    return -(-m // rows_m) * -(-n // rows_n)


def _fold_batch(m: int, lda: int, dims, n: int = 1, impl=None, dtype=None):
    """Fold the batch into M when b is shared by every batch entry: ``(m, lda, dims)`` after.

    ``dims`` are the collapsed batch dims [(size, a_stride, b_stride)]. With one dim whose b
    stride is 0 and a's rows evenly strided across it (its a stride is ``m * lda``, or M = 1),
    the ``size * m`` rows of a form one matrix of row stride lda (C's rows always do: it is
    C-contiguous), so one GEMM replaces ``size`` of them.
    """
    if len(dims) == 1 and dims[0][2] == 0:
        size, a_st, _ = dims[0]
        folded = size * m
        if (m == 1 or a_st == m * lda) and folded <= INT32_MAX \
                and _n_tiles(_pick_impl(impl, dtype, True, folded), folded, n) <= INT32_MAX:
            return folded, (a_st if m == 1 else lda), []
    return m, lda, dims


def _pick_impl(impl, dtype, nt: bool, m: int, cc: int | None = None, problem=None, n: int = 0, k: int = 0) -> str:
    """The kernel impl=None ("auto") means for this call (M after folding) on a device of compute
    capability ``cc`` (None: one with every instruction): options.DEFAULTS["gemm_nt" / "gemm_nn"].
    ``problem(impl)``: why TMA cannot read the operands (None: the wgmma row does not apply)."""
    if not options.is_default(impl):
        return impl
    return options.choose(options.Call("gemm_nt" if nt else "gemm_nn", dtype, cc=cc, m=m, n=n, k=k, problem=problem))


def _mma_tile(nt: bool) -> C.GemmTile:
    """GEMM_TILES["mma"], or the 2-stage tile where the device's per-block shared memory is
    smaller than the main tile's ring (Turing)."""
    main = GEMM_TILES["mma"]
    return main if gemm_mma_smem_bytes(main, nt) <= device.smem_optin() else C.GEMM_MMA_SMALL_SMEM


def _check_args(fn, a, b, out, impl, nt):
    """Every check, before anything is allocated or launched. Returns (batch, M, N, K)."""
    _checks.check_array(fn, "a", a, min_ndim=2)
    _checks.check_array(fn, "b", b, min_ndim=2)
    _checks.check_same_dtype(fn, "b", b, "a", a)
    _checks.check_last_contiguous(fn, "a", a)
    _checks.check_last_contiguous(fn, "b", b)
    _checks.check_choice(fn, "impl", impl, (None,) + GEMM_IMPLS)
    m, k = a.shape[-2:]
    n, kb = b.shape[-2:] if nt else b.shape[-2:][::-1]
    if kb != k:
        want = "[..., N, K]" if nt else "[..., K, N]"
        raise ValueError(f"{fn}(): b has shape {tuple(b.shape)} (expected {want}) with K={kb}, "
                         f"but a has shape {tuple(a.shape)} with K={k}")
    try:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except ValueError:
        raise ValueError(f"{fn}(): batch dims of a {tuple(a.shape[:-2])} and b {tuple(b.shape[:-2])} "
                         f"do not broadcast") from None
    if impl == "mma" and np.dtype(a.dtype) not in MMA_DTYPES:
        raise TypeError(f"{fn}(): impl='mma' needs float16 or bfloat16 inputs, got float32 "
                        f"(use impl='simt' or impl=None)")
    if impl == "wgmma":
        if np.dtype(a.dtype) not in MMA_DTYPES:
            raise TypeError(f"{fn}(): impl='wgmma' needs float16 or bfloat16 inputs, got float32 "
                            f"(use impl='simt' or impl=None)")
        _checks.require_impl(fn, "gemm", "wgmma", a.dtype)
    if impl == "skinny" and not nt:
        raise ValueError(f"{fn}(): impl='skinny' is a gemm_nt kernel (b rows are the weight rows it "
                         f"streams); use impl='mma', impl='simt' or impl=None")
    if impl in ("mma", "skinny"):
        _checks.require_impl(fn, "gemm", impl, a.dtype)
    for name, v in (("M", m), ("N", n), ("K", k)):
        _checks.check_int32(fn, name, v)
    if _n_tiles(_pick_impl(impl, a.dtype, nt, m), m, n) > INT32_MAX:
        raise ValueError(f"{fn}(): M={m}, N={n} need more than 2^31-1 thread blocks")
    if out is not None:
        _checks.check_out(fn, out, batch + (m, n), a.dtype)
        _checks.check_no_overlap(fn, out, {"a": a, "b": b})
    return batch, m, n, k


def _gemm(fn, a, b, out, impl, nt):
    batch, m, n, k = _check_args(fn, a, b, out, impl, nt)
    if out is None:
        out = cupy.empty(batch + (m, n), dtype=a.dtype)
    if out.size == 0:
        return out  # empty batch, M = 0 or N = 0: nothing to launch
    if k == 0:
        out.fill(0)
        return out

    dims = _collapse(batch, _batch_strides(a, batch), _batch_strides(b, batch))
    if len(dims) > 2:  # the kernel takes two batch dims: materialise the broadcast batch
        a = cupy.ascontiguousarray(cupy.broadcast_to(a, batch + a.shape[-2:]))
        b = cupy.ascontiguousarray(cupy.broadcast_to(b, batch + b.shape[-2:]))
        dims = _collapse(batch, _batch_strides(a, batch), _batch_strides(b, batch))
    isz = a.itemsize
    lda = a.strides[-2] // isz if m > 1 else 0  # a unit dim's stride is never used
    b_rows = n if nt else k
    ldb = b.strides[-2] // isz if b_rows > 1 else 0
    m, lda, dims = _fold_batch(m, lda, dims, n, impl, a.dtype)
    dims = [(1, 0, 0)] * (2 - len(dims)) + dims
    # impl=None: options.DEFAULTS (wgmma on sm_90 for the large shapes an H100 run measured faster,
    # for operands TMA can read)
    impl = _pick_impl(impl, a.dtype, nt, m, device.compute_capability(), n=n, k=k,
                      problem=lambda i: _tma_problem(a, b, m, n, k, lda, ldb, dims, nt))
    if impl == "wgmma":
        return _launch_wgmma(fn, a, b, out, m, n, k, lda, ldb, dims, nt)
    (n_out, a_so, b_so), (n_in, a_si, b_si) = dims
    nbatch = n_out * n_in

    vec_ok = 0  # bit 0: 16-byte vector / cp.async loads of a and b; bit 1: paired 16-bit stores
    per16 = 16 // isz
    if a.data.ptr % 16 == 0 and b.data.ptr % 16 == 0 and \
            all(s % per16 == 0 for s in (lda, ldb, a_so, a_si, b_so, b_si)):
        vec_ok |= 1
    if out.data.ptr % 4 == 0 and n % 2 == 0:
        vec_ok |= 2

    rows_m, rows_n = _tile_rows(impl)
    if impl == "skinny":
        threads, smem = 32 * GEMM_SKINNY.warps, 0
    else:
        tile = _mma_tile(nt) if impl == "mma" else GEMM_TILES[impl]
        threads = tile.threads
        smem = gemm_mma_smem_bytes(tile, nt) if impl == "mma" else 0
    tiles_m, tiles_n = -(-m // rows_m), -(-n // rows_n)
    kern = get_function(SPEC, _expr(impl, a.dtype, nt, tile=None if impl == "skinny" else tile),
                        dynamic_smem=smem)
    i32, i64 = np.int32, np.int64
    kern((tiles_m * tiles_n, min(nbatch, MAX_GRID_YZ), 1), (threads, 1, 1),
         (a, b, out, i32(m), i32(n), i32(k), i32(tiles_n), i64(nbatch), i64(n_in),
          i64(a_so), i64(a_si), i64(lda), i64(b_so), i64(b_si), i64(ldb), i32(vec_ok)), shared_mem=smem)
    return out


# --- v4 (Hopper): operands through tensor maps ------------------------------------------------------
def _filled(strides, dims, itemsize):
    """Byte strides of TMA dims 1.. (``dims``: all of them, innermost first) with a packed
    stand-in for the stride of each dimension of extent 1 (never applied, but TMA wants a
    positive multiple of 16): the previous dimension's stride times its extent, rounded up to 16
    bytes. The stride of a dimension of more entries is kept as it is, 0 (a broadcast view) and
    negative ones included, for tma.problem to refuse: a packed stride there would read memory
    that is not the operand's."""
    out, prev = [], itemsize
    for s, extent_before, extent in zip(strides, dims, dims[1:]):
        if extent == 1:
            natural = -(-prev * extent_before // 16) * 16
            s = natural if natural < 2**40 else 16
        out.append(s)
        prev = s
    return out


def _wgmma_operands(a, b, m, n, k, lda, ldb, dims, nt, bn):
    """(name, ptr, dims, strides, box) of a and b as 4-D TMA boxes (gemm_sm90.cu's layout), and
    the kernel's batch flags."""
    isz = a.itemsize
    (n_out, a_so, b_so), (n_in, a_si, b_si) = dims
    a_dims = (k, m, n_in if a_si else 1, n_out if a_so else 1)
    b_dims = ((k, n) if nt else (n, k)) + (n_in if b_si else 1, n_out if b_so else 1)
    a_st = _filled([lda * isz, a_si * isz, a_so * isz], a_dims, isz)
    b_st = _filled([ldb * isz, b_si * isz, b_so * isz], b_dims, isz)
    flags = (bool(a_si) * 1) | (bool(a_so) * 2) | (bool(b_si) * 4) | (bool(b_so) * 8)
    b_box = (64, bn, 1, 1) if nt else (64, 64, 1, 1)
    return [("a", a.data.ptr, a_dims, a_st, (64, 128, 1, 1)), ("b", b.data.ptr, b_dims, b_st, b_box)], flags


def _tma_problem(a, b, m, n, k, lda, ldb, dims, nt):
    """Why TMA cannot read an operand (naming it), or None."""
    ops, _ = _wgmma_operands(a, b, m, n, k, lda, ldb, dims, nt, 256)
    batch = ("the inner batch dim", "the outer batch dim")
    names = {"a": ("K", "M (a's rows)") + batch, "b": (("K", "N (b's rows)") if nt else ("N", "K (b's rows)")) + batch}
    for name, ptr, d, st, box in ops:
        if (why := tma.problem(ptr, a.dtype, d, st, box, names=names[name])) is not None:
            return f"TMA cannot read {name}: {why}"
    if max(dims[0][0], dims[1][0]) > INT32_MAX:
        return "a batch dimension has more than 2^31 - 1 entries"
    return None


def _sm_count() -> int:
    """Streaming multiprocessors of the current device: the persistent grid's size."""
    return device.sm_count()


def _launch_wgmma(fn, a, b, out, m, n, k, lda, ldb, dims, nt):
    why = _tma_problem(a, b, m, n, k, lda, ldb, dims, nt)
    if why is not None:
        raise ValueError(f"{fn}(): impl='wgmma' needs operands TMA can read: {why} (use impl='mma' or impl=None)")
    nbatch = dims[0][0] * dims[1][0]
    sms = _sm_count()
    tile = C.gemm_wgmma_tile(m, n, nbatch, sms)
    ops, flags = _wgmma_operands(a, b, m, n, k, lda, ldb, dims, nt, tile.bn)
    maps = [tma.tensor_map(ptr, a.dtype, d, st, box, fn=fn, what=name) for name, ptr, d, st, box in ops]
    if out.data.ptr % 4 == 0 and n % 2 == 0:
        flags |= 16  # PAIR_STORE
    tiles_m, tiles_n = -(-m // tile.bm), -(-n // tile.bn)
    kern = get_function(SPEC_SM90, _expr("wgmma", a.dtype, nt, tile.bn), dynamic_smem=tile.smem_bytes)
    i32, i64 = np.int32, np.int64
    kern((min(nbatch * tiles_m * tiles_n, sms), 1, 1), (128 * (1 + tile.bm // 64), 1, 1),
         (*maps, out, i32(m), i32(n), i32(k), i32(tiles_m), i32(tiles_n), i64(nbatch), i64(dims[1][0]), i32(flags)),
         shared_mem=tile.smem_bytes)
    return out


def gemm_nt(a, b, out=None, *, impl=None):
    """``a @ b^T`` over the last two dims, batched over the leading dims.

    Parameters
    ----------
    a : cupy.ndarray, shape [..., M, K]
        float32, float16 or bfloat16; last dim contiguous (rows and batch may be strided).
    b : cupy.ndarray, shape [..., N, K]
        Same dtype as ``a``. Leading dims broadcast against ``a``'s (a 2-D ``b`` is shared by
        every batch entry without a copy).
    out : cupy.ndarray, shape [..., M, N], optional
        C-contiguous, same dtype as ``a``; written in place and returned. It must not overlap
        ``a`` or ``b`` in memory (ValueError).
    impl : {None, "simt", "mma", "skinny", "wgmma"} ("auto": None)
        Which kernel (module docstring); None is skinny for M <= 16 (after folding a batch
        that shares ``b`` into M), else tensor cores for 16-bit inputs, SIMT for float32.

    Returns
    -------
    cupy.ndarray, shape broadcast(a.shape[:-2], b.shape[:-2]) + (M, N), dtype of ``a``
        Accumulated in float32 and rounded once. K = 0 gives zeros.

    Examples
    --------
    >>> x = cupy.random.standard_normal((4, 17, 64)).astype(cupy.float16)   # [B, M, K]
    >>> w = cupy.random.standard_normal((96, 64)).astype(cupy.float16)      # [N, K], shared
    >>> gemm_nt(x, w).shape                                                 # x @ w^T
    (4, 17, 96)
    """
    return _gemm("gemm_nt", a, b, out, impl, True)


def gemm_nn(a, b, out=None, *, impl=None):
    """``a @ b`` over the last two dims, batched over the leading dims.

    Parameters
    ----------
    a : cupy.ndarray, shape [..., M, K]
        float32, float16 or bfloat16; last dim contiguous (rows and batch may be strided).
    b : cupy.ndarray, shape [..., K, N]
        Same dtype as ``a``; leading dims broadcast against ``a``'s.
    out : cupy.ndarray, shape [..., M, N], optional
        C-contiguous, same dtype as ``a``; written in place and returned. It must not overlap
        ``a`` or ``b`` in memory (ValueError).
    impl : {None, "simt", "mma", "wgmma"} ("auto": None)
        As for :func:`gemm_nt`; None is tensor cores for 16-bit inputs, SIMT for float32
        (skinny is a gemm_nt kernel).

    Returns
    -------
    cupy.ndarray, shape broadcast(a.shape[:-2], b.shape[:-2]) + (M, N), dtype of ``a``

    Examples
    --------
    >>> p = cupy.random.random((2, 8, 128, 128), dtype=cupy.float32)   # [B, H, Sq, Sk]
    >>> v = cupy.random.random((2, 8, 128, 64), dtype=cupy.float32)    # [B, H, Sk, D]
    >>> gemm_nn(p, v).shape
    (2, 8, 128, 64)
    """
    return _gemm("gemm_nn", a, b, out, impl, False)
