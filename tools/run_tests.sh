#!/usr/bin/env bash
# `make test`'s suite: pytest on WORKERS workers and, beside it at the lowest CPU priority,
# every walkthrough notebook the suite leaves out (it runs the newest stage's and the edited
# ones). The suite's processes often wait (on processes they start, on sockets, on timers);
# the notebooks use those gaps instead of adding their 200 worker-seconds to the wall time
# (docs/tests.md). Fails when either fails; Ctrl-C or SIGTERM stops both.
#     tools/run_tests.sh PYTHON WORKERS REPORT_DIR [pytest args ...]
set -uo pipefail
python=$1 workers=$2 report_dir=$3
shift 3
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # the suite starts hundreds of processes: keep bytecode caches
# A session of its own, so that one signal reaches the notebooks' pytest and its kernels.
setsid nice -n 19 "$python" -m pytest -q -p no:cacheprovider tests/test_notebooks.py \
    -k test_notebook_runs --other-notebooks > "$report_dir/notebooks.log" 2>&1 &
notebooks=$!
trap 'kill -- -$notebooks 2>/dev/null; exit 130' INT TERM
"$python" -m pytest -q -n "$workers" --dist loadfile --junitxml="$report_dir/suite.xml" "$@"
suite=$?
suite_end=$(date +%s)
wait $notebooks
notebooks_rc=$?
echo "[make test] the notebooks beside the suite (ended $(( $(date +%s) - suite_end )) s after it):"
tail -n 1 "$report_dir/notebooks.log"
[ $notebooks_rc -eq 5 ] && notebooks_rc=0  # none left out: the suite ran them all
[ $suite -eq 0 ] && [ $notebooks_rc -eq 0 ]
