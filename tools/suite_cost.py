"""What the suite costs, per stage and per test file, from a run's JUnit report.

`make test` writes `.venv/suite.xml` (pytest's `--junitxml`); this reads it, or any other run's:

    python tools/suite_cost.py                      # .venv/suite.xml
    python tools/suite_cost.py run.xml --files 15   # and the 15 costliest test files
    python tools/suite_cost.py a.xml b.xml.gz       # two runs side by side (two CPU classes)

A test's seconds are its setup, call and teardown (JUnit's "total"), so a module's engine is
charged to the first test that builds it. Under pytest-xdist they are worker-seconds: with two
workers the wall time is about half their sum. A test belongs to the stage its `stage`
parameter names (`[s14-...]`); tests of no stage (the guard, the tools, the lesson sizes) are
one row of their own.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_REPORT = Path(".venv/suite.xml")
NO_STAGE = "none"
STAGE_ID = re.compile(r"\[s(\d\d)\b")


@dataclass
class Cost:
    tests: int = 0
    seconds: float = 0.0
    failed: int = 0
    skipped: int = 0

    def add(self, seconds: float, outcome: str) -> None:
        self.tests += 1
        self.seconds += seconds
        self.failed += outcome == "failed"
        self.skipped += outcome == "skipped"


@dataclass
class SuiteCost:
    by_stage: dict[str, Cost] = field(default_factory=lambda: defaultdict(Cost))
    by_file: dict[str, Cost] = field(default_factory=lambda: defaultdict(Cost))
    total: Cost = field(default_factory=Cost)
    wall_seconds: float = 0.0


def _outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if case.find("skipped") is not None else "passed"


def read_report(path: Path) -> SuiteCost:
    """One JUnit report -> its cost per stage and per test file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as report:
        root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cost = SuiteCost(wall_seconds=sum(float(s.get("time", 0)) for s in suites))
    for case in root.iter("testcase"):
        seconds, outcome = float(case.get("time", 0)), _outcome(case)
        match = STAGE_ID.search(case.get("name", ""))
        stage = match.group(1) if match else NO_STAGE
        test_file = case.get("classname", "").split(".")[-1] or "?"
        cost.by_stage[stage].add(seconds, outcome)
        cost.by_file[test_file].add(seconds, outcome)
        cost.total.add(seconds, outcome)
    return cost


def stage_table(costs: dict[str, SuiteCost]) -> str:
    """Markdown: one row per stage, two columns (tests, seconds) per report."""
    names = list(costs)
    stages = sorted(
        {s for c in costs.values() for s in c.by_stage}, key=lambda s: (s == NO_STAGE, s)
    )
    head = "| stage | " + " | ".join(f"{n}: tests | {n}: worker-s" for n in names) + " |"
    lines = [head, "| --- |" + " --- | --- |" * len(names)]
    for stage in [*stages, "all"]:
        cells = []
        for cost in costs.values():
            row = cost.total if stage == "all" else cost.by_stage.get(stage, Cost())
            cells += [f"{row.tests:,}", f"{row.seconds:,.0f}"]
        label = {"all": "**all**", NO_STAGE: "no stage (guard, tools, lessons)"}.get(stage, stage)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    walls = ", ".join(f"{n}: {c.wall_seconds:,.0f} s" for n, c in costs.items())
    return "\n".join(lines) + f"\n\npytest's wall time: {walls}."


def file_table(cost: SuiteCost, top: int) -> str:
    rows = sorted(cost.by_file.items(), key=lambda item: -item[1].seconds)[:top]
    lines = ["| test file | tests | worker-s |", "| --- | --- | --- |"]
    lines += [f"| {name} | {c.tests:,} | {c.seconds:,.0f} |" for name, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "reports", nargs="*", type=Path, help=f"JUnit XML (default {DEFAULT_REPORT})"
    )
    parser.add_argument("--files", type=int, default=0, metavar="N", help="the N costliest files")
    args = parser.parse_args(argv)
    reports = args.reports or [DEFAULT_REPORT]
    missing = [str(p) for p in reports if not p.is_file()]
    if missing:
        print(f"error: no report at {', '.join(missing)} (run `make test` first)", file=sys.stderr)
        return 2
    stems = [path.name.removesuffix(".gz").removesuffix(".xml") for path in reports]
    labels = [
        stem if stems.count(stem) == 1 else f"{path.parent.name}/{stem}"
        for stem, path in zip(stems, reports, strict=True)
    ]
    costs = {label: read_report(path) for label, path in zip(labels, reports, strict=True)}
    print(stage_table(costs))
    for name, cost in costs.items():
        if args.files:
            print(f"\n{name}: the {args.files} costliest test files\n")
            print(file_table(cost, args.files))
        if cost.total.failed:
            print(f"\n{name}: {cost.total.failed} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
