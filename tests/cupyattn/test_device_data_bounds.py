"""Device data a caller hands over (offsets, lengths, page ids, a cache's own lengths) can make a
kernel compute wrong rows, never read or write outside the arrays it was given.

For every entry point that takes such data from device memory, and every impl it accepts, calls
with out-of-range values (offsets past the end, negative, decreasing; lengths past the capacity or
negative; page ids past the pages or negative) on inputs that hold only finite values, into outputs
that hold only finite values (zeros). The emulator's allocation guard (tests/emu: 0xFF bytes
around every array, checked after each launch) turns a write outside any array into an error, and
a read past an array's end into NaN, which reaches the outputs: so each call must finish, and its
outputs hold no NaN, Hopper kernels included (their scheduler clamps offsets and lengths to the
arrays' extents: kernels_cu/flash_attn_sm90_sched.cuh). The cases are tiny: milliseconds each on
the emulator.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import device_cannot_run, np_dtype

# per impl: (dtype, head dim), as tests/cupyattn/test_options_matrix.py's (builds the emulator already has)
SETUP = {"flash": ("float32", 32), "flash_mma": ("float16", 32), "naive": ("float16", 32),
         "wgmma": ("float16", 64), "wgmma_persistent": ("float16", 64), "simt": ("float32", 32),
         "mma": ("float16", 32)}


def _arr(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np_dtype(dtype)))


def _zeros(shape, dtype):
    import cupy

    return cupy.zeros(shape, dtype=np_dtype(dtype))


def _finite(*arrays):
    """Every output array holds no NaN (a read past an array's end shows as NaN here)."""
    import cupy

    for a in arrays:
        if a is not None:
            assert not bool(cupy.isnan(a.astype(cupy.float32)).any()), "an output holds NaN: a read outside an array"


def _skip(op, impl):
    dtype, d = SETUP[impl]
    if why := device_cannot_run(op, impl, dtype, d):
        pytest.skip(why)
    return dtype, d


def _run(entry, impl, cases, call):
    """Each (name, data) of ``cases`` through ``call(data)``: none may fail."""
    failed = []
    for name, data in cases:
        try:
            call(data)
            ok = True
        except RuntimeError as e:  # the guard: "wrote outside an allocation"
            ok, why = False, str(e).splitlines()[0]
        except AssertionError as e:
            ok, why = False, str(e).splitlines()[0]
        if not ok:
            failed.append(f"{name}: {why}")
    assert not failed, f"{entry} impl={impl}: " + "; ".join(failed)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash", "flash_mma", "wgmma_persistent"])
def test_attention_varlen_device_offsets(impl):
    import cupy

    import cupyattn

    dtype, d = _skip("attention", impl)
    rng = np.random.default_rng(1)
    tq, tk, hq, hkv = 17, 19, 2, 1
    q, k, v = _arr(rng, (tq, hq, d), dtype), _arr(rng, (tk, hkv, d), dtype), _arr(rng, (tk, hkv, d), dtype)
    far = [("q far past the end", ([0, 3, 2**30], [0, 9, tk])),
           ("k far past the end", ([0, 3, tq], [0, 9, 2**30])),
           ("both negative", ([0, -2**30, tq], [0, -2**30, tk]))]
    cases = [("q past the end", ([0, 3, tq + 1], [0, 9, tk])), ("k past the end", ([0, 3, tq], [0, 9, tk + 1])),
             ("q negative", ([0, -4, tq], [0, 9, tk])), ("k negative", ([0, 3, tq], [-3, 9, tk])),
             ("q decreasing", ([0, 12, 5], [0, 9, tk])), ("k decreasing", ([0, 3, tq], [0, 15, 4]))] + far

    def call(data):
        cq, ck = (cupy.asarray(np.asarray(x, dtype=np.int32)) for x in data)
        out = _zeros((tq, hq, d), dtype)
        o, l = cupyattn.attention_varlen(q, k, v, cq, ck, 32, 32, causal=True, impl=impl, return_lse=True, out=out)
        cupy.cuda.get_current_stream().synchronize()
        _finite(o)  # (lse: the call allocates it, so rows no offset reaches hold its fresh memory)
    _run("attention_varlen", impl, cases, call)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash", "flash_mma", "wgmma_persistent"])
def test_attention_paged_device_lengths_and_pages(impl):
    import cupy

    import cupyattn

    dtype, d = _skip("attention", impl)
    rng = np.random.default_rng(2)
    page, n_pages, hq, hkv = 8, 5, 2, 1
    kp, vp = _arr(rng, (n_pages, page, hkv, d), dtype), _arr(rng, (n_pages, page, hkv, d), dtype)
    table = [[0, 1, 2], [3, 4, 0]]
    q4 = _arr(rng, (2, hq, 3, d), dtype)
    qp = _arr(rng, (5, hq, d), dtype)
    far = [("seq_lens far past", ([2**30, 5], table, None)),
           ("packed q far past", ([9, 12], table, [0, 2, 2**30]))]
    cases = [("seq_lens past the capacity", ([40, 5], table, None)), ("seq_lens negative", ([-7, 5], table, None)),
             ("page ids past the pages", ([20, 12], [[0, 9, 2], [3, 2**30, 0]], None)),
             ("page ids negative", ([20, 12], [[0, -1, 2], [-2**30, 4, 0]], None)),
             ("packed q past the end", ([9, 12], table, [0, 2, 6])),
             ("packed q decreasing", ([9, 12], table, [0, 4, 1]))] + far

    def call(data):
        lens, tab, cq = data
        sl = cupy.asarray(np.asarray(lens, dtype=np.int32))
        bt = cupy.asarray(np.asarray(tab, dtype=np.int32))
        if cq is None:
            out = _zeros(q4.shape, dtype)
            o, l = cupyattn.attention_paged(q4, kp, vp, bt, sl, causal=True, impl=impl, return_lse=True, out=out)
        else:
            out = _zeros(qp.shape, dtype)
            o, l = cupyattn.attention_paged(qp, kp, vp, bt, sl, cu_seqlens_q=cupy.asarray(np.asarray(cq, np.int32)),
                                            max_seqlen_q=8, causal=True, impl=impl, return_lse=True, out=out)
        cupy.cuda.get_current_stream().synchronize()
        _finite(o)  # (lse: the call allocates it, so rows no offset reaches hold its fresh memory)
    _run("attention_paged", impl, cases, call)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flash", "flash_mma", "naive", "wgmma", "wgmma_persistent"])
def test_attention_device_key_lengths(impl):
    import cupy

    import cupyattn

    dtype, d = _skip("attention", impl)
    rng = np.random.default_rng(3)
    q, k, v = _arr(rng, (2, 2, 9, d), dtype), _arr(rng, (2, 1, 17, d), dtype), _arr(rng, (2, 1, 17, d), dtype)
    cases = [("past Sk", [40, 2**30]), ("negative", [-1, -2**30])]

    def call(kl):
        out = _zeros(q.shape, dtype)
        o, l = cupyattn.attention(q, k, v, causal=True, key_lengths=cupy.asarray(np.asarray(kl, np.int32)), impl=impl,
                                  return_lse=True, out=out)
        cupy.cuda.get_current_stream().synchronize()
        _finite(o)  # (lse: the call allocates it, so rows no offset reaches hold its fresh memory)
    _run("attention", impl, cases, call)


def _decode_cases():
    return [("lengths past the capacity", [40, 2**30]), ("lengths negative", [-1, -2**30])]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_paged_device_lengths_and_pages(impl, splits):
    import cupy

    import cupyattn

    dtype, d = _skip("decode", impl)
    rng = np.random.default_rng(4)
    kp, vp = _arr(rng, (5, 4, 1, d), dtype), _arr(rng, (5, 4, 1, d), dtype)
    q = _arr(rng, (2, 4, d), dtype)
    table = [[0, 1, 2], [3, 4, 0]]
    cases = [(n, (lens, table)) for n, lens in _decode_cases()] + [
        ("page ids past the pages", ([12, 9], [[0, 9, 2], [3, 2**30, 0]])),
        ("page ids negative", ([12, 9], [[0, -1, 2], [-2**30, 4, 0]]))]

    def call(data):
        lens, tab = data
        out = _zeros(q.shape, dtype)
        cupyattn.decode_attention_paged(q, kp, vp, cupy.asarray(np.asarray(tab, np.int32)),
                                        cupy.asarray(np.asarray(lens, np.int32)), max_seq_len=12, num_splits=splits,
                                        impl=impl, out=out)
        cupy.cuda.get_current_stream().synchronize()
        _finite(out)
    _run("decode_attention_paged", impl, cases, call)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["simt", "mma"])
@pytest.mark.parametrize("paged", [False, True])
def test_caches_with_corrupt_device_lengths(impl, paged):
    """A cache's own lengths (a public array) corrupted on the device: decode, append and the fused
    RoPE append stay inside the cache (rows are dropped, not written past it)."""
    import cupy

    import cupyattn

    dtype, d = _skip("decode", impl)
    rng = np.random.default_rng(5)
    dt = np_dtype(dtype)
    cache = (cupyattn.PagedKVCache(1, 2, 1, d, num_pages=6, page_size=4, dtype=dt) if paged
             else cupyattn.KVCache(1, 2, 1, 12, d, dt))
    cache.append(0, _arr(rng, (2, 1, 5, d), dtype), _arr(rng, (2, 1, 5, d), dtype))
    q = _arr(rng, (2, 4, 1, d), dtype)
    qkv = _arr(rng, (2, 2, (4 + 2) * d), dtype)

    def call(lens):
        cache.lengths[0] = cupy.asarray(np.asarray(lens, np.int32))
        out = _zeros(q.shape, dtype)
        cache.decode(q, 0, impl=impl, num_splits=2, out=out)
        cache.lengths[0] = cupy.asarray(np.asarray(lens, np.int32))
        cache.append(0, _arr(rng, (2, 1, 2, d), dtype), _arr(rng, (2, 1, 2, d), dtype))
        cache.lengths[0] = cupy.asarray(np.asarray(lens, np.int32))
        qo = cache.append_qkv(0, qkv, 4)
        cupy.cuda.get_current_stream().synchronize()
        _finite(out, qo, cache.k, cache.v)
        cache.host_lengths[0] = 5  # (the host mirror is what the host's capacity checks read)
    _run("KVCache", impl, _decode_cases() + [("lengths at the capacity", [12, 12])], call)


@pytest.mark.gpu
def test_fused_step_with_corrupt_device_lengths():
    import cupy

    import cupyattn
    from cupyattn import fused

    if why := device_cannot_run("fused", "skinny", "float16"):
        pytest.skip(why)
    rng = np.random.default_rng(6)
    cache = cupyattn.KVCache(1, 2, 1, 8, 32, np.float16)
    x, nw = _arr(rng, (2, 1, 64), "float16"), _arr(rng, (64,), "float16")
    w = _arr(rng, ((4 + 2) * 32, 64), "float16")

    def call(lens):
        cache.lengths[0] = cupy.asarray(np.asarray(lens, np.int32))
        qo = fused.rmsnorm_qkv_rope_append(x, nw, w, cache, 0, 4)
        cupy.cuda.get_current_stream().synchronize()
        _finite(qo, cache.k, cache.v)
        cache.host_lengths[0] = 0
    _run("rmsnorm_qkv_rope_append", "skinny", _decode_cases() + [("lengths at the capacity", [8, 8])], call)
