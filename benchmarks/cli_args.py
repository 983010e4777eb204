"""Flag types of the benchmark CLI: every value is checked at parse time, before any device.

A bad value ends the command with one line naming the flag and what it takes, exit status 2,
the same with or without a GPU (argparse's ``type=`` functions raise
``argparse.ArgumentTypeError``; :class:`OneLineParser` prints that one line, not the usage). The
checks that involve two flags (``--hi`` against ``--lo``, heads against KV heads) are
:func:`check_combinations`'s, run right after parsing.

None means "not given" everywhere: a default is chosen only for a flag that was not given, never
because a value is 0 or empty (0 is a seed, an empty path is an error).
"""
from __future__ import annotations

import argparse
import sys

MAX_DIM = 2**31 - 1  # sizes the kernels take as int32
MAX_SEED = 2**32 - 1  # NumPy's and CuPy's seeds


class OneLineParser(argparse.ArgumentParser):
    """argparse with one error line: ``<prog>: error: argument --flag: <what it takes>``, exit 2
    (argparse prints the whole usage first, which buries the line that matters)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_in(lo: int, hi: int = MAX_DIM, what: str = ""):
    """An argparse type: an integer in [lo, hi] (``what`` names the range in the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            rng = what or (f"at least {lo}" if hi == MAX_DIM else f"from {lo} to {hi}")
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


positive = int_in(1)
nonneg = int_in(0)
seed = int_in(0, MAX_SEED)


def power_of_two(lo: int, hi: int):
    """An argparse type: a power of two in [lo, hi] (a page size)."""
    base = int_in(lo, hi)

    def parse(text: str) -> int:
        value = base(text)
        if value & (value - 1):
            raise argparse.ArgumentTypeError(f"expected a power of two from {lo} to {hi}, got {value}")
        return value
    parse.__name__ = "power of two"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite float above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


def path(text: str) -> str:
    """An argparse type: a non-empty path."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def int_list(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas (``--batch 1,8``)."""
    try:
        out = [int(x, 10) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or max(out) > MAX_DIM:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def name_list(text: str) -> list[str]:
    """An argparse type: names separated by commas, none empty (``--impl a,b``)."""
    out = [x.strip() for x in text.split(",")]
    if not out or "" in out:
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return out


def split_counts(hi: int):
    """An argparse type: split counts in [1, hi] or ``auto`` (the automatic choice), separated by
    commas (``--splits auto,16,33``); ``auto`` becomes None."""
    one = int_in(1, hi)

    def parse(text: str) -> list:
        items = name_list(text)
        return [None if x == "auto" else one(x) for x in items]
    parse.__name__ = "split counts"
    return parse


def preset(text: str) -> str:
    """An argparse type: a tinylm preset name."""
    from tinylm.config import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"expected a tinylm preset ({', '.join(PRESETS)}), got {text!r}")
    return text


def model_list(text: str) -> list[str]:
    """An argparse type: models separated by commas, each 'smollm2', a tinylm preset, 'families' (each
    family's preset, tinylm.config.FAMILY_PRESETS) or an existing GGUF file (benchmarks.model_bench.
    load_model's three kinds)."""
    import os

    from tinylm.config import FAMILY_PRESETS, PRESETS

    names = [n for m in name_list(text) for n in (FAMILY_PRESETS if m == "families" else [m])]
    for n in names:
        if n == "smollm2" or n in PRESETS:
            continue
        if not n.endswith(".gguf"):
            raise argparse.ArgumentTypeError(f"expected smollm2, families, a tinylm preset ({', '.join(PRESETS)}) or a "
                                             f".gguf file, got {n!r}")
        if not os.path.isfile(n):
            raise argparse.ArgumentTypeError(f"no GGUF file at {n!r}")
    return names


def given(a, key) -> bool:
    """Whether flag ``key`` was given (a store_true flag: set)."""
    v = getattr(a, key, None)
    return v is not None and v is not False  # (identity: 0 == False, and 0 is a value)


def check_combinations(a) -> str | None:
    """The first rule two flags break together, as ``argument --flag: ...``; None when all hold.
    Pure: run before the device is touched."""
    from .specs import SHAPE_FLAGS  # (a --sweep brings its own shapes: these are refused beside it)

    op = a.op
    if getattr(a, "sweep", None):
        extra = [k for k in SHAPE_FLAGS.get(op, ()) if given(a, k)]
        if extra:
            return f"argument --{extra[0].replace('_', '-')}: --sweep {a.sweep} brings its own shapes"
    if op == "model" and a.dtype:
        return "argument --dtype: the model cases take --model-dtype"
    h, hkv = getattr(a, "H", None), getattr(a, "Hkv", None)
    if hkv is not None and hkv > (h if h is not None else 16):  # 16: specs.cli_case's default H
        return f"argument --Hkv: {hkv} KV heads for {h if h is not None else 16} query heads (--H): expected at most --H"
    if hkv is not None and (h if h is not None else 16) % hkv:
        return f"argument --Hkv: --H {h if h is not None else 16} is not a multiple of --Hkv {hkv}"
    if op == "varlen" and a.lo is not None and a.hi is not None and a.hi < a.lo:
        return f"argument --hi: {a.hi} is below --lo {a.lo}"
    if op == "paged" and a.Sk is not None and a.Sq is not None and a.Sk < a.Sq:
        return f"argument --Sk: {a.Sk} cached keys cannot hold the {a.Sq} new ones (--Sq)"
    if op == "all" and getattr(a, "impl", None):
        return "argument --impl: `all` runs every impl of every op; name impls on one op's command"
    return None


def fail(prog: str, message: str) -> int:
    """Print ``<prog>: error: <message>`` (one line) and return exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
