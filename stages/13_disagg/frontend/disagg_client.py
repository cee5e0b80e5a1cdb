"""The front end of disaggregation: a prefill engine core, a decode engine core, and the proxy.

    server --Request--> DisaggClient --("add", max_tokens=1, do_remote_decode)--> prefill core
                          |  <--("outputs": finished, kv_transfer_params)---------+
                          +--("add", the request + kv_transfer_params)--------> decode core
                          <--("outputs": the tokens)----------------------------+
                          <--> "peer" messages relayed between the two cores (pull, done, ...)

vLLM's toy proxy (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`) does the same
over HTTP: prefill with `max_tokens=1` and `do_remote_decode`, copy the returned transfer
params into the request, stream it from the decode instance. Here the two engine cores are
stage 10's processes (frontend/engine_core.py) with `kv_role="prefill"` and `"decode"`, joined by a
gloo pair for the KV (`kv_transfer_address`), and the proxy is inside the OpenAI server's front end:
one process tokenizes, routes, relays, detokenizes (OutputProcessor) and streams.

`DisaggClient` has AsyncLLM's interface (`generate`, `abort`, `num_pending`, `drain`,
`shutdown`, `dead`, `health_report`), as DPClient does, and shares its plumbing
(frontend/core_client.py); where a request goes is its own (`_admit`). Failures stay with their
requests:
- a transfer that fails or times out is computed on the decode engine (or fails the request:
  `kv_transfer_on_failure`), decided by the cores' connectors;
- a dead core fails the requests it holds, with an error naming it; requests still to come go
  to the other core whole (a prefill or decode engine runs a plain request as stage 12 does);
  the service is dead (a 503) only once both are.
Both cores are supervised as every stage's children are (common/supervisor.py): started, waited
for at once, read by one thread each, and stopped with the front end (`shutdown`, the finalizer).

Placement (parallel/placement.py `pair_devices`): a GPU each when there are two, else both share
one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from stages.common.weights import DEFAULT_MODEL

from ..async_llm import EngineDeadError, _Job
from ..config import EngineConfig
from ..disagg.transfer_state import PeerMessage
from ..disagg.transfer_worker import CONNECT_TIMEOUT_SECONDS
from ..parallel.group import open_rendezvous
from ..parallel.placement import pair_devices
from ..request import RequestOutput
from .core_client import CoreClient
from .core_messages import EngineCoreOutputs, EngineCoreRequest
from .engine_core import EngineCoreSpec

PREFILL, DECODE = 0, 1
ROLES = ("prefill", "decode")


@dataclass(eq=False)
class _Flight:
    """One request's trip: its job, its message for the decode core, where it is now."""

    job: _Job
    message: EngineCoreRequest
    core: int
    phase: Literal["prefill", "decode", "whole"]  # whole: one core runs it all (the other died)
    # The prefill core's own prefix-cache hit: the request's cached tokens once it decodes (the
    # decode core computed none of the prompt, but what it received is no cache hit either).
    prefill_cached: int = 0


def prefill_message(message: EngineCoreRequest) -> EngineCoreRequest:
    """The prefill core's copy: one token, and keep the prompt's KV for a decode engine."""
    params = replace(message.params, max_tokens=1)
    return replace(message, params=params, kv_transfer_params={"do_remote_decode": True})


class DisaggClient(CoreClient[_Flight]):
    """One prefill and one decode engine core behind one front end, with AsyncLLM's interface."""

    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        self.config = EngineConfig(model=model, **config)
        if not self.config.disaggregated:
            raise ValueError("DisaggClient runs a prefill/decode pair: set disaggregated=True")
        skip = {"model", "data_parallel_size", "routing_policy", "disaggregated", "kv_role"}
        tokenizer, model_config, core = self._open(skip)
        self._kv_store = None  # the store the cores meet at, unless the config names one
        if (address := self.config.kv_transfer_address) is None:  # bound now: no port to lose
            self._kv_store, served = open_rendezvous(2, CONNECT_TIMEOUT_SECONDS)
            address = served.replace("tcp://", "store://")
        core["kv_transfer_address"] = address
        cores = []
        for index, (role, (devices, share)) in enumerate(
            zip(ROLES, pair_devices(self.config), strict=True)
        ):
            placed: dict[str, Any] = {"kv_role": role, "device": devices[0]}
            if self.config.ranks_per_device is None and share is not None:
                placed["ranks_per_device"] = share
            spec = EngineCoreSpec(index, model, {**core, **placed})
            cores.append((spec, f"disagg-{role}", f"{role} engine core", devices))
        readies = self._start_cores(cores)
        self._front_end(tokenizer, model_config, readies)
        self._pools = [(0, 0), (0, 0)]  # each core's (free, total) KV blocks, last reported
        self._transfers_pending = [False, False]
        self.num_handed_over = 0
        self._start_reading(lambda index: f"disagg-reader-{ROLES[index]}")

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_store = None  # closes it, once both cores are gone

    # ----------------------------------------------------------------- AsyncLLM's interface
    def _admit(self, job: _Job) -> tuple[int, EngineCoreRequest]:
        """Under the lock: prefill on one core, then decode on the other (`_hand_over`); with
        one core dead the other runs it whole."""
        alive = [index for index, r in enumerate(self.replicas) if r.alive]
        if not alive:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        message = self.output_processor.add_request(job.request)
        split = len(alive) == 2  # else the survivor runs it whole
        core, phase = (PREFILL, "prefill") if split else (alive[0], "whole")
        self._in_flight[job.request.request_id] = _Flight(job, message, core, phase)
        return core, prefill_message(message) if split else message

    def abort(self, request_id: str) -> None:
        """End a request now, on the core that has it; a held prefill KV is freed at once."""
        with self._lock:
            flight = self._retire(request_id, aborted=True)
            if flight is None:
                return
            output = self.output_processor.abort_request(request_id)
        if output is not None:
            flight.job.emit(output)
        self._send(flight.core, ("abort", (request_id,)))
        if flight.phase == "decode":  # the decode core may not have seen it yet
            self._send(PREFILL, ("peer", (PeerMessage("abort", request_id),)))

    @property
    def dead(self) -> str | None:
        """Why nothing can be served any more (both cores died), else None."""
        if any(r.alive for r in self.replicas):
            return None
        return "both engine cores have died: " + "; ".join(str(r.error) for r in self.replicas)

    def ping(self) -> None:
        """Ask both cores for their counts now (they answer on their next round)."""
        for index in range(len(self.replicas)):
            self._send(index, ("ping", None))

    def health_report(self) -> dict[str, Any]:
        """Per core: role, pid, alive, queue lengths (zero once dead), KV blocks free (as last
        reported: `ping` refreshes them), transfers under way; requests in each phase."""
        with self._lock:
            phases = [f.phase for f in self._in_flight.values()]
        cores = [
            {
                "role": ROLES[index],
                "pid": r.process.pid,
                "alive": r.alive,
                "waiting": r.num_waiting if r.alive else 0,  # a dead core holds nothing:
                "running": r.num_running if r.alive else 0,  # its last report no longer holds
                "kv_blocks_free": self._pools[index][0],
                "kv_blocks": self._pools[index][1],
                "transfers_pending": self._transfers_pending[index],
                "error": r.error,
            }
            for index, r in enumerate(self.replicas)
        ]
        return {
            "status": "ok" if all(r.alive for r in self.replicas) else "degraded",
            "disaggregated": True,
            "pending_requests": len(phases),
            "in_prefill": phases.count("prefill"),
            "in_decode": phases.count("decode"),
            "handed_over": self.num_handed_over,
            "cores": cores,
        }

    # ----------------------------------------------------------------- the reader threads
    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        """One step of one core: hand finished prefills to the decode core, stream the rest,
        relay the transfer messages to the other core."""
        core, other = message.replica, 1 - message.replica
        replica = self.replicas[core]
        sends: list[tuple[int, tuple[str, Any]]] = []
        deliveries: list[tuple[_Job, RequestOutput]] = []
        with self._lock:
            replica.num_waiting, replica.num_running = message.num_waiting, message.num_running
            self._pools[core] = (message.num_free_blocks, message.num_blocks)
            self._transfers_pending[core] = message.transfers_pending
            tokens = []
            for output in message.outputs:
                flight = self._in_flight.get(output.request_id)
                if flight is None or flight.core != core:
                    continue  # gone, or a late word from the core it left
                if flight.phase == "decode":  # cached: what the prefill core found cached
                    tokens.append(replace(output, num_cached_tokens=flight.prefill_cached))
                elif flight.phase == "whole":
                    tokens.append(output)
                elif output.finish_reason is not None:  # its one token is dropped
                    flight.prefill_cached = output.num_cached_tokens
                    sends += self._hand_over(flight, output.kv_transfer_params)
            processed = self.output_processor.process_outputs(tokens)
            for output in processed.request_outputs:
                flight = self._in_flight.get(output.request_id)
                if flight is not None:
                    deliveries.append((flight.job, output))
                    if output.finished:
                        self._retire(output.request_id, aborted=output.finish_reason == "abort")
        for job, output in deliveries:
            job.emit(output)
        if message.peer_messages:
            sends.append((other, ("peer", message.peer_messages)))
        if processed.ids_to_abort:  # stop strings the core cannot see
            sends.append((core, ("abort", tuple(processed.ids_to_abort))))
        for index, payload in sends:
            self._send(index, payload)

    def _hand_over(
        self, flight: _Flight, params: dict[str, Any] | None
    ) -> list[tuple[int, tuple[str, Any]]]:
        """Under the lock: the prefill finished; the decode core gets the request and where its
        KV waits. With the decode core dead the prefill core runs it whole (its held KV freed:
        nobody will pull it)."""
        request_id = flight.message.request_id
        if self.replicas[DECODE].alive:
            flight.core, flight.phase = DECODE, "decode"
            self.num_handed_over += 1
            return [(DECODE, ("add", replace(flight.message, kv_transfer_params=params)))]
        flight.phase = "whole"
        return [
            (PREFILL, ("peer", (PeerMessage("abort", request_id),))),
            (PREFILL, ("add", flight.message)),
        ]

    def _core_of(self, request_id: str) -> int | None:
        """The core a request is on; with one core dead, the other takes new requests whole."""
        flight = self._in_flight.get(request_id)
        return None if flight is None else flight.core

    def _retire(self, request_id: str, aborted: bool) -> _Flight | None:
        """Under the lock: the request's end, counted once."""
        flight = self._in_flight.pop(request_id, None)
        if flight is not None:
            self.num_finished += 1
            self.num_aborted += aborted
        return flight

    def _end(self, request_id: str) -> tuple[int, _Job] | None:
        flight = self._retire(request_id, aborted=True)
        return None if flight is None else (flight.core, flight.job)


__all__ = ["DisaggClient", "prefill_message"]
