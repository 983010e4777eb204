"""benchmarks/causal_sweep.py, the Hopper attention decision run (`benchmarks/gpu_run.sh causal`): its
cases and variants name instantiations the kernel's spec builds, and gpu_run.sh runs it as one capped
step (CPU tier; the run itself needs a GPU)."""
import subprocess
import sys
from pathlib import Path

from benchmarks import causal_sweep as CS
from cupyattn import config
from cupyattn import flash_attn_sm90 as W

ROOT = Path(__file__).resolve().parents[2]


def test_every_variant_launches_a_built_instantiation(monkeypatch):
    """Each dense row's knobs give a tile the spec built, for both dtypes and every case's head dim."""
    seen = set()
    for name, kind, dt, p in CS.cases(quick=False):
        if kind != "dense":
            continue
        for variant, impl, kw in CS.dense_variants(dt, p["D"], p["causal"], (dt, p["D"], p["causal"]) == CS.HEADLINE):
            seen.add(variant)
            if impl == "flash_mma":
                continue
            with CS.knobs(**kw):
                sched = W.PERSIST if impl == "wgmma_persistent" or config.ATTN_SM90_DENSE_SCHEDULER == "persistent" \
                    else W.GRID
                t = W.tile_for(impl or "wgmma", p["D"], sched, p["causal"])
                assert W._expr(dt, p["D"], t, sched) in W.SPEC.name_expressions, (name, variant)
    assert {"default", "wgmma", "wgmma-sections", "wgmma_persistent-sections", "wgmma+persist", "wgmma_persistent",
            "wgmma-wide176", "wgmma-overlap-off",
            "wgmma_persistent-overlap-on", "wgmma-sec4", "flash_mma"} <= seen
    assert config.ATTN_SM90_DENSE_SCHEDULER == "grid" and config.ATTN_SM90_OVERLAP is None   # knobs restored
    kinds = {(k, dt) for _, k, dt, _ in CS.cases(quick=False)}
    assert {("dense", "float16"), ("dense", "bfloat16"), ("varlen", "bfloat16"), ("ragged", "float16"),
            ("paged", "float16")} <= kinds


def test_gpu_run_causal_stage_is_one_capped_step():
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    body = text[text.index("run_causal() {"):]
    body = body[:body.index("\n}\n")]
    assert "-m benchmarks.causal_sweep" in body and 'CAUSAL_TIMEOUT:-300' in body
    assert "stage_causal() { run_causal; }" in text   # a stage of its own (gpu_run.sh causal)
    r = subprocess.run([sys.executable, "-m", "benchmarks.causal_sweep", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "--no-ncu" in r.stdout
