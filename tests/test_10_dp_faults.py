"""Stage 10 promises under faults: a broken replica, a drain, tensor parallelism inside a
replica, and a burst of clients that give up.

A core whose `step()` raises (here: a request with a token id outside the vocabulary, sent
straight to replica 0, so only that replica sees it) fails the requests it holds with its
traceback and leaves the rotation; the other replica finishes its own request with one
engine's tokens and takes every new one. `drain` lets a short request finish, ends a long one
with an error frame once the grace period is over, and refuses new requests with a 503. Two
replicas of two tensor-parallel ranks each (four processes) answer what one in-process engine
answers (Ctrl-C of such a front end: test_10_dp.py's no-orphan test). After a burst
where clients finish, abort and disconnect, the router's load and the replicas' queues are 0.

Start-up costs seconds: one DP=2 x TP=2 server per module (the drain test runs last on it and
closes it); the fault test needs its own client, since it breaks a replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from stages.common import supervisor
from stages.common.tooling.server_process import ThreadedServer

from .conftest import LONG_CONTEXT_REQUEST, TEST_KV_CACHE_BYTES, since, subject, wait_for
from .parents import children_of
from .test_09_tp import _wait_gone
from .test_10_dp import DP_MODULES

pytestmark = [since("10"), pytest.mark.slow, subject(*DP_MODULES)]

BLOCK = 4
PROMPTS = ["The quick brown fox", "Once upon a time there", "A B C D E F G", "hello"]
# Tokens: the requests the tests abandon, abort or drain are still running then, however fast
# the machine (the long-context tiny model: its cores are processes, whose steps no test holds).
LONG = LONG_CONTEXT_REQUEST


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _client(stage: ModuleType, model: Any, **config: Any) -> Any:
    config = {"block_size": BLOCK, "kv_cache_bytes": TEST_KV_CACHE_BYTES, **config}
    return _module(stage, "frontend.dp_client").DPClient(str(model), data_parallel_size=2, **config)


def _loads(client: Any) -> list[int]:
    return [r["load"] for r in client.router.stats()["replicas"]]


def _greedy(stage: ModuleType, n: int = 10):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _wait_idle(client: Any, seconds: float = 10.0) -> list[dict[str, Any]]:
    """Until every live replica reports empty queues (its last message after an abort)."""
    deadline = time.monotonic() + seconds
    while True:
        replicas = [r for r in client.health_report()["replicas"] if r["alive"]]
        if all(r["running"] == r["waiting"] == 0 for r in replicas):
            return replicas
        if time.monotonic() > deadline:
            return replicas
        time.sleep(0.05)


_SERVERS: dict[str, tuple[ThreadedServer, Any]] = {}  # per stage, for this module


@pytest.fixture(scope="module", autouse=True)
def _stop_dp_servers():
    yield
    for server, client in _SERVERS.values():
        server.stop()
        client.shutdown()
        pids = [r.process.pid for r in client.replicas]
        assert _wait_gone(pids), "a replica outlived shutdown"
    _SERVERS.clear()


@pytest.fixture
def tp_server(stage, tiny_long_context_model) -> tuple[ThreadedServer, Any]:
    """Two replicas of two tensor-parallel ranks each over the tiny checkpoint (llama-gqa's
    weights, a long context), kept for the module (the drain test, last, closes it)."""
    if stage.__name__ not in _SERVERS:
        client = _client(stage, tiny_long_context_model, tensor_parallel_size=2)
        _SERVERS[stage.__name__] = (ThreadedServer(stage.create_app(client)).start(), client)
    return _SERVERS[stage.__name__]


async def _final(client: Any, prompt: str, params: Any) -> Any:
    request = client.make_request(prompt, params, output_kind="final")
    return [o async for o in client.generate(request)][-1]


# ------------------------------------------------------------------------- a core that raises
def _step_error(device: torch.device) -> str:
    """What the poisoned step raises, as its traceback names it. On the CPU the embedding checks
    the id: IndexError. On CUDA the lookup is a kernel whose bounds check is a device-side
    assert, reported at the next wait on the device (the step handle's, when its result is
    read) as `torch.AcceleratorError: CUDA error: device-side assert triggered`; that error
    also leaves the process's CUDA context unusable, so the replica must go."""
    return "IndexError" if device.type == "cpu" else "device-side assert triggered"


def test_a_core_whose_step_raises_fails_its_requests_and_leaves_the_rotation(
    stage, tiny_long_context_model, make_llm, device
):
    error = _step_error(device)
    model = tiny_long_context_model  # the doomed request still runs when the poison comes
    client = _client(stage, model, routing_policy="round_robin")
    messages = _module(stage, "frontend.core_messages")
    expected = make_llm(stage, model, block_size=BLOCK).generate([PROMPTS[1]], _greedy(stage, 40))
    try:

        async def run() -> tuple[Any, Any]:
            doomed = client.make_request(PROMPTS[0], _greedy(stage, LONG), output_kind="delta")
            outputs = client.generate(doomed)  # round robin: replica 0
            await outputs.__anext__()
            assert client.router.last_decision.replica == 0
            survivor = asyncio.ensure_future(_final(client, PROMPTS[1], _greedy(stage, 40)))
            await asyncio.sleep(0)  # submitted: replica 1
            assert client.router.last_decision.replica == 1
            poison = messages.EngineCoreRequest(
                "poison", (10**6,), _greedy(stage, 2), None, time.time()
            )  # a token id no embedding holds: replica 0's next step raises
            client._send(0, ("add", poison))
            last = [o async for o in outputs][-1]
            return last, await survivor

        doomed, survivor = asyncio.run(run())
        assert doomed.finish_reason == "error"
        assert "engine replica 0" in doomed.error and "Traceback" in doomed.error
        assert error in doomed.error and "step" in doomed.error, doomed.error
        assert survivor.finish_reason == "length"
        assert survivor.token_ids == expected[0].token_ids  # the other replica was untouched
        assert _wait_gone([client.replicas[0].process.pid])
        health = client.health_report()
        assert health["status"] == "degraded" and client.dead is None
        assert [r["alive"] for r in health["replicas"]] == [False, True]
        assert error in health["replicas"][0]["error"]
        served = [r["served"] for r in health["router"]["replicas"]]

        async def more() -> list[Any]:
            return await asyncio.gather(*(_final(client, p, _greedy(stage)) for p in PROMPTS))

        assert all(o.finish_reason == "length" for o in asyncio.run(more()))
        after = [r["served"] for r in client.router.stats()["replicas"]]
        assert after == [served[0], served[1] + len(PROMPTS)]  # all to the survivor
        assert _loads(client) == [0, 0] and client.num_pending == 0
    finally:
        client.shutdown()
    assert _wait_gone([r.process.pid for r in client.replicas])


# ------------------------------------------------------------------------- a core that can't start
def fake_starts(monkeypatch, module: ModuleType, plan: dict[int, str]) -> list[int]:
    """Make `module` (stages/common/supervisor.py) start fake cores (tests/fake_cores.py) per
    `plan`; the list fills with their pids. The start-up wait is cut to 60 s, so that a front
    end that waits for its cores in turn fails (blaming the hanging core) instead of waiting
    300 s."""
    from stages.common.spawn import start_stage_process

    from .fake_cores import fake_core

    pids: list[int] = []

    def start(function: Any, args: tuple[Any, ...], name: str) -> Any:
        process, conn = start_stage_process(fake_core, (args[0].replica, plan), name)
        pids.append(process.pid)
        return process, conn

    monkeypatch.setattr(module, "start_stage_process", start)
    monkeypatch.setattr(module, "START_TIMEOUT_SECONDS", 60.0)
    return pids


@pytest.mark.parametrize(
    ("plan", "expected"),
    [({1: "fatal"}, "engine replica 1 .*failed to start.*no room for the KV cache"),
     ({1: "exit"}, "engine replica 1 .*exited with code 3")],
    ids=["fatal", "exit"],
)  # fmt: skip
def test_a_replica_that_dies_at_start_up_is_named_while_another_still_loads(
    stage, tiny_model, monkeypatch, plan, expected
):
    """Replica 0 never gets ready; replica 1 dies at once. The front end fails on replica 1's
    death, with its own error, and stops replica 0 (before: it waited for replica 0 until the
    timeout, then blamed it)."""
    pids = fake_starts(monkeypatch, supervisor, plan)
    with pytest.raises(RuntimeError, match=expected) as failed:
        _client(stage, tiny_model("llama-gqa"))
    assert "replica 0" not in str(failed.value)
    assert len(pids) == 2 and _wait_gone(pids), "a replica outlived the failed start"


# ------------------------------------------------------------------------- TP inside DP
def test_two_replicas_of_two_ranks_answer_what_one_engine_answers(
    stage, tiny_model, make_llm, tp_server
):
    _, client = tp_server
    workers = [children_of(r.process.pid) for r in client.replicas]
    assert [len(w) for w in workers] == [1, 1], workers  # 2 replicas + 2 ranks: 4 processes
    single = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    greedy = [_greedy(stage, 12)] * len(PROMPTS)
    seeded = [
        stage.SamplingParams(max_tokens=12, temperature=1.0, seed=20 + i)
        for i in range(len(PROMPTS))
    ]
    params = greedy + seeded
    expected = [o.token_ids for o in single.generate(PROMPTS * 2, params)]

    async def run() -> list[Any]:
        return await asyncio.gather(
            *(_final(client, p, q) for p, q in zip(PROMPTS * 2, params, strict=True))
        )

    assert [o.token_ids for o in asyncio.run(run())] == expected
    assert all(r["served"] for r in client.router.stats()["replicas"])
    assert _loads(client) == [0, 0]


# ------------------------------------------------------------------------- load accounting
def _disconnect_after_first_frame(url: str, body: dict[str, Any]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return  # leaving the block closes the connection mid-stream


def _give_up_waiting(url: str, body: dict[str, Any]) -> None:
    try:
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    except httpx.TimeoutException:
        return  # the client gave up; the server notices the closed connection


def test_load_returns_to_zero_after_a_burst_with_aborts_and_disconnects(
    stage, tp_server, monkeypatch
):
    """Every way a request can end gives its load back and, for those abandoned, tells its
    core to drop it: no abandoned request runs to its end in a replica."""
    server, client = tp_server
    core_tokens: dict[str, int] = {}  # per request, the tokens its core produced
    core_finished: dict[str, str] = {}
    on_outputs = client._on_outputs

    def recording(message: Any) -> None:
        for output in message.outputs:
            core_tokens[output.request_id] = core_tokens.get(output.request_id, 0) + len(
                output.new_token_ids
            )
            if output.finish_reason is not None:
                core_finished[output.request_id] = output.finish_reason
        on_outputs(message)

    monkeypatch.setattr(client, "_on_outputs", recording)
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    long_body = {"model": model, "prompt": "hi", "max_tokens": LONG, "ignore_eos": True}

    async def in_process() -> list[str]:
        async def finish(prompt: str) -> str:
            return (await _final(client, prompt, _greedy(stage, 6))).finish_reason

        async def leave(prompt: str) -> str:
            request = client.make_request(prompt, _greedy(stage, LONG), output_kind="delta")
            outputs = client.generate(request)
            await outputs.__anext__()
            await outputs.aclose()  # the consumer goes away
            return "left"

        async def abort(prompt: str) -> str:
            request = client.make_request(prompt, _greedy(stage, LONG), output_kind="delta")
            reasons = []
            async for output in client.generate(request):
                client.abort(request.request_id)  # as another task would
                reasons.append(output.finish_reason)
            return reasons[-1]

        jobs = [finish(p) for p in PROMPTS] + [leave(p) for p in PROMPTS[:2]]
        jobs += [abort(p) for p in PROMPTS[2:]]
        return await asyncio.gather(*jobs)

    with ThreadPoolExecutor(4) as pool:
        http = [
            pool.submit(_disconnect_after_first_frame, server.url, long_body | {"stream": True})
        ]
        http += [pool.submit(_give_up_waiting, server.url, long_body) for _ in range(2)]
        reasons = asyncio.run(in_process())
        for future in http:
            future.result()
    assert reasons == ["length"] * 4 + ["left"] * 2 + ["abort"] * 2
    deadline = time.monotonic() + 15  # the server notices a closed connection within ~0.2 s
    while client.num_pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.num_pending == 0 and _loads(client) == [0, 0]
    assert client.output_processor.requests == {}
    idle = _wait_idle(client)
    assert all(r["running"] == r["waiting"] == 0 for r in idle), idle
    ran_out = [rid for rid, reason in core_finished.items() if reason == "length"]
    assert len(ran_out) == len(PROMPTS), core_finished  # only the four that were waited for
    assert all(core_tokens[rid] == 6 for rid in ran_out), core_tokens


# ------------------------------------------------------------------------- drain (runs last)
class _DrainClock:
    """The drain's clock (`time` in frontend/core_client.py): real time plus what the test adds,
    so the grace ends when the test says, not when a loaded or an idle machine gets there."""

    def __init__(self) -> None:
        self.added = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.added

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_drain_ends_requests_within_its_grace_and_refuses_new_ones(stage, tp_server, monkeypatch):
    """The long stream cannot end first: after its first step the front end hears nothing more
    of it (its core's later outputs are withheld), as of a request still decoding; the grace
    ends (the drain's clock moves) only once the short request has finished."""
    server, client = tp_server
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "temperature": 0, "ignore_eos": True}
    frames: list[str] = []
    short: dict[str, Any] = {}
    heard: dict[str, int] = {}  # the long request: its id -> the outputs the front end heard
    on_outputs = client._on_outputs

    def withholding(message: Any) -> None:
        outputs = []
        for output in message.outputs:
            if not heard:  # the first request the front end hears of: the long stream
                heard[output.request_id] = 0
            if output.request_id in heard:
                if heard[output.request_id]:
                    continue  # the long request's later steps: withheld
                heard[output.request_id] += 1
            outputs.append(output)
        on_outputs(dataclasses.replace(message, outputs=tuple(outputs)))

    monkeypatch.setattr(client, "_on_outputs", withholding)
    clock = _DrainClock()
    monkeypatch.setattr(_module(stage, "frontend.core_client"), "time", clock)
    grace = 30.0  # of the drain's clock, which the test moves past it

    def stream() -> None:
        payload = body | {"max_tokens": LONG, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=60) as r:
            frames.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

    def finish_short() -> None:
        response = httpx.post(
            f"{server.url}/v1/completions", json=body | {"max_tokens": 3}, timeout=60
        )
        short["status"], short["body"] = response.status_code, response.json()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_for(lambda: any(heard.values()), timeout=60), "the stream never ran"
    shorter = threading.Thread(target=finish_short)
    shorter.start()
    assert wait_for(lambda: client.num_pending == 2 or not shorter.is_alive(), timeout=60)
    drainer = threading.Thread(target=client.drain, args=(grace,))
    drainer.start()
    assert wait_for(lambda: client.closing is not None, timeout=30)
    refused = httpx.post(f"{server.url}/v1/completions", json=body | {"max_tokens": 3}, timeout=60)
    shorter.join(timeout=60)
    assert not shorter.is_alive()
    assert drainer.is_alive(), "the drain ended before its grace"
    clock.added = grace + 1  # the grace is over
    for thread in (drainer, streamer):
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert refused.status_code == 503 and "shutting down" in refused.text
    assert short["status"] == 200, short  # it finished within the grace period
    assert short["body"]["choices"][0]["finish_reason"] == "length"
    assert frames[-1] == "[DONE]" and "shutting down" in frames[-2], frames[-3:]
    text = "".join(json.loads(f)["choices"][0]["text"] for f in frames[:-2])
    assert text and client.num_pending == 0 and _loads(client) == [0, 0]
    idle = _wait_idle(client)  # the replicas dropped the ended request
    assert all(r["running"] == r["waiting"] == 0 for r in idle), idle
