"""What the front ends over engine-core processes share: DPClient (stage 10), DisaggClient (13).

Each holds its engine cores in child processes (common/supervisor.py), tokenizes and validates
in the front end (InputProcessor: the cores never see text), detokenizes (OutputProcessor) and
streams each request's outputs to the coroutine that awaits them. Where a request goes (the router's
pick, or a prefill core then a decode core) and what a core's death does are each front end's
own (`_admit`, `abort`, `_end`, `_core_of`); the plumbing around them is written once,
here: a request refused while draining or when its id runs already, its outputs streamed until
it finishes (a consumer that stops early aborts it), the requests in flight counted and
drained, a message sent to a core (one that cannot be reached is dead), the cores started,
watched and stopped, and a dead core's requests failed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import fields, replace
from typing import Any, Generic, TypeVar

from stages.common.model_config import ModelConfig
from stages.common.supervisor import Supervisor
from stages.common.tokenizer import Tokenizer
from stages.common.weights import resolve_model, served_model_name

from ..async_llm import EngineDeadError, _Job
from ..config import EngineConfig
from ..input_processor import InputProcessor
from ..request import Request, RequestOutput
from .core_messages import EngineCoreRequest
from .engine_core import CoreProcess, EngineCoreSpec, run_engine_core
from .output_processor import OutputProcessor

F = TypeVar("F")  # what a front end records of a request in flight


class CoreClient(ABC, Generic[F]):
    """AsyncLLM's request plumbing over engine-core processes. A subclass starts its cores
    (`_open`, `_start_cores`, `_front_end`, then `_start_reading`), says where a request goes
    and how one ends, and which core holds a request (`_core_of`)."""

    config: EngineConfig
    replicas: list[CoreProcess]
    input_processor: InputProcessor
    output_processor: OutputProcessor
    tokenizer: Tokenizer
    model_name: str  # what /v1/models serves
    closing: str | None  # why new requests are refused (draining), else None
    _supervisor: Supervisor[CoreProcess]
    _lock: threading.Lock  # the requests in flight and the output processor
    _in_flight: dict[str, F]  # request id -> its record, under the lock
    num_finished: int
    num_aborted: int

    # ----------------------------------------------------------------- starting the cores
    def _open(self, skip: set[str]) -> tuple[Tokenizer, ModelConfig, dict[str, Any]]:
        """Before any core starts: the tokenizer and model config the front end needs, and
        the config fields every core gets (all but `skip`, which are the front end's own)."""
        model_path = resolve_model(self.config.model)
        model_config = ModelConfig.from_pretrained(model_path)
        tokenizer = Tokenizer.from_pretrained(model_path, extra_eos_ids=model_config.eos_token_ids)
        names = [f.name for f in fields(EngineConfig) if f.name not in skip]
        return tokenizer, model_config, {name: getattr(self.config, name) for name in names}

    def _start_cores(self, cores: Sequence[tuple[EngineCoreSpec, str, str, Any]]) -> list[Any]:
        """Start every core (its spec, process name, label and devices) under one supervisor,
        which stops them when the client goes, and wait for all to say "ready" at once: the
        first death fails the start and stops the others. Returns their "ready" messages."""
        self._supervisor = Supervisor(CoreProcess)
        self.replicas = self._supervisor.children
        try:
            for spec, name, label, devices in cores:
                self._supervisor.start(run_engine_core, (spec,), name, label).devices = devices
            return self._supervisor.wait_for("ready")
        except BaseException:
            self.shutdown()
            raise

    def _front_end(
        self, tokenizer: Tokenizer, model_config: ModelConfig, readies: list[Any]
    ) -> None:
        """Once every core is ready: the context every core can hold, the processors on each
        side of the cores, and nothing in flight."""
        model = self.config.model
        self.config = replace(self.config, max_model_len=min(r.max_model_len for r in readies))
        self.input_processor = InputProcessor(self.config, tokenizer, model_config.vocab_size)
        self.tokenizer = tokenizer
        self.model_name = served_model_name(self.config.served_model_name, model)
        self.output_processor = OutputProcessor()
        self._lock = threading.Lock()
        self._in_flight = {}
        self.closing = None
        self.num_finished = self.num_aborted = 0

    def _start_reading(self, thread_name: Callable[[int], str]) -> None:
        """One reader thread per core, handing each step's outputs to `_on_outputs` and a
        core's death to `_replica_died`: the last thing a front end starts."""
        self._supervisor.watch(
            self,
            {"outputs"},
            lambda client, _, kind, outputs: client._on_outputs(outputs),
            type(self)._replica_died,
            thread_name,
        )

    def make_request(self, prompt: Any, params: Any = None, **kwargs: Any) -> Request:
        """Tokenize and validate in the front end (ValueError if the request can't run)."""
        return self.input_processor.make_request(prompt, params, **kwargs)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit the request (`_admit` says to which core), and yield its outputs until it
        finishes; stopping early aborts it. Refused: an id already running (ValueError), and
        any request while draining or when no core can take it (EngineDeadError)."""
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        request_id = request.request_id
        with self._lock:
            if self.closing is not None:
                raise EngineDeadError(self.closing)
            if request_id in self._in_flight:
                raise ValueError(f"request id {request_id!r} is already running")
            core, message = self._admit(job)
        self._send(core, ("add", message))
        finished = False
        try:
            while True:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def drain(self, grace_seconds: float, reason: str = "the server is shutting down") -> None:
        """Refuse new requests, give the running ones `grace_seconds`, then end the rest."""
        self.closing = reason
        deadline = time.monotonic() + grace_seconds
        while self.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            ended = [self._end(request_id) for request_id in list(self._in_flight)]
            for request_id in list(self.output_processor.requests):
                self.output_processor.abort_request(request_id)
        for core, job in filter(None, ended):
            job.emit(EngineDeadError(reason))
            self._send(core, ("abort", (job.request.request_id,)))

    def shutdown(self) -> None:
        """Stop every core (ask, wait a little, then kill). Safe to call twice."""
        self._supervisor.stop()

    def _send(self, index: int, message: tuple[str, Any]) -> None:
        replica = self.replicas[index]
        if replica.alive and (unreachable := replica.send(message)) is not None:
            self._replica_died(index, unreachable)

    def _replica_died(self, index: int, how: str) -> None:
        """Fail the requests core `index` holds, each with an error naming it (`how` it died:
        its reader's words, supervisor.ending, or why a send failed); the others go on."""
        replica = self.replicas[index]
        if self._supervisor.stopped.is_set():
            return
        reason = f"{replica.name} {how}"
        failed: list[tuple[_Job, RequestOutput]] = []
        with self._lock:
            if not replica.alive:
                return
            replica.alive, replica.error = False, reason
            self._core_died(index)
            for request_id in [r for r in self._in_flight if self._core_of(r) == index]:
                ended = self._end(request_id)
                output = self.output_processor.fail_request(request_id, reason)
                if ended is not None and output is not None:
                    failed.append((ended[1], output))
        for job, output in failed:
            job.emit(output)

    def _core_died(self, index: int) -> None:
        """Under the lock, as core `index` is found dead: what else a front end forgets."""

    # ----------------------------------------------------------------- each front end's own
    @abstractmethod
    def _admit(self, job: _Job) -> tuple[int, EngineCoreRequest]:
        """Under the lock: the core the request goes to and its message; recorded in flight."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request now, on the core that has it."""

    @abstractmethod
    def _end(self, request_id: str) -> tuple[int, _Job] | None:
        """Under the lock: end a request in flight as aborted; its core and job (None: gone)."""

    @abstractmethod
    def _core_of(self, request_id: str) -> int | None:
        """Under the lock: the core that holds a request in flight."""
