"""One stage of the engine, a complete package. Its lesson is README.md; its manifest,
lesson.toml, names its technique and the code that carries it.

Public surface, the same in every stage: `LLM` (offline), `LLMEngine` (the step API),
`SamplingParams`, `RequestOutput`, `EngineConfig` and `create_app` (the HTTP server); from stage
02 `AsyncLLM`; from stage 03 the paged KV cache (`BlockAllocator`, `KVCacheManager`,
`PagedKVCache`) and the paged attention for any query length (`paged_attention`, with its Triton
kernel and PyTorch reference); from stage 10 `DPClient` (engine-core replicas behind a router),
`device_plan` (the devices of each replica's ranks) and `serving_engine`, what the server runs
for a config; from stage 13 `DisaggClient` (a prefill and a decode engine core behind one front
end); from stage 15 `PRESETS` (deployment presets, `EngineConfig(preset=...)`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .async_llm import AsyncLLM
from .block_pool import BlockAllocator, OutOfBlocksError
from .config import EngineConfig
from .engine import LLMEngine
from .frontend.disagg_client import DisaggClient
from .frontend.dp_client import DPClient
from .kernels import paged_attention, unified_attention_reference, unified_attention_triton
from .kv_cache import KVCacheManager, PagedKVCache
from .llm import LLM
from .parallel.placement import device_plan
from .presets import PRESETS
from .request import RequestOutput
from .sampling import SamplingParams

if TYPE_CHECKING:
    from fastapi import FastAPI

# The stage's number and technique come from its manifest (lesson.toml), the one place they live.
_LESSON = tomllib.loads(Path(__file__).with_name("lesson.toml").read_text())
STAGE: str = _LESSON["stage"]
TECHNIQUE: str = _LESSON["technique"]


def serving_engine(model: str | None = None, **config: Any) -> LLM | DPClient | DisaggClient:
    """What a server runs: with disaggregated=True a prefill and a decode engine core behind
    the proxy (`DisaggClient`); else engine-core processes behind a router (`DPClient`): one
    per data-parallel replica, and one for a single engine too (`engine_core_process`, vLLM
    V1's layout); with engine_core_process=False and one replica, the in-process engine of
    stage 09 (`LLM`)."""
    resolved = EngineConfig(**config)  # stage 15: a preset may set the topology
    in_cores = resolved.data_parallel_size > 1 or resolved.engine_core_process
    kind: Any = DPClient if in_cores else LLM
    if resolved.disaggregated:
        kind = DisaggClient
    return kind(model, **config) if model is not None else kind(**config)


def create_app(engine: LLM | DPClient | DisaggClient) -> FastAPI:
    """The HTTP server for `engine` (see server.py); FastAPI is imported here, so
    offline use of the engine never needs it."""
    from .server import create_app as _create_app

    return _create_app(engine)


__all__ = [
    "LLM",
    "PRESETS",
    "STAGE",
    "TECHNIQUE",
    "AsyncLLM",
    "BlockAllocator",
    "DPClient",
    "DisaggClient",
    "EngineConfig",
    "KVCacheManager",
    "LLMEngine",
    "OutOfBlocksError",
    "PagedKVCache",
    "RequestOutput",
    "SamplingParams",
    "create_app",
    "device_plan",
    "paged_attention",
    "serving_engine",
    "unified_attention_reference",
    "unified_attention_triton",
]
