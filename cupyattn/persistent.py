"""The host side of a persistent kernel: an op list with dependencies, planned into per-block
queues of fixed-size instructions and the counters that order them (no kernel here; NumPy only).

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
block (``blocks=1``) runs the whole global order and never waits at all.

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

from dataclasses import dataclass

import numpy as np

INSTR_WORDS = 8
OPCODE, LAYER, TILE, ARG0, ARG1, SIGNAL, WAIT_BEGIN, WAIT_COUNT = range(INSTR_WORDS)
FIELDS = ("opcode", "layer", "tile", "arg0", "arg1", "signal", "wait_begin", "wait_count")


@dataclass(frozen=True)
class Dep:
    """A consumer's need: counters of producer ``op``. ``groups`` None: every group of the
    producer, for every consumer tile; else one tuple of producer groups per consumer tile."""

    op: str
    groups: tuple | None = None


@dataclass(frozen=True)
class Op:
    """``tiles`` instructions of ``opcode``. ``group_of``: the counter group each tile signals
    (None: all one group); ``deps``: what each tile waits for; ``args``: ARG0, ARG1."""

    name: str
    opcode: int
    tiles: int
    layer: int = 0
    args: tuple = (0, 0)
    group_of: tuple | None = None
    deps: tuple = ()

    @property
    def groups(self) -> int:
        return 1 if self.group_of is None else (max(self.group_of) + 1 if self.group_of else 0)


@dataclass
class Plan:
    """Per-block queues (``instructions[queue_start[b]:queue_start[b + 1]]`` is block b's, in
    order), the ``waits`` table and the counters: op name -> (first counter, groups)."""

    blocks: int
    instructions: np.ndarray  # int32 [n, INSTR_WORDS], the queues back to back
    queue_start: np.ndarray   # int32 [blocks + 1]
    waits: np.ndarray         # int32 [max(n_waits, 1), 2] (counter, target)
    n_waits: int
    n_counters: int
    counters: dict
    ops: tuple

    def queue(self, block: int) -> np.ndarray:
        return self.instructions[self.queue_start[block]:self.queue_start[block + 1]]

    def waits_of(self, row: int) -> list[tuple[int, int]]:
        ins = self.instructions[row]
        w = self.waits[ins[WAIT_BEGIN]:ins[WAIT_BEGIN] + ins[WAIT_COUNT]]
        return [(int(c), int(t)) for c, t in w]

    def table(self, limit: int | None = None) -> str:
        """The queues as text: one line per instruction (block, position, fields, waits)."""
        names = {op.opcode: op.name.split(".")[0] for op in self.ops}
        lines = [f"plan: {len(self.instructions)} instructions on {self.blocks} blocks, {self.n_counters} counters, "
                 f"{self.n_waits} waits"]
        for b in range(self.blocks):
            for pos, row in enumerate(range(self.queue_start[b], self.queue_start[b + 1])):
                if limit is not None and pos >= limit:
                    lines.append(f"  block {b}: ... {self.queue_start[b + 1] - row} more")
                    break
                i = self.instructions[row]
                lines.append(f"  block {b} #{pos}: {names.get(int(i[OPCODE]), i[OPCODE])} layer {i[LAYER]} tile "
                             f"{i[TILE]} args ({i[ARG0]}, {i[ARG1]}) signal {i[SIGNAL]} waits {self.waits_of(row)}")
        return "\n".join(lines)


def _check_ops(ops) -> dict:
    seen: dict = {}
    for op in ops:
        if not isinstance(op, Op):
            raise TypeError(f"plan(): ops must be persistent.Op, got {type(op).__name__}")
        if op.name in seen:
            raise ValueError(f"plan(): op name {op.name!r} appears twice")
        if not isinstance(op.tiles, int) or op.tiles < 0:
            raise ValueError(f"plan(): op {op.name!r} has tiles={op.tiles!r}, expected an int >= 0")
        if op.group_of is not None and (len(op.group_of) != op.tiles or min(op.group_of, default=0) < 0):
            raise ValueError(f"plan(): op {op.name!r}: group_of must give a group >= 0 for each of its "
                             f"{op.tiles} tiles")
        for d in op.deps:
            if d.op not in seen:
                raise ValueError(f"plan(): op {op.name!r} depends on {d.op!r}, which is not an earlier op "
                                 "(the op list must be in a topological order)")
            if d.groups is not None and len(d.groups) != op.tiles:
                raise ValueError(f"plan(): op {op.name!r}: Dep({d.op!r}).groups must list groups for each of "
                                 f"its {op.tiles} tiles")
        seen[op.name] = op
    return seen


def plan(ops, blocks: int) -> Plan:
    """Lay ``ops`` (a topological order) out on ``blocks`` queues, round-robin (module docstring)."""
    ops = tuple(ops)
    _check_ops(ops)
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or blocks < 1:
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
                    if not 0 <= g < groups:
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
    glob = np.asarray(rows, dtype=np.int64).reshape(n, INSTR_WORDS)
    owner = np.arange(n) % blocks                       # round-robin
    order = np.lexsort((np.arange(n), owner))            # block 0's queue, then block 1's ...
    instr = np.ascontiguousarray(glob[order]).astype(np.int32)
    start = np.zeros(blocks + 1, np.int32)
    np.cumsum(np.bincount(owner, minlength=blocks), out=start[1:])
    w = np.asarray(waits, dtype=np.int32).reshape(-1, 2) if waits else np.zeros((1, 2), np.int32)
    return Plan(blocks, instr, start, np.ascontiguousarray(w), len(waits), n_counters, counters, ops)


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


__all__ = ["Op", "Dep", "Plan", "plan", "simulate", "INSTR_WORDS", "FIELDS"]
