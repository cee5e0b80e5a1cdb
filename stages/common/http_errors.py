"""Errors over HTTP: OpenAI-style error bodies for every failure, and a guard in front of the
routes that refuses oversized bodies before anything parses them.

No request can hurt another: bad input is a 400 (never a FastAPI 422 or a bare 500), a body past
the cap is a 413 decided from its Content-Length (or while it streams in), and any exception
still becomes a JSON error for that request alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# The request fields the engine's own checks (SamplingParams, the prompt's length) name first in
# their messages: "max_tokens must be at least 1", "messages is too long: ...".
CHECKED_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                  "prompt", "messages")  # fmt: skip


def param_named(message: str) -> str | None:
    """The request parameter a message is about: the first of `CHECKED_PARAMS` it names as a
    word ("at most 16 stop strings" is about `stop`, not `stop_token_ids`), else None."""
    found = [
        (m.start(), name) for name in CHECKED_PARAMS if (m := re.search(rf"\b{name}\b", message))
    ]
    return min(found)[1] if found else None


class APIError(Exception):
    """An error the client caused (or can act on): becomes an OpenAI-style error body. Its
    `param` names the parameter at fault, as OpenAI's do; left out, it is the one the message
    names (`param_named`), so that a ValueError from the engine's checks keeps it too."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status = message, status
        self.param = param if param is not None or status >= 500 else param_named(message)


def error_body(message: str, *, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# Far beyond any prompt a context of today's models holds (8k tokens are ~40 kB of text), far
# below what would stall the event loop while it is parsed.
MAX_BODY_BYTES = 2 * 2**20


class RequestBodyGuard:
    """ASGI middleware in front of every route: refuses a body larger than `max_bytes` with a
    413 before anything parses it, and treats every POST body as JSON whatever its content type
    (curl's `-d` sends a form type). A declared Content-Length is checked at once; a chunked
    body is read here, counting, before the route sees it (the route's own reader would turn
    an error raised mid-body into a 400 about parsing)."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            """The whole body once, then the real channel (which reports a disconnect)."""
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(
            error_body(f"request body too large: the limit is {self.max_bytes} bytes", status=413)
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers with an OpenAI-style JSON error body; bad input is a 400, never a
    FastAPI 422 or a bare 500. Oversized bodies are refused before parsing (a 413)."""
    app.add_middleware(RequestBodyGuard)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, status=exc.status, param=exc.param), status_code=exc.status
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

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


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A message a user understands, and the offending parameter."""
    parts, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return "request body is not valid JSON", None
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        # a union reports each branch it tried ("prompt.str", "prompt.list[int]"): keep the field
        location = [p for p in location if not (p[:1].islower() and "[" in p) and p != "str"]
        name = ".".join(location) or "body"
        param = param or (location[0] if location else None)
        message = error.get("msg", "invalid")
        if error.get("type") == "missing":
            message = "is required"
        elif error.get("type") == "extra_forbidden":
            message = "is not a parameter of this API"
        parts.append(f"{name}: {message}")
    return "invalid request: " + "; ".join(dict.fromkeys(parts)), param
