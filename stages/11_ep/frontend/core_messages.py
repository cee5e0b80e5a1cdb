"""The messages between the front end and an engine core: plain, picklable, frozen.

With data parallelism the engine core (scheduler, KV cache, model) runs in its own process and
the front end (HTTP, tokenizing, detokenizing, stop strings, routing) in the server's. What
crosses the pipe is only token ids and numbers, as in vLLM V1's `EngineCoreRequest` and
`EngineCoreOutputs`: no tokenizer, no text, no Request object with its locks and clocks.

    front end --("add", EngineCoreRequest)----> core
              --("abort", (request_id, ...))--> core
              --("shutdown", None)------------> core
              <--("ready", CoreReady)---------- core   once, after the model loaded
              <--("outputs", EngineCoreOutputs)- core  once per step
              <--("fatal", traceback text)----- core   its step raised: it exits
"""

from __future__ import annotations

from dataclasses import dataclass

from ..block_pool import KVEvent
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


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one request got in one step: its new token ids, and why it ended if it did."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    num_cached_tokens: int = 0
    error: str | None = None  # why it failed, when finish_reason is "error"


@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    """One step of one replica: the requests that advanced, the KV events the step recorded
    (for the cache-aware router) and the replica's queue lengths (for /health)."""

    replica: int
    outputs: tuple[EngineCoreOutput, ...]
    kv_events: tuple[KVEvent, ...] = ()
    num_waiting: int = 0
    num_running: int = 0


@dataclass(frozen=True, slots=True)
class CoreReady:
    """A replica's first message: it loaded, and what the front end must know of it."""

    replica: int
    pid: int
    max_model_len: int
    block_size: int


__all__ = ["CoreReady", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest"]
