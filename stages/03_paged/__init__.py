"""Stage 03, paged: a block-pool KV cache, paged attention, static batches of requests.

Public surface (the same in every stage): `LLM`, `SamplingParams`, `RequestOutput`,
`EngineConfig`, `AsyncLLM` and `create_app` for the HTTP server; new here: `BlockAllocator`,
`KVCacheManager`, `PagedKVCache` and the `paged_attention` kernels.
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

if TYPE_CHECKING:
    from fastapi import FastAPI

STAGE = "03"
TECHNIQUE = "paged: block-pool KV cache, Triton paged attention, static batching"


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
    "create_app",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
]
