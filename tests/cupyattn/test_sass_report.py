"""The machine-code report of the Hopper kernels (cupyattn/_sass.py, `python -m cupyattn check --sass`)
and the invariants it establishes for kernels_cu/flash_attn_sm90.cu (CPU tier).

The parser is checked on hand-written nvdisasm listings (no tool needed); the invariants read the
loops the offline compile gate attaches to each sm_90a build (one nvdisasm run per build, no second
compile): in every instantiation the unmasked key loop holds no mask arithmetic and no serialised
wgmma, the masked step exists once, the P V wait sits after every exp2 where the tile overlaps, and
the code stays under a size bound (the 2026-11-27 persistent kernel was 302 KB).
"""
import struct

import pytest

from cupyattn import _compile_check, _sass
from cupyattn import flash_attn_sm90 as W

EMULATE = __import__("os").environ.get("CUPYATTN_EMULATE") == "1"
CODE_BOUND = 160 * 1024   # bytes of machine code per instantiation (today's largest: 133 KB, the 176-key tile)

# A listing in nvdisasm -c's format: a loop whose body waits on an mbarrier through an out-of-line
# retry block (a branch back into straight code: not a loop), a nested loop, a BRA.DIV (conditional).
LISTING = """
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0040*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0050*/                   FSEL R5, R5, -INF , !P1 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/                   MUFU.EX2 R6, R6 ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0090*/                   MUFU.EX2 R7, R7 ;
.L_x_3:
        /*00a0*/                   FADD R8, R8, R9 ;
        /*00b0*/                   FADD R8, R8, R9 ;
        /*00c0*/                   FADD R8, R8, R9 ;
        /*00d0*/                   FADD R8, R8, R9 ;
        /*00e0*/                   FADD R8, R8, R9 ;
        /*00f0*/                   FADD R8, R8, R9 ;
        /*0100*/                   FADD R8, R8, R9 ;
        /*0110*/                   FADD R8, R8, R9 ;
        /*0120*/                   FADD R8, R8, R9 ;
        /*0130*/                   FADD R8, R8, R9 ;
        /*0140*/                   FADD R8, R8, R9 ;
        /*0150*/               @P2 BRA `(.L_x_3) ;
        /*0160*/                   BRA.DIV UR4, `(.L_x_5) ;
.L_x_5:
        /*0170*/               @P3 BRA `(.L_x_1) ;
        /*0180*/                   EXIT ;
.L_x_9:
        /*0190*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*01a0*/              @!P0 BRA `(.L_x_9) ;
        /*01b0*/                   BRA `(.L_x_2) ;
"""


def test_loops_of_a_listing():
    """Two natural loops reported (the outer one and the nested FADD loop); the retry block that
    jumps back into the body is not one (its spin on itself is, too short to report); the outer
    loop's own counts leave the nested loops out; its wait-all comes after 2 of its 3 exp2s."""
    (insns, labels), = _sass.parse_sass(LISTING).values()
    assert len(insns) == 28 and insns[1].op == "HGMMA.64x128x16.F32" and labels[".L_x_9"] == 0x190
    got = {(lp.start, lp.end): lp for lp in _sass.loops(insns, labels)}
    assert set(got) == {(0x10, 0x1b0), (0xa0, 0x150)}
    outer, inner = got[(0x10, 0x1b0)], got[(0xa0, 0x150)]
    assert inner.insns == 12 and inner.nested == 0 and inner.kind == "other"
    # nested: the FADD loop and the retry block's own spin (a loop too short to report)
    assert outer.insns == 12 and outer.nested == 14 and outer.hgmma == 1 and outer.depbar == 2 and outer.ex2 == 3
    assert outer.mask == 1 and outer.ex2_before_wait0 == 2 and outer.predicated == 2
    assert outer.kind == "consumer, unmasked"   # one select of -inf: not a masked tile's 64


def _elf(size: int, cut: int = 0) -> bytes:
    """A 64-bit ELF whose headers declare ``size`` bytes (the program header table last), ``cut``
    bytes short."""
    b = bytearray(size)
    b[:4] = b"\x7fELF"
    struct.pack_into("<QQ", b, 0x20, size - 56, 64)          # phoff: one entry ending at size; shoff
    struct.pack_into("<HHHHH", b, 0x36, 56, 1, 64, 0, 0)      # phentsize, phnum, shentsize, shnum, shstrndx
    return bytes(b[:size - cut])


def test_pad_elf_restores_the_byte_cupy_drops():
    full, short = _elf(400), _elf(400, cut=1)
    assert _sass.elf_end(short) == 400
    assert _sass.pad_elf(short) == full and _sass.pad_elf(full) is full


def _args(expr):
    """flash_attn_sm90<T, D, BLOCK_N, STAGES, OVERLAP, PINGPONG, SCHED, REG_P, REG_C> -> (D, BLOCK_N, OVERLAP)."""
    a = [x.strip() for x in expr.partition("<")[2].rstrip(">").split(",")]
    return int(a[1]), int(a[2]), a[4] == "true"


@pytest.mark.skipif(EMULATE, reason="the offline compile check needs the real CuPy and NVRTC")
def test_hopper_attention_machine_code_invariants(compile_report):
    """Per instantiation of the Hopper attention kernel: one unmasked key loop, with no select of
    -inf, D/16 + BLOCK_N/16 HGMMAs (+1: ptxas' stand-in for the first tile's empty P V group) and
    two wgmma waits (none serialised); one masked key loop (the masked step, once), one -inf select
    per score; with OVERLAP the P V wait after every exp2 in both; code under CODE_BOUND."""
    reports, errors = compile_report("flash_attn_sm90")
    assert not errors, errors
    assert reports
    for r in reports:
        assert r.loops is not None, "no nvdisasm: pip install nvidia-cuda-nvdisasm (the test extra)"
        d, bn, overlap = _args(r.kernel)
        assert 0 < r.code_bytes <= CODE_BOUND, (r.kernel, r.code_bytes)
        bulk = [lp for lp in r.loops if lp["kind"] == "consumer, unmasked"]
        masked = [lp for lp in r.loops if lp["kind"] == "consumer, masked"]
        assert len(bulk) == 1 and len(masked) == 1, (r.kernel, [lp["kind"] for lp in r.loops])
        b, m = bulk[0], masked[0]
        assert b["mask"] == 0, (r.kernel, b)
        assert b["hgmma"] == d // 16 + bn // 16 + (1 if overlap else 0), (r.kernel, b)
        assert b["depbar"] == 2 and b["ex2"] == bn // 2 + 2, (r.kernel, b)
        assert bn // 2 <= m["mask"] <= bn // 2 + 4, (r.kernel, m)
        if overlap:
            assert b["ex2_before_wait0"] == b["ex2"] and m["ex2_before_wait0"] == m["ex2"], (r.kernel, b, m)


def test_report_names_every_hopper_instantiation():
    """check --sass reports every sm_90a instantiation (the attention kernel's and the GEMM's)."""
    got = {e for _, e in _compile_check.hopper_exprs()}
    assert set(W.SPEC.name_expressions) <= got and any(e.startswith("gemm_wgmma") for e in got)
