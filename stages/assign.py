"""Assignments: a student's copy of a stage with its technique blanked, and the grader for it.

    python -m stages assign 03 ~/hw          # ~/hw/03_paged/ (the copy) and ~/hw/ASSIGNMENT.md
    python -m stages grade ~/hw/03_paged     # each task's tests on the copy, reported per task

The stage's lesson.toml lists the functions that carry its technique (`[[task]]`). In the copy
each keeps its decorators, signature and docstring (the contract) and the rest of its body becomes
`raise NotImplementedError("task N: file.py::function — summary")`; every other byte is the
reference engine, except that an import only the blanked code used keeps a `# noqa: F401` (it
stays as a hint, and the copy lints clean). `--solution` writes the reference itself.

Grading runs the repository's suite on the copy (`pytest --stage-path`, as anyone can) and reports,
per task, which of the tests its manifest entry lists pass. As in tiny-llm, each task names its
tests and the command that runs them; as in the CMU llmsys grader, everything is graded on the
CPU, and a test that skips here (one that needs a GPU, say) is reported with its reason instead of
counted. A test that runs the whole engine reaches more than one task's function, so it can fail
on another task's stub: the report names the stubs a failure reached (in its traceback, its
captured output, or an exception that ended a background thread, such as the engine loop), so a
student sees "do task 2 first" rather than a bare failure or a hang.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    lines: Sequence[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> tuple[int, int]:
    """Zero-based [start, end) of a function's code after its docstring, own-line comments that
    close the body included (they belong to the code, and may give it away)."""
    doc = _docstring_node(node)
    if doc is None:
        raise ValueError(f"{node.name} has no docstring: a task function needs its contract")
    assert doc.end_lineno is not None and node.end_lineno is not None
    if len(node.body) > 1 and node.body[1].lineno <= doc.end_lineno:
        raise ValueError(f"{node.name}: code on the docstring's line; format the file first")
    start, end = doc.end_lineno, node.end_lineno
    while end < len(lines) and lines[end].lstrip().startswith("#"):
        if len(lines[end]) - len(lines[end].lstrip()) < doc.col_offset:
            break
        end += 1
    return start, end


def blank_tasks(folder: Path, tasks: Iterable[tuple[int, Task]]) -> None:
    """Replace each task function's code in `folder` (a stage copy) by its stub, in place."""
    by_file: dict[str, list[tuple[int, Task]]] = {}
    for number, task in tasks:
        by_file.setdefault(task.file, []).append((number, task))
    for name, file_tasks in by_file.items():
        path = folder / name
        lines = path.read_text().splitlines(keepends=True)
        edits = []
        for number, task in file_tasks:
            node = find_function(path, task.qualname)
            if node is None:
                raise ValueError(f"{path}: task function {task.qualname} not found")
            start, end = body_span(lines, node)
            indent = " " * _docstring_node(node).col_offset  # type: ignore[union-attr]
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


def grade_command(copy: Path) -> str:
    return f"cd {ROOT} && {_python()} -m stages grade {copy}"


def pytest_command(copy: Path, node_ids: Sequence[str] = ()) -> str:
    return " ".join([f"cd {ROOT} && {_python()} -m pytest -q --stage-path {copy}", *node_ids])


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


def assignment_markdown(lesson: Lesson, copy: Path, *, solution: bool = False) -> str:
    readme = lesson.path / "README.md"
    intro, idea = _readme_brief(readme.read_text() if readme.is_file() else "", copy.name)
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
    out += [f"The whole lesson is `{copy.name}/README.md`, in your copy.", ""] * readme.is_file()
    out += [
        "## What to do",
        "",
        _fill(f"Your copy of the stage: `{copy}`. {state}"),
        "",
        "Grade it (each task's tests, and which of them pass):",
        "",
        "```",
        grade_command(copy),
        "```",
        "",
        _fill(
            "`--quick` leaves out the tests that use the real model (slow). The whole suite on "
            "your copy, every earlier stage's promises included:"
        ),
        "",
        "```",
        pytest_command(copy),
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
            out += ["", "```", pytest_command(copy, task.tests), "```", ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------- running the tests
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


@dataclass(frozen=True, slots=True)
class Case:
    """One collected test item (a node id with its [param] suffix) and how it ended."""

    node_id: str
    outcome: str  # passed | failed | error | skipped
    message: str = ""
    stubs: tuple[int, ...] = ()  # the task numbers whose stubs it reached
    seconds: float = 0.0


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


def _base(node_id: str) -> str:
    return node_id.partition("[")[0]


def _matches(collected: str, node_id: str) -> bool:
    return collected == node_id or collected.startswith((node_id + "[", node_id + "::"))


def run_jobs(
    jobs: Sequence[Job], *, timeout: float = 300.0, show_output: bool = False
) -> list[RunResult]:
    """Run each job's pytest session, one after another in one worker process (the import of
    torch and the model happens once), each with a fresh copy of the suite's modules."""
    with tempfile.TemporaryDirectory(prefix="stages-grade-") as tmp:
        spec, results = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        spec.write_text(
            json.dumps(
                {
                    "out": str(results),
                    "timeout": timeout,
                    "jobs": [
                        [str(j.copy), list(j.node_ids), j.quick, j.cases, j.stage] for j in jobs
                    ],
                }
            )
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "stages.assign", "--run-jobs", str(spec)],
            cwd=ROOT,
            env=env,
            stdout=None if show_output else subprocess.PIPE,
            stderr=None if show_output else subprocess.STDOUT,
            text=True,
        )
        done = json.loads(results.read_text()) if results.is_file() else []
    output = proc.stdout or ""
    if len(done) != len(jobs):
        raise RuntimeError(f"the test worker stopped (exit {proc.returncode}):\n{output[-4000:]}")
    return [
        RunResult(
            cases=tuple(Case(c[0], c[1], c[2], tuple(c[3]), c[4]) for c in r["cases"]),
            deselected=tuple(r["deselected"]),
            thread_stubs=tuple(r["thread_stubs"]),
            exit_code=r["exit_code"],
            output=output,
        )
        for r in done
    ]


def _stub_numbers(text: str) -> set[int]:
    return {int(m[1]) for m in STUB_PATTERN.finditer(text)}


class _Recorder:
    """A pytest plugin for the worker: records each item's outcome and the stubs it reached,
    bounds each test phase by a timeout, and fails the running phase at once when a background
    thread dies on a stub (a test waiting on that thread would otherwise wait for its timeout)."""

    def __init__(self, timeout: float, cases: str = "all") -> None:
        self.timeout, self.which_cases = timeout, cases
        self._failed_tests: set[str] = set()
        self.cases: dict[str, dict[str, Any]] = {}
        self.deselected: list[str] = []
        self.thread_stubs: set[int] = set()
        self._in_phase = False
        self._stub_death: str | None = None

    def pytest_sessionstart(self, session: Any) -> None:
        previous = self._previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            found = _stub_numbers(str(args.exc_value))
            if found:
                self.thread_stubs |= found
                if self._in_phase and threading.current_thread() is not threading.main_thread():
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

    def _on_alarm(self, signum: int, frame: Any) -> None:
        import pytest

        if not self._in_phase:  # a late signal, after its phase ended: nothing to interrupt
            return
        reason, self._stub_death = self._stub_death, None
        pytest.fail(reason or f"timed out after {self.timeout:.0f} s", pytrace=False)

    @contextmanager
    def _phase(self) -> Iterator[None]:
        self._in_phase = True
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._in_phase = False

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        if self.which_cases == "first":
            kept, seen = [], set()
            for item in items:
                if _base(item.nodeid) not in seen:
                    seen.add(_base(item.nodeid))
                    kept.append(item)
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept

    def pytest_runtest_setup(self, item: Any) -> Iterator[None]:
        if self.which_cases == "until-failure" and _base(item.nodeid) in self._failed_tests:
            import pytest

            pytest.skip("an earlier case of this test failed")
        with self._phase():
            return (yield)

    def pytest_runtest_call(self, item: Any) -> Iterator[None]:
        with self._phase():
            return (yield)

    def pytest_runtest_teardown(self, item: Any, nextitem: Any) -> Iterator[None]:
        with self._phase():
            return (yield)

    def pytest_deselected(self, items: Sequence[Any]) -> None:
        self.deselected += [item.nodeid for item in items]

    def pytest_runtest_logreport(self, report: Any) -> None:
        case = self.cases.setdefault(
            report.nodeid, {"outcome": "passed", "message": "", "stubs": set(), "seconds": 0.0}
        )
        case["seconds"] += report.duration
        if report.failed:
            self._failed_tests.add(_base(report.nodeid))
            text = report.longreprtext + "".join(content for _, content in report.sections)
            case["stubs"] |= _stub_numbers(text)
            if case["outcome"] != "failed":
                case["outcome"] = "failed" if report.when == "call" else "error"
                crash = getattr(report.longrepr, "reprcrash", None)
                lines = (crash.message if crash else report.longreprtext).strip().splitlines()
                case["message"] = lines[0] if lines else report.when
        elif report.skipped and case["outcome"] == "passed":
            case["outcome"] = "skipped"
            longrepr = report.longrepr
            case["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)

    def result(self, exit_code: int) -> dict[str, Any]:
        cases = [
            [k, v["outcome"], v["message"], sorted(v["stubs"]), v["seconds"]]
            for k, v in self.cases.items()
        ]
        return {
            "cases": cases,
            "deselected": self.deselected,
            "thread_stubs": sorted(self.thread_stubs),
            "exit_code": exit_code,
        }


def _worker(spec_path: str) -> None:
    """`python -m stages.assign --run-jobs SPEC`: the worker process of `run_jobs`."""
    import pytest

    for name in ("pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown"):
        pytest.hookimpl(wrapper=True)(getattr(_Recorder, name))  # pytest loads in the worker only
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for copy, node_ids, quick, cases, stage in spec["jobs"]:
        for name in list(sys.modules):  # a fresh suite (and stage copy) for every session
            if name == "tests" or name.startswith(("tests.", "stages._external")):
                del sys.modules[name]
        recorder = _Recorder(spec["timeout"], cases)
        args = ["-q", "-p", "no:cacheprovider", "--stage-path", copy, *node_ids]
        args += (["-m", "not slow"] if quick else []) + (["--stage", stage] if stage else [])
        code = pytest.main(args, plugins=[recorder])
        results.append(recorder.result(int(code)))
        Path(spec["out"]).write_text(json.dumps(results))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads a timed-out test left behind must not keep the worker alive


# ------------------------------------------------------------------------------------- grading
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
    """pass: every test that ran passed (at least one); fail otherwise; else 'not graded'."""
    statuses = {t.status for t in tests}
    if "fail" in statuses:
        return "fail"
    return "pass" if "pass" in statuses else "not graded"


def _why(lesson: Lesson, number: int, test: GradedTest) -> list[str]:
    """What to tell about a failing test: the stubs it reached, or its first failure."""
    failed = [c for c in test.cases if c.outcome in ("failed", "error")]
    others = sorted(test.blocked_by - {number})
    if others:
        names = ", ".join(f"{n} ({lesson.tasks[n - 1].qualname})" for n in others)
        return [f"reached the stub of task {names}: that task comes first"]
    if test.blocked_by:
        return ["reached this task's stub"]
    messages = [c.message for c in failed if c.message]
    return (
        [messages[0] if len(messages[0]) <= 150 else messages[0][:147] + "..."] if messages else []
    )


def format_report(
    lesson: Lesson,
    copy: Path,
    result: RunResult,
    states: dict[int, str],
    chosen: Iterable[int] | None = None,
) -> str:
    """The per-task report: each task's status, each of its tests with its passing cases, the
    first failure's message, and the other tasks whose stubs a failure reached."""
    chosen = set(chosen or range(1, len(lesson.tasks) + 1))
    lines, passed = [], 0
    for number, task in numbered(lesson):
        if number not in chosen:
            continue
        tests = task_tests(task, result)
        status = task_status(tests)
        passed += status == "pass"
        note = {"stub": "not started", "written": ""}.get(states[number], states[number])
        title = f"task {number}  {task.function}: {status.upper()}"
        lines.append(title + (f" ({note})" if note else ""))
        for test in tests:
            counts = sum(c.outcome == "passed" for c in test.cases), len(test.cases)
            detail = f"  {counts[0]}/{counts[1]} cases" if test.cases else ""
            if test.status == "not run":
                slow = any(_matches(d, test.node_id) for d in result.deselected)
                detail = "  (slow: left out by --quick)" if slow else "  (no test for this stage)"
            lines.append(f"    {test.status:<7} {test.node_id}{detail}")
            lines += [f"{' ' * 12}{why}" for why in _why(lesson, number, test)]
    for n in sorted(set(result.thread_stubs)):
        where = lesson.tasks[n - 1].qualname
        lines.append(f"a background thread stopped on the stub of task {n} ({where})")
    head = f"stage {lesson.stage} ({lesson.title}), {copy}: {passed} of {len(chosen)} tasks pass"
    return "\n".join([head, "", *lines])


def grade(
    copy: Path | str,
    *,
    stage: str | None = None,
    quick: bool = False,
    tasks: Sequence[int] = (),
    timeout: float = 300.0,
    verbose: bool = False,
) -> tuple[str, bool]:
    """Run the tasks' tests on a stage copy; return the report and whether every task passes."""
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
    node_ids = [t for n, task in numbered(lesson) if n in chosen for t in task.tests]
    job = Job(folder, tuple(dict.fromkeys(node_ids)), quick, stage=lesson.stage)
    (result,) = run_jobs([job], timeout=timeout, show_output=verbose)
    if result.exit_code not in (0, 1, 5):  # 5: nothing collected (--quick, say): still a report
        raise RuntimeError(
            f"pytest could not run (exit {result.exit_code}):\n{result.output[-3000:]}"
        )
    report = format_report(lesson, folder, result, states, chosen)
    graded = [task_status(task_tests(t, result)) for n, t in numbered(lesson) if n in chosen]
    return report, all(s == "pass" for s in graded)


if __name__ == "__main__" and sys.argv[1:2] == ["--run-jobs"]:
    _worker(sys.argv[2])
