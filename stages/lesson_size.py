"""How big a lesson is: the changed lines between two neighbouring stage folders.

A lesson is what a reader holds while reading `python -m stages diff A B`. Its size is counted
as `diff -ruN` counts it: every added and every removed line of every file of the two folders,
bench.py (each stage's benchmark differs wholesale), the README, lesson.toml and the README's
diagrams aside. `python -m stages diff A B --stat` prints it per file.

The target for stages 09-15 is `TARGET` changed lines per neighbouring pair. Six pairs are over
it today: 08 -> 09 by 100 lines of tensor parallelism itself, 09 -> 10 by 3 (the front ends'
shared core plumbing, issue 39), and 11 -> 12 to 14 -> 15 because
each of those stages teaches two to four ideas the course plan gives one stage (the README of
each splits its lesson into parts). `CEILINGS` holds them where they are, so a change can shrink
a lesson but never grow one past its ceiling unnoticed (tests/test_lesson_size.py).

A lesson of several ideas names them in its lesson.toml (`[[part]]`: a title and its files), and
each part keeps to the target: `python -m stages diff A B --part N` is one idea a reader can hold,
and `--stat` sizes every part.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from stages import stage_info
from stages.lesson import Part, load_lesson

TARGET = 1200  # changed lines per neighbouring pair, stages 09-15
CEILINGS = {  # pairs over TARGET: their size when the ceiling was set (issue 26), rounded up
    ("08", "09"): 1300,
    ("09", "10"): 1250,  # issue 39: the cores' start, reading and death written once (13 reuses)
    ("11", "12"): 1850,
    ("12", "13"): 2650,
    ("13", "14"): 1550,  # issue 38: the paths probed at a real shape, and the fail-over
    ("14", "15"): 2350,
}
NOT_COUNTED = frozenset({"bench.py", "README.md", "lesson.toml"})
NOT_COUNTED_DIRS = frozenset({"diagrams", "__pycache__"})


def _counted(folder: Path) -> set[str]:
    """The files of a stage folder a lesson's size counts."""
    names = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    return {
        n.as_posix()
        for n in names
        if n.name not in NOT_COUNTED
        and not NOT_COUNTED_DIRS & set(n.parts)
        and not any(part.startswith(".") for part in n.parts)
    }


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def folder_stat(old: Path, new: Path) -> dict[str, tuple[int, int]]:
    """{file: (lines added, lines removed)} for every counted file that differs."""
    stat = {}
    for name in sorted(_counted(old) | _counted(new)):
        added = removed = 0
        for line in difflib.unified_diff(_lines(old / name), _lines(new / name), n=0):
            if line.startswith(("+++", "---")):
                continue
            added += line.startswith("+")
            removed += line.startswith("-")
        if added or removed:
            stat[name] = (added, removed)
    return stat


def lesson_stat(a: str, b: str) -> dict[str, tuple[int, int]]:
    """`folder_stat` of two stages, by number or folder name."""
    return folder_stat(stage_info(a).path, stage_info(b).path)


def changed_lines(stat: dict[str, tuple[int, int]]) -> int:
    return sum(added + removed for added, removed in stat.values())


def ceiling(a: str, b: str) -> int:
    """The most changed lines the lesson from stage `a` to `b` may have."""
    return CEILINGS.get((stage_info(a).number, stage_info(b).number), TARGET)


def lesson_parts(a: str, b: str) -> tuple[Part, ...]:
    """The parts stage `b`'s manifest names, when `a` is the stage before it (else none)."""
    lesson = load_lesson(b)
    previous = lesson.previous.number if lesson.previous else None
    return lesson.parts if previous == stage_info(a).number else ()


def part_stats(
    a: str, b: str, stat: dict[str, tuple[int, int]] | None = None
) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """(title, `folder_stat` of its files) for each part of the lesson from `a` to `b` (`stat`:
    the lesson's, if the caller has it already)."""
    stat = lesson_stat(a, b) if stat is None else stat
    return [(p.title, {f: stat[f] for f in p.files if f in stat}) for p in lesson_parts(a, b)]


def _file_lines(stat: dict[str, tuple[int, int]], indent: str = "") -> list[str]:
    width = max((len(name) for name in stat), default=0)
    rows = sorted(stat.items(), key=lambda item: (-sum(item[1]), item[0]))
    return [f"{indent}{name:<{width}}  +{add:<5} -{rem}" for name, (add, rem) in rows]


def stat_lines(a: str, b: str, part: int | None = None) -> list[str]:
    """What `python -m stages diff A B --stat` prints: a line per file, largest first (grouped by
    part where the lesson has parts), then the total against the target; with `part`, that
    part alone."""
    stat = lesson_stat(a, b)
    parts = part_stats(a, b, stat)
    if part is not None:
        title, files = parts[part - 1]
        total = changed_lines(files)
        return [*_file_lines(files), f"part {part} of {len(parts)}, {title}: {len(files)} files, "
                f"{total} changed lines (target {TARGET} a part)"]  # fmt: skip
    lines = []
    for number, (title, files) in enumerate(parts, 1):
        lines += [f"part {number}: {title} ({changed_lines(files)} changed lines)"]
        lines += _file_lines(files, "  ")
    lines += [] if parts else _file_lines(stat)
    total, limit = changed_lines(stat), ceiling(a, b)
    note = f"target {TARGET}" + (f", ceiling {limit}" if limit != TARGET else "")
    lines.append(f"{len(stat)} files, {total} changed lines ({note}; bench.py, README aside)")
    return lines


def part_files(a: str, b: str, part: int) -> tuple[str, ...]:
    """The files of part `part` (from 1) of the lesson from `a` to `b`; a ValueError names the
    parts there are."""
    parts = lesson_parts(a, b)
    if not parts:
        raise ValueError(f"the lesson {a} -> {b} has no parts (lesson.toml names none)")
    if not 1 <= part <= len(parts):
        titles = "; ".join(f"{i}: {p.title}" for i, p in enumerate(parts, 1))
        raise ValueError(f"the lesson {a} -> {b} has parts 1-{len(parts)} ({titles})")
    return parts[part - 1].files
