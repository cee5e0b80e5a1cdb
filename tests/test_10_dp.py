"""Stage 10 promises: moving the engine core out of the server's process changes nothing a client
sees, and the replicas behave as processes should.

The front end detokenizes and cuts stop strings (OutputProcessor): fed a request's tokens one
step at a time it gives the in-process engine's text, cut, kinds and finish reasons, and names
the requests the core must drop. Two replicas behind the server answer exactly what one
in-process engine answers (greedy and seeded, concurrent, streamed or not, with stop strings),
under every routing policy. A replica killed mid-run fails its own requests with an error
naming it, leaves the rotation and shows in /health; the other keeps serving. Replicas die with
their front end (shut down, killed, terminated, Ctrl-C with two ranks each). After everything
the router's load is 0.

Replica start-up costs seconds: one DP=2 server per module, engines cached (`make_llm`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import httpx
import pytest

from stages.common.tooling.server_process import ThreadedServer

from .conftest import TEST_KV_CACHE_BYTES, since, subject
from .parents import ParentProcesses, children_of
from .test_09_tp import _wait_gone

# What these tests are about: on a later newest stage they run again only if one of these changed.
DP_MODULES = (
    "frontend/dp_client.py",
    "frontend/engine_core.py",
    "frontend/output_processor.py",
    "frontend/core_messages.py",
    "frontend/router.py",
    "server.py",
    "request.py",
    "kv_cache.py",
)
pytestmark = [since("10"), pytest.mark.slow, subject(*DP_MODULES)]
# The replicas' lifecycle: what the tests of dying and killed replicas are about.
LIFECYCLE = subject("frontend/dp_client.py", "frontend/engine_core.py", "frontend/core_messages.py")

BLOCK = 4
PROMPTS = ["The quick brown fox", "Once upon a time there", "A B C D E F G", "hello"]


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _client(stage: ModuleType, model: Any, **config: Any) -> Any:
    config = {"block_size": BLOCK, "kv_cache_bytes": TEST_KV_CACHE_BYTES, **config}
    return _module(stage, "frontend.dp_client").DPClient(str(model), data_parallel_size=2, **config)


def _loads(client: Any) -> list[int]:
    return [r["load"] for r in client.router.stats()["replicas"]]


_SERVERS: dict[str, tuple[ThreadedServer, Any]] = {}  # per stage, for this module


@pytest.fixture(scope="module", autouse=True)
def _stop_dp_servers():
    yield
    for server, client in _SERVERS.values():
        server.stop()
        client.shutdown()
        assert _wait_gone([r.process.pid for r in client.replicas]), "a replica outlived shutdown"
    _SERVERS.clear()


@pytest.fixture
def dp_server(stage, tiny_model) -> tuple[ThreadedServer, Any]:
    """A DP=2 server (cache_aware) over the tiny checkpoint, kept for the module."""
    if stage.__name__ not in _SERVERS:
        client = _client(stage, tiny_model("llama-gqa"))
        _SERVERS[stage.__name__] = (ThreadedServer(stage.create_app(client)).start(), client)
    return _SERVERS[stage.__name__]


@pytest.fixture
def one_server(stage, tiny_model, live_server) -> ThreadedServer:
    return live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)[0]


@LIFECYCLE
def test_replicas_need_the_front_end(stage, tiny_model):
    with pytest.raises(ValueError, match="DPClient"):
        stage.LLM(str(tiny_model("llama-gqa")), data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        stage.EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="routing_policy"):
        stage.EngineConfig(routing_policy="random")


# ------------------------------------------------------------------------- DP=2 == DP=1
def _completion(url: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of a /v1/completions call, streamed or not."""
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
    return text, finish


def _bodies(one_url: str) -> list[dict[str, Any]]:
    bodies = []
    for i, prompt in enumerate(PROMPTS):
        base = {"model": "x", "prompt": prompt, "max_tokens": 14, "ignore_eos": True}
        base["model"] = httpx.get(f"{one_url}/v1/models", timeout=10).json()["data"][0]["id"]
        greedy = {**base, "temperature": 0}
        seeded = {**base, "temperature": 1.0, "seed": 100 + i}
        text, _ = _completion(one_url, greedy)
        stop = text[4:7]
        bodies += [greedy, seeded, {**greedy, "stop": [stop]} if len(stop) == 3 else greedy]
    return [{**b, "stream": s} for b in bodies for s in (False, True)]


def test_two_replicas_answer_what_one_engine_answers(stage, dp_server, one_server):
    server, client = dp_server
    bodies = _bodies(one_server.url)
    expected = [_completion(one_server.url, b) for b in bodies]
    assert any(finish == "stop" for _, finish in expected)  # a stop string was hit
    with ThreadPoolExecutor(6) as pool:  # concurrent: both replicas busy at once
        got = list(pool.map(lambda b: _completion(server.url, b), bodies))
    assert got == expected
    served = [r["served"] for r in client.router.stats()["replicas"]]
    assert all(served), f"a replica served nothing: {served}"
    assert _loads(client) == [0, 0] and client.num_pending == 0


# ------------------------------------------------------------------------- routing policies
async def _generate_all(client: Any, stage, prompts: list[str], n: int = 10) -> list[Any]:
    params = stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    async def one(prompt: str) -> Any:
        request = client.make_request(prompt, params, output_kind="final")
        return [o async for o in client.generate(request)][-1]

    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_each_routing_policy_end_to_end(stage, tiny_model, make_llm, dp_server, policy):
    model = tiny_model("llama-gqa")
    client = (
        dp_server[1] if policy == "cache_aware" else _client(stage, model, routing_policy=policy)
    )
    try:
        llm = make_llm(stage, model, block_size=BLOCK)
        params = stage.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        before = client.router.stats()["decisions"]
        outputs = asyncio.run(_generate_all(client, stage, PROMPTS))
        assert [o.token_ids for o in outputs] == expected
        decisions = client.router.stats()["decisions"]
        made = {k: decisions.get(k, 0) - before.get(k, 0) for k in decisions}
        if policy == "cache_aware":  # a long shared prompt again: the replica that holds it
            long_prompt = " ".join(PROMPTS * 3)
            asyncio.run(_generate_all(client, stage, [long_prompt]))
            holder = client.router.last_decision.replica
            asyncio.run(_generate_all(client, stage, [long_prompt]))
            assert client.router.last_decision.reason == "cache_hit"
            assert client.router.last_decision.replica == holder
        else:
            assert made.get(policy) == len(PROMPTS)
            assert all(r["served"] == 2 for r in client.router.stats()["replicas"])
        assert _loads(client) == [0, 0]
    finally:
        if client is not dp_server[1]:
            client.shutdown()


def test_a_client_that_leaves_frees_its_load_and_its_replica(stage, dp_server):
    """Stopping early (a client gone) aborts the request in the front end and in its core:
    the router's load is back to 0 at once and the replica stops running it."""
    _, client = dp_server
    params = stage.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def leave_early() -> int:
        request = client.make_request("hi", params, output_kind="delta")
        outputs = client.generate(request)
        await outputs.__anext__()
        await outputs.aclose()  # the consumer goes away after the first step
        return client.router.last_decision.replica

    replica = asyncio.run(leave_early())
    assert _loads(client) == [0, 0] and client.num_pending == 0
    for _ in range(100):  # the core hears the abort and reports an empty batch
        report = client.health_report()["replicas"][replica]
        if report["running"] == 0 and report["waiting"] == 0:
            break
        threading.Event().wait(0.05)
    assert report["running"] == report["waiting"] == 0, report


# ------------------------------------------------------------------------- failures
@subject("frontend/dp_client.py")  # the front end's bookkeeping: where DPClient changes
def test_a_live_replica_that_fails_one_request_gives_back_its_load(stage, tiny_model):
    """A replica that fails one request with "error" and lives on (here: a prompt its pool can
    never hold, sent past the front end's check, which the core fails as stuck): that request
    alone ends, its router load and pending job are given back, both replicas stay alive and
    serve the next requests. (A front end that retired only non-"error" endings passed every
    other test; the load leaked on a live replica.)"""
    client = _client(stage, tiny_model("llama-gqa"), kv_cache_bytes=64 * 2**10)
    try:
        pool_tokens = client.config.max_model_len  # clamped to the pool by the cores
        params = stage.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

        async def run() -> list[Any]:
            doomed = client.make_request("hi", params)
            doomed.prompt_token_ids = [7] * (pool_tokens + 2 * BLOCK)  # past the check
            finals = [await _last(client, doomed)]
            for prompt in PROMPTS[:2]:  # afterwards, each replica still serves
                finals.append(await _last(client, client.make_request(prompt, params)))
            return finals

        failed, *served = asyncio.run(run())
        assert failed.finish_reason == "error" and failed.error, failed
        assert [o.finish_reason for o in served] == ["length", "length"]
        assert _loads(client) == [0, 0] and client.num_pending == 0
        assert client.dead is None and all(r["alive"] for r in client.health_report()["replicas"])
    finally:
        client.shutdown()


async def _last(client: Any, request: Any) -> Any:
    async for output in client.generate(request):
        last = output
    return last


@LIFECYCLE
def test_a_killed_replica_fails_its_requests_and_the_other_serves(stage, tiny_model):
    client = _client(stage, tiny_model("llama-gqa"), routing_policy="round_robin")
    try:
        with ThreadedServer(stage.create_app(client)) as server:
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
            body |= {"temperature": 0, "stream": True}
            victim = client.replicas[0]
            frames: list[str] = []

            def stream() -> None:  # round robin: the first request goes to replica 0
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and not frames:
                            os.kill(victim.process.pid, signal.SIGKILL)
                        frames.append(line)

            thread = threading.Thread(target=stream)
            thread.start()
            thread.join(timeout=60)
            assert not thread.is_alive()
            errors = [f for f in frames if '"error"' in f]
            assert errors and "engine replica 0" in errors[0], frames[-3:]
            assert _wait_gone([victim.process.pid])
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 200  # one replica is left
            replicas = health.json()["replicas"]
            assert [r["alive"] for r in replicas] == [False, True]
            assert "engine replica 0" in replicas[0]["error"]
            assert replicas[0]["running"] == replicas[0]["waiting"] == 0, "dead: runs nothing"
            short = {**body, "max_tokens": 4, "stream": False}
            for _ in range(3):  # every new request goes to the survivor
                answer = httpx.post(f"{server.url}/v1/completions", json=short, timeout=60)
                assert answer.status_code == 200, answer.text
            stats = client.router.stats()["replicas"]
            assert [r["served"] for r in stats] == [1, 3] and [r["load"] for r in stats] == [0, 0]
            os.kill(client.replicas[1].process.pid, signal.SIGKILL)
            assert _wait_gone([client.replicas[1].process.pid])
            for _ in range(50):
                health = httpx.get(f"{server.url}/health", timeout=10)
                if health.status_code == 503:
                    break
                threading.Event().wait(0.1)
            assert health.status_code == 503 and "replica 1" in health.text
    finally:
        client.shutdown()


# A process started in the background inherits SIGINT ignored (POSIX): restore Python's handler,
# as a terminal's foreground process has it (see tests/test_09_tp.py).
ORPHAN_SCRIPT = """
import importlib, signal, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import stages
stage = stages.load({stage!r})
dp = importlib.import_module(stage.__name__ + ".frontend.dp_client")
client = dp.DPClient(
    {model!r}, block_size=4, kv_cache_bytes={kv}, data_parallel_size=2, tensor_parallel_size={tp}
)
print(" ".join(str(r.process.pid) for r in client.replicas), flush=True)
time.sleep(120)
"""
WAYS = ("SIGKILL", "SIGTERM", "SIGINT")


@pytest.fixture(scope="module")
def parents() -> Iterator[ParentProcesses]:
    started = ParentProcesses()
    yield started
    started.kill_all()


@LIFECYCLE
@pytest.mark.parametrize("how", WAYS)
def test_replicas_die_with_their_front_end(stage, tiny_model, parents, how):
    """No replica outlives its front end, killed or terminated; on Ctrl-C (SIGINT to the whole
    process group, replicas of two ranks each) no replica and no rank does. The three front ends
    start together (tests/parents.py); each test stops its own."""
    model, kv = str(tiny_model("llama-gqa")), TEST_KV_CACHE_BYTES
    scripts = {
        way: ORPHAN_SCRIPT.format(
            stage=stage.STAGE, model=model, kv=kv, tp=2 if way == "SIGINT" else 1
        )
        for way in WAYS
    }
    parent = parents.started(stage.STAGE, scripts)[how]
    proc, replicas = parent.process, parent.child_pids
    assert len(replicas) == 2, f"the front end did not start: {replicas!r}"
    ranks = []
    if how == "SIGINT":
        ranks = [pid for replica in replicas for pid in children_of(replica)]
        assert len(ranks) == 2, f"expected one worker per replica, found {ranks}"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    else:
        os.kill(proc.pid, getattr(signal, how))
    proc.wait(timeout=30)
    assert _wait_gone(replicas + ranks), f"{replicas + ranks} outlived their front end ({how})"
