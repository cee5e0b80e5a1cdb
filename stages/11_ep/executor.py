r"""Executors: how the engine runs its model, in its own process or across tensor-parallel ranks.

    engine --SchedulerOutput--> executor --> rank 0: ModelRunner (in the engine's process)
                                         \-> ranks 1..N-1: worker processes (worker.py)

The seam is vLLM's (`UniProcExecutor`, `MultiprocExecutor`); the shape is nano-vllm's: rank 0
runs in the engine's process, so a step costs no extra hop for the rank that returns tokens.

Each step the engine's plain `SchedulerOutput` is pickled once and written to every worker's
pipe (`send_bytes`): one small write per worker, and the engine's thread never waits for a
worker to read it, so async scheduling still overlaps the next step's host work with this
step's forward. (bench.py measures this against a gloo `broadcast_object_list`, which blocks
the sender until every rank has taken part.) Every rank then builds its own inputs from the same
output and runs the same model runner on its shard; the collectives inside the forward keep the
ranks in step. Every rank samples, and the counter-based sampler draws the same token on each
(the logits are all-gathered, identical everywhere), so the next step's placeholders and
drafts are filled on every rank without sending tokens around; only rank 0 returns them.

Placement: on GPUs rank r of an engine on cuda:b runs on cuda:b+r, one GPU each (`rank_devices`;
stage 10 gives each data-parallel replica its own b), and with NCCL too few GPUs is refused before
any worker starts. Gloo (`distributed_backend`) takes CUDA tensors too, staged through host
memory, and lets ranks share a GPU: rank r then runs on cuda:(b+r) mod the visible GPUs, and the
default KV budget splits each GPU's free memory between the ranks on it (`ranks_per_device`, as
the ranks of a CPU host always did). Every process makes its rank's GPU current before it
touches CUDA (`worker.bind_device`), so what runs outside a step's stream (`prompt_logits`,
NCCL's set-up) lands there too, not on cuda:0.

Failure: a monitor thread watches every worker's pipe and process. A worker that exits or
reports an error marks the executor failed with a message naming the rank, its pid and its
exit (the rank that failed first: a killed rank's neighbours fail in their collectives and
exit too, so the monitor weighs every rank's end before it names one); the next step raises
`WorkerDiedError`, which fails every request (each rank holds part of every request) and turns
the server's `/health` into a 503. Rank 0's step is never waited
for blindly: a collective waiting on a dead rank fails by itself on gloo (its socket closes),
but on NCCL it never returns, so the engine polls the step (step_wait.py) and gives up as soon
as the monitor marks the executor failed, or after `distributed_timeout_seconds`. NCCL's own
watchdog is the last resort: the engine process asks it to abort the communicators without
killing the process (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`), so a server lives on to say 503.
Workers die with the engine: `shutdown` (also run when the engine is garbage collected or the
interpreter exits) stops them, and a worker whose engine vanished (killed, crashed) exits by
itself (worker.py).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import resolve_distributed_backend
from stages.common.model_config import ModelConfig
from stages.common.server_process import free_port
from stages.common.spawn import start_stage_process

from .config import EngineConfig
from .model_runner import ModelRunner, StepHandle
from .parallel import check_tensor_parallel_fits, init_tensor_parallel
from .scheduler import SchedulerOutput
from .step_wait import wait_until
from .worker import WorkerSpec, bind_device, worker_main

START_TIMEOUT_SECONDS = 300.0  # a worker imports torch and loads its shard within this
STOP_TIMEOUT_SECONDS = 5.0  # a worker asked to stop exits within this, or is killed
WATCH_SECONDS = 0.2  # how often the monitor looks at the workers' processes
BLAME_GRACE_SECONDS = 0.5  # after a rank's end, how long the others get to show theirs
# NCCL's watchdog, when a collective outlives the timeout: 2 aborts the communicators and leaves
# the process alive (the engine's: it may be the server); torch's default (3) ends the process.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited or failed: the engine cannot run another step."""


class UniProcExecutor:
    """Stage 08's behaviour: the model runner in the engine's own process."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        bind_device(device)
        self.driver = ModelRunner(config, model_path, model_config, device, dtype)
        self.tensor_parallel_size = 1

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return self.driver.launch(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        return self.launch(scheduler_output).result()

    def call(self, method: str, *args: Any) -> Any:
        """Run `ModelRunner.method(*args)` (on every rank; here there is one)."""
        return getattr(self.driver, method)(*args)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of `ModelRunner.method(*args)`, in rank order."""
        return [self.call(method, *args)]

    def check_alive(self) -> None:
        """Raise WorkerDiedError if a rank has failed (never, with one rank)."""

    def workers(self) -> list[dict[str, Any]]:
        return []

    def shutdown(self) -> None:
        """Nothing to stop."""


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
    replies: list[Any]  # call results, in order, filled by the monitor thread
    error: str | None = None  # the error it reported, if it did
    ended_at: float | None = None  # when the monitor saw its error or its pipe close


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
        backend = resolve_distributed_backend(config.distributed_backend, device.type)
        # NCCL on too few GPUs: refused before any process starts; gloo shares them.
        devices = rank_devices(device, size, backend=backend)
        if config.ranks_per_device is None:  # the default KV budget splits a device's memory
            config = replace(config, ranks_per_device=ranks_sharing(devices))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._workers: list[_Worker] = []
        self._stopped = threading.Event()
        for rank in range(1, size):
            spec = WorkerSpec(
                rank=rank, size=size, init_method=init_method, backend=backend,
                config=config, model_path=model_path, model_config=model_config,
                device=devices[rank], dtype=dtype,
            )  # fmt: skip
            # A fresh interpreter (not fork: it would copy this process's threads and locks).
            process, conn = start_stage_process(worker_main, (spec,), name=f"tp-rank-{rank}")
            self._workers.append(_Worker(rank, process, conn, []))
        # Stop the workers when the engine goes away, however it goes (no reference to self).
        self._finalizer = weakref.finalize(self, _stop_workers, list(self._workers), self._stopped)
        try:
            self._wait_for("started")
            bind_device(devices[0])  # before NCCL's set-up touches the current device
            if backend == "nccl":
                os.environ.setdefault(*NCCL_ERROR_HANDLING)
            tp = init_tensor_parallel(
                0, size, init_method, backend, config.distributed_timeout_seconds
            )
            self.driver = ModelRunner(config, model_path, model_config, devices[0], dtype, tp=tp)
            self._wait_for("ready")
        except BaseException as exc:
            reason = self._worker_error()  # a worker's own error explains rank 0's
            self.shutdown()
            if reason is not None:
                raise WorkerDiedError(reason) from exc
            raise
        self._monitor = threading.Thread(
            target=_watch, args=(weakref.ref(self),), name="tp-monitor", daemon=True
        )
        self._monitor.start()

    # ------------------------------------------------------------------------- steps
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Send the step to every worker, then start it here; rank 0's handle returns tokens.

        The order is `("execute_model", (scheduler_output,))`, sent by `_send` (pickled once,
        one pipe write per worker, counted in `send_stats`); a step with no request is sent to
        no worker. A failed executor raises (`check_alive`) before it sends anything. Rank 0's
        `driver.launch` handle comes back wrapped in `_WatchedStep` with `_step_result`, so
        that waiting for its tokens gives up when a worker dies. The launch itself is
        `_checked` too: on CUDA rank 0's forward runs inside it (gloo's collective on a CUDA
        tensor blocks the host), so a dead peer's socket error is raised here, not by the
        result, and must name the dead rank all the same."""
        self.check_alive()
        if scheduler_output.requests:  # an empty step runs nowhere (the runner skips it)
            self._send(("execute_model", (scheduler_output,)))
        step = self._checked(lambda: self.driver.launch(scheduler_output))
        return _WatchedStep(step, self._step_result)

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
        self._finalizer()

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
        if unreachable:  # the monitor's verdict names the rank that died first, and how
            self._await_failure()
            self._fail(unreachable[0])  # only if the monitor said nothing
        count, size, seconds = self._sent
        self._sent = (count + 1, size + len(payload), seconds + time.perf_counter() - started)
        self.check_alive()

    def _step_result(self, step: StepHandle) -> dict[str, list[int]]:
        """Rank 0's tokens, once its step is done. Polled, never a blind wait: given up as soon
        as a worker has failed (WorkerDiedError naming it) or, if no step ends in
        `distributed_timeout_seconds`, with the executor marked failed (a rank is stuck)."""

        def wait() -> dict[str, list[int]]:
            try:
                wait_until(step.done, lambda: self.failure, self._timeout)
            except TimeoutError as exc:
                self._fail(f"a step ran past distributed_timeout_seconds={self._timeout:g}: {exc}")
                raise WorkerDiedError(self.failure) from exc
            return step.result()

        return self._checked(wait)

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
        monitor a moment to weigh every rank's end (it learns of a death just after, and names
        the rank killed first, not a neighbour that failed in its collective)."""
        deadline = time.monotonic() + seconds
        with self._replied:
            while self.failure is None and time.monotonic() < deadline:
                self._replied.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _wait_for(self, stage: str) -> None:
        """Wait for every worker to report `stage`, failing fast if one dies first."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        for worker in self._workers:
            while not worker.conn.poll(0.1):
                if worker.process.poll() is not None:
                    code = worker.process.returncode
                    raise WorkerDiedError(
                        f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited "
                        f"with code {code} before it was {stage}"
                    )
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel rank {worker.rank} not {stage} in time")
            kind, detail = worker.conn.recv()
            if kind == "error":
                raise WorkerDiedError(f"tensor-parallel rank {worker.rank} failed: {detail}")
            if kind != stage:
                raise WorkerDiedError(f"tensor-parallel rank {worker.rank} sent {kind!r}")

    def _worker_error(self, seconds: float = 2.0) -> str | None:
        """The first error a worker reported while the engine started, if one did."""
        deadline = time.monotonic() + seconds
        for worker in self._workers:
            while worker.conn.poll(max(0.0, deadline - time.monotonic())):
                try:
                    kind, detail = worker.conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "error":
                    return f"tensor-parallel rank {worker.rank} failed: {detail}"
        return None

    def _take(self, worker: _Worker) -> None:
        """A message from `worker` is waiting: a call's reply, or its end (an error, or its
        pipe closed), which `_check_exits` weighs against the other ranks' ends."""
        try:
            kind, detail = worker.conn.recv()
        except (EOFError, OSError):  # it died: its exit code says more
            kind, detail = "error", None
        if kind != "error":
            with self._replied:
                worker.replies.append(detail)
                self._replied.notify_all()
        elif worker.ended_at is None:
            worker.error, worker.ended_at = detail, time.monotonic()

    def _check_exits(self) -> None:
        """Once a worker has ended or reported an error, fail the executor naming the rank that
        failed first. A killed rank breaks its neighbours' collectives: they report errors and
        exit too, often before the monitor sees the kill, so the first sign may be an innocent
        rank's. After a short grace, in which every rank the failure touched shows it, the
        blame goes to a rank killed by a signal, else to one that ended without a word, else
        to the first that reported an error."""
        if self._stopped.is_set() or not any(_ended(w) for w in self._workers):
            return
        time.sleep(BLAME_GRACE_SECONDS)
        for worker in self._workers:  # what the others said meanwhile
            with contextlib.suppress(EOFError, OSError):
                while worker.ended_at is None and worker.conn.poll():
                    self._take(worker)
        if not self._stopped.is_set():
            self._fail(_blame([w for w in self._workers if _ended(w)]))

    def _fail(self, reason: str) -> None:
        with self._replied:
            if self.failure is None:
                self.failure = reason
            self._replied.notify_all()


def _ended(worker: _Worker) -> bool:
    return worker.ended_at is not None or worker.process.poll() is not None


def _blame(ended: list[_Worker]) -> str:
    """Which of the ended workers failed first (`_check_exits`), and how, in words."""

    def suspicion(worker: _Worker) -> tuple[float, ...]:
        code = worker.process.poll()
        if code is not None and code < 0:  # killed by a signal: from outside, nobody's echo
            return (0, worker.rank)
        if worker.error is None:  # ended without a word
            return (1, worker.rank)
        return (2, worker.ended_at or 0.0, worker.rank)  # the first to report an error

    worker = min(ended, key=suspicion)
    name = f"tensor-parallel rank {worker.rank} (pid {worker.process.pid})"
    code = worker.process.poll()
    if worker.error is not None and (code is None or code >= 0):
        return f"{name} failed: {worker.error}"
    if code is None:
        return f"{name} closed its pipe"
    reason = f"{name} exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            reason += f" (killed by {signal.Signals(-code).name})"
    return reason


def _watch(executor_ref: weakref.ref[MultiprocExecutor]) -> None:
    """The monitor thread: read every worker's replies and notice any worker's end. It holds
    the executor only while handling an event, so an engine nobody uses can be collected (and
    its finalizer stop the workers)."""
    executor = executor_ref()
    if executor is None:
        return
    by_conn, stopped = {w.conn: w for w in executor._workers}, executor._stopped
    del executor
    while not stopped.is_set():
        try:
            ready = wait(list(by_conn), timeout=WATCH_SECONDS)
        except OSError:  # the pipes were closed: the workers are being stopped
            return
        executor = executor_ref()
        if executor is None or executor.failure is not None:
            return
        for conn in ready:
            executor._take(by_conn[conn])
        executor._check_exits()
        del executor


def make_executor(
    config: EngineConfig,
    model_path: Path,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> UniProcExecutor | MultiprocExecutor:
    """One rank: the runner in this process (stage 08). More: worker processes."""
    kind = UniProcExecutor if config.tensor_parallel_size == 1 else MultiprocExecutor
    return kind(config, model_path, model_config, device, dtype)


def _stop_workers(workers: list[_Worker], stopped: threading.Event) -> None:
    stopped.set()
    for worker in workers:
        with contextlib.suppress(OSError):  # already gone
            worker.conn.send_bytes(pickle.dumps(("shutdown", ())))
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        worker.conn.close()


def rank_devices(
    device: torch.device, size: int, num_gpus: int | None = None, *, backend: str = "nccl"
) -> list[torch.device]:
    """The device of each of `size` ranks of an engine on `device`. On GPUs rank r of an engine
    on cuda:b runs on cuda:b+r, one GPU each (vLLM offsets a data-parallel replica's ranks the
    same way); on a CPU every rank shares the host. With NCCL, ValueError when the GPUs run out
    (NCCL refuses two ranks on one GPU); with gloo, rank r wraps to cuda:(b+r) mod the visible
    GPUs. `num_gpus`: how many are visible (None: ask CUDA; given, CUDA is never asked)."""
    if device.type != "cuda":
        return [device] * size
    base = device.index or 0
    visible = torch.cuda.device_count() if num_gpus is None else num_gpus
    if backend == "gloo" and visible > 0:
        return [torch.device("cuda", (base + rank) % visible) for rank in range(size)]
    if base + size > visible:
        raise ValueError(
            f"tensor_parallel_size={size} on cuda:{base} needs GPUs cuda:{base}..cuda:"
            f"{base + size - 1}, but {visible} are visible"
        )
    return [torch.device("cuda", base + rank) for rank in range(size)]


def ranks_sharing(devices: list[torch.device]) -> int:
    """The most ranks on any one device: each rank's default KV budget is that device's free
    memory divided by this (every rank of a CPU host; with gloo, the ranks sharing a GPU)."""
    return max(devices.count(device) for device in devices)
