"""The mutation check of the assignments (tools/mutation_check.py): a known wrong implementation
of a task, patched into the stage's solution copy, fails that task's grade.

Every mutation still applies (its snippet is found once in its task's function, and the task is
in today's manifest): a cheap repository check on every stage. Grading a mutated copy runs
pytest sessions, a per-stage fixed cost: the mutations marked `in_suite` (caught by fast tests)
run on the newest stage and on the stages whose files changed (conftest's `fixed_cost_stages`),
on every stage with --full-matrix. The whole check is `python tools/mutation_check.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import stages
from stages import assign as assignments

from .conftest import fixed_cost_stages

ROOT = Path(__file__).resolve().parents[1]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_check", ROOT / "tools/mutation_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_check", module)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`number` is each stage (those given with --stage) that has mutations; none with
    --stage-path: the check is of the repository's assignments, not of a student's copy."""
    if "number" not in metafunc.fixturenames:
        return
    wanted = {f"{int(s):02d}" for s in metafunc.config.getoption("--stage")}
    chosen = [
        info.number
        for info in stages.list_stages()
        if not metafunc.config.getoption("--stage-path")
        and (not wanted or info.number in wanted)
        and any(m.stage == info.number for m in tool.MUTATIONS)
    ]
    if "tmp_path" in metafunc.fixturenames:  # grading runs pytest sessions: a fixed cost
        kept = set(fixed_cost_stages(metafunc.config, chosen))
        chosen = [n for n in chosen if n in kept]
        chosen = [n for n in chosen if any(m.in_suite for m in _of(n))]
    metafunc.parametrize("number", chosen, ids=[f"s{n}" for n in chosen])


def _of(number: str) -> list:
    return [m for m in tool.MUTATIONS if m.stage == number]


def test_every_mutation_applies_to_its_task(number: str, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp(f"mut-{number}")
    copy = assignments.assign(number, root, solution=True, force=True)  # one copy per stage
    for mutation in _of(number):
        assert mutation.task >= 1  # the function is a task of today's manifest
        path = copy / mutation.function.partition("::")[0]
        original = path.read_text()
        tool.apply(mutation, copy)  # raises unless the snippet is in it exactly once
        compile(path.read_text(), "mutated", "exec")
        path.write_text(original)  # the next mutation starts from the solution again


def test_in_suite_mutations_fail_their_task(number: str, tmp_path: Path) -> None:
    chosen = [m for m in _of(number) if m.in_suite]
    outcomes = tool.check(chosen, tmp_path, timeout=60)
    missed = [f"{o.mutation.label} -> {o.status}: {'; '.join(o.detail)}" for o in outcomes]
    assert all(o.caught for o in outcomes), "wrong code passes its task:\n" + "\n".join(missed)
    table = tool.markdown(chosen, outcomes)  # the table docs/assignments.md holds
    assert f"{len(chosen)} wrong implementations, {len(chosen)} fail their task" in table
    for outcome in outcomes:
        assert f"| {outcome.mutation.task} | `{outcome.mutation.function}` |" in table
        assert all(f"`{t.partition('::')[2]}`" in table for t in outcome.failed_by)
