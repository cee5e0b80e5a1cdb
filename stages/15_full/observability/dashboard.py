"""The live view's front end: a hub that fans the engines' step views out to browsers.

    engine thread / core reader threads --sink(label, views)--> hub inbox (a deque: thread-safe)
    hub tick, every 100 ms on the event loop: inbox -> latest view per engine + batch history
        -> one event -> each viewer's bounded queue -> GET /v1/engine/stream (SSE) -> the page

The number of viewers switches the engines' watching: the first viewer turns it on in every
engine (in process: `LLMEngine.watcher`; in core processes: a ("watch", True) message), the last
one to leave turns it off, so an engine nobody watches builds no view. Events are coalesced to
at most one per `interval` (10 a second): each carries the newest view of every engine, the
batches of the steps since the last event (capped), each engine's queue counts, and the
front end's time-to-first-token and inter-token-latency samples of the last minute. A prefix
hit lights its blocks for one step; the next event shows every hit since the last one. A viewer
that reads slowly loses intermediate events (its queue holds a few; the oldest goes), never
memory, and never holds the engine up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, StreamingResponse

from stages.common.http_errors import APIError

from .live_latency import LatencyWindow
from .live_view import HIT, USED, StepWatcher, View, queue_counts

INTERVAL = 0.1  # seconds between events: at most 10 a second per viewer
HISTORY = 64  # batches kept between two events (the oldest go)
INBOX = 1024  # step views waiting for the next tick (the oldest go)
QUEUED = 4  # events a viewer's queue holds; a slow viewer loses the oldest
PING_SECONDS = 15.0  # an idle stream sends an SSE comment this often (proxies keep it open)
MAX_VIEWERS = 16  # streams at once; more get a 503 (each costs the event loop a little)
PAGE = Path(__file__).with_name("dashboard.html")  # the page: plain JS and SVG, no network


@dataclass(eq=False)
class Viewer:
    """One browser's stream: a bounded queue of events; `dropped` counts the ones it lost."""

    queue: asyncio.Queue[dict[str, Any] | None] = field(
        default_factory=lambda: asyncio.Queue(QUEUED)
    )  # None: the stream ends (the server drains)
    dropped: int = 0

    def offer(self, event: dict[str, Any] | None) -> None:
        if self.queue.full():  # a slow reader: the oldest event goes, the newest stays
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(event)


def engine_labels(client: Any) -> list[str]:
    """The engines' labels, as /metrics writes them: "0"; "0", "1", ...; "prefill", "decode"."""
    if getattr(client, "replicas", None) is None:
        return ["0"]
    return [client.engine_label(index) for index in range(len(client.replicas))]


def watch_engines(client: Any, sink: Callable[[str, Sequence[View]], None] | None) -> None:
    """Switch step views on (to `sink`) or off (None) in every engine of the server's client:
    core processes by message (frontend/core_client.py `watch`), the in-process engine by its
    `watcher`, with a view of it now (read from the event loop, as /health reads it: a step
    changing a table meanwhile skips it, and its own view follows)."""
    if hasattr(client, "watch"):
        client.watch(sink)
        return
    engine = client.engine
    if sink is None:
        engine.watcher = None
        return
    watcher = StepWatcher(engine, lambda view: sink("0", (view,)))
    with contextlib.suppress(RuntimeError):  # "dictionary changed size during iteration"
        watcher.snapshot(engine)
    engine.watcher = watcher


def live_queues(client: Any) -> dict[str, dict[str, int]]:
    """Each engine's queue counts as /health reports them now (a core's from its last
    message); the views add loading and swapped."""
    replicas = getattr(client, "replicas", None)
    if replicas is None:
        with contextlib.suppress(RuntimeError):
            return {"0": queue_counts(client.engine)}
        return {}
    return {
        client.engine_label(index): {
            "waiting": r.num_waiting if r.alive else 0,
            "running": r.num_running if r.alive else 0,
        }
        for index, r in enumerate(replicas)
    }


class DashboardHub:
    """Viewers, the engines' latest views, and the tick that turns them into events."""

    def __init__(
        self,
        client: Any,
        *,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        watch: Callable[[Any, Any], None] = watch_engines,
        ping_seconds: float = PING_SECONDS,
    ) -> None:
        self.client, self.interval, self.clock, self._watch = client, interval, clock, watch
        self.ping_seconds = ping_seconds
        self.max_viewers = MAX_VIEWERS
        self.labels = engine_labels(client)
        self.latency = LatencyWindow(clock=clock)
        self.viewers: set[Viewer] = set()
        self.latest: dict[str, View] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._inbox: deque[tuple[str, View]] = deque(maxlen=INBOX)
        self._last_event = float("-inf")
        self._sent_latency = -1
        self._changed = False  # views arrived since the last event
        self._hits: dict[str, set[int]] = {}  # per engine: blocks hit since the last event
        self._task: asyncio.Task[None] | None = None
        self._frame: tuple[Any, str] = (None, "")  # the last event and its SSE frame

    def sink(self, label: str, views: Sequence[View]) -> None:
        """From any thread: views of engine `label`'s steps (deque appends are atomic)."""
        for view in views:
            self._inbox.append((label, view))

    def subscribe(self) -> Viewer:
        """A new viewer gets the latest state at once; the first one turns watching on."""
        viewer = Viewer()
        self.viewers.add(viewer)
        if len(self.viewers) == 1:
            self._watch(self.client, self.sink)
            self._task = asyncio.get_running_loop().create_task(self._run())
        viewer.offer(self.event(self.clock(), batches=False))
        return viewer

    def unsubscribe(self, viewer: Viewer) -> None:
        """The last viewer to leave turns watching off and stops the tick."""
        self.viewers.discard(viewer)
        if not self.viewers:
            self._watch(self.client, None)
            if self._task is not None:
                self._task.cancel()
                self._task = None

    def frame(self, event: dict[str, Any]) -> str:
        """`event` as one SSE frame, serialized once however many viewers send it."""
        if self._frame[0] is not event:
            self._frame = (event, f"data: {json.dumps(event, separators=(',', ':'))}\n\n")
        return self._frame[1]

    def collect(self, now: float) -> dict[str, Any] | None:
        """The next event, or None: nothing new, or the last one is younger than `interval`."""
        if now - self._last_event < self.interval:
            return None
        self._take_inbox()
        self.latency.catch_up()  # requests not streamed: their tokens, as they arrive
        if not self._changed and self.latency.version == self._sent_latency:
            return None
        self._last_event = now
        return self.event(now)

    def event(self, now: float, batches: bool = True) -> dict[str, Any]:
        """Every engine's latest view, the batches since the last event (`batches`: False for
        a new viewer's first event, which leaves them to everyone's next), the queue counts
        and the latency samples, as one JSON-able dict."""
        self._take_inbox()
        history: list[dict[str, Any]] = []
        if batches:
            history = list(self.history)
            self.history.clear()
            self._sent_latency, self._changed = self.latency.version, False
        engines = {label: self._lit(label, batches) for label in self.labels}
        queues = {
            label: dict(view["queues"]) if view is not None else {}
            for label, view in engines.items()
        }
        for label, counts in live_queues(self.client).items():
            queues.setdefault(label, {}).update(counts)
        return {
            "t": time.time(),
            "labels": self.labels,
            "engines": engines,
            "batches": history,
            "queues": queues,
            "latency": self.latency.recent(now),
        }

    def _lit(self, label: str, take: bool) -> View | None:
        """The latest view of `label`, with every prefix hit since the last event lit (a hit
        lights its blocks for one step only: most steps fall between two events)."""
        view = self.latest.get(label)
        hits = self._hits.pop(label, None) if take else self._hits.get(label)
        if view is None or not hits:
            return view
        cells = list(view["blocks"]["grid"])
        for block in hits:
            if cells[block] == USED:
                cells[block] = HIT
        grid = "".join(cells)
        blocks = view["blocks"] | {"grid": grid, "hit": grid.count(HIT)}
        return view | {"blocks": blocks}

    def _take_inbox(self) -> None:
        while self._inbox:
            label, view = self._inbox.popleft()
            self._changed = True
            if view["blocks"]["hit"]:
                grid = view["blocks"]["grid"]
                found = (i for i, cell in enumerate(grid) if cell == HIT)
                self._hits.setdefault(label, set()).update(found)
            self.latest[label] = view
            if view["batch"]:
                self.history.append(
                    {"engine": label, "step": view["step"], "t": view["t"], "batch": view["batch"]}
                )

    def draining(self) -> str | None:
        """Why the server refuses new requests (it drains, then stops), or None."""
        return getattr(self.client, "closing", None)

    async def _run(self) -> None:
        """The tick: at most one event per interval, to every viewer. When the server starts
        to drain, every stream ends at once: an open stream would hold the shutdown until
        uvicorn's grace period cancels it."""
        while True:
            await asyncio.sleep(self.interval)
            if self.draining() is not None:
                for viewer in list(self.viewers):
                    viewer.offer(None)
                return
            event = self.collect(self.clock())
            if event is not None:
                for viewer in list(self.viewers):
                    viewer.offer(event)


def add_dashboard_routes(app: FastAPI, hub: DashboardHub) -> None:
    """`GET /dashboard` (the page) and `GET /v1/engine/stream` (its server-sent events)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/v1/engine/stream")
    async def engine_stream() -> StreamingResponse:
        """One `data: <json>` frame per event, a `: ping` comment when idle. A client that
        goes away cancels the generator: its `finally` lets the viewer go."""
        if (reason := hub.draining()) is not None:
            raise APIError(f"the server is draining: {reason}", status=503)
        if len(hub.viewers) >= hub.max_viewers:
            message = f"{hub.max_viewers} viewers are watching already: try again later"
            raise APIError(message, status=503)

        async def frames() -> AsyncIterator[str]:
            viewer = hub.subscribe()
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(viewer.queue.get(), hub.ping_seconds)
                    except TimeoutError:
                        yield ": ping\n\n"
                        continue
                    if event is None:  # the server drains: the stream ends
                        return
                    yield hub.frame(event)
            finally:
                hub.unsubscribe(viewer)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)


__all__ = [
    "DashboardHub",
    "LatencyWindow",
    "Viewer",
    "add_dashboard_routes",
    "watch_engines",
]
