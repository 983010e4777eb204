"""cupyattn: FlashAttention-class transformer-inference kernels over CuPy arrays.

Kernels are CUDA C in ``kernels_cu/``, compiled at run time by NVRTC (``cupy.RawModule``);
no torch and no build step. ``cupyattn.reference`` holds float64 NumPy references of every op.

>>> import cupy, cupyattn
>>> q = k = v = cupy.random.standard_normal((1, 8, 1024, 64)).astype(cupy.float16)
>>> o = cupyattn.attention(q, k, v, causal=True)          # fused FlashAttention-2 forward
"""
from . import reference
from ._loader import KernelCompileError, KernelSpec, all_specs
from .attention_op import IMPLS as ATTENTION_IMPLS
from .attention_op import SUPPORTED_HEAD_DIMS, attention
from .decode import choose_num_splits, decode_attention
from .gemm import gemm_nn, gemm_nt
from .kvcache import KVCache
from .layers import add, embedding, rmsnorm, rope, swiglu
from .softmax_op import softmax

__version__ = "0.1.0"

__all__ = ["attention", "softmax", "gemm_nt", "gemm_nn", "KVCache", "decode_attention", "choose_num_splits",
           "rmsnorm", "rope", "swiglu", "add", "embedding", "reference", "SUPPORTED_HEAD_DIMS",
           "ATTENTION_IMPLS", "KernelSpec", "KernelCompileError", "all_specs"]
