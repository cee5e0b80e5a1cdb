"""Stage 02 promises under faults: no request can hurt another, over HTTP.

An error tied to one request fails that request alone (a 500 for it, an error frame in its
stream) while the others finish; a fatal engine error fails every job with a clear error and
turns `/health` into a 503 naming the cause; oversized bodies are refused before they are parsed,
and tokenization runs off the event loop, so `/health` and other streams stay responsive.
"""

from __future__ import annotations

import importlib
import json
import threading
import time

import httpx
import pytest

from stages.common.tooling.server_process import ThreadedServer

from .conftest import SERVER_MODULES, StepGate, eager_config, since, subject, wait_for

pytestmark = [since("02"), subject(*SERVER_MODULES)]
# What the engine does with a request matters to these too.
ENGINE_AND_SERVER = subject(*SERVER_MODULES, "engine.py", "scheduler.py", "kv_cache.py")


@pytest.fixture
def own_server(stage, tiny_model):
    """A server of its own (not the suite's shared cache): these tests break engines."""
    servers = []

    def start(**config):
        app = stage.create_app(stage.LLM(str(tiny_model("llama-gqa")), **config))
        server = ThreadedServer(app).start()
        servers.append(server)
        return server, app.state.engine

    yield start
    for server in servers:
        server.stop()


def _stream_events(url: str, body: dict) -> list:
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [
            line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ")
        ]


@ENGINE_AND_SERVER
def test_one_failing_request_does_not_fail_the_others(stage, own_server, monkeypatch):
    request_module = importlib.import_module(f"{stage.__name__}.request")
    original = request_module.Request.append_token

    def append_token(self, token_id, *when):  # stage 15 passes the iteration's time
        if self.prompt and self.prompt.startswith("doomed"):
            raise RuntimeError("detokenizer exploded")
        original(self, token_id, *when)

    monkeypatch.setattr(request_module.Request, "append_token", append_token)
    server, async_llm = own_server()
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    results: dict[str, object] = {}

    def good(i: int) -> None:
        results[f"good{i}"] = _stream_events(server.url, {**body, "prompt": f"fine {i}"})

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    bad = httpx.post(f"{server.url}/generate", json={**body, "prompt": "doomed"}, timeout=60)
    bad_stream = _stream_events(server.url, {**body, "prompt": "doomed too"})
    for thread in threads:
        thread.join(timeout=60)
    assert bad.status_code == 500 and "detokenizer exploded" in bad.json()["error"]["message"]
    assert bad_stream[-1] == "[DONE]" and "error" in bad_stream[-2]
    for i in range(3):
        events = results[f"good{i}"]
        assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "length"
        assert sum(len(e["token_ids"]) for e in events[:-1]) == 12
    # the same keep-alive connection keeps working after a 500
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.post("/generate", json={**body, "prompt": "doomed"}).status_code == 500
        ok = client.post("/generate", json={**body, "prompt": "fine again"})
        assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 12
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert async_llm.dead is None


@ENGINE_AND_SERVER
def test_a_dead_engine_fails_every_job_and_health_says_why(stage, own_server):
    server, async_llm = own_server(**eager_config(stage))
    engine = async_llm.engine
    original = engine.runner.model.forward
    calls = {"n": 0}

    def broken(*args):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(*args)

    engine.runner.model.forward = broken
    body = {"prompt": "hello", "max_tokens": 50, "temperature": 0, "ignore_eos": True}
    events = _stream_events(server.url, body)
    # What the stream said goes in the message: where generate itself failed (a blank task of
    # an assignment), its error names the stub the grader must report.
    assert calls["n"] > 3, f"the fault never fired: no step called model.forward; {events}"
    assert events[-1] == "[DONE]" and "illegal memory access" in json.dumps(events[-2])
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and "illegal memory access" in health.text
    refused = httpx.post(f"{server.url}/generate", json=body, timeout=10)
    assert refused.status_code == 503 and "stopped" in refused.json()["error"]["message"]


def test_oversized_body_is_refused_before_parsing(own_server):
    server, _ = own_server()
    huge = b'{"prompt": "' + b"x" * (12 * 2**20) + b'", "max_tokens": 4}'
    response = httpx.post(
        f"{server.url}/generate",
        content=huge,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert "too large" in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_long_prompt_is_refused_before_tokenizing(stage, own_server):
    server, async_llm = own_server()
    engine = async_llm.engine
    calls = {"n": 0}
    original = engine.tokenizer.encode

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    engine.tokenizer.encode = counting
    body = {"prompt": "word " * 200_000, "max_tokens": 4}  # 1 MB: under the body cap
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 400 and "too long" in response.json()["error"]["message"]
    assert calls["n"] == 0, "the prompt was tokenized before its length was checked"


def test_tokenization_runs_off_the_event_loop(own_server):
    """While one request's tokenization is stuck, /health still answers."""
    server, async_llm = own_server()
    engine = async_llm.engine
    release = threading.Event()
    entered = threading.Event()
    original = engine.tokenizer.encode

    def slow(*args, **kwargs):
        entered.set()
        release.wait(timeout=30)
        return original(*args, **kwargs)

    engine.tokenizer.encode = slow
    result: dict[str, int] = {}

    def post() -> None:
        body = {"prompt": "hello", "max_tokens": 2}
        result["status"] = httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code

    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        health = httpx.get(f"{server.url}/health", timeout=10)  # times out if the loop is stuck
        assert health.status_code == 200
    finally:
        release.set()
        thread.join(timeout=60)
    assert result["status"] == 200


def test_health_reports_liveness_and_load(own_server):
    server, _ = own_server()
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert {"waiting", "running", "pending_requests"} <= set(health)


def test_drain_ends_requests_in_flight_after_the_grace_period(own_server):
    """The bounded shutdown: new requests are refused at once, running ones get the grace
    period, then end with a clear error frame and [DONE]; every block comes back. The engine is
    held (`StepGate`) after a few steps until the grace is over: on a fast machine the 400
    tokens would otherwise end before it, and the drain would have nothing to cut."""
    server, async_llm = own_server()
    body = {"prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    grace = 0.3
    result: dict[str, list] = {}

    def stream() -> None:
        result["events"] = _stream_events(server.url, body)

    thread = threading.Thread(target=stream)
    with StepGate(async_llm.engine, free=3) as gate:
        thread.start()
        assert gate.held.wait(timeout=60), "the stream never ran three steps"
        drainer = threading.Thread(target=async_llm.drain, args=(grace,))
        started = time.monotonic()
        drainer.start()
        assert wait_for(lambda: async_llm.closing is not None, timeout=30)
        refused = httpx.post(f"{server.url}/generate", json=body, timeout=10)
        # the drain's own mark that the grace is over (it ends the streams at the next step)
        over = wait_for(lambda: async_llm._end_all is not None, timeout=30)
        waited = time.monotonic() - started
    drainer.join(timeout=60)
    thread.join(timeout=60)
    assert over, "the drain never ended its grace period"
    assert waited >= grace, f"the drain cut the stream after {waited:.2f} s, before its grace"
    assert not drainer.is_alive() and async_llm.num_pending == 0
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    events = result["events"]
    assert events[-1] == "[DONE]" and "shutting down" in json.dumps(events[-2])
    tokens = sum(len(e.get("token_ids", [])) for e in events[:-2])
    assert 0 < tokens < 400
    manager = getattr(async_llm.engine, "kv_manager", None)
    assert manager is None or manager.num_free_blocks == manager.allocator.num_blocks


def test_a_stream_during_the_drain_is_refused_before_it_starts(own_server):
    """Once the drain began, a streaming request gets a 503 status (what load balancers read),
    as a plain request does, never a 200 with the error in-band."""
    server, async_llm = own_server()
    async_llm.drain(0)  # nothing in flight: returns at once, and new requests are refused
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    for path, extra in (("/generate", {}), ("/v1/completions", {}), ("/v1/chat/completions", {})):
        if path == "/v1/chat/completions":
            extra = {"messages": [{"role": "user", "content": "hi"}], "prompt": None}
        payload = {k: v for k, v in {**body, **extra}.items() if v is not None}
        response = httpx.post(f"{server.url}{path}", json=payload, timeout=30)
        assert response.status_code == 503, (path, response.text)
        assert "shutting down" in response.json()["error"]["message"]


@ENGINE_AND_SERVER
def test_health_counts_preemptions_and_evictions(stage, own_server):
    """`/health` reports what the scheduler counts: preemptions (0 before stage 04, whose
    scheduler is the first that preempts) and, from stage 07, prefix-cache evictions."""
    server, async_llm = own_server()
    engine = async_llm.engine
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["num_preemptions"] == 0
    if hasattr(engine.scheduler, "num_preemptions"):
        engine.scheduler.num_preemptions = 3
        assert httpx.get(f"{server.url}/health", timeout=10).json()["num_preemptions"] == 3
    allocator = getattr(getattr(engine, "kv_manager", None), "allocator", None)
    if hasattr(allocator, "num_evictions"):
        assert health["num_evictions"] == 0
        allocator.num_evictions = 5
        assert httpx.get(f"{server.url}/health", timeout=10).json()["num_evictions"] == 5
    else:
        assert "num_evictions" not in health


def test_an_overlong_prompt_stops_tokenizing_early(own_server):
    """A prompt under the character guard but far over the context is refused after a few
    pieces are tokenized, not after the whole text (which froze every stream for a second per
    prompt on the real model), while a running stream goes on."""
    server, async_llm = own_server()
    engine = async_llm.engine
    guard = engine.max_model_len * engine.tokenizer.max_chars_per_token
    prompt = ("word " * guard)[: guard - 8]
    tokenized = {"chars": 0}
    original = engine.tokenizer.encode

    def counting(text, *args, **kwargs):
        tokenized["chars"] += len(text)
        return original(text, *args, **kwargs)

    engine.tokenizer.encode = counting
    stream_body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}
    events: list = []
    thread = threading.Thread(target=lambda: events.extend(_stream_events(server.url, stream_body)))
    steps = async_llm.num_steps  # before the stream: its steps all count
    thread.start()
    refusals = [
        httpx.post(f"{server.url}/generate", json={"prompt": prompt, "max_tokens": 4}, timeout=60)
        for _ in range(4)
    ]
    thread.join(timeout=120)
    for response in refusals:
        assert response.status_code == 400 and "too long" in response.json()["error"]["message"]
    assert tokenized["chars"] < 4 * len(prompt) / 2, "each refused prompt was tokenized whole"
    assert async_llm.num_steps > steps and events[-1] == "[DONE]"
    assert sum(len(e.get("token_ids", [])) for e in events[:-1]) == 200


def test_tokenizing_is_bounded_in_concurrency(own_server):
    """However many requests arrive at once, only a few are tokenized at a time (each holds the
    GIL while it runs); the others wait their turn and are then served."""
    server, async_llm = own_server()
    engine = async_llm.engine
    original = engine.tokenizer.encode
    lock = threading.Lock()
    state = {"active": 0, "most": 0}
    release = threading.Event()

    def slow(*args, **kwargs):
        with lock:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
        release.wait(timeout=30)
        with lock:
            state["active"] -= 1
        return original(*args, **kwargs)

    engine.tokenizer.encode = slow
    statuses: list[int] = []

    def post() -> None:
        body = {"prompt": "hello", "max_tokens": 2}
        statuses.append(httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for _ in range(200):  # until some are inside the tokenizer
        if state["active"]:
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.5)  # give the others every chance to enter too
    most_while_blocked = state["most"]
    release.set()
    for thread in threads:
        thread.join(timeout=60)
    assert 1 <= most_while_blocked <= 2, most_while_blocked
    assert statuses == [200] * 6


@ENGINE_AND_SERVER
def test_a_request_the_scheduler_never_places_fails_alone(stage, own_server):
    """A step that schedules nothing with nothing in flight (a scheduler bug, or a request no
    step can take) must not spin the engine loop for ever: the stuck request fails with the
    engine's "no progress" error, the server stays up and later requests run."""
    server, async_llm = own_server()
    scheduler = async_llm.engine.scheduler
    nothing = importlib.import_module(f"{stage.__name__}.scheduler").SchedulerOutput()
    original = scheduler.schedule
    stuck = {"on": True}
    scheduler.schedule = lambda: nothing if stuck["on"] else original()
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    refused = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert refused.status_code == 500 and "no progress" in refused.json()["error"]["message"]
    assert async_llm.dead is None and httpx.get(f"{server.url}/health").status_code == 200
    stuck["on"] = False
    ok = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 4
