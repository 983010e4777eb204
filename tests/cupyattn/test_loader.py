"""The loader: spec handling and the offline compile check (NVRTC, no GPU: CPU tier);
compile-on-demand of one instantiation per call and its stderr line (GPU tier, also emulated)."""
import numpy as np
import pytest
from conftest import expected_builds

import cupyattn
from cupyattn import _compile_check as cc
from cupyattn import _loader, config, device
from cupyattn._loader import KERNELS_DIR, KernelSpec


def test_headers_are_inlined_once(tmp_path):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include <cuda_fp16.h>\nint k;\n')
    code = _loader.inline_headers(str(tmp_path / "k.cu"))  # absolute: its headers from its folder
    assert code.count("int b;") == 1 and "int a;" in code and "#include <cuda_fp16.h>" in code
    assert '#include "' not in code  # CuPy's cache key now covers every project header


def test_spec_registry_rejects_conflicting_names():
    KernelSpec("test_dup", "common.cuh", ("k<float>",))
    KernelSpec("test_dup", "common.cuh", ("k<float>",))  # identical re-declaration is fine
    with pytest.raises(ValueError, match="registered twice"):
        KernelSpec("test_dup", "common.cuh", ("k<double>",))
    with pytest.raises(TypeError, match="tuples"):
        KernelSpec("test_list", "common.cuh", ["k<float>"])
    _loader._REGISTRY.pop("test_dup")


def test_sm90a_options_need_sm90():
    spec = KernelSpec("test_sm90a", "common.cuh", ("k",), sm90a=True)
    try:
        assert "-arch=sm_90a" in spec.options_for("90")
        with pytest.raises(RuntimeError, match="sm_90 device"):
            spec.options_for("80")
    finally:
        _loader._REGISTRY.pop("test_sm90a")


def test_parse_ptxas_log_reads_every_field():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1kIfEvv' for 'sm_80'
ptxas info    : Function properties for _Z1kIfEvv
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 364 bytes cmem[0]
ptxas info    : Compiling entry function '_Z1kIdEvv' for 'sm_80'
ptxas info    : Function properties for _Z1kIdEvv
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 364 bytes cmem[0]
"""
    rows = list(cc.parse_ptxas_log(log, {"_Z1kIfEvv": "k<float>"}))
    assert rows == [("k<float>", "sm_80", 40, 4096, 24, 8, 12), ("_Z1kIdEvv", "sm_80", 8, 0, 0, 0, 0)]


def test_check_fails_when_ptxas_ignores_setmaxnreg(tmp_path):
    """setmaxnreg without __launch_bounds__(threads, 1): ptxas drops it with warning C7508, and
    the offline check fails naming the kernel; with the 1 it passes."""
    for header in ("ptx_insn.cuh", "ptx.cuh", "ptx_sm90.cuh"):  # ptx_sm90.cuh includes ptx.cuh, which includes ptx_insn.cuh
        (tmp_path / header).write_text((KERNELS_DIR / header).read_text())
    body = "(float* x) {\n    if (threadIdx.x < 128) setmaxnreg_dec<40>(); else setmaxnreg_inc<232>();\n" \
           "    x[threadIdx.x] = 1.0f;\n}\n"
    (tmp_path / "regs.cu").write_text('#include "ptx_sm90.cuh"\n'
                                      f"template <int X> __global__ void __launch_bounds__(256, 1) bounded{body}"
                                      f"template <int X> __global__ void unbounded{body}")
    # an absolute source (headers from its folder): no global changes under the background compile gate
    spec = KernelSpec("test_regs", str(tmp_path / "regs.cu"), ("bounded<0>", "unbounded<0>"), sm90a=True)
    try:
        assert [r.arch for r in cc.compile_spec(spec, "90", ["bounded<0>"])] == ["sm_90a"]
        with pytest.raises(RuntimeError, match=r"test_regs.*ptxas ignored an instruction in unbounded<0>: \(C7508\).*setmaxnreg"):
            cc.compile_spec(spec, "90", ["unbounded<0>"])
    finally:
        _loader._REGISTRY.pop("test_regs")


def test_compile_error_names_spec_and_shows_log(tmp_path):
    (tmp_path / "bad.cu").write_text("template <typename T> __global__ void k(T* x) { x[0] = undefined_name; }\n")
    spec = KernelSpec("test_bad", str(tmp_path / "bad.cu"), ("k<float>",))
    try:
        with pytest.raises(RuntimeError) as e:
            cc.compile_spec(spec, "80")
        assert "test_bad" in str(e.value) and "undefined_name" in str(e.value)
    finally:
        _loader._REGISTRY.pop("test_bad")


def test_spill_is_reported(tmp_path):
    # a kernel with a large dynamically indexed local array must use local memory (stack)
    (tmp_path / "stack.cu").write_text(
        "__global__ void k(float* x, int i) { float a[256];"
        " for (int j = 0; j < 256; ++j) a[j] = x[j]; x[0] = a[i]; }\n")
    spec = KernelSpec("test_stack", str(tmp_path / "stack.cu"), ("k",))
    try:
        (r,) = cc.compile_spec(spec, "80")
        assert r.kernel == "k" and r.arch == "sm_80" and r.stack_bytes >= 1024
    finally:
        _loader._REGISTRY.pop("test_stack")


def test_every_kernel_file_has_a_spec():
    specs = cupyattn.all_specs()
    used = {s.source for s in specs}
    for f in KERNELS_DIR.glob("*.cu"):
        assert f.name in used, f"kernels_cu/{f.name} is not compiled by any KernelSpec"


@pytest.mark.whole_compile_gate
def test_offline_check_compiles_every_instantiation_without_spills(compile_report):
    """The compile gate: for each of its GPU families (sm_90; under CUPYATTN_FULL=1 every one the
    installed NVRTC knows, sm_75 ... sm_120), every instantiation a device of that family runs (no
    bf16 tensor-core kernels on sm_75, tiles within its shared memory; Hopper-only specs once, for
    sm_90a), no errors, no spills."""
    reports, errors = compile_report()
    assert errors == [] and [f"{r.kernel} {r.arch}" for r in reports if r.spills] == []
    built = {(r.spec, r.kernel, r.arch) for r in reports}
    want = {(s.name, e, a) for s in cupyattn.all_specs() for e, a in expected_builds(s)}
    assert built == want and len(built) == len(reports)
    assert {f"sm_{a}" for a in cc.check_arches()} | {"sm_90a"} == {r.arch for r in reports}
    assert "90" in cc.GATE_ARCHES  # the default gate builds Hopper whole (CUPYATTN_FULL=1: every family)


def test_check_cli_prints_rows_as_it_goes_and_fails_on_unknown_spec(capsys):
    assert cc.main(["--only", "kvcache", "--arch", "80"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("compiling every kernel") and out[1].split()[:2] == ["kernel", "arch"]
    assert any(l.startswith("kv_append_kernel<__half>") and "sm_80" in l for l in out)
    n = len(cupyattn.kvcache.SPEC.name_expressions)
    assert out[-1].startswith(f"{n} kernel builds, 0 errors, 0 with spills")
    assert cc.main(["--only", "nosuch"]) == 1
    assert "ERROR: no kernel spec named 'nosuch'" in capsys.readouterr().out


# --- GPU tier (also on the CPU emulator): compile on demand ------------------------------------
@pytest.mark.gpu
def test_a_call_compiles_only_the_instantiation_it_launches(monkeypatch):
    import cupy

    from cupyattn import flash_attn

    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    # bf16 D=64: impl=None takes flash_mma (flash below sm_80) everywhere (not in config.ATTN_AUTO_WGMMA)
    bf16 = config.BFLOAT16
    assert (bf16, 64) not in config.ATTN_AUTO_WGMMA
    q = cupy.asarray(np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(bf16))
    cupyattn.attention(q, q, q, causal=True)
    cupyattn.attention(q, q, q, causal=True)  # memoised: no second build
    assert list(_loader._FUNCTIONS) == [("flash_attn", flash_attn._expr(flash_attn.default_impl(bf16, 64),
                                                                        bf16, 64, True), cupy.cuda.Device().id)]
    with pytest.raises(KeyError, match="not an instantiation of kernel spec 'flash_attn'"):
        _loader.get_function(flash_attn.SPEC, "flash_attn_fwd<double, 7>")


@pytest.mark.gpu
def test_emulator_builds_a_chunk_once_and_a_failed_chunk_falls_back_to_one(monkeypatch):
    """Under the CPU emulator the loader builds a spec's instantiations a chunk at a time (a g++
    start-up costs more than the kernels): the chunk holding the one launched, memoised for its
    neighbours; if the chunk does not build, the instantiation alone (its own error, if any)."""
    import cupy

    from cupyattn import kvcache

    if not hasattr(cupy, "_cupyattn_emulator_chunk"):
        pytest.skip("NVRTC builds one instantiation at a time: the emulator's chunks only")
    _, arch = device.device_arch()
    exprs = kvcache.SPEC.exprs_for(device.compute_capability())
    monkeypatch.setattr(cupy, "_cupyattn_emulator_chunk", 4)
    assert _loader._module_exprs(kvcache.SPEC, exprs[5], arch) == exprs[4:8]
    assert _loader._module_exprs(kvcache.SPEC, exprs[-1], arch) == exprs[(len(exprs) - 1) // 4 * 4:]
    built, fail_chunks = [], []

    class Recording(cupy.RawModule):
        def __init__(self, code, options=(), name_expressions=(), **kw):
            built.append(tuple(name_expressions))
            super().__init__(code, options, name_expressions, **kw)

        def compile(self, log_stream=None):
            if fail_chunks and len(self.exprs) > 1:
                raise cupy.cuda.compiler.CompileException("a chunk that does not build")
            super().compile(log_stream)

    monkeypatch.setattr(cupy, "RawModule", Recording)
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "_MODULES", {})
    _loader.get_function(kvcache.SPEC, exprs[5])
    _loader.get_function(kvcache.SPEC, exprs[6])  # its neighbour: no second build
    assert built == [exprs[4:8]]
    # the same chunk for an older target (CUPYATTN_ARCH: other -D options) is another build
    assert kvcache.SPEC.exprs_for(75) == exprs
    monkeypatch.setenv("CUPYATTN_ARCH", "75")
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    _loader.get_function(kvcache.SPEC, exprs[5])
    assert built == [exprs[4:8], exprs[4:8]]
    monkeypatch.delenv("CUPYATTN_ARCH")
    built.clear()
    fail_chunks.append(True)
    assert _loader.get_function(kvcache.SPEC, exprs[0]).expr == exprs[0]
    assert built == [exprs[0:4], (exprs[0],)]


@pytest.mark.gpu
@pytest.mark.parametrize("quiet", [False, True])
def test_a_slow_compile_is_announced_on_stderr(monkeypatch, capfd, quiet):
    """A compile still running after ANNOUNCE_AFTER_S prints one line naming the kernel."""
    import time

    import cupy

    from cupyattn import kvcache

    real = cupy.RawModule

    class SlowModule(real):  # stands in for a long NVRTC run
        def get_function(self, name):
            time.sleep(0.5)
            return super().get_function(name)

    monkeypatch.setattr(cupy, "RawModule", SlowModule)
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "ANNOUNCE_AFTER_S", 0.05)
    monkeypatch.setenv("CUPYATTN_QUIET", "1" if quiet else "")
    _loader.get_function(kvcache.SPEC, "kv_advance_lengths_kernel")
    err = capfd.readouterr().err
    if quiet:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("cupyattn: compiling kv_advance_lengths_kernel "
                                                        "(kernels_cu/kvcache.cu) for sm_")


@pytest.mark.gpu
def test_dynamic_shared_memory_is_opted_in_once_and_checked(monkeypatch):
    import cupy

    from cupyattn import kvcache

    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "_SMEM_RAISED", {})
    expr = "kv_advance_lengths_kernel"
    fn = _loader.get_function(kvcache.SPEC, expr, dynamic_smem=1024)  # under 48 KB: untouched
    assert fn.max_dynamic_shared_size_bytes == 48 * 1024 - fn.shared_size_bytes  # the driver's default
    fn = _loader.get_function(kvcache.SPEC, expr, dynamic_smem=100 * 1024)
    assert fn.max_dynamic_shared_size_bytes == 100 * 1024
    lengths = cupy.zeros(3, dtype=np.int32)
    fn((1,), (32,), (lengths, lengths, np.int32(3), np.int32(2), np.int32(0)), shared_mem=100 * 1024)
    assert cupy.asnumpy(lengths).tolist() == [2, 2, 2]
    limit = int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    with pytest.raises(ValueError, match=rf"needs {limit + 16} B of shared memory per block \(0 B static \+ "
                                         rf"{limit + 16} B dynamic\); this device allows {limit} B"):
        _loader.get_function(kvcache.SPEC, expr, dynamic_smem=limit + 16)


# --- CPU tier without a GPU: the error says what is missing and what still works ---------------
def test_without_a_gpu_the_error_says_so_plainly():
    from conftest import EMULATE, HAS_GPU

    if HAS_GPU or EMULATE:
        pytest.skip("this machine has a GPU (or emulates one)")
    from cupyattn import kvcache

    reason = cupyattn.gpu_unavailable_reason()
    assert reason and "NVIDIA" in reason and "insufficient" not in reason
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU: .*NVIDIA.*tinylm --backend numpy"):
        _loader.get_function(kvcache.SPEC, "kv_advance_lengths_kernel")
    for make, name in ((lambda: cupyattn.KVCache(1, 1, 1, 16, 32, "float16"), "KVCache"),
                       (lambda: cupyattn.SamplingParams(1), "SamplingParams")):
        with pytest.raises(RuntimeError, match=rf"^{name}\(\) needs a CUDA GPU: .*NVIDIA"):
            make()


def _no_gpu_calls():
    """(name, call) of every public op and constructor, given NumPy arrays where arrays go: what a
    user without a GPU may try first."""
    from cupyattn import fused

    x, i32 = np.ones((1, 2, 4, 64), np.float16), np.zeros(2, np.int32)
    return [
        ("attention", lambda: cupyattn.attention(x, x, x)),
        ("attention_varlen", lambda: cupyattn.attention_varlen(x[0, 0], x[0, 0], x[0, 0], i32, i32, 4, 4)),
        ("attention_paged", lambda: cupyattn.attention_paged(x, x, x, i32[None], i32[:1])),
        ("decode_attention_paged", lambda: cupyattn.decode_attention_paged(x[0], x, x, i32[None], i32[:1])),
        ("softmax", lambda: cupyattn.softmax(x)),
        ("gemm_nt", lambda: cupyattn.gemm_nt(x, x)),
        ("gemm_nn", lambda: cupyattn.gemm_nn(x, x)),
        ("rmsnorm", lambda: cupyattn.rmsnorm(x, x[0, 0, 0])),
        ("add_rmsnorm", lambda: cupyattn.add_rmsnorm(x, x, x[0, 0, 0])),
        ("rope", lambda: cupyattn.rope(x, np.arange(4))),
        ("swiglu", lambda: cupyattn.swiglu(x, x)),
        ("add", lambda: cupyattn.add(x, x)),
        ("embedding", lambda: cupyattn.embedding(i32, x[0, 0])),
        ("sample", lambda: cupyattn.sample(x[0, 0], None)),
        ("gemm_residual", lambda: fused.gemm_residual(x[0, 0], x[0, 0], x[0, 0])),
        ("rmsnorm_gemm", lambda: fused.rmsnorm_gemm(x[0, 0], x[0, 0, 0], x[0, 0])),
        ("KVCache", lambda: cupyattn.KVCache(1, 1, 1, 16, 64, "float16")),
        ("PagedKVCache", lambda: cupyattn.PagedKVCache(1, 1, 1, 64, 4, 16, "float16")),
        ("SamplingParams", lambda: cupyattn.SamplingParams(1)),
        ("auto_num_splits", lambda: cupyattn.auto_num_splits(1, 8, 8, 64, np.float16, 1024)),
    ]


@pytest.mark.parametrize("name,call", _no_gpu_calls(), ids=[n for n, _ in _no_gpu_calls()])
def test_without_a_gpu_every_op_fails_in_one_line_that_says_what_to_do(name, call):
    """No chained traceback from CuPy (the cause is suppressed), one line naming the function, the
    reason and what works without a GPU; never the advice to move NumPy input to the GPU."""
    import traceback

    from conftest import EMULATE, HAS_GPU

    if HAS_GPU or EMULATE:
        pytest.skip("this machine has a GPU (or emulates one)")
    with pytest.raises((TypeError, RuntimeError)) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and "cupy.asarray" not in msg, msg
    assert "cupyattn.gpu_unavailable_reason()" in msg and "tinylm --backend numpy" in msg, msg
    assert msg.startswith(f"{name}(") or msg.startswith("cupyattn kernel launch needs"), msg
    shown = "".join(traceback.format_exception(e.value))
    assert shown.count("Traceback (most recent call last)") == 1 and "CUDARuntimeError" not in shown, shown


def test_python_m_cupyattn_follows_argparse_conventions():
    """No command: usage on stderr, status 2; --help: on stdout, status 0; an unknown command: 2."""
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "cupyattn", *args], capture_output=True, text=True,
                              timeout=120, cwd=KERNELS_DIR.parent)

    r = run()
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("usage: python -m cupyattn {check,options}"), r
    assert "error: a command is required" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("usage: python -m cupyattn {check,options}"), r
    assert "  options " in r.stdout
    r = run("nosuch")
    assert r.returncode == 2 and "unknown command 'nosuch'" in r.stderr and r.stdout == ""
    r = run("options", "--json")
    assert r.returncode == 2 and "takes no arguments" in r.stderr and r.stdout == ""


# --- CPU tier: the shared-memory opt-in, with ptxas' static sizes ----------------------------
def _dynamic_smem_launches():
    """(spec, name expression, dynamic bytes) of every launch the ops make with dynamic smem."""
    from cupyattn import decode, flash_attn, flash_attn_sm90, gemm
    from cupyattn import config as C

    for dt in C.DTYPES:
        for d in C.HEAD_DIMS:
            group_plans = {decode._plan("simt", dt, d, 1)}
            if dt in C.MMA_DTYPES:
                group_plans |= {decode._plan("mma", dt, d, g) for g in range(1, 65)}
                for causal in (False, True):
                    yield flash_attn.SPEC, flash_attn._expr("flash_mma", dt, d, causal), C.flash_mma_smem_bytes(d)
            for p in group_plans:
                yield decode.SPEC, p.expr, p.tile.ring_bytes
        if dt in C.MMA_DTYPES:
            for nt in (True, False):
                yield gemm.SPEC, gemm._expr("mma", dt, nt), C.gemm_mma_smem_bytes(C.GEMM_TILES["mma"], nt)
                for bn, tile in C.GEMM_WGMMA_TILES.items():
                    yield gemm.SPEC_SM90, gemm._expr("wgmma", dt, nt, bn), tile.smem_bytes
    for dt, d, t, sched in flash_attn_sm90.instantiations():   # the Hopper attention kernel, every variant
        yield flash_attn_sm90.SPEC, flash_attn_sm90._expr(dt, d, t, sched), flash_attn_sm90.smem_bytes(t, d, sched)


def test_every_dynamic_smem_launch_is_opted_in_as_the_driver_requires(compile_report, monkeypatch):
    """The driver refuses a block whose static + dynamic shared memory passes 48 KB unless the
    kernel's max_dynamic_shared_size_bytes covers the dynamic part (its default is 48 KB minus
    the static part). The first H100 run failed float32 decode launches this way (D=128: a 48 KB
    ring beside 4.7 KB of static arrays), with the opt-in keyed on the ring alone. Here the loader
    meets a stand-in kernel holding ptxas' static size for each instantiation (sm_90, 227 KB)."""
    launches = list(_dynamic_smem_launches())
    static = {}
    for spec in {s for s, _, _ in launches}:
        reports, errors = compile_report(spec.name)
        assert not errors, errors
        static.update({(spec.name, r.kernel): r.smem_bytes for r in reports if r.arch in ("sm_90", "sm_90a")})
    # the launches of the instantiations the gate built (all of them under CUPYATTN_FULL=1)
    built = [t for t in launches if (t[0].name, t[1]) in static]
    assert built and (cc.gate_pairs() or len(built) == len(launches)), (len(built), len(launches))
    launches = built

    class StandIn:
        def __init__(self, static_bytes):
            self.shared_size_bytes = static_bytes
            self.max_dynamic_shared_size_bytes = 48 * 1024 - static_bytes

    from cupyattn import device as D   # an H100 as the loader sees it: sm_90, 227 KB per block

    monkeypatch.setattr(D, "device_arch", lambda: (0, "90"))
    monkeypatch.setattr(D, "compute_capability", lambda: 90)
    monkeypatch.setattr(D, "smem_optin", lambda: 227 * 1024)
    monkeypatch.setattr(_loader, "_compile", lambda spec, expr, arch: StandIn(static[(spec.name, expr)]))
    monkeypatch.setattr(_loader, "_FUNCTIONS", {})
    monkeypatch.setattr(_loader, "_SMEM_RAISED", {})
    opted = 0
    for spec, expr, dyn in launches:
        fn = _loader.get_function(spec, expr, dynamic_smem=dyn)
        assert dyn <= fn.max_dynamic_shared_size_bytes, (expr, fn.shared_size_bytes, dyn)
        assert fn.shared_size_bytes + dyn <= 227 * 1024, expr
        opted += fn.max_dynamic_shared_size_bytes != 48 * 1024 - fn.shared_size_bytes
    assert opted > 0  # some launches need the opt-in (flash_mma, float32 decode)
    smallest = min(launches, key=lambda t: static[(t[0].name, t[1])] + t[2])
    assert static[(smallest[0].name, smallest[1])] + smallest[2] <= 48 * 1024  # and some do not


def test_gate_builds_every_template_argument_value_and_pair():
    """The test command's compile gate (_compile_check.gate_exprs with pairs): per kernel template,
    every value of each template argument and every pair of values of two still builds; the
    Hopper kernels whole; fewer builds than every instantiation."""
    import itertools

    kept = every = 0
    for spec in cupyattn.all_specs():
        full, sub = spec.exprs_for(90), cc.gate_exprs(spec, "90", pairs=True)
        assert set(sub) <= set(full) and cc.gate_exprs(spec, "90") == full
        if spec.sm90a:
            assert sub == full, spec.name
        for kernel in {e.partition("<")[0] for e in full}:
            def features(exprs):
                out = set()
                for e in exprs:
                    if e.partition("<")[0] == kernel:
                        args = list(enumerate(e.partition("<")[2].rpartition(">")[0].split(",")))
                        out |= set(args) | set(itertools.combinations(args, 2))
                return out
            assert features(sub) == features(full), (spec.name, kernel)
        kept, every = kept + len(sub), every + len(full)
    assert kept < every / 2, (kept, every)


def test_all_pairs_keeps_each_value_and_the_pairs_asked_for():
    """tests/tiers.py's subset of a parameter grid: each value of every parameter, each pair of
    values of the paired parameters, not every combination."""
    import itertools

    grid = [(("dtype", dt), ("n", n), ("flag", f)) for dt in "abc" for n in range(5) for f in (0, 1)]
    keep = cc.all_pairs(grid, list, paired={"dtype", "flag"}.__contains__)
    assert {p for item in keep for p in item} == {p for item in grid for p in item}
    assert {(item[0], item[2]) for item in keep} == {(item[0], item[2]) for item in grid}
    assert len(keep) < len(grid) and keep == [g for g in grid if g in keep]
    every_pair = cc.all_pairs(grid, list)
    assert {(a, b) for item in every_pair for a, b in itertools.combinations(item, 2)} == \
        {(a, b) for item in grid for a, b in itertools.combinations(item, 2)}
