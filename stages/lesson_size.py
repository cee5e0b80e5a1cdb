"""How big a lesson is: the changed lines between two neighbouring stage folders.

A lesson is what a reader holds while reading `python -m stages diff A B`. Its size is counted
as `diff -ruN` counts it: every added and every removed line of every file of the two folders,
bench.py (each stage's benchmark differs wholesale), the README, lesson.toml and the README's
diagrams aside. `python -m stages diff A B --stat` prints it per file.

The target for stages 09-15 is `TARGET` changed lines per neighbouring pair. Five pairs are over
it today: 08 -> 09 by 84 lines of tensor parallelism itself, and 11 -> 12 to 14 -> 15 because
each of those stages teaches two to four ideas the course plan gives one stage (the README of
each splits its lesson into parts). `CEILINGS` holds them where they are, so a change can shrink
a lesson but never grow one past its ceiling unnoticed (tests/test_lesson_size.py).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from stages import stage_info

TARGET = 1200  # changed lines per neighbouring pair, stages 09-15
CEILINGS = {  # pairs over TARGET: their size when the ceiling was set (issue 26), rounded up
    ("08", "09"): 1300,
    ("11", "12"): 1850,
    ("12", "13"): 2650,
    ("13", "14"): 1500,
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


def stat_lines(a: str, b: str) -> list[str]:
    """What `python -m stages diff A B --stat` prints: a line per file, largest first, then the
    total against the target."""
    stat = lesson_stat(a, b)
    width = max((len(name) for name in stat), default=0)
    rows = sorted(stat.items(), key=lambda item: (-sum(item[1]), item[0]))
    lines = [f"{name:<{width}}  +{add:<5} -{rem}" for name, (add, rem) in rows]
    total, limit = changed_lines(stat), ceiling(a, b)
    note = f"target {TARGET}" + (f", ceiling {limit}" if limit != TARGET else "")
    lines.append(f"{len(stat)} files, {total} changed lines ({note}; bench.py, README aside)")
    return lines
