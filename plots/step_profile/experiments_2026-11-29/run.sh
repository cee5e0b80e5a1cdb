#!/usr/bin/env bash
# Rerun the experiments stage 05's README reports as failed or not adopted, on this machine,
# against the committed code (HEAD). Each patch is applied to a temporary worktree, never to
# this tree. Output: the raw lines, to stdout (experiments.log beside this script is one run).
#
#   bash plots/step_profile/experiments_2026-11-29/run.sh > experiments.log
set -euo pipefail
root=$(git rev-parse --show-toplevel)
here="$root/plots/step_profile/experiments_2026-11-29"
py="${PYTHON:-$root/.venv/bin/python}"
tree=$(mktemp -d)
git -C "$root" worktree add -q --detach "$tree" HEAD
trap 'git -C "$root" worktree remove --force "$tree"' EXIT
profile() {  # $1: the tree to profile; stage 15 at 1 and 64 requests, the table's rows
    (cd "$1" && "$py" -m stages.common.tooling.step_profile --stages 15 --requests 1 64 \
        2>/dev/null | grep '15_full ')
}
echo "columns: stage reqs step_us us/req tok/s CPU/step own_CPU/step <phases...> switches/step"
for patch in free_inputs_on_engine_thread no_greedy_sampling_tensors; do
    git -C "$tree" checkout -q -- .
    git -C "$tree" apply "$here/$patch.patch"
    for round in 1 2 3; do
        echo "=== $patch, round $round: HEAD"; profile "$root"
        echo "=== $patch, round $round: patched"; profile "$tree"
    done
done
echo "=== inline_step.py (stage 05, tiny model)"
for mode in thread inline; do "$py" "$here/inline_step.py" $mode tiny 05 1 64 256 2>/dev/null; done
echo "=== inline_step.py (stage 05, embedded model), two rounds"
for round in 1 2; do
    for mode in thread inline; do "$py" "$here/inline_step.py" $mode embedded 05 1 64 2>/dev/null; done
done
