"""Assignments (stages/assign.py), for every stage: the student copy blanks exactly the functions
the stage's lesson.toml lists (contract kept, everything else the reference, byte for byte),
lints clean, and its ASSIGNMENT.md names every task and the grading command; graded with the
suite, the skeleton fails each task's tests, the reference passes them, and a copy with one
task's function restored passes that task's tests, unless they reach another task's stub (a test
that runs the whole engine needs every function on its path; the grade report says which).

Repository checks: parametrized over the stage folders, not the `stage` fixture (`--stage NN`
still selects). The grading checks run each task's primary test (the first one its manifest
lists that is not marked slow) through `stages.assign.run_jobs`: one worker process per stage,
one pytest session per copy, a parametrized test cut to its first case where a pass is expected
and stopped at its first failing case where a failure is. The grading checks are a per-stage
fixed cost: by default they run on the newest stage and on the stages whose files changed
(conftest's `fixed_cost_stages`), on every stage with --full-matrix.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stages
from stages import assign as assignments
from stages import grade as grading
from stages.lesson import Lesson, Task, find_function, load_lesson, task_part

from .conftest import fixed_cost_stages

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0  # per test phase, in the worker; a hang is a failure, not a stuck suite


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`info` is every stage folder (those given with --stage); none with --stage-path: a
    student's copy is graded by the suite, not checked as an assignment generator."""
    if "info" not in metafunc.fixturenames:
        return
    wanted = {f"{int(s):02d}" for s in metafunc.config.getoption("--stage")}
    chosen = [
        info
        for info in stages.list_stages()
        if not metafunc.config.getoption("--stage-path") and (not wanted or info.number in wanted)
    ]
    if "runs" in metafunc.fixturenames:  # grading runs pytest sessions: a per-stage fixed cost
        kept = set(fixed_cost_stages(metafunc.config, [i.number for i in chosen]))
        chosen = [info for info in chosen if info.number in kept]
        _GRADED.update(info.number for info in chosen)
    metafunc.parametrize("info", chosen, ids=[i.folder for i in chosen])


@pytest.fixture(autouse=True)
def _repository_only(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--stage-path"):
        pytest.skip("the assignment generator is checked on the repository, not on a copy")


def primary_test(task: Task) -> str:
    """The test a task is checked by here: the first listed that is not marked slow."""
    assert task.tests, f"{task.function}: a task needs at least one test to be graded"
    return next((t for t in task.tests if not assignments.is_slow(t)), task.tests[0])


_COPIES: dict[str, tuple[Path, Path]] = {}
_RUNS: dict[str, dict[str, grading.RunResult]] = {}
_GRADED: set[str] = set()  # the stages whose grading this session runs (pytest_generate_tests)


def _copies(number: str, factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if number not in _COPIES:
        root = factory.mktemp(f"assign-{number}")
        skeleton = assignments.assign(number, root / "student")
        solution = assignments.assign(number, root / "solution", solution=True)
        _COPIES[number] = skeleton, solution
    return _COPIES[number]


@pytest.fixture
def copies(info: stages.StageInfo, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(skeleton copy, solution copy) of the stage, written once per session."""
    return _copies(info.number, tmp_path_factory)


def _grading_jobs(number: str, factory: pytest.TempPathFactory) -> dict[str, grading.Job]:
    """The primary tests on the skeleton, the solution and each one-task-restored copy."""
    lesson = load_lesson(number)
    skeleton, solution = _copies(number, factory)
    primaries = tuple(dict.fromkeys(primary_test(t) for t in lesson.tasks))
    jobs = {
        "skeleton": grading.Job(skeleton, primaries, cases="until-failure"),
        "solution": grading.Job(solution, primaries, cases="first"),
    }
    root = factory.mktemp(f"restored-{number}")
    for task_number, task in assignments.numbered(lesson):
        copy = assignments.assign(number, root / str(task_number), restored=[task_number])
        jobs[f"restored {task_number}"] = grading.Job(copy, (primary_test(task),), cases="first")
    return jobs


@pytest.fixture
def runs(
    info: stages.StageInfo, copies: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, grading.RunResult]:
    """The grading runs of the stage. Every stage this session grades is run at the first
    request, in one worker process: the start-up (Python, torch, the suite's imports) is paid
    once, not once per stage."""
    if info.number not in _RUNS:
        numbers = sorted((_GRADED | {info.number}) - set(_RUNS))
        jobs = {
            (n, name): job
            for n in numbers
            for name, job in _grading_jobs(n, tmp_path_factory).items()
        }
        results = grading.run_jobs(list(jobs.values()), timeout=TIMEOUT)
        for (number, name), result in zip(jobs, results, strict=True):
            _RUNS.setdefault(number, {})[name] = result
    return _RUNS[info.number]


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    parts = [node.args, node.returns, *node.decorator_list]
    return [type(node).__name__, node.name, *(ast.dump(p) if p else "" for p in parts)]


def _restore(copy_text: str, ref_text: str, path_copy: Path, path_ref: Path, lesson: Lesson) -> str:
    """The copy's text with every task body put back from the reference."""
    copy_lines, ref_lines = copy_text.splitlines(keepends=True), ref_text.splitlines(keepends=True)
    spans = []
    for task in lesson.tasks:
        twins = assignments.twins(lesson.path, task)
        for function in (task.function, *twins):
            file, _, qualname = function.partition("::")
            if path_ref.as_posix().endswith(f"/{file}"):
                twin = function in twins
                ours = find_function(path_copy, qualname)
                theirs = find_function(path_ref, qualname)
                spans.append(
                    (
                        assignments.body_span(copy_lines, ours, twin=twin),
                        assignments.body_span(ref_lines, theirs, twin=twin),
                    )
                )
    for (start, end), (ref_start, ref_end) in sorted(spans, reverse=True):
        copy_lines[start:end] = ref_lines[ref_start:ref_end]
    return "".join(copy_lines)


# --------------------------------------------------------------------------- the generated copy
def test_copy_blanks_exactly_the_task_functions(
    info: stages.StageInfo, copies: tuple[Path, Path]
) -> None:
    lesson = load_lesson(info.number)
    skeleton, solution = copies
    files = lambda root: sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert files(skeleton) == files(info.path) == files(solution)
    for name in files(info.path):
        assert (solution / name).read_bytes() == (info.path / name).read_bytes(), name
    task_files = {task.file for task in lesson.tasks}
    for name in sorted(set(files(info.path)) - task_files):
        assert (skeleton / name).read_bytes() == (info.path / name).read_bytes(), name
    for number, task in assignments.numbered(lesson):
        ours = find_function(skeleton / task.file, task.qualname)
        ref = find_function(info.path / task.file, task.qualname)
        assert ours is not None and ref is not None, task.function
        assert _signature(ours) == _signature(ref), f"{task.function}: contract changed"
        assert ast.get_docstring(ours, clean=False) == ast.get_docstring(ref, clean=False)
        code = ours.body[1:]
        assert isinstance(code[0], ast.Raise), f"{task.function}: body not replaced"
        assert ast.literal_eval(code[0].exc.args[0]) == assignments.stub_message(number, task)
        assert [ast.unparse(s) for s in code[1:]] in ([], ["yield"]), task.function
    for name in sorted(task_files):
        ours, ref = (skeleton / name).read_text(), (info.path / name).read_text()
        restored = _restore(ours, ref, skeleton / name, info.path / name, lesson)
        restored_lines, ref_lines = restored.splitlines(), ref.splitlines()
        assert len(restored_lines) == len(ref_lines), name
        import_lines = {
            line
            for node in ast.walk(ast.parse(ref))
            if isinstance(node, ast.Import | ast.ImportFrom)
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        }
        for number, (a, b) in enumerate(zip(restored_lines, ref_lines, strict=True), start=1):
            # outside the task bodies only an import the blanked code alone used may differ,
            # by a noqa that keeps the copy lint-clean (the import stays as a hint); in a
            # parenthesised import, the name's own line carries it
            assert a == b or (a == b + assignments.NOQA and number in import_lines), (
                f"{name}: {a!r} != {b!r}"
            )


def test_copy_lints_clean(info: stages.StageInfo, copies: tuple[Path, Path]) -> None:
    skeleton, _ = copies
    ruff = [sys.executable, "-m", "ruff"]
    config = ["--config", str(ROOT / "pyproject.toml"), "--no-cache"]
    for command in (
        ["check", *config, str(skeleton)],
        ["format", "--check", *config, str(skeleton)],
    ):
        proc = subprocess.run(ruff + command, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_student_repository_lints_clean_blank_and_solved(
    info: stages.StageInfo, tmp_path: Path
) -> None:
    """`make test` lints first: the student repository (`assign NN DIR --repo`) lints clean with
    its own pyproject.toml both as handed out and once the student wrote the reference's
    bodies. The second failed before: an import only the blanked code used carried
    `# noqa: F401`, and once used again ruff reported that noqa as unused (RUF100), so a
    correct solution failed `make test` before any test ran. (A `--solution` repository is
    the repository's own files, which its lint checks.) About 0.3 s a stage."""
    from stages import student_repo

    lesson = load_lesson(info.number)
    copy = student_repo.write_repo(info.number, tmp_path)

    def lint(state: str) -> None:
        for command in (["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]):
            proc = subprocess.run(
                [sys.executable, "-m", "ruff", *command],
                cwd=tmp_path,
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, f"{state}: ruff {command[0]}\n{proc.stdout}{proc.stderr}"

    lint("the blank scaffold")
    for name in sorted({task.file for task in lesson.tasks}):
        path, ref = copy / name, info.path / name
        path.write_text(_restore(path.read_text(), ref.read_text(), path, ref, lesson))
    lint("the scaffold with the reference's bodies written in")


def test_assignment_md_names_every_task_and_the_grading_command(
    info: stages.StageInfo, copies: tuple[Path, Path]
) -> None:
    lesson = load_lesson(info.number)
    skeleton, _ = copies
    text = (skeleton.parent / assignments.ASSIGNMENT_FILE).read_text()
    assert assignments.grade_command(skeleton) in text
    assert f"--stage-path {skeleton}" in text
    readme = info.path / "README.md"
    if readme.is_file():  # the lesson in brief (a stage still being written may lack it)
        intro, idea = assignments._readme_brief(readme.read_text(), skeleton.name)
        assert intro and intro in text and idea in text
    for number, task in assignments.numbered(lesson):
        section = text.split(f"## Task {number}: `{task.function}`\n", 1)[1].split("\n## ", 1)[0]
        assert " ".join(task.summary.split()) in " ".join(section.split())
        assert ast.get_docstring(find_function(info.path / task.file, task.qualname)).split()[0]
        assert all(hint in section for hint in task.hints)
        assert all(f"`{test}`" in section for test in task.tests)
        assert assignments.pytest_command(skeleton, task.tests) in section
    if lesson.parts:  # a lesson of several ideas: each part, with the tasks that are in it
        section = " ".join(text.split("## The lesson in parts\n", 1)[1].split("\n## ")[0].split())
        for number, part in enumerate(lesson.parts, 1):
            tasks = [
                str(n)
                for n, task in assignments.numbered(lesson)
                if task_part(lesson, task) == number - 1
            ]
            item = section.split(f"{number}. **{part.title}**", 1)[1].split(f"{number + 1}. **")[0]
            assert all(f"`{name}`" in item for name in part.files + part.hunks), item
            assert not tasks or item.startswith(
                f" (task{'s' * (len(tasks) > 1)} {', '.join(tasks)})"
            )


def _prose_sections(readme: str) -> dict[str, int]:
    """Each `## ` section of a README and its lines of prose (not a table row, not code)."""
    found = {}
    for part in re.split(r"^## ", readme, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        body = re.sub(r"^```.*?^```[ \t]*$", "", body, flags=re.M | re.S)
        found[title.strip()] = sum(
            1 for line in body.splitlines() if line.strip() and not line.lstrip().startswith("|")
        )
    return found


def test_hints_point_to_explanations_that_exist(info: stages.StageInfo) -> None:
    """A hint that names a README section ("README: 'The idea' (...)") names one the stage's
    README has, with prose in it: not a section that is only a table of files (a student sent
    there reads file names). A hint that names a module's docstring names a module of the
    stage that has one."""
    lesson = load_lesson(info.number)
    readme = info.path / "README.md"
    sections = _prose_sections(readme.read_text() if readme.is_file() else "")
    for number, task in assignments.numbered(lesson):
        for hint in task.hints:
            if section := re.match(r"README: '([^']+)'", hint):
                assert section[1] in sections, f"task {number}: {hint!r}: no such section"
                assert sections[section[1]] >= 3, f"task {number}: {hint!r}: a table, no prose"
            if module := re.match(r"([\w/]+\.py)'s module docstring", hint):
                path = info.path / module[1]
                assert path.is_file(), f"task {number}: {hint!r}: no such module"
                assert ast.get_docstring(ast.parse(path.read_text())), f"task {number}: {hint!r}"


# ---------------------------------------------------------------------------------- the grading
def test_skeleton_fails_and_reference_passes_each_tasks_tests(
    info: stages.StageInfo, runs: dict[str, grading.RunResult]
) -> None:
    lesson = load_lesson(info.number)
    for number, task in assignments.numbered(lesson):
        test = primary_test(task)
        skeleton = grading.graded_status(runs["skeleton"].cases_of(test))
        solution = grading.graded_status(runs["solution"].cases_of(test))
        assert skeleton == "fail", (
            f"task {number}: the skeleton does not fail {test}: "
            f"{[(c.node_id, c.outcome, c.message) for c in runs['skeleton'].cases_of(test)]}\n"
            f"{runs['skeleton'].output[-3000:]}"
        )
        assert solution == "pass", (
            f"task {number}: the reference does not pass {test}\n{runs['solution'].output[-3000:]}"
        )


def test_one_restored_task_passes_its_test_or_reaches_another_tasks_stub(
    info: stages.StageInfo, runs: dict[str, grading.RunResult]
) -> None:
    """Tasks are graded independently where the technique allows; where a task's test runs code
    of another task, its failure must name that task's stub (never an unexplained failure)."""
    lesson = load_lesson(info.number)
    needs = {}
    for number, task in assignments.numbered(lesson):
        result = runs[f"restored {number}"]
        test = primary_test(task)
        cases = result.cases_of(test)
        if grading.graded_status(cases) == "pass":
            continue
        failed = [c for c in cases if c.outcome in ("failed", "error")]
        reached = {n for c in failed for n in c.stubs} | set(result.thread_stubs)
        explained = all(c.stubs for c in failed) or bool(result.thread_stubs)
        assert failed and explained, (
            f"task {number} restored alone fails {test} without reaching another task's stub:\n"
            + "\n".join(f"{c.node_id}: {c.outcome} {c.message}" for c in cases)
            + f"\n{result.output[-3000:]}"
        )
        assert number not in reached
        needs[number] = sorted(reached)
    print(f"stage {info.number}: tasks whose primary test needs other tasks: {needs}")


# ------------------------------------------------------------------------- the grader's timer
HANGS = """\
import sys
import threading
import time


def test_hangs():
    time.sleep(60)


def test_thread_dies_on_a_stub():
    def loop():
        raise NotImplementedError("task 2: engine.py::Engine.step \u2014 Step.")

    threading.Thread(target=loop, name="engine-loop").start()
    time.sleep(60)


def test_slow_import():
    import slow_module  # noqa: F401  (its import outlasts the timeout)

    time.sleep(60)


def test_the_slow_import_finished():
    assert sys.modules["slow_module"].DONE


def test_passes():
    pass
"""


def test_grader_times_out_a_hang_ends_a_stub_death_early_and_never_splits_an_import(
    tmp_path: Path,
) -> None:
    """The worker's timer (pytest-timeout's settings, this repository's alarm): a hang fails
    with the stacks of where it hung, a thread that dies on a stub fails its test at once, and
    an import the timer outlasts is finished first (never left half initialised)."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_hangs.py").write_text(HANGS)
    (folder / "slow_module.py").write_text("import time\n\ntime.sleep(1.5)\nDONE = True\n")
    # the grader's options (--stage-path, --stage) come from stages/pytest_plugin.py
    (folder / "conftest.py").write_text(
        "import sys\n\nsys.path.insert(0, __file__.rpartition('/')[0])\n"
    )
    job = grading.Job(folder, (str(folder / "test_hangs.py"),))
    passing = grading.Job(folder, (str(folder / "test_hangs.py") + "::test_passes",))
    result, second = grading.run_jobs([job, passing], timeout=1.0)
    assert [c.outcome for c in second.cases] == ["passed"]
    assert "1 passed" in second.output and "time.sleep" not in second.output  # its own output
    by_name = {c.node_id.rpartition("::")[2]: c for c in result.cases}
    assert by_name["test_hangs"].outcome == "failed"
    assert by_name["test_hangs"].message == "Failed: timed out after 1 s"
    assert "in test_hangs" in result.output and "time.sleep(60)" in result.output
    died = by_name["test_thread_dies_on_a_stub"]
    assert (died.outcome, died.stubs) == ("failed", (2,)), died
    assert died.message.startswith("Failed: thread 'engine-loop' stopped on NotImplementedError")
    assert died.seconds < 1.0 and result.thread_stubs == (2,)
    assert by_name["test_slow_import"].message == "Failed: timed out after 1 s"
    assert by_name["test_the_slow_import_finished"].outcome == "passed"
    assert by_name["test_passes"].outcome == "passed"


# A stand-in for stage 01's sampling.py (its tasks 3 and 4): one task function that never
# returns, one that returns at once, and tests that hang in them or around them.
HANG_SAMPLING = """\
STOP = []


def apply_top_k_top_p(x):
    \"\"\"Task 3 of stage 01; here a loop that never ends.\"\"\"
    while not STOP:
        x += 1


def _filtered_probs(x):
    \"\"\"Task 4 of stage 01; here it returns at once.\"\"\"
    return x
"""
HANGS_IN_TASKS = """\
import threading

import sampling


def test_an_engine_loop_that_never_ends():
    while True:  # calls task 4's function every step, but never hangs in it
        sampling._filtered_probs(sum(range(300)))


def test_hangs_in_a_task_function():
    for _ in range(100):
        sampling._filtered_probs(1)
    sampling.apply_top_k_top_p(0)


def test_an_engine_thread_hangs_in_a_task_function():
    thread = threading.Thread(target=sampling.apply_top_k_top_p, args=(0,), daemon=True)
    thread.start()
    try:
        thread.join()
    finally:
        sampling.STOP.append(True)
"""


def test_a_timed_out_test_names_the_task_function_it_hung_in_not_the_one_the_timer_hit(
    tmp_path: Path,
) -> None:
    """Issue 25: a stage-13 task whose natural mistake hung every engine test was reported
    under every task at once and never named. When a test's timer runs out the worker samples
    every thread's stack: a task function in all of the samples (a loop inside it, on the main
    thread or an engine thread) is where the test hung; a loop that only calls a task function
    each step (task 4 here, as stage 13's step calls task 1's deadlines) blames none."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "sampling.py").write_text(HANG_SAMPLING)
    (folder / "test_hangs_in_tasks.py").write_text(HANGS_IN_TASKS)
    (folder / "conftest.py").write_text(
        "import sys\n\nsys.path.insert(0, __file__.rpartition('/')[0])\n"
    )
    job = grading.Job(folder, (str(folder / "test_hangs_in_tasks.py"),), stage="01")
    (result,) = grading.run_jobs([job], timeout=1.0)
    by_name = {c.node_id.rpartition("::")[2]: c for c in result.cases}
    assert all(c.message == "Failed: timed out after 1 s" for c in result.cases), result.cases
    assert by_name["test_an_engine_loop_that_never_ends"].where == ""
    for name in ("test_hangs_in_a_task_function", "test_an_engine_thread_hangs_in_a_task_function"):
        assert by_name[name].where.startswith("3|apply_top_k_top_p|sampling.py:"), by_name[name]


def test_report_names_the_task_whose_direct_test_fails_for_a_failure_in_no_task() -> None:
    """Issue 25 (stage 13, task 3): an engine test that fails in no task's function (the run
    never ended) is listed by tasks 1, 3 and 4; the report points each to task 3, the first
    task that fails its direct test, and a timeout that hung in a task function names it."""
    engine = "tests/t.py::test_engine"
    tasks = tuple(
        Task(f"a.py::f{n}", "F.", tests=(f"tests/t.py::test_f{n}", engine)) for n in range(1, 5)
    )
    lesson = Lesson("13", "fake", "Fake", "t", ("a.py",), (), tasks, Path("/nowhere"), None)
    cases = (
        grading.Case("tests/t.py::test_f1", "passed"),
        grading.Case("tests/t.py::test_f2", "passed"),
        grading.Case("tests/t.py::test_f3", "failed", "AssertionError: held nothing"),
        grading.Case("tests/t.py::test_f4", "failed", "AssertionError: no", (), 0.0, "4|f4|a.py:9"),
        grading.Case(engine, "failed", "AssertionError: the run never ended"),
    )
    result = grading.RunResult(cases, deselected=(), thread_stubs=(), exit_code=1)
    states = dict.fromkeys(range(1, 5), "written")
    report = grading.format_report(lesson, Path("/copy"), result, states)
    sections = report.split("\ntask ")[1:]
    blame = "task 3 (f3) fails its direct test tests/t.py::test_f3: look there first"
    assert blame in sections[0] and blame in sections[1] and blame in sections[3], report
    assert "this task's direct test fails too: start there" in sections[2], report
    assert "task 1 (f1)" not in report and "task 4 (f4)" not in report, report
    hung = grading.Case(engine, "failed", "Failed: timed out after 9 s", (), 0.0, "2|f2|a.py:5")
    result = grading.RunResult((*cases[:4], hung), deselected=(), thread_stubs=(), exit_code=1)
    report = grading.format_report(lesson, Path("/copy"), result, states)
    assert "hung in task 2's function f2 (a.py:5): look there first" in report, report
    assert "hung in this task's function (a.py:5)" in report and "fails its direct" not in report


# ----------------------------------------------------------------------- the generator, in small
SOURCE = '''\
import itertools
import os


class Engine:
    async def generate(self, request):
        """Yield outputs."""
        for item in itertools.repeat(request, 2):
            yield item
        # a comment that closes the body

    def name(self):
        """The name."""
        return os.name
'''


def _fake_lesson(tmp_path: Path, summary: str) -> Path:
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "engine.py").write_text(SOURCE)
    return folder


def test_stub_keeps_generators_blanks_closing_comments_and_marks_orphaned_imports(
    tmp_path: Path,
) -> None:
    folder = _fake_lesson(tmp_path, "s")
    task = Task(function="engine.py::Engine.generate", summary="Yield every output " * 8)
    assignments.blank_tasks(folder, [(3, task)])
    text = (folder / "engine.py").read_text()
    assert "closes the body" not in text and "itertools.repeat" not in text
    assert (
        f"import itertools{assignments.NOQA}\n" in text
        and f"import os{assignments.NOQA}" not in text
    )
    assert max(len(line) for line in text.splitlines()) <= assignments.LINE_LENGTH
    namespace: dict = {}
    exec(compile(text, "engine.py", "exec"), namespace)
    agen = namespace["Engine"]().generate("r")
    assert agen.__class__.__name__ == "async_generator"
    with pytest.raises(NotImplementedError, match=r"task 3: engine.py::Engine.generate — Yield"):
        agen.asend(None).send(None)
    assert grading.task_state(folder, 3, task, folder) == "stub"


def test_stub_literals_survive_quotes_and_backslashes() -> None:
    for summary in ('Say "hi"', "it's \\n", "both ' and \""):
        task = Task(function="m.py::f", summary=summary)
        (line,) = assignments.stub_lines(1, task, "", generator=False)
        call = ast.parse(line).body[0].exc  # type: ignore[attr-defined]
        assert call.args[0].value == assignments.stub_message(1, task)
    # wrapped, a part's escaped quotes count toward the line length too (stage 09's task 6)
    task = Task(function="m.py::f", summary='It\'s ("reply", name) and ("reply", result). ' * 6)
    lines = assignments.stub_lines(1, task, "    ", generator=False)
    assert max(len(line.rstrip("\n")) for line in lines) <= assignments.LINE_LENGTH, lines
    call = ast.parse("".join(line.removeprefix("    ") for line in lines)).body[0].exc
    assert call.args[0].value == assignments.stub_message(1, task)


def test_stub_literals_are_what_ruff_format_writes(tmp_path: Path) -> None:
    """Quotes chosen as ruff format chooses them (fewest escapes), so a blank scaffold passes
    `ruff format --check` whatever quotes a summary holds (stage 09's task 6 has both)."""
    summaries = ['Say "hi"', "it's", "both ' and \"", 'It\'s ("reply", x) and ("reply", y). ' * 6]
    source = "\n\n".join(
        f"def f{i}():\n" + "".join(
            assignments.stub_lines(1, Task(function="m.py::f", summary=s), "    ", False)
        )
        for i, s in enumerate(summaries)
    )  # fmt: skip
    (tmp_path / "stubs.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--diff", "stubs.py"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_task_state_tells_started_from_untouched(tmp_path: Path) -> None:
    reference = tmp_path / "ref"
    reference.mkdir()
    (reference / "m.py").write_text('def f(x: int) -> int:\n    """Double."""\n    return 2 * x\n')
    task = Task(function="m.py::f", summary="Double x.")
    student = tmp_path / "student"
    student.mkdir()
    (student / "m.py").write_text((reference / "m.py").read_text())
    assert grading.task_state(student, 1, task, reference) == "written"
    assignments.blank_tasks(student, [(1, task)])
    assert grading.task_state(student, 1, task, reference) == "stub"
    (student / "m.py").write_text('def f(x):\n    """Double."""\n    return x + x\n')
    assert grading.task_state(student, 1, task, reference) == "signature changed"
    (student / "m.py").write_text("def g():\n    pass\n")
    assert grading.task_state(student, 1, task, reference) == "missing"


def test_assign_refuses_to_overwrite_or_to_write_into_the_repository(tmp_path: Path) -> None:
    first = stages.list_stages()[0]
    assignments.assign(first.number, tmp_path)
    with pytest.raises(ValueError, match="already exists"):
        assignments.assign(first.number, tmp_path)
    assignments.assign(first.number, tmp_path, force=True, solution=True)
    assert "**solution**" in (tmp_path / assignments.ASSIGNMENT_FILE).read_text()
    with pytest.raises(ValueError, match="inside the repository"):
        assignments.assign(first.number, stages.STAGES_DIR, force=True)
    with pytest.raises(ValueError, match="no task"):
        assignments.assign(first.number, tmp_path / "x", restored=[99])


def test_report_names_passes_failures_stubs_and_skips(tmp_path: Path) -> None:
    tasks = (
        Task("a.py::f", "F.", tests=("tests/t.py::test_f",)),
        Task(
            "a.py::g",
            "G.",
            tests=("tests/t.py::test_g_alone", "tests/t.py::test_g", "tests/t.py::test_gpu"),
        ),
        Task("a.py::h", "H.", tests=("tests/t.py::test_h",)),
    )
    lesson = Lesson("09", "fake", "Fake", "t", ("a.py",), (), tasks, tmp_path, None)
    cases = (
        grading.Case("tests/t.py::test_f[1]", "passed"),
        grading.Case("tests/t.py::test_f[2]", "passed"),
        grading.Case("tests/t.py::test_g_alone", "passed"),
        grading.Case("tests/t.py::test_g", "failed", "NotImplementedError: task 3: ...", (3,)),
        grading.Case("tests/t.py::test_gpu", "skipped", "needs a GPU"),
        grading.Case("tests/t.py::test_h", "failed", "AssertionError: assert 1 == 2"),
    )
    result = grading.RunResult(cases, deselected=(), thread_stubs=(), exit_code=1)
    states = {1: "written", 2: "written", 3: "stub"}
    report = grading.format_report(lesson, tmp_path, result, states)
    assert report.splitlines()[0].endswith("1 of 3 tasks pass (2 of 3 direct tests)")
    assert report.splitlines()[1].startswith("A task passes when every one of its tests")
    assert "task 1  a.py::f: PASS" in report and "2/2 cases" in report
    # a task whose direct test passes while a later test waits for a later task says so
    assert "task 2  a.py::g: FAIL (1 of 2 tests pass; the others wait for task 3)" in report
    assert "reached the stub of task 3 (h): this test needs it too" in report
    assert "skip    tests/t.py::test_gpu" in report
    assert "task 3  a.py::h: FAIL (not started)" in report and "assert 1 == 2" in report
    assert grading.task_status(grading.task_tests(tasks[1], result)) == "fail"


def test_cli_assign_then_grade_one_solved_task(tmp_path: Path, capsys) -> None:
    """The commands a student runs: assign, solve task 1 (here: paste the reference), grade."""
    from stages.cli import main

    info = stages.stage_info("03")
    assert main(["assign", info.number, str(tmp_path)]) == 0
    copy = tmp_path / info.folder
    assert assignments.grade_command(copy) in capsys.readouterr().out
    lesson = load_lesson(info.number)
    task = lesson.tasks[0]
    solved = assignments.assign(info.number, tmp_path / "solved", restored=[1])
    (copy / task.file).write_text((solved / task.file).read_text())
    code = main(["grade", str(copy), "--task", "1", "--task", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    # Its direct test passes; the rest of its grade (every test that catches its bugs) runs the
    # engine and waits for later tasks, and the report says which.
    waiting = f"task 1  {task.function}: FAIL (1 of {len(task.tests)} tests pass; the others wait"
    assert waiting in out, out
    assert f"task 2  {lesson.tasks[1].function}: FAIL (not started)" in out
    assert "0 of 2 tasks pass (1 of 2 direct tests)" in out


def test_readme_brief_takes_the_opening_and_the_idea() -> None:
    readme = textwrap.dedent("""\
        # Stage 09: fake

        Opening [link](model.py) text.

        ```
        python -m stages 09 run
        ```

        ## The problem

        P.

        ## The idea

        The idea, see [x](https://example.com).

        ## The code
        """)
    intro, idea = assignments._readme_brief(readme, "09_fake")
    assert intro == "Opening [link](09_fake/model.py) text."
    assert idea == "The idea, see [x](https://example.com)."


# ------------------------------------------------------------------ the commands, from anywhere
def test_whole_suite_command_runs_from_any_directory(tmp_path: Path) -> None:
    """The README's `pytest --stage-path DIR`, started outside the repository: the suite's
    options are known (stages/pytest_plugin.py, an entry point), with no test path the
    repository's tests run, and a test path as ASSIGNMENT.md writes it is found there too."""
    copy = assignments.assign("01", tmp_path / "hw")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pytest_script = Path(sys.executable).with_name("pytest")
    base = [str(pytest_script), "-q", "-p", "no:cacheprovider", "--stage-path", str(copy)]
    run = lambda *more: subprocess.run(
        [*base, *more], cwd=elsewhere, capture_output=True, text=True, timeout=600
    )
    whole = run("--collect-only")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    for name in ("test_01_model.py::", "test_01_sampling.py::test_top_k_top_p_masks[s01]"):
        assert name in whole.stdout, whole.stdout[-3000:]
    one = run("tests/test_01_sampling.py::test_top_k_top_p_masks")
    text = one.stdout + one.stderr
    assert one.returncode == 1 and "1 failed" in text, text[-3000:]
    assert "NotImplementedError: task" in text and "apply_top_k_top_p" in text  # the copy's stub


# ------------------------------------------------------------ crashes, and where a failure is
CRASHES = """\
import os
import signal


def test_before():
    pass


def test_livelock():
    raise RuntimeError("no progress: a step scheduled nothing and nothing is in flight")


def test_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_after():
    pass
"""


def test_a_test_that_kills_the_worker_is_reported_as_crashed_and_the_rest_still_run(
    tmp_path: Path,
) -> None:
    """A signal that ends the grading worker (SIGSEGV, SIGFPE from a kernel fed nonsense) no
    longer ends the grade: the test that was running fails as crashed, with the signal, and
    the tests and jobs after it run in a fresh worker."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_crashes.py").write_text(CRASHES)
    job = grading.Job(folder, (str(folder / "test_crashes.py"),))
    after = grading.Job(folder, (str(folder / "test_crashes.py") + "::test_after",))
    result, second = grading.run_jobs([job, after], timeout=60)
    by_name = {c.node_id.rpartition("::")[2]: c for c in result.cases}
    assert sorted(by_name) == ["test_after", "test_before", "test_crashes", "test_livelock"]
    assert by_name["test_livelock"].no_progress and not by_name["test_before"].no_progress
    assert by_name["test_before"].outcome == by_name["test_after"].outcome == "passed"
    crashed = by_name["test_crashes"]
    assert crashed.outcome == "failed" and "SIGSEGV" in crashed.message, crashed
    assert result.exit_code == 1 and "in test_crashes" in result.output  # faulthandler's trace
    assert [c.outcome for c in second.cases] == ["passed"]


OUTLIVES_ITS_TIMER = """\
import signal
import time

import pytest


@pytest.fixture
def never_stops():
    yield
    time.sleep(3600)  # a teardown that waits on something that never comes


def test_before():
    pass


def test_fails_then_its_teardown_never_returns(never_stops):
    assert False  # pytest-timeout stops its timer here (for a debugger); the worker does not


def test_times_out_then_its_teardown_never_returns(never_stops):
    time.sleep(3600)


def test_main_thread_never_returns_to_python():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as a call stuck in C would be
    time.sleep(3600)


def test_after():
    pass
"""


def test_a_test_that_outlives_its_timer_is_reported_as_hung_and_the_rest_still_run(
    tmp_path: Path,
) -> None:
    """A grade always ends. A failed test's teardown runs on a limit of its own (pytest-timeout
    stops its timer at the failure): one that never returns ends the worker (the alarm fires
    again). A test whose main thread never gets back to Python (no signal handler runs) is
    killed by the grader at the deadline the worker's progress note set. Each fails as hung,
    with every thread's stack in the output, and the tests after it run in a fresh worker."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_outlives.py").write_text(OUTLIVES_ITS_TIMER)
    job = grading.Job(folder, (str(folder / "test_outlives.py"),))
    (result,) = grading.run_jobs([job], timeout=1)
    by_name = {c.node_id.rpartition("::")[2]: c for c in result.cases}
    assert by_name["test_before"].outcome == by_name["test_after"].outcome == "passed", by_name
    hung = [name for name in by_name if "never_returns" in name]
    assert len(hung) == 3, by_name
    for name in hung:
        case = by_name[name]
        assert case.outcome == "failed" and case.message.startswith("hung:"), case
        # its deadline came from its own 1 s timer, not from the 600 s allowed outside tests
        assert "its 1 s timer" in case.message, case
    assert "gives up on" in result.output and "in never_stops" in result.output  # its stack
    assert "in test_main_thread_never_returns_to_python" in result.output  # SIGUSR1's stacks
    assert result.exit_code == 1


POISONS_AST = """\
import ast


def test_poisons_the_interpreter():
    def broken(*args, **kwargs):
        raise SystemError("AST constructor recursion depth mismatch (before=1, after=0)")

    ast.parse = broken  # what CPython 3.11's bug leaves behind, process-wide
"""

FAILS = """\
def test_fails():
    assert 1 + 1 == 3
"""


def test_a_session_that_breaks_the_interpreters_ast_is_rerun_and_the_rest_run_fresh(
    tmp_path: Path,
) -> None:
    """CPython 3.11's AST bug (python/cpython#106905): once one AST construction fails, every
    later one in that process raises SystemError, and pytest needs the AST to format a
    failure's traceback, so every later session of the grading worker loses its failures'
    messages. The worker checks the AST after each session: when it is broken, that session
    runs again in a fresh worker (kept then, whatever happens) and the sessions after it too.
    Simulated here by a test that breaks `ast.parse` for its whole process, as the bug does."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_poisons.py").write_text(POISONS_AST)
    (folder / "test_fails.py").write_text(FAILS)
    poison = grading.Job(folder, (str(folder / "test_poisons.py"),))
    fails = grading.Job(folder, (str(folder / "test_fails.py"),))
    first, second = grading.run_jobs([poison, fails], timeout=60)
    assert [c.outcome for c in first.cases] == ["passed"], first
    (failed,) = second.cases
    assert failed.outcome == "failed" and "assert (1 + 1) == 3" in failed.message, failed
    assert "SystemError" not in second.output, second.output[-3000:]


CARETS = """\
import ast
import traceback


def test_formats_a_traceback_without_parsing():
    calls, real = [], ast.parse
    ast.parse = lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs)
    try:
        try:
            {}["missing"]
        except KeyError as exc:
            text = "".join(traceback.format_exception(exc))
    finally:
        ast.parse = real
    assert "KeyError" in text and calls == [], calls
"""


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="CPython 3.11's bug and workaround")
def test_the_worker_formats_tracebacks_without_parsing_the_failing_line(tmp_path: Path) -> None:
    """The other half of CPython 3.11's AST bug: the counter is one per interpreter, so a
    server thread drawing a logged traceback's carets (an `ast.parse` of the failing line)
    while pytest parses on the main thread can break it. The grading worker draws no carets
    (`grade_worker._tracebacks_without_carets`): formatting a traceback there parses nothing.
    Plain CPython 3.11 parses the line of `{}["missing"]` to place the carets."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_carets.py").write_text(CARETS)
    (result,) = grading.run_jobs([grading.Job(folder, (str(folder / "test_carets.py"),))])
    assert [c.outcome for c in result.cases] == ["passed"], result.output[-3000:]


def test_a_session_that_exits_with_the_ast_status_twice_stops_the_grade_not_loops(
    tmp_path: Path,
) -> None:
    """The rerun is once: a test that ends the worker with that exit status itself (a
    student's `os._exit(75)`) stops the grade with the worker's status, never loops."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_exits.py").write_text("import os\n\n\ndef test_exits():\n    os._exit(75)\n")
    job = grading.Job(folder, (str(folder / "test_exits.py"),))
    with pytest.raises(RuntimeError, match="exit 75"):
        grading.run_jobs([job], timeout=60)


def _replace_body(copy: Path, function: str, body: str) -> None:
    """Put `body` (at the function's indent) in place of a function's code in a copy."""
    file, _, qualname = function.partition("::")
    path = copy / file
    lines = path.read_text().splitlines(keepends=True)
    node = find_function(path, qualname)
    start, end = assignments.body_span(lines, node)
    indent = " " * (node.col_offset + 4)
    lines[start:end] = [indent + line + "\n" for line in body.splitlines()]
    path.write_text("".join(lines))


def _task_number(lesson: Lesson, function: str) -> int:
    return next(n for n, t in assignments.numbered(lesson) if t.function == function)


def test_grade_names_a_crashed_test_and_the_task_a_failure_was_raised_in(tmp_path: Path) -> None:
    """On a generated copy of stage 01: a task function that kills its process fails its task
    as crashed (and the grade goes on); a failure raised inside another task's function names
    that task, under the task whose test it is, with the whole message."""
    lesson = load_lesson("01")
    top_k, probs = "sampling.py::apply_top_k_top_p", "sampling.py::_filtered_probs"
    copy = assignments.assign("01", tmp_path / "wrong", solution=True)
    _replace_body(copy, top_k, 'raise ValueError("a wrong mask\\nsecond line of the message")')
    report, passed = grading.grade(copy, quick=True, tasks=[_task_number(lesson, probs)])
    assert not passed
    top_k_number = _task_number(lesson, top_k)
    assert f"raised in task {top_k_number}'s function apply_top_k_top_p (sampling.py:" in report
    assert "a wrong mask" in report and "second line of the message" in report, report
    assert grading.VERBOSE_HINT in report

    crashing = assignments.assign("01", tmp_path / "crash", solution=True)
    marker = tmp_path / "crashed-once"  # the first call kills its worker; later ones raise
    _replace_body(
        crashing, top_k,
        "import os\nimport pathlib\nimport signal\n\n"
        f"if not pathlib.Path({str(marker)!r}).exists():\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "raise RuntimeError('after the crash')",
    )  # fmt: skip
    report, passed = grading.grade(crashing, quick=True, tasks=[top_k_number])
    assert not passed and f"task {top_k_number}  {top_k}: FAIL" in report, report
    assert "crashed: the test killed the grading worker (SIGSEGV, exit -11)" in report, report
    assert "after the crash" in report, "the grade went on after the crash"


def test_report_prints_the_whole_assertion_where_it_was_raised_and_a_livelock() -> None:
    tasks = (
        Task("a.py::f", "F.", tests=("tests/t.py::test_engine",)),
        Task("a.py::g", "G.", tests=("tests/t.py::test_g",)),
    )
    lesson = Lesson("09", "fake", "Fake", "t", ("a.py",), (), tasks, Path("/nowhere"), None)
    message = "\n".join(
        ["AssertionError: assert [1, 2] == [1, 3]", *(f"line {i}" for i in range(30))]
    )
    cases = (
        grading.Case("tests/t.py::test_engine", "failed", message, (), 0.0, "2|g|a.py:12"),
        grading.Case(
            "tests/t.py::test_g", "failed", "RuntimeError: no progress: ...", (), 0.0, "", True
        ),
    )
    result = grading.RunResult(cases, deselected=(), thread_stubs=(), exit_code=1)
    report = grading.format_report(lesson, Path("/copy"), result, {1: "written", 2: "written"})
    assert "raised in task 2's function g (a.py:12): look there first" in report
    assert "also failed in this task's function: tests/t.py::test_engine" in report
    assert "line 13" in report and "line 14" not in report and "16 more lines" in report
    assert "LLMEngine.check_progress" in report and "livelock" in report
    assert grading.VERBOSE_HINT in report
    verbose = grading.format_report(
        lesson, Path("/copy"), result, {1: "written", 2: "written"}, verbose=True
    )
    assert "line 29" in verbose and grading.VERBOSE_HINT not in verbose


# ------------------------------------------------------------ no answer one command away
def test_a_blanked_reference_takes_its_triton_twin_with_it(
    info: stages.StageInfo, copies: tuple[Path, Path]
) -> None:
    """A task that blanks a `*_reference` function also blanks the Triton kernels its
    `*_triton` twin launches (left solved beside it they would be the answer in another
    language); the solution and a copy with that task restored keep them."""
    lesson = load_lesson(info.number)
    skeleton, solution = copies
    for number, task in assignments.numbered(lesson):
        for twin in assignments.twins(info.path, task):
            file, _, name = twin.partition("::")
            ours = find_function(skeleton / file, name)
            code = [s for s in ours.body if not isinstance(s, ast.Expr)]
            assert isinstance(code[0], ast.Raise), f"{twin}: left solved beside {task.function}"
            assert ast.literal_eval(code[0].exc.args[0]) == assignments.stub_message(number, task)
            assert ast.dump(find_function(solution / file, name)) == ast.dump(
                find_function(info.path / file, name)
            )


def test_rejection_sampler_and_paged_attention_kernels_are_twins() -> None:
    """The two reference/Triton pairs a task blanks today (stage 03's attention, stage 08's
    rejection sampler): found by name, with the kernels they launch."""
    found = {
        (info.number, twin)
        for info in stages.list_stages()
        for task in load_lesson(info.number).tasks
        for twin in assignments.twins(info.path, task)
    }
    assert ("08", "spec_decode/rejection_sampler.py::_rejection_kernel") in found
    assert ("08", "spec_decode/rejection_sampler.py::_race_argmax") in found
    assert any(n == "03" and t.startswith("kernels.py::") for n, t in found), found


def test_student_repository_is_standalone_and_grades_itself(tmp_path: Path) -> None:
    """`assign 02 DIR --repo`: stage 01 solved, 02 blanked, no later stage, the tests that
    apply, the grader and a README; `diff` cannot show a later or solved stage; the grade
    command run inside it fails the skeleton and passes the solution (--quick)."""
    from stages import student_repo

    lesson = load_lesson("02")
    first = stages.stage_info("01")
    student, solved = tmp_path / "student", tmp_path / "solved"
    copy = student_repo.write_repo("02", student)
    student_repo.write_repo("02", solved, solution=True)
    numbered_dirs = sorted(p.name for p in (student / "stages").iterdir() if p.name[:1].isdigit())
    assert numbered_dirs == [first.folder, lesson.path.name]
    for path in first.path.rglob("*.py"):
        relative = path.relative_to(first.path)
        assert (student / "stages" / first.folder / relative).read_bytes() == path.read_bytes()
    for number, task in assignments.numbered(lesson):
        assert grading.task_state(copy, number, task, lesson.path) == "stub", task.function
    tests = sorted(p.name for p in (student / "tests").glob("*.py"))
    assert "conftest.py" in tests and "test_02_streaming.py" in tests
    assert not [t for t in tests if t[5:7].isdigit() and t[5:7] > "02"], tests
    assert "test_assignments.py" not in tests and "test_mutations.py" not in tests
    for name in ("pyproject.toml", "Makefile", "README.md", assignments.ASSIGNMENT_FILE):
        assert (student / name).is_file(), name
    command = assignments.grade_command(copy, student)
    assert command in (student / "README.md").read_text()
    assert command in (student / assignments.ASSIGNMENT_FILE).read_text()

    def run(repo: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "stages", *args],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=1200,
        )

    later = run(student, "diff", "02", "03")
    assert later.returncode == 2 and "unknown stage" in later.stderr, later.stderr
    graded = run(student, "grade", f"stages/{lesson.path.name}", "--quick")
    assert graded.returncode == 1, graded.stdout + graded.stderr[-3000:]
    assert f"0 of {len(lesson.tasks)} tasks pass" in graded.stdout, graded.stdout
    assert str(student) in graded.stdout  # graded by the repository's own tools
    passed = run(solved, "grade", f"stages/{lesson.path.name}", "--quick")
    assert passed.returncode == 0, passed.stdout + passed.stderr[-3000:]
    n = len(lesson.tasks)
    assert f"{n} of {n} tasks pass" in passed.stdout


def test_the_grading_alarm_never_interrupts_code_that_holds_a_process_wide_lock():
    """An exception raised by the alarm inside logging (or an import) can leave its module lock
    held, and every later server thread of the worker then hangs on its first log line (seen:
    'the server did not start within 30 s', a uvicorn thread in logging._acquireLock). The
    alarm waits until the main thread has left such code."""
    import logging
    import sys

    from stages.grade_worker import _inside_lock_holder

    seen = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(_inside_lock_holder(sys._getframe()))

    logger = logging.getLogger("grading-alarm-test")
    logger.addHandler(Capture())
    logger.warning("inside logging")
    assert seen == [True]
    assert not _inside_lock_holder(sys._getframe())


def test_grade_json_gives_each_tasks_points_tests_and_failures(tmp_path: Path, capsys) -> None:
    """`grade --json`: the same grade as the report, as data a CI reads: per task its status,
    points earned of its points (lesson.toml), tests and cases passed, the failing tests with
    the first line of their message, seconds; exit 1 while a task fails."""
    import json

    from stages.cli import main

    info = stages.stage_info("03")
    lesson = load_lesson(info.number)
    solved = assignments.assign(info.number, tmp_path / "solved", restored=[1])
    capsys.readouterr()
    code = main(["grade", str(solved), "--task", "1", "--task", "2", "--json", "--quick"])
    grade = json.loads(capsys.readouterr().out)
    assert code == 1 and grade["stage"] == "03" and grade["passed"] is False
    first, second = grade["tasks"]
    # Task 1 solved alone: its direct test passes, its engine tests wait for later tasks (a
    # solved task's full points: tests/test_gradebook.py's "solved" student).
    assert first["task"] == 1 and first["status"] == "fail" and first["earned"] == 0
    assert first["points"] == lesson.tasks[0].points
    assert first["tests_passed"] == 1 and first["tests_total"] == len(lesson.tasks[0].tests)
    assert 0 < first["cases_passed"] < first["cases_total"] and first["seconds"] >= 0
    assert all("NotImplementedError" in f["message"] for f in first["failing"]), first["failing"]
    assert second["status"] == "fail" and second["earned"] == 0 and second["failing"]
    assert all(f["test"].startswith("tests/") and f["message"] for f in second["failing"])
    assert grade["earned"] == 0 and grade["points"] == first["points"] + second["points"]


def test_a_task_is_worth_its_points_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "03_paged"
    shutil.copytree(
        stages.stage_info("03").path, folder, ignore=shutil.ignore_patterns("__pycache__")
    )
    manifest = folder / "lesson.toml"
    text = manifest.read_text()
    manifest.write_text(text.replace("[[task]]\n", "[[task]]\npoints = 25\n", 1))
    assert load_lesson(folder).tasks[0].points == 25
    assert load_lesson(folder).tasks[1].points == 10  # the default
    manifest.write_text(text.replace("[[task]]\n", "[[task]]\npoints = -1\n", 1))
    with pytest.raises(ValueError, match="points"):
        load_lesson(folder)


@pytest.mark.parametrize("number", ["15"])
def test_the_workflow_grades_with_the_courses_pinned_tests_into_the_job_summary(
    number: str, tmp_path: Path
):
    """The student repository's `.github/workflows/grade.yml`, read as YAML: a plain job (no
    GitHub Classroom, discontinued) that checks out the course at a pinned commit, grades the
    student's copy from there, and writes the points to the job summary (its script run here on
    a grade made up of the stage's tasks)."""
    yaml = pytest.importorskip("yaml")
    from stages import student_repo

    lesson = load_lesson(number)
    student_repo.write_repo(number, tmp_path / "repo")
    text = (tmp_path / "repo" / student_repo.WORKFLOW).read_text()
    workflow = yaml.safe_load(text)
    assert "classroom-resources" not in text and "discontinued on 2026-08-28" in text
    assert workflow["env"]["COURSE_REF"] and workflow["env"]["COURSE_REF"] != "main"
    steps = workflow["jobs"]["grade"]["steps"]
    course = next(s for s in steps if s.get("with", {}).get("path") == "course")
    assert course["with"]["ref"] == "${{ env.COURSE_REF }}"
    grade = steps[-1]
    assert grade["working-directory"] == "course"
    command, summary = grade["run"].split("\n", 2)[:2], grade["run"].split("\n", 2)[2]
    assert f'"$GITHUB_WORKSPACE/student/stages/{lesson.path.name}"' in command[0]
    tasks = [{"task": n, "function": t.function, "earned": 0, "points": t.points,
              "tests_passed": 0, "tests_total": len(t.tests)}
             for n, t in assignments.numbered(lesson)]  # fmt: skip
    points = sum(t.points for t in lesson.tasks)
    made = {"stage": number, "earned": 0, "points": points, "tasks": tasks}
    (tmp_path / "grade.json").write_text(json.dumps(made))
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    script = summary.replace(".venv/bin/python", sys.executable)  # as the job's shell runs it
    subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, check=True)
    written = (tmp_path / "summary.md").read_text()
    assert f"Stage {number}: 0/{points} points" in written
    assert written.count("\n| ") == len(lesson.tasks) + 1
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "grade.yml" in readme and "discontinued on 2026-08-28" in readme
