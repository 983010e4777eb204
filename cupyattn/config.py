"""Everything Python and the CUDA kernels must agree on, defined once.

The kernels in ``kernels_cu/`` hold no copy of these numbers: per-instantiation shapes (tile
sizes, warps, head dims, element types) reach them as template arguments in the name
expressions the op modules build from the tables below, and spec-wide constants as ``-D``
options (:func:`defines`; a ``.cu`` file that needs one fails to compile without it). Adding a
head dim or a tile entry is an edit here; the op modules, the offline compile check
(``python -m cupyattn check``), the tests and the benchmarks read the tables from this module.

Each tile table entry carries its reason. Nothing here has been tuned on a GPU yet (see the
README's status): the reasons are register, shared-memory and occupancy arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# --- element types --------------------------------------------------------------------------
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)   # NumPy and CuPy 14 take bfloat16 through ml_dtypes
DTYPES = (FLOAT32, FLOAT16, BFLOAT16)     # what every op accepts
MMA_DTYPES = (FLOAT16, BFLOAT16)          # what the tensor-core (mma.sync) kernels accept

# dtype -> the kernels' C++ element type in template name expressions
CTYPES = {FLOAT32: "float", FLOAT16: "__half", BFLOAT16: "__nv_bfloat16"}
# index dtype -> C++ type (embedding ids, rope positions)
INDEX_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def ctype(dtype) -> str:
    """The kernels' C++ element type of a supported dtype, e.g. ``float16 -> "__half"``."""
    return CTYPES[np.dtype(dtype)]


def cbool(flag) -> str:
    """A Python bool as a C++ template argument."""
    return "true" if flag else "false"


def defines(**constants) -> tuple[str, ...]:
    """NVRTC ``-D`` options for spec-wide constants: ``defines(X=1) -> ("-DX=1",)``."""
    return tuple(f"-D{k}={v}" for k, v in constants.items())


# --- hardware and indexing limits -----------------------------------------------------------
INT32_MAX = 2**31 - 1
MAX_GRID_X = 2**31 - 1      # gridDim.x
MAX_GRID_YZ = 65535         # gridDim.y and gridDim.z
MAX_BLOCK_THREADS = 1024
STATIC_SMEM_BYTES = 48 * 1024   # static __shared__ per block without the opt-in attribute

# --- fused attention (kernels_cu/flash_attn.cu) and decode (kernels_cu/decode.cu) ------------
HEAD_DIMS = (32, 64, 80, 96, 128, 256)   # head dims of the fused attention and decode kernels


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

# impl="flash_mma" (tensor cores, flash_attn_mma, fp16/bf16): head_dim -> tile, block_m = 16 x
# warps. smem = (block_m + block_n) x (D + 8) x 2 B (rows padded by 16 B so the 8 rows a
# fragment load touches fall in distinct banks). O takes D/2 fp32 registers per lane, S block_n/2.
FLASH_MMA_TILES = {
    32: FlashTile(64, 64, 4, "small tiles, 4 warps to hide latency; 10.0 KB"),
    64: FlashTile(64, 64, 4, "O 32 + S 32 registers; 18.0 KB"),
    80: FlashTile(64, 64, 4, "D = 5 k-steps of 16 for S, 10 n-tiles of 8 for O; 22.0 KB"),
    96: FlashTile(64, 64, 4, "O 48 registers; 26.0 KB"),
    128: FlashTile(64, 64, 4, "O 64 + S 32 registers; 34.0 KB"),
    256: FlashTile(32, 32, 2, "O alone is 128 registers: block_n 32 keeps S at 16; 33.0 KB"),
}

# --- decode (kernels_cu/decode.cu) ------------------------------------------------------------
DECODE_THREADS = 128        # 4 warps per decode block
DECODE_HEAD_TILE = 8        # query heads per block (GQA groups above 8 take several head tiles)
DECODE_MAX_SPLITS = 256     # combine kernel's per-split weights live in smem
DECODE_COMBINE_THREADS = 128
# automatic split count (decode.choose_num_splits)
DECODE_MAX_AUTO_SPLITS = 64
DECODE_MIN_KEYS_PER_SPLIT = 256   # an automatic split never gets fewer keys than this
DECODE_WAVES = 2                  # automatic splits aim at this many blocks per SM

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


GEMM_TILES = {
    "simt": GemmTile(128, 64, 16, 256, "8x4 register micro-tile per thread: 32 accumulators + 12 "
                     "fragment + 12 prefetch registers; As 16x132 + Bs 16x68 fp32 = 12.7 KB smem"),
    "mma": GemmTile(128, 128, 32, 256, "8 warps of 64x32 = 4x4 mma tiles (64 fp32 acc/thread); "
                    "2 stages x 2 x 128x(32+8) halves = 40 KB static smem; +8-half row pad makes "
                    "every ldmatrix phase hit 32 distinct banks"),
}
GEMM_IMPLS = ("auto",) + tuple(GEMM_TILES)
GEMM_MMA_PAD = 8   # halves of padding per smem row of the mma kernel

# --- row softmax (kernels_cu/row_softmax.cu) --------------------------------------------------
SOFTMAX_VPTS = (1, 2, 4, 8, 16, 32)     # values per lane of the warp-per-row kernel
SOFTMAX_WARP_MAX = 32 * SOFTMAX_VPTS[-1]  # longer rows go to the block-per-row kernel
SOFTMAX_ROWS_PER_BLOCK = 4             # warp-per-row: 4 rows per 128-thread block
SOFTMAX_BLOCK = 512                    # block-per-row: a 1M-element row is ~2K elements per
                                       # thread per pass; 16 warps keep loads in flight

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
# 16-byte vector width in elements per C++ type
VEC16 = {CTYPES[d]: 16 // d.itemsize for d in DTYPES}
# rmsnorm weight types: the activation's own, or float32 next to fp16/bf16 activations
RMSNORM_WEIGHT_CTYPES = {CTYPES[d]: tuple(dict.fromkeys((CTYPES[d], CTYPES[FLOAT32]))) for d in DTYPES}
