"""Offline compile check: every registered kernel spec, for each GPU family the dispatch serves
(sm_75, 80, 86, 89, 90, 100, 120: those the installed NVRTC knows; sm_70 on request), every
instantiation that family can run (``KernelSpec.exprs_for``: no bf16 tensor-core kernels below
sm_80; Hopper-only specs, ``sm90a=True``, once, for sm_90a), with no GPU. Uses the same spec objects,
source string and options as the runtime loader, and reads registers / shared memory / stack /
spills from ptxas' ``-v`` log. A ptxas report that it ignored an instruction (C7508:
``setmaxnreg`` in a kernel without ``__launch_bounds__(threads, 1)``) or serialised every wgmma
(C7514 / C7515, or any line saying wgmma was serialized: an accumulator read between a wgmma and
the wait that retires it, as ptxas sees the paths) is an error: the kernel would run, slower than
written.

NVRTC is reached through CuPy's private ``_NVRTCProgram`` (it compiles for an explicit arch with
no device); the check asserts it exists so a CuPy upgrade that removes it fails loudly here.
The work is cut into jobs of a few instantiations (one NVRTC program each) that run on a thread
per CPU core (NVRTC releases the GIL); each job's rows are printed as soon as it finishes.
"""
from __future__ import annotations

import io
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from struct import error as struct_error

from . import _sass
from ._loader import KernelSpec, all_specs

ARCHES = ("75", "80", "86", "89", "90", "100", "120")   # the families of config.GPU_FAMILIES, sm_70 aside
ALL_ARCHES = ("70",) + ARCHES   # sm_70 (Volta: SIMT kernels only) on request: NVRTC 12 deprecates it
# What the test suite's compile gate builds by default: Hopper, the GPU every figure was measured
# on, whole (sm_90, + sm_90a for the Hopper kernels), no errors or spills. Each family takes 4-5
# minutes of NVRTC on one core (sm_75 326 builds, sm_90 441), so the default test command, which
# must finish in minutes on 2 cores beside the emulated GPU tests, gates sm_90 alone;
# CUPYATTN_FULL=1 (tests/tiers.py) gates every family in ARCHES, sm_75's Turing branches of
# ptx.cuh and 64 KB tiles among them (the default run still builds and runs Turing's default paths
# on the emulator as sm_75). sm_80 takes the same source as sm_90 (every ptx.cuh branch is >= 800)
# with a looser launch-bounds cap; sm_100 is tested for what it runs in place of what spilled there
# (tests/cupyattn/test_gpu_families.py).
GATE_ARCHES = ("90",)
# Of those, the test command's gate builds an all-pairs subset (:func:`gate_exprs`): per kernel
# template, every value of each template argument and every pair of values of two arguments
# (decode: 38 of 261 sm_90 instantiations, flash_attn 31 of 96), the Hopper kernels (sm_90a) whole.
# `python -m cupyattn check` and CUPYATTN_FULL=1 build every instantiation.
JOB_SIZE = 6  # instantiations per NVRTC program: small enough to spread over the cores
# ptxas messages that mean an instruction was dropped, each an error of the check. They are printed
# before the per-kernel rows, so sm_90a instantiations are built one per program to name the kernel.
_IGNORED_RE = re.compile(r"^ptxas.*\((C7508|C7514|C7515)\)(.*)$", re.M)
# and any other ptxas line saying it serialised wgmma (the codes of that warning have varied)
_SERIALISED_RE = re.compile(r"^ptxas.*wgmma.*serializ.*$", re.M | re.I)

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


@dataclass
class KernelReport:
    spec: str
    kernel: str  # name expression, e.g. gemm_nt_kernel<__half, 64, 64>
    arch: str
    registers: int
    smem_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    hot: bool
    code_bytes: int = 0   # machine code of the kernel (its cubin's .text section)
    loops: list | None = None   # sm_90a with nvdisasm installed: _sass.loop_summary's loops of the kernel

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def rawmodule_options(spec: KernelSpec, arch: str) -> tuple[str, ...]:
    """What cupy.RawModule hands NVRTC for this spec on an sm_<arch> device, plus ptxas -v."""
    from cupy._core import core

    opts = core.assemble_cupy_compiler_options(spec.options_for(arch))
    if not any(o.startswith("-arch") for o in opts):
        opts += (f"-arch=sm_{arch}",)
    return opts + ("-ftz=true", "--device-as-default-execution-space", "-Xptxas", "-v")


def parse_ptxas_log(log: str, mangled_to_expr: dict[str, str]):
    """Yield (name_expression, arch, regs, smem, stack, spill_st, spill_ld) per entry function."""
    cur = None
    stats: dict = {}
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            if cur:
                yield cur + tuple(stats.get(k, 0) for k in ("regs", "smem", "stack", "st", "ld"))
            cur, stats = (mangled_to_expr.get(m.group(1), m.group(1)), m.group(2)), {}
            continue
        if cur is None:
            continue
        if (m := _FRAME_RE.search(line)):
            stats["stack"], stats["st"], stats["ld"] = map(int, m.groups())
        if (m := _REGS_RE.search(line)):
            stats["regs"] = int(m.group(1))
            if (s := _SMEM_RE.search(line)):
                stats["smem"] = int(s.group(1))
    if cur:
        yield cur + tuple(stats.get(k, 0) for k in ("regs", "smem", "stack", "st", "ld"))


def compile_spec(spec: KernelSpec, arch: str, name_expressions=None) -> list[KernelReport]:
    """Compile ``name_expressions`` (default: all) of one spec for one arch in one NVRTC program;
    raise RuntimeError with NVRTC's log on failure."""
    from cupy.cuda import compiler

    if not hasattr(compiler, "_NVRTCProgram"):
        raise RuntimeError("this CuPy has no cupy.cuda.compiler._NVRTCProgram; pin cupy 14.x for the check")
    exprs = list(spec.name_expressions if name_expressions is None else name_expressions)
    prog = compiler._NVRTCProgram(spec.code(), f"{spec.name}.cu", name_expressions=exprs, method="cubin")
    log = io.StringIO()
    try:
        cubin, mapping = prog.compile(rawmodule_options(spec, arch), log_stream=log)
    except compiler.CompileException as e:
        raise RuntimeError(f"kernel spec {spec.name!r} ({spec.source}) failed for sm_{arch}:\n"
                           f"{e.get_message()}") from e
    ignored = _IGNORED_RE.findall(log.getvalue())
    ignored += [("serialised wgmma", ": " + m) for m in _SERIALISED_RE.findall(log.getvalue())]
    if ignored:
        raise RuntimeError(f"kernel spec {spec.name!r} ({spec.source}) for sm_{arch}: ptxas ignored an "
                           f"instruction in {', '.join(exprs)}: ({ignored[0][0]}){ignored[0][1]}")
    mangled = {v: k for k, v in mapping.items()}
    sizes, loops = {}, {}
    try:
        elf = _sass.pad_elf(bytes(cubin))
        sizes = {mangled.get(m, m): n for m, n in _sass.text_sizes(elf).items()}
        if spec.sm90a:   # the Hopper kernels' loops, for the machine-code invariants the tests hold
            loops = _sass.loop_summary(elf, mangled)
    except (ValueError, IndexError, struct_error, RuntimeError):  # sizes / loops unknown; the check goes on
        pass
    # a non-template kernel is compiled by every program of its file: keep only what was asked
    reports = [KernelReport(spec.name, expr, a, *vals, hot=spec.hot, code_bytes=sizes.get(expr, 0),
                            loops=loops.get(expr))
               for expr, a, *vals in parse_ptxas_log(log.getvalue(), mangled) if expr in exprs]
    missing = set(exprs) - {r.kernel for r in reports}
    if missing:
        raise RuntimeError(f"kernel spec {spec.name!r}: no ptxas report for {sorted(missing)}")
    return reports


def nvrtc_arches(arches=ARCHES) -> tuple[str, ...]:
    """The subset of ``arches`` the installed NVRTC can compile for (sm_100 and sm_120 need NVRTC
    12.8 or newer)."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        known = {str(a) for a in nvrtc.getSupportedArchs()}
    except Exception:  # an NVRTC without the query: try them all, errors will say
        return tuple(arches)
    return tuple(a for a in arches if a in known)


def gate_pairs() -> bool:
    """Whether the test suite's compile gate builds :func:`gate_exprs`' all-pairs subset: yes,
    unless CUPYATTN_FULL=1."""
    return os.environ.get("CUPYATTN_FULL", "").strip() in ("", "0")


def check_arches() -> tuple[str, ...]:
    """The arches the test suite's compile gate builds: CUPYATTN_CHECK_ARCHES (comma-separated, e.g.
    "75,80,90", "all" for every ARCHES entry; 80 and 90 are always added, the tests read their
    reports), else every ARCHES entry under CUPYATTN_FULL=1, else GATE_ARCHES; only those the
    installed NVRTC knows."""
    v = os.environ.get("CUPYATTN_CHECK_ARCHES", "").strip()
    if not v:
        full = os.environ.get("CUPYATTN_FULL", "").strip() not in ("", "0")
        return nvrtc_arches() if full else nvrtc_arches(GATE_ARCHES)
    if v == "all":
        return nvrtc_arches()
    wanted = {a.strip() for a in v.split(",") if a.strip()} | {"80", "90"}
    bad = wanted - set(ALL_ARCHES)
    if bad:
        raise ValueError(f"CUPYATTN_CHECK_ARCHES={v!r}: {sorted(bad)} not in {', '.join(ALL_ARCHES)}")
    return nvrtc_arches(tuple(a for a in ALL_ARCHES if a in wanted))


def all_pairs(items, params, paired=None) -> list:
    """The items to keep (in their order) so that every value of each parameter and every pair of
    values of two parameters (both ``paired(name)``, if given) still occurs: a greedy all-pairs
    covering array, first of the best at each step. ``params(item)`` -> (name, value) pairs,
    hashable."""
    import itertools

    def features(ps):
        ps = sorted(ps)
        return set(ps) | set(itertools.combinations([p for p in ps if paired is None or paired(p[0])], 2))

    feats = [features(params(item)) for item in items]
    need, keep = set().union(*feats) if feats else set(), set()
    while need:
        best = max(range(len(items)), key=lambda i: len(feats[i] & need))
        keep.add(best)
        need -= feats[best]
    return [item for i, item in enumerate(items) if i in keep]


def _template_args(expr: str):
    """``k<float, 64, true>`` -> ((0, 'float'), (1, '64'), (2, 'true'))."""
    args = expr.partition("<")[2].rpartition(">")[0]
    return tuple(enumerate(a.strip() for a in args.split(","))) if args else ()


def gate_exprs(spec: KernelSpec, arch, pairs: bool = False) -> tuple[str, ...]:
    """The instantiations of ``spec`` the check builds for ``arch``: all a device of that compute
    capability runs, or with ``pairs`` (the test command's gate) an all-pairs subset of each kernel
    template's arguments (:func:`all_pairs`)."""
    exprs = spec.exprs_for(int(arch))
    if not pairs or spec.sm90a:  # the Hopper kernels whole: few, and the likeliest to spill or serialise
        return exprs
    by_kernel: dict = {}
    for e in exprs:
        by_kernel.setdefault(e.partition("<")[0], []).append(e)
    keep = {e for group in by_kernel.values() for e in (group if len(group) == 1 else all_pairs(group, _template_args))}
    return tuple(e for e in exprs if e in keep)


def _jobs(specs, arches, pairs=False):
    """(spec, arch, name expressions) jobs of at most JOB_SIZE instantiations each: per arch, the
    instantiations a device of that compute capability can run (with ``pairs``, :func:`gate_exprs`'
    subset)."""
    jobs = []
    for spec in specs:
        for arch in arches:
            exprs, size = gate_exprs(spec, arch, pairs), 1 if spec.sm90a else JOB_SIZE
            jobs += [(spec, arch, exprs[i:i + size]) for i in range(0, len(exprs), size)]
    return jobs


# NVRTC seconds per arch of the last run_check (summed over its jobs: wall time x workers when the
# cores are busy); the CLI reports them, for CI's time budget
ARCH_SECONDS: dict[str, float] = {}
_LOCK = threading.Lock()


def run_check(only: str | None = None, arches=None, on_reports=None, workers: int | None = None,
              pairs: bool = False):
    """Compile every spec (or the one named ``only``) for ``arches`` (default: the ARCHES the
    installed NVRTC knows) -> (reports, errors); with ``pairs``, :func:`gate_exprs`' subset.

    ``on_reports(reports, done, total)`` is called after each finished job (progress output).
    Reports come back in spec, arch and instantiation order whatever order the jobs finish in.
    """
    import cupyattn  # noqa: F401  (importing the package registers every op module's specs)

    arches = nvrtc_arches() if arches is None else tuple(arches)
    specs = [s for s in all_specs() if only is None or s.name == only]
    if only is not None and not specs:
        return [], [f"no kernel spec named {only!r}; known: {', '.join(s.name for s in all_specs())}"]
    jobs = _jobs(specs, arches, pairs)
    results: dict[int, list] = {}
    errors = []
    ARCH_SECONDS.clear()

    def timed(spec, arch, exprs):
        t0 = time.perf_counter()
        try:
            return compile_spec(spec, arch, exprs)
        finally:
            key = f"sm_{arch}a" if spec.sm90a else f"sm_{arch}"
            with _LOCK:
                ARCH_SECONDS[key] = ARCH_SECONDS.get(key, 0.0) + time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = {pool.submit(timed, spec, arch, exprs): i for i, (spec, arch, exprs) in enumerate(jobs)}
        for n, fut in enumerate(as_completed(futures), 1):
            try:
                results[futures[fut]] = fut.result()
            except RuntimeError as e:
                results[futures[fut]] = []
                if str(e) not in errors:
                    errors.append(str(e))
            if on_reports is not None:
                on_reports(results[futures[fut]], n, len(jobs))
    order = {(s.name, a + ("a" if s.sm90a else ""), e): i for i, s in enumerate(specs) for a in arches
             for e in s.name_expressions}
    reports = sorted((r for rs in results.values() for r in rs),
                     key=lambda r: order.get((r.spec, r.arch[3:], r.kernel), len(order)))
    return reports, errors


def per_arch_summary(reports) -> dict:
    """arch -> {kernels, max_registers, with_spills, nvrtc_seconds} of a run_check's reports."""
    out = {}
    for arch in dict.fromkeys(r.arch for r in reports):
        rs = [r for r in reports if r.arch == arch]
        out[arch] = {"kernels": len(rs), "max_registers": max(r.registers for r in rs),
                     "with_spills": sum(r.spills for r in rs), "nvrtc_seconds": round(ARCH_SECONDS.get(arch, 0.0), 1)}
    return out


_COLS = (("kernel", 64), ("arch", 6), ("regs", 5), ("smem B", 7), ("stack B", 8), ("spill st/ld", 11),
         ("code KB", 8))


def _row(values) -> str:
    return "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)
                     for i, (v, (_, w)) in enumerate(zip(values, _COLS)))


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m cupyattn check",
                                description="Compile every kernel instantiation each GPU family can run "
                                            f"(sm_{', sm_'.join(ARCHES)} where NVRTC knows them; "
                                            "Hopper-only kernels for sm_90a) with NVRTC (no GPU "
                                            "needed); fail on errors, ignored instructions or spills.")
    p.add_argument("--only", help="check one kernel spec by name")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress on stderr)")
    p.add_argument("--arch", action="append", choices=ALL_ARCHES,
                   help="restrict to these arches (70: Volta, SIMT kernels only, on request)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr with --json")
    p.add_argument("--sass", action="store_true",
                   help="the machine-code report of the Hopper (sm_90a) kernels instead: code size, registers, "
                        "each loop's instruction mix and where the P V wait sits among the exp2s (needs nvdisasm: "
                        "pip install nvidia-cuda-nvdisasm, or CUPYATTN_NVDISASM)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.sass:
        return _sass_main(args, json)

    def progress(reports, done, total):
        if args.json:
            if not args.quiet:
                print(f"[{done}/{total}] compiled {len(reports)} kernels", file=sys.stderr, flush=True)
            return
        for r in reports:
            print(_row((r.kernel, r.arch, r.registers, r.smem_bytes, r.stack_bytes,
                        f"{r.spill_stores}/{r.spill_loads}", f"{r.code_bytes / 1024:.1f}")), flush=True)

    if not args.json:
        print("compiling every kernel instantiation with NVRTC (rows appear as each batch finishes)",
              flush=True)
        print(_row([c for c, _ in _COLS]), flush=True)
    reports, errors = run_check(args.only, tuple(args.arch) if args.arch else None, progress)
    spills = [r for r in reports if r.spills]
    if args.json:
        print(json.dumps({"kernels": [asdict(r) for r in reports], "errors": errors,
                          "spills": [f"{r.kernel} {r.arch}" for r in spills],
                          "arches": per_arch_summary(reports),
                          "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    else:
        for arch, a in per_arch_summary(reports).items():
            print(f"{arch}: {a['kernels']} kernels, at most {a['max_registers']} registers, "
                  f"{a['with_spills']} with spills, {a['nvrtc_seconds']:.0f} s of NVRTC")
        print(f"{len(reports)} kernel builds, {len(errors)} errors, {len(spills)} with spills "
              f"({time.perf_counter() - t0:.0f} s)")
        for r in spills:
            print(f"SPILL: {r.kernel} {r.arch}: {r.spill_stores} B stored, {r.spill_loads} B loaded")
        for e in errors:
            print("ERROR:", e)
    return 1 if errors or spills else 0


# --- the machine-code report (check --sass): compiled here, read by cupyattn._sass -----------------
def compile_cubin(spec, expr: str, arch: str = "90"):
    """(cubin bytes, mangled name, ptxas log) of one instantiation, compiled as the check does."""
    from cupy.cuda import compiler

    prog = compiler._NVRTCProgram(spec.code(), f"{spec.name}.cu", name_expressions=[expr], method="cubin")
    log = io.StringIO()
    cubin, mapping = prog.compile(rawmodule_options(spec, arch), log_stream=log)
    return bytes(cubin), mapping[expr], log.getvalue()


def sass_report(spec, expr: str, nvdisasm: str | None = None) -> _sass.SassReport:
    """The machine-code report of one sm_90a instantiation of ``spec``."""
    cubin, mangled, log = compile_cubin(spec, expr)
    cubin = _sass.pad_elf(cubin)
    regs = spill = 0
    for name, _arch, r, _smem, _stack, st, ld in parse_ptxas_log(log, {mangled: expr}):
        if name == expr:
            regs, spill = r, st + ld
    funcs = _sass.parse_sass(_sass.disassemble(cubin, nvdisasm))
    insns, labels = funcs.get(mangled, ([], {}))
    ser = _SERIALISED_RE.search(log)
    return _sass.SassReport(expr, spec.name, _sass.text_sizes(cubin).get(mangled, 16 * len(insns)), regs, spill,
                            len(insns), _sass.loops(insns, labels), ser.group(0).strip()[:200] if ser else "")


def hopper_exprs(only: str | None = None):
    """(spec, name expression) of every sm_90a instantiation (of the spec named ``only``)."""
    import cupyattn  # noqa: F401  (registers every spec)

    return [(s, e) for s in all_specs() if s.sm90a and (only is None or s.name == only) for e in s.name_expressions]


def run_sass(only: str | None = None, workers: int | None = None, on_report=None) -> list[_sass.SassReport]:
    """Reports of every sm_90a instantiation (threads: NVRTC releases the GIL)."""
    jobs = hopper_exprs(only)
    exe = _sass.nvdisasm_path()
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futs = [pool.submit(sass_report, s, e, exe) for s, e in jobs]
        out = []
        for f in futs:
            r = f.result()
            out.append(r)
            if on_report is not None:
                on_report(r)
    return out


def _sass_main(args, json) -> int:
    """``check --sass``: cupyattn._sass's report of every sm_90a instantiation (of ``--only``)."""
    if _sass.nvdisasm_path() is None:
        print("python -m cupyattn check --sass: no nvdisasm found (pip install nvidia-cuda-nvdisasm, or set "
              f"{_sass.NVDISASM_ENV})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    on = None if args.json else (lambda r: print(_sass.format_report(r), flush=True))
    try:
        reports = run_sass(args.only, on_report=on)
    except RuntimeError as e:
        print("ERROR:", e)
        return 1
    if args.json:
        print(json.dumps({"kernels": [_sass.as_dict(r) for r in reports],
                          "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    else:
        print(f"{len(reports)} sm_90a instantiations ({time.perf_counter() - t0:.0f} s)")
    return 1 if any(r.spill_bytes for r in reports) else 0
