"""Every refusal of an explicit ``impl=`` names the caller's argument and an alternative that is
valid for the entry point it was called on.

Each entry point x every impl name any entry point knows (and one no entry point knows) x every
dtype, on the emulated families sm_75, sm_80 and sm_90 (CUPYATTN_ARCH lowers the device): a call
either reaches the launch (stopped there: nothing is compiled or run) or raises, and then its
message must name ``impl`` and offer an alternative of this entry point (``impl=None`` or one of its
own impls), never another entry point's (decode_attention_paged must not answer with attention's
"use impl='flash'"). The valid inputs are tiny; the cases cost milliseconds each.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from cupyattn import options as O

DTYPES = ("float32", "float16", "bfloat16")
ARCHS = (75, 80, 90)
GEMM_IMPLS = ("auto", "simt", "mma", "skinny", "wgmma")
DECODE_IMPLS = ("auto", "simt", "mma")
# every impl name some entry point takes, and one none takes
ALL_IMPLS = sorted({i for impls in O.ENTRY_IMPLS.values() for i in impls} | set(GEMM_IMPLS) | {"tiled"})
VALID = {**{e: set(i) for e, i in O.ENTRY_IMPLS.items()},
         "PagedKVCache.decode": set(DECODE_IMPLS), "KVCache.decode": set(DECODE_IMPLS),
         "gemm_nt": set(GEMM_IMPLS), "gemm_nn": set(GEMM_IMPLS) - {"skinny"}}
VALID["decode_attention"] |= {"auto"}
VALID["decode_attention_paged"] |= {"auto"}


class _Launched(Exception):
    """Raised where a kernel would be compiled: the call passed every check."""


def _calls(dtype):
    """entry point -> call(impl) on small valid inputs of ``dtype`` (D = 64: every impl's head dim)."""
    import cupy

    import cupyattn

    dt = np.dtype(cupyattn.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(dt))

    q, k = arr(1, 4, 17, 64), arr(1, 2, 17, 64)
    qv, kv = arr(17, 4, 64), arr(17, 2, 64)
    cu = np.array([0, 17], dtype=np.int32)
    cache = cupyattn.KVCache(1, 1, 2, 32, 64, dt)
    cache.append(0, arr(1, 2, 3, 64), arr(1, 2, 3, 64))
    paged = cupyattn.PagedKVCache(1, 1, 2, 64, num_pages=4, page_size=8, dtype=dt)
    paged.append(0, arr(1, 2, 17, 64), arr(1, 2, 17, 64))
    pages = (paged.k[0], paged.v[0], paged.block_table, [17])
    a, b = arr(5, 64), arr(6, 64)
    return {
        "attention": lambda impl: cupyattn.attention(q, k, k, causal=True, impl=impl),
        "attention_varlen": lambda impl: cupyattn.attention_varlen(qv, kv, kv, cu, cu, 17, 17, impl=impl),
        "attention_paged": lambda impl: cupyattn.attention_paged(q[:, :, :2], *pages, impl=impl),
        "decode_attention": lambda impl: cupyattn.decode_attention(q[:, :, :1], cache, 0, impl=impl),
        "decode_attention_paged": lambda impl: cupyattn.decode_attention_paged(q[:, :, 0], *pages, impl=impl),
        "PagedKVCache.decode": lambda impl: paged.decode(q[:, :, 0], 0, impl=impl),
        "gemm_nt": lambda impl: cupyattn.gemm_nt(a, b, impl=impl),
        "gemm_nn": lambda impl: cupyattn.gemm_nn(a, b.T.copy(), impl=impl),
    }


def check_message(entry: str, impl: str, msg: str) -> str | None:
    """What is wrong with refusal ``msg`` of ``impl`` on ``entry``, or None: it must name
    ``impl``, offer impl=None, "one of" the valid impls or a named one, and name no impl of another
    entry point as the alternative."""
    if "impl" not in msg:
        return "does not name the impl argument"
    named = set(re.findall(r"impl='(\w+)'", msg)) - {impl}
    if named - VALID[entry]:
        return f"offers {sorted(named - VALID[entry])}, which {entry} does not take"
    if not (named or "impl=None" in msg or "expected one of" in msg):
        return "offers no alternative"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_every_refusal_names_impl_and_an_alternative_of_its_entry_point(monkeypatch, arch):
    import cupyattn
    from cupyattn import _loader, device

    if device.compute_capability() < arch:
        pytest.skip(f"the device is below sm_{arch}")
    calls = {dtype: _calls(dtype) for dtype in DTYPES}  # (the caches' appends run here)
    monkeypatch.setenv("CUPYATTN_ARCH", str(arch))
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "_SMEM_RAISED", {})

    def no_build(spec, expr, arch_):
        raise _Launched(expr)

    monkeypatch.setattr(_loader, "_compile", no_build)
    bad, refused = [], 0
    for dtype in DTYPES:
        for entry, call in calls[dtype].items():
            for impl in ALL_IMPLS:
                try:
                    call(impl)
                except _Launched:
                    continue
                except (TypeError, ValueError) as e:
                    refused += 1
                    why = check_message(entry, impl, str(e))
                    if why:
                        bad.append(f"{entry}(impl={impl!r}) {dtype} sm_{arch}: {why}: {e}")
            try:  # the alternative every refusal may offer: impl=None runs on every entry point
                call(None)
                bad.append(f"{entry}(impl=None) {dtype} sm_{arch}: launched nothing")
            except _Launched:
                pass
            except (TypeError, ValueError) as e:
                bad.append(f"{entry}(impl=None) {dtype} sm_{arch}: refused: {e}")
    assert refused > 40  # the invalid names alone: 8 entry points x 3 dtypes
    assert not bad, "\n".join(bad)
    # the cases the issue names
    x = calls["float32"]
    for impl in ("wgmma_persistent", "flash_mma"):
        with pytest.raises(ValueError, match=r"decode_attention_paged\(\): impl='\w+' is not supported; expected one "
                                             r"of None, 'auto', 'simt', 'mma'"):
            x["decode_attention_paged"](impl)
    del cupyattn


def test_the_message_check_can_fail():
    assert check_message("decode_attention_paged", "flash_mma",
                         "decode_attention_paged(): impl='flash_mma' needs float16 (use impl='flash')")
    assert check_message("attention", "wgmma", "attention(): wgmma needs sm_90")
    assert check_message("gemm_nt", "mma", "gemm_nt(): impl='mma' needs float16 or bfloat16")
    assert check_message("attention", "flash_mma", "attention(): impl='flash_mma' needs fp16 (use impl='flash')") is None
