"""How long users wait for NVRTC: ``python -m benchmarks.compile_time [--json PATH]``.

Each figure is taken in a fresh Python process with an empty CuPy kernel cache
(``CUPY_CACHE_DIR`` set to a new temporary directory), so nothing is reused:

- ``first_attention_nvrtc_s``: the NVRTC compile (for sm_90, with the options cupy.RawModule
  uses) of the one instantiation that ``attention(q, k, v, causal=True)`` launches for float16,
  D=128; needs no GPU;
- ``check_s``: the whole offline compile check, ``python -m cupyattn check`` (every
  instantiation, sm_80 and sm_90);
- with a GPU only: ``first_attention_call_s`` / ``second_process_call_s``, the first
  ``attention`` call in a fresh process with an empty cache, and again in a second process that
  finds CuPy's disk cache filled by the first.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_NVRTC_ONE = r"""
import time, numpy as np
from cupy.cuda import compiler
from cupyattn import flash_attn
from cupyattn._compile_check import rawmodule_options
dt = np.dtype(np.float16)
expr = flash_attn._expr(flash_attn.DEFAULT_IMPL[dt], dt, 128, True)
t = time.perf_counter()
prog = compiler._NVRTCProgram(flash_attn.SPEC.code(), "flash_attn.cu", name_expressions=[expr], method="cubin")
prog.compile(rawmodule_options(flash_attn.SPEC, "90")[:-2])
print(expr, time.perf_counter() - t)
"""

_FIRST_CALL = r"""
import time, cupy, numpy as np, cupyattn
q = cupy.random.standard_normal((1, 8, 256, 128)).astype(cupy.float16)
cupy.cuda.Device().synchronize()
t = time.perf_counter()
cupyattn.attention(q, q, q, causal=True)
cupy.cuda.Device().synchronize()
print(time.perf_counter() - t)
"""


def _python(code: str, cache_dir: str) -> str:
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir, "CUPYATTN_QUIET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return r.stdout.strip().splitlines()[-1]


def measure() -> dict:
    from tinylm.model import has_cuda_device

    out: dict = {"cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as cache:
        expr, secs = _python(_NVRTC_ONE, cache).rsplit(" ", 1)
        out["first_attention_kernel"] = expr
        out["first_attention_nvrtc_s"] = round(float(secs), 2)
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "cupyattn", "check", "--json", "--quiet"],
                           env={**os.environ, "CUPY_CACHE_DIR": cache}, capture_output=True, text=True)
        out["check_s"] = round(time.perf_counter() - t, 1)
        out["check_ok"] = r.returncode == 0
        out["check_kernel_builds"] = len(json.loads(r.stdout)["kernels"]) if r.stdout else 0
    if has_cuda_device():
        with tempfile.TemporaryDirectory() as cache:
            out["first_attention_call_s"] = round(float(_python(_FIRST_CALL, cache)), 2)
            out["second_process_call_s"] = round(float(_python(_FIRST_CALL, cache)), 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    res = measure()
    for k, v in res.items():
        print(f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["check_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
