"""Scaled dot-product attention over CuPy arrays: fused FlashAttention-2 kernels (SIMT for every
dtype, tensor-core mma.sync for fp16/bf16) and a split (naive) pipeline built from cupyattn's GEMM
and softmax.

Layout ``[B, H, S, D]``; K/V may have fewer heads than Q (GQA/MQA); causal masks with Sq != Sk
are aligned bottom-right. See ``kernels_cu/flash_attn.cu`` for the kernel and its tile table;
``impl="wgmma"`` (Hopper) lives in :mod:`cupyattn.flash_attn_sm90`, ``impl="wgmma_persistent"``
(Hopper; impl=None takes it for causal fp16 at D = 256) in :mod:`cupyattn.flash_attn_sm90_persistent`.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks, device, options
from . import config as C
from . import flash_attn_sm90 as _sm90
from . import flash_attn_sm90_persistent as _sm90p
from ._checks import check_array, check_choice, check_last_contiguous, check_out, check_same_dtype
from .config import DTYPES, HEAD_DIMS, MAX_GRID_YZ, MMA_DTYPES
from .flash_launch import (Serving, check_flash_mma_device, check_window_softcap, choose, fused_dims, launch,
                           padded_copy)
# the launch module's names that tests and benchmarks read here
from .flash_launch import SPEC  # noqa: F401
from .flash_launch import expr as _expr  # noqa: F401
from .flash_launch import tile_for as _tile  # noqa: F401
from .gemm import gemm_nn, gemm_nt
from .row_softmax import softmax

IMPLS = ("flash", "flash_mma", "naive")
# sm_90 only: "wgmma" (impl=None takes it where config.ATTN_AUTO_WGMMA says; flash_attn_sm90.py) and
# its persistent variant (explicit impl only; flash_attn_sm90_persistent.py)
HOPPER_IMPLS = ("wgmma", "wgmma_persistent")
# What impl=None runs for each dtype on a GPU that has every instruction and enough shared memory
# (options.DEFAULTS on no device in particular; Hopper rows need the call's operands): tensor cores
# where they apply. default_impl() says what it runs on the current device.
DEFAULT_IMPL = {d: options.choose(options.Call("attention", d, 64)) for d in DTYPES}
_FN = "attention"


def default_impl(dtype, head_dim: int) -> str:
    """What ``impl=None`` runs on the current device where no Hopper kernel applies: flash_mma for
    fp16/bf16 where the device has its instructions (bf16 from sm_80, config.IMPL_MIN_CC) and
    registers at ``head_dim`` (config.IMPL_MIN_CC_BY_HEAD_DIM: D = 256 from sm_80) and its tile fits
    the shared memory per block (not Turing's 64 KB at D = 96, 128: the 32-key tiles of
    FLASH_MMA_SMALL_SMEM_TILES serve an explicit impl="flash_mma" there, and stay off the default
    until they have run on a GPU), else flash (options.DEFAULTS["attention"]'s last rows). At a
    head dim no fused kernel has (not config.HEAD_DIMS): up to 256, what runs at the next of them
    (q, k, v zero-padded to it); past 256, naive, the split pipeline, where it implements the call
    (no window, no softcap)."""
    return options.choose(options.Call("attention", dtype, head_dim, device.compute_capability(),
                                       device.smem_optin()))


# --- argument checks ------------------------------------------------------------------------
def _check_mask(mask, target):
    """Additive float mask (or bool: True keeps the key) broadcastable to ``target`` = (B, Hq, Sq,
    Sk) -> 4-D shape it has."""
    check_array(_FN, "mask", mask, dtypes=_checks.FLOAT_DTYPES + (np.dtype(np.bool_),), min_ndim=0)
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
    """Every check of attention() -> (impl, scale, mask shape, key lengths, Serving or None, the
    (q, k, v) the kernel reads). impl=None is options.DEFAULTS["attention"]'s choice. At a D the
    fused kernels lack (up to 256), the kernel reads zero-padded copies made here, after every
    check that the caller's arguments can fail (those left, on the fresh copies, are TMA's, which
    a C-contiguous copy passes, and the Hopper kernels' int32 tile count)."""
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
    b, hq, sq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{_FN}(): k has shape {tuple(k.shape)}, expected [B={b}, Hkv, Sk, D={d}] "
                         f"to match q {tuple(q.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{_FN}(): v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    hkv, sk = k.shape[1], k.shape[2]
    if hkv == 0:
        raise ValueError(f"{_FN}(): k and v have no heads (Hkv=0, shape {tuple(k.shape)}); they need at least one")
    if hq % hkv:
        raise ValueError(f"{_FN}(): q heads Hq={hq} must be a multiple of k/v heads Hkv={hkv}")
    for what, n in (("B", b), ("Hq", hq), ("Hkv", hkv), ("Sq", sq), ("Sk", sk), ("D", d)):
        _checks.check_int32(_FN, what, n)
    if -(-b * hq // MAX_GRID_YZ) > MAX_GRID_YZ:
        raise ValueError(f"{_FN}(): B*Hq = {b * hq} (batch x query heads) is more than one launch's grid "
                         f"holds ({MAX_GRID_YZ}^2)")
    # the call options an impl may lack (cupyattn/options.py: the table the docs are made from)
    window_used = window is not None and win != ((-1, 0) if causal else (-1, -1))
    used = [o for o, on in (("causal", causal), ("window", window_used), ("softcap", cap > 0),
                            ("mask", mask is not None), ("key_lengths", key_lengths is not None),
                            ("scale", scale is not None), ("return_lse", return_lse), ("out", out is not None)) if on]
    if impl is not None:
        options.check(_FN, _FN, impl, used)
    no_fused = C.padded_head_dim(d) is None   # D past the largest fused head dim: only naive
    if no_fused and impl != "naive" and (impl is not None or not options.supports(_FN, "naive", used)):
        lacks = [o for o in options.REFUSED[(_FN, "naive")] if o in used]
        naive = f"impl='naive' takes any D but has no {' or '.join(lacks)}" if lacks else "impl='naive' takes any D"
        who = f"impl={impl!r}: the fused kernels take" if impl is not None else "the fused kernels: they take"
        raise ValueError(f"{_FN}(): head_dim D={d} is not supported by {who} D up to "
                         f"{max(HEAD_DIMS)} (a D not in {', '.join(map(str, HEAD_DIMS))} zero-padded to the "
                         f"next) ({naive})")
    if impl not in (None, "flash", "naive") and np.dtype(q.dtype) not in MMA_DTYPES:
        raise TypeError(f"{_FN}(): impl={impl!r} needs float16 or bfloat16 inputs, got {np.dtype(q.dtype)} "
                        f"(use impl='flash')")
    dk = d if no_fused or impl == "naive" else C.padded_head_dim(d, fused_dims(impl))
    if impl == "flash_mma":
        check_flash_mma_device(_FN, q.dtype, dk)
    elif impl in HOPPER_IMPLS:
        _checks.require_impl(_FN, "attention", impl, q.dtype)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_last_contiguous(_FN, name, x)
    scale = (1.0 / math.sqrt(d) if d else 1.0) if scale is None else _checks.check_real(_FN, "scale", scale)
    mshape = _check_mask(mask, (b, hq, sq, sk)) if mask is not None else None
    kl = _check_key_lengths(key_lengths, b, sk) if key_lengths is not None else None
    if out is not None:
        check_out(_FN, out, (b, hq, sq, d), q.dtype)
        _checks.check_no_overlap(_FN, out, {"q": q, "k": k, "v": v, "mask": mask,
                                            "key_lengths": key_lengths})
    launches = bool(q.size and sk)
    ops = (q, k, v) if dk == d else tuple(padded_copy(x, dk, launches) for x in (q, k, v))
    if impl is None:  # TMA must read q, k, v for a Hopper kernel (asked only where its row applies)
        problems = {"wgmma": lambda: _sm90.launch_problem(*ops),
                    _sm90p.IMPL: lambda: _sm90p.launch_problem(_FN, _sm90p.IMPL, _sm90p.dense_ops(*ops), ops[0], b)}
        impl = choose(_FN, q, d, used=used, causal=causal, launches=launches, problem=lambda i: problems[i]())
    if impl == "wgmma":
        _sm90.check(*ops)
    elif impl == "wgmma_persistent":
        _sm90p.check_dense(_FN, impl, *ops)
    return impl, scale, mshape, kl, sv, ops


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
        The diagonal counts from ``Sk`` whatever ``key_lengths`` says: with both, row ``i`` of
        sequence ``b`` sees ``j <= i + Sk - Sq`` and ``j < key_lengths[b]``. For each sequence's
        own bottom-right diagonal (prompts of other lengths padded into one batch), use
        :func:`cupyattn.attention_varlen`.
        Flags must be bools: ``causal="False"`` is a TypeError, not a true value.
    scale : float, optional
        Multiplies ``q k^T``; default ``1 / sqrt(D)``.
    mask : cupy.ndarray, optional
        Additive float mask broadcastable to [B, Hq, Sq, Sk] (``-inf`` hides a key), or a bool
        mask (torch SDPA's: ``True`` lets the key take part, ``False`` hides it; a row with no
        True gives zeros here, where SDPA gives NaN). The flash kernels read float32 through
        strides (0 on broadcast dims); a float16/bfloat16 mask is first converted to float32 (a
        bool mask to 0 / -inf), and for ``flash_mma`` a mask whose key dim is strided is made
        contiguous (each a copy of the mask's own, un-broadcast size).
    key_lengths : int array [B], optional
        Keys ``j >= key_lengths[b]`` are hidden. Host values (list / NumPy) are checked to lie in
        [0, Sk]; a CuPy array is used as is (not read back: the flash kernel clamps it to [0, Sk]).
    impl : {None, "flash", "flash_mma", "naive", "wgmma", "wgmma_persistent"}
        None (default): the fastest correct kernel for the dtype on this GPU,
        ``default_impl(q.dtype, D)`` (``DEFAULT_IMPL[q.dtype]`` from sm_80 on; see docs/gpus.md);
        at a D over 256, ``"naive"``, which takes any D but has no window or softcap (a
        ValueError names D and the option), holds S in memory and rounds it to the input dtype
        (float16/bfloat16: about twice the fused kernels' error).
        Head dims: the fused impls have kernels at ``cupyattn.config.HEAD_DIMS`` = (32, 64, 80,
        96, 128, 256) (the Hopper ones at 64, 128, 256); a call at another D up to 256 runs on
        copies of q, k, v zero-padded to the impl's next head dim, and ``out`` gets the first D
        columns (as FlashAttention-2 pads; every option works, the scores are unchanged and
        ``scale`` defaults to 1/sqrt(D) of the caller's D).
        ``"flash"``: one fused FlashAttention-2 kernel launch (SIMT, fp32 FMA); S is
        never written to memory and only ``out`` (and ``lse``, and a B-element int32 copy of
        host key_lengths; at a padded D, the copies) are allocated.
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
        warp-specialised (cupyattn/flash_attn_sm90.py); float16/bfloat16, D up to 256 (kernels
        at 64, 128, 256), q/k/v that TMA can read (16-byte-aligned base and strides, no
        broadcast or reversed view, else a ValueError naming the tensor and the stride; at a
        padded D the copies are what TMA reads); masks as ``flash_mma`` takes
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
    impl, scale, mshape, kl, sv, (qk, kk, vk) = _check_args(q, k, v, causal, scale, mask, key_lengths, impl,
                                                            return_lse, out, window, softcap)
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
    if mask is not None and mask.dtype == np.bool_:  # torch SDPA's bool mask: True takes part
        mask = cupy.where(mask, np.float32(0), np.float32(-np.inf))
    elif mask is not None and mask.dtype != cupy.float32:
        mask = mask.astype(cupy.float32)
    dk = qk.shape[3]   # D, or the head dim q, k, v were zero-padded to: the kernel writes dk columns
    o = out if dk == d else cupy.empty((b, hq, sq, dk), dtype=q.dtype)
    if impl == "naive":
        _naive(qk, kk, vk, causal, scale, mask, mshape, kl, o, lse)
    elif impl == "wgmma":
        _sm90.run(qk, kk, vk, causal, scale, kl, o, lse, mask, mshape)
    elif impl == "wgmma_persistent":
        win, cap = (sv.window, sv.softcap) if sv is not None else ((-1, -1), 0.0)
        _sm90p.run_dense(qk, kk, vk, causal, scale, kl, o, lse, mask, mshape, win, cap)
    else:
        launch(impl, qk, kk, vk, causal, scale, mask, mshape, kl, o, lse, sv)
    if o is not out:
        out[...] = o[..., :d]
    return (out, lse) if return_lse else out


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
