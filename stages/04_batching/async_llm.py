"""The engine on its own thread, streaming each request's tokens into asyncio.

Stage 01 ran the model inside the HTTP handler, on the event loop: while it computed, the server
could not even answer `/health`. Here the event loop only does I/O. Handlers submit requests to
a queue; one worker thread runs the engine (PyTorch releases the GIL inside its kernels, so the
loop stays responsive) and hands every new token back to the loop with `call_soon_threadsafe`.
Each request gets an asyncio queue of `RequestOutput` snapshots, which the server turns into
server-sent events as they arrive.

From this stage on the worker drives the engine step by step: it moves newly arrived requests
into the engine, applies aborts, runs one `step()`, and routes each output to its request. How
requests share a step is the engine's business: here the scheduler lets every concurrent HTTP
request join the running batch at the next step.
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
        """Stop a request at its next step (or before it starts); its output ends 'abort'."""
        with self._lock:
            if request_id in self._active:
                self._abort_requested.add(request_id)

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        with self._lock:
            return len(self._active)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- the worker thread
    def _admit_new_jobs(self, jobs: dict[str, _Job]) -> bool:
        """Move submitted requests into the engine; wait for one if the engine is idle.
        Returns False when asked to shut down."""
        block = not self.engine.has_unfinished()
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            jobs[job.request.request_id] = job
            self.engine.add_request(job.request)
            block = False

    def _apply_aborts(self, jobs: dict[str, _Job]) -> None:
        with self._lock:
            aborted, self._abort_requested = self._abort_requested, set()
        for request_id in aborted:
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(jobs, output)

    def _deliver(self, jobs: dict[str, _Job], output: RequestOutput) -> None:
        job = jobs[output.request_id]
        job.emit(output)
        if output.finished:
            del jobs[output.request_id]
            with self._lock:
                self._active.discard(output.request_id)
                self._abort_requested.discard(output.request_id)
                self.num_finished += 1
                self.num_aborted += output.finish_reason == FINISH_ABORT

    def _run(self) -> None:
        jobs: dict[str, _Job] = {}
        while self._admit_new_jobs(jobs):
            self._apply_aborts(jobs)
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                for request_id, job in list(jobs.items()):
                    output = self.engine.abort_request(request_id)
                    job.emit(exc)
                    if output is not None:
                        self._deliver(jobs, output)
                continue
            for output in outputs:
                self._deliver(jobs, output)
