"""The walkthrough notebooks run top to bottom in a fresh kernel.

`notebooks/NN_*.ipynb` belongs to stage NN and runs only when that stage is selected
(``pytest --stage 02`` runs only 02's notebook). Each notebook executes in memory, with the
repository root as the kernel's working directory; the file on disk is never rewritten (to
refresh the saved outputs, run ``python tools/build_notebooks.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from .conftest import _selected_stages

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, request: pytest.FixtureRequest) -> None:
    stage = path.name[:2]
    if stage not in _selected_stages(request.config):
        pytest.skip(f"stage {stage} is not selected")
    if request.config.getoption("--stage-path"):
        pytest.skip("notebooks run the repository's stages, not the one at --stage-path")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:  # the failing cell's source and traceback, uncoloured
        pytest.fail(f"{path.name}: a cell failed\n{_ANSI.sub('', str(exc))}", pytrace=False)
