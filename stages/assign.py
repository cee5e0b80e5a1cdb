"""Assignments: a student's copy of a stage with its technique blanked, and its ASSIGNMENT.md.

    python -m stages assign 03 ~/hw          # ~/hw/03_paged/ (the copy) and ~/hw/ASSIGNMENT.md
    python -m stages grade ~/hw/03_paged     # each task's tests on the copy, reported per task

The stage's lesson.toml lists the functions that carry its technique (`[[task]]`). In the copy
each keeps its decorators, signature and docstring (the contract) and the rest of its body becomes
`raise NotImplementedError("task N: file.py::function — summary")`; every other byte is the
reference engine, except that an import only the blanked code used keeps a
`# noqa: F401, RUF100`: it stays as a hint, the copy lints clean, and so does the student's
finished code (where the noqa suppresses nothing, which RUF100 alone would report). A blanked
`*_reference` function takes the Triton kernels of its `*_triton` twin with it (`twins`):
solved, they would be the answer in another language. `--solution` writes the reference
itself; `--repo` a whole student repository (stages/student_repo.py). ASSIGNMENT.md is
written by stages/assignment_md.py.

As in tiny-llm, each task names its tests and the command that runs them; stages/grade.py
grades a copy per task.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from stages import STAGES_DIR
from stages.assignment_md import ASSIGNMENT_FILE as ASSIGNMENT_FILE
from stages.assignment_md import ROOT as ROOT
from stages.assignment_md import _docstring_node as _docstring_node
from stages.assignment_md import _readme_brief as _readme_brief
from stages.assignment_md import assignment_markdown as assignment_markdown
from stages.assignment_md import grade_command as grade_command
from stages.assignment_md import is_slow as is_slow
from stages.assignment_md import numbered as numbered
from stages.assignment_md import pytest_command as pytest_command
from stages.lesson import Task, find_function, load_lesson

LINE_LENGTH = 100  # pyproject's ruff line length: the generated code lints clean
STUB_PATTERN = re.compile(r"task (\d+): (\S+::[\w.]+) \u2014")
# marks an import that only the blanked code used: F401 while the task is blank, and RUF100
# (an unused noqa) once the student's code uses the import again
NOQA = "  # noqa: F401, RUF100"


# ------------------------------------------------------------------------------ the student copy
def stub_message(number: int, task: Task) -> str:
    return f"task {number}: {task.function} \u2014 {' '.join(task.summary.split())}"


def _literal(text: str) -> str:
    """A string literal as ruff format writes it: double quotes, unless single quotes need
    fewer escapes (more double quotes than single ones in the text)."""
    text = text.replace("\\", "\\\\")
    if text.count('"') > text.count("'"):
        return "'" + text.replace("'", "\\'") + "'"
    return '"' + text.replace('"', '\\"') + '"'


def stub_lines(number: int, task: Task, indent: str, generator: bool) -> list[str]:
    """The body that replaces a task function's code, wrapped to the line length."""
    message = stub_message(number, task)
    lines = [f"{indent}raise NotImplementedError({_literal(message)})"]
    if len(lines[0]) > LINE_LENGTH:  # implicit concatenation, one part per line
        width, parts = LINE_LENGTH - len(indent) - 6, [""]
        for word in re.findall(r"\S+\s*", message):
            if parts[-1] and len(_literal(parts[-1] + word)) - 2 > width:  # escapes count
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
