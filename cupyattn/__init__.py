"""cupyattn: FlashAttention-class transformer-inference kernels over CuPy arrays.

Kernels are CUDA C in ``kernels_cu/``, compiled at run time by NVRTC (``cupy.RawModule``);
no torch and no build step. ``cupyattn.reference`` holds float64 NumPy references of every op.
"""
from . import reference
from ._loader import KernelCompileError, KernelSpec, all_specs

__version__ = "0.1.0"
