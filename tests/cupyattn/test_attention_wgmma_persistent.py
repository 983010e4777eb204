"""impl="wgmma_persistent": the Hopper attention kernel (kernels_cu/flash_attn_sm90.cu) under its
persistent scheduler: the tile order and the counter, window and softcap, packed (attention_varlen)
and paged (attention_paged) sequences.

GPU tier against the float64 references (cupyattn/reference.py), on an H100 or on the CPU
emulator (tests/emu: wgmma, TMA and mbarriers from the PTX ISA; 1-4 blocks in flight in a seeded
order, which take their tiles from the shared counter in different orders under different
schedules). The grid is cut to a few blocks (``_grid``) so that every block computes several tiles:
the rings, the Q slot, the work slots and the ping-pong turns carry over from tile to tile, and a
dynamic schedule's counter is claimed concurrently. Shapes stay tiny (a wgmma is slow to emulate);
heavier cases are ``emu_slow``. The emulated CI tier builds four of the six instantiations (fp16
D = 64, 128, 256, bf16 D = 128: about 45 CPU-seconds with the builds, 25 without); bf16 at D = 64
and 256 and the heavier variants are ``emu_slow`` (run on a GPU, and with ``-m gpu`` on the
emulator). Outputs are NaN-poisoned before each call.

CPU tier: the scheduler's section arithmetic (config), instantiations, the offline sm_90a check.
"""
import os

import numpy as np
import pytest

from conftest import assert_close, nan_like, rand_with_outliers, skip_unless_device_runs, to_device, to_host
from cupyattn import config
from cupyattn import device as _device
from cupyattn import flash_attn as FA
from cupyattn import flash_attn_sm90 as W
from cupyattn import flash_attn_sm90_persistent as P
from cupyattn import reference as ref
from test_attention import _assert_lse
from test_varlen_paged import _packed, _shuffled_pages

EMULATE = os.environ.get("CUPYATTN_EMULATE") == "1"
IMPL = "wgmma_persistent"


@pytest.fixture
def rng():
    return np.random.default_rng(3838)


@pytest.fixture
def grid(monkeypatch):
    """A persistent grid of ``n`` blocks (default 3): each block takes several tiles."""
    def set_grid(n=3):
        monkeypatch.setattr(P, "_sm_count", lambda: n)
    set_grid()
    return set_grid


def _hopper():
    skip_unless_device_runs("attention", IMPL, "float16")


def _counter_is_zero():
    """Every launch leaves its stream's tile counter at 0 (the last claim resets it)."""
    for c in W._COUNTERS.values():
        assert int(to_host(c)[0]) == 0


def _assert_result(got, lse, out, want, wlse, dtype):
    """The call returned ``out``, close to the reference, lse too; the tile counter is back at 0."""
    assert got is out
    assert_close(got, want, dtype)
    _assert_lse(to_host(lse), wlse, 2e-3 if dtype == "float16" else 2e-2)
    _counter_is_zero()


def _dense(rng, dtype, b, hq, hkv, sq, sk, d, impl=IMPL, causal=False, window=None, softcap=None, mask=None,
           key_lengths=None, scale=None, q_scale=1.0):
    """attention() against reference.attention, out and lse, on fresh inputs with outliers."""
    qh = rand_with_outliers(rng, (b, hq, sq, d)) * q_scale
    kh, vh = (rand_with_outliers(rng, (b, hkv, sk, d)) for _ in range(2))
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in (qh, kh, vh))
    out = nan_like((b, hq, sq, d), dtype)
    got, lse = FA.attention(q, k, v, causal=causal, scale=scale, mask=mask, key_lengths=key_lengths, impl=impl,
                            return_lse=True, out=out, window=window, softcap=softcap)
    want, wl = ref.attention(qr, kr, vr, causal=causal, scale=scale, mask=None if mask is None else to_host(mask),
                             key_lengths=key_lengths, return_lse=True, window=window, softcap=softcap)
    _assert_result(got, lse, out, want, wl, dtype)
    assert np.all(to_host(got)[~np.isfinite(wl)] == 0.0)   # rows that see no key: zeros
    return got


# --- GPU tier: dense attention() ------------------------------------------------------------------
# (Sq, Sk): several query tiles per head (the scheduler's ranks; causal: heaviest first), partial
# last tiles of queries and keys, Sq > Sk (the first rows see nothing) and Sq < Sk (bottom-right).
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal,shape,hq,hkv", [
    ("float16", 64, True, (260, 200), 2, 1),      # 3 query tiles x 2 heads over 3 blocks, MQA
    ("bfloat16", 128, False, (130, 97), 4, 2),    # static order (equal tiles), GQA
    ("float16", 128, True, (97, 260), 2, 2),      # Sq < Sk: the diagonal run crosses key tiles
    ("bfloat16", 128, True, (200, 130), 3, 1),    # Sq > Sk: zeros and lse -inf on top
    pytest.param("bfloat16", 64, True, (200, 130), 3, 1, marks=pytest.mark.emu_slow),  # bf16 D=64's build
])
def test_persistent_matches_reference(rng, grid, dtype, d, causal, shape, hq, hkv):
    _hopper()
    _dense(rng, dtype, 1, hq, hkv, *shape, d, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,shape", [
    ("float16", True, (130, 97)),
    pytest.param("bfloat16", False, (17, 130), marks=pytest.mark.emu_slow),  # bf16 D=256's build
])
def test_persistent_head_dim_256(rng, grid, dtype, causal, shape):
    """D = 256: v4's own tile (no softmax / P V overlap), 64-key tiles, MQA."""
    _hopper()
    _dense(rng, dtype, 2, 3, 1, *shape, 256, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal,window,softcap,shape", [
    ("float16", 64, False, (40, 7), None, (260, 300)),      # both edges: left-masked, bulk, right-masked runs
    ("bfloat16", 128, True, (100, -1), 30.0, (200, 260)),   # causal window + softcap (every tile masked)
    ("float16", 64, False, (-1, -1), 0.5, (97, 130)),       # softcap alone, huge scores (q x 40)
    ("float16", 128, False, (0, 0), None, (130, 17)),       # Sq > Sk: most rows see no key (zeros)
])
def test_window_and_softcap(rng, grid, dtype, d, causal, window, softcap, shape):
    """window and softcap as flash_attn.cu's serving variant takes them (bottom-right positions,
    the cap on the scaled scores before masking; v3, impl="wgmma", has neither and refuses them).
    Key tiles entirely outside the window are never loaded: a window that cuts them off shows in
    fewer tiles, not in the result, which the reference checks."""
    _hopper()
    _dense(rng, dtype, 1, 2, 1, *shape, d, causal=causal, window=window, softcap=softcap,
           q_scale=40.0 if softcap else 1.0)


@pytest.mark.gpu
def test_masks_key_lengths_and_scale(rng, grid):
    """An additive mask with -inf entries and a fully masked row (every tile takes the masked
    run), key lengths ending inside a loaded tile, and a negative scale (the bulk run's max of
    unscaled S would pick the wrong key: every tile masked)."""
    _hopper()
    import cupy

    m = np.where(rng.random((2, 1, 130, 97)) < 0.3, -np.inf, rng.standard_normal((2, 1, 130, 97)))
    m[..., 3, :] = -np.inf
    _dense(rng, "float16", 2, 4, 2, 130, 97, 64, causal=True, mask=cupy.asarray(m, dtype=cupy.float32),
           key_lengths=[97, 50])
    _dense(rng, "bfloat16", 2, 2, 1, 97, 130, 128, causal=False, key_lengths=[61, 130], scale=-0.3)


@pytest.mark.gpu
def test_hidden_keys_never_contribute_whatever_they_hold(rng, grid):
    """K/V rows past key_lengths hold NaN / inf (an unwritten cache): the loader zeroes the V rows
    of the tile past the length (TMA reads them with the rest), the masked run hides the keys."""
    _hopper()
    import cupy

    b, hq, hkv, sq, sk, d, dtype = 3, 2, 1, 40, 200, 128, "bfloat16"
    kl = np.array([sk, 61, 0])
    (q, qr), (k, kr), (v, vr) = (to_device(rand_with_outliers(rng, s), dtype)
                                 for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    want, wl = ref.attention(qr, kr, vr, causal=True, key_lengths=kl, return_lse=True)
    for bb in range(b):
        k[bb, :, kl[bb]:] = np.nan
        v[bb, :, kl[bb]:] = np.inf if bb == 1 else np.nan
    out, lse = FA.attention(q, k, v, causal=True, key_lengths=cupy.asarray(kl), impl=IMPL, return_lse=True,
                            out=nan_like((b, hq, sq, d), dtype))
    assert_close(out, want, dtype)
    _assert_lse(to_host(lse), wl, 2e-2)
    assert np.all(to_host(out)[2] == 0.0)


@pytest.mark.gpu
def test_launch_after_launch_and_on_another_stream(rng, grid):
    """The counter is back at 0 after each launch (no memset between them): two causal calls in a
    row, and one on a second stream (its own counter), all right."""
    _hopper()
    import cupy

    for _ in range(2):
        _dense(rng, "float16", 1, 2, 1, 200, 200, 64, causal=True)
    with cupy.cuda.Stream(non_blocking=True):
        _dense(rng, "float16", 1, 2, 1, 200, 200, 64, causal=True)
    assert len(W._COUNTERS) >= 2


@pytest.mark.gpu
def test_one_block_and_more_blocks_than_tiles(rng, grid):
    """Grid 1 (one block computes every tile, its rings wrap many times) and a grid of more
    blocks than tiles (dense: cut to the tiles)."""
    _hopper()
    grid(1)
    _dense(rng, "float16", 2, 2, 2, 130, 130, 64, causal=True)
    grid(64)
    _dense(rng, "bfloat16", 1, 2, 1, 17, 130, 64, causal=False)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.emu_slow), True])
def test_l2_sections_of_heads(rng, grid, monkeypatch, causal):
    """Head sections smaller than Hq (an L2 that holds two K/V heads): 6 query heads on 3 K/V heads
    in sections of 4 query heads, the last section short (2): every (head, query tile) is computed
    once, whatever order the blocks claim them in."""
    _hopper()
    monkeypatch.setattr(config, "ATTN_SM90_ORDER", "sections")
    monkeypatch.setattr(config, "ATTN_SM90_SECTION", 4)
    _dense(rng, "float16", 1, 6, 3, 200, 150, 64, causal=causal)


# --- GPU tier: attention_varlen ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv,causal,window,softcap", [
    ("float16", 64, 4, 2, True, None, None),
    ("bfloat16", 128, 2, 1, False, None, None),
    ("float16", 40, 2, 1, True, (20, -1), 15.0),   # D = 40: copies zero-padded to 64
    pytest.param("float16", 64, 3, 1, True, (20, -1), 15.0, marks=pytest.mark.emu_slow),  # matrix: pairs
    pytest.param("bfloat16", 64, 2, 2, False, (9, 3), None, marks=pytest.mark.emu_slow),
])
def test_varlen(rng, grid, dtype, d, hq, hkv, causal, window, softcap):
    """Ragged packed sequences: a sequence over two query tiles, an empty one, one query over 30
    keys, Sq > Sk; a key tile of one sequence reaches into the next (those keys hidden, their V
    rows zeroed). Host offsets first, then device offsets (used unchecked)."""
    _hopper()
    import cupy

    import cupyattn

    lens_q, lens_k = [17, 1, 0, 130, 5], [17, 30, 4, 150, 1]
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens_q, lens_k, hq, hkv, d, dtype)
    want, wlse = ref.attention_varlen(qh, kh, vh, cq, ck, causal, window=window, softcap=softcap, return_lse=True)
    for cu in ((cq, ck), (cupy.asarray(cq), cupy.asarray(ck))):
        out = nan_like(q.shape, dtype)
        got, lse = cupyattn.attention_varlen(q, k, v, *cu, max(lens_q), max(lens_k), causal=causal, window=window,
                                             softcap=softcap, return_lse=True, out=out, impl=IMPL)
        _assert_result(got, lse, out, want, wlse, dtype)


@pytest.mark.gpu
def test_varlen_many_sequences_and_idle_blocks(rng, grid):
    """40 short sequences (some empty): the scheduler's warp scan over 32 sequences at a time walks
    two windows, resuming where it stopped; then 2 tiles on a grid of 8 (blocks with no tile
    publish the end at once; the counter is still reset by the launch's last claim)."""
    _hopper()
    import cupyattn

    lens = [int(x) for x in rng.integers(0, 12, 40)]
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens, lens, 1, 1, 64, "float16")
    want = ref.attention_varlen(qh, kh, vh, cq, ck, causal=True)
    got = cupyattn.attention_varlen(q, k, v, cq, ck, 12, 12, causal=True, impl=IMPL, out=nan_like(q.shape, "float16"))
    assert_close(got, want, "float16")
    _counter_is_zero()
    grid(8)
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, [17], [40], 2, 1, 64, "float16")
    got = cupyattn.attention_varlen(q, k, v, cq, ck, 17, 40, causal=True, impl=IMPL, out=nan_like(q.shape, "float16"))
    assert_close(got, ref.attention_varlen(qh, kh, vh, cq, ck, causal=True), "float16")
    _counter_is_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [[0, 3, 25], [0, 12, 5, 40], [-7, 3, 17]])
def test_varlen_device_offsets_past_the_rows_stay_inside(rng, grid, cu):
    """Device offsets are not checked on the host (that would synchronise); the kernel clamps each
    sequence to the rows it was given (17 here): [0, 3, 25] ends 8 rows past q, k, v, out and lse,
    [0, 12, 5, 40] also goes backwards, [-7, 3, 17] starts before row 0. Nothing is read or written
    past the arrays (the emulator's guard bytes), and every sequence is the reference's over its
    clamped rows (where two clamped sequences overlap, both write: those rows are not checked)."""
    _hopper()
    import cupy

    import cupyattn

    rows, hq, hkv, d, dtype = 17, 2, 1, 64, "float16"
    (q, k, v), (qh, kh, vh), _, _ = _packed(rng, [rows], [rows], hq, hkv, d, dtype)
    out = nan_like(q.shape, dtype)
    cud = cupy.asarray(cu, dtype=cupy.int32)
    got, lse = cupyattn.attention_varlen(q, k, v, cud, cud, 20, 20, causal=True, impl=IMPL, return_lse=True, out=out)
    clamped, first = [], 0
    for b in range(len(cu) - 1):
        lo = min(max(cu[b], 0), rows)
        hi = min(max(cu[b + 1], lo), rows)
        clamped.append((lo, hi))
    cover = np.zeros(rows, dtype=int)
    for lo, hi in clamped:
        cover[lo:hi] += 1
    checked = 0
    for lo, hi in clamped:
        mine = np.flatnonzero(cover[lo:hi] == 1)
        if hi == lo or mine.size == 0:
            continue
        c = np.array([0, hi - lo], dtype=np.int32)
        want, wlse = ref.attention_varlen(qh[lo:hi], kh[lo:hi], vh[lo:hi], c, c, True, return_lse=True)
        assert_close(got[lo:hi][mine], want[mine], dtype)
        _assert_lse(to_host(lse)[:, lo:hi][:, mine], wlse[:, mine], 2e-3)
        checked += mine.size
    assert checked >= 8
    _counter_is_zero()


@pytest.mark.gpu
def test_varlen_neighbours_rows_never_reach_a_sequence(rng, grid):
    """The middle sequence's V rows are inf: the first sequence's key tile covers them (TMA reads
    128 rows), so they must be zeroed, not multiplied by P = 0 (0 x inf is NaN). The sequences
    around it are exact; the last one's tile runs past the packed end (TMA's zero fill)."""
    _hopper()
    import cupyattn

    lens = [30, 20, 40]
    (q, k, v), (qh, kh, vh), cq, ck = _packed(rng, lens, lens, 2, 1, 64, "float16")
    v[30:50] = np.inf
    vh = vh.copy()
    vh[30:50] = np.inf
    want = ref.attention_varlen(qh, kh, vh, cq, ck, causal=False)
    got = to_host(cupyattn.attention_varlen(q, k, v, cq, ck, 40, 40, impl=IMPL, out=nan_like(q.shape, "float16")))
    for s in (slice(0, 30), slice(50, 90)):
        assert_close(got[s], want[s], "float16")


# --- GPU tier: attention_paged ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size,d,dtype", [(8, 64, "float16"), (16, 128, "bfloat16"),
                                               pytest.param(64, 64, "bfloat16", marks=pytest.mark.emu_slow),
                                               (256, 64, "float16")])
def test_paged_packed_queries(rng, grid, page_size, d, dtype):
    """Chunked prefill over shuffled pages (NaN in spare pages and past each length): pages of 8
    and 16 tokens (16 and 8 copies per key tile, one per page and lane), 64 (2 per tile) and 256
    (a tile inside one page, at its row offset); causal with a window and softcap, GQA."""
    _hopper()
    import cupyattn

    lens, new, hq, hkv = [150, 9, 300], [20, 9, 130], 4, 2
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, page_size, hkv, d, dtype)
    cu = np.cumsum([0] + new).astype(np.int32)
    q, qh = to_device(rand_with_outliers(rng, (int(cu[-1]), hq, d)), dtype)
    for window, softcap in ((None, None), ((70, -1), 8.0)):
        want, wlse = ref.attention_paged(qh, cu, kh, vh, th, lens, causal=True, window=window, softcap=softcap,
                                         return_lse=True)
        out = nan_like(q.shape, dtype)
        got, lse = cupyattn.attention_paged(q, kd, vd, table, lens, cu_seqlens_q=cu, max_seqlen_q=max(new),
                                            causal=True, window=window, softcap=softcap, return_lse=True, out=out,
                                            impl=IMPL)
        _assert_result(got, lse, out, want, wlse, dtype)


@pytest.mark.gpu
def test_paged_dense_queries_and_device_lengths(rng, grid):
    """q [B, Hq, Sq, D] (every sequence added Sq tokens) over pages of 32, seq_lens on the device
    (read by the kernel only), lse [B, Hq, Sq]."""
    _hopper()
    import cupy

    import cupyattn

    lens, sq, hq, hkv, d, dtype = [17, 140, 40], 17, 2, 1, 64, "float16"
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, 32, hkv, d, dtype)
    q, qh = to_device(rand_with_outliers(rng, (3, hq, sq, d)), dtype)
    cu = np.arange(4) * sq
    want, wlse = ref.attention_paged(qh.transpose(0, 2, 1, 3).reshape(-1, hq, d), cu, kh, vh, th, lens,
                                     causal=True, return_lse=True)
    want = want.reshape(3, sq, hq, d).transpose(0, 2, 1, 3)
    wlse = wlse.reshape(hq, 3, sq).transpose(1, 0, 2)
    out = nan_like(q.shape, dtype)
    got, lse = cupyattn.attention_paged(q, kd, vd, table, cupy.asarray(lens, dtype=cupy.int32), causal=True,
                                        return_lse=True, out=out, impl=IMPL)
    assert_close(got, want, dtype)
    _assert_lse(to_host(lse), wlse, 2e-3)


@pytest.mark.gpu
def test_paged_head_major_pages_through_the_maps_strides(rng, grid):
    """Pages stored head-major ([N, Hkv, P, D], FlashInfer's HND) handed over as their
    [N, P, Hkv, D] view: the tensor maps take the view's strides, so the kernel reads them as it
    reads NHD pages (what attention_paged(layout="HND") needs of it: the view, no copy)."""
    _hopper()
    import cupy


    lens, new, hq, hkv, d, dtype = [70, 33], [17, 33], 2, 2, 64, "float16"
    kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, 16, hkv, d, dtype)
    k_hnd, v_hnd = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kd, vd))   # [N, Hkv, P, D]
    cu = np.cumsum([0] + new).astype(np.int32)
    q, qh = to_device(rand_with_outliers(rng, (int(cu[-1]), hq, d)), dtype)
    out = nan_like(q.shape, dtype)
    lens_d = cupy.asarray(lens, dtype=cupy.int32)
    P.run_paged(q, k_hnd.transpose(0, 2, 1, 3), v_hnd.transpose(0, 2, 1, 3), table, lens_d, cupy.asarray(cu), 2,
                max(lens), d ** -0.5, (-1, 0), 0.0, out, None)
    assert_close(out, ref.attention_paged(qh, cu, kh, vh, th, lens, causal=True), dtype)


@pytest.mark.gpu
def test_argument_checks(rng):
    """Clear errors before anything is written: pages under 8 tokens, float32, D = 32, a device
    that is not sm_90, views TMA cannot read, naming the argument."""
    import cupy

    import cupyattn
    from cupyattn import _loader
    from cupyattn._checks import ComputeCapabilityError

    _hopper()
    kd, vd, table, *_ = _shuffled_pages(rng, [9], 4, 1, 64, "float16")
    q, _ = to_device(rand_with_outliers(rng, (9, 2, 64)), "float16")
    out = nan_like(q.shape, "float16")
    with pytest.raises(ValueError, match=r"attention_paged\(\): impl='wgmma_persistent' needs page_size >= 8 .*got 4"):
        cupyattn.attention_paged(q, kd, vd, table, [9], cu_seqlens_q=[0, 9], max_seqlen_q=9, impl=IMPL, out=out)
    (qv, kv, vv), _, cq, ck = _packed(rng, [5], [5], 2, 1, 32, "float16")
    with pytest.raises(ValueError, match=r"attention_paged\(\): head_dim D=32 is not supported by "
                                         r"impl='wgmma_persistent'"):   # pages are not padded
        pages = cupy.zeros((1, 8, 1, 32), cupy.float16)
        cupyattn.attention_paged(qv, pages, pages, cupy.zeros((1, 1), np.int32), [5], cu_seqlens_q=[0, 5],
                                 max_seqlen_q=5, impl=IMPL)
    with pytest.raises(ValueError, match=r"attention_varlen\(\): impl='wgmma' is not supported; expected one of"):
        cupyattn.attention_varlen(qv, kv, vv, cq, ck, 5, 5, impl="wgmma")   # v3: dense inputs only
    q4, _ = to_device(rand_with_outliers(rng, (1, 2, 20, 64)), "float32")
    with pytest.raises(TypeError, match=r"attention\(\): impl='wgmma_persistent' needs float16 or bfloat16"):
        FA.attention(q4, q4, q4, impl=IMPL)
    q4 = q4.astype(cupy.float16)
    wide = to_device(np.zeros((1, 2, 20, 68)), "float16")[0][..., :64]    # rows of 136 bytes
    o4 = nan_like(q4.shape, "float16")
    with pytest.raises(ValueError, match=r"attention\(\): impl='wgmma_persistent' needs q, k, v that TMA can "
                                         r"read: k: its stride of 136 bytes along S"):
        FA.attention(q4, wide, q4, impl=IMPL, window=(3, 3), out=o4)
    bcast = cupy.broadcast_to(q4[:1, :1], (1, 2, 20, 64))                  # a 0 stride over 2 heads
    with pytest.raises(ValueError, match=r"impl='wgmma_persistent' needs q, k, v that TMA can read: v:"):
        FA.attention(q4, q4, bcast, impl=IMPL, out=o4)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_device, "compute_capability", lambda: 80)
        with pytest.raises(ComputeCapabilityError, match=r"impl='wgmma_persistent' with float16 inputs needs "
                                                         r"compute capability 9\.0 exactly"):
            FA.attention(q4, q4, q4, impl=IMPL, out=o4)
    assert bool(cupy.isnan(out.astype(cupy.float32)).all()) and bool(cupy.isnan(o4.astype(cupy.float32)).all())


@pytest.mark.gpu
def test_impl_none_takes_v4_where_measured(rng, grid, monkeypatch):
    """impl=None runs v4 for the (dtype, D) pairs of config.ATTN_AUTO_PERSISTENT (measured faster
    on an H100, 2026-11-27) and inputs it can launch on, with the reference's results; the
    previous default elsewhere: attention non-causal (v3), pairs outside the table, operands TMA
    cannot read (a broadcast key), pages under 8 tokens and HND pages."""
    _hopper()
    import cupy

    import cupyattn

    calls = []
    real = W.launch   # every launch of the kernel; the persistent scheduler's are recorded
    monkeypatch.setattr(W, "launch", lambda fn, *a, **k: (k["sched"] == W.PERSIST and calls.append(fn)) or
                        real(fn, *a, **k))
    f16 = np.dtype(np.float16)
    monkeypatch.setattr(config, "ATTN_AUTO_PERSISTENT", {"attention": ((f16, 64),), "attention_varlen": ((f16, 64),),
                                                         "attention_paged": ((f16, 64),)})
    (q, qr), (k, kr) = (to_device(rand_with_outliers(rng, s), "float16") for s in ((1, 2, 40, 64), (1, 1, 70, 64)))
    for causal, window, softcap, runs in ((True, None, None, ["attention"]), (True, (5, 0), 3.0, ["attention"]),
                                          (False, None, None, [])):
        calls.clear()
        want = ref.attention(qr, kr, kr, causal=causal, window=window, softcap=softcap)
        got = FA.attention(q, k, k, causal=causal, window=window, softcap=softcap, out=nan_like(q.shape, "float16"))
        assert_close(got, want, "float16")
        assert calls == runs, (causal, window, calls)
    calls.clear()
    bcast = cupy.broadcast_to(k[:, :, :1], k.shape)  # a 0 key stride: TMA cannot read it
    want = ref.attention(qr, kr, np.broadcast_to(kr[:, :, :1], kr.shape), causal=True)
    assert_close(FA.attention(q, k, bcast, causal=True, out=nan_like(q.shape, "float16")), want, "float16")
    assert calls == []

    (qv, kv, vv), (qvh, kvh, vvh), cq, ck = _packed(rng, [5, 9], [5, 9], 2, 1, 64, "float16")
    want = ref.attention_varlen(qvh, kvh, vvh, cq, ck, causal=True)
    got = cupyattn.attention_varlen(qv, kv, vv, cq, ck, 9, 9, causal=True, out=nan_like(qv.shape, "float16"))
    assert_close(got, want, "float16")
    assert calls == ["attention_varlen"]
    calls.clear()
    cupyattn.attention_varlen(qv.astype(cupy.float32), kv.astype(cupy.float32), vv.astype(cupy.float32), cq, ck, 9, 9)
    assert calls == []  # float32: flash

    lens = [9, 20]
    for page, layout, runs in ((16, "NHD", ["attention_paged"]), (4, "NHD", []), (16, "HND", [])):
        calls.clear()
        kd, vd, table, kh, vh, th = _shuffled_pages(rng, lens, page, 1, 64, "float16", layout=layout)
        want = ref.attention_paged(qvh, cq, kh, vh, th, lens, causal=True)
        got = cupyattn.attention_paged(qv, kd, vd, table, lens, cu_seqlens_q=cq, max_seqlen_q=9, causal=True,
                                       layout=layout, out=nan_like(qv.shape, "float16"))
        assert_close(got, want, "float16")
        assert calls == runs, (page, layout, calls)
    _counter_is_zero()


def test_impl_none_table_names_built_pairs():
    """config.ATTN_AUTO_PERSISTENT names the entry points that read it and (dtype, D) pairs the
    kernel is built for."""
    assert set(config.ATTN_AUTO_PERSISTENT) == {"attention", "attention_varlen", "attention_paged"}
    for pairs in config.ATTN_AUTO_PERSISTENT.values():
        assert all(dt in config.MMA_DTYPES and d in config.ATTN_WGMMA_PERSISTENT_TILES for dt, d in pairs)


# --- the persistent kernel's benchmark rows (the CLI end to end on tiny cases) ---------------------------------
@pytest.mark.gpu
@pytest.mark.emu_slow  # about 40 s on the emulator
def test_benchmark_rows_varlen_paged_and_causal(tmp_path, monkeypatch, capsys, grid):
    """`benchmarks varlen` (ragged, against the dense kernels and SDPA on the padded batch) and
    `benchmarks paged` (against the same keys contiguous): every impl right against the float64
    reference of the real rows; the persistent kernel in the attention rows."""
    _hopper()
    import conftest
    from benchmarks import report, timing
    from benchmarks.__main__ import main

    if conftest.EMULATE:  # the ceilings are GB-sized copies and GEMMs
        monkeypatch.setattr(timing, "measure_ceilings", lambda **kw: {"copy_gbps": 1.0, "gemm_tflops": 1.0})
    for argv, impls in ((["varlen", "--B", "3", "--H", "2", "--Hkv", "1", "--D", "64", "--lo", "5", "--hi", "70",
                          "--causal"], ("varlen", "varlen-wgmma", "padded", "padded-wgmma")),
                        (["paged", "--B", "2", "--H", "2", "--Hkv", "1", "--Sq", "17", "--Sk", "70", "--D", "64",
                          "--page", "16", "--causal"], ("paged", "paged-wgmma", "contiguous", "contiguous-wgmma")),
                        (["attention", "--B", "1", "--H", "2", "--Sq", "70", "--D", "64", "--causal"],
                         ("wgmma_persistent", "varlen-wgmma"))):
        out = tmp_path / f"{argv[0]}.json"
        rc = main(argv + ["--impl", ",".join(impls), "--reps", "1", "--warmup", "1", "--no-progress", "--no-flush",
                          "--json", str(out)])
        assert rc == 0, capsys.readouterr().err[-3000:]
        by = {x["impl"]: x for x in report.read_json(out)["records"]}
        for impl in impls:
            assert by[impl]["status"] == "ok" and by[impl]["rel_err"] < 1e-2, by[impl]


def test_benchmark_cases_of_issue_38():
    """The causal prefill sweep spans 128..16k; the varlen lengths come from the fixed seed in
    [64, 4096]; paged prefill at pages 16, 64, 256; FLOPs count only the pairs seen."""
    from benchmarks import specs

    causal = specs.sweep_cases("attention-causal")
    assert [c.p["Sq"] for c in causal] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert all(c.p["causal"] and c.p["B"] * c.p["Sq"] == 16384 for c in causal)
    v = specs.default_cases("varlen")[0]
    lens = specs.varlen_lengths(v.p["B"], v.p["lo"], v.p["hi"], v.p["seed"])
    assert lens == specs.varlen_lengths(16, 64, 4096, 0) and min(lens) >= 64 and max(lens) <= 4096
    assert specs.case_flops(v) == sum(2 * 32 * n * n * 128 for n in lens)   # causal: half of 4 n^2 D per head
    assert [c.p["page"] for c in specs.default_cases("paged")] == [16, 64, 256]
    p = specs.make_case("paged", "float16", B=1, H=1, Hkv=1, Sq=3, L=5, D=1, causal=True, page=16)
    assert specs.case_flops(p) == 4 * (3 + 4 + 5)   # queries at positions 2, 3, 4 see 3, 4, 5 keys


# --- CPU tier ---------------------------------------------------------------------------------------
def test_heads_per_section_follows_l2_and_groups():
    """Whole GQA groups, as many as the L2 share holds, at least one group, at most every head."""
    mb = 2**20
    f = config.attn_wgmma_heads_per_section
    share = config.ATTN_WGMMA_L2_SHARE
    assert f(50 * mb, int(50 * mb * share) // 16, 1, 32) == 16      # 16 K/V heads fit
    assert f(50 * mb, int(50 * mb * share) // 16, 4, 32) == 32      # capped at Hq
    assert f(50 * mb, int(50 * mb * share) // 3, 4, 32) == 12       # 3 groups of 4
    assert f(50 * mb, 10**12, 4, 32) == 4                            # one group even if it overflows L2
    assert f(50 * mb, 1, 1, 7) == 7


def test_persistent_instantiations_fit_and_are_built():
    """Every persistent tile is built (the kernel's one spec) and fits the shared memory with its
    second Q slot where the kernel takes one."""
    for d, t in config.ATTN_WGMMA_PERSISTENT_TILES.items():
        assert d in config.ATTN_WGMMA_TILES and W.smem_bytes(t, d, W.PERSIST) <= 227 * 1024 and t.reason
        for dt in config.MMA_DTYPES:
            assert W._expr(dt, d, t, W.PERSIST) in P.SPEC.name_expressions
    # D = 64 and 128 take a second Q slot, D = 256 (64 KB of Q) does not
    t64, t256 = config.ATTN_WGMMA_PERSISTENT_TILES[64], config.ATTN_WGMMA_PERSISTENT_TILES[256]
    assert W.smem_bytes(t64, 64, W.PERSIST) == W.smem_bytes(t64, 64, W.GRID) + 128 * 64 * 2
    assert W.smem_bytes(t256, 256, W.PERSIST) == W.smem_bytes(t256, 256, W.GRID)


def test_compile_check_refuses_serialised_wgmma():
    """ptxas' serialised-wgmma warnings (C7514, C7515, or worded without a code) are errors of the
    offline check; other warnings are not."""
    from cupyattn import _compile_check as cc

    for line in ("ptxas /tmp/x, line 5; warning : Potential Performance Loss: wgmma.mma_async instructions are "
                 "serialized due to the presence of Extern calls in the function 'k' (C7515)",
                 "ptxas warning : wgmma.mma_async instructions are serialized due to an accumulator read (C7514)",
                 "ptxas info : wgmma.mma_async serialized in function 'k'",
                 "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                 "due to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'"):
        assert cc._IGNORED_RE.findall(line) or cc._SERIALISED_RE.findall(line), line
    assert not (cc._IGNORED_RE.findall("ptxas info : Used 168 registers")
                or cc._SERIALISED_RE.findall("ptxas info : Used 168 registers"))
