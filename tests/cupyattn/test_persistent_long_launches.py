"""Long launches of the persistent kernels: one block takes hundreds of work items in one launch.

A persistent kernel reuses its rings' slots, its mbarriers' phases and its counters once per work
item, so whatever drifts per use (an mbarrier count one off, a phase bit, a stage index that wraps
wrong, a counter's target or epoch) shows only after many uses: an mbarrier initialised with one
arrival too few deadlocks at its 256th use. The other tests give a block a few work items; these
give one block hundreds, at shapes small enough for CI (on the CPU emulator, tests/emu: most work
items are cheap, a tile with no key or a GEMV tile of 16 rows). GPU tier, on a GPU or the emulator,
against the float64 references on fresh inputs with outliers; outputs NaN-poisoned.

- the persistent Hopper attention (flash_attn_sm90_persistent.cu, impl="wgmma_persistent") on a
  grid of one block: 600 tiles from the dynamic schedule's counter, twice (the counter back at 0
  after 600 claims); a few of them see keys whose V rows past the length hold NaN (the loader
  zeroes them: the proxy fences and the __syncwarp before lane 0's arrival);
- the megakernel (megakernel.cu, the queue from cupyattn/persistent.py's plan) on one block: an
  LM head of 600 tiles that stream their weights through the ring, each signalling one counter
  that the sampling tiles wait for (target 600), two steps in a row (the counter sets swap).
"""
import numpy as np
import pytest

from conftest import assert_close, nan_like, rand_with_outliers, skip_unless_device_runs, to_device, to_host
from cupyattn import reference as ref

# Work items of the one block per launch: the attention's work ring has 2 slots, so each slot's
# barriers see TILES / 2 uses, more than the 288 arrivals its empty barrier counts (256 consumer
# threads and 32 loader lanes): one initialised an arrival short drifts one phase per use and goes
# wrong (a deadlock, a slot read twice) at its 288th.
TILES = 600


@pytest.mark.gpu
def test_persistent_attention_one_block_hundreds_of_tiles(monkeypatch):
    """300 sequences x 2 query heads, one query row each: 600 causal tiles (the dynamic schedule)
    on one block. Most sequences have no key (key_lengths 0: the work ring and the scheduler only,
    zeros out); every 20th has 1..64 keys of 70, the rest of its K / V rows NaN."""
    skip_unless_device_runs("attention", "wgmma_persistent", "float16")
    import cupy

    import cupyattn
    from cupyattn import flash_attn_sm90_persistent as P
    from test_attention_wgmma_persistent import _counter_is_zero

    monkeypatch.setattr(P, "_sm_count", lambda: 1)
    rng = np.random.default_rng(6060)
    b, hq, sk, d = TILES // 2, 2, 70, 64
    kl = np.zeros(b, dtype=np.int32)
    kl[::20] = rng.integers(1, 65, size=len(kl[::20]))
    for _ in range(2):  # launch after launch: the last claim of each resets the counter
        (q, qr), (k, kr), (v, vr) = (to_device(rand_with_outliers(rng, s), "float16")
                                     for s in ((b, hq, 1, d), (b, 1, sk, d), (b, 1, sk, d)))
        for i in np.flatnonzero(kl):
            k[i, :, kl[i]:] = np.nan
            v[i, :, kl[i]:] = np.nan
        out = nan_like((b, hq, 1, d), "float16")
        cupyattn.attention(q, k, v, causal=True, key_lengths=cupy.asarray(kl), impl="wgmma_persistent", out=out)
        assert_close(out, ref.attention(qr, kr, vr, causal=True, key_lengths=kl), "float16")
        assert np.all(to_host(out)[kl == 0] == 0.0)  # no key seen: zeros
        _counter_is_zero()


@pytest.mark.gpu
def test_megakernel_one_block_hundreds_of_instructions():
    """One block runs an LM head of 600 tiles (vocabulary 9600: 600 weight chunks through the
    6-slot ring), each signalling the counter the 3 sampling tiles wait for, in two steps (the
    second counts in the other counter set): the logits and the greedy tokens of each step are
    right."""
    skip_unless_device_runs("megakernel", "persistent", "float16")
    import cupy

    from cupyattn.megakernel import OPCODES
    from cupyattn.persistent import Dep, Op
    from test_megakernel import _Model, _op

    rng = np.random.default_rng(6061)
    m = _Model(rng, "float16", v=16 * TILES)
    m.sampling.set(0.0, seed=5)  # greedy
    ops = [_op("lm_head", m, layer=0), Op("sample", OPCODES["sample"], 3, deps=(Dep("lm_head"),))]
    assert ops[0].tiles == TILES
    want = ref.gemm_nt(ref.rmsnorm(m.h.x, m.h.out_norm, 1e-5), m.h.tok)
    dplan = m.step.plan(ops)
    for step in range(2):
        m.logits[...] = np.nan
        m.step.launch(dplan, 1)
        assert_close(m.logits, want, "float16")
        got = to_host(m.logits)  # the reference sampler on the kernel's logits (its ties broken the same way)
        assert cupy.asnumpy(m.tokens).tolist() == [ref.sample_token(got[i], 0.0, 0, 1.0, seed=5 + i, step=step)
                                                   for i in range(3)], step
        assert cupy.asnumpy(m.step.step_state)[0] == step + 1  # the epoch: steps done
