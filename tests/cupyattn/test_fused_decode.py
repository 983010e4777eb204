"""The fused decode step (cupyattn.fused, decode_attention(fused_combine=True), tinylm fused=True).

CPU tier: the offline compile check of the fused kernels, the PDL launch's argument marshalling.
GPU tier (also run on the CPU emulator): each fused op against the float64 composition of the
unfused references on fresh random inputs with outliers, odd sizes and every dtype, outputs
NaN-poisoned; the fused combine against the reference and, bit for bit, against the combine
kernel; bad arguments raise before anything is written; and tinylm's fused step: its kernel
budget (counted launches and graph nodes) and greedy tokens equal to the NumPy backend's.
"""
import ctypes

import numpy as np
import pytest

from conftest import DTYPES, EMULATE, assert_close, nan_like, np_dtype, rand_with_outliers, to_device, to_host
from cupyattn import reference as ref


@pytest.fixture
def rng():
    return np.random.default_rng(9753)


# --- CPU -----------------------------------------------------------------------------------------
def test_compile_check_no_errors_no_spills(compile_report):
    reports, errors = compile_report("fused_decode")
    assert not errors, errors
    assert {r.kernel.split("<")[0] for r in reports} == {
        "norm_qkv_rope_append_kernel", "gemm_residual_kernel", "norm_gate_up_swiglu_kernel", "norm_gemm_kernel"}
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills]


def test_pdl_kernel_params_point_at_values_of_the_kernel_types():
    """cuLaunchKernelEx's kernelParams: one pointer per argument, to a value of the width the
    kernel's parameter has (CuPy's own conversions: int32, int64, float, double, pointers)."""
    from cupyattn._loader import NULL, kernel_params

    args = (np.int32(-7), np.int64(1 << 40), np.float32(0.5), np.float64(-2.25), NULL, np.uint32(3))
    ptrs, values = kernel_params(args)
    assert len(ptrs) == len(args) == len(values)
    got = [ctypes.cast(p, ctypes.POINTER(type(v))).contents.value for p, v in zip(ptrs, values)]
    assert got == [-7, 1 << 40, 0.5, -2.25, 0, 3]
    assert [ctypes.sizeof(v) for v in values] == [4, 8, 4, 8, 8, 4]
    with pytest.raises(TypeError, match="PDL launch: argument of type int"):
        kernel_params((3,))


def test_pdl_launch_passes_the_raw_kernels_function_handle(monkeypatch):
    """launch(pdl=True) hands cuLaunchKernelEx the CUfunction of what RawModule.get_function
    returns, a RawKernel: its .kernel.ptr (it has no .ptr; the H100 run of 2026-11-27 failed
    there), with the grid, block, shared memory, stream and the serialisation attribute."""
    import sys
    import types

    from cupyattn import _loader

    seen = {}

    class Attr:
        def __init__(self):
            self.value = types.SimpleNamespace()

    def launch_ex(cfg, fn, params, extra):
        seen.update(fn=fn, cfg=cfg, params=params)
        return (0,)

    driver = types.SimpleNamespace(
        CUlaunchConfig=types.SimpleNamespace, CUstream=lambda p: ("stream", p), CUfunction=lambda p: ("function", p),
        CUlaunchAttribute=Attr, cuLaunchKernelEx=launch_ex, CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        CUlaunchAttributeID=types.SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6))
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    stream = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=77))
    monkeypatch.setattr(_loader, "cupy", types.SimpleNamespace(ndarray=type("ndarray", (), {}), cuda=stream))
    raw_kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xABC))  # no .ptr of its own
    _loader.launch(raw_kernel, (5,), (128, 2), (np.int32(3),), shared_mem=96, pdl=True)
    cfg = seen["cfg"]
    assert seen["fn"] == ("function", 0xABC) and cfg.hStream == ("stream", 77) and cfg.sharedMemBytes == 96
    dims = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ)
    assert dims == (5, 1, 1, 128, 2, 1)
    assert cfg.numAttrs == 1 and cfg.attrs[0].id == 6 and cfg.attrs[0].value.programmaticStreamSerializationAllowed == 1


def test_fused_decode_is_default_and_pdl_opt_in():
    """The fused step is tinylm's default since an H100 run measured it faster (tinylm/config.py
    cites the run); PDL launches stay opt-in until a GPU run times them."""
    from cupyattn import config
    from tinylm.config import TINYLM_FUSED_DECODE

    assert TINYLM_FUSED_DECODE is True and config.FUSED_DECODE_PDL is False


def test_decode_rings_hold_the_fused_combine_weights():
    """combine_if_last keeps num_splits + 1 floats in the decode kernel's ring once it is done."""
    from cupyattn import config as c

    tiles = list(c.DECODE_SIMT_TILES.values()) + list(c.DECODE_MMA_TILES.values())
    assert min(t.ring_bytes for t in tiles) >= 4 * (c.DECODE_MAX_SPLITS + 1)


# --- GPU: the fused projections --------------------------------------------------------------------
def _w(rng, shape, dtype, scale=1.0):
    return to_device(rand_with_outliers(rng, shape, scale, outlier_value=8.0 * scale), dtype)


SIZES = [(1, 64, 17), (5, 97, 96), (17, 576, 40)]  # (M, K, N): M = 17 takes two row tiles


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SIZES)
def test_gpu_rmsnorm_gemm(rng, dtype, m, k, n):
    from cupyattn import fused

    x, xr = _w(rng, (m, 1, k), dtype)
    g, gr = to_device(1 + 0.1 * rng.standard_normal(k), dtype)
    w, wr = _w(rng, (n, k), dtype, k ** -0.5)
    out = nan_like((m, 1, n), dtype)
    assert fused.rmsnorm_gemm(x, g, w, 1e-5, out=out) is out
    assert_close(out, ref.gemm_nt(ref.rmsnorm(xr, gr, 1e-5), wr), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", SIZES)
def test_gpu_gemm_residual(rng, dtype, m, k, n):
    import cupy

    from cupyattn import fused

    a, ar = _w(rng, (m, k), dtype)
    w, wr = _w(rng, (n, k), dtype, k ** -0.5)
    x, xr = _w(rng, (m, n), dtype)
    assert fused.gemm_residual(x, a, w) is x
    assert_close(x, xr + ref.gemm_nt(ar, wr), dtype)
    a2 = cupy.asarray(np.ascontiguousarray(np.asarray(a.get())[::-1]))[::-1]  # rows with a negative stride
    with pytest.raises(ValueError, match="gemm_residual"):
        fused.gemm_residual(x, a2[:, ::2], w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,f", [(1, 64, 8), (3, 97, 17), (17, 128, 64)])
def test_gpu_rmsnorm_gate_up_swiglu(rng, dtype, m, k, f):
    from cupyattn import fused

    x, xr = _w(rng, (m, k), dtype)
    g, gr = to_device(1 + 0.1 * rng.standard_normal(k), dtype)
    w, wr = _w(rng, (2 * f, k), dtype, 2 * k ** -0.5)
    out = nan_like((m, f), dtype)
    fused.rmsnorm_gate_up_swiglu(x, g, w, 1e-5, out=out)
    gu = ref.gemm_nt(ref.rmsnorm(xr, gr, 1e-5), wr)
    assert_close(out, ref.swiglu(gu[:, :f], gu[:, f:]), dtype)


def _cache_with_lengths(rng, dtype, b, hkv, d, lengths, layers=2, max_seq=24):
    """A KVCache of random contents whose layer-1 sequences hold ``lengths`` tokens."""
    import cupy

    from cupyattn.kvcache import KVCache

    cache = KVCache(layers, b, hkv, max_seq, d, np_dtype(dtype))
    for c in (cache.k, cache.v):
        c[...] = cupy.asarray(rng.standard_normal(c.shape).astype(np_dtype(dtype)))
    t = max(lengths)
    k, _ = to_device(rng.standard_normal((b, hkv, t, d)), dtype)
    v, _ = to_device(rng.standard_normal((b, hkv, t, d)), dtype)
    cache.append(1, k, v, num_new=list(lengths))
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["adjacent", "neox"])
@pytest.mark.parametrize("b,hq,hkv,d,k", [(1, 3, 1, 64, 96), (3, 4, 2, 16, 33), (17, 2, 1, 32, 64)])
def test_gpu_rmsnorm_qkv_rope_append(rng, dtype, style, b, hq, hkv, d, k):
    import cupy

    from cupyattn import fused

    lengths = [int(v) for v in rng.integers(1, 20, size=b)]
    cache = _cache_with_lengths(rng, dtype, b, hkv, d, lengths)
    k0, v0, len0 = to_host(cache.k), to_host(cache.v), cupy.asnumpy(cache.lengths)
    x, xr = _w(rng, (b, 1, k), dtype)
    g, gr = to_device(1 + 0.1 * rng.standard_normal(k), dtype)
    w, wr = _w(rng, ((hq + 2 * hkv) * d, k), dtype, k ** -0.5)
    q_out = nan_like((b, hq, 1, d), dtype)
    base = 100000.0
    fused.rmsnorm_qkv_rope_append(x, g, w, cache, 1, hq, 1e-5, base, style, q_out=q_out)
    qkv = ref.gemm_nt(ref.rmsnorm(xr, gr, 1e-5), wr)  # [B, 1, (Hq + 2 Hkv) D]
    q, kc, vc, new_len = ref.qkv_rope_append(qkv, k0[1], v0[1], len0[1], hq, base, style)
    assert_close(q_out, q, dtype)
    rows = (np.arange(b), slice(None), np.asarray(lengths))
    assert_close(to_host(cache.k)[1][rows], kc[rows], dtype)
    assert_close(to_host(cache.v)[1][rows], vc[rows], dtype)
    # every other cache row, the other layer and its lengths untouched; the ticket is back at 0
    kk, vv = to_host(cache.k), to_host(cache.v)
    kk[1][rows], vv[1][rows] = k0[1][rows], v0[1][rows]
    assert np.array_equal(kk, k0) and np.array_equal(vv, v0)
    assert cupy.asnumpy(cache.lengths).tolist() == [len0[0].tolist(), new_len.tolist()]
    assert cache.host_lengths.tolist() == cupy.asnumpy(cache.lengths).tolist()
    assert int(cache.ticket[0]) == 0


def _z(shape, dtype=np.float32):
    import cupy

    return cupy.zeros(shape, dtype=dtype)


@pytest.mark.gpu
def test_gpu_bad_arguments_raise_before_writing():
    import cupy

    from cupyattn import fused
    from cupyattn.kvcache import KVCache

    cache = KVCache(1, 2, 1, 4, 16, np.float32)
    cache.append(0, _z((2, 1, 4, 16)), _z((2, 1, 4, 16)))  # full
    x, g, w = _z((2, 1, 8)), _z(8), _z((3 * 16, 8))
    q_out = cupy.full((2, 1, 1, 16), 7.0, dtype=np.float32)
    for call, exc, pattern in [
        (lambda: fused.rmsnorm_qkv_rope_append(x, g, w, cache, 0, 1, q_out=q_out), ValueError,
         "rmsnorm_qkv_rope_append\\(\\): cache is full"),
        (lambda: fused.rmsnorm_qkv_rope_append(x, g, w[:40], cache, 0, 1), ValueError, r"wqkv must be C-contiguous of shape \[48, K=8\]"),
        (lambda: fused.rmsnorm_qkv_rope_append(x[:1], g, w, cache, 0, 1), ValueError, r"expected \[batch=2, 1, K\]"),
        (lambda: fused.rmsnorm_qkv_rope_append(x, g.astype(np.float16), w, cache, 0, 1), TypeError, "norm_weight has dtype float16"),
        (lambda: fused.rmsnorm_qkv_rope_append(x, g, w, cache, 0, 1, rope_style="gptj"), ValueError, "rope_style"),
        (lambda: fused.rmsnorm_qkv_rope_append(x, g, w, cache, 0, 1, eps=-1.0), ValueError, "eps"),
        (lambda: fused.gemm_residual(_z((2, 5)), _z((2, 8)), _z((4, 8))), ValueError, r"gemm_residual\(\): x has shape \(2, 5\)"),
        (lambda: fused.gemm_residual(_z((2, 4)).T, _z((4, 8)), _z((2, 8))), ValueError, "gemm_residual"),
        (lambda: fused.rmsnorm_gate_up_swiglu(_z((2, 8)), g, _z((5, 8))), ValueError, "w_gate_up has 5 rows"),
        (lambda: fused.rmsnorm_gemm(_z((2, 8)), _z(7), _z((4, 8))), ValueError, r"norm_weight must be contiguous of shape \(8,\)"),
        (lambda: fused.rmsnorm_gemm(np.zeros((2, 8), np.float32), g, _z((4, 8))), TypeError, "x must be a cupy.ndarray"),
    ]:
        with pytest.raises(exc, match=pattern):
            call()
    assert cupy.asnumpy(q_out).tolist() == [[[[7.0] * 16]]] * 2
    assert cupy.asnumpy(cache.lengths).tolist() == [[4, 4]] == cache.host_lengths.tolist()
    assert int(cache.ticket[0]) == 0


@pytest.mark.gpu
def test_gpu_pdl_flag_without_cuda_bindings_says_so(monkeypatch):
    """With config.FUSED_DECODE_PDL on and no cuda-bindings, a clear error before anything moves."""
    import importlib.util

    import cupy

    from cupyattn import config, fused

    if importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None:
        pytest.skip("cuda-bindings is installed here")
    monkeypatch.setattr(config, "FUSED_DECODE_PDL", True)
    x = cupy.ones((2, 8), dtype=np.float32)
    with pytest.raises(RuntimeError, match="needs the cuda-bindings package"):
        fused.gemm_residual(x, _z((2, 8)), _z((8, 8)))
    assert cupy.asnumpy(x).tolist() == [[1.0] * 8] * 2


@pytest.mark.gpu
def test_gpu_pdl_flag_routes_every_fused_launch(monkeypatch, rng):
    """With config.FUSED_DECODE_PDL every fused kernel is launched through the PDL path, with the
    same results as without the flag: on a GPU with cuda-bindings through cuLaunchKernelEx
    itself (a RawKernel's handle is .kernel.ptr: the H100 run of 2026-11-27 found .ptr), else
    (the emulator has no cuLaunchKernelEx) recorded and launched plainly."""
    import importlib.util

    import cupy

    from cupyattn import _loader, config, fused

    real = not EMULATE and importlib.util.find_spec("cuda") is not None \
        and importlib.util.find_spec("cuda.bindings") is not None
    calls = []

    def record(fn, grid, block, args, shared_mem=0, pdl=False):
        calls.append(pdl)
        _loader.launch(fn, grid, block, args, shared_mem, pdl=pdl and real)

    x0, _ = _w(rng, (3, 64), "float16")
    g, _ = to_device(1 + 0.1 * rng.standard_normal(64), "float16")
    w, _ = _w(rng, (64, 64), "float16", 0.125)
    w2, _ = _w(rng, (64, 32), "float16", 0.125)

    def step():
        x = x0.copy()
        y = fused.rmsnorm_gate_up_swiglu(x, g, w)
        fused.gemm_residual(x, fused.rmsnorm_gemm(x, g, w[:32]), w2)
        return cupy.asnumpy(y), cupy.asnumpy(x)

    plain = step()
    monkeypatch.setattr(fused, "launch", record)
    monkeypatch.setattr(config, "FUSED_DECODE_PDL", True)
    with_pdl = step()
    assert calls == [True, True, True]
    assert all(np.array_equal(a, b) for a, b in zip(plain, with_pdl))


# --- GPU: decode attention with the combine inside -------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,impl", [("float32", "simt"), ("float16", "simt"), ("float16", "mma"),
                                        ("bfloat16", "mma")])
@pytest.mark.parametrize("splits", [2, 5])
def test_gpu_decode_fused_combine(rng, dtype, impl, splits):
    """Equal bit for bit to the combine kernel's output (same partials, same merge), close to the
    reference, counters back at zero, and a second call (a graph replay) gives the same."""
    import cupy

    import cupyattn

    b, hq, hkv, d = 3, 8, 2, 64
    lengths = [97, 1, 40]
    cache = _cache_with_lengths(rng, dtype, b, hkv, d, lengths, layers=2, max_seq=128)
    q, qr = _w(rng, (b, hq, 1, d), dtype)
    ws = (cupy.empty((splits, b, hq, d), np.float32), cupy.empty((splits, b, hq), np.float32),
          cupy.zeros((b, hq), np.uint32))
    want = cupyattn.decode_attention(q, cache, 1, num_splits=splits, impl=impl)
    for _ in range(2):
        out = nan_like((b, hq, 1, d), dtype)
        cupyattn.decode_attention(q, cache, 1, num_splits=splits, impl=impl, out=out, workspace=ws,
                                  fused_combine=True)
        assert np.array_equal(to_host(out), to_host(want))
        assert not cupy.asnumpy(ws[2]).any()
    r = ref.decode_attention(qr, to_host(cache.k[1]), to_host(cache.v[1]), lengths)
    assert_close(out, r, dtype)
    with pytest.raises(TypeError, match=r"workspace must be a tuple \(o_part, lse_part, counters\)"):
        cupyattn.decode_attention(q, cache, 1, num_splits=splits, workspace=ws[:2], fused_combine=True)
    with pytest.raises(ValueError, match=r"workspace\[2\] \(the fused combine's counters\)"):
        cupyattn.decode_attention(q, cache, 1, num_splits=splits, workspace=ws[:2] + (_z((b, 1), np.uint32),),
                                  fused_combine=True)


# --- GPU: tinylm's fused decode step -----------------------------------------------------------------
# The budget: 5 kernels per layer (norm+QKV+RoPE+append, attention with its combine, O+residual,
# norm+gate|up+SwiGLU, down+residual) + 3 (embedding, norm+logits, sampling), at any length.
FUSED_KERNELS_PER_LAYER, FUSED_KERNELS_PER_STEP_EXTRA = 5, 3


@pytest.fixture(scope="module")
def tiny_fused():
    from tinylm import load

    return load("tiny", backend="cupy", dtype="float32", max_seq=600, fused=True)


@pytest.mark.gpu
def test_gpu_fused_step_kernel_budget(tiny_fused, monkeypatch):
    """One decode step's launches (emulator) and captured graph nodes stay within the budget,
    also when the decode attention splits (the unfused step adds a combine kernel per layer
    there; the tiny preset's 512 tokens are too few for an automatic split, so it is forced)."""
    from tinylm.graphs import decode_step, graph_kernel_count

    g = tiny_fused
    budget = FUSED_KERNELS_PER_LAYER * g.args.n_layers + FUSED_KERNELS_PER_STEP_EXTRA
    g.generate(list(range(1, 6)), 4, ignore_eos=True)
    state = g._state
    assert state.graphs and all(graph_kernel_count(gr) <= budget for gr in state.graphs.values())
    if EMULATE:
        import fakecupy

        monkeypatch.setattr(g.model.ops, "decode_splits", lambda *args: 3)
        fakecupy.reset_counters()
        decode_step(g.model, state)
        assert fakecupy.counters["kernels"] <= budget and fakecupy.counters["cupy_ops"] == 0


@pytest.mark.gpu
def test_gpu_fused_greedy_tokens_equal_unfused_and_numpy(tiny_fused):
    """Greedy tokens of a batch of ragged prompts (graph replays, per-sequence positions): the
    fused step's equal the unfused step's and the NumPy backend's (float32). The half-precision
    logits and the real model: tests/tinylm/test_cupy_backend.py (fused=True cases)."""
    from tinylm import load

    prompts = [[10, 20, 30, 40, 50], [7], [200, 1, 2, 150, 3, 4, 99, 98, 0, 5, 6]]
    got = [r.generated_ids for r in tiny_fused.generate_batch(prompts, 8)]
    unfused = load("tiny", backend="cupy", dtype="float32", max_seq=64, fused=False)
    assert got == [r.generated_ids for r in unfused.generate_batch(prompts, 8)]
    numpy = load("tiny", backend="numpy")
    assert got == [numpy.generate(p, 8).generated_ids for p in prompts]
