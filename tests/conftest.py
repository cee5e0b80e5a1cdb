"""One cumulative suite for every stage.

Each test module declares the first stage its guarantees apply to (``pytestmark =
since("02")``); any test taking the `stage` fixture then runs on that stage and every later one,
so a later stage can never silently break an earlier stage's promise.

    pytest --stage 04                  # only stage 04
    pytest --stage-path ~/my/04_batching   # grade another copy of a stage (a student's)
    pytest --full-matrix               # every test on every stage it applies to

By default three rules leave out runs that cannot find anything new (see `unit`, the real-model
rule in `pytest_generate_tests`, and `fixed_cost_stages`).
"""

from __future__ import annotations

import os

# `pytest --device` (stages/pytest_plugin.py) has chosen the device before this module loads;
# an install whose plugin did not load keeps the CPU: kernels interpreted, before triton loads.
if os.environ.get("STAGES_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ast
import contextlib
import ctypes
import dataclasses
import functools
import gc
import random
import re
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import stages
from stages.common.devices import DIST_BACKEND_VARIABLE
from stages.common.tooling.server_process import ThreadedServer
from stages.common.tooling.tiny import TINY_SPECS, make_tiny_checkpoint

# One torch thread per pytest-xdist worker (`make test` runs two): the tests are mostly small
# tensors and Python, where two workers on two cores beat one worker with two threads. Every
# process a worker starts (ranks, replicas, cores, notebook kernels, graded suites) inherits one
# thread too: with two threads each, their OpenMP teams spun on the cores the workers need
# (`time pytest -n 2 tests/test_09_tp.py tests/test_13_disagg_processes.py`: user CPU 181 -> 151
# s, wall 153 -> 134 s on the 2-core EPYC, 2026-11-29).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(
    1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))
)


def _triton_missing() -> str | None:
    """Why the Triton tests cannot run here, or None. Triton has no macOS or Windows wheel (and
    none for some Arm builds): there the kernels' PyTorch references still run, the kernels'
    own tests are skipped with this reason."""
    try:
        import triton  # noqa: F401 - TRITON_INTERPRET is set above, before this import
    except ImportError as exc:
        return f"triton is not installed on this platform ({exc}): its kernels cannot run"
    return None


TRITON_MISSING = _triton_missing()
# A test (or one parameter: `pytest.param("triton", marks=needs_triton)`) that runs a Triton
# kernel: skipped with TRITON_MISSING's reason where triton cannot be installed.
needs_triton = pytest.mark.needs_triton


# The costliest test files (worker-seconds in `python tools/suite_cost.py`), run first.
# pytest-xdist's `--dist loadfile` hands files to its workers in collection order, so a costly
# file collected last runs alone while the other worker idles (about 25 s of a 690 s run);
# costliest first, the short files fill the end.
COSTLIEST_FIRST = (
    "test_09_tp.py",
    "test_assignments.py",
    "test_10_dp.py",
    "test_13_disagg_processes.py",
    "test_15_dashboard_browser.py",
    "test_12_offload.py",
    "test_11_ep.py",
    "test_gradebook.py",
    "test_01_server.py",
    "test_02_faults.py",
    "test_03_paged.py",
    "test_08_specdec.py",
    "test_gpu_check.py",
    "test_10_dp_faults.py",
    "test_mutations.py",
)


def _cost_rank(item: pytest.Item) -> int:
    name = item.path.name
    return COSTLIEST_FIRST.index(name) if name in COSTLIEST_FIRST else len(COSTLIEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_cost_rank)  # stable: each file's tests keep their order
    if TRITON_MISSING:
        for item in items:
            if item.get_closest_marker("needs_triton"):
                item.add_marker(pytest.mark.skip(reason=TRITON_MISSING))


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU class this run assumes, so a failure report says which machine it came from.
    `ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA` run as a lesser CPU (docs/tests.md)."""
    import platform

    forced = {
        name: os.environ[name]
        for name in ("STAGES_CPU_CLASS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        if name in os.environ
    }
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return [
        f"cpu: {platform.machine()} {platform.processor() or ''}, torch capability "
        f"{torch.backends.cpu.get_cpu_capability()}, avx512_bf16 {bf16}, "
        f"forced {forced or 'nothing'}; triton: {TRITON_MISSING or 'installed'}"
    ]


def since(first_stage: str) -> pytest.MarkDecorator:
    """Mark a test (or a module, via `pytestmark`) as applying from `first_stage` on."""
    return pytest.mark.since(first_stage)


def until(last_stage: str) -> pytest.MarkDecorator:
    """Mark a test whose subject a later stage removes on purpose (say why where it is used)."""
    return pytest.mark.until(last_stage)


def unit(module: str) -> pytest.MarkDecorator:
    """Mark a test that exercises one stage module (and what it imports from its own stage). By
    default it runs only on the stages where that module, or a module of its stage it imports,
    differs from the previous stage's copy: byte-identical code cannot behave differently, and
    the snapshot guard (test_snapshots.py) proves the copies identical. With
    --stage or --stage-path it runs on every selected stage. This keeps the cumulative suite's
    cost from multiplying by the number of stages for tests that cannot find anything new."""
    return pytest.mark.unit(module)


@functools.cache
def _stage_imports(folder: Path, module: str) -> frozenset[str]:
    """The modules of its own stage a module imports at run time, as paths in the stage folder
    (`from .x import ...`, and from a sub-package such as harness/ `from ..x import ...`;
    imports under `if TYPE_CHECKING:` only name types, so they do not count)."""
    tree = ast.parse((folder / module).read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for node in ast.walk(block)
    }
    package = Path(module).parent.parts
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level or id(node) in typing_only:
            continue
        if node.level - 1 > len(package):
            continue  # above the stage: not one of its modules
        base = package[: len(package) - node.level + 1]
        if node.module:
            path = "/".join((*base, *node.module.split(".")))
            names.update((f"{path}.py", f"{path}/__init__.py"))
        else:
            names.update("/".join((*base, f"{alias.name}.py")) for alias in node.names)
    return frozenset(names)


@functools.cache
def _module_closure(folder: Path, module: str) -> frozenset[str]:
    """A module and every module of its stage it imports, directly or not."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name not in seen and (folder / name).exists():
            seen.add(name)
            todo += _stage_imports(folder, name)
    return frozenset(seen)


def _stages_changing(module: str, candidates: list[str]) -> list[str]:
    """The candidate stages where `module`, or a module of its stage it imports, differs from
    the previous stage's copy: elsewhere every byte it runs is the previous stage's."""
    folders = {info.number: info.path for info in stages.list_stages()}
    ordered = sorted(folders)
    kept = []
    for number in candidates:
        folder = folders[number]
        if not (folder / module).exists():
            raise pytest.UsageError(f"unit({module!r}): {folder / module} does not exist")
        index = ordered.index(number)
        previous = folders[ordered[index - 1]] if index else None
        for name in sorted(_module_closure(folder, module)):
            before = previous / name if previous else None
            if (
                before is None
                or not before.exists()
                or before.read_bytes() != (folder / name).read_bytes()
            ):
                kept.append(number)
                break
    return kept


def changed_stages(root: Path) -> frozenset[str] | None:
    """The stages whose files differ from the last commit (staged, unstaged or untracked), or,
    when the branch has an upstream, from where it left it: a stage's folder, its notebook, or
    a test file its lesson.toml's tasks name. None outside a git work tree (nothing is known)."""

    def git(*args: str) -> list[str] | None:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:  # no git at all
            return None
        return proc.stdout.split("\0") if proc.returncode == 0 else None

    status = git("status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames")
    if status is None:
        return None
    paths = {entry[3:] for entry in status if len(entry) > 3}
    if git("rev-parse", "--verify", "--quiet", "@{upstream}") is not None:
        paths.update(git("diff", "-z", "--name-only", "--no-renames", "@{upstream}...HEAD") or [])
    from stages.lesson import _stage_folders, load_lesson

    changed = set()
    for info in _stage_folders(root / "stages"):
        tests = set()
        with contextlib.suppress(ValueError):  # a manifest being edited: its folder still counts
            lesson = load_lesson(info.path, stages_dir=info.path.parent)
            tests = {t.partition("::")[0] for task in lesson.tasks for t in task.tests}
        for path in paths:
            first = path.split("/")[:2]
            if (
                first == ["stages", info.folder]
                or (first[0] == "notebooks" and Path(path).stem == info.folder)
                or path in tests
            ):
                changed.add(info.number)
    return frozenset(changed)


_CHANGED: dict[str, frozenset[str] | None] = {}


def _changed(config: pytest.Config) -> frozenset[str] | None:
    """`changed_stages` of this repository, computed once per session."""
    if "changed" not in _CHANGED:
        _CHANGED["changed"] = changed_stages(Path(stages.STAGES_DIR).parent)
    return _CHANGED["changed"]


def fixed_cost_stages(config: pytest.Config, candidates: list[str]) -> list[str]:
    """Where a per-stage fixed cost (a notebook, a quick bench, an assignment's grading) runs:
    by default on the newest stage and on the stages whose files changed (`changed_stages`), so
    that one more stage adds one more run only when it is the one being worked on; every
    candidate with --stage, --stage-path, --full-matrix, or outside a git work tree."""
    if (
        config.getoption("--stage")
        or config.getoption("--stage-path")
        or config.getoption("--full-matrix")
    ):
        return candidates
    changed = _changed(config)
    if changed is None:
        return candidates
    newest = stages.list_stages()[-1].number
    return [s for s in candidates if s == newest or s in changed]


def subject_stages(
    config: pytest.Config, candidates: list[str], modules: tuple[str, ...]
) -> list[str]:
    """Where a test marked `subject(modules)` runs by default: the stage that introduces it, the
    newest stage, the stages being edited (`changed_stages`; every stage outside a git work
    tree), and every stage where one of `modules` differs from the previous stage's copy. On
    the other stages the code the test is about is byte-identical to a stage it already ran on;
    what did change there has its own tests, and every test ran on each stage while it was the
    newest (CI runs the whole suite on every commit)."""
    changed = _changed(config)
    if changed is None or not candidates:
        return candidates
    folders = {info.number: info.path for info in stages.list_stages()}
    ordered = sorted(folders)
    newest = ordered[-1]
    kept = []
    for number in candidates:
        index = ordered.index(number)
        previous = folders[ordered[index - 1]] if index else None
        if number in (candidates[0], newest) or number in changed or previous is None:
            kept.append(number)
            continue
        for name in modules:
            here, before = folders[number] / name, previous / name
            if not here.exists() and not before.exists():
                continue
            if not (here.exists() and before.exists()) or here.read_bytes() != before.read_bytes():
                kept.append(number)
                break
    return kept


# The options --stage, --stage-path and --full-matrix, and the markers since/until/unit/
# fixed_cost, are registered by stages/pytest_plugin.py, which pytest loads through its entry
# point before any conftest (so that `pytest --stage-path DIR` works from any directory); named
# here too for an install that predates the entry point (then a no-op otherwise).
pytest_plugins = ["stages.pytest_plugin"]


def _selected_stages(config: pytest.Config) -> list[str]:
    path = config.getoption("--stage-path")
    wanted = [f"{int(s):02d}" for s in config.getoption("--stage")]
    if path:
        match = re.match(r"(\d\d)_", Path(path).name)
        if not match and len(wanted) != 1:
            raise pytest.UsageError("--stage-path needs a folder named NN_* or one --stage NN")
        return [match.group(1) if match else wanted[0]]
    available = [info.number for info in stages.list_stages()]
    return [s for s in available if not wanted or s in wanted]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stage" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("since")
    first = marker.args[0] if marker else "01"
    last_marker = metafunc.definition.get_closest_marker("until")
    last = last_marker.args[0] if last_marker else "99"
    chosen = [s for s in _selected_stages(metafunc.config) if first <= s <= last]
    explicit = metafunc.config.getoption("--stage") or metafunc.config.getoption("--stage-path")
    full = explicit or metafunc.config.getoption("--full-matrix")
    unit_marker = metafunc.definition.get_closest_marker("unit")
    if unit_marker and not full:
        chosen = _stages_changing(unit_marker.args[0], chosen)
    fixed_cost = metafunc.definition.get_closest_marker("fixed_cost")
    if fixed_cost:
        chosen = fixed_cost_stages(metafunc.config, chosen)
    elif metafunc.definition.get_closest_marker("slow") and not full:
        # Real-model and multi-process tests cost seconds each: by default they run where their
        # guarantee is introduced and on the newest stage (every stage in between is covered by
        # the tiny-model tests and the snapshot guard); --full-matrix runs every stage. A test
        # marked `subject(modules)` skips the newest stage when those modules there are
        # byte-identical to the introducing stage's: it would run the same code again.
        chosen = sorted({chosen[0], chosen[-1]}) if chosen else chosen  # once if the same
        subject = metafunc.definition.get_closest_marker("subject")
        if subject and len(chosen) == 2 and _same_modules(chosen[0], chosen[1], subject.args):
            chosen = chosen[:1]
    elif (subject := metafunc.definition.get_closest_marker("subject")) and not (
        full or unit_marker
    ):
        chosen = subject_stages(metafunc.config, chosen, subject.args)
    metafunc.parametrize("stage", chosen, indirect=True, ids=[f"s{s}" for s in chosen])


def subject(*modules: str) -> pytest.MarkDecorator:
    """Mark a test with the stage modules it is about. A slow test then skips the newest stage
    when those are byte-identical to the introducing stage's (pytest_generate_tests); any other
    test runs only where they change, as `subject_stages` says."""
    return pytest.mark.subject(*modules)


def _same_modules(first: str, last: str, modules: tuple[str, ...]) -> bool:
    """Whether every one of `modules` is byte-identical in stages `first` and `last`."""
    folders = {info.number: info.path for info in stages.list_stages()}
    for name in modules:
        a, b = folders[first] / name, folders[last] / name
        if not (a.exists() and b.exists()) or a.read_bytes() != b.read_bytes():
            return False
    return True


_STAGE_MODULES: dict[str, ModuleType] = {}


@pytest.fixture
def stage(request: pytest.FixtureRequest) -> ModuleType:
    """The stage package under test (from the repo, or from --stage-path)."""
    number = request.param
    if number not in _STAGE_MODULES:
        path = request.config.getoption("--stage-path")
        _STAGE_MODULES[number] = (
            stages.load_from_path(path, alias=f"student_{number}") if path else stages.load(number)
        )
    return _STAGE_MODULES[number]


# ------------------------------------------------------------------------------------- models
@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> Callable[[str], Path]:
    """tiny_model("llama-gqa") -> folder of a tiny random checkpoint (written once)."""

    def make(name: str = "llama-gqa") -> Path:
        return make_tiny_checkpoint(tiny_dir / name, TINY_SPECS[name])

    return make


# The tiny model (llama-gqa's weights) with a context no machine decodes within a test's timers:
# for servers in processes of their own, where no test can hold the engine's steps, a request
# of LONG_CONTEXT_REQUEST tokens (ignore_eos) is still running when a grace period or a
# client's timeout ends (docs/timer_tests.md).
LONG_CONTEXT = 32768
LONG_CONTEXT_REQUEST = 32000  # tokens: minutes of decoding on a CPU, tens of seconds on a GPU


@pytest.fixture(scope="session")
def tiny_long_context_model(tiny_dir: Path) -> Path:
    spec = dataclasses.replace(TINY_SPECS["llama-gqa"], max_position_embeddings=LONG_CONTEXT)
    return make_tiny_checkpoint(tiny_dir / "llama-gqa-long-context", spec)


@pytest.fixture(scope="session")
def real_model(request: pytest.FixtureRequest) -> Path:
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache). On a GPU run
    (`--device cuda`) a machine without it skips: its GGUF (98 MB) cannot travel to a lent GPU
    machine, and the tiny checkpoints carry the correctness checks there. On the CPU a missing
    model is an error, as it would be for a user."""
    from stages.common.weights import resolve_model

    try:
        return resolve_model(None)
    except (ValueError, ImportError, OSError) as exc:
        if request.config.getoption("--device") == "cuda":
            pytest.skip(f"the embedded model is not installed on this GPU machine: {exc}")
        raise


# ------------------------------------------------------------------------------------- devices
class Marks(list):
    """Several marks, usable as `pytestmark = [*marks]` or as one decorator `@marks`."""

    def __call__(self, function: Callable) -> Callable:
        for mark in self:
            function = mark(function)
        return function


def eager_config(stage: ModuleType) -> dict[str, bool]:
    """Engine config that runs every step's forward eagerly. Where a stage has CUDA graphs (on
    by default on CUDA), a decode step replays a graph and never calls `model.forward`, so a
    test that injects a fault there must turn them off (the first GPU runs found two that
    never fired)."""
    fields = {f.name for f in dataclasses.fields(stage.EngineConfig)}
    return {"cuda_graphs": False} if "cuda_graphs" in fields else {}


def requires_cuda(why: str) -> Marks:
    """Marks for a test that needs a CUDA GPU: `-m cuda` selects it; elsewhere it skips and
    says what it would check."""
    return Marks(
        [
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU: {why}"),
        ]
    )


def pytest_configure(config: pytest.Config) -> None:
    """`--device cuda` needs a GPU to run tests; collecting them (`--collect-only`, the CPU's
    dry run of a GPU run) does not. With fewer than two GPUs the engines' ranks use gloo
    (`STAGES_DIST_BACKEND`, unless the user set it): gloo takes CUDA tensors and lets ranks
    share a GPU, which NCCL refuses, so the multi-process tests run instead of skipping."""
    cuda = config.getoption("--device") == "cuda"
    if cuda and not torch.cuda.is_available() and not config.getoption("--collect-only"):
        raise pytest.UsageError("--device cuda given, but torch sees no CUDA device here")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        os.environ.setdefault(DIST_BACKEND_VARIABLE, "gloo")


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where tensors built by a test go: `pytest --device` (cpu by default)."""
    return torch.device(request.config.getoption("--device"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """On a GPU run with NCCL, a test whose engine needs more GPUs than the machine has (data x
    tensor parallel ranks, one GPU each: NCCL refuses two ranks on one device) skips, naming
    the count, instead of failing: `device_plan` refuses it before any process starts. (With
    one GPU the run uses gloo, whose ranks share it: see pytest_configure.)"""
    try:
        return (yield)
    except ValueError as exc:
        if item.config.getoption("--device") == "cuda" and NOT_ENOUGH_GPUS.search(str(exc)):
            pytest.skip(f"needs more GPUs than this machine has: {exc}")
        raise


# The placement's refusals: device_plan (stage 10 on), "... needs 4 GPUs, but 1 are visible";
# the executor's (stage 09 on), "... needs GPUs cuda:0..cuda:1, but 1 are visible".
NOT_ENOUGH_GPUS = re.compile(
    r"needs (\d+ GPUs?|GPUs cuda:\d+\.\.cuda:\d+), but \d+ (is|are) visible"
)


# Engines and servers are cached for the session, but only the most recently used few: a
# real-model engine of stage 03+ holds ~0.9 GB, and the suite builds dozens of them.
# pytest runs each test function on every stage in turn, so the caches hold one entry per stage
# (and a spare): with fewer, every function rebuilt every stage's engine and server.
MAX_CACHED_ENGINES = len(stages.list_stages()) + 2
MAX_CACHED_SERVERS = len(stages.list_stages()) + 1
# Real-model tests need a few thousand tokens of KV, not the engine's default 1 GiB pool.
TEST_KV_CACHE_BYTES = 256 * 2**20
TEST_CUDA_GRAPH_MAX_BATCH = 8  # on a GPU run: buckets 1, 2, 4, 8 (larger batches run eagerly)

_ENGINES: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def _engine_key(stage: ModuleType, model: Path | str, config: dict[str, Any]) -> tuple[Any, ...]:
    return (stage.__name__, str(model), tuple(sorted(config.items())))


def _with_test_defaults(stage: ModuleType, config: dict[str, Any]) -> dict[str, Any]:
    """Give engines of stages that have a KV budget a small one, unless the test sets it; on a
    GPU run, capture CUDA graphs up to batch 8 only (each of the default 35 buckets costs a
    capture at every engine's start, and the suite starts hundreds of engines)."""
    engine_config = getattr(stage, "EngineConfig", None)
    names = {f.name for f in dataclasses.fields(engine_config)} if engine_config else set()
    if "kv_cache_bytes" in names and "kv_cache_bytes" not in config:
        config = {**config, "kv_cache_bytes": TEST_KV_CACHE_BYTES}
    # The oracles are fp32 (transformers, the plain path): an engine under test keeps fp32
    # weights unless the test names a format. Stage 15's quantization="auto" is tested on its
    # own (test_15_auto_format.py).
    if "quantization" in names and "quantization" not in config:
        config = {**config, "quantization": "none"}
    on_gpu = os.environ.get("STAGES_DEVICE") == "cuda"
    if on_gpu and "cuda_graph_max_batch" in names and "cuda_graph_max_batch" not in config:
        config = {**config, "cuda_graph_max_batch": TEST_CUDA_GRAPH_MAX_BATCH}
    return config


# An evicted engine of a checkpoint this large is collected at once (a real-model engine holds
# ~0.9 GB). A tiny one is left to Python's own collector: a full `gc.collect()` walks the whole
# suite's heap (torch, transformers, every loaded stage) and cost ~0.25 s per eviction, which
# was three quarters of the tiny-model tests' time.
LARGE_CHECKPOINT_BYTES = 50 * 2**20


def _holds_a_large_checkpoint(key: tuple[Any, ...]) -> bool:
    folder = Path(key[1])
    return folder.is_dir() and (
        sum(f.stat().st_size for f in folder.glob("*.safetensors")) > LARGE_CHECKPOINT_BYTES
    )


def _is_heavy(key: tuple[Any, ...]) -> bool:
    """Whether a cached engine holds a large checkpoint or starts processes of its own (ranks,
    replicas, a disaggregated pair: each imports torch and holds its share, about 0.7 GB)."""
    config = dict(key[2])
    processes = (
        config.get("tensor_parallel_size", 1) > 1
        or config.get("data_parallel_size", 1) > 1
        or bool(config.get("disaggregated"))
    )
    return processes or _holds_a_large_checkpoint(key)


# Of those, at most this many per cache are heavy (`_is_heavy`: a large checkpoint, or
# processes of their own). A run of every stage (`--full-matrix`, or a fix carried through many
# stages) runs each real-model test on up to 15 stages and each tensor-parallel test on 7, and
# one engine per stage kept a pytest worker at 15-25 GB in the largest modules (one worker was
# killed at 11.5 GB on 24 GiB), and seven cached tensor-parallel engines held fourteen rank
# processes of 0.7 GB each (a run killed at 88%). Runs of the newest and the edited stages use
# at most two stages for such tests, so they rebuild nothing.
MAX_CACHED_HEAVY_ENGINES = 2


def _cached(
    cache: OrderedDict, key: Any, build: Callable[[], Any], capacity: int, evict: Callable
) -> Any:
    """cache[key], built on a miss; the least recently used entries beyond capacity go, and
    the least recently used heavy ones beyond `MAX_CACHED_HEAVY_ENGINES` before a heavy one
    is built."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    if _is_heavy(key):
        heavy = [k for k in cache if _is_heavy(k)]
        stale = heavy[: max(0, len(heavy) - (MAX_CACHED_HEAVY_ENGINES - 1))]
        for old_key in stale:
            evict(cache.pop(old_key))
        if stale:  # an engine a test served is still held by FastAPI's caches: drop them first
            _forget_fastapi_endpoint_caches()
            gc.collect()
            _return_free_memory_to_the_os()
    cache[key] = build()
    while len(cache) > capacity:
        old_key, old = cache.popitem(last=False)
        evict(old)
        del old
        if _holds_a_large_checkpoint(old_key):
            gc.collect()
            _return_free_memory_to_the_os()
    return cache[key]


def _evict_all(cache: OrderedDict, evict: Callable) -> None:
    while cache:
        evict(cache.popitem(last=False)[1])


def _collect_and_freeze() -> None:
    """Free what the module left, then move every survivor to the collector's permanent
    generation. What survives a module's end lives for the session (imported libraries, the
    stages, the transformers oracles), and each later `gc.collect()` walked all of it again:
    ~0.3 s, more as the session grew. Frozen objects are still freed by reference counting."""
    gc.collect()
    gc.freeze()
    _return_free_memory_to_the_os()


def _stop_server(entry: tuple[ThreadedServer, Any]) -> None:
    entry[0].stop()
    _forget_fastapi_endpoint_caches()


def _forget_fastapi_endpoint_caches() -> None:
    """FastAPI memoises facts about endpoint functions in module-level lru_caches. They keep a
    stopped app's route closures, and so its engine, alive; clearing them lets it be freed."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _unfreeze_at_the_end() -> Iterator[None]:
    """Hand the frozen objects back to the collector, so that the interpreter's exit frees
    them (nanobind, under triton, reports every binding still alive then as a leak)."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _same_random_state_in_every_order() -> None:
    """Seed the global generators before each test: a test's draws must not depend on which
    tests ran before it in its process (pytest-xdist hands each worker a different share)."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def _fresh_engines_per_module() -> Iterator[None]:
    """Engines rarely carry over between test modules; dropping them keeps the suite's memory
    at one module's worth instead of the whole session's."""
    yield
    _evict_all(_ENGINES, lambda _: None)
    _evict_all(_SERVERS, _stop_server)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After a module's last test, free what it left and freeze the rest (`_collect_and_freeze`).
    Not in the module fixture's teardown: pytest drops the last test's fixture values
    (`item.funcargs`) only after its teardown, and a fixture that returned an engine kept it
    alive through the collection, into the permanent generation, for the rest of the session
    (about 0.9 GB per module that ended so). Not after the session's last test either: that
    would refreeze what `_unfreeze_at_the_end` handed back."""
    result = yield
    if nextitem is not None and nextitem.path != item.path:
        _collect_and_freeze()
    return result


def _return_free_memory_to_the_os() -> None:
    """glibc keeps freed heap pages for reuse; without this the suite's RSS only ever grows."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., Any]:
    """make_llm(stage, model_path, **config) -> a cached engine (loading once per session)."""

    def make(stage: ModuleType, model: Path | str, **config: Any) -> Any:
        config = _with_test_defaults(stage, config)
        build = lambda: stage.LLM(str(model), **config)
        key = _engine_key(stage, model, config)
        return _cached(_ENGINES, key, build, MAX_CACHED_ENGINES, lambda _: None)

    return make


_HF: dict[str, Any] = {}


@pytest.fixture(scope="session")
def hf_model(request: pytest.FixtureRequest) -> Callable[[Path], Any]:
    """hf_model(path) -> transformers' model on the same weights (cached), on the test device
    (`pytest --device`), where the engines run: a GPU run compares on the GPU."""
    from stages.common.tooling.hf_oracle import load_hf_model

    device = request.config.getoption("--device")

    def make(path: Path) -> Any:
        if str(path) not in _HF:
            _HF[str(path)] = load_hf_model(path, device=device)
        return _HF[str(path)]

    return make


# The HTTP layer: what the server tests are about (`subject`).
SERVER_MODULES = (
    "server.py", "async_llm.py", "streaming.py", "input_processor.py", "llm.py", "__init__.py",
)  # fmt: skip

# ------------------------------------------------------------------------------------- servers
_SERVERS: OrderedDict[tuple[Any, ...], tuple[ThreadedServer, Any]] = OrderedDict()


@pytest.fixture(scope="session")
def live_server() -> Iterator[Callable[..., tuple[ThreadedServer, Any]]]:
    """live_server(stage, model, **config) -> (server, app), one per (stage, model, config)."""

    def start(stage: ModuleType, model: Path | str, **config: Any) -> tuple[ThreadedServer, Any]:
        config = _with_test_defaults(stage, config)

        def build() -> tuple[ThreadedServer, Any]:
            app = stage.create_app(stage.LLM(str(model), **config))
            return ThreadedServer(app).start(), app

        key = _engine_key(stage, model, config)
        return _cached(_SERVERS, key, build, MAX_CACHED_SERVERS, _stop_server)

    yield start
    _evict_all(_SERVERS, _stop_server)
    _collect_and_freeze()


# ------------------------------------------------------------------------------ timers and steps
# A test that asserts what an engine has or has not done when a timer fires (a drain's grace, a
# deadline) holds the engine where it needs it instead of hoping it is slow or fast enough: on a
# fast idle machine a 400-token stream of the tiny model ends within 0.3 s (docs/timer_tests.md).
class StepGate:
    """`with StepGate(engine, free=3) as gate:` lets the engine's first `free` steps run, then
    holds the next one until `gate.release()`: the request stays where the test left it for as
    long as the test needs. `gate.held` is set once a step waits at the gate. A gate never
    released opens after `timeout` seconds, so a broken test fails instead of hanging."""

    def __init__(self, engine: Any, free: int, timeout: float = 60.0) -> None:
        self.engine, self.free, self.timeout = engine, free, timeout
        self.calls = 0
        self.held = threading.Event()
        self.opened = threading.Event()
        self._own = "step" in vars(engine)  # an instance attribute already (another wrapper)

    def __enter__(self) -> StepGate:
        step = self.engine.step

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls > self.free and not self.opened.is_set():
                self.held.set()
                self.opened.wait(self.timeout)
            return step(*args, **kwargs)

        self._step = step
        self.engine.step = gated
        return self

    def release(self) -> None:
        self.opened.set()

    def __exit__(self, *exc: object) -> None:
        self.release()
        if self._own:
            self.engine.step = self._step
        else:
            del self.engine.step


@contextlib.contextmanager
def held_until_abort(async_llm: Any, free: int) -> Iterator[StepGate]:
    """The engine of `async_llm` held after `free` steps until the server aborts a request (a
    client left): a test of what a disconnect does then finds the request still running, however
    fast the machine generates. `gate.opened` is set by that abort; `abort_seen` also sees one
    queued without `abort()` (a student's `generate` may queue it itself)."""
    abort = async_llm.abort
    with StepGate(async_llm.engine, free) as gate:

        def aborting(request_id: str) -> None:
            abort(request_id)
            gate.release()

        async_llm.abort = aborting
        try:
            yield gate
        finally:
            del async_llm.abort


def abort_seen(async_llm: Any, gate: StepGate) -> bool:
    """Whether the server asked to abort a request while `held_until_abort` holds the engine."""
    return gate.opened.is_set() or bool(getattr(async_llm, "_abort_requested", None))


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False). The timeout
    only bounds a wait for something that will happen: never the thing a test asserts."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def step_logits(llm: Any) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the logits every request was sampled from, step by step, while the engine runs:
    {request_id: [logits of output token 0, of token 1, ...]}. Comparing them with
    `llm.prompt_logits(prompt + output)` (teacher forcing, no cache) checks a batched, paged or
    preempted run far more strictly than equal greedy tokens, which tiny random models reduce to
    repetition."""
    recorded: dict[str, list[torch.Tensor]] = {}
    runner = llm.runner
    prepare, compute = runner.prepare_inputs, runner.model.compute_logits
    pending: list[tuple[str, ...]] = []

    def recording_prepare(scheduler_output: Any) -> Any:
        inputs = prepare(scheduler_output)
        pending.append(inputs.sampled_request_ids)
        return inputs

    def recording_compute(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        if pending:
            for request_id, row in zip(pending.pop(0), logits, strict=True):  # launch order
                recorded.setdefault(request_id, []).append(row.float().cpu())  # as forced
        return logits

    runner.prepare_inputs, runner.model.compute_logits = recording_prepare, recording_compute
    graphs = getattr(runner, "graphs", None)  # stage 15: a replayed step's LM head is in its graph
    if graphs is not None:
        replay = graphs.replay

        def recording_replay(bucket: int) -> Any:
            logits, greedy = replay(bucket)
            real = pending[0] if pending else ()
            recording_compute_rows(logits[: len(real)])
            return logits, greedy

        def recording_compute_rows(logits: torch.Tensor) -> None:
            if pending:
                for request_id, row in zip(pending.pop(0), logits, strict=True):  # a copy:
                    # the graph's output buffer is overwritten by the next replay
                    recorded.setdefault(request_id, []).append(row.float().cpu().clone())

        graphs.replay = recording_replay
    try:
        yield recorded
    finally:
        del runner.prepare_inputs
        runner.model.compute_logits = compute
        if graphs is not None:
            del graphs.replay


def assert_logits_match_teacher_forcing(
    llm: Any, outputs: list[Any], recorded: dict[str, list[torch.Tensor]], atol: float = 1e-4
) -> None:
    """Each output token's logits from the engine's run equal the logits of one forward over
    prompt + output (no cache, no batch) at the same position."""
    for out in outputs:
        rows = recorded[out.request_id]
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        forced = llm.prompt_logits(ids[:-1])[len(out.prompt_token_ids) - 1 :]
        # One row per output token, a recompute after preemption included: it samples only the
        # token after everything it recomputed. With async scheduling a request that stopped
        # may have one more step in flight, whose token is dropped: at most one row more.
        n = len(out.token_ids)
        assert n <= len(rows) <= n + 1, (out.request_id, len(rows), n)
        torch.testing.assert_close(torch.stack(rows[:n]), forced, atol=atol, rtol=0)
