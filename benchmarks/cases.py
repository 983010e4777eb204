"""Case runners: device inputs, float64 references, implementations, one record per impl.

For every case: draw random inputs (never zeros), compute a float64 reference with CuPy ops
(chunked so that it fits beside the inputs), then for each implementation: first call (compile,
correctness against the reference), one call under the pool high-water tracker, then
``timing.time_fn``. An impl that fails gets a record with its status and one log line; the rest
of the run goes on.
"""
from __future__ import annotations

import math
import traceback

import numpy as np

from . import peers, serving_cases, timing
from .arrays import np_dtype, rand, to_f64
from .peers import ref_attention  # (serving_cases reads it there too: no cases <-> serving_cases circle)
from .report import fill_timing, new_record
from .specs import case_bytes, case_flops, decode_lengths

# decode "paged-N": decode_attention_paged over the same keys in shuffled pages of N tokens (NHD,
# page ids read per row, the default split rule); the opt-in paged / split paths (not yet the
# defaults, config.py): "-staged" with the page ids staged in shared memory, "-hnd" HND pages with
# staged ids, "-waves" the "waves" split rule with its fused combine (a preallocated workspace);
# "split-kv-waves" the contiguous cache under that rule
PAGED_VARIANTS = {"paged": ("NHD", False, "cost"), "paged-staged": ("NHD", True, "cost"),
                  "paged-hnd": ("HND", True, "cost"), "paged-hnd-waves": ("HND", True, "waves")}
OURS = {"softmax": ("ours",),
        "decode": ("split-kv", "unsplit", "naive", "split-kv-waves",
                   "paged-16", "paged-1", "paged-256", "paged-staged-16", "paged-staged-1", "paged-staged-256",
                   "paged-hnd-16", "paged-hnd-1", "paged-hnd-256", "paged-hnd-waves-16"),
        "model": ("tinylm", "tinylm-fused", "tinylm-eager", "tinylm-mega", "tinylm-fused-pdl", "tinylm-serve",
                  "tinylm-serve-opt-in", "tinylm-mega-new", "tinylm-mega-auto", "tinylm-mega-ring", "tinylm-mega-fine",
                  "tinylm-mega-fine-fit", "tinylm-mega-gu16", "tinylm-mega-spin64", "tinylm-mega-spin0",
                  "tinylm-mega-sample2", "tinylm-fused-topp", "tinylm-mega-topp", "tinylm-mega-new-topp")}
# Impls of paths that are not yet the defaults (config.py): they
# run when named with --impl (benchmarks/gpu_run.sh paged), and a run without --impl (`all`
# included) leaves them out, so its length stays what it was.
OPT_IN = {"decode": ("split-kv-waves", "paged-staged-16", "paged-staged-1", "paged-staged-256", "paged-hnd-16",
                     "paged-hnd-1", "paged-hnd-256", "paged-hnd-waves-16"),
          # the megakernel's plan knobs one at a time, all together and as the cost model chooses
          # (model_bench.MEGA_VARIANTS), and sampled twins of the fused step, today's plan and the
          # new one (model_bench.SAMPLED)
          "model": ("tinylm-mega-new", "tinylm-mega-auto", "tinylm-mega-ring", "tinylm-mega-fine",
                    "tinylm-mega-fine-fit", "tinylm-mega-gu16", "tinylm-mega-spin64", "tinylm-mega-spin0", "tinylm-mega-sample2",
                    "tinylm-fused-topp", "tinylm-mega-topp", "tinylm-mega-new-topp")}


def ours_names(op: str) -> tuple:
    """Our impls of ``op``: "ours" (the default) and every explicit gemm impl; every attention impl."""
    from cupyattn import ATTENTION_IMPLS
    from cupyattn.config import GEMM_IMPLS

    if op == "gemm":
        return ("ours",) + tuple(f"ours-{v}" for v in GEMM_IMPLS if v != "auto")
    if op == "attention":  # "varlen": attention_varlen over the same batch packed (equal lengths)
        return ATTENTION_IMPLS + ("varlen", "varlen-wgmma")
    if op in serving_cases.OURS:
        return serving_cases.OURS[op]
    return OURS[op]


def impl_names(op: str) -> tuple:
    return ours_names(op) + peers.PEERS[op]


def errors(out, ref) -> tuple[float, float]:
    """(max |out - ref|, ||out - ref|| / ||ref||); NaN anywhere gives NaN."""
    import cupy

    d = to_f64(out).reshape(ref.shape) - ref
    mx = float(cupy.abs(d).max())
    rel = float(cupy.linalg.norm(d) / max(float(cupy.linalg.norm(ref)), 1e-300))
    return mx, rel


# --- per-op inputs, reference, implementations ------------------------------------------------
def build_inputs(case) -> dict:
    import cupy

    if case.op in serving_cases.OURS:
        return serving_cases.build_inputs(case)
    p, dt = case.p, case.dtype
    if case.op == "gemm":
        M, N, K = p["M"], p["N"], p["K"]
        b_shape = (N, K) if p["layout"] == "nt" else (K, N)
        return {"a": rand((M, K), dt), "b": rand(b_shape, dt, K ** -0.5),
                "out": cupy.empty((M, N), dtype=np_dtype(dt))}
    if case.op == "softmax":
        x = rand((p["rows"], p["cols"]), dt, 3.0)
        return {"x": x, "out": cupy.empty_like(x)}
    if case.op == "attention":
        B, H, Hkv, Sq, Sk, D = (p[k] for k in ("B", "H", "Hkv", "Sq", "Sk", "D"))
        q = rand((B, H, Sq, D), dt)
        return {"q": q, "k": rand((B, Hkv, Sk, D), dt), "v": rand((B, Hkv, Sk, D), dt),
                "out": cupy.empty_like(q)}
    if case.op == "decode":
        from cupyattn.kvcache import KVCache

        B, H, Hkv, L, D = (p[k] for k in ("B", "H", "Hkv", "L", "D"))
        lens = decode_lengths(p)  # L each, or ragged
        cache = KVCache(1, B, Hkv, L, D, np_dtype(dt))
        kn, vn = rand((B, Hkv, L, D), dt), rand((B, Hkv, L, D), dt)
        cache.append(0, kn, vn, num_new=None if p.get("ragged") is None else lens)
        del kn, vn
        q = rand((B, H, 1, D), dt)
        return {"q": q, "cache": cache, "k": cache.k[0][:, :, :L], "v": cache.v[0][:, :, :L],
                "out": cupy.empty_like(q), "lens": lens if p.get("ragged") is not None else None}
    raise ValueError(case.op)


def reference(case, inp):
    import cupy

    if case.op in serving_cases.OURS:
        return serving_cases.reference(case, inp)
    if case.op == "gemm":
        b = to_f64(inp["b"])
        return cupy.matmul(to_f64(inp["a"]), b.T if case.p["layout"] == "nt" else b)
    if case.op == "softmax":
        x = to_f64(inp["x"])
        e = cupy.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    causal = case.op == "attention" and case.p["causal"]
    if case.op == "decode" and inp["lens"] is not None:  # ragged: each sequence over its own keys
        out = cupy.empty(inp["q"].shape, dtype=cupy.float64)
        for b, n in enumerate(inp["lens"]):
            out[b:b + 1] = ref_attention(inp["q"][b:b + 1], inp["k"][b:b + 1, :, :n], inp["v"][b:b + 1, :, :n], False)
        return out
    return ref_attention(inp["q"], inp["k"], inp["v"], causal)


def make_impl(case, name: str, inp):
    """Zero-arg callable running impl ``name`` on ``inp`` and returning its output."""
    p, op = case.p, case.op
    if op in serving_cases.OURS:
        return serving_cases.make_impl(case, name, inp)
    if op == "gemm":
        if name == "ours" or name.startswith("ours-"):
            from cupyattn import gemm

            f = gemm.gemm_nt if p["layout"] == "nt" else gemm.gemm_nn
            kw = {"impl": name[5:]} if name.startswith("ours-") else {}
            return lambda: f(inp["a"], inp["b"], out=inp["out"], **kw)
        if name == "torch-matmul":
            return peers.torch_matmul(inp["a"], inp["b"], p["layout"], inp["out"])
        return peers.cublas_gemm(inp["a"], inp["b"], p["layout"], inp["out"], tf32=name == "cublas-tf32")
    if op == "softmax":
        if name == "ours":
            from cupyattn import softmax

            return lambda: softmax(inp["x"], out=inp["out"])
        if name == "cupy-ops":
            return lambda: peers.cupy_softmax(inp["x"])
        return peers.torch_softmax(inp["x"])
    causal = op == "attention" and p["causal"]
    q, k, v, out = inp["q"], inp["k"], inp["v"], inp["out"]
    lens = inp.get("lens")  # a ragged decode case's lengths, else None
    if name.startswith("paged"):
        variant, size = name.rsplit("-", 1)
        return _paged_decode(inp, int(size), *PAGED_VARIANTS[variant])
    if name in ("varlen", "varlen-wgmma"):
        return _varlen_attention(q, k, v, causal, out, "wgmma_persistent" if name == "varlen-wgmma" else None)
    if name == "naive" or (op == "attention" and name in ours_names(op)):
        from cupyattn import attention

        kl = None if lens is None else cupy_lengths(lens)
        return lambda: attention(q, k, v, causal=causal, impl=name, out=out, key_lengths=kl)
    if name in ("split-kv", "unsplit"):
        from cupyattn.decode import decode_attention

        ns = case.p.get("splits") if name == "split-kv" else 1  # None: the automatic count
        return lambda: decode_attention(q, inp["cache"], 0, num_splits=ns, out=out)
    if name == "split-kv-waves":
        from cupyattn.decode import decode_attention

        ws = _waves_workspace(q)
        return lambda: decode_attention(q, inp["cache"], 0, out=out, workspace=ws, split_rule="waves")
    if name == "cupy-naive":
        return lambda: peers.cupy_naive_attention(q, k, v, causal)
    if name == "torch-sdpa":
        return peers.torch_sdpa(q, k, v, causal, key_lengths=lens)
    raise ValueError(f"unknown impl {name!r} for {op}")


def cupy_lengths(lens):
    import cupy

    return cupy.asarray(np.asarray(lens, dtype=np.int32))


def _waves_workspace(q):
    """Partials and zeroed counters for the "waves" rule (at most DECODE_WAVE_MAX_SPLITS splits),
    allocated here, outside the timed calls: each call is then one launch."""
    import cupy

    from cupyattn.config import DECODE_WAVE_MAX_SPLITS

    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    return (cupy.empty((DECODE_WAVE_MAX_SPLITS, b, h, d), dtype=cupy.float32),
            cupy.empty((DECODE_WAVE_MAX_SPLITS, b, h), dtype=cupy.float32), cupy.zeros((b, h), dtype=cupy.uint32))


def _paged_decode(inp, page_size, layout="NHD", staged=False, rule="cost"):
    """decode_attention_paged over the case's keys copied into ``layout`` pages of ``page_size``
    tokens at shuffled page ids (the copy is made here, outside the timed call), with the page
    ids staged or not (config.DECODE_PAGE_STAGING, set around each call) under split rule
    ``rule``. seq_lens are host ints (the split rule sees each sequence's length)."""
    import cupy

    from cupyattn import config, decode_attention_paged

    q, k, v = inp["q"], inp["k"], inp["v"]  # [B, H, 1, D], [B, Hkv, L, D]
    B, Hkv, L, D = k.shape
    if L % page_size:
        raise ValueError(f"L={L} is not a multiple of the page size {page_size}")
    n = B * (L // page_size)
    perm = cupy.asarray(np.random.default_rng(0).permutation(n).astype(np.int32))

    def pages(x):  # [B, Hkv, L, D] -> [n, page, Hkv, D] (HND: [n, Hkv, page, D]), sequence page i at perm[b * L/page + i]
        if layout == "HND":
            p = cupy.empty((n, Hkv, page_size, D), dtype=x.dtype)
            p[perm] = x.reshape(B, Hkv, L // page_size, page_size, D).transpose(0, 2, 1, 3, 4).reshape(
                n, Hkv, page_size, D)
            return p
        p = cupy.empty((n, page_size, Hkv, D), dtype=x.dtype)
        p[perm] = x.transpose(0, 2, 1, 3).reshape(n, page_size, Hkv, D)
        return p

    kp, vp = pages(k), pages(v)
    table = perm.reshape(B, L // page_size)
    host = inp["lens"] if inp.get("lens") is not None else [L] * B
    lens = cupy_lengths(host)  # on the device (no copy per call); host bounds for the split rule
    q3, out3 = q[:, :, 0], inp["out"][:, :, 0]
    ws = _waves_workspace(q) if rule == "waves" else None

    def call():
        before, config.DECODE_PAGE_STAGING = config.DECODE_PAGE_STAGING, staged
        try:
            return decode_attention_paged(q3, kp, vp, table, lens, out=out3, layout=layout, split_rule=rule,
                                          workspace=ws, max_seq_len=host)
        finally:
            config.DECODE_PAGE_STAGING = before
    return call


def _varlen_attention(q, k, v, causal, out, impl=None):
    """attention_varlen (``impl``) on the batch packed as [B*S, H, D] (copies made here, not
    timed); the result is handed back as a [B, H, S, D] view for the error check."""
    import cupy

    from cupyattn import attention_varlen

    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    qp, kp, vp = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(-1, x.shape[1], D) for x in (q, k, v))
    cq, ck = (cupy.arange(B + 1, dtype=cupy.int32) * s for s in (Sq, Sk))
    op = cupy.empty_like(qp)
    return lambda: attention_varlen(qp, kp, vp, cq, ck, Sq, Sk, causal=causal, out=op, impl=impl).reshape(
        B, Sq, H, D).transpose(0, 2, 1, 3)


# --- running ----------------------------------------------------------------------------------
def _is_oom(e: BaseException) -> bool:
    return "OutOfMemory" in type(e).__name__ or "out of memory" in str(e).lower()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _torch_if_loaded():
    import sys

    t = sys.modules.get("torch")
    return t if t is not None and t.cuda.is_initialized() else None


def free_memory():
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    t = _torch_if_loaded()
    if t is not None:
        t.cuda.empty_cache()


def measure_impl(case, name, kind, inp, ref, opts, ceilings, flusher, log) -> dict:
    """One record: correctness, peak memory and timing of impl ``name``."""
    import cupy

    rec = new_record(case, name, kind)
    stream = cupy.cuda.get_current_stream()
    try:
        fn = make_impl(case, name, inp)
        out = fn()  # first call: compile / plan, and the output we check
        stream.synchronize()
        if ref is not None:  # (padded serving impls: their real rows, taken out untimed)
            rec["max_abs_err"], rec["rel_err"] = errors(getattr(fn, "extract", lambda o: o)(out), ref)
            rec["err_ref"] = "float64 cupy"
        del out
        t = _torch_if_loaded()
        if t is not None:
            t.cuda.synchronize()
            t.cuda.reset_peak_memory_stats()
            t_base = t.cuda.memory_allocated()
        with timing.PeakPool() as pk:
            base = pk.peak
            fn()
            stream.synchronize()
        extra = pk.peak - base
        if t is not None:
            t.cuda.synchronize()
            extra += t.cuda.max_memory_allocated() - t_base
        rec["peak_mb"] = ((case_bytes(case) or 0) + extra) / 2**20
        tm = timing.time_fn(fn, warmup=opts.warmup, reps=opts.reps, budget_ms=opts.budget_ms,
                            flusher=flusher)
        fill_timing(rec, tm, case_flops(case), case_bytes(case), ceilings)
        if rec["rel_err"] is not None and math.isnan(rec["rel_err"]):
            rec["note"] = "output has NaN"
        elif rec["rel_err"] is not None and rec["rel_err"] > 0.05:
            rec["note"] = "large error vs float64 reference"
    except peers.PeerUnavailable as e:
        rec["status"] = f"skipped: {e}"
        log(f"{case.name} / {name}: skipped ({e})")
    except Exception as e:  # an impl failing must not end the run
        rec["status"] = "oom" if _is_oom(e) else f"error: {_one_line(e)}"
        log(f"{case.name} / {name}: {rec['status']}")
        if getattr(opts, "debug", False):
            log(traceback.format_exc())
    finally:
        free_memory()
    return rec


def run_case(case, impls, opts, ceilings, flusher, log) -> list[dict]:
    """Every requested impl on one case (inputs and reference built once)."""
    import cupy

    ours = set(impl_names(case.op)) - set(peers.PEERS[case.op])
    try:
        inp = build_inputs(case)
        ref = reference(case, inp) if opts.check else None
        cupy.cuda.get_current_stream().synchronize()
    except Exception as e:
        status = "oom" if _is_oom(e) else f"error building inputs: {_one_line(e)}"
        log(f"{case.name}: {status}")
        if getattr(opts, "debug", False):
            log(traceback.format_exc())
        free_memory()
        recs = [new_record(case, n, "ours" if n in ours else "peer") for n in impls]
        for r in recs:
            r["status"] = status
        return recs
    recs = [measure_impl(case, n, "ours" if n in ours else "peer", inp, ref, opts, ceilings,
                         flusher, log) for n in impls]
    del inp, ref
    free_memory()
    return recs
