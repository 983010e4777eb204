"""How many splits a decode launch takes: the one place that chooses them.

Two rules (``split_rule``, config.DECODE_SPLIT_RULES; docs in :mod:`cupyattn.decode`): "cost"
(:func:`choose_num_splits`, the default, measured on an H100) and "waves" (:func:`wave_splits`,
FlashAttention-3's wave-efficiency rule, opt-in). :func:`schedule` applies one to a launch's plan;
decode_attention, decode_attention_paged, the caches' ``decode`` and
:func:`cupyattn.auto_num_splits` (tinylm's graph buckets) all ask it. Pure host arithmetic plus
the device's SM count, no device sync.
"""
from __future__ import annotations

import functools

import numpy as np

from . import config, device
from ._checks import check_choice
from .config import DECODE_MAX_SPLITS, DECODE_MIN_KEYS_PER_SPLIT, DECODE_SPLIT_BLOCKS_PER_SM, DECODE_SPLIT_OVERHEAD_KEYS

@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, kv_heads: int, max_len: int, sm_count: int, blocks_per_sm: int = 1) -> int:
    """Split count for a decode step, from the live length, the SM count and wave quantisation.

    A launch of ``blocks = batch * kv_heads`` blocks per split (``kv_heads`` counts blocks per
    sequence: kv heads times head tiles) runs ``slots = sm_count * blocks_per_sm`` blocks at a
    time, so ``s`` splits take ``ceil(blocks * s / slots)`` waves, each as long as one split's
    work, ``ceil(max_len / s) + DECODE_SPLIT_OVERHEAD_KEYS`` key-times. The result is the ``s`` in
    ``[1, s_max]`` of least cost (the fewest splits among equals), where ``s_max =
    min(DECODE_MAX_SPLITS, max_len // DECODE_MIN_KEYS_PER_SPLIT)`` (at least 1). There is no
    other cap: a single sequence with one kv head (MQA, batch 1) gets enough splits to fill every
    SM when its length allows. ``max_len`` is the longest *live* length (not ``max_seq``).

    Pure and cheap: it visits one candidate per wave count (the fewest splits that reach the
    wave's best per-split length) and stops once no later wave can beat the best found.
    """
    blocks, slots, n = max(1, batch * kv_heads), max(1, sm_count * blocks_per_sm), max(0, max_len)
    s_max = max(1, min(DECODE_MAX_SPLITS, n // DECODE_MIN_KEYS_PER_SPLIT))
    over = DECODE_SPLIT_OVERHEAD_KEYS
    best, best_cost = 1, -(-blocks // slots) * (n + over)
    w = 1
    while (w - 1) * slots // blocks + 1 <= s_max:
        s_lo, s_hi = (w - 1) * slots // blocks + 1, min(s_max, w * slots // blocks)
        if s_hi >= s_lo:  # every s in [s_lo, s_hi] runs in exactly w waves
            k = -(-n // s_hi)                           # least keys per split in this wave count
            s = max(s_lo, -(-n // k) if k else s_lo)    # fewest splits with that many keys
            if w * (k + over) < best_cost:
                best, best_cost = s, w * (k + over)
        w += 1
        if n * blocks / slots + w * over >= best_cost:  # a lower bound on every later wave count
            break
    return best


def wave_splits(lengths, blocks_per_seq: int, sm_count: int, blocks_per_sm: int = 1) -> tuple[int, int]:
    """(num_splits, split_keys) of the "waves" rule for sequences of ``lengths`` live keys, each
    taking ``blocks_per_seq`` blocks per split (kv heads times head tiles), on ``sm_count`` SMs
    running ``blocks_per_sm`` blocks each (``slots``).

    FlashAttention-3's rule (hopper/heuristics.h): for each candidate count ``s`` in ``[1,
    s_max]`` (``s_max = min(DECODE_WAVE_MAX_SPLITS, longest // DECODE_MIN_KEYS_PER_SPLIT)``, at
    least 1) the chunk is ``K = ceil(longest / s)`` keys and sequence b takes ``max(1, ceil(len_b
    / K))`` splits (decode.cu SeqSplit, split_keys = K); its wave efficiency is the useful work over
    the waves it occupies, ``blocks_per_seq * sum(len_b) / (K * ceil(items / slots) * slots)``
    (FA3's ``n_waves / ceil(n_waves)`` when every length is the same). The answer is the smallest
    ``s`` whose efficiency is at least DECODE_WAVE_EFFICIENCY of the best. FA3 returns 1 split
    whenever the blocks fill 80% of the SMs; that shortcut is left out, since in a ragged batch
    the longest sequences then run alone at the end (the efficiency term sees that). Pure.
    """
    return _wave_splits(tuple(max(0, int(n)) for n in lengths), max(1, blocks_per_seq),
                        max(1, sm_count * blocks_per_sm))


@functools.lru_cache(maxsize=1024)
def _wave_splits(lengths: tuple, bps: int, slots: int) -> tuple[int, int]:
    lens = np.asarray(lengths, dtype=np.int64)
    longest = int(lens.max()) if lens.size else 0
    if longest == 0:
        return 1, 1
    s = np.arange(1, max(1, min(config.DECODE_WAVE_MAX_SPLITS, longest // DECODE_MIN_KEYS_PER_SPLIT)) + 1)
    keys = -(-longest // s)                                                 # K per candidate
    items = bps * np.maximum(1, -(-lens[None, :] // keys[:, None])).sum(axis=1)
    eff = bps * int(lens.sum()) / (keys * (-(-items // slots)) * slots)
    pick = int(np.argmax(eff >= config.DECODE_WAVE_EFFICIENCY * eff.max()))
    return int(s[pick]), int(keys[pick])


def check_split_rule(fn: str, split_rule) -> str:
    """``split_rule`` (None: config.DECODE_SPLIT_RULE) as one of config.DECODE_SPLIT_RULES."""
    if split_rule is None:
        return config.DECODE_SPLIT_RULE
    check_choice(fn, "split_rule", split_rule, config.DECODE_SPLIT_RULES)
    return split_rule


def schedule(rule: str, plan, batch: int, num_kv_heads: int, lengths, num_splits=None,
             win_left: int = -1) -> tuple[int, int]:
    """(num_splits, split_keys) of a launch under split rule ``rule``: ``lengths`` the sequences'
    cached lengths as known on the host (a bound for each where only that is known),
    ``win_left`` the window's left bound (a query sees at most win_left + 1 keys). "cost":
    ``num_splits`` or :func:`choose_num_splits` on the longest, uniform chunks (split_keys 0);
    "waves": ``num_splits`` (chunks of ceil(longest / num_splits) keys per sequence) or
    :func:`wave_splits`."""
    live = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if win_left >= 0:
        live = np.minimum(live, win_left + 1)
    longest = int(live.max()) if live.size else 0
    bps = num_kv_heads * plan.head_tiles
    if rule == "cost":
        if num_splits is None:
            num_splits = choose_num_splits(batch, bps, longest, sm_count(), DECODE_SPLIT_BLOCKS_PER_SM)
        return num_splits, 0
    if num_splits is None:
        return wave_splits(live, bps, sm_count(), DECODE_SPLIT_BLOCKS_PER_SM)
    return num_splits, max(1, -(-longest // num_splits))


def sm_count() -> int:
    """Streaming multiprocessors of the current device (the split rules' wave size)."""
    return device.sm_count()


