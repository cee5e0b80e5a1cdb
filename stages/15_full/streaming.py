"""How a submitted request becomes an HTTP answer: the whole output at the end, or SSE frames.

`wait_for_final_output` serves a plain request: it waits for the last output and polls for the
client's disconnect meanwhile (Starlette does not cancel a handler whose client left).
`event_stream` serves `stream: true`: one frame per step's new tokens, then `[DONE]`; a client
that leaves cancels the response generator, which aborts the request in `AsyncLLM`.

The status line goes out before the first frame, so whatever could still refuse a request (the
server draining, the engine dead) is decided before the stream starts: a 503 load balancers can
read, not a 200 with the error inside.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from stages.common.protocol import SSE_DONE, APIError, error_body, sse

from .async_llm import AsyncLLM, EngineDeadError
from .request import Request, RequestOutput

DISCONNECT_POLL_S = 0.2


async def wait_for_final_output(
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


async def _submitted(async_llm: AsyncLLM, request: Request) -> AsyncIterator[RequestOutput]:
    """Submit the request now and return its outputs; a refusal raises here, as an APIError.

    `generate` submits when it is first iterated: a task starts that iteration, and one turn
    of the event loop runs it up to the submission (the task runs before this coroutine
    resumes), so a refused request has already failed when `sleep(0)` returns."""
    outputs = async_llm.generate(request)
    first = asyncio.ensure_future(outputs.__anext__())
    await asyncio.sleep(0)
    if first.done() and first.exception() is not None:
        exc = first.exception()
        if isinstance(exc, EngineDeadError):
            raise APIError(str(exc), status=503) from exc
        if isinstance(exc, ValueError):  # say, a request id that is already running
            raise APIError(str(exc)) from exc

    async def chained() -> AsyncIterator[RequestOutput]:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for output in outputs:
            yield output

    return chained()


async def event_stream(
    async_llm: AsyncLLM,
    request: Request,
    frames: Callable[[RequestOutput, int], list[str]],
) -> StreamingResponse:
    """SSE response: `frames(output, num_output_tokens)` renders each step's events. The
    request's outputs are deltas (each holds only its new text and tokens); the second argument
    counts every output token so far, for `usage`. Refusals come before the status line."""
    outputs = await _submitted(async_llm, request)

    async def body() -> AsyncIterator[str]:
        num_output_tokens = 0
        try:
            async for output in outputs:
                if output.error is not None:  # headers are sent: report the failure in-band
                    yield sse(error_body(f"request failed: {output.error}", status=500))
                    break
                num_output_tokens += len(output.token_ids)
                for frame in frames(output, num_output_tokens):
                    yield frame
        except EngineDeadError as exc:  # the engine died, or the drain ended it, mid-stream
            yield sse(error_body(str(exc), status=503))
        except Exception as exc:
            yield sse(error_body(f"internal error: {exc}", status=500))
        yield SSE_DONE

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
