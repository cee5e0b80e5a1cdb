"""Stage 15: the live view (`GET /dashboard`, `GET /v1/engine/stream`), without a browser.

- a step's view shows the blocks of the running requests in use, by their owner, and lights the
  blocks a repeated prompt's prefix hit shares; its queues are engine_counters' numbers;
- an engine nobody watches builds no view;
- the hub sends at most 10 events a second, a slow viewer loses the oldest events, and the
  first viewer switches watching on, the last one off;
- the stream route sends events (the engine's view, the front end's latency samples) and lets
  its viewer go when the client disconnects;
- engine cores in other processes send their views labelled as /metrics labels them: "0" and
  "1" for two replicas, "prefill" and "decode" for a disaggregated pair.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from .conftest import TEST_KV_CACHE_BYTES, since

pytestmark = since("15")
BLOCK = 4
DEADLINE = 60.0  # seconds any wait below may take at most


def _module(stage, name: str):
    return importlib.import_module(f"{stage.__name__}.{name}")


def _watched(stage, llm) -> list[tuple[dict, dict]]:
    """Watch `llm`: (view, engine_counters at that moment) per step."""
    live_view, metrics = (
        _module(stage, "observability.live_view"),
        _module(stage, "observability.metrics"),
    )
    seen: list[tuple[dict, dict]] = []
    llm.watcher = live_view.StepWatcher(
        llm, lambda view: seen.append((view, metrics.engine_counters(llm)))
    )
    return seen


def test_the_grid_is_one_character_per_block_in_its_state(stage):
    """In use while a table holds it; cached while free with its K/V still a prefix hit (free +
    cached is /health's kv_blocks_free); free otherwise; this step's hits lit over in use."""
    live_view = _module(stage, "observability.live_view")
    ref_counts = [0, 2, 0, 1, 0, 1]
    contents = [None, "hash-a", "hash-b", None, None, "hash-c"]
    grid = live_view._grid(ref_counts, contents, [1])
    assert grid == "".join([live_view.FREE, live_view.HIT, live_view.CACHED, live_view.USED,
                            live_view.FREE, live_view.USED])  # fmt: skip
    assert live_view._grid([0, 0], [None, None], []) == live_view.FREE * 2


def test_a_view_shows_each_requests_blocks_and_a_repeated_prompts_hit(stage, make_llm, tiny_model):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, prefix_caching=True,
                   max_model_len=128)  # fmt: skip
    params = stage.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(10, 31))  # 21 tokens: five full blocks, hits cover at most (21-1)//4
    seen = _watched(stage, llm)
    try:
        first = llm.make_request(prompt, params)
        llm.add_request(first)
        while llm.has_unfinished():
            llm.step()
            table = llm.kv_manager.block_ids(first.request_id)
            view = seen[-1][0]
            grid, owner = view["blocks"]["grid"], view["blocks"]["owner"]
            assert len(grid) == len(owner) == llm.kv_manager.allocator.num_blocks
            for block in table:  # held by the running request, in its colour
                assert grid[block] == "u" and int(owner[block], 16) == first.admission_id % 12
        assert seen[-1][0]["blocks"]["used"] == 0, "the finished request let its blocks go"
        assert seen[-1][0]["blocks"]["cached"] >= 5, "its full blocks stay cached"
        second = llm.make_request(prompt, params)  # the same prompt: a prefix hit
        llm.add_request(second)
        llm.step()
        lit = [v for v, _ in seen if v["blocks"]["hit"]]
        assert len(lit) == 1, "only the step that admitted the repeated prompt lights its hit"
        hit_blocks = llm.kv_manager.block_ids(second.request_id)[:5]
        grid = lit[0]["blocks"]["grid"]
        assert [i for i, c in enumerate(grid) if c == "h"] == sorted(hit_blocks)
        (entry,) = lit[0]["batch"]
        assert entry["id"] == second.request_id and entry["kind"] == "prefill"
        assert entry["new"] == len(prompt) - 5 * BLOCK, "only the rest of the prompt runs"
        while llm.has_unfinished():
            llm.step()
    finally:
        llm.watcher = None
    for view, counters in seen:
        queues = view["queues"]
        assert queues["running"] == counters["num_running"]
        assert queues["waiting"] + queues["loading"] == counters["num_waiting"]
        blocks = view["blocks"]
        assert blocks["free"] + blocks["used"] + blocks["cached"] == len(blocks["grid"])
        assert blocks["used"] / len(blocks["grid"]) == pytest.approx(counters["kv_cache_usage"])
    steps = [view["step"] for view, _ in seen]
    assert steps == list(range(1, len(seen) + 1))
    assert json.loads(json.dumps(seen[0][0])) == seen[0][0], "plain JSON"


def test_an_engine_nobody_watches_builds_no_view(stage, make_llm, tiny_model, monkeypatch):
    live_view = _module(stage, "observability.live_view")
    built: list[int] = []
    real = live_view.step_view
    monkeypatch.setattr(live_view, "step_view", lambda *a, **k: built.append(1) or real(*a, **k))
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    params = stage.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert llm.watcher is None
    llm.generate(["one two three"], params)
    assert built == [], "no viewer: no view"
    views: list[dict] = []
    llm.watcher = live_view.StepWatcher(llm, views.append)
    try:
        llm.generate(["one two three"], params)
    finally:
        llm.watcher = None
    assert len(built) == len(views) >= 5, "a viewer: one view per step"


# ------------------------------------------------------------------------------------ the hub
def _view(step: int, t: float, running: int = 1) -> dict[str, Any]:
    batch = [{"id": "r", "colour": 0, "new": 1, "kind": "decode", "drafts": 0, "accepted": None}]
    return {"step": step, "t": t, "batch": batch,
            "queues": {"waiting": 0, "running": running, "loading": 0, "swapped": 0},
            "blocks": {"grid": "u.", "owner": "0-", "free": 1, "used": 1, "cached": 0,
                       "hit": 0}}  # fmt: skip


def _fake_client(labels=("0", "1")):
    replicas = [SimpleNamespace(alive=True, num_waiting=2, num_running=1) for _ in labels]
    return SimpleNamespace(replicas=replicas, engine_label=lambda index: labels[index])


def test_the_hub_sends_at_most_ten_events_a_second_and_a_slow_viewer_loses_the_oldest(stage):
    dashboard = _module(stage, "observability.dashboard")
    clock = [100.0]
    switched: list[bool] = []
    hub = dashboard.DashboardHub(
        _fake_client(), clock=lambda: clock[0],
        watch=lambda client, sink: switched.append(sink is not None),
    )  # fmt: skip

    async def scenario() -> tuple[list[dict], Any]:
        slow = hub.subscribe()  # never reads
        other = hub.subscribe()
        assert switched == [True], "the first viewer switches watching on, once"
        events = []
        for step in range(1, 201):  # two seconds of steps, one every 10 ms, on each engine
            clock[0] += 0.01
            hub.sink("0", [_view(step, clock[0])])
            hub.sink("1", [_view(step, clock[0], running=3)])
            event = hub.collect(clock[0])
            if event is not None:
                events.append(event)
                for viewer in (slow, other):
                    viewer.offer(event)
        hub.unsubscribe(other)
        assert switched == [True], "a viewer is left"
        hub.unsubscribe(slow)
        assert switched == [True, False], "the last viewer switches watching off"
        return events, slow

    events, slow = asyncio.run(scenario())
    assert 15 <= len(events) <= 20, "coalesced to 10 a second over two seconds"
    times = [e["batches"][-1]["t"] for e in events]
    assert all(b - a >= 0.1 - 1e-9 for a, b in itertools.pairwise(times))
    steps = [b["step"] for e in events for b in e["batches"] if b["engine"] == "0"]
    assert steps == list(range(1, steps[-1] + 1)), "every step's batch, none twice"
    last = events[-1]
    assert last["labels"] == ["0", "1"] and last["engines"]["1"]["queues"]["running"] == 3
    assert last["queues"]["0"]["waiting"] == 2, "the front end's counts, as /health's"
    assert slow.queue.qsize() == dashboard.QUEUED
    assert slow.dropped == len(events) + 1 - dashboard.QUEUED, "its first event counts too"
    newest = [slow.queue.get_nowait() for _ in range(dashboard.QUEUED)]
    assert newest == events[-dashboard.QUEUED :], "it keeps the newest"


def test_a_draining_server_ends_every_stream_and_takes_no_new_viewer(stage):
    """On SIGTERM the server drains: an open stream would hold the shutdown until uvicorn's
    grace period cancels it, so the hub's tick ends every stream at once."""
    dashboard = _module(stage, "observability.dashboard")
    client = _fake_client()
    hub = dashboard.DashboardHub(client, interval=0.01, watch=lambda c, sink: None)
    import asyncio

    async def scenario() -> list[Any]:
        viewer = hub.subscribe()
        viewer.queue.get_nowait()  # its first event
        client.closing = "the server is shutting down"
        return [await asyncio.wait_for(viewer.queue.get(), timeout=DEADLINE)]

    assert hub.draining() is None
    assert asyncio.run(scenario()) == [None], "the end of the stream"
    assert hub.draining() == "the server is shutting down"


def test_a_prefix_hit_between_two_events_is_lit_in_the_next(stage):
    """A hit lights its blocks in one step's view; the event after it shows them lit even when
    later steps came between, and the one after that no more."""
    dashboard = _module(stage, "observability.dashboard")
    clock = [0.0]
    hub = dashboard.DashboardHub(_fake_client(("0",)), clock=lambda: clock[0],
                                 watch=lambda client, sink: None)  # fmt: skip
    hit = _view(1, 0.0)
    hit["blocks"] |= {"grid": "hu..", "owner": "00--", "free": 2, "used": 2, "hit": 1}
    later = _view(2, 0.01)
    later["blocks"] |= {"grid": "uu..", "owner": "00--", "free": 2, "used": 2}
    hub.sink("0", [hit, later])
    clock[0] = 1.0
    event = hub.collect(clock[0])
    assert event["engines"]["0"]["blocks"]["grid"] == "hu.." and event["engines"]["0"]["step"] == 2
    assert event["engines"]["0"]["blocks"]["hit"] == 1 and hub.latest["0"] is later
    hub.sink("0", [_view(3, 0.02)])
    clock[0] = 2.0
    assert hub.collect(clock[0])["engines"]["0"]["blocks"]["hit"] == 0


def test_the_latency_window_keeps_one_gap_per_iteration_and_the_last_minute(stage):
    dashboard = _module(stage, "observability.dashboard")
    clock = [0.0]
    window = dashboard.LatencyWindow(seconds=60.0, clock=lambda: clock[0])
    request = SimpleNamespace(arrival_time=10.0, token_times=[10.5, 10.7, 10.7, 11.0])
    window.observe(request, 0)
    clock[0] = 30.0
    request.token_times.append(11.4)
    window.observe(request, 4)
    recent = window.recent(50.0)
    assert recent["ttft"] == [[50.0, 0.5]]
    assert [v for _, v in recent["itl"]] == pytest.approx([0.2, 0.3, 0.4]), "no zero gap"
    assert [v for _, v in window.recent(70.0)["itl"]] == pytest.approx([0.4]), "a minute"


def test_a_request_not_streamed_feeds_the_plots_before_its_end(stage):
    """A request answered in one piece gets one output, at its end; its tokens arrive step by
    step all the same, and the hub's tick reads them (the plots show it while it runs)."""
    import asyncio

    live_latency = _module(stage, "observability.live_latency")
    window = live_latency.LatencyWindow(seconds=60.0, clock=lambda: 1.0)
    request = SimpleNamespace(arrival_time=10.0, token_times=[])
    gate: list[asyncio.Event] = []

    class Inner:  # a non-streamed request: nothing until the end
        async def generate(self, _request):
            await gate[0].wait()
            yield "final"

    async def scenario():
        gate.append(asyncio.Event())
        consumer = asyncio.ensure_future(
            _drain(live_latency.LatencyTap(Inner(), window).generate(request))
        )
        await asyncio.sleep(0)
        request.token_times += [10.25, 10.5]  # the engine's first two steps
        window.catch_up()  # the hub's tick
        during = window.recent(1.0)
        request.token_times.append(11.0)
        gate[0].set()
        await consumer
        return during, window.recent(1.0)

    during, after = asyncio.run(scenario())
    assert [v for _, v in during["ttft"]] == [0.25] and len(during["itl"]) == 1
    assert [v for _, v in after["ttft"]] == [0.25], "observed once"
    assert [v for _, v in after["itl"]] == pytest.approx([0.25, 0.5])
    assert not window._following, "a finished request is no longer followed"


async def _drain(stream):
    return [item async for item in stream]


# ----------------------------------------------------------------------------- the HTTP routes
def _data(lines: Any, limit: int = 400) -> Any:
    """The events of an SSE stream, parsed (at most `limit` lines read)."""
    for _ in range(limit):
        line = next(lines)
        if line.startswith("data: "):
            yield json.loads(line[6:])


def test_the_stream_sends_views_and_latency_and_lets_a_gone_viewer_go(stage, tiny_model,
                                                                      live_server):  # fmt: skip
    server, app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    hub, engine = app.state.dashboard, app.state.engine.engine
    page = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'EventSource("/v1/engine/stream")' in page.text and len(page.content) < 25_000
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "one two three", "max_tokens": 6, "temperature": 0}
    with httpx.stream("GET", f"{server.url}/v1/engine/stream", timeout=DEADLINE) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _data(response.iter_lines())
        first = next(events)
        assert first["labels"] == ["0"] and first["engines"]["0"] is not None, "a view at once"
        assert engine.watcher is not None and len(hub.viewers) == 1
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        batches: list[dict] = []
        for event in events:  # the steps' batches, then the request's TTFT
            batches += event["batches"]
            if batches and event["latency"]["ttft"]:
                break
        assert sum(r["new"] for b in batches for r in b["batch"]) >= 6, "prompt and decodes"
        assert event["latency"]["ttft"][0][1] > 0
        assert set(event["queues"]["0"]) == {"waiting", "running", "loading", "swapped"}
    deadline = time.monotonic() + DEADLINE
    while (hub.viewers or engine.watcher is not None) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not hub.viewers, "the viewer left with its client"
    assert engine.watcher is None, "nobody watches: the engine builds no view"


def test_viewers_past_the_cap_get_a_503_and_an_event_is_serialized_once(
    stage, tiny_model, live_server, monkeypatch
):
    """A viewer costs the event loop a little (its queue, its frames): their number is capped.
    Every viewer sends the same event: it becomes JSON once."""
    server, app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    hub = app.state.dashboard
    monkeypatch.setattr(hub, "max_viewers", 1)
    url = f"{server.url}/v1/engine/stream"
    with httpx.stream("GET", url, timeout=DEADLINE) as response:
        events = _data(response.iter_lines())  # held: a dropped iterator closes the stream
        next(events)  # watching
        with httpx.stream("GET", url, timeout=DEADLINE) as refused:  # a stream if not refused
            assert refused.status_code == 503
            assert "viewers" in json.loads(refused.read())["error"]["message"]
    event = {"labels": ["0"], "n": 1}
    assert hub.frame(event) is hub.frame(event) and hub.frame(event).startswith("data: {")
    assert hub.frame(dict(event)) == hub.frame(event), "an equal event, the same frame"


# ------------------------------------------------------------------- engine cores in processes
async def _watch_cores(stage, client: Any, labels: list[str]) -> dict[str, list[dict]]:
    """Watch `client`'s cores while two requests run: every view, per label."""
    dashboard = _module(stage, "observability.dashboard")
    seen: dict[str, list[dict]] = {label: [] for label in labels}

    def recording(sink: Any) -> Any:
        def record(label: str, views: Any) -> None:
            seen[label].extend(views)
            sink(label, views)

        return record

    hub = dashboard.DashboardHub(
        client, watch=lambda c, sink: dashboard.watch_engines(c, sink and recording(sink))
    )
    viewer = hub.subscribe()

    async def until(done: Any) -> None:
        deadline = time.monotonic() + DEADLINE
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def run(prompt: str) -> None:
        params = stage.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        async for _ in client.generate(client.make_request(prompt, params)):
            pass

    try:
        await until(lambda: all(seen.values()))  # each idle core sent a view of itself
        await asyncio.gather(run("one two three four five"), run("a b c d e f g h"))
        await until(lambda: all(any(v["batch"] for v in views) for views in seen.values()))
        await until(lambda: viewer.queue.qsize() > 1)
    finally:
        hub.unsubscribe(viewer)
    assert client.view_sink is None, "the last viewer switched the cores off"
    event = viewer.queue.get_nowait()
    assert event["labels"] == labels
    return seen


def _check_cores(stage, client: Any, labels: list[str], busy: int) -> None:
    """Each core sends views; at least `busy` of them show a batch."""
    try:
        assert _module(stage, "observability.dashboard").engine_labels(client) == labels
        seen = asyncio.run(_watch_cores(stage, client, labels))
        for label in labels:
            assert seen[label], f"engine {label} sent no view"
            assert len(seen[label][0]["blocks"]["grid"]) > 0
        assert sum(any(v["batch"] for v in seen[label]) for label in labels) >= busy
    finally:
        client.shutdown()


@pytest.mark.slow
def test_two_replicas_send_their_views_as_engines_0_and_1(stage, tiny_model):
    client = stage.DPClient(str(tiny_model("llama-gqa")), data_parallel_size=2,
                            block_size=BLOCK, kv_cache_bytes=TEST_KV_CACHE_BYTES)  # fmt: skip
    _check_cores(stage, client, ["0", "1"], busy=1)  # the router may pick one for both


@pytest.mark.slow
def test_a_disaggregated_pair_sends_views_as_prefill_and_decode(stage, tiny_model):
    client = stage.serving_engine(str(tiny_model("llama-gqa")), disaggregated=True,
                                  block_size=BLOCK, kv_cache_bytes=TEST_KV_CACHE_BYTES)  # fmt: skip
    assert isinstance(client, stage.DisaggClient)
    _check_cores(stage, client, ["prefill", "decode"], busy=2)
