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


# --- guarded allocations: each array sits between guard bytes that every launch re-checks ------
_GUARD = 256  # bytes each side; 0xFF is NaN for float16/bfloat16/float32 and -1 for integers
_LIVE: list = []  # (weakref to the array, its buffer)


def _guarded(x) -> "ndarray":
    """A C-contiguous copy of ``x`` placed between guard zones; out-of-bounds writes are caught
    after the next launch, out-of-bounds reads see NaN/-1 and spoil the result."""
    import weakref

    x = np.asarray(x)
    buf = np.full(x.nbytes + 2 * _GUARD, 0xFF, dtype=np.uint8)
    a = buf[_GUARD:_GUARD + x.nbytes].view(x.dtype).reshape(x.shape).view(ndarray)
    a[...] = x
    _LIVE.append((weakref.ref(a), buf))
    return a


def _check_guards(where: str):
    alive = []
    for ref, buf in _LIVE:
        if ref() is None:
            continue
        alive.append((ref, buf))
        if (buf[:_GUARD] != 0xFF).any() or (buf[len(buf) - _GUARD:] != 0xFF).any():
            buf[:_GUARD] = buf[len(buf) - _GUARD:] = 0xFF  # report once
            raise RuntimeError(f"{where}: wrote outside an allocation of shape {ref().shape}")
    _LIVE[:] = alive


def asarray(x, dtype=None, order=None):
    return _guarded(np.array(x, dtype=dtype, copy=True))


array = asarray


def empty(shape, dtype=float, order="C"):
    return _guarded(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype=dtype))


def zeros(shape, dtype=float, order="C"):
    return _guarded(np.zeros(shape, dtype=dtype))


def ones(shape, dtype=float, order="C"):
    return _guarded(np.ones(shape, dtype=dtype))


def full(shape, fill_value, dtype=None, order="C"):
    return _guarded(np.full(shape, fill_value, dtype=dtype))


def empty_like(a, dtype=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, shape=None):
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None, shape=None):
    return full(a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype)


def asnumpy(x, *a, **k):
    return np.array(x).view(np.ndarray)


def ascontiguousarray(x, dtype=None):
    if isinstance(x, np.ndarray) and x.flags.c_contiguous and (dtype is None or np.dtype(dtype) == x.dtype):
        return x.view(ndarray)
    return _guarded(np.ascontiguousarray(x, dtype=dtype))


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


def _split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside parentheses, brackets and string literals."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"' or text[j - 1] == "\\":
                j += 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        depth += c in "([{"
        depth -= c in ")]}"
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


_CP_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\d+B)?\s*\[%(\d+)\],\s*\[%(\d+)\],\s*(\d+)(?:,\s*%(\d+))?\s*;")
_LDMATRIX = re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x([124])(\.trans)?\.shared\.b16\s*\{([^}]*)\},\s*\[%(\d+)\]\s*;")
_MMA = re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.(?:f16|bf16)\.f32\s*"
                  r"\{([^}]*)\},\s*\{([^}]*)\},\s*\{([^}]*)\},\s*\{([^}]*)\}\s*;")


def _asm_to_call(body: str) -> str:
    """One ``asm volatile(...)`` statement -> a call of its emulation in emu_runtime.h."""
    segs = _split_top(body, ":")
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', segs[0])).replace("\\n", " ").replace("\\t", " ").strip()
    ops = []
    for seg in segs[1:3]:
        for op in _split_top(seg, ","):
            if op.strip():
                ops.append(re.match(r'\s*"[^"]*"\s*\((.*)\)\s*$', op, re.S).group(1))
    ref = lambda s: ops[int(s.strip().lstrip("%"))]
    regs = lambda s: [ref(x) for x in s.split(",")]
    if re.fullmatch(r"cp\.async\.(commit_group|wait_all|wait_group\s+%?\d+)\s*;", template):
        return "((void)0)"
    if (m := _CP_ASYNC.fullmatch(template)):
        n = m.group(3)
        src = f"(int)({ref(m.group(4))})" if m.group(4) else n
        return f"emu_cp_async((unsigned)({ref(m.group(1))}), (const void*)({ref(m.group(2))}), {n}, {src})"
    if (m := _LDMATRIX.fullmatch(template)):
        outs = ", ".join(f"(unsigned*)&({r})" for r in regs(m.group(3)))
        return f"emu_ldmatrix<{m.group(1)}, {'true' if m.group(2) else 'false'}>({{{outs}}}, (unsigned)({ref(m.group(4))}))"
    if (m := _MMA.fullmatch(template)):
        d = ", ".join(f"(float*)&({r})" for r in regs(m.group(2)))
        a = ", ".join(f"(unsigned)({r})" for r in regs(m.group(3)))
        b = ", ".join(f"(unsigned)({r})" for r in regs(m.group(4)))
        c = ", ".join(f"(float)({r})" for r in regs(m.group(5)))
        return f"emu_mma16816<{'true' if m.group(1) == 'bf16' else 'false'}>({{{d}}}, {{{a}}}, {{{b}}}, {{{c}}})"
    return 'emu_unsupported_asm("%s")' % template[:60].replace('"', "'")


def _strip_asm(code: str) -> str:
    """Replace each inline-PTX statement by its emulation (or a call that throws)."""
    out, i = [], 0
    while (m := _ASM_RE.search(code, i)):
        out.append(code[i:m.start()])
        depth, j = 1, m.end()
        while depth:
            c = code[j]
            if c == '"':
                j += 1
                while code[j] != '"' or code[j - 1] == "\\":
                    j += 1
            depth += (c == "(") - (c == ")")
            j += 1
        out.append(_asm_to_call(code[m.end():j - 1]))
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
                if isinstance(a, np.ndarray):
                    iv[j] = a.__array_interface__["data"][0]
                elif isinstance(a, np.integer) and a.dtype.itemsize == 8:
                    iv[j] = int(a)  # a pointer value, e.g. NULL = numpy.uint64(0)
                else:
                    raise TypeError(f"{where} expects a device array or an 8-byte pointer value, "
                                    f"got {type(a).__name__}")
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
        _check_guards(self.expr)


RawKernel = None  # not used by cupyattn


def install():
    """Make ``import cupy`` return this module (call before anything imports cupy)."""
    mod = sys.modules[__name__]
    sys.modules["cupy"] = mod
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.random"] = random
    sys.modules["cupy.cuda.compiler"] = cuda.compiler
