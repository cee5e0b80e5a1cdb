"""Every Triton matrix product names its precision.

On Ampere and later GPUs `tl.dot` of two fp32 tiles runs in TF32 unless told otherwise: a
10-bit mantissa, errors near 1e-3, and tests that compare with 1e-5 fail on the first GPU run.
TRITON_INTERPRET=1 computes in numpy's fp32, so no CPU test of a kernel's values can see it.
This guard reads the source instead: each `tl.dot` in a stage must pass `input_precision`
("ieee" for fp32 tiles, as the attention kernel does since stage 03).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import since

pytestmark = since("03")


def _dot_calls(path: Path) -> list[ast.Call]:
    """The calls `tl.dot(...)` (or `triton.language.dot(...)`) in one source file."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr == "dot" and owner in ("tl", "triton.language"):
                calls.append(node)
    return calls


def _stage_folder(stage: ModuleType) -> Path:
    return Path(stage.__file__).parent


def test_the_guard_finds_a_dot_without_precision(tmp_path):
    """The check itself can fail: a bare `tl.dot` is found and reported."""
    source = tmp_path / "kernel.py"
    source.write_text("acc += tl.dot(x, w)\nacc += tl.dot(x, w, input_precision='ieee')\n")
    calls = _dot_calls(source)
    assert len(calls) == 2
    assert [any(k.arg == "input_precision" for k in c.keywords) for c in calls] == [False, True]


def test_every_tl_dot_passes_input_precision(stage):
    folder = _stage_folder(stage)
    bare, seen = [], 0
    for path in sorted(folder.glob("*.py")):
        for call in _dot_calls(path):
            seen += 1
            if not any(k.arg == "input_precision" for k in call.keywords):
                bare.append(f"{path.name}:{call.lineno}: {ast.unparse(call)}")
    if not seen:
        pytest.fail(f"no tl.dot found in {folder}: the guard would pass vacuously")
    assert not bare, "tl.dot without input_precision (TF32 on Ampere+):\n" + "\n".join(bare)


def test_fp32_dots_ask_for_ieee(stage):
    """Where the precision is a literal it is "ieee": "tf32" would be the defect spelled out."""
    for path in sorted(_stage_folder(stage).glob("*.py")):
        for call in _dot_calls(path):
            for keyword in call.keywords:
                if keyword.arg == "input_precision" and isinstance(keyword.value, ast.Constant):
                    assert keyword.value.value == "ieee", f"{path.name}:{call.lineno}"
