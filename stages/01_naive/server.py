"""The naive HTTP server: FastAPI in front of the engine, one request at a time.

Every handler calls the engine directly, on the event loop. That is the flaw this stage keeps on
purpose: while one answer is being generated the event loop is blocked, so nothing else is
served (not even `/health`), and the client sees nothing until the whole answer is done.
Stage 02 moves the engine off the event loop and streams tokens as they are produced.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from stages.common.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    chat_response,
    check_model_id,
    check_model_name,
    completion_response,
    install_error_handlers,
    model_card,
    models_response,
    new_id,
    usage,
)

from .llm import LLM
from .request import Request, RequestOutput
from .sampling import SamplingParams


def build_request(
    engine: LLM,
    body: GenerateRequest | CompletionRequest | ChatCompletionRequest,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    default_max_tokens: int | None = 16,
    request_id: str | None = None,
) -> Request:
    """Validate a request body into an engine request; every problem becomes a 400."""
    try:
        params = SamplingParams(**body.sampling_kwargs(default_max_tokens))
        return engine.make_request(prompt, params, messages=messages, request_id=request_id)
    except APIError:
        raise
    except Exception as exc:  # ValueError from validation, TemplateError from a chat template
        raise APIError(str(exc)) from exc


def generate_response(output: RequestOutput) -> dict[str, Any]:
    """The `/generate` JSON body for a finished request."""
    metrics = {"ttft_s": output.ttft, "e2e_s": output.e2e_latency}
    return {
        "request_id": output.request_id,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "usage": usage(len(output.prompt_token_ids), len(output.token_ids)),
        "metrics": metrics,
    }


def _no_streaming(stream: bool) -> None:
    if stream:
        raise APIError(
            "this stage's server does not stream; streaming arrives in stage 02", param="stream"
        )


def create_app(engine: LLM) -> FastAPI:
    app = FastAPI(title="stages 01_naive", version="0.1.0")
    install_error_handlers(app)
    app.state.engine = engine
    served = engine.model_name

    @app.api_route("/health", methods=["GET", "HEAD"])  # health checkers often send HEAD
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(served)

    @app.get("/v1/models/{model_id:path}")  # served names hold slashes: org/model
    async def model(model_id: str) -> dict[str, Any]:
        check_model_id(model_id, served)
        return model_card(served)

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> dict[str, Any]:
        _no_streaming(body.stream)
        messages = body.conversation()
        request = build_request(
            engine,
            body,
            prompt=body.prompt,
            messages=messages,
            default_max_tokens=None if messages else 16,
            request_id=new_id("req"),  # unguessable, as completions' ids: nobody reads another's
        )
        return generate_response(engine.run(request))  # blocks the event loop: see above

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        check_model_name(body.model, served)
        _no_streaming(body.stream)
        request = build_request(engine, body, prompt=body.single_prompt())
        output = engine.run(request)
        return completion_response(
            new_id("cmpl"),
            served,
            output.text,
            output.finish_reason,
            len(output.prompt_token_ids),
            len(output.token_ids),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> dict[str, Any]:
        check_model_name(body.model, served)
        _no_streaming(body.stream)
        request = build_request(engine, body, messages=body.conversation(), default_max_tokens=None)
        output = engine.run(request)
        return chat_response(
            new_id("chatcmpl"),
            served,
            output.text,
            output.finish_reason,
            len(output.prompt_token_ids),
            len(output.token_ids),
        )

    return app
