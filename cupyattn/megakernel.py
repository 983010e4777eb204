"""One persistent kernel per decode step of a Llama-style model (kernels_cu/megakernel.cu).

Correct on an H100 (2026-11-27), slower than the fused step there: tinylm takes it only when
asked (``tinylm.config.TINYLM_MEGAKERNEL`` / ``TINYLM_MEGAKERNEL=1``, ``tinylm.load(..., megakernel=True)``,
``python -m tinylm --megakernel``).

The kernel interprets per-block queues of instructions planned on the host
(:mod:`cupyattn.persistent`): its opcodes (:data:`OPCODES`) are the fused ops of a Llama layer,
its tile geometry is :data:`GEOMETRY` (one table: the kernel gets each entry as a -D option and
checks the relations it relies on), and the op list, the data, says how many tiles of each and
who waits for whom (:mod:`cupyattn.megakernel_llama` builds a model's), so another model of the
same family needs a new op list, not new CUDA.

:class:`LlamaStep` binds the kernel to one model's tensors and one decode state's buffers: it
packs their addresses into the kernel's descriptor (``MkModel``, passed by value), owns the
dependency counters, the step state (epoch, ticket) and the scratch only the kernel reads
(the second residual buffer and the partial slots of split projections, the sampler's
per-chunk candidates), uploads plans and launches steps. A step reads ``tokens``, writes
``logits`` (and, with a sampling op, the sampled ids back into ``tokens``), appends to the KV
cache and advances every layer's lengths by one, all on the device: a launch needs no host
input, so it can be captured in a CUDA graph and replayed.

Example
-------
>>> step = LlamaStep(tok_embd=..., output_norm=..., output=..., layers=[...], cache=cache,
...                  num_heads=9, eps=1e-5, rope_base=1e5, rope_style="adjacent", tokens=tokens,
...                  x=x, q=q, att=att, ffn=ffn, logits=logits, o_part=o_part, lse_part=lse_part,
...                  counter_capacity=512)
>>> plan = step.plan(ops)          # ops: a list of persistent.Op using OPCODES
>>> step.launch(plan, splits=1)    # one decode step
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cupy
import numpy as np

from . import _checks as C
from . import config, persistent
from ._loader import KernelSpec, ctype, defines, get_function
from .config import DTYPES, SAMPLING_MASS_BITS
from .kvcache import ROPE_STYLES, KVCache

# The instruction set (kernels_cu/megakernel.cu's table); the kernel gets these as -D options.
OPCODES = {"embed": 1, "qkv": 2, "attn": 3, "reduce": 4, "oproj": 5, "gate_up": 6, "down": 7, "lm_head": 8,
           "sample": 9, "sample_part": 10}

# The tile geometry, one table: each entry reaches the kernel as a -D option (megakernel_gemv.cuh,
# megakernel_attention.cuh and megakernel_sample.cuh static_assert the relations between them), and
# the op lists (megakernel_llama) and the plan checks below count tiles from it.
GEOMETRY = {
    "MK_TILE_ROWS": (16, "weight rows per GEMV tile: 8 warps x 2 rows (a row pair per warp)"),
    "MK_GATE_UP_ROWS": (8, "gate rows of a gate|up tile and as many up rows: SwiGLU's pairs in one tile"),
    "MK_CHUNK_BYTES": (512, "bytes of one weight row per ring chunk: 32 lanes x a 16-byte vector"),
    "MK_ATTN_MAX_KEYS": (64, "keys of one staged K/V chunk (ring attention) at most: 4 heads x 64 keys = "
                             "one score per thread"),
    "MK_SAMPLE_CHUNK": (2048, "logits per vocabulary chunk of the two-level sampler (a multiple of the "
                              "GEMV tile): 24 chunks of SmolLM2's 49152"),
    "MK_SAMPLE_CAND": (64, "top-k (or top-p) candidates one chunk keeps at most (top_k above it: one block draws)"),
    "MK_SAMPLE_HEAD": (5, "words of a chunk's answer before its candidates' ids (megakernel_sample.cuh)"),
    "MK_SAMPLE_MAX_CANDS": (2048, "candidates the merge gathers at most (16 KB of shared memory)"),
    "MK_SAMPLE_MAX_PARTS": (256, "vocabulary chunks of one sequence at most (the merge's offsets): 512k ids"),
    "MK_MAX_DOWN_CHUNKS": (16, "column chunks of a split down projection at most (its partial slots)"),
    "MK_LOAD_BATCH": (8, "float4 loads in flight per item of the block-wide row loads (partial slots, split "
                         "partials): one L2 round trip per batch"),
}
TILE_ROWS = GEOMETRY["MK_TILE_ROWS"][0]
STAGE_BYTES = TILE_ROWS * GEOMETRY["MK_CHUNK_BYTES"][0]  # one weight-ring chunk: 16 rows x 512 bytes
LAYER_FIELDS = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")  # MkLayer's weights, in order


def down_chunk_counts(ffn_dim: int, itemsize: int, gate_up_rows: int | None = None) -> tuple:
    """The column-chunk counts a split down projection may have, fewest first: whole gate|up tiles
    (of ``gate_up_rows`` ffn rows, None: MK_GATE_UP_ROWS) and whole ring chunks each (columns a
    multiple of 8 and of 512 bytes' worth), at most MK_MAX_DOWN_CHUNKS of them; (1,) when ffn_dim
    has no such divisor."""
    unit = math.lcm(gate_up_rows or GEOMETRY["MK_GATE_UP_ROWS"][0], GEOMETRY["MK_CHUNK_BYTES"][0] // itemsize)
    counts = tuple(ffn_dim // cols for cols in range(ffn_dim, unit - 1, -unit)
                   if ffn_dim % cols == 0 and cols % unit == 0 and ffn_dim // cols <= GEOMETRY["MK_MAX_DOWN_CHUNKS"][0])
    return counts or (1,)


def down_chunks(ffn_dim: int, itemsize: int) -> int:
    """The most column chunks a split down projection may have (the narrowest chunks): the partial
    slots a step allocates."""
    return down_chunk_counts(ffn_dim, itemsize)[-1]


def sample_parts_of(vocab: int) -> int:
    """Vocabulary chunks of the two-level sampler: whole LM-head tiles of about MK_SAMPLE_CHUNK
    logits each (the op list rounds the chunk up to whole tiles)."""
    tiles = -(-vocab // TILE_ROWS)
    per = -(-tiles // -(-vocab // GEOMETRY["MK_SAMPLE_CHUNK"][0]))
    return -(-tiles // per)


def max_tiles(kind: str, s: dict, args=(0, 0)) -> int:
    """The tiles an op of ``kind`` can have for a model of shape ``s`` (LlamaStep.shape) with
    instruction ``args`` (attention: per key split, times the splits at launch)."""
    rows = lambda n: -(-n // TILE_ROWS)  # noqa: E731
    a0 = max(1, int(args[0]) if args else 1)
    return {"embed": 1, "qkv": (s["Hq"] + 2 * s["Hkv"]) * s["D"] // TILE_ROWS,
            "attn": s["B"] * s["Hkv"] * max(1, s["Hq"] // s["Hkv"]), "reduce": s["B"] * s["Hkv"],
            "oproj": rows(s["dim"]) * a0,
            "gate_up": -(-s["F"] // (GEOMETRY["MK_GATE_UP_ROWS"][0] * max(1, a0 >> 4))),  # arg0 >> 4: sub-tiles
            "down": rows(s["dim"]) * a0, "lm_head": rows(s["V"]), "sample": s["B"],
            "sample_part": s["B"] * s.get("parts", sample_parts_of(s["V"]))}[kind]


_OPTIONS = defines(MK_THREADS=config.MEGAKERNEL_THREADS, MK_STAGES=config.MEGAKERNEL_STAGES,
                   MK_MAX_BATCH=config.MEGAKERNEL_MAX_BATCH, MK_MAX_HEAD_DIM=config.MEGAKERNEL_MAX_HEAD_DIM,
                   MK_HEAD_TILE=config.MEGAKERNEL_HEAD_TILE, MK_INSTR_WORDS=persistent.INSTR_WORDS,
                   SAMPLING_MASS_BITS=SAMPLING_MASS_BITS,
                   **{k: v for k, (v, _) in GEOMETRY.items()},
                   **{f"MK_OP_{k.upper()}": v for k, v in OPCODES.items()})
_EXPRS = tuple(f"megakernel<{ctype(t)}>" for t in DTYPES)
SPEC = KernelSpec("megakernel", "megakernel.cu", _EXPRS, options=_OPTIONS,
                  needs=tuple((e, config.impl_min_cc("megakernel", "persistent", t), 0)
                              for e, t in zip(_EXPRS, DTYPES)))

# MkModel (megakernel.cu), what a step only reads: 8 pointers, 14 integers, 3 doubles, 8 bytes each.
# What it writes (MkState) goes as the kernel's pointer arguments instead (LlamaStep.launch).
_POINTERS = ("layers", "tok_embd", "out_norm", "out_w", "fparams", "iparams", "timings", "rope_div")
_INTS = ("B", "dim", "Hq", "Hkv", "D", "F", "V", "L", "max_seq", "splits", "neox", "spin_ns", "attn_keys",
         "parts")
_DOUBLES = ("eps", "freq_scale", "scale_log2")
MODEL_DTYPE = np.dtype([("w", np.uint64, (len(_POINTERS) + len(_INTS) + len(_DOUBLES),))])


@dataclass
class DevicePlan:
    """A :class:`persistent.Plan` on the device (its arrays uploaded once; replays reuse them)."""

    plan: persistent.Plan
    instr: object
    queue: object
    waits: object
    attn_tiles: int = 0  # tiles per head split of its largest attention op: at most B * Hkv * splits at launch


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


class LlamaStep:
    """The megakernel bound to a Llama-style model's tensors and one decode state's buffers.

    Parameters (all CuPy arrays of the cache's dtype unless said otherwise, C-contiguous, 16-byte
    aligned; B = cache.batch <= config.MEGAKERNEL_MAX_BATCH)
    ----------
    tok_embd : [V, dim]
    output_norm : [dim]
    output : [V, dim] (tok_embd itself when the embeddings are tied)
    layers : one object per layer with attributes ``attn_norm`` [dim], ``wqkv``
        [(Hq + 2 Hkv) D, dim], ``wo`` [dim, Hq D], ``ffn_norm`` [dim], ``w_gate_up`` [2F, dim],
        ``w_down`` [dim, F] (tinylm.model.LayerParams)
    cache : KVCache with cache.num_layers == len(layers); head_dim D a multiple of 16, at most
        config.MEGAKERNEL_MAX_HEAD_DIM
    num_heads : int, Hq (a multiple of cache.num_kv_heads)
    eps, rope_base, rope_style : RMSNorm epsilon, RoPE base and pair style ("adjacent" / "neox")
    scale : the softmax scale (None: 1 / sqrt(D))
    rope_divisors : float32 [L, D/2], or None: per layer, each rotation pair's frequency is
        divided by its entry (Llama 3's rope_freqs, LongRoPE's tables, float32's largest value for
        a layer without RoPE), as the fused decode step's ``freq_div``
    tokens : int32 [B] or [B, 1]: the step's input ids (the sampling op writes the next ones here)
    x : [B, dim] (or [B, 1, dim]); q : [B, Hq, D] (or [B, Hq, 1, D]); att : [B, Hq D] (any shape of
        that size); ffn : [B, F]; logits : [B, V]: the step's buffers
    o_part, lse_part : float32 [S, B, Hq, D] and [S, B, Hq], S >= the largest split count used
        (at most config.MEGAKERNEL_MAX_SPLITS)
    sampling : cupyattn.SamplingParams for B sequences, or None (plans without a sampling op)
    counter_capacity : counters per set: at least the n_counters of any plan this step will run
    blocks : int, or None: config.MEGAKERNEL_BLOCKS, else the device's SM count (a persistent
        launch needs every block resident at once: never more than the SMs)
    spin_ns : a waiting block's longest sleep between polls in ns (0: none); None:
        config.MEGAKERNEL_SPIN_NS
    sample_parts : vocabulary chunks per sequence the two-level sampler's buffers hold (None:
        :func:`sample_parts_of` V, what the op lists use)
    """

    def __init__(self, *, tok_embd, output_norm, output, layers, cache, num_heads, eps, rope_base, rope_style,
                 tokens, x, q, att, ffn, logits, o_part, lse_part, sampling=None, counter_capacity=1,
                 blocks=None, spin_ns=None, sample_parts=None, rope_divisors=None, scale=None):
        fn = "LlamaStep"
        if not isinstance(cache, KVCache) or hasattr(cache, "block_table"):
            raise TypeError(f"{fn}(): cache must be a cupyattn.KVCache (contiguous), got {type(cache).__name__}")
        dt = np.dtype(cache.dtype)
        self.dtype = dt
        C.require_impl(fn, "megakernel", "persistent", dt)
        B, Hkv, D, L = cache.batch, cache.num_kv_heads, cache.head_dim, cache.num_layers
        Hq = C.check_positive_int(fn, "num_heads", num_heads)
        if Hq % Hkv:
            raise ValueError(f"{fn}(): num_heads={Hq} is not a multiple of the cache's num_kv_heads={Hkv}")
        if B > config.MEGAKERNEL_MAX_BATCH:
            raise ValueError(f"{fn}(): the cache's batch {B} exceeds config.MEGAKERNEL_MAX_BATCH="
                             f"{config.MEGAKERNEL_MAX_BATCH}")
        if D % 16 or D > config.MEGAKERNEL_MAX_HEAD_DIM:
            raise ValueError(f"{fn}(): the cache's head_dim {D} must be a multiple of 16 and at most "
                             f"{config.MEGAKERNEL_MAX_HEAD_DIM}")
        C.check_array(fn, "tok_embd", tok_embd, ndim=2)
        V, dim = (int(n) for n in tok_embd.shape)
        if len(layers) != L:
            raise ValueError(f"{fn}(): {len(layers)} layers but the cache has {L}")
        w0 = getattr(layers[0], "w_gate_up", None) if layers else None
        F = int(w0.shape[0]) // 2 if w0 is not None else 0
        want = {"tok_embd": (V, dim), "output_norm": (dim,), "output": (V, dim)}
        arrays = {"tok_embd": tok_embd, "output_norm": output_norm, "output": output}
        lshape = {"attn_norm": (dim,), "wqkv": ((Hq + 2 * Hkv) * D, dim), "wo": (dim, Hq * D), "ffn_norm": (dim,),
                  "w_gate_up": (2 * F, dim), "w_down": (dim, F)}
        for i, lp in enumerate(layers):
            for f in LAYER_FIELDS:
                arrays[f"layers[{i}].{f}"], want[f"layers[{i}].{f}"] = getattr(lp, f, None), lshape[f]
        for name, a in arrays.items():
            self._check_tensor(fn, name, a, want[name], dt)
        if rope_divisors is not None:  # read, like the weights: checked for overlap with what is written
            C.check_array(fn, "rope_divisors", rope_divisors, dtypes=(np.dtype(np.float32),), ndim=2)
            if tuple(rope_divisors.shape) != (L, D // 2) or not rope_divisors.flags.c_contiguous:
                raise ValueError(f"{fn}(): rope_divisors must be C-contiguous float32 [{L}, {D // 2}] (layers x "
                                 f"head_dim / 2), got {tuple(rope_divisors.shape)}")
            if not bool(((rope_divisors > 0) & (rope_divisors < np.inf)).all()):  # once, at construction
                raise ValueError(f"{fn}(): rope_divisors must be positive finite numbers")
            arrays["rope_divisors"] = rope_divisors
        vec = 16 // dt.itemsize
        for what, n in (("dim", dim), ("num_heads * head_dim", Hq * D), ("ffn_dim", F)):
            if n < 1 or n % vec:
                raise ValueError(f"{fn}(): {what}={n} must be a positive multiple of {vec} (16-byte rows of "
                                 f"{dt})")
        bufs = {"x": (x, B * dim), "q": (q, B * Hq * D), "att": (att, B * Hq * D), "ffn": (ffn, B * F),
                "logits": (logits, B * V)}
        for name, (a, size) in bufs.items():
            self._check_buffer(fn, name, a, size, dt)
        self._check_buffer(fn, "tokens", tokens, B, np.dtype(np.int32))
        for name, a, nd in (("o_part", o_part, 4), ("lse_part", lse_part, 3)):
            C.check_array(fn, name, a, dtypes=(np.dtype(np.float32),), ndim=nd)
            if tuple(a.shape[1:3]) != (B, Hq) or (nd == 4 and a.shape[3] != D) or not a.flags.c_contiguous:
                raise ValueError(f"{fn}(): {name} must be C-contiguous float32 [splits, {B}, {Hq}"
                                 f"{', ' + str(D) if nd == 4 else ''}], got {tuple(a.shape)}")
        if o_part.shape[0] != lse_part.shape[0]:
            raise ValueError(f"{fn}(): o_part and lse_part hold {o_part.shape[0]} and {lse_part.shape[0]} splits")
        if not 1 <= o_part.shape[0] <= config.MEGAKERNEL_MAX_SPLITS:  # the merge's scratch holds B x that many
            raise ValueError(f"{fn}(): o_part and lse_part hold {o_part.shape[0]} splits, expected 1 to "
                             f"config.MEGAKERNEL_MAX_SPLITS ({config.MEGAKERNEL_MAX_SPLITS})")
        if sampling is not None:
            from .sampling import SamplingParams

            if not isinstance(sampling, SamplingParams) or sampling.batch != B:
                raise TypeError(f"{fn}(): sampling must be a cupyattn.SamplingParams for {B} sequences")
        # The step writes these buffers, the cache (keys, values, lengths) and the sampler's RNG
        # steps while it reads the weights: no written buffer may share memory with anything else
        # the step reads or writes.
        written = dict(tokens=tokens, x=x, q=q, att=att, ffn=ffn, logits=logits, o_part=o_part, lse_part=lse_part)
        touched = {**cache.device_arrays(), **arrays}
        if sampling is not None:
            touched |= {"sampling.fparams": sampling.fparams, "sampling.iparams": sampling.iparams}
        names = list(written)
        for i, name in enumerate(names):
            C.check_no_overlap(fn, written[name], {k: written[k] for k in names[i + 1:]} | touched, out_name=name)
        C.check_choice(fn, "rope_style", rope_style, ROPE_STYLES)
        eps = C.check_real(fn, "eps", eps, minimum=0.0)
        base = C.check_real(fn, "rope_base", rope_base, minimum=0.0, strict=True)
        scale = D ** -0.5 if scale is None else C.check_real(fn, "scale", scale, minimum=0.0, strict=True)
        self.blocks = self._blocks(fn, blocks)
        self.capacity = C.check_positive_int(fn, "counter_capacity", counter_capacity)
        spin = C.check_int(fn, "spin_ns", config.MEGAKERNEL_SPIN_NS if spin_ns is None else spin_ns, minimum=0,
                           maximum=1_000_000)
        self.cache, self.sampling, self.max_splits = cache, sampling, int(o_part.shape[0])
        self.shape = dict(B=B, dim=dim, Hq=Hq, Hkv=Hkv, D=D, F=F, V=V, L=L)
        # The kernel's own scratch, written and read only inside a step: the second residual buffer
        # and the float32 partial slots of split O / down projections ([2 layer parities, slots, B,
        # dim]), the two-level sampler's per-chunk answers (values: max, then candidates; ids: a
        # head of MK_SAMPLE_HEAD words, then candidates) and each LM-head tile's largest logit
        self.slots = Hkv + down_chunks(F, dt.itemsize)
        self.parts = C.check_int(fn, "sample_parts", sample_parts_of(V) if sample_parts is None else sample_parts,
                                 minimum=1, maximum=GEOMETRY["MK_SAMPLE_MAX_PARTS"][0])
        self.shape["parts"] = self.parts
        cand = GEOMETRY["MK_SAMPLE_CAND"][0]
        with C.no_gpu_explained(fn):
            self.xalt = cupy.zeros((B, dim), dtype=dt)
            self.part = cupy.zeros((2, self.slots, B, dim), dtype=np.float32)
            self.sp_val = cupy.zeros((B, self.parts, 1 + cand), dtype=np.float32)
            self.sp_idx = cupy.zeros((B, self.parts, GEOMETRY["MK_SAMPLE_HEAD"][0] + cand), dtype=np.int32)
            self.sp_tmax = cupy.zeros((B, -(-V // TILE_ROWS)), dtype=np.float32)
        # the ring attention's K/V chunk: as many keys as fit config.MEGAKERNEL_ATTN_STAGE_BYTES (rows
        # padded by 16 bytes: conflict-free score reads), at most MK_ATTN_MAX_KEYS
        row = D * dt.itemsize + 16
        self.attn_keys = max(1, min(GEOMETRY["MK_ATTN_MAX_KEYS"][0], config.MEGAKERNEL_ATTN_STAGE_BYTES // (2 * row)))
        # the descriptor's fields, less the split count (set per launch)
        self._layers = cupy.asarray(np.array([[_ptr(getattr(lp, f)) for f in LAYER_FIELDS] for lp in layers],
                                             dtype=np.uint64).reshape(L, len(LAYER_FIELDS)))
        self._keep = (tok_embd, output_norm, output, layers, sampling, rope_divisors)
        # the kernel's MkState arguments, in order: every buffer one block writes and another reads
        self._state = (x, q, att, o_part, lse_part, ffn, logits, tokens, cache.k, cache.v, cache.lengths, self.xalt,
                       self.part, self.sp_val, self.sp_idx, self.sp_tmax)
        self._fields = dict(layers=_ptr(self._layers), tok_embd=_ptr(tok_embd), out_norm=_ptr(output_norm),
                            out_w=_ptr(output), fparams=_ptr(None if sampling is None else sampling.fparams),
                            iparams=_ptr(None if sampling is None else sampling.iparams), timings=0,
                            rope_div=_ptr(rope_divisors),
                            B=B, dim=dim, Hq=Hq, Hkv=Hkv, D=D, F=F, V=V, L=L, max_seq=cache.max_seq,
                            neox=int(rope_style == "neox"), spin_ns=spin, attn_keys=self.attn_keys,
                            parts=self.parts, eps=float(np.float32(eps)),
                            freq_scale=-math.log2(base) / (D // 2), scale_log2=scale * math.log2(math.e))
        # counters [2, capacity] (both sets zero at first); step state (epoch, ticket)
        with C.no_gpu_explained(fn):
            self.counters = cupy.zeros((2, self.capacity), dtype=np.uint32)
            self.step_state = cupy.zeros(2, dtype=np.uint32)
        # dynamic shared memory: the weight ring, then one region that is a GEMV's input rows or the
        # ring attention's two K/V chunks (never both alive: megakernel.cu's resource table)
        stages = config.MEGAKERNEL_STAGES * STAGE_BYTES
        self.xs_off = stages
        self.smem = stages + max(-(-B * max(dim, Hq * D, F) * dt.itemsize // 16) * 16, 4 * self.attn_keys * row)

    @staticmethod
    def _check_tensor(fn, name, a, shape, dt):
        C.check_array(fn, name, a)
        if np.dtype(a.dtype) != dt:
            raise TypeError(f"{fn}(): {name} has dtype {a.dtype} but the cache has {dt}")
        if tuple(a.shape) != tuple(shape) or not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"{fn}(): {name} must be C-contiguous, 16-byte aligned, of shape {tuple(shape)}; got "
                             f"{tuple(a.shape)}")

    @staticmethod
    def _check_buffer(fn, name, a, size, dt):
        C.check_array(fn, name, a, dtypes=None)
        if np.dtype(a.dtype) != dt or a.size != size or not a.flags.c_contiguous or a.data.ptr % 16:
            raise ValueError(f"{fn}(): {name} must be a C-contiguous, 16-byte aligned {dt} buffer of {size} elements, "
                             f"got {a.dtype} of shape {tuple(a.shape)}")

    @staticmethod
    def _blocks(fn, blocks) -> int:
        with C.no_gpu_explained(fn):
            sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        if blocks is None:
            blocks = config.MEGAKERNEL_BLOCKS or sms
        blocks = C.check_positive_int(fn, "blocks", blocks)
        if blocks > sms:
            raise ValueError(f"{fn}(): blocks={blocks} exceeds the device's {sms} SMs: a persistent launch needs "
                             "every block resident at once")
        return blocks

    # --- plans and launches ----------------------------------------------------------------------
    def plan(self, ops) -> DevicePlan:
        """Plan ``ops`` (persistent.Op of OPCODES) on this step's blocks and upload the queues. Each
        op is checked against this model first (its tiles, its layer, the instruction arguments
        that index the kernel's buffers): a bad one raises naming it, nothing is uploaded."""
        fn = "LlamaStep.plan"
        names = {v: k for k, v in OPCODES.items()}
        s = self.shape
        G = s["Hq"] // s["Hkv"]
        attn = 0
        for op in ops:
            kind = names.get(getattr(op, "opcode", None))
            if kind is None:
                raise ValueError(f"{fn}(): op {getattr(op, 'name', op)!r} has opcode "
                                 f"{getattr(op, 'opcode', None)!r}, not one of megakernel.OPCODES")
            if kind in ("sample", "sample_part") and self.sampling is None:
                raise ValueError(f"{fn}(): op {op.name!r} samples, but the step was made with sampling=None")
            if not 0 <= op.layer < s["L"]:
                raise ValueError(f"{fn}(): op {op.name!r} names layer {op.layer} of {s['L']}")
            a0, a1 = (tuple(op.args) + (0, 0))[:2]
            why = self._args_problem(kind, int(a0), int(a1), G)
            if why:
                raise ValueError(f"{fn}(): op {op.name!r}: {why}")
            if kind == "attn":
                attn = max(attn, -(-op.tiles // max(1, a0)))
            elif op.tiles > max_tiles(kind, s, (a0, a1)):
                raise ValueError(f"{fn}(): op {op.name!r} has {op.tiles} tiles; a {kind} op of this model has "
                                 f"at most {max_tiles(kind, s, (a0, a1))}")
        p = persistent.plan(ops, self.blocks)
        if p.n_counters > self.capacity:
            raise ValueError(f"{fn}(): the plan needs {p.n_counters} counters, the step holds {self.capacity} "
                             "(counter_capacity)")
        most = max((int(w) for w in p.instructions[:, persistent.WAIT_COUNT]), default=0)
        if most > config.MEGAKERNEL_THREADS:
            raise ValueError(f"{fn}(): an instruction waits for {most} counters, more than the "
                             f"{config.MEGAKERNEL_THREADS} threads that wait for one each")
        return DevicePlan(p, cupy.asarray(p.instructions), cupy.asarray(p.queue_start), cupy.asarray(p.waits), attn)

    def _args_problem(self, kind: str, a0: int, a1: int, G: int) -> str | None:
        """Why an op's instruction arguments would take the kernel outside its buffers (None: fine);
        megakernel.cu's table says what each means."""
        s, vec = self.shape, 16 // self.dtype.itemsize
        ko, kd, high = a1 & 255, (a1 >> 8) & 255, a1 >> 16
        slots_ok = 1 <= ko and 1 <= kd and ko + kd <= self.slots
        if kind == "attn":  # v1 loops over head tiles; the ring holds one (at most MEGAKERNEL_HEAD_TILE heads)
            lo = -(-G // config.MEGAKERNEL_HEAD_TILE) if a1 == 1 else 0
            if not lo <= a0 <= G or a1 not in (0, 1):
                return (f"attention args ({a0}, {a1}) must be (head splits in [{max(lo, 1)}, {G}] (0: 1), "
                        "variant 0 or 1)")
        elif kind in ("oproj", "down"):  # args[0] 0 or 1: no column chunks
            a0 = max(a0, 1)
            width = s["Hq"] * s["D"] if kind == "oproj" else s["F"]
            if a0 < 1 or width % a0 or (width // a0) % vec:
                return f"args[0]={a0} must split its {width} columns into chunks of whole 16-byte vectors"
            if kind == "down" and a0 > 1 and (width // a0) % GEOMETRY["MK_GATE_UP_ROWS"][0]:
                return f"args[0]={a0} must split ffn_dim into whole gate|up tiles"
            if high & 2 and not (slots_ok and a0 == (ko if kind == "oproj" else kd)):
                return f"args ({a0}, {a1}) name partial slots ({ko} + {kd}) the step does not hold ({self.slots})"
            if not high & 2 and a0 != 1:
                return f"split into {a0} chunks, it must write partial slots (args[1] bit 17)"
        elif kind in ("qkv", "gate_up", "lm_head"):
            mode, sub = (a0 & 15, a0 >> 4) if kind == "gate_up" else (a0, 0)
            if mode not in (0, 1, 2) or sub not in (0, 1, 2) or (mode and not (slots_ok and high < s["L"])):
                return (f"args ({a0}, {a1}) must be (mode 0, 1 or 2 (gate|up: + 16 x 1 or 2 sub-tiles); slots "
                        f"within the step's {self.slots})")
        elif kind in ("sample_part", "sample"):
            covers = a1 >= 1 and a1 % TILE_ROWS == 0 and a0 * a1 >= s["V"] > (a0 - 1) * a1
            chunks = 1 <= a0 <= min(self.parts, GEOMETRY["MK_SAMPLE_MAX_PARTS"][0]) and covers
            if kind == "sample_part" and not chunks:
                return (f"args ({a0}, {a1}) must be (chunks <= {self.parts}, logits per chunk: whole LM-head tiles, "
                        "the chunks covering the vocabulary, none empty)")
            if kind == "sample" and not (chunks or (a0, a1) == (0, 0)):
                return (f"args ({a0}, {a1}) must be (0, 0) (one block) or the (chunks, logits per chunk) of its "
                        "sample_part op")
        return None

    def descriptor(self, splits: int, timings=None) -> np.void:
        """The kernel's MkModel by value (a NumPy structured scalar of uint64 words)."""
        f = dict(self._fields, splits=int(splits), timings=_ptr(timings))
        words = [f[k] for k in _POINTERS] + [f[k] for k in _INTS]
        words += [int(np.array(f[k], dtype=np.float64).view(np.uint64)) for k in _DOUBLES]
        return np.array([(np.array(words, dtype=np.uint64),)], dtype=MODEL_DTYPE)[0]

    def launch(self, dplan: DevicePlan, splits: int = 1, record: bool = True, timings=None) -> None:
        """One decode step with ``dplan`` on the current stream. ``splits``: key splits of its
        attention ops (in [1, o_part's S]). The cache must have room for one more token in every
        layer (checked on the host mirror first: a full cache raises before anything runs);
        ``record``: advance the host mirror of the lengths. ``timings``: uint64 [n, 4] on the device
        to profile the step into (see :meth:`profile`)."""
        fn = "LlamaStep.launch"
        if not isinstance(dplan, DevicePlan) or dplan.plan.blocks != self.blocks:
            raise TypeError(f"{fn}(): dplan must be a DevicePlan made by this step's plan()")
        splits = C.check_int(fn, "splits", splits, minimum=1, maximum=self.max_splits)
        most = self.shape["B"] * self.shape["Hkv"] * splits
        if dplan.attn_tiles > most:
            raise ValueError(f"{fn}(): the plan's attention op has {dplan.attn_tiles} tiles per head split, more "
                             f"than batch x kv heads x splits = {most}")
        kern = get_function(SPEC, f"megakernel<{ctype(self.dtype)}>", dynamic_smem=self.smem)  # built first
        self.cache.check_room(1, fn)
        kern((self.blocks,), (config.MEGAKERNEL_THREADS,),
             (self.descriptor(splits, timings), *self._state, dplan.instr, dplan.queue, dplan.waits, self.counters,
              np.int32(self.capacity), self.step_state, np.int32(self.xs_off)), shared_mem=self.smem)
        if record:
            self.cache.record_advance(1)

    def profile(self, dplan: DevicePlan, splits: int = 1, machine: persistent.Machine | None = None) -> dict:
        """Run one step (a real one: it appends to the cache and advances the lengths) with every
        instruction stamped by %globaltimer, and summarise: per op kind the instructions, the
        median and largest wait (start -> waits done) and work (waits done -> done) in
        microseconds; the step's span; the busiest block's work; beside each, the cost model's
        prediction for the plan (``machine``: None, the H100 estimates with this step's spin).
        Emulated: scheduling ticks."""
        n = len(dplan.plan.instructions)
        t = cupy.zeros((n, 4), dtype=np.uint64)
        self.launch(dplan, splits, timings=t)
        m = machine or persistent.Machine().with_(handoff_us=handoff_us(self._fields["spin_ns"]))
        return profile_summary(dplan.plan, cupy.asnumpy(t), m)


def handoff_us(spin_ns: int) -> float:
    """The cost model's hand-off for a waiter's longest sleep (persistent.Machine.handoff_us): the
    1.4 us fitted at today's 1024 ns cap less the sleep it no longer oversleeps (a counter that
    arrives during a sleep waits half the sleep on average)."""
    return persistent.Machine.handoff_us - (1024 - min(int(spin_ns), 1024)) / 2000.0


def profile_summary(p: persistent.Plan, t: np.ndarray, machine: persistent.Machine | None = None) -> dict:
    """LlamaStep.profile's numbers from the stamps ``t`` [n, 4] (start, ready, done, block) of the
    rows of plan ``p``, and the cost model's for the same plan on ``machine`` (None: its defaults):
    per op kind ``model_wait_us`` / ``model_work_us`` (medians: a row's start less its block's
    previous end, its end less its start), the step ``model_step_us``."""
    names = {v: k for k, v in OPCODES.items()}
    t = t.astype(np.int64)
    start, ready, done, block = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
    c = persistent.estimate(p, machine)
    prev = np.concatenate([[0.0], c.end[:-1]])
    prev[p.queue_start[:-1][np.diff(p.queue_start) > 0]] = 0.0  # a queue's first row waits from the launch
    m_wait, m_work = c.start - prev, c.end - c.start
    ops = {}
    for code in sorted(set(int(x) for x in p.instructions[:, persistent.OPCODE])):
        rows = p.instructions[:, persistent.OPCODE] == code
        wait, work = (ready - start)[rows] / 1e3, (done - ready)[rows] / 1e3
        ops[names[code]] = dict(n=int(rows.sum()), wait_us=float(np.median(wait)), max_wait_us=float(wait.max()),
                                work_us=float(np.median(work)), max_work_us=float(work.max()),
                                model_wait_us=float(np.median(m_wait[rows])),
                                model_work_us=float(np.median(m_work[rows])))
    busy = np.bincount(block, weights=(done - ready), minlength=p.blocks) / 1e3
    return dict(step_us=float((done.max() - start.min()) / 1e3), busiest_block_work_us=float(busy.max()), ops=ops,
                model_step_us=c.step_us, model=c.summary())


__all__ = ["OPCODES", "GEOMETRY", "LlamaStep", "DevicePlan", "SPEC", "profile_summary", "down_chunks",
           "down_chunk_counts", "sample_parts_of", "handoff_us", "max_tiles"]
