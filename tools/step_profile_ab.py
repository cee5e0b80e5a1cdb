"""Before and after, in one run: the step profile of a past commit and of the working tree,
in alternating rounds on the same machine, so that a change's effect is not the machine's drift.

    python tools/step_profile_ab.py BEFORE [--rounds 3] [--stages 05 15] [--requests 1 64 256]
    python tools/step_profile_ab.py BEFORE --embedded [--stages 15] [--requests 1 64]
    python tools/step_profile_ab.py BEFORE --config async_scheduling=true [...]

BEFORE is any git revision. It is checked out into a temporary worktree (removed after), and
each round runs `python -m stages.common.tooling.step_profile` (with `--embedded`:
`embedded_throughput`, the embedded model's tok/s) there and here, one after the other, the
tool itself always this tree's (copied into the worktree); the log (every
round's table, headed by the revision) goes to stdout. `--config KEY=VALUE` sets an
`EngineConfig` field in every engine on both sides (the same setting before and after, where a
default changed between the two). Only ratios within
one such log count (docs/step_cost.md's rule for timings); a difference within the rounds' spread is
noise, not a gain.

The log ends with a summary (`summarize`): per stage and count, the number a claim quotes
(the engine's own CPU per step; tok/s with `--embedded`), before and after, each the median of
its rounds with their range, the ratio of the medians, and the median and range of the
round-by-round ratios (each round's two sides ran minutes apart, so those ratios drift less
than the medians do). `python tools/step_profile_ab.py --summarize LOG` prints it for a log
already written, such as the ones committed in plots/step_profile/.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _revision(tree: Path, ref: str = "HEAD") -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", ref],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


PROFILER = Path("stages/common/tooling/step_profile.py")
EMBEDDED = Path("stages/common/tooling/embedded_throughput.py")


def _profile(
    tree: Path, stages: list[str], requests: list[int], tool: Path, config: list[str]
) -> str:
    module = ".".join(tool.with_suffix("").parts)
    count = "--streams" if tool == EMBEDDED else "--requests"
    command = [sys.executable, "-m", module, "--stages", *stages, count, *map(str, requests)]
    command += [f"--config={item}" for item in config]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout


SUMMARY_COLUMNS = ("own CPU/step", "tok/s")  # the first a log's tables hold is summarized
_ROUND = re.compile(r"=== round (\d+): (.+)")


def summarize(log: str) -> str:
    """The summary of a log this tool wrote: per stage and count, the first of SUMMARY_COLUMNS
    its tables hold, before and after (the first and second table of each round)."""
    values: dict[tuple[str, str], dict[tuple[int, int], float]] = defaultdict(dict)
    labels: list[str] = []
    round_, side, header, column = 0, -1, [], ""
    for line in log.splitlines():
        if match := _ROUND.match(line):
            number = int(match.group(1))
            side = side + 1 if number == round_ else 0
            round_, header = number, []
            if len(labels) <= side:
                labels.append(match.group(2).strip())
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "stage":
            header = cells
            column = next((c for c in SUMMARY_COLUMNS if c in header), "")
            continue
        if header and column and len(cells) == len(header) and cells[0][:2].isdigit():
            row = dict(zip(header, cells, strict=True))
            values[(cells[0], cells[1])][(round_, side)] = float(row[column].replace(",", ""))
    if len(labels) < 2 or not values:
        raise ValueError("no before-and-after rounds found: not a log of this tool")
    lines = [
        f"summary: {column}, before = {labels[0]}, after = {labels[1]} (medians of rounds)",
        f"| stage | {header[1]} | before [range] | after [range] | ratio of medians "
        "| round-by-round ratios: median [range] |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (stage, count), cells in values.items():
        rounds = sorted(r for r, side in cells if side == 0 and (r, 1) in cells)
        pairs = [(cells[(r, 0)], cells[(r, 1)]) for r in rounds]
        if not pairs:
            continue
        before, after = [b for b, _ in pairs], [a for _, a in pairs]
        ratios = [a / b for b, a in pairs]
        lines.append(
            f"| {stage} | {count} | {_spread(before)} | {_spread(after)} "
            f"| {statistics.median(after) / statistics.median(before):.2f} "
            f"| {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} [{min(values):,.1f}-{max(values):,.1f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("before", nargs="?", help="the revision to compare against (a commit, "
                        "a tag)")  # fmt: skip
    parser.add_argument("--summarize", type=Path, metavar="LOG",
                        help="print the summary of a log this tool wrote; run nothing")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", nargs="+", default=["05", "15"])
    parser.add_argument("--requests", nargs="+", type=int, default=None,
                        help="running requests (default 1 64 256), or streams with --embedded "
                        "(default 1 64)")  # fmt: skip
    parser.add_argument("--embedded", action="store_true",
                        help="the embedded model's tok/s (embedded_throughput.py), not the "
                        "tiny model's step profile")  # fmt: skip
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field for every engine, on both sides "
                        "(repeatable; the field must exist at BEFORE too)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.summarize is not None:
        try:
            print(summarize(args.summarize.read_text()))
        except (OSError, ValueError) as exc:
            parser.error(f"{args.summarize}: {exc}")
        return 0
    if args.before is None:
        parser.error("give the revision to compare against (or --summarize LOG)")
    tool = EMBEDDED if args.embedded else PROFILER
    counts = args.requests or ([1, 64] if args.embedded else [1, 64, 256])
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    here = f"{_revision(ROOT)}{' + working tree' if dirty else ''}"
    with tempfile.TemporaryDirectory(prefix="step-profile-ab-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(before), args.before], check=True)  # fmt: skip
        # Both sides measured by this tree's tool: a column it added (the CPU time) then
        # exists before too, and a change to how a phase is timed is no change of the engine.
        for measuring in (PROFILER, EMBEDDED):  # the profiler imports the other's parser
            (before / measuring).write_text((ROOT / measuring).read_text())
        settings = f", with {' '.join(args.config)} on both sides" if args.config else ""
        print(f"(both sides measured by {tool} of {here}{settings})", flush=True)
        log = []
        try:
            for round_ in range(1, args.rounds + 1):
                for tree, label in ((before, _revision(before)), (ROOT, here)):
                    table = _profile(tree, args.stages, counts, tool, args.config)
                    log += [f"=== round {round_}: {label}", table]
                    print(*log[-2:], sep="\n", flush=True)
            print(summarize("\n".join(log)), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(before)], check=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
