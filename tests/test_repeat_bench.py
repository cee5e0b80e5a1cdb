"""tools/repeat_bench.py: a headline from several runs is their median, with the range."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    if not (ROOT / "tools/repeat_bench.py").exists():
        pytest.skip("tools/repeat_bench.py is not here (a student repository has no tools/)")
    spec = importlib.util.spec_from_file_location("repeat_bench", ROOT / "tools/repeat_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_number_is_the_median_of_its_runs_with_the_range():
    tool = _tool()
    runs = [
        {"speedup": 1.10, "tokens": 48, "refused": True, "label": "a"},
        {"speedup": 1.30, "tokens": 40, "refused": True, "label": "b"},
        {"speedup": 1.05, "tokens": 52, "refused": True, "label": "a"},
    ]
    result = tool.aggregate(runs)
    assert result["speedup"] == {"median": 1.10, "min": 1.05, "max": 1.30, "runs": [1.1, 1.3, 1.05]}
    assert result["tokens"]["median"] == 48 and result["tokens"]["max"] == 52
    assert result["refused"] == {"value": True, "runs": [True] * 3}  # agreed: kept
    assert "label" not in result  # runs disagree on a non-number: no headline
    assert tool.median_run(runs, "speedup") == 0  # 1.10 is the middle of 1.05, 1.10, 1.30
    assert tool.median_run(runs[:2], "speedup") == 0  # even count: the lower middle


def test_fewer_than_one_run_is_refused():
    with pytest.raises(SystemExit):
        _tool().main(["12", "--runs", "0"])
