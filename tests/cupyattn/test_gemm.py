"""gemm_nt / gemm_nn: GPU tier against the float64 reference and argument checks on device
arrays (every impl: simt, the multi-stage mma ring, skinny; batch folding); CPU tier for
host-array rejection, the offline compile check, the fold / dispatch rules, and a NumPy
emulation of the kernels' thread/fragment index maps."""
import os

import numpy as np
import pytest

from cupyattn import device, config
from cupyattn import device as _device
from cupyattn._checks import ComputeCapabilityError
from cupyattn import gemm as G
from cupyattn import reference as ref
from conftest import (expected_builds, DTYPES, assert_close, nan_like, np_dtype, rand_with_outliers,
                      skip_unless_device_runs, to_device)

FNS = {"nt": (G.gemm_nt, ref.gemm_nt), "nn": (G.gemm_nn, ref.gemm_nn)}


def _impls(dtype, layout):
    mma = ("mma",) if dtype != "float32" else ()
    skinny = ("skinny",) if layout == "nt" else ()
    return ("simt",) + mma + skinny + ("auto",)


# (layout, dtype, impl): every kernel each layout has, for every dtype it takes
LDV = [pytest.param(lay, d, v, id=f"{lay}-{d}-{v}") for lay in ("nt", "nn") for d in DTYPES for v in _impls(d, lay)]


def _b_shape(layout, n, k, lead=()):
    return tuple(lead) + ((n, k) if layout == "nt" else (k, n))


# --- GPU tier -------------------------------------------------------------------------------
# (M, N, K): 1, tile tails (17, 97, 1000), exact tiles (128), one long K; (17, 33, 300) has 10
# k-tiles, so the mma ring (4 stages) wraps twice, and 16 / 33 rows are one and three skinny
# m-tiles. The two largest are skipped on the CPU emulator (minutes there), never on a GPU.
SHAPES = [(1, 1, 1), (1, 17, 97), (17, 97, 128), (97, 128, 17), (128, 128, 128), (1000, 17, 97),
          (17, 1000, 1), (17, 33, 300), (16, 100, 264), (33, 20, 130),
          pytest.param((128, 1000, 1000), marks=pytest.mark.no_emu),
          pytest.param((97, 97, 4096), marks=pytest.mark.no_emu)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,impl", LDV)
@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(layout, dtype, impl, mnk):
    skip_unless_device_runs("gemm", impl, dtype)
    # K = 4096: inputs are rounded before the reference sees them and accumulation is float32,
    # so the error is the output's final rounding (~2e-4 fp16, ~2e-3 bf16 relative, measured in
    # NumPy) plus ~1e-6 of float32 summation: the default tolerances hold without loosening.
    m, n, k = mnk
    fn, rfn = FNS[layout]
    rng = np.random.default_rng(m * 7 + n * 13 + k)
    a, a64 = to_device(rand_with_outliers(rng, (m, k)), dtype)
    b, b64 = to_device(rand_with_outliers(rng, _b_shape(layout, n, k)), dtype)
    out = nan_like((m, n), dtype)
    got = fn(a, b, out=out, impl=impl)
    assert got is out
    assert_close(got, rfn(a64, b64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,impl", LDV)
def test_batched_broadcast_and_strided(layout, dtype, impl):
    import cupy

    skip_unless_device_runs("gemm", impl, dtype)

    fn, rfn = FNS[layout]
    rng = np.random.default_rng(1)
    m, n, k = 97, 40, 33
    cases = []
    # batched both; 2-D b shared (stride 0); broadcast dims on both sides; b broadcast over the
    # outer dim only (two batch dims, one of stride 0)
    cases.append(((2, 3, m, k), _b_shape(layout, n, k, (2, 3))))
    cases.append(((2, 3, m, k), _b_shape(layout, n, k)))
    cases.append(((2, 1, m, k), _b_shape(layout, n, k, (1, 3))))
    cases.append(((2, 3, m, k), _b_shape(layout, n, k, (3,))))
    for sa, sb in cases:
        a, a64 = to_device(rand_with_outliers(rng, sa), dtype)
        b, b64 = to_device(rand_with_outliers(rng, sb), dtype)
        expect = rfn(a64, b64)
        assert_close(fn(a, b, out=nan_like(expect.shape, dtype), impl=impl), expect, dtype)

    # strided views: every other batch entry, rows wider than K (lda > K), swapped batch dims,
    # and three non-mergeable batch dims (the documented contiguous-copy fallback)
    big_a, big_a64 = to_device(rand_with_outliers(rng, (4, 3, m, k + 5)), dtype)
    big_b, big_b64 = to_device(rand_with_outliers(rng, _b_shape(layout, n + 3, k + 3, (3, 4))), dtype)
    sl_b = (slice(None), slice(None), slice(0, n), slice(0, k)) if layout == "nt" else \
        (slice(None), slice(None), slice(0, k), slice(0, n))
    views = [
        (big_a[::2, :, :, :k], big_a64[::2, :, :, :k], big_b[:, ::2][sl_b].transpose(1, 0, 2, 3),
         big_b64[:, ::2][sl_b].transpose(1, 0, 2, 3)),
        (big_a[:, :, :, :k].transpose(1, 0, 2, 3), big_a64[:, :, :, :k].transpose(1, 0, 2, 3),
         big_b[sl_b], big_b64[sl_b]),
    ]
    x6, x6_64 = to_device(rand_with_outliers(rng, (4, 4, 4, m, k)), dtype)
    views.append((x6[::2, ::3, 1::2], x6_64[::2, ::3, 1::2], big_b[0, 0][sl_b[2:]], big_b64[0, 0][sl_b[2:]]))
    for a, a64, b, b64 in views:
        assert not a.flags.c_contiguous
        expect = rfn(a64, b64)
        assert_close(fn(a, b, out=nan_like(expect.shape, dtype), impl=impl), expect, dtype)

    # misaligned base pointers (not 16-byte aligned: cp.async off) and an odd-offset out
    flat_a, _ = to_device(rand_with_outliers(rng, (m * k + 1,)), dtype)
    flat_b, _ = to_device(rand_with_outliers(rng, (n * k + 1,)), dtype)
    a = flat_a[1:].reshape(m, k)
    b = flat_b[1:].reshape(_b_shape(layout, n, k))
    expect = rfn(cupy.asnumpy(a).astype(np.float64), cupy.asnumpy(b).astype(np.float64))
    out = nan_like((m * n + 1,), dtype)[1:].reshape(m, n)
    fn(a, b, out=out, impl=impl)
    assert_close(out, expect, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_empty_and_k0(layout):
    import cupy

    fn, _ = FNS[layout]
    for dtype in DTYPES:
        dt = np_dtype(dtype)
        a = cupy.zeros((0, 5, 8), dtype=dt)
        b = cupy.zeros(_b_shape(layout, 6, 8), dtype=dt)
        assert fn(a, b).shape == (0, 5, 6)
        assert fn(cupy.zeros((0, 8), dtype=dt), b).shape == (0, 6)
        out = nan_like((3, 5, 6), dtype)
        got = fn(cupy.zeros((3, 5, 0), dtype=dt), cupy.zeros(_b_shape(layout, 6, 0), dtype=dt), out=out)
        assert got is out and not cupy.isnan(out.astype(cupy.float32)).any()
        assert float(abs(out.astype(cupy.float32)).max()) == 0.0


# --- CPU tier: host arrays are rejected ------------------------------------------------------
def test_numpy_input_is_a_type_error():
    a = np.zeros((4, 8), np.float32)
    with pytest.raises(TypeError, match=r"gemm_nt\(\): a must be a cupy.ndarray"):
        G.gemm_nt(a, a)


# --- GPU tier: argument checks (device arrays; nothing is launched) --------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_argument_checks(layout):
    import cupy

    fn, _ = FNS[layout]
    name = f"gemm_{layout}"
    f32, f16 = cupy.float32, cupy.float16
    a = cupy.zeros((2, 4, 8), f32)
    b = cupy.zeros(_b_shape(layout, 5, 8), f32)
    with pytest.raises(TypeError, match=rf"{name}\(\): b has dtype float16 but a has float32"):
        fn(a, b.astype(f16))
    with pytest.raises(TypeError, match=rf"{name}\(\): a has dtype float64"):
        fn(a.astype(cupy.float64), b.astype(cupy.float64))
    with pytest.raises(ValueError, match=rf"{name}\(\): a must have at least 2 dimensions"):
        fn(cupy.zeros(8, f32), b)
    with pytest.raises(ValueError, match=rf"{name}\(\): b must have at least 2 dimensions"):
        fn(a, cupy.zeros(8, f32))
    with pytest.raises(ValueError, match=rf"{name}\(\): b has shape .* with K=7, but a has shape \(2, 4, 8\) with K=8"):
        fn(a, cupy.zeros(_b_shape(layout, 5, 7), f32))
    with pytest.raises(ValueError, match=rf"{name}\(\): batch dims of a \(2,\) and b \(3,\) do not broadcast"):
        fn(a, cupy.zeros(_b_shape(layout, 5, 8, (3,)), f32))
    with pytest.raises(ValueError, match=rf"{name}\(\): out has shape \(2, 4, 4\), expected \(2, 4, 5\)"):
        fn(a, b, out=cupy.zeros((2, 4, 4), f32))
    with pytest.raises(TypeError, match=rf"{name}\(\): out has dtype float16, expected float32"):
        fn(a, b, out=cupy.zeros((2, 4, 5), f16))
    with pytest.raises(ValueError, match=rf"{name}\(\): out must be C-contiguous"):
        fn(a, b, out=cupy.zeros((2, 5, 4), f32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match=rf"{name}\(\): a must be contiguous in its last dimension"):
        fn(cupy.zeros((4, 16), f32)[:, ::2], b)
    with pytest.raises(ValueError, match=rf"{name}\(\): b must be contiguous in its last dimension"):
        fn(a, cupy.zeros(_b_shape(layout, 5, 8), f32).T.copy().T)
    with pytest.raises(ValueError, match=rf"{name}\(\): impl='fast' is not supported"):
        fn(a, b, impl="fast")
    with pytest.raises(TypeError, match=rf"{name}\(\): impl='mma' needs float16 or bfloat16"):
        fn(a, b, impl="mma")
    if layout == "nn":
        with pytest.raises(ValueError, match=r"gemm_nn\(\): impl='skinny' is a gemm_nt kernel"):
            fn(a, b, impl="skinny")


# --- batch folding and dispatch -------------------------------------------------------------
def test_fold_batch_rule():
    """A batch sharing b folds into M when a's rows are evenly strided across it."""
    k = 64
    assert G._fold_batch(1, 0, [(8, k, 0)]) == (8, k, [])                  # x [8, 1, K] @ W^T
    assert G._fold_batch(1, 0, [(8, 3 * k, 0)]) == (8, 3 * k, [])          # rows of a strided view
    assert G._fold_batch(5, k, [(6, 5 * k, 0)]) == (30, k, [])             # x [6, 5, K] contiguous
    assert G._fold_batch(5, k, [(6, 7 * k, 0)]) == (5, k, [(6, 7 * k, 0)])  # gaps between batches
    assert G._fold_batch(5, k, [(6, 5 * k, 40)]) == (5, k, [(6, 5 * k, 40)])  # b differs per batch
    two = [(2, 15 * k, 0), (3, 5 * k, 0)]
    assert G._fold_batch(5, k, two) == (5, k, two)                          # two dims: not one stride
    assert G._fold_batch(5, k, []) == (5, k, [])


def test_auto_impl_rule():
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert G._pick_impl("auto", f16, True, config.GEMM_SKINNY_MAX_M) == "skinny"
    assert G._pick_impl("auto", f32, True, 1) == "skinny"
    assert G._pick_impl("auto", f16, True, config.GEMM_SKINNY_MAX_M + 1) == "mma"
    assert G._pick_impl("auto", f32, True, 17) == "simt"
    assert G._pick_impl("auto", f16, False, 1) == "mma"                    # skinny is NT only
    assert G._pick_impl("simt", f16, True, 1) == "simt"


class _LaunchLog:
    """Wraps the loader's get_function so each launch's kernel, grid and M are recorded."""

    def __init__(self, monkeypatch):
        self.launches = []
        real = G.get_function

        def get_function(spec, expr, dynamic_smem=0):
            kern = real(spec, expr, dynamic_smem)

            def launch(grid, block, args, **kw):
                self.launches.append((expr, tuple(grid), int(args[3])))
                return kern(grid, block, args, **kw)
            return launch
        monkeypatch.setattr(G, "get_function", get_function)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_weight_batch_is_one_gemm(dtype, monkeypatch):
    """x [B, T, K] @ W^T with a 2-D W: one launch over M = B*T rows (W read once), auto picks
    skinny while B*T <= 16; a batch that cannot fold still gives the right answer."""
    rng = np.random.default_rng(3)
    log = _LaunchLog(monkeypatch)
    w, w64 = to_device(rand_with_outliers(rng, (40, 72)), dtype)
    # what auto takes where (docs/gpus.md): tensor cores from the dtype's minimum (fp16 7.5, bf16
    # 8.0), else SIMT; fp32 skinny is FMA-only and runs everywhere
    tc = dtype != "float32" and device.compute_capability() >= config.MMA_MIN_CC[np_dtype(dtype)]
    small, large = ("skinny" if tc or dtype == "float32" else "simt"), ("mma" if tc else "simt")
    for lead, t, kernel in [((5,), 1, small), ((2, 3), 2, small), ((3,), 9, large)]:
        x, x64 = to_device(rand_with_outliers(rng, lead + (t, 72)), dtype)
        out = nan_like(lead + (t, 40), dtype)
        G.gemm_nt(x, w, out=out)
        assert_close(out, ref.gemm_nt(x64, w64), dtype)
        expr, grid, m = log.launches[-1]
        assert expr.startswith(f"gemm_{kernel}_kernel") and grid[1] == 1 and m == int(np.prod(lead)) * t
    big, big64 = to_device(rand_with_outliers(rng, (4, 3, 72)), dtype)
    out = nan_like((4, 1, 40), dtype)
    G.gemm_nt(big[:, 1:2], w, out=out)              # one row per batch entry, 3*72 apart: folds
    assert_close(out, ref.gemm_nt(big64[:, 1:2], w64), dtype)
    assert log.launches[-1][1][1] == 1 and log.launches[-1][2] == 4
    out = nan_like((4, 2, 40), dtype)
    G.gemm_nt(big[:, :2], w, out=out)               # rows 72 apart, batches 216: four GEMMs of M = 2
    assert_close(out, ref.gemm_nt(big64[:, :2], w64), dtype)
    assert log.launches[-1][1][1] == 4 and log.launches[-1][2] == 2


@pytest.mark.gpu
def test_decode_projection_allocates_nothing(monkeypatch):
    """gemm_nt(x, W, out=...) as tinylm's decode step calls it: no allocation, no device-to-host
    copy (CUDA graph capture)."""
    import cupy

    rng = np.random.default_rng(4)
    x, x64 = to_device(rand_with_outliers(rng, (3, 1, 96)), "float16")
    w, w64 = to_device(rand_with_outliers(rng, (50, 96)), "float16")
    out = nan_like((3, 1, 50), "float16")
    with monkeypatch.context() as m:
        for name in ("empty", "zeros", "full", "empty_like", "zeros_like", "asarray", "ascontiguousarray", "asnumpy"):
            m.setattr(cupy, name, lambda *a, _n=name, **k: pytest.fail(f"gemm_nt called cupy.{_n}"))
        G.gemm_nt(x, w, out=out)
    assert_close(out, ref.gemm_nt(x64, w64), "float16")


def test_mma_ring_fits_its_blocks_per_sm(compile_report):
    """The mma tile's dynamic smem ring and registers allow min_blocks per SM on an H100 (228 KB)
    and an A100 (164 KB), checked against ptxas; skinny's static smem fits without opt-in."""
    reports, errors = compile_report("gemm")
    assert not errors
    small = {G._expr("mma", d, nt, tile=config.GEMM_MMA_SMALL_SMEM) for d in config.MMA_DTYPES for nt in (True, False)}
    seen = {(r.kernel, r.arch) for r in reports if r.kernel.startswith(("gemm_mma_kernel", "gemm_skinny_kernel"))}
    assert sorted(seen) == [b for b in expected_builds(G.SPEC)
                            if b[0].startswith(("gemm_mma_kernel", "gemm_skinny_kernel"))]  # every one, every gate arch
    for r in reports:
        if r.arch not in config.SMEM_PER_SM_BY_ARCH:  # the A100 and H100 rows: what min_blocks was chosen for
            continue
        if r.kernel.startswith("gemm_mma_kernel"):
            tile = config.GEMM_MMA_SMALL_SMEM if r.kernel in small else config.GEMM_TILES["mma"]
            nt = ", true," in r.kernel
            blocks = tile.min_blocks[0 if nt else 1]
            per_block = config.gemm_mma_smem_bytes(tile, nt) + r.smem_bytes + config.SMEM_PER_BLOCK_RESERVED
            assert per_block * blocks <= config.SMEM_PER_SM_BY_ARCH[r.arch], r.kernel
            assert r.registers * tile.threads * blocks <= 65536, r.kernel
        elif r.kernel.startswith("gemm_skinny_kernel"):
            assert r.smem_bytes <= config.STATIC_SMEM_BYTES


def test_batch_collapse():
    # contiguous [2, 3] batch -> one dim; b broadcast over the outer dim -> two dims
    assert G._collapse((2, 3), [3 * 40, 40], [3 * 50, 50]) == [(6, 40, 50)]
    assert G._collapse((2, 3), [3 * 40, 40], [0, 50]) == [(2, 120, 0), (3, 40, 50)]
    assert G._collapse((2, 1, 3), [0, 0, 0], [0, 0, 0]) == [(6, 0, 0)]
    assert G._collapse((2, 2, 2), [400, 100, 10], [0, 0, 0]) == [(2, 400, 0), (2, 100, 0), (2, 10, 0)]


@pytest.mark.skipif(os.environ.get("CUPYATTN_EMULATE") == "1",
                    reason="the offline compile check needs the real CuPy and NVRTC")
def test_compile_check_no_spills(compile_report):
    reports, errors = compile_report("gemm")
    assert not errors, errors
    assert "sm_90" in {r.arch for r in reports}  # the gate: Hopper (CUPYATTN_FULL=1: Turing's 2-stage tile too)
    assert sorted((r.kernel, r.arch) for r in reports) == expected_builds(G.SPEC)
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]


# --- CPU tier: NumPy emulation of the kernels' index maps -----------------------------------
# These mirror the index expressions of kernels_cu/gemm.cu line by line (keep them in sync) and
# the PTX ISA's fragment layouts for ldmatrix and mma.m16n8k16, so a wrong lane/row/col formula
# shows up here on a machine without a GPU.
def _ldmatrix_x4(smem, addr, trans):
    """smem: flat array of 16-bit values; addr[lane]: element offset of row lane%8 of matrix
    lane//8. Returns r[lane, i, 2]: lane gets (row l/4, cols 2(l%4)+{0,1}) of matrix i, of its
    transpose with .trans."""
    r = np.zeros((32, 4, 2))
    for i in range(4):
        mat = np.stack([smem[addr[8 * i + row]: addr[8 * i + row] + 8] for row in range(8)])
        if trans:
            mat = mat.T
        for lane in range(32):
            r[lane, i] = mat[lane // 4, 2 * (lane % 4): 2 * (lane % 4) + 2]
    return r


def _mma16816(acc, a, b):
    """acc[32, 4] += A B with A [16, 16] from a[32, 4, 2], B [16, 8] from b[32, 2, 2] (PTX ISA
    'Matrix Fragments for mma.m16n8k16 with floating point type')."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # a_i lives in register i//2, half i%2
            A[g + 8 * ((i // 2) % 2), 2 * t + (i & 1) + 8 * (i >= 4)] = a[lane, i // 2, i % 2]
        for i in range(4):
            B[2 * t + (i & 1) + 8 * (i >= 2), g] = b[lane, i // 2, i % 2]
    assert not np.isnan(A).any() and not np.isnan(B).any()
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            acc[lane, i] += D[g + 8 * (i >= 2), 2 * t + (i & 1)]


def _stage_tile(rows, cols, lds, g, r0, rlim, c0, clim):
    """stage_tile<R, C, LDS>: returns the smem image (zero-filled outside the matrix)."""
    s = np.full(rows * lds, np.nan)
    cpr = cols // 8
    for i in range(rows * cpr // 256):
        for tid in range(256):
            ch = tid + 256 * i
            r, cc = ch // cpr, (ch % cpr) * 8
            gr, gc = r0 + r, c0 + cc
            for e in range(8):
                s[r * lds + cc + e] = g[gr, gc + e] if gr < rlim and gc + e < clim else 0.0
    return s


@pytest.mark.parametrize("nt", [True, False])
def test_mma_kernel_index_maps_emulated(nt):
    BM, BN, BK, PAD = 128, 128, 32, 8
    LDA = BK + PAD
    B_LDS = LDA if nt else BN + PAD
    m, n, k = 100, 90, 50  # one block tile with M, N, K tails
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((n, k) if nt else (k, n))
    expect = a @ (b.T if nt else b)
    c = np.full((m, n), np.nan)
    acc = np.zeros((8, 4, 4, 32, 4))  # [warp][mt][nt][lane][e]
    lanes = np.arange(32)
    for k0 in range(0, k, BK):
        sA = _stage_tile(BM, BK, LDA, a, 0, m, k0, k)
        sB = _stage_tile(BN, BK, LDA, b, 0, n, k0, k) if nt else _stage_tile(BK, BN, B_LDS, b, k0, k, 0, n)
        for warp in range(8):
            wm, wn = warp >> 2, warp & 3
            for ks in (0, 16):
                bf = np.zeros((4, 32, 2, 2))
                for p in range(2):
                    if nt:
                        nn_ = wn * 32 + p * 16 + (lanes >> 4) * 8 + (lanes & 7)
                        kk = ks + ((lanes >> 3) & 1) * 8
                        r = _ldmatrix_x4(sB, nn_ * B_LDS + kk, trans=False)
                    else:
                        kk = ks + ((lanes >> 3) & 1) * 8 + (lanes & 7)
                        nn_ = wn * 32 + p * 16 + (lanes >> 4) * 8
                        r = _ldmatrix_x4(sB, kk * B_LDS + nn_, trans=True)
                    bf[2 * p] = r[:, 0:2]
                    bf[2 * p + 1] = r[:, 2:4]
                for mt in range(4):
                    mm = wm * 64 + mt * 16 + ((lanes >> 3) & 1) * 8 + (lanes & 7)
                    af = _ldmatrix_x4(sA, mm * LDA + ks + (lanes >> 4) * 8, trans=False)
                    for ntile in range(4):
                        _mma16816(acc[warp, mt, ntile], af, bf[ntile])
    for warp in range(8):
        wm, wn = warp >> 2, warp & 3
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for mt in range(4):
                for h in range(2):
                    gm = wm * 64 + mt * 16 + g + 8 * h
                    for ntile in range(4):
                        gn = wn * 32 + ntile * 8 + 2 * t
                        for e in range(2):
                            if gm < m and gn + e < n:
                                c[gm, gn + e] = acc[warp, mt, ntile, lane, 2 * h + e]
    np.testing.assert_allclose(c, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nt", [True, False])
def test_simt_kernel_index_maps_emulated(nt):
    BM, BN, BK = 128, 64, 16
    m, n, k = 130, 70, 20  # M, N, K tails; two tiles in M and N, two K steps
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((n, k) if nt else (k, n))
    expect = a @ (b.T if nt else b)
    c = np.full((m, n), np.nan)
    tid = np.arange(256)
    tx, ty = tid % 16, tid // 16
    tiles_n = -(-n // BN)
    for blk in range(-(-m // BM) * tiles_n):
        m0, n0 = (blk // tiles_n) * BM, (blk % tiles_n) * BN
        acc = np.zeros((256, 8, 4))
        for k0 in range(0, k, BK):
            As, Bs = np.full((BK, BM), np.nan), np.full((BK, BN), np.nan)
            for i in range(8):
                gm, gk = m0 + ty + 16 * i, k0 + tx
                ok = (gm < m) & (gk < k)
                As[tx, ty + 16 * i] = np.where(ok, a[np.minimum(gm, m - 1), np.minimum(gk, k - 1)], 0)
            for i in range(4):
                if nt:
                    gn, gk = n0 + ty + 16 * i, k0 + tx
                    ok = (gn < n) & (gk < k)
                    Bs[tx, ty + 16 * i] = np.where(ok, b[np.minimum(gn, n - 1), np.minimum(gk, k - 1)], 0)
                else:
                    gk, gn = k0 + tid // 64 + 4 * i, n0 + tid % 64
                    ok = (gk < k) & (gn < n)
                    Bs[tid // 64 + 4 * i, tid % 64] = np.where(ok, b[np.minimum(gk, k - 1), np.minimum(gn, n - 1)], 0)
            assert not np.isnan(As).any() and not np.isnan(Bs).any()
            rows = np.concatenate([ty[:, None] * 4 + np.arange(4), 64 + ty[:, None] * 4 + np.arange(4)], 1)
            cols = tx[:, None] * 4 + np.arange(4)
            acc += np.einsum("kti,ktj->tij", As[:, rows], Bs[:, cols])
        for i in range(8):
            gm = m0 + (ty * 4 + i if i < 4 else 64 + ty * 4 + (i - 4))
            for j in range(4):
                gn = n0 + tx * 4 + j
                ok = (gm < m) & (gn < n)
                c[gm[ok], gn[ok]] = acc[ok, i, j]
    np.testing.assert_allclose(c, expect, rtol=1e-12, atol=1e-12)


# --- impl="wgmma" (Hopper: TMA + wgmma, kernels_cu/gemm_sm90.cu) ------------------------------------
def _hopper():
    """Skip where the device (as the dispatch sees it: CUPYATTN_ARCH counts) is not sm_90."""
    skip_unless_device_runs("gemm", "wgmma", "float16")


def _tma_ready(rng, shape, dtype):
    """A view of `shape` whose rows are padded to 16 bytes (TMA strides) and whose base is
    16-byte aligned, any last dimension (K or N tails go through TMA's zero fill)."""
    per16 = 16 // np_dtype(dtype).itemsize
    pitch = -(-shape[-1] // per16) * per16
    full, full64 = to_device(rand_with_outliers(rng, shape[:-1] + (pitch,)), dtype)
    return full[..., :shape[-1]], full64[..., :shape[-1]]


WG_SHAPES = [(1, 1, 1), (17, 97, 128), (97, 128, 17), (128, 128, 128), (1000, 17, 97), (17, 1000, 1),
             (17, 33, 300), (130, 257, 1000),
             pytest.param((2048, 2048, 1024), marks=pytest.mark.no_emu)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mnk", WG_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wgmma_matches_reference(layout, dtype, mnk):
    """Tails in M, N and K (TMA zero fill, guarded stores); K = 300 and 1000 wrap the stage ring
    (4 or 6 stages) and flip its phases several times."""
    _hopper()
    m, n, k = mnk
    fn, rfn = FNS[layout]
    rng = np.random.default_rng(m * 7 + n * 13 + k)
    a, a64 = _tma_ready(rng, (m, k), dtype)
    b, b64 = _tma_ready(rng, _b_shape(layout, n, k), dtype)
    out = nan_like((m, n), dtype)
    assert fn(a, b, out=out, impl="wgmma") is out
    assert_close(out, rfn(a64, b64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_batched_broadcast_persistent(layout, dtype, monkeypatch):
    """Batch dims as 4-D tensor maps (a dimension an operand lacks has size 1 there), a shared 2-D b
    folded into M, strided batch views, and a persistent grid of 3 blocks walking many tiles (the
    ring's phases carry over from tile to tile)."""
    _hopper()
    monkeypatch.setattr(G, "_sm_count", lambda: 3)
    fn, rfn = FNS[layout]
    rng = np.random.default_rng(11)
    m, n, k = 150, 200, 40
    for sa, sb in [((2, 3, m, k), _b_shape(layout, n, k, (2, 3))),   # batched both
                   ((2, 3, m, k), _b_shape(layout, n, k)),           # one b for all: folded into M
                   ((2, 1, m, k), _b_shape(layout, n, k, (1, 3))),   # broadcast on both sides
                   ((2, 3, m, k), _b_shape(layout, n, k, (3,)))]:    # b broadcast over the outer dim
        a, a64 = _tma_ready(rng, sa, dtype)
        b, b64 = _tma_ready(rng, sb, dtype)
        expect = rfn(a64, b64)
        assert_close(fn(a, b, out=nan_like(expect.shape, dtype), impl="wgmma"), expect, dtype)
    big, big64 = _tma_ready(rng, (4, 3, m, k), dtype)
    b, b64 = _tma_ready(rng, _b_shape(layout, n, k, (2, 3)), dtype)
    expect = rfn(big64[::2], b64)   # every other batch entry of a
    assert_close(fn(big[::2], b, out=nan_like(expect.shape, dtype), impl="wgmma"), expect, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_wgmma_refuses_what_tma_cannot_read(layout, monkeypatch):
    """Clear errors before anything is launched or written: float32, an odd row stride, a
    misaligned base, a reversed view, broadcast rows (naming the operand and the stride); a
    non-Hopper device names its arch."""
    import cupy

    fn, _ = FNS[layout]
    name = f"gemm_{layout}"
    rng = np.random.default_rng(5)
    a, _ = to_device(rand_with_outliers(rng, (20, 24)), "float16")
    b, _ = to_device(rand_with_outliers(rng, _b_shape(layout, 16, 24)), "float16")
    out = nan_like((20, 16), "float16")
    with pytest.raises(TypeError, match=rf"{name}\(\): impl='wgmma' needs float16 or bfloat16"):
        fn(a.astype(cupy.float32), b.astype(cupy.float32), impl="wgmma")
    with monkeypatch.context() as m:   # a non-Hopper device (an RTX 30 here): refused before launch
        m.setattr(_device, "compute_capability", lambda: 86)
        with pytest.raises(ComputeCapabilityError, match=rf"{name}\(\): impl='wgmma' with float16 inputs needs "
                                                         r"compute capability 9\.0 exactly .*is 8\.6"):
            fn(a, b, out=out, impl="wgmma")
    assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # untouched
    _hopper()   # the rest needs a device that runs wgmma
    odd, _ = to_device(rand_with_outliers(rng, (20, 21)), "float16")            # 42-byte rows
    odd_b, _ = to_device(rand_with_outliers(rng, _b_shape(layout, 16, 21)), "float16")
    flat, _ = to_device(rand_with_outliers(rng, (20 * 24 + 1,)), "float16")
    shifted = flat[1:].reshape(20, 24)                                              # 2 bytes past 16
    for x, y, why in [(odd, odd_b, r"TMA cannot read a: its stride of 42 bytes"),
                      (shifted, b, r"TMA cannot read a: its base address is 2 bytes past"),
                      (a[::-1], b, r"TMA cannot read a: its stride of -48 bytes along M \(a's rows\) "
                                   r"\(a reversed view\)"),
                      # broadcast rows (stride 0): never rewritten to a packed stride
                      (cupy.broadcast_to(a[:1], a.shape), b, r"TMA cannot read a: its stride of 0 bytes along "
                                                               r"M \(a's rows\) \(a broadcast view: 20 entries"),
                      (a, cupy.broadcast_to(b[:1], b.shape), r"TMA cannot read b: its stride of 0 bytes along "
                                                               + ("N" if layout == "nt" else "K") + r" \(b's rows\)")]:
        with pytest.raises(ValueError, match=rf"{name}\(\): impl='wgmma' needs operands TMA can read: {why}"):
            fn(x, y, out=out, impl="wgmma")
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # untouched


@pytest.mark.gpu
def test_auto_takes_wgmma_only_when_enabled_and_tma_can_read(monkeypatch):
    """impl="auto" keeps mma below config.GEMM_AUTO_WGMMA's sizes (what a GPU run measured faster);
    within them it takes wgmma on sm_90 for TMA-readable operands and mma for others."""
    import cupy

    _hopper()
    rng = np.random.default_rng(6)
    log = _LaunchLog(monkeypatch)
    a, a64 = _tma_ready(rng, (40, 64), "float16")
    w, w64 = _tma_ready(rng, (48, 64), "float16")
    odd, odd64 = to_device(rand_with_outliers(rng, (40, 63)), "float16")
    odd_w, odd_w64 = to_device(rand_with_outliers(rng, (48, 63)), "float16")
    G.gemm_nt(a, w)
    assert log.launches[-1][0].startswith("gemm_mma_kernel")
    monkeypatch.setattr(G.C, "GEMM_AUTO_WGMMA", {np.dtype("float16"): 40})
    out = nan_like((40, 48), "float16")
    G.gemm_nt(a, w, out=out)
    assert log.launches[-1][0].startswith("gemm_wgmma_kernel")
    assert_close(out, ref.gemm_nt(a64, w64), "float16")
    G.gemm_nt(odd, odd_w, out=out)  # 126-byte rows: TMA cannot read them
    assert log.launches[-1][0].startswith("gemm_mma_kernel")
    assert_close(out, ref.gemm_nt(odd64, odd_w64), "float16")
    # broadcast rows (stride 0 over 40 rows): mma reads them right, wgmma never sees them
    G.gemm_nt(cupy.broadcast_to(a[:1], a.shape), w, out=out)
    assert log.launches[-1][0].startswith("gemm_mma_kernel")
    assert_close(out, ref.gemm_nt(np.broadcast_to(a64[:1], a64.shape), w64), "float16")
    out_nn = nan_like((40, 64), "float16")
    G.gemm_nn(a[:, :40], cupy.broadcast_to(w[:1], (40, 64)), out=out_nn)
    assert log.launches[-1][0].startswith("gemm_mma_kernel")
    assert_close(out_nn, ref.gemm_nn(a64[:, :40], np.broadcast_to(w64[:1], (40, 64))), "float16")


def test_wgmma_tile_rule():
    t = config.gemm_wgmma_tile
    assert t(4096, 4096, 1, 132).bn == 256      # 512 tiles of 128 x 256: enough for 132 SMs
    assert t(512, 4096, 1, 132).bn == 128       # 64 wide tiles leave SMs idle; 128 narrow ones
    assert t(128, 128, 1, 132).bn == 256        # one tile either way: keep the wide one
    assert t(8192, 576, 1, 132).bn == 256       # 64 x 3 = 192 tiles


@pytest.mark.skipif(os.environ.get("CUPYATTN_EMULATE") == "1",
                    reason="the offline compile check needs the real CuPy and NVRTC")
def test_wgmma_compiles_for_sm90a_without_spills_within_shared_memory(compile_report):
    reports, errors = compile_report("gemm_sm90")
    assert not errors, errors
    assert sorted(r.kernel for r in reports) == sorted(G.SPEC_SM90.name_expressions)
    for r in reports:
        assert r.arch == "sm_90a" and not r.spills, r
        bn = int(r.kernel.split(", ")[2])
        assert r.smem_bytes + config.GEMM_WGMMA_TILES[bn].smem_bytes <= 227 * 1024, r.kernel
        assert r.registers * 384 <= 65536, r.kernel  # one block per SM at the entry budget
