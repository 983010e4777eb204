"""K/V traffic model of the Hopper attention kernel's tile orders (NumPy; no GPU).

Causal attention at B=4 H=32 S=4096 D=128 reads 256 MB of K and V at least, but the order in
which blocks take their tiles decides how often each K/V tile comes from DRAM again: the old v3
grid put query-tile rank r of every head side by side, 128 heads in one wave, and no head's K/V
survived in L2 until its next tile (about 4.5 GB read, a 1.5 ms floor at 3 TB/s). This module
replays a tile order on a model of the device and counts the bytes the L2 misses:

- the SMs run one tile each at a time (a persistent block, or the resident block of a grid), a
  tile of ``n`` key tiles for ``n + tile_overhead`` time steps, every SM one key tile per step;
  a free SM takes the next tile of the order (a grid's block dispatch, the dynamic scheduler's
  counter), or with ``policy="stride"`` tile ``i + k * sms`` (the static persistent schedule);
- each key-tile read (K and V of ``block_n`` keys of one K/V head) goes through one LRU cache of
  ``l2_bytes`` over all SMs; a miss costs its bytes.

It is a model: the real L2 is two partitions with their own hashing, and Q and O stream through
it too (``qo=True`` counts their footprint against the capacity). Its use is ranking orders and
section sizes, and saying the floor a measured time should be compared with; ncu's
``dram__bytes_read.sum`` is the measurement (benchmarks/causal_sweep.py prints both).

Orders (:func:`tile_order`): ``"sections"``, the kernel's (kernels_cu/flash_attn_sm90_sched.cuh
``Fa3Sched::work``): sequence by sequence, query heads in sections of ``section`` heads, inside
a section query-tile ranks across its heads, heaviest first when causal; ``"v3"``, the grid of the
2026-11-27 kernel (rank r of every (batch, head) side by side), kept for comparison.
"""
from __future__ import annotations

import functools
import heapq
from collections import OrderedDict

import numpy as np

BLOCK_M = 128   # query rows per tile (kernels_cu/flash_attn_sm90.cuh FA3_BLOCK_M)


def _key_tiles(sq: int, sk: int, m0: np.ndarray, causal: bool, block_n: int) -> np.ndarray:
    """Key tiles [0, n) a query tile at rows m0.. reads (bottom-right causal, as the kernel)."""
    hi = np.full(m0.shape, sk, dtype=np.int64)
    if causal:
        last = np.minimum(m0 + BLOCK_M, sq) - 1 + (sk - sq)
        hi = np.clip(last + 1, 0, sk)
    return -(-hi // block_n)


def tile_order(b: int, hq: int, hkv: int, sq: int, sk: int, *, causal: bool, block_n: int,
               order: str = "sections", section: int | None = None):
    """(kv id, key tiles) of every tile of a dense launch, in the order blocks take them.

    ``kv id`` = batch * hkv + the K/V head the query head reads (GQA: h // (hq // hkv)).
    """
    nm = -(-sq // BLOCK_M)
    group = hq // hkv
    if order == "v3":
        # blockIdx i: (b, h) = i % (B*Hq), rank m_tiles - 1 - i // (B*Hq) when causal, else
        # head-major (the non-causal v3 grid kept each head's tiles together)
        idx = np.arange(b * hq * nm)
        if causal:
            bh, m = idx % (b * hq), nm - 1 - idx // (b * hq)
        else:
            bh, m = idx // nm, idx % nm
    elif order == "sections":
        sec = max(1, min(section or hq, hq))
        t = np.arange(b * hq * nm)
        bb, r = t // (hq * nm), t % (hq * nm)
        s = r // (sec * nm)
        h0 = s * sec
        ln = np.minimum(sec, hq - h0)
        in_sec = r - s * sec * nm
        rank = in_sec // ln
        h = h0 + in_sec % ln
        m = nm - 1 - rank if causal else rank
        bh = bb * hq + h
    else:
        raise ValueError(f"tile_order(): order must be 'sections' or 'v3', got {order!r}")
    kv = (bh // hq) * hkv + (bh % hq) // group
    return kv.astype(np.int64), _key_tiles(sq, sk, m.astype(np.int64) * BLOCK_M, causal, block_n)


def simulate(kv: np.ndarray, n_tiles: np.ndarray, *, sms: int, l2_bytes: int, tile_bytes: int,
             policy: str = "greedy", tile_overhead: int = 1, qo_bytes: int = 0) -> dict:
    """Replay tiles (``kv`` ids, ``n_tiles`` key tiles each, in order) on ``sms`` SMs through an
    LRU L2 of ``l2_bytes``; ``tile_bytes``: K + V bytes of one key tile; ``qo_bytes``: Q + O bytes
    of one tile counted against the capacity (streamed, never reused). Returns the bytes read from
    DRAM (``kv_read``), the minimum (each K/V tile once), the key-tile reads and the makespan in
    key-tile steps."""
    cap = max(1, l2_bytes // tile_bytes)
    qo_lines = qo_bytes / tile_bytes
    cache: OrderedDict = OrderedDict()
    extra = 0.0                       # Q / O footprint in lines, trimmed from the LRU end as it grows
    misses = reads = 0
    ntot = len(kv)
    kv_l, nt_l = kv.tolist(), n_tiles.tolist()
    heap = []                         # (time, sm): the SM reads its next key tile at that time
    cur = [None] * sms                # (tile index, next key tile)
    nxt = 0
    if policy == "stride":
        queues = [list(range(i, ntot, sms)) for i in range(sms)]
        for q in queues:
            q.reverse()
    for sm in range(min(sms, ntot)):
        heapq.heappush(heap, (0, sm))
    span = 0
    while heap:
        t, sm = heapq.heappop(heap)
        if cur[sm] is None:           # take a tile
            if policy == "stride":
                if not queues[sm]:
                    continue
                ti = queues[sm].pop()
            else:
                if nxt >= ntot:
                    continue
                ti, nxt = nxt, nxt + 1
            cur[sm] = [ti, 0]
            if qo_lines:
                extra += qo_lines
            if nt_l[ti] == 0:
                cur[sm] = None
                heapq.heappush(heap, (t + tile_overhead, sm))
                continue
        ti, j = cur[sm]
        key = (kv_l[ti], j)
        reads += 1
        if key in cache:
            cache.move_to_end(key)
        else:
            misses += 1
            cache[key] = None
        while len(cache) + extra > cap and cache:
            cache.popitem(last=False)
            if extra >= 1:
                extra -= 1
        j += 1
        if j == nt_l[ti]:
            cur[sm] = None
            span = max(span, t + 1 + tile_overhead)
            heapq.heappush(heap, (t + 1 + tile_overhead, sm))
        else:
            cur[sm][1] = j
            heapq.heappush(heap, (t + 1, sm))
    distinct = len({(k, j) for k, n in zip(kv_l, nt_l) for j in range(n)}) if ntot <= 50000 else None
    return {"kv_read": misses * tile_bytes, "kv_min": None if distinct is None else distinct * tile_bytes,
            "reads": reads, "misses": misses, "steps": span}


@functools.lru_cache(maxsize=256)
def dense_traffic(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, itemsize: int, causal: bool, *,
                  block_n: int, order: str = "sections", section: int | None = None, sms: int = 132,
                  l2_bytes: int = 50 * 2**20, policy: str = "greedy", qo: bool = False) -> dict:
    """The model's figures (:func:`simulate`) for a dense [B, H, S, D] launch in ``order``."""
    kv, nt = tile_order(b, hq, hkv, sq, sk, causal=causal, block_n=block_n, order=order, section=section)
    return simulate(kv, nt, sms=sms, l2_bytes=l2_bytes, tile_bytes=2 * block_n * d * itemsize, policy=policy,
                    qo_bytes=(2 * BLOCK_M * d * itemsize if qo else 0))


def section_candidates(hq: int, hkv: int) -> list[int]:
    """Section sizes worth modelling: whole GQA groups, powers of two times the group, and all heads."""
    group = hq // hkv
    out, s = [], group
    while s < hq:
        out.append(s)
        s *= 2
    return out + [hq]


@functools.lru_cache(maxsize=256)
def best_section(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, itemsize: int, causal: bool, *,
                 block_n: int, sms: int, l2_bytes: int, policy: str = "greedy") -> int:
    """The section size (query heads) whose order the model gives the fewest K/V bytes; the
    largest of the tied ones (fewer, longer sections balance the tail better). Candidates from the
    largest down, stopping at the first that reads every K/V byte once (none smaller can beat it):
    about 0.1 s per candidate at B=4 H=32 S=4096, two or three of them (memoised per shape)."""
    best = None
    for sec in reversed(section_candidates(hq, hkv)):
        got = dense_traffic(b, hq, hkv, sq, sk, d, itemsize, causal, block_n=block_n, section=sec, sms=sms,
                            l2_bytes=l2_bytes, policy=policy)
        if best is None or got["kv_read"] < best[0]:
            best = (got["kv_read"], sec)
        if got["kv_read"] == got["kv_min"]:
            break
    return best[1]
