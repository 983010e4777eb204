"""CPU tier: the Hopper part of the CPU emulator (tests/emu/emu_ptx_sm90.h) catches what it claims
to catch: a kernel that would hang on a GPU (an mbarrier phase that never completes, a warpgroup
that never meets in full) ends with a report naming what it waits for; more arrivals than a
barrier's count, a barrier overwritten by a store, a TMA box read before its barrier's phase, an
accumulator read or written while its wgmma is in flight, a wgmma or TMA store never waited for,
warpgroup threads issuing different wgmmas, a named barrier (bar.sync) whose thread count never
arrives or that two calls name with different counts; lanes of a warp out of step (an operand
published before every lane's stores and fences are ordered before its reader), a work slot
released before it is read (the releasing threads lag, the lone publisher refills the slot), an
mbarrier whose count does not match the threads that arrive on it. (Each instruction's results are checked against NumPy
by tests/cupyattn/test_ptx_sm90.py, on the emulator and on a GPU.)

Runs in a subprocess because the emulator replaces the `cupy` module for the whole process.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
EMU = Path(__file__).resolve().parent  # the emulator beside its tests
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {emu!r})
import fakecupy
fakecupy.install()
import cupy
import numpy as np
from cupyattn import _loader, tma

def expect(fn, *texts):
    try:
        fn()
    except (RuntimeError, TypeError, ValueError) as e:
        for text in texts:
            assert text in str(e), (text, str(e))
        return
    raise AssertionError("no error, expected: " + texts[0])

SRC = _loader.inline_source(r"""
#include "sm90.cuh"
__global__ void never_arrives(float* y) {
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) mbar_init(&bar, 2);
    __syncthreads();
    if (threadIdx.x == 0) mbar_arrive(&bar);   // 1 of 2 arrivals
    mbar_wait(&bar, 0);
    y[threadIdx.x] = 1.0f;
}
__global__ void too_many(float* y) {
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) mbar_init(&bar, 1);
    __syncthreads();
    if (threadIdx.x == 0) { mbar_arrive_expect_tx(&bar, 64); mbar_arrive(&bar); }
}
__global__ void clobbered(float* y) {
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) { mbar_init(&bar, 1); bar = 0; }
    __syncthreads();
    if (threadIdx.x == 0) mbar_arrive(&bar);
}
// reads the TMA box without waiting for the barrier (MODE 0), or waits first (MODE 1)
template <int MODE>
__global__ void tma_read(const __grid_constant__ TmaMap map, float* y) {
    extern __shared__ __align__(128) uint4 smem_raw[];
    __shared__ unsigned long long bar;
    const float* box = reinterpret_cast<const float*>(smem_raw);
    if (threadIdx.x == 0) { mbar_init(&bar, 1); mbar_fence_init(); }
    __syncthreads();
    if (threadIdx.x == 0) { mbar_arrive_expect_tx(&bar, 32 * 4 * 4); tma_load<2>((void*)box, &map, &bar, {0, 0}); }
    __syncthreads();
    if (MODE == 1) mbar_wait(&bar, 0);
    y[threadIdx.x] = box[threadIdx.x];
    __syncthreads();
    if (MODE == 0) mbar_wait(&bar, 0);
}
// MODE 0: reads the accumulators before wgmma.wait_group; 1: writes them; 2: never waits;
// 3: the warpgroup's threads disagree on scale-d; 4: one warp never joins the wgmma;
// 5: overwrites its shared operands while it is in flight; 6: its operands were stored with no
// fence.proxy.async before it (the async proxy may not see them)
template <int MODE>
__global__ void wg_misuse(float* y) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* s = reinterpret_cast<unsigned char*>(smem_raw) + (1024 - smem_u32(smem_raw) % 1024) % 1024;
    for (int i = threadIdx.x; i < 4096; i += 128) s[i] = 0;
    if (MODE != 6) fence_proxy_async_shared();
    __syncthreads();
    float d[8];
    for (int j = 0; j < 8; ++j) d[j] = 1.0f;
    const unsigned long long desc = smem_desc(s, 16, 1024, SWIZZLE_128B);
    wgmma_fence();
    if (MODE == 4 && threadIdx.x >= 96) { y[threadIdx.x] = 0.0f; return; }
    wgmma_ss<__half, 16, 0, 0>(d, desc, desc, MODE == 3 ? threadIdx.x % 2 : 1);
    wgmma_commit_group();
    if (MODE == 0) y[threadIdx.x] = d[0];
    if (MODE == 1) d[0] = 5.0f;
    if (MODE == 5) {
        for (int i = threadIdx.x; i < 4096; i += 128) s[i] = i % 2 ? 0x3c : 0;  // fp16 1.0
        fence_proxy_async_shared();
        __syncthreads();
    }
    if (MODE != 2) wgmma_wait_group<0>();
    if (MODE != 0) y[threadIdx.x] = d[1];
}
// named barriers: warp 0 waits for 64 threads, warp 1 never comes (MODE 0); warp 0 names 64
// threads, the other warps 128 (MODE 1)
template <int MODE>
__global__ void named_misuse(float* y) {
    if (MODE == 0 && threadIdx.x < 32) named_bar_sync(1, 64);
    if (MODE == 1) {
        if (threadIdx.x < 32) named_bar_arrive(1, 64);
        else named_bar_sync(1, 128);
    }
    y[threadIdx.x] = 1.0f;
}
// a load (MODE 0) or store (MODE 1) of a box whose innermost start is x elements into the row
template <int MODE>
__global__ void tma_at(const __grid_constant__ TmaMap map, int x, float* y) {
    extern __shared__ __align__(128) uint4 smem_raw[];
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) { mbar_init(&bar, 1); mbar_fence_init(); }
    __syncthreads();
    if (threadIdx.x == 0 && MODE == 0) { mbar_arrive_expect_tx(&bar, 32 * 4 * 4); tma_load<2>((void*)smem_raw, &map, &bar, {x, 0}); }
    if (threadIdx.x == 0 && MODE == 1) { tma_store<2>(&map, smem_raw, {x, 0}); bulk_commit_group(); bulk_wait_group<0>(); }
    if (MODE == 0) mbar_wait(&bar, 0);
    y[threadIdx.x] = 1.0f;
}
// A stage refilled by TMA while the wgmma reading it is in flight (released before it retired),
// MODE 1; MODE 0 waits for the wgmma first. MODE 2: the barrier's init never made visible to the
// async proxy (no fence.mbarrier_init) before a TMA load completes on it.
template <int MODE>
__global__ void tma_over_wgmma(const __grid_constant__ TmaMap map, float* y) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* s = reinterpret_cast<unsigned char*>(smem_raw) + (1024 - smem_u32(smem_raw) % 1024) % 1024;
    __shared__ unsigned long long bar;
    for (int i = threadIdx.x; i < 8192; i += 128) s[i] = 0;  // A: 64 rows of 128 B
    fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) { mbar_init(&bar, 1); if (MODE != 2) mbar_fence_init(); }
    __syncthreads();
    float d[8];
    const unsigned long long desc = smem_desc(s, 16, 1024, SWIZZLE_128B);
    wgmma_fence();
    wgmma_ss<__half, 16, 0, 0>(d, desc, desc, 0);
    wgmma_commit_group();
    if (MODE != 1) wgmma_wait_group<0>();
    if (threadIdx.x == 0) { mbar_arrive_expect_tx(&bar, 32 * 4 * 4); tma_load<2>((void*)s, &map, &bar, {0, 0}); }
    if (MODE == 1) wgmma_wait_group<0>();
    mbar_wait(&bar, 0);
    y[threadIdx.x] = d[0];
}
// A TMA store of a box the block's threads wrote with st.shared: MODE 1 makes the generic proxy's
// stores visible to the async proxy first (fence.proxy.async), MODE 0 does not.
template <int MODE>
__global__ void store_fenced(const __grid_constant__ TmaMap map) {
    extern __shared__ __align__(128) uint4 smem_raw[];
    reinterpret_cast<float*>(smem_raw)[threadIdx.x] = 1000.0f + threadIdx.x;
    if (MODE == 1) fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) { tma_store<2>(&map, smem_raw, {0, 0}); bulk_commit_group(); bulk_wait_group<0>(); }
}
__global__ void store_unwaited(const __grid_constant__ TmaMap map) {
    extern __shared__ __align__(128) uint4 smem_raw[];
    if (threadIdx.x == 0) { tma_store<2>(&map, smem_raw, {0, 0}); bulk_commit_group(); }
}
// Lanes of one warp out of step: each lane of warp 0 zeroes its share of a wgmma operand (8 KB) and
// makes its stores visible to the async proxy (fence.proxy.async); lane 0 publishes the operand
// with an mbarrier arrival; warpgroup 1 waits for it and reads it with a wgmma (d = 1 + 0). MODE 0:
// a __syncwarp between the lanes' fences and lane 0's arrival; 1: none, so lane 0 may arrive before
// another lane has stored, and no lane's fence but lane 0's is ordered before the wgmma.
template <int MODE>
__global__ void lanes_publish(float* y) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* s = reinterpret_cast<unsigned char*>(smem_raw) + (1024 - smem_u32(smem_raw) % 1024) % 1024;
    __shared__ unsigned long long full;
    if (threadIdx.x == 0) { mbar_init(&full, 1); mbar_fence_init(); }
    __syncthreads();
    if (threadIdx.x < 32) {
        uint4 z;
        z.x = z.y = z.z = z.w = 0u;
        for (int i = threadIdx.x; i < 512; i += 32) reinterpret_cast<uint4*>(s)[i] = z;
        fence_proxy_async_shared();
        if (MODE == 0) __syncwarp();
        if (threadIdx.x == 0) mbar_arrive(&full);
    } else if (threadIdx.x >= 128) {
        mbar_wait(&full, 0);
        float d[8];
        for (int j = 0; j < 8; ++j) d[j] = 1.0f;
        const unsigned long long desc = smem_desc(s, 16, 1024, SWIZZLE_128B);
        wgmma_fence();
        wgmma_ss<__half, 16, 0, 0>(d, desc, desc, 1);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        y[threadIdx.x - 128] = d[0];
    }
}
// A ring of two work slots: thread 32 (a scheduler) writes item i into slot i % 2 and publishes it
// with a plain arrival (count 1); warp 0's lanes read it and release the slot (count 32). MODE 1
// releases before reading: the scheduler may refill the slot first.
template <int MODE>
__global__ void work_ring(int items, float* y) {
    __shared__ unsigned long long full[2], empty[2];
    __shared__ int slot[2];
    if (threadIdx.x == 0)
        for (int s = 0; s < 2; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 32); }
    __syncthreads();
    for (int i = 0; i < items; ++i) {
        const int s = i % 2;
        const unsigned phase = (i / 2) & 1;
        if (threadIdx.x == 32) {
            mbar_wait(&empty[s], phase ^ 1u);
            slot[s] = i;
            mbar_arrive(&full[s]);
        } else if (threadIdx.x < 32) {
            mbar_wait(&full[s], phase);
            int v = 0;
            if (MODE == 0) v = slot[s];
            mbar_arrive(&empty[s]);
            if (MODE == 1) v = slot[s];
            y[i * 32 + threadIdx.x] = (float)v;
        }
    }
}
// An mbarrier of count 2 that three threads arrive on, `uses` times: the third arrival spills into
// the next phase.
__global__ void miscounted(int uses, float* y) {
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) mbar_init(&bar, 2);
    __syncthreads();
    for (int u = 0; u < uses; ++u) {
        if (threadIdx.x < 3) mbar_arrive(&bar);
        __syncthreads();
    }
    y[threadIdx.x] = 1.0f;
}
""")
names = ["never_arrives", "too_many", "clobbered", "tma_read<0>", "tma_read<1>", "store_unwaited", "tma_at<0>", "tma_at<1>"] + \
    [f"wg_misuse<{m}>" for m in range(7)] + ["named_misuse<0>", "named_misuse<1>"] + \
    [f"tma_over_wgmma<{m}>" for m in range(3)] + ["store_fenced<0>", "store_fenced<1>"] + \
    ["lanes_publish<0>", "lanes_publish<1>", "work_ring<0>", "work_ring<1>", "miscounted"]
mod = cupy.RawModule(code=SRC, name_expressions=names)
k = {n: mod.get_function(n) for n in names}
y = cupy.zeros(128, dtype=np.float32)

expect(lambda: k["never_arrives"]((1,), (64,), (y,)), "deadlock",
       "waited on for parity 0 never completes its phase 0 (1 of 2 arrivals pending, tx-count 0)")
expect(lambda: k["too_many"]((1,), (32,), (y,)), "got more arrivals than its count (1) in one phase")
expect(lambda: k["clobbered"]((1,), (32,), (y,)), "was overwritten by an ordinary store")

g = cupy.asarray(np.arange(32 * 4, dtype=np.float32).reshape(4, 32))
m = tma.tensor_map(g.data.ptr, g.dtype, (32, 4), (128,), (32, 4), swizzle=0)
k["tma_read<1>"]((1,), (128,), (m, y), shared_mem=512)
assert np.array_equal(cupy.asnumpy(y), np.arange(128, dtype=np.float32))
seen = set()
for _ in range(8):  # each launch under its own schedule: the box lands at issue, later, or at the wait
    k["tma_read<0>"]((1,), (128,), (m, y), shared_mem=512)
    seen.add("right" if np.array_equal(cupy.asnumpy(y), np.arange(128)) else "wrong")
assert "wrong" in seen, "a TMA box read before its barrier's phase must not reliably be right"
seen = set()
for _ in range(16):  # operands read at issue (zeros: d = 1) or later, as the schedule picks: then the
    try:             # ones overwritten while the wgmma was in flight are read, and their fences are
        k["wg_misuse<5>"]((1,), (128,), (y,), shared_mem=8192)  # not ordered before its issue
        seen.add(float(cupy.asnumpy(y)[0]))
    except RuntimeError as e:
        assert "nothing orders that fence before the read's issue" in str(e), str(e)
        seen.add("unordered")
assert seen == {1.0, "unordered"}, seen

k["wg_misuse<0>"]((1,), (128,), (y,), shared_mem=8192)
assert np.isnan(cupy.asnumpy(y)).all(), "accumulators read before wgmma.wait_group must be poison"
expect(lambda: k["wg_misuse<1>"]((1,), (128,), (y,), shared_mem=8192), "written while its wgmma.mma_async was in flight")
expect(lambda: k["wg_misuse<2>"]((1,), (128,), (y,), shared_mem=8192), "never retired by wgmma.wait_group")
expect(lambda: k["wg_misuse<3>"]((1,), (128,), (y,), shared_mem=8192), "threads of a warpgroup disagree")
expect(lambda: k["wg_misuse<4>"]((1,), (128,), (y,), shared_mem=8192), "deadlock",
       "meets at wgmma.mma_async with 96 of 128 threads")
expect(lambda: k["wg_misuse<0>"]((1,), (96,), (y,), shared_mem=8192), "not whole warpgroups of 128")
expect(lambda: k["store_unwaited"]((1,), (32,), (m,), shared_mem=512), "never retired by cp.async.bulk.wait_group")
# proxies and stage reuse: each misuse fails on every run, whatever the schedule
for _ in range(4):
    expect(lambda: k["wg_misuse<6>"]((1,), (128,), (y,), shared_mem=8192), "wgmma.mma_async reads shared memory",
           "no fence.proxy.async")
    expect(lambda: k["tma_over_wgmma<1>"]((1,), (128,), (m, y), shared_mem=9216),
           "that a wgmma.mma_async in flight still reads")
    expect(lambda: k["tma_over_wgmma<2>"]((1,), (128,), (m, y), shared_mem=9216), "no fence.mbarrier_init")
    k["tma_over_wgmma<0>"]((1,), (128,), (m, y), shared_mem=9216)
    assert (cupy.asnumpy(y) == 0).all()
# an innermost start off a 16-byte boundary (float32: x = 2 is 8 bytes in) stops the kernel, as it
# did on the H100; x = 4 (16 bytes) and x = -4 copy
for mode in (0, 1):
    expect(lambda: k[f"tma_at<{mode}>"]((1,), (32,), (m, np.int32(2), y), shared_mem=512),
           "innermost coordinate 2 is 8 bytes past a 16-byte boundary")
    for x in (4, -4):
        k[f"tma_at<{mode}>"]((1,), (32,), (m, np.int32(x), y), shared_mem=512)
expect(lambda: k["named_misuse<0>"]((1,), (64,), (y,)), "deadlock", "named barrier 1 waits for 64 threads, 32 arrived")
expect(lambda: k["named_misuse<0>"]((1,), (32,), (y,)), "thread count 64 is not a positive multiple of 32 within the block")
expect(lambda: k["named_misuse<1>"]((1,), (128,), (y,)), "bar", "barrier 1 named with", "threads while its phase counts")
# a TMA store reads its source through the async proxy: unfenced generic stores fail on
# every run, fenced ones land (the box is the whole 4 x 32 tensor)
for _ in range(3):
    expect(lambda: k["store_fenced<0>"]((1,), (128,), (m,), shared_mem=512), "cp.async.bulk.tensor (store) reads "
           "shared memory", "no fence.proxy.async")
    g[...] = np.nan
    k["store_fenced<1>"]((1,), (128,), (m,), shared_mem=512)
    assert np.array_equal(cupy.asnumpy(g).ravel(), 1000 + np.arange(128, dtype=np.float32))
# Lanes of a warp interleave between its synchronising points, and a lane's fence.proxy.async hands
# the async proxy only the stores ordered before it: without the __syncwarp, lane 0's arrival
# publishes an operand other lanes have not stored yet (NaN), not fenced yet, or fenced where no
# synchronisation orders it before the wgmma, on every run; with it, every run is right.
for _ in range(4):
    k["lanes_publish<0>"]((1,), (256,), (y,), shared_mem=9216)
    assert (cupy.asnumpy(y) == 1).all()
    try:
        k["lanes_publish<1>"]((1,), (256,), (y,), shared_mem=9216)
        assert not (cupy.asnumpy(y) == 1).all(), "an operand published before its lanes' stores was right"
    except RuntimeError as e:
        assert "reads shared memory" in str(e) and "fence" in str(e), str(e)
# A slot released before it is read: the scheduler (a lone publisher, never held back) refills it
# while the releasing lanes are held back, on every run; read first, every run is right.
wy = cupy.zeros(6 * 32, dtype=np.float32)
for _ in range(4):
    k["work_ring<0>"]((1,), (64,), (np.int32(6), wy))
    assert np.array_equal(cupy.asnumpy(wy), np.repeat(np.arange(6, dtype=np.float32), 32))
    k["work_ring<1>"]((1,), (64,), (np.int32(6), wy))
    assert not np.array_equal(cupy.asnumpy(wy), np.repeat(np.arange(6, dtype=np.float32), 32))
# mbarrier arrival accounting: a phase completed by other threads than the last one, or arrivals
# left in a phase at the block's end, name the barrier (the kernel: fakecupy prefixes it)
expect(lambda: k["miscounted"]((1,), (32,), (np.int32(2), y)), "miscounted: mbarrier `bar` (static __shared__)",
       "(count 2): phase 1 was completed by other threads than phase 0", "arrival count does not match")
expect(lambda: k["miscounted"]((1,), (32,), (np.int32(1), y)), "mbarrier `bar` (static __shared__)",
       "ended the block with 1 arrival(s) in phase 1 that never completes")
# the emulator's encoder applies the driver's documented rules on its own (cupyattn validates first)
expect(lambda: fakecupy._cupyattn_emulator_encode_tiled(6, 2, 16, (8, 8), (24,), (8, 8), (1, 1), 0, 0, 0, 0),
       "CUDA_ERROR_INVALID_VALUE", "multiples of 16")
expect(lambda: fakecupy._cupyattn_emulator_encode_tiled(6, 2, 16, (64, 8), (128,), (64, 8), (1, 1), 0, 2, 0, 0),
       "exceeds the swizzle span")
print("EMULATOR-SM90-OK")
'''


def test_emulator_hopper_checks(tmp_path):
    script = tmp_path / "emu_sm90_selftest.py"
    script.write_text(SCRIPT.replace("{emu!r}", repr(str(EMU))).replace("{root!r}", repr(str(ROOT))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "EMULATOR-SM90-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
