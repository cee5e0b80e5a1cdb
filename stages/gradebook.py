"""Grade a whole class: `python -m stages gradebook ROSTER --stage NN --out DIR`.

ROSTER is a folder of student repositories (one sub-folder per student, its name the student's)
or a CSV of `student,path`. Each student's copy of stage NN (`stages/NN_name` in a student
repository made by `assign --repo`, or the path itself when it is a stage folder) is graded
with this repository's tests and grader, never the student's: only the copy's Python modules
are taken, into a scratch folder (its `conftest.py`, tests and any pytest configuration left
behind), and `python -m stages grade --json` runs from here. Each student runs in a process
group of its own, under a wall-clock limit, a memory limit and a cap on its output, and the
group is killed when it ends, so one student's hang, crash, fork or endless output costs that
student alone. `-j N` grades N students at once. A student graded before at the same commit
of a clean repository, with the same flags (--task, --quick) and the same course (its tests,
the stage's lesson.toml, the grader: `course_hash`), is not graded again, nor, unless
--regrade-hung, one stopped at the time limit under all of those (DIR/students/NN/NAME.json
holds each grade, its key beside it). The table holds every student graded into DIR for the
stage: a roster of part of the class updates those rows and keeps the others.

It writes DIR/grades.csv (a row per student: a column per task with its points, the total,
the commit, and what went wrong if anything did) and DIR/grades.html (students x tasks, each
cell the tests passed, the failing tests' first lines on hover), and prints progress.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import datetime
import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stages import sandbox, stage_info
from stages.grade import TEST_TIMEOUT
from stages.grade_check import check_report, write_sentinel
from stages.lesson import Lesson, load_lesson

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_LIMIT = 32 * 2**20  # bytes a student's grading may print before it is stopped
KEEP_OUT = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")


@dataclass(slots=True)
class StudentGrade:
    """One student's row: the grade (`stages.grade_report.grade_summary`) or why there is none."""

    student: str
    path: str
    commit: str = ""  # the repository's HEAD ("" when not a git repository)
    clean: bool = False  # no uncommitted change: the commit names what was graded
    grade: dict[str, Any] | None = None
    problem: str = ""  # what stopped the grading, if anything did
    seconds: float = 0.0
    reused: bool = False  # taken from an earlier run with the same key
    tasks: list[dict[str, Any]] = field(default_factory=list)
    stage: str = ""
    key: str = ""  # `cache_key`: what the grade depends on; a grade is reused only under it
    hung: bool = False  # stopped at the time limit: not regraded unless asked (--regrade-hung)
    tampered: bool = False  # its report was forged or rewritten (stages/grade_check.py): no grade
    commit_date: str = ""  # the commit's date (ISO 8601): what a deadline is held against

    @property
    def total(self) -> int:
        return self.grade["earned"] if self.grade else 0


def read_roster(roster: Path) -> list[tuple[str, Path]]:
    """(student, path) pairs: a CSV's rows (a `student,path` header optional; relative paths
    are relative to the CSV) or a folder's sub-folders, in name order."""
    if roster.is_file():
        rows = [r for r in csv.reader(roster.read_text().splitlines()) if r and r[0].strip()]
        if rows and [c.strip().lower() for c in rows[0][:2]] == ["student", "path"]:
            rows = rows[1:]
        if any(len(r) < 2 for r in rows):
            raise ValueError(f"{roster}: every row must be student,path")
        pairs = [(r[0].strip(), (roster.parent / r[1].strip()).resolve()) for r in rows]
    elif roster.is_dir():
        pairs = [(p.name, p.resolve()) for p in sorted(roster.iterdir()) if p.is_dir()]
    else:
        raise ValueError(f"{roster}: no such folder or CSV file")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"{roster}: a student is listed twice")
    return pairs


def read_ids(roster: Path) -> dict[str, str]:
    """Each student's id for the LMS: a CSV roster's third column (`student,path,id`), else
    the student's name."""
    ids = {name: name for name, _ in read_roster(roster)}
    if roster.is_file():
        rows = [r for r in csv.reader(roster.read_text().splitlines()) if r and r[0].strip()]
        if rows and [c.strip().lower() for c in rows[0][:2]] == ["student", "path"]:
            rows = rows[1:]  # the header
        ids.update({r[0].strip(): r[2].strip() for r in rows if len(r) > 2 and r[2].strip()})
    return ids


def is_late(row: StudentGrade, deadline: datetime.datetime | None) -> bool:
    """Whether the graded commit is dated after the deadline (never without one or a date)."""
    if deadline is None or not row.commit_date:
        return False
    return datetime.datetime.fromisoformat(row.commit_date) > deadline


def _git(path: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def stage_copy(path: Path, lesson: Lesson) -> Path | None:
    """The student's copy of the stage: `stages/NN_name` in a repository, or the folder
    itself when it is one."""
    for candidate in (path / "stages" / lesson.path.name, path):
        if candidate.name == lesson.path.name and (candidate / "__init__.py").is_file():
            return candidate
    return None


def _take_modules(copy: Path, scratch: Path) -> Path:
    """The copy's engine files into `scratch`: pytest's configuration and conftest files, and
    anything named like a test, stay behind (the course's tests grade it)."""
    target = scratch / copy.name

    def ignored(folder: str, names: list[str]) -> set[str]:
        return {
            n
            for n in names
            if n in KEEP_OUT or n.startswith(("test_", ".")) or n in ("tests", "__pycache__")
        }

    shutil.copytree(copy, target, ignore=ignored, symlinks=False)
    return target


STARTUP = 30.0  # seconds the grading takes before its first test (Python, torch, collection)


def task_budget(timeout: float, test_timeout: float, tasks: int) -> float:
    """Seconds each task's tests may take together: the student's limit, less the start-up and
    one test's overrun per task (a test already running finishes or times out), shared evenly;
    never under one test's limit."""
    return max(test_timeout, (timeout - STARTUP - tasks * test_timeout) / max(1, tasks))


# Run first in the student's process: its pids cgroup (where there is one), the limits, then
# the command in its place (a preexec_fn would do the same, but is not safe where threads start
# processes, as `-j N` does).
LIMITS = (
    "import os, resource, sys\n"
    "memory, output, group, processes = sys.argv[1:5]\n"
    "if group != '-':\n"
    "    open(os.path.join(group, 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(output), int(output)))\n"
    "resource.setrlimit(resource.RLIMIT_NPROC, (int(processes), int(processes)))\n"
    "os.execvp(sys.argv[5], sys.argv[5:])\n"
)


def _processes_now() -> int:
    """Processes of this user now: RLIMIT_NPROC counts them all, so the cap is set above."""
    uid = os.getuid()
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid)


def _owner(path: Path) -> int:
    try:
        return path.stat().st_uid
    except OSError:
        return -1


def grade_student(
    student: str,
    path: Path,
    lesson: Lesson,
    *,
    timeout: float,
    memory_gb: float,
    tasks: list[int],
    quick: bool,
    test_timeout: float = TEST_TIMEOUT,
    isolation: bool = True,
) -> StudentGrade:
    """Grade one student under the limits: `timeout` seconds for the whole grading,
    `test_timeout` for each test (the grader's own limit), and a share of the whole for each
    task's tests (`task_budget`), so that one task's hang fails that task and the others are
    still graded. With `isolation`, in a sandbox of its own (stages/sandbox.py); without, in a
    process group of its own, as the grader's user. Either way the grade is computed here from
    what each test did, checked (stages/grade_check.py), never taken from the student's side."""
    row = StudentGrade(student, str(path))
    copy = stage_copy(path, lesson) if path.is_dir() else None
    if copy is None:
        row.problem = f"no copy of stage {lesson.stage} ({lesson.path.name}) in {path}"
        return row
    row.commit = _git(path, "rev-parse", "HEAD") or ""
    row.commit_date = _git(path, "log", "-1", "--format=%cI") or ""
    row.clean = bool(row.commit) and _git(path, "status", "--porcelain") == ""
    started = time.monotonic()
    chosen = tasks or list(range(1, len(lesson.tasks) + 1))
    with (
        tempfile.TemporaryDirectory(prefix="gradebook-") as tmp,
        sandbox.process_group() as group,
    ):
        scratch = _take_modules(copy, Path(tmp) / "modules")
        (Path(tmp) / "sentinel").mkdir()
        sentinel = write_sentinel(Path(tmp) / "sentinel")
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        memory, processes = int(memory_gb * 2**30), _processes_now() + sandbox.MAX_PROCESSES
        limits = [sys.executable, "-c", LIMITS, str(memory), str(OUTPUT_LIMIT)]
        limits += [str(group) if group else "-", str(processes)]
        if isolation:
            inside = sandbox.INSIDE / "stages" / lesson.path.name
            sentinel = str(sandbox.INSIDE / "sentinel" / sentinel.rpartition("/")[2])
            grader = [*sandbox.bwrap_command(lesson, scratch, Path(tmp) / "sentinel")]
            grader += ["-m", "stages", "grade", str(inside)]
        else:
            grader = [sys.executable, "-m", "stages", "grade", str(scratch)]
        command = [*limits, *grader, "--raw", "--sentinel", sentinel]
        command += ["--stage", lesson.stage, "--timeout", str(max(1, int(test_timeout)))]
        budget = task_budget(timeout, test_timeout, len(chosen))
        command += ["--task-timeout", f"{budget:.1f}"]
        command += ["--quick"] if quick else []
        for number in tasks:
            command += ["--task", str(number)]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                command,
                cwd=ROOT if not isolation else tmp,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=env,
                start_new_session=True,  # a process group of its own: killed whole at the end
            )
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:  # the whole group: whatever the student's code started dies with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        row.seconds = round(time.monotonic() - started, 1)
        if code is None:
            row.problem, row.hung = f"stopped after {timeout:.0f} s (the time limit)", True
            return row
        text = out.read_bytes()[:OUTPUT_LIMIT].decode(errors="replace")
        checked = check_report(text, code, lesson, chosen, sentinel, str(copy))
        row.grade, row.problem, row.tampered = checked.grade, checked.problem, checked.tampered
        if row.grade is None and not row.tampered:
            tail = err.read_bytes()[-2000:].decode(errors="replace").strip().splitlines()
            row.problem += f": {tail[-1]}" if tail else ""
    return row


# What grades a student besides the student's code: the course's tests, the stage's manifest
# (its tasks, tests and points, read by `course_hash`), the modules the student's side runs
# (`student_repo.TOOLS`) and those of the trusted side below.
TRUSTED_FILES = ("gradebook.py", "grade_check.py", "sandbox.py")


def course_hash(lesson: Lesson) -> str:
    """A hash of what the course grades with: the tests that apply to the stage (those a
    student repository gets: `student_repo.repo_tests`, the suite's conftest and helpers
    included; not the course tooling's own tests), the stage's lesson.toml, the grader's
    modules and stages/common: a fixed test or grader regrades all."""
    from stages.student_repo import TOOLS, repo_tests

    files = [*repo_tests(lesson.stage), lesson.path / "lesson.toml"]
    files += [ROOT / "stages" / name for name in (*TOOLS, *TRUSTED_FILES)]
    files += sorted((ROOT / "stages" / "common").rglob("*.py"))
    digest = hashlib.sha256()
    for file in files:
        if "__pycache__" not in file.parts and file.is_file():
            digest.update(f"{file.relative_to(ROOT)}\0".encode() + file.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key(commit: str, lesson: Lesson, tasks: list[int], quick: bool, course: str) -> str:
    """What a grade depends on, hashed: the student's commit, the stage, the flags (--task,
    --quick) and the course (`course_hash`); a cached grade is reused only under the same key."""
    parts = {"commit": commit, "stage": lesson.stage, "tasks": sorted(set(tasks))}
    parts |= {"quick": quick, "course": course}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _students_folder(out: Path, lesson: Lesson) -> Path:
    return out / "students" / lesson.stage  # one stage's grades never stand for another's


def _load(file: Path) -> StudentGrade | None:
    try:
        return StudentGrade(**json.loads(file.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _cached(out: Path, lesson: Lesson, student: str) -> StudentGrade | None:
    return _load(_students_folder(out, lesson) / f"{student}.json")


def _save(out: Path, lesson: Lesson, row: StudentGrade) -> None:
    folder = _students_folder(out, lesson)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{row.student}.json").write_text(json.dumps(asdict(row), indent=1))


def _reusable(before: StudentGrade | None, key: str, regrade_hung: bool) -> bool:
    """A cached row stands when it was made under the same key (a clean repository's commit,
    the stage, the flags and the course) and it is a grade, or a hang not asked to be rerun."""
    if before is None or not key or before.key != key:
        return False
    return (before.grade is not None and not before.problem) or (before.hung and not regrade_hung)


def _tests_cell(task: dict[str, Any] | None) -> str:
    """A task's tests passed of its tests, '*' when its direct test passes: a task at 0 points
    whose own test passes is waiting on another task, not undone."""
    if task is None:
        return ""
    star = "*" if task.get("direct_passed") else ""
    return f"{task['tests_passed']}/{task['tests_total']}{star}"


def write_csv(
    rows: list[StudentGrade],
    lesson: Lesson,
    file: Path,
    ids: dict[str, str] | None = None,
    deadline: datetime.datetime | None = None,
) -> None:
    """A row per student: the student and the LMS id (`read_ids`), per task its points and,
    beside them, its tests passed (see `_tests_cell`), then the total, the commit and its date,
    whether that is after `deadline`, and the problem, if any. The first row under the header
    is each column's maximum ("Points Possible", as LMS gradebooks import it)."""
    numbers = list(range(1, len(lesson.tasks) + 1))
    heads = [h for n in numbers for h in (f"task {n}", f"task {n} tests")]
    maxima = [c for task in lesson.tasks for c in (task.points, "")]
    with file.open("w", newline="") as handle:
        writer = csv.writer(handle)
        tail = ["total", "commit", "commit date", "late", "problem"]
        writer.writerow(["student", "id", *heads, *tail])
        total = sum(task.points for task in lesson.tasks)
        writer.writerow(["Points Possible", "", *maxima, total, "", "", "", ""])
        for row in rows:
            tasks = {t["task"]: t for t in (row.grade or {}).get("tasks", [])}
            cells = [
                c
                for n in numbers
                for c in ((tasks[n]["earned"] if n in tasks else 0), _tests_cell(tasks.get(n)))
            ]
            late = "late" if is_late(row, deadline) else ""
            student_id = (ids or {}).get(row.student, row.student)
            tail = [row.total, row.commit, row.commit_date, late, row.problem]
            writer.writerow([row.student, student_id, *cells, *tail])


def write_html(rows: list[StudentGrade], lesson: Lesson, file: Path) -> None:
    """A static table: a row per student, a cell per task (tests passed of total, green when
    the task passes), the failing tests' first lines on hover, the total."""
    heads = "".join(
        f'<th title="{html.escape(t.function)}">task {n}<br>{t.points} pts</th>'
        for n, t in enumerate(lesson.tasks, 1)
    )
    body = []
    for row in rows:
        tasks = {t["task"]: t for t in (row.grade or {}).get("tasks", [])}
        cells = []
        for number in range(1, len(lesson.tasks) + 1):
            task = tasks.get(number)
            if task is None:
                cells.append('<td class="none">-</td>')
                continue
            hover = "\n".join(f"{f['test']}: {f['message']}" for f in task["failing"])
            state = "pass" if task["status"] == "pass" else "fail"
            shown = f"{task['earned']} pts<br>{_tests_cell(task)} tests"
            cells.append(f'<td class="{state}" title="{html.escape(hover)}">{shown}</td>')
        problem = f' title="{html.escape(row.problem)}"' if row.problem else ""
        name = html.escape(row.student) + (" (!)" if row.problem else "")
        body.append(f"<tr><th{problem}>{name}</th>{''.join(cells)}<td>{row.total}</td></tr>")
    points = sum(t.points for t in lesson.tasks)
    file.write_text(
        f"""<!doctype html>
<meta charset="utf-8">
<title>Stage {lesson.stage} grades</title>
<style>
body {{ font-family: sans-serif; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: center; }}
td.pass {{ background: #c8f0c8; }} td.fail {{ background: #f5c6c6; }} td.none {{ color: #999; }}
</style>
<h1>Stage {lesson.stage}: {html.escape(lesson.title)}</h1>
<p>{len(rows)} students. Each cell: the task's points, and its tests passed of those run, with
* where its direct test (the one about its function alone) passes (hover: the failing tests'
first lines). Total of {points} points. (!) marks a student whose grading did not finish
(hover the name: why).</p>
<table><tr><th>student</th>{heads}<th>total</th></tr>
{chr(10).join(body)}
</table>
"""
    )


def gradebook(
    roster: Path,
    stage: str,
    out: Path,
    *,
    jobs: int = 1,
    timeout: float = 600.0,
    memory_gb: float = 8.0,
    tasks: list[int] | None = None,
    quick: bool = False,
    test_timeout: float = TEST_TIMEOUT,
    regrade_hung: bool = False,
    isolation: bool = True,
    deadline: datetime.datetime | None = None,
) -> list[StudentGrade]:
    """Grade every student of the roster (see the module docstring); return the rows. Without
    a sandbox (stages/sandbox.py) it refuses, unless `isolation` is False (--no-isolation)."""
    lesson = load_lesson(stage_info(stage).number)
    if unknown := set(tasks or ()) - set(range(1, len(lesson.tasks) + 1)):
        raise ValueError(f"stage {lesson.stage} has no task {sorted(unknown)}")
    if jobs < 1 or timeout <= 0 or memory_gb <= 0:
        raise ValueError("-j, --timeout and --memory-gb must be positive")
    if isolation and (why := sandbox.why_not()):
        raise ValueError(
            f"no sandbox for the students' code: {why}; --no-isolation grades without one "
            "(their code then runs as you, beside your files)"
        )
    students = read_roster(roster)
    out.mkdir(parents=True, exist_ok=True)
    course = course_hash(lesson)
    rows: dict[str, StudentGrade] = {}
    todo, keys = [], {}
    for student, path in students:
        before = _cached(out, lesson, student)
        commit = _git(path, "rev-parse", "HEAD") if path.is_dir() else None
        clean = commit is not None and _git(path, "status", "--porcelain") == ""
        keys[student] = cache_key(commit or "", lesson, tasks or [], quick, course) if clean else ""
        if before is not None and _reusable(before, keys[student], regrade_hung):
            before.reused = True
            rows[student] = before
        else:
            todo.append((student, path))
    total = len(students)
    print(
        f"[gradebook] stage {lesson.stage}: {total} students, {len(rows)} already graded "
        f"under the same commit, flags and course, {len(todo)} to grade ({jobs} at a time)",
        file=sys.stderr,
    )
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {
            pool.submit(
                grade_student,
                student,
                path,
                lesson,
                timeout=timeout,
                memory_gb=memory_gb,
                tasks=tasks or [],
                quick=quick,
                test_timeout=min(test_timeout, timeout),
                isolation=isolation,
            ): student
            for student, path in todo
        }
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = future.result()
            row.stage, row.key = lesson.stage, keys[row.student]
            rows[row.student] = row
            _save(out, lesson, row)
            points = sum(t.points for t in lesson.tasks)
            said = row.problem or f"{row.total}/{points} points"
            print(
                f"[gradebook] {done}/{len(todo)} {row.student}: {said} ({row.seconds:.0f} s)",
                file=sys.stderr,
            )
    ordered = [rows[student] for student, _ in students]
    # the students graded before into this folder and missing from this roster keep their rows
    listed = set(rows)
    for file in sorted(_students_folder(out, lesson).glob("*.json")):
        if file.stem not in listed and (kept := _load(file)) is not None:
            kept.reused = True
            ordered.append(kept)
    write_csv(ordered, lesson, out / "grades.csv", read_ids(roster), deadline)
    write_html(ordered, lesson, out / "grades.html")
    print(f"[gradebook] wrote {out / 'grades.csv'} and {out / 'grades.html'}", file=sys.stderr)
    return ordered


def _deadline(text: str) -> datetime.datetime:
    when = datetime.datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stages gradebook", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "roster",
        type=Path,
        nargs="?",
        help="a folder of student repositories, or a CSV of student,path[,id]",
    )
    parser.add_argument("--stage", required=True, help="the stage graded, NN")
    parser.add_argument(
        "--out", type=Path, help="where grades.csv and grades.html go (needed to grade)"
    )
    parser.add_argument("-j", "--jobs", type=int, default=1, help="students graded at once")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a student may take")
    parser.add_argument(
        "--test-timeout", type=float, default=TEST_TIMEOUT, help="seconds a test may take"
    )
    parser.add_argument("--memory-gb", type=float, default=8.0, help="memory a student may use")
    parser.add_argument("--task", type=int, action="append", help="grade only task N (repeatable)")
    parser.add_argument("--quick", action="store_true", help="without the real-model tests")
    parser.add_argument(
        "--no-isolation",
        action="store_true",
        help="grade without a sandbox (stages/sandbox.py): each student's code then runs as "
        "you, with your files in reach; only for code you trust",
    )
    parser.add_argument(
        "--regrade-hung",
        action="store_true",
        help="grade again the students stopped at the time limit under the same commit, flags "
        "and course (by default their row stands: a hang would cost its limit again)",
    )
    parser.add_argument(
        "--deadline",
        type=_deadline,
        help="ISO 8601 date and time (UTC unless it says): a commit dated after it reads late",
    )
    parser.add_argument(
        "--gradescope",
        type=Path,
        metavar="ZIP",
        help="write a Gradescope autograder for --stage to ZIP (stages/gradescope.py) and stop",
    )
    args = parser.parse_args(argv)
    if args.gradescope:
        from stages import gradescope

        written = gradescope.write_autograder(args.stage, args.gradescope, quick=args.quick)
        print(f"[gradebook] wrote the Gradescope autograder {written}", file=sys.stderr)
        return 0
    if args.roster is None or args.out is None:
        parser.error("grading needs a roster (a folder or a CSV of repositories) and --out")
    try:
        gradebook(
            args.roster,
            args.stage,
            args.out,
            jobs=args.jobs,
            timeout=args.timeout,
            memory_gb=args.memory_gb,
            tasks=args.task,
            quick=args.quick,
            test_timeout=args.test_timeout,
            regrade_hung=args.regrade_hung,
            isolation=not args.no_isolation,
            deadline=args.deadline,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
