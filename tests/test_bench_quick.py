"""Every stage's benchmark runs end to end in its quick form and writes well-formed evidence.

Timings are never asserted here (they belong in the committed plots); what is checked is that
the benchmark runs, writes its JSON and PNG with the hardware metadata, and reports a summary.
"""

from __future__ import annotations

import importlib
import json

import pytest

from .conftest import since

pytestmark = [since("01"), pytest.mark.slow, pytest.mark.fixed_cost]

REQUIRED_KEYS = {
    "summary",
    "stage",
    "command",
    "model",
    "dtype",
    "device",
    "machine",
    "hardware",
    "versions",
    "date",
    "workload",
    "results",
}


def test_quick_bench_writes_plot_and_json(stage, tmp_path, real_model):
    bench = importlib.import_module(f"{stage.__name__}.bench")
    record = bench.run(quick=True, out_dir=tmp_path)
    name = bench.NAME
    on_disk = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert set(on_disk) >= REQUIRED_KEYS
    assert next(iter(on_disk)) == "summary"
    assert on_disk["summary"] and all(v is not None for v in on_disk["summary"].values())
    assert on_disk["quick"] is True and record["stage"] == name
    assert name.startswith(stage.STAGE)
