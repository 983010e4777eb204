"""Everything Python and the CUDA kernels must agree on, defined once.

The kernels in ``kernels_cu/`` hold no copy of these numbers: per-instantiation shapes (tile
sizes, warps, head dims, element types) reach them as template arguments in the name
expressions the op modules build from the tables below, and spec-wide constants as ``-D``
options (``_loader.defines``; a ``.cu`` file that needs one fails to compile without it). Adding a
head dim or a tile entry is an edit here; the op modules, the offline compile check
(``python -m cupyattn check``), the tests and the benchmarks read the tables from this module.

Each tile table entry carries its reason (register, shared-memory and occupancy arithmetic, or
"measured faster"); what was measured, and where, is in benchmarks/results/<run>/README.md ("What
cupyattn/config.py cites from this run"), not here. What a GPU family is (limits, shared memory,
instruction minimums) is cupyattn/gpus.py, re-exported below; the current device is
cupyattn/device.py; the C code-generation helpers (ctype, cbool, defines) are the loader's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# --- element types --------------------------------------------------------------------------
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)   # NumPy and CuPy 14 take bfloat16 through ml_dtypes
DTYPES = (FLOAT32, FLOAT16, BFLOAT16)     # what every op accepts
MMA_DTYPES = (FLOAT16, BFLOAT16)          # what the tensor-core (mma.sync) kernels accept

# the GPU families and hardware limits (cupyattn/gpus.py, data only), under the names the op
# modules and tests read here
from .gpus import (GPU_FAMILIES, IMPL_MIN_CC, IMPL_MIN_CC_BY_HEAD_DIM, IMPL_MIN_CC_BY_HEAD_DIM_REASON,  # noqa: F401,E402
                   INT32_MAX, MAX_BLOCK_THREADS, MAX_GRID_X, MAX_GRID_YZ, MIN_COMPUTE_CAPABILITY, MMA_MIN_CC,
                   MMA_MIN_CC_REASON, SMEM_PER_BLOCK_RESERVED, SMEM_PER_SM, SMEM_PER_SM_BY_ARCH,
                   STATIC_SMEM_BYTES, GpuFamily, a_family_has_less, gpu_family, gpu_family_key, impl_min_cc,
                   impl_runs_on)

# The kernels' C++ names of the dtypes and the other code-generation helpers are the loader's
# (cupyattn/_loader.py: CTYPES, INDEX_CTYPES, VEC16, ctype, cbool, defines).


@contextlib.contextmanager
def override(**settings):
    """These settings of this module for the ``with`` block, then restored (also on an error):
    ``with config.override(ATTN_SM90_ORDER="sections"): ...``. A name this module does not define
    is a ValueError, raised before anything is set (a typo would otherwise time the default)."""
    import sys

    mod = sys.modules[__name__]
    unknown = [k for k in settings if not hasattr(mod, k)]
    if unknown:
        raise ValueError(f"config.override(): no such setting {', '.join(unknown)}")
    saved = {k: getattr(mod, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(mod, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


# --- fused attention (kernels_cu/flash_attn.cu) and decode (kernels_cu/decode.cu) ------------
HEAD_DIMS = (32, 64, 80, 96, 128, 256)   # head dims of the fused attention and decode kernels


def padded_head_dim(d: int, dims=HEAD_DIMS) -> int | None:
    """The head dim a fused kernel with head dims ``dims`` runs an attention() or attention_varlen()
    call of head dim ``d`` at: ``d`` itself, else the next larger one (q, k, v are copied
    zero-padded to it, as FlashAttention-2 pads to its kernels' head dims; q.k and the kept columns
    of P V are unchanged); None past the largest."""
    return next((x for x in sorted(dims) if x >= d), None)


@dataclass(frozen=True)
class FlashTile:
    block_m: int   # query rows per CTA
    block_n: int   # keys per K/V tile
    warps: int
    reason: str


# impl="flash" (SIMT, flash_attn_fwd): (head_dim, element bytes) -> tile. Shared memory per CTA
# = Q tile (block_m x D) + one K/V tile (block_n x (D + pad), K then V in the same buffer) + P
# (block_m x block_n fp32), all within the 48 KB of static shared memory. Registers per lane:
# O takes rows/warp x ceil(D/32) fp32, S takes rows/warp x block_n/32.
FLASH_SIMT_TILES = {
    (32, 2): FlashTile(64, 64, 4, "tiny rows: 16 rows/warp, O 16 + S 32 regs; 24.2 KB smem"),
    (64, 2): FlashTile(64, 64, 4, "16 rows/warp, O 32 + S 32 regs; 32.2 KB smem"),
    (80, 2): FlashTile(64, 64, 8, "D/32 = 2.5 -> 3 O cols; 8 rows/warp keeps O at 24 regs; 36.2 KB"),
    (96, 2): FlashTile(64, 64, 8, "as D=80; Q + K/V + P still under 48 KB (40.2 KB)"),
    (128, 2): FlashTile(64, 32, 8, "block_n 64 would need 48.3 KB; O 32 regs; 32.1 KB"),
    (256, 2): FlashTile(32, 32, 4, "Q tile 16 KB, K/V tile 16 KB; O 64 regs; 36.1 KB"),
    (32, 4): FlashTile(64, 64, 4, "fp32 tiles are twice as large per element; 32.2 KB"),
    (64, 4): FlashTile(64, 32, 8, "block_n 64 would need 48.3 KB; 32.1 KB"),
    (80, 4): FlashTile(64, 32, 8, "8 rows/warp, O 24 regs; 38.1 KB"),
    (96, 4): FlashTile(64, 32, 8, "largest fp32 entry under 48 KB (44.1 KB)"),
    (128, 4): FlashTile(32, 32, 4, "block_m 64 would need 56.1 KB; 36.1 KB"),
    (256, 4): FlashTile(8, 32, 2, "one K/V tile alone is 32.1 KB: block_m 16 -> 50.1 KB; 41.1 KB"),
}

# impl="flash_mma" (tensor cores, flash_attn_mma, fp16/bf16; the default for them): head_dim ->
# tile. Each warp owns block_m / warps = 16 or 32 query rows (1 or 2 m16 tiles, MT). Registers per
# lane: Q fragments MT x D/4 (kept for the whole key loop), O accumulators MT x D/2, S MT x
# block_n/2 (fp32). Dynamic shared memory (flash_mma_smem_bytes): Q tile + FLASH_MMA_K_STAGES K
# tiles + one V tile, rows of D + FLASH_MMA_PAD elements. 128 x 64 wherever registers allow.
FLASH_MMA_PAD = 8        # elements per shared row: an odd number of 16 B units -> no ldmatrix conflicts
FLASH_MMA_K_STAGES = 2   # K_{j+1} loads while S_ij and P_ij V_j run (V_j: one buffer, FA2 order)
FLASH_MMA_TILES = {
    32: FlashTile(128, 64, 4, "4 warps x 32 rows: Q 16 + O 32 + S 64 regs (~200 used); each K/V "
                  "ldmatrix feeds 2 m16 tiles (half the smem reads per mma); 25 KB smem"),
    64: FlashTile(128, 64, 4, "4 warps x 32 rows: the fastest of benchmarks/tune.py's candidates on an H100 "
                  "(benchmarks/results/2026-11-23-h100/README.md); 244-250 regs, no spills; 45 KB smem"),
    80: FlashTile(128, 64, 8, "8 warps x 16 rows: Q 20 + O 40 + S 32 regs; D = 5 k-steps, 10 n8 "
                  "tiles (each x4 load covers 16 columns); 55 KB smem"),
    96: FlashTile(128, 64, 8, "8 warps x 16 rows: Q 24 + O 48 + S 32 regs (~185 used); 65 KB smem"),
    128: FlashTile(128, 64, 8, "8 warps x 16 rows: Q 32 + O 64 + S 32 regs (~210 used; 32 rows/warp "
                   "would need 256 before addresses); 85 KB smem, 1 CTA/SM by registers"),
    256: FlashTile(64, 16, 4, "Q 64 + O 128 regs leave room for 16 keys only (32 keys spill a few "
                   "bytes); 4 warps x 16 rows, 2 CTAs/SM by registers; 58 KB smem"),
}


# flash_mma tiles for devices whose per-block shared memory is below the tile above (Turing's 64 KB:
# D = 96 needs 65 KB, D = 128 85 KB): the same 8 warps x 16 rows with 32 keys per K/V tile. ptxas
# (NVRTC 12.9, sm_75: two m16n8k8 per k-step) uses 168-180 registers at D = 96 and 194-208 at D = 128,
# no spills; S shrinks to 16 registers per lane.
FLASH_MMA_SMALL_SMEM_TILES = {
    96: FlashTile(128, 32, 8, "Turing (64 KB per block): 32 keys per K/V tile, 45.5 KB smem"),
    128: FlashTile(128, 32, 8, "Turing (64 KB per block): 32 keys per K/V tile, 59.5 KB smem"),
}


# flash_mma tiles that replace FLASH_MMA_TILES' entry on one GPU family (GPU_FAMILIES key), where
# ptxas spills the main tile for that family's arch. The spec instantiates each for its family only.
FLASH_MMA_FAMILY_TILES = {
    100: {64: FlashTile(128, 64, 8, "ptxas for sm_100 (NVRTC 12.9) gives the 4-warp tile 255 registers "
                        "and spills 4 B (28 B in its serving variant); 8 warps x 16 rows: 168 registers, no "
                        "spills; slower than the 4-warp tile on an H100 (benchmarks/results/2026-11-23-h100/"
                        "README.md); not run on a Blackwell GPU; 45 KB smem")},
}


def flash_mma_main_tile(head_dim: int, cc: int | None = None) -> FlashTile:
    """The flash_mma tile for ``head_dim`` on a device of compute capability ``cc``: its family's
    FLASH_MMA_FAMILY_TILES entry, else FLASH_MMA_TILES' (``cc`` None: FLASH_MMA_TILES')."""
    family = FLASH_MMA_FAMILY_TILES.get(gpu_family_key(cc), {}) if cc is not None else {}
    return family.get(head_dim) or FLASH_MMA_TILES[head_dim]


def flash_mma_smem_bytes(head_dim: int, tile: FlashTile | None = None) -> int:
    """Dynamic shared memory of the flash_mma kernel for ``head_dim`` (16-bit elements) with ``tile``
    (default FLASH_MMA_TILES[head_dim]): Q_i tile, FLASH_MMA_K_STAGES K_j tiles and one V_j tile,
    each row padded by FLASH_MMA_PAD elements."""
    t = tile or FLASH_MMA_TILES[head_dim]
    return (t.block_m + (FLASH_MMA_K_STAGES + 1) * t.block_n) * (head_dim + FLASH_MMA_PAD) * 2


def flash_mma_tile(head_dim: int, smem_limit: int | None = None, cc: int | None = None) -> FlashTile | None:
    """The flash_mma tile for a device of compute capability ``cc`` with ``smem_limit`` bytes of
    shared memory per block (None: any): flash_mma_main_tile's, else FLASH_MMA_SMALL_SMEM_TILES',
    else None (nothing fits)."""
    for t in (flash_mma_main_tile(head_dim, cc), FLASH_MMA_SMALL_SMEM_TILES.get(head_dim)):
        if t is not None and (smem_limit is None or flash_mma_smem_bytes(head_dim, t) <= smem_limit):
            return t
    return None


# --- decode (kernels_cu/decode.cu) ------------------------------------------------------------
def conflict_free_pitch(row_bytes: int, threads_per_row: int) -> int:
    """Smallest smem row pitch >= ``row_bytes`` (a multiple of 16 B) at which the 8 lanes of a
    quarter-warp reading 16-byte chunks (row lane // tpr, chunk lane % tpr) hit 8 distinct
    16-byte bank groups: the SIMT decode kernel's score loop reads K that way."""
    pitch = -(-row_bytes // 16) * 16
    while True:
        groups = {((lane // threads_per_row) * pitch // 16 + lane % threads_per_row) % 8 for lane in range(8)}
        if len(groups) == 8:
            return pitch
        pitch += 16


@dataclass(frozen=True)
class DecodeTile:
    block_n: int        # keys per cp.async ring slot (each slot holds that many K rows and V rows)
    stages: int         # ring depth: tiles t+1 .. t+stages-1 are in flight while tile t is computed
    warps: int
    blocks_per_sm: int  # __launch_bounds__ minimum (caps registers), and the occupancy on an H100
                        # that the split rule assumes; a family whose shared memory per SM holds
                        # fewer rings gets that fewer (decode.cu resident_min_blocks)
    pitch: int          # smem bytes per K/V row
    reason: str

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def ring_bytes(self) -> int:
        """Dynamic shared memory of the kernel: the K/V ring, [stages][K, V][block_n][pitch]."""
        return self.stages * 2 * self.block_n * self.pitch


DECODE_HEAD_TILE = 8        # impl="simt": query heads per block (larger groups take several tiles)
DECODE_MMA_MIN_GROUP = 4    # impl="auto" uses the tensor cores from this GQA group size on (fp16/bf16)
DECODE_MMA_ROWS = 16        # impl="mma": query heads per m16n8k16 A tile (padded with zero rows)
DECODE_MMA_MAX_MTILES = 2   # impl="mma": up to 32 heads per block, so MQA with 32 heads reads K/V once
DECODE_IMPLS = ("auto", "simt", "mma")


def _simt_tile(d: int, itemsize: int, block_n: int, stages: int, blocks: int, why: str) -> DecodeTile:
    row = d * itemsize
    pitch = conflict_free_pitch(row, 128 // block_n)
    kb = stages * 2 * block_n * pitch / 1024
    return DecodeTile(block_n, stages, 4, blocks, pitch, f"{why}; row {row} B, pitch {pitch} B, ring {kb:.1f} KB")


# impl="simt" (decode_kernel, any dtype): (head_dim, element bytes) -> tile. 128 threads; a key's
# dot products are shared by 128 / block_n adjacent lanes, so block_n shrinks as rows grow. 3
# stages keep two K/V tiles in flight per block. blocks_per_sm is what fits an SM's 228 KB (ring +
# q tile and scores + 1 KB reserve; tests check it against ptxas' numbers), at most 4, which caps
# registers at 128 (the kernels use 80-128 with no spills).
DECODE_SIMT_TILES = {
    (32, 2): _simt_tile(32, 2, 64, 3, 4, "2 lanes per key, 2 chunks each"),
    (64, 2): _simt_tile(64, 2, 64, 3, 3, "2 lanes per key, 4 chunks each"),
    (80, 2): _simt_tile(80, 2, 32, 3, 4, "4 lanes per key, 3 chunks each (the last partial)"),
    (96, 2): _simt_tile(96, 2, 32, 3, 4, "4 lanes per key, 3 chunks each"),
    (128, 2): _simt_tile(128, 2, 32, 3, 3, "4 lanes per key, 4 chunks each"),
    (256, 2): _simt_tile(256, 2, 16, 3, 3, "8 lanes per key: one key per quarter-warp, no pad needed"),
    (32, 4): _simt_tile(32, 4, 64, 3, 3, "fp32 rows twice as long: as fp16 D=64"),
    (64, 4): _simt_tile(64, 4, 32, 3, 3, "as fp16 D=128"),
    (80, 4): _simt_tile(80, 4, 16, 3, 4, "8 lanes per key, 20 chunks per row"),
    (96, 4): _simt_tile(96, 4, 16, 3, 4, "8 lanes per key; block_n 32 would need a 448 B pitch"),
    (128, 4): _simt_tile(128, 4, 16, 3, 4, "8 lanes per key, 4 chunks each"),
    (256, 4): _simt_tile(256, 4, 8, 3, 3, "1 KB rows: 16 lanes per key, 4 chunks each"),
}


def _mma_tile(d: int, m_tiles: int, warps: int, block_n: int, stages: int, blocks: int, why: str) -> DecodeTile:
    pitch = 2 * d + 16   # +16 B: the 8 rows of an ldmatrix phase fall in distinct bank groups
    kb = stages * 2 * block_n * pitch / 1024
    return DecodeTile(block_n, stages, warps, blocks, pitch,
                      f"{why}; {m_tiles * 16} head rows, {block_n * m_tiles // warps} keys per warp, ring {kb:.1f} KB")


# impl="mma" (decode_mma_kernel, fp16/bf16): (head_dim, m-tiles) -> tile. The block's warps are
# m_tiles x (warps / m_tiles): a warp scores its own keys of the tile for one 16-head A tile, keeps
# its own online-softmax state and O (head_dim / 2 fp32 registers per lane), and the slices are
# merged once at the end. blocks_per_sm follows from smem (ring + q tile + 1 KB reserve) on 228 KB.
DECODE_MMA_TILES = {
    (32, 1): _mma_tile(32, 1, 4, 64, 3, 6, "O 16 registers; 6 blocks cap registers at 85"),
    (64, 1): _mma_tile(64, 1, 4, 64, 3, 3, "O 32 registers; 4 blocks would need 231 KB"),
    (80, 1): _mma_tile(80, 1, 4, 64, 3, 3, "O 40 registers"),
    (96, 1): _mma_tile(96, 1, 4, 64, 3, 2, "O 48 registers"),
    (128, 1): _mma_tile(128, 1, 4, 64, 3, 2, "O 64 registers; 2 blocks = 221 KB"),
    (256, 1): _mma_tile(256, 1, 2, 32, 3, 2, "O 128 registers: 2 warps of 16 keys"),
    (32, 2): _mma_tile(32, 2, 4, 64, 3, 6, "2 head tiles x 2 key slices"),
    (64, 2): _mma_tile(64, 2, 4, 64, 3, 3, "2 head tiles x 2 key slices"),
    (80, 2): _mma_tile(80, 2, 4, 64, 3, 3, "2 head tiles x 2 key slices"),
    (96, 2): _mma_tile(96, 2, 4, 64, 3, 2, "2 head tiles x 2 key slices"),
    (128, 2): _mma_tile(128, 2, 4, 64, 3, 2, "2 head tiles x 2 key slices; 224 KB for 2 blocks"),
    (256, 2): _mma_tile(256, 2, 4, 32, 2, 2, "O 128 registers, 17 KB q tile: 2 stages keep 2 blocks/SM"),
}
DECODE_MAX_SPLITS = 512     # bound of the combine kernel (its per-split weights live in smem)
DECODE_COMBINE_THREADS = 128
# automatic split count (decode.choose_num_splits)
DECODE_MIN_KEYS_PER_SPLIT = 256   # an automatic split never gets fewer keys than this
DECODE_SPLIT_OVERHEAD_KEYS = 64   # fixed cost of one split (prologue, epilogue, its share of the
                                  # combine) in keys: stops the rule from trading a whole wave
                                  # for a few percent less wave quantisation
# Blocks per SM the split rule counts as one wave: 1, not the tile's occupancy. Evidence: a regression
# pin of four measured points (tests/cupyattn/test_decode.py; the run and its caveats:
# benchmarks/results/2026-11-23-h100/README.md).
DECODE_SPLIT_BLOCKS_PER_SM = 1

# --- decode schedule and paged addressing ---- begin ---------------------------------
# Split rules of decode_attention / decode_attention_paged (split_rule=None takes the default):
#   "cost"   choose_num_splits: least waves x (keys per split + DECODE_SPLIT_OVERHEAD_KEYS), the
#            same chunk count for every sequence, a separate combine launch unless fused_combine
#   "waves"  wave_splits: FlashAttention-3's rule (hopper/heuristics.h num_splits_heuristic): the
#            smallest split count whose wave efficiency over the SMs is within
#            DECODE_WAVE_EFFICIENCY of the best, at most DECODE_WAVE_MAX_SPLITS; the efficiency
#            counts each sequence's own chunks (a ragged batch), each sequence is split into
#            chunks of about split_keys keys (decode.cu SeqSplit: short sequences take fewer
#            blocks), and the combine is fused into the decode kernel (no second launch)
# The default stays "cost" (measured, H100 2026-11-26) until a GPU run measures "waves": it has
# not yet run on a GPU (CPU emulator only). Switching is this one line.
DECODE_SPLIT_RULES = ("cost", "waves")
DECODE_SPLIT_RULE = "cost"
DECODE_WAVE_EFFICIENCY = 0.85   # FA3: the smallest split count within 85% of the best efficiency
DECODE_WAVE_MAX_SPLITS = 128    # FA3's cap; MQA at B=1, 128k keys on 132 SMs then takes 109 splits
# Paged decode addressing: False, each K/V row load first reads its page id from the block table in
# global memory (the load the H100 run of 2026-11-26 found paged decode waiting on: page 16 at 0.53x
# of the contiguous kernel); True, the STAGED kernels (decode.cu, paged.cuh PageWindow) stage a
# split's page ids in shared memory a window ahead of the K/V ring. Not yet run on a GPU (CPU
# emulator only): False until a GPU run measures it. Switching is this one line.
DECODE_PAGE_STAGING = False
# Page layouts of PagedKVCache / the paged ops: "NHD" pages [num_pages, page_size, Hkv, D] (vLLM,
# flash-attention; one head's rows Hkv * D elements apart), "HND" [num_pages, Hkv, page_size, D]
# (FlashInfer's kv_layout="HND"; one head's rows of a page contiguous). PagedKVCache's default is
# "NHD" until a GPU run measures "HND" (not yet run on a GPU); the raw paged functions always
# default to "NHD" (the caller's arrays say which layout they hold).
PAGED_LAYOUTS = ("NHD", "HND")
PAGED_DEFAULT_LAYOUT = "NHD"
# --- decode schedule and paged addressing ---- end -----------------------------------

# --- RoPE (kernels_cu/rope.cuh: layers.rope, the cache appends, the fused step, the megakernel) ---
# Rotation pairs: "adjacent" (x[2i], x[2i+1]), GGUF / llama.cpp's "normal" style; "neox" (x[i],
# x[i + D/2]), the NEOX template flag of the kernels.
ROPE_STYLES = ("adjacent", "neox")

# --- KV-cache append (kernels_cu/kvcache.cu) ------------------------------------------------
KV_APPEND_THREADS = 128
KV_APPEND_ELEMS_PER_BLOCK = 2048  # tokens per block = this // head_dim
KV_ADVANCE_THREADS = 256
# fused rope + append (KVCache.append_qkv): one item = one rotation pair of one head of one token.
# A decode token of SmolLM2 is (9 + 2*3) heads x 32 pairs = 480 items: one block per sequence, which
# then advances its own length (no second launch). Prefill tokens are grouped so that a block has
# about KV_ROPE_APPEND_ITEMS_PER_BLOCK items (16 per thread), enough to amortise the double-precision
# angle setup without leaving SMs idle for prompts of a few hundred tokens.
KV_ROPE_APPEND_THREADS = 256
KV_ROPE_APPEND_ITEMS_PER_BLOCK = 4096

# --- GEMM (kernels_cu/gemm.cu) ----------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    bm: int
    bn: int
    bk: int
    threads: int
    reason: str
    stages: int = 1       # mma: depth of the cp.async ring (simt prefetches one tile into registers)
    min_blocks: tuple = (1, 1)  # mma: __launch_bounds__ minimum blocks per SM (caps registers), (NT, NN)


GEMM_MMA_PAD = 8   # halves of padding per smem row of the mma kernel
GEMM_GROUP_M = 8   # mma: tile rows per raster group (a group's B tiles stay in L2)
GEMM_TILES = {
    "simt": GemmTile(128, 64, 16, 256, "8x4 register micro-tile per thread: 32 accumulators + 12 "
                     "fragment + 12 prefetch registers; As 16x132 + Bs 16x68 fp32 = 12.7 KB smem"),
    "mma": GemmTile(128, 128, 32, 256, "8 warps of 64x32 = 4x4 mma tiles (64 fp32 acc/thread); "
                    "4 stages x 2 x 128x(32+8) halves = 80 KB dynamic smem (NN 74 KB): three k-tiles "
                    "in flight, one barrier per k-tile; NT at 2 blocks/SM (162 KB fits an A100's "
                    "164 KB and an H100's 228 KB) caps registers at 128 with no spills, NN needs ~190 "
                    "and stays at 1 block/SM; the +8-half row pad makes every ldmatrix phase hit 32 "
                    "distinct banks", stages=4, min_blocks=(2, 1)),
}


def gemm_mma_smem_bytes(tile: GemmTile, nt: bool) -> int:
    """Dynamic shared memory of gemm_mma_kernel: per stage an A tile [bm][bk+pad] and a B tile,
    NT [bn][bk+pad] or NN [bk][bn+pad], 16-bit elements (the kernel's own layout)."""
    b_elems = tile.bn * (tile.bk + GEMM_MMA_PAD) if nt else tile.bk * (tile.bn + GEMM_MMA_PAD)
    return tile.stages * (tile.bm * (tile.bk + GEMM_MMA_PAD) + b_elems) * 2


@dataclass(frozen=True)
class SkinnyTile:
    warps: int     # split K; their partial C tiles are summed through smem
    n_tiles: int   # 8-row groups of W per block: each A fragment feeds this many mma's
    chunks: int    # 16-byte chunks a lane loads per W row per step (bytes in flight)
    reason: str


# impl="skinny" (gemm_nt with M <= 16, the decode projections x @ W^T): memory-bound on W, so the
# tile is sized for bytes in flight, not data reuse.
GEMM_SKINNY = SkinnyTile(8, 2, 4, "256 threads; a warp step reads 16 rows x 256 B of W (4 KB in "
                         "flight per warp, 32 KB per block) and 2 x 256 B of x per lane; 16 rows per "
                         "block keep 256 blocks for N = 4096 (about 2 per SM) while each x fragment "
                         "serves 2 mma's; 8 KB static smem for the cross-warp sum")
GEMM_SKINNY_MAX_M = 16   # impl="auto" takes skinny for gemm_nt when the (batch-folded) M is at most this
GEMM_IMPLS = ("auto", "simt", "mma", "skinny", "wgmma")


# impl="wgmma" (kernels_cu/gemm_sm90.cu, Hopper only): 128 x BN output tiles, BK = 64 (one 128-byte
# swizzle row of 16-bit elements), a producer warpgroup and two consumer warpgroups of 64 rows each
# (384 threads, one block per SM, persistent). Per stage: A 16 KB + B BN x 128 B; dynamic shared
# memory = stages x that + 1 KB for the 1 KB alignment of the swizzled stages (227 KB available).
# Not yet run on a GPU: the reasons are shared-memory and register arithmetic, to be replaced by
# `python -m benchmarks.tune gemm` measurements.
@dataclass(frozen=True)
class WgmmaTile:
    bn: int
    stages: int
    reason: str
    bm: int = 128
    bk: int = 64

    @property
    def stage_bytes(self) -> int:
        return (self.bm + self.bn) * self.bk * 2

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes + 1024


GEMM_WGMMA_TILES = {
    256: WgmmaTile(256, 4, "m64n256 per consumer: 128 fp32 accumulators per thread (setmaxnreg 232); "
                   "48 KB per stage, 4 stages = 193 KB: three k-blocks in flight behind the one being "
                   "multiplied; each A byte read from shared memory feeds 256 columns (the widest wgmma)"),
    128: WgmmaTile(128, 6, "for grids that 128 x 256 tiles leave short of the SMs (fewer tiles than SMs): "
                   "twice the tiles; 64 accumulators per thread, 32 KB per stage, 6 stages = 193 KB"),
}
GEMM_WGMMA_GROUP_M = 8        # tile rows per raster group (the B tiles of a group stay in L2)
GEMM_WGMMA_REGS = (40, 232)   # setmaxnreg: producer warpgroup, consumer warpgroups (128 x 40 + 256 x 232 <= 64K)
# impl=None on sm_90 takes wgmma (for TMA-readable operands) for these dtypes where M, N and K are
# all at least the size given: what a GPU run has shown correct (GPU tier, sanitizers) and faster
# than mma in the same run (benchmarks/results/2026-11-26-h100/README.md). Smaller shapes keep mma.
GEMM_AUTO_WGMMA = {FLOAT16: 4096, BFLOAT16: 4096}


def gemm_wgmma_tile(m: int, n: int, nbatch: int, sms: int) -> WgmmaTile:
    """The 128 x 256 tile, unless its tiles would leave SMs idle where 128 x 128 tiles would not."""
    wide, narrow = GEMM_WGMMA_TILES[256], GEMM_WGMMA_TILES[128]
    tiles = nbatch * -(-m // wide.bm) * -(-n // wide.bn)
    return narrow if tiles < sms and nbatch * -(-m // narrow.bm) * -(-n // narrow.bn) > tiles else wide

# --- fused decode step (kernels_cu/fused_decode.cu, cupyattn/fused.py, tinylm) -----------------
# The fused projections run skinny_tile with GEMM_SKINNY's shape: they stream the same weights the
# same way, and a block's 2 x 8-row groups are what the RoPE epilogue needs (8 rotation pairs of
# one head: adjacent pairs in 16 consecutive rows, NeoX pairs in two 8-row groups D/2 apart).
FUSED_SKINNY = GEMM_SKINNY
# (tinylm's choice of this step over the unfused one is tinylm's switch: tinylm/config.py)
# Launch the fused decode kernels with programmatic dependent launch (cuLaunchKernelEx through
# cuda-bindings, griddepcontrol in the kernels; sm_90+). False: not measured on a GPU yet, and it
# needs the cuda-bindings package.
FUSED_DECODE_PDL = False

# --- the megakernel: one persistent kernel per decode step (kernels_cu/megakernel.cu) -------------
# tinylm takes it only when asked (tinylm/config.py TINYLM_MEGAKERNEL). Every value here is
# arithmetic, to be replaced by measurements (`bash benchmarks/gpu_run.sh mega`) when a GPU run has them.
MEGAKERNEL_THREADS = 256      # 8 warps: one weight row pair per warp of a 16-row GEMV tile, one
                              # batch row per warp when the input rows are loaded (batch <= 8)
MEGAKERNEL_STAGES = 6         # weight ring: 6 x 8 KB chunks, 5 in flight per SM (about 5 MB over
                              # 132 SMs, twice what 3 TB/s at ~1 us latency needs); ring + 17 KB
                              # scratch + batch-8 fp16 rows of SmolLM2's widest input (24 KB) fit
                              # the 99 KB parts
MEGAKERNEL_MAX_BATCH = 8      # rows per step (the GEMV keeps 2 x 8 accumulators per lane)
MEGAKERNEL_MAX_HEAD_DIM = 128  # attention keeps head_dim / 32 output dims per lane and head
MEGAKERNEL_HEAD_TILE = 4      # query heads of one kv head scored per pass over its keys (GQA
                              # groups above 4 take several passes)
MEGAKERNEL_MIN_KEYS_PER_SPLIT = 256  # a decode step splits its keys only when each split gets this many
MEGAKERNEL_MAX_SPLITS = 32
MEGAKERNEL_BLOCKS = None      # blocks of a launch (persistent: one per SM); None = the device's SM count
# The plan's knobs (cupyattn.megakernel_llama.MegaKnobs reads them; `benchmarks/gpu_run.sh mega` A/Bs
# them). Each default is the plan the 2026-11-27 H100 run measured; the other values are correct on
# the emulator and predicted faster by the cost model (docs/megakernel.md), not yet run on a GPU.
MEGAKERNEL_ATTN = "v1"        # attention instruction: "v1" (a lane per key, each load consumed as it is
                              # issued) or "ring" (K/V chunks staged by cp.async one chunk ahead)
MEGAKERNEL_ATTN_SHARE = 0.0   # split keys, then heads, until the attention tiles fill this share of the
                              # blocks (0: only MIN_KEYS_PER_SPLIT decides, today's rule)
MEGAKERNEL_ATTN_MIN_KEYS = 8   # keys per split at least when ATTN_SHARE drives the splits (SmolLM2 at 64-127
                              # keys: 8 splits x 3 kv heads x 3 head splits = 72 tiles on 132 SMs)
MEGAKERNEL_ATTN_STAGE_BYTES = 12 * 1024  # one staged K+V chunk of the ring attention (two are in flight):
                              # 42 keys of SmolLM2's fp16 rows, 11 of fp32 head_dim 128
MEGAKERNEL_DEPS = "layer"     # "layer": a projection waits for every tile of the op before it; "fine":
                              # split-K O and down projections into fp32 partial slots, each waiting only
                              # for the tiles whose rows it reads (two device-wide waits per layer)
MEGAKERNEL_DOWN = "narrow"    # with DEPS "fine": "narrow" (the narrowest column chunks of the down
                              # projection) or "fit" (the most chunks whose tiles fit one round on the blocks)
MEGAKERNEL_GATE_UP_ROWS = 8   # ffn rows per gate|up instruction: 8 (one GEMV tile) or 16 (two in turn on the
                              # rows loaded once: SmolLM2's gate|up in one round on 132 SMs)
MEGAKERNEL_FOLD_MERGE = False  # merge split attention partials in the O projection's load (no reduce op)
MEGAKERNEL_SPIN_NS = 1024     # a waiter's longest sleep between polls (it backs off from 32 ns); 0: no sleep
MEGAKERNEL_SAMPLE = "block"   # "block": one block draws a sequence's token; "two_level": chunks of the
                              # vocabulary on many blocks (argmax, top-k/top-p candidates, mass), then one merge

# --- row softmax (kernels_cu/row_softmax.cu) --------------------------------------------------
SOFTMAX_VPTS = (1, 2, 4, 8, 16, 32)     # values per lane of the warp-per-row kernel
SOFTMAX_WARP_MAX = 32 * SOFTMAX_VPTS[-1]  # longer rows go to the block-per-row kernel
SOFTMAX_ROWS_PER_BLOCK = 4             # warp-per-row: 4 rows per 128-thread block
SOFTMAX_BLOCK = 512                    # block-per-row: a 1M-element row is ~2K elements per
                                       # thread per pass; 16 warps keep loads in flight
# block-per-row with the row in registers (v3, SOFTMAX_BLOCK threads, VPT values each) for
# SOFTMAX_WARP_MAX < n <= SOFTMAX_BLOCK * 32: VPT -> min blocks per SM (__launch_bounds__). Why:
# v2 reads each row twice and loops with one load in flight per thread: v3 keeps the row in
# registers (measured faster on an H100: benchmarks/results/2026-11-23-h100/README.md).
# 2 blocks per SM (64 registers) while the values fit; VPT 32 takes 80-95 registers (1 block).
SOFTMAX_REG_TILES = {4: 2, 8: 2, 16: 2, 32: 1}  # ascending VPT: the host takes the first that fits
SOFTMAX_REG_MAX = SOFTMAX_BLOCK * max(SOFTMAX_REG_TILES)

# --- sampling (kernels_cu/sampling.cu) -------------------------------------------------------
SAMPLING_THREADS = 1024     # one block per sequence: at batch 1 it is the only block, so it takes
                            # the most threads a block may have (49152 logits = 48 per thread)
SAMPLING_MASS_BITS = 40     # fixed-point probability mass of the most likely token (2^40)
SAMPLING_MAX_VOCAB = 2**23  # V masses of at most 2^40 sum below 2^63: no 64-bit overflow

# --- layer ops (kernels_cu/layers.cu) ---------------------------------------------------------
LAYERS_THREADS = 256        # block size of the grid-strided kernels (rope, swiglu, add, embedding)
LAYERS_MAX_BLOCKS = 1024    # 1024 blocks of 256 threads fill an H100 (132 SMs x 8 blocks) once
RMSNORM_WARPS = 4           # rows per block of the warp-per-row rmsnorm
RMSNORM_WARP_MAX_D = 1024   # wider rows go to the block-per-row rmsnorm
RMSNORM_IMPLS = ("auto", "warp", "block")

# --- begin: Hopper attention (impl="wgmma", "wgmma_persistent": kernels_cu/flash_attn_sm90.cu) ----
# One block per 128-query tile: a producer warpgroup (one warp issues TMA) and two consumer
# warpgroups of 64 rows each (384 threads, one block per SM). Per consumer thread: S_ij takes
# block_n / 2 fp32 registers, O_i head_dim / 2, P_ij block_n / 4 (16-bit pairs). Shared memory: Q_i
# (128 x D) + `stages` K slots + `stages` V slots (block_n x D each), 16-bit elements, + 1 KB for
# the 1 KB alignment of the swizzled boxes (227 KB available). Not yet run on a GPU: the reasons
# are register and shared-memory arithmetic, to be replaced by `python -m benchmarks.tune
# attention-wgmma` measurements.
@dataclass(frozen=True)
class AttnWgmmaTile:
    block_n: int   # keys per K/V slot: the N of S = Q K^T and the k-extent of O += P V
    stages: int    # K slots and V slots each (K_{j+1}.. load while S_ij, softmax and P V_j run)
    reason: str
    block_m: int = 128
    overlap: bool = True  # softmax of tile j while P_{j-1} V_{j-1} runs (FA3's intra-warpgroup overlap)
    pingpong: bool = True  # the two consumer warpgroups take turns issuing wgmmas (FA3's ping-pong)

    def smem_bytes(self, head_dim: int) -> int:
        return (self.block_m + 2 * self.stages * self.block_n) * head_dim * 2 + 1024


# Every entry overlaps the softmax with the previous tile's P V and ping-pongs the two consumer
# warpgroups (FlashAttention-3's ablation, H100 D=128: 570 TFLOP/s without either, 661 with
# both); here both are unmeasured, and benchmarks.tune tries each off.
ATTN_WGMMA_TILES = {
    64: AttnWgmmaTile(128, 3, "S 64 + O 32 + P 32 registers; 16 KB per K or V slot, 3 stages = 113 KB: "
                      "at D=64 a tile's wgmma work is short, so two tiles stay in flight behind it"),
    128: AttnWgmmaTile(128, 2, "S 64 + O 64 + P 32 registers (FA3's 128 x 128 tile); 32 KB per slot, "
                       "2 stages = 161 KB: K_{j+1} and V_{j+1} load while tile j is computed"),
    256: AttnWgmmaTile(64, 2, "O alone is 128 registers: S 32 + P 16 keep the consumers under 232; "
                       "32 KB per slot, 2 stages + a 64 KB Q tile = 193 KB"),
}
ATTN_WGMMA_REGS = (40, 232)   # setmaxnreg: producer warpgroup, consumer warpgroups (as the GEMM's)
ATTN_WGMMA_STAGE_CHOICES = (2, 3, 4)   # what benchmarks.tune may try (shared memory permitting)
# attention(impl=None) on sm_90 takes wgmma for these (dtype, head dim) pairs: those a GPU run has
# shown correct (GPU tier, sanitizers) and faster than flash_mma in the same run
# (benchmarks/results/2026-11-26-h100-run3/README.md); the other pairs keep flash_mma until timed.
ATTN_AUTO_WGMMA = ((FLOAT16, 64), (FLOAT16, 128), (FLOAT16, 256), (BFLOAT16, 128))
# impl=None of each entry point takes wgmma_persistent on sm_90 for these (dtype, head dim) pairs:
# shown correct by the GPU tier and faster than the previous default in the same run
# (benchmarks/results/2026-11-27-h100/README.md); the pairs not timed keep the previous default. The
# run's racecheck reports and why the kernel is kept as measured: docs/hopper.md.
ATTN_AUTO_PERSISTENT = {
    "attention": ((FLOAT16, 256),),   # causal calls only
    "attention_varlen": ((FLOAT16, 64), (FLOAT16, 128), (FLOAT16, 256), (BFLOAT16, 128)),
    "attention_paged": ((FLOAT16, 128),),
}

# impl="wgmma_persistent": the same kernel (kernels_cu/flash_attn_sm90.cu) under its persistent
# scheduler, one block per SM; also window, softcap, packed (attention_varlen) and paged
# (attention_paged) sequences. First run on a GPU 2026-11-27 (H100, then its own kernel file):
# impl=None takes it where ATTN_AUTO_PERSISTENT (above) says. Its tiles: impl="wgmma"'s, except at
# D=256, measured on 2026-11-27 without the softmax / P V overlap (the kernel of that run needed 240
# registers for it; the unified kernel fits it in 232 with no spill: ATTN_SM90_OVERLAP=True).
ATTN_WGMMA_PERSISTENT_TILES = {
    64: ATTN_WGMMA_TILES[64],
    128: ATTN_WGMMA_TILES[128],
    256: AttnWgmmaTile(64, 2, "impl='wgmma''s D=256 tile without the softmax / P V overlap, as measured on "
                       "2026-11-27: O 128 + S 32 registers at the softmax, P 16 packed after it", overlap=False),
}
# Equal tiles (no causal, window or key_lengths on dense inputs) take the static order (block i:
# tiles i, i + grid, ...); unequal ones are claimed from a counter, longest first.
ATTN_WGMMA_STATIC_WHEN_EQUAL = True
# Share of the L2 the K and V of one head section may take: the tiles in flight (grid = SMs) are
# those of a few sections, and the K/V they read must stay in L2 beside the Q tiles and O rows
# streaming through it. FlashAttention-3 (hopper/tile_scheduler.hpp) budgets 32 MB of the H100's
# 50 MB; the same share here. Unmeasured.
ATTN_WGMMA_L2_SHARE = 0.64
# Pages shorter than this take one TMA copy per 1-4 rows of a key tile; refused on v4 (flash_mma
# reads any page size). 8 rows x 128 B = one 1 KB 128-byte-swizzle atom per copy.
ATTN_WGMMA_MIN_PAGE = 8


def attn_wgmma_heads_per_section(l2_bytes: int, kv_bytes_per_head: int, group: int, hq: int) -> int:
    """Query heads of one L2 section of the Hopper kernel's tile order where the traffic model is
    not run (packed and paged sequences, windows): as many whole GQA groups (``group`` query heads
    share one K/V head of ``kv_bytes_per_head`` bytes, K and V) as ATTN_WGMMA_L2_SHARE of the L2
    holds, at least one group, at most ``hq``."""
    kv_heads = max(1, int(l2_bytes * ATTN_WGMMA_L2_SHARE) // max(1, kv_bytes_per_head))
    return max(1, min(hq, kv_heads * group))


# Variants of the Hopper kernel (kernels_cu/flash_attn_sm90.cu), each built by the offline check and
# tested on the CPU emulator, none yet run on a GPU: opt-in until `benchmarks/gpu_run.sh causal`
# (benchmarks/causal_sweep.py) times them beside the defaults and torch SDPA in one run.
# The scheduler of impl="wgmma" (and of impl=None where it takes "wgmma"): "grid" (one block per
# tile; the default) or "persistent" (one block per SM, as impl="wgmma_persistent").
ATTN_SM90_DENSE_SCHEDULER = "grid"
# The tile order: "v3" (the default, as the 2026-11-27 run measured it): impl="wgmma" on dense inputs
# keeps the grid order of the kernel before the schedulers were split out (causal: rank r of every
# (sequence, head) side by side, heaviest first; otherwise head after head), which the traffic model
# puts at 4.2 GB of K/V at B4 H32 S4096 D128 causal, and the persistent scheduler sections heads by
# the L2-share rule below. "sections": both take dense calls in head sections the traffic model
# sizes (0.27 GB there); the knob below applies to it.
ATTN_SM90_ORDER = "v3"
# Query heads per L2 section of the tile order (both schedulers; ATTN_SM90_ORDER = "sections"): None lets the K/V traffic model
# (cupyattn/kv_traffic.py) pick it for dense calls (the rule above elsewhere); an int fixes it
# (whole GQA groups, at most Hq).
ATTN_SM90_SECTION = None
# impl="wgmma" at D=128 without causal or window: FlashAttention-3's 128 x 176 tile (more keys per
# wgmma, fewer softmax rounds) in place of 128 x 128. Without the softmax / P V overlap: overlapped,
# ptxas (NVRTC 12.9) spills 80 B at 232 registers (S 88 + O 64 + P 44 live at once).
ATTN_SM90_WIDE_N = False
ATTN_SM90_WIDE_TILE = AttnWgmmaTile(176, 2, "S 88 + O 64 registers at the softmax, P 44 after it; 44 KB per "
                                    "slot, 2 stages = 209 KB; no overlap (it would spill)", overlap=False)
# FlashAttention-3's intra-warpgroup overlap forced on (True) or off (False) where the tile tables
# say otherwise; built for D=128 (both schedulers) and the persistent D=256 tile. None: the tables.
ATTN_SM90_OVERLAP = None
# --- end: Hopper attention ---------------------------------------------------------------------

# === GPU families (cupyattn/gpus.py) and the tiles of the families with less shared memory ======
def flash_mma_min_cc(dtype, head_dim: int) -> int:
    """Minimum compute capability of the flash_mma kernel for ``dtype`` and ``head_dim``."""
    return impl_min_cc("attention", "flash_mma", dtype, head_dim)


# GEMM mma tile for devices whose per-block shared memory is below GEMM_TILES["mma"]'s (Turing's
# 64 KB): the same warp tiling with a 2-stage ring, 40 KB; one block per SM needs no register cap.
GEMM_MMA_SMALL_SMEM = GemmTile(128, 128, 32, 256, "Turing (64 KB per block): 2 stages x 2 x 128x(32+8) "
                               "halves = 40 KB; one k-tile in flight while one is multiplied",
                               stages=2, min_blocks=(1, 1))
# Decode tiles whose ring + static arrays pass the device's per-block shared memory (Turing's 64 KB:
# fp16 D=64/128 SIMT at 65-67 KB; 99 KB parts: mma D=128 at 107 KB) run with a 2-deep ring, one
# K/V tile in flight while one is scored (a third less memory); mma tiles that still do not fit
# leave impl="auto" to the SIMT kernel.
DECODE_SMALL_SMEM_STAGES = 2
# impl="mma" decode tiles for what neither the tile nor its 2-deep ring fits (Turing's 64 KB: fp16
# D = 128, 256), so that an explicit impl="mma" runs on a T4 at every head dim: fewer keys per ring
# slot and fewer warps, one block per SM there (no register cap). impl="auto" does not take them:
# decode streams K/V, and the SIMT kernel's 4 warps keep more loads in flight than 1-2 warps of
# these (unmeasured on a T4). ptxas (NVRTC 12.9, sm_75): 140-255 registers, no spills.
DECODE_MMA_SMALL_SMEM_TILES = {
    (128, 1): _mma_tile(128, 1, 2, 32, 3, 1, "2 warps x 16 keys; ring + q tile 56 KB"),
    (128, 2): _mma_tile(128, 2, 4, 32, 3, 1, "2 head tiles x 2 key slices of 16; ring + q tile 60 KB"),
    (256, 1): _mma_tile(256, 1, 1, 16, 3, 1, "one warp of 16 keys (O 128 registers); ring + q tile 58 KB"),
    (256, 2): _mma_tile(256, 2, 2, 16, 2, 1, "one warp per head tile; 2 stages: ring + 17 KB q tile 50 KB"),
}
# === end GPU families ===========================================================================

# --- serving attention (cupyattn/varlen.py, cupyattn/paged.py) ---- begin ----------
# The serving variants reuse the tile tables above (FLASH_*_TILES, DECODE_*_TILES): a packed or
# paged sequence is read tile by tile exactly as a contiguous one, only the row addresses differ.
PAGED_MAX_PAGE_SIZE = 256   # pages of 1 .. 256 tokens (powers of two: a position splits by shift
                            # and mask); 16 is the usual vLLM / FlashInfer size
# softcap (attention, attention_varlen, attention_paged, decode_attention, decode_attention_paged):
# the kernels cap a score s in log2 units as C tanh(s / C) with C = softcap * log2(e) in float32
# (kernels_cu/paged.cuh soft_cap), built with -ftz=true. C must be a normal float32: a subnormal C
# flushes to 0, which means "off" (softcap=1e-50 silently uncapped), and an infinite one makes
# every score NaN (softcap=1e39). And s / C must not flush to 0 for a score that matters: below
# 2^100, only |s| < 2^-25 (far under the float32 rounding of a logit near 1) can. So a softcap is
# 0 / None (off) or lies in [SOFTCAP_MIN, SOFTCAP_MAX] (about 2.4e-38 to 1.3e30; Gemma 2 uses 30
# and 50); _checks.check_softcap refuses the rest, naming the range.
SOFTCAP_MIN = 2.0 ** -125
SOFTCAP_MAX = 2.0 ** 100
# --- serving attention ---------------------------------------------------------------- end ----
