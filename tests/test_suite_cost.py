"""tools/suite_cost.py: a run's JUnit report, summed per stage and per test file."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5" time="9.5">
<testcase classname="tests.test_03_paged" name="test_a[s03]" time="1.5"/>
<testcase classname="tests.test_03_paged" name="test_a[s15-int8]" time="2.0"/>
<testcase classname="tests.test_14_quant" name="test_b[s15]" time="3.0">
<failure message="x"/></testcase>
<testcase classname="tests.test_14_quant" name="test_c[s14]" time="0.5"><skipped/></testcase>
<testcase classname="tests.test_snapshots" name="test_guard" time="2.5"/>
</testsuite></testsuites>
"""


def _tool():
    spec = importlib.util.spec_from_file_location("suite_cost", ROOT / "tools/suite_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_costs_add_up_per_stage_and_per_file(tmp_path, capsys):
    tool = _tool()
    plain, packed = tmp_path / "a.xml", tmp_path / "b.xml.gz"
    plain.write_text(REPORT)
    packed.write_bytes(gzip.compress(REPORT.encode()))
    cost = tool.read_report(plain)
    assert {s: (c.tests, c.seconds) for s, c in cost.by_stage.items()} == {
        "03": (1, 1.5), "15": (2, 5.0), "14": (1, 0.5), tool.NO_STAGE: (1, 2.5),
    }  # fmt: skip
    assert cost.by_file["test_14_quant"].failed == 1 and cost.total.skipped == 1
    assert cost.total.seconds == 9.5 and cost.wall_seconds == 9.5
    assert tool.main([str(plain), str(packed), "--files", "2"]) == 0
    out = capsys.readouterr()
    assert "| 15 | 2 | 5 | 2 | 5 |" in out.out and "a: 1 failed" in out.err
    assert tool.main([str(tmp_path / "missing.xml")]) == 2
