"""A NumPy-backed stand-in for the parts of CuPy that cupyattn uses, so GPU tests can run on the
CPU against emulated kernels (emu_runtime.h). Installed as ``sys.modules['cupy']`` by
tests/conftest.py when CUPYATTN_EMULATE=1. Arrays are host memory; a kernel "launch" compiles the
spec's source with g++ and runs the kernel on CPU threads.

Kernel arguments are checked as CuPy would pass them: a Python int is 8 bytes, a float is a
double, a NumPy scalar has its own size; each must match the C++ parameter's kind and size.

Streams and CUDA graphs (CuPy 14's API): ``cuda.Stream`` (``with stream:`` makes it current),
``stream.begin_capture()`` / ``end_capture() -> cuda.Graph``, ``graph.launch(stream)``. While a
stream captures, a RawKernel launch on it is recorded (grid, block, shared memory and the
argument values as CuPy copies them: pointers and scalars) instead of run; ``Graph.launch``
replays the records in order, refusing to run if an array a record points into has been freed
since (on a GPU the memory pool would have handed that memory to someone else). Everything a
real capture cannot hold, or that this emulator cannot record, raises a "not capturable" error
during a capture: allocating device arrays, NumPy-executed cupy functions and array operators,
host <-> device copies, synchronising, and launches on another stream (they would run at once,
outside the graph). ``counters`` counts what a GPU would execute (RawKernel launches, replayed
graph nodes, cupy-level array kernels, graph launches) for tests and launch-count reports.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import mmap
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_BUILD = Path(tempfile.gettempdir()) / "cupyattn-emu"

# What a GPU would have executed so far: RawKernel launches run eagerly ("kernels"), kernels run by
# graph replays ("graph_nodes"), cupy-level array kernels such as fills, copies and NumPy-executed
# functions ("cupy_ops"), and graph launches ("graph_launches"). Tests reset it with reset_counters().
counters = {"kernels": 0, "graph_nodes": 0, "cupy_ops": 0, "graph_launches": 0}


def reset_counters():
    for k in counters:
        counters[k] = 0


class NotCapturable(RuntimeError):
    """An operation a CUDA graph capture cannot hold (or this emulator cannot record)."""


_CAPTURING = None  # the Stream that is capturing, or None


def _refuse(what: str):
    """Raise NotCapturable while a stream captures (call before doing ``what``)."""
    if _CAPTURING is not None:
        raise NotCapturable(
            f"not capturable: {what} while a stream is capturing a CUDA graph (a captured region "
            f"may only launch RawKernels on the capturing stream into preallocated buffers)")


def _cupy_op(what: str):
    _refuse(what)
    counters["cupy_ops"] += 1


class ndarray(np.ndarray):
    """Host array posing as a device array: ``.data.ptr`` and ``.device`` as in CuPy."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return cuda.Device()

    def get(self, stream=None):
        _refuse("a device-to-host copy (ndarray.get)")
        return np.array(self).view(np.ndarray)

    def set(self, arr, stream=None):
        """Host -> device copy into this array (CuPy's ndarray.set)."""
        _refuse("a host-to-device copy (ndarray.set)")
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"ndarray.set: shape/dtype {arr.shape} {arr.dtype} != {self.shape} {self.dtype}")
        np.copyto(self.view(np.ndarray), arr)

    # NumPy executes these on the host: on a GPU each is a kernel (and maybe an allocation).
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _cupy_op(f"the array operation {ufunc.__name__}.{method}")
        args = [x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, ndarray) else o for o in out)
        res = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _dev(res)

    def __setitem__(self, key, value):
        _cupy_op("an array assignment (__setitem__)")
        super().__setitem__(key, value)

    def fill(self, value):
        _cupy_op("ndarray.fill")
        super().fill(value)

    def copy(self, order="C"):
        _cupy_op("ndarray.copy")
        return _guarded(np.array(self, order=order))

    def astype(self, dtype, *a, copy=True, **k):
        _cupy_op("ndarray.astype")
        return _dev(np.asarray(self).astype(dtype, *a, copy=copy, **k))

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, (np.ndarray, list)) for k in keys):  # advanced indexing copies
            _cupy_op("advanced indexing")
        return super().__getitem__(key)


def _dev(x):
    if isinstance(x, np.ndarray):
        return x.view(ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_dev(v) for v in x)
    return x


def _wrap(f):
    def g(*a, **k):
        _cupy_op(f"cupy.{getattr(f, '__name__', 'function')} (executed by NumPy)")
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

    _refuse("allocating a device array")
    x = np.asarray(x)
    # on pages of its own: the memory model write-protects a launch's outputs to find
    # what each block stores (emu_memory.h), which must not catch anything else's stores
    buf = np.frombuffer(mmap.mmap(-1, x.nbytes + 2 * _GUARD), dtype=np.uint8)
    buf[...] = 0xFF
    a = buf[_GUARD:_GUARD + x.nbytes].view(x.dtype).reshape(x.shape)
    a[...] = x
    a = a.view(ndarray)
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


__version__ = "0.0.0+cpu-emulator"


def get_array_module(*args):
    return sys.modules[__name__]


def asarray(x, dtype=None, order=None):
    return _guarded(np.array(x, dtype=dtype, copy=True))


array = asarray


def _poison(dtype):
    """What fresh memory holds here: NaN for floats, all bits set for integers."""
    dt = np.dtype(dtype)
    return np.nan if dt.kind in "fc" else (np.iinfo(dt).max if dt.kind == "u" else -1)


def empty(shape, dtype=float, order="C"):
    return _guarded(np.full(shape, _poison(dtype), dtype=dtype))


def zeros(shape, dtype=float, order="C"):
    _cupy_op("cupy.zeros")
    return _guarded(np.zeros(shape, dtype=dtype))


def ones(shape, dtype=float, order="C"):
    _cupy_op("cupy.ones")
    return _guarded(np.ones(shape, dtype=dtype))


def full(shape, fill_value, dtype=None, order="C"):
    _cupy_op("cupy.full")
    return _guarded(np.full(shape, fill_value, dtype=dtype))


def empty_like(a, dtype=None, shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, shape=None):
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None, shape=None):
    return full(a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype)


def asnumpy(x, *a, **k):
    _refuse("a device-to-host copy (cupy.asnumpy)")
    return np.array(x).view(np.ndarray)


def ascontiguousarray(x, dtype=None):
    if isinstance(x, np.ndarray) and x.flags.c_contiguous and (dtype is None or np.dtype(dtype) == x.dtype):
        return x.view(ndarray)
    _cupy_op("cupy.ascontiguousarray (a copy kernel)")
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
    """Host arrays are NumPy's: the pool only answers the benchmarks' questions."""

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_bytes(self):
        return 0

    def malloc(self, nbytes):
        return types.SimpleNamespace(ptr=0, size=nbytes)

    def free_all_blocks(self):
        pass


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


# --- cupy.cuda ---------------------------------------------------------------------------------
cuda = types.ModuleType("cupy.cuda")


# the emulated device: CUPYATTN_EMU_ARCH=75 makes it a T4 (compute capability 7.5, 64 KB
# of shared memory per block, kernels built with __CUDA_ARCH__ 750), 100 a B200 (10.0: its own
# flash_mma tile at D = 64, config.FLASH_MMA_FAMILY_TILES); default an H100 (9.0)
EMU_ARCH = os.environ.get("CUPYATTN_EMU_ARCH", "90")
_EMU_DEVICES = {  # SMs, L2 bytes, opt-in shared memory per block
    "75": (40, 4 * 2**20, 64 * 1024), "80": (108, 40 * 2**20, 163 * 1024), "86": (84, 6 * 2**20, 99 * 1024),
    "89": (128, 72 * 2**20, 99 * 1024), "90": (132, 50 * 2**20, 227 * 1024),
    "100": (148, 126 * 2**20, 227 * 1024),
}
if EMU_ARCH not in _EMU_DEVICES:
    raise ValueError(f"CUPYATTN_EMU_ARCH={EMU_ARCH!r}: expected one of {', '.join(_EMU_DEVICES)}")


def emu_sms() -> int:
    """The emulated device's SM count: the family's, or CUPYATTN_EMU_SMS (read at each use, so a test
    can shrink the device a persistent kernel fills). It is also the launch's resident capacity:
    while every block in flight waits for another block, more start, one per SM (emu_launch)."""
    v = os.environ.get("CUPYATTN_EMU_SMS")
    if not v:
        return _EMU_DEVICES[EMU_ARCH][0]
    if not v.isdigit() or not 1 <= int(v) <= 160:
        raise ValueError(f"CUPYATTN_EMU_SMS={v!r}: expected an SM count in 1..160")
    return int(v)


class Device:
    id = 0
    compute_capability = EMU_ARCH

    @property
    def attributes(self):
        return {"MultiProcessorCount": emu_sms(), "L2CacheSize": _EMU_DEVICES[EMU_ARCH][1],
                "MaxSharedMemoryPerBlockOptin": _EMU_DEVICES[EMU_ARCH][2]}

    def __init__(self, i=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def use(self):
        pass

    def synchronize(self):
        _refuse("synchronizing the device")


class CompileException(Exception):
    def get_message(self):
        return str(self)


# --- streams and CUDA graphs (CuPy 14: Stream.begin_capture / end_capture, Graph.launch) -------
_tls = threading.local()


def _stack():
    if not hasattr(_tls, "streams"):
        _tls.streams = []
    return _tls.streams


class Stream:
    """A CUDA stream: launches run at once here (in order), except while it captures."""

    _next_ptr = 1

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else Stream._next_ptr
        if not null:
            Stream._next_ptr += 1
        self.non_blocking = bool(non_blocking)
        self._graph = None

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        return False

    def use(self):
        st = _stack()
        st[:] = st[:-1] + [self] if st else [self]
        return self

    def synchronize(self):
        _refuse("synchronizing a stream")

    def is_capturing(self):
        return _CAPTURING is self

    def begin_capture(self, mode=None):
        global _CAPTURING
        if self.ptr == 0:
            raise RuntimeError("begin_capture: the legacy null stream cannot be captured; use "
                               "cupy.cuda.Stream(non_blocking=True)")
        if _CAPTURING is not None:
            raise RuntimeError("begin_capture: another stream is already capturing")
        self._graph = Graph()
        _CAPTURING = self

    def end_capture(self):
        global _CAPTURING
        if _CAPTURING is not self:
            raise RuntimeError("end_capture: this stream is not capturing")
        _CAPTURING = None
        g, self._graph = self._graph, None
        return g


def get_current_stream():
    st = _stack()
    return st[-1] if st else Stream.null


class Graph:
    """The launches recorded by a capture, replayed in order by :meth:`launch`."""

    def __init__(self):
        self.nodes = []  # (kernel, grid, block, shared_mem, iv, dv, owners: weakrefs of the arrays, regions)

    def launch(self, stream=None):
        if _CAPTURING is not None:
            raise NotCapturable("not capturable: launching a graph inside a capture (this emulator "
                                "records no child graphs)")
        counters["graph_launches"] += 1
        _check_guards("Graph.launch")  # also drops the registry's hold on arrays freed since
        for kern, grid, block, smem, iv, dv, owners, regions in self.nodes:
            for j, ref in owners:
                if ref() is None:
                    raise RuntimeError(f"Graph.launch: argument {j} of {kern.expr} points into memory "
                                       f"freed after the capture (a GPU would reuse it for other data)")
            counters["graph_nodes"] += 1
            kern._run(grid, block, smem, iv, dv, regions)

    def upload(self, stream=None):
        pass

    def debug_dot_str(self, flags=0):
        """DOT text in the layout of cudaGraphDebugDotPrint: one node per recorded kernel."""
        lines = ["digraph dot {", "subgraph cluster_1 {", 'label="graph_1" graph[style="dashed"];']
        for i, (kern, grid, block, *_rest) in enumerate(self.nodes):
            lines.append(f'"graph_1_node_{i}"[style="solid" shape="rectangle" label="{i}\\nKERNEL\\n'
                         f'{kern.expr}\\n<<<{grid},{block}>>>"];')
            if i:
                lines.append(f'"graph_1_node_{i - 1}" -> "graph_1_node_{i}";')
        return "\n".join(lines + ["}", "}"]) + "\n"


def _owner_ref(a):
    """A weak reference to the buffer that owns an array's memory (dead once it is freed)."""
    import weakref

    root = a
    while isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base
    return weakref.ref(root)


Stream.null = Stream(null=True)


class Event:
    """Host wall clock: launches run synchronously on the emulator."""

    def __init__(self, *a, **k):
        self.t = None

    def record(self, stream=None):
        _refuse("recording an event")
        self.t = time.perf_counter()

    def synchronize(self):
        _refuse("synchronizing an event")


def get_elapsed_time(start, end):
    return (end.t - start.t) * 1e3


cuda.Device = Device
cuda.Event = Event
cuda.get_elapsed_time = get_elapsed_time
cuda.compiler = types.SimpleNamespace(CompileException=CompileException)
cuda.nvrtc = types.SimpleNamespace(getVersion=lambda: (0, 0))
cuda.runtime = types.SimpleNamespace(
    getDeviceCount=lambda: 1, driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 0,
    getDeviceProperties=lambda i=0: {"multiProcessorCount": emu_sms(), "name": b"CPU emulator",
                                     "l2CacheSize": _EMU_DEVICES[EMU_ARCH][1], "totalGlobalMem": 8 * 2**30},
    memGetInfo=lambda: (6 * 2**30, 8 * 2**30),  # (free, total) of the 8 GiB the properties claim
    deviceSynchronize=lambda: _refuse("cudaDeviceSynchronize"))
cuda.get_current_stream = get_current_stream
cuda.get_allocator = lambda: None
cuda.set_allocator = lambda f=None: None
cuda.Stream = Stream
cuda.Graph = Graph


# --- RawModule: g++ build of the spec source + launch wrappers ---------------------------------
_ASM_RE = re.compile(r"\basm\s*(volatile\s*)?\(")
# the instruction wrappers only: ptx.cuh around them (the arch-aware helpers) is kept
_PTX_BLOCK = re.compile(r"// ---- begin ptx_insn\.cuh\n.*?\n// ---- end ptx_insn\.cuh", re.S)
# the Hopper header, swapped first: it may hold the inlined ptx.cuh, which its
# emulation includes in turn
_PTX_SM90_BLOCK = re.compile(r"// ---- begin ptx_sm90\.cuh\n.*?\n// ---- end ptx_sm90\.cuh", re.S)
_RUNTIME_HEADERS = ("emu_runtime.h", "emu_hb.h", "emu_memory.h", "emu_ptx.h", "emu_ptx_sm90.h", "emu_sm90_barriers.h")
_PCH_HEADERS = ("emu_runtime.h", "emu_hb.h", "emu_memory.h")  # the precompiled part
_LIB_SOURCES = ("emu_runtime.cpp", "emu_memory.cpp")  # the runtime library (_runtime_lib)
# A module that synchronises blocks through global memory gets the memory model
# (emu_memory.h) on its launches; others see every store at once, at no cost.
# __ldg too: its non-coherent loads of what another block wrote in the launch read poison (emu_memory.h).
_SYNC_RE = re.compile(r"\b(atomic\w*|__threadfence\w*|__nanosleep|volatile|signal_release|wait_acquire|"
                      r"load_acquire|fence_acq_rel_gpu|__ldg)\b")
# CUPYATTN_EMU_MEMMODEL: "auto" (the default: modules _SYNC_RE finds), "all" (every launch: to
# measure what it costs), "off"
_MEMMODEL = os.environ.get("CUPYATTN_EMU_MEMMODEL", "auto")
if _MEMMODEL not in ("auto", "all", "off"):
    raise ValueError(f"CUPYATTN_EMU_MEMMODEL={_MEMMODEL!r}: expected auto, all or off")
_COMMENT = re.compile(r'("(?:\\.|[^"\\\n])*")|//[^\n]*|/\*.*?\*/', re.S)


def _translate(code: str) -> str:
    """CUDA C as the loader inlined it -> C++ for emu_runtime.h: the inlined kernels_cu/ptx.cuh
    and ptx_sm90.cuh are replaced by tests/emu/emu_ptx.h and emu_ptx_sm90.h (the same functions,
    emulated); inline PTX anywhere else is refused, since nothing would emulate it."""
    code = _PTX_SM90_BLOCK.sub('#include "emu_ptx_sm90.h"', code)
    code = _PTX_BLOCK.sub('#include "emu_ptx.h"', code)
    code = _COMMENT.sub(lambda m: m.group(1) or "\n" * m.group(0).count("\n"), code)  # lines kept
    if (m := _ASM_RE.search(code)):
        line = code.count("\n", 0, m.start()) + 1
        raise CompileException(f"inline PTX outside kernels_cu/ptx_insn.cuh (source line {line}) is not "
                                f"emulated: put the instruction in ptx_insn.cuh and tests/emu/emu_ptx.h")
    code = re.sub(r"#\s*include\s*<(cuda_fp16|cuda_bf16|math_constants|cuda_pipeline|cuda_runtime)\.h>", "", code)
    code = re.sub(r"extern\s+__shared__\s+(__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;",
                  r"\2* \3 = reinterpret_cast<\2*>(emu_dyn_smem);", code)
    code = _SHARED_DECL.sub(_static_shared, code)
    return _launch_bounds(code).replace("#pragma once", "")


_SHARED_DECL = re.compile(r"\b__shared__\s+((?:__align__\(\s*\d+\s*\)\s+)?)([^;{}()]*?)\s*;")
_DECLARATOR = re.compile(r"^\s*(\w+)\s*((?:\[[^\]]*\]\s*)*)$")


def _static_shared(m: re.Match) -> str:
    """``__shared__ [__align__(n)] T a[N], b;`` -> per-block variables in the slot's arena: each
    name becomes a reference to ``emu_static_smem(tag, size, align, "name")``, the tag a
    function-local static (one per declaration and template instantiation), the name for the
    emulator's messages."""
    align = re.search(r"\d+", m.group(1))
    parts = [p.strip() for p in m.group(2).split(",")]
    first = re.match(r"^(.*?\S)\s+(\w+\s*(?:\[[^\]]*\]\s*)*)$", parts[0])
    if not first:
        raise CompileException(f"emulator: cannot read the __shared__ declaration {m.group(0)!r}")
    ctype, declarators = first.group(1), [first.group(2)] + parts[1:]
    out = []
    for d in declarators:
        dm = _DECLARATOR.match(d)
        if not dm:
            raise CompileException(f"emulator: cannot read the __shared__ declarator {d!r} in {m.group(0)!r}")
        name, dims = dm.group(1), dm.group(2).strip()
        al = f"std::max<size_t>({align.group(0)}, alignof(emu_ty_{name}))" if align else f"alignof(emu_ty_{name})"
        out.append(f"static char emu_tag_{name}; using emu_ty_{name} = {ctype} {dims}; "
                   f"emu_ty_{name}& {name} = *reinterpret_cast<emu_ty_{name}*>("
                   f"emu_static_smem(&emu_tag_{name}, sizeof(emu_ty_{name}), {al}, \"{name}\"));")
    return " ".join(out)


def _balanced(code: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at code[i]."""
    depth = 0
    for j in range(i, len(code)):
        depth += {"(": 1, ")": -1}.get(code[j], 0)
        if depth == 0:
            return j + 1
    raise CompileException("emulator: unbalanced parentheses in the kernel source")


def _launch_bounds(code: str) -> str:
    """``__launch_bounds__(N[, M]) kernel(params) {`` -> ``kernel(params) {
    emu_check_launch_bounds(N);``: every thread of a launch with more than N threads per block
    stops at its first statement (the driver refuses such a launch)."""
    while (i := code.find("__launch_bounds__")) >= 0:
        op = code.index("(", i)
        close = _balanced(code, op)
        args, depth, first = code[op + 1:close - 1], 0, ""
        for ch in args:  # the first top-level argument
            depth += {"(": 1, ")": -1, "<": 1, ">": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                break
            first += ch
        params = code.index("(", close)
        body = code.index("{", _balanced(code, params))
        code = (code[:i] + code[close:body + 1] + f" emu_check_launch_bounds((long long)({first.strip()}));"
                + code[body + 1:])
    return code


# -O1: at -O2 the emulated kernels run about a quarter faster, but their builds take twice as
# long, and the test command took longer in all (measured on the development machine). The
# kernels pun types as nvcc allows: -fno-strict-aliasing, or -O2 would miscompile them.
_CXX = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-fPIC", "-pthread", "-w", "-fpermissive"]


def _cpu_has(flag: str) -> bool:
    try:
        return any(ln.startswith("flags") and flag in ln.split() for ln in open("/proc/cpuinfo"))
    except OSError:
        return False


# __half <-> float by the F16C instructions where the CPU has them (the builds run where they are
# built): libgcc's software conversion took a third of a half-precision decode kernel's time.
# The same IEEE conversions either way (exact widening, round-to-nearest-even narrowing).
if _cpu_has("f16c"):
    _CXX.append("-mf16c")

# A g++ build costs about half a second of start-up (the spec's source, the headers' inline parts,
# linking; the runtime is a library built once, _runtime_lib) and 0.02 to 0.3 s more per kernel
# instantiation in it (measured on a 2-core development machine). So the loader
# (cupyattn/_loader.py, _module_exprs) builds a spec's instantiations this many at a time,
# consecutive in the spec's order for the device, the first time any of them launches: of the
# instantiations the sm_90 tier launches, chunks of 16 cost the least g++ time (estimated 86
# CPU-s; 8: 90, 4: 107, 1: 179). 1: one build per instantiation, as NVRTC on a GPU.
# CUPYATTN_EMU_CHUNK sets it.
_cupyattn_emulator_chunk = int(os.environ.get("CUPYATTN_EMU_CHUNK", "16"))
if _cupyattn_emulator_chunk < 1:
    raise ValueError(f"CUPYATTN_EMU_CHUNK={_cupyattn_emulator_chunk}: expected a positive count")


def _pch_dir() -> str | None:
    """A directory holding emu_runtime.h (with emu_memory.h, which it includes) and its
    precompiled header (built once per version of the headers; about 0.7 s saved per kernel
    build), or None if g++ cannot make one."""
    texts = {f: (_HERE / f).read_text() for f in _PCH_HEADERS}
    d = _BUILD / f"pch_{hashlib.sha256((''.join(texts.values()) + ' '.join(_CXX)).encode()).hexdigest()[:16]}"
    if not (d / "emu_runtime.h.gch").exists():
        d.mkdir(parents=True, exist_ok=True)
        for f, text in texts.items():
            (d / f).write_text(text)
        tmp = d / f"emu_runtime.h.gch.{os.getpid()}_{threading.get_ident()}"
        r = subprocess.run([*_CXX, "-x", "c++-header", str(d / "emu_runtime.h"), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode:
            return None
        os.replace(tmp, d / "emu_runtime.h.gch")
    return str(d)


def _runtime_lib() -> Path:
    """The emulator's runtime library: its state, the scheduler and the memory model
    (emu_runtime.cpp, emu_memory.cpp), built once per version of them and of the headers, and
    linked to every kernel build. A kernel build then compiles its kernels and the headers' inline
    parts only: it had compiled the runtime too, about 1.8 of the 2.9 CPU-s a one-kernel build
    took on the development machine."""
    text = "".join((_HERE / f).read_text() for f in _PCH_HEADERS + _LIB_SOURCES) + " ".join(_CXX)
    so = _BUILD / f"libemu_rt_{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if not so.exists():
        _BUILD.mkdir(exist_ok=True)
        with _build_lock(so):
            if not so.exists():
                tmp = f"{so}.{os.getpid()}_{threading.get_ident()}"
                # -O2: built once, and the scheduler's loops run at every fiber step
                r = subprocess.run([*_CXX, "-O2", "-shared", f"-I{_HERE}", *(str(_HERE / f) for f in _LIB_SOURCES),
                                    "-o", tmp], capture_output=True, text=True)
                if r.returncode:
                    raise CompileException(f"emulator runtime library build failed:\n{r.stderr[-4000:]}")
                os.replace(tmp, so)
    return so


@contextlib.contextmanager
def _build_lock(so: Path):
    """An exclusive lock on ``so``'s build among the processes of a test session (the xdist workers
    often need the same chunk of a spec at once): the second waits for the first's file instead of
    building it too. Released when the holder exits, however it exits."""
    with open(f"{so}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RawModule:
    def __init__(self, code, options=(), name_expressions=(), **kw):
        self.code, self.exprs = code, list(name_expressions)
        self.defines = [o for o in options if o.startswith("-D")]  # spec-wide constants
        self.defines.append(f"-D__CUDA_ARCH__={EMU_ARCH}0")         # the emulated device's target
        self.lib = None
        self.memmodel = False  # set by compile()

    def compile(self, log_stream=None):
        if self.lib is not None:
            return
        src = ['#include "emu_runtime.h"', _translate(self.code)]
        self.memmodel = _MEMMODEL == "all" or (_MEMMODEL == "auto" and bool(_SYNC_RE.search(src[1])))
        for i, e in enumerate(self.exprs):
            src.append(f'extern "C" int emu_launch_{i}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                       f'unsigned by, unsigned bz, size_t smem, const long long* iv, const double* dv, char* err, int n, '
                       f'unsigned long long seed, const unsigned long long* regions, int nregions, int paged, int capacity) {{ '
                       f'return emu_launch(&{e}, dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, smem, iv, dv, err, n, seed, '
                       f'regions, nregions, paged, capacity); }}')
            src.append(f'extern "C" int emu_params_{i}(char* k, int* s, char* c) {{ return emu_params(&{e}, k, s, c); }}')
        text = "\n".join(src)
        _BUILD.mkdir(exist_ok=True)
        lib = _runtime_lib()
        runtime = "".join((_HERE / f).read_text() for f in _RUNTIME_HEADERS) + lib.name
        h = hashlib.sha256((text + runtime + " ".join(self.defines + _CXX)).encode()).hexdigest()[:16]
        so = _BUILD / f"k_{h}.so"
        if not so.exists():
            with _build_lock(so):  # one build per file: another process needing it waits for it
                if not so.exists():
                    self._build(text, h, so, lib)
        self.lib = ctypes.CDLL(str(so))

    def _build(self, text, h, so, lib):
        tmp = f"{os.getpid()}_{threading.get_ident()}"  # private temp names, then an atomic rename
        cpp = _BUILD / f"k_{h}_{tmp}.cpp"
        cpp.write_text(text)
        pch = _pch_dir()
        inc = ([f"-I{pch}"] if pch else []) + [f"-I{_HERE}"]
        # the runtime library by its path: the module needs it (DT_NEEDED), and the loader finds it there
        r = subprocess.run([*_CXX, "-shared", *inc, *self.defines, str(cpp), str(lib), "-o", f"{so}.{tmp}"],
                           capture_output=True, text=True)
        cpp.unlink()
        if r.returncode:
            raise CompileException(f"emulator build failed for {self.exprs[:3]}...:\n{r.stderr[-4000:]}")
        os.replace(f"{so}.{tmp}", so)

    def get_function(self, expr):
        self.compile()
        return _Kernel(self, self.exprs.index(expr), expr)


class _Kernel:
    def __init__(self, mod, i, expr):
        self.expr = expr
        self._launch = getattr(mod.lib, f"emu_launch_{i}")
        u = ctypes.c_uint
        self._launch.argtypes = [u, u, u, u, u, u, ctypes.c_size_t, ctypes.POINTER(ctypes.c_longlong),
                                 ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong,
                                 ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_int, ctypes.c_int]
        kinds, sizes, consts = ctypes.create_string_buffer(64), (ctypes.c_int * 64)(), ctypes.create_string_buffer(64)
        n = getattr(mod.lib, f"emu_params_{i}")(kinds, sizes, consts)
        self.params = [(kinds.raw[j:j + 1].decode(), sizes[j]) for j in range(n)]
        # the pointer parameters the kernel may write through: the memory model's regions
        self._writes = [j for j in range(n) if self.params[j][0] == "p" and consts.raw[j] == 0] if mod.memmodel else []
        # static __shared__ bytes: unknown here (the emulator maps them to C++ statics), so 0;
        # the driver's default attribute is 48 KB minus them, as on a GPU
        self.shared_size_bytes = 0
        self._max_dyn_smem = STATIC_SMEM_LIMIT - self.shared_size_bytes
        self.attributes = {}

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._max_dyn_smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):
        if not 0 <= int(n) <= OPTIN_SMEM_LIMIT:
            raise ValueError(f"{self.expr}: max_dynamic_shared_size_bytes={n} is outside "
                             f"[0, {OPTIN_SMEM_LIMIT}] (the device's opt-in limit)")
        self._max_dyn_smem = int(n)

    def __call__(self, grid, block, args, shared_mem=0, stream=None, **kw):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise TypeError(f"{self.expr}: {len(args)} arguments for {len(self.params)} parameters")
        iv, dv = (ctypes.c_longlong * max(len(args), 1))(), (ctypes.c_double * max(len(args), 1))()
        iv._structs = keep = []  # by-value struct copies, alive as long as iv (graph nodes hold it)
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
            if kind == "s":  # a struct by value (a TmaMap): a NumPy structured scalar of its size
                if not (isinstance(a, np.void) and a.dtype.itemsize == size):
                    raise TypeError(f"{where} takes a {size}-byte struct by value: pass a NumPy structured "
                                    f"scalar (numpy.void) of that size, got {type(a).__name__}")
                buf = ctypes.create_string_buffer(bytes(a), size)
                keep.append(buf)  # CuPy copies the value at launch (and into a captured graph)
                iv[j] = ctypes.addressof(buf)
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
        _check_launch(self.expr, grid, block, int(shared_mem), self.max_dynamic_shared_size_bytes)
        target = stream if stream is not None else get_current_stream()
        if _CAPTURING is not None:
            if target is not _CAPTURING:
                raise NotCapturable(f"not capturable: {self.expr} launched on another stream while a "
                                    f"stream captures (it would run now, outside the graph)")
            owners = [(j, _owner_ref(a)) for j, a in enumerate(args) if isinstance(a, np.ndarray)]
            _CAPTURING._graph.nodes.append((self, grid, block, int(shared_mem), iv, dv, owners, self._regions(args)))
            return
        counters["kernels"] += 1
        self._run(grid, block, int(shared_mem), iv, dv, self._regions(args))

    def _regions(self, args):
        """(address, bytes) pairs, flat, of the arrays the kernel may write (its non-const pointer
        parameters), overlaps merged: the global memory the memory model tracks (emu_memory.h);
        their count; and whether all of them lie on pages of their own (_guarded's)."""
        spans, paged = [], True
        for j in self._writes:
            a = args[j]
            if isinstance(a, np.ndarray) and a.size:
                root = a
                while isinstance(root.base, np.ndarray):
                    root = root.base
                paged = paged and isinstance(root.base, mmap.mmap)
                lo = hi = a.__array_interface__["data"][0]
                for n, st in zip(a.shape, a.strides):
                    lo, hi = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
                spans.append([lo, hi + a.itemsize])
        spans.sort()
        merged = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        flat = (ctypes.c_ulonglong * max(1, 2 * len(merged)))()
        for k, (lo, hi) in enumerate(merged):
            flat[2 * k], flat[2 * k + 1] = lo, hi - lo
        return flat, len(merged), int(paged)

    def _run(self, grid, block, smem, iv, dv, regions):
        err = ctypes.create_string_buffer(2048)
        seed = schedule.next_seed()
        if self._launch(*map(int, grid), *map(int, block), smem, iv, dv, err, 2048, seed, *regions,
                        emu_sms()):
            raise RuntimeError(f"{self.expr}: {err.value.decode()} ({schedule.describe(seed)})")
        _check_guards(self.expr)


# What cuLaunchKernel refuses on sm_80 / sm_90 (CUDA C Programming Guide, "Compute Capabilities").
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
STATIC_SMEM_LIMIT = 48 * 1024      # without the opt-in attribute
OPTIN_SMEM_LIMIT = _EMU_DEVICES[EMU_ARCH][2]   # sm_90 227 KB, sm_80 163 KB, sm_75 64 KB


def _check_launch(expr, grid, block, smem, smem_attr):
    """Refuse the launches a GPU refuses, with the error a user would need to see."""
    if any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block):
        raise ValueError(f"{expr}: empty or negative launch grid={grid} block={block}")
    for i, (g, lim) in enumerate(zip(grid, MAX_GRID)):
        if int(g) > lim:
            raise ValueError(f"{expr}: grid dimension {'xyz'[i]}={g} exceeds the limit {lim}")
    for i, (b, lim) in enumerate(zip(block, MAX_BLOCK)):
        if int(b) > lim:
            raise ValueError(f"{expr}: block dimension {'xyz'[i]}={b} exceeds the limit {lim}")
    if int(np.prod(block)) > MAX_THREADS:
        raise ValueError(f"{expr}: {int(np.prod(block))} threads per block exceed {MAX_THREADS}")
    if smem > smem_attr:
        raise ValueError(f"{expr}: {smem} B of dynamic shared memory need the kernel's "
                         f"max_dynamic_shared_size_bytes raised first (it is {smem_attr})")


RawKernel = None  # not used by cupyattn


class _Schedule:
    """The seeds of the adversarial schedule (emu_runtime.h): launch i of a test runs under
    sha256(base, i), where base is CUPYATTN_EMU_SEED if set, else the test's id (pytest sets
    PYTEST_CURRENT_TEST), so a failure reproduces by rerunning its test, and another schedule is
    one environment variable away."""

    def __init__(self):
        self.key, self.launches, self.last = None, 0, None
        self.round = 0  # > 0 while tests/conftest.py reruns a test under another schedule

    def base(self) -> str:
        if os.environ.get("CUPYATTN_EMU_SEED"):
            return os.environ["CUPYATTN_EMU_SEED"]
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # less " (call)"
        return f"{test}#schedule{self.round}" if self.round else test

    def next_seed(self) -> int:
        base = self.base()
        if base != self.key:
            self.key, self.launches = base, 0
        self.launches += 1
        self.last = int.from_bytes(hashlib.sha256(f"{base}#{self.launches}".encode()).digest()[:8], "little")
        return self.last

    def describe(self, seed=None) -> str:
        return (f"schedule seed base {self.key!r} (the test's id unless CUPYATTN_EMU_SEED=<any text> "
                f"replaces it), launch {self.launches} of it, seed {seed or self.last}: rerunning the test "
                f"reproduces it")


schedule = _Schedule()

# tensor maps: cupyattn/tma.py encodes through this where the driver's
# cuTensorMapEncodeTiled would be (tests/emu/emu_tma.py; emu_ptx_sm90.h reads the result)
sys.path.insert(0, str(_HERE))
from emu_tma import encode_tiled as _cupyattn_emulator_encode_tiled  # noqa: E402


def install():
    """Make ``import cupy`` return this module (call before anything imports cupy)."""
    mod = sys.modules[__name__]
    sys.modules["cupy"] = mod
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.random"] = random
    sys.modules["cupy.cuda.compiler"] = cuda.compiler
    sys.modules["cupy.cuda.graph"] = types.SimpleNamespace(Graph=Graph)
