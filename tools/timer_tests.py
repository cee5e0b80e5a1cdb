"""Run the timer-sensitive tests many times, on an idle machine and under CPU load.

    python tools/timer_tests.py --rounds 20              # idle and loaded, 20 rounds each
    python tools/timer_tests.py --rounds 5 --avx2        # and both as an AVX2 CPU (test-avx2)
    python tools/timer_tests.py --rounds 3 --group slow  # the tests that start processes
    make test-timers                                     # the first line (ROUNDS=20)

Each round is one pytest run of the selected tests (docs/timer_tests.md lists them and says why
each is here). "loaded" starts busy processes of its own, one per core, for the round: the tests
then get a share of the CPU, as on a busy CI machine; "idle" runs them alone, as on a fast, quiet
laptop. A test whose outcome depends on how fast the machine is fails in one of the two. Prints
a table of failures per test and condition, and exits 1 if any round failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The tests whose outcome once hung on a timer racing the engine, and the ones that wait on a
# timer for something that will happen (docs/timer_tests.md). "fast": seconds a round, "slow":
# each starts server or engine processes of its own.
GROUPS: dict[str, tuple[str, ...]] = {
    "fast": (
        "tests/test_02_faults.py::test_drain_ends_requests_in_flight_after_the_grace_period",
        "tests/test_02_faults.py::test_an_overlong_prompt_stops_tokenizing_early",
        "tests/test_02_faults.py::test_tokenizing_is_bounded_in_concurrency",
        "tests/test_02_faults.py::test_tokenization_runs_off_the_event_loop",
        "tests/test_02_streaming.py::test_a_consumer_that_stops_early_aborts_its_request",
        "tests/test_05_async.py::test_staging_is_double_buffered_and_guarded",
        "tests/test_05_async.py::test_a_copy_that_is_never_queued_fails_the_wait_instead_of_hanging",
        "tests/test_12_host_copies.py::test_a_host_wait_on_a_copy_end_is_polled_under_a_deadline_not_synchronized",
        "tests/test_12_kv_reports.py::test_the_executor_waits_for_the_report_of_a_step_it_resolved",
        "tests/test_13_transport.py::test_a_timed_out_gloo_transfer_costs_that_request_alone",
    ),
    "slow": (
        "tests/test_common.py::test_sigterm_drains_within_the_grace_period",
        "tests/test_gradebook.py::test_a_student_past_the_time_limit_is_stopped_with_everything_it_started",
        "tests/test_02_streaming.py::test_health_answers_during_a_long_generation",
        "tests/test_02_streaming.py::test_stream_disconnect_aborts_the_request",
        "tests/test_02_streaming.py::test_non_streaming_disconnect_aborts_the_request",
        "tests/test_03_paged.py::test_client_disconnect_frees_blocks",
        "tests/test_10_dp_faults.py::test_a_core_whose_step_raises_fails_its_requests_and_leaves_the_rotation",
        "tests/test_10_dp_faults.py::test_load_returns_to_zero_after_a_burst_with_aborts_and_disconnects",
        "tests/test_10_dp_faults.py::test_drain_ends_requests_within_its_grace_and_refuses_new_ones",
        "tests/test_15_dashboard_browser.py::test_the_live_view_follows_the_engine_in_a_real_browser",
    ),
}


def _spin() -> None:
    while True:
        pass


class Load:
    """`with Load(n):` n busy processes (one per core by default) for the block's duration."""

    def __init__(self, processes: int) -> None:
        self.count = processes
        self.processes: list[multiprocessing.Process] = []

    def __enter__(self) -> Load:
        for _ in range(self.count):
            process = multiprocessing.Process(target=_spin, daemon=True)
            process.start()
            self.processes.append(process)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(timeout=10)


def run_round(tests: tuple[str, ...], env: dict[str, str], extra: list[str]) -> dict[str, str]:
    """One pytest run of `tests`: {node id: "passed" | "failed" | "skipped"}."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                   f"--junitxml={report}", *extra, *tests]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if not report.exists():
            return {"(pytest did not run)": f"failed: {done.stdout[-400:]}{done.stderr[-400:]}"}
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            problem = case.find("failure")
            problem = problem if problem is not None else case.find("error")
            if problem is not None:  # kept with its message: a rare failure must say why
                outcomes[node] = f"failed: {(problem.get('message') or '').strip()[:400]}"
            elif case.find("skipped") is not None:
                outcomes[node] = "skipped"
            else:
                outcomes[node] = "passed"
        return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per condition")
    parser.add_argument("--group", choices=[*GROUPS, "all"], default="fast")
    parser.add_argument("--avx2", action="store_true", help="also with ATEN_CPU_CAPABILITY=avx2")
    parser.add_argument("--conditions", default=None, help="e.g. idle,loaded-avx2 (default: all)")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument(
        "--minutes", type=float, default=None, help="start no round after this many minutes"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = parser.parse_args(argv)
    tests = tuple(t for name, group in GROUPS.items() if args.group in (name, "all") for t in group)
    conditions = ["idle", "loaded"] + (["idle-avx2", "loaded-avx2"] if args.avx2 else [])
    if args.conditions:
        conditions = args.conditions.split(",")
    print(f"$ python tools/timer_tests.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{_cpu_name()}, python {platform.python_version()}")  # fmt: skip
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {len(tests)} tests, "
          f"{args.rounds} rounds x {conditions}, loaded = {args.load} busy processes")  # fmt: skip
    failures: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    runs: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    seconds: dict[str, float] = defaultdict(float)
    begun = time.monotonic()
    for n in range(args.rounds):
        if args.minutes is not None and time.monotonic() - begun > 60 * args.minutes:
            print(f"stopped after {n} rounds: --minutes {args.minutes:g} passed")
            break
        for condition in conditions:  # interleaved: a change in the machine hits every condition
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            if condition.endswith("avx2"):  # as `make test-avx2`
                env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
            started = time.monotonic()
            if condition.startswith("loaded"):
                with Load(args.load):
                    outcomes = run_round(tests, env, args.pytest_args)
            else:
                outcomes = run_round(tests, env, args.pytest_args)
            seconds[condition] += time.monotonic() - started
            failed = [node for node, outcome in outcomes.items() if outcome.startswith("failed")]
            for node, outcome in outcomes.items():
                if outcome != "skipped":
                    runs[node][condition] += 1
                    failures[node][condition] += outcome.startswith("failed")
            print(f"round {n + 1} {condition}: {len(outcomes)} tests, {len(failed)} failed"
                  f" ({time.monotonic() - started:.0f} s){': ' if failed else ''}"
                  f"{', '.join(failed)}", flush=True)  # fmt: skip
            for node in failed:
                print(f"    {node}: {outcomes[node]}", flush=True)
    width = max(len(node) for node in runs) if runs else 10
    print(f"\nfailures / runs per test and condition ({time.strftime('%H:%M:%S')})")
    print(f"{'test':<{width}}  " + "  ".join(f"{c:>12}" for c in conditions))
    for node in sorted(runs):
        cells = [f"{failures[node][c]}/{runs[node][c]}" for c in conditions]
        print(f"{node:<{width}}  " + "  ".join(f"{cell:>12}" for cell in cells))
    total = sum(sum(by.values()) for by in failures.values())
    print(f"total failures: {total}; seconds per condition: "
          + ", ".join(f"{c} {seconds[c]:.0f}" for c in conditions))  # fmt: skip
    return 1 if total else 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
