"""kernels_cu/ptx_sm90.cuh (and sm90.cuh's descriptor encoder and stage ring), each instruction
against NumPy. GPU tier: on an H100 this checks the PTX wrappers and, through the same
expectations, the CPU emulator's reading of the ISA; on the emulator it checks
tests/emu/emu_ptx_sm90.h, which replaces ptx_sm90.cuh there.

The expected values are written here from the PTX ISA and the CUDA driver documentation
(shared-memory matrix layouts and swizzle modes, the wgmma register fragments, TMA boxes with
zero fill, stmatrix), never from the code under test: the NumPy layouts below place and read
bytes at the addresses those sections define.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import np_dtype
from cupyattn import _loader

pytestmark = pytest.mark.gpu

SRC = r'''
#include "sm90.cuh"

// The first 1 KB-aligned shared address of the dynamic buffer (the swizzle patterns repeat every
// 1 KB of shared address; launches ask for 1 KB more than they use).
__device__ unsigned char* aligned_1k(void* p) {
    return (unsigned char*)p + (1024 - smem_u32(p) % 1024) % 1024;
}

// --- TMA load: one box at coordinates c into 1 KB-aligned dynamic shared memory, then the raw
// shared bytes out (their swizzled order is part of what is checked).
template <int R>
__global__ void tma_in(const __grid_constant__ TmaMap map, int c0, int c1, int c2, int c3, int c4,
                       int bytes, unsigned char* out) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* box = aligned_1k(smem_raw);
    __shared__ unsigned long long bar;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(&bar, bytes);
        int c[R];
        const int all[5] = {c0, c1, c2, c3, c4};
        for (int i = 0; i < R; ++i) c[i] = all[i];
        tma_load<R>(box, &map, &bar, c);
    }
    mbar_wait(&bar, 0);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = box[i];
}

// --- TMA store: `bytes` of src copied into shared memory as they are (already in the map's
// swizzled order), then one box stored at c.
template <int R>
__global__ void tma_out(const __grid_constant__ TmaMap map, int c0, int c1, int c2, int c3, int c4,
                        int bytes, const unsigned char* src) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* box = aligned_1k(smem_raw);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) box[i] = src[i];
    fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) {
        int c[R];
        const int all[5] = {c0, c1, c2, c3, c4};
        for (int i = 0; i < R; ++i) c[i] = all[i];
        tma_store<R>(&map, box, c);
        bulk_commit_group();
        bulk_wait_group_read<0>();
        bulk_wait_group<0>();
    }
}

// --- wgmma: a_img / b_img are shared-memory images (bytes, 1 KB-aligned in shared memory) of
// the operands in the layouts the descriptors describe; `steps` k16 steps, the descriptors'
// start advancing by a_step / b_step bytes each, one commit, one wait. d_in / d_out are the
// accumulator registers of the 128 threads, [128][N/2] (RS: a_regs [128][4] per step).
template <typename T, int N, int TA, int TB, bool RS>
__global__ void wg(const unsigned char* a_img, int a_bytes, const unsigned char* b_img, int b_bytes,
                   const unsigned* a_regs, unsigned long long a_desc, unsigned long long b_desc,
                   int a_step, int b_step, int steps, int scale_d, const float* d_in, float* d_out) {
    extern __shared__ __align__(1024) uint4 smem_raw[];
    unsigned char* s = aligned_1k(smem_raw);
    unsigned char* sa = s;
    unsigned char* sb = s + ((a_bytes + 1023) / 1024) * 1024;
    for (int i = threadIdx.x; i < a_bytes; i += blockDim.x) sa[i] = a_img[i];
    for (int i = threadIdx.x; i < b_bytes; i += blockDim.x) sb[i] = b_img[i];
    fence_proxy_async_shared();
    __syncthreads();
    // the start address field comes from the real buffer; LBO, SBO and swizzle from the test
    const unsigned long long fields = ~0x3FFFull;
    float d[N / 2];
    for (int j = 0; j < N / 2; ++j) d[j] = d_in[threadIdx.x * (N / 2) + j];
    wgmma_fence();
    for (int st = 0; st < steps; ++st) {
        const unsigned long long db = (b_desc & fields) | (smem_desc(sb + st * b_step, 0, 0, SWIZZLE_NONE) & 0x3FFF);
        if constexpr (RS) {
            unsigned a[4];
            for (int i = 0; i < 4; ++i) a[i] = a_regs[(st * 128 + threadIdx.x) * 4 + i];
            wgmma_rs<T, N, TB>(d, a, db, st > 0 || scale_d);
        } else {
            const unsigned long long da = (a_desc & fields) | (smem_desc(sa + st * a_step, 0, 0, SWIZZLE_NONE) & 0x3FFF);
            wgmma_ss<T, N, TA, TB>(d, da, db, st > 0 || scale_d);
        }
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_acc(d);
    for (int j = 0; j < N / 2; ++j) d_out[threadIdx.x * (N / 2) + j] = d[j];
}

// --- stmatrix: lane l stores r[i] = vals[l][i] of NUM 8x8 matrices; lane l addresses row l % 8 of
// matrix (l / 8) % NUM; the 4 x 64 shared u16 values go out.
template <int NUM, bool TRANS>
__global__ void stm(const unsigned* vals, unsigned short* out) {
    __shared__ __align__(16) unsigned short s[4 * 64];
    const int l = threadIdx.x;
    for (int i = l; i < 4 * 64; i += 32) s[i] = 0xFFFF;
    __syncwarp();
    unsigned r[NUM];
    for (int i = 0; i < NUM; ++i) r[i] = vals[l * 4 + i];
    stmatrix<NUM, TRANS>(s + ((l / 8) % NUM * 8 + l % 8) * 8, r);
    __syncwarp();
    for (int i = l; i < 4 * 64; i += 32) out[i] = s[i];
}

// --- the stage ring without TMA: warp 0 lane 0 produces `rounds` values through STAGES slots,
// each of the 3 consumer warps (lane 0) adds them up and releases the slot; expect_tx of 0 bytes.
// setmaxnreg as the kernels use it: producer warpgroup down, consumers up (needs the 1 in
// __launch_bounds__); on the emulator it is a no-op.
template <int STAGES>
__global__ void __launch_bounds__(256, 1) ring(int rounds, long long* sums) {
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    __shared__ long long slot[STAGES];
    StageRing<STAGES> r(full, empty);
    if (threadIdx.x == 0) r.init(3);
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < 4) {
        setmaxnreg_dec<40>();
        if (warp == 0 && lane == 0)
            for (int i = 0; i < rounds; ++i) {
                r.acquire();
                slot[r.stage] = 1000 + i * 7;
                r.commit(0);
                r.advance();
            }
    } else {
        setmaxnreg_inc<232>();
        if (warp < 7 && lane == 0) {
            long long s = 0;
            for (int i = 0; i < rounds; ++i) {
                r.wait();
                s += slot[r.stage] * (warp - 3);
                r.release(r.stage);
                r.advance();
            }
            sums[warp - 4] = s;
        }
    }
}

// --- named barriers: two warpgroups take turns (the ping-pong hand-off). Group g waits on barrier
// 1 + g (256 threads: its own 128 in bar.sync, the other group's 128 from bar.arrive), appends its
// id to the log, then lets the other group go; group 1 first hands group 0 the first turn.
template <int ROUNDS>
__global__ void turns(int* log) {
    __shared__ int n;
    const int g = threadIdx.x / 128;
    if (threadIdx.x == 0) n = 0;
    __syncthreads();
    if (g == 1) named_bar_arrive(1, 256);
    for (int r = 0; r < ROUNDS; ++r) {
        named_bar_sync(1 + g, 256);
        if (threadIdx.x % 128 == 0) log[n++] = g;
        named_bar_arrive(2 - g, 256);
    }
}
'''

TMA_EXPRS = [f"tma_in<{r}>" for r in (2, 3, 4, 5)] + [f"tma_out<{r}>" for r in (2, 3, 4, 5)]
WG_CASES = {  # name -> (T, N, TRANS_A, TRANS_B, RS)
    "f16-n64-kk": ("__half", 64, 0, 0, False),
    "bf16-n64-kk": ("__nv_bfloat16", 64, 0, 0, False),
    "f16-n256-kmn": ("__half", 256, 0, 1, False),
    "bf16-n16-mnmn": ("__nv_bfloat16", 16, 1, 1, False),
    "f16-n128-rs-k": ("__half", 128, 0, 0, True),
    "bf16-n32-rs-mn": ("__nv_bfloat16", 32, 0, 1, True),
}


def _wg_expr(t, n, ta, tb, rs):
    return f"wg<{t}, {n}, {ta}, {tb}, {'true' if rs else 'false'}>"


EXPRS = TMA_EXPRS + [_wg_expr(*c) for c in WG_CASES.values()] + \
    [f"stm<{n}, {t}>" for n in (1, 2, 4) for t in ("false", "true")] + ["ring<2>", "ring<3>"] + ["turns<5>"]


@pytest.fixture(scope="module")
def kernels():
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("sm_90a instructions: Hopper (H100/H200) only")
    mod = cupy.RawModule(code=_loader.inline_source(SRC), options=_loader.BASE_OPTIONS + ("-arch=sm_90a",),
                         name_expressions=EXPRS)
    return {e: mod.get_function(e) for e in EXPRS}


def _launch(kern, grid, block, args, smem):
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    kern(grid, block, args, shared_mem=smem)


# --- the swizzle and the layouts, from the PTX ISA ------------------------------------------------
def swizzle(addr, width):
    """PTX ISA 9.7.15.5.1.2 / TMA: for a W-byte swizzle (32, 64, 128), address bits [4, 4+b)
    are XORed with bits [7, 7+b), b = log2(W / 16)."""
    addr = np.asarray(addr)
    if width <= 16:
        return addr
    mask = width // 16 - 1
    return addr ^ (((addr >> 7) & mask) << 4)


# --- TMA -------------------------------------------------------------------------------------------
def _tma_box(g, coords, box):
    """The box of the row-major array g (dims reversed: TMA's innermost first) at coords, zero
    outside g: CUDA driver API, cuTensorMapEncodeTiled (out-of-bounds elements are zero-filled)."""
    rank = len(coords)
    shape = g.shape[::-1]  # innermost first
    out = np.zeros(tuple(box[::-1]), dtype=g.dtype)
    idx = np.indices(tuple(box[::-1])).reshape(rank, -1)[::-1]  # innermost first, per element
    glob = idx + np.asarray(coords)[:, None]
    inside = np.all((glob >= 0) & (glob < np.asarray(shape)[:, None]), axis=0)
    flat_out = out.reshape(-1)
    g_idx = tuple(glob[::-1][:, inside])
    flat_out[np.flatnonzero(inside)] = g[g_idx]
    return out


def _map(cupy_arr, box, swz):
    from cupyattn import tma

    dims = cupy_arr.shape[::-1]
    strides = cupy_arr.strides[::-1][1:]
    return tma.tensor_map(cupy_arr.data.ptr, cupy_arr.dtype, dims, strides, box, swz)


# Innermost coordinates sit on 16-byte boundaries: at x = 50 and 60 (fp16) the H100 stopped with an
# illegal instruction (2026-11-26; the emulator refuses them, tests/emu/test_emu_checks_sm90.py).
TMA_CASES = [  # (global shape, row-major; box innermost first; coordinates innermost first; swizzle)
    ((40, 100), (64, 16), (48, 30), 128),          # 2-D, past the right and bottom edges
    ((40, 100), (64, 16), (-8, -5), 128),          # negative coordinates: zero-filled
    ((33, 70), (32, 8), (0, 1), 64),
    ((33, 70), (16, 8), (56, 30), 32),
    ((33, 70), (24, 4), (8, 2), 0),                # no swizzle, a 48-byte row
    ((3, 20, 64), (64, 8, 2), (0, 15, 2), 128),    # 3-D
    ((2, 3, 9, 64), (64, 4, 2, 2), (0, 7, 2, 1), 128),
    ((2, 2, 2, 5, 32), (32, 4, 2, 1, 2), (0, 3, 1, 1, 0), 64),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"r{len(c[0])}-sw{c[3]}")
def test_tma_load_box_zero_fill_and_swizzle(kernels, case, dtype):
    import cupy

    shape, box, coords, swz = case
    rng = np.random.default_rng(len(shape) * 100 + swz)
    # rows padded to 16 bytes (TMA strides), the map covers the unpadded view
    pitch = -(-shape[-1] // 8) * 8
    full = rng.standard_normal(shape[:-1] + (pitch,)).astype(np_dtype(dtype))
    g = full[..., :shape[-1]]
    gd = cupy.asarray(full)[..., :shape[-1]]
    nbytes = int(np.prod(box)) * 2
    out = cupy.full(nbytes, 0xAB, dtype=np.uint8)
    c = list(coords) + [0] * (5 - len(coords))
    _launch(kernels[f"tma_in<{len(shape)}>"], (1,), (128,), (_map(gd, box, swz), *map(np.int32, c),
                                                              np.int32(nbytes), out), nbytes + 1024)
    want = _tma_box(g, coords, box).view(np.uint8).reshape(-1)
    # byte i of the box (row-major) sits at shared offset swizzle(i): the buffer is 1 KB-aligned
    pos = swizzle(np.arange(nbytes), swz)
    got = cupy.asnumpy(out)
    np.testing.assert_array_equal(got[pos], want)


@pytest.mark.parametrize("case", TMA_CASES[:1] + TMA_CASES[5:7], ids=lambda c: f"r{len(c[0])}-sw{c[3]}")
def test_tma_store_writes_the_box_inside_the_tensor_only(kernels, case):
    """The box's elements inside the tensor land; along the innermost dimension "inside" ends at
    the extent rounded up to 16 bytes (the H100 wrote elements 100..103 of 100-element fp16 rows,
    2026-11-26; the emulator does the same), and nothing past that boundary is written."""
    import cupy

    shape, box, coords, swz = case
    rng = np.random.default_rng(7)
    src_box = rng.standard_normal(tuple(box[::-1])).astype(np.float16)
    nbytes = src_box.nbytes
    image = np.zeros(nbytes, dtype=np.uint8)
    image[swizzle(np.arange(nbytes), swz)] = src_box.view(np.uint8).reshape(-1)
    chunked = -(-shape[-1] // 8) * 8   # the extent rounded up to 16 bytes (8 fp16 elements)
    pitch = chunked + 8                # and 16 more bytes that no store may touch
    full = cupy.asarray(np.full(shape[:-1] + (pitch,), -7.0, dtype=np.float16))
    gd = full[..., :shape[-1]]
    g0 = cupy.asnumpy(full)
    c = list(coords) + [0] * (5 - len(coords))
    _launch(kernels[f"tma_out<{len(shape)}>"], (1,), (128,), (_map(gd, box, swz), *map(np.int32, c),
                                                               np.int32(nbytes), cupy.asarray(image)), nbytes + 1024)
    want = g0.copy()
    rank = len(shape)
    idx = np.indices(tuple(box[::-1])).reshape(rank, -1)  # outermost first
    glob = idx + np.asarray(coords[::-1])[:, None]
    inside = np.all((glob >= 0) & (glob < np.asarray(shape[:-1] + (chunked,))[:, None]), axis=0)
    want[tuple(glob[:, inside])] = src_box.reshape(-1)[inside]
    np.testing.assert_array_equal(cupy.asnumpy(full), want)  # the padding past the chunk too


# --- wgmma -------------------------------------------------------------------------------------------
SW_MODES = {0: 16, 1: 128, 2: 64, 3: 32}  # descriptor field -> swizzle width W in bytes (16: none)


def desc_fields(lbo, sbo, mode):
    """Bits 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 swizzle mode (PTX ISA 9.7.15.5.1.2.2)."""
    return ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (mode << 62)


def operand_layout(mn_major, mode, mn_n, k_n):
    """(addr, LBO, SBO): the byte offset of element (mn, k) of a 16-bit operand [mn_n][k_n] before
    the swizzle, per PTX ISA 9.7.15.5.1.2, and the descriptor's two strides. A is [M][K], B is
    seen as [N][K]. Swizzle atoms are 8 rows of W bytes (W = 16 without swizzle).
    K-major: a row is one mn; without swizzle, 8 x 16-byte core matrices, K blocks LBO apart and
    8-row groups SBO apart; swizzled, W-byte rows, 8-row groups SBO = 8 W apart (LBO unused), K past
    the first W bytes in a further region of the same shape.
    MN-major: a row is one k; swizzled, W bytes of mn per row, groups of 8 k SBO apart, W-byte mn
    blocks LBO apart; without swizzle, 16-byte mn chunks SBO apart, groups of 8 k LBO apart."""
    w = SW_MODES[mode]
    if not mn_major and mode == 0:
        lbo, sbo = 128, 16 * k_n
        return (lambda mn, k: (mn % 8) * 16 + (mn // 8) * sbo + (2 * k // 16) * lbo + (2 * k) % 16), lbo, sbo
    if not mn_major:
        sbo, region = 8 * w, mn_n * w
        return (lambda mn, k: (2 * k // w) * region + (mn % 8) * w + (mn // 8) * sbo + (2 * k) % w), 16, sbo
    if mode == 0:
        lbo, sbo = 128, 16 * k_n
        return (lambda mn, k: (k % 8) * 16 + (k // 8) * lbo + (2 * mn // 16) * sbo + (2 * mn) % 16), lbo, sbo
    sbo, lbo = 8 * w, k_n * w
    return (lambda mn, k: (k % 8) * w + (k // 8) * sbo + (2 * mn // w) * lbo + (2 * mn) % w), lbo, sbo


def operand_image(mat, mn_major, mode):
    """Shared-memory bytes of mat [mn][k] (16-bit) laid out by operand_layout, then swizzled (the
    kernel copies them to a 1 KB-aligned buffer, so offsets are addresses for the swizzle); with
    the descriptor fields and the start offset of k16 step 1 (the address of element (0, 16))."""
    addr, lbo, sbo = operand_layout(mn_major, mode, *mat.shape)
    mn, k = np.indices(mat.shape)
    a = swizzle(addr(mn, k), SW_MODES[mode])
    img = np.zeros(-(-(int(a.max()) + 2) // 1024) * 1024, dtype=np.uint8)
    bits = mat.view(np.uint16)
    img[a] = (bits & 0xFF).astype(np.uint8)
    img[a + 1] = (bits >> 8).astype(np.uint8)
    return img, desc_fields(lbo, sbo, mode), int(addr(0, 16)) if mat.shape[1] > 16 else 0


def acc_coords(n):
    """(row, col) of register j of thread t for an m64nN fp32 accumulator (PTX ISA 9.7.15.5.1.1.1:
    warp w rows 16w..16w+15; lane l: d[4i + r] at row l/4 + 8 (r/2), column 8i + 2 (l%4) + r%2)."""
    t = np.arange(128)[:, None]
    j = np.arange(n // 2)[None, :]
    w, l = t // 32, t % 32
    return 16 * w + l // 4 + 8 * ((j % 4) // 2), 8 * (j // 4) + 2 * (l % 4) + j % 2


def a_fragments(a):
    """A [64][16] in wgmma's register layout: per thread 4 registers of two 16-bit values; warp w
    rows 16w.., lane l: a[0] (row l/4, k 2(l%4)..+1), a[1] (row +8), a[2] (k +8), a[3] (both)."""
    bits = a.view(np.uint16).astype(np.uint32)
    regs = np.zeros((128, 4), dtype=np.uint32)
    for t in range(128):
        w, l = t // 32, t % 32
        for i in range(4):
            r = 16 * w + l // 4 + 8 * (i % 2)
            k = 2 * (l % 4) + 8 * (i // 2)
            regs[t, i] = bits[r, k] | (bits[r, k + 1] << 16)
    return regs


@pytest.mark.parametrize("name", list(WG_CASES))
@pytest.mark.parametrize("mode_a,mode_b", [(1, 1), (2, 3), (3, 0), (0, 2)])
@pytest.mark.parametrize("steps,scale_d", [(1, 0), (2, 1)])
def test_wgmma_matches_numpy(kernels, name, mode_a, mode_b, steps, scale_d):
    """D = A B (+ D) over `steps` k16 steps chained on the same accumulators in one group, for
    every swizzle mode on each side, K- and MN-major, A from shared memory or registers."""
    import cupy

    t, n, ta, tb, rs = WG_CASES[name]
    dt = np.dtype("float16") if t == "__half" else np_dtype("bfloat16")
    rng = np.random.default_rng([mode_a, mode_b, steps, n, ta, tb, rs])
    k = 16 * steps
    a = rng.standard_normal((64, k)).astype(dt)
    b = rng.standard_normal((k, n)).astype(dt)
    d0 = rng.standard_normal((64, n)).astype(np.float32)
    img_a, desc_a, step_a = operand_image(a, bool(ta), mode_a)
    img_b, desc_b, step_b = operand_image(np.ascontiguousarray(b.T), bool(tb), mode_b)
    rows, cols = acc_coords(n)
    regs = np.concatenate([a_fragments(np.ascontiguousarray(a[:, 16 * s:16 * s + 16])) for s in range(steps)])
    out = cupy.full((128, n // 2), np.nan, dtype=np.float32)
    args = (cupy.asarray(img_a), np.int32(len(img_a)), cupy.asarray(img_b), np.int32(len(img_b)),
            cupy.asarray(regs), np.uint64(desc_a), np.uint64(desc_b), np.int32(step_a), np.int32(step_b),
            np.int32(steps), np.int32(scale_d), cupy.asarray(np.ascontiguousarray(d0[rows, cols])), out)
    _launch(kernels[_wg_expr(t, n, ta, tb, rs)], (1,), (128,), args, len(img_a) + len(img_b) + 1024)
    want = a.astype(np.float64) @ b.astype(np.float64) + (d0 if scale_d else 0)
    got = np.full((64, n), np.nan)
    got[rows, cols] = cupy.asnumpy(out)
    # products of 16-bit values are exact in fp32; the fp32 sums round a little
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


# --- stmatrix -------------------------------------------------------------------------------------
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
def test_stmatrix(kernels, num, trans):
    """PTX ISA 9.7.14.5.16: the inverse of ldmatrix. Lane l holds (row l/4, cols 2(l%4), 2(l%4)+1)
    of matrix i in r[i] (low half first); with .trans, (rows 2(l%4), 2(l%4)+1, col l/4)."""
    import cupy

    vals = np.random.default_rng(num * 2 + trans).integers(0, 2**32, (32, 4), dtype=np.uint32)
    out = cupy.full(4 * 64, 0, dtype=np.uint16)
    kernels[f"stm<{num}, {'true' if trans else 'false'}>"]((1,), (32,), (cupy.asarray(vals), out))
    want = np.full((4, 8, 8), 0xFFFF, dtype=np.uint16)
    for l in range(32):
        for i in range(num):
            lo, hi = vals[l, i] & 0xFFFF, vals[l, i] >> 16
            if trans:
                want[i, 2 * (l % 4), l // 4], want[i, 2 * (l % 4) + 1, l // 4] = lo, hi
            else:
                want[i, l // 4, 2 * (l % 4)], want[i, l // 4, 2 * (l % 4) + 1] = lo, hi
    np.testing.assert_array_equal(cupy.asnumpy(out).reshape(4, 8, 8), want)


# --- mbarrier phases through the stage ring --------------------------------------------------------
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 7])
def test_stage_ring_phases(kernels, stages, rounds):
    """Each of 3 consumers sees every produced value exactly once, in order, through a ring of
    `stages` slots: a slot reused before every consumer released it, or read before the producer
    committed it, would change a sum."""
    import cupy

    sums = cupy.full(3, -1, dtype=np.int64)
    kernels[f"ring<{stages}>"]((1,), (256,), (np.int32(rounds), sums))
    total = sum(1000 + 7 * i for i in range(rounds))
    assert cupy.asnumpy(sums).tolist() == [total, 2 * total, 3 * total]


# --- named barriers (bar.sync / bar.arrive) ----------------------------------------------------------
def test_named_barriers_alternate_two_warpgroups(kernels):
    """bar.sync waits until the barrier's thread count has arrived, counting bar.arrive: two
    warpgroups handing turns back and forth log 0, 1, 0, 1, ...; a bar.sync that did not wait
    (or an arrive that waited) would let one group log twice in a row."""
    import cupy

    log = cupy.full(10, -1, dtype=np.int32)
    kernels["turns<5>"]((1,), (256,), (log,))
    assert cupy.asnumpy(log).tolist() == [0, 1] * 5
