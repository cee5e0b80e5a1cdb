"""Stage 01, naive: a from-scratch Llama forward, a KV cache, sampling, a blocking server.

Public surface (the same in every stage): `LLM`, `SamplingParams`, `RequestOutput`,
`EngineConfig`, and `create_app` for the HTTP server.
"""

from .config import EngineConfig
from .engine import LLM
from .request import RequestOutput
from .sampling import SamplingParams

STAGE = "01"
TECHNIQUE = "naive: one request at a time, contiguous KV cache, blocking HTTP"


def create_app(engine: LLM):
    """The HTTP server for this stage's engine (see server.py)."""
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
