"""The shape of each stage's imports: no circle, and the engine never reaches its harness.

A circle of imports (a imports b, b imports a) means neither module can be read, tested or
replaced alone, and it works only while one side imports lazily or for types only. Every import
counts here, `if TYPE_CHECKING:` and function-local ones too: they are dependencies a reader
follows all the same. Harnesses (simulations, fake transports, test peers) live in a stage's
`harness/` sub-package; the engine's modules never import it, so no configuration of the engine
reaches them. A stage without a `harness/` passes that check trivially.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stages
from stages.lesson import find_function

HARNESS = "harness"


def module_name(folder: Path, path: Path) -> str:
    """`a/b.py` -> "a.b", `a/__init__.py` -> "a", inside the stage `folder`."""
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage_imports(folder: Path) -> dict[str, set[str]]:
    """Every module of the stage (sub-packages included) -> the stage's modules it imports
    (relative imports, and absolute ones that name the stage's package path)."""
    paths = {module_name(folder, p): p for p in folder.rglob("*.py")}
    prefix = f"stages.{folder.name}."
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) + 1 - node.level]  # up `level - 1` packages
                stem = [*base, *(node.module.split(".") if node.module else [])]
                targets.add(".".join(stem))
                targets.update(".".join([*stem, alias.name]) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                stem = node.module.removeprefix(prefix).split(".")  # type: ignore[union-attr]
                targets.add(".".join(stem))
                targets.update(".".join([*stem, alias.name]) for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(
                    a.name.removeprefix(prefix) for a in node.names if a.name.startswith(prefix)
                )
        graph[name] = {t for t in targets if t in paths and t != name and t}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def harness_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(engine module, harness module) for every import of the harness from outside it.
    `bench.py` is a harness too (a stage's measurement, run by `python -m stages NN bench`):
    it may use the others."""

    def in_harness(name: str) -> bool:
        return name in (HARNESS, "bench") or name.startswith(HARNESS + ".")

    return sorted(
        (name, target)
        for name, targets in graph.items()
        if not in_harness(name)
        for target in targets
        if in_harness(target)
    )


@pytest.mark.parametrize("info", stages.list_stages(), ids=lambda info: info.folder)
def test_no_circle_of_imports_among_a_stages_modules(info):
    problems = circles(stage_imports(info.path))
    assert not problems, f"{info.folder}: import circles {problems}"


@pytest.mark.parametrize("info", stages.list_stages(), ids=lambda info: info.folder)
def test_no_engine_module_imports_the_harness(info):
    problems = harness_imports(stage_imports(info.path))
    assert not problems, f"{info.folder}: engine modules importing the harness {problems}"


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_the_checks_find_a_planted_circle_and_a_harness_import(tmp_path):
    """The checks can fail: a circle through a TYPE_CHECKING import and a function-local one,
    and an engine module importing the harness (the harness importing the engine is fine)."""
    folder = _write(
        tmp_path / "99_fake",
        {
            "__init__.py": "from .engine import Engine\n",
            "engine.py": "from . import scheduler\nfrom .harness.fake import Fake\n",
            "scheduler.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .connector import Meta\n",
            "connector.py": "def f():\n    from .scheduler import Output\n",
            "harness/__init__.py": "",
            "harness/fake.py": "from ..engine import Engine\nfrom .. import scheduler\n",
        },
    )
    graph = stage_imports(folder)
    assert graph["harness.fake"] == {"engine", "scheduler"}
    assert circles(graph) == [["connector", "scheduler"], ["engine", "harness.fake"]]
    assert harness_imports(graph) == [("engine", "harness.fake")]
    assert circles({"a": {"b"}, "b": set()}) == [] and harness_imports({"a": {"b"}}) == []


# Issue 58: each lesson teaches its own technique. Fusing the decode step's elementwise kernels
# and splitting its attention over the context are stage 15's (beside CUDA graphs); stages
# 03-14 keep one plain paged attention and the model's unfused norm, activation and RoPE.
DECODE_STEP_KERNELS = {
    "kernels.py": ("decode_splits", "decode_attention_split_triton",
                   "decode_attention_rope_cache_triton"),
    "model.py": ("final_norm",),
    "fused_kernels.py": ("add_rms_norm", "silu_mul", "rope_and_cache"),
}  # fmt: skip


@pytest.mark.parametrize("info", stages.list_stages(), ids=lambda info: info.folder)
def test_fused_kernels_and_split_decode_attention_are_stage_15s_lesson(info):
    if info.number < "03":
        return
    found = {
        f"{module}::{name}"
        for module, names in DECODE_STEP_KERNELS.items()
        for name in names
        if find_function(info.path / module, name) is not None
    }
    expected = {f"{m}::{n}" for m, names in DECODE_STEP_KERNELS.items() for n in names}
    if info.number == "15":
        assert found == expected, f"{info.folder}: missing {sorted(expected - found)}"
    else:
        assert not (info.path / "fused_kernels.py").exists(), f"{info.folder}: fused_kernels.py"
        assert not found, f"{info.folder}: stage 15's decode-step kernels {sorted(found)}"
        model = (info.path / "model.py").read_text()
        assert "fused_kernels" not in model and "max_seq_len" not in model, info.folder
