"""ASSIGNMENT.md: the lesson in brief, one section per task, and the commands that grade it.

Written next to a student copy by stages/assign.py (`assign`), or at the top of a student
repository by stages/student_repo.py; the task numbering (`numbered`) is the one the stubs,
the grader and this file share.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from stages import STAGES_DIR
from stages.lesson import Lesson, Task, find_function, task_part

ROOT = STAGES_DIR.parent  # the repository: its tests/ grade every copy
ASSIGNMENT_FILE = "ASSIGNMENT.md"
CREDIT_RULE = (  # the grade report (stages/grade_report.py) prints it too
    "A task passes when every one of its tests that ran passes (all or nothing; a skipped "
    "test does not count). Its first test is its direct test, which needs only the tasks "
    "before it; a later test can run the whole engine and wait for a later task, and says so."
)


def numbered(lesson: Lesson) -> list[tuple[int, Task]]:
    return list(enumerate(lesson.tasks, start=1))


def _docstring_node(node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.Expr | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first if isinstance(first.value.value, str) else None
    return None


def _readme_brief(readme: str, folder: str) -> tuple[str, str]:
    """The README's opening paragraphs (commands left out) and its "The idea" section."""
    sections = re.split(r"^## ", readme, flags=re.M)
    head = re.sub(r"^```.*?^```[ \t]*$", "", sections[0], flags=re.M | re.S)
    intro = "\n".join(line for line in head.splitlines() if not line.startswith("# ")).strip()
    idea = next(
        (s.partition("\n")[2].strip() for s in sections[1:] if s.startswith("The idea")), ""
    )
    relink = lambda text: re.sub(r"\]\((?!https?:|#|/)([^)]+)\)", rf"]({folder}/\1)", text)
    return relink(intro), relink(idea)


def _python() -> str:
    """The interpreter as a reader at the repository root types it."""
    try:
        return str(Path(sys.executable).relative_to(ROOT))
    except ValueError:
        return "python"


def grade_command(copy: Path, repo: Path | None = None) -> str:
    """The grading command: from this repository, or inside a student repository (`repo`)."""
    if repo is not None:
        return f".venv/bin/python -m stages grade {copy.relative_to(repo)}"
    return f"cd {ROOT} && {_python()} -m stages grade {copy}"


def pytest_command(copy: Path, node_ids: Sequence[str] = (), repo: Path | None = None) -> str:
    if repo is not None:
        head = f".venv/bin/python -m pytest -q --stage-path {copy.relative_to(repo)}"
    else:
        head = f"cd {ROOT} && {_python()} -m pytest -q --stage-path {copy}"
    return " ".join([head, *node_ids])


def _contract(path: Path, qualname: str) -> str:
    """Decorators, signature and docstring of a function, dedented."""
    node = find_function(path, qualname)
    doc = _docstring_node(node) if node else None
    if node is None or doc is None:
        return ""
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    lines = path.read_text().splitlines()[first - 1 : doc.end_lineno]
    return "\n".join(line[node.col_offset :] for line in lines)


def _previous_hint(lesson: Lesson, task: Task) -> str | None:
    previous = lesson.previous
    if previous is None or not (previous.path / task.file).is_file():
        return None
    where = f"stages/{previous.folder}/{task.file}"
    old = find_function(previous.path / task.file, task.qualname)
    new = find_function(lesson.path / task.file, task.qualname)
    if old is None:
        return f"The stage before: `{where}` is this file without the technique"
    if new is not None and ast.dump(old) != ast.dump(new):
        return f"The stage before: `{where}` has the version of `{task.qualname}` this task changes"
    return None  # the same function there would be the answer


def is_slow(node_id: str) -> bool:
    """Whether a test (file::function) is marked slow, read from its source."""
    file, _, name = node_id.partition("::")
    path = ROOT / file
    node = find_function(path, name.replace("::", "."))
    module = ast.parse(path.read_text()) if path.is_file() else None
    marks = [ast.unparse(d) for d in node.decorator_list] if node else []
    for stmt in module.body if module else []:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            marks.append(ast.unparse(stmt.value))
    return any(re.search(r"\bmark\.slow\b", mark) for mark in marks)


def _fill(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def _parts(lesson: Lesson) -> list[str]:
    """A lesson of several ideas (lesson.toml `[[part]]`): each part, its files and its tasks."""
    if not lesson.parts or lesson.previous is None:
        return []
    out = ["## The lesson in parts", ""]
    for number, part in enumerate(lesson.parts, 1):
        tasks = [str(n) for n, task in numbered(lesson) if task_part(lesson, task) == number - 1]
        files = ", ".join(f"`{name}`" for name in part.files + part.hunks)
        which = f" (task{'s' * (len(tasks) > 1)} {', '.join(tasks)})" if tasks else ""
        out += [_fill(f"{number}. **{part.title}**{which}: {files}"), ""]
    command = f"python -m stages diff {lesson.previous.number} {lesson.stage} --part N"
    return [*out, _fill(f"In the course repository, `{command}` shows part N alone."), ""]


def assignment_markdown(
    lesson: Lesson, copy: Path, *, solution: bool = False, repo: Path | None = None
) -> str:
    """ASSIGNMENT.md: the lesson in brief, the tasks, and the commands that grade them (run
    inside `repo` when the copy is part of a student repository)."""
    readme = lesson.path / "README.md"
    shown = copy.relative_to(repo) if repo is not None else copy
    folder = str(shown) if repo is not None else copy.name
    intro, idea = _readme_brief(readme.read_text() if readme.is_file() else "", folder)
    count = len(lesson.tasks)
    if solution:
        state = "This is the **solution** copy: every task function keeps its reference code."
    else:
        state = (
            f"It is the complete reference engine except for the {count} functions below: each "
            "keeps its signature and docstring (the contract), and its body raises "
            "`NotImplementedError`. Write them and change nothing else."
        )
    out = [f"# Assignment: stage {lesson.stage}, {lesson.title.lower()}", ""]
    out += [intro, ""] if intro else []
    out += ["## The idea", "", idea, ""] if idea else []
    out += _parts(lesson)
    out += [f"The whole lesson is `{folder}/README.md`, in your copy.", ""] * readme.is_file()
    out += [
        "## What to do",
        "",
        _fill(f"Your copy of the stage: `{shown}`. {state}"),
        "",
        _fill(
            "Grade it (each task's tests, and which of them pass), from the repository's root "
            "(the folder that holds this file):"
            if repo is not None
            else "Grade it (each task's tests, and which of them pass):"
        ),
        "",
        "```",
        grade_command(copy, repo),
        "```",
        "",
        _fill(
            "`--quick` leaves out the tests that use the real model (slow). The whole suite on "
            "your copy, every earlier stage's promises included:"
        ),
        "",
        "```",
        pytest_command(copy, repo=repo),
        "```",
        "",
        _fill(
            f"{CREDIT_RULE} The report counts the tasks that pass and the direct tests that "
            "pass, and names, for a failing test, the other task's stub it reached or the task "
            "function its failure was raised in."
        ),
        "",
    ]
    for number, task in numbered(lesson):
        out += [f"## Task {number}: `{task.function}`", "", _fill(" ".join(task.summary.split()))]
        out += [""]
        out += ["```python", _contract(lesson.path / task.file, task.qualname), "```", ""]
        hints = [*task.hints, *filter(None, [_previous_hint(lesson, task)])]
        if hints:
            out += ["Hints:", "", *(f"- {hint}" for hint in hints), ""]
        if task.tests:
            slow = " (slow: uses the real model)"
            out += ["Tests:", ""]
            out += [f"- `{t}`{slow if is_slow(t) else ''}" for t in task.tests]
            out += ["", "```", pytest_command(copy, task.tests, repo), "```", ""]
    return "\n".join(out).rstrip() + "\n"
