"""The messages between the front end and an engine core: plain, picklable, frozen.

With data parallelism the engine core (scheduler, KV cache, model) runs in its own process and
the front end (HTTP, tokenizing, detokenizing, stop strings, routing) in the server's. What
crosses the pipe is only token ids and numbers, as in vLLM V1's `EngineCoreRequest` and
`EngineCoreOutputs`: no tokenizer, no text, no Request object with its locks and clocks.

    front end --("add", EngineCoreRequest)----> core
              --("abort", (request_id, ...))--> core
              --("peer", (PeerMessage, ...))--> core   the other engine's transfer messages
              --("ping", None)-----------------> core   answer with the counts now
              --("watch", True | False)---------> core   the live view: send step views or not
              --("shutdown", None)------------> core
              <--("ready", CoreReady)---------- core   once, after the model loaded
              <--("outputs", EngineCoreOutputs)- core  once per step
              <--("fatal", traceback text)----- core   its step raised: it exits

Disaggregation (stage 13) adds the transfer parameters a request carries in (do_remote_decode,
or where its KV waits) and a prefill engine hands back out, and the control messages between a
prefill and a decode engine (`PeerMessage`), which the front end relays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..block_pool import KVEvent
from ..disagg.transfer_state import PeerMessage
from ..sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A validated, tokenized request. `params` has no stop strings (the front end checks
    them on the text) and its seed is resolved (the front end drew one if the client gave
    none), so any replica samples the same tokens."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    kv_transfer_params: dict[str, Any] | None = None  # disaggregation (stage 13)


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one request got in one step: its new token ids, and why it ended if it did."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    num_cached_tokens: int = 0
    error: str | None = None  # why it failed, when finish_reason is "error"
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine: where its KV waits
    events: tuple[tuple[str, float], ...] = ()  # the scheduler's, since the last output (15)


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """One step of one replica: the requests that advanced, the KV events the step recorded
    (for the cache-aware router) and the replica's queue lengths (for /health)."""

    replica: int
    outputs: tuple[EngineCoreOutput, ...]
    kv_events: tuple[KVEvent, ...] = ()
    num_waiting: int = 0
    num_running: int = 0
    peer_messages: tuple[PeerMessage, ...] = ()  # for the other engine of a prefill/decode pair
    num_free_blocks: int = 0  # the KV pool after the step (a leak shows here)
    num_blocks: int = 0
    transfers_pending: bool = False  # a KV transfer or a message about one is under way
    stats: dict[str, float] = field(default_factory=dict)  # metrics.engine_counters (stage 15)
    step_views: tuple[dict[str, Any], ...] = ()  # live_view.step_view, while watched (stage 15)


@dataclass(frozen=True, slots=True)
class CoreReady:
    """A replica's first message: it loaded, and what the front end must know of it."""

    replica: int
    pid: int
    max_model_len: int
    block_size: int
    weight_format: Any = None  # stage 15: what quantization="auto" chose (quant/auto.py)


__all__ = ["CoreReady", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest"]
