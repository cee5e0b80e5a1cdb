"""The walkthrough notebooks: every stage has one, each .ipynb matches its source, and each
source runs top to bottom in a fresh kernel.

`notebooks/NN_name.py` (jupytext's percent format) is the source of `notebooks/NN_name.ipynb`;
`python tools/sync_notebooks.py` rewrites the .ipynb from it. The notebook of stage NN runs only
when that stage is selected (``pytest --stage 02`` runs only 02's). It is built in memory from
the .py, so the test runs what the source says, and executes with the repository root as the
kernel's working directory; no file is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import stages

from .conftest import _selected_stages

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


def test_every_stage_has_a_notebook() -> None:
    for info in stages.list_stages():
        for suffix in (".py", ".ipynb"):
            path = NOTEBOOK_DIR / f"{info.folder}{suffix}"
            assert path.exists(), f"stage {info.number} has no walkthrough {path.name}"
    orphans = [p.name for p in NOTEBOOK_DIR.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a .py source: {orphans}"


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_matches_its_source(source: Path) -> None:
    """The committed .ipynb has the source's cells, in order, and no outputs."""
    target = source.with_suffix(".ipynb")
    assert target.exists(), f"{target.name} is missing: run python tools/sync_notebooks.py"
    expected, committed = jupytext.read(source), jupytext.read(target)
    fix = f"{target.name} is out of date with {source.name}: run python tools/sync_notebooks.py"
    want = [(c.cell_type, c.source) for c in expected.cells]
    have = [(c.cell_type, c.source) for c in committed.cells]
    for index, (w, h) in enumerate(zip(want, have, strict=False)):
        assert h == w, f"{fix}\ncell {index}, the .ipynb has:\n{h}\n---- the .py has:\n{w}"
    assert len(have) == len(want), f"{fix}\n{len(have)} cells, the .py has {len(want)}"
    assert committed.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent", (
        f"{target.name} is not paired with {source.name} (jupytext formats): {fix}"
    )
    with_outputs = [
        i for i, c in enumerate(committed.cells) if c.cell_type == "code" and c.get("outputs")
    ]
    assert not with_outputs, (
        f"{target.name} is committed with outputs (cells {with_outputs}): {fix}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_runs(source: Path, request: pytest.FixtureRequest) -> None:
    stage = source.name[:2]
    if stage not in _selected_stages(request.config):
        pytest.skip(f"stage {stage} is not selected")
    if request.config.getoption("--stage-path"):
        pytest.skip("notebooks run the repository's stages, not the one at --stage-path")
    nb = jupytext.read(source)
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:  # the failing cell's source and traceback, uncoloured
        pytest.fail(f"{source.name}: a cell failed\n{_ANSI.sub('', str(exc))}", pytrace=False)
