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

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.assign import ROOT, STUB_PATTERN, _docstring_node, numbered
from stages.lesson import Lesson, Task, find_function, load_lesson


@dataclass(frozen=True, slots=True)
class Job:
    """One pytest session on one stage copy."""

    copy: Path
    node_ids: tuple[str, ...]
    quick: bool = False  # -m "not slow"
    stage: str = ""  # --stage NN, for a copy whose folder is not named NN_*
    # which cases of a parametrized test run: "all"; "first" (a quick check that passes);
    # "until-failure" (the rest of a test's cases are skipped once one fails: a quick check
    # that fails)
    cases: str = "all"


@dataclass(frozen=True, slots=True)
class Case:
    """One collected test item (a node id with its [param] suffix) and how it ended."""

    node_id: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""
    stubs: tuple[int, ...] = ()  # the task numbers whose stubs it reached
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class RunResult:
    cases: tuple[Case, ...]
    deselected: tuple[str, ...]
    thread_stubs: tuple[int, ...]  # stubs that ended a background thread, at any point
    exit_code: int
    output: str = ""

    def cases_of(self, node_id: str) -> list[Case]:
        """The items a manifest's node id (without [param]) stands for."""
        return [c for c in self.cases if _matches(c.node_id, node_id)]


def _base(node_id: str) -> str:
    return node_id.partition("[")[0]


def _matches(collected: str, node_id: str) -> bool:
    return collected == node_id or collected.startswith((node_id + "[", node_id + "::"))


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
    return [
        RunResult(
            cases=tuple(Case(c[0], c[1], c[2], tuple(c[3]), c[4]) for c in r["cases"]),
            deselected=tuple(r["deselected"]),
            thread_stubs=tuple(r["thread_stubs"]),
            exit_code=r["exit_code"],
            output=output,
        )
        for r in done
    ]


def _stub_numbers(text: str) -> set[int]:
    return {int(m[1]) for m in STUB_PATTERN.finditer(text)}


class _Recorder:
    """A pytest plugin for the worker: records each item's outcome and the stubs it reached,
    bounds each test phase by a timeout, and fails the running phase at once when a background
    thread dies on a stub (a test waiting on that thread would otherwise wait for its timeout)."""

    def __init__(self, timeout: float, cases: str = "all") -> None:
        self.timeout, self.which_cases = timeout, cases
        self._failed_tests: set[str] = set()
        self.cases: dict[str, dict[str, Any]] = {}
        self.deselected: list[str] = []
        self.thread_stubs: set[int] = set()
        self._in_phase = False
        self._stub_death: str | None = None

    def pytest_sessionstart(self, session: Any) -> None:
        previous = self._previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            found = _stub_numbers(str(args.exc_value))
            if found:
                self.thread_stubs |= found
                if self._in_phase and threading.current_thread() is not threading.main_thread():
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

    def _on_alarm(self, signum: int, frame: Any) -> None:
        import pytest

        if not self._in_phase:  # a late signal, after its phase ended: nothing to interrupt
            return
        reason, self._stub_death = self._stub_death, None
        pytest.fail(reason or f"timed out after {self.timeout:.0f} s", pytrace=False)

    @contextmanager
    def _phase(self) -> Iterator[None]:
        self._in_phase = True
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._in_phase = False

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        if self.which_cases == "first":
            kept, seen = [], set()
            for item in items:
                if _base(item.nodeid) not in seen:
                    seen.add(_base(item.nodeid))
                    kept.append(item)
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept

    def pytest_runtest_setup(self, item: Any) -> Iterator[None]:
        if self.which_cases == "until-failure" and _base(item.nodeid) in self._failed_tests:
            import pytest

            pytest.skip("an earlier case of this test failed")
        with self._phase():
            return (yield)

    def pytest_runtest_call(self, item: Any) -> Iterator[None]:
        with self._phase():
            return (yield)

    def pytest_runtest_teardown(self, item: Any, nextitem: Any) -> Iterator[None]:
        with self._phase():
            return (yield)

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


def _worker(spec_path: str) -> None:
    """`python -m stages.grade --run-jobs SPEC`: the worker process of `run_jobs`."""
    import pytest

    for name in ("pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown"):
        pytest.hookimpl(wrapper=True)(getattr(_Recorder, name))  # pytest loads in the worker only
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for copy, node_ids, quick, cases, stage in spec["jobs"]:
        for name in list(sys.modules):  # a fresh suite (and stage copy) for every session
            if name == "tests" or name.startswith(("tests.", "stages._external")):
                del sys.modules[name]
        recorder = _Recorder(spec["timeout"], cases)
        args = ["-q", "-p", "no:cacheprovider", "--stage-path", copy, *node_ids]
        args += (["-m", "not slow"] if quick else []) + (["--stage", stage] if stage else [])
        code = pytest.main(args, plugins=[recorder])
        results.append(recorder.result(int(code)))
        Path(spec["out"]).write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads a timed-out test left behind must not keep the worker alive


# ------------------------------------------------------------------------------------- grading
def task_state(copy: Path, number: int, task: Task, reference: Path) -> str:
    """'stub' (untouched), 'missing', 'unparsable', 'signature changed' or 'written'."""
    try:
        node = find_function(copy / task.file, task.qualname)
    except SyntaxError:
        return "unparsable"
    if node is None:
        return "missing"
    code = node.body[1:] if _docstring_node(node) else node.body
    first = code[0] if code else None
    if isinstance(first, ast.Raise) and isinstance(first.exc, ast.Call) and first.exc.args:
        message = first.exc.args[0]
        if isinstance(message, ast.Constant) and _stub_numbers(str(message.value)) == {number}:
            return "stub"
    ref = find_function(reference / task.file, task.qualname)

    def signature(n: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
        parts = [n.args, n.returns, *n.decorator_list]
        return (type(n).__name__, *(ast.dump(p) if p else "" for p in parts))

    return "signature changed" if ref and signature(ref) != signature(node) else "written"


@dataclass(frozen=True, slots=True)
class GradedTest:
    node_id: str
    status: str  # pass | fail | skip | not run
    cases: tuple[Case, ...]

    @property
    def blocked_by(self) -> set[int]:
        return {n for c in self.cases if c.outcome in ("failed", "error") for n in c.stubs}


def graded_status(cases: Sequence[Case]) -> str:
    if not cases:
        return "not run"
    if any(c.outcome in ("failed", "error") for c in cases):
        return "fail"
    return "skip" if all(c.outcome == "skipped" for c in cases) else "pass"


def task_tests(task: Task, result: RunResult) -> list[GradedTest]:
    found = [(t, result.cases_of(t)) for t in task.tests]
    return [GradedTest(t, graded_status(cases), tuple(cases)) for t, cases in found]


def task_status(tests: Sequence[GradedTest]) -> str:
    """pass: every test that ran passed (at least one); fail otherwise; else 'not graded'."""
    statuses = {t.status for t in tests}
    if "fail" in statuses:
        return "fail"
    return "pass" if "pass" in statuses else "not graded"


def _why(lesson: Lesson, number: int, test: GradedTest) -> list[str]:
    """What to tell about a failing test: the stubs it reached, or its first failure."""
    failed = [c for c in test.cases if c.outcome in ("failed", "error")]
    others = sorted(test.blocked_by - {number})
    if others:
        names = ", ".join(f"{n} ({lesson.tasks[n - 1].qualname})" for n in others)
        return [f"reached the stub of task {names}: that task comes first"]
    if test.blocked_by:
        return ["reached this task's stub"]
    messages = [c.message for c in failed if c.message]
    return (
        [messages[0] if len(messages[0]) <= 150 else messages[0][:147] + "..."] if messages else []
    )


def format_report(
    lesson: Lesson,
    copy: Path,
    result: RunResult,
    states: dict[int, str],
    chosen: Iterable[int] | None = None,
) -> str:
    """The per-task report: each task's status, each of its tests with its passing cases, the
    first failure's message, and the other tasks whose stubs a failure reached."""
    chosen = set(chosen or range(1, len(lesson.tasks) + 1))
    lines, passed = [], 0
    for number, task in numbered(lesson):
        if number not in chosen:
            continue
        tests = task_tests(task, result)
        status = task_status(tests)
        passed += status == "pass"
        note = {"stub": "not started", "written": ""}.get(states[number], states[number])
        title = f"task {number}  {task.function}: {status.upper()}"
        lines.append(title + (f" ({note})" if note else ""))
        for test in tests:
            counts = sum(c.outcome == "passed" for c in test.cases), len(test.cases)
            detail = f"  {counts[0]}/{counts[1]} cases" if test.cases else ""
            if test.status == "not run":
                slow = any(_matches(d, test.node_id) for d in result.deselected)
                detail = "  (slow: left out by --quick)" if slow else "  (no test for this stage)"
            lines.append(f"    {test.status:<7} {test.node_id}{detail}")
            lines += [f"{' ' * 12}{why}" for why in _why(lesson, number, test)]
    for n in sorted(set(result.thread_stubs)):
        where = lesson.tasks[n - 1].qualname
        lines.append(f"a background thread stopped on the stub of task {n} ({where})")
    head = f"stage {lesson.stage} ({lesson.title}), {copy}: {passed} of {len(chosen)} tasks pass"
    return "\n".join([head, "", *lines])


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
