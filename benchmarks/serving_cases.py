"""Inputs, references and impls of the serving cases: ragged packed batches (op ``varlen``) and
chunked prefill over a paged KV cache (op ``paged``). ``cases.py`` hands these ops here.

varlen: B sequences of ragged lengths (``specs.varlen_lengths``), packed ``[total, H, D]``.
  ours  ``varlen`` attention_varlen (impl=None: flash_mma today), ``varlen-wgmma`` the persistent
        Hopper kernel (impl="wgmma_persistent"); ``padded`` / ``padded-wgmma`` our dense kernel
        (impl=None / "wgmma") on the batch padded to the longest sequence, key_lengths hiding the
        padding: the same tokens, plus the padding's query rows and the tiles they read
  peer  ``torch-sdpa`` on the padded batch (causal: the padding keys sit past every real row's
        diagonal; not causal: a boolean key-padding mask)
paged: B sequences of L cached keys (the Sq new ones last) in pages of ``page`` tokens at
  shuffled page ids, q [B, H, Sq, D].
  ours  ``paged`` attention_paged (impl=None), ``paged-wgmma`` (impl="wgmma_persistent");
        ``contiguous`` / ``contiguous-wgmma`` attention() on the same keys in one [B, Hkv, L, D]
        buffer (impl=None / "wgmma_persistent"): what paging costs the same kernel
  peer  ``torch-sdpa`` on the contiguous keys (bottom-right causal)
Every impl's output is checked against a float64 reference of the real rows only.
"""
from __future__ import annotations

import numpy as np

from . import peers
from .arrays import rand
from .specs import varlen_lengths

OURS = {"varlen": ("varlen", "varlen-wgmma", "padded", "padded-wgmma"),
        "paged": ("paged", "paged-wgmma", "contiguous", "contiguous-wgmma")}


def build_inputs(case) -> dict:
    import cupy

    p, dt = case.p, case.dtype
    if case.op == "varlen":
        lens = varlen_lengths(p["B"], p["lo"], p["hi"], p["seed"])
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        total = int(cu[-1])
        q, k, v = (rand((total, h, p["D"]), dt) for h in (p["H"], p["Hkv"], p["Hkv"]))
        return {"lens": lens, "cu": cu, "cu_d": cupy.asarray(cu), "q": q, "k": k, "v": v,
                "out": cupy.empty_like(q)}
    B, H, Hkv, Sq, L, D, page = (p[x] for x in ("B", "H", "Hkv", "Sq", "L", "D", "page"))
    q, k, v = rand((B, H, Sq, D), dt), rand((B, Hkv, L, D), dt), rand((B, Hkv, L, D), dt)
    n = B * -(-L // page)
    perm = cupy.asarray(np.random.default_rng(0).permutation(n).astype(np.int32))

    def pages(x):  # [B, Hkv, L, D] -> [n, page, Hkv, D], sequence page i at perm[b * L/page + i]
        pad = -(-L // page) * page - L
        xp = cupy.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x
        out = cupy.empty((n, page, Hkv, D), dtype=x.dtype)
        out[perm] = xp.transpose(0, 2, 1, 3).reshape(n, page, Hkv, D)
        return out

    return {"q": q, "k": k, "v": v, "kp": pages(k), "vp": pages(v), "table": perm.reshape(B, -1),
            "lens": cupy.full(B, L, dtype=cupy.int32), "out": cupy.empty_like(q)}


def _padded(x, lens, longest):
    """Packed [total, H, D] -> [B, H, longest, D] (zeros past each length)."""
    import cupy

    out = cupy.zeros((len(lens), x.shape[1], longest, x.shape[2]), dtype=x.dtype)
    at = 0
    for b, n in enumerate(lens):
        out[b, :, :n] = x[at:at + n].transpose(1, 0, 2)
        at += n
    return out


def _packed(x, lens):
    """[B, H, longest, D] -> packed [total, H, D] of the real rows (a copy)."""
    import cupy

    return cupy.concatenate([x[b, :, :n].transpose(1, 0, 2) for b, n in enumerate(lens)])


def reference(case, inp):
    """float64 attention of the real rows, one sequence at a time."""
    import cupy

    from .peers import ref_attention

    causal = case.p["causal"]
    if case.op == "varlen":
        outs, cu = [], inp["cu"]
        for b, n in enumerate(inp["lens"]):
            s = slice(int(cu[b]), int(cu[b + 1]))
            qq, kk, vv = (x[s].transpose(1, 0, 2)[None] for x in (inp["q"], inp["k"], inp["v"]))
            outs.append(ref_attention(qq, kk, vv, causal)[0].transpose(1, 0, 2))
        return cupy.concatenate(outs)
    return ref_attention(inp["q"], inp["k"], inp["v"], causal)


def make_impl(case, name: str, inp):
    """Zero-arg callable running impl ``name``; for the padded ones, its ``extract`` attribute takes
    the real rows out of what it returns (outside the timed call) for the error check."""
    import cupy

    import cupyattn

    causal = case.p["causal"]
    if case.op == "varlen":
        lens, longest = inp["lens"], max(inp["lens"])
        q, k, v, out, cu = inp["q"], inp["k"], inp["v"], inp["out"], inp["cu_d"]
        if name in ("varlen", "varlen-wgmma"):
            impl = "wgmma_persistent" if name == "varlen-wgmma" else None
            return lambda: cupyattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, out=out,
                                                     impl=impl)
        qp, kp, vp = (_padded(x, lens, longest) for x in (q, k, v))   # copies made here, not timed
        op = cupy.empty_like(qp)
        kl = cupy.asarray(lens, dtype=cupy.int32)
        if name in ("padded", "padded-wgmma"):
            impl = "wgmma" if name == "padded-wgmma" else None
            def run():
                return cupyattn.attention(qp, kp, vp, causal=causal, key_lengths=kl, out=op, impl=impl)
        elif name == "torch-sdpa":
            sdpa = peers.torch_sdpa(qp, kp, vp, causal=True) if causal else _sdpa_key_padding(qp, kp, vp, lens)

            def run():
                return sdpa()
        else:
            raise ValueError(f"unknown impl {name!r} for varlen")
        run.extract = lambda o: _packed(o if isinstance(o, cupy.ndarray) else cupy.from_dlpack(o.contiguous()), lens)
        return run
    q, out = inp["q"], inp["out"]
    if name in ("paged", "paged-wgmma"):
        impl = "wgmma_persistent" if name == "paged-wgmma" else None
        return lambda: cupyattn.attention_paged(q, inp["kp"], inp["vp"], inp["table"], inp["lens"], causal=causal,
                                                out=out, impl=impl)
    if name in ("contiguous", "contiguous-wgmma"):
        impl = "wgmma_persistent" if name == "contiguous-wgmma" else None
        return lambda: cupyattn.attention(q, inp["k"], inp["v"], causal=causal, out=out, impl=impl)
    if name == "torch-sdpa":
        return peers.torch_sdpa(q, inp["k"], inp["v"], causal=causal)
    raise ValueError(f"unknown impl {name!r} for paged")


def _sdpa_key_padding(q, k, v, lens):
    """torch SDPA with a boolean [B, 1, 1, L] mask hiding each sequence's padding keys."""
    torch = peers.get_torch()
    import torch.nn.functional as F

    tq, tk, tv = peers.to_torch(q), peers.to_torch(k), peers.to_torch(v)
    keep = torch.arange(k.shape[2], device=tq.device)[None, :] < torch.tensor(lens, device=tq.device)[:, None]
    kw = {"attn_mask": keep[:, None, None, :]}
    if k.shape[1] != q.shape[1]:
        kw["enable_gqa"] = True
    return peers.wrap_torch(lambda: F.scaled_dot_product_attention(tq, tk, tv, **kw))
