"""The "Follow one request" sections of stages 09-15 and their diagrams (tools/request_diagrams.py).

Repository checks, fast (no stage is imported): every checked-in SVG is what its spec renders,
every stage from 09 has the section, the section links each of the stage's diagrams, and every
module it names exists in the stage. The last tests show that the checks can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools/request_diagrams.py"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    if not TOOL.exists():
        pytest.skip("tools/request_diagrams.py is not here (a student repository has no tools/)")
    spec = importlib.util.spec_from_file_location("request_diagrams", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_checked_in_diagrams_match_their_specs(tool: ModuleType) -> None:
    assert tool.drift() == []


def test_every_stage_from_09_follows_one_request_through_its_diagrams(tool: ModuleType) -> None:
    assert tool.readme_problems() == []
    assert {f.name for f in tool.stage_folders()} >= {"09_tp", "13_disagg", "15_full"}


def test_stage_15_has_one_diagram_per_preset(tool: ModuleType) -> None:
    presets = (ROOT / "stages/15_full/presets.py").read_text()
    names = {d.name.replace("_", "-") for d in tool.stage_diagrams("15_full")}
    for preset in ("chatbot", "api", "long-context", "moe"):
        assert f'"{preset}": Preset(' in presets
        assert preset in names


def test_a_diagram_is_small_svg(tool: ModuleType) -> None:
    for diagram in tool.DIAGRAMS:
        text = tool.render(diagram)
        assert text.startswith("<svg ") and text.rstrip().endswith("</svg>")
        assert len(text.encode()) < 8_000, diagram.name


def test_the_checks_can_fail(tool: ModuleType) -> None:
    diagram = tool.DIAGRAMS[0]
    changed = tool.Diagram(
        diagram.stage, diagram.name, "another title", diagram.boxes, diagram.steps
    )
    assert tool.render(changed) != diagram.path.read_text()
    readme = "# Stage\n\n## Follow one request\n\n![tp](diagrams/tp.svg) `engine.py`\n\n## Next\n"
    assert "diagrams/tp.svg" in tool.section(readme)
    assert "## Next" not in tool.section(readme)
    assert tool.section("# Stage\n\n## The code\n") is None
    too_long = ("srv", "srv", "a note far too long to fit inside one lane of the diagram", "")
    with pytest.raises(ValueError, match="too long"):
        tool.render(tool.Diagram("09_tp", "x", "t", diagram.boxes, (too_long,)))
