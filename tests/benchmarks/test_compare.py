"""CPU tier: the checks that keep a benchmark number honest, on the committed results and a fake
NVML: `compare`'s flags, the README table's clean rows, the idle-GPU guard, the settle plan."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import compare, gpu_guard, readme_table, settle

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOV27 = RESULTS / "2026-11-27-nvidia-h100-80gb-hbm3.json"
NOV26 = RESULTS / "2026-11-26-nvidia-h100-80gb-hbm3.json"


def _flags(rows):
    return {(r["case"], r["impl"]): r["flags"] for r in rows}


# --- compare --------------------------------------------------------------------------------------
def test_compare_flags_the_2026_11_27_outliers():
    """On the committed runs: the decode B1 L131072 split-kv row (3.104 ms against 0.211) and the
    M=1 GEMM rows (cuBLAS twice its time, ours-skinny 2.7x the default running the same kernel)
    are flagged; the GEMM 4096^3 default and cuBLAS, timed alike both days, are not."""
    assert compare.baseline(NOV27, RESULTS) == NOV26
    rows = compare.compare(compare.load(NOV27), compare.load(NOV26))
    f = _flags(rows)
    split = f[("decode B1 H32/8 L131072 D128 float16", "split-kv")]
    assert any(x.startswith("slower: 14.70x") for x in split) and any(x.startswith("spread: max/min 2.28") for x in split)
    m1 = "gemm skinny M1 N4096 K4096 float16"
    assert any("slower: 1.99x" in x for x in f[(m1, "cublas")]) and any("spread" in x for x in f[(m1, "cublas")])
    assert any(x.startswith("twin: ours-skinny") for x in f[(m1, "ours")])
    assert any("slower" in x for x in f[(m1, "ours-skinny")])
    assert f[("gemm M4096 N4096 K4096 nt float16", "ours")] == [] and f[("gemm M4096 N4096 K4096 nt float16", "cublas")] == []
    assert f[("decode B8 H32/8 L32768 D128 float16", "split-kv")] == []
    # a ratio below 1 (faster) is never "slower"
    assert all(not any(x.startswith("slower") for x in r["flags"]) for r in rows if r["ratio"] and r["ratio"] <= 1.1)


def test_compare_rules_by_hand():
    """Each rule on records built here: 10% slower, spread 1.5, the twin rule, a shared run."""
    def rec(impl, ms, lo, hi, case="gemm M1", shape="M1 N64 K64 nt", op="gemm"):
        return {"op": op, "case": case, "shape": shape, "dtype": "float16", "impl": impl, "kind": "ours",
                "status": "ok", "median_ms": ms, "min_ms": lo, "max_ms": hi, "reps": 10}

    old = {"meta": {"gpu": "G"}, "records": [rec("ours", 1.0, 1.0, 1.0), rec("cublas", 1.0, 1.0, 1.0)]}
    new = {"meta": {"gpu": "G", "compute_capability": "90"},
           "records": [rec("ours", 1.1, 1.0, 1.4), rec("cublas", 1.11, 1.0, 1.6), rec("ours-skinny", 1.7, 1.6, 1.8)]}
    f = _flags(compare.compare(new, old))
    assert f[("gemm M1", "ours")] == ["twin: ours-skinny (the same kernel) took 1.55x as long"]  # 1.1 is not > 1.1
    assert [x.split(":")[0] for x in f[("gemm M1", "cublas")]] == ["slower", "spread"]
    assert f[("gemm M1", "ours-skinny")] == []  # no old record: nothing to compare, spread 1.125
    new["meta"]["gpu_guard"] = {"shared": True}
    assert all(any(x.startswith("shared") for x in v) for v in _flags(compare.compare(new, old)).values())
    new["meta"]["gpu_guard"] = {"shared": None, "checked": False}  # --allow-shared without NVML
    assert compare.shared(new) and not compare.shared(old)


def test_compare_cli_prints_the_flags_first(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks", "compare", str(NOV27)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("new: ") and "2026-11-26" in lines[1] and lines[2].startswith("flags: ")
    first_table = next(i for i, l in enumerate(lines) if l.startswith("case "))
    flags = [l for l in lines[:first_table] if l.startswith("  FLAG ")]
    assert len(flags) == int(lines[2].split()[1]) and any("L131072" in l and "split-kv" in l for l in flags)
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "compare", str(tmp_path / "none.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_first_run_of_a_gpu_model_is_compared_with_a_kin_model(tmp_path):
    """An H200's first run (no H200 run recorded) is compared with the newest H100 run, since the
    same die, SMs and L2 with ceilings at least as high make any 10% loss a finding; a run of the
    same model, once there, is preferred; another SM count, lower ceilings or a shared run are not
    kin (no baseline: spread and twin flags only)."""
    for p in (NOV26, NOV27):
        (tmp_path / p.name).write_text(p.read_text())
    h100 = compare.load(NOV27)
    run = json.loads(json.dumps(h100))
    run["meta"].update(gpu="NVIDIA H200", date_utc="2026-11-29T00:00:00Z")
    run["ceilings"]["copy_gbps"] *= 1.4
    case = "decode B8 H32/8 L32768 D128 float16"
    rec = next(r for r in run["records"] if r["case"] == case and r["impl"] == "split-kv")
    rec["median_ms"] *= 1.3
    new = tmp_path / "2026-11-29-nvidia-h200.json"

    def write(**meta):
        r = json.loads(json.dumps(run))
        r["meta"].update(meta)
        new.write_text(json.dumps(r))
        return compare.baseline(new, tmp_path)

    assert write() == tmp_path / NOV27.name
    rows = compare.compare(compare.load(new), h100)
    assert any(x.startswith("slower: 1.30x") for x in _flags(rows)[(case, "split-kv")])
    text = compare.report(new, tmp_path / NOV27.name, rows, compare.load(new), h100)
    assert "another GPU model (NVIDIA H100 80GB HBM3)" in text and "copy_gbps 1.40x" in text
    assert write(sm_count=114) is None
    # with such a model given as OLD by hand, the header says its ratios are no findings
    assert "not one this should match" in compare.report(new, NOV27, [], compare.load(new), h100)
    run["ceilings"]["copy_gbps"] = 0.9 * h100["ceilings"]["copy_gbps"]
    assert write() is None
    run["ceilings"]["copy_gbps"] = 1.4 * h100["ceilings"]["copy_gbps"]
    kin = json.loads((tmp_path / NOV27.name).read_text())
    kin["meta"]["gpu_guard"] = {"shared": True}
    (tmp_path / NOV27.name).write_text(json.dumps(kin))
    assert write() == tmp_path / NOV26.name  # the newest unshared kin run
    same = json.loads(json.dumps(run))
    same["meta"]["date_utc"] = "2026-11-28T00:00:00Z"
    (tmp_path / "2026-11-28-nvidia-h200.json").write_text(json.dumps(same))
    assert write() == tmp_path / "2026-11-28-nvidia-h200.json"


# --- the README table from clean rows only --------------------------------------------------------
def test_readme_table_leaves_out_flagged_rows_and_shared_runs(tmp_path):
    block = readme_table.table(NOV27)
    assert "GEMM fp16 1 x 4096 x 4096 |" not in block and "1.84x" not in block
    assert "Left out, flagged by" in block and "GEMM fp16 1 x 4096 x 4096 (ours: twin" in block
    assert "| GEMM fp16 4096^3 (A B^T) | default: 0.207 ms | cublas: 0.183 ms | **0.88x** |" in block
    run = json.loads(NOV27.read_text())
    run["meta"]["gpu_guard"] = {"checked": True, "shared": True, "reasons": ["1 other process(es)"]}
    run["meta"]["date_utc"] = "2026-11-28T00:00:00Z"
    for p in (NOV26, NOV27):
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "2026-11-28-shared.json").write_text(json.dumps(run))
    assert readme_table.newest(tmp_path).name == NOV27.name  # the shared run is never the source
    with pytest.raises(ValueError, match="shared its GPU"):
        readme_table.table(tmp_path / "2026-11-28-shared.json")


# --- the idle-GPU guard against a fake NVML -------------------------------------------------------
class _Err(Exception):
    pass


def fake_pynvml(procs_seq, util=0, names=None):
    """A pynvml stand-in: each call of nvmlDeviceGetComputeRunningProcesses returns the next list
    of pids from ``procs_seq``."""
    m = types.ModuleType("pynvml")
    calls = iter(procs_seq)
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 1, 2
    m.NVMLError = _Err
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByPciBusId = lambda bus: ("h", bus)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=p, usedGpuMemory=(1 + i) * 2**30)
                                                       for i, p in enumerate(next(calls))]
    m.nvmlSystemGetProcessName = lambda pid: (names or {}).get(pid, b"python3")
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30)
    m.nvmlDeviceGetClockInfo = lambda h, c: {1: 1980, 2: 2619}[c]
    m.nvmlDeviceGetMaxClockInfo = lambda h, c: {1: 1980, 2: 2619}[c]

    def reasons(h):
        raise _Err("Not Supported")  # a query the driver lacks is recorded as None, never fatal
    m.nvmlDeviceGetCurrentClocksEventReasons = reasons
    return m


@pytest.fixture
def nvml(monkeypatch):
    monkeypatch.delenv(gpu_guard.ALLOW_ENV, raising=False)
    monkeypatch.delenv("CUPYATTN_EMULATE", raising=False)

    def install(*procs_seq, **kw):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(procs_seq, **kw))
    return install


def test_guard_passes_an_idle_gpu_and_records_what_it_saw(nvml):
    import os

    me = os.getpid()
    nvml([me], [me])
    g = gpu_guard.Guard(False, "0000:3B:00.0")
    assert g.start() is None and g.finish() is False
    m = g.meta
    assert m["checked"] and m["shared"] is False and m["processes_visible"] and m["reasons"] == []
    assert m["before"]["sm_clock_mhz"] == 1980 and m["after"]["mem_clock_max_mhz"] == 2619
    assert m["before"]["processes"] == [{"pid": me, "name": "python3", "used_mib": 1024}]
    assert m["before"]["clock_reasons"] is None and m["before"]["utilization_pct"] == 0
    json.dumps(m)  # goes into the results JSON as it is


def test_guard_refuses_another_process_before_timing(nvml):
    import os

    nvml([os.getpid(), 4242], names={4242: b"python3 -m benchmarks all"})
    g = gpu_guard.Guard(False)
    msg = g.start()
    assert msg.startswith("refused: the GPU is not idle (1 other process(es) on the GPU before timing: pid 4242")
    assert "--allow-shared" in msg and g.meta["shared"] is True


def test_guard_marks_a_process_that_came_during_the_run(nvml):
    import os

    me = os.getpid()
    nvml([me], [me, 7])
    g = gpu_guard.Guard(False)
    assert g.start() is None and g.finish() is True
    assert g.meta["shared"] and "after timing" in g.meta["reasons"][0]


def test_guard_busy_gpu_other_namespace_and_allow_shared(nvml, monkeypatch):
    nvml([111], util=97)  # our context under another PID namespace (counted as ours), but busy
    g = gpu_guard.Guard(False)
    assert "utilization 97% before timing" in g.start()
    nvml([111, 222])  # two processes, neither with our PID: one of them is someone else's
    g = gpu_guard.Guard(True)
    assert g.start() is None and g.meta["shared"] and g.meta["allowed_shared"]
    nvml([])  # NVML lists nothing, not even this process: the processes cannot be seen
    g = gpu_guard.Guard(False)
    assert g.start() is None and g.meta["processes_visible"] is False and g.meta["shared"] is False
    monkeypatch.setenv(gpu_guard.ALLOW_ENV, "1")
    assert gpu_guard.Guard(False).allow


def test_guard_without_nvml_refuses_unless_allowed(monkeypatch):
    monkeypatch.delenv(gpu_guard.ALLOW_ENV, raising=False)
    monkeypatch.delenv("CUPYATTN_EMULATE", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    msg = gpu_guard.Guard(False).start()
    assert "nvidia-ml-py" in msg and "--allow-shared" in msg
    g = gpu_guard.Guard(True)
    assert g.start() is None and g.meta["checked"] is False and g.meta["shared"] is None
    assert compare.shared({"meta": {"gpu_guard": g.meta}})  # unchecked: never a README source
    monkeypatch.setenv("CUPYATTN_EMULATE", "1")
    g = gpu_guard.Guard(False)
    assert g.start() is None and "emulator" in g.meta["reason"]


# --- settle: which kernels changed since the last GPU run -----------------------------------------
def test_settle_manifest_is_the_recorded_runs_kernels_and_plans_their_tests(tmp_path):
    manifest = json.loads(settle.MANIFEST.read_text())
    settle.check_manifest(manifest)
    assert manifest["kernels_sha256"] == json.loads(NOV27.read_text())["meta"]["kernels_sha256"]
    kernels = tmp_path / "k"
    kernels.mkdir()
    for name in manifest["files"]:
        (kernels / name).write_bytes(b"x")
    assert settle.changed({"files": settle.file_hashes(kernels)}, kernels) == []
    (kernels / "decode.cu").write_bytes(b"y")
    (kernels / "new.cuh").write_bytes(b"z")
    base = {"files": {n: h for n, h in settle.file_hashes(kernels).items() if n not in ("decode.cu", "new.cuh")}}
    base["files"]["decode.cu"] = "0" * 64
    assert settle.changed(base, kernels) == ["decode.cu", "new.cuh"]
    tests, fams = settle.cover(["decode.cu"])
    assert "tests/cupyattn/test_decode.py" in tests and fams == ["decode", "serving"]
    assert settle.cover(["ptx.cuh"])[0] is None  # a shared header: everything
    for name in manifest["files"]:  # every kernel file is mapped (or shared)
        assert name in settle.COVER, name
    for entry in settle.COVER.values():
        for t in (entry[0] if entry != settle.SHARED else ()):
            assert (ROOT / t).is_file(), t
