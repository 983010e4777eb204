"""Every GPU family from Turing (sm_75) up: the dispatch table (config "GPU families"),
what the offline check compiles per arch, the CUPYATTN_ARCH override, and (GPU tier, also on the
emulator as sm_75 and sm_90) the errors for an explicit impl the device cannot run.

The expected minimums come from the PTX ISA's target notes (ldmatrix and mma.m16n8k8.f16: sm_75;
cp.async, mma.m16n8k16, bf16 mma: sm_80; wgmma: sm_90a) and the per-block shared-memory limits
of the CUDA C Programming Guide (T4 64 KB, sm_86/89/120 99 KB), not from the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyattn
from conftest import assert_close, device_cannot_run, gate_built, nan_like, np_dtype, rand_with_outliers, to_device
from cupyattn import _compile_check as cc
from cupyattn import _loader, config, decode, device, flash_attn, flash_launch, gemm
from cupyattn import reference as ref

F16, BF16, F32 = config.FLOAT16, config.BFLOAT16, config.FLOAT32


# --- CPU tier ------------------------------------------------------------------------------------
def test_instruction_minimums_follow_the_ptx_isa():
    runs = config.impl_runs_on
    for op, impl in (("attention", "flash_mma"), ("decode", "mma"), ("gemm", "mma"), ("gemm", "skinny")):
        assert not runs(op, impl, F16, 70) and runs(op, impl, F16, 75)      # ldmatrix, m16n8k8.f16
        assert not runs(op, impl, BF16, 75) and runs(op, impl, BF16, 80)    # bf16 mma
        assert runs(op, impl, BF16, 120)
    assert runs("gemm", "skinny", F32, 70)                                  # FMA only
    assert runs("gemm", "wgmma", F16, 90)
    assert not any(runs("gemm", "wgmma", F16, c) for c in (80, 89, 100, 120))  # sm_90a: 9.0 only
    for impl in ("flash", "naive"):
        assert all(runs("attention", impl, d, 70) for d in config.DTYPES)
    assert config.gpu_family(87).smem_optin == 99 * 1024  # newest family at or below
    with pytest.raises(ValueError, match=r"6\.1 is below the minimum 7\.0"):
        config.gpu_family(61)


def _mma_exprs(exprs):
    return [e for e in exprs if "mma" in e or "skinny" in e or e.startswith(("norm_", "gemm_residual"))]


def test_each_arch_compiles_what_it_can_run():
    """exprs_for: sm_75 gets fp16 tensor-core kernels but no bf16 ones and nothing over its 64 KB;
    sm_70 no tensor-core kernel; sm_80 and sm_90 everything; sm_90a specs only on 9.0."""
    specs = {s.name: s for s in cupyattn.all_specs()}
    for s in specs.values():
        if s.sm90a:
            assert s.exprs_for(90) == s.name_expressions and s.exprs_for(100) == s.exprs_for(80) == ()
            continue
        # everything but the tiles of another family (config.FLASH_MMA_FAMILY_TILES: sm_100's)
        others = tuple(e for e in s.name_expressions if 90 in dict(s.families).get(e, (90,)))
        assert s.exprs_for(80) == s.exprs_for(90) == others
        assert s.exprs_for(60) == ()
        t4 = s.exprs_for(75)
        assert not [e for e in _mma_exprs(t4) if "__nv_bfloat16" in e], s.name
        assert not [e for e in _mma_exprs(s.exprs_for(70)) if "__half" in e or "bfloat16" in e], s.name
        smem = {e: b for e, _, b in s.needs}
        assert all(smem.get(e, 0) <= 64 * 1024 for e in t4)
    # the Turing defaults are there: fp16 flash_mma at D=64, fp16 mma GEMM (2-stage tile), SIMT decode
    assert flash_attn._expr("flash_mma", F16, 64, True) in specs["flash_attn"].exprs_for(75)
    assert flash_attn._expr("flash_mma", F16, 128, True) not in specs["flash_attn"].exprs_for(75)  # 85 KB
    # ... but its 32-key tile (60 KB) is, for fp16 only: no family that runs bf16 mma has under 99 KB
    small = config.FLASH_MMA_SMALL_SMEM_TILES[128]
    assert flash_attn._expr("flash_mma", F16, 128, True, tile=small) in specs["flash_attn"].exprs_for(75)
    assert flash_attn._expr("flash_mma", BF16, 128, True, tile=small) not in specs["flash_attn"].name_expressions
    for d, m in config.DECODE_MMA_SMALL_SMEM_TILES:   # explicit decode mma on a T4 at D = 128, 256
        compact = decode._mma_expr(F16, d, m, config.DECODE_MMA_SMALL_SMEM_TILES[(d, m)])
        assert compact in specs["decode"].exprs_for(75)
        assert decode._mma_expr(BF16, d, m, config.DECODE_MMA_SMALL_SMEM_TILES[(d, m)]) not in specs["decode"].name_expressions
    assert flash_attn._expr("flash_mma", F16, 256, True) not in specs["flash_attn"].exprs_for(75)  # spills
    assert gemm._expr("mma", F16, True, tile=config.GEMM_MMA_SMALL_SMEM) in specs["gemm"].exprs_for(75)
    assert gemm._expr("mma", F16, True) not in specs["gemm"].exprs_for(75)                          # 80 KB


def test_a_family_tile_replaces_the_main_one_on_its_family_only():
    """config.FLASH_MMA_FAMILY_TILES: sm_100 (and its family, e.g. 10.3) compiles and dispatches its
    own D = 64 flash_mma tile in all three variants, every other family the main one; the other
    head dims keep FLASH_MMA_TILES' entry on sm_100."""
    spec, smem = flash_attn.SPEC, 227 * 1024
    mine, main = config.FLASH_MMA_FAMILY_TILES[100][64], config.FLASH_MMA_TILES[64]
    assert mine != main and config.flash_mma_smem_bytes(64, mine) <= smem
    for dt in (F16, BF16):
        for causal, serving in ((False, False), (True, False), (False, True)):
            ours = flash_attn._expr("flash_mma", dt, 64, causal, serving, tile=mine)
            theirs = flash_attn._expr("flash_mma", dt, 64, causal, serving, tile=main)
            assert spec.min_cc(ours) == 100
            for c in (100, 103):
                assert ours in spec.exprs_for(c) and theirs not in spec.exprs_for(c)
            for c in (80, 86, 90, 120):
                assert theirs in spec.exprs_for(c) and ours not in spec.exprs_for(c)
    assert flash_attn._tile("flash_mma", F16, 64, smem, 100) == config.flash_mma_main_tile(64, 103) == mine
    assert flash_attn._tile("flash_mma", F16, 64, smem, 90) == flash_attn._tile("flash_mma", F16, 64) == main
    assert all(flash_attn._tile("flash_mma", BF16, d, smem, 100) == config.FLASH_MMA_TILES[d]
               for d in config.HEAD_DIMS if d != 64)


def test_what_sm100_runs_in_place_of_its_spilling_builds_does_not_spill():
    """ptxas for sm_100 spilled the main D = 64 flash_mma tile (4 B, its serving variant 28 B) and
    the fp32 skinny GEMM / fused residual GEMM (8 B, before their sm_100 launch bounds). What sm_100
    runs now compiles without spills (the whole sm_100 check takes too long for CI)."""
    from cupyattn import fused

    if "100" not in cc.nvrtc_arches(("100",)):
        pytest.skip("the installed NVRTC does not know sm_100")
    picks = ((flash_attn.SPEC, [e for e in flash_attn.SPEC.exprs_for(100)
                                if e.startswith(("flash_attn_mma<__half, 64,", "flash_attn_mma<__nv_bfloat16, 64,"))]),
             (gemm.SPEC, [e for e in gemm.SPEC.exprs_for(100) if e.startswith("gemm_skinny_kernel<float,")]),
             (fused.SPEC, [e for e in fused.SPEC.exprs_for(100) if "<float," in e]))
    for spec, exprs in picks:
        reports = cc.compile_spec(spec, "100", exprs)
        assert exprs and sorted(r.kernel for r in reports) == sorted(exprs)
        assert not [(r.kernel, r.spill_stores) for r in reports if r.spills], spec.name


@pytest.mark.parametrize("limit,cc", [(64 * 1024, 75), (99 * 1024, 86), (99 * 1024, 120)])
def test_decode_plans_fit_the_device(limit, cc):
    """Every decode plan on a device of ``limit`` bytes per block fits it (ring + static bound),
    bf16 takes SIMT below sm_80, and an H100 keeps the configured tiles."""
    for dt in config.DTYPES:
        for d in config.HEAD_DIMS:
            for group in (1, 3, 4, 8, 32):
                p = decode._plan("auto", dt, d, group, cc, limit)
                m_tiles = int(p.expr.split(",")[2]) if p.impl == "mma" else 1
                assert p.tile.ring_bytes + decode.static_smem_bytes(p.impl, d, dt.itemsize, p.tile, m_tiles) <= limit
                ps = decode._plan("auto", dt, d, group, cc, limit, serving=True, staged=True)  # + the page window
                m_tiles = int(ps.expr.split(",")[2]) if ps.impl == "mma" else 1
                assert ps.tile.ring_bytes + decode.static_smem_bytes(ps.impl, d, dt.itemsize, ps.tile, m_tiles,
                                                                      staged=True) <= limit
                assert ps.expr.endswith(", true, true>")
                if dt == BF16 and cc < 80:
                    assert p.impl == "simt"
                assert decode._plan("auto", dt, d, group, 90, 227 * 1024) == decode._plan("auto", dt, d, group)
                if dt == F32 or (dt == BF16 and cc < 80):
                    continue
                # an explicit impl="mma" fits at every head dim (the compact tiles on a T4)
                p = decode._plan("mma", dt, d, group, cc, limit)
                m_tiles = int(p.expr.split(",")[2])
                assert p.tile.ring_bytes + decode.static_smem_bytes("mma", d, dt.itemsize, p.tile, m_tiles) <= limit


def test_static_smem_bound_holds_for_every_decode_kernel(compile_report):
    """decode.static_smem_bytes (which decides what fits a device) is at least ptxas' static size."""
    reports, errors = compile_report(decode.SPEC.name)
    assert not errors, errors
    bounds = {}  # expr -> (bound, what)
    for dt in config.DTYPES:
        for d in config.HEAD_DIMS:
            for sv, st in decode.VARIANTS:  # serving: the same static arrays; staged: + page window
                for tile in decode._tiles_and_small(config.DECODE_SIMT_TILES[(d, dt.itemsize)]):
                    bounds[decode._simt_expr(dt, d, tile, sv, st)] = (
                        decode.static_smem_bytes("simt", d, dt.itemsize, tile, staged=st), (dt, d, tile, sv, st))
                for m in range(1, config.DECODE_MMA_MAX_MTILES + 1):
                    for tile in decode.mma_tiles(dt, d, m) if dt != F32 else ():
                        bounds[decode._mma_expr(dt, d, m, tile, sv, st)] = (
                            decode.static_smem_bytes("mma", d, dt.itemsize, tile, m, st), (dt, d, m, tile, sv, st))
    assert len(bounds) == len(decode.SPEC.needs)
    for expr, r in gate_built(reports, bounds).items():  # every one under CUPYATTN_FULL=1
        assert r.smem_bytes <= bounds[expr][0], bounds[expr][1]


def test_nvrtc_refuses_bf16_tensor_cores_for_sm75():
    """ptx.cuh's static_assert: a bf16 mma instantiation built for sm_75 fails naming the minimum."""
    expr = flash_attn._expr("flash_mma", BF16, 64, False)
    with pytest.raises(RuntimeError, match="requires sm_80 or higher"):
        cc.compile_spec(flash_attn.SPEC, "75", [expr])


def test_arch_override_is_checked(monkeypatch):
    monkeypatch.setenv("CUPYATTN_ARCH", "74")
    with pytest.raises(ValueError, match=r"CUPYATTN_ARCH='74': expected one of 70, 75, 80"):
        device.arch_override()
    monkeypatch.setenv("CUPYATTN_ARCH", "75")
    assert device.arch_override() == 75
    assert "-DCUPYATTN_TARGET_SM=750" in decode.SPEC.options_for("90")
    monkeypatch.setenv("CUPYATTN_ARCH", "")
    assert not any("TARGET_SM" in o for o in decode.SPEC.options_for("90"))


# --- GPU tier (also emulated, as sm_90 and as sm_75) ---------------------------------------------
def _cc() -> int:
    return device.compute_capability()


@pytest.mark.gpu
def test_explicit_impl_the_device_cannot_run_is_refused_before_launch():
    """bf16 tensor-core impls below sm_80: ComputeCapabilityError naming impl, device and minimum;
    the caller's out buffer is untouched."""
    import cupy

    if _cc() >= 80:
        pytest.skip("this device runs every mma.sync impl")
    x = cupy.asarray(np.ones((1, 2, 17, 64), dtype=BF16))
    out = nan_like((1, 2, 17, 64), "bfloat16")
    with pytest.raises(cupyattn.ComputeCapabilityError,
                       match=r"attention\(\): impl='flash_mma' with bfloat16 inputs needs compute capability 8\.0.*is 7\.5"):
        cupyattn.attention(x, x, x, impl="flash_mma", out=out)
    assert bool(cupy.isnan(out).all())
    h = cupy.asarray(np.ones((1, 1, 5, 256), dtype=F16))   # fp16 D=256: SIMT below sm_80 (config)
    with pytest.raises(cupyattn.ComputeCapabilityError, match=r"impl='flash_mma' at head_dim D=256 needs compute capability 8\.0"):
        cupyattn.attention(h, h, h, impl="flash_mma")
    a = cupy.asarray(np.ones((4, 32), dtype=BF16))
    for impl in ("mma", "skinny"):
        with pytest.raises(cupyattn.ComputeCapabilityError, match=rf"gemm_nt\(\): impl='{impl}'.*8\.0"):
            cupyattn.gemm_nt(a, a, impl=impl)
    cache = cupyattn.KVCache(1, 1, 1, 16, 64, "bfloat16")
    with pytest.raises(cupyattn.ComputeCapabilityError, match=r"impl='mma'.*8\.0"):
        cupyattn.decode_attention(cupy.asarray(np.ones((1, 4, 1, 64), dtype=BF16)), cache, 0, impl="mma")
    assert isinstance(cupyattn.ComputeCapabilityError("x"), ValueError)


@pytest.mark.gpu
def test_wgmma_below_sm90_is_refused_before_launch():
    """impl="wgmma" (sm_90a code) on any other device: ComputeCapabilityError naming the impl, the
    device's compute capability and 9.0, before anything is allocated or written."""
    import cupy

    if _cc() == 90:
        pytest.skip("this device runs wgmma")
    x = cupy.asarray(np.ones((1, 2, 17, 64), dtype=F16))
    out = nan_like((1, 2, 17, 64), "float16")
    with pytest.raises(cupyattn.ComputeCapabilityError, match=r"attention\(\): impl='wgmma' with float16 inputs "
                                                               rf"needs compute capability 9\.0 exactly .*is {_cc() // 10}\.{_cc() % 10}"):
        cupyattn.attention(x, x, x, impl="wgmma", out=out)
    assert bool(cupy.isnan(out).all())
    a = cupy.asarray(np.ones((64, 64), dtype=F16))
    for fn in (cupyattn.gemm_nt, cupyattn.gemm_nn):
        c = nan_like((64, 64), "float16")
        with pytest.raises(cupyattn.ComputeCapabilityError, match=rf"{fn.__name__}\(\): impl='wgmma'.*9\.0 exactly"):
            fn(a, a, out=c, impl="wgmma")
        assert bool(cupy.isnan(c).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_default_attention_is_what_the_table_says(dtype):
    """The default runs and matches the float64 reference; it is flash_mma only where the device has
    the instructions and the tile fits its shared memory."""
    import cupy

    rng = np.random.default_rng(24)
    q, qr = to_device(rand_with_outliers(rng, (1, 3, 17, 128)), dtype)
    k, kr = to_device(rand_with_outliers(rng, (1, 1, 97, 128)), dtype)
    v, vr = to_device(rng.standard_normal((1, 1, 97, 128)), dtype)
    out = nan_like((1, 3, 17, 128), dtype)
    cupyattn.attention(q, k, v, causal=True, out=out)
    assert_close(out, ref.attention(qr, kr, vr, causal=True), dtype)
    # tensor cores from the dtype's minimum (fp16 7.5, bf16 8.0) where the main D = 128 tile fits;
    # a T4's 64 KB keeps the SIMT default (its 32-key tile serves explicit calls until run on a GPU)
    tc = np_dtype(dtype) in config.MMA_DTYPES and _cc() >= config.MMA_MIN_CC[np_dtype(dtype)]
    fits = config.flash_mma_smem_bytes(128) <= device.smem_optin()
    assert flash_attn.default_impl(np_dtype(dtype), 128) == ("flash_mma" if tc and fits else "flash")
    if tc:
        smem = device.smem_optin()
        tile = flash_attn._tile("flash_mma", np_dtype(dtype), 128, smem)
        assert config.flash_mma_smem_bytes(128, tile) <= smem
        assert (tile == config.FLASH_MMA_TILES[128]) == (smem >= 85 * 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, (9, 0)])
def test_flash_mma_launches_the_family_tile(monkeypatch, window):
    """fp16 flash_mma at D = 64 launches the device family's tile (config.flash_mma_main_tile:
    sm_100's own, else FLASH_MMA_TILES'), plain and as the serving variant (a window), and
    matches the float64 reference."""
    if why := device_cannot_run("attention", "flash_mma", F16, 64):
        pytest.skip(why)
    seen, real = [], flash_launch.get_function
    monkeypatch.setattr(flash_launch, "get_function", lambda spec, expr, **kw: seen.append(expr) or real(spec, expr, **kw))
    rng = np.random.default_rng(100)
    q, qr = to_device(rand_with_outliers(rng, (1, 2, 150, 64)), "float16")
    k, kr = to_device(rand_with_outliers(rng, (1, 1, 150, 64)), "float16")
    v, vr = to_device(rng.standard_normal((1, 1, 150, 64)), "float16")
    out = nan_like((1, 2, 150, 64), "float16")
    cupyattn.attention(q, k, v, causal=True, window=window, impl="flash_mma", out=out)
    assert_close(out, ref.attention(qr, kr, vr, causal=True, window=window), "float16")
    tile = config.flash_mma_main_tile(64, _cc())
    assert seen == [flash_attn._expr("flash_mma", F16, 64, window is None, window is not None, tile=tile)]


@pytest.mark.gpu
def test_sm80_only_instruction_fails_to_build_for_sm75():
    """A kernel that calls an sm_80-only wrapper of ptx_insn.cuh directly does not build for sm_75
    (NVRTC on a T4, the emulator's same static_assert as sm_75)."""
    import cupy

    if _cc() >= 80:
        pytest.skip("cp.async exists here")
    src = _loader.inline_source('#include "ptx.cuh"\n__global__ void k(const float* g) {\n'
                                '    __shared__ __align__(16) float s[4];\n    cp_async_sm80<16>(s, g, 16);\n}\n')
    mod = cupy.RawModule(code=src, options=_loader.BASE_OPTIONS, name_expressions=["k"])
    with pytest.raises(Exception, match="cp.async requires sm_80 or higher"):
        mod.get_function("k")


@pytest.mark.gpu
def test_arch_override_runs_the_turing_branches(monkeypatch):
    """CUPYATTN_ARCH=75 on a newer device: dispatch as sm_75 and build ptx.cuh's Turing branches
    (plain copies, two m16n8k8 per m16n8k16); fp16 attention and a GEMM still match the reference."""
    if _cc() < 75:
        pytest.skip("needs a device of sm_75 or newer")
    monkeypatch.setenv("CUPYATTN_ARCH", "75")
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "_SMEM_RAISED", {})
    assert device.compute_capability() == 75 and device.smem_optin() <= 64 * 1024
    assert flash_attn.default_impl(BF16, 64) == "flash" and flash_attn.default_impl(F16, 64) == "flash_mma"
    rng = np.random.default_rng(75)
    q, qr = to_device(rand_with_outliers(rng, (1, 2, 33, 64)), "float16")
    k, kr = to_device(rand_with_outliers(rng, (1, 2, 40, 64)), "float16")
    out = nan_like((1, 2, 33, 64), "float16")
    cupyattn.attention(q, k, k, out=out)
    assert_close(out, ref.attention(qr, kr, kr), "float16")
    a, ar = to_device(rng.standard_normal((97, 40)), "float16")
    b, br = to_device(rng.standard_normal((17, 40)), "float16")
    assert_close(cupyattn.gemm_nt(a, b, impl="mma"), ar @ br.T, "float16")
