r"""Tensor parallelism's executor: rank 0 in the engine's process, ranks 1..N-1 in workers.

Each step the engine's plain `SchedulerOutput` is pickled once and written to every worker's
pipe (`send_bytes`): one small write per worker, and the engine's thread never waits for a
worker to read it, so async scheduling still overlaps the next step's host work with this
step's forward. (bench.py measures this against a gloo `broadcast_object_list`, which blocks
the sender until every rank has taken part.) Every rank then builds its own inputs from the same
output and runs the same model runner on its shard; the collectives inside the forward keep the
ranks in step. Every rank samples, and the counter-based sampler draws the same token on each
(the logits are all-gathered, identical everywhere), so the next step's placeholders and
drafts are filled on every rank without sending tokens around; only rank 0 returns them.

Placement (parallel/placement.py): on GPUs rank r of an engine on cuda:b runs on cuda:b+r, and every
process makes its rank's GPU current before it touches CUDA (`worker.bind_device`).

Failure: the workers are supervised as every stage's children are (common/supervisor.py: one reader
thread per worker watches its pipe and process). A worker that exits or reports an error marks
the executor failed with a message naming the rank, its pid and its exit (the rank that failed
first: a killed rank's neighbours fail in their collectives and exit too, so the executor
weighs every rank's end before it names one); the next step raises `WorkerDiedError`, which
fails every request (each rank holds part of every request) and turns the server's `/health`
into a 503. Rank 0's step is never waited for blindly: a collective waiting on a dead rank
fails by itself on gloo (its socket closes), but on NCCL it never returns, so the engine polls
the step (common/step_wait.py) and gives up as soon as a reader thread marks the executor failed, or
after `distributed_timeout_seconds`. NCCL's own watchdog is the last resort: the engine asks it
to abort the communicators but not the process (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`), so a
server lives on to say 503. Workers die with the engine: `shutdown` (also run when the engine
is garbage collected or the interpreter exits) stops them, and a worker whose engine vanished
(killed, crashed) exits by itself (supervisor.exit_when_orphaned).

KV transfers (stage 12): every rank moves its own shard of a transfer's blocks and reports what
ended (a worker after each step it runs); `take_kv_connector_output` combines the reports.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import resolve_distributed_backend
from stages.common.model_config import ModelConfig
from stages.common.step_wait import wait_until
from stages.common.supervisor import Supervisor, ending, first_failed

from ..config import EngineConfig
from ..kv_connector.base import KVConnectorOutput, KVOutputAggregator
from ..model_runner import ModelRunner, StepHandle
from ..scheduler import SchedulerOutput
from .group import check_tensor_parallel_fits, init_tensor_parallel, open_rendezvous
from .placement import rank_devices, ranks_sharing
from .worker import WorkerSpec, bind_device, worker_main

BLAME_GRACE_SECONDS = 0.5  # after a rank's end, how long the others get to show theirs
# NCCL's watchdog, when a collective outlives the timeout: 2 aborts the communicators and leaves
# the process alive (the engine's: it may be the server); torch's default (3) ends the process.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot run another step."""


class _WatchedStep(StepHandle):
    """Rank 0's step, waited for by `wait` (MultiprocExecutor._step_result): given up when a
    worker dies, and then the error names the worker."""

    def __init__(self, step: StepHandle, wait: Callable[[StepHandle], Any]) -> None:
        super().__init__(step.request_ids, list, step.done)
        self._step, self._wait_for = step, wait

    def result(self) -> dict[str, list[int]]:
        return self._wait_for(self._step)


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection
    replies: list[Any]  # call results, in order, filled by its reader thread
    kv_reports: list[KVConnectorOutput] = field(default_factory=list)  # not yet combined
    kv_reported: int = 0  # how many steps it has reported on


class MultiprocExecutor:
    """Rank 0 in the engine's process, ranks 1..N-1 in worker processes it starts."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        size = config.tensor_parallel_size
        if not config.expert_parallel:  # expert parallelism replicates attention: no split
            check_tensor_parallel_fits(model_config, size)
        self.tensor_parallel_size = size
        self._timeout = config.distributed_timeout_seconds
        self._sent: tuple[int, int, float] = (0, 0, 0.0)  # sends, bytes, seconds
        self.failure: str | None = None
        self._replied = threading.Condition()
        self._kv_aggregator = KVOutputAggregator(size)
        self._kv_steps = 0  # steps the workers report on (sent, with a connector)
        self._kv_resolved = 0  # ... of which the engine has taken the tokens
        backend = resolve_distributed_backend(config.distributed_backend, device.type)
        # NCCL on too few GPUs: refused before any process starts; gloo shares them.
        devices = rank_devices(device, size, backend=backend)
        if config.ranks_per_device is None:  # the default KV budget splits a device's memory
            config = replace(config, ranks_per_device=ranks_sharing(devices))
        store, init_method = open_rendezvous(size, config.distributed_timeout_seconds)
        self._workers: list[_Worker] = []
        self._supervisor: Supervisor = Supervisor()  # stops the workers when the engine goes
        try:
            for rank in range(1, size):
                spec = WorkerSpec(
                    rank=rank,
                    size=size,
                    init_method=init_method,
                    backend=backend,
                    config=config,
                    model_path=model_path,
                    model_config=model_config,
                    device=devices[rank],
                    dtype=dtype,
                )
                label = f"tensor-parallel rank {rank}"
                child = self._supervisor.start(worker_main, (spec,), f"tp-rank-{rank}", label)
                self._workers.append(_Worker(rank, child.process, child.conn, []))
            self._supervisor.wait_for("started", WorkerDiedError)
            bind_device(devices[0])  # before NCCL's set-up touches the current device
            if backend == "nccl":
                os.environ.setdefault(*NCCL_ERROR_HANDLING)
            tp = init_tensor_parallel(
                0, size, init_method, backend, config.distributed_timeout_seconds, store
            )
            self.driver = ModelRunner(config, model_path, model_config, devices[0], dtype, tp=tp)
            self._supervisor.wait_for("ready", WorkerDiedError)
        except BaseException as exc:
            reason = self._supervisor.reported_error({"error"})  # it explains rank 0's error
            self.shutdown()
            if reason is not None:
                raise WorkerDiedError(reason) from exc
            raise
        self._supervisor.watch(
            self,
            {"reply", "kv_output"},
            MultiprocExecutor._on_message,
            MultiprocExecutor._on_end,
            lambda index: f"tp-reader-{index + 1}",
        )

    # ------------------------------------------------------------------------- steps
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Send the step to every worker, then start it here; rank 0's handle returns tokens.

        The order is `("execute_model", (scheduler_output,))`, sent by `_send` (pickled once,
        one pipe write per worker, counted in `send_stats`); a step with no request and no KV
        transfer is sent to no worker. A failed executor raises (`check_alive`) before it
        sends anything. Rank 0's `driver.launch` handle comes back wrapped in `_WatchedStep`
        with `_step_result`, so that waiting for its tokens gives up when a worker dies. The
        launch itself is `_checked` too: on CUDA rank 0's forward runs inside it (gloo's
        collective on a CUDA tensor blocks the host), so a dead peer's socket error is raised
        here, not by the result, and must name the dead rank all the same."""
        self.check_alive()
        # An empty step runs nowhere; one with KV transfers runs on every rank (each its shard).
        sent = bool(scheduler_output.requests) or scheduler_output.kv_connector_metadata is not None
        if sent:
            self._send(("execute_model", (scheduler_output,)))
        step = self._checked(lambda: self.driver.launch(scheduler_output))
        if not (sent and getattr(self.driver, "kv_connector", None) is not None):
            return _WatchedStep(step, self._step_result)
        self._kv_steps += 1  # every worker reports on this step once it has run it
        return _WatchedStep(step, functools.partial(self._step_result, reported=self._kv_steps))

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        return self.launch(scheduler_output).result()

    def call(self, method: str, *args: Any) -> Any:
        """Run `ModelRunner.method(*args)` on every rank (it may hold collectives); rank 0's
        result. Waits for every worker's answer, so an error on any rank surfaces here."""
        return self._call("call", method, args)[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of `ModelRunner.method(*args)`, in rank order (small results
        only: they come back through the pipes)."""
        return self._call("call_all", method, args)

    def take_kv_connector_output(self) -> KVConnectorOutput:
        """Every rank's KV transfer report (rank 0's from its runner, the workers' from their
        pipes), combined by kv_connector.KVOutputAggregator: ended when every rank says so,
        failed when any does. First waits (as long as a call may) for every worker's report of
        each step whose tokens the engine took: a transfer all ranks end in one step ends there."""
        reports = [self.driver.take_kv_connector_output()]
        deadline = time.monotonic() + self._timeout
        with self._replied:
            while any(w.kv_reported < self._kv_resolved for w in self._workers):
                self.check_alive()
                if not self._replied.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise WorkerDiedError("no KV transfer report from every rank in time")
            for worker in self._workers:
                reports += worker.kv_reports
                worker.kv_reports = []
        return self._kv_aggregator.aggregate(reports)

    def _call(self, kind: str, method: str, args: tuple[Any, ...]) -> list[Any]:
        self.check_alive()
        counts = [len(w.replies) for w in self._workers]
        self._send((kind, (method, args)))
        result = self._checked(lambda: getattr(self.driver, method)(*args))
        deadline = time.monotonic() + self._timeout
        with self._replied:
            while any(len(w.replies) <= n for w, n in zip(self._workers, counts, strict=True)):
                self.check_alive()
                if not self._replied.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise WorkerDiedError(f"no answer to {method!r} from every rank in time")
            return [result, *(w.replies[n] for w, n in zip(self._workers, counts, strict=True))]

    # ------------------------------------------------------------------------- health
    def check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def workers(self) -> list[dict[str, Any]]:
        """Rank, pid and liveness of every worker (the server's /health shows them)."""
        return [
            {"rank": w.rank, "pid": w.process.pid, "alive": w.process.poll() is None}
            for w in self._workers
        ]

    def shutdown(self) -> None:
        """Stop every worker (ask, wait a little, then kill). Safe to call twice."""
        self._supervisor.stop()

    # ------------------------------------------------------------------------- internals
    def send_stats(self) -> dict[str, float]:
        """What shipping the steps has cost so far: sends, bytes and microseconds per send
        (pickling once, then one pipe write per worker)."""
        count, size, seconds = self._sent
        return {
            "sends": count,
            "bytes_per_send": size / max(1, count),
            "us_per_send": 1e6 * seconds / max(1, count),
        }

    def _send(self, message: tuple[str, tuple[Any, ...]]) -> None:
        started = time.perf_counter()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # once, for all
        unreachable: list[str] = []
        for worker in self._workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError as exc:
                unreachable.append(f"tensor-parallel rank {worker.rank} cannot be reached: {exc}")
        if unreachable:  # the readers' verdict (_on_end) names the rank that died first, and how
            self._await_failure()
            self._fail(unreachable[0])  # only if the readers said nothing
        count, size, seconds = self._sent
        self._sent = (count + 1, size + len(payload), seconds + time.perf_counter() - started)
        self.check_alive()

    def _step_result(self, step: StepHandle, reported: int = 0) -> dict[str, list[int]]:
        """Rank 0's tokens, once its step is done. Polled, never a blind wait: given up as soon
        as a worker has failed (WorkerDiedError naming it) or, if no step ends in
        `distributed_timeout_seconds`, with the executor marked failed (a rank is stuck).
        `reported`: the step's number among those the workers report KV transfers on."""

        def wait() -> dict[str, list[int]]:
            try:
                wait_until(step.done, lambda: self.failure, self._timeout)
            except TimeoutError as exc:
                self._fail(f"a step ran past distributed_timeout_seconds={self._timeout:g}: {exc}")
                raise WorkerDiedError(self.failure) from exc
            return step.result()

        tokens = self._checked(wait)
        if reported:  # its tokens are taken: every worker's report of it is due
            self._kv_resolved = max(self._kv_resolved, reported)
        return tokens

    def _checked(self, run: Callable[[], Any]) -> Any:
        """Run `run()`; if it fails while a worker has failed, say which worker."""
        try:
            return run()
        except Exception as exc:
            self._await_failure()
            if self.failure is not None:
                raise WorkerDiedError(self.failure) from exc
            raise

    def _await_failure(self, seconds: float = 2.0) -> None:
        """Something broke (a collective, a pipe write) and a worker may be dead: give the
        reader threads a moment to weigh every rank's end (they learn of a death just after,
        and name the rank killed first, not a neighbour that failed in its collective)."""
        deadline = time.monotonic() + seconds
        with self._replied:
            while self.failure is None and time.monotonic() < deadline:
                self._replied.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _on_message(self, index: int, kind: str, detail: Any) -> None:
        """A worker's reply to a call, or its KV transfer report (its reader hands it here)."""
        worker = self._workers[index]
        with self._replied:
            if kind == "kv_output":  # the transfers that ended on its shard, after a step
                worker.kv_reports.append(detail)
                worker.kv_reported += 1
            else:
                worker.replies.append(detail)
            self._replied.notify_all()

    def _on_end(self, index: int, how: str) -> None:
        """A worker ended (its error, its pipe closed, or its process gone): fail the executor
        naming the rank that failed first (supervisor.first_failed), after a short grace in
        which every rank the failure touched shows it (each worker's reader notes its end)."""
        if self.failure is not None:
            return
        time.sleep(BLAME_GRACE_SECONDS)
        if not self._supervisor.stopped.is_set():
            child = first_failed([c for c in self._supervisor.children if c.ended()])
            self._fail(f"{child.name} {ending(child.process, child.last_word)}")

    def _fail(self, reason: str) -> None:
        with self._replied:
            if self.failure is None:
                self.failure = reason
            self._replied.notify_all()
