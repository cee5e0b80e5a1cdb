"""Stage 02, streaming: the engine runs off the event loop and tokens stream as SSE.

Public surface (the same in every stage): `LLM`, `SamplingParams`, `RequestOutput`,
`EngineConfig`, and `create_app` for the HTTP server; new here: `AsyncLLM`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .async_llm import AsyncLLM
from .config import EngineConfig
from .engine import LLM
from .request import RequestOutput
from .sampling import SamplingParams

if TYPE_CHECKING:
    from fastapi import FastAPI

STAGE = "02"
TECHNIQUE = "streaming: engine thread + asyncio, SSE and OpenAI-compatible streaming"


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
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "create_app",
]
