"""The host plan of a persistent kernel (cupyattn.persistent) and the Llama op list tinylm plans
with it (tinylm.megakernel.llama_ops), on the CPU: round-robin queues, counters and their
step-relative targets, refusals of what is not a topological op list; a simulated run of the
queues under random interleavings finishes, a queue out of the global order deadlocks."""
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
    from tinylm.megakernel import llama_ops

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
    from tinylm.megakernel import instruction_counts, llama_ops

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
    from tinylm.megakernel import step_splits

    a = PRESETS["smollm2-135m-shape"]
    keys = config.MEGAKERNEL_MIN_KEYS_PER_SPLIT
    assert step_splits(a, 1, keys, 132, 512) == 1
    assert step_splits(a, 1, 8 * keys, 132, 512) == 8
    assert step_splits(a, 8, 64 * keys, 132, 512) == 132 // 24       # no more attention tiles than blocks
    assert step_splits(a, 1, 10 ** 6, 132, 512) == config.MEGAKERNEL_MAX_SPLITS
    assert step_splits(a, 1, 10 ** 6, 132, 3) == 3 and step_splits(a, 4, 10 ** 6, 1, 512) == 1
