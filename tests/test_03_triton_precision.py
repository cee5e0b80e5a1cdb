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


def _kernel_launches(path: Path) -> list[tuple[ast.Call, bool]]:
    """Each Triton launch `kernel[grid](...)` in a file, and whether an enclosing `with`
    statement calls `on_device(...)`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call)
            and ast.unparse(item.context_expr.func) == "on_device"
            for item in node.items
        ):
            guarded |= {id(inner) for inner in ast.walk(node)}
    return [
        (node, id(node) in guarded)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
        and ast.unparse(node.func.value).startswith("_")  # `_name_kernel[grid](...)`
    ]  # fmt: skip


def test_the_launch_guard_finds_an_unguarded_launch(tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text(
        "_k[grid](x)\nwith on_device(x.device):\n    _k[grid](x)\nwith other():\n    _k[(1,)](x)\n"
    )
    assert [ok for _, ok in _kernel_launches(source)] == [False, True, False]


def test_every_triton_launch_runs_on_its_tensors_device(stage):
    """Triton launches on the current CUDA device, not on its arguments' (a PyTorch op guards
    itself): every launch sits in `with on_device(...)` (stages/common/devices.py), or an
    engine on cuda:1 would run its kernels on cuda:0."""
    folder = _stage_folder(stage)
    found = [
        (f"{path.name}:{call.lineno}", ok)
        for path in sorted(folder.glob("*.py"))
        for call, ok in _kernel_launches(path)
    ]
    assert found, f"no Triton launch found in {folder}: the guard would pass vacuously"
    assert all(ok for _, ok in found), f"launches outside on_device(...): {found}"


def test_on_device_makes_a_gpu_current_and_leaves_a_cpu_alone():
    import contextlib

    import torch

    from stages.common.devices import on_device

    assert isinstance(on_device(torch.device("cpu")), contextlib.nullcontext)
    guard = on_device(torch.device("cuda", 1))  # built, not entered: no GPU needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
