"""Stage 13 in processes: a prefill and a decode engine core, a gloo pair between them, and the
proxy in the OpenAI server's front end (DisaggClient), built as `serve --config
disaggregated=true` builds it.

- The server answers what one in-process engine answers (greedy and seeded, streamed or not,
  concurrent); afterwards both cores' pools are full and no transfer is under way.
- A request's cached tokens are the prefill core's own prefix hits, never the KV the decode
  core received (issue 27); a dead core's queue lengths in /health are zero.
- A dead core fails only its requests: a request decoding when the prefill core dies finishes
  right, new requests run whole on the survivor; a request decoding when the decode core dies
  fails with an error naming it, and with both gone /health is a 503.
- The cores die with their front end (SIGKILL): no orphan.
- From stage 15, a request's trace joins the prefill core's events to the decode core's.

Start-up costs seconds: one client per module for the first test, one for the killing test.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from stages.common import supervisor
from stages.common.tooling.server_process import ThreadedServer

from .conftest import TEST_KV_CACHE_BYTES, since, subject
from .parents import ParentProcesses
from .test_09_tp import _wait_gone

pytestmark = [
    since("13"),
    pytest.mark.slow,
    subject(
        "frontend/disagg_client.py",
        "frontend/engine_core.py",
        "frontend/core_messages.py",
        "disagg/connector.py",
        "disagg/transfer_worker.py",
        "disagg/transport.py",
    ),
]

BLOCK = 4
PROMPTS = ["The quick brown fox", "Once upon a time there", "A B C D E F G H I J", "hello"]
_SERVERS: dict[str, tuple[ThreadedServer, Any]] = {}  # per stage, for this module


def _client(stage, model, **config):
    config = {"block_size": BLOCK, "kv_cache_bytes": TEST_KV_CACHE_BYTES, **config}
    client = stage.serving_engine(str(model), disaggregated=True, **config)
    assert isinstance(client, stage.DisaggClient)
    return client


@pytest.fixture(scope="module", autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    for server, client in _SERVERS.values():
        server.stop()
        client.shutdown()
        assert _wait_gone([r.process.pid for r in client.replicas]), "a core outlived shutdown"
    _SERVERS.clear()


@pytest.fixture
def disagg_server(stage, tiny_model) -> tuple[ThreadedServer, Any]:
    if stage.__name__ not in _SERVERS:
        client = _client(stage, tiny_model("llama-gqa"))
        _SERVERS[stage.__name__] = (ThreadedServer(stage.create_app(client)).start(), client)
    return _SERVERS[stage.__name__]


@pytest.fixture
def one_server(stage, tiny_model, live_server) -> ThreadedServer:
    return live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)[0]


def _completion(url: str, body: dict[str, Any]) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) of a /v1/completions call, streamed or not."""
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        return answer["choices"][0]["text"], answer["choices"][0]["finish_reason"], answer["usage"]
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
    return text, finish, None


def _model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _pools_full(client, seconds: float = 20.0) -> list[dict]:
    """Wait until both cores report every KV block free and no transfer under way."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.ping()
        time.sleep(0.05)
        cores = client.health_report()["cores"]
        live = [c for c in cores if c["alive"]]
        if all(c["kv_blocks"] and c["kv_blocks_free"] == c["kv_blocks"] for c in live) and not any(
            c["transfers_pending"] for c in live
        ):
            return cores
    raise AssertionError(f"a core's pool is not full again: {client.health_report()['cores']}")


def test_disaggregated_server_answers_what_one_engine_answers(stage, disagg_server, one_server):
    server, client = disagg_server
    model = _model_id(one_server.url)
    bodies = []
    for i, prompt in enumerate(PROMPTS):
        base = {"model": model, "prompt": prompt, "max_tokens": 14, "ignore_eos": True}
        bodies += [{**base, "temperature": 0}, {**base, "temperature": 1.0, "seed": 100 + i}]
    bodies = [{**b, "stream": s} for b in bodies for s in (False, True)]
    expected = [_completion(one_server.url, b)[:2] for b in bodies]
    with ThreadPoolExecutor(6) as pool:  # concurrent: prefills and decodes overlap
        got = list(pool.map(lambda b: _completion(server.url, b), bodies))
    assert [g[:2] for g in got] == expected
    for _, _, usage in got:
        if usage is not None:  # the prefill core's own hits (full blocks): not what it sent
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached % BLOCK == 0 and cached < usage["prompt_tokens"], usage
    assert client.num_pending == 0 and client.num_handed_over >= len(bodies)
    _pools_full(client)


def _stream_and_kill(url: str, body: dict, pid: int) -> list[str]:
    """Stream a completion; SIGKILL `pid` once its first frame arrived. Returns the frames."""
    frames: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and not frames:
                    os.kill(pid, signal.SIGKILL)
                frames.append(line)

    thread = threading.Thread(target=stream)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return frames


def _text(frames: list[str]) -> str:
    events = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e)


@since("15")
def test_a_trace_joins_the_prefill_cores_events(disagg_server):
    """Stage 15: a disaggregated request's trace holds the prefill core's scheduler events
    (named `prefill_*`) before the decode core's, on one clock."""
    server, _client = disagg_server
    body = {"model": _model_id(server.url), "prompt": "count: one two three", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    trace = httpx.get(f"{server.url}/v1/requests/{reply['id']}/trace", timeout=10).json()
    names = [e["event"] for e in trace["events"]]
    times = [e["t_s"] for e in trace["events"]]
    assert names[0] == "arrived" and names[-1] == "finished" and times == sorted(times), names
    assert "prefill_scheduled" in names and "scheduled" in names, names
    assert names.index("prefill_scheduled") < names.index("scheduled") < names.index("first_token")


def test_cached_tokens_are_the_prefill_cores_own_hits(disagg_server):
    """Issue 27: the KV the decode core received is no cache hit. A fresh prompt under a new
    cache_salt reports 0 cached tokens (not all but one); sent again, the prefill core's own
    prefix hit (its full blocks)."""
    server, _client = disagg_server
    prompt = "a fresh prompt, under its own salt, for the cached-token count " * 2
    body = {"model": _model_id(server.url), "prompt": prompt, "max_tokens": 2,
            "temperature": 0, "cache_salt": f"salt-{time.monotonic_ns()}"}  # fmt: skip
    first = _completion(server.url, body)[2]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0, first
    again = _completion(server.url, body)[2]
    full_blocks = (first["prompt_tokens"] - 1) // BLOCK * BLOCK  # the last token is computed
    assert again["prompt_tokens_details"]["cached_tokens"] == full_blocks, again


def test_the_cores_meet_at_a_store_the_client_bound_before_they_started(disagg_server):
    """With no `kv_transfer_address` the client serves the pair's TCP store, bound to a port
    the OS picked as it bound it, and both cores join it (`store://`). Before, the client
    probed a free port and the decode core bound it after loading its model: another program
    could take the port in between (stage 09's workers lost theirs that way once)."""
    _, client = disagg_server
    assert all(replica.alive for replica in client.replicas)
    with socket.socket() as other, pytest.raises(OSError, match=r"(?i)in use"):
        other.bind(("127.0.0.1", client._kv_store.port))


def test_a_dead_core_reports_nothing_running_or_waiting(stage):
    """Issue 27: a dead core's last report no longer holds: /health shows it holding nothing."""
    disagg_client = importlib.import_module(f"{stage.__name__}.frontend.disagg_client")
    cores = [SimpleNamespace(process=SimpleNamespace(pid=1), alive=alive, num_waiting=2,
                             num_running=3, error=None if alive else "killed")
             for alive in (True, False)]  # fmt: skip
    front_end = SimpleNamespace(_lock=threading.Lock(), _in_flight={}, replicas=cores,
                                _pools=[(1, 8), (8, 8)], _transfers_pending=[False, False],
                                num_handed_over=0)  # fmt: skip
    report = disagg_client.DisaggClient.health_report(front_end)
    counts = [(c["alive"], c["running"], c["waiting"]) for c in report["cores"]]
    assert report["status"] == "degraded" and counts == [(True, 3, 2), (False, 0, 0)]


def test_a_dead_core_fails_only_its_requests(stage, tiny_model, one_server):
    client = _client(stage, tiny_model("llama-gqa"))
    try:
        with ThreadedServer(stage.create_app(client)) as server:
            model = _model_id(server.url)
            body = {"model": model, "prompt": "hi there", "max_tokens": 300, "ignore_eos": True}
            body |= {"temperature": 0, "stream": True}
            prefill, decode = client.replicas
            frames = _stream_and_kill(server.url, body, prefill.process.pid)
            assert not [f for f in frames if '"error"' in f], frames[-3:]  # decode's request
            assert _text(frames) == _completion(one_server.url, {**body, "stream": False})[0]
            assert _wait_gone([prefill.process.pid])
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert "prefill engine core" in health.json()["cores"][0]["error"]
            short = {**body, "max_tokens": 6, "stream": False}
            assert _completion(server.url, short)[0] == _completion(one_server.url, short)[0]
            _pools_full(client)
            frames = _stream_and_kill(server.url, body, decode.process.pid)
            errors = [f for f in frames if '"error"' in f]
            assert errors and "decode engine core" in errors[0], frames[-3:]
            for _ in range(50):
                health = httpx.get(f"{server.url}/health", timeout=10)
                if health.status_code == 503:
                    break
                time.sleep(0.1)
            assert health.status_code == 503 and "both engine cores" in health.text
    finally:
        client.shutdown()
    assert _wait_gone([r.process.pid for r in client.replicas])


def test_a_taken_transfer_address_fails_the_start_naming_the_decode_core(
    stage, tiny_model, monkeypatch
):
    """Another program listens on `kv_transfer_address`: the decode core, which serves the
    pair's store there, cannot bind it and dies at once; the prefill core, connected to the
    stranger, would wait for a peer for minutes. The start fails on the decode core's death
    with its own error (before: after 300 s, blaming the prefill core). The start-up wait is
    cut to 60 s, so that a front end waiting for its cores in turn fails instead of hanging."""
    monkeypatch.setattr(supervisor, "START_TIMEOUT_SECONDS", 60.0)
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        address = f"tcp://127.0.0.1:{stranger.getsockname()[1]}"
        with pytest.raises(RuntimeError, match=r"decode engine core \(pid \d+\)") as failed:
            _client(stage, tiny_model("llama-gqa"), kv_transfer_address=address)
    assert "prefill" not in str(failed.value).split(":")[0], failed.value
    assert "address already in use" in str(failed.value).lower(), failed.value


ORPHAN_SCRIPT = """
import importlib, time
import stages
stage = stages.load({stage!r})
client = stage.DisaggClient({model!r}, disaggregated=True, block_size=4, kv_cache_bytes={kv})
print(" ".join(str(r.process.pid) for r in client.replicas), flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def parents() -> Iterator[ParentProcesses]:
    started = ParentProcesses()
    yield started
    started.kill_all()


def test_cores_die_with_their_front_end(stage, tiny_model, parents):
    script = ORPHAN_SCRIPT.format(
        stage=stage.STAGE, model=str(tiny_model("llama-gqa")), kv=TEST_KV_CACHE_BYTES
    )
    parent = parents.started(stage.STAGE, {"SIGKILL": script})["SIGKILL"]
    assert len(parent.child_pids) == 2, f"the front end did not start: {parent.child_pids!r}"
    os.kill(parent.process.pid, signal.SIGKILL)
    parent.process.wait(timeout=30)
    assert _wait_gone(parent.child_pids), f"{parent.child_pids} outlived their front end"
