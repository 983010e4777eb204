"""cupyattn: FlashAttention-class transformer-inference kernels over CuPy arrays.

Kernels are CUDA C in ``kernels_cu/``, compiled at run time by NVRTC (``cupy.RawModule``), one
template instantiation at a time as calls need them; no torch and no build step.
``cupyattn.reference`` holds float64 NumPy references of every op; ``cupyattn.config`` the
dtypes, head dims, tile tables and launch constants the Python side and the kernels share.

>>> import cupy, cupyattn
>>> q = k = v = cupy.random.standard_normal((1, 8, 1024, 64)).astype(cupy.float16)
>>> o = cupyattn.attention(q, k, v, causal=True)          # fused FlashAttention-2 forward
"""
from . import config, fused, megakernel, persistent, reference
from ._checks import ComputeCapabilityError, gpu_unavailable_reason
from ._loader import KernelCompileError, KernelSpec, all_specs
from .config import BFLOAT16 as bfloat16
from .config import HEAD_DIMS
from .decode import auto_num_splits, choose_num_splits, decode_attention
from .flash_attn import HOPPER_IMPLS, IMPLS
from .flash_attn import attention
from .varlen import attention_varlen
from .gemm import gemm_nn, gemm_nt
from .kvcache import KVCache
from .paged import PagedKVCache, attention_paged, decode_attention_paged
from .layers import add, add_rmsnorm, embedding, rmsnorm, rope, swiglu
from .row_softmax import softmax
from .sampling import SamplingParams, sample

ATTENTION_IMPLS = IMPLS + HOPPER_IMPLS  # every attention(impl=...) value; "wgmma" needs an sm_90 GPU
del IMPLS, HOPPER_IMPLS

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "softmax", "gemm_nt", "gemm_nn", "KVCache", "decode_attention", "PagedKVCache", "decode_attention_paged", "attention_paged", "choose_num_splits", "auto_num_splits",
           "rmsnorm", "add_rmsnorm", "rope", "swiglu", "add", "embedding", "sample", "SamplingParams",
           "fused", "megakernel", "persistent", "reference", "config", "bfloat16", "HEAD_DIMS", "ATTENTION_IMPLS", "KernelSpec",
           "KernelCompileError", "ComputeCapabilityError", "all_specs", "gpu_unavailable_reason"]
