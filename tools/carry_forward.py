"""Carry a fix made in one stage into every later stage that holds the same module.

Stages are snapshots: stage N+1 starts as a copy of stage N, and each stage's lesson.toml lists
the files it changes. When a bug is fixed in stage K, the same lines must change in K+1, K+2, ...
in the same commit. This walks the later stages in order, each one against the stage before it
("before" = that stage's file before the fix, "after" = with the fix):

- the module is not listed in the stage's `changes` and was byte-identical to the previous
  stage's before the fix: a plain copy of the fixed file, so the copies stay byte-identical;
- the stage lists the module as changed (or it already differed): a 3-way merge
  (`git merge-file`: base = previous stage before, theirs = previous stage after, ours = this
  stage's file), so the fix lands on top of the stage's own changes;
- the stage lists the module in `removed`, or no longer has it: the carrying stops there.

The fix in stage K is the difference between its file at HEAD and the file as edited now.

    python tools/carry_forward.py 01                # every .py changed in stage 01 since HEAD
    python tools/carry_forward.py 01 model.py       # one module
    python tools/carry_forward.py 01 --dry-run      # show what would happen, change nothing
    python tools/carry_forward.py --check           # list every snapshot violation in the repo

A conflict is left in the later file with the usual <<<<<<< markers and reported, and that
module is carried no further: resolve it, then run this again from that stage. The exit status
is the number of files with conflicts (with --check: 1 if anything is wrong).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import StageInfo, list_stages, stage_info  # noqa: E402
from stages.lesson import Lesson, load_lesson, snapshot_violations, task_problems  # noqa: E402


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def changed_modules(stage_dir: Path) -> list[str]:
    rel = stage_dir.relative_to(ROOT)
    names = _git("diff", "--name-only", "HEAD", "--", str(rel)).decode().split()
    return [Path(n).relative_to(rel).as_posix() for n in names if n.endswith(".py")]


def merge(
    ours: bytes, base: bytes, theirs: bytes, labels: tuple[str, str, str]
) -> tuple[bytes, int]:
    """git merge-file on three texts, returning (merged text, number of conflicts)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp, name) for name in ("ours", "base", "theirs")]
        for path, text in zip(paths, (ours, base, theirs), strict=True):
            path.write_bytes(text)
        result = subprocess.run(
            ["git", "merge-file", "-p", *(a for label in labels for a in ("-L", label)), *paths],
            capture_output=True,
        )
    if not 0 <= result.returncode <= 127:
        raise RuntimeError(f"git merge-file failed: {result.stderr.decode().strip()}")
    return result.stdout, result.returncode


def _lesson(stage: StageInfo) -> Lesson | None:
    try:
        return load_lesson(stage.number)
    except ValueError as exc:  # a manifest being edited: fall back to comparing the files
        print(f"  warning: {exc}; deciding by content alone")
        return None


def carry_module(source: StageInfo, module: str, dry_run: bool) -> int:
    """Carry one module's fix from `source` through the later stages; return the conflicts."""
    edited = source.path / module
    rel = edited.relative_to(ROOT).as_posix()
    print(f"{rel}:")
    if not edited.is_file():
        print(f"  deleted in {source.folder}: not carried (list it in `removed` where it goes)")
        return 0
    try:
        before = _git("show", f"HEAD:{rel}")
    except subprocess.CalledProcessError:
        print("  not in HEAD: no fix to carry (a new module is added stage by stage)")
        return 0
    after, previous = edited.read_bytes(), source
    if after == before:
        print("  unchanged since HEAD: nothing to carry")
        return 0
    for stage in [s for s in list_stages() if s.number > source.number]:
        target, lesson = stage.path / module, _lesson(stage)
        where = target.relative_to(ROOT).as_posix()
        if lesson and module in lesson.removed:
            print(f"  {stage.folder} removes {module}: stopping here")
            break
        if not target.is_file():
            print(f"  {stage.folder} has no {module} (and does not list it in `removed`): stopping")
            break
        ours = target.read_bytes()
        listed = lesson is not None and module in lesson.changes
        if ours == after:
            result, action = ours, ""
        elif ours == before and not listed:
            result, action = after, f"copied from {previous.folder} (identical before the fix)"
        else:
            result, conflicts = merge(ours, before, after, (stage.folder, "base", previous.folder))
            if not listed:
                print(f"  note: {where} differs from {previous.folder} but is not listed")
            if conflicts:
                if not dry_run:
                    target.write_bytes(result)
                would = "would have" if dry_run else "left"
                print(f"  {where}: {would} {conflicts} conflict(s); once resolved, carry on with:")
                print(f"    python tools/carry_forward.py {stage.number} {module}")
                return 1
            action = f"3-way merged from {previous.folder}" + (" (listed)" if listed else "")
        if result == ours:  # fixed by hand earlier: its text before the fix is unknown,
            action = "already has the fix"  # so keep merging from the last known pair
        elif not dry_run:
            target.write_bytes(result)
        print(f"  {where}: {'(dry run) ' if dry_run else ''}{action}")
        if result != ours:
            before, after, previous = ours, result, stage
    return 0


def check() -> int:
    """Print every snapshot violation and task problem in the repository; 1 if any."""
    problems = []
    for stage in list_stages():
        try:
            lesson = load_lesson(stage.number)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        problems += snapshot_violations(lesson) + task_problems(lesson)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)" if problems else "every stage is a faithful snapshot")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stage", nargs="?", help="the stage where the fix was made, e.g. 01")
    parser.add_argument("modules", nargs="*", help="module paths inside the stage folder")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--check", action="store_true", help="list every snapshot violation")
    args = parser.parse_args()
    if args.check:
        return check()
    if args.stage is None:
        parser.error("give the stage where the fix was made (or --check)")
    source = stage_info(args.stage)
    modules = args.modules or changed_modules(source.path)
    if not modules:
        print(f"nothing changed in {source.folder} since HEAD")
    return sum(carry_module(source, module, args.dry_run) for module in modules)


if __name__ == "__main__":
    sys.exit(main())
