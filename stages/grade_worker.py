"""The grading worker: `python -m stages.grade_worker SPEC`, started by stages/grade.py.

It runs each job's pytest session in turn, in this one process (Python, torch and the suite's
imports are paid once), and records per test item how it ended, the task stubs it reached, and
the task whose function raised, or, for a test that timed out, the task whose function it hung
in (`Recorder._hang`). It also writes, before and after every test, which test is
running, and by when it must have ended: a test that kills the process (a signal, such as
SIGSEGV from a kernel fed nonsense) ends the worker with no report of its own, and the grader
then names that test as crashed and carries on with the rest in a fresh worker
(stages/grade.py, `run_jobs`). A test that outlives its timer (a teardown that never returns, a
main thread that never gets back to Python) ends the worker the same way, named as hung: by the
worker itself when its alarm cannot fail the test, or by the grader at the deadline.
"""

from __future__ import annotations

import ast
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Generator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from stages.grade_report import (
    AST_BROKEN_EXIT,
    HUNG_EXIT,
    SESSION_MARK,
    _base,
    _matches,
    _stub_numbers,
)

NO_PROGRESS = "no progress: a step scheduled nothing"  # LLMEngine.check_progress's message
MESSAGE_LIMIT = 4000  # characters of a failure's message kept for the report
# When a test's timer runs out, the stacks of every thread are sampled this many times, this
# far apart, before the test fails: a task function on a stack in every sample is where it hung.
HANG_SAMPLES, HANG_INTERVAL = 20, 0.01
# After a test failed (its timer ran out, or a phase raised), its teardown gets this long (at
# most the test's own timer) before the worker gives up on it; the alarm waits this long (the
# same cap) for the main thread to leave an import or pytest's reporting.
TEARDOWN_LIMIT, DEFER_LIMIT = 30.0, 10.0
# The grader (stages/grade.py) kills the worker this long after the worker's own limits above
# ran out: the worker names the hang itself when it can, the grader when it cannot (a main
# thread that never returns to Python, where no signal handler runs).
DEADLINE_SLACK = 2.0
# Seconds outside any test (collecting a session, starting the next) before the grader kills it.
IDLE_LIMIT = 600.0


class Recorder:
    """A pytest plugin for the worker: records each item's outcome, the stubs it reached and
    the task function a failure was raised in, and fails the running test at once when a
    background thread dies on a stub (a test waiting on that thread would otherwise wait for
    its timeout).

    pytest-timeout decides when a test's timer runs (the whole test: setup, call, teardown) and
    for how long (`--timeout`, or a test's own `timeout` marker); this plugin arms the timer
    itself, through pytest-timeout's `pytest_timeout_set_timer` hook, for what that plugin does
    not do: never raise inside an import (see `_on_alarm`), and end the test early, with the
    thread's exception as the reason, when a thread stops on a stub."""

    def __init__(
        self,
        cases: str = "all",
        *,
        spans: Sequence[Sequence[Any]] = (),
        skip: Sequence[str] = (),
        failed: Sequence[str] = (),
        progress: Path | None = None,
        job: int = 0,
        task_of: dict[str, int] | None = None,
        task_limit: float | None = None,
        sentinel: str = "",
    ) -> None:
        self.which_cases = cases
        self.sentinel = sentinel  # stages/grade_check.py's test that must fail: run last
        # a task's tests share a time budget: once spent, its other tests fail unrun, so one
        # task's hang costs that task, not the student's whole grading (the later tasks too)
        self._task_of, self._task_limit = dict(task_of or {}), task_limit
        self._spent: dict[int, float] = {}
        self._failed_tests: set[str] = set(failed)
        self._skip = set(skip)  # items an earlier worker ran (it crashed): not run again
        # (task number, file, first line, last line, qualname) of each task function
        self._spans = [
            (int(n), str(Path(p).resolve()), int(a), int(b), q) for n, p, a, b, q in spans
        ]
        self._progress, self.job = progress, job
        self.running: str | None = None
        self.cases: dict[str, dict[str, Any]] = {}
        self.deselected: list[str] = []
        self.thread_stubs: set[int] = set()
        self._thread_where: dict[str, str] = {}
        self._armed: Any = None  # the running test's pytest-timeout settings, while timed
        self._stub_death: str | None = None
        self._interruptible = False  # in a test's setup, call or teardown (see `_phase`)
        self._samples: list[list[str]] = []  # task functions on the stacks, after the timer ran out
        self._hangs: dict[str, str] = {}  # a timed-out test: the task function it hung in, or ""
        self._limit = 0.0  # the running test's timer, in seconds (0: not armed)
        self._failed = False  # the running test failed: its teardown runs on its own limit
        self._deferred_since: float | None = None  # the alarm waits for the main thread
        self.stacks: Any = None  # a file on the worker's own stderr, for stacks of a hang

    # ------------------------------------------------------------------------- where it failed
    def where(self, exc: BaseException | None) -> str:
        """'N|qualname|file.py:line' of the deepest frame inside a task function (the final
        exception's traceback first, then the exceptions it chains); '' if none."""
        seen: set[int] = set()
        while self._spans and exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            frames: list[tuple[str, int]] = []
            tb: TracebackType | None = exc.__traceback__
            while tb is not None:
                frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
                tb = tb.tb_next
            for filename, line in reversed(frames):
                if found := self._in_task(filename, line):
                    return found
            exc = exc.__cause__ or exc.__context__
        return ""

    def _in_task(self, filename: str, line: int) -> str:
        """'N|qualname|file.py:line' when a line of a file lies in a task function, else ''."""
        path = str(Path(filename).resolve())
        for number, span_path, first, last, qualname in self._spans:
            if path == span_path and first <= line <= last:
                return f"{number}|{qualname}|{Path(path).name}:{line}"
        return ""

    def _tasks_on_stacks(self) -> list[str]:
        """The task functions on every thread's stack now, deepest first ('N|qualname|place')."""
        found = []
        for frame in sys._current_frames().values():
            while frame is not None:
                if where := self._in_task(frame.f_code.co_filename, frame.f_lineno):
                    found.append(where)
                frame = frame.f_back
        return found

    def _hang(self) -> str:
        """Where a timed-out test hung: the deepest task function that was on a stack in every
        sample ('' when none was). A loop inside a task function is in all of them; an engine
        loop that never ends but calls a task function each step (task 1's deadlines, say) is
        not, so the timer's moment never blames the function that happened to run then."""
        key = lambda where: where.rpartition("|")[0]  # the task and function, not the line
        always = set.intersection(*({key(w) for w in sample} for sample in self._samples))
        last = self._samples[-1] if self._samples else []
        return next((w for w in last if key(w) in always), "")

    # ------------------------------------------------------------------------- progress
    def _save(self) -> None:
        """Which test runs, and what the session recorded so far (read after a crash)."""
        if self._progress is None:
            return
        temporary = self._progress.with_suffix(".tmp")
        state = {
            "job": self.job,
            "running": self.running,
            "limit": self._limit,
            "deadline": time.time() + self._allowed(),
            "partial": self.result(-1),
        }
        temporary.write_text(json.dumps(state))
        os.replace(temporary, self._progress)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.running = nodeid
        self._save()

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.running = None
        self._save()

    def _allowed(self) -> float:
        """Seconds from now the grader waits before it kills this worker as hung."""
        if not self.running or not self._limit:  # between tests, or a test with no timer
            return IDLE_LIMIT
        return self._limit + self._teardown_limit() + self._defer_limit() + DEADLINE_SLACK

    def _teardown_limit(self) -> float:
        return min(TEARDOWN_LIMIT, self._limit)

    def _defer_limit(self) -> float:
        return min(DEFER_LIMIT, self._limit)

    def _give_up(self, why: str) -> None:
        """The running test outlived what the alarm can do: print every thread's stack to the
        worker's output, and end the worker (the grader names the test as hung)."""
        out = self.stacks or sys.__stderr__
        out.write(f"\n+++ the grading worker gives up on {self.running}: {why}\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        _exit(HUNG_EXIT)

    # ------------------------------------------------------------------------- the timer
    def pytest_sessionstart(self, session: Any) -> None:
        self._terminal = session.config.get_terminal_writer()
        root = Path(session.config.rootpath)
        self._task_of = {_relative(t, root): n for t, n in self._task_of.items()}
        previous = self._previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if self.running and self.running not in self._thread_where:
                self._thread_where[self.running] = self.where(args.exc_value)
            found = _stub_numbers(str(args.exc_value))
            if found:
                self.thread_stubs |= found
                on_thread = threading.current_thread() is not threading.main_thread()
                if self._armed and on_thread and not self._failed:
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
        self._armed, self._samples = settings, []
        self._limit, self._failed, self._deferred_since = settings.timeout, False, None
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.setitimer(signal.ITIMER_REAL, settings.timeout)
        return True

    def pytest_timeout_cancel_timer(self, item: Any) -> bool:
        """pytest-timeout stops the timer when the test ends, and also when a phase fails
        (`pytest_exception_interact`, for a debugger): a failed test's teardown would then run
        with no timer at all. That teardown gets its own limit instead."""
        if self.running and self._armed and not self._failed:  # a phase failed: teardown next
            self._failed = True
            signal.setitimer(signal.ITIMER_REAL, self._teardown_limit())
            return True
        if self.running and self._failed:  # a later phase failed too: its limit still runs
            return True
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._armed, self._limit, self._failed = None, 0.0, False
        return True

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if not self._armed:  # a late signal, after its test ended: nothing to interrupt
            return
        if self._failed:  # failed, and its teardown has not returned within its limit
            self._give_up(f"its teardown did not return within {self._teardown_limit():.0f} s")
        if not self._stub_death and len(self._samples) < HANG_SAMPLES and self._spans:
            self._samples.append(self._tasks_on_stacks())  # where it hangs, before failing it
            signal.setitimer(signal.ITIMER_REAL, HANG_INTERVAL)
            return
        if _inside_lock_holder(frame):
            # Raising inside the import system or the logging module can leave a lock held (a
            # module lock, logging's module lock) or a module half initialised for the rest of
            # the worker's life: every later session's server thread then hangs on its import
            # or its first log line (seen: a uvicorn thread stuck in logging._acquireLock).
            # Let the main thread leave that code, and try again in 5 ms.
            self._defer("inside an import or the logging module")
            return
        if not self._interruptible:  # pytest is reporting: wait for the next phase
            self._defer("outside the test's setup, call and teardown")
            return
        self._deferred_since = None
        # the test fails now; its teardown (which stops its servers and threads) gets its own limit
        self._failed = True
        signal.setitimer(signal.ITIMER_REAL, self._teardown_limit())
        reason, self._stub_death = self._stub_death, None
        if reason:
            pytest.fail(reason, pytrace=False)
        from pytest_timeout import dump_stacks

        # where the test was stopped, and every other thread (an engine loop, a server)
        self._terminal.sep("+", title="Timeout: the test's stack (main thread)")
        self._terminal.write("".join(traceback.format_stack(frame)))
        dump_stacks(self._terminal)
        if self.running and self._samples:
            self._hangs[self.running] = self._hang()
        pytest.fail(f"timed out after {self._armed.timeout:.0f} s", pytrace=False)

    def _defer(self, where: str) -> None:
        """Try the alarm again in 5 ms, for at most `_defer_limit` seconds in all."""
        now = time.monotonic()
        self._deferred_since = self._deferred_since or now
        if now - self._deferred_since > self._defer_limit():
            self._give_up(f"its timer ran out and the main thread stayed {where}")
        signal.setitimer(signal.ITIMER_REAL, 0.005)

    # ------------------------------------------------------------------------- the items
    @pytest.hookimpl(trylast=True)  # after the suite's conftest sorted them
    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        if self.which_cases == "first":
            kept, seen = [], set()
            for item in items:
                if _base(item.nodeid) not in seen:
                    seen.add(_base(item.nodeid))
                    kept.append(item)
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept
        if self._skip:  # what an earlier worker ran: silently, it is already reported
            items[:] = [item for item in items if item.nodeid not in self._skip]
        if self.sentinel:  # last: code that rewrites reports once imported rewrites its too
            name = "::" + self.sentinel.rpartition("::")[2]
            items.sort(key=lambda item: item.nodeid.endswith(name))

    @pytest.hookimpl(wrapper=True, tryfirst=True)  # before the fixtures are set up
    def pytest_runtest_setup(self, item: Any) -> Generator[None, Any, Any]:
        if self.which_cases == "until-failure" and _base(item.nodeid) in self._failed_tests:
            pytest.skip("an earlier case of this test failed")
        return (yield from self._phase())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> bool | None:
        """A test whose task spent its time fails unrun (reported as an error in its setup;
        its fixtures are not even set up)."""
        task = self._task(item.nodeid)
        if self._task_limit is None or not task or self._spent.get(task, 0) < self._task_limit:
            return None
        from _pytest.reports import TestReport

        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        why = f"not run: task {task}'s tests used its time limit ({self._task_limit:.0f} s)"
        report = TestReport(item.nodeid, item.location, {}, "failed", why, "setup")
        item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _task(self, nodeid: str) -> int:
        """The task whose budget a test item spends: the first task that lists it (0: none)."""
        return next((n for t, n in self._task_of.items() if _matches(nodeid, t)), 0)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: Any) -> Generator[None, Any, Any]:
        return (yield from self._phase())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: Any) -> Generator[None, Any, Any]:
        return (yield from self._phase())

    def _phase(self) -> Generator[None, Any, Any]:
        """While a test's setup, call or teardown runs, the alarm may fail it; between them
        pytest makes its reports, where an exception would be an internal error."""
        self._interruptible = True
        try:
            return (yield)
        finally:
            self._interruptible = False

    def pytest_deselected(self, items: Sequence[Any]) -> None:
        self.deselected += [item.nodeid for item in items]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        report = yield
        if report.failed and call.excinfo is not None:
            where = self.where(call.excinfo.value) or self._thread_where.get(item.nodeid, "")
            if item.nodeid in self._hangs:  # timed out: where it hung, not where the timer hit
                where = self._hangs.pop(item.nodeid)
            case = self._case(item.nodeid)
            case["where"] = case["where"] or where
        return report

    def _case(self, nodeid: str) -> dict[str, Any]:
        empty = {"outcome": "passed", "message": "", "stubs": set(), "seconds": 0.0}
        return self.cases.setdefault(nodeid, {**empty, "where": "", "no_progress": False})

    def pytest_runtest_logreport(self, report: Any) -> None:
        case = self._case(report.nodeid)
        case["seconds"] += report.duration
        task = self._task(report.nodeid)
        self._spent[task] = self._spent.get(task, 0.0) + report.duration
        if report.failed:
            self._failed_tests.add(_base(report.nodeid))
            text = report.longreprtext + "".join(content for _, content in report.sections)
            case["stubs"] |= _stub_numbers(text)
            case["no_progress"] = case["no_progress"] or NO_PROGRESS in text
            if case["outcome"] != "failed":
                case["outcome"] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                message = (crash.message if crash else report.longreprtext).strip()
                case["message"] = message[:MESSAGE_LIMIT] or report.when
        elif report.skipped and case["outcome"] == "passed":
            case["outcome"] = "skipped"
            longrepr = report.longrepr
            case["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)

    def result(self, exit_code: int) -> dict[str, Any]:
        keys = ("outcome", "message", "stubs", "seconds", "where", "no_progress")
        cases = [
            [k, *(sorted(v[key]) if key == "stubs" else v[key] for key in keys)]
            for k, v in self.cases.items()
        ]
        return {
            "cases": cases,
            "deselected": self.deselected,
            "thread_stubs": sorted(self.thread_stubs),
            "exit_code": exit_code,
        }


def _relative(node_id: str, root: Path) -> str:
    """A node id as pytest names its items: an absolute path made relative to the rootdir."""
    path, sep, rest = node_id.partition("::")
    if Path(path).is_absolute() and Path(path).is_relative_to(root):
        path = Path(path).relative_to(root).as_posix()
    return f"{path}{sep}{rest}"


def _inside_lock_holder(frame: Any) -> bool:
    """Whether a frame (or one of its callers) runs inside importlib's machinery or the logging
    module: code that holds a process-wide lock an exception could leave acquired."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib") or name == logging.__file__:
            return True
        frame = frame.f_back
    return False


def ast_works() -> bool:
    """Whether this interpreter can still build an AST. CPython 3.11 has a bug
    (python/cpython#106905, pytest-dev/pytest#10874): once one AST construction fails on its
    recursion check, a counter stays off and every later one in the process raises
    `SystemError: AST constructor recursion depth mismatch`. pytest parses source to rewrite
    assertions and to format every failure's traceback, so every later session in the worker
    would lose its failures' messages (or stop with an internal error), wrongly."""
    try:
        ast.parse("x = (1,)")
    except SystemError:
        return False
    return True


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


def _tracebacks_without_carets() -> None:
    """CPython 3.11 draws a traceback's carets (`^^^^`) by parsing each failing line
    (`traceback._extract_caret_anchors_from_line_segment`, an `ast.parse`), and the AST
    constructor's recursion check keeps one counter per interpreter (python/cpython#106905).
    A server thread that logs a request's exception while the main thread parses (pytest
    formatting a failure) can leave that counter off, and every later parse in the worker
    fails (`ast_works`). Seen in stage 15's skeleton after every other stage's sessions in one
    worker: the metrics test's 500 was logged while its failure was formatted. This worker's
    tracebacks go without carets; their lines and messages are the same."""
    if sys.version_info[:2] == (3, 11):
        traceback._extract_caret_anchors_from_line_segment = lambda segment: None  # type: ignore[attr-defined]


def main(spec_path: str) -> None:
    """Run the spec's jobs; results after each session, progress around each test."""
    _preload_server_modules()
    _tracebacks_without_carets()
    # the worker's own stderr, kept apart from the tests' captured output: a hung worker's
    # stacks go there, on SIGUSR1 from the grader or from `Recorder._give_up`
    stacks = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    spec = json.loads(Path(spec_path).read_text())
    progress = Path(spec["progress"])
    results = []
    for index, job in enumerate(spec["jobs"]):
        if spec["mark_sessions"]:
            print(f"{SESSION_MARK}{index}", flush=True)
        for name in list(sys.modules):  # a fresh suite (and stage copy) for every session
            if name == "tests" or name.startswith(("tests.", "stages._external")):
                del sys.modules[name]
        recorder = Recorder(
            job["cases"],
            spans=job["spans"],
            skip=job["skip"],
            failed=job["failed"],
            progress=progress,
            job=index,
            task_of=job.get("task_of"),
            task_limit=job.get("task_limit"),
            sentinel=job.get("sentinel", ""),
        )
        recorder.stacks = stacks
        recorder._save()  # this job's, even if it ends before its first test
        args = ["-q", "-p", "no:cacheprovider", "--stage-path", job["copy"], *job["node_ids"]]
        args += ["--timeout", str(spec["timeout"]), "--timeout-method", "signal"]
        args += ["-m", "not slow"] if job["quick"] else []
        args += ["--stage", job["stage"]] if job["stage"] else []
        try:
            code = int(pytest.main(args, plugins=[recorder]))
        except Exception:
            if ast_works():
                raise
            code = int(pytest.ExitCode.INTERNAL_ERROR)
        if not ast_works():  # the session broke the interpreter's AST: stop this worker
            if job.get("keep_if_ast_breaks"):  # its second try: kept, whatever it recorded
                results.append(recorder.result(code))
                Path(spec["out"]).write_text(json.dumps(results))
            _exit(AST_BROKEN_EXIT)
        results.append(recorder.result(code))
        Path(spec["out"]).write_text(json.dumps(results))
    _exit(0)


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # threads a timed-out test left behind must not keep the worker alive


if __name__ == "__main__":
    main(sys.argv[1])
