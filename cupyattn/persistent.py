"""The host side of a persistent kernel: an op list with dependencies, planned into per-block
queues of fixed-size instructions and the counters that order them, and a cost model of the
result (no kernel here; NumPy only).

A persistent kernel (kernels_cu/megakernel.cu) runs one block per SM; each block interprets its
own queue of instructions in order. The plan is data a test can print and check:

- an :class:`Op` is ``tiles`` instructions of one opcode (one per tile), optionally for one
  ``layer``; each finished tile bumps one counter of its op (``group_of[tile]``, one group by
  default);
- a :class:`Dep` says which producer counters a consumer tile waits for, and the plan turns it
  into (counter, target) pairs: the target is how many of the producer's tiles signal that
  counter in one step, so targets are step-relative (the kernel keeps two counter sets and
  clears the one the next step uses: nothing is reset between launches);
- :func:`plan` lays the instructions out round-robin: the ops in list order (which must be a
  topological order: every dependency names an earlier op), their tiles in order, instruction k
  of that global order on block k % blocks.

Why every schedule this makes is free of deadlock (given all blocks resident at once, which a
persistent launch of at most one block per SM guarantees): each block's queue follows the global
order, so the first unfinished instruction of the global order has every producer finished
(they come earlier) and nothing unfinished before it in its own queue: it can run. A single
block (``blocks=1``) runs the whole global order and never waits at all. :func:`simulate` runs
the queues under random interleavings and reports a deadlock by name; the proof covers any op
list :func:`plan` accepts, fine-grained dependencies included.

The cost model (:func:`estimate`, printed by :meth:`Plan.table`): each op may carry a
:class:`Cost` per tile (bytes it streams, dependent L2 round trips it cannot hide). A pass over
the global order gives each instruction a start (its block free, and each counter it waits for
reached plus one hand-off) and an end (start + per-instruction overhead + trips x trip latency +
bytes at one block's share of the memory bandwidth; a tile whose block still holds its input rows
skips its load's trips); the critical path is walked back from the last end. Its constants
(:class:`Machine`) are estimates to be checked against
``LlamaStep.profile`` on a GPU, never a measurement.

Instruction words (int32, INSTR_WORDS per instruction; the kernel reads the same layout):

==========  =================================================================================
word        meaning
==========  =================================================================================
OPCODE      the kernel's opcode of the op
LAYER       the op's layer
TILE        the tile index within the op (the kernel derives rows, heads, splits from it)
ARG0, ARG1  per-op integers the kernel may use
SIGNAL      counter this tile increments when done (-1: nobody waits for this op)
WAIT_BEGIN  first row of ``waits`` ([n, 2] int32: counter, target) this instruction waits for
WAIT_COUNT  how many rows
==========  =================================================================================
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

INSTR_WORDS = 8
OPCODE, LAYER, TILE, ARG0, ARG1, SIGNAL, WAIT_BEGIN, WAIT_COUNT = range(INSTR_WORDS)
FIELDS = ("opcode", "layer", "tile", "arg0", "arg1", "signal", "wait_begin", "wait_count")
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


@dataclass(frozen=True)
class Dep:
    """A consumer's need: counters of producer ``op``. ``groups`` None: every group of the
    producer, for every consumer tile; else one tuple of producer groups per consumer tile."""

    op: str
    groups: tuple | None = None


@dataclass(frozen=True)
class Cost:
    """What one tile of an op costs (the cost model's input, declared by whoever builds the op
    list from the kernel's structure): ``bytes`` streamed from memory (weights, K/V, activations),
    ``trips`` dependent L2 round trips it cannot overlap (a load whose result the next load's
    address or the next step needs), ``load_trips`` of those its input load's, which a tile skips
    when the tile before it on its block read the same input (``Op.input_of``: the kernel keeps
    the rows in shared memory)."""

    bytes: float = 0.0
    trips: float = 0.0
    load_trips: float = 0.0


@dataclass(frozen=True)
class Op:
    """``tiles`` instructions of ``opcode``. ``group_of``: the counter group each tile signals
    (None: all one group); ``deps``: what each tile waits for; ``args``: ARG0, ARG1; ``cost``:
    one tile's :class:`Cost` (None: free, for the cost model); ``input_of``: which input each tile
    reads (None: one for all), for the cost model's reuse of a block's loaded rows."""

    name: str
    opcode: int
    tiles: int
    layer: int = 0
    args: tuple = (0, 0)
    group_of: tuple | None = None
    deps: tuple = ()
    cost: Cost | None = field(default=None, compare=False)
    input_of: tuple | None = field(default=None, compare=False)

    @property
    def groups(self) -> int:
        return 1 if self.group_of is None else (max(self.group_of) + 1 if self.group_of else 0)


@dataclass
class Plan:
    """Per-block queues (``instructions[queue_start[b]:queue_start[b + 1]]`` is block b's, in
    order), the ``waits`` table and the counters: op name -> (first counter, groups). ``order``:
    each queue row's index in the global order."""

    blocks: int
    instructions: np.ndarray  # int32 [n, INSTR_WORDS], the queues back to back
    queue_start: np.ndarray   # int32 [blocks + 1]
    waits: np.ndarray         # int32 [max(n_waits, 1), 2] (counter, target)
    n_waits: int
    n_counters: int
    counters: dict
    ops: tuple
    order: np.ndarray = None  # int64 [n]: global index of each row

    def queue(self, block: int) -> np.ndarray:
        return self.instructions[self.queue_start[block]:self.queue_start[block + 1]]

    def waits_of(self, row: int) -> list[tuple[int, int]]:
        ins = self.instructions[row]
        w = self.waits[ins[WAIT_BEGIN]:ins[WAIT_BEGIN] + ins[WAIT_COUNT]]
        return [(int(c), int(t)) for c, t in w]

    def cost(self, machine: "Machine | None" = None) -> "PlanCost":
        """The cost model's prediction for this plan (:func:`estimate`)."""
        return estimate(self, machine)

    def table(self, limit: int | None = None, machine: "Machine | None" = None) -> str:
        """The plan as text: one line per op (tiles, blocks, waits, device-wide or not, bytes
        and trips per tile, the model's start and end), the model's totals, then with ``limit``
        each block's first ``limit`` instructions (block, position, fields, waits)."""
        c = estimate(self, machine)
        m = c.machine
        lines = [f"plan: {len(self.instructions)} instructions on {self.blocks} blocks, {self.n_counters} counters, "
                 f"{self.n_waits} waits",
                 f"cost model ({m.name}: {m.handoff_us:g} us per hand-off, {m.trip_us:g} us per dependent L2 trip, "
                 f"{m.instr_us:g} us per instruction, {m.hbm_gbps:.0f} GB/s over {m.sms} SMs): step "
                 f"{c.step_us:.1f} us; critical path {len(c.path)} instructions, {c.path_handoffs} hand-offs; "
                 f"{c.device_wide_waits} device-wide waits ({c.max_device_wide_per_layer} at most per layer); "
                 f"busiest block {c.busiest_block_us:.1f} us of work, {c.max_block_bytes / 1e6:.2f} MB",
                 f"  {'op':<14}{'tiles':>6}{'blocks':>7}{'waits':>6}{'wide':>5}{'KB/tile':>9}{'trips':>6}"
                 f"{'KB/block':>9}{'start':>9}{'end':>9}"]
        for r in c.ops:
            wide = "yes" if r["device_wide"] else ""
            lines.append(f"  {r['op']:<14}{r['tiles']:>6}{r['blocks']:>7}{r['waits']:>6}{wide:>5}"
                         f"{r['bytes_per_tile'] / 1e3:>9.1f}{r['trips_per_tile']:>6.0f}"
                         f"{r['max_bytes_per_block'] / 1e3:>9.1f}{r['start_us']:>9.1f}{r['end_us']:>9.1f}")
        if limit is None:
            return "\n".join(lines)
        names = {op.opcode: op.name.split(".")[0] for op in self.ops}
        for b in range(self.blocks):
            for pos, row in enumerate(range(self.queue_start[b], self.queue_start[b + 1])):
                if pos >= limit:
                    lines.append(f"  block {b}: ... {self.queue_start[b + 1] - row} more")
                    break
                i = self.instructions[row]
                lines.append(f"  block {b} #{pos}: {names.get(int(i[OPCODE]), i[OPCODE])} layer {i[LAYER]} tile "
                             f"{i[TILE]} args ({i[ARG0]}, {i[ARG1]}) signal {i[SIGNAL]} waits {self.waits_of(row)}")
        return "\n".join(lines)


# --- validation ---------------------------------------------------------------------------------------
def _int32(where: str, name: str, value, minimum: int = INT32_MIN) -> int:
    """An integer (not a bool) in [minimum, INT32_MAX]: the kernel reads every word as int32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"plan(): {where}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if not minimum <= int(value) <= INT32_MAX:
        raise ValueError(f"plan(): {where}: {name}={int(value)} does not fit an int32 instruction word "
                         f"(expected {minimum} <= {name} <= {INT32_MAX})")
    return int(value)


def _check_ops(ops) -> dict:
    """Every op well formed before anything is laid out: names unique strings, opcode, layer,
    tiles and args int32 words (tiles >= 0, no bools), groups ints >= 0, deps on earlier ops."""
    seen: dict = {}
    for k, op in enumerate(ops):
        if not isinstance(op, Op):
            raise TypeError(f"plan(): ops[{k}] must be a persistent.Op, got {type(op).__name__}")
        where = f"ops[{k}] ({op.name!r})"
        if not isinstance(op.name, str) or not op.name:
            raise TypeError(f"plan(): ops[{k}]: name must be a non-empty str, got {op.name!r}")
        if op.name in seen:
            raise ValueError(f"plan(): op name {op.name!r} appears twice")
        _int32(where, "opcode", op.opcode)
        _int32(where, "layer", op.layer)
        if isinstance(op.tiles, bool) or not isinstance(op.tiles, numbers.Integral) or op.tiles < 0:
            raise ValueError(f"plan(): op {op.name!r} has tiles={op.tiles!r}, expected an int >= 0")
        _int32(where, "tiles", op.tiles, 0)
        if not isinstance(op.args, (tuple, list)) or len(op.args) > 2:
            raise TypeError(f"plan(): {where}: args must be a tuple of at most 2 ints (ARG0, ARG1), got {op.args!r}")
        for j, a in enumerate(op.args):
            _int32(where, f"args[{j}]", a)
        if op.group_of is not None:
            if len(op.group_of) != op.tiles:
                raise ValueError(f"plan(): op {op.name!r}: group_of must give a group >= 0 for each of its "
                                 f"{op.tiles} tiles")
            for g in op.group_of:
                if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
                    raise ValueError(f"plan(): op {op.name!r}: group_of must give a group >= 0 for each of its "
                                     f"{op.tiles} tiles, got {g!r}")
        if op.cost is not None and not isinstance(op.cost, Cost):
            raise TypeError(f"plan(): {where}: cost must be a persistent.Cost or None, got {type(op.cost).__name__}")
        if not isinstance(op.deps, (tuple, list)):
            raise TypeError(f"plan(): {where}: deps must be a tuple of persistent.Dep, got {type(op.deps).__name__}")
        for d in op.deps:
            if not isinstance(d, Dep):
                raise TypeError(f"plan(): {where}: deps must hold persistent.Dep, got {type(d).__name__}")
            if d.op not in seen:
                raise ValueError(f"plan(): op {op.name!r} depends on {d.op!r}, which is not an earlier op "
                                 "(the op list must be in a topological order)")
            if d.groups is not None and len(d.groups) != op.tiles:
                raise ValueError(f"plan(): op {op.name!r}: Dep({d.op!r}).groups must list groups for each of "
                                 f"its {op.tiles} tiles")
        seen[op.name] = op
    return seen


# --- the plan -----------------------------------------------------------------------------------------
def plan(ops, blocks: int) -> Plan:
    """Lay ``ops`` (a topological order) out on ``blocks`` queues, round-robin (module docstring).
    Every op is checked first (``_check_ops``): a bad one raises naming it, nothing is built."""
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise TypeError(f"plan(): ops must be a sequence of persistent.Op, got {type(ops).__name__}")
    ops = tuple(ops)
    _check_ops(ops)
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or not 1 <= blocks <= INT32_MAX:
        raise ValueError(f"plan(): blocks must be an int >= 1, got {blocks!r}")
    blocks = int(blocks)
    waited = {d.op for op in ops for d in op.deps}
    counters, n_counters, members = {}, 0, {}
    for op in ops:  # counters only for ops someone waits for
        if op.name in waited:
            counters[op.name] = (n_counters, op.groups)
            n_counters += op.groups
            g = np.zeros(op.tiles, np.int64) if op.group_of is None else np.asarray(op.group_of, np.int64)
            members[op.name] = np.bincount(g, minlength=op.groups)
    rows, waits = [], []
    for op in ops:
        for t in range(op.tiles):
            begin = len(waits)
            for d in op.deps:
                first, groups = counters[d.op]
                need = range(groups) if d.groups is None else d.groups[t]
                for g in need:
                    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 0 <= g < groups:
                        raise ValueError(f"plan(): op {op.name!r} tile {t} waits for group {g} of {d.op!r}, "
                                         f"which has {groups}")
                    if members[d.op][g]:  # a group nobody signals is never waited for
                        waits.append((first + g, int(members[d.op][g])))
            sig = -1
            if op.name in counters:
                sig = counters[op.name][0] + (0 if op.group_of is None else op.group_of[t])
            a0, a1 = (tuple(op.args) + (0, 0))[:2]
            rows.append((op.opcode, op.layer, t, a0, a1, sig, begin, len(waits) - begin))
    n = len(rows)
    for what, count in (("instructions", n), ("waits", len(waits)), ("counters", n_counters)):
        if count > INT32_MAX:
            raise ValueError(f"plan(): {count} {what} do not fit int32 instruction words")
    glob = np.asarray(rows, dtype=np.int64).reshape(n, INSTR_WORDS)
    owner = np.arange(n) % blocks                       # round-robin
    order = np.lexsort((np.arange(n), owner))            # block 0's queue, then block 1's ...
    instr = np.ascontiguousarray(glob[order]).astype(np.int32)
    start = np.zeros(blocks + 1, np.int32)
    np.cumsum(np.bincount(owner, minlength=blocks), out=start[1:])
    w = np.asarray(waits, dtype=np.int32).reshape(-1, 2) if waits else np.zeros((1, 2), np.int32)
    return Plan(blocks, instr, start, np.ascontiguousarray(w), len(waits), n_counters, counters, ops, order)


def simulate(p: Plan, rng=None) -> list[tuple[int, int]]:
    """Run the plan's queues on the host with step-relative counters, picking at each move a
    block whose next instruction's waits hold (``rng``: which one at random; None: the lowest).
    Returns the (block, row) order it ran; RuntimeError naming the stuck blocks on a deadlock."""
    heads = [int(s) for s in p.queue_start[:-1]]
    counts = np.zeros(max(p.n_counters, 1), np.int64)
    ran = []
    while True:
        ready, stuck = [], []
        for b in range(p.blocks):
            row = heads[b]
            if row == p.queue_start[b + 1]:
                continue
            (ready if all(counts[c] >= t for c, t in p.waits_of(row)) else stuck).append(b)
        if not ready:
            if stuck:
                raise RuntimeError(f"simulate(): deadlock: blocks {stuck} wait on counters that never reach "
                                   f"their targets")
            return ran
        b = ready[int(rng.integers(len(ready)))] if rng is not None else ready[0]
        row = heads[b]
        sig = int(p.instructions[row, SIGNAL])
        if sig >= 0:
            counts[sig] += 1
        ran.append((b, row))
        heads[b] += 1


# --- the cost model -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """The constants of the cost model: an H100 SXM's (132 SMs, 3.0 TB/s copy measured here) and
    latencies fitted to the one profiled megakernel step (2026-11-27, SmolLM2, today's plan at 256
    keys: 1956 us; the median work per instruction of each op kind, 2.3 to 35 us, is matched by
    the trips the op list declares at 0.5 us per dependent L2 round trip and 0.3 us per
    instruction, its decode and barriers): 1.4 us per hand-off (a release's membar, the L2 trip
    of the increment, the waiter's poll and its sleep, which backs off to 1024 ns there, the
    block barrier). Estimates from one run: ``LlamaStep.profile`` prints the model's figures
    beside the measured ones, to correct them."""

    name: str = "H100 estimate"
    sms: int = 132
    hbm_gbps: float = 3000.0
    handoff_us: float = 1.4
    trip_us: float = 0.5
    instr_us: float = 0.3

    def with_(self, **kw) -> "Machine":
        from dataclasses import replace

        return replace(self, **kw)


@dataclass
class PlanCost:
    """The cost model's answer for one plan (:func:`estimate`). Times in microseconds from the
    launch; ``start``/``end`` per queue row; ``path``: the rows of the critical path, first to
    last; ``ops``: one dict per op (the columns Plan.table prints)."""

    machine: Machine
    step_us: float
    start: np.ndarray
    end: np.ndarray
    path: list
    path_handoffs: int
    ops: list
    device_wide_waits: int
    max_device_wide_per_layer: int
    busiest_block_us: float
    max_block_bytes: float

    def summary(self) -> dict:
        """The totals as plain numbers (for reports and JSON)."""
        return dict(step_us=round(self.step_us, 2), path_instructions=len(self.path), path_handoffs=self.path_handoffs,
                    device_wide_waits=self.device_wide_waits,
                    max_device_wide_per_layer=self.max_device_wide_per_layer,
                    busiest_block_us=round(self.busiest_block_us, 2), max_block_mb=round(self.max_block_bytes / 1e6, 3))


def _is_wide(op: Op, dep: Dep, producer: Op) -> bool:
    """A device-wide wait: some tile of ``op`` waits for every tile of a producer of several."""
    if producer.tiles <= 1:
        return False
    if dep.groups is None:
        return True
    return any(len(set(gs)) >= producer.groups for gs in dep.groups)


def estimate(plan: Plan, machine: Machine | None = None) -> PlanCost:
    """Predict one step of ``plan`` on ``machine`` (module docstring, "The cost model")."""
    p = plan
    m = machine or Machine()
    n = len(p.instructions)
    by_name = {op.name: op for op in p.ops}
    op_of_glob = np.repeat(np.arange(len(p.ops)), [op.tiles for op in p.ops]) if n else np.zeros(0, np.int64)
    order = p.order if p.order is not None else np.arange(n)
    row_of_glob = np.empty(n, np.int64)
    row_of_glob[order] = np.arange(n)
    block_of_row = np.repeat(np.arange(p.blocks), np.diff(p.queue_start))
    us_per_byte = m.sms / (m.hbm_gbps * 1e3)  # one block's share of the bandwidth, bytes per microsecond
    start, end = np.zeros(n), np.zeros(n)
    pred = np.full(n, -1, np.int64)          # what decided each row's start (-1: the launch)
    via_wait = np.zeros(n, bool)
    free, last = np.zeros(p.blocks), np.full(p.blocks, -1, np.int64)
    held = [None] * p.blocks                 # (op, input) whose rows each block holds
    reached = np.zeros(max(p.n_counters, 1))   # when each counter reached its step's target
    setter = np.full(max(p.n_counters, 1), -1, np.int64)
    for k in range(n):
        row, op = row_of_glob[k], p.ops[op_of_glob[k]]
        b = block_of_row[row]
        t0, pr, w = free[b], last[b], False
        for c, _ in p.waits_of(row):
            tw = reached[c] + m.handoff_us
            if tw > t0:
                t0, pr, w = tw, setter[c], True
        cost = op.cost or Cost()
        start[row], pred[row], via_wait[row] = t0, pr, w
        tile = int(p.instructions[row, TILE])
        key = (op_of_glob[k], 0 if op.input_of is None else op.input_of[tile])
        trips = cost.trips - (cost.load_trips if held[b] == key else 0.0)
        held[b] = key
        end[row] = t0 + m.instr_us + trips * m.trip_us + cost.bytes * us_per_byte
        free[b], last[b] = end[row], row
        sig = int(p.instructions[row, SIGNAL])
        if sig >= 0 and end[row] >= reached[sig]:
            reached[sig], setter[sig] = end[row], row
    path, handoffs = [], 0
    r = int(np.argmax(end)) if n else -1
    while r >= 0:
        path.append(r)
        handoffs += int(via_wait[r])
        r = int(pred[r])
    path.reverse()
    rows_of = np.split(np.argsort(op_of_glob[order], kind="stable"), np.cumsum([op.tiles for op in p.ops])[:-1]) \
        if n else [np.zeros(0, np.int64) for _ in p.ops]
    ops, wide_per_layer, wide_total = [], {}, 0
    for op, rows in zip(p.ops, rows_of):
        cost = op.cost or Cost()
        wide = any(_is_wide(op, d, by_name[d.op]) for d in op.deps)
        wide_total += int(wide)
        kind, _, layer = op.name.partition(".")
        if wide and layer.isdigit():
            wide_per_layer[layer] = wide_per_layer.get(layer, 0) + 1
        blocks = np.bincount(block_of_row[rows], minlength=p.blocks) if len(rows) else np.zeros(p.blocks)
        waits = max((int(p.instructions[r, WAIT_COUNT]) for r in rows), default=0)
        ops.append(dict(op=op.name, tiles=op.tiles, blocks=int((blocks > 0).sum()), waits=waits, device_wide=wide,
                        bytes_per_tile=cost.bytes, trips_per_tile=cost.trips,
                        max_bytes_per_block=float(blocks.max() * cost.bytes) if len(rows) else 0.0,
                        start_us=float(start[rows].min()) if len(rows) else 0.0,
                        end_us=float(end[rows].max()) if len(rows) else 0.0))
    work = np.bincount(block_of_row, weights=end - start, minlength=p.blocks) if n else np.zeros(p.blocks)
    tile_bytes = np.array([(p.ops[i].cost or Cost()).bytes for i in op_of_glob[order]]) if n else np.zeros(0)
    block_bytes = np.bincount(block_of_row, weights=tile_bytes, minlength=p.blocks) if n else np.zeros(p.blocks)
    return PlanCost(m, float(end.max()) if n else 0.0, start, end, path, handoffs, ops, wide_total,
                    max(wide_per_layer.values(), default=0), float(work.max()) if n else 0.0,
                    float(block_bytes.max()) if n else 0.0)


__all__ = ["Op", "Dep", "Cost", "Plan", "plan", "simulate", "Machine", "PlanCost", "estimate", "INSTR_WORDS",
           "FIELDS"]
