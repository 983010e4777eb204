"""CPU tier: the emulated GPU tier catches the bug classes that only a GPU's timing shows
otherwise. Each mutant below is one seeded bug of a named class, applied as a text edit to a real
kernel source (a copy of kernels_cu/); the op that launches it runs on the CPU emulator at a small
shape under 3 schedules and must fail (a wrong result against the float64 reference, NaN, or an
emulator error). The unmutated sources must pass the same runs, so a catch is the mutant's doing.
The memory-model classes (a stage released before the wgmma reading it retired, a missing
fence.proxy.async, a missing release or acquire around the split-KV combine's ticket or the
megakernel's counters, a missing barrier before a counter's release; a missing __syncwarp between
the loader lanes' zeroing and lane 0's arrival, a work slot released before its last read, an
mbarrier count one short of its arrivals, __ldg of another block's output of the launch) must fail
under every one of the 3 schedules, not some: the emulator catches them by its model
(tests/emu/README.md, "The memory model"), not by a lucky timing. So must the persistent kernel's tile counter left unreset
(its claims are relaxed atomic adds that publish no data, so there is no release or acquire to
delete; what a launch must get right is that its last claim returns the counter to 0 for the next
launch).

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiers

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
ROOT = Path(__file__).resolve().parents[2]

_GEMM_WAIT = "            cp_async_wait<STAGES - 2>();\n"
_GEMM_BAR = "            __syncthreads();\n"
_GEMM_REFILL = "            if (kt + STAGES - 1 < nk) load_stage((kt + STAGES - 1) % STAGES, (kt + STAGES - 1) * T_BK);\n"
_FLASH_RETIRE = ("        if (jt > 0) {  // K_j has landed for every thread; every warp is done with P V_{j-1}\n"
                 "            cp_async_wait<0>();\n"
                 "            __syncthreads();\n"
                 "        }\n")
_FLASH_V = ("        stage_rows<T, BLOCK_N, HEAD_DIM, LDS, THREADS>(v_s, seq.v, n0, k_end - n0, vec & 4);\n"
            "        cp_async_commit();\n")
_FLASH_COMMENT = ("        // Issue V_j (into the V buffer P V_{j-1} released) and K_{j+1} (into the K stage S_{j-1}\n"
                  "        // released); two groups, so that the V wait below can leave K_{j+1} in flight.\n")

_RING_NEXT = ("        cp_async_wait<MK_STAGES - 2>();\n        __syncthreads();\n"
              "        const unsigned char* slot = ring + (consumed % MK_STAGES) * MK_STAGE_BYTES;\n"
              "        ++consumed;\n        issue_one();\n")

_GEMM_WG_RELEASE = ("        wgmma_wait_group<1>();                               // k-block kb-1 has read its stage\n"
                    "        if (prev >= 0 && leader) ring.release(prev);\n")
_FA3_RETIRE_PV = ("        wgmma_wait_group<0>();                            // P_{j-1} V_{j-1} has retired\n"
                  "        wgmma_fence_acc(o);\n        wgmma_fence_frag(p);\n        if (j > 0) {\n"
                  "            if (q.leader) q.vring.release(q.vring.stage);  // V_{j-1} read\n")
_TICKET = "        last = atomic_add_acq_rel(counter, 1u) == n - 1u;\n"  # ptx.cuh last_block_ticket
_SCHED_RESET = ("            if (old == (unsigned)total - 1u) atomic_add_relaxed(counter, 0u - (unsigned)total);"
                "  // the launch's last add\n")

# Snippets the other classes match as patterns (re): short and stable, so that a modest refactor of the
# kernel keeps them applicable; a pattern that no longer matches exactly once fails the test loudly.
# The loader lanes' __syncwarp between their zeroing (each lane's stores and its fence.proxy.async) and
# lane 0's arrival that publishes the V slot (flash_attn_sm90.cuh, v3 and v4 alike):
_FA3_TAIL_SYNCWARP = re.compile(r"__syncwarp\(\);[^\n]*\n(\s*if \(lane == 0\) mbar_arrive\()")
# The Hopper attention's consumers release their work slot after the epilogue, which reads the slot:
_FA3_STORE_RELEASE = re.compile(r"(\n[ \t]*)(\w*_store<[^;]*;[^\n]*)\n[ \t]*wring\.release\(wring\.stage\);[^\n]*")
# The work ring's empty barrier: its count, one arrival short (every thread that releases the slot)
_FA3_WRING_INIT = re.compile(r"(wring\.init\()([^;]*)(\);)")

# (bug class, file, text, mutated text, op, every): each text (a string, or a compiled pattern and its
# replacement) must occur exactly once in the file; every: the mutant must fail under every schedule
# (else under at least one)
MUTANTS = [
    ("barrier removed (softmax v3: red_l read before every warp wrote it)", "row_softmax.cu",
     "    if (lane == 0) red_l[warp] = l;\n    __syncthreads();\n", "    if (lane == 0) red_l[warp] = l;\n",
     "softmax_block"),
    ("ring refill moved before the barrier that retires its readers (gemm.cu mma ring)", "gemm.cu",
     _GEMM_WAIT + _GEMM_BAR + _GEMM_REFILL, _GEMM_WAIT + _GEMM_REFILL + _GEMM_BAR, "gemm_mma"),
    ("ring refill moved before the barrier that retires its readers (flash_attn.cu V buffer)", "flash_attn.cu",
     _FLASH_RETIRE + _FLASH_COMMENT + _FLASH_V, _FLASH_V + _FLASH_RETIRE + _FLASH_COMMENT, "flash_mma"),
    ("cp.async.wait_group count off by one (gemm.cu mma ring)", "gemm.cu",
     _GEMM_WAIT, "            cp_async_wait<STAGES - 1>();\n", "gemm_mma"),
    ("shuffle over a partial mask (common.cuh warp max)", "common.cuh",
     "v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));", "v = fmaxf(v, __shfl_xor_sync(0x0000ffffu, v, o));",
     "softmax_warp"),
    ("tail read past the end (a row's last tile loaded without its bound: row_softmax.cu row_load)",
     "row_softmax.cu", "v[i] = j < kv ? to_float(xr[j]) * scale : -CUDART_INF_F;", "v[i] = to_float(xr[j]) * scale;",
     "softmax_warp"),
    ("stage released before the wgmma reading it retired (gemm_sm90.cu ring)", "gemm_sm90.cu",
     _GEMM_WG_RELEASE, "".join(reversed(_GEMM_WG_RELEASE.splitlines(keepends=True))), "gemm_wgmma", True),
    ("fence.proxy.async deleted after the generic stores a wgmma reads (flash_attn_sm90.cuh V-tail zeroing)",
     "flash_attn_sm90.cuh", "    fence_proxy_async_shared();                           // generic stores -> visible to wgmma\n",
     "", "flash_wgmma", True),
    ("V slot released before the P V wgmma reading it retired (flash_attn_sm90.cuh)", "flash_attn_sm90.cuh",
     _FA3_RETIRE_PV, _FA3_RETIRE_PV.splitlines(keepends=True)[-1] + "".join(_FA3_RETIRE_PV.splitlines(keepends=True)[:-1]),
     "flash_wgmma", True),
    ("release deleted: the split-KV combine's ticket relaxed, an acquire fence after it (ptx.cuh)", "ptx.cuh",
     _TICKET, "        last = atomic_add_relaxed(counter, 1u) == n - 1u;\n        fence_acq_rel_gpu();\n",
     "decode_fused", True),
    ("acquire deleted: the split-KV combine's ticket relaxed, a release fence before it (ptx.cuh)", "ptx.cuh",
     _TICKET, "        fence_acq_rel_gpu();\n        last = atomic_add_relaxed(counter, 1u) == n - 1u;\n",
     "decode_fused", True),
    ("no block barrier between the split's partial stores and the ticket's release (ptx.cuh)", "ptx.cuh",
     "    __syncthreads();  // every thread's earlier accesses precede the ticket's release\n", "", "decode_fused", True),
    # the megakernel's weight ring (megakernel_gemv.cuh), one block: its LM-head tiles wrap the ring 3 times
    ("cp.async.wait_group count off by one (megakernel weight ring)", "megakernel_gemv.cuh",
     "        cp_async_wait<MK_STAGES - 2>();\n", "        cp_async_wait<MK_STAGES - 1>();\n", "megakernel"),
    ("ring refill moved before the barrier that retires its readers (megakernel weight ring)", "megakernel_gemv.cuh",
     _RING_NEXT, _RING_NEXT.replace("        __syncthreads();\n", "").replace("        issue_one();\n", "")
     .replace("cp_async_wait<MK_STAGES - 2>();\n", "cp_async_wait<MK_STAGES - 2>();\n        issue_one();\n"
              "        __syncthreads();\n"), "megakernel"),
    # the megakernel's ring attention (megakernel_attention.cuh), one block: 151 keys in 3 staged chunks
    ("cp.async.wait_group count off by one (megakernel ring attention)", "megakernel_attention.cuh",
     "        if (c + 1 < nchunks) cp_async_wait<1>();\n", "        if (c + 1 < nchunks) cp_async_wait<2>();\n",
     "megakernel_ring"),
    ("ring refill moved before the barrier that retires its readers (megakernel ring attention)",
     "megakernel_attention.cuh",
     "        if (c >= 0) __syncthreads();  // every thread is done with chunk c - 1 (its slot refills next)\n", "",
     "megakernel_ring"),
    ("tile counter not reset by the launch's last claim (flash_attn_sm90_sched.cuh: the next launch skips tiles)",
     "flash_attn_sm90_sched.cuh", _SCHED_RESET, "", "flash_persistent", True),
    # lanes of one warp out of step: without the __syncwarp, lane 0 publishes the slot while other lanes
    # may not have zeroed their rows yet, or their fences are not ordered before the consumers' wgmma
    ("__syncwarp deleted between the loader lanes' zeroing and lane 0's arrival (flash_attn_sm90.cuh, v3)",
     "flash_attn_sm90.cuh", _FA3_TAIL_SYNCWARP, r"\1", "flash_wgmma", True),
    ("__syncwarp deleted between the loader lanes' zeroing and lane 0's arrival (flash_attn_sm90.cuh, v4)",
     "flash_attn_sm90.cuh", _FA3_TAIL_SYNCWARP, r"\1", "flash_persistent_tail", True),
    # an early release on a ring whose producer publishes with a plain arrive: the scheduler refills the
    # work slot while consumers still read it
    ("work slot released before the epilogue reads it (flash_attn_sm90.cu consumers, persistent)",
     "flash_attn_sm90.cu", _FA3_STORE_RELEASE, r"\1wring.release(wring.stage);\1\2", "flash_persistent", True),
    # an mbarrier initialised with one arrival too few (init(255) where 256 consumer threads and the
    # loader arrive, init(287) where the 32 loader lanes do)
    ("mbarrier count one short of its arrivals (flash_attn_sm90.cu work ring)", "flash_attn_sm90.cu",
     _FA3_WRING_INIT, r"\g<1>\g<2> - 1\g<3>", "flash_persistent", True),
    # a non-coherent load (ld.global.nc) of what another block wrote in the same launch
    ("__ldg of another block's output of the same launch (decode.cu split-KV combine's partials)", "decode.cu",
     "__ldcg(o_part + ", "__ldg(o_part + ", "decode_fused", True),
    ("__ldg of another block's output of the same launch (megakernel_gemv.cuh input rows)", "megakernel_gemv.cuh",
     "__ldcg(src + c0", "__ldg(src + c0", "megakernel_blocks", True),
]
# The megakernel's counters between blocks (megakernel.cu): caught only by an emulator with a memory
# model and several blocks in flight while others spin; the op runs gate|up then down
# (whose tiles wait for every gate|up tile) on 4 blocks.
ORDER_MUTANTS = [
    ("counter released without release semantics", "megakernel.cu",
     "signal_release(ctr + ins.signal, 1u);", "atomic_add_relaxed(ctr + ins.signal, 1u);", "megakernel_blocks"),
    ("counter awaited without acquire semantics", "megakernel.cu",
     "wait_acquire(ctr + w[0], (unsigned)w[1], (unsigned)m.spin_ns);",
     "while ((int)(atomic_add_relaxed(ctr + w[0], 0u) - (unsigned)w[1]) < 0) __nanosleep(32);", "megakernel_blocks"),
    ("no block barrier between an instruction's writes and its release", "megakernel.cu",
     "        __syncthreads();  // every thread's writes of the instruction precede the release\n", "",
     "megakernel_blocks"),
]
MUTANTS = [m if len(m) == 6 else m + (False,) for m in MUTANTS]
ORDER_MUTANTS = [m + (True,) for m in ORDER_MUTANTS]  # the memory model catches each every time
# Second instances of a class caught above in another kernel (the same mistake elsewhere): each
# mutant costs a g++ build of its kernel and 3 runs, so the test command runs one instance per
# class and CUPYATTN_FULL=1 these too (docs/testing.md).
SECOND_INSTANCES = {
    "ring refill moved before the barrier that retires its readers (flash_attn.cu V buffer)",
    "cp.async.wait_group count off by one (megakernel weight ring)",
    "ring refill moved before the barrier that retires its readers (megakernel weight ring)",
    "cp.async.wait_group count off by one (megakernel ring attention)",
    "ring refill moved before the barrier that retires its readers (megakernel ring attention)",
    "counter released without release semantics",   # the split-KV ticket's relaxed-ticket mutants
    "counter awaited without acquire semantics",    # (ptx.cuh last_block_ticket) stand for these
    "__syncwarp deleted between the loader lanes' zeroing and lane 0's arrival (flash_attn_sm90.cuh, v4)",
    "__ldg of another block's output of the same launch (megakernel_gemv.cuh input rows)",
}
# a release-early, a missing proxy fence and a missing release / acquire each stay in the
# default run for the wgmma GEMM, the wgmma attention and the split-KV combine
assert SECOND_INSTANCES <= {m[0] for m in MUTANTS + ORDER_MUTANTS}

SCRIPT = r'''
import os, re, shutil, sys, tempfile
from pathlib import Path
os.environ["CUPYATTN_EMULATE"] = "1"
os.environ["CUPYATTN_QUIET"] = "1"
sys.path.insert(0, {root!r})  # this checkout's cupyattn and kernels_cu, whatever is installed
sys.path.insert(0, {tests!r})
sys.path.insert(0, {tests!r} + "/cupyattn")  # test_megakernel's model
import conftest  # installs the emulated cupy
import cupy
import numpy as np
from conftest import assert_close, nan_like, rand_with_outliers, to_device
import cupyattn
from cupyattn import _loader, reference as ref

MUTANTS = {mutants!r}
ORIGINAL = _loader.KERNELS_DIR

CHUNK = cupy._cupyattn_emulator_chunk

def use_sources(path):
    _loader.KERNELS_DIR = Path(path)
    _loader._code.cache_clear()
    _loader._FUNCTIONS.clear()
    # a mutant's kernel is built alone (its source is built once); the controls by the chunks the
    # emulated tier builds anyway
    cupy._cupyattn_emulator_chunk = CHUNK if Path(path) == ORIGINAL else 1

def run(op, seed):
    """One run of `op` at a small odd shape on fresh inputs; raises if the result is wrong."""
    rng = np.random.default_rng(seed)
    if op == "gemm_mma":
        a, a64 = to_device(rand_with_outliers(rng, (70, 200)), "float16")
        b, b64 = to_device(rand_with_outliers(rng, (40, 200), scale=0.1), "float16")
        out = nan_like((70, 40), "float16")
        cupyattn.gemm_nt(a, b, out=out, impl="mma")
        assert_close(out, ref.gemm_nt(a64, b64), "float16")
    elif op == "gemm_wgmma":  # K = 456: 8 k-blocks through the 4- or 6-stage ring, which wraps
        pitch = (rng.standard_normal((17, 456)), rng.standard_normal((40, 456)) * 0.1)
        (a, a64), (b, b64) = (to_device(x, "float16") for x in pitch)
        out = nan_like((17, 40), "float16")
        cupyattn.gemm_nt(a, b, out=out, impl="wgmma")
        assert_close(out, ref.gemm_nt(a64, b64), "float16")
    elif op == "flash_wgmma":  # 4 key tiles of 128 through the 3-slot rings; the last ends at key 430
        q, k, v = (to_device(rand_with_outliers(rng, (1, 1, s, 64)), "float16") for s in (17, 450, 450))
        kl = np.array([430], dtype=np.int32)
        k[0][..., 430:, :] = np.nan  # an unwritten cache past the length: the V rows must be zeroed
        v[0][..., 430:, :] = np.nan
        out = nan_like((1, 1, 17, 64), "float16")
        cupyattn.attention(q[0], k[0], v[0], key_lengths=cupy.asarray(kl), impl="wgmma", out=out)
        assert_close(out, ref.attention(q[1], k[1], v[1], key_lengths=kl), "float16")
    elif op == "decode_fused":  # 3 splits per (sequence, head tile); their last block merges them
        from cupyattn.kvcache import KVCache
        b, hq, hkv, d, lengths = 2, 4, 2, 32, [70, 45]
        cache = KVCache(1, b, hkv, 80, d, np.float16)
        (k, k64), (v, v64) = (to_device(rng.standard_normal((b, hkv, 70, d)), "float16") for _ in range(2))
        cache.append(0, k, v, num_new=lengths)
        q, q64 = to_device(rng.standard_normal((b, hq, 1, d)), "float16")
        ws = (cupy.empty((3, b, hq, d), np.float32), cupy.empty((3, b, hq), np.float32), cupy.zeros((b, hq), np.uint32))
        out = nan_like((b, hq, 1, d), "float16")
        cupyattn.decode_attention(q, cache, 0, num_splits=3, impl="simt", out=out, workspace=ws, fused_combine=True)
        assert_close(out, ref.decode_attention(q64, cupy.asnumpy(cache.k[0]), cupy.asnumpy(cache.v[0]), lengths),
                     "float16")
    elif op == "flash_persistent":  # 2 blocks, 4 causal tiles: 2 from the counter; launch after launch
        from cupyattn import flash_attn_sm90_persistent as P
        P._sm_count = lambda: 2
        for _ in range(2):
            q, k, v = (to_device(rand_with_outliers(rng, (1, 2, 130, 64)), "float16") for _ in range(3))
            out = nan_like((1, 2, 130, 64), "float16")
            cupyattn.attention(q[0], k[0], v[0], causal=True, impl="wgmma_persistent", out=out)
            assert_close(out, ref.attention(q[1], k[1], v[1], causal=True), "float16")
    elif op == "flash_persistent_tail":  # one block, 3 sequences whose last key tiles end past their lengths
        from cupyattn import flash_attn_sm90_persistent as P
        P._sm_count = lambda: 1
        q, k, v = (to_device(rand_with_outliers(rng, (3, 2, s, 64)), "float16") for s in (20, 200, 200))
        kl = np.array([130, 61, 200], dtype=np.int32)
        for b in range(3):
            k[0][b, :, kl[b]:] = np.nan
            v[0][b, :, kl[b]:] = np.nan
        out = nan_like((3, 2, 20, 64), "float16")
        cupyattn.attention(q[0], k[0], v[0], key_lengths=cupy.asarray(kl), impl="wgmma_persistent", out=out)
        assert_close(out, ref.attention(q[1], k[1], v[1], key_lengths=kl), "float16")
    elif op == "flash_mma":
        q, k, v = (to_device(rand_with_outliers(rng, (1, 2, s, 64)), "float16") for s in (17, 150, 150))
        out = nan_like((1, 2, 17, 64), "float16")
        cupyattn.attention(q[0], k[0], v[0], impl="flash_mma", out=out)
        assert_close(out, ref.attention(q[1], k[1], v[1]), "float16")
    elif op == "megakernel":  # one block: 10 LM-head tiles of 2 weight-ring chunks each
        from test_megakernel import _Model, _op
        m = _Model(rng, "float16", dim=296, v=150)
        m.run([_op("lm_head", m, layer=0)])
        assert_close(m.logits, ref.gemm_nt(ref.rmsnorm(m.h.x, m.h.out_norm, 1e-5), m.h.tok), "float16")
    elif op == "megakernel_ring":  # one block: the ring attention over 151 keys, 3 staged chunks of 64
        from cupyattn.megakernel import OPCODES
        from cupyattn.persistent import Op
        from test_megakernel import _Model
        m = _Model(rng, "float16", hq=4, hkv=2, lengths=(150, 0, 47), max_seq=160)
        q, q64 = to_device(rng.standard_normal((3, 4, 32)), "float16")
        m.q[...] = q
        m.run([Op("attn", OPCODES["attn"], 6, 1, args=(1, 1))], 1)
        kc, vc = cupy.asnumpy(m.cache.k[1]).astype(np.float64), cupy.asnumpy(m.cache.v[1]).astype(np.float64)
        want = ref.decode_attention(q64[:, :, None], kc, vc, m.lengths + 1)[:, :, 0]
        assert_close(m.att.reshape(3, 4, -1), want, "float16")
    elif op == "megakernel_blocks":  # 4 blocks: down tiles wait for every gate|up tile's ffn rows
        from cupyattn.persistent import Dep
        from test_megakernel import _Model, _op
        m = _Model(rng, "float16")
        m.step.blocks = 4
        m.run([_op("gate_up", m), _op("down", m, deps=(Dep("gate_up"),))])
        L1, f = m.h.layers[1], m.s["f"]
        gu = ref.gemm_nt(ref.rmsnorm(m.h.x, L1.ffn_norm, 1e-5), L1.w_gate_up)
        assert_close(m.x, m.h.x + ref.gemm_nt(ref.swiglu(gu[:, :f], gu[:, f:]), L1.w_down), "float16")
    else:
        rows, n = (3, 1500) if op == "softmax_block" else (17, 97)
        x, x64 = to_device(rand_with_outliers(rng, (rows, n), scale=3.0), "float32")
        out = nan_like((rows, n), "float32")
        cupyattn.softmax(x, out=out)
        assert_close(out, ref.softmax(x64), "float32")

def outcome(op, seed):
    """'passed', or how this schedule's run failed."""
    try:
        run(op, seed)
    except AssertionError as e:
        return "wrong result: " + str(e).splitlines()[0][:150]
    except Exception as e:
        return f"{{type(e).__name__}}: " + str(e).splitlines()[0][:150]
    return "passed"

def verdict(op, every=False):
    """'passed' if the 3 schedules all passed (every: if any did), else how the first failed."""
    outs = []
    for seed in range(3):
        outs.append(outcome(op, seed))
        if not every and outs[-1] != "passed":
            break
    failed = [o for o in outs if o != "passed"]
    return "passed" if not failed or (every and len(failed) < len(outs)) else failed[0]

for op in sorted({{m[4] for m in MUTANTS}}):
    use_sources(ORIGINAL)
    print(f"CONTROL {{op}}: {{verdict(op)}}", flush=True)
for i, (cls, name, text, mutated, op, every) in enumerate(MUTANTS):
    tmp = Path(tempfile.mkdtemp(prefix="cupyattn-mutant-"))
    shutil.copytree(ORIGINAL, tmp / "kernels_cu", ignore=shutil.ignore_patterns("__pycache__"))
    src = (tmp / "kernels_cu" / name).read_text()
    found = len(text.findall(src)) if isinstance(text, re.Pattern) else src.count(text)
    assert found == 1, f"mutant {{i}} ({{cls}}): its text occurs {{found}} times in {{name}}, not once; update it"
    mutant = text.sub(mutated, src) if isinstance(text, re.Pattern) else src.replace(text, mutated)
    (tmp / "kernels_cu" / name).write_text(mutant)
    use_sources(tmp / "kernels_cu")
    print(f"MUTANT {{i}} {{cls}}: {{verdict(op, every)}}", flush=True)
    shutil.rmtree(tmp)
'''


def test_each_bug_class_is_caught_on_the_emulator(tmp_path):
    _caught(tmp_path, [m for m in MUTANTS if m[0] not in SECOND_INSTANCES])


def test_megakernel_counter_order_is_caught_on_the_emulator(tmp_path):
    _caught(tmp_path, [m for m in ORDER_MUTANTS if m[0] not in SECOND_INSTANCES])


@pytest.mark.skipif(not tiers.FULL, reason="second instances of caught bug classes: CUPYATTN_FULL=1 runs them")
def test_second_instances_of_each_bug_class_are_caught_on_the_emulator(tmp_path):
    _caught(tmp_path, [m for m in MUTANTS + ORDER_MUTANTS if m[0] in SECOND_INSTANCES])


def _caught(tmp_path, mutants):
    script = tmp_path / "mutants.py"
    script.write_text(SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), mutants=mutants))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    report = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, report
    controls = [ln for ln in r.stdout.splitlines() if ln.startswith("CONTROL ")]
    verdicts = [ln for ln in r.stdout.splitlines() if ln.startswith("MUTANT ")]
    ops = {m[4] for m in mutants}
    assert len(controls) == len(ops) and all(ln.endswith(": passed") for ln in controls), report
    assert len(verdicts) == len(mutants), report
    missed = [ln for ln in verdicts if ln.endswith(": passed")]
    assert not missed, "mutants the emulated tier did not catch:\n" + "\n".join(missed) + "\n\n" + report
