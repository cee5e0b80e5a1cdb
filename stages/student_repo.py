"""A standalone student repository for one stage: what a course hands out.

    python -m stages assign 03 ~/course/hw3 --repo             # the student's repository
    python -m stages assign 03 ~/course/hw3-answers --repo --solution

The repository holds the stages before NN (solved: they are what the student builds on), stage
NN with its tasks blanked (stages/assign.py, Triton twins included), no later stage, the tests
that apply to stages up to NN (a test file's NN_ is the first stage it applies to), the shared
`stages/common`, the tools that grade (`python -m stages grade`, the pytest plugin), and
pyproject.toml and the Makefile. So no answer is one command away: `diff` can only compare the
stages that are there, and there is no solved copy of NN. Its README says how to grade, by
the same command as in this repository; `make test` there runs the whole suite.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

from stages import STAGES_DIR, list_stages
from stages.assign import ASSIGNMENT_FILE, ROOT, assignment_markdown, blank_tasks, numbered
from stages.assignment_md import CREDIT_RULE
from stages.lesson import Lesson, load_lesson

# the package's modules a student repository needs: the stage loader, the command line, the
# manifests, the assignment tools and the grader (with its worker and the pytest plugin)
TOOLS = (
    "__init__.py",
    "__main__.py",
    "assign.py",
    "assignment_md.py",
    "cli.py",
    "cli_args.py",
    "grade.py",
    "grade_report.py",
    "grade_worker.py",
    "lesson.py",
    "pytest_plugin.py",
    "student_repo.py",
)
TOP_FILES = ("pyproject.toml", "Makefile", "LICENSE", ".gitignore")
# tests of this repository's course tooling (they generate and grade every stage's
# assignment, run notebooks, or measure every lesson against this README, which the student
# repository does not have): not the student's to run
LEFT_OUT_TESTS = frozenset(
    {
        "test_assignments.py",
        "test_docs.py",  # this repository's README.md and docs/, which a student repo has not
        "test_gradebook.py",
        "test_lesson_size.py",
        "test_mutations.py",
        "test_notebooks.py",
        "test_step_profile.py",
    }
)
_IGNORE = shutil.ignore_patterns("__pycache__", ".*")


def repo_tests(stage: str) -> list[Path]:
    """The test files that apply to stages up to `stage` (and the suite's own files)."""
    kept = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        first = re.match(r"test_(\d\d)_", path.name)
        if path.name not in LEFT_OUT_TESTS and not (first and first[1] > stage):
            kept.append(path)
    return kept


def readme(lesson: Lesson, solution: bool) -> str:
    copy = f"stages/{lesson.path.name}"
    state = (
        "with every task solved (the instructor's copy)"
        if solution
        else "with the functions that carry its technique blanked: `ASSIGNMENT.md` lists them"
    )
    intro = (
        "An LLM inference engine built in stages, each a complete engine. This repository holds "
        f"the stages before {lesson.stage}, solved (what this stage builds on), and `{copy}`, "
        f"{state}. The stage's lesson is `{copy}/README.md`. Run the commands below from this "
        "folder."
    )
    return f"""# Stage {lesson.stage}: {lesson.title.lower()} (assignment)

{textwrap.fill(intro, 100, break_long_words=False, break_on_hyphens=False)}

```
make test                                                # set-up (.venv), lint, the whole suite
.venv/bin/python -m stages grade {copy}           # each task's tests, reported per task
.venv/bin/python -m stages grade {copy} --quick   # without the real-model tests (faster)
.venv/bin/python -m stages grade {copy} --task 2  # one task
.venv/bin/python -m stages {lesson.stage} demo                         # run the engine
```

The first `make test` creates `.venv` and installs what the engine needs (PyTorch, a few
minutes); the grade commands need that done once. `--verbose` shows pytest's own output (each
failure's traceback and message). Everything runs on the CPU.

{textwrap.fill(CREDIT_RULE, 100, break_long_words=False, break_on_hyphens=False)}

## Grading on every push

`.github/workflows/grade.yml` is a plain GitHub Actions job: on every push it fetches the
course's repository at a pinned commit, and grades `{copy}` with that checkout's tests and
grader (not this repository's, which you can edit), then writes each task's points to the
job's summary. It is feedback: the instructor's grade comes from `python -m stages gradebook`
(in a sandbox, with the course's tests) or the Gradescope autograder it exports. GitHub
Classroom, which an earlier version of this workflow targeted, was discontinued on 2026-08-28.
"""


WORKFLOW = Path(".github/workflows/grade.yml")
COURSE_REPOSITORY = "OWNER/COURSE"  # the course's repository on GitHub: set it in the workflow
TASK_TIMEOUT_MINUTES = 60  # the whole job's limit (set-up included)


def _course_commit() -> str:
    """This course repository's commit, which the workflow pins (HEAD where git says none)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return "HEAD"
    return done.stdout.strip() if done.returncode == 0 else "HEAD"


# the job's summary from `grade --json` (a heredoc in the workflow: no shell quoting inside)
SUMMARY = """\
import json, os, sys
g = json.load(open(sys.argv[1]))
lines = [f"## Stage {g['stage']}: {g['earned']}/{g['points']} points", "",
         "| task | function | points | tests |", "|---|---|---|---|"]
for t in g["tasks"]:
    lines.append(f"| {t['task']} | `{t['function']}` | {t['earned']}/{t['points']} | "
                 f"{t['tests_passed']}/{t['tests_total']} |")
open(os.environ["GITHUB_STEP_SUMMARY"], "a").write("\\n".join(lines) + "\\n")
"""


def grade_workflow(lesson: Lesson, course: str = COURSE_REPOSITORY, ref: str = "") -> str:
    """A plain GitHub Actions job for the student's repository: the course's tests and grader
    fetched at a pinned commit (`ref`), the stage graded with them (never with the student's
    copy of the tests), each task's points written to the job summary. GitHub Classroom's
    autograding actions, which this replaced, went with Classroom (discontinued 2026-08-28)."""
    copy = f"stages/{lesson.path.name}"
    ref = ref or _course_commit()
    return f"""# Grading of stage {lesson.stage} ({lesson.title}) on every push, written by
# `python -m stages assign {lesson.stage} DIR --repo`: the course's tests and grader at a pinned
# commit grade this repository's {copy}; the points go to the job summary. (GitHub Classroom,
# which an earlier version targeted, was discontinued on 2026-08-28.)
name: Grade
"on":
  - push
permissions:
  contents: read
env:
  COURSE_REPOSITORY: {course}
  COURSE_REF: {ref}
jobs:
  grade:
    runs-on: ubuntu-latest
    timeout-minutes: {TASK_TIMEOUT_MINUTES}
    steps:
    - name: The student's code
      uses: actions/checkout@v4
      with:
        path: student
    - name: The course's tests and grader, at the pinned commit
      uses: actions/checkout@v4
      with:
        repository: ${{{{ env.COURSE_REPOSITORY }}}}
        ref: ${{{{ env.COURSE_REF }}}}
        path: course
    - name: Set up the engine (PyTorch for the CPU, then the package)
      working-directory: course
      run: |
        python3 -m venv .venv
        .venv/bin/python -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
        make .venv/.installed
    - name: Grade with the course's tests
      working-directory: course
      run: |
        .venv/bin/python -m stages grade "$GITHUB_WORKSPACE/student/{copy}" \\
          --stage {lesson.stage} --json > grade.json || true
        .venv/bin/python - grade.json <<'SUMMARY'
{textwrap.indent(SUMMARY, " " * 8)}        SUMMARY
"""


def write_repo(
    stage: str | int, out_dir: Path | str, *, solution: bool = False, force: bool = False
) -> Path:
    """Write the student repository of a stage to out_dir; return its stage copy."""
    lesson = load_lesson(str(stage))
    out = Path(out_dir).expanduser().resolve()
    if out == ROOT or ROOT in out.parents:
        raise ValueError(f"{out} is inside the repository: choose another folder")
    ours = ["stages", "tests", "README.md", ASSIGNMENT_FILE, str(WORKFLOW), *TOP_FILES]
    present = [name for name in ours if (out / name).exists()]
    if present and not force:
        raise ValueError(f"{out} already holds {', '.join(present)}: choose another, or --force")
    for name in present:  # only what this command writes
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    package = out / "stages"
    package.mkdir(parents=True)
    for name in TOOLS:
        shutil.copy2(STAGES_DIR / name, package / name)
    shutil.copytree(STAGES_DIR / "common", package / "common", ignore=_IGNORE)
    for info in list_stages():
        if info.number < lesson.stage:
            shutil.copytree(info.path, package / info.folder, ignore=_IGNORE)
    copy = package / lesson.path.name
    shutil.copytree(lesson.path, copy, ignore=_IGNORE)
    if not solution:
        blank_tasks(copy, numbered(lesson))
    (out / "tests").mkdir()
    for path in repo_tests(lesson.stage):
        shutil.copy2(path, out / "tests" / path.name)
    for name in TOP_FILES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, out / name)
    (out / "README.md").write_text(readme(lesson, solution))
    workflow = out / WORKFLOW
    workflow.parent.mkdir(parents=True, exist_ok=True)
    workflow.write_text(grade_workflow(lesson))
    notes = assignment_markdown(lesson, copy, solution=solution, repo=out)
    (out / ASSIGNMENT_FILE).write_text(notes)
    return copy
