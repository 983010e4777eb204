#!/usr/bin/env bash
# On the development machine (it has the network): put into .carry/ what a GPU machine without
# network lacks, for benchmarks/gpu_run.sh to pick up there. .carry/ is git-ignored; hand it to
# the device tool as a carried path (it must stay under 64 MiB with the tree):
#   .carry/wheels/gguf-*.whl       tinylm reads GGUF files; the GPU image has no gguf package
#                                  (its dependencies numpy, pyyaml, requests, tqdm are there)
#   .carry/wheels/nvidia_ml_py-*.whl  NVML's binding for the benchmark's idle-GPU guard (pure Python)
#   .carry/smollm2-4layers.gguf    the first 4 of SmolLM2-135M's 30 layers, same tokenizer and
#                                  embedding (~40 MB; the whole 98 MB file is too big to carry)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .carry/wheels
ver="$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .carry/wheels "gguf==$ver"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .carry/wheels "nvidia-ml-py>=12"
[ -f .carry/smollm2-4layers.gguf ] || "$PY" -m tinylm.reduce_gguf .carry/smollm2-4layers.gguf --layers 4
du -sh .carry
