"""The HTTP protocol every stage's server speaks: request schemas, responses, error bodies.

Two APIs:
- `POST /generate`: this project's own, minimal (prompt or messages in; text and token ids out,
  or SSE frames when `stream` is true).
- the OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`, so the
  official `openai` client and standard load generators work unchanged.

Nothing here knows about an engine: the schemas turn JSON into plain sampling arguments, and the
builders turn results back into JSON. Each stage's `server.py` wires them to its engine.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error the client caused (or can act on): becomes an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_body(message: str, *, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers with an OpenAI-style JSON error body; bad input is a 400, never a
    FastAPI 422 or a bare 500."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, status=exc.status, param=exc.param), status_code=exc.status
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_describe_validation_error(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), status=exc.status_code), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", status=500), status_code=500
        )


def _describe_validation_error(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return "request body is not valid JSON"
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


# --------------------------------------------------------------------------- request schemas
class _SamplingFields(BaseModel):
    """Sampling fields shared by every endpoint (values are checked by SamplingParams)."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for the stage's SamplingParams; rejects what the engine lacks."""
        if self.n != 1:
            raise APIError("only n=1 is supported", param="n")
        if self.logprobs not in (None, False):
            raise APIError("logprobs are not supported", param="logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError("presence/frequency penalties are not supported", param="penalty")
        kwargs: dict[str, Any] = {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "stop": self.stop or (),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; OpenAI's list-of-parts form is joined, non-text parts refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError("only text content parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)


class GenerateRequest(_SamplingFields):
    """Body of `POST /generate`: a prompt (text or token ids) or a chat conversation."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = 16


class CompletionRequest(_SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise APIError("only one prompt per request is supported", param="prompt")
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if (isinstance(prompt, str) and not prompt) or (isinstance(prompt, list) and not prompt):
            raise APIError("prompt must not be empty", param="prompt")
        return prompt


class ChatCompletionRequest(_SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_kwargs(default_max_tokens)


def include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def check_model_name(requested: str | None, served: str) -> None:
    """Reject a request for a model this server does not serve."""
    if requested is not None and requested != served:
        raise APIError(
            f"model {requested!r} does not exist; this server serves {served!r}", param="model"
        )


# --------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_response(served: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": served, "object": "model", "created": int(time.time()), "owned_by": "stages"}
        ],
    }


def completion_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    request_id: str, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    request_id: str, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(
    request_id: str, model: str, obj: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The final chunk OpenAI sends when `stream_options.include_usage` is set."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent-event frame: `data: <json>` and a blank line."""
    # ASCII-only JSON: U+2028/U+2029 left raw would split the frame for line-based clients.
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
