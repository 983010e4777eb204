"""The one kernel loader: a spec says *what* to compile, `get_function` builds and caches it.

A :class:`KernelSpec` names a ``.cu`` file in ``kernels_cu/``, the template instantiations to
compile from it (CuPy ``name_expressions``) and extra NVRTC options. Every op module declares
its specs at import time (which registers them, so ``python -m cupyattn check`` sees them all)
and asks :func:`get_function` for a kernel; nothing else in the package builds a module.

CuPy's on-disk cache key covers the source text but not headers found through ``-I``, so the
project's own ``#include "x.cuh"`` lines are inlined here before compiling: a header edit then
changes the source string and recompiles.
"""
from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path

import numpy as np

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels_cu"

# Options every spec gets; the arch is chosen per device by CuPy (runtime) or by the check.
BASE_OPTIONS = ("-std=c++17",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_REGISTRY: dict[str, "KernelSpec"] = {}
_MODULES: dict[tuple[str, int], object] = {}
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
    """

    name: str
    source: str
    name_expressions: tuple[str, ...]
    options: tuple[str, ...] = ()
    hot: bool = True
    sm90a: bool = False

    def __post_init__(self):
        if not isinstance(self.name_expressions, tuple) or not isinstance(self.options, tuple):
            raise TypeError(f"KernelSpec {self.name}: name_expressions and options must be tuples")
        old = _REGISTRY.get(self.name)
        if old is not None and old != self:
            raise ValueError(f"KernelSpec name {self.name!r} registered twice with different contents")
        _REGISTRY[self.name] = self

    def code(self) -> str:
        """The source string handed to NVRTC, with the project's own headers inlined."""
        return inline_headers(self.source)

    def options_for(self, arch: str) -> tuple[str, ...]:
        """Options for a compute capability string such as '80' or '90'."""
        opts = BASE_OPTIONS + self.options
        if self.sm90a:
            if arch != "90":
                raise RuntimeError(f"kernel spec {self.name!r} needs an sm_90 device, got sm_{arch}")
            opts += ("-arch=sm_90a",)
        return opts


def all_specs() -> list[KernelSpec]:
    """Every spec registered by the op modules (import cupyattn first)."""
    return sorted(_REGISTRY.values(), key=lambda s: s.name)


def inline_headers(filename: str, _seen: set | None = None) -> str:
    """Read kernels_cu/<filename> and replace each ``#include "x.cuh"`` by that file, once."""
    seen = set() if _seen is None else _seen
    text = (KERNELS_DIR / filename).read_text()

    def repl(m):
        name = m.group(1)
        if name in seen:
            return f"// (already inlined: {name})"
        seen.add(name)
        return f"// ---- begin {name}\n{inline_headers(name, seen)}\n// ---- end {name}"

    return _INCLUDE_RE.sub(repl, text)


def _device_arch() -> tuple[int, str]:
    import cupy

    dev = cupy.cuda.Device()
    return dev.id, dev.compute_capability


def get_module(spec: KernelSpec):
    """The compiled ``cupy.RawModule`` of ``spec`` for the current device (memoised)."""
    import cupy

    dev_id, arch = _device_arch()
    key = (spec.name, dev_id)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            try:
                mod = cupy.RawModule(code=spec.code(), options=spec.options_for(arch),
                                     name_expressions=spec.name_expressions)
                mod.compile()
            except cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(
                    f"compiling kernel spec {spec.name!r} ({spec.source}) for sm_{arch} failed; "
                    f"instantiations: {', '.join(spec.name_expressions)}\n{e.get_message()}") from e
            _MODULES[key] = mod
    return mod


def get_function(spec: KernelSpec, name_expression: str):
    """One kernel of ``spec`` (a name expression it declares) for the current device."""
    if name_expression not in spec.name_expressions:
        raise KeyError(f"{name_expression!r} is not an instantiation of kernel spec {spec.name!r}")
    return get_module(spec).get_function(name_expression)
