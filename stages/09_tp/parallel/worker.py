"""A tensor-parallel worker process: ranks 1..N-1 of the engine's model.

A worker makes its GPU the current device first (`bind_device`: before NCCL or anything else
touches CUDA, which would otherwise use cuda:0), joins the process group, loads its shard into
its own `ModelRunner`, says "ready", then runs what the engine's executor sends, in order: each
step's `SchedulerOutput` (`execute_model`, no answer: only rank 0 returns tokens) or a call
every rank must make because it holds collectives (`prompt_logits`), answered with a short
acknowledgement.

It never outlives the engine: it reads its orders from a pipe whose other end only the engine
holds, so when the engine dies the read ends (EOF) and the worker exits; a watchdog thread also
exits it if its parent process changes (the engine was killed while the worker was busy), and a
collective waiting on a dead engine fails when the socket closes. Ctrl-C reaches every process
of a terminal's group: the worker ignores it and lets the engine decide (it stops its workers
on the way out). Any exception is reported to the engine, then the worker exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from stages.common.model_config import ModelConfig
from stages.common.supervisor import exit_when_orphaned

from ..config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (picklable: it crosses the spawn)."""

    rank: int
    size: int
    init_method: str
    backend: str
    config: EngineConfig
    model_path: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (spawned by multiproc_executor.MultiprocExecutor)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_orphaned(os.getppid())
    # Ranks share the host's cores on a CPU: each takes its share, so none oversubscribes. A
    # user's OMP_NUM_THREADS wins (the test suite sets 1: its two workers already fill two cores).
    if spec.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    try:
        bind_device(spec.device)  # before anything touches CUDA
        conn.send(("started", os.getpid()))
        from ..model_runner import ModelRunner  # after the "started": imports take seconds
        from .group import init_tensor_parallel

        timeout = spec.config.distributed_timeout_seconds
        tp = init_tensor_parallel(spec.rank, spec.size, spec.init_method, spec.backend, timeout)
        runner = ModelRunner(
            spec.config, spec.model_path, spec.model_config, spec.device, spec.dtype, tp=tp
        )
        conn.send(("ready", runner.num_blocks))
        _serve(runner, conn)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # nothing to save: skip the interpreter's teardown (~0.6 s with torch)
    except BaseException:  # reported, then the process ends: the engine fails its requests
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc(limit=8)))
        os._exit(1)


def _serve(runner: object, conn: Connection) -> None:
    """Run the engine's orders until it says stop or goes away.

    An order is a pickled `(method, args)` read with `conn.recv_bytes()`, run in the order
    sent: `("execute_model", (scheduler_output,))` runs `runner.execute_model(*args)` and sends
    no answer (rank 0 returns the tokens); `("call", (name, call_args))` and `("call_all",
    (name, call_args))` run `getattr(runner, name)(*call_args)` and answer with `conn.send`:
    `("reply", name)` for a call (an acknowledgement), `("reply", result)` for a call_all
    (the executor's `call_all` returns every rank's result); `("shutdown", ())` returns. The
    engine gone (EOFError or OSError on the pipe) returns too."""
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            return
        if method == "shutdown":
            return
        if method == "execute_model":
            runner.execute_model(*args)  # type: ignore[attr-defined]
        elif method in ("call", "call_all"):  # answered: its name, or its result
            name, call_args = args
            result = getattr(runner, name)(*call_args)
            conn.send(("reply", result if method == "call_all" else name))


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (nothing on a CPU, or for a bare "cuda",
    which means the current one). Work queued outside a step's stream context (`prompt_logits`,
    NCCL's set-up, a kernel launched by Triton) goes to the current device: without this, to
    cuda:0 whatever the rank's own GPU is, with tensors that live on another."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
