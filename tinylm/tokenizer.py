"""Byte-level BPE tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Encoding runs on Hugging Face ``tokenizers`` (BPE over the GGUF vocabulary and merges);
decoding is our own table of token bytes, so ``decode`` is exact and ``StreamDecoder`` can hold
back the bytes of a UTF-8 character that is not complete yet.

Pre-tokenization reproduces llama.cpp's ``smollm`` pre-tokenizer: every digit is its own piece
(so the space before a number is a piece of its own), then GPT-2's regex split, then the
byte-to-unicode mapping (ByteLevel, no prefix space). No BOS is added unless the file's
``tokenizer.ggml.add_bos_token`` asks for it.

Ids follow llama.cpp's on the same file (tests/tinylm/golden/llamacpp_golden.json): a
SentencePiece file's space prefix before every run of text, Llama 3's whole-word rule, Phi-3's
control tokens that drop the whitespace after them.

Control tokens (``<|im_start|>``, ``<|im_end|>``, ...) come only from the chat template
(``encode_chat``): text is encoded as plain text, so a user who types ``<|im_start|>system`` gets
those characters, not a forged turn. ``encode(text, allow_special=True)`` is the explicit opt-in
that matches control-token text as control tokens (for raw prompts written by the developer).
"""
from __future__ import annotations

import codecs
import re
from typing import Iterable

from .errors import GGUFError
from .gguf_io import load_metadata

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_KEY = "tokenizer.ggml."
# Phi-3's vocabularies (SentencePiece ones in phi3 files): whitespace right after a control token
# is dropped (its tokenizer.json marks them rstrip; llama.cpp does the same for models named phi-3 /
# phi3), except after these. Phi-4-mini's byte-level BPE vocabulary (a phi3 file too, named
# "Phi 4 Mini") keeps it, as llama.cpp does.
PHI3_KEEPS_SPACE_AFTER = ("<unk>", "<s>", "<|endoftext|>")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0,
    0xad) are shifted to U+0100 and up, in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
# control tokens that end a turn or a text: ChatML, Llama 3 (<|eot_id|>, <|eom_id|>), Gemma, Phi-3 (<|end|>)
END_OF_TURN = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
               "<|end|>")
_SYSTEM_RE = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


def _short(value, n: int = 60) -> str:
    """repr of a metadata value, cut to ``n`` characters (a bad vocabulary can be huge)."""
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."


def check_text(fn: str, name: str, text) -> str:
    """``text`` if it is a str that UTF-8 can encode, else a TypeError / ValueError naming the
    function and the argument (bytes, None, or a lone surrogate such as argv's undecodable bytes)."""
    if not isinstance(text, str):
        hint = " (decode bytes first, e.g. data.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else ""
        raise TypeError(f"{fn}(): {name} must be a str, got {type(text).__name__}{hint}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{fn}(): {name} is not valid Unicode text: lone surrogate "
                         f"U+{ord(text[e.start]):04X} at index {e.start}") from None
    return text


class Tokenizer:
    """Encode text to token ids and back for a GGUF ``gpt2``-model (byte-level BPE) vocabulary.

    Example::

        tok = Tokenizer.from_gguf(path)
        ids = tok.encode_chat("What is 2+2?")       # ChatML; the user text stays plain text
        text = tok.decode(ids)
    """

    def __init__(self, tokens: list[str], merges: list[str] | None, token_types: list[int] | None = None,
                 eos_id: int | None = None, bos_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None, pre: str | None = "smollm", scores=None,
                 add_space_prefix: bool = True, unk_id: int | None = None, rstrip: Iterable[str] = ()):
        from tokenizers import AddedToken

        n = len(tokens)
        token_types = list(token_types) if token_types is not None else [NORMAL] * n
        if len(token_types) != n:
            raise ValueError(f"Tokenizer: {n} tokens but {len(token_types)} token types")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            raise ValueError("Tokenizer: the vocabulary has duplicate tokens")
        self.sentencepiece = merges is None  # SentencePiece-style: merges from scores, byte fallback
        if self.sentencepiece:
            hf = _sentencepiece_bpe(tokens, token_types, scores, add_space_prefix, unk_id)
        else:
            hf = _byte_level_bpe(vocab, merges, pre)
        special = [i for i, ty in enumerate(token_types) if ty == CONTROL]
        user = [i for i, ty in enumerate(token_types) if ty == USER_DEFINED]
        # ``rstrip``: the texts of the control / user-defined tokens that drop the whitespace after them
        self._rstrip = frozenset(rstrip)
        if user:
            hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False, rstrip=tokens[i] in self._rstrip)
                           for i in user])
        # The encoder of plain text (control-token text is just text); a chat template's text and
        # the explicit opt-in are split at control tokens first (_split_control), each run between
        # them encoded alone (_encode_pieces).
        self._hf_plain = hf

        # Bytes of every token: byte-level tokens undo the byte->unicode map; control and
        # user-defined tokens are their own UTF-8 text.
        self._bytes: list[bytes] = []
        for tok, ty in zip(tokens, token_types):
            if self.sentencepiece:  # "<0x41>" is byte 0x41; "▁" stands for a space
                if ty == BYTE and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
                    self._bytes.append(bytes([int(tok[3:5], 16)]))
                else:
                    self._bytes.append(tok.encode("utf-8") if ty in (CONTROL, UNKNOWN) else
                                       tok.replace("\u2581", " ").encode("utf-8"))
            elif ty in (CONTROL, USER_DEFINED) or any(c not in _UNICODE_TO_BYTE for c in tok):
                self._bytes.append(tok.encode("utf-8"))
            else:
                self._bytes.append(bytes(_UNICODE_TO_BYTE[c] for c in tok))
        self._special = frozenset(special)
        # Byte values with no token of their own. BPE (here, in HF and in llama.cpp alike) drops
        # them silently; SmolLM2 lacks 21: six ASCII controls (0x04 0x06 0x13 0x14 0x16 0x1d),
        # bytes never valid in UTF-8 (0xc0 0xc1 0xf5-0xff) and the lead bytes 0xf1 0xf2 of code
        # points U+40000-U+BFFFF. Text without them round-trips exactly. A SentencePiece vocabulary
        # falls back to its <0xXX> tokens.
        if self.sentencepiece:
            self.missing_bytes = frozenset(b for b in range(256) if f"<0x{b:02X}>" not in vocab)
        else:
            b2u = _byte_to_unicode()
            self.missing_bytes = frozenset(b for b in range(256) if b2u[b] not in vocab)
        self.tokens = list(tokens)
        self.token_types = token_types
        self.vocab_size = n
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        # Control tokens by text, e.g. {"<|im_start|>": 1, "<|im_end|>": 2, ...}
        self.special_ids = {tokens[i]: i for i in special}
        control = sorted(self.special_ids, key=len, reverse=True)  # the longest match first
        self._control_re = re.compile("|".join(map(re.escape, control))) if control else None
        self.default_system = default_system_message(chat_template)

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict, path="<gguf>") -> "Tokenizer":
        """Build from the metadata dict ``tinylm.gguf_io.load_gguf`` returns; metadata that is
        absent or of the wrong type or range raises GGUFError naming ``path`` and the key."""

        def bad(key, want):
            return GGUFError(f"{path}: metadata {key!r} must be {want}, got {_short(meta.get(key))}")

        model = meta.get(_KEY + "model")
        if model not in ("gpt2", "llama"):
            raise GGUFError(f"{path}: tokenizer.ggml.model is {_short(model)}; tinylm implements byte-level "
                            "BPE ('gpt2') and SentencePiece-style BPE with byte fallback ('llama')")
        pre = meta.get(_KEY + "pre")
        if model == "gpt2" and pre is not None and pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{path}: tokenizer.ggml.pre is {_short(pre)}; tinylm implements the pre-tokenizers "
                            f"{', '.join(PRE_TOKENIZERS)}")
        tokens, merges = meta.get(_KEY + "tokens"), meta.get(_KEY + "merges")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise bad(_KEY + "tokens", "a list of non-empty strings")
        scores = None
        if model == "llama":
            merges, scores = None, meta.get(_KEY + "scores")
            if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores):
                raise bad(_KEY + "scores", f"{len(tokens)} numbers (one per token)")
        elif not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
            raise bad(_KEY + "merges", "a list of strings 'left right'")
        n = len(tokens)
        types = meta.get(_KEY + "token_type")
        if types is not None and (not isinstance(types, list) or len(types) != n or not all(
                isinstance(t, int) and not isinstance(t, bool) and NORMAL <= t <= BYTE for t in types)):
            raise bad(_KEY + "token_type", f"{n} token types in [{NORMAL}, {BYTE}] (one per token)")

        def opt_id(key):
            v = meta.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n):
                raise bad(key, f"a token id in [0, {n})")
            return v

        add_bos = meta.get(_KEY + "add_bos_token", model == "llama")
        if not isinstance(add_bos, bool):
            raise bad(_KEY + "add_bos_token", "a bool")
        prefix = meta.get(_KEY + "add_space_prefix", meta.get("general.architecture") not in ("gemma2", "gemma3"))
        if not isinstance(prefix, bool):
            raise bad(_KEY + "add_space_prefix", "a bool")
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise bad("tokenizer.chat_template", "a string")
        try:
            return cls(tokens=tokens, merges=merges, token_types=types, eos_id=opt_id(_KEY + "eos_token_id"),
                       bos_id=opt_id(_KEY + "bos_token_id"), add_bos=add_bos, chat_template=template,
                       pre=pre or "smollm", scores=scores, add_space_prefix=prefix,
                       unk_id=opt_id(_KEY + "unknown_token_id"),
                       rstrip=[t for t, ty in zip(tokens, types or [NORMAL] * n)
                               if ty in (UNKNOWN, CONTROL, USER_DEFINED) and t not in PHI3_KEEPS_SPACE_AFTER]
                       if meta.get("general.architecture") == "phi3" and model == "llama" else ())
        except Exception as e:  # duplicate tokens, merges of unknown tokens (tokenizers' own errors)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GGUFError(f"{path}: cannot build the tokenizer from its metadata: {msg}") from None

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Read only the metadata of a GGUF file (errors as tinylm.gguf_io.GGUFError)."""
        return cls.from_gguf_metadata(load_metadata(path), path)

    @classmethod
    def of(cls, opened) -> "Tokenizer":
        """The tokenizer of a ``tinylm.gguf_io.GGUFModel`` (built once, kept on it)."""
        tok = getattr(opened, "_tokenizer", None)
        if tok is None:
            tok = opened._tokenizer = cls.from_gguf_metadata(opened.meta, opened.path)
        return tok

    # --- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``, encoded as plain text: ``"<|im_end|>"`` in the text is those
        characters, never the control token. ``allow_special=True`` (an explicit opt-in for
        raw prompts) matches control-token text as control tokens.

        ``decode(encode(text)) == text`` unless the UTF-8 of ``text`` holds one of
        ``missing_bytes``, which are dropped (as every BPE implementation of this vocabulary does).
        """
        check_text("Tokenizer.encode", "text", text)
        if not isinstance(allow_special, bool):
            raise TypeError(f"Tokenizer.encode(): allow_special must be a bool, got {allow_special!r}")
        ids = self._encode_pieces(self._split_control(text)) if allow_special else self._plain(text)
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """Ids of one user turn followed by the assistant header, through the file's own chat
        template (ChatML, Llama 3 headers, Gemma turns, [INST], ... with whatever default system
        block the template writes), or in plain ChatML (what ``encode(render_chat(prompt,
        system), allow_special=True)`` gives for text without control tokens) for a vocabulary
        with ChatML tokens and no template. ``prompt`` and ``system`` are encoded as plain text:
        the control tokens come from the template only. ``system=None``: the template's default."""
        check_text("Tokenizer.encode_chat", "prompt", prompt)
        if system is not None:
            check_text("Tokenizer.encode_chat", "system", system)
        if self.chat_template:
            return self._encode_template(prompt, system)
        start, end = self.special_ids.get("<|im_start|>"), self.special_ids.get("<|im_end|>")
        if start is None or end is None:
            raise ValueError("Tokenizer.encode_chat(): this vocabulary has no ChatML control tokens "
                             "<|im_start|> / <|im_end|>")
        plain = self._plain  # no template, so no default system line either
        ids = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        if system is not None:
            ids += [start, *plain("system\n" + system), end, *plain("\n")]
        return ids + [start, *plain("user\n" + prompt), end, *plain("\n"), start, *plain("assistant\n")]

    def _encode_template(self, prompt: str, system: str | None) -> list[int]:
        """One user turn (after a system message when given) through the file's own chat template
        (Jinja, as Hugging Face renders it), with add_generation_prompt. Control tokens come from
        the template's text only: the message contents are marked while rendering, and control
        token text found inside them stays plain text."""
        import datetime

        import jinja2

        messages = ([] if system is None else [{"role": "system", "content": system}]) + \
            [{"role": "user", "content": prompt}]
        env = _chat_environment()

        def raise_exception(msg):
            raise ValueError(f"Tokenizer.encode_chat(): the chat template refuses: {msg}")

        now = datetime.datetime.now()  # one clock for both renders below (Llama 3.1+, SmolLM3 print the date)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = now.strftime
        try:
            tmpl = env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"Tokenizer.encode_chat(): the file's chat template cannot be read: {e}") from None
        names = {"bos_token": "" if self.bos_id is None else self.tokens[self.bos_id],
                 "eos_token": "" if self.eos_id is None else self.tokens[self.eos_id]}
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = tmpl.render(messages=[dict(m, content=k) for m, k in zip(messages, marks)],
                             add_generation_prompt=True, **names)
        real = tmpl.render(messages=messages, add_generation_prompt=True, **names)
        # the contents as the template wrote them: as given, or trimmed (Llama 3's `| trim`)
        contents = None
        for fix in (lambda c: c, str.strip):
            filled = marked
            for k, m in zip(marks, messages):
                filled = filled.replace(k, fix(m["content"]))
            if filled == real and all(marked.count(k) == 1 for k in marks):
                contents = [fix(m["content"]) for m in messages]
                break
        if contents is not None:
            # split the template's own text at control tokens; plain runs (template text and
            # contents together, as one string would be encoded) are encoded as plain text
            pieces = [""]
            for part in re.split("(\ue000\\d+\ue001)", marked):
                m = re.fullmatch("\ue000(\\d+)\ue001", part)
                split = [contents[int(m.group(1))]] if m else self._split_control(part)
                pieces[-1] += split[0]  # a run continues across a content
                pieces += split[1:]
        elif not any(t in m["content"] for m in messages for t in self.special_ids):
            # the template edits or branches on the text (SmolLM3 reads "/no_think" out of the
            # system message): the rendered text split at control tokens, none of which can come
            # from the messages, since they hold no control-token text
            pieces = self._split_control(real)
        else:
            raise ValueError("Tokenizer.encode_chat(): the chat template changes the message text in a way "
                             "tinylm cannot follow, and a message holds control-token text")
        ids = self._encode_pieces(pieces)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _plain(self, text: str) -> list[int]:
        return self._hf_plain.encode(text, add_special_tokens=False).ids

    def _split_control(self, text: str) -> list:
        """``text`` split at the control tokens' text (the longest first where several start at
        one place): [run, id, run, id, ..., run], runs possibly empty."""
        pieces, pos = [], 0
        for hit in self._control_re.finditer(text) if self._control_re else ():
            pieces += [text[pos:hit.start()], self.special_ids[hit.group()]]
            pos = hit.end()
        return pieces + [text[pos:]]

    def _encode_pieces(self, pieces) -> list[int]:
        """Ids of runs of plain text and control-token ids, each run encoded alone (its own
        SentencePiece space prefix, as llama.cpp encodes the fragments between special tokens);
        after a token of ``rstrip`` the run's leading ASCII whitespace is dropped (C isspace, as
        llama.cpp: a no-break space stays)."""
        ids, prev = [], None
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                if prev is not None and self.tokens[prev] in self._rstrip:
                    piece = piece.lstrip(" \t\n\v\f\r")
                if piece:
                    ids += self._plain(piece)
            prev = piece if isinstance(piece, int) else None
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"Tokenizer: token id {token_id} out of range [0, {self.vocab_size})")
        return self._bytes[token_id]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special]
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; exact inverse of encode. Bytes that are not valid UTF-8 (a cut
        multi-byte character) decode to U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS (``<|im_end|>`` for SmolLM2) and the control tokens that end
        a turn or a text in the families' vocabularies (END_OF_TURN), as llama.cpp stops on them."""
        ids = {self.eos_id} if self.eos_id is not None else set()
        ids |= {self.special_ids[t] for t in END_OF_TURN if t in self.special_ids}
        return frozenset(ids)

    # --- chat ------------------------------------------------------------------------------

    def render_chat(self, prompt: str, system: str | None = None) -> str:
        """One user turn in ChatML, ready for the assistant's answer.

        ``system=None`` uses the chat template's default system line (what the template adds
        when the conversation has no system message); pass a string for another one. The text
        equals the template rendered with add_generation_prompt=True.
        """
        return render_chat(prompt, self.default_system if system is None else system)

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)


# --- byte-level BPE pre-tokenizers --------------------------------------------------------------
# Each as llama.cpp splits (llama-vocab.cpp's regex lists, applied one after the other, each match
# its own piece) before the byte-to-unicode map; GPT2 marks GPT-2's own split done by ByteLevel.
# llama.cpp's adaptations are kept where they differ from the models' tokenizer.json (Llama 3's
# contractions without (?i:), GPT-4o's and Tekken's letter cases as "a letter but not a-z / A-Z"),
# since they decide the ids of a GGUF file; every entry was checked against llama-cpp-python 0.3.36
# on 3,000 random texts through a trained 3,000-token vocabulary (tests: llamacpp_golden.json).
GPT2 = "gpt-2's split"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_QWEN2 = (_LLAMA3[0].replace(r"\p{N}{1,3}", r"\p{N}"),)
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_GPT2 = (r"\p{N}", GPT2)  # every digit its own piece, then GPT-2's split (SmolLM2, StarCoder)
# llama.cpp pre-tokenizer name -> (splits, ignore_merges: a word found whole in the vocabulary is
# taken whole before any merge, as Llama 3's tokenizer.json says and llama.cpp does for these)
PRE_TOKENIZERS = {
    "smollm": (_DIGITS_GPT2, False), "starcoder": (_DIGITS_GPT2, False), "refact": (_DIGITS_GPT2, False),
    "command-r": (_DIGITS_GPT2, False), "exaone": (_DIGITS_GPT2, False),
    "gpt-2": ((GPT2,), False), "olmo": ((GPT2,), False),
    "llama-bpe": (_LLAMA3, True), "llama3": (_LLAMA3, True), "falcon3": (_LLAMA3, True), "pixtral": (_LLAMA3, True),
    "smaug-bpe": (_LLAMA3, False), "dbrx": (_LLAMA3, False),
    "qwen2": (_QWEN2, False), "deepseek-r1-qwen": (_QWEN2, False), "stablelm2": (_QWEN2, False),
    "tekken": (_TEKKEN, True), "gpt-4o": (_GPT4O, False), "deepseek-v3": (_DEEPSEEK3, False),
}


def _byte_level_bpe(vocab: dict, merges: list, pre: str):
    """HF ``tokenizers`` BPE over a byte-level vocabulary with the named pre-tokenizer."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    splits, ignore_merges = PRE_TOKENIZERS[pre]
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=ignore_merges))
    seq = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits if r != GPT2]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        seq + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=GPT2 in splits)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(tokens, token_types, scores, add_space_prefix: bool, unk_id):
    """HF ``tokenizers`` BPE that encodes as SentencePiece's BPE does over a GGUF "llama"
    vocabulary: spaces become U+2581 (with ``add_space_prefix``, one more before each run of
    text, whatever it starts with, as llama.cpp and the models' own SentencePiece do), adjacent pieces
    merge best score first (merges derived from the scores: every split of a piece into two
    pieces of the vocabulary, ranked by the piece's score, as HF builds them), and characters
    without a piece fall back to their UTF-8 bytes' ``<0xXX>`` tokens."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, token_types) if ty in (NORMAL, USER_DEFINED)}
    ranked = []
    for t in normal:
        for i in range(1, len(t)):
            left, right = t[:i], t[i:]
            if left in normal and right in normal:
                ranked.append((-float(scores[vocab[t]]), vocab[t], vocab[left], (left, right)))
    ranked.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=[r[3] for r in ranked], unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # spaces kept whole (no split on them); the prefix on each run between added tokens, as
    # llama.cpp prefixes each fragment (HF's GGUF converter for Llama files prefixes only the
    # first, and not one that starts with a space: a departure from SentencePiece)
    space = normalizers.Replace(" ", "\u2581")
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


def _chat_environment():
    """Jinja as Hugging Face renders chat templates: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, and its ``{% generation %}`` tag (SmolLM3's template marks the assistant's text with
    it; here, as in HF's output, the tag renders its body)."""
    import jinja2.sandbox
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[Generation, "jinja2.ext.loopcontrols"])


def default_system_message(chat_template: str | None) -> str | None:
    """The system line a ChatML template inserts when the conversation has none, or None."""
    m = _SYSTEM_RE.search(chat_template or "")
    return m.group(1) if m else None


def render_chat(prompt: str, system: str | None = None, chat_template: str | None = None) -> str:
    """One user turn in ChatML followed by the assistant header (add_generation_prompt).

    ``system=None`` takes the default system line of ``chat_template`` (none when the template
    has none or is not given); a string, even "", is used as the system message.
    """
    if system is None:
        system = default_system_message(chat_template)
    head = "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    return f"{head}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


class StreamDecoder:
    """Turn ids arriving one by one into text, never splitting a UTF-8 character.

    ``feed(ids)`` returns the text that is complete so far (possibly ""); the bytes of a
    character that a later token will finish are held back. ``flush()`` returns what is held
    (as U+FFFD when it is not valid UTF-8). The concatenation of all returned pieces equals
    ``tokenizer.decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids) -> str:
        if isinstance(ids, int) or hasattr(ids, "__index__"):
            ids = [int(ids)]
        return self._utf8.decode(self.tokenizer.decode_bytes(ids, self.skip_special))

    __call__ = feed

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
