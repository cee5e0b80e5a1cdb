"""The streaming HTTP server: the event loop does I/O, the engine runs on its own thread.

Each handler validates its request (a 400 before anything starts), submits it to `AsyncLLM`, and
either streams server-sent events as tokens arrive (`stream: true`) or waits for the last one
(streaming.py). A client that goes away aborts its request.

Validation tokenizes, and tokenizing holds the GIL: it runs on worker threads, at most
`MAX_TOKENIZING` at once, so a burst of long prompts waits its turn instead of starving the
engine thread and every running stream.

With the prefix cache (stage 07) every usage block reports the prompt tokens the cache served
(`prompt_tokens_details.cached_tokens`), a request may bring a `cache_salt`, and `/health` shows
the aggregate hit rate and how many cached blocks were evicted.

With data parallelism (stage 10) `create_app` takes a `DPClient` instead of an `LLM`: it builds
requests and serves them with AsyncLLM's interface, and `/health` shows each replica (alive,
load) and the router's stats; a 503 only once no replica is left.

With disaggregation (stage 13) it takes a `DisaggClient` the same way: a prefill and a decode
engine core behind the same endpoints, `/health` showing both.

Stage 15: `/metrics` (observability/metrics.py, `ObservedClient`) serves every engine's numbers in
Prometheus' format; `/dashboard` (observability/dashboard.py) shows the engines step by step while
someone watches.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from stages.common.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    chat_chunk,
    chat_response,
    check_model_id,
    check_model_name,
    completion_chunk,
    completion_response,
    error_body,
    include_usage,
    install_error_handlers,
    model_card,
    models_response,
    new_id,
    sse,
    usage,
    usage_chunk,
)

from .async_llm import AsyncLLM
from .config import EngineConfig, resolution_notes
from .frontend.disagg_client import DisaggClient
from .frontend.dp_client import DPClient
from .llm import LLM
from .observability.dashboard import DashboardHub, add_dashboard_routes
from .observability.http import add_observability_routes
from .observability.live_latency import LatencyTap
from .observability.metrics import FrontendMetrics, ObservedClient
from .request import Request, RequestOutput
from .sampling import SamplingParams
from .streaming import event_stream, wait_for_final_output

MAX_TOKENIZING = 2  # requests validated (tokenized) at once; the others wait their turn


def build_request(
    engine: LLM | DPClient | DisaggClient,
    body: GenerateRequest | CompletionRequest | ChatCompletionRequest,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    default_max_tokens: int | None = 16,
    request_id: str | None = None,
) -> Request:
    """Validate a request body into an engine request; every problem becomes a 400.

    A stream wants each step's new tokens ("delta" outputs); a plain request only the end."""
    try:
        params = SamplingParams(**body.sampling_kwargs(default_max_tokens))
        return engine.make_request(
            prompt,
            params,
            messages=messages,
            request_id=request_id,
            output_kind="delta" if body.stream else "final",
            cache_salt=body.cache_salt,
        )
    except APIError:
        raise
    except Exception as exc:  # ValueError from validation, TemplateError from a chat template
        raise APIError(str(exc)) from exc


async def build_request_off_loop(limit: asyncio.Semaphore, *args: Any, **kwargs: Any) -> Request:
    """`build_request` on a worker thread, at most `limit` at once: chat templating and
    tokenizing a long prompt take milliseconds to seconds, and the event loop must keep serving
    other streams meanwhile."""
    async with limit:
        return await asyncio.to_thread(build_request, *args, **kwargs)


def health_report(async_llm: AsyncLLM) -> dict[str, Any]:
    """Liveness and load: requests waiting and running, preemptions so far (0 before stage 04,
    whose scheduler is the first that preempts), and KV blocks when the stage has a pool. Read
    from the event loop without locks: each number is a snapshot, not a ledger."""
    engine = async_llm.engine
    report: dict[str, Any] = {
        "status": "ok",
        "pending_requests": async_llm.num_pending,
        "waiting": len(engine.scheduler.waiting),
        "running": len(engine.scheduler.running),
        "steps": async_llm.num_steps,
        "num_preemptions": getattr(engine.scheduler, "num_preemptions", 0),
    }
    kv_manager = getattr(engine, "kv_manager", None)
    if kv_manager is not None:
        free = kv_manager.num_free_blocks
        report["kv_blocks_free"] = free
        report["kv_blocks_used"] = kv_manager.allocator.num_blocks - free
        report["prefix_cache"] = kv_manager.stats.as_dict()
        report["num_evictions"] = kv_manager.allocator.num_evictions  # cached blocks reused
    connector = getattr(engine, "kv_connector", None)
    if connector is not None:  # stage 15: the host tier's (or a transfer's) counters
        report["kv_connector"] = dataclasses.asdict(connector.stats)
    executor = getattr(engine, "executor", None)
    if executor is not None:  # stage 09: the ranks, and each worker process's state
        report["tensor_parallel_size"] = executor.tensor_parallel_size
        report["workers"] = executor.workers()
    return with_format_note(report | configuration_report(engine.config), engine)


def with_format_note(report: dict[str, Any], engine: Any) -> dict[str, Any]:
    """quantization="auto" (stage 15): what it chose on this machine, and why, in the notes."""
    weight_format = getattr(engine, "weight_format", None)
    if weight_format is not None:
        report["config_notes"]["quantization"] = f"auto: {weight_format.describe()}"
    return report


def configuration_report(config: EngineConfig) -> dict[str, Any]:
    """The resolved configuration (a preset's settings filled in, the engine's resolutions
    made) and what rules switched without a field saying so (`config.resolution_notes`)."""
    return {"config": dataclasses.asdict(config), "config_notes": resolution_notes(config)}


def generate_response(output: RequestOutput) -> dict[str, Any]:
    """The `/generate` JSON body for a finished request."""
    metrics = {"ttft_s": output.ttft, "e2e_s": output.e2e_latency}
    return {
        "request_id": output.request_id,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "usage": usage(
            len(output.prompt_token_ids), len(output.token_ids), output.num_cached_tokens
        ),
        "metrics": metrics,
    }


def create_app(engine: LLM | DPClient | DisaggClient) -> FastAPI:
    app = FastAPI(title=f"stages {__package__.rsplit('.', 1)[-1]}", version="0.1.0")
    install_error_handlers(app)
    front_ends = (DPClient, DisaggClient)  # engine cores in their own processes
    async_llm: Any = engine if isinstance(engine, front_ends) else AsyncLLM(engine)
    app.state.engine = async_llm
    app.router.on_shutdown.append(async_llm.shutdown)
    frontend = FrontendMetrics(max_model_len=engine.config.max_model_len or 2048)  # /metrics
    hub = DashboardHub(async_llm)  # stage 15: the live view, /dashboard
    app.state.dashboard = hub
    client = LatencyTap(ObservedClient(async_llm, frontend), hub.latency)
    served = engine.model_name
    tokenizing = asyncio.Semaphore(MAX_TOKENIZING)

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None)  # HEAD: checkers
    async def health() -> Any:
        if async_llm.closing is not None:  # refusing every request: load balancers must move on
            body = {"status": "draining", "reason": async_llm.closing}
            return JSONResponse(body, status_code=503)
        if isinstance(async_llm, front_ends):  # cores: 503 only when none is left
            if async_llm.dead is not None:
                return JSONResponse(error_body(async_llm.dead, status=503), status_code=503)
            report = async_llm.health_report() | configuration_report(async_llm.config)
            return with_format_note(report, async_llm)
        # A worker that died while the engine idled is known before any step fails.
        dead = async_llm.dead or getattr(async_llm.engine.executor, "failure", None)
        if dead is not None:
            body = error_body(f"the engine has stopped: {dead}", status=503)
            return JSONResponse(body, status_code=503)
        return health_report(async_llm)

    add_observability_routes(app, frontend, async_llm, served)
    add_dashboard_routes(app, hub)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(served)

    @app.get("/v1/models/{model_id:path}")  # served names hold slashes: org/model
    async def model(model_id: str) -> dict[str, Any]:
        check_model_id(model_id, served)
        return model_card(served)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, http: HTTPRequest) -> Any:
        messages = body.conversation()
        request = await build_request_off_loop(
            tokenizing,
            engine,
            body,
            prompt=body.prompt,
            messages=messages,
            default_max_tokens=None if messages else 16,
            request_id=new_id("req"),  # unguessable, as completions' ids: nobody reads another's
        )
        if not body.stream:
            return generate_response(await wait_for_final_output(client, request, http))

        def frames(output: RequestOutput, _: int) -> list[str]:
            return [
                sse(
                    {
                        "request_id": output.request_id,
                        "text": output.text,
                        "token_ids": output.token_ids,
                        "finish_reason": output.finish_reason,
                    }
                )
            ]

        return await event_stream(client, request, frames)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Any:
        check_model_name(body.model, served)
        request_id = new_id("cmpl")
        request = await build_request_off_loop(
            tokenizing, engine, body, prompt=body.single_prompt(), request_id=request_id
        )
        prompt_tokens = len(request.prompt_token_ids)
        if not body.stream:
            output = await wait_for_final_output(client, request, http)
            return completion_response(
                request_id,
                served,
                output.text,
                output.finish_reason,
                prompt_tokens,
                len(output.token_ids),
                output.num_cached_tokens,
            )

        def frames(output: RequestOutput, num_output_tokens: int) -> list[str]:
            events = []
            text = output.text
            if text or output.finished:
                events.append(sse(completion_chunk(request_id, served, text, output.finish_reason)))
            if output.finished and include_usage(body):
                events.append(
                    sse(
                        usage_chunk(
                            request_id,
                            served,
                            "text_completion",
                            prompt_tokens,
                            num_output_tokens,
                            output.num_cached_tokens,
                        )
                    )
                )
            return events

        return await event_stream(client, request, frames)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest) -> Any:
        check_model_name(body.model, served)
        request_id = new_id("chatcmpl")
        request = await build_request_off_loop(
            tokenizing,
            engine,
            body,
            messages=body.conversation(),
            default_max_tokens=None,
            request_id=request_id,
        )
        prompt_tokens = len(request.prompt_token_ids)
        if not body.stream:
            output = await wait_for_final_output(client, request, http)
            return chat_response(
                request_id,
                served,
                output.text,
                output.finish_reason,
                prompt_tokens,
                len(output.token_ids),
                output.num_cached_tokens,
            )
        first = True

        def frames(output: RequestOutput, num_output_tokens: int) -> list[str]:
            nonlocal first
            events = []
            text = output.text
            if first:  # OpenAI opens every chat stream with the assistant role
                events.append(
                    sse(chat_chunk(request_id, served, {"role": "assistant", "content": ""}, None))
                )
                first = False
            if text:
                events.append(sse(chat_chunk(request_id, served, {"content": text}, None)))
            if output.finished:
                events.append(sse(chat_chunk(request_id, served, {}, output.finish_reason)))
                if include_usage(body):
                    events.append(
                        sse(
                            usage_chunk(
                                request_id,
                                served,
                                "chat.completion.chunk",
                                prompt_tokens,
                                num_output_tokens,
                                output.num_cached_tokens,
                            )
                        )
                    )
            return events

        return await event_stream(client, request, frames)

    return app
