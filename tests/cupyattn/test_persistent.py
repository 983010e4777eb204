"""The host plan of a persistent kernel (cupyattn.persistent) and the Llama op list planned with
it (cupyattn.megakernel_llama.llama_ops), on the CPU: round-robin queues, counters and their
step-relative targets, refusals of what is not a topological op list or does not fit the
kernel's int32 words; a simulated run of the queues under random interleavings finishes, a
queue out of the global order deadlocks; the cost model in closed form."""
from __future__ import annotations

import numpy as np
import pytest

from cupyattn.persistent import SIGNAL, TILE, WAIT_COUNT, Dep, Op, plan, simulate


def _chain():
    """a (4 tiles, 2 groups) -> b (3 tiles, each waiting for one group of a) -> c (2 tiles, all of b)."""
    return [Op("a", 1, 4, group_of=(0, 1, 0, 1)),
            Op("b", 2, 3, deps=(Dep("a", ((0,), (1,), (0, 1))),)),
            Op("c", 3, 2, layer=5, args=(7, 9), deps=(Dep("b"),))]


def test_plan_lays_out_round_robin_with_step_relative_targets():
    p = plan(_chain(), 2)
    print(p.table())
    # global order a0 a1 a2 a3 b0 b1 b2 c0 c1: instruction k on block k % 2
    assert p.queue_start.tolist() == [0, 5, 9]
    assert [(int(i[0]), int(i[TILE])) for i in p.queue(0)] == [(1, 0), (1, 2), (2, 0), (2, 2), (3, 1)]
    assert [(int(i[0]), int(i[TILE])) for i in p.queue(1)] == [(1, 1), (1, 3), (2, 1), (3, 0)]
    assert p.counters == {"a": (0, 2), "b": (2, 1)} and p.n_counters == 3
    rows = {(int(i[0]), int(i[TILE])): r for r, i in enumerate(p.instructions)}
    # a's tiles signal their group's counter; nobody waits for c, so c signals nothing
    assert [int(p.instructions[rows[1, t], SIGNAL]) for t in range(4)] == [0, 1, 0, 1]
    assert all(int(p.instructions[rows[3, t], SIGNAL]) == -1 for t in range(2))
    # targets: how many tiles signal the counter in one step (2 per group of a, 3 for b)
    assert [p.waits_of(rows[2, t]) for t in range(3)] == [[(0, 2)], [(1, 2)], [(0, 2), (1, 2)]]
    assert p.waits_of(rows[3, 0]) == [(2, 3)] and p.waits_of(rows[1, 0]) == []
    assert p.instructions[rows[3, 1]][3:5].tolist() == [7, 9] and int(p.instructions[rows[3, 1]][1]) == 5


def test_plan_refuses_what_is_not_a_topological_op_list():
    with pytest.raises(ValueError, match=r"plan\(\): op 'b' depends on 'z', which is not an earlier op"):
        plan([Op("b", 1, 1, deps=(Dep("z"),))], 1)
    with pytest.raises(ValueError, match="appears twice"):
        plan([Op("a", 1, 1), Op("a", 1, 1)], 1)
    with pytest.raises(ValueError, match="group_of must give a group"):
        plan([Op("a", 1, 2, group_of=(0,))], 1)
    with pytest.raises(ValueError, match=r"Dep\('a'\).groups must list groups for each of its 2 tiles"):
        plan([Op("a", 1, 1), Op("b", 1, 2, deps=(Dep("a", ((0,),)),))], 1)
    with pytest.raises(ValueError, match="waits for group 3 of 'a', which has 1"):
        plan([Op("a", 1, 1), Op("b", 1, 1, deps=(Dep("a", ((3,),)),))], 1)
    with pytest.raises(ValueError, match="blocks must be an int >= 1"):
        plan(_chain(), 0)


@pytest.mark.parametrize("blocks", [1, 3, 7, 132])
def test_simulated_queues_finish_under_any_interleaving(blocks):
    """Every block runs as far as its waits allow, in a random order each move: all finish. One
    block runs the global order and never waits."""
    from tinylm.config import PRESETS
    from cupyattn.megakernel_llama import llama_ops

    p = plan(llama_ops(PRESETS["tiny"].with_(n_layers=3), 2, 3), blocks)
    for seed in range(3):
        ran = simulate(p, np.random.default_rng(seed))
        assert sorted(r for _, r in ran) == list(range(len(p.instructions)))
    if blocks == 1:
        assert [r for _, r in simulate(p)] == list(range(len(p.instructions)))


def test_a_queue_out_of_the_global_order_deadlocks():
    """The reason queues follow the global order: swap a consumer before its producer on one block
    while the other block waits for that consumer, and no interleaving finishes."""
    p = plan([Op("a", 1, 1), Op("b", 2, 1, deps=(Dep("a"),)), Op("c", 3, 1, deps=(Dep("b"),)),
              Op("d", 4, 1, deps=(Dep("c"),))], 2)
    # block 0: a, c; block 1: b, d. Put c before a on block 0: c waits for b, b for a.
    p.instructions[[0, 1]] = p.instructions[[1, 0]]
    with pytest.raises(RuntimeError, match=r"simulate\(\): deadlock: blocks \[0, 1\]"):
        simulate(p)


def test_llama_ops_of_smollm2():
    """SmolLM2-135M's decode step at batch 1: instruction counts per op from the shapes (hidden 576,
    FFN 1536, 9 + 3 + 3 heads of 64, vocab 49152, 30 layers), a kv head's attention waiting for
    the 5 heads' QKV tiles of its group (3 q, k, v: 5 x 4 tiles), and the merge present only when
    the keys are split."""
    from tinylm.config import PRESETS
    from cupyattn.megakernel_llama import instruction_counts, llama_ops

    a = PRESETS["smollm2-135m-shape"]
    one = instruction_counts(llama_ops(a, 1, 1))
    assert one == {"embed": 1, "qkv": 30 * 15 * 4, "attn": 30 * 3, "oproj": 30 * 36, "gate_up": 30 * 192,
                   "down": 30 * 36, "lm_head": 3072, "sample": 1}
    ops = llama_ops(a, 2, 4, sample=False)
    assert instruction_counts(ops)["reduce"] == 30 * 2 * 3 and "sample" not in instruction_counts(ops)
    p = plan(ops, 132)
    rows = [r for r, i in enumerate(p.instructions) if i[0] == ops[2].opcode and i[1] == 0]  # attention, layer 0
    first = p.counters["qkv.0"][0]
    assert sorted({tuple(p.waits_of(r)[0]) for r in rows}) == [(first + g, 20) for g in range(3)]
    assert max(int(w) for w in p.instructions[:, WAIT_COUNT]) == 1  # every instruction waits for one counter


def test_step_splits():
    from cupyattn import config
    from tinylm.config import PRESETS
    from cupyattn.megakernel_llama import step_splits

    a = PRESETS["smollm2-135m-shape"]
    keys = config.MEGAKERNEL_MIN_KEYS_PER_SPLIT
    assert step_splits(a, 1, keys, 132, 512) == 1
    assert step_splits(a, 1, 8 * keys, 132, 512) == 8
    assert step_splits(a, 8, 64 * keys, 132, 512) == 132 // 24       # no more attention tiles than blocks
    assert step_splits(a, 1, 10 ** 6, 132, 512) == config.MEGAKERNEL_MAX_SPLITS
    assert step_splits(a, 1, 10 ** 6, 132, 3) == 3 and step_splits(a, 4, 10 ** 6, 1, 512) == 1


# --- validation (every op checked before anything is laid out) -------------------------------------
@pytest.mark.parametrize("op, pattern", [
    (Op("a", 2 ** 40, 1), r"plan\(\): ops\[0\] \('a'\): opcode=1099511627776 does not fit an int32 instruction word"),
    (Op("a", -2 ** 31 - 1, 1), "opcode=-2147483649 does not fit"),
    (Op("a", True, 1), r"opcode must be an int, got True \(bool\)"),
    (Op("a", 1.0, 1), r"opcode must be an int, got 1.0 \(float\)"),
    (Op("a", 1, True), r"op 'a' has tiles=True, expected an int >= 0"),
    (Op("a", 1, 2.0), r"op 'a' has tiles=2.0, expected an int >= 0"),
    (Op("a", 1, -1), r"op 'a' has tiles=-1, expected an int >= 0"),
    (Op("a", 1, 2 ** 31), r"tiles=2147483648 does not fit an int32 instruction word"),
    (Op("a", 1, 1, layer=2 ** 31), "layer=2147483648 does not fit"),
    (Op("a", 1, 1, layer=False), r"layer must be an int, got False \(bool\)"),
    (Op("a", 1, 1, args=(1, 2 ** 33)), r"args\[1\]=8589934592 does not fit"),
    (Op("a", 1, 1, args=(1, 2, 3)), "args must be a tuple of at most 2 ints"),
    (Op("a", 1, 1, args=("x",)), r"args\[0\] must be an int, got 'x' \(str\)"),
    (Op("a", 1, 2, group_of=(0, 0.5)), "group_of must give a group >= 0 for each of its 2 tiles, got 0.5"),
    (Op("a", 1, 2, group_of=(0, -1)), "got -1"),
    (Op("", 1, 1), r"ops\[0\]: name must be a non-empty str"),
    (Op("a", 1, 1, deps=(Dep("a"),)), "depends on 'a', which is not an earlier op"),
    (Op("a", 1, 1, deps=("b",)), r"deps must hold persistent.Dep, got str"),
    (Op("a", 1, 1, cost=(1, 2)), r"cost must be a persistent.Cost or None, got tuple"),
])
def test_plan_validates_every_op_with_a_clear_error(op, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern):
        plan([op], 2)


def test_plan_validates_the_op_list_and_blocks():
    with pytest.raises(TypeError, match=r"plan\(\): ops must be a sequence of persistent.Op, got str"):
        plan("abc", 1)
    with pytest.raises(TypeError, match=r"plan\(\): ops\[1\] must be a persistent.Op, got dict"):
        plan([Op("a", 1, 1), {"name": "b"}], 1)
    with pytest.raises(ValueError, match="waits for group True of 'a'"):
        plan([Op("a", 1, 2, group_of=(0, 1)), Op("b", 2, 1, deps=(Dep("a", ((True,),)),))], 1)
    for bad in (True, 1.0, 2 ** 31, -1):
        with pytest.raises(ValueError, match="blocks must be an int >= 1"):
            plan(_chain(), bad)
    p = plan([Op("a", np.int64(3), np.int32(2), layer=np.int16(1))], np.int64(2))  # NumPy ints are ints
    assert p.instructions[:, 0].tolist() == [3, 3] and p.instructions.dtype == np.int32


# --- the cost model ------------------------------------------------------------------------------------
def test_cost_model_in_closed_form():
    """a (2 tiles, 1 trip) on blocks 0 and 1; b (2 tiles, 2 trips) waits for a; c (1 tile of 2000
    bytes) waits for b. With 0.5 us per instruction, 1 us per trip, 3 us per hand-off and 1000
    bytes per us per block: a ends at 1.5, b starts at 1.5 + 3 and ends at 7, c starts at 10 and
    ends at 10 + 0.5 + 2 = 12.5; the critical path is a -> b -> c with two hand-offs."""
    from cupyattn.persistent import Cost, Machine

    ops = [Op("a", 1, 2, cost=Cost(0, 1)), Op("b", 2, 2, deps=(Dep("a"),), cost=Cost(0, 2)),
           Op("c", 3, 1, deps=(Dep("b"),), cost=Cost(2000, 0))]
    p = plan(ops, 2)
    m = Machine(sms=2, hbm_gbps=2.0, handoff_us=3.0, trip_us=1.0, instr_us=0.5)
    c = p.cost(m)
    assert c.step_us == pytest.approx(12.5)
    assert [round(r["start_us"], 6) for r in c.ops] == [0.0, 4.5, 10.0]
    assert [round(r["end_us"], 6) for r in c.ops] == [1.5, 7.0, 12.5]
    assert len(c.path) == 3 and c.path_handoffs == 2
    assert [p.ops[int(np.searchsorted(np.cumsum([o.tiles for o in p.ops]), p.order[r], side="right"))].name
            for r in c.path] == ["a", "b", "c"]
    assert [r["device_wide"] for r in c.ops] == [False, True, True] and c.device_wide_waits == 2
    assert c.busiest_block_us == pytest.approx(1.5 + 2.5 + 2.5) and c.max_block_bytes == 2000
    text = p.table(machine=m)
    assert "step 12.5 us; critical path 3 instructions, 2 hand-offs" in text and "block 0 #0" not in text
    assert "block 0 #0: a layer 0 tile 0" in p.table(limit=1, machine=m)
    # one block: everything in a row, each wait still a hand-off (the block polls its own release)
    one = plan(ops, 1).cost(m)
    assert len(one.path) == 5 and one.step_us == pytest.approx(3 + 3 + 5 + 3 + 2.5)


def test_cost_model_skips_the_load_of_rows_a_block_holds():
    """A tile whose block ran a tile of the same op and input just before skips its load's trips
    (the kernel keeps the input rows in shared memory): on one block, 4 tiles of 3 trips (2 of them
    the load) cost 3 + 1 + 1 + 1 trips with one input, 3 each when every tile reads another, and
    3 + 1 + 3 + 1 with inputs (0, 0, 1, 1); another op in between drops what the block held."""
    from cupyattn.persistent import Cost, Machine

    m = Machine(sms=1, hbm_gbps=1.0, handoff_us=0.0, trip_us=1.0, instr_us=0.0)
    cost = Cost(0, 3, 2)
    for input_of, want in ((None, 6), ((0, 1, 2, 3), 12), ((0, 0, 1, 1), 8)):
        assert plan([Op("a", 1, 4, cost=cost, input_of=input_of)], 1).cost(m).step_us == pytest.approx(want)
    ops = [Op("a", 1, 1, cost=cost), Op("b", 2, 1, cost=Cost(0, 1)), Op("c", 3, 1, cost=cost)]
    assert plan(ops, 1).cost(m).step_us == pytest.approx(3 + 1 + 3)
    assert plan(ops[:1] + [Op("a2", 1, 1, cost=cost)], 1).cost(m).step_us == pytest.approx(6)  # another op: no reuse
