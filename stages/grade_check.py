"""The gradebook's trusted side of a grade: what a student's grading printed, checked, and the
grade computed from it here, never in the process that ran the student's code.

As Gradescope's autograder and PrairieLearn's external grader do, the harness that runs the
submission is not trusted to say the grade: it only reports what each test did, and the side
that never runs (nor imports) the student's code checks that report before any point counts.

- The grading process must exit 0 (`grade --raw` does once it printed its result): one killed
  by the student's code, or stopped by a forged result written into its output, gives none.
- The result is one line (`RAW_MARK` + JSON), exactly once, of the expected shape: each case a
  node id, an outcome, a message, ...; no test twice; every test of the graded tasks present
  (run, or left out by --quick).
- Each run carries a sentinel: a test, under a name drawn at random for that run, that must
  fail. A report in which it passed (or that lacks it) was made by code that rewrote pytest's
  reports or forged the result: the student is marked tampered, not graded.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.grade_report import RAW_MARK, Case, RunResult, _matches, grade_summary
from stages.lesson import Lesson

OUTCOMES = ("passed", "failed", "error", "skipped")
FIELDS = (str, str, str, list, (int, float), str, bool)  # a case's fields, in Case's order


def write_sentinel(folder: Path) -> str:
    """A test that must fail, under a name drawn now, in `folder`; its node id."""
    name = f"test_{secrets.token_hex(8)}"
    file = folder / f"{name}.py"
    file.write_text(f"def {name}():\n    raise AssertionError({secrets.token_hex(8)!r})\n")
    return f"{file}::{name}"


@dataclass(frozen=True, slots=True)
class Checked:
    """A checked report: the grade (None when the report cannot be trusted) or why not."""

    grade: dict[str, Any] | None
    problem: str = ""
    tampered: bool = False


def _case(entry: Any) -> Case | None:
    """A case of the report, or None where its shape is not a case's."""
    if not isinstance(entry, list) or len(entry) != len(FIELDS):
        return None
    if not all((isinstance(v, t) and not isinstance(v, bool)) or (t is bool and isinstance(v, bool))
               for v, t in zip(entry, FIELDS, strict=True)):  # fmt: skip
        return None
    if entry[1] not in OUTCOMES or not all(isinstance(n, int) for n in entry[3]):
        return None
    return Case(entry[0], entry[1], entry[2], tuple(entry[3]), float(entry[4]), *entry[5:])


def check_report(
    output: str,
    exit_code: int,
    lesson: Lesson,
    chosen: Iterable[int],
    sentinel: str,
    copy: str = "",
) -> Checked:
    """The grade of a `grade --raw --sentinel SENTINEL` run, from its output and exit status,
    or why there is none (see the module docstring)."""
    chosen = sorted(set(chosen))
    if exit_code != 0:
        return Checked(None, f"the grader did not finish (exit {exit_code})")
    lines = [line for line in output.splitlines() if line.startswith(RAW_MARK)]
    if len(lines) != 1:
        problem = f"tampered: {len(lines)} results in the grader's output, not one"
        return Checked(None, problem, tampered=len(lines) > 1)
    try:
        data = json.loads(lines[0][len(RAW_MARK) :])
        cases = [_case(entry) for entry in data["cases"]]
        deselected = [str(d) for d in data["deselected"]]
        code = data["exit_code"]
    except (ValueError, KeyError, TypeError):
        return Checked(None, "tampered: the grader's result is not of its shape", tampered=True)
    if any(c is None for c in cases) or not isinstance(code, int):
        return Checked(None, "tampered: the grader's result is not of its shape", tampered=True)
    found = [c for c in cases if c is not None]
    ids = [c.node_id for c in found]
    if len(set(ids)) != len(ids):
        return Checked(None, "tampered: a test is reported twice", tampered=True)
    name = sentinel.rpartition("::")[2]
    marks = [c for c in found if c.node_id.rpartition("::")[2] == name]
    # an error is no pass: as the last item, its setup tears down the suite's module fixtures
    if len(marks) != 1 or marks[0].outcome not in ("failed", "error"):
        said = marks[0].outcome if len(marks) == 1 else "missing"
        why = f"tampered: the run's sentinel test, which must fail, is {said}"
        return Checked(None, why, tampered=True)
    if code not in (0, 1, 5):
        return Checked(None, f"pytest could not run (exit {code})")
    result = RunResult(tuple(c for c in found if c is not marks[0]), tuple(deselected), (), code)
    expected = {t for n in chosen for t in lesson.tasks[n - 1].tests}
    lacking = sorted(
        t
        for t in expected
        if not result.cases_of(t) and not any(_matches(d, t) for d in deselected)
    )
    if lacking:
        why = f"tampered: the grader's result lacks {len(lacking)} tests ({lacking[0]}, ...)"
        return Checked(None, why, tampered=True)
    return Checked(grade_summary(lesson, Path(copy), result, chosen))
