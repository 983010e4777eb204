"""tinylm's NumPy backend against HF transformers on the same GGUF, on the CPU, in one run.

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.cpu_peer [--new-tokens 64] [--threads 1]

Needs torch and transformers (optional peers, not dependencies). Both decode greedily from the
same chat prompt; the script reports decode tokens/s, TTFT, and whether the token ids agree.
This is the measurement behind the README's CPU figures; GPU runs use `python -m benchmarks model`.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (set OPENBLAS_NUM_THREADS to match)")
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from tinylm import load
    from tinylm.gguf_io import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    gen = load(None, backend="numpy")
    prompt_ids = gen.encode(gen.tokenizer.render_chat(args.prompt))
    n = args.new_tokens
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
    print(json.dumps({
        "prompt_tokens": len(prompt_ids), "new_tokens": n, "threads": args.threads,
        "tinylm_numpy": {"decode_tokens_per_s": ours.decode_tokens_per_s, "ttft_ms": ours.ttft_ms},
        "hf_transformers": {"decode_tokens_per_s": (n - 1) / (t2 - t1), "ttft_ms": (t1 - t0) * 1e3,
                            "transformers": transformers.__version__, "torch": torch.__version__},
        "same_token_ids": ids == list(ours.generated_ids)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
