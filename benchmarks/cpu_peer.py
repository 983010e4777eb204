"""tinylm's NumPy backend against HF transformers on the same GGUF, on the CPU, in one run.

    python -m benchmarks.cpu_peer [--new-tokens 64] [--threads default,1] [--runs 2] [--json PATH]

Needs torch and transformers (optional peers, not dependencies). For each thread setting a fresh
process runs both sides with the same limit: ``default`` leaves OpenBLAS and torch at their own
defaults (one thread per core), ``N`` sets OPENBLAS_NUM_THREADS / OMP_NUM_THREADS and torch's
threads to N. Both decode greedily from the same chat prompt; the script reports decode tokens/s,
TTFT, their ratios (tinylm / HF) and whether the token ids agree. This is the measurement behind
the README's CPU figures; GPU runs use ``python -m benchmarks model``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _one(new_tokens: int, prompt: str, threads: str) -> dict:
    """Both generations in this process (its BLAS thread count was fixed at startup)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from tinylm import load
    from tinylm.gguf_io import default_model_path

    if threads != "default":
        torch.set_num_threads(int(threads))
    path = default_model_path()
    gen = load(None, backend="numpy")
    prompt_ids = gen.encode(prompt, chat=True)
    n = new_tokens
    ours = gen.generate(prompt_ids, n, ignore_eos=True)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        ids = [int(nxt)]
        for _ in range(n - 1):  # greedy decode with HF's KV cache
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(int(nxt))
        t2 = time.perf_counter()
    hf_tps = (n - 1) / (t2 - t1)
    return {
        "threads": threads, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "prompt_tokens": len(prompt_ids), "new_tokens": n,
        "tinylm_numpy": {"decode_tokens_per_s": ours.decode_tokens_per_s, "ttft_ms": ours.ttft_ms},
        "hf_transformers": {"decode_tokens_per_s": hf_tps, "ttft_ms": (t1 - t0) * 1e3,
                            "transformers": transformers.__version__, "torch": torch.__version__},
        "decode_ratio": ours.decode_tokens_per_s / hf_tps,
        "ttft_ratio": ours.ttft_ms / ((t1 - t0) * 1e3),
        "same_token_ids": ids == list(ours.generated_ids)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", default="default,1",
                   help="comma-separated thread settings, each 'default' or a count (default,1)")
    p.add_argument("--runs", type=int, default=2, help="runs per thread setting (fresh process each)")
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_one(args.new_tokens, args.prompt, args.threads)))
        return 0
    runs = []
    for threads in [t.strip() for t in args.threads.split(",") if t.strip()]:
        env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARS}
        if threads != "default":
            env.update({k: threads for k in _THREAD_VARS})
        for _ in range(args.runs):
            r = subprocess.run([sys.executable, "-m", f"{__package__}.cpu_peer", "--child", "--threads", threads,
                                "--new-tokens", str(args.new_tokens), "--prompt", args.prompt],
                               env=env, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            x = runs[-1]
            print(f"threads {threads:>7}: tinylm {x['tinylm_numpy']['decode_tokens_per_s']:6.1f} tok/s, "
                  f"TTFT {x['tinylm_numpy']['ttft_ms']:6.0f} ms | HF {x['hf_transformers']['decode_tokens_per_s']:6.1f}"
                  f" tok/s, TTFT {x['hf_transformers']['ttft_ms']:6.0f} ms | decode ratio "
                  f"{x['decode_ratio']:.2f}x, same ids: {x['same_token_ids']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
