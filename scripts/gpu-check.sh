#!/usr/bin/env bash
# gpu-check: every GPU check of fp8scope in one command, for a lent CUDA machine with no network (an H200):
# versions; the project made importable without installing anything from an index; the GPU tests; the
# benchmarks (kernels, linear, GPT throughput) at meaningful sizes; a short fp8-train run per recipe; then a
# summary table (each part pass/FAIL, key numbers, benchmark goals met / NOT met).
#
#   bash scripts/gpu-check.sh                  # on the GPU machine
#   bash scripts/gpu-check.sh --fetch-wheels   # on a machine with network: wheels the GPU machine lacks
#                                              # (orjson, torchao) into .whl/, to carry along with the tree
#
# Uses the machine's own python3 (PYTHON=... to choose another), which must have torch and triton. The
# packages (fp8_trainer, fp8_kernels, fp8_protocol, monitor_server) are linked into a temporary folder on
# PYTHONPATH instead of installed; wheels found in .whl/ are installed into it with pip --no-index (fp8_trainer imports orjson, for which a json-based stand-in is
# written when no wheel came along; torchao is the benchmarks' baseline, left out when missing).
# Each part is bounded by `timeout` (its cap, in seconds), and all together by GPU_CHECK_BUDGET seconds
# (default 300: five minutes; a part that would start with too little left is skipped and counts as failed).
# The parts run in the order of what they tell: the GPU tests; the 1.3b preset's throughput and ceiling
# (where FP8 can pay); the 124m preset's benchmarks; then the rest (kernel bandwidth, Linear, the compiled
# fp8-train CUDA-graph test, fp8-train per recipe, diagnostics). By default only DEFAULT_PARTS run
# (gpu-tests, bench-gpt-1.3b, bench-ceiling-1.3b, after versions and import), whose caps add up to the
# default budget; the others show as "not selected" and count as nothing. GPU_CHECK_PARTS=a,b,... runs the
# parts named instead (a name ending in * names every part it begins: train-*), in the script's order, and
# GPU_CHECK_PARTS=all every part, with a budget for their caps: GPU_CHECK_PARTS=all GPU_CHECK_BUDGET=2000
# (about 33 minutes; on a short lease name fewer). versions and import always run (e.g.
# GPU_CHECK_PARTS=bench-gpt,bench-ceiling).
# Output goes to the terminal and, with the JSON results and the test report, to $OUT/ when OUT is set
# (else bench/results/gpu-check/).
# Exit status: 0 every part passed (benchmark goals are reported, not enforced), 1 a part failed, 2 no CUDA
# GPU here (nothing is run).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    # the GPU machine's python is 3.12 on x86-64 (.library/device/KINDS.md); torchao 0.18 supports torch 2.11
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "orjson>=3.10,<4" "torchao==${TORCHAO_VERSION:-0.18.0}"
elif [ $# -gt 0 ]; then
    echo "usage: bash scripts/gpu-check.sh [--fetch-wheels]" >&2
    exit 2
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "gpu-check: no CUDA GPU ($PY: torch does not import, or torch.cuda.is_available() is False); nothing run"
    exit 2
fi

BUDGET=${GPU_CHECK_BUDGET:-300}
RESULTS=${OUT:-$ROOT/bench/results/gpu-check}
mkdir -p "$RESULTS"
rm -f "$RESULTS"/{kernels,linear,gpt_throughput,gpt_compile,kernel_configs,gpt_ceiling_124m,gpt_ceiling_1.3b,gpt_throughput_1.3b,gpt_compile_1.3b}.json \
    "$RESULTS"/{gpu-tests,gpu-tests-compile}.xml # none left from an earlier run
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
NAMES=() STATUS=() SECS=() DETAILS=()
# bench/gpt_throughput.py's configurations, eager and CUDA-graph ones (bench-gpt), compiled ones (bench-gpt-compile;
# torchao, which the benchmark compiles, among them: measured beside fp8scope compiled)
GPT_EAGER=bf16,delayed,current,bf16+graph,delayed+graph
GPT_COMPILED=torchao,bf16+compile,delayed+compile,bf16+compile+graph,delayed+compile+graph
# the parts a run without GPU_CHECK_PARTS runs (with versions and import): their caps add up to 300 s
DEFAULT_PARTS=gpu-tests,bench-gpt-1.3b,bench-ceiling-1.3b
# the GPU test that compiles (fp8-train --compile captured in CUDA graphs): a part of its own, gpu-tests-compile
COMPILED_GRAPH_TEST="tests/trainer/test_cuda_graph_gpu.py::test_fp8_train_cuda_graph_trains_as_the_eager_loop[compiled]"
RAN=0 # whether the last run_part ran its command

# run_part NAME CAP_SECONDS CMD...: runs CMD under timeout, its output to the terminal and $WORK/NAME.log
run_part() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=$((cap < left ? cap : left))
    NAMES+=("$name")
    RAN=0
    if ! selected "$name"; then
        local why="not in GPU_CHECK_PARTS"
        [ -n "${GPU_CHECK_PARTS:-}" ] || why="not a default part (GPU_CHECK_PARTS=all: every part)"
        STATUS+=("not selected") SECS+=(0) DETAILS+=("$why")
        return 1
    fi
    if [ "$limit" -lt 20 ]; then
        STATUS+=("skipped") SECS+=(0) DETAILS+=("not started: ${left}s of the ${BUDGET}s budget left")
        echo "===== $name: skipped (budget)"
        return 1
    fi
    echo "===== $name (limit ${limit}s): $*"
    RAN=1
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    SECS+=($(($(date +%s) - t0)))
    case $rc in
        0) STATUS+=("pass") ;;
        124 | 137) STATUS+=("TIMEOUT") ;;
        *) STATUS+=("FAIL rc=$rc") ;;
    esac
    DETAILS+=("")
    return "$rc"
}

# selected NAME: whether GPU_CHECK_PARTS (unset: DEFAULT_PARTS; all: every part) names part NAME
selected() {
    local parts=${GPU_CHECK_PARTS:-$DEFAULT_PARTS} want
    [ "$parts" = all ] || [ "$1" = versions ] || [ "$1" = import ] && return 0
    for want in ${parts//,/ }; do
        # shellcheck disable=SC2053  # a pattern on purpose: train-* names every train part
        [[ $1 == $want ]] && return 0
    done
    return 1
}

# set_detail TEXT: the detail column of the last part, if it ran
set_detail() { if [ "$RAN" = 1 ]; then DETAILS[${#DETAILS[@]} - 1]=$1; fi; }

# bench_detail JSON: the detail column of a benchmark that ran: its one-line summary and its goals, from the
# JSON it wrote; a benchmark that wrote none failed
bench_detail() {
    [ "$RAN" = 1 ] || return 0
    if [ ! -f "$1" ]; then
        [ "${STATUS[${#STATUS[@]} - 1]}" = pass ] && STATUS[${#STATUS[@]} - 1]="FAIL (no JSON)"
        set_detail "no results ($1)"
        return 0
    fi
    set_detail "$("$PY" - "$1" <<'EOF' 2>&1 | tail -1
import json, sys
d = json.load(open(sys.argv[1]))
goals = ", ".join(f"{k} {g['value']:.2f} {'met' if g['met'] else 'NOT met'}" for k, g in d["goals"].items())
print(d["summary"] + (f" | goals: {goals}" if goals else " | goals: not assessed"))
EOF
)"
}

# fp8-train --device cuda for each RUN (a recipe; RECIPE-graph: the same with --cuda-graph, each optimizer
# step replayed from a CUDA graph): 12 steps of the 124m preset, its step-12 line in the summary
train_runs() {
    local run recipe line flags cap
    for run in "$@"; do
        # NAME[-compile][-graph]: the recipe, then --compile (the first steps compile) and --cuda-graph
        recipe=${run%%-*} flags=() cap=45
        case $run in *-compile*) flags+=(--compile) cap=150 ;; esac
        case $run in *-graph) flags+=(--cuda-graph) ;; esac
        run_part "train-$run" "$cap" "$PY" -m fp8_trainer.app.cli --device cuda --preset 124m --recipe "$recipe" \
            --steps 12 --batch-size 8 --seq-len 1024 --eval-interval 0 --log-interval 6 --no-progress "${flags[@]}"
        line=$(grep -sE '^step +12 ' "$WORK/train-$run.log" | tail -1 | tr -s ' ')
        if [ "$RAN" = 1 ] && grep -q 'non-finite' "$WORK/train-$run.log"; then
            STATUS[${#STATUS[@]} - 1]="FAIL (non-finite loss)"
        fi
        set_detail "${line:-no step 12 line}"
    done
}

main() {
    echo "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $ROOT at $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"

    # ----- versions -----
    run_part versions 20 "$PY" - <<'EOF'
import platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "CUDA", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
p = torch.cuda.get_device_properties(0)
print(f"gpu {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
      f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
EOF
    local versions
    versions=$("$PY" -c 'import torch, triton; p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, {p.name} sm_{p.major}{p.minor}")' 2>&1 | tail -1)
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
        versions+=", driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
    fi
    set_detail "$versions"

    # ----- the project importable without a package index -----
    local site="$WORK/site"
    mkdir -p "$site"
    ln -s "$ROOT/fp8_kernels" "$site/fp8_kernels"
    ln -s "$ROOT/fp8_trainer" "$site/fp8_trainer"
    ln -s "$ROOT/monitor_server" "$site/monitor_server"
    ln -s "$ROOT/fp8_protocol" "$site/fp8_protocol"
    local wheels=""
    if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
        wheels=$(cd "$ROOT/.whl" && ls ./*.whl | sed 's|^\./||' | tr '\n' ' ')
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$ROOT"/.whl/*.whl
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$PY" -c 'import orjson' >/dev/null 2>&1; then
        # fp8_trainer imports its monitor client, which imports orjson (not on the GPU image); nothing here
        # sends telemetry, so without a carried wheel a standard-library stand-in lets the package import
        cat >"$site/orjson.py" <<'EOF'
"""Stand-in for orjson written by scripts/gpu-check.sh (no orjson wheel carried): the standard json module."""
import json

JSONDecodeError = json.JSONDecodeError
OPT_SERIALIZE_NUMPY = 0


def dumps(obj, default=None, option=None):
    return json.dumps(obj, default=default).encode()


def loads(data):
    return json.loads(data)
EOF
        wheels+="+ an orjson stand-in (no wheel carried)"
    fi
    if run_part import 20 "$PY" -c 'import fp8_kernels, fp8_trainer; print("fp8_trainer and fp8_kernels import")'; then
        set_detail "${wheels:+installed: $wheels}"
    else
        set_detail "$(grep -m1 -E 'Error' "$WORK/import.log") - on a machine with network run 'bash scripts/gpu-check.sh --fetch-wheels' and carry .whl"
        return
    fi
    local ao
    ao=$("$PY" -c 'import torchao; print(torchao.__version__)' 2>/dev/null | tail -1)
    echo "torchao: ${ao:-not importable (benchmarks measure no torchao baseline)}"

    # ----- GPU tests -----
    local tests=(tests/kernels/test_kernels_gpu.py tests/trainer/test_fp8_linear_gpu.py)
    local extra
    for extra in tests/kernels/test_ptx.py tests/kernels/test_launch_key.py tests/kernels/test_triton_block_quantize.py \
        tests/trainer/test_cuda_graph_gpu.py tests/trainer/test_block_scaled_mm_gpu.py; do
        [ -f "$extra" ] && tests+=("$extra")
    done
    # fp8-train's own GPU test is left to the train-* parts below, which run the 124m preset per recipe; the
    # CUDA-graph test of fp8-train --compile (it compiles the tiny preset first) to gpu-tests-compile
    run_part gpu-tests 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts=-rfEs -k "not fp8_train_cli" \
        --deselect "$COMPILED_GRAPH_TEST" --junitxml="$RESULTS/gpu-tests.xml" "${tests[@]}"
    set_detail "$(grep -sE '(passed|failed|error|skipped)' "$WORK/gpu-tests.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')"

    # ----- GPT 1.3b, where the GEMMs FP8 speeds up are the largest share of the step -----
    # eager fp8scope against eager bf16 (the compiled configurations, torchao among them, below); the ceiling
    # of the eager step only (a second 1.3b model, captured in a CUDA graph, would not fit the part's cap)
    run_part bench-gpt-1.3b 80 "$PY" bench/gpt_throughput.py --preset 1.3b --batch-size 8 --seq-len 2048 \
        --warmup 3 --steps 8 --rounds 2 --configs bf16,delayed --out "$RESULTS/gpt_throughput_1.3b.json"
    bench_detail "$RESULTS/gpt_throughput_1.3b.json"
    # what FP8 can buy that step at most: its bf16 step time against the GEMMs FP8 replaces (Amdahl)
    run_part bench-ceiling-1.3b 60 "$PY" bench/gpt_ceiling.py --preset 1.3b --batch-size 8 --seq-len 2048 \
        --step-configs bf16 --out "$RESULTS/gpt_ceiling_1.3b.json"
    bench_detail "$RESULTS/gpt_ceiling_1.3b.json"
    # compiled, each against bf16 compiled (torchao, which the benchmark compiles, among them); three
    # configurations: the benchmark holds all its models at once, and six 1.3b models with their AdamW
    # states would not fit in the GPU's memory
    run_part bench-gpt-1.3b-compile 240 "$PY" bench/gpt_throughput.py --preset 1.3b --batch-size 8 --seq-len 2048 \
        --warmup 3 --steps 8 --rounds 2 --configs bf16+compile,delayed+compile,torchao --out "$RESULTS/gpt_compile_1.3b.json"
    bench_detail "$RESULTS/gpt_compile_1.3b.json"

    # ----- GPT 124m: eager and CUDA-graph configurations, the ceiling, the compiled configurations -----
    run_part bench-gpt 200 "$PY" bench/gpt_throughput.py --preset 124m --batch-size 16 --seq-len 1024 \
        --warmup 5 --steps 20 --rounds 2 --configs "$GPT_EAGER" --out "$RESULTS/gpt_throughput.json"
    bench_detail "$RESULTS/gpt_throughput.json"
    run_part bench-ceiling 90 "$PY" bench/gpt_ceiling.py --preset 124m --batch-size 16 --seq-len 1024 \
        --out "$RESULTS/gpt_ceiling_124m.json"
    bench_detail "$RESULTS/gpt_ceiling_124m.json"
    # each configuration's first steps compile: a part of its own
    run_part bench-gpt-compile 240 "$PY" bench/gpt_throughput.py --preset 124m --batch-size 16 --seq-len 1024 \
        --warmup 5 --steps 20 --rounds 2 --configs "bf16,$GPT_COMPILED" --out "$RESULTS/gpt_compile.json"
    bench_detail "$RESULTS/gpt_compile.json"

    # ----- the rest: kernel bandwidth, one Linear, the compiled GPU test, fp8-train per recipe -----
    run_part bench-kernels 100 "$PY" bench/kernels.py --min-exp 22 --max-exp 28 --step-exp 2 --reps 10 \
        --out "$RESULTS/kernels.json"
    bench_detail "$RESULTS/kernels.json"
    run_part bench-linear 120 "$PY" bench/linear.py --device cuda --reps 10 --out "$RESULTS/linear.json"
    bench_detail "$RESULTS/linear.json"
    run_part gpu-tests-compile 90 "$PY" -m pytest -q -p no:cacheprovider -o addopts=-rfEs \
        --junitxml="$RESULTS/gpu-tests-compile.xml" "$COMPILED_GRAPH_TEST"
    set_detail "$(grep -sE '(passed|failed|error|skipped)' "$WORK/gpu-tests-compile.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')"

    # which path each block-scaled GEMM takes here (native scaled_mm or the emulation), and why
    run_part block-gemm-paths 30 "$PY" scripts/block_gemm_paths.py
    set_detail "$(head -1 "$WORK/block-gemm-paths.log" 2>/dev/null)"

    train_runs delayed current bf16 delayed-graph mxfp8 block delayed-compile-graph

    # ----- diagnostics: where the time goes, and the kernels' launch configurations side by side -----
    run_part kernel-configs 90 "$PY" bench/kernel_configs.py --reps 5 --out "$RESULTS/kernel_configs.json"
    set_detail "$(grep -s -A3 '^best per kernel' "$WORK/kernel-configs.log" | tail -3 | tr -s ' ' | tr '\n' ';')"
    run_part profile 60 "$PY" bench/profile_gpu.py --only "${PROFILE_PARTS:-host}" --out "$RESULTS/profile.txt"
    set_detail "$(grep -sE '^fp8scope delayed .* ms per call' "$WORK/profile.log" | head -1 | tr -s ' ') (host, 512^3 fwd+bwd)"
}

summary() {
    local i failed=0 chosen=0
    echo
    echo "================ gpu-check summary ($(($(date +%s) - START))s of a ${BUDGET}s budget) ================"
    printf '%-27s %-22s %5s  %s\n' part result sec details
    for i in "${!NAMES[@]}"; do
        printf '%-27s %-22s %5s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${DETAILS[$i]}"
        case ${STATUS[$i]} in
            "not selected") ;;
            pass) chosen=$((chosen + 1)) ;;
            *) chosen=$((chosen + 1)) failed=$((failed + 1)) ;;
        esac
    done
    "$PY" - "$RESULTS" <<'EOF' 2>/dev/null
import json, pathlib, sys
met, missed = [], []
for name in ("gpt_throughput_1.3b", "gpt_compile_1.3b", "gpt_throughput", "gpt_compile", "kernels", "linear"):
    path = pathlib.Path(sys.argv[1]) / f"{name}.json"
    if path.exists():
        for key, g in json.loads(path.read_text())["goals"].items():
            (met if g["met"] else missed).append(f"{name}:{key}")
print(f"benchmark goals: {len(met)} met, {len(missed)} NOT met" + (f" ({', '.join(missed)})" if missed else ""))
EOF
    if [ "$failed" -eq 0 ]; then
        echo "result: all $chosen parts passed"
    else
        echo "result: $failed of $chosen parts did not pass"
    fi
    return $((failed > 0))
}

{
    main
    summary | tee "$RESULTS/summary.txt"
    echo "results in $RESULTS"
} 2>&1 | tee "$RESULTS/gpu-check.log"
# the summary's status: the pipeline's first stage ran it; its table says the same
grep -q '^result: all ' "$RESULTS/summary.txt"
