"""Measured tuning on a GPU: candidate configurations timed side by side, one call.

    python -m benchmarks.tune [--json PATH] [softmax] [flash] [decode] [gemm] [attention-wgmma]

- ``softmax``: the row-in-registers block kernel (v3) against the two-pass block kernel (v2) on
  rows of 2K-16K columns (8192 rows), every dtype; % of the measured copy bandwidth.
- ``flash``: candidate (block_m, block_n, warps) tiles of flash_attn_mma for D=64 and D=128 at
  the issue's shape (fp16, B=4, H=32, S=4096, causal and not), each built as its own kernel spec;
  each output is checked against the configured tile's.
- ``decode``: decode_attention at every split count 1..512 (powers of two) and the automatic
  choice, for the benchmark's default decode cases.
- ``gemm``: impl="wgmma" (Hopper) tile candidates (output tile width, ring stages, setmaxnreg
  split) at 4096^3 and 8192^3, fp16 and bf16, A B^T and A B, each built as its own kernel spec,
  beside the configured tile, impl="mma" and cuBLAS measured in the same process; each output is
  compared with cuBLAS's. (Thread-block clusters with TMA multicast are not implemented yet, so
  there is no cluster candidate.)
- ``attention-wgmma``: impl="wgmma" (Hopper) attention tile candidates (keys per K/V slot, ring
  stages, softmax / P V overlap and consumer ping-pong on and off;
  cupyattn.flash_attn_sm90.tuning_tiles) for D = 64, 128 and 256 at the issue's shape
  (fp16, B=4, H=32, S=4096, causal and not), beside the configured tile, flash_mma and torch
  SDPA (when importable) in the same process; then the same candidates in the persistent
  variant (impl="wgmma_persistent", config.ATTN_WGMMA_PERSISTENT_TILES; a candidate whose
  registers spill there still runs and is timed); each output is compared with flash_mma's.

Timing: CUDA events (benchmarks/timing.py), 3 untimed warm-up calls, median of up to 30 reps,
L2 not flushed between reps. The candidates of one case are timed interleaved, in ROUNDS rounds,
round r starting at candidate r, so no candidate is always the first timed; a row's ``ms`` is the
median of its rounds' medians (all in ``ms_rounds``). Rows are printed as their case finishes;
the JSON holds them all under ``rows`` and a ``meta`` block (date, command, commit,
kernels_sha256 and dispatch_sha256, GPU and versions, ``l2_flushed``, ``timing``). For choosing
config.py entries by measurement; not part of the recorded results.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

ROUNDS = 3  # rounds of interleaved timing per case
TIMING = (f"CUDA events; 3 warm-up calls, then the median of up to 30 reps; the candidates of a case "
          f"interleaved over {ROUNDS} rounds in rotated order, ms = median of the rounds' medians")


def _ms(fn, reps=30):
    from .timing import time_fn

    return time_fn(fn, warmup=3, reps=reps, budget_ms=1500).median_ms


def timed_interleaved(cands, emit, derive=None, reps=30):
    """Time one case's candidates, ``[(row, fn), ...]``, in ROUNDS rounds; round r times them
    starting at candidate r (mod n). Each row gets ``ms`` (median of its rounds' medians) and
    ``ms_rounds``, then ``derive(row)`` adds what follows from ms; a candidate that raises gets
    ``error`` instead. Rows are emitted in candidate order."""
    times = [[] for _ in cands]
    for r in range(ROUNDS):
        for i in range(len(cands)):
            j = (i + r) % len(cands)
            row, fn = cands[j]
            if "error" in row:
                continue
            try:
                times[j].append(_ms(fn, reps))
            except Exception as e:  # a candidate that does not build or launch is a finding
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for (row, _), t in zip(cands, times):
        if t and "error" not in row:
            row.update(ms=statistics.median(t), ms_rounds=t)
            if derive:
                derive(row)
        emit(row)


def tune_softmax(ceil, emit):
    import cupy

    from cupyattn import config, row_softmax
    from cupyattn._loader import get_function

    from .arrays import rand

    for dt in ("float16", "bfloat16", "float32"):
        for n in (2048, 4096, 8192, 16384):
            x = rand((8192, n), dt, 3.0)
            y = cupy.empty_like(x)
            args = (x, y, cupy.int64(8192), cupy.int32(n), cupy.int32(1), cupy.float32(1.0), cupy.int32(0))
            vpt = next(v for v in config.SOFTMAX_REG_TILES if config.SOFTMAX_BLOCK * v >= n)
            cands = []
            for name, expr in (("v3-reg", row_softmax._block_reg_expr(x.dtype, vpt)),
                               ("v2-2pass", row_softmax._block_expr(x.dtype))):
                k = get_function(row_softmax.SPEC, expr)
                cands.append((dict(op="softmax", dtype=dt, cols=n, impl=name),
                              lambda k=k: k((8192,), (config.SOFTMAX_BLOCK,), args)))

            def derive(row, nbytes=2 * x.nbytes):
                row["gbps"] = nbytes / row["ms"] / 1e6
                row["pct_copy"] = 100 * row["gbps"] / ceil

            timed_interleaved(cands, emit, derive)


FLASH_CANDIDATES = {
    64: [(128, 64, 8), (128, 128, 8), (64, 64, 4), (128, 32, 8), (128, 64, 4), (256, 64, 8)],
    128: [(128, 64, 8), (64, 64, 4), (128, 32, 8), (128, 128, 8), (64, 128, 4), (64, 32, 4)],
}


def tune_flash(emit):
    import cupy

    from cupyattn import attention, config
    from cupyattn import flash_launch as flash_attn  # (the launch module reads SPEC at launch)
    from cupyattn._loader import KernelSpec

    from .arrays import rand

    def with_tile(d, tile, spec, fn):  # run fn with this candidate's tile and kernel spec installed
        def run():
            base, fam, old = config.FLASH_MMA_TILES[d], config.FLASH_MMA_FAMILY_TILES, flash_attn.SPEC
            config.FLASH_MMA_TILES[d], config.FLASH_MMA_FAMILY_TILES = tile, {}  # on every family
            flash_attn.SPEC = spec or old
            try:
                return fn()
            finally:
                config.FLASH_MMA_TILES[d], config.FLASH_MMA_FAMILY_TILES, flash_attn.SPEC = base, fam, old
        return run

    for d, cands in FLASH_CANDIDATES.items():
        q, k, v = (rand((4, 32, 4096, d), "float16") for _ in range(3))
        for causal in (False, True):
            want = attention(q, k, v, causal=causal, impl="flash_mma")
            flops = 4 * 4 * 32 * 4096 * 4096 * d * (0.5 if causal else 1.0)
            timed = []
            for bm, bn, w in cands:
                tile = config.FlashTile(bm, bn, w, "tuning candidate")
                row = dict(op="flash_mma", D=d, causal=causal, block_m=bm, block_n=bn, warps=w,
                           smem=(bm + (config.FLASH_MMA_K_STAGES + 1) * bn) * (d + config.FLASH_MMA_PAD) * 2)
                call = lambda: attention(q, k, v, causal=causal, impl="flash_mma")  # noqa: E731
                try:
                    expr = with_tile(d, tile, None, lambda: flash_attn.expr("flash_mma", q.dtype, d, causal))()
                    spec = KernelSpec(f"flash_tune_{d}_{bm}_{bn}_{w}_{int(causal)}", flash_attn.SPEC.source,
                                      (expr,), flash_attn.SPEC.options)
                    got = with_tile(d, tile, spec, call)()
                    row["max_abs_diff"] = float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max())
                except Exception as e:  # a candidate that does not build or launch is a finding
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    spec = None
                timed.append((row, with_tile(d, tile, spec, call)))
            timed_interleaved(timed, emit, lambda row, f=flops: row.update(tflops=f / row["ms"] / 1e9), reps=20)


def tune_decode(ceil, emit):
    import cupy

    from cupyattn import decode

    from .cases import build_inputs
    from .specs import default_cases, case_bytes

    for case in default_cases("decode"):
        inp = build_inputs(case)
        nbytes = case_bytes(case)
        auto = decode.auto_num_splits(case.p["B"], case.p["H"], case.p["Hkv"], case.p["D"], inp["q"].dtype,
                                      case.p["L"], "auto")
        cands = [(dict(op="decode", case=case.name, splits=ns or f"auto={auto}"),
                  lambda ns=ns: decode.decode_attention(inp["q"], inp["cache"], 0, num_splits=ns, out=inp["out"]))
                 for ns in (None, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]

        def derive(row, nbytes=nbytes):
            row["gbps"] = nbytes / row["ms"] / 1e6
            row["pct_copy"] = 100 * row["gbps"] / ceil

        timed_interleaved(cands, emit, derive)
        del inp
        cupy.get_default_memory_pool().free_all_blocks()


# (BN, stages, (producer regs, consumer regs)): shared memory <= 227 KB, 128 x P + 256 x C <= 64K
GEMM_WGMMA_CANDIDATES = [(256, 4, (40, 232)), (256, 3, (40, 232)), (256, 4, (24, 240)),
                         (128, 6, (40, 232)), (128, 4, (40, 232)), (128, 7, (24, 240))]


def tune_gemm(emit):
    import cupy

    from cupyattn import config, gemm
    from cupyattn._loader import KernelSpec

    from .arrays import rand

    tiles, regs, spec, pick = config.GEMM_WGMMA_TILES, config.GEMM_WGMMA_REGS, gemm.SPEC_SM90, config.gemm_wgmma_tile

    def with_tile(cand, rp_rc, cand_spec, fn):  # run fn with this candidate's tile, registers and spec
        def run():
            config.GEMM_WGMMA_TILES, config.GEMM_WGMMA_REGS = {cand.bn: cand}, rp_rc
            config.gemm_wgmma_tile = lambda *args, _t=cand: _t
            gemm.SPEC_SM90 = cand_spec or spec
            try:
                return fn()
            finally:
                config.GEMM_WGMMA_TILES, config.GEMM_WGMMA_REGS, gemm.SPEC_SM90 = tiles, regs, spec
                config.gemm_wgmma_tile = pick
        return run

    for size in (4096, 8192):
        for dt in ("float16", "bfloat16"):
            for layout in ("nt", "nn"):
                f = gemm.gemm_nt if layout == "nt" else gemm.gemm_nn
                a = rand((size, size), dt)
                b = rand((size, size), dt, size ** -0.5)
                want = cupy.matmul(a, b.T if layout == "nt" else b)  # cuBLAS
                flops = 2 * size ** 3
                base = dict(op="gemm", size=size, dtype=dt, layout=layout)
                timed = [(dict(base, impl="cublas"), lambda: cupy.matmul(a, b.T if layout == "nt" else b, out=want))]
                timed += [(dict(base, impl=impl), lambda impl=impl: f(a, b, impl=impl)) for impl in ("mma", "wgmma")]
                for bn, stages, (rp, rc) in GEMM_WGMMA_CANDIDATES:
                    cand = config.WgmmaTile(bn, stages, "tuning candidate")
                    row = dict(base, impl="wgmma", bn=bn, stages=stages, regs=f"{rp}/{rc}", smem=cand.smem_bytes)
                    call = lambda: f(a, b, impl="wgmma")  # noqa: E731
                    try:
                        expr = with_tile(cand, (rp, rc), None, lambda: gemm._expr("wgmma", a.dtype, layout == "nt", bn))()
                        cand_spec = KernelSpec(f"gemm_tune_{bn}_{stages}_{rp}_{rc}_{layout}_{dt}", spec.source,
                                               (expr,), spec.options, sm90a=True)
                        got = with_tile(cand, (rp, rc), cand_spec, call)()
                        row["max_abs_diff"] = float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max())
                    except Exception as e:  # a candidate that does not build or launch is a finding
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        cand_spec = None
                    timed.append((row, with_tile(cand, (rp, rc), cand_spec, call)))
                timed_interleaved(timed, emit, lambda row: row.update(tflops=flops / row["ms"] / 1e9))
                del a, b, want, timed
                cupy.get_default_memory_pool().free_all_blocks()


def tune_attention_wgmma(emit):
    import cupy

    from cupyattn import attention
    from cupyattn import flash_attn_sm90 as W
    from cupyattn import flash_attn_sm90_persistent as WP

    from . import peers
    from .arrays import rand

    for d in (64, 128, 256):
        q, k, v = (rand((4, 32, 4096, d), "float16") for _ in range(3))
        for causal in (False, True):
            base = dict(op="attention-wgmma", D=d, causal=causal)
            flops = 4 * 4 * 32 * 4096 * 4096 * d * (0.5 if causal else 1.0)
            want = attention(q, k, v, causal=causal, impl="flash_mma")
            runs = [("flash_mma", lambda: attention(q, k, v, causal=causal, impl="flash_mma")),
                    ("wgmma", lambda: attention(q, k, v, causal=causal, impl="wgmma")),
                    ("wgmma_persistent", lambda: attention(q, k, v, causal=causal, impl="wgmma_persistent"))]
            try:
                runs.append(("torch-sdpa", peers.torch_sdpa(q, k, v, causal)))
            except Exception as e:  # no torch here: the peer is left out, said once per case
                emit(dict(base, impl="torch-sdpa", error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            for name, fn in runs:
                try:
                    ms = _ms(fn, reps=20)
                    emit(dict(base, impl=name, ms=ms, tflops=flops / ms / 1e9))
                except Exception as e:
                    emit(dict(base, impl=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            for impl, tile in [("wgmma", t) for t in W.tuning_tiles(d)] + [("wgmma_persistent", t)
                                                                         for t in W.tuning_tiles(d)]:
                row = dict(base, impl=impl, block_n=tile.block_n, stages=tile.stages, overlap=tile.overlap,
                           pingpong=tile.pingpong, smem=tile.smem_bytes(d))
                out, lse = cupy.empty_like(q), None
                run = W.run if impl == "wgmma" else WP.run_dense
                try:
                    run(q, k, v, causal, d ** -0.5, None, out, lse, tile=tile)
                    row["max_abs_diff"] = float(cupy.abs(out.astype(cupy.float32) - want.astype(cupy.float32)).max())
                    ms = _ms(lambda: run(q, k, v, causal, d ** -0.5, None, out, lse, tile=tile), reps=20)
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                except Exception as e:  # a candidate that does not build or launch is a finding
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                emit(row)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


PARTS = ("softmax", "flash", "decode", "gemm", "attention-wgmma")


def parse_args(argv=None):
    """The parsed command line; ``parts`` is filled in (all of them when none is named)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tune", description=__doc__.split("\n\n")[0])
    # no choices= here: with nargs="*", Python 3.11's argparse refuses the empty default
    ap.add_argument("parts", nargs="*", metavar="PART", help=f"{', '.join(PARTS)} (default: all of them)")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args(argv)
    bad = [p for p in a.parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    if not a.parts:  # (nargs="*": none named means all of them)
        a.parts = list(PARTS)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from .timing import measure_ceilings, require_device

    require_device()
    from . import report

    meta = report.run_meta(["tune", *(argv if argv is not None else sys.argv[1:])], report.device_meta())
    meta["command"] = "python -m benchmarks.tune " + " ".join(argv if argv is not None else sys.argv[1:])
    meta.update(l2_flushed=False, timing=TIMING)
    ceil = measure_ceilings()["copy_gbps"]
    rows = []

    def emit(row):
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    for part in a.parts:
        try:
            {"softmax": lambda: tune_softmax(ceil, emit), "flash": lambda: tune_flash(emit),
             "decode": lambda: tune_decode(ceil, emit), "gemm": lambda: tune_gemm(emit),
             "attention-wgmma": lambda: tune_attention_wgmma(emit)}[part]()
        except Exception as e:
            print(f"{part}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": meta, "copy_gbps": ceil, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
