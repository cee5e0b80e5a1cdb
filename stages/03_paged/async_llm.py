"""The engine on its own thread, streaming each request's tokens into asyncio.

Stage 01 ran the model inside the HTTP handler, on the event loop: while it computed, the server
could not even answer `/health`. Here the event loop only does I/O. Handlers submit requests to
a queue; one worker thread drives the engine's step loop (PyTorch releases the GIL inside its
kernels, so the loop stays responsive): it moves newly arrived requests into the engine, applies
aborts, runs one `step()`, and hands each output back to the loop with `call_soon_threadsafe`.
Each request gets an asyncio queue of `RequestOutput`s, which the server turns into server-sent
events as they arrive.

How requests share a step is the scheduler's business, not this loop's: stage 02's scheduler
runs them one at a time, in arrival order; stage 03 batches them statically, stage 04
continuously, and this loop stays the same.

Failures: an error tied to one request ends that request (its output carries the error) and the
loop goes on. An exception that escapes `step()` means the engine itself is broken: every job
fails with that error, `dead` names the cause (the server's `/health` turns 503) and new
requests are refused. `drain` is the bounded shutdown: refuse new requests, give the running
ones a grace period, then end the rest with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import LLMEngine
from .request import FINISH_ABORT, Request, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


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

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._active: set[str] = set()  # submitted and not yet finished
        self._abort_requested: set[str] = set()
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.largest_step = 0  # most requests that advanced in one step (1 without batching)
        self.dead: str | None = None  # why the engine loop stopped, if it did
        self.closing: str | None = None  # set by drain(): new requests are refused
        self._end_all: str | None = None  # set by drain() when the grace period is over
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs (in its output kind) until it finishes.

        If the consumer stops early (the client disconnected), the request is aborted
        (`abort`). An exception the loop sends for the request is raised. Refused: a request
        id already running (ValueError "... is already running"), and any request once the
        engine is dead or draining (EngineDeadError).
        """
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # under the lock: a job is either queued before death or refused
            if self.dead is not None:
                raise EngineDeadError(f"the engine has stopped: {self.dead}")
            if self.closing is not None:
                raise EngineDeadError(self.closing)
            if request.request_id in self._active:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._active.add(request.request_id)
            self._jobs.put(job)
        finished = False
        try:
            while True:
                item = await job.outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already let go of it
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

    def drain(self, grace_seconds: float, reason: str = "the server is shutting down") -> None:
        """Refuse new requests, wait up to `grace_seconds` for the running ones to finish, then
        end every request still in flight with `reason` (streams get an error frame and
        [DONE]). Returns once none is left."""
        with self._lock:
            self.closing = reason
        deadline = time.monotonic() + grace_seconds
        while self.num_pending and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        with self._lock:
            self._end_all = reason
        while self.num_pending and self._thread.is_alive():
            time.sleep(0.05)

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
            block = False
            try:
                self.engine.add_request(job.request)
            except ValueError as exc:  # this request's problem, not the engine's
                job.emit(exc)
                self._retire(job.request.request_id, aborted=True)
                continue
            jobs[job.request.request_id] = job

    def _apply_aborts(self, jobs: dict[str, _Job]) -> None:
        with self._lock:
            aborted, self._abort_requested = self._abort_requested, set()
            end_all = self._end_all
        if end_all is not None:  # the drain's grace period is over
            for request_id, job in list(jobs.items()):
                self.engine.abort_request(request_id)
                job.emit(EngineDeadError(end_all))
                del jobs[request_id]
                self._retire(request_id, aborted=True)
        for request_id in aborted:
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(jobs, output)

    def _deliver(self, jobs: dict[str, _Job], output: RequestOutput) -> None:
        job = jobs[output.request_id]
        job.emit(output)
        if output.finished:
            del jobs[output.request_id]
            self._retire(output.request_id, output.finish_reason == FINISH_ABORT)

    def _fail_if_stuck(self, jobs: dict[str, _Job]) -> None:
        """A step that scheduled nothing with nothing in flight would repeat for ever
        (`LLMEngine.check_progress`): the loop would spin and every request would wait. End the
        request the scheduler cannot place (the head of the queue) with that error, so the loop
        never spins and the requests behind it get their turn."""
        if (stuck := self.engine.fail_stuck_request()) is None:
            return
        request_id, exc = stuck
        job = jobs.pop(request_id, None)
        if job is not None:
            job.emit(exc)
        self._retire(request_id, aborted=True)

    def _retire(self, request_id: str, aborted: bool) -> None:
        with self._lock:
            self._active.discard(request_id)
            self._abort_requested.discard(request_id)
            self.num_finished += 1
            self.num_aborted += aborted

    def _run(self) -> None:
        """The engine loop, on the worker thread: admit submitted requests, apply aborts, run
        one step, deliver each output to its job. If a step raises, the engine is broken: every
        job fails with that error and `dead` says why."""
        jobs: dict[str, _Job] = {}
        try:
            while self._admit_new_jobs(jobs):
                self._apply_aborts(jobs)
                outputs = self.engine.step()
                self.num_steps += 1
                self.largest_step = max(self.largest_step, len(outputs))
                for output in outputs:
                    self._deliver(jobs, output)
                self._fail_if_stuck(jobs)
        except BaseException as exc:  # the engine itself failed: nothing can run any more
            with self._lock:
                self.dead = f"{type(exc).__name__}: {exc}"
            error = EngineDeadError(f"the engine has stopped: {self.dead}")
            while True:  # fail every job, including those still queued
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs[job.request.request_id] = job
            for request_id, job in jobs.items():
                job.emit(error)
                self._retire(request_id, aborted=True)
