"""One cumulative suite for every stage.

Each test module declares the first stage its guarantees apply to (``pytestmark =
since("02")``); any test taking the `stage` fixture then runs on that stage and every later one,
so a later stage can never silently break an earlier stage's promise.

    pytest --stage 04                  # only stage 04
    pytest --stage-path ~/my/04_batching   # grade another copy of a stage (a student's)
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on the CPU, before triton loads
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import stages
from stages.common.tiny import TINY_SPECS, make_tiny_checkpoint

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def since(first_stage: str) -> pytest.MarkDecorator:
    """Mark a test (or a module, via `pytestmark`) as applying from `first_stage` on."""
    return pytest.mark.since(first_stage)


def until(last_stage: str) -> pytest.MarkDecorator:
    """Mark a test whose subject a later stage removes on purpose (say why where it is used)."""
    return pytest.mark.until(last_stage)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stage",
        action="append",
        default=[],
        help="run only these stages, e.g. --stage 04 (repeatable)",
    )
    parser.addoption(
        "--stage-path",
        default=None,
        help="test a stage folder elsewhere on disk (its name starts with NN_)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "since(stage): first stage a test applies to")
    config.addinivalue_line("markers", "until(stage): last stage a test applies to")


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
    metafunc.parametrize("stage", chosen, indirect=True, ids=[f"s{s}" for s in chosen])


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


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache)."""
    from stages.common.weights import resolve_model

    return resolve_model(None)


_ENGINES: dict[tuple[Any, ...], Any] = {}


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., Any]:
    """make_llm(stage, model_path, **config) -> a cached engine (loading once per session)."""

    def make(stage: ModuleType, model: Path | str, **config: Any) -> Any:
        key = (stage.__name__, str(model), tuple(sorted(config.items())))
        if key not in _ENGINES:
            _ENGINES[key] = stage.LLM(str(model), **config)
        return _ENGINES[key]

    return make


_HF: dict[str, Any] = {}


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], Any]:
    """hf_model(path) -> transformers' model on the same weights (cached)."""
    from stages.common.hf_oracle import load_hf_model

    def make(path: Path) -> Any:
        if str(path) not in _HF:
            _HF[str(path)] = load_hf_model(path)
        return _HF[str(path)]

    return make


# ------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


_SERVERS: dict[tuple[Any, ...], tuple[LiveServer, Any]] = {}


@pytest.fixture(scope="session")
def live_server(make_llm: Callable[..., Any]) -> Iterator[Callable[..., tuple[LiveServer, Any]]]:
    """live_server(stage, model, **config) -> (server, engine), one per (stage, model, config)."""

    def start(stage: ModuleType, model: Path | str, **config: Any) -> tuple[LiveServer, Any]:
        key = (stage.__name__, str(model), tuple(sorted(config.items())))
        if key not in _SERVERS:
            engine = stage.LLM(str(model), **config)
            app = stage.create_app(engine)
            server = LiveServer(app).__enter__()
            _SERVERS[key] = (server, app)
        return _SERVERS[key]

    yield start
    for server, _ in _SERVERS.values():
        server.__exit__(None, None, None)
    _SERVERS.clear()
