"""What to measure, with no device: cases, FLOP and byte counts, predefined sweeps.

Everything here is pure Python so that the CPU test tier can check it. A :class:`Case` is one
problem shape of one op; the runners in ``cases.py`` turn it into device arrays and timings.

Counting rules (the "two numbers" of a case):
- FLOPs count one multiply-add as 2. Softmax counts no FLOPs: it is bound by memory.
- Bytes are the fewest a kernel must move through device memory: every input read once, every
  output written once. A kernel that re-reads K/V per query tile moves more; the ratio to this
  minimum is what "GB/s" and "% of ceiling" expose.
"""
from __future__ import annotations

import dataclasses

OPS = ("gemm", "softmax", "attention", "decode", "varlen", "paged", "model")
DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of one op. ``params`` keys depend on ``op``:

    gemm: M N K layout batch | softmax: rows cols | attention: B H Hkv Sq Sk D causal |
    decode: B H Hkv L D [ragged] [splits: split-kv's fixed count] | varlen: B H Hkv D causal lo hi
    seed (B sequences of lengths drawn from [lo, hi] by NumPy's default_rng(seed):
    :func:`varlen_lengths`) | paged: B H Hkv Sq L
    D causal page (chunked prefill: Sq new queries per sequence over its L cached keys, the new
    ones last, in pages of ``page`` tokens) | model: model prompt_len new_tokens batch [serve].
    A decode case with ``ragged`` (a seed) caches ``decode_lengths`` keys per sequence (128 to L,
    drawn from that seed) instead of L each; a model case with ``serve`` runs tinylm's continuous
    batching over ``batch`` slots (2 x batch prompts) beside HF's batched generate.
    ``sweep``/``group``/``x`` place the case on a sweep plot (line group and x-axis value).
    """

    op: str
    dtype: str
    params: tuple  # sorted (key, value) pairs, so a Case is hashable
    label: str = ""
    sweep: str = ""
    group: str = ""
    x: float | None = None

    @property
    def p(self) -> dict:
        return dict(self.params)

    @property
    def shape(self) -> str:
        return shape_str(self.op, self.p)

    @property
    def name(self) -> str:
        return self.label or f"{self.op} {self.shape} {self.dtype}"


def make_case(op: str, dtype: str, label: str = "", sweep: str = "", group: str = "",
              x: float | None = None, **params) -> Case:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if op != "model" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return Case(op, dtype, tuple(sorted(params.items())), label, sweep, group, x)


def shape_str(op: str, p: dict) -> str:
    """A short, stable text form of a case's shape (table column and record field)."""
    if op == "gemm":
        b = f"{p['batch']}x" if p.get("batch", 1) != 1 else ""
        return f"{b}M{p['M']} N{p['N']} K{p['K']} {p['layout']}"
    if op == "softmax":
        return f"{p['rows']}x{p['cols']}"
    if op == "attention":
        kv = f"/{p['Hkv']}" if p["Hkv"] != p["H"] else ""
        c = " causal" if p["causal"] else ""
        return f"B{p['B']} H{p['H']}{kv} Sq{p['Sq']} Sk{p['Sk']} D{p['D']}{c}"
    if op == "decode":
        ragged = f" ragged{p['ragged']}" if p.get("ragged") is not None else ""
        splits = f" splits{p['splits']}" if p.get("splits") is not None else ""
        return f"B{p['B']} H{p['H']}/{p['Hkv']} L{p['L']} D{p['D']}{ragged}{splits}"
    if op in ("varlen", "paged"):
        kv = f"/{p['Hkv']}" if p["Hkv"] != p["H"] else ""
        c = " causal" if p["causal"] else ""
        if op == "varlen":
            return f"B{p['B']} H{p['H']}{kv} len {p['lo']}..{p['hi']} seed {p['seed']} D{p['D']}{c}"
        return f"B{p['B']} H{p['H']}{kv} Sq{p['Sq']} L{p['L']} D{p['D']} page {p['page']}{c}"
    if op == "model":
        mode = f"serve S{p['batch']}" if p.get("serve") else f"B{p.get('batch', 1)}"
        return f"{p['model']} {mode} prompt{p['prompt_len']} new{p['new_tokens']}"
    raise ValueError(op)


# --- FLOP and byte formulas ---------------------------------------------------------------------
def gemm_flops(M: int, N: int, K: int, batch: int = 1) -> int:
    return 2 * M * N * K * batch


def gemm_bytes(M: int, N: int, K: int, itemsize: int, batch: int = 1) -> int:
    """A [M,K] and B [N,K] read once, C [M,N] written once, per batch element."""
    return (M * K + N * K + M * N) * itemsize * batch


def softmax_bytes(rows: int, cols: int, itemsize: int) -> int:
    return 2 * rows * cols * itemsize


def attention_flops(B: int, H: int, Sq: int, Sk: int, D: int, causal: bool = False) -> int:
    """S = Q K^T and O = P V: 2 * (2*Sq*Sk*D) per head; causal with Sq == Sk does half."""
    f = 4 * B * H * Sq * Sk * D
    return f // 2 if causal and Sq == Sk else f


def attention_bytes(B: int, H: int, Hkv: int, Sq: int, Sk: int, D: int, itemsize: int) -> int:
    """Q read and O written ([B,H,Sq,D] each), K and V read once ([B,Hkv,Sk,D] each)."""
    return (2 * B * H * Sq * D + 2 * B * Hkv * Sk * D) * itemsize


def varlen_lengths(B: int, lo: int, hi: int, seed: int) -> list[int]:
    """The B sequence lengths of a varlen case: uniform in [lo, hi], NumPy default_rng(seed)."""
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, B)]


def prefill_pairs(Sq: int, L: int, causal: bool) -> int:
    """(query, key) pairs Sq new queries see over L keys (the new ones last; causal bottom-right:
    query i sees L - Sq + i + 1 keys)."""
    return Sq * (L - Sq) + Sq * (Sq + 1) // 2 if causal else Sq * L


def decode_lengths(p: dict) -> list[int]:
    """Cached keys per sequence of a decode case: L each, or with ``ragged`` (a seed) B lengths
    drawn uniformly from [min(128, L), L] by NumPy's default_rng(seed), the longest set to L (so
    the case's L is its longest sequence)."""
    B, L = p["B"], p["L"]
    if p.get("ragged") is None:  # (seed 0 is a seed)
        return [L] * B
    import numpy as np

    lens = np.random.default_rng(p["ragged"]).integers(min(128, L), L + 1, B)
    lens[int(np.argmax(lens))] = L
    return [int(n) for n in lens]


def decode_flops(B: int, H: int, L: int, D: int) -> int:
    """One query token per sequence over L cached keys: attention_flops with Sq=1."""
    return attention_flops(B, H, 1, L, D)


def decode_bytes(B: int, H: int, Hkv: int, L: int, D: int, itemsize: int) -> int:
    """The live part of the K/V cache read once, plus q read and out written."""
    return attention_bytes(B, H, Hkv, 1, L, D, itemsize)


def case_flops(case: Case) -> int | None:
    p = case.p
    if case.op == "gemm":
        return gemm_flops(p["M"], p["N"], p["K"], p.get("batch", 1))
    if case.op == "attention":
        return attention_flops(p["B"], p["H"], p["Sq"], p["Sk"], p["D"], p["causal"])
    if case.op == "decode":  # (ragged: the cached keys of every sequence, each once)
        return sum(decode_flops(1, p["H"], n, p["D"]) for n in decode_lengths(p))
    if case.op == "varlen":
        return sum(attention_flops(1, p["H"], n, n, p["D"], p["causal"])
                   for n in varlen_lengths(p["B"], p["lo"], p["hi"], p["seed"]))
    if case.op == "paged":
        return 4 * p["B"] * p["H"] * p["D"] * prefill_pairs(p["Sq"], p["L"], p["causal"])
    return None  # softmax: memory bound; model: reported as tokens/s


def case_bytes(case: Case) -> int | None:
    p, it = case.p, ITEMSIZE.get(case.dtype, 0)
    if case.op == "gemm":
        return gemm_bytes(p["M"], p["N"], p["K"], it, p.get("batch", 1))
    if case.op == "softmax":
        return softmax_bytes(p["rows"], p["cols"], it)
    if case.op == "attention":
        return attention_bytes(p["B"], p["H"], p["Hkv"], p["Sq"], p["Sk"], p["D"], it)
    if case.op == "decode":
        return sum(decode_bytes(1, p["H"], p["Hkv"], n, p["D"], it) for n in decode_lengths(p))
    if case.op == "varlen":
        return sum(attention_bytes(1, p["H"], p["Hkv"], n, n, p["D"], it)
                   for n in varlen_lengths(p["B"], p["lo"], p["hi"], p["seed"]))
    if case.op == "paged":
        return attention_bytes(p["B"], p["H"], p["Hkv"], p["Sq"], p["L"], p["D"], it)
    return None


def rates(flops: int | None, nbytes: int | None, ms: float) -> tuple[float | None, float | None]:
    """(TFLOP/s, GB/s) for a time in milliseconds; None where the count is None."""
    if not ms or ms <= 0:
        return None, None
    tf = flops / (ms * 1e-3) / 1e12 if flops is not None else None
    gb = nbytes / (ms * 1e-3) / 1e9 if nbytes is not None else None
    return tf, gb


def roofline_pct(tflops: float | None, gbps: float | None, ceilings: dict) -> tuple[float | None, str]:
    """Percent of the nearer measured ceiling, and which one ('compute' or 'memory').

    The larger of the two fractions tells what bounds the case (METHOD: the larger floor wins).
    """
    best, bound = None, ""
    for value, key, name in ((tflops, "gemm_tflops", "compute"), (gbps, "copy_gbps", "memory")):
        ceil = ceilings.get(key)
        if value is None or not ceil:
            continue
        pct = 100.0 * value / ceil
        if best is None or pct > best:
            best, bound = pct, name
    return best, bound


# --- predefined sweeps -------------------------------------------------------------------------
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
PREFILL_LENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # the causal prefill sweep (short prompts: TTFT)
DECODE_LENS = tuple(1024 * 2**i for i in range(8))  # 1k .. 128k
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Llama-2-7B (dim 4096, FFN 11008) projections, weights in nn.Linear orientation [N, K]:
LLAMA2_7B_PROJ = (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                  ("down", 4096, 11008))
# SmolLM2-135M (hidden 576, FFN 1536, 9 query and 3 KV heads of 64; tinylm packs q|k|v and gate|up):
SMOLLM2_PROJ = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
GEMM_TOKENS = (1, 16, 128, 512, 2048, 4096)


def _attention_sweep(dtype: str) -> list[Case]:
    # FlashAttention-2's benchmark shape: 16k tokens per batch, hidden size 2048.
    out = []
    for D in (64, 128):
        for causal in (False, True):
            for S in SEQ_LENS:
                B, H = max(1, 16384 // S), 2048 // D
                out.append(make_case("attention", dtype, sweep="attention-seqlen",
                                     group=f"D{D}{' causal' if causal else ''}", x=S,
                                     B=B, H=H, Hkv=H, Sq=S, Sk=S, D=D, causal=causal))
    return out


def _attention_causal_sweep(dtype: str) -> list[Case]:
    # Causal prefill from short prompts to long ones: 16k tokens per batch, 32 heads of
    # 128 (hidden 4096, a Llama-2-7B layer), the persistent wgmma kernel beside v3, flash_mma and
    # torch SDPA
    return [make_case("attention", dtype, sweep="attention-causal", group="D128 causal", x=S,
                      B=max(1, 16384 // S), H=32, Hkv=32, Sq=S, Sk=S, D=128, causal=True)
            for S in PREFILL_LENS]


def _paged_page_sweep(dtype: str) -> list[Case]:
    # Chunked prefill over pages of 16 .. 256 tokens: 1024 new tokens over 4096 cached, Llama-3-8B
    # heads (32 on 8 K/V heads, D 128)
    return [make_case("paged", dtype, sweep="paged-page", group="B4 Sq1024 L4096", x=page,
                      B=4, H=32, Hkv=8, Sq=1024, L=4096, D=128, causal=True, page=page)
            for page in (16, 32, 64, 128, 256)]


def _proj_sweep(sweep: str, projections, dtype: str) -> list[Case]:
    return [make_case("gemm", dtype, sweep=sweep, group=name, x=M,
                      label=f"gemm {name} M{M} N{N} K{K} {dtype}",
                      M=M, N=N, K=K, layout="nt", batch=1)
            for name, N, K in projections for M in GEMM_TOKENS]


def _gemm_sweep(dtype: str) -> list[Case]:
    return _proj_sweep("gemm-llama2-7b", LLAMA2_7B_PROJ, dtype)


def _gemm_smollm2_sweep(dtype: str) -> list[Case]:
    return _proj_sweep("gemm-smollm2", SMOLLM2_PROJ, dtype)


def _decode_len_sweep(dtype: str) -> list[Case]:
    # Llama-3-8B-like heads: 32 query heads sharing 8 KV heads, head_dim 128.
    return [make_case("decode", dtype, sweep="decode-len", group=f"B{B}", x=L,
                      B=B, H=32, Hkv=8, L=L, D=128)
            for B in (1, 8) for L in DECODE_LENS]


def _decode_batch_sweep(dtype: str) -> list[Case]:
    return [make_case("decode", dtype, sweep="decode-batch", group="L4096", x=B,
                      B=B, H=32, Hkv=8, L=4096, D=128) for B in DECODE_BATCHES]


def _softmax_sweep(dtype: str) -> list[Case]:
    return [make_case("softmax", dtype, sweep="softmax-cols", group="rows 8192", x=c,
                      rows=8192, cols=c) for c in (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)]


SWEEPS = {  # name -> (op, builder, x-axis label)
    "attention-seqlen": ("attention", _attention_sweep, "sequence length"),
    "attention-causal": ("attention", _attention_causal_sweep, "sequence length"),
    "paged-page": ("paged", _paged_page_sweep, "page size (tokens)"),
    "gemm-llama2-7b": ("gemm", _gemm_sweep, "tokens (M)"),
    "gemm-smollm2": ("gemm", _gemm_smollm2_sweep, "tokens (M)"),
    "decode-len": ("decode", _decode_len_sweep, "cached length"),
    "decode-batch": ("decode", _decode_batch_sweep, "batch"),
    "softmax-cols": ("softmax", _softmax_sweep, "columns"),
}


def sweep_cases(name: str, dtype: str = "float16") -> list[Case]:
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; choose from {', '.join(SWEEPS)}")
    return SWEEPS[name][1](dtype)


def sweeps_for(op: str) -> list[str]:
    return [n for n, (o, _, _) in SWEEPS.items() if o == op]


# --- default cases (what `all` runs, and a subcommand without shape args) -------------------------
def default_cases(op: str, preset: str = "llama2-7b-4layers") -> list[Case]:
    if op == "gemm":
        # 4096^3 and 8192^3 against cuBLAS (compute-bound; every impl, wgmma included, beside it);
        # decode-sized M = 1, 8, 16 rows times a 4096 x 4096 weight (memory-bound: the skinny
        # kernel, read W once) against cupy.matmul
        return ([make_case("gemm", dt, M=s, N=s, K=s, layout=lay, batch=1)
                 for s in (4096, 8192) for dt in ("float16", "bfloat16") for lay in ("nt", "nn")]
                + [make_case("gemm", "float32", M=2048, N=2048, K=2048, layout="nt", batch=1)]
                + [make_case("gemm", "float16", label=f"gemm skinny M{m} N4096 K4096 float16",
                             M=m, N=4096, K=4096, layout="nt", batch=1) for m in (1, 8, 16)])
    if op == "softmax":
        # 8192 x 4096 in every dtype; the goal shape, float32 8192 x 8192 (% of copy bandwidth)
        return ([make_case("softmax", dt, rows=8192, cols=4096) for dt in DTYPES]
                + [make_case("softmax", "float32", rows=8192, cols=8192)])
    if op == "attention":
        # The goal shapes (B=4, H=32, S=4096, fp16, D=128 and 64, causal and not; peers:
        # torch SDPA, naive CuPy, our naive path), then bf16 and GQA (8 KV heads), then D=256
        # (the Hopper kernel's third head dim). Then a head dim no kernel has, run zero-padded to 64:
        # Stable Diffusion 1.5's widest self-attention (64 x 64 latents: 4096 tokens, 8 heads of 40).
        return ([make_case("attention", dt, B=4, H=32, Hkv=Hkv, Sq=4096, Sk=4096, D=D, causal=c)
                 for dt, Hkv, D, c in (("float16", 32, 128, False), ("float16", 32, 128, True),
                                       ("float16", 32, 64, False), ("float16", 32, 64, True),
                                       ("bfloat16", 32, 128, True), ("float16", 8, 128, True),
                                       ("float16", 32, 256, False), ("float16", 32, 256, True))]
                + [make_case("attention", "float16", B=2, H=8, Hkv=8, Sq=4096, Sk=4096, D=40, causal=False)])
    if op == "decode":
        # the bandwidth goals (fp16, 32 query heads on 8 kv heads, D=128): B=8 at 32k and B=1 at
        # 128k, reported as GB/s and % of the measured copy ceiling; a short batch; MQA at B=1;
        # a continuous-batching step: 64 sequences of 128 to 32k keys
        return ([make_case("decode", "float16", B=B, H=32, Hkv=8, L=L, D=128)
                 for B, L in ((8, 32768), (1, 131072), (16, 4096))]
                + [make_case("decode", "float16", B=1, H=32, Hkv=1, L=131072, D=128),
                   ragged_decode_case()])
    if op == "varlen":
        # ragged batches: 16 sequences of 64 .. 4096 tokens (seed 0), 32 heads of 128,
        # causal and not; D=64 causal
        return [make_case("varlen", "float16", B=16, H=32, Hkv=32, D=D, causal=c, lo=64, hi=4096, seed=0)
                for D, c in ((128, True), (128, False), (64, True))]
    if op == "paged":
        # chunked prefill: 1024 new tokens over 4096 cached, pages of 16, 64, 256
        return [make_case("paged", "float16", B=4, H=32, Hkv=8, Sq=1024, L=4096, D=128, causal=True, page=pg)
                for pg in (16, 64, 256)]
    if op == "model":
        # SmolLM2-135M from its GGUF file at batch 1 and 8, and a synthetic preset (random weights).
        return [model_case(m, 128, 128, b) for m, b in (("smollm2", 1), ("smollm2", 8), (preset, 1))]
    raise ValueError(op)


def ragged_decode_case(dtype: str = "float16", B: int = 64, L: int = 32768, seed: int = 39, **heads) -> Case:
    """A continuous-batching decode step: B sequences of 128 to L keys (decode_lengths), Llama-3-8B
    heads (32 query on 8 kv, D=128) unless given."""
    kw = {"H": 32, "Hkv": 8, "D": 128, **heads}
    return make_case("decode", dtype, B=B, L=L, ragged=seed, **kw)


def model_case(model: str, prompt_len: int, new_tokens: int, batch: int = 1, serve: bool = False) -> Case:
    """tinylm end to end: ``batch`` prompts of ``prompt_len`` tokens, ``new_tokens`` each; with
    ``serve``, continuous batching over ``batch`` slots (benchmarks/serve_bench.py)."""
    if serve:
        return make_case("model", "auto", label=f"model {model} serve S{batch}", model=model, prompt_len=prompt_len,
                         new_tokens=new_tokens, batch=batch, serve=True)
    return make_case("model", "auto", label=f"model {model} B{batch}", model=model, prompt_len=prompt_len,
                     new_tokens=new_tokens, batch=batch)


# The CLI's shape flags per op (argparse dest names)
SHAPE_FLAGS = {"gemm": ("M", "N", "K", "layout"), "softmax": ("rows", "cols"),
               "attention": ("B", "H", "Hkv", "Sq", "Sk", "D", "causal"),
               "decode": ("B", "H", "Hkv", "Sk", "D", "ragged", "splits"),
               "varlen": ("B", "H", "Hkv", "D", "causal", "lo", "hi", "seed_lens"),
               "paged": ("B", "H", "Hkv", "Sq", "Sk", "D", "causal", "page")}


def cli_case(op: str, a) -> Case | None:
    """The one case described by shape flags on the command line, or None if none were given.
    A flag not given (None) takes the default below; a given value is used as it is (the CLI's
    types have range-checked it, cli_args)."""
    if not any(getattr(a, k, None) is not None and getattr(a, k) is not False for k in SHAPE_FLAGS.get(op, ())):
        return None

    def get(key, default):
        v = getattr(a, key, None)
        return default if v is None else v

    dt = get("dtype", "float16")
    if op == "gemm":
        M = get("M", 4096)
        return make_case("gemm", dt, M=M, N=get("N", M), K=get("K", M), layout=get("layout", "nt"), batch=1)
    if op == "softmax":
        return make_case("softmax", dt, rows=get("rows", 8192), cols=get("cols", 4096))
    H = get("H", 16)
    Hkv, D = get("Hkv", H), get("D", 128)
    if op == "attention":
        Sq = get("Sq", get("Sk", 4096))
        return make_case("attention", dt, B=get("B", 4), H=H, Hkv=Hkv, Sq=Sq, Sk=get("Sk", Sq), D=D,
                         causal=bool(a.causal))
    if op == "varlen":  # lengths in [lo, hi]: a default bound moves to meet a given one
        lo = get("lo", min(64, get("hi", 64)))
        return make_case("varlen", dt, B=get("B", 16), H=H, Hkv=Hkv, D=D, causal=bool(a.causal),
                         lo=lo, hi=get("hi", max(4096, lo)), seed=get("seed_lens", 0))
    if op == "paged":  # Sq new tokens among Sk cached: a default moves to fit a given one
        sq = get("Sq", min(1024, get("Sk", 1024)))
        return make_case("paged", dt, B=get("B", 4), H=H, Hkv=Hkv, Sq=sq, L=get("Sk", max(4096, sq)), D=D,
                         causal=bool(a.causal), page=get("page", 64))
    extra = {k: getattr(a, k) for k in ("ragged", "splits") if getattr(a, k, None) is not None}
    return make_case("decode", dt, B=get("B", 1), H=H, Hkv=Hkv, L=get("Sk", 8192), D=D, **extra)
