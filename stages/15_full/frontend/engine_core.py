"""An engine core process: one data-parallel replica, driven by messages on a pipe.

The front end (frontend/dp_client.py) starts one per replica with `start_stage_process`. The core
builds an `LLMEngine` (with its own tensor-parallel workers if `tensor_parallel_size > 1`), says
"ready", then runs vLLM V1's busy loop (`EngineCoreProc.run_busy_loop`):

    take every message waiting (add, abort, shutdown): without blocking while there is work,
    else wait on the pipe (with a timeout, so a vanished parent is noticed);
    step(); send one EngineCoreOutputs: the step's new tokens, the KV events, the queue lengths.

Stage 15: ("watch", True) makes the core build a view of every step (observability/live_view.py),
sent in `EngineCoreOutputs.step_views`; ("watch", False) stops it. Unwatched, a core builds none.

A prefill or decode engine of a disaggregated pair (stage 13) also relays its transfer messages
through the front end: "peer" messages in, `peer_messages` out. While a transfer is under way
and nothing else can run, the loop polls the pipe every `TRANSFER_POLL_SECONDS` instead of
spinning, and sends nothing when a step did nothing.

It never detokenizes: its requests carry no detokenizer and no stop strings (the front end's
OutputProcessor does both). A request that cannot be added, or that the scheduler can never
place, fails alone: its output carries the error. An exception from `step()` means the core is
broken: the traceback goes to the front end as "fatal" and the process exits. It dies with its
front end, like a tensor-parallel worker: the pipe's EOF, or a watchdog on the parent pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stages.common.devices import place_cpu_threads, requested_device
from stages.common.supervisor import Child, exit_when_orphaned

from ..observability.live_view import StepWatcher
from ..observability.metrics import engine_counters
from ..request import FINISH_ERROR, Request, RequestOutput
from .core_messages import CoreReady, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

IDLE_WAIT_SECONDS = 0.5  # an idle core waits this long on its pipe before looking again
TRANSFER_POLL_SECONDS = 0.002  # ... and this long while only a KV transfer is under way


@dataclass(frozen=True)
class EngineCoreSpec:
    """Everything a replica needs to build its engine (picklable: it crosses the spawn)."""

    replica: int
    model: str
    config: dict[str, Any]  # EngineConfig fields, data_parallel_size left out
    replicas: int = 1  # engine cores sharing the host's CPU cores (devices.place_cpu_threads)


@dataclass(eq=False)
class CoreProcess(Child):
    """An engine core's process as its front end sees it (frontend/dp_client.py, stage 13's
    pair)."""

    devices: list[str] = field(default_factory=list)  # its ranks' devices, rank 0 first
    num_waiting: int = 0  # its queue lengths, as its last output reported them
    num_running: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # its latest (stage 15)


class _Shutdown(Exception):
    """The front end asked the core to stop, or went away."""


def run_engine_core(spec: EngineCoreSpec, conn: Connection) -> None:
    """Process main of one replica."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the front end decides
    exit_when_orphaned(os.getppid())
    try:
        from ..engine import LLMEngine  # imports take seconds

        place_cpu_threads(requested_device(spec.config.get("device")), spec.replicas)
        engine = LLMEngine(spec.model, **spec.config)
        conn.send(
            (
                "ready",
                CoreReady(
                    spec.replica,
                    os.getpid(),
                    engine.max_model_len,
                    engine.block_size,
                    engine.weight_format,
                ),
            )
        )
        _busy_loop(spec.replica, engine, conn)
    except _Shutdown:
        pass
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("fatal", f"engine replica {spec.replica}: " + traceback.format_exc(limit=8)))
        os._exit(1)
    with contextlib.suppress(Exception):
        engine.shutdown()  # its tensor-parallel workers, if any


def _busy_loop(replica: int, engine: Any, conn: Connection) -> None:
    """Take every message waiting (add, abort, shutdown: without blocking while the engine has
    work, else waiting a little), then run one step and send its `EngineCoreOutputs`; a
    request that fails on arrival fails alone. Ends (`_Shutdown`) on "shutdown" or when the
    front end's end of the pipe closes."""
    eos = frozenset(engine.tokenizer.eos_token_ids)
    while True:
        failed: list[EngineCoreOutput] = []
        heard = False  # a message arrived: the counts the front end holds may be stale
        wait = _wait_seconds(engine)
        while _poll(conn, wait):
            wait, heard = 0.0, True
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError) as exc:  # the front end is gone
                raise _Shutdown from exc
            if kind == "add":
                failed.extend(_add(engine, payload, eos))
            elif kind == "abort":
                for request_id in payload:
                    engine.abort_request(request_id)
            elif kind == "peer":
                engine.deliver_peer_messages(payload)
            elif kind == "ping":  # heard: the counts go out after this round
                pass
            elif kind == "watch":  # the live view (stage 15): a view now, then one per step
                _watch(engine, payload)
            elif kind == "shutdown":
                raise _Shutdown
            else:  # a front end and a core out of step: fail loudly, as a failed step does
                raise ValueError(f"engine core got an unknown message {kind!r}")
        if not (engine.has_unfinished() or engine.has_pending_transfers() or failed):
            if heard:  # say so even without a step: an abort emptied the queues
                if engine.watcher is not None:  # and show it: no step will (stage 15)
                    engine.watcher.snapshot(engine)
                conn.send(("outputs", _step_message(replica, engine, [])))
            continue
        outputs = [_core_output(o) for o in engine.step()] + failed
        outputs += _fail_if_stuck(engine)
        message = _step_message(replica, engine, outputs)
        if heard or message.outputs or message.peer_messages or not engine.waiting_on_transfers():
            conn.send(("outputs", message))


def _wait_seconds(engine: Any) -> float:
    """How long to wait on the pipe: not at all while requests can run, a little while only
    transfers are under way (a step would do nothing), longer when idle."""
    if engine.has_unfinished() and not engine.waiting_on_transfers():
        return 0.0
    if engine.has_unfinished() or engine.has_pending_transfers():
        return TRANSFER_POLL_SECONDS
    return IDLE_WAIT_SECONDS


def _step_message(replica: int, engine: Any, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
    """One step's outputs with the KV events it recorded and the queue lengths after it."""
    return EngineCoreOutputs(
        replica=replica,
        outputs=tuple(outputs),
        kv_events=tuple(engine.kv_manager.drain_kv_events()),
        num_waiting=len(engine.scheduler.waiting),
        num_running=len(engine.scheduler.running),
        peer_messages=tuple(engine.take_peer_messages()),
        num_free_blocks=engine.kv_manager.allocator.num_free,
        num_blocks=engine.kv_manager.allocator.num_blocks,
        transfers_pending=engine.has_pending_transfers(),
        stats=engine_counters(engine),  # stage 15: totals for /metrics
        step_views=engine.watcher.take() if engine.watcher is not None else (),
    )


def _watch(engine: Any, on: bool) -> None:
    """Start (with a view of the engine as it is: an idle core sends no step) or stop building
    step views; they travel in the next `EngineCoreOutputs`."""
    if on and engine.watcher is None:
        engine.watcher = StepWatcher(engine)
        engine.watcher.snapshot(engine)
    elif not on:
        engine.watcher = None


def _poll(conn: Connection, seconds: float) -> bool:
    try:
        return conn.poll(seconds)
    except (EOFError, OSError) as exc:  # the front end is gone
        raise _Shutdown from exc


def _add(engine: Any, message: EngineCoreRequest, eos: frozenset[int]) -> list[EngineCoreOutput]:
    """Add one request; a request the engine refuses fails alone."""
    request = Request(
        request_id=message.request_id,
        prompt=None,
        prompt_token_ids=list(message.prompt_token_ids),
        params=message.params,
        seed=message.params.seed if message.params.seed is not None else 0,
        eos_token_ids=eos,
        detokenizer=None,  # the front end detokenizes
        output_kind="delta",  # each output carries only the step's new tokens
        cache_salt=message.cache_salt,
        arrival_time=message.arrival_time,
        kv_transfer_params=message.kv_transfer_params,
    )
    try:
        engine.add_request(request)
    except Exception as exc:
        return [_error(message.request_id, exc)]
    return []


def _fail_if_stuck(engine: Any) -> list[EngineCoreOutput]:
    """A request the scheduler can never place would make every step idle for ever: fail it
    (the head of the queue), so the others get their turn (AsyncLLM does the same)."""
    stuck = engine.fail_stuck_request()
    return [] if stuck is None else [_error(*stuck)]


def _error(request_id: str, exc: BaseException) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, (), FINISH_ERROR, 0, f"{type(exc).__name__}: {exc}")


def _core_output(output: RequestOutput) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=output.request_id,
        new_token_ids=tuple(output.token_ids),
        finish_reason=output.finish_reason,
        num_cached_tokens=output.num_cached_tokens,
        error=output.error,
        kv_transfer_params=output.kv_transfer_params,
        events=output.events,
    )


__all__ = ["CoreProcess", "EngineCoreSpec", "run_engine_core"]
