"""The snapshot guard: each stage folder is the previous one plus what its lesson.toml lists.

Repository checks, not per-stage behaviour: nothing here takes the `stage` fixture or imports a
stage package (the manifests and sources are read and parsed, never run), so the guard is fast
and still speaks when an engine is broken. The second half tests the guard itself on fake stage
folders, so that it is known to be able to fail.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import stages
from stages.lesson import (
    Lesson,
    find_function,
    load_lesson,
    snapshot_violations,
    task_problems,
    unchanged_modules,
)

from .conftest import changed_stages

ROOT = Path(__file__).resolve().parents[1]
STAGES = stages.list_stages()
# Text a byte-identical copy cannot keep true: "this stage" means the stage that wrote it.
_THIS_STAGE = re.compile(r"\bthis\s+stage\b", re.IGNORECASE)
HOW_TO_FIX = (
    "Either list the module in the stage's lesson.toml (`changes`, or `removed`), or carry the "
    "change from the earlier stage with `python tools/carry_forward.py NN module.py` so the "
    "copies stay byte-identical."
)


@pytest.fixture
def repository(request: pytest.FixtureRequest) -> None:
    """Skip when grading a student's copy (--stage-path): it is checked against its manifest,
    not as part of this repository's chain."""
    if request.config.getoption("--stage-path"):
        pytest.skip("repository snapshot checks do not apply to --stage-path")


def node_id_problems(node_id: str, root: Path = ROOT) -> list[str]:
    """What is wrong with a task's test node id ("tests/test_x.py::test_y"), if anything."""
    if "[" in node_id:
        return [f"{node_id}: give the node id without the [param] suffix"]
    file, sep, name = node_id.partition("::")
    path = root / file
    if not sep or not name or not path.is_file():
        return [f"{node_id}: no test file {file}" if sep else f"{node_id}: not file::test"]
    if find_function(path, name.replace("::", ".")) is None:
        return [f"{node_id}: {file} has no test {name}"]
    return []


# ------------------------------------------------------------------------- the repository's stages
def each_repository_stage(test: Callable[..., None]) -> Callable[..., None]:
    """Run `test` once per stage folder of the repository (not per `stage` fixture)."""
    ids = [info.folder for info in STAGES]
    parametrized = pytest.mark.parametrize("info", STAGES, ids=ids)(test)
    return pytest.mark.usefixtures("repository")(parametrized)


@each_repository_stage
def test_manifest_loads_and_names_its_stage(info: stages.StageInfo) -> None:
    lesson = load_lesson(info.number)
    assert (lesson.stage, lesson.name, lesson.path) == (info.number, info.name, info.path)
    assert lesson.changes, "a stage that changes nothing teaches nothing"
    if info is STAGES[0]:
        assert lesson.previous is None
    else:
        assert lesson.previous == STAGES[STAGES.index(info) - 1]


@each_repository_stage
def test_unlisted_modules_are_byte_identical_to_the_previous_stage(info: stages.StageInfo) -> None:
    violations = snapshot_violations(load_lesson(info.number))
    assert not violations, "\n".join(["", *violations, HOW_TO_FIX])


def stale_stage_references(lesson: Lesson) -> list[str]:
    """Lines saying "this stage" in a module the stage copies unchanged from the one before:
    the copy says it about the stage that wrote it, which is not this one (say "stage NN")."""
    found = []
    for name in unchanged_modules(lesson):
        if not name.endswith(".py") or not (lesson.path / name).is_file():
            continue  # a missing module is the snapshot guard's to report
        for number, line in enumerate((lesson.path / name).read_text().splitlines(), 1):
            if _THIS_STAGE.search(line):
                found.append(f"{lesson.path.name}/{name}:{number}: {line.strip()}")
    return found


@each_repository_stage
def test_copied_modules_do_not_say_this_stage(info: stages.StageInfo) -> None:
    stale = stale_stage_references(load_lesson(info.number))
    assert not stale, "\n".join(
        ["", *stale, "A module copied unchanged from the previous stage says 'stage NN' instead."]
    )


@each_repository_stage
def test_task_functions_exist_with_a_docstring(info: stages.StageInfo) -> None:
    lesson = load_lesson(info.number)
    problems = task_problems(lesson)
    assert not problems, "\n".join(["", *problems])


@each_repository_stage
def test_task_tests_name_existing_test_functions(info: stages.StageInfo) -> None:
    lesson = load_lesson(info.number)
    problems = [p for task in lesson.tasks for t in task.tests for p in node_id_problems(t)]
    assert not problems, "\n".join(["", *problems])


@pytest.mark.usefixtures("repository")
def test_diff_shows_the_listed_modules_only_unless_all(capsys: pytest.CaptureFixture) -> None:
    from stages.cli import main

    if len(STAGES) < 2:
        pytest.skip("needs two stages")
    first, last = STAGES[-2:]
    assert main(["diff", first.number, last.number]) == 0
    shown = {
        line.split("/", 1)[1].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("+++ ")
    }
    assert shown <= set(load_lesson(last.number).changes) - {"bench.py"}
    assert main(["diff", first.number, last.number, "--all"]) == 0
    assert f"+++ {last.folder}/README.md" in capsys.readouterr().out


# ------------------------------------------------------------------------ the guard, on fake stages
def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))


BASE = {
    "__init__.py": "",
    "model.py": '''\
        class Model:
            def forward(self):
                """Run the model."""
                return 1
        ''',
    "engine.py": "ENGINE = 1\n",
}


def _manifest(stage: str, name: str, changes: list[str], extra: str = "") -> str:
    return (
        f'stage = "{stage}"\nname = "{name}"\ntitle = "T"\ntechnique = "t"\n'
        f"changes = {json.dumps(changes)}\n{extra}"
    )


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    """Two fake stages: 02 changes model.py (listed) and keeps engine.py and __init__.py."""
    _write(tmp_path / "01_alpha", BASE | {"lesson.toml": _manifest("01", "alpha", sorted(BASE))})
    task = '[[task]]\nfunction = "model.py::Model.forward"\nsummary = "s"\n'
    model = BASE["model.py"].replace("return 1", "return 2")
    _write(
        tmp_path / "02_beta",
        BASE | {"model.py": model, "lesson.toml": _manifest("02", "beta", ["model.py"], task)},
    )
    return tmp_path


def _violations(root: Path, folder: str = "02_beta") -> list[str]:
    return snapshot_violations(load_lesson(root / folder, stages_dir=root))


def test_guard_accepts_a_faithful_snapshot(fake: Path) -> None:
    lesson = load_lesson(fake / "02_beta", stages_dir=fake)
    assert lesson.previous is not None and lesson.previous.folder == "01_alpha"
    assert unchanged_modules(lesson) == ["__init__.py", "engine.py"]
    assert _violations(fake) == [] and _violations(fake, "01_alpha") == []
    assert task_problems(lesson) == []
    assert (lesson.tasks[0].file, lesson.tasks[0].qualname) == ("model.py", "Model.forward")


def test_guard_reports_an_unlisted_changed_module(fake: Path) -> None:
    (fake / "02_beta" / "engine.py").write_text("ENGINE = 2\n")
    assert any("engine.py differs" in v for v in _violations(fake))


def test_this_stage_is_reported_only_in_copied_modules(fake: Path) -> None:
    for stage in ("01_alpha", "02_beta"):
        model = fake / stage / "model.py"
        model.write_text(model.read_text() + "# the model of this stage\n")
    lesson = load_lesson(fake / "02_beta", stages_dir=fake)
    assert stale_stage_references(lesson) == []  # model.py is listed: its text is its own
    (fake / "01_alpha" / "engine.py").write_text("ENGINE = 1  # This\n# stage's engine\n")
    (fake / "02_beta" / "engine.py").write_text("ENGINE = 1  # This\n# stage's engine\n")
    assert stale_stage_references(lesson) == []  # one line at a time: a split phrase is rare
    (fake / "01_alpha" / "engine.py").write_text("ENGINE = 1  # in This Stage\n")
    (fake / "02_beta" / "engine.py").write_text("ENGINE = 1  # in This Stage\n")
    assert stale_stage_references(lesson) == ["02_beta/engine.py:1: ENGINE = 1  # in This Stage"]


def test_guard_reports_a_listed_but_unchanged_module_as_stale(fake: Path) -> None:
    (fake / "02_beta" / "model.py").write_text(textwrap.dedent(BASE["model.py"]))
    assert any("model.py is listed but identical" in v for v in _violations(fake))


def test_guard_reports_new_missing_and_removed_files(fake: Path) -> None:
    (fake / "02_beta" / "extra.py").write_text("")
    (fake / "02_beta" / "engine.py").unlink()
    problems = _violations(fake)
    assert any("new file extra.py" in v for v in problems)
    assert any("engine.py of 01_alpha is missing" in v for v in problems)
    (fake / "02_beta" / "engine.py").write_text("ENGINE = 1\n")
    (fake / "02_beta" / "lesson.toml").write_text(
        _manifest("02", "beta", ["model.py", "extra.py"], 'removed = ["engine.py"]\n')
    )
    assert _violations(fake) == [
        "02_beta (stage 02): engine.py is listed in `removed` but still exists"
    ]
    (fake / "02_beta" / "engine.py").unlink()
    assert _violations(fake) == []


def test_guard_reports_a_missing_or_undocumented_task_function(fake: Path) -> None:
    model = fake / "02_beta" / "model.py"
    model.write_text(model.read_text().replace('"""Run the model."""', "pass"))
    lesson = load_lesson(fake / "02_beta", stages_dir=fake)
    assert task_problems(lesson) == [
        "02_beta: task function model.py::Model.forward has no docstring"
    ]
    model.write_text("class Model:\n    pass\n")
    assert task_problems(lesson) == ["02_beta: task function model.py::Model.forward not found"]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (_manifest("02", "beta", ["model.py"], "colour = 1\n"), "unknown keys"),
        (_manifest("02", "beta", ["model.py"]).replace('title = "T"', "title = 3"), "title"),
        (_manifest("02", "beta", ["nope.py"]), "do not exist"),
        (_manifest("02", "beta", ["model.py", "README.md"]), "stage-specific"),
        (_manifest("03", "beta", ["model.py"]), "folder is 02_beta"),
        (
            _manifest(
                "02", "beta", ["model.py"], '[[task]]\nfunction = "engine.py::x"\nsummary = "s"\n'
            ),
            "not listed in `changes`",
        ),
        (
            _manifest(
                "02", "beta", ["model.py"], '[[task]]\nfunction = "model.py"\nsummary = "s"\n'
            ),
            "file.py::Class.method",
        ),
        ("stage = ", "not valid TOML"),
        (  # a lesson in parts names every changed file in one part
            _manifest("02", "beta", ["model.py"], '[[part]]\ntitle = "P"\nfiles = ["x.py"]\n'),
            r"in none: \['model.py'\], not changed: \['x.py'\]",
        ),
        (
            _manifest("02", "beta", ["model.py"], '[[part]]\ntitle = "P"\nfiles = []\nsize = 1\n'),
            "unknown part keys",
        ),
    ],
)
def test_invalid_manifests_are_rejected_clearly(fake: Path, manifest: str, message: str) -> None:
    (fake / "02_beta" / "lesson.toml").write_text(manifest)
    with pytest.raises(ValueError, match=message):
        load_lesson(fake / "02_beta", stages_dir=fake)


def test_missing_manifest_is_rejected(fake: Path) -> None:
    (fake / "02_beta" / "lesson.toml").unlink()
    with pytest.raises(ValueError, match="no manifest"):
        load_lesson(fake / "02_beta", stages_dir=fake)


def test_find_function_handles_methods_async_and_conditional_definitions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        textwrap.dedent('''\
        if True:
            def kernel():
                pass
        class A:
            async def run(self):
                """Doc."""
            def nested(self):
                def inner():
                    pass
        ''')
    )
    assert isinstance(find_function(source, "kernel"), ast.FunctionDef)
    assert isinstance(find_function(source, "A.run"), ast.AsyncFunctionDef)
    for missing in ("inner", "A.inner", "B.run", "run"):
        assert find_function(source, missing) is None
    assert find_function(tmp_path / "absent.py", "kernel") is None


def test_node_ids_are_checked_against_the_test_files(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_y():\n    pass\n")
    assert node_id_problems("tests/test_x.py::test_y", tmp_path) == []
    for bad in ("tests/test_x.py::test_z", "tests/nope.py::test_y", "tests/test_x.py::test_y[a]"):
        assert node_id_problems(bad, tmp_path)


# ------------------------------------------------------- the suite's rule for per-stage fixed costs
def test_changed_stages_follows_the_work_tree_and_the_files_a_stage_is_graded_by(
    fake: Path,
) -> None:
    """conftest's `changed_stages`: what decides where a notebook, a quick bench and an
    assignment's grading run by default (every stage when git cannot tell)."""
    root = fake.parent / "repo"
    (root / "stages").mkdir(parents=True)
    fake.rename(root / "stages" / "x")
    for folder in ("01_alpha", "02_beta"):
        (root / "stages" / "x" / folder).rename(root / "stages" / folder)
    manifest = root / "stages" / "02_beta" / "lesson.toml"
    manifest.write_text(
        manifest.read_text().replace('summary = "s"', 'summary = "s"\ntests = ["tests/t.py::f"]')
    )
    (root / "notebooks").mkdir()
    (root / "notebooks" / "01_alpha.py").write_text("# %%\n")
    (root / "tests").mkdir()
    (root / "tests" / "t.py").write_text("def f():\n    pass\n")
    assert changed_stages(root) is None  # not a git work tree: nothing is known
    git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert changed_stages(root) == frozenset()
    (root / "notebooks" / "01_alpha.py").write_text("# %%\nx = 1\n")
    assert changed_stages(root) == {"01"}
    git("add", ".")
    assert changed_stages(root) == {"01"}  # staged counts too
    (root / "tests" / "t.py").write_text("def f():\n    assert True\n")
    assert changed_stages(root) == {"01", "02"}  # a test a task of 02 is graded by
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "y")
    (root / "stages" / "02_beta" / "new.py").write_text("")  # untracked
    assert changed_stages(root) == {"02"}
    clone = fake.parent / "clone"  # a clone: its commits not yet upstream count as well
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
    assert changed_stages(clone) == frozenset()
    (clone / "stages" / "01_alpha" / "engine.py").write_text("ENGINE = 2\n")
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "z"],
        cwd=clone,
        check=True,
    )
    assert changed_stages(clone) == {"01"}
