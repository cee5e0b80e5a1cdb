"""Stages 08-15 are laid out by technique: the spine flat, each technique in a folder of its own.

A reader who lists a stage folder sees the course's table of contents; each README from 08 on
carries a module map generated from the code (tools/module_map.py), so the map cannot drift
from what the folder holds.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

import stages
from stages.lesson import _spans

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGES = {"diagrams", "__pycache__"}


def _tool():
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "tools/module_map.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


LAID_OUT = [info for info in stages.list_stages() if int(info.number) >= 8]


@pytest.mark.parametrize("info", LAID_OUT, ids=lambda info: info.number)
def test_every_folder_is_a_technique_the_course_names_and_says_what_it_is(info):
    tool = _tool()
    for folder in sorted(p for p in info.path.iterdir() if p.is_dir()):
        if folder.name in NOT_PACKAGES:
            continue
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder} is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing"
        assert folder.name in tool.FOLDER_ORDER, f"{folder.name}/ is not in the course's order"


def test_each_readme_from_08_has_the_module_map_of_its_code():
    assert _tool().main(["--check"]) == 0, "run: python tools/module_map.py"


def test_a_stale_map_is_found_and_rewritten():
    tool = _tool()
    readme = (stages.stage_info("15").path / "README.md").read_text()
    stale = readme.replace("| `cpu_paths.py` |", "| `quant_cpu_paths.py` |", 1)
    assert stale != readme and tool.with_map(stale, "15") == readme
    bare = readme.split(tool.BEGIN)[0].rsplit("## Module map", 1)[0] + "## The code\n"
    assert tool.BEGIN in tool.with_map(bare, "15")  # a README without a map gets one


def _imports_tooling(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if any(name.startswith("stages.common.tooling") for name in names):
            return True
    return False


def test_no_engine_module_imports_the_tooling(tmp_path):
    """stages/common/tooling drives and measures the engine; the engine never needs it: only
    a stage's bench.py (and its harness/) may import it."""
    offenders = [
        path.relative_to(ROOT).as_posix()
        for info in stages.list_stages()
        for path in info.path.rglob("*.py")
        if path.name != "bench.py" and "harness" not in path.parts and _imports_tooling(path)
    ]
    engine_common = [p for p in (ROOT / "stages/common").glob("*.py") if _imports_tooling(p)]
    assert offenders == [] and engine_common == [], (offenders, engine_common)
    planted = tmp_path / "planted.py"
    planted.write_text("from stages.common.tooling.latency import summarize\n")
    assert _imports_tooling(planted)


TABLES_KEPT = {"observability/metrics.py": {"TTFT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS"}}
# Written in stage 03 under the spine's convention (a kernel's arguments grouped by meaning) and
# moved into stage 15 by issue 58: the fused kernels and the split-K decode attention.
MOVED_FROM_THE_SPINE = {
    "fused_kernels.py": None,  # the whole module
    "kernels.py": {
        "_attend_chunk", "_split_decode_kernel", "_merge_splits_kernel",
        "decode_attention_split_triton", "_rope_cache_decode_kernel",
        "decode_attention_rope_cache_triton",
    },
    "model.py": {"Attention.forward"},
}  # fmt: skip


def _moved_from_the_spine(path: Path, name: str, line: int) -> bool:
    """Whether `line` of stage 15's `name` lies in code issue 58 moved there from stage 03."""
    if name not in MOVED_FROM_THE_SPINE:
        return False
    definitions = MOVED_FROM_THE_SPINE[name]
    return definitions is None or any(
        qualname in definitions and first <= line <= last
        for qualname, first, last in _spans(path.read_text())
    )


@pytest.mark.parametrize("info", LAID_OUT, ids=lambda info: info.number)
def test_code_is_formatted_as_it_comes_not_packed_to_fit_a_count(info):
    """From 08 on, `# fmt: skip` is kept only where stages 01-07 already have the line, for
    tables of numbers (`TABLES_KEPT`) and in the code moved from the spine into stage 15
    (`MOVED_FROM_THE_SPINE`): packing statements onto fewer lines to meet a line count
    is what issue 39 unpacked."""
    spine = stages.stage_info("07").path
    packed = []
    for path in sorted(info.path.rglob("*.py")):
        name = path.relative_to(info.path).as_posix()
        before = set((spine / name).read_text().splitlines()) if (spine / name).is_file() else set()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "# fmt: skip" not in line or line in before:
                continue
            if info.number == "15" and _moved_from_the_spine(path, name, number):
                continue
            statement = _statement_at(path, number)
            if statement not in TABLES_KEPT.get(name, set()):
                packed.append(f"{name}:{number}")
    assert not packed, f"stage {info.number}: `# fmt: skip` packs code at {packed}"


def _statement_at(path: Path, line: int) -> str:
    """The name a top-level assignment ending at `line` binds ('' for any other statement)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.end_lineno == line:
            target = node.targets[0]
            return target.id if isinstance(target, ast.Name) else ""
    return ""
