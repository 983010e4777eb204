"""Offline machine-code report of the Hopper kernels (``python -m cupyattn check --sass``).

Each sm_90a instantiation is compiled by NVRTC exactly as the compile check compiles it (same
spec, source and options), its cubin disassembled by ``nvdisasm`` (NVIDIA's
``nvidia-cuda-nvdisasm`` wheel, the ``sass`` extra, or one on PATH / ``CUPYATTN_NVDISASM``), and
read for what decides its speed and that no GPU is needed to see:

- code size (bytes of the kernel's ``.text`` section) and registers (ptxas' ``-v`` line);
- every loop (a backward branch and its target; wait loops of a few instructions left out), with
  its instruction mix per iteration as written in the body: HGMMA, WARPGROUP.DEPBAR (wgmma waits),
  BAR (named barriers), MUFU.EX2, predicated instructions, and ``mask``: selects of -inf (FSEL with
  a -INF operand), the arithmetic that hides a key, which a loop that needs no masking must not hold;
- in each loop with HGMMAs, where the wait that retires everything (``WARPGROUP.DEPBAR.LE gsb0,
  0x0``, the P V wait in an overlapped key loop) sits among the loop's exp2s: ``ex2_before_wait0``
  of them run before it. FlashAttention-3's intra-warpgroup overlap is real only when the softmax's
  exp2s come before that wait (they run while P V is in flight).

CuPy's offline cubin can come back one byte short of the ELF it holds (its size query counts a
terminating NUL it does not copy); :func:`pad_elf` pads it to the end its headers declare.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

NVDISASM_ENV = "CUPYATTN_NVDISASM"
MIN_LOOP = 12   # instructions: shorter loops are mbarrier / spin waits, not work


def nvdisasm_path() -> str | None:
    """nvdisasm: $CUPYATTN_NVDISASM, the nvidia-cuda-nvdisasm wheel's (nvidia/cu13|cu12/bin), PATH."""
    env = os.environ.get(NVDISASM_ENV, "").strip()
    if env:
        return env
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels

        for root in getattr(nvidia, "__path__", []):
            for sub in ("cu13", "cu12", "cuda_nvdisasm"):
                p = Path(root) / sub / "bin" / "nvdisasm"
                if p.is_file():
                    return str(p)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


# --- the ELF container ------------------------------------------------------------------------------
def _sections(elf: bytes):
    """(name, offset, size) of each section of a 64-bit little-endian ELF."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab_off = heads[shstrndx][4]
    out = []
    for name, kind, _flags, _addr, off, size in heads:
        end = elf.index(b"\0", strtab_off + name)
        out.append((elf[strtab_off + name:end].decode(), off, 0 if kind == 8 else size))  # 8: NOBITS
    return out


def elf_end(elf: bytes) -> int:
    """The byte count the ELF's headers declare: the end of its program header table, of its
    section header table or of its furthest section, whichever is latest (CuPy's short cubin
    lacks the last byte of the program header table, which ptxas puts last)."""
    phoff, shoff = struct.unpack_from("<QQ", elf, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        _n, kind, _f, _a, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        if kind != 8:
            end = max(end, off + size)
    return end


def pad_elf(elf: bytes) -> bytes:
    """``elf`` padded with NULs to :func:`elf_end` (CuPy's offline cubin may be a byte short)."""
    end = elf_end(elf)
    return elf + b"\0" * (end - len(elf)) if len(elf) < end else elf


def text_sizes(elf: bytes) -> dict[str, int]:
    """Mangled kernel name -> bytes of machine code (its ``.text.<name>`` section)."""
    return {n[len(".text."):]: size for n, _off, size in _sections(elf) if n.startswith(".text.")}


# --- the disassembly ---------------------------------------------------------------------------------
_INSN_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][\w.]*)\s*([^;]*);")
_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+):")
_FUNC_RE = re.compile(r"^\s*\.text\.(\S+):")
_TARGET_RE = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Insn:
    offset: int
    pred: str      # "@P0 " etc., or ""
    op: str        # opcode with modifiers, e.g. WARPGROUP.DEPBAR.LE
    args: str


def parse_sass(text: str) -> dict[str, tuple[list[Insn], dict[str, int]]]:
    """nvdisasm -c output -> mangled function name -> (instructions, label -> offset)."""
    funcs: dict = {}
    cur, pending = None, []
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), ([], {}))
            pending = []
            continue
        if cur is None:
            continue
        m = _LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN_RE.search(line)
        if m:
            off = int(m.group(1), 16)
            for lab in pending:
                cur[1][lab] = off
            pending = []
            cur[0].append(Insn(off, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return funcs


@dataclass
class LoopReport:
    start: int          # byte offsets of the loop's header and of its last instruction
    end: int
    insns: int          # of its own body: the counts below leave out loops nested in it
    nested: int         # instructions of the loops nested in it
    hgmma: int
    depbar: int         # WARPGROUP.DEPBAR (wgmma.wait_group)
    bar: int            # BAR.SYNC / BAR.ARV (named barriers: ping-pong turns)
    ex2: int            # MUFU.EX2
    predicated: int
    mask: int           # FSEL ... -INF: a key hidden by a mask
    utmaldg: int        # TMA loads (the producer's loops)
    ex2_before_wait0: int | None = None   # exp2s before the first wait-all (None: no such wait)

    @property
    def kind(self) -> str:
        """consumer key loops: "masked" (a select of -inf per pair of scores at least) or
        "unmasked"; "consumer, tile": a loop around such loops (the consumers' loop over tiles,
        its own body: no softmax); "consumer, mma": wgmma without a softmax (a GEMM's k loop);
        "producer": TMA copies inside; "other"."""
        if self.hgmma and not self.ex2:
            return "consumer, tile" if self.nested >= 100 else "consumer, mma"
        if self.hgmma:
            return "consumer, masked" if self.mask >= 8 else "consumer, unmasked"
        return "producer" if self.utmaldg else "other"


def _is_wait0(i: Insn) -> bool:
    return i.op.startswith("WARPGROUP.DEPBAR") and i.args.replace(" ", "").endswith(",0x0")


def _blocks(insns: list[Insn], labels: dict[str, int]):
    """Basic blocks (first, last instruction index) and their successor block indices."""
    index = {i.offset: n for n, i in enumerate(insns)}
    starts = {0} | {index[o] for o in labels.values() if o in index}
    for n, i in enumerate(insns):
        if i.op.startswith(("BRA", "EXIT", "RET", "JMP", "BRX")) and n + 1 < len(insns):
            starts.add(n + 1)
    starts = sorted(starts)
    of = {}
    spans = []
    for k, s in enumerate(starts):
        e = (starts[k + 1] if k + 1 < len(starts) else len(insns)) - 1
        spans.append((s, e))
        of[s] = k
    succ = []
    for k, (s, e) in enumerate(spans):
        last, out = insns[e], []
        m = _TARGET_RE.search(last.args) if last.op.startswith("BRA") else None
        if m and m.group(1) in labels and labels[m.group(1)] in index:
            out.append(of[index[labels[m.group(1)]]])
        # BRA P1, `(...)` / BRA.DIV UR4, `(...)`: an operand before the target makes it conditional
        unconditional = (last.op.startswith(("BRA", "EXIT", "RET", "JMP", "BRX")) and not last.pred
                         and not last.op.startswith("BRA.DIV") and not last.args.split("`")[0].strip())
        if not unconditional and k + 1 < len(spans):
            out.append(k + 1)
        succ.append(out)
    return spans, succ


def _dominators(succ):
    """dom[b]: bit set of the blocks that dominate block b (entry block 0), iteratively."""
    n = len(succ)
    pred = [[] for _ in range(n)]
    for b, ss in enumerate(succ):
        for t in ss:
            pred[t].append(b)
    full = (1 << n) - 1
    dom = [full] * n
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            d = full
            for p in pred[b]:
                d &= dom[p]
            d = (d if pred[b] else 0) | (1 << b)
            if d != dom[b]:
                dom[b], changed = d, True
    return dom, pred


def loops(insns: list[Insn], labels: dict[str, int]) -> list[LoopReport]:
    """Every natural loop of MIN_LOOP instructions or more (a branch to a block that dominates it:
    the out-of-line retry blocks of mbarrier waits, which jump back into straight code, are not
    loops), its body the blocks that reach the back edge without passing the header. Loops with one
    header are merged; a loop nested in another is reported on its own and left out of the outer
    one's counts. Order inside a body: by address from the header on (the order ptxas laid it out)."""
    if not insns:
        return []
    spans, succ = _blocks(insns, labels)
    dom, pred = _dominators(succ)
    bodies: dict[int, set] = {}
    for b, ss in enumerate(succ):
        for h in ss:
            if dom[b] >> h & 1:                         # back edge b -> h
                body, stack = ({h, b}, [b]) if b != h else ({h}, [])
                while stack:
                    x = stack.pop()
                    for p in pred[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(h, set()).update(body)
    out = []
    for h, body in sorted(bodies.items()):
        hs = spans[h][0]
        # the loop's own blocks: a nested loop (its header inside this body) is reported on its own
        inner = set().union(*[b for h2, b in bodies.items() if h2 != h and h2 in body and b < body])
        own = body - inner
        order = sorted(own, key=lambda k: (spans[k][0] < hs, spans[k][0]))
        seq = [insns[n] for k in order for n in range(spans[k][0], spans[k][1] + 1)]
        if len(seq) < MIN_LOOP:
            continue
        ex2 = [k for k, x in enumerate(seq) if x.op.startswith("MUFU.EX2")]
        w0 = next((k for k, x in enumerate(seq) if _is_wait0(x)), None)
        out.append(LoopReport(
            start=insns[hs].offset, end=max(insns[spans[k][1]].offset for k in body), insns=len(seq),
            nested=sum(spans[k][1] - spans[k][0] + 1 for k in inner),
            hgmma=sum(x.op.startswith("HGMMA") for x in seq),
            depbar=sum(x.op.startswith("WARPGROUP.DEPBAR") for x in seq),
            bar=sum(x.op.startswith(("BAR.SYNC", "BAR.ARV", "BAR.RED")) for x in seq),
            ex2=len(ex2), predicated=sum(bool(x.pred) for x in seq),
            mask=sum(x.op.startswith("FSEL") and "-INF" in x.args for x in seq),
            # TMA copies sit in ptxas' one-lane-at-a-time loops (ELECT, BRA.U.ANY): counted whole
            utmaldg=sum(insns[n].op.startswith("UTMALDG") for k in body for n in range(spans[k][0], spans[k][1] + 1)),
            ex2_before_wait0=None if w0 is None else sum(k < w0 for k in ex2)))
    return out


@dataclass
class SassReport:
    kernel: str          # name expression
    spec: str
    code_bytes: int
    registers: int
    spill_bytes: int
    insns: int
    loops: list[LoopReport] = field(default_factory=list)
    serialised: str = ""   # ptxas' note that it serialised the wgmmas (C7514 / C7515 / C7520), if any

    def key_loops(self, kind: str) -> list[LoopReport]:
        """The consumer's loops of one kind ("consumer, unmasked" / "consumer, masked")."""
        return [x for x in self.loops if x.kind == kind]


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> str:
    """nvdisasm -c of a cubin (padded first: :func:`pad_elf`)."""
    exe = nvdisasm or nvdisasm_path()
    if exe is None:
        raise RuntimeError("no nvdisasm: pip install nvidia-cuda-nvdisasm (the 'sass' extra), or set "
                           f"{NVDISASM_ENV} to an nvdisasm binary")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(pad_elf(cubin))
        path = f.name
    try:
        res = subprocess.run([exe, "-c", path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({res.returncode}): {res.stderr.strip()[:400]}")
    return res.stdout


def loop_summary(cubin: bytes, mangled: dict[str, str]) -> dict[str, list[dict]]:
    """Expression -> its loops (LoopReport fields and kind) for each kernel of a cubin whose mangled
    name ``mangled`` maps; {} without nvdisasm. The compile check attaches it to its sm_90a reports
    (one disassembly per build, no second compile), which the CPU tests read."""
    exe = nvdisasm_path()
    if exe is None:
        return {}
    out = {}
    for name, (insns, labels) in parse_sass(disassemble(cubin, exe)).items():
        if name in mangled:
            out[mangled[name]] = [dict(asdict(lp), kind=lp.kind) for lp in loops(insns, labels)]
    return out


def format_report(r: SassReport) -> str:
    """A few lines per instantiation: size, registers, then one line per loop with HGMMAs or TMA."""
    lines = [f"{r.kernel}  [{r.spec}]  {r.code_bytes / 1024:.1f} KB code, {r.insns} instructions, "
             f"{r.registers} registers, {r.spill_bytes} B spilled"]
    if r.serialised:
        lines.append(f"    SERIALISED: {r.serialised}")
    for lp in r.loops:
        if lp.kind == "other":
            continue
        w = "" if lp.ex2_before_wait0 is None else f", wait0 after {lp.ex2_before_wait0}/{lp.ex2} EX2"
        lines.append(f"    loop {lp.start:#07x}-{lp.end:#07x} {lp.kind:<18} {lp.insns:5d} insns"
                     f"{f' (+{lp.nested} nested)' if lp.nested else ''}: HGMMA {lp.hgmma}, "
                     f"DEPBAR {lp.depbar}, BAR {lp.bar}, EX2 {lp.ex2}, predicated {lp.predicated}, "
                     f"mask {lp.mask}, UTMALDG {lp.utmaldg}{w}")
    return "\n".join(lines)


def as_dict(r: SassReport) -> dict:
    d = asdict(r)
    for lp, x in zip(d["loops"], r.loops):
        lp["kind"] = x.kind
    return d
