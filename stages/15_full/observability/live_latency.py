"""The live view's latency plots: time to first token and inter-token latency of the last minute.

Fed on the event loop as tokens reach the front end (`LatencyTap` wraps the server's client),
and on the hub's tick for requests answered in one piece at their end (not streamed), whose
tokens arrive step by step with no output to carry them. Kept apart from `/metrics`'
histograms: these are raw samples for a plot, bounded in time and in number.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

WINDOW = 60.0  # seconds of latency samples an event carries
SAMPLES = 1024  # at most this many of each kind (the newest), so an event stays small


class LatencyWindow:
    """Time-to-first-token and inter-token-latency samples of the last `seconds`, bounded.
    Fed on the event loop (`LatencyTap`) as tokens reach the front end."""

    def __init__(self, seconds: float = WINDOW, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.ttft: deque[tuple[float, float]] = deque(maxlen=SAMPLES)  # (when, seconds)
        self.itl: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self.version = 0  # counts samples added: the hub sends an event when it moved
        self._following: dict[int, list[Any]] = {}  # id(request) -> [request, times seen]

    def follow(self, request: Any) -> None:
        """Watch `request`'s token times until `forget`: a request answered in one piece (not
        streamed) brings no output before its end, but its tokens arrive step by step."""
        self._following[id(request)] = [request, 0]

    def catch_up(self, request: Any = None) -> None:
        """Observe the tokens that arrived since the last look: of `request`, or of every
        request followed (the hub's tick)."""
        entries = (self._following.get(id(request)),) if request is not None else None
        for entry in entries or list(self._following.values()):
            if entry is None:
                continue
            request, seen = entry
            upto = len(request.token_times)  # the engine may append meanwhile
            if upto > seen:
                self.observe(request, seen, upto)
                entry[1] = upto

    def forget(self, request: Any) -> None:
        self.catch_up(request)
        self._following.pop(id(request), None)

    def observe(self, request: Any, seen: int, upto: int | None = None) -> None:
        """The request's token times from index `seen` to `upto`: its first is a TTFT, each
        later iteration a gap (one iteration's tokens share one time: no zero gaps)."""
        times, now = request.token_times, self.clock()
        for index in range(seen, len(times) if upto is None else upto):
            if index == 0:
                self.ttft.append((now, times[0] - request.arrival_time))
            elif times[index] != times[index - 1]:
                self.itl.append((now, times[index] - times[index - 1]))
            else:
                continue
            self.version += 1

    def recent(self, now: float) -> dict[str, list[list[float]]]:
        """[seconds ago, value] of each sample younger than the window, oldest first."""
        out: dict[str, list[list[float]]] = {}
        for name, samples in (("ttft", self.ttft), ("itl", self.itl)):
            while samples and now - samples[0][0] > self.seconds:
                samples.popleft()
            out[name] = [[round(now - at, 3), round(value, 6)] for at, value in samples]
        return out


class LatencyTap:
    """A front end's client whose streams feed a `LatencyWindow` as their tokens arrive. Adds
    no await of its own (a request is still submitted on the first iteration)."""

    def __init__(self, inner: Any, window: LatencyWindow) -> None:
        self.inner, self.window = inner, window

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        self.window.follow(request)
        try:
            async for output in self.inner.generate(request):
                self.window.catch_up(request)
                yield output
        finally:
            self.window.forget(request)
