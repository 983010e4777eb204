"""The Llama family in the megakernel: a model's op list, its split counts, what a model needs to
run it, and :class:`LlamaDecoder`, which binds a model and a decode state to one
:class:`cupyattn.megakernel.LlamaStep`.

Not yet the default anywhere (see cupyattn.megakernel): tinylm asks for it with
``Transformer(megakernel=True)``.

:func:`llama_ops` turns a model's shape into the op list the host plans into per-block queues
(cupyattn.persistent): per layer the fused step's five kernels become ops of many small tiles
(QKV with RoPE and the cache append, attention partials, their merge when the keys are split,
O projection, gate|up + SwiGLU, down projection), after an embedding op and before the LM head
and the sampling ops. The tile geometry is cupyattn.megakernel's (``GEOMETRY``, the table the
kernel's constants come from). Each op carries its :class:`persistent.Cost` per tile, so
``plan.table()`` prints the cost model's prediction beside the plan.

How the ops depend on each other is set by :class:`MegaKnobs` (defaults: ``cupyattn.config``'s
MEGAKERNEL_* block, today's measured plan):

- ``deps="layer"``: a projection waits for every tile of the op before it (five waits per layer,
  four of them device-wide); ``deps="fine"``: the O projection is split over kv heads and the
  down projection over FFN column chunks, each tile writing a float32 partial of its rows into a
  slot of its own, and waits only for the attention of its kv head / the gate|up tiles of its
  chunk; the next RMSNorm's load sums the slots in a fixed order (deterministic: no atomics),
  and the first QKV tile of the next layer writes the summed residual back. Two device-wide waits
  per layer remain: the two RMSNorms need the whole residual.
- ``down`` (with ``deps="fine"``): "narrow", the narrowest column chunks the kernel allows (SmolLM2:
  6 chunks of 256, 216 tiles, two rounds on 132 blocks), or "fit", the most chunks whose tiles
  still fit one round on the blocks (SmolLM2: 3 chunks of 512, 108 tiles).
- ``gate_up_rows``: ffn rows per gate|up instruction, 8 (one GEMV tile: SmolLM2's 192 in two rounds
  on 132 blocks) or 16 (two tiles in turn on the rows loaded once: 96 instructions, one round).
- ``attn``: "v1" (a lane per key) or "ring" (K/V chunks staged one ahead by cp.async);
  ``attn_share``: split the keys, then the query heads of a kv head, until the attention tiles
  fill that share of the blocks; ``fold_merge``: the split partials merged in the O projection's
  load instead of by a reduce op (always so with ``deps="fine"``).
- ``sample``: "block" (one block per sequence) or "two_level" (vocabulary chunks on many blocks:
  argmax, top-k or top-p candidates and the chunk's mass, then one merge per sequence).
- ``spin_ns``: the longest sleep of a waiting block between polls.

Any Llama-family model with 16-byte rows and head_dim a multiple of 16 (at most 128) runs
through the same CUDA; a new model of the family is a new shape, not new code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from . import config
from .megakernel import GEOMETRY, OPCODES, LlamaStep, down_chunk_counts, handoff_us, sample_parts_of
from .persistent import Cost, Dep, Op

TILE_ROWS = GEOMETRY["MK_TILE_ROWS"][0]
GATE_UP_ROWS = GEOMETRY["MK_GATE_UP_ROWS"][0]


# --- the model's shape and the knobs -------------------------------------------------------------
@dataclass(frozen=True)
class LlamaShape:
    """What the megakernel needs of a Llama-style model (tinylm.config.ModelArgs has these names)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_style: str = "adjacent"
    # per layer, the head_dim / 2 divisors of each rotation pair's frequency (LlamaStep's
    # rope_divisors), or () for none: Llama 3's rope_freqs, LongRoPE, layers without RoPE
    rope_divisors: tuple = ()
    attn_scale: float | None = None  # the softmax scale, None = 1 / sqrt(head_dim)

    @classmethod
    def of(cls, args) -> "LlamaShape":
        """The shape of any object with these attribute names (a ModelArgs, a LlamaShape; one
        without ``rope_divisors`` or ``attn_scale`` has none)."""
        if isinstance(args, cls):
            return args
        rest = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in ("rope_divisors", "attn_scale")}
        return cls(**rest, attn_scale=getattr(args, "attn_scale", None),
                   rope_divisors=tuple(tuple(float(x) for x in row) for row in getattr(args, "rope_divisors", ())))


_CHOICES = {"attn": ("v1", "ring"), "deps": ("layer", "fine"), "down": ("narrow", "fit"),
            "sample": ("block", "two_level")}
# each knob's setting in cupyattn.config
CONFIG_NAMES = {"attn": "MEGAKERNEL_ATTN", "attn_share": "MEGAKERNEL_ATTN_SHARE",
                "min_keys_per_split": "MEGAKERNEL_MIN_KEYS_PER_SPLIT", "attn_min_keys": "MEGAKERNEL_ATTN_MIN_KEYS",
                "deps": "MEGAKERNEL_DEPS", "down": "MEGAKERNEL_DOWN", "gate_up_rows": "MEGAKERNEL_GATE_UP_ROWS",
                "fold_merge": "MEGAKERNEL_FOLD_MERGE", "spin_ns": "MEGAKERNEL_SPIN_NS", "sample": "MEGAKERNEL_SAMPLE"}


@dataclass(frozen=True)
class MegaKnobs:
    """How the Llama op list is built (module docstring); ``from_config()`` reads config's
    MEGAKERNEL_* block, ``with_(name=value)`` changes one and checks it."""

    attn: str = "v1"
    attn_share: float = 0.0
    min_keys_per_split: int = 256
    attn_min_keys: int = 8
    deps: str = "layer"
    down: str = "narrow"
    gate_up_rows: int = 8
    fold_merge: bool = False
    spin_ns: int = 1024
    sample: str = "block"

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"MegaKnobs(): {name} must be one of {choices}, got {getattr(self, name)!r}")
        if isinstance(self.attn_share, bool) or not 0.0 <= float(self.attn_share) <= 1.0:
            raise ValueError(f"MegaKnobs(): attn_share must be a number in [0, 1], got {self.attn_share!r}")
        for name, lo, hi in (("min_keys_per_split", 1, 2 ** 30), ("attn_min_keys", 1, 2 ** 30),
                             ("spin_ns", 0, 1_000_000)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ValueError(f"MegaKnobs(): {name} must be an int in [{lo}, {hi}], got {v!r}")
        if isinstance(self.gate_up_rows, bool) or self.gate_up_rows not in (GATE_UP_ROWS, 2 * GATE_UP_ROWS):
            raise ValueError(f"MegaKnobs(): gate_up_rows must be {GATE_UP_ROWS} or {2 * GATE_UP_ROWS}, got "
                             f"{self.gate_up_rows!r}")
        if not isinstance(self.fold_merge, bool):
            raise ValueError(f"MegaKnobs(): fold_merge must be a bool, got {self.fold_merge!r}")

    @classmethod
    def from_config(cls) -> "MegaKnobs":
        return cls(**{k: getattr(config, name) for k, name in CONFIG_NAMES.items()})

    def as_config(self) -> dict:
        """The config settings (name -> value) that give these knobs."""
        return {name: getattr(self, k) for k, name in CONFIG_NAMES.items()}

    def with_(self, **changes) -> "MegaKnobs":
        return replace(self, **changes)

    @property
    def fine(self) -> bool:
        return self.deps == "fine"

    @property
    def folds(self) -> bool:
        return self.fold_merge or self.fine


# The plan the cost model calls "new" (docs/megakernel.md): every knob on.
NEW_PLAN = MegaKnobs(attn="ring", attn_share=0.5, deps="fine", down="fit", gate_up_rows=16, fold_merge=True,
                     spin_ns=64, sample="two_level")


# --- eligibility -----------------------------------------------------------------------------------
def llama_problem(shape, dtype, batch: int | None = None, cc: int | None = None) -> str | None:
    """Why a model of ``shape`` in ``dtype`` cannot run through the megakernel (None: it can);
    ``batch`` and the device's compute capability ``cc`` are checked when given."""
    s = LlamaShape.of(shape)
    if s.head_dim % 16 or s.head_dim > config.MEGAKERNEL_MAX_HEAD_DIM:
        return (f"the megakernel needs a head_dim that is a multiple of 16 and at most "
                f"{config.MEGAKERNEL_MAX_HEAD_DIM}, got {s.head_dim}")
    if s.n_heads % s.n_kv_heads:
        return f"the megakernel needs n_heads a multiple of n_kv_heads, got {s.n_heads} and {s.n_kv_heads}"
    if s.rope_divisors and [len(r) for r in s.rope_divisors] != [s.head_dim // 2] * s.n_layers:
        return f"the megakernel needs rope_divisors of n_layers rows of head_dim / 2 = {s.head_dim // 2}"
    vec = 16 // np.dtype(dtype).itemsize
    for what, n in (("dim", s.dim), ("n_heads * head_dim", s.n_heads * s.head_dim), ("ffn_dim", s.ffn_dim)):
        if n % vec:
            return f"the megakernel needs {what} a multiple of {vec} ({np.dtype(dtype).name} 16-byte rows), got {n}"
    if batch is not None and batch > config.MEGAKERNEL_MAX_BATCH:
        return f"the megakernel decodes at most {config.MEGAKERNEL_MAX_BATCH} sequences at once, got batch={batch}"
    if cc is not None:
        need = config.impl_min_cc("megakernel", "persistent", dtype)
        if not config.impl_runs_on("megakernel", "persistent", dtype, cc):
            return (f"the megakernel needs compute capability {need // 10}.{need % 10}, this device is "
                    f"{cc // 10}.{cc % 10}")
    return None


# --- splits --------------------------------------------------------------------------------------------
def step_splits(shape, batch: int, length: int, blocks: int, most: int, knobs: MegaKnobs | None = None) -> int:
    """Key splits of a step whose longest sequence holds ``length`` keys (the lower end of its
    context bucket): at least ``min_keys_per_split`` keys per split (``attn_min_keys`` and enough
    splits to fill ``attn_share`` of the blocks when that knob is set), no more attention tiles
    than blocks, at most config.MEGAKERNEL_MAX_SPLITS and ``most`` (the partials' room)."""
    k = knobs or MegaKnobs.from_config()
    s, B = LlamaShape.of(shape), int(batch)
    room = max(1, blocks // (B * s.n_kv_heads))
    if k.attn_share > 0:
        want = min(math.ceil(k.attn_share * blocks / (B * s.n_kv_heads)), -(-int(length) // k.attn_min_keys))
    else:
        want = -(-int(length) // k.min_keys_per_split)
    return max(1, min(want, room, config.MEGAKERNEL_MAX_SPLITS, most))


def head_splits(shape, batch: int, splits: int, blocks: int, knobs: MegaKnobs | None = None) -> int:
    """Query-head splits of a kv head's attention: the fewest that keep a tile's heads within
    config.MEGAKERNEL_HEAD_TILE, more (up to one head per tile) while ``attn_share`` of the blocks
    is not reached with the key splits alone and the tiles stay within the blocks."""
    k = knobs or MegaKnobs.from_config()
    s = LlamaShape.of(shape)
    G = s.n_heads // s.n_kv_heads
    hs = -(-G // config.MEGAKERNEL_HEAD_TILE)
    per = int(batch) * s.n_kv_heads * splits
    while k.attn_share > 0 and hs < G and per * hs < k.attn_share * blocks and per * (hs + 1) <= blocks:
        hs += 1
    return -(-G // -(-G // hs))  # no tile left without a head (7 heads in 5 splits: 4 of 2 heads)


def split_down(shape, itemsize: int, blocks: int, knobs: MegaKnobs | None = None) -> int:
    """Column chunks of the down projection: 1 unless ``deps="fine"``; then with ``down="narrow"``
    the most the kernel allows (megakernel.down_chunk_counts), with "fit" the most whose
    row tiles x chunks stay within ``blocks`` (one round), at least 1."""
    k = knobs or MegaKnobs.from_config()
    if not k.fine:
        return 1
    s = LlamaShape.of(shape)
    counts = down_chunk_counts(s.ffn_dim, itemsize, k.gate_up_rows)
    if k.down == "narrow":
        return counts[-1]
    rows = -(-s.dim // TILE_ROWS)
    return max([c for c in counts if rows * c <= blocks] or [1])


# --- the op list ---------------------------------------------------------------------------------------
def _slots(ko: int, kd: int, high: int = 0) -> int:
    """ARG1 of the ops that read or write the partial slots: O chunks | down chunks << 8 | high << 16."""
    return ko | kd << 8 | high << 16


def llama_ops(shape, batch: int, splits: int = 1, sample: bool = True, *, knobs: MegaKnobs | None = None,
              heads: int | None = None, itemsize: int = 2, keys: int | None = None,
              blocks: int = 132) -> list[Op]:
    """The decode step of a Llama-style model for ``batch`` sequences with attention over
    ``splits`` key splits and ``heads`` query-head splits (None: :func:`head_splits`), as a
    topologically ordered op list; ``sample``: end with the sampling ops (else the step stops at
    the logits). ``itemsize`` (bytes of the model's dtype) and ``keys`` (the context, None: 256)
    set only the ops' costs; ``blocks`` only the automatic head splits."""
    k = knobs or MegaKnobs.from_config()
    s, B = LlamaShape.of(shape), int(batch)
    hq, hkv, d, G = s.n_heads, s.n_kv_heads, s.head_dim, s.n_heads // s.n_kv_heads
    hs = head_splits(s, B, splits, blocks, k) if heads is None else int(heads)
    keys = 256 if keys is None else int(keys)
    rows = lambda n: -(-n // TILE_ROWS)  # noqa: E731
    per_head = d // TILE_ROWS  # QKV tiles of one head (8 rotation pairs each)
    qkv_heads = hq + 2 * hkv
    # the kv group of each QKV tile's head: q head h -> h // G, k and v heads of kv head j -> j
    qkv_group = tuple((h // G if h < hq else (h - hq) % hkv) for h in range(qkv_heads) for _ in range(per_head))
    ko = hkv if k.fine else 1
    kd = split_down(s, itemsize, blocks, k)
    fold = k.folds and splits > 1
    n_attn = B * hkv * hs * splits
    # attention tile t = ((b * Hkv + kvh) * hs + head split) * splits + key split
    att_kvh = tuple((t // (hs * splits)) % hkv for t in range(n_attn))
    att_bk = tuple(t // (hs * splits) for t in range(n_attn))
    if k.fine:
        attn_group = att_kvh                       # the O projection of kv head j waits for j's tiles
    elif splits > 1 and not fold:
        attn_group = att_bk                        # a merge waits for its own (sequence, kv head)
    else:
        attn_group = None
    # Costs per tile (persistent.Cost): bytes streamed, dependent L2 trips. The trips of today's ops are
    # fitted to the H100 profile of 2026-11-27 (a SmolLM2 step's median work per instruction: qkv 4.3 us,
    # oproj 2.8, gate|up 3.6, down 5.1, LM head 2.3, one-block greedy sample 16.4, attention 35.4 at
    # 256 keys against 40 predicted), each split into its input load's trips (3 for rows normalised on
    # load then: rows, norm weights, the sum of squares; 1 for plain rows), which a tile skips when its
    # block holds the rows already (the LM head's median tile: 2.3 us, its block's first one 3 trips
    # more), and the rest (QKV's 3: the product's sums, the cache position, RoPE and the cache write).
    # Since then, from the kernel's structure: the norm weights load with the rows and the cache
    # position before them (one trip less each: `norm` below), a split tile's partial write costs no
    # trip, the ring one per chunk, and the block-wide loads of the partial slots and of the split
    # partials (megakernel_gemv.cuh) one per batch of MK_LOAD_BATCH loads per item in place of the
    # plain row load's one (the merge one more: its log-sum-exps first).
    x_bytes = B * s.dim * itemsize
    gemv = lambda k_cols, load, rest: Cost(TILE_ROWS * k_cols * itemsize + B * k_cols * itemsize,  # noqa: E731
                                           load + rest, load)
    batch, norm = GEOMETRY["MK_LOAD_BATCH"][0], 2  # a normalised row load's trips
    items = lambda k_cols: -(-B * k_cols // 4 // config.MEGAKERNEL_THREADS)  # noqa: E731  (a thread's, in turn)
    wide = lambda k_cols, loads: items(k_cols) * -(-loads // batch) - 1  # noqa: E731
    per_split = -(-keys // splits)
    kv_bytes = 2 * per_split * d * itemsize
    if k.attn == "ring":
        row = d * itemsize + 16  # LlamaStep.attn_keys: keys per staged chunk
        chunk = max(1, min(GEOMETRY["MK_ATTN_MAX_KEYS"][0], config.MEGAKERNEL_ATTN_STAGE_BYTES // (2 * row)))
        attn_trips = 2 + 0.5 * (-(-per_split // chunk) - 1)
    else:  # each warp's 32-key tile: D / vec dependent K loads, then 32 keys x D / 32 dependent V loads
        # (72 for SmolLM2 in fp16; 64 fit the profile: the compiler overlaps a few)
        vec = 16 // itemsize
        attn_trips = 2 + 0.9 * (d // vec + 32 * (-(-d // 32))) * -(-per_split // (32 * config.MEGAKERNEL_THREADS // 32))
    # gate|up: instructions of k.gate_up_rows ffn rows (sub-tiles of GATE_UP_ROWS in turn, arg0 >> 4 when
    # more than one), each sub-tile after the first one trip more (its product's sums and epilogue)
    gu_sub = k.gate_up_rows // GATE_UP_ROWS
    n_gu = -(-s.ffn_dim // k.gate_up_rows)
    per_chunk = n_gu if kd == 1 else s.ffn_dim // kd // k.gate_up_rows  # gate|up tiles one down chunk reads
    one = gemv(s.dim, norm + (wide(s.dim, ko) if k.fine else 0), 2)
    gu_cost = Cost(one.bytes + (gu_sub - 1) * TILE_ROWS * s.dim * itemsize, one.trips + gu_sub - 1, one.load_trips)
    gu_mode = int(k.fine) | (gu_sub << 4 if gu_sub > 1 else 0)
    ops = [Op("embed", OPCODES["embed"], 1, cost=Cost(x_bytes, 1))]
    prev = "embed"
    for i in range(s.n_layers):
        mode = 2 if (k.fine and i > 0) else 0
        ops.append(Op(f"qkv.{i}", OPCODES["qkv"], qkv_heads * per_head, i, args=(mode, _slots(ko, kd, max(i - 1, 0))),
                      group_of=qkv_group, deps=(Dep(prev),),
                      cost=gemv(s.dim, norm + (wide(s.dim, ko + kd) if mode else 0), 2)))
        ops.append(Op(f"attn.{i}", OPCODES["attn"], n_attn, i, args=(hs, int(k.attn == "ring")),
                      group_of=attn_group, deps=(Dep(f"qkv.{i}", tuple((g,) for g in att_kvh)),),
                      cost=Cost(kv_bytes + G * d * itemsize, attn_trips)))
        att = f"attn.{i}"
        if splits > 1 and not fold:  # merge tile b * Hkv + kvh waits for its own splits' partials
            ops.append(Op(f"reduce.{i}", OPCODES["reduce"], B * hkv, i,
                          deps=(Dep(att, tuple((t,) for t in range(B * hkv))),),
                          cost=Cost(splits * G * d * 4, 2)))
            att = f"reduce.{i}"
        o_rows, o_cols = rows(s.dim), hq * d // ko
        o_dep = Dep(att, tuple((t % ko,) for t in range(o_rows * ko))) if k.fine else Dep(att)
        ops.append(Op(f"oproj.{i}", OPCODES["oproj"], o_rows * ko, i, args=(ko, _slots(ko, kd, int(fold) | 2 * k.fine)),
                      deps=(o_dep,), cost=gemv(o_cols, 1 + (1 + wide(o_cols, splits) if fold else 0), 2),
                      input_of=tuple(t % ko for t in range(o_rows * ko))))
        ops.append(Op(f"gate_up.{i}", OPCODES["gate_up"], n_gu, i, args=(gu_mode, _slots(ko, kd, i)),
                      group_of=tuple(t // per_chunk for t in range(n_gu)) if k.fine else None,
                      deps=(Dep(f"oproj.{i}"),), cost=gu_cost))
        d_rows = rows(s.dim)
        d_dep = Dep(f"gate_up.{i}", tuple((t % kd,) for t in range(d_rows * kd))) if k.fine else Dep(f"gate_up.{i}")
        ops.append(Op(f"down.{i}", OPCODES["down"], d_rows * kd, i, args=(kd, _slots(ko, kd, 2 * k.fine)),
                      deps=(d_dep,), cost=gemv(s.ffn_dim // kd, 1, 3 if k.fine else 4),
                      input_of=tuple(t % kd for t in range(d_rows * kd))))
        prev = f"down.{i}"
    n_lm = rows(s.vocab_size)
    parts = per_part = 0
    if sample and k.sample == "two_level":  # chunks of whole LM-head tiles, none empty
        per_part = -(-n_lm // sample_parts_of(s.vocab_size))
        parts = -(-n_lm // per_part)
    ops.append(Op("lm_head", OPCODES["lm_head"], n_lm, args=(2 if k.fine else 0, _slots(ko, kd, s.n_layers - 1)),
                  deps=(Dep(prev),), cost=gemv(s.dim, norm + (wide(s.dim, ko + kd) if k.fine else 0), 2)))
    if sample and parts:
        # every part waits for the whole LM head: without a top-k it needs the row's largest logit
        # (the tiles' maxima); the last chunk's tiles end with the op anyway (round-robin)
        n, chunk = B * parts, TILE_ROWS * per_part
        ops.append(Op("sample_part", OPCODES["sample_part"], n, args=(parts, chunk),
                      group_of=tuple(t // parts for t in range(n)), deps=(Dep("lm_head"),),
                      cost=Cost(TILE_ROWS * per_part * itemsize, 6)))
        ops.append(Op("sample", OPCODES["sample"], B, args=(parts, chunk),
                      deps=(Dep("sample_part", tuple((b,) for b in range(B))),), cost=Cost(parts * 8, 3)))
    elif sample:  # one block reads the whole row: 24 trips fit the profile's 16.4 us (greedy)
        ops.append(Op("sample", OPCODES["sample"], B, deps=(Dep("lm_head"),),
                      cost=Cost(s.vocab_size * itemsize, 24)))
    return ops


def instruction_counts(ops) -> dict:
    """Instructions per op kind (the part of an op's name before the layer), for reports."""
    out: dict = {}
    for op in ops:
        kind = op.name.split(".")[0]
        out[kind] = out.get(kind, 0) + op.tiles
    return out


def plan_cost(shape, batch: int, keys: int, blocks: int, knobs: MegaKnobs, itemsize: int = 2,
              most: int | None = None):
    """(persistent.Plan, its PlanCost) of a step of ``batch`` sequences at ``keys`` keys on
    ``blocks`` blocks with ``knobs`` (its splits as :func:`step_splits` chooses them, at most
    ``most``: config.MEGAKERNEL_MAX_SPLITS by default), costed on the H100 estimate at the
    knobs' spin."""
    from . import persistent

    splits = step_splits(shape, batch, keys, blocks, most or config.MEGAKERNEL_MAX_SPLITS, knobs)
    p = persistent.plan(llama_ops(shape, batch, splits, True, knobs=knobs, itemsize=itemsize, keys=keys,
                                  blocks=blocks), blocks=blocks)
    return p, p.cost(persistent.Machine().with_(handoff_us=handoff_us(knobs.spin_ns)))


def cheapest_knobs(shape, batch: int, keys: int, blocks: int, itemsize: int = 2, base: MegaKnobs | None = None,
                   most: int | None = None) -> tuple:
    """(knobs, predicted step in us): of ``base``'s knobs (None: config's) with the plan's varied
    (attn, attn_share 0 or 0.5, deps, down, gate_up_rows, fold_merge, sample; the spin stays
    ``base``'s: the model's hand-off cost of a spin is one linear guess), the set whose plan the cost model
    (persistent.estimate, its H100 estimate at ``base``'s spin) predicts fastest for a step of
    ``batch`` sequences at ``keys`` keys on ``blocks`` blocks (``most``: the splits the partials
    hold, config.MEGAKERNEL_MAX_SPLITS by default). A model fitted to one profiled step chooses
    here: ``benchmarks model --impl tinylm-mega-auto`` times its choice beside the fixed plans."""
    import itertools

    base = base or MegaKnobs.from_config()
    best = None
    for attn, share, deps, down, rows, fold, sample in itertools.product(
            _CHOICES["attn"], (0.0, 0.5), _CHOICES["deps"], _CHOICES["down"], (GATE_UP_ROWS, 2 * GATE_UP_ROWS),
            (False, True), _CHOICES["sample"]):
        k = base.with_(attn=attn, attn_share=share, deps=deps, down=down, gate_up_rows=rows, fold_merge=fold,
                       sample=sample)
        us = plan_cost(shape, batch, keys, blocks, k, itemsize, most)[1].step_us
        if best is None or us < best[1]:
            best = (k, us)
    return best


# --- binding a model and a decode state ------------------------------------------------------------------
class LlamaDecoder:
    """The megakernel bound to a Llama model and one decode state, and the plans it uploaded.

    Parameters
    ----------
    weights : an object with ``tok_embd`` [V, dim], ``output_norm`` [dim], ``output`` [V, dim] and
        ``layers`` (each with attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down): CuPy arrays of
        one dtype (tinylm's Params)
    shape : the model's shape (:class:`LlamaShape`, or tinylm's ModelArgs)
    state : an object with ``cache`` (cupyattn.KVCache), ``tokens`` (int32, B ids: the step's
        input, the sampled ids written back), ``logits`` (B x V of the cache's dtype) and
        ``sampling`` (cupyattn.SamplingParams or None): tinylm's RunState
    knobs : :class:`MegaKnobs` (None: from config); blocks: as LlamaStep's

    The step's scratch (residual stream, queries, attention rows, partials) is the decoder's own.
    """

    def __init__(self, weights, shape, state, knobs: MegaKnobs | None = None, blocks=None):
        import cupy

        s = self.shape = LlamaShape.of(shape)
        self.knobs = knobs or MegaKnobs.from_config()
        cache = state.cache
        B, dt = cache.batch, np.dtype(cache.dtype)
        self.batch, self.itemsize = B, dt.itemsize
        most = config.MEGAKERNEL_MAX_SPLITS
        e = lambda *shp, t=dt: cupy.empty(shp, dtype=t)  # noqa: E731
        div = cupy.asarray(np.array(s.rope_divisors, dtype=np.float32)) if s.rope_divisors else None
        self.step = LlamaStep(tok_embd=weights.tok_embd, output_norm=weights.output_norm, output=weights.output,
                              layers=weights.layers, cache=cache, num_heads=s.n_heads, eps=s.norm_eps,
                              rope_base=s.rope_base, rope_style=s.rope_style, tokens=state.tokens,
                              x=e(B, s.dim), q=e(B, s.n_heads, s.head_dim), att=e(B, s.n_heads * s.head_dim),
                              ffn=e(B, s.ffn_dim), logits=state.logits,
                              o_part=e(most, B, s.n_heads, s.head_dim, t=np.float32),
                              lse_part=e(most, B, s.n_heads, t=np.float32), sampling=state.sampling,
                              counter_capacity=self._counters(), blocks=blocks, spin_ns=self.knobs.spin_ns,
                              rope_divisors=div, scale=s.attn_scale)
        self.plans = {}

    def _counters(self) -> int:
        """Counters of the largest plan this decoder may run: split attention (its merges, or its
        per-kv-head groups) with sampling; as persistent.plan counts them (a group per waited-for
        op's group), without laying the plan out. The head splits change no group; the narrowest
        down chunks give the most (one gate|up group per chunk), whatever the blocks."""
        ops = llama_ops(self.shape, self.batch, 2, True, knobs=self.knobs.with_(down="narrow"), heads=1,
                        itemsize=self.itemsize)
        waited = {d.op for op in ops for d in op.deps}
        return sum(op.groups for op in ops if op.name in waited)

    def splits(self, keys: int) -> int:
        """Key splits of a step whose longest sequence holds ``keys`` keys (pass the lower end of
        the caller's context bucket, so eager steps and graph replays of a bucket agree)."""
        return step_splits(self.shape, self.batch, keys, self.step.blocks, self.step.max_splits, self.knobs)

    def ops(self, keys: int, sample: bool) -> list[Op]:
        """The op list of a step at ``keys`` keys (its splits chosen by :meth:`splits`)."""
        splits = self.splits(keys)
        return llama_ops(self.shape, self.batch, splits, sample, knobs=self.knobs, itemsize=self.itemsize,
                         keys=keys, blocks=self.step.blocks)

    def run(self, keys: int, sample: bool) -> None:
        """One step at ``keys`` keys (as :meth:`splits`): logits (and with ``sample`` the next ids
        in the state's tokens); every layer's lengths advance by one."""
        splits = self.splits(keys)
        key = (splits, bool(sample))
        dplan = self.plans.get(key)
        if dplan is None:
            dplan = self.plans[key] = self.step.plan(
                llama_ops(self.shape, self.batch, splits, sample, knobs=self.knobs, itemsize=self.itemsize,
                          keys=keys, blocks=self.step.blocks))
        self.step.launch(dplan, splits)


__all__ = ["LlamaShape", "MegaKnobs", "NEW_PLAN", "CONFIG_NAMES", "llama_problem", "step_splits", "head_splits",
           "split_down", "llama_ops", "instruction_counts", "handoff_us", "LlamaDecoder"]
