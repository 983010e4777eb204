"""One small launch of every kernel instantiation, for NVIDIA compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python -m benchmarks.sanitize_cases
    python -m benchmarks.sanitize_cases --only attention,decode     # a subset of op families

Each op family below calls the public API on small odd-sized inputs (tails in every tile
dimension, GQA, causal and not, masks and key lengths, split and unsplit decode, every dtype and
head dim, aligned and misaligned rows so both vector widths run); the families whose tiles depend
on shared memory per block run again with the tiles smaller GPU families dispatch (shallower
rings, the 2-stage GEMM, the 64 KB attention and decode tiles). At the end the script compares
the kernels it launched with every name expression this device can run (``KernelSpec.exprs_for``)
and exits 1 naming any it missed, so the sanitizer stage of ``benchmarks/gpu_run.sh`` provably
covers every instantiation. Correctness against the float64
references is the test tier's job; this only launches, synchronises and checks that outputs
are finite. It also runs on the CPU emulator (tests/benchmarks/test_sanitize_cases.py).
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np

FAMILIES = ("attention", "decode", "kvcache", "gemm", "softmax", "layers", "sampling", "fused", "serving",
            "megakernel")


def _rand(shape, dtype, seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    x = cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    # in a fresh allocation (256-byte aligned: CuPy's pool, the emulator's guarded pages), so
    # every vector path whose alignment the dispatch checks is taken, whatever astype returned
    out = cupy.empty(shape, dtype)
    out[...] = x
    return out


def _misaligned(x):
    """x's values in a C-contiguous array one element past an aligned address (no vector loads)."""
    import cupy

    buf = cupy.empty(x.size + 1, dtype=x.dtype)
    buf[1:] = x.reshape(-1)
    return buf[1:].reshape(x.shape)


def _finite(*arrays):
    import cupy

    for a in arrays:
        if isinstance(a, tuple):  # e.g. add_rmsnorm's (sum, normed)
            _finite(*a)
            continue
        if not bool(cupy.isfinite(a.astype(np.float32)).all()):
            raise AssertionError(f"non-finite output of shape {a.shape}")


def attention(ca, cfg):
    import cupy

    for dt in cfg.DTYPES:
        impls = ("flash", "flash_mma") if dt in cfg.MMA_DTYPES else ("flash",)
        for d in cfg.HEAD_DIMS:
            q, k, v = _rand((1, 4, 130, d), dt, 1), _rand((1, 2, 150, d), dt, 2), _rand((1, 2, 150, d), dt, 3)
            mask = _rand((130, 150), np.float32, 4)
            for impl in impls:
                o, lse = ca.attention(q, k, v, causal=True, impl=impl, return_lse=True)
                o2 = ca.attention(q, k, v, mask=mask, key_lengths=cupy.asarray([77], np.int32), impl=impl)
                _finite(o, lse, o2)
            if dt in cfg.MMA_DTYPES and d in cfg.ATTN_WGMMA_TILES and _hopper():
                # wgmma (Hopper): causal with lse; a mask and a key length ending inside a loaded
                # key tile (the producer zeroes the V rows past it)
                o, lse = ca.attention(q, k, v, causal=True, impl="wgmma", return_lse=True)
                o2 = ca.attention(q, k, v, mask=mask, key_lengths=cupy.asarray([77], np.int32), impl="wgmma")
                _finite(o, lse, o2)
            if dt in cfg.MMA_DTYPES and d in cfg.ATTN_WGMMA_PERSISTENT_TILES and _hopper():
                # the persistent variant on a grid of 2 blocks (several tiles each, the counter's
                # claims): a causal window with softcap (masked and bulk runs), a mask and a key
                # length inside a loaded tile, a plain call (the static order)
                with _grid(2):
                    o, lse = ca.attention(q, k, v, causal=True, window=(60, -1), softcap=20.0, impl="wgmma_persistent",
                                          return_lse=True)
                    o2 = ca.attention(q, k, v, mask=mask, key_lengths=cupy.asarray([77], np.int32),
                                      impl="wgmma_persistent")
                    _finite(o, lse, o2, ca.attention(q, k, v, impl="wgmma_persistent"))
            if dt in cfg.MMA_DTYPES and d in cfg.ATTN_WGMMA_TILES and _hopper():
                # the Hopper kernel's opt-in variants (config.ATTN_SM90_*): each instantiation a
                # knob can ask for, causal with lse (the 176-key tile takes no causal)
                for knob, value, impl, causal in _SM90_VARIANTS:
                    with cfg.override(**{knob: value}):
                        _finite(*ca.attention(q, k, v, causal=causal, impl=impl, return_lse=True))
        _finite(ca.attention(q[:, :, :33], k, v, causal=True, impl="naive"))


# (config knob, value, impl, causal): what launches every variant instantiation of
# cupyattn.flash_attn_sm90.instantiations() beside the tile tables' own
_SM90_VARIANTS = (("ATTN_SM90_DENSE_SCHEDULER", "persistent", "wgmma", True),
                  ("ATTN_SM90_OVERLAP", False, "wgmma", True), ("ATTN_SM90_OVERLAP", False, "wgmma_persistent", True),
                  ("ATTN_SM90_OVERLAP", True, "wgmma_persistent", True), ("ATTN_SM90_WIDE_N", True, "wgmma", False))


def decode(ca, cfg):
    import cupy

    for dt in cfg.DTYPES:
        for d in cfg.HEAD_DIMS:
            # (Hq, Hkv, impl): SIMT; tensor cores with one and with two 16-row m-tiles
            shapes = [(4, 2, "simt")] + ([(8, 2, "mma"), (40, 2, "mma")] if dt in cfg.MMA_DTYPES else [])
            for hq, hkv, impl in shapes:
                cache = ca.KVCache(1, 2, hkv, 600, d, dt)
                cache.append(0, _rand((2, hkv, 531, d), dt, 5), _rand((2, hkv, 531, d), dt, 6),
                             num_new=[531, 9])
                q = _rand((2, hq, 1, d), dt, 7)
                for splits in (1, 3):
                    _finite(ca.decode_attention(q, cache, 0, num_splits=splits, impl=impl))
                _finite(ca.decode_attention(q, cache, 0, num_splits=3, impl=impl, fused_combine=True))
                # the "waves" rule: per-sequence chunks (531 keys: 3 splits, 9 keys: 1, written
                # straight to out) merged in the kernel and by the combine kernel
                for fused in (True, False):
                    _finite(ca.decode_attention(q, cache, 0, num_splits=3, impl=impl, split_rule="waves",
                                                fused_combine=fused))


def kvcache(ca, cfg):
    for dt in cfg.DTYPES:
        cache = ca.KVCache(1, 3, 2, 64, 32, dt)
        cache.append(0, _rand((3, 2, 5, 32), dt, 8), _rand((3, 2, 5, 32), dt, 9))
        cache.append(0, _rand((3, 2, 4, 32), dt, 10), _rand((3, 2, 4, 32), dt, 11), num_new=[4, 1, 0])
        for style in ("adjacent", "neox"):
            for t in (1, 3):  # one-token steps advance the lengths inside the kernel
                q = cache.append_qkv(0, _rand((3, t, (4 + 2 + 2) * 32), dt, 12), num_heads=4, rope_style=style)
                _finite(q)


def serving(ca, cfg):
    """The SERVING instantiations: packed and paged attention with a window and
    softcap, paged decode (SIMT and both mma tiles, split), paged appends."""
    import cupy

    for dt in cfg.DTYPES:
        impls = ("flash", "flash_mma") if dt in cfg.MMA_DTYPES else ("flash",)
        for d in cfg.HEAD_DIMS:
            cu = np.array([0, 7, 90, 130], dtype=np.int32)
            q, k, v = _rand((130, 4, d), dt, 20), _rand((130, 2, d), dt, 21), _rand((130, 2, d), dt, 22)
            wg = ("wgmma_persistent",) if dt in cfg.MMA_DTYPES and d in cfg.ATTN_WGMMA_PERSISTENT_TILES and _hopper() \
                else ()
            for impl in impls + wg:
                with _grid(2) if impl in wg else contextlib.nullcontext():
                    _finite(ca.attention_varlen(q, k, v, cu, cu, 83, 83, causal=True, window=(40, 0), softcap=30.0,
                                                impl=impl))
            shapes = [(4, 2, "simt")] + ([(8, 2, "mma"), (40, 2, "mma")] if dt in cfg.MMA_DTYPES else [])
            for hq, hkv, impl in shapes:
                cache = ca.PagedKVCache(1, 2, hkv, d, num_pages=80, page_size=16, dtype=dt)
                cache.append(0, _rand((2, hkv, 531, d), dt, 23), _rand((2, hkv, 531, d), dt, 24), num_new=[531, 9])
                qd = _rand((2, hq, d), dt, 25)
                _finite(cache.decode(qd, 0, num_splits=3, impl=impl, window=(100, -1), softcap=20.0))
                # the opt-in paths: HND pages of 1 token, page ids staged (531 keys in one split: windows refreshed),
                # the waves rule with its fused combine and with the combine kernel
                hnd = ca.PagedKVCache(1, 2, hkv, d, num_pages=600, page_size=1, dtype=dt, layout="HND")
                hnd.append(0, _rand((2, hkv, 531, d), dt, 23), _rand((2, hkv, 531, d), dt, 24), num_new=[531, 9])
                with cfg.override(DECODE_PAGE_STAGING=True):
                    _finite(hnd.decode(qd, 0, num_splits=1, impl=impl), hnd.decode(qd, 0, num_splits=3, impl=impl))
                    for fused in (True, False):
                        _finite(hnd.decode(qd, 0, num_splits=3, impl=impl, split_rule="waves", fused_combine=fused,
                                           window=(400, -1)))
                if impl == "simt":
                    qp = _rand((9, hq, d), dt, 26)
                    for fimpl in impls + wg:   # the persistent kernel: 8 pages of 16 per key tile
                        _finite(ca.attention_paged(qp, cache.k[0], cache.v[0], cache.block_table, cache.lengths[0],
                                                   cu_seqlens_q=cupy.asarray([0, 0, 9], dtype=cupy.int32),
                                                   max_seqlen_q=9, causal=True, impl=fimpl))
        for layout in ("NHD", "HND"):
            cache = ca.PagedKVCache(1, 3, 2, 32, num_pages=12, page_size=4, dtype=dt, layout=layout)
            for style in ("adjacent", "neox"):
                for t in (1, 3):
                    _finite(cache.append_qkv(0, _rand((3, t, (4 + 2 + 2) * 32), dt, 27), num_heads=4,
                                             rope_style=style))
            cache.append(0, _rand((3, 2, 5, 32), dt, 28), _rand((3, 2, 5, 32), dt, 29))
            _finite(ca.attention_paged(_rand((5, 4, 32), dt, 30), cache.k[0], cache.v[0], cache.block_table,
                                       cache.lengths[0], cu_seqlens_q=cupy.asarray([0, 2, 3, 5], dtype=cupy.int32),
                                       max_seqlen_q=2, causal=True, layout=layout))


def gemm(ca, cfg):
    for dt in cfg.DTYPES:
        mma = dt in cfg.MMA_DTYPES
        a, bt, bn = _rand((2, 131, 72), dt, 13), _rand((97, 72), dt, 14), _rand((72, 97), dt, 15)
        for impl in ("simt", "mma") if mma else ("simt",):
            _finite(ca.gemm_nt(a, bt, impl=impl), ca.gemm_nn(a, bn, impl=impl))
        _finite(ca.gemm_nt(a[:, :5], bt, impl="skinny"))
        if mma and _hopper():
            # wgmma: 128 x 256 tiles (few tiles either way), then 128 x 128 ones (N = 300: more
            # narrow tiles than wide ones, all fewer than the SMs); 144-byte rows, K tail of 8
            # (gemm_nn's b: rows padded to 16 bytes, N = 97 and 300 through views)
            wide = _rand((300, 72), dt, 23)
            for b_nt, b_nn in ((bt, _rand((72, 104), dt, 15)[:, :97]), (wide, _rand((72, 304), dt, 24)[:, :300])):
                _finite(ca.gemm_nt(a, b_nt, impl="wgmma"), ca.gemm_nn(a, b_nn, impl="wgmma"))


def softmax(ca, cfg):
    for dt in cfg.DTYPES:
        reg = [cfg.SOFTMAX_BLOCK * v for v in cfg.SOFTMAX_REG_TILES]  # each block-reg VPT's longest row
        for n in [32 * v for v in cfg.SOFTMAX_VPTS] + reg + [3001, 20000]:
            _finite(ca.softmax(_rand((5, n), dt, 16), causal=n <= 64))


def layers(ca, cfg):
    import cupy

    for dt in cfg.DTYPES:
        for d in (17, 64, 2048):  # scalar rows, vector rows, block-per-row rmsnorm
            x, r = _rand((3, d), dt, 17), _rand((3, d), dt, 18)
            for wdt in dict.fromkeys((dt, np.dtype(np.float32))):  # weights in x's dtype or float32
                w = _rand((d,), wdt, 19)
                for impl in ("warp", "block"):
                    _finite(ca.rmsnorm(x, w, impl=impl), ca.add_rmsnorm(x.copy(), r, w, impl=impl))
            _finite(ca.swiglu(x, r), ca.add(x, r), ca.layers.geglu(x, r))
            # the families' in-place ops (Qwen2's biases, Gemma's softcap, Qwen3's and Gemma 3's
            # per-head norms), in place
            y = x.copy()
            ca.layers.bias_add(y, _rand((d,), dt, 31))
            ca.layers.softcap(y, 30.0)
            _finite(y)
            table = _rand((11, d), dt, 20)
            for idt in (np.int32, np.int64):
                _finite(ca.embedding(cupy.asarray([3, 0, 10], idt), table))
        heads = _rand((3, 4, 64), dt, 32)
        ca.layers.head_rmsnorm(heads[:, 1:], _rand((64,), dt, 33))
        _finite(heads)
        for style in ("adjacent", "neox"):
            for idt in (np.int32, np.int64):
                pos = cupy.asarray([[5, 2**31 + 3, 0]] if idt == np.int64 else [[0, 1, 2]], idt)  # [B, T]
                x = _rand((1, 2, 3, 64), dt, 21)
                _finite(ca.rope(x, pos, style=style), ca.rope(_misaligned(x), pos, style=style))


def fused(ca, cfg):
    """The fused decode step's kernels: 3 rows (one tile, partial), 17 rows (two), aligned and
    misaligned activations (vector and scalar loads), both RoPE styles."""
    for dt in cfg.DTYPES:
        g, w = _rand((72,), dt, 23), _rand((97, 72), dt, 24)
        for m in (3, 17):
            x = _rand((m, 72), dt, 25)
            for xx in (x, _misaligned(x)):
                _finite(ca.fused.rmsnorm_gemm(xx, g, w), ca.fused.rmsnorm_gate_up_swiglu(xx, g, w[:96]))
                _finite(ca.fused.gemm_residual(_rand((m, 97), dt, 26), xx, w))
        cache = ca.KVCache(1, 3, 2, 64, 32, dt)
        cache.append(0, _rand((3, 2, 5, 32), dt, 27), _rand((3, 2, 5, 32), dt, 28), num_new=[5, 1, 3])
        for style in ("adjacent", "neox"):
            x = _rand((3, 1, 72), dt, 29)
            _finite(ca.fused.rmsnorm_qkv_rope_append(x, g, _rand(((4 + 2 + 2) * 32, 72), dt, 30), cache, 0, 4,
                                                     rope_style=style))


def megakernel(ca, cfg):
    """Two decode steps of the megakernel per dtype on a small Llama (odd vocabulary and FFN, GQA,
    batch 3), unsplit and with split attention + merge, sampling inside (top-k, no cut, top-p: each
    way the two-level merge draws), today's plan and the new one (cupyattn.megakernel_llama.NEW_PLAN).
    One block: it runs its
    queue in order and never waits, so no sanitizer's serialisation of blocks can hang it (the
    several-block runs are the GPU tests')."""
    import cupy

    from tinylm.config import ModelArgs
    from cupyattn.megakernel_llama import NEW_PLAN, llama_ops

    a = ModelArgs(dim=72, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=40, vocab_size=37, max_seq=16)
    for dt in cfg.DTYPES:
        layers = [type("L", (), dict(attn_norm=_rand((72,), dt, 31), wqkv=_rand((256, 72), dt, 32),
                                     wo=_rand((72, 128), dt, 33), ffn_norm=_rand((72,), dt, 34),
                                     w_gate_up=_rand((80, 72), dt, 35), w_down=_rand((72, 40), dt, 36)))()
                  for _ in range(2)]
        cache, tok = ca.KVCache(2, 3, 2, 16, 32, dt), _rand((37, 72), dt, 37)
        bufs = dict(tokens=cupy.zeros(3, np.int32), x=cupy.empty((3, 72), dt), q=cupy.empty((3, 4, 32), dt),
                    att=cupy.empty((3, 128), dt), ffn=cupy.empty((3, 40), dt), logits=cupy.empty((3, 37), dt),
                    o_part=cupy.empty((2, 3, 4, 32), np.float32), lse_part=cupy.empty((2, 3, 4), np.float32))
        step = ca.megakernel.LlamaStep(tok_embd=tok, output_norm=_rand((72,), dt, 38), output=tok, layers=layers,
                                       cache=cache, num_heads=4, eps=1e-5, rope_base=1e4, rope_style="adjacent",
                                       sampling=ca.SamplingParams(3, temperature=[0.7, 1.0, 0.8], top_k=[5, 0, 0],
                                                                  top_p=[1.0, 1.0, 0.9], seed=1),
                                       counter_capacity=64, blocks=1, **bufs)
        # today's plan, then every knob of the new one (ring attention over split keys and heads, split
        # projections into partial slots, the merge on load, two-level sampling)
        for knobs in (None, NEW_PLAN):
            for splits in (1, 2):
                ops = llama_ops(a, 3, splits, sample=True, knobs=knobs, itemsize=np.dtype(dt).itemsize, heads=None)
                step.launch(step.plan(ops), splits)
        _finite(bufs["logits"])


def sampling(ca, cfg):
    for dt in cfg.DTYPES:
        logits = _rand((3, 1000), dt, 22)
        params = ca.SamplingParams(3, temperature=[0.0, 0.8, 1.2], top_k=[0, 50, 0], top_p=[1.0, 1.0, 0.9], seed=7)
        ca.sample(logits, params)
    from cupyattn import sampling as S

    S.philox4x32(np.zeros((5, 4), np.uint32), np.ones((5, 2), np.uint32))


@contextlib.contextmanager
def _grid(n):
    """The persistent attention kernel on ``n`` blocks (each computes several tiles)."""
    from cupyattn import flash_attn_sm90_persistent as p

    real = p._sm_count
    p._sm_count = lambda: n
    try:
        yield
    finally:
        p._sm_count = real


def _hopper() -> bool:
    from cupyattn import device

    return device.compute_capability() >= 90


def launched() -> set[str]:
    """Name expressions compiled (and so launched) in this process."""
    from cupyattn import _loader

    return {expr for (_spec, expr, _dev) in _loader._FUNCTIONS}


def missing() -> list[str]:
    """Every name expression this device can run (KernelSpec.exprs_for: its compute capability,
    or CUPYATTN_ARCH's, and shared memory) that this process has not launched."""
    from cupyattn import _loader, device

    done, cc = launched(), device.compute_capability()
    return [e for s in _loader.all_specs() for e in s.exprs_for(cc) if e not in done]


# the families whose tiles fall back to a shallower ring where a device's per-block shared memory
# is smaller (config "GPU families": Turing 64 KB, 99 KB parts); the second pass launches those
SHALLOW_FAMILIES = ("decode", "gemm", "serving")
# the families with tiles for 64 KB devices (config FLASH_MMA_SMALL_SMEM_TILES,
# DECODE_MMA_SMALL_SMEM_TILES); the third pass launches those
COMPACT_FAMILIES = ("attention", "decode", "serving")


@contextlib.contextmanager
def shallow_rings(compact: bool = False):
    """Dispatch as a device with less shared memory per block does, whatever this one has: every
    decode tile with its shallower ring (decode._fit's fallback), the GEMM's 2-stage mma tile; with
    ``compact``, the 64 KB tiles where the spec has them (an explicit decode impl="mma" at D = 128,
    256 and fp16 flash_mma at D = 96, 128)."""
    from cupyattn import config as cfg
    from cupyattn import decode_launch as decode  # (the launch modules hold the tile choices)
    from cupyattn import flash_launch, gemm

    fit, tile, fa_tile = decode._fit, gemm._mma_tile, flash_launch.tile_for

    def small_fit(impl, dtype, d, t, m_tiles, limit, explicit=False, staged=False):
        c = cfg.DECODE_MMA_SMALL_SMEM_TILES.get((d, m_tiles))
        if compact and explicit and impl == "mma" and c in decode.mma_tiles(dtype, d, m_tiles):
            return c
        return decode._small(t)

    def small_tile(impl, dtype, head_dim, smem_limit=None, cc=None):
        return flash_launch.mma_tiles(dtype, head_dim)[-1] if impl == "flash_mma" else fa_tile(impl, dtype, head_dim)

    decode._fit = small_fit
    gemm._mma_tile = lambda nt: cfg.GEMM_MMA_SMALL_SMEM
    if compact:
        flash_launch.tile_for = small_tile
    try:
        yield
    finally:
        decode._fit, gemm._mma_tile, flash_launch.tile_for = fit, tile, fa_tile


def run(families=FAMILIES) -> None:
    import cupy

    import cupyattn as ca
    from cupyattn import config as cfg

    def one(f, label=""):
        globals()[f](ca, cfg)
        cupy.cuda.get_current_stream().synchronize()
        print(f"sanitize_cases: {f}{label} done", flush=True)

    for f in families:
        one(f)
    with shallow_rings():
        for f in families:
            if f in SHALLOW_FAMILIES:
                one(f, " (shallow rings)")
    with shallow_rings(compact=True):
        for f in families:
            if f in COMPACT_FAMILIES:
                one(f, " (64 KB tiles)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sanitize_cases", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(FAMILIES),
                   help=f"comma-separated op families (default: all of {','.join(FAMILIES)})")
    args = p.parse_args(argv)
    families = tuple(f for f in args.only.split(",") if f)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--only: unknown family {unknown[0]!r}; choose from {','.join(FAMILIES)}")
    from cupyattn import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        print(f"sanitize_cases: {reason}", file=sys.stderr)
        return 2
    run(families)
    miss = missing() if set(families) == set(FAMILIES) else []
    if miss:
        print(f"sanitize_cases: {len(miss)} instantiation(s) never launched: {', '.join(miss)}", file=sys.stderr)
        return 1
    print(f"sanitize_cases: launched {len(launched())} kernel instantiations", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
