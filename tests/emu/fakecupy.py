"""A NumPy-backed stand-in for the parts of CuPy that cupyattn uses, so GPU tests can run on the
CPU against emulated kernels (emu_runtime.h). Installed as ``sys.modules['cupy']`` by
tests/conftest.py when CUPYATTN_EMULATE=1. Arrays are host memory; a kernel "launch" compiles the
spec's source with g++ and runs the kernel on CPU threads.

Kernel arguments are checked as CuPy would pass them: a Python int is 8 bytes, a float is a
double, a NumPy scalar has its own size; each must match the C++ parameter's kind and size.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_BUILD = Path(tempfile.gettempdir()) / "cupyattn-emu"


class ndarray(np.ndarray):
    """Host array posing as a device array: ``.data.ptr`` and ``.device`` as in CuPy."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return cuda.Device()

    def get(self):
        return np.array(self).view(np.ndarray)


def _dev(x):
    if isinstance(x, np.ndarray):
        return x.view(ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_dev(v) for v in x)
    return x


def _wrap(f):
    def g(*a, **k):
        return _dev(f(*a, **k))

    g.__name__ = getattr(f, "__name__", "f")
    return g


def asarray(x, dtype=None, order=None):
    return np.array(x, dtype=dtype, order=order or "K", copy=True).view(ndarray)


array = asarray


def asnumpy(x, *a, **k):
    return np.array(x).view(np.ndarray)


def ascontiguousarray(x, dtype=None):
    return np.ascontiguousarray(x, dtype=dtype).view(ndarray)


def __getattr__(name):  # every other cupy.<function> is NumPy's, returning device-typed arrays
    f = getattr(np, name)
    return _wrap(f) if callable(f) and not isinstance(f, type) else f


random = types.ModuleType("cupy.random")
_rng = np.random.default_rng(0)
random.standard_normal = lambda size=None, dtype=np.float64: _dev(_rng.standard_normal(size).astype(dtype))
random.random = lambda size=None, dtype=np.float64: _dev(_rng.random(size).astype(dtype))
random.randn = lambda *s: _dev(_rng.standard_normal(s))
random.randint = lambda lo, hi=None, size=None, dtype=int: _dev(_rng.integers(lo, hi, size).astype(dtype))
random.seed = lambda s=None: None
random.default_rng = lambda seed=None: types.SimpleNamespace(
    standard_normal=lambda size=None, dtype=np.float64: _dev(np.random.default_rng(seed).standard_normal(size).astype(dtype)))


class _Pool:
    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


# --- cupy.cuda ---------------------------------------------------------------------------------
cuda = types.ModuleType("cupy.cuda")


class Device:
    id = 0
    compute_capability = "90"
    attributes = {"MultiProcessorCount": 132, "L2CacheSize": 50 * 2**20, "MaxSharedMemoryPerBlockOptin": 227 * 1024}

    def __init__(self, i=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def use(self):
        pass

    def synchronize(self):
        pass


class CompileException(Exception):
    def get_message(self):
        return str(self)


class _Stream:
    ptr = 0
    null = None

    def synchronize(self):
        pass


cuda.Device = Device
cuda.compiler = types.SimpleNamespace(CompileException=CompileException)
cuda.runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1,
    getDeviceProperties=lambda i=0: {"multiProcessorCount": 132, "name": b"cpu-emulator", "l2CacheSize": 50 * 2**20},
    deviceSynchronize=lambda: None)
cuda.get_current_stream = lambda: _Stream()
cuda.Stream = _Stream
cuda.Stream.null = _Stream()


# --- RawModule: g++ build of the spec source + launch wrappers ---------------------------------
_ASM_RE = re.compile(r"\basm\s+(volatile\s*)?\(")


def _strip_asm(code: str) -> str:
    """Replace each inline-PTX statement by a call that throws (balanced-parenthesis scan)."""
    out, i = [], 0
    while (m := _ASM_RE.search(code, i)):
        out.append(code[i:m.start()])
        depth, j = 1, m.end()
        while depth:
            c = code[j]
            if c == '"':
                j = code.index('"', j + 1)
                while code[j - 1] == "\\":
                    j = code.index('"', j + 1)
            depth += (c == "(") - (c == ")")
            j += 1
        out.append('emu_unsupported_asm("%s")' % code[m.start():m.start() + 40].replace('"', "'").replace("\n", " "))
        i = j
    out.append(code[i:])
    return "".join(out)


def _translate(code: str) -> str:
    code = re.sub(r"#\s*include\s*<(cuda_fp16|cuda_bf16|math_constants|cuda_pipeline|cuda_runtime)\.h>", "", code)
    code = re.sub(r"extern\s+__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;",
                  r"\2* \3 = reinterpret_cast<\2*>(emu_dyn_smem);", code)
    code = code.replace("#pragma once", "")
    return _strip_asm(code)


class RawModule:
    def __init__(self, code, options=(), name_expressions=(), **kw):
        self.code, self.exprs = code, list(name_expressions)
        self.lib = None

    def compile(self, log_stream=None):
        if self.lib is not None:
            return
        src = ['#include "emu_runtime.h"', _translate(self.code)]
        for i, e in enumerate(self.exprs):
            src.append(f'extern "C" int emu_launch_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                       f'unsigned by, unsigned bz, size_t smem, const long long* iv, const double* dv, char* err, int n)'
                       f' {{ return emu_launch(&{e}, dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, smem, iv, dv, err, n); }}')
            src.append(f'extern "C" int emu_params_{i}(char* k, int* s) {{ return emu_params(&{e}, k, s); }}')
        text = "\n".join(src)
        _BUILD.mkdir(exist_ok=True)
        h = hashlib.sha256((text + (_HERE / "emu_runtime.h").read_text()).encode()).hexdigest()[:16]
        so = _BUILD / f"k_{h}.so"
        if not so.exists():
            cpp = _BUILD / f"k_{h}.cpp"
            cpp.write_text(text)
            r = subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", f"-I{_HERE}",
                                "-fpermissive", str(cpp), "-o", str(so) + ".tmp"], capture_output=True, text=True)
            if r.returncode:
                raise CompileException(f"emulator build failed for {self.exprs[:3]}...:\n{r.stderr[-4000:]}")
            Path(str(so) + ".tmp").rename(so)
        self.lib = ctypes.CDLL(str(so))

    def get_function(self, expr):
        self.compile()
        return _Kernel(self, self.exprs.index(expr), expr)


class _Kernel:
    def __init__(self, mod, i, expr):
        self.expr = expr
        self._launch = getattr(mod.lib, f"emu_launch_{i}")
        u = ctypes.c_uint
        self._launch.argtypes = [u, u, u, u, u, u, ctypes.c_size_t, ctypes.POINTER(ctypes.c_longlong),
                                 ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int]
        kinds, sizes = ctypes.create_string_buffer(64), (ctypes.c_int * 64)()
        n = getattr(mod.lib, f"emu_params_{i}")(kinds, sizes)
        self.params = [(kinds.raw[j:j + 1].decode(), sizes[j]) for j in range(n)]
        self.max_dynamic_shared_size_bytes = 0
        self.attributes = {}

    def __call__(self, grid, block, args, shared_mem=0, stream=None, **kw):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise TypeError(f"{self.expr}: {len(args)} arguments for {len(self.params)} parameters")
        iv, dv = (ctypes.c_longlong * max(len(args), 1))(), (ctypes.c_double * max(len(args), 1))()
        for j, (a, (kind, size)) in enumerate(zip(args, self.params)):
            where = f"{self.expr}: argument {j}"
            if kind == "p":
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{where} expects a device array, got {type(a).__name__}")
                iv[j] = a.__array_interface__["data"][0]
                continue
            if isinstance(a, np.ndarray):
                raise TypeError(f"{where} expects a scalar, got an array")
            if isinstance(a, bool):
                got_kind, got_size = "b", 1
            elif isinstance(a, int):
                got_kind, got_size = "i", 8
            elif isinstance(a, float):
                got_kind, got_size = "f", 8
            else:
                dt = np.asarray(a).dtype
                got_kind = "f" if dt.kind == "f" else "b" if dt.kind == "b" else "i"
                got_size = dt.itemsize
            if (got_kind, got_size) != (kind, size):
                raise TypeError(f"{where}: passed {got_kind}{got_size * 8} but the kernel takes {kind}{size * 8}"
                                " (CuPy passes Python int as int64 and float as double)")
            iv[j], dv[j] = (int(a), 0.0) if kind != "f" else (0, float(a))
        if 0 in grid or 0 in block:
            raise ValueError(f"{self.expr}: empty launch grid={grid} block={block}")
        err = ctypes.create_string_buffer(512)
        if self._launch(*map(int, grid), *map(int, block), int(shared_mem), iv, dv, err, 512):
            raise RuntimeError(f"{self.expr}: {err.value.decode()}")


RawKernel = None  # not used by cupyattn


def install():
    """Make ``import cupy`` return this module (call before anything imports cupy)."""
    mod = sys.modules[__name__]
    sys.modules["cupy"] = mod
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.random"] = random
    sys.modules["cupy.cuda.compiler"] = cuda.compiler
