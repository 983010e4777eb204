"""Peers: what our kernels are compared with in the same run.

- gemm: ``cublas`` (cupy.matmul; float32 with TF32 off), ``cublas-tf32`` (float32 only),
  ``torch-matmul`` (cuBLAS through torch; its float32 default is TF32 off too).
- softmax: ``cupy-ops`` (max/exp/sum/divide as CuPy ops, float32 math), ``torch``.
- attention / decode: ``cupy-naive`` (cupy.matmul + CuPy-ops softmax), ``torch-sdpa``.
- varlen / paged: ``torch-sdpa`` on the padded batch / on the keys in one contiguous buffer
  (benchmarks/serving_cases.py).
- model: ``hf-transformers`` (LlamaForCausalLM built from tinylm's config and weights; see
  ``benchmarks/hf_peer.py``), eager; ``hf-compiled``, the same model with a static KV cache and
  ``torch.compile(mode="reduce-overhead")`` (the gpt-fast recipe), HF's own fast path.

torch peers see our CuPy arrays through DLPack (zero copy) and run on CuPy's current stream, so
the CUDA events of ``timing.time_fn`` bracket their work. A peer that is not installed is
skipped with one line saying so; nothing else changes.
"""
from __future__ import annotations

import contextlib

PEERS = {
    "gemm": ("cublas", "cublas-tf32", "torch-matmul"),
    "softmax": ("cupy-ops", "torch"),
    "attention": ("cupy-naive", "torch-sdpa"),
    "decode": ("cupy-naive", "torch-sdpa"),
    "varlen": ("torch-sdpa",),   # on the padded batch (benchmarks/serving_cases.py)
    "paged": ("torch-sdpa",),    # on the same keys, contiguous
    "model": ("hf-transformers", "hf-compiled"),
}
# Which peer a record's single `peer`/`speedup` columns refer to, in order of preference.
PRIMARY = {
    "gemm": ("cublas", "torch-matmul"),
    "softmax": ("torch", "cupy-ops"),
    "attention": ("torch-sdpa", "cupy-naive"),
    "decode": ("torch-sdpa", "cupy-naive"),
    "varlen": ("torch-sdpa",),
    "paged": ("torch-sdpa",),
    "model": ("hf-compiled", "hf-transformers"),
}
TORCH_PEERS = {"torch", "torch-sdpa", "torch-matmul", "hf-transformers", "hf-compiled"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (library missing, dtype unsupported); message is one line."""


def get_torch():
    """torch, or PeerUnavailable when it is not importable."""
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install raising something else
        raise PeerUnavailable(f"torch is not importable ({type(e).__name__}: {e})") from None
    return torch


def get_transformers():
    try:
        import transformers
    except Exception as e:
        raise PeerUnavailable(f"transformers is not importable ({type(e).__name__}: {e})") from None
    return transformers


def available(op: str, names, skip) -> list[str]:
    """The peers among ``names`` whose libraries import here; ``skip(line)`` for each other."""
    out = []
    for name in names:
        try:
            if name in TORCH_PEERS:
                get_torch()
            if name in ("hf-transformers", "hf-compiled"):
                get_transformers()
        except PeerUnavailable as e:
            skip(f"skipping peer {name} ({op}): {e}")
            continue
        out.append(name)
    return out


# --- torch glue -------------------------------------------------------------------------------
def to_torch(x):
    """Zero-copy torch view of a CuPy array (DLPack)."""
    torch = get_torch()
    try:
        return torch.from_dlpack(x)
    except Exception as e:
        raise PeerUnavailable(f"DLPack to torch failed for dtype {x.dtype}: {e}") from None


def torch_stream_ctx():
    """Run torch work on CuPy's current stream, so events recorded there bracket it."""
    import cupy

    torch = get_torch()
    ptr = cupy.cuda.get_current_stream().ptr
    if ptr == 0:  # CuPy's default is the legacy null stream, which is torch's default too
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(ptr))


def wrap_torch(fn):
    """A zero-arg callable running ``fn`` on CuPy's stream with autograd off."""
    torch = get_torch()

    def run():
        with torch.inference_mode(), torch_stream_ctx():
            return fn()

    return run


# --- CuPy peers -------------------------------------------------------------------------------
@contextlib.contextmanager
def cublas_compute_type(dtype, tf32: bool):
    """Force CuPy's cuBLAS compute type for ``dtype`` (float32: TF32 on/off), then restore.

    CuPy keeps float32 GEMMs in full precision unless CUPY_TF32=1 (``__main__`` sets it to 0
    before importing CuPy); this makes each peer explicit either way. Uses CuPy's
    ``_core._routines_linalg`` compute-type switch; when absent, TF32 is reported unavailable.
    """
    try:
        from cupy._core import _routines_linalg as rl
    except ImportError:
        rl = None
    if rl is None or not hasattr(rl, "set_compute_type"):
        if tf32:
            raise PeerUnavailable("this CuPy has no cuBLAS compute-type switch (TF32 peer)")
        yield
        return
    old = rl.get_compute_type(dtype)
    rl.set_compute_type(dtype, rl.COMPUTE_TYPE_TF32 if tf32 else rl.COMPUTE_TYPE_FP32)
    try:
        yield
    finally:
        rl.set_compute_type(dtype, old)


def cublas_gemm(a, b, layout: str, out, tf32: bool = False):
    """cupy.matmul for C = A B^T (nt: b is [N,K]) or C = A B (nn)."""
    import cupy

    bb = b.swapaxes(-1, -2) if layout == "nt" else b
    if a.dtype != cupy.float32:
        if tf32:
            raise PeerUnavailable("TF32 applies to float32 only")
        return lambda: cupy.matmul(a, bb, out=out)

    def run():
        with cublas_compute_type(a.dtype, tf32):
            return cupy.matmul(a, bb, out=out)

    return run


def cupy_softmax(x, axis=-1):
    """Softmax written as CuPy ops, math in float32 (what a user would write first)."""
    import cupy

    from .arrays import from_f32, to_f32

    xf = to_f32(x)
    xf = xf - xf.max(axis=axis, keepdims=True)
    e = cupy.exp(xf)
    return from_f32(e / e.sum(axis=axis, keepdims=True), x.dtype)


def causal_keep(sq: int, sk: int):
    """Bool [Sq, Sk]: query i sees key j when j <= i + Sk - Sq (bottom-right aligned)."""
    import cupy

    return cupy.arange(sk)[None, :] <= cupy.arange(sq)[:, None] + (sk - sq)


def cupy_naive_attention(q, k, v, causal=False, scale=None):
    """S = Q K^T (cuBLAS, input dtype), softmax in float32, O = P V; GQA by broadcasting.

    q [B,H,Sq,D], k/v [B,Hkv,Sk,D] with any strides cupy.matmul takes. Materialises S and P,
    [B,H,Sq,Sk] in float32: exactly the memory traffic flash attention avoids. The softmax
    works in place on S, so the peak is about one float32 S plus one P in the input dtype.
    """
    import cupy

    from .arrays import from_f32, to_f32

    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    if g > 1:  # GQA: [B, Hkv, g, Sq, D] against K/V broadcast over the group axis
        q, k, v = q.reshape(B, Hkv, g, Sq, D), k[:, :, None], v[:, :, None]
    s = to_f32(cupy.matmul(q, k.swapaxes(-1, -2)))
    s *= scale
    if causal:
        s += cupy.where(causal_keep(Sq, Sk), 0.0, -cupy.inf).astype(cupy.float32)
    m = s.max(axis=-1, keepdims=True)
    s -= cupy.where(cupy.isfinite(m), m, 0.0)  # fully masked rows -> zeros, not NaN
    cupy.exp(s, out=s)
    den = s.sum(axis=-1, keepdims=True)
    s /= cupy.where(den > 0, den, 1.0)
    p = from_f32(s, q.dtype)
    del s
    return cupy.matmul(p, v).reshape(B, H, Sq, D)


# --- torch peers ------------------------------------------------------------------------------
def torch_sdpa(q, k, v, causal=False, scale=None, key_lengths=None):
    """torch SDPA on DLPack views; bottom-right causal via causal_lower_right when Sq != Sk;
    ``key_lengths`` (host ints, one per batch row): a boolean mask hiding keys past each length
    (built here, outside the timed call; SDPA then reads every key of the padded batch)."""
    torch = get_torch()
    import torch.nn.functional as F

    tq, tk, tv = to_torch(q), to_torch(k), to_torch(v)
    sq, sk = q.shape[2], k.shape[2]
    kw = {"scale": scale}
    if k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    if key_lengths is not None:
        if causal:
            raise PeerUnavailable("key lengths with a causal mask")
        lens = torch.tensor(list(key_lengths), device=tq.device)
        kw["attn_mask"] = (torch.arange(sk, device=tq.device)[None, :] < lens[:, None])[:, None, None, :]
    elif causal and sq != sk:
        try:
            from torch.nn.attention.bias import causal_lower_right
        except ImportError:
            raise PeerUnavailable("this torch has no causal_lower_right (Sq != Sk causal)") from None
        kw["attn_mask"] = causal_lower_right(sq, sk)
    elif causal:
        kw["is_causal"] = True
    del torch
    return wrap_torch(lambda: F.scaled_dot_product_attention(tq, tk, tv, **kw))


def torch_softmax(x):
    torch = get_torch()
    tx = to_torch(x)
    return wrap_torch(lambda: torch.softmax(tx, dim=-1))


def torch_matmul(a, b, layout: str, out):
    """torch.matmul (cuBLAS) on DLPack views, writing into our output buffer."""
    torch = get_torch()
    ta, tb, tout = to_torch(a), to_torch(b), to_torch(out)
    tb = tb.t() if layout == "nt" else tb
    return wrap_torch(lambda: torch.matmul(ta, tb, out=tout))


def ref_attention(q, k, v, causal, chunk_bytes=512 * 2**20):
    """float64 attention on the device, one (batch, kv head) and block of query rows at a time."""
    import cupy

    from .arrays import to_f64

    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = H // Hkv
    out = cupy.empty((B, H, Sq, D), dtype=cupy.float64)
    rows = max(1, min(Sq, chunk_bytes // (8 * g * Sk)))
    keep = causal_keep(Sq, Sk) if causal else None
    for b in range(B):
        for h in range(Hkv):
            kk, vv = to_f64(k[b, h]), to_f64(v[b, h])  # [Sk, D]
            for r0 in range(0, Sq, rows):
                qq = to_f64(q[b, h * g:(h + 1) * g, r0:r0 + rows])  # [g, rows, D]
                s = cupy.matmul(qq, kk.T) * (D ** -0.5)
                if keep is not None:
                    s = cupy.where(keep[r0:r0 + rows], s, -cupy.inf)
                m = s.max(axis=-1, keepdims=True)
                p = cupy.exp(s - cupy.where(cupy.isfinite(m), m, 0.0))
                den = p.sum(axis=-1, keepdims=True)
                out[b, h * g:(h + 1) * g, r0:r0 + rows] = cupy.matmul(p, vv) / cupy.where(den > 0, den, 1.0)
    return out
