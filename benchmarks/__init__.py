"""The benchmark CLI (``python -m benchmarks`` / ``cupyattn-bench``) and recorded results.

Modules: ``specs`` (cases, FLOP/byte formulas, sweeps; pure), ``timing`` (CUDA events, L2 flush,
ceilings, pool high-water mark), ``peers`` (cuBLAS, naive CuPy, torch), ``hf_peer`` (HF
transformers Llama from tinylm weights), ``cases`` and ``model_bench`` (runners), ``report``
(record schema, table, JSON/CSV, plots, --record files). Nothing here is imported by cupyattn.
"""
