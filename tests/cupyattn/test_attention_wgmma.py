"""attention(impl="wgmma"), the Hopper kernel (kernels_cu/flash_attn_sm90.cu) under its grid scheduler,
and the kernel's variants (config.ATTN_SM90_*): GPU tier against
the float64 reference (on an H100, or on the CPU emulator, whose wgmma / TMA / mbarrier model is
tests/emu/emu_ptx_sm90.h), argument checks, and the offline sm_90a compile check (CPU tier).

Emulated shapes stay small (Sq, Sk up to 130: two query tiles, two key tiles of 128 or three of
64): a warpgroup-collective wgmma is slow to emulate. Every output is NaN-poisoned before the
call, so an element the kernel forgets to write fails."""
import os

import numpy as np
import pytest

from conftest import assert_close, nan_like, rand_with_outliers, skip_unless_device_runs, to_device, to_host
from cupyattn import _loader, config
from cupyattn import device as _device
from cupyattn._checks import ComputeCapabilityError
from cupyattn import flash_attn as FA
from cupyattn import flash_attn_sm90 as W
from cupyattn import reference as ref
from test_attention import _assert_lse, _qkv, _run, padded_every_option
from test_dispatch import launched
from test_attention import test_gpu_nan_semantics_follow_the_reference as _nan_semantics

EMULATE = os.environ.get("CUPYATTN_EMULATE") == "1"


@pytest.fixture
def rng():
    return np.random.default_rng(2226)


def _hopper():
    """Skip where the device (as the dispatch sees it: CUPYATTN_ARCH counts) is not sm_90."""
    skip_unless_device_runs("attention", "wgmma", "float16")


# --- GPU tier: against the float64 reference -------------------------------------------------------
# (Sq, Sk): one query against a full and a partial key tile; tails of both below one tile; Sq > Sk
# (causal: the first rows see no key: zeros, lse -inf) and Sq < Sk (bottom-right diagonal); two
# query tiles x two key tiles (the stage ring wraps and flips its phase, the causal grid starts with
# the heavier tile). Each (dtype, D, causal) meets two of them, so every shape meets each dtype,
# each D and both masks without the full product (minutes on the emulator).
SHAPES = [(1, 130), (17, 97), (97, 17), (130, 130)]
CASES = [pytest.param(dt, d, c, SHAPES[(i + j) % 4], id=f"{dt}-d{d}-{'causal' if c else 'full'}-{SHAPES[(i + j) % 4]}")
         for i, (dt, d, c) in enumerate((dt, d, c) for dt in ("float16", "bfloat16") for d in (64, 128)
                                        for c in (False, True))
         for j in (0, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal,shape", CASES)
def test_wgmma_matches_reference(rng, dtype, d, causal, shape):
    """GQA (4 query heads on 2 kv heads), batch 2, lse, poisoned out."""
    _hopper()
    sq, sk = shape
    _run(rng, dtype, 2, 4, 2, sq, sk, d, "wgmma", causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,shape", [("float16", True, (130, 97)), ("bfloat16", False, (17, 130))])
def test_wgmma_head_dim_256(rng, dtype, causal, shape):
    """D = 256: four 128-byte boxes per row, 64-key tiles (three of them for 130 keys), a 128-column
    O fragment; MQA (one kv head for three query heads)."""
    _hopper()
    _run(rng, dtype, 1, 3, 1, *shape, 256, "wgmma", causal=causal, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype,d,causal", [
    ("wgmma", "float16", 40, True), ("wgmma", "bfloat16", 72, False), ("wgmma_persistent", "float16", 100, True),
    (None, "float16", 111, False)])
def test_hopper_kernels_at_a_head_dim_they_lack(rng, impl, dtype, d, causal):
    """A D between the Hopper kernels' head dims runs on q, k, v zero-padded to the next of theirs
    (40 -> 64, 72 and 100 -> 128): GQA, lse, out poisoned. impl=None at D = 111 takes wgmma at 128
    (config.ATTN_AUTO_WGMMA) on copies that TMA reads whatever the caller's strides were."""
    _hopper()
    if impl is None:  # config.ATTN_AUTO_WGMMA's row for (float16, 128), read at the padded D
        import cupy

        assert (np.dtype(np.float16), 128) in config.ATTN_AUTO_WGMMA
        q, k = cupy.zeros((1, 4, 17, d), np.float16), cupy.zeros((1, 2, 17, d), np.float16)
        assert launched(lambda: FA.attention(q, k, k), attention=True) == "wgmma"
    _run(rng, dtype, 2, 4, 2, 17, 97, d, impl, causal=causal, return_lse=True, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["wgmma", "wgmma_persistent"])
def test_hopper_kernels_at_a_padded_head_dim_take_every_option(rng, impl):
    """D = 72 (-> 128): mask, key_lengths, scale, lse, a poisoned out, window and softcap (the
    persistent kernel), and k, v as broadcast views over the batch, which TMA cannot read but the
    padded copies it reads instead are contiguous."""
    _hopper()
    import cupy

    bcast = lambda x: cupy.broadcast_to(x[:1], x.shape)  # noqa: E731
    padded_every_option(rng, impl, "float16", 72, True, serving=impl == "wgmma_persistent", kv_view=bcast)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,sq", [(128, False, 97), (64, True, 40), (256, True, 130)])
def test_wgmma_hidden_keys_never_contribute_whatever_they_hold(rng, d, causal, sq):
    """K/V rows past key_lengths hold NaN / inf (an unwritten cache). Lengths 61 and 120 end
    inside a key tile whose rows past them are loaded by TMA with the rest of the tile (the
    producer zeroes them before P V reads them; P = 0 times NaN would be NaN); 0 gives zero rows
    and lse -inf; Sk leaves nothing hidden. Causal with Sq = 40: the diagonal and the length end in
    the same tile. MQA."""
    _hopper()
    import cupy

    b, hq, hkv, sk, dtype = 4, 2, 1, 130, "bfloat16"
    kl = np.array([sk, 61, 0, 120])
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    want, wl = ref.attention(qr, kr, vr, causal=causal, key_lengths=kl, return_lse=True)
    for bb in range(b):
        k[bb, :, kl[bb]:] = np.nan
        v[bb, :, kl[bb]:] = np.inf if bb == 1 else np.nan
    out, lse = FA.attention(q, k, v, causal=causal, key_lengths=cupy.asarray(kl), impl="wgmma",
                            return_lse=True, out=nan_like((b, hq, sq, d), dtype))
    assert_close(out, want, dtype)
    _assert_lse(to_host(lse), wl, 2e-2)
    assert np.all(to_host(out)[2] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.0])
def test_wgmma_scale_and_strided_views(rng, scale):
    """A negative scale (every tile takes the masking path: the fast path's max of unscaled S
    would pick the wrong key), zero (uniform weights) and a large one; q, k, v as [B, S, H, D]
    buffers viewed as [B, H, S, D] (strided maps); host key_lengths."""
    _hopper()
    _run(rng, "float16", 2, 4, 2, 97, 130, 64, "wgmma", causal=True, scale=scale, layout="bshd",
         key_lengths=[130, 77], return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,block_n,stages,overlap,pingpong,causal", [
    (64, 128, 3, False, True, True), (64, 128, 3, True, False, False), (64, 128, 3, False, False, True),
    (128, 64, 2, True, True, False), (128, 64, 4, True, True, True)])
def test_wgmma_tuning_variants_match_reference(rng, monkeypatch, d, block_n, stages, overlap, pingpong, causal):
    """Tiles benchmarks.tune may pick (flash_attn_sm90.tuning_tiles) besides the configured one: the
    softmax / P V overlap or the consumers' ping-pong switched off, 64-key slots (Sk = 130: three
    key tiles through a 2-slot ring, so it wraps and flips its phase); key lengths ending inside a
    tile."""
    _hopper()
    import cupy

    from cupyattn import _loader

    # the tuning spec registers itself; keep it out of the registry other tests read (the
    # sanitizer script's list of instantiations to launch)
    monkeypatch.setattr(_loader, "_REGISTRY", dict(_loader._REGISTRY))
    monkeypatch.setattr(W, "_TUNING_SPEC", None)
    tile = config.AttnWgmmaTile(block_n, stages, "test", overlap=overlap, pingpong=pingpong)
    assert any((t.block_n, t.stages, t.overlap, t.pingpong) == (block_n, stages, overlap, pingpong)
               for t in W.tuning_tiles(d))
    dtype, b, hq, hkv, sq, sk = "float16", 2, 2, 1, 130, 130
    kl = np.array([130, 70])
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, b, hq, hkv, sq, sk, d))
    want, wl = ref.attention(qr, kr, vr, causal=causal, key_lengths=kl, return_lse=True)
    out, lse = nan_like(q.shape, dtype), cupy.full((b, hq, sq), np.nan, dtype=cupy.float32)
    W.run(q, k, v, causal, d ** -0.5, cupy.asarray(kl, dtype=cupy.int32), out, lse, tile=tile)
    assert_close(out, want, dtype)
    _assert_lse(to_host(lse), wl, 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,knobs,d,causal,shape,tile", [
    ("wgmma", {"ATTN_SM90_DENSE_SCHEDULER": "persistent"}, 64, True, (130, 200), "64, 128, 3, true, true, 1,"),
    ("wgmma", {"ATTN_SM90_WIDE_N": True}, 128, False, (97, 380), "128, 176, 2, false, true, 0,"),
    ("wgmma", {"ATTN_SM90_OVERLAP": False}, 128, True, (130, 200), "128, 128, 2, false, true, 0,"),
    ("wgmma_persistent", {"ATTN_SM90_OVERLAP": True}, 256, True, (17, 130), "256, 64, 2, true, true, 1,"),
    ("wgmma", {"ATTN_SM90_ORDER": "sections"}, 64, False, (200, 200), "64, 128, 3, true, true, 0,"),
    ("wgmma", {"ATTN_SM90_ORDER": "sections", "ATTN_SM90_SECTION": 2}, 64, True, (200, 200),
     "64, 128, 3, true, true, 0,"),
])
def test_variant_knobs_match_reference(rng, monkeypatch, impl, knobs, d, causal, shape, tile):
    """Each opt-in variant (config.ATTN_SM90_*) computes the reference's result and launches the
    instantiation it names: the persistent scheduler under impl="wgmma", the 128 x 176 tile (380
    keys: the third key tile ends inside its box and past the keys), the overlap switched off and on,
    the traffic model's section order, sections of one GQA group; key lengths ending inside a tile,
    lse, GQA."""
    _hopper()
    import cupy

    for knob, value in knobs.items():
        monkeypatch.setattr(config, knob, value)
    launched = []
    real = W.get_function
    monkeypatch.setattr(W, "get_function", lambda spec, expr, **kw: launched.append(expr) or real(spec, expr, **kw))
    sq, sk = shape
    dtype, b, hq, hkv = "bfloat16" if d == 128 else "float16", 2, 4, 2
    kl = cupy.asarray([sk, sk - 33], dtype=cupy.int32)
    _run(rng, dtype, b, hq, hkv, sq, sk, d, impl, causal=causal, key_lengths=kl, return_lse=True)
    assert launched and all(tile in e for e in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("layout,folds", [("bhsd", True), ("bshd", False)])
def test_v3_causal_order_folds_the_batch_into_the_heads(rng, monkeypatch, layout, folds):
    """config.ATTN_SM90_ORDER = "v3" (the default): a causal grid launch without key lengths or mask
    runs as one sequence of B Hq heads (query-tile rank r of every sequence and head side by side,
    v3's order) where the batch stride is Hq head strides (a view); [B, S, H, D] views, whose batch
    does not fold, keep one section of Hq heads per sequence. Both match the reference (GQA: head
    b Hq + h reads K/V head b Hkv + h / group)."""
    _hopper()
    assert config.ATTN_SM90_ORDER == "v3"
    seen = []
    real = W._fold_batch
    monkeypatch.setattr(W, "_fold_batch", lambda *a: seen.append(real(*a)) or seen[-1])
    _run(rng, "float16", 3, 4, 2, 200, 200, 64, "wgmma", causal=True, return_lse=True, layout=layout)
    assert len(seen) == 1 and (seen[0] is not None) == folds
    if folds:
        assert seen[0][0].shape == (1, 12, 200, 64) and seen[0][1].shape == (1, 6, 200, 64)


@pytest.mark.gpu
def test_wgmma_nan_semantics_follow_the_reference(rng):
    """test_attention's NaN rules, for wgmma: a NaN key behind a -inf mask entry is hidden; a NaN
    query makes only its own row NaN (out and lse), even when the mask leaves it one key."""
    _hopper()
    _nan_semantics(rng, "wgmma", "float16")


def _mask(rng, shape, view=None):
    """A float32 device mask with about 30% -inf entries and one query row entirely -inf (zeros,
    lse -inf), the rest N(0, 1); ``view`` maps a wider array to the mask (a strided key dim)."""
    import cupy

    m = np.where(rng.random(shape) < 0.3, -np.inf, rng.standard_normal(shape))
    m[..., 3, :] = -np.inf
    m = cupy.asarray(m, dtype=cupy.float32)
    return m if view is None else view(m)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal,mshape,view,kl", [
    ("float16", 64, False, (97, 130), None, None),                       # [Sq, Sk], broadcast over B, H
    ("bfloat16", 128, True, (2, 1, 97, 130), None, [130, 50]),          # per batch, key lengths
    ("float16", 64, True, (2, 4, 97, 260), lambda m: m[..., ::2], None),  # strided key dim: copied
    ("float16", 128, False, (97, 1), None, [61, 130]),                  # one value per query row
])
def test_wgmma_additive_masks(rng, dtype, d, causal, mshape, view, kl):
    """Masks broadcast to [B, Hq, Sq, Sk] through strides (0 on broadcast dims), with -inf
    entries and fully masked rows, beside causal and key lengths; GQA."""
    _hopper()
    _run(rng, dtype, 2, 4, 2, 97, 130, d, "wgmma", causal=causal, mask=_mask(rng, mshape, view),
         key_lengths=kl, return_lse=True)


@pytest.mark.gpu
def test_wgmma_argument_checks(rng, monkeypatch):
    """Clear errors before anything is launched or written: float32, an unsupported head dim,
    views TMA cannot read (naming the tensor), a non-Hopper device (naming its arch)."""
    import cupy

    def dev(shape, dtype="float16"):
        return to_device(rand_with_outliers(rng, shape), dtype)[0]

    q, k = dev((1, 2, 20, 64)), dev((1, 2, 30, 64))
    out = nan_like(q.shape, "float16")
    with pytest.raises(TypeError, match=r"attention\(\): impl='wgmma' needs float16 or bfloat16 inputs, got float32"):
        FA.attention(q.astype(cupy.float32), k.astype(cupy.float32), k.astype(cupy.float32), impl="wgmma")
    q300, k300 = dev((1, 2, 20, 300)), dev((1, 2, 30, 300))
    with pytest.raises(ValueError, match=r"attention\(\): head_dim D=300 is not supported by impl='wgmma': the fused "
                                         r"kernels take D up to 256 .*\(impl='naive' takes any D\)"):
        FA.attention(q300, k300, k300, impl="wgmma")
    with monkeypatch.context() as m:   # a non-Hopper device (an RTX 30 here): refused before launch
        m.setattr(_device, "compute_capability", lambda: 86)
        with pytest.raises(ComputeCapabilityError, match=r"attention\(\): impl='wgmma' with float16 inputs needs "
                                                         r"compute capability 9\.0 exactly .*is 8\.6"):
            FA.attention(q, k, k, impl="wgmma", out=out)
    assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # untouched
    _hopper()   # the rest needs a device that runs wgmma
    wide = dev((1, 2, 30, 68))                      # rows of 136 bytes: not a multiple of 16
    flat = dev((2 * 30 * 64 + 1,))
    shifted = flat[1:].reshape(1, 2, 30, 64)        # base 2 bytes past a 16-byte boundary
    for kk, vv, why in [(wide[..., :64], k, r"k: its stride of 136 bytes"),
                        (k, shifted, r"v: its base address is 2 bytes past"),
                        (k, k[:, :, ::-1], r"v: its stride of -128 bytes along S \(a reversed view\)"),
                        # a broadcast (stride 0 over 2 heads): never rewritten to a packed stride
                        (cupy.broadcast_to(k[:, :1], k.shape), k, r"k: its stride of 0 bytes along H \(a broadcast "
                                                                  r"view: 2 entries at one address\)")]:
        with pytest.raises(ValueError, match=rf"attention\(\): impl='wgmma' needs q, k, v that TMA can read: {why}"):
            FA.attention(q, kk, vv, impl="wgmma", out=out)
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # untouched


@pytest.mark.gpu
def test_impl_none_takes_wgmma_only_when_enabled_and_launchable(rng, monkeypatch):
    """impl=None keeps flash_mma for (dtype, head dim) pairs outside config.ATTN_AUTO_WGMMA (those
    a GPU run measured faster); for a pair inside it, it takes wgmma on sm_90 for inputs it can
    launch on (tinylm's prefill goes through this) and flash_mma for the others, e.g. rows TMA
    cannot read."""
    _hopper()
    calls = []
    real = W.run
    monkeypatch.setattr(W, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    dtype = "bfloat16"  # bf16 at D=64: not measured, so outside the table
    (q, qr), (k, kr), (v, vr) = (to_device(x, dtype) for x in _qkv(rng, 1, 2, 1, 40, 70, 64))
    want = ref.attention(qr, kr, vr, causal=True)
    assert_close(FA.attention(q, k, v, causal=True, out=nan_like(q.shape, dtype)), want, dtype)
    assert (np.dtype(dtype), 64) not in config.ATTN_AUTO_WGMMA and calls == []
    monkeypatch.setattr(config, "ATTN_AUTO_WGMMA", ((np.dtype(dtype), 64),))
    assert_close(FA.attention(q, k, v, causal=True, out=nan_like(q.shape, dtype)), want, dtype)
    assert calls == [1]
    wide = to_device(np.zeros((1, 1, 70, 68)), dtype)[0]
    wide[..., :64] = k
    assert_close(FA.attention(q, wide[..., :64], v, causal=True, out=nan_like(q.shape, dtype)), want, dtype)
    assert calls == [1]  # 136-byte rows: flash_mma


# --- CPU tier: tile table, instantiations, offline compile for sm_90a ------------------------------------
def test_wgmma_tile_table_fits_and_is_built():
    """Every head dim of both tables has an instantiation per dtype under its scheduler, a tile the
    kernel's static_asserts take, and shared memory within an H100's 227 KB; so has every variant a
    config knob can ask for; impl=None takes wgmma only for (dtype, head dim) pairs the table has."""
    for d, t in config.ATTN_WGMMA_TILES.items():
        assert d % 64 == 0 and d <= 256 and t.block_n % 16 == 0 and t.block_n <= 256, (d, t)
        assert t.reason
    built = set(W.SPEC.name_expressions)
    for dt, d, t, sched in W.instantiations():
        assert W.smem_bytes(t, d, sched) <= 227 * 1024, (d, t, sched)
        assert W._expr(dt, d, t, sched) in built
    for dt in config.MMA_DTYPES:
        for d in config.ATTN_WGMMA_TILES:
            assert W._expr(dt, d, config.ATTN_WGMMA_TILES[d], W.GRID) in built
            assert W._expr(dt, d, config.ATTN_WGMMA_PERSISTENT_TILES[d], W.PERSIST) in built
    assert len(built) == 20   # 2 dtypes x (3 D x 2 schedulers + 3 overlap switches + the wide tile)
    assert "wgmma" not in FA.DEFAULT_IMPL.values()
    assert all(dt in config.MMA_DTYPES and d in config.ATTN_WGMMA_TILES for dt, d in config.ATTN_AUTO_WGMMA)


def test_variant_knobs_pick_built_tiles(monkeypatch):
    """Each knob's tile is an instantiation of the spec; the wide tile only for the grid at D = 128
    with no causal / window; an overlap switch nobody built falls back to the table's tile."""
    for d in config.ATTN_WGMMA_TILES:
        for impl, sched in (("wgmma", W.GRID), ("wgmma", W.PERSIST), ("wgmma_persistent", W.PERSIST)):
            for wide in (False, True):
                for ov in (None, False, True):
                    monkeypatch.setattr(config, "ATTN_SM90_WIDE_N", wide)
                    monkeypatch.setattr(config, "ATTN_SM90_OVERLAP", ov)
                    for masked in (False, True):
                        t = W.tile_for(impl, d, sched, masked)
                        assert W._expr("float16", d, t, sched) in W.SPEC.name_expressions, (impl, d, wide, ov)
                        assert (t.block_n == 176) == (wide and impl == "wgmma" and sched == W.GRID and d == 128
                                                      and not masked)
    monkeypatch.setattr(config, "ATTN_SM90_WIDE_N", False)
    monkeypatch.setattr(config, "ATTN_SM90_OVERLAP", False)
    assert not W.tile_for("wgmma", 128, W.GRID, True).overlap
    assert W.tile_for("wgmma", 64, W.GRID, True).overlap   # D = 64: no switched tile built


def test_wgmma_tuning_candidates_fit():
    for d in config.ATTN_WGMMA_TILES:
        tiles = W.tuning_tiles(d)
        assert tiles and all(W.smem_bytes(t, d, W.GRID) <= 227 * 1024 for t in tiles)
        c = config.ATTN_WGMMA_TILES[d]
        key = lambda t: (t.block_n, t.stages, t.overlap, t.pingpong)  # noqa: E731
        assert key(c) in {key(t) for t in tiles}, d
        assert {(t.overlap, t.pingpong) for t in tiles} == {(True, True), (True, False), (False, True),
                                                            (False, False)}, d


@pytest.mark.skipif(EMULATE, reason="the offline compile check needs the real CuPy and NVRTC")
def test_wgmma_compiles_for_sm90a_without_spills_within_shared_memory(compile_report):
    """Both schedulers and every variant: no spills, no serialised wgmma (the check fails on ptxas'
    C7514 / C7515), one block per SM at 384 threads, static + dynamic shared memory within 227 KB."""
    reports, errors = compile_report("flash_attn_sm90")
    assert not errors, errors
    assert sorted(r.kernel for r in reports) == sorted(W.SPEC.name_expressions)
    smem = {W._expr(dt, d, t, s): W.smem_bytes(t, d, s) for dt, d, t, s in W.instantiations()}
    for r in reports:
        assert r.arch == "sm_90a" and not r.spills, r
        assert r.smem_bytes + smem[r.kernel] <= 227 * 1024, r.kernel
        assert r.registers * 384 <= 65536, r.kernel  # one block per SM at the entry budget
