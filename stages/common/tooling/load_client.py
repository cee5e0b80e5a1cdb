"""An async HTTP load client that measures what a user feels: TTFT and ITL per request.

It speaks this project's `/generate` SSE and the OpenAI `/v1/completions` and
`/v1/chat/completions` APIs (streaming or not): `send_request` sends one request and times
its first token and every gap after it; a benchmark sends as many at once as it needs.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Api = Literal["generate", "completions", "chat"]


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One request to send: a prompt (text, token ids, or chat messages) and its limits."""

    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    api: Api = "generate"
    stream: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # temperature, ignore_eos, ...


@dataclass(slots=True)
class ClientResult:
    """What the client observed for one request (times are time.perf_counter seconds)."""

    sent_at: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    done_at: float | None = None
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    usage_tokens: int | None = None  # the server's own count (`stream_options.include_usage`)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def itl(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def _body(request: ClientRequest, model: str | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "stream": request.stream,
        **request.extra,
    }
    if request.api == "generate":
        key = (
            "messages"
            if isinstance(request.prompt, list)
            and request.prompt
            and isinstance(request.prompt[0], dict)
            else "prompt"
        )
        return "/generate", {key: request.prompt, **body}
    if model is not None:
        body["model"] = model
    if request.api == "chat":
        return "/v1/chat/completions", {"messages": request.prompt, **body}
    return "/v1/completions", {"prompt": request.prompt, **body}


def _count_and_text(api: Api, event: dict[str, Any]) -> tuple[int, str, str | None]:
    """Tokens, text and finish reason carried by one SSE event."""
    if api == "generate":
        return len(event.get("token_ids", [])), event.get("text", ""), event.get("finish_reason")
    choices = event.get("choices") or []
    if not choices:
        return 0, "", None
    choice = choices[0]
    text = (
        choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
    )
    return (1 if text else 0), text or "", choice.get("finish_reason")


async def send_request(
    client: httpx.AsyncClient, base_url: str, request: ClientRequest, model: str | None = None
) -> ClientResult:
    path, body = _body(request, model)
    result = ClientResult(sent_at=time.perf_counter())
    try:
        if not request.stream:
            response = await client.post(base_url + path, json=body)
            result.status = response.status_code
            result.done_at = time.perf_counter()
            result.first_token_at = result.done_at  # a blocking client sees everything at once
            payload = response.json()
            if response.status_code != 200:
                result.error = payload.get("error", {}).get("message", response.text)
                return result
            if request.api == "generate":
                result.text, result.num_tokens = payload["text"], len(payload["token_ids"])
                result.finish_reason = payload["finish_reason"]
            else:
                choice = payload["choices"][0]
                result.text = choice.get("text") or choice.get("message", {}).get("content", "")
                result.num_tokens = payload["usage"]["completion_tokens"]
                result.finish_reason = choice["finish_reason"]
            result.token_times = [result.done_at]
            return result
        async with client.stream("POST", base_url + path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    break
                if event.get("usage"):  # the last chunk, when the request asked for usage
                    result.usage_tokens = event["usage"].get("completion_tokens")
                tokens, text, finish = _count_and_text(request.api, event)
                now = time.perf_counter()
                if tokens:
                    result.first_token_at = result.first_token_at or now
                    result.token_times.extend([now] * tokens)
                    result.num_tokens += tokens
                result.text += text
                result.finish_reason = finish or result.finish_reason
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.done_at = time.perf_counter()
    return result
