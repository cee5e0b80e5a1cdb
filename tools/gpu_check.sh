#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (no network, about 8 minutes).
#
#   tools/gpu_check.sh --dry-run      # here, on the CPU: list the steps, build .whl/, size the tree
#   tools/gpu_check.sh                # there: install .whl/, the suite on CUDA, the GPU bench
#
# On the device machine (the `device` tool: carry [".whl"], a timeout that leaves time to rerun):
#   0. installs the carried wheels (.whl/: what the image lacks, built here by --dry-run) into
#      /tmp/site, and the repository itself as an editable install (its pytest plugin);
#   1. correctness on the newest stage, `--device cuda`: CUDA graph tokens = eager tokens, the
#      fused kernels and the split-K / folded decode attention against their references, the
#      paged attention, the async path on CUDA;
#   2. the GPU bench (tools/gpu_bench.py): batch-1 roofline, throughput against transformers,
#      Triton attention against SDPA, async scheduling and CUDA graphs on and off (every cell's
#      greedy tokens must agree; each cell's error is recorded and the bench goes on);
#   3. the GPU-specific tests of stages 03, 05, 12, 13 and 14 (`-m cuda`), and the Triton
#      kernel tests of stages 03 and 14 natively;
#   4. an NCCL process group of world size 1, created and used once (tools/nccl_check.py);
#   5. the step profile of stages 05 and 15 on CUDA: host time per phase, kernels per decode
#      step, and their torch.profiler traces;
#   6. `pytest --device cuda` on the newest stage (engines, Triton kernels compiled, bf16 tests).
# Logs (and the profile's traces) go to $OUT/gpu_check_logs.tar.gz, the bench and the profile to
# $OUT/plots/gpu/ (the tool brings $OUT back: at most 8 files, two folders down). One deadline covers the whole script, the install included
# (DEADLINE_SECONDS, 420): each step gets its own limit or what is left, whichever is less, so
# one that hangs cannot eat the others' time. Each step runs in its own process group, which is
# killed when the step ends (no worker outlives its step), and each has its own exit status in
# the summary: the exit status is the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
SKIP_WHEELS=0
STEPS_FILE=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --skip-wheels) SKIP_WHEELS=1 ;;  # with --dry-run: do not download (offline, or tests)
        --steps=*) STEPS_FILE=${arg#--steps=} ;;  # tests: these "name|seconds|command" lines
                                                  # instead of the steps below, no set-up
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (use --dry-run, --skip-wheels)" >&2; exit 2 ;;
    esac
done

STARTED=$(date +%s)
DEADLINE_SECONDS=${DEADLINE_SECONDS:-420}
DEADLINE_MARGIN=${DEADLINE_MARGIN:-15}  # kept for the summary and the archive at the end
SHORTEST_STEP=${SHORTEST_STEP:-10}  # a step with less time left than this is not started
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
WHEELS=.whl
TREE_LIMIT_BYTES=$((64 * 1024 * 1024))
# What the device image lacks (its page in the device tool lists what it has), pinned to the
# versions this repository is tested with where a local venv knows them.
# fastapi >= 0.160 imports opentelemetry-api; openai >= 3 runs on httpx2 (first GPU run,
# 2026-11-26: both missing there failed every server test); ruff lints the assignments' copies.
# The tests' own plugins and imports travel too (an image without them failed whole steps), and
# so do the needs of every wheel carried (they install with --no-deps): `--dry-run` lists any
# requirement of a carried wheel that is neither carried nor in IMAGE_HAS.
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn \
gguf openai distro jiter sniffio opentelemetry-api httpx2 httpcore2 \
truststore ruff pytest-xdist execnet pytest-timeout hypothesis sortedcontainers \
prometheus-client"
# What the lent machines' image holds (the device tool's KINDS.md, 2026-11-17), by the names
# wheels' metadata use: a carried wheel may need these without carrying them.
IMAGE_HAS="annotated-doc anyio attrs certifi click h11 httpcore httpx idna jinja2 markupsafe numpy packaging \
pluggy iniconfig pytest pyyaml requests sniffio tqdm typing-extensions typing_extensions urllib3 \
zipp sentencepiece regex psutil filelock fsspec colorama"
NEWEST=$(ls -d stages/[0-9][0-9]_* | tail -n 1 | sed 's|stages/\([0-9]*\)_.*|\1|')

# -v: each result is in the log as it ends, so a step stopped at its limit still says what passed.
# Left out on the GPU machine: the notebooks (they run the embedded model, whose 94 MiB GGUF cannot
# travel: the device tool carries 64 MiB) and the GPU bench's quick form (a CPU smoke test under
# the Triton interpreter; step 1 runs the real bench).
PYTEST=("$PYTHON" -m pytest -p stages.pytest_plugin --device cuda -v -ra --timeout 180 -p no:cacheprovider
    --ignore tests/test_notebooks.py
    --deselect tests/test_gpu_check.py::test_the_gpu_bench_runs_end_to_end_in_its_quick_cpu_form)
# Correctness first, so that one call always yields a verdict on the tokens: graph tokens =
# eager tokens, every Triton kernel against its reference, the async path on CUDA, all on the
# newest stage (about 90 s measured for these files' CPU share; compiling adds to it on a GPU).
# Then the bench (which also asserts every batch-1 cell's greedy tokens agree, graphs on and
# off), then the rest: each later step gets its cap or what is left of the deadline. Measured
# on an H100: the bench 160 s, the `-m cuda` tests 55 s, the newest stage 202 s. Limits can be
# lowered for a rerun (CORRECTNESS_SECONDS, BENCH_SECONDS, ...) when less device time is left.
# One command per step: a step of two commands would report the second's status only.
CORRECTNESS_TESTS="tests/test_15_cuda_graphs.py tests/test_15_cuda_graph_plan.py \
tests/test_15_fused_kernels.py tests/test_15_decode_attention.py tests/test_03_attention.py \
tests/test_05_async_cuda.py"
STEPS=(
    "correctness|${CORRECTNESS_SECONDS:-100}|${PYTEST[*]} -n 6 --dist load --stage $NEWEST $CORRECTNESS_TESTS"
    "gpu_bench|${BENCH_SECONDS:-180}|$PYTHON tools/gpu_bench.py --out $OUT/plots/gpu"
    "gpu_tests|${GPU_TESTS_SECONDS:-60}|${PYTEST[*]} -n 6 --dist loadfile --stage 03 --stage 05 --stage 12 --stage 13 --stage 14 -m cuda tests"
    "triton_tests|${TRITON_TESTS_SECONDS:-30}|${PYTEST[*]} -n 6 --dist load --stage 03 --stage 14 tests/test_03_attention.py tests/test_14_quant.py -k triton"
    "nccl|${NCCL_SECONDS:-20}|$PYTHON tools/nccl_check.py"
    "step_profile|${PROFILE_SECONDS:-60}|$PYTHON -m stages.common.tooling.step_profile --device cuda --stages 05 15 --requests 1 64 256 --out $OUT/plots/gpu/step_profile.json"
    "newest|${NEWEST_SECONDS:-220}|${PYTEST[*]} -n 12 --dist loadfile --stage $NEWEST tests"
)

if [ -n "$STEPS_FILE" ]; then
    mapfile -t STEPS <"$STEPS_FILE"
fi

tree_bytes() {
    # What the device tool sends: tracked and untracked-not-ignored files, plus the carried .whl/.
    local files wheels=0
    files=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
        | tail -n 1 | cut -f1)
    [ -d "$WHEELS" ] && wheels=$(du -sb "$WHEELS" | cut -f1)
    echo $(( ${files:-0} + wheels ))
}

pinned() {
    # "name==version" for each package a local venv has, else the bare name.
    local venv_python=.venv/bin/python name version
    for name in $PACKAGES; do
        version=""
        [ -x "$venv_python" ] && version=$("$venv_python" -c \
            "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null)
        if [ -n "$version" ]; then echo "$name==$version"; else echo "$name"; fi
    done
}

build_wheels() {
    mkdir -p "$WHEELS"
    # The device runs Python 3.12 on x86-64 Linux: binary wheels for that, one version each.
    "${DOWNLOAD_PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$WHEELS" $(pinned)
}

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check --dry-run: what a GPU machine would run (newest stage: $NEWEST)"
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit command <<<"$step"
        echo "  [$name, at most ${limit}s] $command"
    done
    echo "  wheels to carry in $WHEELS/: $(pinned | tr '\n' ' ')"
    if [ "$SKIP_WHEELS" = 0 ]; then
        build_wheels || { echo "gpu_check: could not build $WHEELS/ (pip download failed)" >&2; exit 1; }
        echo "  built $WHEELS/: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)"
        missing=$("${DOWNLOAD_PYTHON:-python3}" tools/wheel_needs.py "$WHEELS" $IMAGE_HAS)
        if [ -n "$missing" ]; then
            echo "gpu_check: carried wheels need what is neither carried nor in the image: $missing" >&2
            exit 1
        fi
        echo "  every carried wheel's requirements are carried or in the image"
    fi
    bytes=$(tree_bytes)
    echo "  the tree that would travel: $((bytes / 1024 / 1024)) MiB (limit 64 MiB)"
    if [ "$bytes" -ge "$TREE_LIMIT_BYTES" ]; then
        echo "gpu_check: the tree is over 64 MiB: the device tool would refuse it" >&2
        exit 1
    fi
    total=0
    for step in "${STEPS[@]}"; do IFS='|' read -r _ limit _ <<<"$step"; total=$((total + limit)); done
    echo "  the steps' caps add up to ${total}s; one deadline of ${DEADLINE_SECONDS}s covers the run, install included"
    echo "  in order, correctness first: a step past the deadline gets what is left, or is not run"
    if [ "$DEADLINE_SECONDS" -gt 420 ]; then
        echo "gpu_check: a deadline of ${DEADLINE_SECONDS}s leaves no rerun in a 600s device call" >&2
        exit 1
    fi
    exit 0
fi

mkdir -p "$OUT/plots/gpu" "$OUT/logs"
if [ -n "$STEPS_FILE" ]; then
    :  # a test's steps: no install, no environment report
elif [ -d "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || echo "gpu_check: wheel install failed" >&2
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" PATH="/tmp/site/bin:$PATH"
fi
# The repository as an editable install: its pytest plugin's entry point is what lets
# `pytest --stage-path DIR` run from any directory (the assignments' tests do).
if [ -z "$STEPS_FILE" ] && ! "$PYTHON" -m pip install -q --no-deps --no-index --no-build-isolation -e . \
    >"$OUT/logs/install.log" 2>&1; then
    echo "gpu_check: editable install failed (install.log): running from PYTHONPATH" >&2
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1
[ -n "$STEPS_FILE" ] || {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/logs/env.log" 2>&1
cat "$OUT/logs/env.log" 2>/dev/null

run_step() {
    # One step in its own process group (setsid), stopped at its limit (TERM, then KILL ten
    # seconds later) and reaped whatever happens: nothing it started survives into the next step.
    local name=$1 limit=$2 command=$3 group watchdog status
    setsid bash -c "$command" >"$OUT/logs/$name.log" 2>&1 &
    group=$!
    # The watchdog is a process group too, so that stopping it stops its sleep as well.
    # It leaves a mark when it fires: a status of 128 or more is then "stopped at its limit",
    # otherwise the step died of a signal of its own (a segfault is not a timeout).
    rm -f "$OUT/logs/$name.limit"
    setsid bash -c "sleep $limit; touch '$OUT/logs/$name.limit'; kill -TERM -- -$group; sleep 10; \
kill -KILL -- -$group" >/dev/null 2>&1 &
    watchdog=$!
    wait "$group"
    status=$?
    kill -KILL -- "-$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
    kill -KILL -- "-$group" 2>/dev/null  # its stragglers (pytest-xdist workers, engine cores)
    return "$status"
}

failed=0
summary=()
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    left=$(( DEADLINE_SECONDS - ( $(date +%s) - STARTED ) - DEADLINE_MARGIN ))
    if [ "$left" -lt "$SHORTEST_STEP" ]; then
        echo "== $name: not run, the deadline (${DEADLINE_SECONDS}s) is reached"
        summary+=("$name: not run (deadline)")
        failed=$((failed + 1))
        continue
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s): $command"
    started=$(date +%s)
    run_step "$name" "$limit" "$command"
    status=$?
    took=$(( $(date +%s) - started ))
    echo "== $name: exit $status after ${took}s"
    tail -n 15 "$OUT/logs/$name.log"
    if [ -f "$OUT/logs/$name.limit" ]; then
        status="$status (stopped at its ${limit}s limit)"
    elif [ "$status" -ge 128 ]; then
        status="$status (killed by signal $((status - 128)), not by its limit)"
    fi
    summary+=("$name: exit $status after ${took}s")
    [ "$status" = 0 ] || failed=$((failed + 1))
done
printf 'gpu_check: %s\n' "${summary[@]}"
# The device tool brings back at most 8 files: every log and the profile's traces travel as one
# archive; the bench's and the profile's JSON and plots beside it.
mv "$OUT"/plots/gpu/*_trace.json* "$OUT/logs/" 2>/dev/null
tar -czf "$OUT/gpu_check_logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
if [ -f "$OUT/plots/gpu/gpu_bench.json" ]; then
    "$PYTHON" -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; \
print(json.dumps(s, indent=1))" "$OUT/plots/gpu/gpu_bench.json"
fi
echo "gpu_check: $failed step(s) failed; logs in $OUT"
exit "$failed"
