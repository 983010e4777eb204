"""impl=None of every entry point is read from one table (cupyattn/options.py DEFAULTS).

For a grid of calls per entry point (dtypes, head dims, causal, options, page sizes and layouts,
GQA groups, GEMM shapes, TMA-readable or not), on the emulated family the tier runs this file as
(sm_90, and sm_75, sm_80, sm_100 through tests/tiers.py): the kernel the call launches (the
launch is stopped before anything is compiled) must be the impl that options.choose gives for the
call's facts, stated here from the inputs (dtype, D, the device's compute capability and shared
memory per block, the options used, whether TMA can read the operands). Each case costs
milliseconds.
"""
from __future__ import annotations

import numpy as np
import pytest

# kernel name (the name expression's template) -> the impl that launches it
KERNEL_IMPL = {"flash_attn_fwd": "flash", "flash_attn_mma": "flash_mma", "decode_kernel": "simt",
               "decode_mma_kernel": "mma", "gemm_simt_kernel": "simt", "gemm_mma_kernel": "mma",
               "gemm_skinny_kernel": "skinny", "gemm_wgmma_kernel": "wgmma", "rmsnorm_warp_kernel": "warp",
               "rmsnorm_block_kernel": "block"}
DTYPES = ("float32", "float16", "bfloat16")


class Launched(Exception):
    """Raised where the first kernel of a call would be compiled."""


def launched(call, attention: bool = False) -> str:
    """The impl whose kernel ``call()`` launches first (nothing is compiled or run); ``attention``:
    the call is an attention entry point's, whose GEMMs are its split pipeline ("naive")."""
    from cupyattn import _loader

    saved = _loader._compile, _loader._FUNCTIONS, _loader._SMEM_RAISED

    def stop(spec, expr, arch):
        raise Launched(expr)

    _loader._compile, _loader._FUNCTIONS, _loader._SMEM_RAISED = stop, {}, {}
    try:
        call()
    except Launched as e:
        name, args = str(e).split("<", 1)
        if name.startswith("gemm_") and attention:  # the split pipeline's first kernel: S = q k^T
            return "naive"
        if name == "flash_attn_sm90":   # one Hopper kernel: its scheduler (7th template argument) is the impl
            return {"0": "wgmma", "1": "wgmma_persistent"}[args.split(",")[6].strip()]
        return KERNEL_IMPL[name]
    finally:
        _loader._compile, _loader._FUNCTIONS, _loader._SMEM_RAISED = saved
    raise AssertionError("the call launched nothing")


def cases():
    """(entry, case id, call, facts): ``call()`` runs the entry point with impl left out, ``facts``
    the options.Call fields the test states for it (device fields are added by the test)."""
    import cupy

    import cupyattn

    out = []

    def arr(shape, dtype):  # (values do not matter: nothing runs)
        dt = np.dtype(cupyattn.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        return cupy.zeros(shape, dtype=dt)

    for dt in DTYPES:
        for d in (64, 96, 128, 256):
            for causal in (False, True):
                q, k = arr((1, 4, 17, d), dt), arr((1, 2, 17, d), dt)
                base = dict(dtype=dt, head_dim=d, causal=causal, used=("causal",) if causal else ())
                out.append(("attention", f"{dt}-D{d}-causal{causal}",
                            lambda q=q, k=k, c=causal: cupyattn.attention(q, k, k, causal=c), base))
                if d == 128:  # a window (v3 lacks it); k broadcast over the batch (TMA cannot read it)
                    out.append(("attention", f"{dt}-D{d}-causal{causal}-window",
                                lambda q=q, k=k, c=causal: cupyattn.attention(q, k, k, causal=c, window=(8, 0)),
                                dict(base, used=base["used"] + ("window",))))
                    kb = cupy.broadcast_to(k[:1], (2,) + k.shape[1:])
                    qb = arr((2, 4, 17, d), dt)
                    out.append(("attention", f"{dt}-D{d}-causal{causal}-broadcast",
                                lambda q=qb, k=kb, c=causal: cupyattn.attention(q, k, k, causal=c),
                                dict(base, tma=False)))
            if d == 96:  # and head dims no fused kernel has: padded to the next (up to 256), else the split pipeline
                for dd, window in ((40, None), (40, (8, 0)), (111, None), (300, None)):
                    q, k = arr((1, 4, 17, dd), dt), arr((1, 2, 17, dd), dt)
                    out.append(("attention", f"{dt}-D{dd}-window{window}",
                                lambda q=q, k=k, w=window: cupyattn.attention(q, k, k, causal=True, window=w),
                                dict(dtype=dt, head_dim=dd, causal=True,
                                     used=("causal",) + (("window",) if window else ()))))
                continue
            cu = np.array([0, 7, 17], dtype=np.int32)
            qv, kv = arr((17, 4, d), dt), arr((17, 2, d), dt)
            out.append(("attention_varlen", f"{dt}-D{d}",
                        lambda qv=qv, kv=kv: cupyattn.attention_varlen(qv, kv, kv, cu, cu, 10, 10, causal=True),
                        dict(dtype=dt, head_dim=d, causal=True, used=("causal",))))
            for page in (4, 8):
                for layout in ("NHD", "HND"):
                    cache = cupyattn.PagedKVCache(1, 2, 2, d, num_pages=8, page_size=page,
                                                  dtype=np.dtype(arr((1,), dt).dtype), layout=layout)
                    cache.lengths[...] = 5
                    cache.host_lengths[...] = 5
                    qp = arr((2, 4, 2, d), dt)
                    out.append(("attention_paged", f"{dt}-D{d}-page{page}-{layout}",
                                lambda qp=qp, c=cache: cupyattn.attention_paged(qp, c, 0, causal=True),
                                dict(dtype=dt, head_dim=d, causal=True, page_size=page,
                                     used=("causal",) + (("hnd_pages",) if layout == "HND" else ()))))
            for group in (1, 4, 8):
                cache = cupyattn.KVCache(1, 2, 2, 64, d, np.dtype(arr((1,), dt).dtype))
                cache.lengths[...] = 9
                cache.host_lengths[...] = 9
                qd = arr((2, 2 * group, 1, d), dt)
                out.append(("decode_attention", f"{dt}-D{d}-group{group}",
                            lambda qd=qd, c=cache: cupyattn.decode_attention(qd, c, 0),
                            dict(dtype=dt, head_dim=d, group=group)))
                paged = cupyattn.PagedKVCache(1, 2, 2, d, num_pages=8, page_size=4, dtype=cache.dtype)
                out.append(("decode_attention_paged", f"{dt}-D{d}-group{group}",
                            lambda qd=qd, c=paged: cupyattn.decode_attention_paged(qd[:, :, 0], c, 0),
                            dict(dtype=dt, head_dim=d, group=group)))
        big = arr((4096, 4096), dt)  # one square operand serves both sides of the large shape
        for m, n, k in ((1, 64, 64), (16, 96, 64), (17, 33, 64), (4096, 4096, 4096)):
            a = big if m == 4096 else arr((m, k), dt)
            for entry, fn, bb in (("gemm_nt", cupyattn.gemm_nt, big if m == 4096 else arr((n, k), dt)),
                                  ("gemm_nn", cupyattn.gemm_nn, big if m == 4096 else arr((k, n), dt))):
                out.append((entry, f"{dt}-{m}x{n}x{k}", lambda fn=fn, a=a, bb=bb: fn(a, bb),
                            dict(dtype=dt, m=m, n=n, k=k)))
        for d in (64, 2048):
            x, w = arr((3, d), dt), arr((d,), dt)
            out.append(("rmsnorm", f"{dt}-D{d}", lambda x=x, w=w: cupyattn.rmsnorm(x, w), dict(dtype=dt, head_dim=d)))
    return out


def table_choice(entry, facts) -> str:
    """options.choose for a case's stated facts on the current device."""
    from cupyattn import device, config, decode_launch, options

    f = dict(facts)
    dt = np.dtype(config.BFLOAT16) if f["dtype"] == "bfloat16" else np.dtype(f.pop("dtype"))
    f.pop("dtype", None)
    tma = f.pop("tma", True)   # contiguous operands (16-byte rows): TMA reads them
    cc, smem = device.compute_capability(), device.smem_optin()
    fits = None
    if entry.startswith("decode"):  # a tile of the kernel within the device's shared memory per block
        d, m = f["head_dim"], min(-(-f["group"] // config.DECODE_MMA_ROWS), config.DECODE_MMA_MAX_MTILES)
        fits = lambda i: decode_launch._fit(i, dt, d, config.DECODE_MMA_TILES[(d, m)], m, smem) is not None  # noqa
    return options.choose(options.Call(entry, dt, cc=cc, smem=smem, fits=fits,
                                       problem=lambda i: None if tma else "not TMA-readable", **f))


@pytest.mark.gpu
def test_impl_none_is_the_tables_choice():
    """What each entry point's impl=None launches on this (emulated) family equals the first row
    of options.DEFAULTS[entry] whose conditions hold for the call's facts."""
    from cupyattn import device

    bad, seen = [], {}
    for entry, cid, call, facts in cases():
        got, want = launched(call, entry.startswith("attention")), table_choice(entry, facts)
        seen.setdefault(entry, set()).add(got)
        if got != want:
            bad.append(f"{entry} {cid}: launched {got}, the table says {want}")
    assert not bad, f"sm_{device.compute_capability()}:\n" + "\n".join(bad)
    # the grid reaches more than one row of each table where the family has them
    assert all(len(impls) >= 2 for e, impls in seen.items() if e != "attention_varlen"), seen
    assert "naive" in seen["attention"], seen  # a head dim no fused kernel has


def test_defaults_text_is_generated_from_the_rows():
    from cupyattn import options

    for entry, rules in options.DEFAULTS.items():
        text = options.defaults_text(entry)
        assert all(f"`{impl}`" in text for impl, _ in rules)
        assert all(c.text in text for _, conds in rules for c in conds)
    assert options.DEFAULTS["attention"][-1] == ("flash", ())


def test_config_override_sets_and_restores_and_refuses_unknown_names():
    """config.override: the settings hold inside the block and are back after it, also after an
    error; an unknown name is refused before anything is set."""
    from cupyattn import config

    before = (config.ATTN_SM90_ORDER, config.DECODE_PAGE_STAGING)
    with config.override(ATTN_SM90_ORDER="sections", DECODE_PAGE_STAGING=not before[1]):
        assert (config.ATTN_SM90_ORDER, config.DECODE_PAGE_STAGING) == ("sections", not before[1])
    assert (config.ATTN_SM90_ORDER, config.DECODE_PAGE_STAGING) == before
    with pytest.raises(RuntimeError, match="inside"):
        with config.override(ATTN_SM90_ORDER="sections"):
            raise RuntimeError("inside")
    assert config.ATTN_SM90_ORDER == before[0]
    with pytest.raises(ValueError, match="ATTN_SM90_ORDR"):
        with config.override(DECODE_PAGE_STAGING=not before[1], ATTN_SM90_ORDR="sections"):
            pass
    assert config.DECODE_PAGE_STAGING == before[1]
