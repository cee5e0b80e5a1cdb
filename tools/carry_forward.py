"""Carry a fix made in one stage into every later stage that holds the same module.

Stages are snapshots: stage N+1 starts as a copy of stage N. When a bug is fixed in stage K, the
same lines must change in K+1, K+2, ... in the same commit. This does it mechanically with a
3-way merge (`git merge-file`): base = the file as committed (HEAD) in stage K, theirs = the
file as edited now in stage K, ours = the same module in each later stage.

    python tools/carry_forward.py 01                # every .py changed in stage 01 since HEAD
    python tools/carry_forward.py 01 model.py       # one module
    python tools/carry_forward.py 01 --dry-run      # show what would merge, change nothing

A conflict is left in the later file with the usual <<<<<<< markers and reported; the exit
status is the number of files with conflicts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages import list_stages, stage_info  # noqa: E402


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def changed_modules(stage_dir: Path) -> list[str]:
    rel = stage_dir.relative_to(ROOT)
    names = _git("diff", "--name-only", "HEAD", "--", str(rel)).split()
    return [str(Path(n).relative_to(rel)) for n in names if n.endswith(".py")]


def carry(source_stage: str, modules: list[str], dry_run: bool) -> int:
    source = stage_info(source_stage)
    later = [s for s in list_stages() if s.number > source.number]
    conflicts = 0
    for module in modules or changed_modules(source.path):
        edited = source.path / module
        base_text = _git("show", f"HEAD:{edited.relative_to(ROOT)}")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as base:
            base.write(base_text)
        for stage in later:
            target = stage.path / module
            if not target.exists():
                continue
            if dry_run:
                print(f"would merge {edited.relative_to(ROOT)} -> {target.relative_to(ROOT)}")
                continue
            result = subprocess.run(
                [
                    "git",
                    "merge-file",
                    "-L",
                    stage.folder,
                    "-L",
                    "base",
                    "-L",
                    source.folder,
                    str(target),
                    base.name,
                    str(edited),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            status = "merged" if result.returncode == 0 else f"{result.returncode} conflict(s)"
            conflicts += result.returncode > 0
            print(f"{target.relative_to(ROOT)}: {status}")
        Path(base.name).unlink()
    return conflicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", help="the stage where the fix was made, e.g. 01")
    parser.add_argument("modules", nargs="*", help="module paths inside the stage folder")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    return carry(args.stage, args.modules, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
