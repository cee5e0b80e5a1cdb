"""The walkthrough notebooks: every stage has one, each .ipynb matches its source, and each
source runs top to bottom.

`notebooks/NN_name.py` (jupytext's percent format) is the source of `notebooks/NN_name.ipynb`;
`python tools/sync_notebooks.py` rewrites the .ipynb from it. A notebook runs in a fresh IPython
shell in a child forked from a runner that imported torch, transformers and IPython once
(`tests/notebook_runner.py`): a kernel's cell semantics without a kernel's start, 3 s less a
notebook. Running a notebook is a per-stage fixed cost (the real model): by default the newest
stage's runs, and those of the stages whose files or notebook changed since the last commit
(conftest's `fixed_cost_stages`); ``--full-matrix`` (`make test-notebooks`) runs every one,
``pytest --stage 02`` only 02's. It runs what the .py says, with the repository root as its
working directory; no file is written.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import stages

from .conftest import _selected_stages, fixed_cost_stages
from .notebook_runner import NotebookRunner

# The notebook tools come with `make` (the dev extras); where they are absent (a bare GPU
# machine, a student's own environment) these tests are skipped, not a collection error that
# stops every other test file.
_WHY = "the notebook tools are not installed: pip install -e '.[dev]' (make does this)"
jupytext = pytest.importorskip("jupytext", reason=_WHY)
pytest.importorskip("IPython", reason=_WHY)

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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`notebook`: the sources of the stages `fixed_cost_stages` picks (none for --stage-path:
    notebooks run the repository's stages, not a copy elsewhere)."""
    if "notebook" not in metafunc.fixturenames:
        return
    config = metafunc.config
    selected = [] if config.getoption("--stage-path") else _selected_stages(config)
    chosen = set(fixed_cost_stages(config, selected))
    sources = [p for p in SOURCES if p.name[:2] in chosen]
    metafunc.parametrize("notebook", sources, ids=[p.stem for p in sources])


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotebookRunner]:
    """One runner per worker: the heavy imports once, each notebook in a fresh forked child."""
    started = NotebookRunner(ROOT, tmp_path_factory.mktemp("notebooks"))
    try:
        yield started
    finally:
        started.close()


@pytest.mark.slow
def test_notebook_runs(notebook: Path, runner: NotebookRunner) -> None:
    outcome, output = runner.run(notebook, timeout=300)
    if not outcome["ok"]:  # the failing cell's source, its traceback and the notebook's output
        where = "" if outcome["cell"] is None else f" in cell {outcome['cell']}"
        pytest.fail(
            f"{notebook.name}: failed{where}\n{outcome['source']}\n----\n"
            f"{_ANSI.sub('', outcome['error'])}\n---- output (last 3,000 characters):\n"
            f"{_ANSI.sub('', output[-3000:])}",
            pytrace=False,
        )


def test_a_failing_cell_is_reported_with_its_source_and_traceback(
    runner: NotebookRunner, tmp_path: Path
) -> None:
    source = tmp_path / "broken.py"
    source.write_text("# %%\nvalue = 41\n\n# %%\nraise ValueError(f'bad {value + 1}')\n")
    outcome, _output = runner.run(source, timeout=60)
    assert not outcome["ok"] and outcome["cell"] == 1, outcome
    assert "raise ValueError" in outcome["source"] and "ValueError: bad 42" in outcome["error"]


def test_a_notebook_past_its_time_is_killed_with_what_it_started(
    runner: NotebookRunner, tmp_path: Path
) -> None:
    """A hung notebook fails its test after `timeout`, and the processes it started go with
    it (they share its process group); the runner then takes the next notebook."""
    source = tmp_path / "hangs.py"
    source.write_text(
        "# %%\nimport subprocess, time\nchild = subprocess.Popen(['sleep', '600'])\n"
        "print(child.pid, flush=True)\ntime.sleep(600)\n"
    )
    outcome, output = runner.run(source, timeout=3)
    assert not outcome["ok"] and "timed out" in outcome["error"], outcome
    pid = int(output.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), f"the notebook's child {pid} outlived it"
    fine = tmp_path / "fine.py"
    fine.write_text("# %%\nassert 1 + 1 == 2\n")
    again, _ = runner.run(fine, timeout=60)
    assert again["ok"], again


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
