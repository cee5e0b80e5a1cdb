"""Each lesson stays the size it is or shrinks (stages/lesson_size.py; docs/design.md's table).

The count is `diff -ruN`'s (added plus removed lines, bench.py, the README, lesson.toml and the
diagrams aside); a planted pair of folders checks the counting itself, and every neighbouring
pair from 08 -> 09 on must stay at or under its ceiling: the target, or where a stage teaches
more than one idea today, the size it had when its ceiling was set.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import pytest

from stages import list_stages, stage_info
from stages.cli import main
from stages.lesson import load_lesson, part_diff, part_line_counts, task_part, with_parts
from stages.lesson_size import (
    CEILINGS,
    PART_TARGET,
    TARGET,
    ceiling,
    changed_lines,
    folder_stat,
    lesson_parts,
    lesson_stat,
    part_stats,
)

NUMBERS = [info.number for info in list_stages()]
PAIRS = [(a, b) for a, b in itertools.pairwise(NUMBERS) if b >= "09"]
PARTED = list(itertools.pairwise(NUMBERS))  # every lesson over PART_TARGET is read in parts
WITH_PARTS = [(a, b) for a, b in PARTED if load_lesson(b).parts]  # the lessons that name parts


def test_the_count_is_added_plus_removed_lines_and_skips_what_is_not_the_lesson(tmp_path: Path):
    old, new = tmp_path / "a", tmp_path / "b"
    for folder in (old, new):
        (folder / "diagrams").mkdir(parents=True)
    (old / "engine.py").write_text("a\nb\nc\n")
    (new / "engine.py").write_text("a\nB\nc\nd\n")  # one line changed (-1 +1), one added
    (new / "router.py").write_text("x\ny\n")  # a new module: all its lines
    (old / "gone.py").write_text("z\n")  # a removed one: all its lines
    (new / "page.html").write_text("<p>\n")  # not Python, still the lesson
    for skipped in ("bench.py", "README.md", "lesson.toml", "diagrams/flow.svg"):
        (new / skipped).write_text("anything\n" * 50)
    stat = folder_stat(old, new)
    assert stat == {
        "engine.py": (2, 1), "router.py": (2, 0), "gone.py": (0, 1), "page.html": (1, 0)
    }  # fmt: skip
    assert changed_lines(stat) == 7


def test_ceilings_are_only_for_pairs_over_the_target_and_name_real_neighbours():
    for (a, b), limit in CEILINGS.items():
        assert (a, b) in PAIRS, f"{a} -> {b} is not a pair of neighbouring stages"
        assert limit > TARGET, f"{a} -> {b}: a ceiling at or under the target is the target"


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_no_lesson_grows_past_its_ceiling(a: str, b: str):
    stat = lesson_stat(a, b)
    total, limit = changed_lines(stat), ceiling(a, b)
    largest = sorted(stat.items(), key=lambda item: -sum(item[1]))[:5]
    assert total <= limit, (
        f"stages {a} -> {b}: {total} changed lines, over {limit} "
        f"(largest: {[(name, sum(counts)) for name, counts in largest]}). Move plumbing that "
        "is not this stage's technique to stages/common or a harness, or split the lesson."
    )


def test_the_design_notes_give_each_lessons_size_as_counted_now():
    """docs/design.md's table of lesson sizes is the count, not a memory of it."""
    readme = (Path(__file__).parents[1] / "docs" / "design.md").read_text()
    rows = dict(re.findall(r"^\| (\d\d -> \d\d) \| ([\d,]+) \|", readme, re.MULTILINE))
    assert set(rows) == {f"{a} -> {b}" for a, b in PAIRS}, "one row per lesson from 08 -> 09"
    for a, b in PAIRS:
        counted = changed_lines(lesson_stat(a, b))
        assert int(rows[f"{a} -> {b}"].replace(",", "")) == counted, (
            f"docs/design.md: {a} -> {b} is {rows[f'{a} -> {b}']} changed lines; it is {counted}"
        )


@pytest.mark.parametrize(("a", "b"), PARTED, ids=[f"{a}-{b}" for a, b in PARTED])
def test_a_lesson_is_read_in_parts_of_one_sitting_with_the_plumbing_last(a: str, b: str):
    """From 01 -> 02 on, a lesson over `PART_TARGET` names its ideas (lesson.toml `[[part]]`), each
    part, which `python -m stages diff A B --part N` shows alone, is `PART_TARGET` lines or
    less, and the plumbing (checks, health, supervision, harnesses) comes after the technique."""
    parts = part_stats(a, b)
    if changed_lines(lesson_stat(a, b)) > PART_TARGET:
        assert parts, f"{a} -> {b} is over {PART_TARGET} changed lines and names no parts"
    for title, files in parts:
        assert changed_lines(files) <= PART_TARGET, f"{a} -> {b}, part {title!r}: over the target"
    plumbing = [title.startswith("Plumbing") for title, _ in parts]
    assert plumbing == sorted(plumbing), f"{a} -> {b}: a plumbing part before the technique"


@pytest.mark.parametrize(("a", "b"), WITH_PARTS, ids=[f"{a}-{b}" for a, b in WITH_PARTS])
def test_the_parts_are_patches_that_stack_into_the_lesson(a: str, b: str):
    """No part applied is the old stage's file, every part applied the new one's, and the parts
    together count the lesson: no change is lost or shown twice."""
    lesson = load_lesson(b)
    assert lesson.previous is not None
    for name in {n for part in lesson.parts for n in part.files}:
        old, new = lesson.previous.path / name, lesson.path / name
        before = old.read_text().splitlines(keepends=True) if old.exists() else []
        assert with_parts(lesson, name, ()) == before, name
        assert with_parts(lesson, name, range(len(lesson.parts))) == new.read_text().splitlines(
            keepends=True
        ), name
    per_part = sum(changed_lines(files) for _, files in part_stats(a, b))
    assert per_part == changed_lines(
        {k: v for k, v in lesson_stat(a, b).items() if k != "bench.py"}
    )


def test_a_hunk_moves_one_definitions_change_to_its_ideas_part(capsys):
    """Stage 15's server.py lives in part 4 (the metrics served), but its health report's
    change is plumbing: part 7 shows it, part 4 does not, and each part's diff is its count."""
    lesson = load_lesson("15")
    home = next(i for i, p in enumerate(lesson.parts, 1) if "server.py" in p.files)
    plumbing = next(
        i for i, p in enumerate(lesson.parts, 1) if "server.py::health_report" in p.hunks
    )
    assert home != plumbing

    def server_changes(part: int) -> set[str]:
        diff = "".join(part_diff(lesson, part)).split("+++ 15_full/server.py\n", 1)[1]
        diff = diff.split("\n--- ", 1)[0]
        return {
            line for line in diff.splitlines() if line.startswith(("+", "-")) and line[1:].strip()
        }

    assert server_changes(plumbing) and server_changes(home)
    assert not server_changes(plumbing) & server_changes(home)
    counts = part_line_counts(lesson)
    for number in (home, plumbing):
        diff = [line for line in part_diff(lesson, number) if not line.startswith(("+++", "---"))]
        added = sum(line.startswith("+") for line in diff)
        removed = sum(line.startswith("-") for line in diff)
        assert (added, removed) == tuple(map(sum, zip(*counts[number - 1].values(), strict=True)))


def test_a_task_belongs_to_the_part_that_holds_its_function():
    lesson = load_lesson("15")
    for task in lesson.tasks:
        part = lesson.parts[task_part(lesson, task)]
        assert task.file in part.files or any(
            task.function.startswith(hunk) for hunk in part.hunks
        ), task.function


def test_a_manifest_refuses_a_hunk_that_is_not_a_definition_or_is_listed_twice(tmp_path: Path):
    stage = stage_info("15").path
    text = (stage / "lesson.toml").read_text()
    for bad, said in (
        ('"server.py::health_report"', '"server.py::no_such_function"'),
        ('"server.py::health_report"', '"server.py::health_report", "server.py::health_report"'),
        ('"server.py::health_report"', '"README.md::x"'),
    ):
        copy = tmp_path / stage.name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(stage, copy, ignore=shutil.ignore_patterns("__pycache__"))
        (copy / "lesson.toml").write_text(text.replace(bad, said, 1))
        with pytest.raises(ValueError, match="hunk"):
            load_lesson(copy)


@pytest.mark.parametrize(("a", "b"), PARTED, ids=[f"{a}-{b}" for a, b in PARTED])
def test_the_readme_lists_each_part_with_its_size_as_counted_now(a: str, b: str):
    """ "The lesson in parts" in the stage's README: `N. **title** (size lines: ...)`, in the
    manifest's order, each size the count of now."""
    parts = part_stats(a, b)
    if not parts:
        return
    readme = (stage_info(b).path / "README.md").read_text()
    assert "## The lesson in parts" in readme, f"README {b} has no 'The lesson in parts'"
    section = readme.split("## The lesson in parts", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^(\d+)\. \*\*(.+?)\*\* \(([\d,]+) lines", section, re.MULTILINE)
    counted = [(str(n), title, f"{changed_lines(files):,}") for n, (title, files) in
               enumerate(parts, 1)]  # fmt: skip
    assert listed == counted, f"README {b}'s parts {listed}; lesson.toml and the count: {counted}"
    whole = f"{changed_lines(lesson_stat(a, b)):,}"
    for said in re.findall(r"([\d,]+) changed lines", section):  # the lesson's size, if given
        assert said == whole, f"README {b} says the lesson is {said} changed lines; it is {whole}"


def test_diff_shows_one_part_and_refuses_a_part_that_is_not_there(capsys):
    parts = lesson_parts("12", "13")
    assert main(["diff", "12", "13", "--part", "1"]) == 0
    shown = set(re.findall(r"^\+\+\+ 13_disagg/(\S+)", capsys.readouterr().out, re.MULTILINE))
    assert shown == set(parts[0].files)  # part 1 claims no hunks elsewhere
    assert main(["diff", "14", "15", "--part", "9"]) == 0  # dashboard.html too, not only .py
    assert "+++ 15_full/observability/dashboard.html" in capsys.readouterr().out
    assert main(["diff", "12", "13", "--stat", "--part", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"part 2 of {len(parts)}, ")
    assert main(["diff", "12", "13", "--part", str(len(parts) + 1)]) == 2
    assert "has parts 1-" in capsys.readouterr().err
    assert main(["diff", "06", "07", "--part", "1"]) == 2
    assert "has no parts" in capsys.readouterr().err
