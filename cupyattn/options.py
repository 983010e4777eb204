"""Which options each attention and decode path implements: one table, read by three parties.

- The dispatch: ``impl=None`` (attention) never picks a path that lacks an option the call uses
  (:func:`supports`), and an explicit ``impl=`` that lacks it raises a ValueError naming the
  option before anything is allocated or launched (:func:`check`).
- The documentation: ``docs/options.md`` is :func:`markdown`'s output (``python -m cupyattn
  options > docs/options.md``; tests/test_options_matrix.py fails when it is stale).
- The tests: tests/test_options_matrix.py runs every entry point x impl x option (alone and in
  pairs) on the emulated families and either compares with the float64 reference or expects the
  refusal this table states, so a path that silently ignores an option fails there.

Options are of two kinds: call arguments (``causal``, ``window``, ...; the dispatch sees them)
and input layouts (``gqa``, ``broadcast``, ``strided``, ``negative_stride``; the paths' own
checks see them, e.g. TMA's rules for ``wgmma``). An option an entry point does not take at all
is absent from its ``ENTRY_OPTIONS`` row. Turning a refusal into support is deleting its line
in ``REFUSED`` once the kernel implements it: the matrix test then compares instead of expecting
the refusal.
"""
from __future__ import annotations

# option -> what it means (the docs' legend)
OPTIONS = {
    "causal": "`causal=True` (bottom-right aligned when Sq != Sk)",
    "window": "`window=(left, right)`, a sliding window",
    "softcap": "`softcap=c`: scores `c * tanh(s / c)` (Gemma 2)",
    "mask": "`mask=`, an additive float mask broadcast to [B, Hq, Sq, Sk]",
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
                  "(opt-in, not yet run on a GPU)",
    "hnd_pages": "`layout=\"HND\"`: pages [num_pages, Hkv, page_size, D] (FlashInfer's; PagedKVCache(layout=)); "
                 "not yet run on a GPU",
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
# How impl=None / "auto" chooses, per entry point (the docs' note; the code is each module's).
DEFAULTS = {
    "attention": "impl=None: on sm_90, `wgmma_persistent` for causal calls of "
                 "config.ATTN_AUTO_PERSISTENT['attention']'s (dtype, D) pairs (fp16, D=256), else `wgmma` for "
                 "config.ATTN_AUTO_WGMMA's, each when it implements every option of the call and TMA can read "
                 "q, k, v; else `flash_mma` (fp16/bf16 where the device has it), else `flash`",
    "attention_varlen": "impl=None: on sm_90 `wgmma_persistent` for config.ATTN_AUTO_PERSISTENT's (dtype, D) "
                        "pairs (fp16 at D=64, 128, 256; bf16 at D=128) when TMA can read q, k, v; else "
                        "`flash_mma` for fp16/bf16 where the device has it, else `flash`",
    "attention_paged": "impl=None: as attention_varlen, `wgmma_persistent` for fp16 at D=128 with NHD pages "
                       "of 8 tokens or more",
    "decode_attention": "impl='auto': `mma` for fp16/bf16 with a GQA group of 4 or more where the device "
                        "has it, else `simt`",
    "decode_attention_paged": "impl='auto': as decode_attention; PagedKVCache.decode(q, layer, **kw) "
                              "forwards to it",
}

# (entry point, impl) -> {option: why it is refused}. Every other option of ENTRY_OPTIONS[entry]
# is implemented by that impl. Call options here raise ValueError from :func:`check`; layouts
# are refused by the path's own checks (their messages name the operand and the stride).
V3_LACKS = "not in kernels_cu/flash_attn_sm90.cu (v3); impl='wgmma_persistent' implements it"
TMA_REFUSES = {  # the Hopper kernels read q, k, v through TMA tensor maps
    "broadcast": "TMA cannot describe a stride of 0 (a ValueError names the operand and the stride)",
    "negative_stride": "TMA cannot describe a negative stride (a ValueError names the operand and the stride)",
}
REFUSED = {
    ("attention", "naive"): {
        "window": "the split pipeline (gemm_nt, softmax, gemm_nn) has no window",
        "softcap": "the split pipeline (gemm_nt, softmax, gemm_nn) has no softcap",
    },
    ("attention", "wgmma"): {"window": V3_LACKS, "softcap": V3_LACKS, **TMA_REFUSES},
    ("attention", "wgmma_persistent"): TMA_REFUSES,
    ("attention_varlen", "wgmma_persistent"): TMA_REFUSES,
    ("attention_paged", "wgmma_persistent"): {
        **TMA_REFUSES,
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
             "reads (do not edit by hand; tests/test_options_matrix.py checks it is current and runs",
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
        lines += [""] + notes + ([""] if notes else []) + [DEFAULTS[entry] + ".", ""]
    lines += ["## Options", ""] + [f"- **{o}**: {what}" for o, what in OPTIONS.items()] + [""]
    return "\n".join(lines)

