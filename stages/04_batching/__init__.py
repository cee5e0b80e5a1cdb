"""Stage 04, batching: a scheduler re-decides the batch every step (continuous batching).

Public surface (the same in every stage): `LLM`, `SamplingParams`, `RequestOutput`,
`EngineConfig`, `AsyncLLM`, `create_app`, the paged KV cache and kernels of stage 03; new here:
`Scheduler` and `ScheduledBatch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .async_llm import AsyncLLM
from .config import EngineConfig
from .engine import LLM
from .kernels import paged_attention, paged_attention_reference, paged_attention_triton
from .kv_cache import BlockAllocator, KVCacheManager, OutOfBlocksError, PagedKVCache
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import ScheduledBatch, Scheduler

if TYPE_CHECKING:
    from fastapi import FastAPI

STAGE = "04"
TECHNIQUE = "batching: continuous batching scheduler, mixed prefill/decode, preemption"


def create_app(engine: LLM) -> FastAPI:
    """The HTTP server for this stage's engine (see server.py); FastAPI is imported here, so
    offline use of the engine never needs it."""
    from .server import create_app as _create_app

    return _create_app(engine)


__all__ = [
    "LLM",
    "STAGE",
    "TECHNIQUE",
    "AsyncLLM",
    "BlockAllocator",
    "EngineConfig",
    "KVCacheManager",
    "OutOfBlocksError",
    "PagedKVCache",
    "RequestOutput",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "create_app",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
]
