"""The OpenAI-compatible response bodies and server-sent-event frames every stage's server sends.

Plain builders from results to JSON: nothing here knows about an engine or about requests'
schemas (those are in protocol.py, which re-exports these names for the servers).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage block; with a prefix cache (stage 07 on), the prompt tokens it served."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def model_card(served: str) -> dict[str, Any]:
    """One model as `GET /v1/models/{id}` (the openai client's `models.retrieve`) shows it."""
    return {"id": served, "object": "model", "created": int(time.time()), "owned_by": "stages"}


def models_response(served: str) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(served)]}


def completion_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
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
    cached_tokens: int | None = None,
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
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
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
    request_id: str,
    model: str,
    obj: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The final chunk OpenAI sends when `stream_options.include_usage` is set."""
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent-event frame: `data: <json>` and a blank line."""
    # ASCII-only JSON: U+2028/U+2029 left raw would split the frame for line-based clients.
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
