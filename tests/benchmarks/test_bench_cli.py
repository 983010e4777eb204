"""CPU tier of the benchmark CLI: formulas, sweeps, schema, table, no-GPU exit, peers, hashes.

The last tests run the whole CLI in a subprocess on a NumPy stand-in for CuPy (no device
needed): every runner path is exercised, only the numbers are meaningless there.
"""
from __future__ import annotations

import builtins
import hashlib
import importlib.util
import json
import math
import os
import re
import subprocess
import time
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import hf_peer, peers, report, specs, timing
from benchmarks.__main__ import _parser, impls_for_case, main, plan, select_impls

from conftest import EMULATE, HAS_GPU

ROOT = Path(__file__).resolve().parents[2]


# --- formulas ---------------------------------------------------------------------------------
def test_gemm_formulas_by_hand():
    assert specs.gemm_flops(2, 3, 4) == 2 * 2 * 3 * 4 == 48
    assert specs.gemm_flops(2, 3, 4, batch=5) == 240
    # A 2x4 + B 3x4 + C 2x3 = 8 + 12 + 6 elements of 2 bytes
    assert specs.gemm_bytes(2, 3, 4, 2) == 52


def test_attention_formulas_by_hand():
    # 4*B*H*Sq*Sk*D
    assert specs.attention_flops(1, 2, 3, 5, 4) == 480
    assert specs.attention_flops(1, 1, 4, 4, 8, causal=True) == 4 * 4 * 4 * 8 // 2 == 256
    # causal is halved only when Sq == Sk
    assert specs.attention_flops(1, 1, 2, 4, 8, causal=True) == 4 * 2 * 4 * 8
    # Q and O: 2 * (1*2*3*4) = 48 elements; K and V: 2 * (1*1*5*4) = 40 elements; 2 bytes each
    assert specs.attention_bytes(1, 2, 1, 3, 5, 4, 2) == 176


def test_decode_and_softmax_formulas_by_hand():
    assert specs.decode_flops(2, 4, 10, 8) == 4 * 2 * 4 * 10 * 8 == 2560
    # q+out: 2*(2*4*1*8)=128; cache K+V: 2*(2*2*10*8)=640; fp16
    assert specs.decode_bytes(2, 4, 2, 10, 8, 2) == (128 + 640) * 2
    assert specs.softmax_bytes(3, 5, 4) == 120


def test_case_counts_and_rates():
    c = specs.make_case("attention", "float16", B=1, H=2, Hkv=1, Sq=3, Sk=5, D=4, causal=False)
    assert specs.case_flops(c) == 480 and specs.case_bytes(c) == 176
    s = specs.make_case("softmax", "float32", rows=3, cols=5)
    assert specs.case_flops(s) is None and specs.case_bytes(s) == 120
    g = specs.make_case("gemm", "bfloat16", M=2, N=3, K=4, layout="nt", batch=1)
    assert specs.case_bytes(g) == 52
    d = specs.make_case("decode", "float16", B=2, H=4, Hkv=2, L=10, D=8)
    assert specs.case_flops(d) == 2560
    tf, gb = specs.rates(1e12, 1e9, 1.0)  # in 1 ms
    assert tf == pytest.approx(1000.0) and gb == pytest.approx(1000.0)
    assert specs.rates(None, 2e9, 2.0) == (None, pytest.approx(1000.0))
    assert specs.rates(1, 1, 0.0) == (None, None)


def test_roofline_picks_the_nearer_ceiling():
    ceil = {"gemm_tflops": 800.0, "copy_gbps": 3000.0}
    assert specs.roofline_pct(400.0, 300.0, ceil) == (pytest.approx(50.0), "compute")
    assert specs.roofline_pct(8.0, 2700.0, ceil) == (pytest.approx(90.0), "memory")
    assert specs.roofline_pct(None, None, ceil) == (None, "")
    assert specs.roofline_pct(1.0, None, {}) == (None, "")


def test_shape_strings_are_stable():
    c = specs.make_case("attention", "float16", B=2, H=8, Hkv=2, Sq=17, Sk=97, D=64, causal=True)
    assert c.shape == "B2 H8/2 Sq17 Sk97 D64 causal"
    assert c.name == "attention B2 H8/2 Sq17 Sk97 D64 causal float16"
    assert specs.make_case("gemm", "float32", M=1, N=2, K=3, layout="nn", batch=1).shape == "M1 N2 K3 nn"
    with pytest.raises(ValueError):
        specs.make_case("conv", "float16")
    with pytest.raises(ValueError):
        specs.make_case("gemm", "int8", M=1, N=1, K=1, layout="nt")


# --- sweeps -----------------------------------------------------------------------------------
def test_attention_sweep():
    cases = specs.sweep_cases("attention-seqlen")
    assert {c.p["Sq"] for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {(c.p["D"], c.p["causal"]) for c in cases} == {(64, False), (64, True), (128, False), (128, True)}
    assert len(cases) == 24
    for c in cases:
        p = c.p
        assert p["Sq"] == p["Sk"] == c.x and p["B"] * p["Sq"] == 16384 and p["H"] * p["D"] == 2048
        assert c.sweep == "attention-seqlen" and c.dtype == "float16"
    assert all(c.dtype == "bfloat16" for c in specs.sweep_cases("attention-seqlen", "bfloat16"))


def test_gemm_and_decode_sweeps():
    g = specs.sweep_cases("gemm-llama2-7b")
    shapes = {(c.group, c.p["N"], c.p["K"]) for c in g}
    assert shapes == {("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                      ("down", 4096, 11008)}
    assert all(c.p["layout"] == "nt" and c.x == c.p["M"] for c in g)
    s = specs.sweep_cases("gemm-smollm2")
    assert {(c.group, c.p["N"], c.p["K"]) for c in s} == {("qkv", 960, 576), ("o", 576, 576),
                                                          ("gate_up", 3072, 576), ("down", 576, 1536)}
    assert specs.sweeps_for("gemm") == ["gemm-llama2-7b", "gemm-smollm2"]
    big = [c for c in specs.default_cases("gemm") if c.p["M"] == 8192]
    assert sorted((c.dtype, c.p["layout"]) for c in big) == [(d, l) for d in ("bfloat16", "float16") for l in ("nn", "nt")]
    assert "ours-wgmma" in cases_module().impl_names("gemm")
    lens = specs.sweep_cases("decode-len")
    assert sorted({c.p["L"] for c in lens}) == [1024 * 2**i for i in range(8)]
    assert max(c.p["L"] for c in lens) == 131072
    bat = specs.sweep_cases("decode-batch")
    assert [c.p["B"] for c in bat] == [1, 2, 4, 8, 16, 32, 64]
    for c in lens + bat:
        assert c.p["H"] % c.p["Hkv"] == 0
    assert specs.sweeps_for("decode") == ["decode-len", "decode-batch"]
    with pytest.raises(ValueError):
        specs.sweep_cases("nope")


def test_every_sweep_case_is_well_formed():
    for name, (op, _, _) in specs.SWEEPS.items():
        cases = specs.sweep_cases(name)
        assert cases and len(set(cases)) == len(cases)
        for c in cases:
            assert c.op == op and c.x is not None and c.group
            assert specs.case_bytes(c) > 0


def cases_module():
    from benchmarks import cases

    return cases


# --- CLI planning -----------------------------------------------------------------------------
def _plan(*argv):
    return plan(_parser().parse_args(list(argv)))


def test_plan_from_shape_flags():
    (c,) = _plan("attention", "--B", "2", "--H", "4", "--Sq", "128", "--D", "64", "--causal")
    assert c.p == {"B": 2, "H": 4, "Hkv": 4, "Sq": 128, "Sk": 128, "D": 64, "causal": True}
    (g,) = _plan("gemm", "--M", "64", "--layout", "nn", "--dtype", "float32")
    assert (g.p["M"], g.p["N"], g.p["K"], g.p["layout"], g.dtype) == (64, 64, 64, "nn", "float32")
    (d,) = _plan("decode", "--B", "3", "--H", "8", "--Hkv", "2", "--Sk", "1000")
    assert (d.p["B"], d.p["L"], d.p["H"], d.p["Hkv"]) == (3, 1000, 8, 2)
    (s,) = _plan("softmax", "--rows", "7", "--cols", "9")
    assert s.p == {"rows": 7, "cols": 9}


def test_plan_defaults_sweeps_and_all(tmp_path, monkeypatch):
    assert all(c.dtype == "bfloat16" for c in _plan("softmax", "--dtype", "bfloat16"))
    assert len(_plan("attention", "--sweep", "attention-seqlen")) == 24
    every = _plan("all", "--skip-model")
    assert {c.op for c in every} == {"gemm", "softmax", "attention", "decode", "varlen", "paged"}
    with_model = _plan("all", "--preset", "tiny")
    assert [(c.p["model"], c.p["batch"]) for c in with_model if c.op == "model"] == [
        ("smollm2", 1), ("smollm2", 8), ("tiny", 1)]
    n_sweeps = sum(len(specs.sweep_cases(n)) for n in specs.SWEEPS)
    assert len(_plan("all", "--with-sweeps", "--skip-model")) == len(every) + n_sweeps
    (m,) = _plan("model", "--model", "tiny", "--new-tokens", "5")
    assert m.p == {"model": "tiny", "prompt_len": 128, "new_tokens": 5, "batch": 1}
    assert m.name == "model tiny B1" and m.shape == "tiny B1 prompt128 new5"
    assert [c.p["batch"] for c in _plan("model", "--model", "tiny", "--batch", "1,8")] == [1, 8]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.gguf").write_bytes(b"")  # --model checks that a GGUF file exists
    two = _plan("all", "--skip-model", "--model", "tiny"), _plan("all", "--model", "tiny,a/b.gguf", "--batch", "1,8")
    assert not [c for c in two[0] if c.op == "model"]
    assert [(c.p["model"], c.p["batch"]) for c in two[1] if c.op == "model"] == [
        ("tiny", 1), ("tiny", 8), ("a/b.gguf", 1), ("a/b.gguf", 8)]
    assert [(c.p["model"], c.p["batch"]) for c in _plan("model", "--preset", "tiny", "--batch", "4")] == [
        ("smollm2", 4), ("tiny", 4)]


def test_impl_selection_and_tf32_only_for_float32():
    quiet = []
    assert select_impls("attention", ["flash", "cupy-naive"], quiet.append) == ["flash", "cupy-naive"]
    with pytest.raises(ValueError, match="argument --impl: unknown impl"):
        select_impls("attention", ["flashy"], quiet.append)
    fp16 = specs.make_case("gemm", "float16", M=8, N=8, K=8, layout="nt", batch=1)
    fp32 = specs.make_case("gemm", "float32", M=8, N=8, K=8, layout="nt", batch=1)
    assert impls_for_case(fp16, ["ours", "cublas", "cublas-tf32"]) == ["ours", "cublas"]
    assert impls_for_case(fp32, ["ours", "cublas", "cublas-tf32"]) == ["ours", "cublas", "cublas-tf32"]
    assert impls_for_case(fp32, ["ours-simt", "ours-mma"]) == ["ours-simt"]
    assert impls_for_case(fp16, ["ours-simt", "ours-mma"]) == ["ours-simt", "ours-mma"]
    big = specs.make_case("gemm", "float16", M=17, N=8, K=8, layout="nt", batch=1)
    nn = specs.make_case("gemm", "float16", M=1, N=8, K=8, layout="nn", batch=1)
    assert impls_for_case(fp16, ["ours", "ours-skinny"]) == ["ours", "ours-skinny"]  # M = 8
    assert impls_for_case(big, ["ours", "ours-skinny"]) == impls_for_case(nn, ["ours", "ours-skinny"]) == ["ours"]
    attn = {dt: specs.make_case("attention", dt, B=1, H=2, Hkv=2, Sq=8, Sk=8, D=64, causal=False)
            for dt in ("float16", "bfloat16")}
    assert impls_for_case(attn["float16"], ["flash", "cupy-naive"]) == ["flash", "cupy-naive"]
    assert impls_for_case(attn["bfloat16"], ["flash", "cupy-naive"]) == ["flash"]  # CuPy: no batched bf16


def test_issue39_cases_and_impls():
    """The ragged decode case (lengths from a fixed seed, bytes and FLOPs over the live keys only),
    the opt-in decode impls (run when named, left out of the default selection), the serve cases
    (slots 8, 32, 64 unless --batch) and which impls apply to them."""
    from benchmarks import cases

    rag = specs.ragged_decode_case()
    lens = specs.decode_lengths(rag.p)
    assert rag in specs.default_cases("decode") and rag.shape == "B64 H32/8 L32768 D128 ragged39"
    assert len(lens) == 64 and min(lens) >= 128 and max(lens) == 32768 and len(set(lens)) > 32
    assert lens == specs.decode_lengths(rag.p)  # fixed by the seed
    assert specs.case_bytes(rag) == sum(specs.decode_bytes(1, 32, 8, n, 128, 2) for n in lens)
    assert specs.case_bytes(rag) < specs.case_bytes(specs.make_case("decode", "float16", B=64, H=32, Hkv=8,
                                                                    L=32768, D=128))
    quiet = []
    default = select_impls("decode", None, quiet.append)
    assert not set(cases.OPT_IN["decode"]) & set(default) and "paged-16" in default
    assert select_impls("decode", ["paged-hnd-1", "split-kv-waves"], quiet.append) == ["paged-hnd-1", "split-kv-waves"]
    assert impls_for_case(rag, ["split-kv", "cupy-naive", "torch-sdpa"]) == ["split-kv", "torch-sdpa"]
    serve = _plan("model", "--serve", "--model", "tiny")
    assert [c.name for c in serve] == [f"model tiny serve S{s}" for s in (8, 32, 64)]
    assert [c.p["batch"] for c in _plan("model", "--serve", "--model", "tiny", "--batch", "2")] == [2]
    names = ["tinylm", "tinylm-serve", "tinylm-serve-opt-in", "hf-transformers", "hf-compiled"]
    assert impls_for_case(serve[0], names) == ["tinylm-serve", "tinylm-serve-opt-in", "hf-transformers"]
    plain = _plan("model", "--model", "tiny")[0]
    assert impls_for_case(plain, names) == ["tinylm", "hf-transformers", "hf-compiled"]
    args = _parser().parse_args(["decode", "--B", "4", "--Sk", "1000", "--ragged", "3"])
    (one,) = plan(args)
    assert one.p["ragged"] == 3 and specs.decode_lengths(one.p)[0] <= 1000


def test_decode_splits_option_fixes_split_kvs_count(monkeypatch):
    """`decode --splits N`: the case says so in its name, split-kv calls decode_attention with
    num_splits=N (the automatic count without it), unsplit with 1."""
    from benchmarks import cases
    from cupyattn import decode

    seen = []
    monkeypatch.setattr(decode, "decode_attention", lambda q, cache, layer, num_splits=None, out=None:
                        seen.append(num_splits))
    inp = {"q": None, "k": None, "v": None, "cache": None, "out": None, "lens": None}
    for argv, want in ((["--splits", "33"], [33, 1]), ([], [None, 1])):
        (case,) = plan(_parser().parse_args(["decode", "--B", "1", "--Sk", "131072", *argv]))
        assert case.shape.endswith(" splits33") == bool(argv) and case.p.get("splits") == (33 if argv else None)
        seen.clear()
        for name in ("split-kv", "unsplit"):
            cases.make_impl(case, name, inp)()
        assert seen == want


def test_our_impl_names_follow_the_op_modules():
    from benchmarks import cases

    names = cases.impl_names("attention")
    assert "flash" in names and "naive" in names and names[-2:] == ("cupy-naive", "torch-sdpa")
    g = cases.impl_names("gemm")
    assert g[0] == "ours" and "ours-auto" not in g and g[-3:] == ("cublas", "cublas-tf32", "torch-matmul")
    assert cases.impl_names("decode")[:3] == ("split-kv", "unsplit", "naive")


# --- peers ------------------------------------------------------------------------------------
@pytest.fixture
def no_torch(monkeypatch):
    real = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch.") or name == "transformers":
            raise ImportError(f"No module named {name!r} (test)")
        return real(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_torch_peers_skipped_with_one_line_when_torch_is_absent(no_torch):
    lines = []
    assert peers.available("attention", ["cupy-naive", "torch-sdpa"], lines.append) == ["cupy-naive"]
    assert len(lines) == 1 and "torch-sdpa" in lines[0] and "torch" in lines[0]
    assert "\n" not in lines[0]
    lines.clear()
    assert select_impls("softmax", None, lines.append) == ["ours", "cupy-ops"]
    assert len(lines) == 1 and "skipping peer torch" in lines[0]
    lines.clear()
    assert select_impls("model", None, lines.append) == ["tinylm", "tinylm-fused", "tinylm-eager", "tinylm-mega",
                                                         "tinylm-fused-pdl", "tinylm-serve", "tinylm-serve-opt-in"]
    assert len(lines) == 2 and "hf-transformers" in lines[0] and "hf-compiled" in lines[1]
    with pytest.raises(peers.PeerUnavailable):
        peers.get_torch()


# --- records: table, JSON, CSV, speedups ------------------------------------------------------
def _records():
    c = specs.make_case("attention", "float16", B=1, H=2, Hkv=2, Sq=64, Sk=64, D=64, causal=True,
                        sweep="attention-seqlen", group="D64 causal", x=64)
    ceil = {"gemm_tflops": 800.0, "copy_gbps": 3000.0}
    out = []
    for impl, kind, ms in (("flash", "ours", 0.5), ("naive", "ours", 2.0),
                           ("cupy-naive", "peer", 4.0), ("torch-sdpa", "peer", 1.0)):
        r = report.new_record(c, impl, kind)
        report.fill_timing(r, timing.Timing(ms, ms * 0.9, ms * 1.2, 30), specs.case_flops(c),
                           specs.case_bytes(c), ceil)
        r.update(max_abs_err=1.5e-3, rel_err=2.5e-4, err_ref="float64 cupy", peak_mb=12.5)
        out.append(r)
    bad = report.new_record(c, "cupy-naive-bf16", "peer")
    bad["status"] = "error: TypeError: nope"
    out.append(bad)
    report.add_speedups(out, peers.PRIMARY["attention"])
    return out, ceil


def test_speedups_over_peers_and_naive():
    recs, _ = _records()
    flash, naive = recs[0], recs[1]
    assert flash["speedups"] == {"cupy-naive": pytest.approx(8.0), "torch-sdpa": pytest.approx(2.0),
                                 "naive": pytest.approx(4.0)}
    assert (flash["peer"], flash["peer_ms"], flash["speedup"]) == ("torch-sdpa", 1.0, pytest.approx(2.0))
    assert "naive" not in naive["speedups"] and naive["speedup"] == pytest.approx(0.5)
    assert recs[2]["speedups"] == {} and recs[2]["speedup"] is None


def test_model_record_share_of_the_weight_read_limit():
    """A decode step reads every weight once: GB/s = weight bytes x steps/s (tokens/s / batch),
    and the weight-read limit in tokens/s is copy GB/s / weight bytes x batch."""
    from benchmarks.model_bench import _fill

    for batch in (1, 8):
        rec = {}
        _fill(rec, [2.0, 3.0, 4.0], [900.0 * batch, 1000.0 * batch, 1100.0 * batch], [500.0], 300e6,
              {"copy_gbps": 3000.0}, batch)
        assert rec["decode_tok_s"] == 1000.0 * batch and rec["ttft_ms"] == 3.0
        assert rec["gbps"] == pytest.approx(300.0) and rec["pct_ceiling"] == pytest.approx(10.0)
        assert rec["weight_limit_tok_s"] == pytest.approx(10000.0 * batch)
    rec = {}
    _fill(rec, [1.0], [10.0], [], 1e6, {}, 1)
    assert "weight_limit_tok_s" not in rec  # no ceiling measured: no limit claimed


def test_fill_timing_numbers():
    recs, ceil = _records()
    flash = recs[0]
    flops = specs.attention_flops(1, 2, 64, 64, 64, True)
    assert flash["tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
    assert flash["gbps"] == pytest.approx(specs.attention_bytes(1, 2, 2, 64, 64, 64, 2) / 0.5e-3 / 1e9)
    assert flash["bound"] in ("compute", "memory") and flash["reps"] == 30
    assert set(flash) == set(report.FIELDS)


def test_table_formatting():
    recs, ceil = _records()
    head, rows = report.table_rows(recs)
    assert head[:3] == ["case", "impl", "ms (min-max)"] and all(len(r) == len(head) for r in rows)
    assert rows[0][1] == "flash" and rows[0][2] == "0.5 (0.45-0.6)"
    assert "torch-sdpa 2x" in rows[0][6] and "naive 4x" in rows[0][6]
    assert rows[0][8] == "2.5e-04" and rows[0][9] == "ok"
    assert rows[4][2] == "" and rows[4][9].startswith("error")
    text = report.format_table(recs, ceil)
    assert text.splitlines()[0].startswith("ceilings: copy 3000 GB/s")
    assert "flash" in text and "cupy-naive" in text


def test_json_round_trip_and_schema(tmp_path):
    recs, ceil = _records()
    recs[1]["rel_err"] = float("nan")  # JSON has no NaN: written as null
    run = report.run_dict({"gpu": "Test GPU", "kernels_sha256": "0" * 64}, ceil, recs)
    path = report.write_json(tmp_path / "out" / "run.json", run)
    back = report.read_json(path)
    assert back["schema"] == report.SCHEMA and back["ceilings"] == ceil
    assert [list(r) for r in back["records"]] == [list(report.FIELDS)] * len(recs)
    assert back["records"][1]["rel_err"] is None
    for a, b in zip(back["records"], recs):
        for k in report.FIELDS:
            if k != "rel_err" or a[k] is not None:
                assert a[k] == b[k], k
    json.loads(path.read_text())  # strict JSON
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    with pytest.raises(ValueError):
        report.read_json(bad)


def test_csv_round_trip(tmp_path):
    recs, _ = _records()
    path = report.write_csv(tmp_path / "run.csv", recs)
    assert path.read_text().splitlines()[0] == ",".join(report.FIELDS)
    back = report.read_csv(path)
    assert len(back) == len(recs)
    for a, b in zip(back, recs):
        for k in report.FIELDS:
            assert a[k] == (b[k] if b[k] is not None or k != "speedups" else {}), k
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        report.read_csv(tmp_path / "x.csv")


def test_record_path_never_overwrites(tmp_path):
    p1 = report.record_path("NVIDIA H100 80GB HBM3", "2026-11-22", tmp_path)
    assert p1.name == "2026-11-22-nvidia-h100-80gb-hbm3.json"
    p1.write_text("{}")
    p2 = report.record_path("NVIDIA H100 80GB HBM3", "2026-11-22", tmp_path)
    assert p2.name == "2026-11-22-nvidia-h100-80gb-hbm3-2.json"


# --- kernels_sha256 ---------------------------------------------------------------------------
def test_kernels_sha256_by_hand(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.cu").write_bytes(b"__global__ void k() {}\n")
    (tmp_path / "sub" / "a.cuh").write_bytes(b"#pragma once\n")
    text = ("b.cu\n" + hashlib.sha256(b"__global__ void k() {}\n").hexdigest() + "\n"
            + "sub/a.cuh\n" + hashlib.sha256(b"#pragma once\n").hexdigest() + "\n")
    expected = hashlib.sha256(text.encode()).hexdigest()
    assert report.kernels_sha256(tmp_path) == expected
    # bytecode caches are not sources
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert report.kernels_sha256(tmp_path) == expected
    (tmp_path / "sub" / "a.cuh").write_bytes(b"#pragma once // edited\n")
    assert report.kernels_sha256(tmp_path) != expected


def test_dispatch_sha256_covers_kernels_config_and_op_modules(tmp_path):
    """A results file's dispatch_sha256 changes with an edit to a kernel, to config.py or to an
    op module, and with nothing else of the checkout."""
    import shutil

    kern, pkg = tmp_path / "kernels_cu", tmp_path / "cupyattn"
    shutil.copytree(ROOT / "kernels_cu", kern, ignore=shutil.ignore_patterns("__pycache__"))
    pkg.mkdir()
    for f in ("config.py", "decode.py", "flash_attn.py", "gemm.py", "_loader.py"):
        shutil.copy(ROOT / "cupyattn" / f, pkg / f)
    (tmp_path / "README.md").write_text("notes\n")
    before = report.dispatch_sha256(kern, pkg)
    assert report.kernels_sha256(kern) == report.kernels_sha256(ROOT / "kernels_cu")
    for path, edit in [(pkg / "config.py", "\nFLASH_MMA_PAD = 16\n"), (pkg / "decode.py", "\n# split\n"),
                       (kern / "gemm.cu", "\n// tile\n")]:
        text = path.read_text()
        path.write_text(text + edit)
        assert report.dispatch_sha256(kern, pkg) != before, path.name
        path.write_text(text)
        assert report.dispatch_sha256(kern, pkg) == before
    (tmp_path / "README.md").write_text("other notes\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "config.cpython-312.pyc").write_bytes(b"\0")
    assert report.dispatch_sha256(kern, pkg) == before


def test_kernels_sha256_of_the_tree():
    h = report.kernels_sha256(ROOT / "kernels_cu")
    assert len(h) == 64 and int(h, 16) >= 0


# --- timing helpers ---------------------------------------------------------------------------
def test_summarize_and_plan_reps():
    t = timing.summarize([3.0, 1.0, 2.0, 10.0])
    assert (t.median_ms, t.min_ms, t.max_ms, t.reps) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        timing.summarize([])
    assert timing.plan_reps(1.0, 30, 1000.0) == 30
    assert timing.plan_reps(100.0, 30, 1000.0) == 10
    assert timing.plan_reps(10_000.0, 30, 1000.0) == 5  # never fewer than 5
    assert timing.plan_reps(10_000.0, 3, 1000.0) == 3
    assert timing.plan_reps(0.0, 30, 1000.0) == 30


# --- no GPU -----------------------------------------------------------------------------------
def test_help_works_without_a_device():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "attention" in r.stdout and "decode" in r.stdout


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the benchmark would run")
def test_no_gpu_prints_one_line_and_fails():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "attention", "--B", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m benchmarks: "), r.stderr
    # what is missing in plain words (not CUDA's "driver version is insufficient"), what still works
    assert "NVIDIA" in lines[0] and "need a CUDA GPU" in lines[0] and "--backend numpy" in lines[0]
    assert r.stdout == ""


def test_usage_names_the_command_the_user_typed():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m benchmarks ")
    script = Path(sys.executable).parent / "cupyattn-bench"
    if script.exists():  # the console script of an installed package
        r = subprocess.run([str(script), "--help"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith("usage: cupyattn-bench "), r.stdout[:200]


def test_sweep_of_another_op_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["attention", "--sweep", "decode-len"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


# --- the HF peer maps tinylm weights correctly --------------------------------------------------
def test_neox_row_order_turns_adjacent_rope_into_neox():
    from cupyattn import reference

    rng = np.random.default_rng(0)
    H, T, D = 2, 5, 8
    x = rng.standard_normal((1, H, T, D))
    pos = np.arange(T)[None, :]
    perm = hf_peer.neox_row_order(H, D).reshape(H, D) % D
    adj = reference.rope(x, pos, 1000.0, "adjacent")
    neox = reference.rope(x[..., perm[0]], pos, 1000.0, "neox")
    np.testing.assert_allclose(neox, adj[..., perm[0]], atol=1e-12)
    assert sorted(hf_peer.neox_row_order(3, 4)) == list(range(12))


# --- GPU tier (also on the CPU emulator, whose tests/emu/fakecupy is the one CuPy stand-in) ---
def _no_ceilings_on_the_emulator(monkeypatch):
    """The emulator runs kernels on the CPU: skip the GB-sized ceiling measurements there."""
    import conftest

    if conftest.EMULATE:
        monkeypatch.setattr(timing, "measure_ceilings", lambda **kw: {"copy_gbps": 1.0, "gemm_tflops": 1.0})


def _device_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


@pytest.mark.gpu
def test_bfloat16_helpers_round_to_nearest_even():
    import cupy

    from benchmarks import arrays
    from cupyattn import bfloat16

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 4, 1000),
                        [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -2.5, 0.0]]).astype(np.float32)
    got = arrays.from_f32(cupy.asarray(x), "bfloat16")
    assert got.dtype == bfloat16
    np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint16), x.astype(bfloat16).view(np.uint16))
    np.testing.assert_array_equal(cupy.asnumpy(arrays.to_f64(got)), x.astype(bfloat16).astype(np.float64))
    assert arrays.to_f32(got).dtype == np.float32
    assert arrays.from_f32(cupy.asarray(x), "float16").dtype == np.float16
    r = arrays.rand((3, 4), "bfloat16")
    assert r.shape == (3, 4) and np.all(cupy.asnumpy(arrays.to_f64(r)) != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,causal", [(5, 5, True), (3, 9, True), (9, 3, True), (7, 11, False)])
def test_naive_cupy_peer_and_chunked_reference_match_float64(sq, sk, causal):
    import cupy

    from benchmarks import cases
    from cupyattn import reference

    rng = np.random.default_rng(sq * 100 + sk)
    q = rng.standard_normal((2, 4, sq, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, sk, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, sk, 16)).astype(np.float32)
    want = reference.attention(q, k, v, causal=causal)
    qd, kd, vd = map(cupy.asarray, (q, k, v))
    got = cases.ref_attention(qd, kd, vd, causal, chunk_bytes=256)  # forces row chunks
    np.testing.assert_allclose(cupy.asnumpy(got), want, atol=1e-12)
    peer = peers.cupy_naive_attention(qd, kd, vd, causal)
    assert peer.dtype == np.float32 and not np.isnan(cupy.asnumpy(peer)).any()
    np.testing.assert_allclose(cupy.asnumpy(peer), want, atol=1e-5)
    mx, rel = cases.errors(peer, cupy.asarray(want))
    assert mx < 1e-5 and rel < 1e-5


@pytest.mark.gpu
def test_softmax_peer_and_errors():
    import cupy

    from benchmarks import cases
    from cupyattn import reference

    x = np.random.default_rng(2).standard_normal((7, 33)).astype(np.float16) * 4
    out = peers.cupy_softmax(cupy.asarray(x))
    assert out.dtype == np.float16
    want = cupy.asarray(reference.softmax(x))
    mx, rel = cases.errors(out, want)
    assert rel < 2e-3
    bad = out.copy()
    bad[0, 0] = np.nan
    assert math.isnan(cases.errors(bad, want)[1])


@pytest.mark.gpu
def test_cli_end_to_end_small_attention(tmp_path, monkeypatch, capsys):
    _no_ceilings_on_the_emulator(monkeypatch)
    out = tmp_path / "run.json"
    rc = main(["attention", "--B", "1", "--H", "4", "--Hkv", "2", "--Sq", "33", "--D", "32", "--causal",
               "--reps", "3", "--warmup", "1", "--no-progress", "--json", str(out),
               "--csv", str(tmp_path / "run.csv"), "--record", "--results-dir", str(tmp_path / "res")])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    run = report.read_json(out)
    assert run["meta"]["gpu"] == _device_name() and len(run["meta"]["kernels_sha256"]) == 64
    assert len(run["meta"]["dispatch_sha256"]) == 64
    by = {x["impl"]: x for x in run["records"]}
    for impl in ("cupy-naive", "flash", "flash_mma", "naive"):  # ours run on the device (or emulator)
        assert by[impl]["status"] == "ok", by[impl]
        assert by[impl]["rel_err"] < 1e-2 and by[impl]["median_ms"] > 0
    if "torch-sdpa" in by:
        assert by["torch-sdpa"]["status"] == "ok" and by["torch-sdpa"]["rel_err"] < 1e-2
    recorded = list((tmp_path / "res").glob("*.json"))
    assert len(recorded) == 1 and report.read_json(recorded[0])["records"] == run["records"]
    assert len(report.read_csv(tmp_path / "run.csv")) == len(run["records"])
    assert "cupy-naive" in stdout


@pytest.mark.gpu
def test_cli_gemm_softmax_sweep_small(tmp_path, monkeypatch, capsys):
    _no_ceilings_on_the_emulator(monkeypatch)
    rc = main(["gemm", "--M", "16", "--N", "24", "--K", "40", "--dtype", "float32", "--no-progress",
               "--reps", "2", "--warmup", "1", "--json", str(tmp_path / "g.json")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    by = {x["impl"]: x for x in report.read_json(tmp_path / "g.json")["records"]}
    assert by["cublas"]["status"] == "ok" and by["cublas"]["rel_err"] < 1e-5
    assert by["ours"]["status"] == "ok" and by["ours"]["rel_err"] < 1e-5
    if "torch-matmul" in by:
        assert by["torch-matmul"]["status"] == "ok" and by["torch-matmul"]["rel_err"] < 1e-5
    assert "cublas-tf32" in by  # recorded: run on a GPU, skipped (no cuBLAS switch) on the emulator
    rc = main(["softmax", "--rows", "5", "--cols", "37", "--dtype", "bfloat16", "--impl", "ours,cupy-ops",
               "--reps", "2", "--warmup", "1", "--no-progress", "--json", str(tmp_path / "s.json"),
               "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    by = {x["impl"]: x for x in report.read_json(tmp_path / "s.json")["records"]}
    assert by["cupy-ops"]["status"] == "ok" and by["cupy-ops"]["rel_err"] < 1e-2
    assert by["ours"]["status"] == "ok" and by["ours"]["rel_err"] < 1e-2
    assert "--plot: no sweep" in err


@pytest.mark.gpu
def test_cli_model_small(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _no_ceilings_on_the_emulator(monkeypatch)
    rc = main(["model", "--model", "tiny", "--new-tokens", "5", "--prompt-len", "7",
               "--model-backend", "numpy", "--hf-device", "cpu", "--model-dtype", "float32",
               "--impl", "tinylm,tinylm-fused,hf-transformers",
               "--model-reps", "1", "--no-progress", "--json", str(tmp_path / "m.json")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    by = {x["impl"]: x for x in report.read_json(tmp_path / "m.json")["records"]}
    assert by["tinylm-fused"]["status"] == "skipped: the numpy backend has no fused decode step"
    ours, hf = by["tinylm"], by["hf-transformers"]
    assert ours["status"] == "ok" and hf["status"] == "ok", (ours, hf)
    assert ours["rel_err"] < 1e-4 and ours["decode_tok_s"] > 0 and ours["ttft_ms"] > 0
    assert ours["median_ms"] == pytest.approx(1e3 / ours["decode_tok_s"])
    assert "hf-transformers" in ours["speedups"] and "/5 greedy tokens" in hf["note"]
    assert ours["peer"] == "hf-transformers" and ours["gbps"] > 0


@pytest.mark.gpu
def test_cli_model_graphs_and_eager_on_device(tmp_path, monkeypatch, capsys):
    """The model case end to end on the device (or emulator), tiny preset in float32 at batch 1
    and 2: every impl runs, agrees with the NumPy float32 logits, and the graph impls report the
    kernels of one captured decode step (unfused: embedding, first norm, 9 per layer, logits,
    sampling; fused: embedding, 5 per layer, norm + logits, sampling) and of the captured prefill."""
    import tiers

    _no_ceilings_on_the_emulator(monkeypatch)
    impls = ("tinylm", "tinylm-fused", "tinylm-eager")
    batches = (1, 2) if tiers.FULL or not EMULATE else (2,)  # both: 50 s of emulator CPU; batch 2 by default
    rc = main(["model", "--model", "tiny", "--new-tokens", "6", "--prompt-len", "5",
               "--batch", ",".join(map(str, batches)), "--model-dtype", "float32", "--impl", ",".join(impls),
               "--model-reps", "1", "--no-progress", "--json", str(tmp_path / "m.json")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    recs = report.read_json(tmp_path / "m.json")["records"]
    assert [(r["case"], r["impl"]) for r in recs] == [(f"model tiny B{b}", i) for b in batches for i in impls]
    per_step = {"tinylm": 4 + 9 * 2, "tinylm-fused": 3 + 5 * 2, "tinylm-eager": None}
    prefill = {"tinylm": 4 + 10 * 2, "tinylm-fused": 3 + 7 * 2, "tinylm-eager": None}  # tests/tinylm/test_prefill.py
    for r in recs:
        assert r["status"] == "ok" and r["rel_err"] < 1e-4 and r["decode_tok_s"] > 0 and r["gbps"] > 0, r
        assert r["launches_per_step"] == per_step[r["impl"]], r
        assert r["prefill_launches"] == prefill[r["impl"]], r
    assert "graph replays/run" in recs[0]["note"] and "batch 2" in recs[-1]["note"]


@pytest.mark.gpu
@pytest.mark.emu_slow  # about 90 s on the emulator (two warm-ups and two timed runs); the paths: tests/tinylm/test_continuous_batching.py
def test_cli_serve_small(tmp_path, monkeypatch, capsys):
    """model --serve end to end on the device (or emulator): the tiny preset in float32 over 2
    slots (4 prompts), tinylm's continuous batching with the defaults and with the opt-in paths
    (HND pages, staged page ids, the waves split rule), and HF's batched generate on the CPU when
    torch is here: tokens/s and ms per step for each, the config restored after the opt-in run."""
    from cupyattn import config

    _no_ceilings_on_the_emulator(monkeypatch)
    hf = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    impls = ["tinylm-serve", "tinylm-serve-opt-in"] + (["hf-transformers"] if hf else [])
    before = (config.PAGED_DEFAULT_LAYOUT, config.DECODE_PAGE_STAGING, config.DECODE_SPLIT_RULE)
    rc = main(["model", "--serve", "--model", "tiny", "--batch", "2", "--new-tokens", "4", "--prompt-len", "5",
               "--model-dtype", "float32", "--impl", ",".join(impls), "--model-reps", "1", "--hf-device", "cpu",
               "--no-progress", "--json", str(tmp_path / "s.json")])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert (config.PAGED_DEFAULT_LAYOUT, config.DECODE_PAGE_STAGING, config.DECODE_SPLIT_RULE) == before
    recs = report.read_json(tmp_path / "s.json")["records"]
    assert [(r["case"], r["impl"]) for r in recs] == [("model tiny serve S2", i) for i in impls]
    for r in recs:
        assert r["status"] == "ok" and r["decode_tok_s"] > 0 and r["ms_per_step"] > 0 and r["ttft_ms"] > 0, r
        assert r["median_ms"] == pytest.approx(1e3 / r["decode_tok_s"])
    assert "2 slots, 4 prompts" in recs[0]["note"] and "HND pages" in recs[1]["note"]
    if hf:
        assert "prompts' greedy tokens equal to tinylm-serve's" in recs[2]["note"]


def test_plot_of_a_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    ceil = {"gemm_tflops": 800.0, "copy_gbps": 3000.0}
    recs = []
    for c in specs.sweep_cases("attention-seqlen")[:12]:  # D64, both causal settings
        for impl, ms in (("flash", 1.0), ("cupy-naive", 3.0)):
            r = report.new_record(c, impl, "ours" if impl == "flash" else "peer")
            report.fill_timing(r, timing.Timing(ms, ms, ms, 1), specs.case_flops(c),
                               specs.case_bytes(c), ceil)
            recs.append(r)
    path = report.plot_sweep(recs, ceil, tmp_path / "p" / "attn.png", "attention-seqlen", "seq len")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # softmax sweep has no FLOPs: GB/s is plotted
    sm = []
    for c in specs.sweep_cases("softmax-cols"):
        r = report.new_record(c, "ours", "ours")
        report.fill_timing(r, timing.Timing(0.1, 0.1, 0.1, 1), None, specs.case_bytes(c), ceil)
        sm.append(r)
    assert report.plot_sweep(sm, ceil, tmp_path / "sm.png", "softmax", "cols").stat().st_size > 0


def test_sweep_axis_follows_the_bound():
    """Decode has FLOPs but is memory-bound: plotted in GB/s (the first H100 plots showed its
    TFLOP/s, a flat line at the bottom of a 767 TFLOP/s axis)."""
    ceil = {"copy_gbps": 3000.0, "gemm_tflops": 760.0}
    for sweep, want in (("decode-batch", "gbps"), ("softmax-cols", "gbps"), ("attention-seqlen", "tflops")):
        recs = []
        for c in specs.sweep_cases(sweep)[:6]:
            r = report.new_record(c, "x", "ours")
            report.fill_timing(r, timing.Timing(0.1, 0.1, 0.1, 1), specs.case_flops(c), specs.case_bytes(c), ceil)
            recs.append(r)
        assert report.sweep_axis(recs)[0] == want, (sweep, [r["bound"] for r in recs])


def test_gpu_run_script_is_valid_bash_and_runs_everything():
    script = ROOT / "benchmarks" / "gpu_run.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert 'export PYTHONPATH="$PWD' in text and "-m pytest -m gpu" in text
    assert "-m benchmarks all --record" in text and "--plot" in text
    for name in specs.SWEEPS:
        assert name in text
    assert "compute-sanitizer --tool" in text and "-m benchmarks.sanitize_cases" in text
    assert all(tool in text for tool in ("memcheck", "racecheck", "synccheck"))
    r = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": "/tmp/cupyattn-gpu-run-test"}, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr


def _gpu_run_dry(tmp_path, stage, *arg):
    """The steps gpu_run.sh STAGE would run, as (name, argv) (GPU_RUN_DRY=1: printed, not run)."""
    out = tmp_path / stage
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), stage, *arg], capture_output=True, text=True,
                       timeout=120, env={"PATH": os.environ["PATH"], "OUT": str(out), "GPU_RUN_DRY": "1",
                                         "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = (out / "dry-run.tsv").read_text().splitlines() if (out / "dry-run.tsv").exists() else []
    return [(row.split("\t")[0], row.split("\t")[1:-1]) for row in rows]


def test_gpu_run_every_benchmark_command_parses(tmp_path, capsys):
    """Every `-m benchmarks` command of every stage (settle included) passes the CLI's own checks
    (flags, their ranges, impl names): a typo there would cost a GPU session's minutes. Every test
    file a stage names exists. Each stage runs at least one step."""
    from benchmarks import cases, cli_args
    from benchmarks.__main__ import requested_impls

    stages = re.findall(r"^stage_(\w+)\(\)", (ROOT / "benchmarks" / "gpu_run.sh").read_text(), re.M)
    assert {"settle", "tests", "recheck", "lease", "record", "all", "decode_paged"} <= set(stages)
    seen = 0
    for stage in stages:
        if stage == "summary":
            continue
        steps = _gpu_run_dry(tmp_path, stage.replace("_", "-"), *(["softmax-cols"] if stage == "sweep" else []))
        assert steps, stage
        for name, argv in steps:
            if "benchmarks" in argv and argv[argv.index("benchmarks") - 1] == "-m":
                bench = argv[argv.index("benchmarks") + 1:]
                a = _parser().parse_args(bench)  # SystemExit(2) on a bad flag
                if a.op == "compare":
                    continue
                assert cli_args.check_combinations(a) is None, (stage, name, bench)
                for op in dict.fromkeys(c.op for c in plan(a)):
                    assert set(requested_impls(op, a.impl if a.op != "all" else None)) <= set(cases.impl_names(op))
                seen += 1
            for t in (x for x in argv if x.startswith("tests/")):
                assert (ROOT / t).is_file(), (stage, t)
    assert seen > 20


def test_gpu_run_settle_fits_one_call_and_times_what_issue_57_asks(tmp_path):
    """settle: one stage under 10 minutes (its budget, every step's cap cut to it); decode B1
    Hq32 Hkv8 L131072 at split counts auto/16/32/33/64 beside unsplit with --reps 50; GEMM M=1;
    the opt-in decode variants on the paged and MQA cases; then the GPU tests and sanitizers of what
    changed, or, when a header every kernel includes changed, a line that sends them to calls of
    their own (they do not fit beside the timings)."""
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    budget = int(re.search(r"SETTLE_BUDGET:-(\d+)", text).group(1))
    assert budget <= 570
    steps = dict(_gpu_run_dry(tmp_path, "settle"))
    decode = steps["settle decode B1 L128k"]
    assert "--splits" in decode and decode[decode.index("--splits") + 1] == "auto,16,32,33,64"
    assert decode[decode.index("--reps") + 1] == "50" and "unsplit" in decode[decode.index("--impl") + 1]
    gemm = steps["settle gemm M1"]
    assert gemm[gemm.index("--M") + 1] == "1" and {"ours", "ours-skinny", "cublas"} <= set(gemm[gemm.index("--impl") + 1].split(","))
    paged = steps["settle-decode-paged"]
    assert set(cases_opt_in()) <= set(paged[paged.index("--impl") + 1].split(","))
    from benchmarks import settle

    tests, _ = settle.cover(settle.changed(json.loads(settle.MANIFEST.read_text())))
    if tests is None:  # a shared header changed: the whole tier and every sanitizer take calls of their own
        assert "gpu tests" not in steps and not any(n.startswith("sanitize") for n in steps)
        assert "run 'gpu_run.sh tests'" in (tmp_path / "settle" / "steps.log").read_text()
    else:
        assert steps["gpu tests"][:5] == [sys.executable, "-m", "pytest", "-m", "gpu"]
        assert set(tests) <= set(steps["gpu tests"])


def test_gpu_run_decide_fits_one_call_of_a_device_session_in_priority_order(tmp_path):
    """decide: one call of a 15-minute device session (its budget, the caps of its steps cut to
    it), the megakernel's GPU tests before its timings, its A/B and batch 1/8 run, then settle's
    re-timed outliers, then the opt-in decode variants; no step that does not fit (HF compiled,
    sanitizers, the whole GPU tier)."""
    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    budget = int(re.search(r"DECIDE_BUDGET:-(\d+)", text).group(1))
    assert budget <= 570
    names = [name for name, _ in _gpu_run_dry(tmp_path, "decide")]
    assert names == ["megakernel gpu tests", "mega knobs A/B", "mega vs fused and HF", "settle decode B1 L128k",
                     "settle gemm M1", "decide-decode-paged"]
    # the same commands as the stages they come from ($OUT aside)
    def steps(stage):
        return {n: [a.replace(str(tmp_path / stage), "$OUT") for a in argv] for n, argv in _gpu_run_dry(tmp_path, stage)}

    mega, settle, decide = steps("mega"), steps("settle"), steps("decide")
    for name, argv in decide.items():
        if name in mega:
            assert argv == mega[name], name
        elif name.startswith("settle "):
            assert argv == settle[name], name
    paged = decide["decide-decode-paged"]
    assert set(cases_opt_in()) <= set(paged[paged.index("--impl") + 1].split(","))
    body = re.search(r"stage_decide\(\) \{.*?\n\}", text, re.S).group(0)
    assert "run_mega\n" in body and "run_mega full" not in body


def cases_opt_in():
    from benchmarks import cases

    return cases.OPT_IN["decode"]


def test_gpu_run_paged_stage_names_real_impls():
    """The paged stage measures every paged variant and both split rules beside the
    contiguous kernel and SDPA, and the serve stage the continuous-batching impls beside HF."""
    import re

    from benchmarks import cases

    text = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    impls = re.search(r'DECODE_PAGED_IMPLS="(.*?)"', text, re.S).group(1).replace("\\\n", "").split(",")
    assert set(impls) <= set(cases.impl_names("decode")) and set(cases.OPT_IN["decode"]) <= set(impls)
    assert {"split-kv", "torch-sdpa", "paged-1", "paged-16", "paged-256"} <= set(impls)
    serve = re.search(r"run_serve\(\) \{.*?\n\}", text, re.S).group(0)
    assert "--serve" in serve and "--batch 8,32,64" in serve
    assert set(re.search(r"--impl (\S+)", serve).group(1).split(",")) <= set(cases.impl_names("model"))


def test_gpu_run_kills_a_step_as_a_process_group_and_says_so(tmp_path):
    """A step past its cap is killed with everything it started (a child that ignores SIGTERM
    and a grandchild included: SIGKILL after KILL_GRACE), the next step starts after, and the
    summary says which step was killed at its cap."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nif [ "$2" = pytest ]; then trap "" TERM; sleep 120 & echo $! >> "$OUT/kids"; '
                    'sleep 120; fi\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "tests"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": str(fake),
                                        "STEP_TIMEOUT": "1", "MEGA_TIMEOUT": "1", "KILL_GRACE": "1"})
    assert time.monotonic() - t0 < 30 and r.returncode == 1
    kids = [int(x) for x in (out / "kids").read_text().split()]
    assert len(kids) == 2  # one per step: the second started after the first was gone
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    summary = (out / "results" / "summary.txt").read_text()
    assert "=== gpu tests: exit 124 after" in summary and "(killed at its cap of 1 s)" in summary
    assert "=== megakernel gpu tests: exit 124" in summary


def test_gpu_run_step_timeout_stops_a_step_and_keeps_going(tmp_path):
    """STEP_TIMEOUT ends a step that would outrun a capped device call; the script goes on and
    reports the failure in steps.log and its exit status."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nif [ "$2" = pytest ]; then sleep 30; fi\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "tests"], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(out),
                                                   "PYTHON": str(fake), "STEP_TIMEOUT": "1"})
    assert time.monotonic() - t0 < 25
    assert r.returncode == 1
    assert "=== gpu tests: exit 124 after" in (out / "steps.log").read_text()


def test_gpu_run_keeps_the_logs_summary_lines_beside_the_results(tmp_path):
    """gpu_run.sh's summary (run at the end of every stage, and alone without a GPU) copies
    pytest's and compute-sanitizer's own summary lines and the step exit codes into
    results/summary.txt."""
    (tmp_path / "pytest-gpu.log").write_text("....F.\n1 failed, 1284 passed, 2 skipped in 96.01s\n")
    (tmp_path / "sanitize-memcheck.log").write_text("ok\n========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "sanitize-racecheck.log").write_text(
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    (tmp_path / "steps.log").write_text("=== gpu tests: pytest\n=== gpu tests: exit 1 after 96 s (log: x)\n")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "summary"], capture_output=True, text=True,
                       env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "CUPYATTN_GIT_COMMIT": "abc123"},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "results" / "summary.txt").read_text()
    assert "commit: abc123" in text
    assert "pytest-gpu.log: 1 failed, 1284 passed, 2 skipped in 96.01s" in text
    assert "sanitize-memcheck.log: ERROR SUMMARY: 0 errors" in text
    assert "sanitize-racecheck.log: RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" in text
    assert "=== gpu tests: exit 1 after 96 s" in text
    (tmp_path / "compare-bench.txt").write_text("new: x\nflags: 1 of 3 timed records\n  FLAG decode / split-kv: slower\n")
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "summary"], capture_output=True, text=True,
                   env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "CUPYATTN_GIT_COMMIT": "abc123"}, timeout=60)
    lines = (tmp_path / "results" / "summary.txt").read_text().splitlines()
    assert lines[2].startswith("compare flags") and lines[3] == "  FLAG decode / split-kv: slower"


def test_tune_times_candidates_interleaved(monkeypatch):
    """benchmarks.tune times a case's candidates in rounds with a rotated start (no candidate is
    always timed first) and reports the median of each candidate's rounds."""
    from benchmarks import tune

    order, fake = [], {"a": [5.0, 1.0, 3.0], "b": [2.0, 2.0, 8.0], "c": [1.0, 1.0, 1.0]}
    monkeypatch.setattr(tune, "_ms", lambda fn, reps=30: fn())

    def cand(name):
        def fn():
            order.append(name)
            return fake[name].pop(0)
        return fn

    def broken():
        raise RuntimeError("too many resources requested for launch\nmore")

    rows = []
    tune.timed_interleaved([({"impl": n}, cand(n)) for n in "abc"] + [({"impl": "x"}, broken)], rows.append,
                           derive=lambda row: row.update(double=2 * row["ms"]))
    assert tune.ROUNDS == 3
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [r["impl"] for r in rows] == ["a", "b", "c", "x"]
    assert [r["ms"] for r in rows[:3]] == [3.0, 2.0, 1.0] and rows[0]["ms_rounds"] == [5.0, 1.0, 3.0]
    assert rows[1]["double"] == 4.0
    assert rows[3]["error"] == "RuntimeError: too many resources requested for launch" and "ms" not in rows[3]


def test_tune_cli_parses_before_it_needs_a_device():
    """The first GPU call of benchmarks.tune died in argparse (a default list with choices);
    parsing is checked here, where no device time is spent."""
    from benchmarks import tune

    assert tune.parse_args([]).parts == ["softmax", "flash", "decode", "gemm", "attention-wgmma"]
    assert tune.parse_args(["decode", "--json", "x.json"]).parts == ["decode"]
    with pytest.raises(SystemExit) as e:
        tune.parse_args(["nosuch"])
    assert e.value.code == 2


def test_sanitize_cases_cli_checks_its_options():
    from benchmarks import sanitize_cases

    with pytest.raises(SystemExit) as e:
        sanitize_cases.main(["--only", "attention,nosuch"])
    assert e.value.code == 2


# --- GPU tier: the CLI end to end on small cases (also runs under CUPYATTN_EMULATE=1) ----------
@pytest.mark.gpu
@pytest.mark.parametrize("argv", [
    ["gemm", "--M", "64", "--N", "48", "--K", "40"],
    ["softmax", "--rows", "17", "--cols", "300"],
    # minutes each on the CPU emulator: GPU only
    pytest.param(["attention", "--B", "1", "--H", "4", "--Hkv", "2", "--Sq", "97", "--D", "64",
                  "--causal"], marks=pytest.mark.no_emu),
    pytest.param(["decode", "--B", "2", "--H", "8", "--Hkv", "2", "--Sk", "1000", "--D", "64"],
                 marks=pytest.mark.no_emu),
], ids=lambda a: a[0])
def test_cli_smoke_on_device(argv, tmp_path, monkeypatch):
    _no_ceilings_on_the_emulator(monkeypatch)
    out = tmp_path / "run.json"
    assert main(argv + ["--reps", "3", "--warmup", "1", "--no-progress", "--json", str(out)]) == 0
    recs = report.read_json(out)["records"]
    assert {r["kind"] for r in recs} == {"ours", "peer"}
    tol = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
    for r in recs:
        if r["status"] == "ok":  # whatever ran must be right and timed
            assert r["median_ms"] > 0 and r["rel_err"] <= tol[r["dtype"]], r
        if r["kind"] == "peer":
            assert r["status"] == "ok" or r["status"].startswith("skipped"), r
