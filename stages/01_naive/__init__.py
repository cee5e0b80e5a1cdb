"""Stage 01, naive: a from-scratch Llama forward, a KV cache, sampling, a blocking server.

Public surface (the same in every stage): `LLM`, `SamplingParams`, `RequestOutput`,
`EngineConfig`, and `create_app` for the HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import EngineConfig
from .engine import LLM
from .request import RequestOutput
from .sampling import SamplingParams

if TYPE_CHECKING:
    from fastapi import FastAPI

STAGE = "01"
TECHNIQUE = "naive: one request at a time, contiguous KV cache, blocking HTTP"


def create_app(engine: LLM) -> FastAPI:
    """The HTTP server for this stage's engine (see server.py); FastAPI is imported here, so
    offline use of the engine never needs it."""
    from .server import create_app as _create_app

    return _create_app(engine)


__all__ = [
    "LLM",
    "STAGE",
    "TECHNIQUE",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "create_app",
]
