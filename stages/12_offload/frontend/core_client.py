"""What the front ends over engine-core processes share: DPClient (stage 10), DisaggClient (13).

Each holds its engine cores in child processes (common/supervisor.py), tokenizes and validates
in the front end (InputProcessor: the cores never see text), detokenizes (OutputProcessor) and
streams each request's outputs to the coroutine that awaits them. Where a request goes (the router's
pick, or a prefill core then a decode core) and what a core's death does are each front end's
own (`_admit`, `abort`, `_end`, `_replica_died`); the plumbing around them is written once,
here: a request refused while draining or when its id runs already, its outputs streamed until
it finishes (a consumer that stops early aborts it), the requests in flight counted and
drained, a message sent to a core (one that cannot be reached is dead), the cores stopped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

from stages.common.supervisor import Supervisor

from ..async_llm import EngineDeadError, _Job
from ..input_processor import InputProcessor
from ..request import Request, RequestOutput
from .core_messages import EngineCoreRequest
from .engine_core import CoreProcess
from .output_processor import OutputProcessor

F = TypeVar("F")  # what a front end records of a request in flight


class CoreClient(ABC, Generic[F]):
    """AsyncLLM's request plumbing over engine-core processes. A subclass starts its cores and
    sets the attributes below; it says where a request goes and how one ends."""

    replicas: list[CoreProcess]
    input_processor: InputProcessor
    output_processor: OutputProcessor
    closing: str | None  # why new requests are refused (draining), else None
    _supervisor: Supervisor[CoreProcess]
    _lock: threading.Lock  # the requests in flight and the output processor
    _in_flight: dict[str, F]  # request id -> its record, under the lock

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
    def _replica_died(self, index: int, how: str) -> None:
        """Fail the requests core `index` holds (`how` it died)."""
