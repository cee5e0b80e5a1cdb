"""The engine on its own thread, streaming each request's tokens into asyncio.

Stage 01 ran the model inside the HTTP handler, on the event loop: while it computed, the server
could not even answer `/health`. Here the event loop only does I/O. Handlers submit requests to
a queue; one worker thread runs the engine (PyTorch releases the GIL inside its kernels, so the
loop stays responsive) and hands every new token back to the loop with `call_soon_threadsafe`.
Each request gets an asyncio queue of `RequestOutput` snapshots, which the server turns into
server-sent events as they arrive.

Requests still run one at a time, in arrival order: batching them is stage 03's and 04's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import LLM
from .request import FINISH_ABORT, Request, RequestOutput


@dataclass(eq=False)
class _Job:
    """A submitted request and the way back to the coroutine waiting on it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]

    def emit(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncLLM:
    """Async front of the engine: `async for output in async_llm.generate(request)`."""

    def __init__(self, engine: LLM) -> None:
        self.engine = engine
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._active: set[str] = set()  # submitted and not yet finished
        self._abort_requested: set[str] = set()
        self.num_finished = 0
        self.num_aborted = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield a snapshot after each token, the last one finished.

        If the consumer stops early (the client disconnected), the request is aborted.
        """
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._active.add(request.request_id)
        self._jobs.put(job)
        finished = False
        try:
            while True:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at its next token (or before it starts); its output ends 'abort'."""
        with self._lock:
            if request_id in self._active:
                self._abort_requested.add(request_id)

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (the one running plus the queue)."""
        with self._lock:
            return len(self._active)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- the worker thread
    def _should_abort(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._abort_requested

    def _retire(self, request: Request) -> None:
        with self._lock:
            self._active.discard(request.request_id)
            self._abort_requested.discard(request.request_id)
            self.num_finished += 1
            self.num_aborted += request.finish_reason == FINISH_ABORT

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            request = job.request
            try:
                if self._should_abort(request.request_id):
                    request.finish(FINISH_ABORT)
                    job.emit(request.output())
                    continue
                steps = self.engine.stream(request)
                for output in steps:
                    if self._should_abort(request.request_id) and not output.finished:
                        steps.close()  # the engine marks the request aborted
                        output = request.output()
                    job.emit(output)
                    if output.finished:
                        break
            except Exception as exc:  # one bad request must not kill the loop
                request.finish(FINISH_ABORT)
                job.emit(exc)
            finally:
                self._retire(request)
