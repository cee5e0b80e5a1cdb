"""The suite's command-line options, as a pytest plugin that loads in every pytest run.

    pytest --stage-path ~/hw/03_paged        # the whole suite on a copy, from any directory

The options `--stage`, `--stage-path` and `--full-matrix` used to be registered by
tests/conftest.py, but pytest reads a conftest only when it starts from the repository (or is
given a path inside it): from any other directory `--stage-path DIR` stopped with "unrecognized
arguments". Registered here, through the `pytest11` entry point of pyproject.toml (the editable
install), they are known before any conftest. When `--stage-path` comes with no test path, the
suite is this repository's tests/ (not the copy's folder, which holds none), and a test path
that does not exist where pytest was started but does in the repository (`tests/test_03...`, as
ASSIGNMENT.md writes it) is taken from the repository. `--device cuda` runs the suite's engines
and kernels on a GPU (`--device cpu`, the default, keeps them on the CPU even where a GPU
exists): it sets `STAGES_DEVICE` and `STAGES_DTYPE` (stages/common/devices.py) before any test
module loads, and on CUDA Triton kernels run natively instead of under `TRITON_INTERPRET=1`.
Started elsewhere, pytest reads no ini file, so the markers and warning filters of
pyproject.toml's `[tool.pytest.ini_options]` are added here too. tests/conftest.py names this
module in `pytest_plugins`, so a checkout whose install predates the entry point still gets the
options (from the repository, as before).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

# stages/common/devices.py reads these; named here so that the plugin does not import torch.
DEVICE_VARIABLE, DTYPE_VARIABLE = "STAGES_DEVICE", "STAGES_DTYPE"

ROOT = Path(__file__).resolve().parents[1]  # the repository whose tests/ grade every copy
TESTS = ROOT / "tests"
# pyproject.toml's [tool.pytest.ini_options], for a run whose rootdir is elsewhere
INI_LINES = {
    "markers": (
        "slow: seconds, not milliseconds (the real embedded model, or an interpreted Triton "
        "kernel)",
        "since(stage): first stage a test applies to",
        "until(stage): last stage a test applies to",
        "unit(module): a test of one module of a stage",
        "subject(*modules): the modules a slow test is about: on the newest stage it runs only "
        "if one of them differs from the copy in the stage that introduced the test",
        "fixed_cost: a per-stage fixed cost (a bench, a notebook, an assignment's grading): by "
        "default on the newest stage and on the stages whose files changed (git)",
        "cuda: needs a CUDA GPU (streams, events, pinned memory, graphs): skipped elsewhere, "
        "selected on a GPU with `-m cuda`",
        "needs_triton: runs a Triton kernel: skipped, with the reason, where triton is not "
        "installed (macOS, Windows)",
    ),
    "filterwarnings": ("ignore::DeprecationWarning", "ignore::UserWarning"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stages", "the staged engine's suite")
    group.addoption(
        "--stage",
        action="append",
        default=[],
        help="run only these stages, e.g. --stage 04 (repeatable)",
    )
    group.addoption(
        "--full-matrix",
        action="store_true",
        help="run every test on every stage it applies to (by default real-model tests run on "
        "their first and the newest stage, unit() tests only where their module changed, and "
        "fixed_cost tests on the newest stage and the stages whose files changed since the last "
        "commit)",
    )
    group.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the suite's engines and kernels run (default cpu, even on a GPU machine); "
        "cuda runs every test that can run on a GPU there, Triton natively",
    )
    group.addoption(
        "--dtype",
        default="float32",
        help="the engines' default dtype for the suite (default float32: the oracle tolerances "
        "are fp32's; bf16 numerics have their own tests with their own tolerances)",
    )
    group.addoption(
        "--stage-path",
        default=None,
        help="test a stage folder elsewhere on disk (its name starts with NN_); with no test "
        "path, the whole suite of this repository runs on it, from any directory",
    )


def _suite_paths(given: list[str], invocation_dir: Path) -> list[str]:
    """The test paths to run: the repository's tests/ when none is given, and a given path
    taken from the repository when it does not exist where pytest was started."""
    if not given:
        return [str(TESTS)]
    paths = []
    for arg in given:
        path, sep, rest = arg.partition("::")
        here, there = invocation_dir / path, ROOT / path
        moved = not Path(path).is_absolute() and not here.exists() and there.exists()
        paths.append(f"{there}{sep}{rest}" if moved else arg)
    return paths


def choose_device(device: str, dtype: str) -> None:
    """Make `device` and `dtype` what "auto" means in this process and the processes it starts
    (workers inherit the environment), and pick how Triton runs: interpreted on the CPU,
    compiled on CUDA. Must run before triton is imported."""
    os.environ[DEVICE_VARIABLE] = device
    os.environ[DTYPE_VARIABLE] = dtype
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, args: list[str]) -> None:
    """Choose the device (`--device`), and with --stage-path point the run at this repository's
    tests (see the module docstring). Runs before pytest looks for the first conftests, and
    edits `args` in place, which pytest parses again afterwards."""
    namespace = early_config.known_args_namespace
    choose_device(getattr(namespace, "device", "cpu"), getattr(namespace, "dtype", "float32"))
    if not getattr(namespace, "stage_path", None):
        return
    given = list(namespace.file_or_dir or [])
    wanted = _suite_paths(given, early_config.invocation_params.dir)
    if wanted == given:
        return
    for old in given:  # positional arguments: replace each where it stands
        args[args.index(old)] = wanted[given.index(old)]
    if not given:
        args.append(wanted[0])
    namespace.file_or_dir = wanted


def _key(name: str, line: str) -> str:
    """What two ini lines must share to be the same entry: a marker's name, a filter's text."""
    return re.split(r"[:(]", line)[0].strip() if name == "markers" else line.strip()


def pytest_configure(config: pytest.Config) -> None:
    """The markers and warning filters of pyproject.toml, where its ini was not read."""
    for name, lines in INI_LINES.items():
        present = {_key(name, str(line)) for line in config.getini(name)}
        for line in lines:
            if _key(name, line) not in present:
                config.addinivalue_line(name, line)
