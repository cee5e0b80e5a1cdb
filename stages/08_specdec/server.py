"""The streaming HTTP server: the event loop does I/O, the engine runs on its own thread.

Each handler validates its request (a 400 before anything starts), submits it to `AsyncLLM`, and
either streams server-sent events as tokens arrive (`stream: true`) or waits for the last one.
A client that goes away aborts its request: for a stream, Starlette cancels the response
generator; for a plain request, `_wait_for_final_output` polls for the disconnect.

With the prefix cache (stage 07) every usage block reports the prompt tokens the cache served
(`prompt_tokens_details.cached_tokens`), a request may bring a `cache_salt`, and `/health` shows
the aggregate hit rate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from stages.common.protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    chat_chunk,
    chat_response,
    check_model_name,
    completion_chunk,
    completion_response,
    error_body,
    include_usage,
    install_error_handlers,
    models_response,
    new_id,
    sse,
    usage,
    usage_chunk,
)

from .async_llm import AsyncLLM, EngineDeadError
from .llm import LLM
from .request import Request, RequestOutput
from .sampling import SamplingParams

DISCONNECT_POLL_S = 0.2


def build_request(
    engine: LLM,
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


async def build_request_off_loop(*args: Any, **kwargs: Any) -> Request:
    """`build_request` on a worker thread: chat templating and tokenizing a long prompt take
    milliseconds to seconds, and the event loop must keep serving other streams meanwhile."""
    return await asyncio.to_thread(build_request, *args, **kwargs)


def health_report(async_llm: AsyncLLM) -> dict[str, Any]:
    """Liveness and load: requests waiting and running, and KV blocks when the stage has a
    pool. Read from the event loop without locks: each number is a snapshot, not a ledger."""
    engine = async_llm.engine
    report: dict[str, Any] = {
        "status": "ok",
        "pending_requests": async_llm.num_pending,
        "waiting": len(engine.scheduler.waiting),
        "running": len(engine.scheduler.running),
        "steps": async_llm.num_steps,
    }
    kv_manager = getattr(engine, "kv_manager", None)
    if kv_manager is not None:
        free = kv_manager.num_free_blocks
        report["kv_blocks_free"] = free
        report["kv_blocks_used"] = kv_manager.allocator.num_blocks - free
        report["prefix_cache"] = kv_manager.stats.as_dict()
    return report


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


async def _wait_for_final_output(
    async_llm: AsyncLLM, request: Request, http_request: HTTPRequest
) -> RequestOutput:
    """Run a request to the end, aborting it if the client disconnects meanwhile."""

    async def last_output() -> RequestOutput:
        output = None
        try:
            async for output in async_llm.generate(request):  # noqa: B007 (the last one counts)
                pass
        except EngineDeadError as exc:
            raise APIError(str(exc), status=503) from exc
        assert output is not None
        if output.error is not None:
            raise APIError(f"request failed: {output.error}", status=500)
        return output

    task = asyncio.ensure_future(last_output())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                raise APIError("client disconnected", status=499)
    finally:
        if not task.done():
            task.cancel()  # cancelling the consumer aborts the request in AsyncLLM


def _event_stream(
    async_llm: AsyncLLM,
    request: Request,
    frames: Callable[[RequestOutput, int], list[str]],
) -> StreamingResponse:
    """SSE response: `frames(output, num_output_tokens)` renders each step's events. The
    request's outputs are deltas (each holds only its new text and tokens); the second argument
    counts every output token so far, for `usage`."""

    async def body() -> AsyncIterator[str]:
        num_output_tokens = 0
        try:
            async for output in async_llm.generate(request):
                if output.error is not None:  # headers are sent: report the failure in-band
                    yield sse(error_body(f"request failed: {output.error}", status=500))
                    break
                num_output_tokens += len(output.token_ids)
                for frame in frames(output, num_output_tokens):
                    yield frame
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), status=503))
        except Exception as exc:
            yield sse(error_body(f"internal error: {exc}", status=500))
        yield SSE_DONE

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def create_app(engine: LLM) -> FastAPI:
    app = FastAPI(title=f"stages {__package__.rsplit('.', 1)[-1]}", version="0.1.0")
    install_error_handlers(app)
    async_llm = AsyncLLM(engine)
    app.state.engine = async_llm
    app.router.on_shutdown.append(async_llm.shutdown)
    served = engine.model_name

    @app.get("/health", response_model=None)
    async def health() -> Any:
        if async_llm.dead is not None:
            body = error_body(f"the engine has stopped: {async_llm.dead}", status=503)
            return JSONResponse(body, status_code=503)
        return health_report(async_llm)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(served)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, http: HTTPRequest) -> Any:
        messages = [m.model_dump() for m in body.messages] if body.messages else None
        request = await build_request_off_loop(
            engine,
            body,
            prompt=body.prompt,
            messages=messages,
            default_max_tokens=None if messages else 16,
        )
        if not body.stream:
            return generate_response(await _wait_for_final_output(async_llm, request, http))

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

        return _event_stream(async_llm, request, frames)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Any:
        check_model_name(body.model, served)
        request_id = new_id("cmpl")
        request = await build_request_off_loop(
            engine, body, prompt=body.single_prompt(), request_id=request_id
        )
        prompt_tokens = len(request.prompt_token_ids)
        if not body.stream:
            output = await _wait_for_final_output(async_llm, request, http)
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

        return _event_stream(async_llm, request, frames)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest) -> Any:
        check_model_name(body.model, served)
        request_id = new_id("chatcmpl")
        request = await build_request_off_loop(
            engine,
            body,
            messages=body.conversation(),
            default_max_tokens=None,
            request_id=request_id,
        )
        prompt_tokens = len(request.prompt_token_ids)
        if not body.stream:
            output = await _wait_for_final_output(async_llm, request, http)
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

        return _event_stream(async_llm, request, frames)

    return app
