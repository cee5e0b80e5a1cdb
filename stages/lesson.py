"""A stage's manifest, `lesson.toml`, and the snapshot guard built on it.

Stage N is stage N-1 copied forward plus one technique. The manifest names that technique, the
files it changes relative to the previous stage, and the functions that carry it (the ones an
assignment blanks). Everything the manifest does not list must stay byte-identical to the
previous stage: that is what keeps `diff` between two folders equal to the lesson, and what
`snapshot_violations` checks. Nothing here imports a stage package, so a broken engine cannot
hide a broken snapshot.
"""

from __future__ import annotations

import ast
import difflib
import itertools
import re
import sys
import tomllib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages import STAGES_DIR, StageInfo, list_stages, stage_info

MANIFEST = "lesson.toml"
STAGE_SPECIFIC = frozenset({"README.md", MANIFEST})  # differ in every stage, never listed
STAGE_SPECIFIC_DIRS = frozenset({"diagrams"})  # the README's figures: stage-specific as it is
_FOLDER = re.compile(r"^(\d\d)_([a-z0-9_]+)$")
_TOP_KEYS = {"stage", "name", "title", "technique", "changes", "removed", "task", "part"}
_TASK_KEYS = {"function", "summary", "hints", "tests", "points"}
DEFAULT_POINTS = 10  # a task's points where its [[task]] names none
_PART_KEYS = {"title", "files", "hunks"}


@dataclass(frozen=True, slots=True)
class Task:
    """One function that carries the technique: what an assignment blanks and grades."""

    function: str  # "file.py::name" or "file.py::Class.method"
    summary: str
    hints: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()  # pytest node ids, without a [param] suffix
    points: int = DEFAULT_POINTS  # what the task is worth in a grade (gradebook, Classroom)

    @property
    def file(self) -> str:
        return self.function.partition("::")[0]

    @property
    def qualname(self) -> str:
        return self.function.partition("::")[2]


@dataclass(frozen=True, slots=True)
class Part:
    """One idea of a lesson that teaches several. A part is cut by idea, not by file: `files`
    are the files whose changes are this part's (each file in one part: its home), and `hunks`
    ("file.py::Class.method") take the changed lines inside one definition out of that file's
    home part into this one, so a file that serves two ideas shows each change in its idea's
    part. `python -m stages diff A B --part N` shows the part alone, on top of parts 1..N-1;
    stages/lesson_size.py sizes it."""

    title: str
    files: tuple[str, ...]
    hunks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Lesson:
    """A loaded, validated manifest together with where its stage and the previous one live."""

    stage: str
    name: str
    title: str
    technique: str
    changes: tuple[str, ...]
    removed: tuple[str, ...]
    tasks: tuple[Task, ...]
    path: Path
    previous: StageInfo | None
    parts: tuple[Part, ...] = ()  # none: the lesson is one idea


def _stage_folders(root: Path) -> list[StageInfo]:
    """Stage folders under `root` (like `stages.list_stages`, for any directory)."""
    found = [(_FOLDER.match(p.name), p) for p in sorted(root.iterdir()) if p.is_dir()]
    return [StageInfo(m[1], m[2], p) for m, p in found if m and (p / "__init__.py").exists()]


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _text(table: dict[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: `{key}` must be a non-empty string, got {value!r}")
    return value


def _task(table: Any, where: str) -> Task:
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table ([[task]])")
    if unknown := set(table) - _TASK_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_TASK_KEYS)}")
    task = Task(
        function=_text(table, "function", where),
        summary=_text(table, "summary", where),
        hints=_strings(table.get("hints", []), f"{where}.hints"),
        tests=_strings(table.get("tests", []), f"{where}.tests"),
        points=table.get("points", DEFAULT_POINTS),
    )
    if not isinstance(task.points, int) or isinstance(task.points, bool) or task.points < 0:
        raise ValueError(f"{where}: points must be a whole number >= 0, got {task.points!r}")
    if not task.file or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", task.qualname):
        raise ValueError(f"{where}: function {task.function!r} is not 'file.py::Class.method'")
    return task


def _parts(tables: Any, changes: tuple[str, ...], where: str) -> tuple[Part, ...]:
    """`[[part]]` tables: every changed file (bench.py aside) in exactly one part's `files`, or
    no parts; each hunk ("file.py::name") in one part, in a changed Python file."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"{where}: `part` must be an array of tables ([[part]])")
    if unknown := {key for table in tables for key in table} - _PART_KEYS:
        raise ValueError(f"{where}: unknown part keys {sorted(unknown)}; allowed: {_PART_KEYS}")
    parts = tuple(
        Part(
            _text(t, "title", where),
            _strings(t.get("files", []), f"{where}: part files"),
            _strings(t.get("hunks", []), f"{where}: part hunks"),
        )
        for t in tables
    )
    listed = [name for part in parts for name in part.files]
    expected = set(changes) - {"bench.py"}
    if parts and (len(set(listed)) != len(listed) or set(listed) != expected):
        missing, stray = sorted(expected - set(listed)), sorted(set(listed) - expected)
        raise ValueError(
            f"{where}: each changed file must be in exactly one part (bench.py aside); "
            f"in none: {missing}, not changed: {stray}, or listed twice"
        )
    hunks = [hunk for part in parts for hunk in part.hunks]
    if len(set(hunks)) != len(hunks):
        raise ValueError(f"{where}: a hunk is listed in two parts: {hunks}")
    for hunk in hunks:
        file, _, name = hunk.partition("::")
        if file not in expected or not file.endswith(".py") or not name:
            raise ValueError(f"{where}: hunk {hunk!r} is not 'file.py::name' of a changed file")
    return parts


def load_lesson(key_or_path: str | int | Path, *, stages_dir: Path = STAGES_DIR) -> Lesson:
    """Load the manifest of a repository stage ("03") or of any stage folder (a Path: a student's
    copy). The previous stage is looked up among the stage folders of `stages_dir` (the
    repository's by default), so a student's copy is compared with the repository's."""
    is_path = isinstance(key_or_path, Path) or "/" in str(key_or_path)
    folder = Path(key_or_path) if is_path else stage_info(key_or_path).path
    file = folder / MANIFEST
    if not file.is_file():
        raise ValueError(f"{file}: no manifest; every stage folder needs a {MANIFEST}")
    try:
        data = tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid TOML: {exc}") from exc
    if unknown := set(data) - _TOP_KEYS:
        raise ValueError(f"{file}: unknown keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    number = _text(data, "stage", str(file))
    if not re.fullmatch(r"\d\d", number):
        raise ValueError(f'{file}: `stage` must be two digits like "03", got {number!r}')
    match = _FOLDER.match(folder.name)
    if match and match[1] != number:
        raise ValueError(f"{file}: says stage {number} but the folder is {folder.name}")
    changes = _strings(data.get("changes"), f"{file}: `changes`")
    removed = _strings(data.get("removed", []), f"{file}: `removed`")
    tasks = data.get("task", [])
    if not isinstance(tasks, list):
        raise ValueError(f"{file}: `task` must be an array of tables ([[task]])")
    for name in changes + removed:
        if name in STAGE_SPECIFIC:
            raise ValueError(f"{file}: {name} is stage-specific by nature; do not list it")
    if len(set(changes)) != len(changes) or set(changes) & set(removed):
        raise ValueError(f"{file}: a file is listed twice in `changes` / `removed`")
    if missing := [name for name in changes if not (folder / name).is_file()]:
        raise ValueError(f"{file}: `changes` lists files that do not exist: {missing}")
    lesson = Lesson(
        stage=number,
        name=_text(data, "name", str(file)),
        title=_text(data, "title", str(file)),
        technique=_text(data, "technique", str(file)),
        changes=changes,
        removed=removed,
        tasks=tuple(_task(t, f"{file}: task {i + 1}") for i, t in enumerate(tasks)),
        path=folder,
        previous=next((s for s in reversed(_stage_folders(stages_dir)) if s.number < number), None),
        parts=_parts(data.get("part", []), changes, str(file)),
    )
    if stray := [t.function for t in lesson.tasks if t.file not in changes]:
        raise ValueError(f"{file}: task functions in files not listed in `changes`: {stray}")
    for part in lesson.parts:
        for hunk in part.hunks:
            name, _, qualname = hunk.partition("::")
            if not any(q == qualname for q, _, _ in _spans(_text_of(folder / name))) and not any(
                q == qualname for q, _, _ in _spans(_text_of(lesson_previous_file(lesson, name)))
            ):
                raise ValueError(f"{file}: hunk {hunk!r}: no such definition in either stage")
    return lesson


def _scope(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a module or class body, looking inside if/try/with blocks (kernels defined
    only when triton imports) but not inside other functions or classes."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If | ast.With):
            found += _scope(node.body) + _scope(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            blocks = [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
            found += [n for block in blocks for n in _scope(block)]
    return found


def find_function(path: Path, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The definition of `name` or `Class.method` in a source file, or None (file missing too).
    Parsed, never imported: a student's half-written engine can still be inspected."""
    if not path.is_file():
        return None
    body: list[ast.stmt] = ast.parse(path.read_text(), filename=str(path)).body
    *outer, last = qualname.split(".")
    for name in outer:
        cls = [n for n in _scope(body) if isinstance(n, ast.ClassDef) and n.name == name]
        if not cls:
            return None
        body = cls[-1].body
    defs = [n for n in _scope(body) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return next((n for n in reversed(defs) if n.name == last), None)


def _files(folder: Path) -> set[str]:
    """Every file of a stage folder that must be accounted for (caches and dotfiles aside)."""
    names = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    return {
        n.as_posix()
        for n in names
        if n.as_posix() not in STAGE_SPECIFIC
        and n.parts[0] not in STAGE_SPECIFIC_DIRS
        and not any(part == "__pycache__" or part.startswith(".") for part in n.parts)
    }


def unchanged_modules(lesson: Lesson) -> list[str]:
    """Files of the previous stage that this stage must carry byte for byte."""
    if lesson.previous is None:
        return []
    listed = set(lesson.changes) | set(lesson.removed)
    return sorted(_files(lesson.previous.path) - listed)


def snapshot_violations(lesson: Lesson) -> list[str]:
    """Everything that makes the folder differ from "previous stage + the listed changes"."""
    here, prev = lesson.path, lesson.previous
    before = _files(prev.path) if prev else set()
    where = f"{here.name} (stage {lesson.stage})"
    problems = []
    for name in unchanged_modules(lesson):
        assert prev is not None
        if not (here / name).is_file():
            problems.append(f"{where}: {name} of {prev.folder} is missing and not in `removed`")
        elif (here / name).read_bytes() != (prev.path / name).read_bytes():
            problems.append(f"{where}: {name} differs from {prev.folder}/{name} but is not listed")
    for name in sorted(_files(here) - before - set(lesson.changes)):
        problems.append(f"{where}: new file {name} is not listed in `changes`")
    for name in lesson.changes:
        old = prev.path / name if prev else None
        if old and name in before and (here / name).read_bytes() == old.read_bytes():
            problems.append(f"{where}: {name} is listed but identical to {prev.folder}'s (stale)")
    for name in lesson.removed:
        if (here / name).exists():
            problems.append(f"{where}: {name} is listed in `removed` but still exists")
        elif name not in before:
            problems.append(f"{where}: `removed` lists {name}, which the previous stage lacks")
    return problems


def task_problems(lesson: Lesson) -> list[str]:
    """Task functions that are missing or have no docstring (the contract a student keeps)."""
    problems = []
    for task in lesson.tasks:
        try:
            node = find_function(lesson.path / task.file, task.qualname)
        except SyntaxError as exc:
            problems.append(f"{lesson.path.name}: {task.file} does not parse: {exc}")
            continue
        if node is None:
            problems.append(f"{lesson.path.name}: task function {task.function} not found")
        elif ast.get_docstring(node) is None:
            problems.append(f"{lesson.path.name}: task function {task.function} has no docstring")
    return problems


def lesson_previous_file(lesson: Lesson, name: str) -> Path | None:
    """`name` in the previous stage's folder (None for stage 01)."""
    return lesson.previous.path / name if lesson.previous else None


def _text_of(path: Path | None) -> str:
    return path.read_text() if path is not None and path.is_file() else ""


def _spans(source: str) -> list[tuple[str, int, int]]:
    """(qualname, first line, last line) of every class and function of a module, nested ones
    too, decorators included (lines from 1). A file that does not parse has none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[tuple[str, int, int]] = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in _scope(body):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found.append((prefix + node.name, first, node.end_lineno or node.lineno))
                walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    return found


def _owners(lesson: Lesson, name: str, lines: list[str]) -> list[int]:
    """For each line of one side of a changed file, the part (index) that owns a change there:
    the part that claims the innermost definition holding the line as a hunk, else the file's
    home part (the one whose `files` lists it)."""
    home = next(i for i, part in enumerate(lesson.parts) if name in part.files)
    owner = [home] * len(lines)
    claimed = {
        hunk.partition("::")[2]: i
        for i, part in enumerate(lesson.parts)
        for hunk in part.hunks
        if hunk.partition("::")[0] == name
    }
    if not claimed:
        return owner
    # Outer definitions first, so an inner claimed one overrides its outer one.
    for qualname, first, last in sorted(_spans("".join(lines)), key=lambda s: s[1] - s[2]):
        if qualname in claimed:
            owner[first - 1 : last] = [claimed[qualname]] * (last - first + 1)
    return owner


def _owned_diff(lesson: Lesson, name: str) -> list[tuple[str, str, int]]:
    """A changed file's lesson diff, line by line in difflib's order (the matching
    `folder_stat` counts): ("equal", line, -1) for a line both sides share, ("delete", line,
    owner) for a removed one, ("insert", line, owner) for an added one, where owner is the part
    (index) that owns the change. Every view of the parts reads this one walk."""
    old = _text_of(lesson_previous_file(lesson, name)).splitlines(keepends=True)
    new = _text_of(lesson.path / name).splitlines(keepends=True)
    old_owner, new_owner = _owners(lesson, name, old), _owners(lesson, name, new)
    lines: list[tuple[str, str, int]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes():
        if tag == "equal":
            lines += [("equal", line, -1) for line in old[i1:i2]]
            continue
        lines += [("delete", old[i], old_owner[i]) for i in range(i1, i2)]
        lines += [("insert", new[j], new_owner[j]) for j in range(j1, j2)]
    return lines


def part_of_change(lesson: Lesson, name: str) -> list[tuple[int, int]]:
    """For each changed line of a file, who owns it: (part, +1 for an added line / -1 for a
    removed one), in diff order."""
    diff = _owned_diff(lesson, name)
    return [(owner, 1 if kind == "insert" else -1) for kind, _, owner in diff if kind != "equal"]


def with_parts(lesson: Lesson, name: str, applied: Collection[int]) -> list[str]:
    """One changed file with only the changes of the parts in `applied` made: parts are
    patches stacked in order, so `with_parts(..., range(N))` -> `with_parts(..., range(N + 1))`
    is part N+1 alone, and every part applied is the new stage's file."""
    return [
        line
        for kind, line, owner in _owned_diff(lesson, name)
        if kind == "equal" or (kind == "delete") != (owner in applied)
    ]


def part_line_counts(lesson: Lesson) -> list[dict[str, tuple[int, int]]]:
    """For each part of the lesson, {file: (lines added, lines removed)} of its changes."""
    counts: list[dict[str, tuple[int, int]]] = [{} for _ in lesson.parts]
    for name in sorted({n for part in lesson.parts for n in part.files}):
        for owner, sign in part_of_change(lesson, name):
            added, removed = counts[owner].get(name, (0, 0))
            counts[owner][name] = (added + (sign > 0), removed + (sign < 0))
    return counts


def task_part(lesson: Lesson, task: Task) -> int | None:
    """The part (index) a task belongs to: the one claiming the innermost hunk that holds its
    function, else its file's home part; None when the lesson has no parts."""
    if not lesson.parts:
        return None
    claimed = {hunk: i for i, part in enumerate(lesson.parts) for hunk in part.hunks}
    qualname = task.qualname
    while qualname:
        if f"{task.file}::{qualname}" in claimed:
            return claimed[f"{task.file}::{qualname}"]
        qualname = qualname.rpartition(".")[0]
    return next(i for i, part in enumerate(lesson.parts) if task.file in part.files)


def _lesson_files(old: str, new: str) -> set[str] | None:
    """What the stages after `old` up to `new` list in their lesson.toml (`changes` and
    `removed`): the lesson. None when a manifest is invalid (then every module is shown)."""
    low, high = sorted((stage_info(old).number, stage_info(new).number))
    try:
        lessons = [load_lesson(i.number) for i in list_stages() if low < i.number <= high]
    except ValueError as exc:
        print(f"[stages] {exc}; showing every module", file=sys.stderr)
        return None
    return {name for lesson in lessons for name in lesson.changes + lesson.removed}


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


class _Opcodes(difflib.SequenceMatcher):
    """A matcher that reports the opcodes it is given (so difflib groups them into hunks)."""

    def __init__(self, opcodes: list[tuple[str, int, int, int, int]]) -> None:
        super().__init__(None, [], [])
        self._given = opcodes

    def get_opcodes(self) -> list[tuple[str, int, int, int, int]]:
        return list(self._given)


def _part_opcodes(lesson: Lesson, name: str, part: int) -> list[tuple[str, int, int, int, int]]:
    """Opcodes from `with_parts(range(part))` to `with_parts(range(part + 1))` (part from 0):
    this part's changes and nothing else, from the lesson's own matching (a re-diff of the two
    versions could pair lines differently and show another part's lines as changed). An
    earlier part's change is already made on both sides, a later one's on neither."""
    steps: list[str] = []  # one per line of either version: "equal", "delete" or "insert"
    for kind, _, owner in _owned_diff(lesson, name):
        if kind == "equal":
            steps.append("equal")
        elif kind == "delete" and owner >= part:  # an earlier part already removed it
            steps.append("delete" if owner == part else "equal")
        elif kind == "insert" and owner <= part:  # a later part has not added it yet
            steps.append("insert" if owner == part else "equal")
    opcodes: list[tuple[str, int, int, int, int]] = []
    before = after = 0
    for tag, run in itertools.groupby(steps):
        n = len(list(run))
        size_before, size_after = (0 if tag == "insert" else n), (0 if tag == "delete" else n)
        opcodes.append((tag, before, before + size_before, after, after + size_after))
        before, after = before + size_before, after + size_after
    return opcodes


def _range(start: int, length: int) -> str:
    """A unified diff's `start,length` (the line before an empty range, as diff writes it)."""
    return f"{start + 1 if length else start},{length}" if length != 1 else f"{start + 1}"


def part_diff(lesson: Lesson, part: int) -> Iterator[str]:
    """Part `part` (from 1) of a lesson alone: each file with parts 1..part-1 made, against
    the same file with this part made too (`python -m stages diff A B --part N`)."""
    assert lesson.previous is not None
    for name in sorted({name for p in lesson.parts for name in p.files}):
        before = with_parts(lesson, name, range(part - 1))
        after = with_parts(lesson, name, range(part))
        groups = list(_Opcodes(_part_opcodes(lesson, name, part - 1)).get_grouped_opcodes(3))
        if not groups or groups == [[("equal", 0, len(before), 0, len(after))]]:
            continue
        yield f"--- {lesson.previous.path.name}/{name}\n+++ {lesson.path.name}/{name}\n"
        for group in groups:
            first, last = group[0], group[-1]
            old_range = _range(first[1], last[2] - first[1])
            new_range = _range(first[3], last[4] - first[3])
            yield f"@@ -{old_range} +{new_range} @@\n"
            for tag, i1, i2, j1, j2 in group:
                lines = [" " + line for line in before[i1:i2]] if tag == "equal" else []
                lines += ["-" + line for line in before[i1:i2]] if tag == "delete" else []
                lines += ["+" + line for line in after[j1:j2]] if tag == "insert" else []
                yield from (line if line.endswith("\n") else line + "\n" for line in lines)


def lesson_diff(a: str, b: str, *, every_file: bool = False) -> Iterator[str]:
    """The unified diff from stage `a` to stage `b` (`python -m stages diff A B`), line by line.
    By default only the modules the lesson.toml of each stage after A up to B lists, without
    bench.py (each stage's benchmark differs wholesale by nature); `every_file` shows every
    file, READMEs included."""
    old, new = stage_info(a).path, stage_info(b).path
    listed = None if every_file else _lesson_files(a, b)

    def files(root: Path) -> set[str]:
        return {
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and (every_file or p.suffix == ".py")
        }

    names = files(old) | files(new)
    if listed is not None:
        names &= listed - {"bench.py"}
    for name in sorted(names):
        a_lines = (
            (old / name).read_text().splitlines(keepends=True) if (old / name).exists() else []
        )
        b_lines = (
            (new / name).read_text().splitlines(keepends=True) if (new / name).exists() else []
        )
        diff = difflib.unified_diff(a_lines, b_lines, f"{old.name}/{name}", f"{new.name}/{name}")
        for line in diff:
            yield line if line.endswith("\n") else line + "\n"
