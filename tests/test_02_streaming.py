"""Stage 02 promises: tokens stream as server-sent events, the server answers while it
generates, and a client that leaves aborts its request."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from .conftest import (
    SERVER_MODULES,
    StepGate,
    abort_seen,
    held_until_abort,
    since,
    subject,
    unit,
    wait_for,
)

pytestmark = [since("02"), subject(*SERVER_MODULES)]


def _sse_events(response: httpx.Response) -> list[dict | str]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line."""
    events: list[dict | str] = []
    buffer = ""
    for chunk in response.iter_text():
        buffer += chunk
        while "\n\n" in buffer:
            frame, buffer = buffer.split("\n\n", 1)
            assert frame.startswith("data: "), frame
            payload = frame[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert buffer == ""
    return events


def _wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def tiny_server(stage, tiny_model, live_server):
    server, app = live_server(stage, tiny_model("llama-gqa"))
    return server, app.state.engine


def test_generate_sse_framing_matches_the_blocking_answer(tiny_server):
    server, _ = tiny_server
    body = {"prompt": "hello world", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    blocking = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    with httpx.stream(
        "POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    frames = events[:-1]
    assert len(frames) == 20  # one event per token
    assert [f["finish_reason"] for f in frames[:-1]] == [None] * 19
    assert frames[-1]["finish_reason"] == "length"
    assert [t for f in frames for t in f["token_ids"]] == blocking["token_ids"]
    assert "".join(f["text"] for f in frames) == blocking["text"]


def test_streamed_text_never_shows_a_stop_string(tiny_server):
    server, _ = tiny_server
    body = {"prompt": "hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["text"]
    stop = full[10:12]  # a two-character stop string from the middle of the answer
    cut = full[: full.index(stop)]
    with httpx.stream(
        "POST", f"{server.url}/generate", json={**body, "stop": [stop], "stream": True}, timeout=60
    ) as response:
        frames = _sse_events(response)[:-1]
    assert "".join(f["text"] for f in frames) == cut
    assert frames[-1]["finish_reason"] == "stop"


@pytest.mark.slow
def test_openai_client_streams(stage, real_model, live_server):
    server, _ = live_server(stage, real_model)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    plain = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert plain.choices[0].message.content == text

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    pieces = list(completion)
    assert pieces[-1].choices[0].finish_reason == "length"
    streamed = "".join(p.choices[0].text for p in pieces)
    blocking = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert streamed == blocking.choices[0].text


@pytest.fixture
def real_server(stage, real_model, live_server):
    """The real model decodes slowly enough on a CPU (tens of ms per token) that a 500-token
    request is certainly still running when the test acts on it."""
    server, app = live_server(stage, real_model)
    return server, app.state.engine


LONG_BODY = {
    "prompt": "Tell me a long story.",
    "max_tokens": 500,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.mark.slow
def test_health_answers_during_a_long_generation(real_server):
    server, async_llm = real_server
    # held after two steps (its first token is out) until /health answered: "still runs" is
    # then a fact, not a bet that the machine decodes 500 tokens slower than /health answers
    with (
        StepGate(async_llm.engine, free=2) as gate,
        httpx.stream(
            "POST", f"{server.url}/generate", json={**LONG_BODY, "stream": True}, timeout=60
        ) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generation is under way
        assert gate.held.wait(timeout=60)
        health = httpx.get(f"{server.url}/health", timeout=5)
        gate.release()
        assert health.status_code == 200
        assert health.json()["pending_requests"] >= 1  # answered while the request still runs
    assert _wait_until(lambda: async_llm.num_pending == 0)


@pytest.mark.slow
def test_stream_disconnect_aborts_the_request(real_server):
    server, async_llm = real_server
    aborted = async_llm.num_aborted
    with held_until_abort(async_llm, free=5) as gate:  # still running when the client leaves
        with httpx.stream(
            "POST", f"{server.url}/generate", json={**LONG_BODY, "stream": True}, timeout=60
        ) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
        assert wait_for(lambda: abort_seen(async_llm, gate), 30), "no abort came"
    assert _wait_until(lambda: async_llm.num_aborted == aborted + 1)
    assert _wait_until(lambda: async_llm.num_pending == 0)


@pytest.mark.slow
def test_non_streaming_disconnect_aborts_the_request(real_server):
    server, async_llm = real_server
    aborted = async_llm.num_aborted
    with held_until_abort(async_llm, free=3) as gate:  # still running when the client leaves
        with pytest.raises(httpx.ReadTimeout):
            timeout = httpx.Timeout(30, read=1.0)
            httpx.post(f"{server.url}/generate", json=LONG_BODY, timeout=timeout)
        assert wait_for(lambda: abort_seen(async_llm, gate), 30), "no abort came"
    assert _wait_until(lambda: async_llm.num_aborted == aborted + 1)
    assert _wait_until(lambda: async_llm.num_pending == 0)


def test_concurrent_streams_all_complete(tiny_server):
    server, _ = tiny_server
    results: dict[int, str] = {}

    def client(i: int) -> None:
        body = {
            "prompt": f"request {i}",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
            frames = _sse_events(r)[:-1]
        results[i] = "".join(f["text"] for f in frames) + f"|{len(frames)}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        solo = httpx.post(
            f"{server.url}/generate",
            json={
                "prompt": f"request {i}",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        ).json()
        assert results[i] == solo["text"] + "|12"


@unit("async_llm.py")
def test_a_consumer_that_stops_early_aborts_its_request(stage, tiny_model):
    """AsyncLLM.generate directly, on a tiny model (the server tests that disconnect use the
    real model): a consumer that leaves after its first output, as a client that disconnected,
    aborts its request; one that reads to the end aborts nothing."""
    async_llm = stage.AsyncLLM(stage.LLM(str(tiny_model("llama-gqa"))))
    engine = async_llm.engine
    params = stage.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def consume(request, count: int | None) -> list:
        outputs = []
        stream = async_llm.generate(request)
        async for output in stream:
            outputs.append(output)
            if count is not None and len(outputs) == count:
                break
        await stream.aclose()
        return outputs

    try:
        aborted = async_llm.num_aborted
        with held_until_abort(async_llm, free=3):  # its 400 tokens cannot end before it leaves
            asyncio.run(consume(engine.make_request("leaves early", params), 1))
        assert _wait_until(lambda: async_llm.num_aborted == aborted + 1)
        assert _wait_until(lambda: async_llm.num_pending == 0)
        short = stage.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outputs = asyncio.run(consume(engine.make_request("reads it all", short), None))
        assert outputs[-1].finish_reason == "length" and async_llm.num_aborted == aborted + 1
    finally:
        async_llm.shutdown()


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
def _scripted_async_llm(stage, script):
    """An AsyncLLM whose engine loop (`_run`, the next task) is replaced by a script: each
    submitted job is answered with `script(request)`'s items, in order. No engine runs."""
    import types

    async_llm_module = __import__(f"{stage.__name__}.async_llm", fromlist=["AsyncLLM"])

    class Scripted(async_llm_module.AsyncLLM):
        def _run(self) -> None:
            while (job := self._jobs.get()) is not None:
                for item in script(job.request):
                    job.emit(item)

    return Scripted(types.SimpleNamespace()), async_llm_module


@unit("async_llm.py")
def test_generate_submits_and_yields_until_finished_or_aborts(stage):
    """AsyncLLM.generate alone (the engine loop scripted): it submits the request, yields each
    output as it arrives and stops after the finished one; an error from the loop is raised;
    a second request under a running id is refused; a consumer that stops early asks for
    its request's abort, one that reads to the end does not."""
    import types

    request_module = __import__(f"{stage.__name__}.request", fromlist=["RequestOutput"])

    def output(request_id: str, tokens: list[int], reason: str | None):
        return request_module.RequestOutput(
            request_id, None, [1], tokens, "", reason, 0.0, None, []
        )

    def script(request):
        if request.request_id == "bad":
            return [ValueError("prompt too long")]
        return [output(request.request_id, [5], None), output(request.request_id, [5, 6], "length")]

    async_llm, async_llm_module = _scripted_async_llm(stage, script)

    async def consume(request_id: str, count: int | None) -> list:
        outputs = []
        stream = async_llm.generate(types.SimpleNamespace(request_id=request_id))
        async for item in stream:
            outputs.append(item)
            if count is not None and len(outputs) == count:
                break
        await stream.aclose()
        return outputs

    async def duplicate() -> None:
        first = async_llm.generate(types.SimpleNamespace(request_id="dup"))
        await first.__anext__()  # "dup" is running now
        with pytest.raises(ValueError, match="already running"):
            await async_llm.generate(types.SimpleNamespace(request_id="dup")).__anext__()
        await first.aclose()

    try:
        outputs = asyncio.run(consume("whole", None))
        assert [o.token_ids for o in outputs] == [[5], [5, 6]]
        assert outputs[-1].finished and async_llm.num_pending == 1  # the loop retires it
        assert "whole" not in async_llm._abort_requested, "read to the end: nothing to abort"
        async_llm._active.clear()
        with pytest.raises(ValueError, match="prompt too long"):
            asyncio.run(consume("bad", None))
        async_llm._active.clear()
        assert len(asyncio.run(consume("leaves", 1))) == 1
        assert async_llm._abort_requested == {"leaves"}, "a consumer that left aborts"
        async_llm._active.clear()
        async_llm._abort_requested.clear()
        asyncio.run(duplicate())
        async_llm.dead = "boom"
        with pytest.raises(async_llm_module.EngineDeadError, match="boom"):
            asyncio.run(consume("late", None))
    finally:
        async_llm.shutdown()
