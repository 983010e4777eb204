"""The benchmark CLI (``python -m benchmarks`` / ``cupyattn-bench``) and recorded results.

Modules: ``specs`` (cases, FLOP/byte formulas, sweeps; pure), ``timing`` (CUDA events, L2 flush,
ceilings, pool high-water mark), ``peers`` (cuBLAS, naive CuPy, torch), ``hf_peer`` (HF
transformers Llama from tinylm weights), ``cases`` and ``model_bench`` (runners), ``report``
(record schema, table, JSON/CSV, plots, --record files), ``cli_args`` (every flag's type and range),
``gpu_guard`` (the idle-GPU guard), ``compare`` (a run against the one before), ``readme_table``,
``ran_where`` and ``docs`` (the generated parts of README.md and docs/), ``settle`` (what changed
since the last GPU run). Nothing here is imported by cupyattn.
"""
