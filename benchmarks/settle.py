"""Which kernels changed since a recorded GPU run, and which GPU tests and sanitizer families
cover them (``gpu_run.sh settle`` reads this; no GPU and no git needed on the GPU machine).

A manifest (``benchmarks/results/<session>/kernels.json``) holds the sha256 of every file under
kernels_cu/ as a run saw it; its files combine, by DESIGN.md's recipe, into the ``kernels_sha256``
that run's results JSON records, so the manifest is checked against the run itself
(:func:`check_manifest`). The working tree's files are hashed the same way and compared.

    python -m benchmarks.settle plan            # shell assignments for gpu_run.sh
    python -m benchmarks.settle manifest COMMIT OUT.json   # (on a git checkout) write a manifest
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

from .report import RESULTS_DIR, combine_hashes, kernel_file_hashes

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels_cu"
MANIFEST = RESULTS_DIR / "2026-11-27-h100" / "kernels.json"  # the last recorded GPU run's kernels
SHARED = "every"  # a header every kernel includes: all tests, all families

# kernels_cu file -> (GPU test files that launch what it defines, sanitize_cases families)
COVER = {
    "decode.cu": (("tests/cupyattn/test_decode.py", "tests/cupyattn/test_varlen_paged.py"), ("decode", "serving")),
    "paged.cuh": (("tests/cupyattn/test_varlen_paged.py", "tests/cupyattn/test_decode.py",
                   "tests/cupyattn/test_attention_wgmma_persistent.py"), ("serving",)),
    "flash_attn.cu": (("tests/cupyattn/test_attention.py", "tests/cupyattn/test_varlen_paged.py"),
                      ("attention", "serving")),
    "flash_attn_sm90.cu": (("tests/cupyattn/test_attention_wgmma.py",), ("attention",)),
    "flash_attn_sm90.cuh": (("tests/cupyattn/test_attention_wgmma.py", "tests/cupyattn/test_attention_wgmma_persistent.py"),
                            ("attention", "serving")),
    "flash_attn_sm90_persistent.cu": (("tests/cupyattn/test_attention_wgmma_persistent.py",), ("attention", "serving")),
    "flash_attn_sm90_sched.cuh": (("tests/cupyattn/test_attention_wgmma_persistent.py",), ("attention", "serving")),
    "sm90.cuh": (("tests/cupyattn/test_ptx_sm90.py", "tests/cupyattn/test_attention_wgmma.py",
                  "tests/cupyattn/test_attention_wgmma_persistent.py", "tests/cupyattn/test_gemm.py"),
                 ("attention", "gemm", "serving")),
    "ptx_sm90.cuh": (("tests/cupyattn/test_ptx_sm90.py", "tests/cupyattn/test_tma.py", "tests/cupyattn/test_attention_wgmma.py",
                      "tests/cupyattn/test_attention_wgmma_persistent.py", "tests/cupyattn/test_gemm.py"),
                     ("attention", "gemm", "serving")),
    "gemm.cu": (("tests/cupyattn/test_gemm.py",), ("gemm",)),
    "gemm_sm90.cu": (("tests/cupyattn/test_gemm.py",), ("gemm",)),
    "skinny.cuh": (("tests/cupyattn/test_gemm.py", "tests/cupyattn/test_fused_ops.py", "tests/cupyattn/test_fused_decode.py"),
                   ("gemm", "fused")),
    "fused_decode.cu": (("tests/cupyattn/test_fused_ops.py", "tests/cupyattn/test_fused_decode.py"), ("fused",)),
    "kvcache.cu": (("tests/cupyattn/test_decode.py", "tests/cupyattn/test_layers.py", "tests/cupyattn/test_varlen_paged.py"),
                   ("kvcache",)),
    "rope.cuh": (("tests/cupyattn/test_layers.py", "tests/cupyattn/test_fused_ops.py", "tests/cupyattn/test_varlen_paged.py"),
                 ("kvcache", "layers", "fused")),
    "layers.cu": (("tests/cupyattn/test_layers.py",), ("layers",)),
    "row_softmax.cu": (("tests/cupyattn/test_softmax.py",), ("softmax",)),
    "sampling.cu": (("tests/cupyattn/test_fused_ops.py", "tests/cupyattn/test_ops_on_random_shapes.py"), ("sampling",)),
    "sampling.cuh": (("tests/cupyattn/test_fused_ops.py", "tests/cupyattn/test_megakernel.py"), ("sampling", "megakernel")),
    **{k: (("tests/cupyattn/test_megakernel.py", "tests/tinylm/test_megakernel_tinylm.py"), ("megakernel",))
       for k in ("megakernel.cu", "megakernel_attention.cuh", "megakernel_gemv.cuh", "megakernel_sample.cuh")},
    "common.cuh": SHARED, "ptx.cuh": SHARED, "ptx_insn.cuh": SHARED, "__init__.py": SHARED,
}
# GPU tests that failed in the last recorded run and whose fixes have not run on a GPU since
# (benchmarks/results/2026-11-27-h100/pytest-mega.log): run whatever changed
ALWAYS = ("tests/tinylm/test_megakernel_tinylm.py",)


def file_hashes(kernels_dir=KERNELS) -> dict[str, str]:
    """{relative POSIX path: sha256} of every file under kernels_dir but __pycache__/."""
    return kernel_file_hashes(kernels_dir)


def check_manifest(manifest: dict) -> None:
    """ValueError unless the manifest's files combine into the kernels_sha256 it names."""
    if combine_hashes(manifest["files"]) != manifest["kernels_sha256"]:
        raise ValueError("the manifest's files do not combine into its kernels_sha256")


def changed(manifest: dict, kernels_dir=KERNELS, now: dict | None = None) -> list[str]:
    """Kernel files added, removed or edited since the manifest's run (``now``: file_hashes of
    kernels_dir, when the caller has them)."""
    now, then = file_hashes(kernels_dir) if now is None else now, manifest["files"]
    return sorted(n for n in set(now) | set(then) if now.get(n) != then.get(n))


def cover(files) -> tuple[list[str], list[str]]:
    """(GPU test files, sanitize families) that cover ``files``; a shared header or a file not in
    COVER brings everything (None)."""
    from .sanitize_cases import FAMILIES

    tests, fams = list(ALWAYS), []
    for f in files:
        c = COVER.get(f, SHARED)
        if c == SHARED:
            return None, list(FAMILIES)
        tests += c[0]
        fams += c[1]
    return list(dict.fromkeys(tests)), list(dict.fromkeys(fams))


def make_manifest(commit: str) -> dict:
    """The manifest of ``commit``'s kernels_cu/ (needs git), checked by recombining."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "kernels_cu"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    files = {n[len("kernels_cu/"):]: hashlib.sha256(subprocess.run(["git", "show", f"{commit}:{n}"], cwd=ROOT,
                                                                   capture_output=True, check=True).stdout).hexdigest()
             for n in names if "__pycache__" not in n}
    return {"commit": commit, "kernels_sha256": combine_hashes(files), "files": files}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.settle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="shell assignments: SETTLE_CHANGED, SETTLE_TESTS (empty: all), SETTLE_FAMILIES")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p = sub.add_parser("manifest", help="write COMMIT's kernel file hashes (needs git)")
    p.add_argument("commit")
    p.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "manifest":
        m = make_manifest(a.commit)
        a.out.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
        print(f"wrote {a.out} (kernels_sha256 {m['kernels_sha256'][:12]})", file=sys.stderr)
        return 0
    m = json.loads(a.manifest.read_text())
    check_manifest(m)
    now = file_hashes()
    files = changed(m, now=now)
    tests, fams = cover(files)
    print(f"SETTLE_CHANGED={shlex.quote(' '.join(files))}")
    print(f"SETTLE_TESTS={shlex.quote(' '.join(tests) if tests is not None else '')}")
    print(f"SETTLE_FAMILIES={shlex.quote(','.join(fams))}")
    print(f"SETTLE_SINCE={shlex.quote(m['commit'][:7] + ' ' + m['kernels_sha256'][:12])}")
    print(f"SETTLE_NOW={shlex.quote(combine_hashes(now)[:12])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
