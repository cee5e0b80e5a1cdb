#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (no network, about 8 minutes).
#
#   tools/gpu_check.sh --dry-run      # here, on the CPU: list the steps, build .whl/, size the tree
#   tools/gpu_check.sh                # there: install .whl/, the suite on CUDA, the GPU bench
#
# On the device machine (the `device` tool: carry [".whl"], a timeout that leaves time to rerun):
#   1. installs the carried wheels (.whl/: what the image lacks, built here by --dry-run) into
#      /tmp/site, and runs the repository from its folder (PYTHONPATH), not installed;
#   2. `pytest --device cuda` on the newest stage (engines, Triton kernels compiled, bf16 tests);
#   3. the GPU-specific tests of stages 03, 05, 12, 13 and 14 (`-m cuda`, and the Triton kernel
#      tests natively);
#   4. the GPU bench (tools/gpu_bench.py): batch-1 roofline, throughput against transformers,
#      Triton attention against SDPA, async scheduling and CUDA graphs on and off.
# Logs go to $OUT/*.log and the bench to $OUT/plots/gpu/ (the tool brings $OUT back: at most 8
# files, two folders down). Each step has its own time limit, so one that hangs cannot eat the
# others' time; the exit status is the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
SKIP_WHEELS=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --skip-wheels) SKIP_WHEELS=1 ;;  # with --dry-run: do not download (offline, or tests)
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (use --dry-run, --skip-wheels)" >&2; exit 2 ;;
    esac
done

PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
WHEELS=.whl
TREE_LIMIT_BYTES=$((64 * 1024 * 1024))
TIME_LIMIT_SECONDS=480
# What the device image lacks (its page in the device tool lists what it has), pinned to the
# versions this repository is tested with where a local venv knows them.
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn \
gguf openai distro jiter sniffio"
NEWEST=$(ls -d stages/[0-9][0-9]_* | tail -n 1 | sed 's|stages/\([0-9]*\)_.*|\1|')

PYTEST=("$PYTHON" -m pytest -p stages.pytest_plugin --device cuda -q -ra --timeout 180 -p no:cacheprovider)
STEPS=(
    "newest|240|${PYTEST[*]} -n 8 --dist loadfile --stage $NEWEST tests"
    "gpu_tests|90|${PYTEST[*]} -n 4 --dist loadfile --stage 03 --stage 05 --stage 12 --stage 13 --stage 14 -m cuda tests ; ${PYTEST[*]} --stage 03 --stage 14 tests/test_03_attention.py tests/test_14_quant.py -k triton"
    "gpu_bench|150|$PYTHON tools/gpu_bench.py --out $OUT/plots/gpu"
)

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
    fi
    bytes=$(tree_bytes)
    echo "  the tree that would travel: $((bytes / 1024 / 1024)) MiB (limit 64 MiB)"
    if [ "$bytes" -ge "$TREE_LIMIT_BYTES" ]; then
        echo "gpu_check: the tree is over 64 MiB: the device tool would refuse it" >&2
        exit 1
    fi
    total=0
    for step in "${STEPS[@]}"; do IFS='|' read -r _ limit _ <<<"$step"; total=$((total + limit)); done
    echo "  time limits add up to ${total}s (at most ${TIME_LIMIT_SECONDS}s: one device call of 600s, a rerun's margin)"
    if [ "$total" -gt "$TIME_LIMIT_SECONDS" ]; then
        echo "gpu_check: the steps may take ${total}s, over ${TIME_LIMIT_SECONDS}s" >&2
        exit 1
    fi
    exit 0
fi

mkdir -p "$OUT/plots/gpu"
if [ -d "$WHEELS" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || echo "gpu_check: wheel install failed" >&2
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

failed=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    echo "== $name (at most ${limit}s): $command"
    started=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$command" >"$OUT/$name.log" 2>&1
    status=$?
    echo "== $name: exit $status after $(( $(date +%s) - started ))s"
    tail -n 15 "$OUT/$name.log"
    [ "$status" = 0 ] || failed=$((failed + 1))
done
if [ -f "$OUT/plots/gpu/gpu_bench.json" ]; then
    "$PYTHON" -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; \
print(json.dumps(s, indent=1))" "$OUT/plots/gpu/gpu_bench.json"
fi
echo "gpu_check: $failed step(s) failed; logs in $OUT"
exit "$failed"
