"""Before and after, in one run: the step profile of a past commit and of the working tree,
in alternating rounds on the same machine, so that a change's effect is not the machine's drift.

    python tools/step_profile_ab.py BEFORE [--rounds 3] [--stages 05 15] [--requests 1 64 256]
    python tools/step_profile_ab.py BEFORE --embedded [--stages 15] [--requests 1 64]

BEFORE is any git revision. It is checked out into a temporary worktree (removed after), and
each round runs `python -m stages.common.tooling.step_profile` (with `--embedded`:
`embedded_throughput`, the embedded model's tok/s) there and here, one after the other, the
tool itself always this tree's (copied into the worktree); the log (every
round's table, headed by the revision) goes to stdout. Only ratios within
one such log count (the README's rule for timings); a difference within the rounds' spread is
noise, not a gain.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _revision(tree: Path, ref: str = "HEAD") -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", ref],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


PROFILER = Path("stages/common/tooling/step_profile.py")
EMBEDDED = Path("stages/common/tooling/embedded_throughput.py")


def _profile(tree: Path, stages: list[str], requests: list[int], tool: Path) -> str:
    module = ".".join(tool.with_suffix("").parts)
    count = "--streams" if tool == EMBEDDED else "--requests"
    command = [sys.executable, "-m", module, "--stages", *stages, count, *map(str, requests)]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("before", help="the revision to compare against (a commit, a tag)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", nargs="+", default=["05", "15"])
    parser.add_argument("--requests", nargs="+", type=int, default=None,
                        help="running requests (default 1 64 256), or streams with --embedded "
                        "(default 1 64)")  # fmt: skip
    parser.add_argument("--embedded", action="store_true",
                        help="the embedded model's tok/s (embedded_throughput.py), not the "
                        "tiny model's step profile")  # fmt: skip
    args = parser.parse_args(argv)
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
        (before / tool).write_text((ROOT / tool).read_text())
        print(f"(both sides measured by {tool} of {here})", flush=True)
        try:
            for round_ in range(1, args.rounds + 1):
                for tree, label in ((before, _revision(before)), (ROOT, here)):
                    print(f"=== round {round_}: {label}", flush=True)
                    print(_profile(tree, args.stages, counts, tool), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(before)], check=False)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
