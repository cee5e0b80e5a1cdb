"""Grading a student's copy of a stage, per task (the copy comes from stages/assign.py).

    python -m stages grade ~/hw/03_paged     # each task's tests on the copy, reported per task

Grading runs the repository's suite on the copy (`pytest --stage-path`, as anyone can) in one
worker process and reports, per task, which of the tests its manifest entry lists pass. As in
the CMU llmsys grader, everything is graded on the CPU, and a test that skips here (one that
needs a GPU, say) is reported with its reason instead of counted. A test that runs the whole
engine reaches more than one task's function, so it can fail on another task's stub: the report
names the stubs a failure reached (in its traceback, its captured output, or an exception that
ended a background thread, such as the engine loop), so a student sees "do task 2 first"
rather than a bare failure or a hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.assign import ROOT, numbered
from stages.grade_report import Case as Case
from stages.grade_report import Job as Job
from stages.grade_report import RunResult as RunResult
from stages.grade_report import _base, _stub_numbers
from stages.grade_report import format_report as format_report
from stages.grade_report import graded_status as graded_status
from stages.grade_report import task_state as task_state
from stages.grade_report import task_status as task_status
from stages.grade_report import task_tests as task_tests
from stages.lesson import load_lesson


def run_jobs(
    jobs: Sequence[Job], *, timeout: float = 300.0, show_output: bool = False
) -> list[RunResult]:
    """Run each job's pytest session, one after another in one worker process (the import of
    torch and the model happens once), each with a fresh copy of the suite's modules."""
    with tempfile.TemporaryDirectory(prefix="stages-grade-") as tmp:
        spec, results = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        spec.write_text(
            json.dumps(
                {
                    "out": str(results),
                    "timeout": timeout,
                    "mark_sessions": not show_output,
                    "jobs": [
                        [str(j.copy), list(j.node_ids), j.quick, j.cases, j.stage] for j in jobs
                    ],
                }
            )
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "stages.grade", "--run-jobs", str(spec)],
            cwd=ROOT,
            env=env,
            stdout=None if show_output else subprocess.PIPE,
            stderr=None if show_output else subprocess.STDOUT,
            text=True,
        )
        done = json.loads(results.read_text()) if results.is_file() else []
    output = proc.stdout or ""
    if len(done) != len(jobs):
        raise RuntimeError(f"the test worker stopped (exit {proc.returncode}):\n{output[-4000:]}")
    # each session's own output (what the worker printed after that session's marker)
    parts = re.split(rf"^{_SESSION_MARK}\d+\n", output, flags=re.MULTILINE)[1:]
    outputs = parts if len(parts) == len(jobs) else [output] * len(jobs)
    return [
        RunResult(
            cases=tuple(Case(c[0], c[1], c[2], tuple(c[3]), c[4]) for c in r["cases"]),
            deselected=tuple(r["deselected"]),
            thread_stubs=tuple(r["thread_stubs"]),
            exit_code=r["exit_code"],
            output=text,
        )
        for r, text in zip(done, outputs, strict=True)
    ]


_SESSION_MARK = "--- stages.grade session "  # the worker's line before each session's output


class _Recorder:
    """A pytest plugin for the worker: records each item's outcome and the stubs it reached,
    and fails the running test at once when a background thread dies on a stub (a test waiting
    on that thread would otherwise wait for its timeout).

    pytest-timeout decides when a test's timer runs (the whole test: setup, call, teardown) and
    for how long (`--timeout`, or a test's own `timeout` marker); this plugin arms the timer
    itself, through pytest-timeout's `pytest_timeout_set_timer` hook, for what that plugin does
    not do: never raise inside an import (see `_on_alarm`), and end the test early, with the
    thread's exception as the reason, when a thread stops on a stub."""

    def __init__(self, cases: str = "all") -> None:
        self.which_cases = cases
        self._failed_tests: set[str] = set()
        self.cases: dict[str, dict[str, Any]] = {}
        self.deselected: list[str] = []
        self.thread_stubs: set[int] = set()
        self._armed: Any = None  # the running test's pytest-timeout settings, while timed
        self._stub_death: str | None = None

    def pytest_sessionstart(self, session: Any) -> None:
        self._terminal = session.config.get_terminal_writer()
        previous = self._previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            found = _stub_numbers(str(args.exc_value))
            if found:
                self.thread_stubs |= found
                if self._armed and threading.current_thread() is not threading.main_thread():
                    name = args.thread.name if args.thread else "?"
                    self._stub_death = f"thread {name!r} stopped on {args.exc_value!r}"
                    signal.setitimer(signal.ITIMER_REAL, 0.001)
            previous(args)

        threading.excepthook = hook
        self._previous_alarm = signal.signal(signal.SIGALRM, self._on_alarm)  # POSIX only

    def pytest_sessionfinish(self, session: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous_alarm)
        threading.excepthook = self._previous_hook

    def pytest_timeout_set_timer(self, item: Any, settings: Any) -> bool:
        """pytest-timeout's hook (first result wins over its own SIGALRM timer)."""
        self._armed = settings
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.setitimer(signal.ITIMER_REAL, settings.timeout)
        return True

    def pytest_timeout_cancel_timer(self, item: Any) -> bool:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._armed = None
        return True

    def _on_alarm(self, signum: int, frame: Any) -> None:
        import pytest

        if not self._armed:  # a late signal, after its test ended: nothing to interrupt
            return
        if _inside_import(frame):
            # Raising inside the import system can leave a module lock held or a module half
            # initialised for the rest of the worker's life (every later session's server
            # thread then hangs on its import): let the import finish, try again in 5 ms.
            signal.setitimer(signal.ITIMER_REAL, 0.005)
            return
        reason, self._stub_death = self._stub_death, None
        if reason:
            pytest.fail(reason, pytrace=False)
        from pytest_timeout import dump_stacks

        # where the test was stopped, and every other thread (an engine loop, a server)
        self._terminal.sep("+", title="Timeout: the test's stack (main thread)")
        self._terminal.write("".join(traceback.format_stack(frame)))
        dump_stacks(self._terminal)
        pytest.fail(f"timed out after {self._armed.timeout:.0f} s", pytrace=False)

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        if self.which_cases == "first":
            kept, seen = [], set()
            for item in items:
                if _base(item.nodeid) not in seen:
                    seen.add(_base(item.nodeid))
                    kept.append(item)
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept

    def pytest_runtest_setup(self, item: Any) -> None:
        if self.which_cases == "until-failure" and _base(item.nodeid) in self._failed_tests:
            import pytest

            pytest.skip("an earlier case of this test failed")

    def pytest_deselected(self, items: Sequence[Any]) -> None:
        self.deselected += [item.nodeid for item in items]

    def pytest_runtest_logreport(self, report: Any) -> None:
        case = self.cases.setdefault(
            report.nodeid, {"outcome": "passed", "message": "", "stubs": set(), "seconds": 0.0}
        )
        case["seconds"] += report.duration
        if report.failed:
            self._failed_tests.add(_base(report.nodeid))
            text = report.longreprtext + "".join(content for _, content in report.sections)
            case["stubs"] |= _stub_numbers(text)
            if case["outcome"] != "failed":
                case["outcome"] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                lines = (crash.message if crash else report.longreprtext).strip().splitlines()
                case["message"] = lines[0] if lines else report.when
        elif report.skipped and case["outcome"] == "passed":
            case["outcome"] = "skipped"
            longrepr = report.longrepr
            case["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)

    def result(self, exit_code: int) -> dict[str, Any]:
        cases = [
            [k, v["outcome"], v["message"], sorted(v["stubs"]), v["seconds"]]
            for k, v in self.cases.items()
        ]
        return {
            "cases": cases,
            "deselected": self.deselected,
            "thread_stubs": sorted(self.thread_stubs),
            "exit_code": exit_code,
        }


def _inside_import(frame: Any) -> bool:
    """Whether a frame (or one of its callers) runs inside importlib's machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _preload_server_modules() -> None:
    """Import what a uvicorn server imports lazily (protocols, event loop, lifespan) once, up
    front: then no test's server thread imports while the main thread is interrupted."""
    try:
        import uvicorn

        async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
            return None

        uvicorn.Config(app, log_level="warning").load()
    except Exception:  # only a head start: the tests import what they need anyway
        pass


def _worker(spec_path: str) -> None:
    """`python -m stages.grade --run-jobs SPEC`: the worker process of `run_jobs`."""
    import pytest

    # before the fixtures are set up (pytest loads in the worker only: no decorator above)
    pytest.hookimpl(tryfirst=True)(_Recorder.pytest_runtest_setup)
    _preload_server_modules()
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for index, (copy, node_ids, quick, cases, stage) in enumerate(spec["jobs"]):
        if spec["mark_sessions"]:
            print(f"{_SESSION_MARK}{index}", flush=True)
        for name in list(sys.modules):  # a fresh suite (and stage copy) for every session
            if name == "tests" or name.startswith(("tests.", "stages._external")):
                del sys.modules[name]
        recorder = _Recorder(cases)
        args = ["-q", "-p", "no:cacheprovider", "--stage-path", copy, *node_ids]
        args += ["--timeout", str(spec["timeout"]), "--timeout-method", "signal"]
        args += (["-m", "not slow"] if quick else []) + (["--stage", stage] if stage else [])
        code = pytest.main(args, plugins=[recorder])
        results.append(recorder.result(int(code)))
        Path(spec["out"]).write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads a timed-out test left behind must not keep the worker alive


# ------------------------------------------------------------------------------------- grading


def grade(
    copy: Path | str,
    *,
    stage: str | None = None,
    quick: bool = False,
    tasks: Sequence[int] = (),
    timeout: float = 300.0,
    verbose: bool = False,
) -> tuple[str, bool]:
    """Run the tasks' tests on a stage copy; return the report and whether every task passes."""
    folder = Path(copy).expanduser().resolve()
    match = re.match(r"(\d\d)_", folder.name)
    number = stage or (match[1] if match else None)
    if number is None or not (folder / "__init__.py").is_file():
        raise ValueError(f"{folder} is not a stage copy named NN_name (or pass --stage NN)")
    lesson = load_lesson(number)
    chosen = set(tasks) or set(range(1, len(lesson.tasks) + 1))
    if unknown := chosen - set(range(1, len(lesson.tasks) + 1)):
        raise ValueError(f"stage {lesson.stage} has no task {sorted(unknown)}")
    states = {n: task_state(folder, n, t, lesson.path) for n, t in numbered(lesson)}
    node_ids = [t for n, task in numbered(lesson) if n in chosen for t in task.tests]
    job = Job(folder, tuple(dict.fromkeys(node_ids)), quick, stage=lesson.stage)
    (result,) = run_jobs([job], timeout=timeout, show_output=verbose)
    if result.exit_code not in (0, 1, 5):  # 5: nothing collected (--quick, say): still a report
        raise RuntimeError(
            f"pytest could not run (exit {result.exit_code}):\n{result.output[-3000:]}"
        )
    report = format_report(lesson, folder, result, states, chosen)
    graded = [task_status(task_tests(t, result)) for n, t in numbered(lesson) if n in chosen]
    return report, all(s == "pass" for s in graded)


if __name__ == "__main__" and sys.argv[1:2] == ["--run-jobs"]:
    _worker(sys.argv[2])
