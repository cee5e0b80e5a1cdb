"""The grader's vocabulary and its report: what a run of a task's tests found, per task.

`Job`, `Case` and `RunResult` are what the grading worker (stages/grade.py) hands back;
`task_state` tells a stub from a solved or changed function, and `format_report` prints, per
task, which of its tests pass and, when a test reached another task's stub, which task comes
first.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.assign import STUB_PATTERN, _docstring_node, numbered, twins
from stages.assignment_md import CREDIT_RULE
from stages.lesson import Lesson, Task, find_function, load_lesson

SESSION_MARK = "--- stages.grade session "  # the worker's line before each session's output
# The worker's exit status when a session left the interpreter unable to build an AST
# (`grade_worker.ast_works`): the grader runs that session again, and the rest, in a new worker.
AST_BROKEN_EXIT = 75
# The worker's exit status when a test went on past its timer and what follows it (a teardown
# that never returns, a main thread stuck where the alarm may not raise): the grader reports
# that test as hung and runs the rest in a new worker.
HUNG_EXIT = 76


def _base(node_id: str) -> str:
    return node_id.partition("[")[0]


def _matches(collected: str, node_id: str) -> bool:
    return collected == node_id or collected.startswith((node_id + "[", node_id + "::"))


def _stub_numbers(text: str) -> set[int]:
    return {int(m[1]) for m in STUB_PATTERN.finditer(text)}


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
    # (node id, task) of each listed test, and the seconds a task's tests may take together
    # (None: no limit): stages/grade_worker.py fails a task's remaining tests past it
    task_of: tuple[tuple[str, int], ...] = ()
    task_limit: float | None = None
    sentinel: str = ""  # a test that must fail (stages/grade_check.py): run last


@dataclass(frozen=True, slots=True)
class Case:
    """One collected test item (a node id with its [param] suffix) and how it ended."""

    node_id: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""
    stubs: tuple[int, ...] = ()  # the task numbers whose stubs it reached
    seconds: float = 0.0
    # "N|qualname|file.py:line": the task function a failure was raised in (a timeout: the one
    # it hung in, on some thread's stack all along; stages/grade_worker.py, `Recorder._hang`)
    where: str = ""
    no_progress: bool = False  # it ended on the engine's "no progress" error (a livelock)


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


RAW_MARK = "stages-grade-raw: "  # the line of `grade --raw` that carries the result


def raw_result(result: RunResult) -> dict[str, Any]:
    """What each test did, as plain data (`grade --raw`): no grade, which the trusted side
    computes itself from this (stages/grade_check.py)."""
    return {
        "cases": [[getattr(c, k) for k in Case.__slots__] for c in result.cases],
        "deselected": list(result.deselected),
        "thread_stubs": list(result.thread_stubs),
        "exit_code": result.exit_code,
    }


def task_spans(copy: Path, stage: str = "") -> list[tuple[int, str, int, int, str]]:
    """(task number, file, first line, last line, qualname) of each task function in a copy
    (the stage from `stage` or the folder's NN_): where the grader looks for the task a failure
    was raised in. Empty for a folder that is no stage's copy."""
    match = re.match(r"(\d\d)_", Path(copy).name)
    try:
        lesson = load_lesson(stage or (match[1] if match else ""))
    except ValueError:
        return []
    spans = []
    for number, task in numbered(lesson):
        for function in (task.function, *twins(lesson.path, task)):
            file, _, qualname = function.partition("::")
            path = Path(copy) / file
            node = find_function(path, qualname) if path.is_file() else None
            if node is not None and node.end_lineno is not None:
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                spans.append((number, str(path), first, node.end_lineno, qualname))
    return spans


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
    """pass: every test that ran passed (at least one); fail otherwise; else 'not graded'.
    The rule CREDIT_RULE states, which the report prints."""
    statuses = {t.status for t in tests}
    if "fail" in statuses:
        return "fail"
    return "pass" if "pass" in statuses else "not graded"


MESSAGE_LINES = 15  # lines of a failure's message the report prints (--verbose: everything)
VERBOSE_HINT = (
    "--verbose shows pytest's own output: each failure's whole traceback and message, and what "
    "the test printed"
)
NO_PROGRESS_NOTE = (
    'the engine stopped with "no progress" (LLMEngine.check_progress): a step scheduled nothing '
    "while requests were left, so every later step would do nothing too (a livelock). Likely "
    "cause: the scheduling this test reaches can fit no request into a step, e.g. a "
    "prefix-cache hit that covers the whole prompt (its last token must still be computed, "
    "to sample from), blocks that are never freed so a request is never admitted, or a "
    "request over the step's token budget that is never chunked"
)


def _where(lesson: Lesson, number: int, case: Case) -> str:
    """Which task function a failure was raised in (or a timed-out test hung in), said from
    task `number`'s side."""
    task, qualname, place = case.where.split("|")
    verb = "hung" if TIMED_OUT in case.message else "raised"
    if int(task) == number:
        return f"{verb} in this task's function ({place})"
    return f"{verb} in task {task}'s function {qualname} ({place}): look there first"


TIMED_OUT = "timed out after"  # the worker's message for a test whose timer ran out


def _suspect(lesson: Lesson, number: int, test: GradedTest, suspect: int | None) -> list[str]:
    """For a failure raised in no task function (an engine run that never ended, a timeout
    with no task function stuck on a stack): the first task whose direct test fails."""
    if suspect is None or (suspect == number and test.node_id == lesson.tasks[number - 1].tests[0]):
        return []
    if suspect == number:
        return ["raised in no task's function; this task's direct test fails too: start there"]
    direct = lesson.tasks[suspect - 1].tests[0]
    return [
        f"raised in no task's function; task {suspect} "
        f"({lesson.tasks[suspect - 1].qualname}) fails its direct test {direct}: look there first"
    ]


def _why(
    lesson: Lesson,
    number: int,
    test: GradedTest,
    verbose: bool = False,
    suspect: int | None = None,
) -> list[str]:
    """What to tell about a failing test: the stubs it reached, or where its first failure
    was raised (else the first task whose direct test fails: `suspect`) and its whole message
    (the assertion with pytest's explanation)."""
    failed = [c for c in test.cases if c.outcome in ("failed", "error")]
    others = sorted(test.blocked_by - {number})
    if others:
        names = ", ".join(f"{n} ({lesson.tasks[n - 1].qualname})" for n in others)
        if max(others) < number:
            return [f"reached the stub of task {names}: that task comes first"]
        return [f"reached the stub of task {names}: this test needs it too (it passes once done)"]
    if test.blocked_by:
        return ["reached this task's stub"]
    lines = []
    first = next((c for c in failed if c.message), failed[0] if failed else None)
    if first is not None and first.where:
        lines.append(_where(lesson, number, first))
    elif first is not None:
        lines += _suspect(lesson, number, test, suspect)
    message = first.message.splitlines() if first is not None else []
    shown = message if verbose else message[:MESSAGE_LINES]
    lines += shown
    if len(shown) < len(message):
        lines.append(f"... {len(message) - len(shown)} more lines (--verbose shows them)")
    if any(c.no_progress for c in failed):
        lines.append(NO_PROGRESS_NOTE)
    return lines


def _partial(number: int, tests: Sequence[GradedTest]) -> list[str]:
    """The title's note for a task some of whose tests pass: how many, and the later tasks
    the failing ones wait for (so a task done in order never reads as a bare failure)."""
    ran = [t for t in tests if t.status in ("pass", "fail")]
    failing = [t for t in ran if t.status == "fail"]
    if not failing or len(failing) == len(ran):
        return []
    notes = [f"{len(ran) - len(failing)} of {len(ran)} tests pass"]
    later = sorted({n for t in failing for n in t.blocked_by if n > number})
    if later and all(t.blocked_by - {number} for t in failing):
        notes.append(f"the others wait for task {', '.join(map(str, later))}")
    return notes


def format_report(
    lesson: Lesson,
    copy: Path,
    result: RunResult,
    states: dict[int, str],
    chosen: Iterable[int] | None = None,
    *,
    verbose: bool = False,
) -> str:
    """The per-task report: each task's status, each of its tests with its passing cases, the
    first failure's message and the task function it was raised in, the other tasks whose
    stubs a failure reached, and, where a failure was raised in a task that does not list the
    test, a note under that task."""
    chosen = set(chosen or range(1, len(lesson.tasks) + 1))
    lines, passed, direct, failures = [], 0, 0, False
    suspect = next(  # the first task that fails its direct test (not on another's stub)
        (
            n
            for n, task in numbered(lesson)
            if n in chosen
            and (tests := task_tests(task, result)[:1])
            and tests[0].status == "fail"
            and not tests[0].blocked_by - {n}
        ),
        None,
    )
    listed = {t for task in lesson.tasks for t in task.tests}
    for number, task in numbered(lesson):
        if number not in chosen:
            continue
        tests = task_tests(task, result)
        status = task_status(tests)
        passed += status == "pass"
        direct += bool(tests) and tests[0].status == "pass"
        note = {"stub": "not started", "written": ""}.get(states[number], states[number])
        notes = [note, *_partial(number, tests)] if note else _partial(number, tests)
        title = f"task {number}  {task.function}: {status.upper()}"
        lines.append(title + (f" ({'; '.join(notes)})" if notes else ""))
        for test in tests:
            counts = sum(c.outcome == "passed" for c in test.cases), len(test.cases)
            detail = f"  {counts[0]}/{counts[1]} cases" if test.cases else ""
            if test.status == "not run":
                slow = any(_matches(d, test.node_id) for d in result.deselected)
                detail = "  (slow: left out by --quick)" if slow else "  (no test for this stage)"
            lines.append(f"    {test.status:<7} {test.node_id}{detail}")
            why = _why(lesson, number, test, verbose, suspect)
            lines += [f"{' ' * 12}{line}" for line in why]
            failures |= test.status == "fail"
        elsewhere = sorted(
            {
                _base(c.node_id)
                for c in result.cases
                if c.outcome in ("failed", "error")
                and c.where.startswith(f"{number}|")
                and not any(_matches(c.node_id, t) for t in task.tests)
                and any(_matches(c.node_id, t) for t in listed)
            }
        )
        lines += [f"    also failed in this task's function: {t}" for t in elsewhere]
    for n in sorted(set(result.thread_stubs)):
        where = lesson.tasks[n - 1].qualname
        lines.append(f"a background thread stopped on the stub of task {n} ({where})")
    if failures and not verbose:
        lines += ["", VERBOSE_HINT]
    head = f"stage {lesson.stage} ({lesson.title}), {copy}: {passed} of {len(chosen)} tasks pass"
    head += f" ({direct} of {len(chosen)} direct tests)"
    return "\n".join([head, textwrap.fill(CREDIT_RULE, 100), "", *lines])


def grade_summary(
    lesson: Lesson, copy: Path, result: RunResult, chosen: Iterable[int] | None = None
) -> dict[str, Any]:
    """The grade as plain data (`python -m stages grade --json`, the gradebook): per task its
    status, points earned of its points, tests and cases passed of those run, each failing
    test's name and the first line of its message, and its tests' seconds."""
    chosen = set(chosen or range(1, len(lesson.tasks) + 1))
    tasks = []
    for number, task in numbered(lesson):
        if number not in chosen:
            continue
        tests = task_tests(task, result)
        status = task_status(tests)
        cases = [c for t in tests for c in t.cases]
        failing = [
            {"test": c.node_id, "message": (c.message.strip().splitlines() or [""])[0][:300]}
            for c in cases
            if c.outcome in ("failed", "error")
        ]
        tasks.append(
            {
                "task": number,
                "function": task.function,
                "status": status,
                "points": task.points,
                "earned": task.points if status == "pass" else 0,
                # its first test, the one about its function alone: a task whose direct test
                # passes but earns nothing waits on another task (shown beside the points)
                "direct_passed": bool(tests) and tests[0].status == "pass",
                "tests_passed": sum(t.status == "pass" for t in tests),
                "tests_total": len(tests),
                "cases_passed": sum(c.outcome == "passed" for c in cases),
                "cases_total": len(cases),
                "failing": failing,
                "seconds": round(sum(c.seconds for c in cases), 3),
            }
        )
    return {
        "stage": lesson.stage,
        "title": lesson.title,
        "copy": str(copy),
        "earned": sum(t["earned"] for t in tasks),
        "points": sum(t["points"] for t in tasks),
        "passed": all(t["status"] == "pass" for t in tasks),
        "tasks": tasks,
    }
