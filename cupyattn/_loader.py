"""The one kernel loader: a spec says *what* can be compiled, `get_function` builds and caches
one instantiation at a time.

A :class:`KernelSpec` names a ``.cu`` file in ``kernels_cu/``, every template instantiation the
op module may launch from it (CuPy ``name_expressions``) and extra NVRTC options. Every op module
declares its specs at import time (which registers them, so ``python -m cupyattn check`` sees
them all) and asks :func:`get_function` for a kernel; nothing else in the package builds a
module. A call compiles only the instantiation it launches (one NVRTC program with one name
expression), memoised per device; CuPy's disk cache (``CUPY_CACHE_DIR``) makes the next process
fast. A compile that takes more than a second prints one line to stderr saying what is being
compiled (``CUPYATTN_QUIET=1`` silences it).

CuPy's on-disk cache key covers the source text but not headers found through ``-I``, so the
project's own ``#include "x.cuh"`` lines are inlined here before compiling: a header edit then
changes the source string and recompiles. Each inlined header is framed by the lines
``// ---- begin x.cuh`` and ``// ---- end x.cuh`` (the CPU emulator of the tests relies on
them to swap ``ptx.cuh`` for its own implementation).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import threading
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

from . import device, gpus
from .gpus import STATIC_SMEM_BYTES


# --- code generation: Python values as the kernels' template arguments and -D options ------------
# dtype -> the kernels' C++ element type in template name expressions (cupyattn.config.DTYPES)
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16"}
# index dtype -> C++ type (embedding ids, rope positions)
INDEX_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
# 16-byte vector width in elements per C++ element type
VEC16 = {c: 16 // d.itemsize for d, c in CTYPES.items()}


def ctype(dtype) -> str:
    """The kernels' C++ element type of a supported dtype, e.g. ``float16 -> "__half"``."""
    return CTYPES[np.dtype(dtype)]


def cbool(flag) -> str:
    """A Python bool as a C++ template argument."""
    return "true" if flag else "false"


def defines(**constants) -> tuple[str, ...]:
    """NVRTC ``-D`` options for spec-wide constants: ``defines(X=1) -> ("-DX=1",)``."""
    return tuple(f"-D{k}={v}" for k, v in constants.items())



def _kernels_dir() -> Path:
    """The .cu sources: ``cupyattn/kernels_cu/`` when installed (pyproject maps the repository's
    top-level kernels_cu/ there), the checkout's ``kernels_cu/`` next to ``cupyattn/`` otherwise
    (running from a clone, or an editable install)."""
    here = Path(__file__).resolve().parent
    installed = here / "kernels_cu"
    return installed if installed.is_dir() else here.parent / "kernels_cu"


KERNELS_DIR = _kernels_dir()

# Options every spec gets; the arch is chosen per device by CuPy (runtime) or by the check.
BASE_OPTIONS = ("-std=c++17",)
ANNOUNCE_AFTER_S = 1.0  # a compile still running after this long is announced on stderr

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_REGISTRY: dict[str, "KernelSpec"] = {}
_FUNCTIONS: dict[tuple[str, str, int], object] = {}
_SMEM_RAISED: dict[tuple[str, str, int], int] = {}  # dynamic shared memory opted in per kernel
_LOCK = threading.Lock()


# A null pointer kernel argument. Never pass None: CuPy turns it into an empty argument slot,
# not a zero pointer value; an 8-byte zero is exactly what a `T*` parameter expects.
NULL = np.uint64(0)


def ptr_or_null(x):
    """``x`` as a kernel argument, or :data:`NULL` when ``x`` is None (optional buffers)."""
    return NULL if x is None else x


class KernelCompileError(RuntimeError):
    """NVRTC rejected a spec; the message names the spec, the instantiations and the log."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What to compile: ``source`` (file in kernels_cu/), instantiations, options.

    ``hot`` kernels fail the offline check on any register spill; ``sm90a`` marks specs that
    use Hopper-only instructions and therefore need ``-arch=sm_90a`` (and an sm_90 device).
    ``needs``: (name expression, minimum compute capability, shared memory per block in bytes) of
    the instantiations that need more than gpus.MIN_COMPUTE_CAPABILITY or than 48 KB of shared
    memory (the tensor-core kernels, the deep rings); the offline check compiles for an arch only
    what a device of that family runs (:meth:`exprs_for`). ``families``: (name expression, the
    gpus.GPU_FAMILIES keys whose devices run it) of the instantiations only some families dispatch
    to: a tile that replaces the main one on one family (config.FLASH_MMA_FAMILY_TILES) and the
    tile it replaces.
    """

    name: str
    source: str
    name_expressions: tuple[str, ...]
    options: tuple[str, ...] = ()
    hot: bool = True
    sm90a: bool = False
    needs: tuple[tuple[str, int, int], ...] = ()
    families: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name_expressions, tuple) or not isinstance(self.options, tuple):
            raise TypeError(f"KernelSpec {self.name}: name_expressions and options must be tuples")
        old = _REGISTRY.get(self.name)
        if old is not None and old != self:
            raise ValueError(f"KernelSpec name {self.name!r} registered twice with different contents")
        _REGISTRY[self.name] = self

    def code(self) -> str:
        """The source string handed to NVRTC, with the project's own headers inlined."""
        return _code(self.source)

    def exprs_for(self, cc: int) -> tuple[str, ...]:
        """The name expressions a device of compute capability ``cc`` runs (sm90a specs: all of
        them on 9.0, none elsewhere): instructions, shared memory per block and ``families``."""
        if self.sm90a:
            return self.name_expressions if cc == 90 else ()
        if cc < gpus.MIN_COMPUTE_CAPABILITY:
            return ()
        smem, family = gpus.gpu_family(cc).smem_optin, gpus.gpu_family_key(cc)
        need, only = {e: b for e, _, b in self.needs}, dict(self.families)
        return tuple(e for e in self.name_expressions if self.min_cc(e) <= cc and need.get(e, 0) <= smem
                     and family in only.get(e, (family,)))

    def min_cc(self, name_expression: str) -> int:
        """The compute capability an instantiation's instructions need (sm90a specs: 90)."""
        if self.sm90a:
            return 90
        return max([c for e, c, _ in self.needs if e == name_expression] + [gpus.MIN_COMPUTE_CAPABILITY])

    def options_for(self, arch: str) -> tuple[str, ...]:
        """Options for a compute capability string such as '80' or '90'."""
        # the family's shared memory per SM: a __launch_bounds__ minimum never asks for more blocks
        # than can be resident there (decode.cu resident_min_blocks)
        opts = BASE_OPTIONS + self.options + (f"-DCUPYATTN_SMEM_PER_SM={gpus.gpu_family(int(arch)).smem_per_sm}",)
        target = device.arch_override()
        if target is not None and target < int(arch):
            opts += (f"-DCUPYATTN_TARGET_SM={target}0",)  # ptx.cuh takes the older family's branches
        if self.sm90a:
            if arch != "90":
                raise RuntimeError(f"kernel spec {self.name!r} needs an sm_90 device, got sm_{arch}")
            opts += ("-arch=sm_90a",)
        return opts


def all_specs() -> list[KernelSpec]:
    """Every spec registered by the op modules (import cupyattn first)."""
    return sorted(_REGISTRY.values(), key=lambda s: s.name)


def inline_source(text: str, _seen: set | None = None, root: Path | None = None) -> str:
    """``text`` with each ``#include "x.cuh"`` replaced by ``root``/x.cuh (default kernels_cu/;
    itself inlined), each header once, framed by ``// ---- begin x.cuh`` / ``// ---- end x.cuh``
    lines."""
    seen = set() if _seen is None else _seen
    root = KERNELS_DIR if root is None else root

    def repl(m):
        name = m.group(1)
        if name in seen:
            return f"// (already inlined: {name})"
        seen.add(name)
        body = inline_source((root / name).read_text(), seen, root)
        return f"// ---- begin {name}\n{body}\n// ---- end {name}"

    return _INCLUDE_RE.sub(repl, text)


def inline_headers(filename: str) -> str:
    """kernels_cu/<filename> with the project's headers inlined (:func:`inline_source`). An
    absolute ``filename`` (a test's own kernel) takes its headers from its own folder, so nothing
    global changes while other threads compile the project's kernels."""
    path = KERNELS_DIR / filename
    return inline_source(path.read_text(), root=path.parent)


@functools.lru_cache(maxsize=None)
def _code(filename: str) -> str:
    return inline_headers(filename)


def _announce(spec: KernelSpec, name_expression: str, arch: str) -> None:
    print(f"cupyattn: compiling {name_expression} (kernels_cu/{spec.source}) for sm_{arch} with "
          f"NVRTC; once per kernel, then cached on disk (CUPYATTN_QUIET=1 hides this line)",
          file=sys.stderr, flush=True)


# Modules that hold a chunk of a spec's instantiations (the CPU emulator only: _module_exprs).
_MODULES: dict = {}


def _module_exprs(spec: KernelSpec, name_expression: str, arch: str) -> tuple[str, ...]:
    """The instantiations to build together with ``name_expression``: on a GPU only itself (NVRTC
    builds each instantiation alone, when it first launches); under the CPU emulator, whose g++
    builds cost seconds of start-up and little per instantiation, its chunk of
    ``cupy._cupyattn_emulator_chunk`` consecutive instantiations of those the device runs
    (tests/emu/fakecupy.py)."""
    n = getattr(cupy, "_cupyattn_emulator_chunk", 1)
    exprs = spec.exprs_for(device.compute_capability()) if n > 1 else ()  # CUPYATTN_ARCH's too
    if name_expression not in exprs:
        return (name_expression,)
    i = exprs.index(name_expression) // n * n
    return exprs[i:i + n]


def _build_function(spec: KernelSpec, name_expression: str, arch: str):
    exprs = _module_exprs(spec, name_expression, arch)
    options = spec.options_for(arch)  # CUPYATTN_ARCH's target among them: part of the key
    if len(exprs) > 1:
        key = (cupy.RawModule, spec.code(), options, exprs)
        mod = _MODULES.get(key)
        if mod is None:
            mod = cupy.RawModule(code=spec.code(), options=options, name_expressions=exprs)
            try:
                mod.compile()
                _MODULES[key] = mod
            except cupy.cuda.compiler.CompileException:  # built alone below: its own error, if any
                mod = None
        if mod is not None:
            return mod.get_function(name_expression)
    mod = cupy.RawModule(code=spec.code(), options=options, name_expressions=(name_expression,))
    return mod.get_function(name_expression)


def _compile(spec: KernelSpec, name_expression: str, arch: str):
    """Build one instantiation (with its chunk under the emulator: _module_exprs); announce it on
    stderr if it takes over ANNOUNCE_AFTER_S."""
    timer = None
    if os.environ.get("CUPYATTN_QUIET", "") in ("", "0"):
        timer = threading.Timer(ANNOUNCE_AFTER_S, _announce, (spec, name_expression, arch))
        timer.daemon = True
        timer.start()
    try:
        return _build_function(spec, name_expression, arch)
    except cupy.cuda.compiler.CompileException as e:
        raise KernelCompileError(
            f"compiling {name_expression} from kernel spec {spec.name!r} ({spec.source}) for "
            f"sm_{arch} failed:\n{e.get_message()}") from e
    finally:
        if timer is not None:
            timer.cancel()


def smem_needs_opt_in(static_bytes: int, dynamic_bytes: int) -> bool:
    """Whether a launch with ``dynamic_bytes`` of dynamic shared memory needs the kernel's
    ``max_dynamic_shared_size_bytes`` raised first: the driver refuses (CUDA_ERROR_INVALID_VALUE)
    a block whose static plus dynamic shared memory passes 48 KB without it. The static part
    counts too: decode's float32 D=128 kernel has a 48 KB ring beside 4.7 KB of static arrays,
    which the first H100 run refused while the opt-in looked at the ring alone."""
    return dynamic_bytes > 0 and static_bytes + dynamic_bytes > STATIC_SMEM_BYTES


def get_function(spec: KernelSpec, name_expression: str, dynamic_smem: int = 0):
    """One kernel of ``spec`` (a name expression it declares) for the current device, compiled
    on first use (only that instantiation) and memoised per device.

    ``dynamic_smem``: bytes of dynamic shared memory the caller will launch it with
    (``kernel(grid, block, args, shared_mem=dynamic_smem)``). When it and the kernel's static
    ``__shared__`` arrays together pass 48 KB, the kernel's opt-in attribute is raised here first
    (once per kernel and size), and a total beyond the device's opt-in limit is a clear error
    instead of a failed launch.
    """
    dev_id, arch = device.device_arch()
    key = (spec.name, name_expression, dev_id)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        if name_expression not in spec.name_expressions:
            raise KeyError(f"{name_expression!r} is not an instantiation of kernel spec {spec.name!r}")
        cc = device.compute_capability()
        if cc < spec.min_cc(name_expression):  # the op modules' checks say it first
            raise device.ComputeCapabilityError(
                f"{name_expression} (kernel spec {spec.name!r}) needs compute capability "
                f"{spec.min_cc(name_expression) // 10}.{spec.min_cc(name_expression) % 10}; this device "
                f"is {cc // 10}.{cc % 10} (docs/gpus.md)")
        with _LOCK:
            fn = _FUNCTIONS.get(key)
            if fn is None:
                fn = _FUNCTIONS[key] = _compile(spec, name_expression, arch)
                _SMEM_RAISED.pop(key, None)  # a new function object starts at the driver's default
    if dynamic_smem > 0 and _SMEM_RAISED.get(key, 0) < dynamic_smem:
        static = int(fn.shared_size_bytes)
        if smem_needs_opt_in(static, dynamic_smem):
            limit = device.smem_optin()
            if static + dynamic_smem > limit:
                raise ValueError(f"{name_expression} needs {static + dynamic_smem} B of shared memory per "
                                 f"block ({static} B static + {dynamic_smem} B dynamic); this device "
                                 f"allows {limit} B")
            fn.max_dynamic_shared_size_bytes = dynamic_smem
        _SMEM_RAISED[key] = dynamic_smem
    return fn


# --- launching with programmatic dependent launch (PDL) ---------------------------------------
# CuPy's RawKernel call has no launch attributes, so a PDL launch goes through the driver's
# cuLaunchKernelEx (package cuda-bindings) on CuPy's current stream; stream capture records it
# into a CUDA graph with a programmatic edge. The kernel must call pdl_wait() (ptx.cuh) before it
# reads anything the previous kernel wrote.
def _ctypes_arg(a):
    """One kernel argument as the ctypes value the driver copies (CuPy's own conversions)."""
    import ctypes

    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    kinds = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
             np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
             np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
    if isinstance(a, np.generic) and a.dtype in kinds:
        return kinds[a.dtype](a.item())
    raise TypeError(f"PDL launch: argument of type {type(a).__name__} is not a device array or a "
                    f"NumPy scalar of {sorted(map(str, kinds))}")


def kernel_params(args):
    """(ctypes array of pointers to the argument values, the values): what cuLaunchKernelEx's
    kernelParams takes. Keep both alive until the launch returns."""
    import ctypes

    values = [_ctypes_arg(a) for a in args]
    ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return ptrs, values


def launch(fn, grid, block, args, shared_mem: int = 0, pdl: bool = False) -> None:
    """``fn(grid, block, args, shared_mem=...)`` on the current stream; with ``pdl`` through
    cuLaunchKernelEx with the programmatic-stream-serialization attribute."""
    if not pdl:
        fn(grid, block, args, shared_mem=shared_mem)
        return
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise RuntimeError("programmatic dependent launch (config.FUSED_DECODE_PDL) needs the "
                           "cuda-bindings package (pip install cuda-bindings)") from e
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(g) for g in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(b) for b in block)
    cfg.sharedMemBytes = int(shared_mem)
    cfg.hStream = driver.CUstream(cupy.cuda.get_current_stream().ptr)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    ptrs, _values = kernel_params(args)
    import ctypes

    # CuPy's RawModule.get_function gives a RawKernel, whose CUfunction is .kernel.ptr (a
    # cupy.cuda.function.Function has .ptr itself)
    handle = getattr(fn, "kernel", fn).ptr
    err, = driver.cuLaunchKernelEx(cfg, driver.CUfunction(handle), ctypes.addressof(ptrs), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed: {err}")
