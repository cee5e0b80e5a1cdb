"""The front end of data parallelism: replicas in their own processes, one router, one server.

    server --Request--> DPClient --route--> Router
                          | ("add", EngineCoreRequest)          replica i: frontend/engine_core.py
                          +--------------------------------->  (LLMEngine, own KV cache)
                          <---------------------------------+
                          | ("outputs", EngineCoreOutputs): token ids, KV events, counts
                    reader thread i -> OutputProcessor (text, stop strings) -> request's queue

`DPClient` offers the server what `AsyncLLM` does (`generate`, `abort`, `num_pending`, `drain`,
`shutdown`, `dead`) plus what building a request needs (`make_request`, `model_name`): the
front end tokenizes and validates with its own InputProcessor (the replicas never see text)
and detokenizes with the OutputProcessor. That plumbing, shared with stage 13's DisaggClient,
is frontend/core_client.py's; where a request goes is DPClient's own (`_admit`: the router's pick).
One reader thread per replica blocks on its pipe and hands each step's outputs to the waiting
coroutines (`call_soon_threadsafe`).

Load accounting: `Router.route` counts a request at admission; `finished` is called exactly
once per request, wherever it ends (finished, aborted, the client gone, drained, its replica
dead), under one lock with the table of jobs, so the two never disagree.

Placement: replica i runs on its own devices (parallel/placement.py: with tensor parallelism t, GPUs
i*t .. i*t+t-1), so replicas never share a GPU nor size their KV pools from the same free
memory; with NCCL too few GPUs is refused before any replica starts. With gloo the replicas may
share GPUs, and each is told how many ranks share its GPUs (`ranks_per_device`), so that their
default KV budgets together take the share of free memory that one engine's would.

A replica that dies (its pipe closes, or it reports a fatal error) fails its in-flight
requests with an error naming it, leaves the router's rotation, and shows in `/health`; the
others carry on. The service is dead (`dead`, a 503) only when no replica is left. The replicas
are started, waited for, read and stopped by the supervisor every stage's children share
(common/supervisor.py): they die with the front end (`shutdown`, the finalizer, or their own
watchdog).
"""

from __future__ import annotations

from typing import Any

from stages.common.weights import DEFAULT_MODEL

from ..async_llm import EngineDeadError, _Job
from ..config import EngineConfig
from ..parallel.placement import device_plan, ranks_per_device
from ..request import RequestOutput
from .core_client import CoreClient
from .core_messages import EngineCoreOutputs, EngineCoreRequest
from .engine_core import EngineCoreSpec
from .router import NoReplicaAliveError, Router


class DPClient(CoreClient[_Job]):
    """`data_parallel_size` engine-core processes behind one router, with AsyncLLM's interface."""

    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        self.config = EngineConfig(model=model, **config)
        size = self.config.data_parallel_size
        if size < 2:
            raise ValueError("DPClient runs replicas: data_parallel_size must be at least 2")
        plan = device_plan(self.config)  # too few GPUs: refused before any process starts
        tokenizer, model_config, core = self._open(
            {"model", "data_parallel_size", "routing_policy"}
        )
        core["kv_events"] = self.config.kv_events or self.config.routing_policy == "cache_aware"
        shares = ranks_per_device(plan)  # ranks of every replica on each GPU (gloo shares)
        cores = []
        for index, devices in enumerate(plan):
            # The replica's engine runs on its rank 0's device; its executor places the rest.
            placed: dict[str, Any] = {"device": devices[0]}
            if self.config.ranks_per_device is None and shares[index] is not None:
                placed["ranks_per_device"] = shares[index]
            spec = EngineCoreSpec(index, model, {**core, **placed}, replicas=size)
            cores.append((spec, f"dp-replica-{index}", f"engine replica {index}", devices))
        readies = self._start_cores(cores)
        self._front_end(tokenizer, model_config, readies)
        self.router = Router(size, self.config.routing_policy, readies[0].block_size)
        self._job_replica: dict[str, int] = {}
        self._start_reading(lambda index: f"dp-reader-{index}")

    # ----------------------------------------------------------------- AsyncLLM's interface
    def _admit(self, job: _Job) -> tuple[int, EngineCoreRequest]:
        """Under the lock: the router picks the replica (and counts the request there)."""
        request = job.request
        try:
            replica = self.router.route(request.prompt_token_ids, request.cache_salt)
        except NoReplicaAliveError as exc:
            raise EngineDeadError(f"the engine has stopped: {self.dead or exc}") from exc
        message = self.output_processor.add_request(request)
        self._in_flight[request.request_id], self._job_replica[request.request_id] = job, replica
        return replica, message

    def abort(self, request_id: str) -> None:
        """End a request now; its last output ends "abort" and its replica drops it."""
        with self._lock:
            job = self._retire(request_id, aborted=True)
            if job is None:
                return
            output = self.output_processor.abort_request(request_id)
        replica, job = job
        if output is not None:
            job.emit(output)
        self._send(replica, ("abort", (request_id,)))

    @property
    def dead(self) -> str | None:
        """Why nothing can be served any more (every replica died), else None."""
        if any(r.alive for r in self.replicas):
            return None
        return "every engine replica has died: " + "; ".join(str(r.error) for r in self.replicas)

    def health_report(self) -> dict[str, Any]:
        """Per replica: pid, alive, queue lengths (zero once dead), load; the router's stats."""
        with self._lock:
            stats = self.router.stats()
            pending = len(self._in_flight)
        replicas = [
            {
                "index": index,
                "pid": r.process.pid,
                "alive": r.alive,
                "devices": r.devices,
                "waiting": r.num_waiting if r.alive else 0,  # a dead replica holds nothing:
                "running": r.num_running if r.alive else 0,  # its last report no longer holds
                "load": stats["replicas"][index]["load"],
                "error": r.error,
            }
            for index, r in enumerate(self.replicas)
        ]
        return {
            "status": "ok" if all(r.alive for r in self.replicas) else "degraded",
            "pending_requests": pending,
            "data_parallel_size": len(self.replicas),
            "replicas": replicas,
            "router": stats,
        }

    # ----------------------------------------------------------------- the reader threads
    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        replica = self.replicas[message.replica]
        deliveries: list[tuple[_Job, RequestOutput]] = []
        with self._lock:
            replica.num_waiting, replica.num_running = message.num_waiting, message.num_running
            self.router.apply_events(message.replica, message.kv_events)
            processed = self.output_processor.process_outputs(message.outputs)
            for output in processed.request_outputs:
                job = self._in_flight.get(output.request_id)
                if job is None:
                    continue
                deliveries.append((job, output))
                if output.finished:
                    self._retire(output.request_id, aborted=output.finish_reason == "abort")
        for job, output in deliveries:
            job.emit(output)
        if processed.ids_to_abort:  # stop strings the core cannot see
            self._send(message.replica, ("abort", tuple(processed.ids_to_abort)))

    def _core_died(self, index: int) -> None:
        self.router.mark_dead(index)  # out of rotation: the others carry on

    def _core_of(self, request_id: str) -> int | None:
        return self._job_replica.get(request_id)

    def _retire(self, request_id: str, aborted: bool) -> tuple[int, _Job] | None:
        """Under the lock: the request's end, counted once in the router."""
        job = self._in_flight.pop(request_id, None)
        if job is None:
            return None
        replica = self._job_replica.pop(request_id)
        self.router.finished(replica)
        self.num_finished += 1
        self.num_aborted += aborted
        return replica, job

    def _end(self, request_id: str) -> tuple[int, _Job] | None:
        return self._retire(request_id, aborted=True)


__all__ = ["DPClient"]
