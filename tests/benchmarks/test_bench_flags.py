"""CPU tier: every flag of the benchmark CLI is checked at parse time, before any device.

A bad value is one line on stderr naming the flag, exit status 2, whether or not the machine has a
GPU (the parse runs before the device is touched). 0 and "" are values, never "use the default".
"""
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import specs
from benchmarks.__main__ import _parser, main, plan

ROOT = Path(__file__).resolve().parents[2]

# (argv, the flag the message must name): one bad value per flag and kind (type, range, 0, empty)
BAD = [
    (["attention", "--reps", "0"], "--reps"), (["attention", "--reps", "x"], "--reps"),
    (["attention", "--warmup", "-1"], "--warmup"), (["attention", "--budget-ms", "0"], "--budget-ms"),
    (["attention", "--budget-ms", "nan"], "--budget-ms"), (["attention", "--budget-ms", "inf"], "--budget-ms"),
    (["attention", "--seed", "-1"], "--seed"), (["attention", "--seed", str(2**32)], "--seed"),
    (["attention", "--dtype", "float64"], "--dtype"), (["attention", "--impl", ""], "--impl"),
    (["attention", "--impl", "flash,"], "--impl"), (["attention", "--impl", "nope"], "--impl"),
    (["attention", "--json", ""], "--json"), (["attention", "--csv", " "], "--csv"), (["attention", "--plot", ""], "--plot"),
    *([[op, f"--{k}", v], f"--{k}"] for op, keys in (("attention", "B H Hkv Sq Sk D"), ("decode", "B H Hkv Sk D"),
                                                      ("varlen", "B H Hkv D lo hi"), ("paged", "B H Hkv Sq Sk D"),
                                                      ("gemm", "M N K"), ("softmax", "rows cols"))
      for k in keys.split() for v in ("0", "-3", "2.5")),
    (["attention", "--B", str(2**31)], "--B"),
    (["attention", "--H", "8", "--Hkv", "3"], "--Hkv"), (["attention", "--H", "4", "--Hkv", "8"], "--Hkv"),
    (["decode", "--Hkv", "5"], "--Hkv"),
    (["gemm", "--layout", "tn"], "--layout"), (["attention", "--sweep", "decode-len"], "--sweep"),
    (["attention", "--sweep", "attention-seqlen", "--B", "2"], "--B"),
    (["decode", "--sweep", "decode-len", "--splits", "8"], "--splits"),
    (["decode", "--splits", "0"], "--splits"), (["decode", "--splits", "513"], "--splits"),
    (["decode", "--splits", "-1"], "--splits"), (["decode", "--splits", "8,,16"], "--splits"),
    (["decode", "--splits", "auto,x"], "--splits"),
    (["decode", "--ragged", "-1"], "--ragged"), (["decode", "--ragged", "x"], "--ragged"),
    (["decode", "--Sq", "4"], "--Sq"), (["decode", "--causal"], "--causal"),
    (["paged", "--page", "0"], "--page"), (["paged", "--page", "3"], "--page"), (["paged", "--page", "512"], "--page"),
    (["paged", "--Sq", "100", "--Sk", "50"], "--Sk"),
    (["varlen", "--lo", "20", "--hi", "5"], "--hi"), (["varlen", "--seed-lens", "-2"], "--seed-lens"),
    (["model", "--model", "nope"], "--model"), (["model", "--model", "tiny,"], "--model"),
    (["model", "--model", "missing.gguf"], "--model"), (["model", "--preset", "nope"], "--preset"),
    (["model", "--model-reps", "0"], "--model-reps"), (["model", "--prompt-len", "0"], "--prompt-len"),
    (["model", "--new-tokens", "1"], "--new-tokens"), (["model", "--batch", "0"], "--batch"),
    (["model", "--batch", "1,,8"], "--batch"), (["model", "--batch", "x"], "--batch"),
    (["model", "--model-dtype", "int8"], "--model-dtype"), (["model", "--dtype", "float32"], "--dtype"),
    (["all", "--impl", "flash"], "--impl"), (["all", "--reps", "0"], "--reps"),
    (["compare", ""], "NEW.json"),
]


@pytest.mark.parametrize("argv, flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_one_line_naming_it_and_exit_2(argv, flag, capsys):
    """In process: the parse (and the two-flag checks) end the command before the device check."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], err
    assert "Traceback" not in err


def test_bad_flags_exit_2_in_a_fresh_process():
    """As a user runs it (no GPU here, or one: the parse comes first either way)."""
    for argv in (["decode", "--splits", "0"], ["paged", "--page", "3"], ["varlen", "--lo", "20", "--hi", "5"]):
        r = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 2 and len(lines) == 1 and argv[1] in lines[0], r.stderr
        assert r.stdout == ""


def _one(*argv):
    (case,) = plan(_parser().parse_args(list(argv)))
    return case


def test_zero_is_a_value_not_the_default():
    """0 is a seed (--ragged, --seed-lens), and --warmup 0 means none; a flag not given takes the
    default, whatever the other flags hold."""
    rag0 = _one("decode", "--B", "4", "--Sk", "1000", "--ragged", "0")
    assert rag0.p["ragged"] == 0 and rag0.shape.endswith("ragged0")
    assert specs.decode_lengths(rag0.p) != [1000] * 4 and max(specs.decode_lengths(rag0.p)) == 1000
    plain = _one("decode", "--B", "4", "--Sk", "1000")
    assert "ragged" not in plain.p and specs.decode_lengths(plain.p) == [1000] * 4
    assert _one("varlen", "--seed-lens", "0").p["seed"] == 0
    assert _one("varlen", "--seed-lens", "5").p["seed"] == 5
    assert _parser().parse_args(["attention", "--warmup", "0"]).warmup == 0


def test_defaults_move_to_meet_a_given_bound():
    """A default that would break a rule together with a given flag gives way to it (no silent
    raise of a given value, no error for a flag the user did not give)."""
    v = _one("varlen", "--hi", "32")
    assert (v.p["lo"], v.p["hi"]) == (32, 32)
    v = _one("varlen", "--lo", "5000")
    assert (v.p["lo"], v.p["hi"]) == (5000, 5000)
    p = _one("paged", "--Sk", "512")
    assert (p.p["Sq"], p.p["L"]) == (512, 512)
    p = _one("paged", "--Sq", "8192")
    assert (p.p["Sq"], p.p["L"]) == (8192, 8192)
    assert _one("paged", "--page", "1").p["page"] == 1 and _one("paged", "--page", "256").p["page"] == 256


def test_split_counts_make_one_case_each():
    cases = plan(_parser().parse_args(["decode", "--Sk", "4096", "--splits", "auto,1,512"]))
    assert [c.p.get("splits") for c in cases] == [None, 1, 512]


def test_no_value_or_default_idiom_in_benchmarks():
    """`x or default` reads 0 and "" as "not given": the CLI's values are None-checked instead."""
    import re

    bad = []
    for f in sorted((ROOT / "benchmarks").glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\b(a|args|opts|p)\.(get\(\"\w+\"\)|\w+) or (\"|'|\d|\[|\{|list\(|max\(|min\()", line):
                bad.append(f"{f.name}:{i}: {line.strip()}")
    assert bad == []
