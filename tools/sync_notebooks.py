"""Write every walkthrough notebook, notebooks/NN_*.ipynb, from its source notebooks/NN_*.py.

    python tools/sync_notebooks.py            # rewrite each .ipynb from its .py
    python tools/sync_notebooks.py --check    # exit 1, naming every .ipynb that is out of date

The .py files are the sources, in jupytext's percent format (`# %%` starts a code cell,
`# %% [markdown]` a markdown cell written as comments), so ruff lints them and a change to a
notebook is a readable diff. Each .ipynb is generated from its source without outputs and with
fixed cell ids, so it changes only when the source does. With jupytext installed, Jupyter opens
either file and keeps the pair in step (`make notebooks`); run this tool after editing anyway,
to normalise the .ipynb. The test suite executes the sources and checks the pairs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"


def sources() -> list[Path]:
    """The notebook sources, one per stage: notebooks/NN_name.py."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))


def notebook_text(source: Path) -> str:
    """The .ipynb text for a source: its cells, no outputs, cell ids `<name>-NN`."""
    nb = jupytext.read(source)
    prefix = source.stem.replace("_", "-")
    for index, cell in enumerate(nb.cells):
        cell.id = f"{prefix}-{index:02d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return jupytext.writes(nb, fmt="ipynb") + "\n"  # a final newline, as Jupyter saves


def out_of_date() -> list[str]:
    """Why each out-of-date .ipynb is so; empty when every notebook matches its source."""
    problems = []
    for source in sources():
        target = source.with_suffix(".ipynb")
        if not target.exists():
            problems.append(f"{target.relative_to(ROOT)}: missing")
        elif target.read_text(encoding="utf-8") != notebook_text(source):
            problems.append(f"{target.relative_to(ROOT)}: differs from {source.name}")
    for target in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")):
        if not target.with_suffix(".py").exists():
            problems.append(f"{target.relative_to(ROOT)}: has no source {target.stem}.py")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; fail if any .ipynb is out of date"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = out_of_date()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run: python tools/sync_notebooks.py", file=sys.stderr)
        return 1 if problems else 0
    for source in sources():
        target = source.with_suffix(".ipynb")
        text = notebook_text(source)
        if target.exists() and target.read_text(encoding="utf-8") == text:
            continue
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target.relative_to(ROOT)}")
    for target in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")):
        if not target.with_suffix(".py").exists():
            print(f"warning: {target.relative_to(ROOT)} has no source", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
