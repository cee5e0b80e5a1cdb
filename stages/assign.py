"""Assignments: a student's copy of a stage with its technique blanked, and its ASSIGNMENT.md.

    python -m stages assign 03 ~/hw          # ~/hw/03_paged/ (the copy) and ~/hw/ASSIGNMENT.md
    python -m stages grade ~/hw/03_paged     # each task's tests on the copy, reported per task

The stage's lesson.toml lists the functions that carry its technique (`[[task]]`). In the copy
each keeps its decorators, signature and docstring (the contract) and the rest of its body becomes
`raise NotImplementedError("task N: file.py::function — summary")`; every other byte is the
reference engine, except that an import only the blanked code used keeps a `# noqa: F401` (it
stays as a hint, and the copy lints clean). `--solution` writes the reference itself.

As in tiny-llm, each task names its tests and the command that runs them; stages/grade.py
grades a copy per task.
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

from stages import STAGES_DIR
from stages.lesson import Lesson, Task, find_function, load_lesson

ROOT = STAGES_DIR.parent  # the repository: its tests/ grade every copy
LINE_LENGTH = 100  # pyproject's ruff line length: the generated code lints clean
STUB_PATTERN = re.compile(r"task (\d+): (\S+::[\w.]+) \u2014")
ASSIGNMENT_FILE = "ASSIGNMENT.md"
NOQA = "  # noqa: F401"  # marks an import that only the blanked code used


# ------------------------------------------------------------------------------ the student copy
def stub_message(number: int, task: Task) -> str:
    return f"task {number}: {task.function} \u2014 {' '.join(task.summary.split())}"


def _literal(text: str) -> str:
    """A string literal as ruff format writes it (double quotes unless that needs escapes)."""
    text = text.replace("\\", "\\\\")
    if '"' in text and "'" not in text:
        return f"'{text}'"
    return '"' + text.replace('"', '\\"') + '"'


def stub_lines(number: int, task: Task, indent: str, generator: bool) -> list[str]:
    """The body that replaces a task function's code, wrapped to the line length."""
    message = stub_message(number, task)
    lines = [f"{indent}raise NotImplementedError({_literal(message)})"]
    if len(lines[0]) > LINE_LENGTH:  # implicit concatenation, one part per line
        width, parts = LINE_LENGTH - len(indent) - 6, [""]
        for word in re.findall(r"\S+\s*", message):
            if parts[-1] and len(parts[-1] + word) > width:
                parts.append("")
            parts[-1] += word
        inner = [f"{indent}    {_literal(part)}" for part in parts]
        lines = [f"{indent}raise NotImplementedError(", *inner, f"{indent})"]
    if generator:  # `yield` anywhere makes a (async) generator: keep that part of the contract
        lines.append(f"{indent}yield  # keeps this a generator, as its contract says")
    return [line + "\n" for line in lines]


def _is_generator(node: ast.AST) -> bool:
    todo = list(ast.iter_child_nodes(node))
    while todo:
        child = todo.pop()
        if isinstance(child, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
        ):
            todo.extend(ast.iter_child_nodes(child))
    return False


def _docstring_node(node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.Expr | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first if isinstance(first.value.value, str) else None
    return None


def body_span(
    lines: Sequence[str],
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    *,
    twin: bool = False,
) -> tuple[int, int]:
    """Zero-based [start, end) of a function's code after its docstring, own-line comments that
    close the body included (they belong to the code, and may give it away). A task function
    needs its docstring (the contract); a `twin` kernel may have none (its code starts at its
    first statement)."""
    doc = _docstring_node(node)
    if doc is None and twin:
        first = node.body[0]
        start, end, col = first.lineno - 1, node.end_lineno, first.col_offset
    elif doc is None:
        raise ValueError(f"{node.name} has no docstring: a task function needs its contract")
    else:
        assert doc.end_lineno is not None
        if len(node.body) > 1 and node.body[1].lineno <= doc.end_lineno:
            raise ValueError(f"{node.name}: code on the docstring's line; format the file first")
        start, end, col = doc.end_lineno, node.end_lineno, doc.col_offset
    assert end is not None
    while end < len(lines) and lines[end].lstrip().startswith("#"):
        if len(lines[end]) - len(lines[end].lstrip()) < col:
            break
        end += 1
    return start, end


_JIT = re.compile(r"\bjit\b")


def twins(stage_dir: Path, task: Task) -> tuple[str, ...]:
    """The Triton kernels ("file.py::name") that implement a `*_reference` task function's
    contract: those its `*_triton` twin launches, directly or through another kernel. Left
    solved beside the blanked reference they would be the answer in another language, so an
    assignment blanks them with the task (and restores them with it)."""
    if not task.qualname.endswith("_reference"):
        return ()
    path = stage_dir / task.file
    wrapper = find_function(path, task.qualname.removesuffix("_reference") + "_triton")
    if wrapper is None:
        return ()
    kernels = {
        node.name: node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
        and any(_JIT.search(ast.unparse(d)) for d in node.decorator_list)
    }
    found: list[str] = []
    todo: list[ast.FunctionDef | ast.AsyncFunctionDef] = [wrapper]
    while todo:
        for name in ast.walk(todo.pop()):
            if isinstance(name, ast.Name) and name.id in kernels and name.id not in found:
                found.append(name.id)
                todo.append(kernels[name.id])
    return tuple(f"{task.file}::{name}" for name in sorted(found))


def blank_tasks(folder: Path, tasks: Iterable[tuple[int, Task]]) -> None:
    """Replace each task function's code in `folder` (a stage copy) by its stub, in place, and
    the code of its Triton twins (`twins`) by the same stub."""
    by_file: dict[str, list[tuple[int, Task, str, bool]]] = {}
    for number, task in tasks:
        by_file.setdefault(task.file, []).append((number, task, task.qualname, False))
        for twin in twins(folder, task):
            by_file[task.file].append((number, task, twin.partition("::")[2], True))
    for name, file_tasks in by_file.items():
        path = folder / name
        lines = path.read_text().splitlines(keepends=True)
        edits = []
        for number, task, qualname, twin in file_tasks:
            node = find_function(path, qualname)
            if node is None:
                raise ValueError(f"{path}: task function {qualname} not found")
            start, end = body_span(lines, node, twin=twin)
            indent = " " * node.body[0].col_offset
            edits.append((start, end, stub_lines(number, task, indent, _is_generator(node))))
        before = "".join(lines)
        for start, end, stub in sorted(edits, reverse=True):
            lines[start:end] = stub
        for line in _imports_only_tasks_used(before, "".join(lines)):
            if "noqa" not in lines[line - 1]:
                lines[line - 1] = lines[line - 1].rstrip("\n") + NOQA + "\n"
        path.write_text("".join(lines))


def _imports_only_tasks_used(before: str, after: str) -> list[int]:
    """Lines (1-based) of the imports that only the blanked code used: they stay, as a hint,
    with a noqa so that the copy still lints clean."""

    def used(tree: ast.Module) -> set[str]:
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):  # names exported through __all__ count as used
            targets = getattr(node, "targets", [getattr(node, "target", None)])
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
        return names

    old, new = ast.parse(before), ast.parse(after)
    was_used, now_used = used(old), used(new)
    lines = []
    for node in ast.walk(new):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                name = alias.asname or alias.name.partition(".")[0]
                if name in was_used and name not in now_used:
                    lines.append(alias.lineno)
    return sorted(set(lines))


def numbered(lesson: Lesson) -> list[tuple[int, Task]]:
    return list(enumerate(lesson.tasks, start=1))


def assign(
    stage: str | int,
    out_dir: Path | str,
    *,
    solution: bool = False,
    restored: Iterable[int] = (),
    force: bool = False,
) -> Path:
    """Write the student copy of a stage to out_dir/NN_name and out_dir/ASSIGNMENT.md; return the
    copy. `solution` writes the reference instead; `restored` keeps those tasks' reference code."""
    lesson = load_lesson(str(stage))
    out = Path(out_dir).expanduser().resolve()
    copy, notes = out / lesson.path.name, out / ASSIGNMENT_FILE
    if out == STAGES_DIR or STAGES_DIR in out.parents:
        raise ValueError(f"{out} is inside the repository's stages/: choose another folder")
    if not force and (copy.exists() or notes.exists()):
        raise ValueError(f"{copy} or {notes} already exists: choose another folder, or --force")
    keep = set(restored)
    if unknown := keep - set(range(1, len(lesson.tasks) + 1)):
        raise ValueError(f"stage {lesson.stage} has no task {sorted(unknown)}")
    if copy.exists():
        shutil.rmtree(copy)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(lesson.path, copy, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    if not solution:
        blank_tasks(copy, [(n, t) for n, t in numbered(lesson) if n not in keep])
    notes.write_text(assignment_markdown(lesson, copy, solution=solution))
    return copy


# ------------------------------------------------------------------------------- ASSIGNMENT.md
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
    out += [f"The whole lesson is `{folder}/README.md`, in your copy.", ""] * readme.is_file()
    out += [
        "## What to do",
        "",
        _fill(f"Your copy of the stage: `{shown}`. {state}"),
        "",
        "Grade it (each task's tests, and which of them pass):",
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
            "A test that runs the whole engine reaches more than one of these functions: it can "
            "fail on another task's stub, and the grade report then names that task. Tasks "
            "whose tests are unit tests are graded on their own."
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
