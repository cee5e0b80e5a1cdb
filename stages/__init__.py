"""The staged inference engine: one folder per stage, each a complete engine.

Stage folders start with digits (`01_naive`), which Python cannot import by name, so this module
loads them through importlib: ``stages.load("04")`` returns the stage-04 package. Inside a stage,
modules import each other relatively, so the same folder also loads from elsewhere on disk
(``load_from_path``), which is how the test suite grades a student's copy of a stage.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

STAGES_DIR = Path(__file__).resolve().parent
_FOLDER = re.compile(r"^(\d\d)_([a-z0-9_]+)$")


@dataclass(frozen=True, slots=True)
class StageInfo:
    """A stage folder: its two-digit number, its name and where it lives."""

    number: str
    name: str
    path: Path

    @property
    def folder(self) -> str:
        return f"{self.number}_{self.name}"


def list_stages() -> list[StageInfo]:
    """Every stage folder in this repository, in order."""
    found = []
    for child in sorted(STAGES_DIR.iterdir()):
        match = _FOLDER.match(child.name)
        if match and (child / "__init__.py").exists():
            found.append(StageInfo(match.group(1), match.group(2), child))
    return found


def stage_info(key: str | int) -> StageInfo:
    """Find a stage by number ("4", "04", 4) or by folder name ("04_batching")."""
    text = str(key)
    number = f"{int(text):02d}" if text.isdigit() else text.split("_", 1)[0]
    for info in list_stages():
        if info.number == number or info.folder == text:
            return info
    known = ", ".join(i.folder for i in list_stages())
    raise ValueError(f"unknown stage {key!r}; known stages: {known}")


def load(key: str | int, module: str | None = None) -> ModuleType:
    """Import a stage package by number, e.g. ``load("01")``, or one of its modules by its
    dotted name inside the stage, e.g. ``load("13", "harness.fake_transport")``: stage folders
    start with digits, so ``import stages.13_disagg...`` is not Python."""
    info = stage_info(key)
    package = importlib.import_module(f"stages.{info.folder}")
    return importlib.import_module(f"{package.__name__}.{module}") if module else package


def load_from_path(path: str | Path, *, alias: str | None = None) -> ModuleType:
    """Import a stage package from any folder (a student's copy, say).

    The package is registered under ``stages._external.<alias>`` so that its relative imports
    resolve to its own files, never to the repository's copy of the same stage.
    """
    folder = Path(path).resolve()
    if not (folder / "__init__.py").exists():
        raise ValueError(f"{folder} is not a stage package (no __init__.py)")
    name = f"stages._external.{alias or re.sub(r'[^0-9a-zA-Z_]', '_', folder.name)}"
    if name in sys.modules:
        return sys.modules[name]
    parent = "stages._external"
    if parent not in sys.modules:
        sys.modules[parent] = ModuleType(parent)
        sys.modules[parent].__path__ = []  # a namespace-like parent for the loaded stages
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_stage(name: str, folder: str | Path) -> ModuleType:
    """The stage package `name` in another process: a repository stage imports by its name
    (``stages.12_offload``); a copy loaded from a path (``stages._external.<alias>``) exists only
    in the process that loaded it, so it is loaded again from `folder` under the same alias.
    Spawned workers, replicas and cores call this before they unpickle anything of the stage."""
    if name in sys.modules:
        return sys.modules[name]
    parent, _, alias = name.rpartition(".")
    if parent == "stages._external":
        return load_from_path(folder, alias=alias)
    return importlib.import_module(name)


__all__ = [
    "STAGES_DIR",
    "StageInfo",
    "import_stage",
    "list_stages",
    "load",
    "load_from_path",
    "stage_info",
]
