"""`python -m stages gradebook` (stages/gradebook.py): a class graded with the course's tests.

A roster of generated student repositories of stage 03, graded on task 1 (quick): blank, solved,
one task solved, one that edited its own tests and added a conftest to pass them, one that
hangs, one that is not a student repository. Each gets what its code earns, the hang costs
that student alone, the CSV and the HTML say so, and a second run reuses the grades of clean
repositories at the same commit.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from stages import grade as grading
from stages import student_repo
from stages.gradebook import StudentGrade, gradebook, read_roster, write_csv, write_html
from stages.lesson import load_lesson

STAGE = "03"
TEST_TIMEOUT = 20  # seconds a test of a student may take


def _commit(repo: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=s", "-c", "user.email=s@x", "commit", "-qm", "work")


@pytest.fixture(scope="module")
def roster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("roster")
    lesson = load_lesson(STAGE)
    task = lesson.tasks[0]
    student_repo.write_repo(STAGE, root / "blank")
    student_repo.write_repo(STAGE, root / "solved", solution=True)
    copy = student_repo.write_repo(STAGE, root / "one_task")
    solved = root / "solved" / "stages" / copy.name
    (copy / task.file).write_text((solved / task.file).read_text())
    cheat = student_repo.write_repo(STAGE, root / "edited_tests")
    for test in (root / "edited_tests" / "tests").glob("test_03_*.py"):
        test.write_text("def test_passes():\n    pass\n")
    (cheat / "conftest.py").write_text("raise SystemExit('a student conftest ran')\n")
    hang = student_repo.write_repo(STAGE, root / "hangs")
    source = (hang / task.file).read_text()
    stub = '        raise NotImplementedError(\n            "task 1:'
    assert stub in source
    (hang / task.file).write_text(
        # A deadlock, which holds no core: a busy loop would slow the class graded beside it
        source.replace(
            stub, "        while True:\n            __import__('time').sleep(0.1)\n" + stub
        )
    )
    (root / "not_a_repository").mkdir()
    (root / "not_a_repository" / "notes.txt").write_text("hello\n")
    for name in ("blank", "solved", "one_task", "edited_tests", "hangs"):
        _commit(root / name)
    return root


@pytest.mark.slow
def test_a_class_gets_what_its_code_earns_and_a_hang_costs_one_student(roster, tmp_path):
    out = tmp_path / "grades"
    started = time.monotonic()
    # 30 s a student: the hang (every test of task 1 reaches it) costs that, not 20 s a test.
    # A test's limit leaves room for a busy machine: 5 s timed out a solved student's engine
    # test on 2 cores shared with the suite's other worker (and, then, a hang that spun).
    # 90 s a student: in a sandbox, three at a time on 2 shared cores, a solved student took
    # 28-30 s; the hang spends task 1's share (40 s), then its other tests fail unrun.
    rows = gradebook(
        roster, STAGE, out, jobs=3, timeout=90, test_timeout=TEST_TIMEOUT, tasks=[1], quick=True
    )
    elapsed = time.monotonic() - started
    by = {r.student: r for r in rows}
    points = load_lesson(STAGE).tasks[0].points
    assert [r.student for r in rows] == sorted(by)  # roster order: the folders' names
    assert by["solved"].total == points, by["solved"]
    # One task solved: its direct test passes, but its grade also holds every test of the stage
    # that catches its bugs (the mutation sweep), and those run the engine, which waits for the
    # later tasks: no points yet, and the grade says how far it got.
    task_one = lambda row: row.grade["tasks"][0]
    assert by["one_task"].total == 0 and task_one(by["one_task"])["tests_passed"] >= 1
    assert task_one(by["blank"])["tests_passed"] == 0
    assert by["blank"].total == 0 and not by["blank"].problem
    assert by["edited_tests"].total == 0 and not by["edited_tests"].problem  # course tests
    assert by["hangs"].total == 0
    hang = by["hangs"]
    failing = [f for t in (hang.grade or {}).get("tasks", []) for f in t["failing"]]
    assert hang.problem.startswith("stopped after") or failing, hang
    assert "no copy of stage 03" in by["not_a_repository"].problem
    assert all(len(r.commit) == 40 and r.clean for r in rows if r.student != "not_a_repository")
    assert elapsed < 240
    table = list(csv.reader((out / "grades.csv").read_text().splitlines()))
    assert table[0][:4] == ["student", "id", "task 1", "task 1 tests"]
    assert table[0][-5:] == ["total", "commit", "commit date", "late", "problem"]
    assert table[1][0] == "Points Possible" and int(table[1][-5]) == sum(
        t.points for t in load_lesson(STAGE).tasks
    )
    totals = {row[0]: int(row[-5]) for row in table[2:]}
    assert totals == {r.student: r.total for r in rows}
    page = (out / "grades.html").read_text()
    assert page.count("<tr>") == len(rows) + 1 and 'class="pass"' in page
    assert 'class="fail"' in page and "no copy of stage 03" in page
    saved = json.loads((out / "students" / STAGE / "solved.json").read_text())
    assert saved["grade"]["earned"] == points
    # The second run, on part of the class (a CSV roster): the clean repositories are reused,
    # the folder that is no repository is looked at again. Regrading the hang would only cost
    # its time limit once more.
    part = tmp_path / "part.csv"
    part.write_text("".join(f"{n},{roster / n}\n" for n in ("blank", "solved", "not_a_repository")))
    again = {
        r.student: r
        for r in gradebook(
            part, STAGE, out, jobs=3, timeout=90, test_timeout=TEST_TIMEOUT, tasks=[1], quick=True
        )
    }
    assert again["solved"].reused and again["blank"].reused  # clean, same commit: not regraded
    assert not again["not_a_repository"].reused and again["solved"].total == points


@pytest.mark.slow
def test_a_roster_can_be_a_csv_and_a_bad_one_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    listed = tmp_path / "roster.csv"
    listed.write_text("student,path\nann,a\nbob,missing\n")
    assert read_roster(listed) == [("ann", tmp_path / "a"), ("bob", tmp_path / "missing")]
    listed.write_text("ann,a\nann,a\n")
    with pytest.raises(ValueError, match="twice"):
        read_roster(listed)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages",
            "gradebook",
            str(tmp_path / "nope"),
            "--stage",
            STAGE,
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no such folder or CSV" in done.stderr


@pytest.mark.slow
def test_a_student_past_the_time_limit_is_stopped_with_everything_it_started(roster, monkeypatch):
    """The wall-clock limit kills the student's whole process group: here a student whose task
    1 never returns (no machine grades it within the second); the row says why and nothing it
    started is left. Its processes are told apart by a variable of their environment, which
    they inherit, so that the graders another test runs beside this one are not counted."""
    import secrets

    from stages.gradebook import grade_student

    lesson = load_lesson(STAGE)
    mark = f"STAGES_TEST_MARK={secrets.token_hex(8)}"
    monkeypatch.setenv(*mark.split("="))
    row = grade_student(
        "hangs", roster / "hangs", lesson, timeout=1, memory_gb=8, tasks=[1], quick=True
    )
    assert row.problem == "stopped after 1 s (the time limit)" and row.grade is None
    left = set()
    for _ in range(200):  # a killed process may take a moment to leave /proc
        if not (left := {p for p in _processes_with_env(mark) if _alive(p, wait=0)}):
            break
        time.sleep(0.05)
    assert left == set(), "a process of the stopped student is still alive"


def _alive(pid: int, wait: float = 2.0) -> bool:
    """Whether a process still runs (a zombie awaiting its reaper does not) after `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return False
        if state == "Z" or time.monotonic() > deadline:
            return state != "Z"
        time.sleep(0.05)


def _processes_with_env(entry: str) -> set[int]:
    """Process ids whose environment holds `entry` ("NAME=value"), this process aside."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                environment = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if entry.encode() in environment:
                found.add(int(proc.name))
    return found


def _processes(marker: str = "") -> set[int]:
    """Process ids whose command line runs the grader (or holds `marker`)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                command = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if marker and marker.encode() in command:
                found.add(int(proc.name))
            elif not marker and (b"stages\x00grade" in command or b"grade_worker" in command):
                found.add(int(proc.name))
    return found


# ------------------------------------------------------------------------ time limits per task
TASK_TESTS = """\
import os
import time


def test_one_hangs():
    time.sleep(60)


def test_one_other():
    pass


def test_two_passes():
    pass


def test_two_forks_a_child_that_holds_the_output():
    if os.fork() == 0:  # the child keeps the worker's stdout open for a minute
        with open(__file__ + ".pid", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        os._exit(0)
"""


def test_a_task_past_its_time_limit_fails_alone(tmp_path: Path) -> None:
    """Task 1's hang spends task 1's budget: its other test fails unrun, task 2 still runs; a
    fork holding the worker's output does not hold the grade, and nothing it started stays."""
    folder = tmp_path / "01_fake"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "test_tasks.py").write_text(TASK_TESTS)
    test = lambda name: f"{folder / 'test_tasks.py'}::{name}"
    names = ("one_hangs", "one_other", "two_passes", "two_forks_a_child_that_holds_the_output")
    owners = tuple((test(f"test_{n}"), 1 if n.startswith("one") else 2) for n in names)
    job = grading.Job(folder, tuple(t for t, _ in owners), task_of=owners, task_limit=0.5)
    started = time.monotonic()
    (result,) = grading.run_jobs([job], timeout=1.0)
    assert time.monotonic() - started < 30, "the forked child held the grade"
    by = {c.node_id.rpartition("::")[2]: c for c in result.cases}
    assert by["test_one_hangs"].message == "Failed: timed out after 1 s"
    assert by["test_one_other"].outcome == "error"
    assert "task 1's tests used its time limit" in by["test_one_other"].message
    assert by["test_two_passes"].outcome == "passed"
    assert by["test_two_forks_a_child_that_holds_the_output"].outcome == "passed"
    child = int((folder / "test_tasks.py.pid").read_text())
    assert not _alive(child), "the forked child is still alive"


def test_the_table_shows_each_tasks_tests_beside_its_points(tmp_path: Path) -> None:
    """A task at 0 points whose direct test passes reads so in the CSV and the HTML."""
    lesson = load_lesson(STAGE)
    task = lambda n, earned, passed, direct: {
        "task": n, "earned": earned, "tests_passed": passed, "tests_total": 3,
        "direct_passed": direct, "status": "pass" if earned else "fail", "failing": [],
    }  # fmt: skip
    grade = {"earned": 10, "tasks": [task(1, 10, 3, True), task(2, 0, 1, True)]}
    rows = [StudentGrade("ann", "/a", grade=grade), StudentGrade("bob", "/b", problem="gone")]
    write_csv(rows, lesson, tmp_path / "g.csv")
    table = list(csv.reader((tmp_path / "g.csv").read_text().splitlines()))
    assert table[0][2:6] == ["task 1", "task 1 tests", "task 2", "task 2 tests"]
    assert table[2][2:6] == ["10", "3/3*", "0", "1/3*"] and table[3][2:4] == ["0", ""]
    write_html(rows, lesson, tmp_path / "g.html")
    assert "0 pts<br>1/3* tests" in (tmp_path / "g.html").read_text()


# ------------------------------------------------------------------------------------ the cache
def _fake_class(root: Path, names: tuple[str, ...]) -> Path:
    """Tiny git repositories (one file each): what the cache reads is the commit alone."""
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "work.py").write_text(f"# {name}\n")
        _commit(root / name)
    return root


@pytest.fixture
def graded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """`grade_student` replaced: each call recorded, its grade the stage and flags it ran
    under, and a student named `hangs` stopped at the time limit."""
    from stages import gradebook as book

    calls = []

    def fake(student: str, path: Path, lesson, *, tasks, quick, **_: object) -> StudentGrade:
        calls.append((student, lesson.stage, tuple(tasks), quick))
        row = StudentGrade(student, str(path))
        if student == "hangs":
            row.problem, row.hung = "stopped after 1 s (the time limit)", True
        else:
            points = {"points": 1, "earned": 1 if quick else 50, "tasks": []}
            row.grade = {"stage": lesson.stage, **points}
        return row

    monkeypatch.setattr(book, "grade_student", fake)
    return calls


def test_the_cache_keys_on_commit_stage_flags_and_course(graded, tmp_path, monkeypatch):
    """Each case of issue 61: a grade is reused only under the same commit, stage, flags and
    course; a hang is not regraded unless asked; a partial roster keeps the other rows."""
    from stages import gradebook as book

    roster = _fake_class(tmp_path / "class", ("ann", "bob", "hangs"))
    out = tmp_path / "out"
    # the sandbox is another test's: these rows come from the stand-in grader
    run = lambda *a, **k: {
        r.student: r for r in gradebook(roster, *a, out=out, isolation=False, **k)
    }
    run(STAGE, tasks=[1], quick=True)
    assert len(graded) == 3
    again = run(STAGE)  # not the --task 1 --quick grade: the full one
    assert len(graded) == 6 and again["ann"].grade["earned"] == 50 and not again["ann"].reused
    assert [r.reused for r in run(STAGE).values()] == [True, True, True] and len(graded) == 6
    assert run(STAGE, regrade_hung=True)["hangs"].problem and graded[-1][0] == "hangs"
    assert run("04")["ann"].grade["stage"] == "04" and graded[-1][1] == "04"  # another stage
    assert run(STAGE)["ann"].reused  # stage 03's grades are still there, apart
    calls = len(graded)
    monkeypatch.setattr(book, "course_hash", lambda lesson: "a fixed test")
    run(STAGE)
    assert len(graded) == calls + 3, "a changed test, manifest or grader regrades everyone"
    (roster / "ann" / "work.py").write_text("# changed, not committed\n")
    assert not run(STAGE)["ann"].reused  # uncommitted: no commit names what was graded
    _commit(roster / "ann")
    assert not run(STAGE)["ann"].reused and run(STAGE)["ann"].reused  # a new commit, once
    part = tmp_path / "part.csv"
    part.write_text(f"bob,{roster / 'bob'}\n")
    rows = gradebook(part, STAGE, out, isolation=False)
    assert [r.student for r in rows] == ["bob", "ann", "hangs"], "a row was dropped"
    assert [r[0] for r in csv.reader((out / "grades.csv").read_text().splitlines())][2:] == [
        "bob",
        "ann",
        "hangs",
    ]


# ---------------------------------------------------------- results the student cannot forge
def _raw(cases: list[list[object]], exit_code: int = 1) -> str:
    from stages.grade_report import RAW_MARK

    return RAW_MARK + json.dumps({"cases": cases, "deselected": [], "thread_stubs": [],
                                  "exit_code": exit_code})  # fmt: skip


def test_a_report_is_checked_before_any_point_counts(tmp_path: Path) -> None:
    """The trusted side's checks (stages/grade_check.py), on made-up reports: the grade comes
    from a report of the right shape whose sentinel failed; a sentinel that passed, two
    results, a missing test or a killed grader give none."""
    from stages.grade_check import check_report, write_sentinel

    lesson = load_lesson(STAGE)
    sentinel = write_sentinel(tmp_path)
    assert (
        "must" not in sentinel
        and sentinel.rpartition("::")[2] in Path(sentinel.partition("::")[0]).read_text()
    )
    case = lambda node, outcome: [node, outcome, "", [], 0.1, "", False]
    tests = [case(t, "passed") for t in lesson.tasks[0].tests]
    good = _raw([*tests, case(sentinel, "failed")])
    checked = check_report(good, 0, lesson, [1], sentinel)
    assert checked.grade is not None and checked.grade["earned"] == lesson.tasks[0].points
    forged = _raw([*tests, case(sentinel, "passed")])
    assert check_report(forged, 0, lesson, [1], sentinel).tampered
    assert check_report(good + "\n" + good, 0, lesson, [1], sentinel).tampered
    assert check_report(
        _raw([*tests[1:], case(sentinel, "failed")]), 0, lesson, [1], sentinel
    ).tampered
    twice = _raw([*tests, tests[0], case(sentinel, "failed")])
    assert check_report(twice, 0, lesson, [1], sentinel).tampered
    killed = check_report(good, -9, lesson, [1], sentinel)
    assert killed.grade is None and "did not finish" in killed.problem and not killed.tampered
    assert check_report(good.replace("0.1", '"x"'), 0, lesson, [1], sentinel).tampered


# -------------------------------------------------------------------------- a sandbox each
FORGES = """
import json as _json, os as _os, signal as _signal
_forged = {{"cases": [], "deselected": [], "thread_stubs": [], "exit_code": 0}}
for _where in ({out!r} + "/grades.csv", {out!r} + "/students/03/blank.json"):
    try:
        open(_where, "w").write("forged")
    except OSError:
        pass
try:
    with open(f"/proc/{{_os.getppid()}}/fd/1", "w") as _out:
        _out.write("stages-grade-raw: " + _json.dumps(_forged) + "\\n")
    _os.kill(_os.getppid(), _signal.SIGKILL)
except OSError:
    pass
"""
EXECS = """
import os as _os
for _path in ({reference!r}, _os.path.join(_os.getcwd(), {relative!r})):
    if _os.path.isfile(_path) and "raise NotImplementedError" not in open(_path).read():
        exec(open(_path).read())
"""
RUNAWAY = """
import subprocess as _subprocess, sys as _sys
_subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(300)  # runaway-61"],
                  start_new_session=True)
"""
PATCHES = """
import _pytest.reports as _reports
_made = _reports.TestReport.from_item_and_call.__func__
def _passed(cls, item, call):
    report = _made(cls, item, call)
    report.outcome, report.longrepr = "passed", None
    return report
_reports.TestReport.from_item_and_call = classmethod(_passed)
"""


@pytest.mark.slow
@pytest.mark.skipif(bool(__import__("stages.sandbox").sandbox.why_not()), reason="no bwrap")
def test_a_class_of_forgers_and_runaways_grades_in_sandboxes(tmp_path: Path) -> None:
    """Blank 0, solved full points; one that writes a forged result into its grader's stdout
    (and tries the output folder) and kills it, one that runs the course's reference of its
    task, one that rewrites pytest's reports, one that leaves a new session's child: none
    gets a point, the rewrite reads tampered, nothing is left running or on /tmp."""
    from stages import gradebook as book

    lesson = load_lesson(STAGE)
    task = lesson.tasks[0]
    root, out = tmp_path / "class", tmp_path / "out"
    student_repo.write_repo(STAGE, root / "solved", solution=True)
    reference = str(lesson.path / task.file)
    extra = {
        "forges": FORGES.format(out=str(out)),
        "execs": EXECS.format(
            reference=reference, relative=f"stages/{lesson.path.name}/{task.file}"
        ),
        "patches": PATCHES,
        "runaway": RUNAWAY,
    }
    for name in ("blank", *extra):
        copy = student_repo.write_repo(STAGE, root / name)
        if name in extra:
            with (copy / (task.file if name == "execs" else "__init__.py")).open("a") as f:
                f.write(extra[name])
    for name in ("solved", "blank", *extra):
        _commit(root / name)
    # The graders' own scratch (stages-grade-*) lives in each sandbox's throw-away /tmp; on
    # this side a student's grading leaves the gradebook's scratch (gradebook-*), which only
    # this file's tests make (one worker runs a file: the suite's --dist loadfile).
    scratch = Path(tempfile.gettempdir())
    scratch_before = set(scratch.glob("gradebook-*"))
    started = time.monotonic()
    rows = book.gradebook(root, STAGE, out, jobs=2, timeout=120, tasks=[1], quick=True)
    elapsed = time.monotonic() - started
    by = {r.student: r for r in rows}
    assert by["solved"].total == task.points, by["solved"]
    assert {n: by[n].total for n in ("blank", *extra)} == dict.fromkeys(("blank", *extra), 0)
    assert by["patches"].tampered and by["patches"].problem.startswith("tampered")
    assert not by["blank"].problem and not by["execs"].problem and not by["runaway"].problem
    assert by["forges"].problem.startswith(("the grader did not finish", "tampered")), by["forges"]
    assert "forged" not in (out / "grades.csv").read_text()
    assert json.loads((out / "students" / STAGE / "blank.json").read_text())["student"] == "blank"
    assert not _processes("runaway-61"), "a runaway outlived its sandbox"
    assert set(scratch.glob("gradebook-*")) == scratch_before, "a student's scratch was left"
    assert not list(Path("/sys/fs/cgroup/pids").glob("stages-grade-*"))
    assert elapsed < 400


# ------------------------------------------------------------------------------------ exports
def test_the_csv_carries_ids_maxima_commit_dates_and_a_late_flag(tmp_path):
    """What an LMS imports: the roster's id (its third column, else the name), each task's
    maximum in a "Points Possible" row, the commit and its date, and "late" for a commit dated
    after --deadline."""
    import datetime

    from stages.gradebook import read_ids

    lesson = load_lesson(STAGE)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    roster = tmp_path / "roster.csv"
    roster.write_text("student,path,id\nann,a,s-1001\nbob,b\n")
    assert read_ids(roster) == {"ann": "s-1001", "bob": "bob"}
    rows = [
        StudentGrade("ann", "/a", commit="c1", commit_date="2026-12-01T10:00:00+00:00"),
        StudentGrade("bob", "/b", commit="c2", commit_date="2026-12-03T10:00:00+01:00"),
    ]
    deadline = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)
    write_csv(rows, lesson, tmp_path / "g.csv", read_ids(roster), deadline)
    table = list(csv.reader((tmp_path / "g.csv").read_text().splitlines()))
    head = table[0]
    maxima = dict(zip(head, table[1], strict=True))
    assert maxima["task 1"] == str(lesson.tasks[0].points) and maxima["task 1 tests"] == ""
    assert maxima["total"] == str(sum(t.points for t in lesson.tasks))
    by = {row[0]: dict(zip(head, row, strict=True)) for row in table[2:]}
    assert by["ann"]["id"] == "s-1001" and by["bob"]["id"] == "bob"
    assert by["ann"]["commit date"] == "2026-12-01T10:00:00+00:00" and by["ann"]["late"] == ""
    assert by["bob"]["late"] == "late"


def test_the_gradescope_autograder_writes_results_gradescope_reads(tmp_path):
    """`gradebook --gradescope` writes a zip with setup.sh, an executable run_autograder and
    the course; run locally (AUTOGRADER pointing at a folder laid out as Gradescope's) against
    a solved submission, run_autograder writes a results.json of Gradescope's schema: a score,
    and tests with name, score, max_score, output and visibility, the score their sum."""
    import stat
    import zipfile

    from stages.cli import main as cli

    archive = tmp_path / "autograder.zip"
    assert cli(["gradebook", "--gradescope", str(archive), "--stage", STAGE, "--quick"]) == 0
    root = tmp_path / "autograder"
    with zipfile.ZipFile(archive) as opened:
        names = set(opened.namelist())
        mode = opened.getinfo("run_autograder").external_attr >> 16
        opened.extractall(root / "source")
    assert {"setup.sh", "run_autograder", "pyproject.toml"} <= names and mode & stat.S_IXUSR
    assert f"tests/test_{STAGE}_paged.py" in names and "stages/gradebook.py" in names
    student_repo.write_repo(STAGE, root / "submission", solution=True)
    env = {
        **os.environ,
        "AUTOGRADER": str(root),
        "PYTHON": sys.executable,
        "GRADE_ARGS": "--task 1 --timeout 300",
    }
    done = subprocess.run(
        ["bash", str(root / "source" / "run_autograder")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((root / "results" / "results.json").read_text())
    assert set(results) >= {"score", "tests"} and isinstance(results["score"], int | float)
    (test,) = results["tests"]  # --task 1: one task graded
    assert set(test) == {"name", "score", "max_score", "output", "visibility"}
    assert test["name"].startswith("task 1: ") and test["visibility"] in ("visible", "hidden")
    assert test["score"] == test["max_score"] == load_lesson(STAGE).tasks[0].points
    assert results["score"] == sum(t["score"] for t in results["tests"])
