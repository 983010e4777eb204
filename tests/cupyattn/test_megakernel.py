"""The megakernel's kernel (kernels_cu/megakernel*.cu*, cupyattn.megakernel.LlamaStep), op by op.

CPU tier: the offline compile check (no spills, no stack), the opt-in default (the emulator catching
a broken weight ring or counter order: tests/emu/test_emu_mutants.py). GPU tier (also on the CPU
emulator, one block: a single block runs its queue in the global order, so every wait is already
satisfied): each opcode alone against the float64 reference on fresh inputs with outliers, odd sizes
and every dtype, outputs NaN-poisoned; bad arguments raise before anything runs. Whole decode steps
through tinylm: tests/tinylm/test_megakernel_tinylm.py (several blocks in flight there, on the emulator
too); the host plan: tests/cupyattn/test_persistent.py.
"""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import (DTYPES, assert_close, nan_like, np_dtype, rand_with_outliers, skip_unless_device_runs,
                      to_device, to_host)
from cupyattn import reference as ref
from cupyattn.persistent import Dep, Op


@pytest.fixture(autouse=True)
def device_runs_the_megakernel(request):
    """GPU tests skip on a device below the megakernel's compute capability (config.IMPL_MIN_CC)."""
    if "gpu" in request.keywords:
        skip_unless_device_runs("megakernel", "persistent", "float16")


# --- CPU ----------------------------------------------------------------------------------------------
def test_megakernel_is_opt_in_until_a_gpu_run_shows_it_faster():
    """The megakernel stays opt-in, and so does every new plan knob (their defaults are the plan the
    2026-11-27 H100 run measured: megakernel_llama.MegaKnobs())."""
    from cupyattn.megakernel_llama import MegaKnobs
    from tinylm import config

    assert config.TINYLM_MEGAKERNEL is (os.environ.get("TINYLM_MEGAKERNEL", "") == "1")
    assert "slower than the fused step" in open(config.__file__).read().split("TINYLM_MEGAKERNEL =")[0][-400:]
    assert MegaKnobs.from_config() == MegaKnobs(attn="v1", attn_share=0.0, min_keys_per_split=256, deps="layer",
                                                fold_merge=False, spin_ns=1024, sample="block")


def test_compile_check_no_errors_no_spills(compile_report):
    reports, errors = compile_report("megakernel")
    assert not errors, errors
    assert {r.kernel for r in reports} >= {"megakernel<float>", "megakernel<__half>", "megakernel<__nv_bfloat16>"}
    assert not [f"{r.kernel} {r.arch}" for r in reports if r.spills or r.stack_bytes]


# --- GPU: each opcode alone (one block) -----------------------------------------------------------
# Odd sizes: dim 72 and vocab 37 end in a partial 16-row tile, ffn 40 in a partial 8-row gate|up
# tile; 3 sequences; G = 3 query heads per kv head (one head tile), or 6 (two passes over the keys).
SHAPE = dict(B=3, dim=72, hq=3, hkv=1, d=32, f=40, v=37, layers=2, max_seq=40)


def _w(rng, shape, dtype, scale=1.0):
    return to_device(rand_with_outliers(rng, shape, scale, outlier_value=8.0 * scale), dtype)


class _Model:
    """Random weights, a KV cache holding random rows and ``lengths`` tokens per sequence, NaN-
    poisoned buffers, and a one-block LlamaStep over them; ``h`` holds float64 copies."""

    def __init__(self, rng, dtype, style="adjacent", lengths=(5, 1, 17), max_splits=4, sample_parts=None,
                 rope_divisors=None, **shape):
        import cupy

        from cupyattn.kvcache import KVCache
        from cupyattn.megakernel import LlamaStep
        from cupyattn.sampling import SamplingParams

        s = dict(SHAPE, **shape)
        B, dim, hq, hkv, d, f, v, L = (s[k] for k in ("B", "dim", "hq", "hkv", "d", "f", "v", "layers"))
        self.s, self.dtype, self.style = s, dtype, style
        h = self.h = SimpleNamespace()
        self.tok, h.tok = _w(rng, (v, dim), dtype)
        self.out_norm, h.out_norm = to_device(1 + 0.1 * rng.standard_normal(dim), dtype)
        self.layers, h.layers = [], []
        for _ in range(L):
            dev, host = {}, {}
            for name, shp, sc in (("attn_norm", (dim,), None), ("wqkv", ((hq + 2 * hkv) * d, dim), dim ** -0.5),
                                  ("wo", (dim, hq * d), (hq * d) ** -0.5), ("ffn_norm", (dim,), None),
                                  ("w_gate_up", (2 * f, dim), 2 * dim ** -0.5), ("w_down", (dim, f), f ** -0.5)):
                if sc is None:
                    dev[name], host[name] = to_device(1 + 0.1 * rng.standard_normal(shp), dtype)
                else:
                    dev[name], host[name] = _w(rng, shp, dtype, sc)
            self.layers.append(SimpleNamespace(**dev))
            h.layers.append(SimpleNamespace(**host))
        self.cache = KVCache(L, B, hkv, s["max_seq"], d, np_dtype(dtype))
        for c in (self.cache.k, self.cache.v):
            c[...] = cupy.asarray(rng.standard_normal(c.shape).astype(np_dtype(dtype)))
        self.cache.lengths[...] = cupy.asarray(np.array([lengths] * L, dtype=np.int32))
        self.cache.host_lengths[...] = np.array([lengths] * L)
        self.lengths = np.array(lengths)
        self.tokens = cupy.asarray(np.array([3, 0, v - 1][:B] + [1] * max(0, B - 3), dtype=np.int32))
        self.x, h.x = _w(rng, (B, dim), dtype)
        self.q = nan_like((B, hq, d), dtype)
        self.att = nan_like((B, hq * d), dtype)
        self.ffn = nan_like((B, f), dtype)
        self.logits = nan_like((B, v), dtype)
        self.o_part = cupy.full((max_splits, B, hq, d), np.nan, dtype=np.float32)
        self.lse_part = cupy.full((max_splits, B, hq), np.nan, dtype=np.float32)
        self.sampling = SamplingParams(B)
        self.step = LlamaStep(tok_embd=self.tok, output_norm=self.out_norm, output=self.tok, layers=self.layers,
                              cache=self.cache, num_heads=hq, eps=1e-5, rope_base=1e4, rope_style=style,
                              tokens=self.tokens, x=self.x, q=self.q, att=self.att, ffn=self.ffn, logits=self.logits,
                              o_part=self.o_part, lse_part=self.lse_part, sampling=self.sampling,
                              counter_capacity=16, blocks=1, sample_parts=sample_parts,
                              rope_divisors=None if rope_divisors is None else cupy.asarray(rope_divisors))

    def run(self, ops, splits=1):
        import cupy

        self.step.launch(self.step.plan(ops), splits)
        cupy.cuda.Device().synchronize()

    def tiles(self, op):
        s = self.s
        return {"qkv": (s["hq"] + 2 * s["hkv"]) * s["d"] // 16, "oproj": -(-s["dim"] // 16), "down": -(-s["dim"] // 16),
                "gate_up": -(-s["f"] // 8), "lm_head": -(-s["v"] // 16)}[op]


def _op(name, m, layer=1, **kw):
    from cupyattn.megakernel import OPCODES

    return Op(name, OPCODES[name], kw.pop("tiles", None) or m.tiles(name), layer, **kw)


@pytest.fixture
def rng():
    return np.random.default_rng(4040)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_embed(rng, dtype):
    """x[b] = tok_embd[tokens[b]]; the ids include 0 and V - 1 (the edges)."""
    from cupyattn.megakernel import OPCODES

    m = _Model(rng, dtype)
    m.x[...] = np.nan
    m.run([Op("embed", OPCODES["embed"], 1)])
    assert_close(m.x, m.h.tok[to_host(m.tokens).astype(int)], dtype, tol=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style,divided", [("adjacent", False), ("neox", False), ("adjacent", True),
                                          ("neox", True)])
def test_gpu_op_qkv(rng, dtype, style, divided):
    """RMSNorm + QKV projection + RoPE at each sequence's position + append, layer 1 only; at the
    end of the step every layer's lengths advance by one (the last block's duty). ``divided``:
    each pair's frequency divided by layer 1's row of rope_divisors (layer 0's is another; one
    pair of float32's largest value: no turn, as a layer without RoPE)."""
    import cupy

    div = None
    if divided:
        div = (0.5 + 40.0 * rng.random((SHAPE["layers"], SHAPE["d"] // 2)) ** 2).astype(np.float32)
        div[1, 3] = np.finfo(np.float32).max
    m = _Model(rng, dtype, style, rope_divisors=div)
    k0, v0 = to_host(m.cache.k), to_host(m.cache.v)
    m.run([_op("qkv", m)])
    L1 = m.h.layers[1]
    qkv = ref.gemm_nt(ref.rmsnorm(m.h.x[:, None], L1.attn_norm, 1e-5), L1.wqkv)
    q, kc, vc, new_len = ref.qkv_rope_append(qkv, k0[1], v0[1], m.lengths, m.s["hq"], 1e4, style,
                                             freq_div=None if div is None else div[1].astype(np.float64))
    assert_close(m.q, q[:, :, 0], dtype)
    rows = (np.arange(m.s["B"]), slice(None), m.lengths)
    assert_close(to_host(m.cache.k)[1][rows], kc[rows], dtype)
    assert_close(to_host(m.cache.v)[1][rows], vc[rows], dtype)
    kk, vv = to_host(m.cache.k), to_host(m.cache.v)
    kk[1][rows], vv[1][rows] = k0[1][rows], v0[1][rows]
    assert np.array_equal(kk, k0) and np.array_equal(vv, v0)  # nothing else written
    assert cupy.asnumpy(m.cache.lengths).tolist() == [new_len.tolist()] * 2 == m.cache.host_lengths.tolist()


_ATTN_CASES = [(1, 3, 1, 1), (3, 3, 1, 1), (2, 6, 1, 2), (1, 4, 2, 1), (3, 6, 2, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["v1", "ring"])
@pytest.mark.parametrize("splits,hq,hkv,hs", _ATTN_CASES)
def test_gpu_op_attention(rng, dtype, variant, splits, hq, hkv, hs):
    """Attention over lengths[b] + 1 keys (the step's own token included), the query heads of a kv
    head over hs tiles; with splits > 1 the partials (normalised O_c, natural-log lse_c) against
    the reference's and the merge op's output. v1: 6 heads per kv head in one tile take two passes
    over the keys (head tile 4); the ring: 150 keys of a sequence go through it in several staged
    chunks (42 or 64 keys each). A sequence of 1 key leaves splits empty."""
    from cupyattn.megakernel import OPCODES

    lengths, max_seq = ((5, 0, 17), 40) if variant == "v1" else ((150, 0, 47), 160)
    m = _Model(rng, dtype, hq=hq, hkv=hkv, lengths=lengths, max_seq=max_seq)
    qr_dev, qr = _w(rng, (3, hq, m.s["d"]), dtype)
    m.q[...] = qr_dev
    n, args = 3 * hkv * hs * splits, (hs, int(variant == "ring"))
    ops = [Op("attn", OPCODES["attn"], n, 1, args=args)]
    if splits > 1:
        own = tuple((t,) for t in range(3 * hkv))  # merge tile t waits for group t: its own splits
        ops.append(Op("reduce", OPCODES["reduce"], 3 * hkv, 1, deps=(Dep("attn", own),)))
        ops[0] = Op("attn", OPCODES["attn"], n, 1, args=args, group_of=tuple(t // (hs * splits) for t in range(n)))
    m.run(ops, splits)
    kc, vc, live = to_host(m.cache.k[1]), to_host(m.cache.v[1]), m.lengths + 1
    want = ref.decode_attention(qr[:, :, None], kc, vc, live)[:, :, 0]
    assert_close(m.att.reshape(3, hq, -1), want, dtype)
    if splits > 1:
        o, lse = ref.decode_split_partials(qr[:, :, None], kc, vc, live, splits)
        assert_close(m.o_part[:splits], o[..., 0, :], "float32" if dtype == "float32" else dtype)
        got = to_host(m.lse_part[:splits])
        fin = np.isfinite(lse[..., 0])
        assert np.array_equal(np.isfinite(got), fin) and np.allclose(got[fin], lse[..., 0][fin], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["oproj", "down"])
def test_gpu_op_projection_residual(rng, dtype, op):
    """x += a W^T: O projection of the merged heads, down projection of the SwiGLU output."""
    m = _Model(rng, dtype)
    src, w = (m.att, "wo") if op == "oproj" else (m.ffn, "w_down")
    a, ah = _w(rng, src.shape, dtype)
    src[...] = a
    m.run([_op(op, m)])
    assert_close(m.x, m.h.x + ref.gemm_nt(ah, getattr(m.h.layers[1], w)), dtype)


def _slots(ko, kd, high=0):
    return ko | kd << 8 | high << 16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_split_projections_and_composed_loads(rng, dtype):
    """The "fine" plan's pieces, layer 1 (odd: slots and residual of parity 1): the O projection
    split over its 2 kv heads' columns and the down projection over its column chunks (ffn 512:
    2 chunks in fp16/bf16, 4 in fp32) write float32 partials to their slots, nothing to x; then a
    gate|up tile composes x' = xalt + (sum of the O slots) before its RMSNorm (mode 1), and a QKV
    tile composes x' + (sum of the down slots) (mode 2), which its tile 0 also stores into x, the
    next layer's residual. Against the float64 reference of the same rounding."""
    import cupy

    from cupyattn.megakernel import down_chunks

    m = _Model(rng, dtype, hq=4, hkv=2, f=512)
    s, B, dim, it = m.s, 3, m.s["dim"], np.dtype(np_dtype(dtype)).itemsize
    ko, kd = 2, down_chunks(512, it)
    assert kd == (4 if dtype == "float32" else 2) and m.step.slots >= ko + kd
    a, ah = _w(rng, m.att.shape, dtype)
    f, fh = _w(rng, m.ffn.shape, dtype)
    m.att[...], m.ffn[...] = a, f
    m.step.part[...] = np.nan
    x_before = to_host(m.x)
    rows = -(-dim // 16)
    m.run([_op("oproj", m, tiles=rows * ko, args=(ko, _slots(ko, kd, 2))),
           _op("down", m, tiles=rows * kd, args=(kd, _slots(ko, kd, 2)))])
    L1 = m.h.layers[1]
    part = to_host(m.step.part[1])
    for c in range(ko):
        cols = slice(c * 64, (c + 1) * 64)
        assert_close(part[c], ref.gemm_nt(ah[:, cols], L1.wo[:, cols]), "float32")
    w = 512 // kd
    for c in range(kd):
        cols = slice(c * w, (c + 1) * w)
        assert_close(part[ko + c], ref.gemm_nt(fh[:, cols], L1.w_down[:, cols]), "float32")
    assert np.array_equal(to_host(m.x), x_before)  # split tiles leave x alone
    # mode 1: gate|up of layer 1 reads xalt (parity 1) + the O slots
    xa, xah = _w(rng, (B, dim), dtype)
    m.step.xalt[...] = xa
    rnd = lambda v: to_host(cupy.asarray(v.astype(np_dtype(dtype))))  # noqa: E731  (a rounding to the dtype)
    fsum = lambda slots: functools.reduce(lambda acc, v: (acc + v).astype(np.float32), slots,  # noqa: E731
                                          np.float32(0))
    x1 = rnd(xah + rnd(fsum(part[:ko])))  # the slots summed in order in float32, as the kernel does
    m.run([_op("gate_up", m, args=(1, _slots(ko, kd, 1)))])
    gu = ref.gemm_nt(ref.rmsnorm(x1, L1.ffn_norm, 1e-5), L1.w_gate_up)
    assert_close(m.ffn, ref.swiglu(gu[:, :512], gu[:, 512:]), dtype)
    # mode 2: QKV of layer 0 (as layer 2 would: slots of layer 1) reads x1 + the down slots; its tile 0
    # stores the composed rows into x (parity 0)
    x2 = rnd(x1 + rnd(fsum(part[ko:])))
    k0, pos = to_host(m.cache.k), cupy.asnumpy(m.cache.lengths[0])  # each launch advanced the lengths
    m.x[...] = np.nan
    m.run([_op("qkv", m, layer=0, args=(2, _slots(ko, kd, 1)))])
    qkv = ref.gemm_nt(ref.rmsnorm(x2[:, None], m.h.layers[0].attn_norm, 1e-5), m.h.layers[0].wqkv)
    q, _, _, _ = ref.qkv_rope_append(qkv, k0[0], to_host(m.cache.v)[0], pos, 4, 1e4, "adjacent")
    assert_close(m.q, q[:, :, 0], dtype)
    assert_close(m.x, x2, dtype, tol=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_oproj_merges_split_attention_on_load(rng, dtype):
    """The merge folded into the O projection (flags bit 0): 3 key splits of each (sequence, kv
    head) write partials, and the O projection, waiting for them, merges them as it loads its
    input: x += attention(q) Wo^T with no reduce op (att stays poisoned)."""
    from cupyattn.megakernel import OPCODES

    m = _Model(rng, dtype, hq=4, hkv=2, lengths=(5, 0, 17))
    qr_dev, qr = _w(rng, (3, 4, m.s["d"]), dtype)
    m.q[...] = qr_dev
    m.run([Op("attn", OPCODES["attn"], 3 * 2 * 3, 1),
           _op("oproj", m, args=(1, _slots(1, 1, 1)), deps=(Dep("attn"),))], 3)
    kc, vc = to_host(m.cache.k[1]), to_host(m.cache.v[1])
    att = ref.decode_attention(qr[:, :, None], kc, vc, m.lengths + 1)[:, :, 0].reshape(3, -1)
    assert_close(m.x, m.h.x + ref.gemm_nt(att, m.h.layers[1].wo), dtype)
    assert np.isnan(to_host(m.att)).all()


def _two_level(m):
    """The two-level sampler's ops over m's 150 logits: 2 chunks of 80 per sequence, one merge each."""
    from cupyattn.megakernel import OPCODES

    return [Op("sample_part", OPCODES["sample_part"], 3 * 2, args=(2, 80), group_of=(0, 0, 1, 1, 2, 2)),
            Op("sample", OPCODES["sample"], 3, args=(2, 80), deps=(Dep("sample_part", ((0,), (1,), (2,))),))]


def _set_logits(m, logits, host):
    """m's logits, and the LM-head tiles' maxima the chunks read (what the LM head writes with them)."""
    import cupy

    m.logits[...] = logits
    v = host.shape[1]
    pad = np.full((host.shape[0], -(-v // 16) * 16), -np.inf)
    pad[:, :v] = np.where(np.isnan(host), -np.inf, host)
    m.step.sp_tmax[...] = cupy.asarray(pad.reshape(host.shape[0], -1, 16).max(axis=2).astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_sample_two_level(rng, dtype):
    """The two-level sampler: 150 logits in 2 chunks of 80 (sample_part), then one merge per
    sequence (sample), on 2 blocks: greedy, top-k with top-p (chunk candidates), top-k above the
    chunks' 64 (the candidates when the union holds its cut, else the whole row: 140 of 150 ids
    always), no cut (the chunk holding the draw),
    top-p alone (candidates and the row's mass), a near-uniform top-p (wider than the candidates:
    the whole row), logits with ties (a chunk of 80 equal logits keeps too many candidates: the
    whole row again), a top-p or a top-k whose cut falls below ids a chunk left out though the
    candidates hold the mass or the count it needs (chunk 0 in [5, 6), chunk 1 in [4, 5): the whole
    row): each id equal to
    reference.sample_token's on the same logits, seeds and steps; the RNG step advances once."""
    import cupy

    m = _Model(rng, dtype, v=150, sample_parts=2, max_seq=64)  # each launch appends to the cache
    m.step.blocks = 2
    z, zh = _w(rng, m.logits.shape, dtype, 3.0)
    ties = np.round(zh * 2) / 2
    ties[1, :80] = 1.5  # chunk 0 of sequence 1: 80 equal logits
    tz, tzh = to_device(ties, dtype)
    dz, dzh = to_device(np.concatenate([5 + rng.random((3, 80)), 4 + rng.random((3, 70))], axis=1), dtype)
    for logits, host in ((z, zh), (tz, tzh), (dz, dzh)):
        _set_logits(m, logits, host)
        settings = [(0.0, 0, 1.0), (0.9, 5, 0.8), (1.2, 70, 1.0), (0.7, 0, 0.9), (1.0, 3, 1.0), (1.0, 0, 1.0),
                    (0.8, 0, 0.5), (1.3, 150, 0.7), (60.0, 0, 0.97), (1.0, 100, 0.9), (1.0, 140, 1.0)]
        for step, (temp, k, p) in enumerate(settings):
            m.sampling.set(temp, k, p, seed=11, step=step)
            m.run(_two_level(m))
            want = [ref.sample_token(host[b], temp, k, p, seed=11 + b, step=step) for b in range(3)]
            assert cupy.asnumpy(m.tokens).tolist() == want, (temp, k, p)
            assert cupy.asnumpy(m.sampling.iparams[:, 3]).tolist() == [step + 1] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_op_sample_two_level_reads_what_it_says(rng, dtype):
    """Which logits the merge reads, seen by poisoning the row between the chunks' launch and the
    merge's: top-p alone over peaked logits draws from the chunks' candidates and mass (every logit
    NaN by then), as does a top-k of 70 (the two chunks' 128 candidates hold it), no cut reads only
    the chunk holding the draw (the other chunk NaN), and a top-p wider than the candidates or a
    top-k of 140 draws over the whole row (all NaN: no candidate, -1)."""
    import cupy

    from cupyattn.megakernel import OPCODES

    m = _Model(rng, dtype, v=150, sample_parts=2)
    m.step.blocks = 2
    z, zh = to_device(rng.standard_normal(m.logits.shape) * 4.0, dtype)  # peaked: the nucleus is a few ids
    parts, merge = _two_level(m)
    merge = Op("sample", OPCODES["sample"], 3, args=(2, 80))
    for step, (temp, k, p, poison) in enumerate([(0.8, 0, 0.9, "all"), (1.0, 0, 1.0, "other chunk"),
                                                 (0.9, 70, 0.95, "all"), (40.0, 0, 0.99, "all"),
                                                 (0.9, 140, 1.0, "all")]):
        _set_logits(m, z, zh)
        m.sampling.set(temp, k, p, seed=3, step=step)
        m.run([parts])
        want = [ref.sample_token(zh[b], temp, k, p, seed=3 + b, step=step) for b in range(3)]
        bad = np.full(zh.shape, np.nan)
        if poison == "other chunk":
            for b, t in enumerate(want):
                keep = slice(0, 80) if t < 80 else slice(80, 150)
                bad[b, keep] = zh[b, keep]
        m.logits[...] = to_device(bad, dtype)[0]
        m.run([merge])
        got = cupy.asnumpy(m.tokens).tolist()
        assert got == (want if temp < 40 and k < 128 else [-1] * 3), (temp, k, p, got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sub", [1, 2])
def test_gpu_op_gate_up_swiglu(rng, dtype, sub):
    """gate|up + SwiGLU in 8-row tiles, and in instructions of two 8-row sub-tiles (arg0 = 2 << 4:
    ffn 40 in 3 instructions, the last one's second sub-tile past the end)."""
    m = _Model(rng, dtype)
    m.run([_op("gate_up", m, args=(0 if sub == 1 else 2 << 4, 0), tiles=-(-m.s["f"] // (8 * sub)))])
    f = m.s["f"]
    gu = ref.gemm_nt(ref.rmsnorm(m.h.x, m.h.layers[1].ffn_norm, 1e-5), m.h.layers[1].w_gate_up)
    assert_close(m.ffn, ref.swiglu(gu[:, :f], gu[:, f:]), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_lm_head(rng, dtype):
    """Final RMSNorm + logits over the tied embedding, and each 16-row tile's largest logit as
    stored (the two-level sampler's row maximum; vocab 37: the last tile holds 5)."""
    import cupy

    m = _Model(rng, dtype)
    m.step.sp_tmax[...] = np.nan
    m.run([_op("lm_head", m, layer=0)])
    assert_close(m.logits, ref.gemm_nt(ref.rmsnorm(m.h.x, m.h.out_norm, 1e-5), m.h.tok), dtype)
    got = to_host(m.logits)
    want = [[got[b, 16 * t:16 * t + 16].max() for t in range(3)] for b in range(3)]
    assert cupy.asnumpy(m.step.sp_tmax).tolist() == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_op_sample(rng, dtype):
    """Greedy and sampled ids equal the reference sampler's (reference.sample_token on the same
    logits, seeds and steps); each sequence's RNG step advances by one."""
    import cupy

    from cupyattn.megakernel import OPCODES

    m = _Model(rng, dtype)
    z, zh = _w(rng, m.logits.shape, dtype, 3.0)
    m.logits[...] = z
    for temp, k, p in [(0.0, 0, 1.0), (0.9, 5, 0.8)]:
        m.sampling.set(temp, k, p, seed=11, step=2)
        m.run([Op("sample", OPCODES["sample"], 3)])
        want = [ref.sample_token(zh[b], temp, k, p, seed=11 + b, step=2) for b in range(3)]
        assert cupy.asnumpy(m.tokens).tolist() == want, (temp, k, p)
        assert cupy.asnumpy(m.sampling.iparams[:, 3]).tolist() == [3] * 3


@pytest.mark.gpu
def test_gpu_bad_arguments_raise_before_anything_runs(rng):
    """Each refusal names the function and the argument; nothing is launched or written: the
    buffers keep their poison, the lengths and the step state stay as they were."""
    import cupy

    from cupyattn.megakernel import OPCODES, LlamaStep

    m = _Model(rng, "float16")
    base = dict(tok_embd=m.tok, output_norm=m.out_norm, output=m.tok, layers=m.layers, cache=m.cache,
                num_heads=m.s["hq"], eps=1e-5, rope_base=1e4, rope_style="adjacent", tokens=m.tokens, x=m.x, q=m.q,
                att=m.att, ffn=m.ffn, logits=m.logits, o_part=m.o_part, lse_part=m.lse_part,
                sampling=m.sampling, counter_capacity=8, blocks=1)
    bad_layers = [SimpleNamespace(**{**vars(m.layers[0]), "wo": m.layers[0].wo.astype(np.float32)}), m.layers[1]]
    for change, exc, pattern in [
        (dict(layers=bad_layers), TypeError,
         r"LlamaStep\(\): layers\[0\].wo has dtype float32 but the cache has float16"),
        (dict(layers=m.layers[:1]), ValueError, "1 layers but the cache has 2"),
        (dict(num_heads=0), ValueError, r"LlamaStep\(\): num_heads must be an integer >= 1"),
        (dict(x=m.x[:2]), ValueError, "x must be a C-contiguous, 16-byte aligned float16 buffer of 216 elements"),
        (dict(tokens=m.tokens.astype(np.int64)), ValueError, "tokens must be"),
        (dict(o_part=m.o_part[:, :2]), ValueError, r"o_part must be C-contiguous float32 \[splits, 3, 3, 32\]"),
        (dict(o_part=cupy.zeros((33, 3, 3, 32), np.float32), lse_part=cupy.zeros((33, 3, 3), np.float32)), ValueError,
         r"o_part and lse_part hold 33 splits, expected 1 to config.MEGAKERNEL_MAX_SPLITS \(32\)"),
        (dict(rope_style="gptj"), ValueError, "rope_style"),
        (dict(blocks=10 ** 6), ValueError, "exceeds the device's"),
        (dict(output=m.tok[:, :64]), ValueError, "output must be C-contiguous, 16-byte aligned, of shape"),
        (dict(att=m.q.reshape(3, -1)), ValueError, r"LlamaStep\(\): q overlaps att in memory"),
        (dict(tokens=m.cache.lengths[0]), ValueError, r"LlamaStep\(\): tokens overlaps the cache's lengths"),
        (dict(x=m.layers[0].wqkv.reshape(-1)[:216]), ValueError, r"LlamaStep\(\): x overlaps layers\[0\].wqkv"),
        (dict(tokens=m.sampling.iparams.reshape(-1)[:3]), ValueError, "tokens overlaps sampling.iparams"),
        (dict(rope_divisors=cupy.ones((2, 15), np.float32)), ValueError,
         r"rope_divisors must be C-contiguous float32 \[2, 16\] \(layers x head_dim / 2\), got \(2, 15\)"),
        (dict(rope_divisors=cupy.zeros((2, 16), np.float32)), ValueError, "rope_divisors must be positive finite"),
        (dict(rope_divisors=cupy.ones((2, 16), np.float64)), TypeError, "rope_divisors"),
        (dict(scale=0.0), ValueError, r"LlamaStep\(\): scale must be"),
    ]:
        with pytest.raises(exc, match=pattern):
            LlamaStep(**{**base, **change})
    step = m.step
    with pytest.raises(ValueError, match=r"LlamaStep.plan\(\): op 'x' has opcode 99"):
        step.plan([Op("x", 99, 1)])
    nosample = LlamaStep(**{**base, "sampling": None})
    with pytest.raises(ValueError, match="samples, but the step was made with sampling=None"):
        nosample.plan([Op("sample", OPCODES["sample"], 3)])
    for args in ((1, 0), (1, 30), (2, 16)):  # the merge's chunks must be its parts' (V = 37 here)
        with pytest.raises(ValueError, match=r"args \(\d+, \d+\) must be \(0, 0\) \(one block\) or the \(chunks"):
            step.plan([Op("sample", OPCODES["sample"], 3, args=args)])
    dplan = step.plan([_op("lm_head", m, layer=0)])
    with pytest.raises(ValueError, match=r"LlamaStep.launch\(\): splits must be"):
        step.launch(dplan, 5)
    m.cache.host_lengths[1, 2] = m.s["max_seq"]  # a full sequence: the launch must not start
    with pytest.raises(ValueError, match=r"LlamaStep.launch\(\): cache is full: sequence 2 of layer 1"):
        step.launch(dplan, 1)
    assert np.isnan(to_host(m.logits)).all() and cupy.asnumpy(step.step_state).tolist() == [0, 0]
    assert cupy.asnumpy(m.cache.lengths).tolist() == [[5, 1, 17]] * 2
