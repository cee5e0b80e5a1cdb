"""How big a lesson is: the changed lines between two neighbouring stage folders.

A lesson is what a reader holds while reading `python -m stages diff A B`. Its size is counted
as `diff -ruN` counts it: every added and every removed line of every file of the two folders,
bench.py (each stage's benchmark differs wholesale), the README, lesson.toml and the README's
diagrams aside. `python -m stages diff A B --stat` prints it per file.

The target for stages 09-15 is `TARGET` changed lines per neighbouring pair. Six pairs are over
it today: 08 -> 09 by 109 lines of tensor parallelism itself, 09 -> 10 by 11 (the front ends'
shared core plumbing, issue 39, and the engine core's branch of the deferred detokenizing,
issue 40), and 11 -> 12 to 14 -> 15 because
each of those stages teaches two to four ideas the course plan gives one stage (the README of
each splits its lesson into parts). `CEILINGS` holds them where they are, so a change can shrink
a lesson but never grow one past its ceiling unnoticed (tests/test_lesson_size.py).

A lesson is read in parts of one idea each: from 01 -> 02 on, a lesson over `PART_TARGET` names
them in its lesson.toml (`[[part]]`: a title, its files, and the hunks it takes from other parts'
files, stages/lesson.py), each part is `PART_TARGET` lines or less, and the plumbing parts come
last.
`python -m stages diff A B --part N` is one idea a reader holds in a sitting, and `--stat` sizes
every part.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from stages import stage_info
from stages.lesson import Lesson, Part, load_lesson, part_line_counts

TARGET = 1200  # changed lines per neighbouring pair, stages 09-15
PART_TARGET = 600  # changed lines a part (one idea, one sitting): most whole lessons of 01-07
CEILINGS = {  # pairs over TARGET: their size when the ceiling was set (issue 26), rounded up
    ("08", "09"): 1310,  # issue 39: the packing (`# fmt: skip`) unpacked
    ("09", "10"): 1250,  # issue 39: the cores' start, reading and death written once (13 reuses)
    ("11", "12"): 1850,
    ("12", "13"): 2650,
    ("13", "14"): 1580,  # issue 38: the paths probed at a real shape, and the fail-over; issue 62:
    # the batch path (a bf16 copy of the dequantized weight through one GEMM)
    ("14", "15"): 3420,  # issue 39: the packing unpacked; issue 40: the LM head in the graph,
    # and async scheduling per device (a CPU default of off: devices.default_async_scheduling)
    # issue 58: kernel fusion and split-K decode attention moved here from 03; issue 62: the
    # default weight format (quant/auto.py), one engine served from an engine-core process
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


def parted_lesson(a: str, b: str) -> Lesson | None:
    """Stage `b`'s manifest when `a` is the stage before it and it names parts (else None)."""
    lesson = load_lesson(b)
    previous = lesson.previous.number if lesson.previous else None
    return lesson if lesson.parts and previous == stage_info(a).number else None


def lesson_parts(a: str, b: str) -> tuple[Part, ...]:
    """The parts stage `b`'s manifest names, when `a` is the stage before it (else none)."""
    lesson = parted_lesson(a, b)
    return lesson.parts if lesson else ()


def part_stats(a: str, b: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """(title, {file: (added, removed)} of its changes) for each part of the lesson from `a`
    to `b`: a file's lines are counted in the part that owns each change (its hunks)."""
    lesson = parted_lesson(a, b)
    if lesson is None:
        return []
    return list(zip((p.title for p in lesson.parts), part_line_counts(lesson), strict=True))


def _file_lines(stat: dict[str, tuple[int, int]], indent: str = "") -> list[str]:
    width = max((len(name) for name in stat), default=0)
    rows = sorted(stat.items(), key=lambda item: (-sum(item[1]), item[0]))
    return [f"{indent}{name:<{width}}  +{add:<5} -{rem}" for name, (add, rem) in rows]


def stat_lines(a: str, b: str, part: int | None = None) -> list[str]:
    """What `python -m stages diff A B --stat` prints: a line per file, largest first (grouped by
    part where the lesson has parts), then the total against the target; with `part`, that
    part alone."""
    stat = lesson_stat(a, b)
    parts = part_stats(a, b)
    if part is not None:
        check_part(a, b, part)
        title, files = parts[part - 1]
        total = changed_lines(files)
        summary = f"part {part} of {len(parts)}, {title}: {len(files)} files, {total} changed lines"
        return [*_file_lines(files), f"{summary} (target {PART_TARGET} a part)"]
    lines = []
    for number, (title, files) in enumerate(parts, 1):
        lines += [f"part {number}: {title} ({changed_lines(files)} changed lines)"]
        lines += _file_lines(files, "  ")
    lines += [] if parts else _file_lines(stat)
    total, limit = changed_lines(stat), ceiling(a, b)
    note = f"target {TARGET}" + (f", ceiling {limit}" if limit != TARGET else "")
    lines.append(f"{len(stat)} files, {total} changed lines ({note}; bench.py, README aside)")
    return lines


def check_part(a: str, b: str, part: int) -> Lesson:
    """The lesson from `a` to `b` when it has a part `part` (from 1); else a ValueError that
    names the parts there are."""
    lesson = parted_lesson(a, b)
    if lesson is None:
        raise ValueError(f"the lesson {a} -> {b} has no parts (lesson.toml names none)")
    if not 1 <= part <= len(lesson.parts):
        titles = "; ".join(f"{i}: {p.title}" for i, p in enumerate(lesson.parts, 1))
        raise ValueError(f"the lesson {a} -> {b} has parts 1-{len(lesson.parts)} ({titles})")
    return lesson
