"""Which options each attention and decode path implements, and which kernel ``impl=None`` runs
for every entry point: two tables, each read by the dispatch, the docs and the tests.

- The dispatch: ``impl=None`` (attention) never picks a path that lacks an option the call uses
  (:func:`supports`), and an explicit ``impl=`` that lacks it raises a ValueError naming the
  option before anything is allocated or launched (:func:`check`).
- The documentation: ``docs/options.md`` is :func:`markdown`'s output (``python -m cupyattn
  options > docs/options.md``; tests/cupyattn/test_options_matrix.py fails when it is stale).
- The tests: tests/cupyattn/test_options_matrix.py runs every entry point x impl x option (alone and in
  pairs) on the emulated families and either compares with the float64 reference or expects the
  refusal this table states, so a path that silently ignores an option fails there.

``DEFAULTS`` is the other table: per entry point an ordered list of (impl, conditions); impl=None
(``"auto"`` too, where an entry point takes it) runs the first impl whose conditions all hold for
the call (:func:`choose`). Each condition carries its prose, so the docs' "how impl=None chooses"
lines are generated from the rows the dispatch reads (:func:`defaults_text`), and
tests/cupyattn/test_dispatch.py compares them with what each entry point launches on every emulated family.

Options are of two kinds: call arguments (``causal``, ``window``, ...; the dispatch sees them)
and input layouts (``gqa``, ``broadcast``, ``strided``, ``negative_stride``; the paths' own
checks see them, e.g. TMA's rules for ``wgmma``). An option an entry point does not take at all
is absent from its ``ENTRY_OPTIONS`` row. Turning a refusal into support is deleting its line
in ``REFUSED`` once the kernel implements it: the matrix test then compares instead of expecting
the refusal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import config as C

# option -> what it means (the docs' legend)
OPTIONS = {
    "causal": "`causal=True` (bottom-right aligned when Sq != Sk)",
    "window": "`window=(left, right)`, a sliding window",
    "softcap": "`softcap=c`: scores `c * tanh(s / c)` (Gemma 2)",
    "mask": "`mask=`, an additive float mask (or a bool one, True: the key takes part) broadcast to [B, Hq, Sq, Sk]",
    "key_lengths": "`key_lengths=`, keys per batch entry",
    "scale": "`scale=` other than 1/sqrt(D)",
    "gqa": "GQA / MQA: fewer K/V heads than query heads",
    "broadcast": "broadcast views: a stride of 0 on a dimension of more than one entry",
    "strided": "strided views: any strides but a contiguous last dimension",
    "negative_stride": "reversed views: a negative stride",
    "return_lse": "`return_lse=True`: the row log-sum-exp too",
    "out": "`out=`: the caller's output buffer",
    "packed_q": "`cu_seqlens_q=`: packed queries of different lengths",
    "device_lengths": "offsets / lengths as CuPy arrays (used unchecked, graph-safe)",
    "num_splits": "`num_splits=`: split-KV",
    "workspace": "`workspace=`: the caller's split-KV partials",
    "fused_combine": "`fused_combine=True`: the splits merged inside the decode kernel",
    "split_rule": "`split_rule=\"waves\"`: FlashAttention-3's wave-efficiency split count, chunks per sequence "
                  "(opt-in; where it has run: docs/ran-where.md)",
    "hnd_pages": "`layout=\"HND\"`: pages [num_pages, Hkv, page_size, D] (FlashInfer's; PagedKVCache(layout=)); "
                 "opt-in (where it has run: docs/ran-where.md)",
}

# option -> how the caller writes it (what a refusal names); "<option>=" where not listed
ARGUMENTS = {
    "hnd_pages": "layout='HND'",
    "packed_q": "cu_seqlens_q=",
    "device_lengths": "device offsets / lengths",
    "gqa": "k/v with fewer heads than q",
    "broadcast": "a broadcast view",
    "strided": "a strided view",
    "negative_stride": "a reversed view",
}


def argument(option: str) -> str:
    """How the caller writes ``option`` (``window=``, ``layout='HND'``): what a refusal names."""
    return ARGUMENTS.get(option, f"{option}=")


# entry point -> (the impls an explicit impl= names, the options it takes)
_ATTN = ("causal", "window", "softcap", "scale", "gqa", "broadcast", "strided", "negative_stride")
_DECODE = ("window", "softcap", "scale", "gqa", "broadcast", "strided", "negative_stride", "out", "num_splits",
           "workspace")
ENTRY_IMPLS = {
    "attention": ("flash", "flash_mma", "naive", "wgmma", "wgmma_persistent"),
    "attention_varlen": ("flash", "flash_mma", "wgmma_persistent"),
    "attention_paged": ("flash", "flash_mma", "wgmma_persistent"),
    "decode_attention": ("simt", "mma"),
    "decode_attention_paged": ("simt", "mma"),
}
ENTRY_OPTIONS = {
    "attention": _ATTN + ("mask", "key_lengths", "return_lse", "out"),
    "attention_varlen": _ATTN + ("return_lse", "out", "device_lengths"),
    "attention_paged": _ATTN + ("packed_q", "return_lse", "out", "device_lengths", "hnd_pages"),
    "decode_attention": _DECODE + ("fused_combine", "split_rule"),
    "decode_attention_paged": _DECODE + ("device_lengths", "fused_combine", "split_rule", "hnd_pages"),
}
# (entry point, impl) -> {option: why it is refused}. Every other option of ENTRY_OPTIONS[entry]
# is implemented by that impl. Call options here raise ValueError from :func:`check`; layouts
# are refused by the path's own checks (their messages name the operand and the stride).
V3_LACKS = "not in kernels_cu/flash_attn_sm90.cu (v3); impl='wgmma_persistent' implements it"
TMA_REFUSES_PAGED = {  # the Hopper kernels read q, k, v through TMA tensor maps
    "broadcast": "TMA cannot describe a stride of 0 (a ValueError names the operand and the stride)",
    "negative_stride": "TMA cannot describe a negative stride (a ValueError names the operand and the stride)",
}
# dense and packed inputs at a head dim the kernel lacks are read through zero-padded copies
PADDED = "; at a head dim it has no kernel for, it reads zero-padded contiguous copies, and runs"
TMA_REFUSES = {o: why + PADDED for o, why in TMA_REFUSES_PAGED.items()}
REFUSED = {
    ("attention", "naive"): {
        "window": "the split pipeline (gemm_nt, softmax, gemm_nn) has no window",
        "softcap": "the split pipeline (gemm_nt, softmax, gemm_nn) has no softcap",
    },
    ("attention", "wgmma"): {"window": V3_LACKS, "softcap": V3_LACKS, **TMA_REFUSES},
    ("attention", "wgmma_persistent"): TMA_REFUSES,
    ("attention_varlen", "wgmma_persistent"): TMA_REFUSES,
    ("attention_paged", "wgmma_persistent"): {
        **TMA_REFUSES_PAGED,
        "hnd_pages": "its TMA maps read NHD pages [num_pages, page_size, Hkv, D]; impl=None serves HND",
    },
}
# (entry point, impl, option) -> a condition on an implemented option (the docs' footnotes)
TMA_STRIDES = "strides and base 16-byte multiples (TMA), else a ValueError naming the operand"
CONDITIONS = {
    ("attention", "wgmma", "strided"): TMA_STRIDES + "; impl=None then takes flash_mma",
    ("attention", "wgmma_persistent", "strided"): TMA_STRIDES,
    ("attention_varlen", "wgmma_persistent", "strided"): TMA_STRIDES,
    ("attention_paged", "wgmma_persistent", "strided"): TMA_STRIDES,
    ("attention", "flash_mma", "strided"): "views not 16-byte aligned take a slower element-wise staging path",
    ("attention", "naive", "strided"): "non-contiguous k, v are copied first",
}
# entry point -> which inputs the layouts (broadcast, strided, negative_stride) apply to, where not all
LAYOUT_INPUTS = {
    "attention_paged": "q only: k_pages and v_pages must be C-contiguous",
    "decode_attention": "q only: the cache's arrays are its own",
    "decode_attention_paged": "q only: k_pages and v_pages must be C-contiguous",
}
LAYOUTS = ("gqa", "broadcast", "strided", "negative_stride")
# (entry point, impl) -> what else the docs say of the path (conditions on no single option)
PATH_NOTES = {
    ("attention_paged", "wgmma_persistent"): "pages of at least config.ATTN_WGMMA_MIN_PAGE (8) tokens, else a "
                                             "ValueError naming page_size",
}


def refused(entry: str, impl: str, option: str) -> str | None:
    """Why ``impl`` of ``entry`` refuses ``option``, or None when it implements it."""
    return REFUSED.get((entry, impl), {}).get(option)


def supports(entry: str, impl: str, used) -> bool:
    """Whether ``impl`` of ``entry`` implements every option in ``used``."""
    return not any(refused(entry, impl, o) for o in used)


def implementing(entry: str, option: str) -> tuple[str, ...]:
    """The impls of ``entry`` that implement ``option`` (in ENTRY_IMPLS' order)."""
    return tuple(i for i in ENTRY_IMPLS[entry] if not refused(entry, i, option))


def check(fn: str, entry: str, impl: str, used) -> None:
    """ValueError naming ``fn``, ``impl``, the argument of the first option of ``used`` it does not
    implement and the impls of ``entry`` that do (before anything is allocated or launched)."""
    for option in used:
        why = refused(entry, impl, option)
        if why:
            others = ", ".join(f"impl={i!r}" for i in implementing(entry, option))
            raise ValueError(f"{fn}(): impl={impl!r} does not implement {argument(option)} ({why}); "
                             f"{others} or impl=None (which picks one that does) implement it")


def cell(entry: str, impl: str, option: str) -> str:
    """The docs' cell: 'yes', 'yes*' (a condition, in the footnotes), 'no' or '' (not taken)."""
    if option not in ENTRY_OPTIONS[entry]:
        return ""
    if refused(entry, impl, option):
        return "no"
    return "yes*" if (entry, impl, option) in CONDITIONS else "yes"


def markdown() -> str:
    """docs/options.md: one table per entry point (impls x options), the refusals and conditions
    with their reasons, and how impl=None / "auto" chooses."""
    lines = ["# Options by kernel path", "",
             "Generated by `python -m cupyattn options` from `cupyattn/options.py`, the table the dispatch",
             "reads (do not edit by hand; tests/cupyattn/test_options_matrix.py checks it is current and runs",
             "every cell on the emulated GPU families). `yes`: implemented and tested against the float64",
             "reference; `no`: refused with a ValueError naming the option (impl=None never picks such a",
             "path); `yes*`: implemented with a condition (below); empty: the entry point has no such",
             "option.", ""]
    for entry, impls in ENTRY_IMPLS.items():
        opts = ENTRY_OPTIONS[entry]
        lines += [f"## `{entry}`", "", "| impl | " + " | ".join(opts) + " |",
                  "|---|" + "---|" * len(opts)]
        lines += [f"| `{impl}` | " + " | ".join(cell(entry, impl, o) for o in opts) + " |" for impl in impls]
        notes = [f"- `{impl}`, {o}: no: {why}" for impl in impls for o, why in REFUSED.get((entry, impl), {}).items()]
        notes += [f"- `{impl}`, {o}: {why}" for (e, impl, o), why in CONDITIONS.items() if e == entry]
        notes += [f"- `{impl}`: {why}" for (e, impl), why in PATH_NOTES.items() if e == entry]
        notes += [f"- broadcast, strided, negative_stride: {LAYOUT_INPUTS[entry]}"] if entry in LAYOUT_INPUTS else []
        lines += [""] + notes + ([""] if notes else []) + [defaults_text(entry), ""]
    lines += ["## impl=None of the other entry points", ""]
    lines += [f"- `{e}`: {defaults_text(e)}" for e in DEFAULTS if e not in ENTRY_IMPLS] + [""]
    lines += ["## Options", ""] + [f"- **{o}**: {what}" for o, what in OPTIONS.items()] + [""]
    return "\n".join(lines)



# --- impl=None: which kernel each entry point runs ---------------------------------------------
@dataclass
class Call:
    """What a default rule may ask of one call. ``cc`` / ``smem`` None: a device with every
    instruction and no shared-memory limit. ``problem(impl)``: why TMA cannot read this call's
    operands for ``impl`` (None: it can); absent, no rule that needs the operands applies.
    ``fits(impl)``: whether ``impl`` has a tile within the device's shared memory per block (decode
    plans it); absent: yes."""
    entry: str
    dtype: object
    head_dim: int = 0               # D as the caller has it (rmsnorm: the row length); kernel_dim pads it
    cc: int | None = None           # compute capability (CUPYATTN_ARCH applied)
    smem: int | None = None         # opt-in shared memory per block
    used: tuple = ()                # the call options (OPTIONS keys) it uses
    causal: bool = False
    launches: bool = True           # False: nothing is launched (an empty input)
    page_size: int = 0
    group: int = 1                  # query heads per kv head
    m: int = 0                      # GEMM sizes (M after folding a shared-weight batch)
    n: int = 0
    k: int = 0
    problem: Callable[[str], str | None] | None = None
    fits: Callable[[str], bool] | None = None


@dataclass(frozen=True)
class If:
    """One condition of a default rule: how the docs say it (a string, or a function of nothing that
    writes it from config's current values), and whether it holds for (call, impl)."""
    said: object
    holds: Callable[[Call, str], bool]

    @property
    def text(self) -> str:
        return self.said() if callable(self.said) else self.said


def _pairs(pairs) -> str:
    """(dtype, D) pairs as prose: 'float16 at D = 64, 128; bfloat16 at D = 128'."""
    by = {}
    for dt, d in pairs:
        by.setdefault(str(np.dtype(dt)), []).append(str(d))
    return "; ".join(f"{dt} at D = {', '.join(ds)}" for dt, ds in by.items())


def kernel_dim(c: Call) -> int:
    """The head dim the fused kernels run ``c`` at: D, or for an attention() / attention_varlen() call
    at another D the next of config.HEAD_DIMS (config.padded_head_dim; q, k, v zero-padded); D
    itself past the largest (the other entry points take HEAD_DIMS only, so D)."""
    return C.padded_head_dim(c.head_dim) or c.head_dim


def _auto_pairs(name: str, pairs: Callable, tiles: Callable) -> If:
    """(dtype, D) in the config table ``name`` (``pairs()``: its value now, so a change to config is
    what the dispatch and the docs read) and D in its kernel's tile table (``tiles()``); D padded as
    the kernels run it (:func:`kernel_dim`)."""
    return If(lambda: f"(dtype, D) is in config.{name} ({_pairs(pairs())})",
              lambda c, i: (np.dtype(c.dtype), kernel_dim(c)) in pairs() and kernel_dim(c) in tiles())


def _runs(op: str, at_d: bool = False) -> If:
    return If("the device runs it" + (" at D" if at_d else "") + " (config.IMPL_MIN_CC)",
              lambda c, i: c.cc is None or C.impl_runs_on(op, i, c.dtype, c.cc, kernel_dim(c) if at_d else None))


def _persistent(entry: str) -> If:
    return _auto_pairs(f"ATTN_AUTO_PERSISTENT[{entry!r}]", lambda: C.ATTN_AUTO_PERSISTENT.get(entry, ()),
                       lambda: C.ATTN_WGMMA_PERSISTENT_TILES)


CAUSAL = If("the call is causal", lambda c, i: c.causal)
LAUNCHES = If("there is something to compute", lambda c, i: c.launches)
IMPLEMENTS = If("it implements every option of the call",
                lambda c, i: supports(c.entry, i, c.used))
TMA = If("TMA can read the operands", lambda c, i: c.problem is not None and c.problem(i) is None)
MMA_DTYPE = If("the inputs are float16 or bfloat16", lambda c, i: np.dtype(c.dtype) in C.MMA_DTYPES)
FITS = If("one of its tiles fits the device's shared memory per block", lambda c, i: c.fits is None or c.fits(i))
MMA_TILE_FITS = If("its tile for D (config.flash_mma_main_tile) fits the device's shared memory per block",
                   lambda c, i: c.smem is None or kernel_dim(c) not in C.FLASH_MMA_TILES
                   or C.flash_mma_smem_bytes(kernel_dim(c), C.flash_mma_main_tile(kernel_dim(c), c.cc)) <= c.smem)
PAGES = If(f"pages hold at least config.ATTN_WGMMA_MIN_PAGE ({C.ATTN_WGMMA_MIN_PAGE}) tokens",
           lambda c, i: c.page_size >= C.ATTN_WGMMA_MIN_PAGE)
GROUP = If(f"a kv head serves at least config.DECODE_MMA_MIN_GROUP ({C.DECODE_MMA_MIN_GROUP}) query heads",
           lambda c, i: c.group >= C.DECODE_MMA_MIN_GROUP)
GEMM_LARGE = If(lambda: "M, N and K are at least config.GEMM_AUTO_WGMMA's size for the dtype "
                f"({', '.join(f'{np.dtype(d)} {n}' for d, n in C.GEMM_AUTO_WGMMA.items())})",
                lambda c, i: min(c.m, c.n, c.k) >= C.GEMM_AUTO_WGMMA.get(np.dtype(c.dtype), float("inf")))
SKINNY_M = If(f"M (a shared-weight batch folded in) is at most config.GEMM_SKINNY_MAX_M ({C.GEMM_SKINNY_MAX_M})",
              lambda c, i: c.m <= C.GEMM_SKINNY_MAX_M)
NOT_SKINNY_M = If(f"M is over config.GEMM_SKINNY_MAX_M ({C.GEMM_SKINNY_MAX_M})",
                  lambda c, i: c.m > C.GEMM_SKINNY_MAX_M)
WARP_ROWS = If(f"rows hold at most config.RMSNORM_WARP_MAX_D ({C.RMSNORM_WARP_MAX_D}) elements",
               lambda c, i: c.head_dim <= C.RMSNORM_WARP_MAX_D)

FUSED_D = If(lambda: f"D is at most {max(C.HEAD_DIMS)} (a D not in config.HEAD_DIMS, "
                     f"{', '.join(map(str, C.HEAD_DIMS))}, runs zero-padded to the next one)",
             lambda c, i: C.padded_head_dim(c.head_dim) is not None)
OTHER_D = If(lambda: f"D is over {max(C.HEAD_DIMS)} (the split pipeline takes any D, with S in memory)",
             lambda c, i: C.padded_head_dim(c.head_dim) is None)

_MMA = (MMA_DTYPE, _runs("attention", at_d=True), MMA_TILE_FITS)
_FLASH = (("flash_mma", _MMA), ("flash", ()))
# dense attention has a path for any head dim: the fused kernels up to 256 (padded), then the split pipeline
_FLASH_ANY_D = (("flash_mma", (FUSED_D,) + _MMA), ("naive", (OTHER_D, IMPLEMENTS)), ("flash", ()))
_DECODE_RULES = (("mma", (MMA_DTYPE, GROUP, _runs("decode"), FITS)), ("simt", ()))
# entry point -> ((impl, (conditions...)), ...): impl=None runs the first whose conditions hold.
# The Hopper rows are what an H100 run measured faster (config.ATTN_AUTO_*, GEMM_AUTO_WGMMA).
DEFAULTS = {
    "attention": (("wgmma_persistent", (CAUSAL, LAUNCHES, _persistent("attention"), _runs("attention"), IMPLEMENTS,
                                        TMA)),
                  ("wgmma", (_auto_pairs("ATTN_AUTO_WGMMA", lambda: C.ATTN_AUTO_WGMMA, lambda: C.ATTN_WGMMA_TILES),
                             _runs("attention"), IMPLEMENTS, TMA)))
    + _FLASH_ANY_D,
    "attention_varlen": (("wgmma_persistent", (LAUNCHES, _persistent("attention_varlen"), _runs("attention"),
                                               IMPLEMENTS, TMA)),) + _FLASH,
    "attention_paged": (("wgmma_persistent", (IMPLEMENTS, PAGES, LAUNCHES, _persistent("attention_paged"),
                                              _runs("attention"), TMA)),) + _FLASH,
    "decode_attention": _DECODE_RULES,
    "decode_attention_paged": _DECODE_RULES,
    "gemm_nt": (("wgmma", (GEMM_LARGE, NOT_SKINNY_M, _runs("gemm"), TMA)), ("skinny", (SKINNY_M, _runs("gemm"))),
                ("mma", (MMA_DTYPE, _runs("gemm"))), ("simt", ())),
    "gemm_nn": (("wgmma", (GEMM_LARGE, _runs("gemm"), TMA)), ("mma", (MMA_DTYPE, _runs("gemm"))), ("simt", ())),
    "rmsnorm": (("warp", (WARP_ROWS,)), ("block", ())),
}
# entry points that are another's for impl=None (their methods and variants)
DEFAULT_OF = {"KVCache.decode": "decode_attention", "PagedKVCache.decode": "decode_attention_paged",
              "add_rmsnorm": "rmsnorm"}
# entry points whose impl= also takes "auto", the same as None
AUTO_ALIAS = ("decode_attention", "decode_attention_paged", "gemm_nt", "gemm_nn", "rmsnorm")


def is_default(impl) -> bool:
    """Whether ``impl`` asks for the default: None, or its alias "auto"."""
    return impl is None or impl == "auto"


def choose(call: Call) -> str:
    """The impl ``impl=None`` runs for ``call``: the first of DEFAULTS[call.entry] whose conditions
    all hold (evaluated in order, so a costly one, TMA, is asked last and only where it matters)."""
    rules = DEFAULTS[DEFAULT_OF.get(call.entry, call.entry)]
    for impl, conditions in rules:
        if all(cond.holds(call, impl) for cond in conditions):
            return impl
    raise AssertionError(f"DEFAULTS[{call.entry!r}] has no unconditional last row")  # pragma: no cover


def defaults_text(entry: str) -> str:
    """How impl=None chooses on ``entry``, in words generated from DEFAULTS (the docs' line)."""
    rules = DEFAULTS[entry]
    alias = " (or 'auto')" if entry in AUTO_ALIAS else ""
    parts = [f"`{impl}` when " + " and ".join(c.text for c in conds) for impl, conds in rules[:-1]]
    return (f"impl=None{alias} runs the first that applies: " + "; ".join(parts)
            + f"; else `{rules[-1][0]}`.")
