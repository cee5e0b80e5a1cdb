"""The HTTP side of stage 15's observability: `GET /metrics` and a finished request's trace.

Kept out of observability/metrics.py so that an engine-core process, which imports
observability/metrics.py for `engine_counters`, never imports FastAPI.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from stages.common.http_errors import APIError

from .metrics import CONTENT_TYPE, TRACES_KEPT, FrontendMetrics, engine_snapshots, render


def add_observability_routes(
    app: FastAPI, frontend: FrontendMetrics, client: Any, model_name: str
) -> None:
    """`/metrics` renders `frontend` and each engine of `client` (the server's AsyncLLM,
    DPClient or DisaggClient), every series labelled with the served `model_name`;
    `/v1/requests/{id}/trace` answers from `frontend.traces`."""

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        frontend.observe_first_tokens()  # requests answered in one piece, still running
        return PlainTextResponse(
            render(frontend, engine_snapshots(client), model_name), media_type=CONTENT_TYPE
        )

    @app.get("/v1/requests/{request_id:path}/trace")
    async def trace(request_id: str) -> dict[str, Any]:
        with frontend.lock:
            found = frontend.traces.get(request_id)
        if found is None:
            message = f"no trace for {request_id!r}: unknown, still running, or not among the "
            raise APIError(message + f"last {TRACES_KEPT} finished", status=404)
        return found
