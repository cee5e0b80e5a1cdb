"""Grading a student's copy of a stage, per task (the copy comes from stages/assign.py).

    python -m stages grade ~/hw/03_paged     # each task's tests on the copy, reported per task

Grading runs the repository's suite on the copy (`pytest --stage-path`, as anyone can) in one
worker process (stages/grade_worker.py) and reports, per task, which of the tests its manifest
entry lists pass. As in the CMU llmsys grader, everything is graded on the CPU, and a test that
skips here (one that needs a GPU, say) is reported with its reason instead of counted. A test
that runs the whole engine reaches more than one task's function, so it can fail on another
task's stub: the report names the stubs a failure reached (in its traceback, its captured
output, or an exception that ended a background thread, such as the engine loop), and the task
whose function the failure was raised in, so a student sees "do task 2 first" or "look at task
5" rather than a bare failure or a hang. A test that kills the worker (a signal such as SIGSEGV
or SIGFPE, from a kernel fed nonsense) is reported as crashed, and the rest run in a new worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.assign import ROOT, numbered
from stages.grade_report import (
    AST_BROKEN_EXIT,
    HUNG_EXIT,
    RAW_MARK,
    SESSION_MARK,
    _base,
    raw_result,
)
from stages.grade_report import VERBOSE_HINT as VERBOSE_HINT
from stages.grade_report import Case as Case
from stages.grade_report import Job as Job
from stages.grade_report import RunResult as RunResult
from stages.grade_report import format_report as format_report
from stages.grade_report import grade_summary as grade_summary
from stages.grade_report import graded_status as graded_status
from stages.grade_report import task_spans as task_spans
from stages.grade_report import task_state as task_state
from stages.grade_report import task_status as task_status
from stages.grade_report import task_tests as task_tests
from stages.lesson import load_lesson

# Seconds a test may take by default: a hang costs its own test this, not the grading's whole
# limit (a correct solution's slowest grading test takes a few seconds on a laptop's CPU).
TEST_TIMEOUT = 30.0
# How often the grader reads the worker's progress, and how long a hung worker gets to print
# its threads' stacks before it is killed.
POLL_SECONDS, STACKS_SECONDS = 0.5, 0.5


def _case(c: Sequence[Any]) -> Case:
    return Case(c[0], c[1], c[2], tuple(c[3]), c[4], c[5], c[6])


@dataclass
class _Carried:
    """What a job recorded before its worker crashed: kept, and added to its continuation."""

    cases: list[Case] = field(default_factory=list)
    deselected: list[str] = field(default_factory=list)
    thread_stubs: set[int] = field(default_factory=set)
    output: str = ""

    def merged(self, r: dict[str, Any], output: str) -> RunResult:
        """The job's result: what was carried, then what its (last) session recorded."""
        code = r["exit_code"]
        if self.cases and code in (0, 5):  # the crashed test failed, whatever came after
            code = 1
        return RunResult(
            cases=(*self.cases, *map(_case, r["cases"])),
            deselected=tuple(dict.fromkeys([*self.deselected, *r["deselected"]])),
            thread_stubs=tuple(sorted(self.thread_stubs | set(r["thread_stubs"]))),
            exit_code=code,
            output=self.output + output,
        )


def _crash_message(returncode: int, limit: float = 0.0) -> str:
    if returncode == HUNG_EXIT:
        timer = f" its {limit:.0f} s timer and" if limit else ""
        return (
            f"hung: the test went on past{timer} what follows it (its teardown, or a main "
            "thread that never returned to Python); the grading worker was stopped, with "
            "its threads' stacks in the output (--verbose)"
        )
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"crashed: the test killed the grading worker ({name}, exit {returncode})"


def _worker(
    jobs: Sequence[Job],
    skip: dict[str, Any],
    timeout: float,
    show_output: bool,
    tmp: Path,
    keep_first: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int, str]:
    """One worker process over the jobs: (results of the jobs it finished, its last progress
    note, its exit code, its output). `skip` is for the first job (after a crash);
    `keep_first`: the first job's result is kept even if it breaks the AST (its second try)."""
    spec, results, progress = tmp / "jobs.json", tmp / "results.json", tmp / "progress.json"
    for path in (results, progress):
        path.unlink(missing_ok=True)
    entries = []
    for index, job in enumerate(jobs):
        extra = skip if index == 0 else {"skip": [], "failed": []}
        extra = {**extra, "keep_if_ast_breaks": keep_first and index == 0}
        entries.append(
            {
                "copy": str(job.copy),
                "node_ids": list(job.node_ids),
                "quick": job.quick,
                "cases": job.cases,
                "stage": job.stage,
                "spans": task_spans(job.copy, job.stage),
                "task_of": dict(job.task_of),
                "task_limit": job.task_limit,
                "sentinel": job.sentinel,
                **extra,
            }
        )
    payload = {"out": str(results), "progress": str(progress), "timeout": timeout}
    spec.write_text(json.dumps({**payload, "mark_sessions": not show_output, "jobs": entries}))
    # The output goes to a file, not a pipe: a process the tests fork that keeps the pipe open
    # would hold the grade until it exits. The worker has a session of its own, killed whole
    # when it ends (or the grade is interrupted): nothing a test started outlives it.
    log = tmp / "worker.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.grade_worker", str(spec)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=None if show_output else sink,
            stderr=None if show_output else subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = _wait_or_kill_when_hung(proc, progress)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = json.loads(results.read_text()) if results.is_file() else []
    note = _read_note(progress)
    return done, note, code, log.read_text(errors="replace")


def _read_note(progress: Path) -> dict[str, Any] | None:
    """The worker's last progress note (None before its first; it is replaced whole)."""
    try:
        return json.loads(progress.read_text())
    except (OSError, ValueError):
        return None


def _wait_or_kill_when_hung(proc: subprocess.Popen[bytes], progress: Path) -> int:
    """The worker's exit status. A worker past the deadline its last progress note sets (a test
    far past its timer, or a session stuck outside any test) gets SIGUSR1 (its threads' stacks
    into its output), then SIGKILL: it returns HUNG_EXIT, as the worker does when it gives up
    on a test itself."""
    while True:
        try:
            return proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        note = _read_note(progress)
        if note is None or time.time() < note.get("deadline", float("inf")):
            continue
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(STACKS_SECONDS)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # SIGKILL: it leaves at once
        return HUNG_EXIT


def run_jobs(
    jobs: Sequence[Job], *, timeout: float = TEST_TIMEOUT, show_output: bool = False
) -> list[RunResult]:
    """Run each job's pytest session, one after another in one worker process (the import of
    torch and the model happens once), each with a fresh copy of the suite's modules. A test
    that kills the worker is recorded as failed ("crashed", with the signal), and so is one that
    outlives its timer and its teardown ("hung"); the jobs go on in a new worker, that test and
    those already run left out. A session after which the interpreter can no longer build an
    AST (CPython 3.11's bug: `grade_worker.ast_works`) runs once more in a new worker, and the
    jobs after it there too."""
    out: list[RunResult] = []
    todo, carried = list(jobs), _Carried()
    skip: dict[str, Any] = {"skip": [], "failed": []}
    retried: set[int] = set()  # jobs (by index) that broke the AST once: kept on their retry
    with tempfile.TemporaryDirectory(prefix="stages-grade-") as tmp:
        while todo:
            first = len(jobs) - len(todo)
            done, note, code, output = _worker(
                todo, skip, timeout, show_output, Path(tmp), keep_first=first in retried
            )
            # each session's own output (what the worker printed after that session's marker)
            sessions = re.split(rf"^{re.escape(SESSION_MARK)}\d+\n", output, flags=re.M)[1:]
            part = lambda i, s=sessions, o=output: s[i] if i < len(s) else o
            for index, result in enumerate(done):
                out.append((carried if index == 0 else _Carried()).merged(result, part(index)))
            if done:
                carried = _Carried()
            if len(done) == len(todo):
                break
            # that session again, and the rest, in a new worker; once only: a session that
            # exits with that status again (or with a test's own os._exit) is not retried forever
            if code == AST_BROKEN_EXIT and first + len(done) not in retried:
                retried.add(first + len(done))
                if done:
                    skip = {"skip": [], "failed": []}
                todo = todo[len(done) :]
                continue
            running = note and note["job"] == len(done) and note["running"]
            if (code >= 0 and code != HUNG_EXIT) or not running:  # outside any test: no skip
                how = "hung outside any test" if code == HUNG_EXIT else f"stopped (exit {code})"
                raise RuntimeError(f"the test worker {how}:\n{output[-4000:]}")
            message = _crash_message(code, note.get("limit", 0.0))
            partial = [_case(c) for c in note["partial"]["cases"] if c[0] != running]
            carried.cases += [*partial, Case(running, "failed", message)]
            carried.deselected += note["partial"]["deselected"]
            carried.thread_stubs |= set(note["partial"]["thread_stubs"])
            carried.output += part(len(done))
            failed = [c for c in carried.cases if c.outcome in ("failed", "error")]
            skip = {
                "skip": [c.node_id for c in carried.cases],
                "failed": [_base(c.node_id) for c in failed],
            }
            todo = todo[len(done) :]
    return out


# ------------------------------------------------------------------------------------- grading


def grade(
    copy: Path | str,
    *,
    stage: str | None = None,
    quick: bool = False,
    tasks: Sequence[int] = (),
    timeout: float = TEST_TIMEOUT,
    verbose: bool = False,
    as_json: bool = False,
    task_timeout: float | None = None,
    raw: bool = False,
    sentinel: str = "",
) -> tuple[str, bool]:
    """Run the tasks' tests on a stage copy; return the report (with `as_json`, the grade as
    JSON: `grade_summary`) and whether every task passes. `task_timeout`: seconds a task's
    tests may take together, past which its other tests fail unrun (that task alone).

    For the gradebook, which trusts nothing this process says: `raw` returns what each test
    did, a line `RAW_MARK` + JSON (stages/grade_check.py checks it and computes the grade), and
    `sentinel` is one more test to run, one that must fail."""
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
    owners: dict[str, int] = {}  # each test spends the time of the first task that lists it
    for n, task in numbered(lesson):
        for test in task.tests if n in chosen else ():
            owners.setdefault(test, n)
    task_of, node_ids = tuple(owners.items()), tuple(owners)
    node_ids += (sentinel,) if sentinel else ()
    job = Job(folder, node_ids, quick, lesson.stage, "all", task_of, task_timeout, sentinel)
    (result,) = run_jobs([job], timeout=timeout, show_output=verbose)
    if result.exit_code not in (0, 1, 5):  # 5: nothing collected (--quick, say): still a report
        raise RuntimeError(
            f"pytest could not run (exit {result.exit_code}):\n{result.output[-3000:]}"
        )
    if raw:
        return RAW_MARK + json.dumps(raw_result(result)), True
    if as_json:
        summary = grade_summary(lesson, folder, result, chosen)
        return json.dumps(summary, indent=1), summary["passed"]
    report = format_report(lesson, folder, result, states, chosen, verbose=verbose)
    graded = [task_status(task_tests(t, result)) for n, t in numbered(lesson) if n in chosen]
    return report, all(s == "pass" for s in graded)
