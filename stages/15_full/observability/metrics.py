"""`GET /metrics`: the engine's numbers in Prometheus' text format, under vLLM's names.

Two sources, split as vLLM V1 splits them (`v1/metrics/stats.py`, `loggers.py`):
- the engine core counts what only it sees, as a snapshot of totals and gauges after each step
  (`engine_counters`): requests running and waiting, KV blocks in use, prefix-cache tokens
  queried and hit, preemptions, drafts proposed and accepted, and the KV connector's
  counters where there is one (the host tier's stores and loads, a transfer's). An in-process
  engine is read directly; an engine core in another process (stages 10 and 13) sends the
  snapshot with every step's outputs (`EngineCoreOutputs.stats`), and the front end keeps the
  latest per core;
- the front end times what a client sees (`FrontendMetrics.observe`, once per finished request,
  from the request's own clocks): time to first token, every inter-token gap, end-to-end
  latency, the request's phases (queue, prefill, decode, inference: `request_phases`, from its
  scheduler trace), prompt and generated tokens, requests by finish reason.

The engine core also counts the tokens each step scheduled (`StepTokens`, kept by the
scheduler), sent as cumulative buckets among its totals: `vllm:iteration_tokens_total`.

Each finished request also leaves its lifecycle trace (`request_trace`): arrival, what the
scheduler did with it (scheduled, preempted, KV loads), first token, finish; the last
`TRACES_KEPT` are served at `GET /v1/requests/{request_id}/trace`.

Totals are sent rather than increments, so a lost or reordered message costs nothing: the next
one carries the truth. Rendering walks a few dozen numbers: cheap enough for the event loop.
Histograms use vLLM's bucket edges; `engine` labels each core ("0", "1", ... for data-parallel
replicas; "prefill" / "decode" for a disaggregated pair).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .live_view import queue_counts
from .metrics_render import render as render  # re-exported: /metrics' text

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TRACES_KEPT = 1000  # finished requests whose trace /v1/requests/{id}/trace can still show

# vLLM's buckets (seconds), v1/metrics/loggers.py: tables of numbers, kept as tables
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
PHASE_BUCKETS = E2E_BUCKETS  # queue, prefill, decode and inference time: vLLM's request buckets
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`): the edges of
    the per-request token counts, sized by the model's context."""
    edges: list[int] = []
    for scale in itertools.count():
        for mantissa in (1, 2, 5):
            if mantissa * 10**scale > max_value:
                return tuple(edges)
            edges.append(mantissa * 10**scale)
    raise AssertionError("unreachable")


class StepTokens:
    """Tokens scheduled per engine step, as the engine core counts them (the scheduler calls
    `observe` once per step that scheduled any): steps per bucket, not cumulative, so a step
    costs one bisect; `counters` turns them into `vllm:iteration_tokens_total`'s buckets."""

    def __init__(self) -> None:
        self.steps = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # the last: above every edge
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        self.steps[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.total += num_tokens

    def counters(self) -> dict[str, float]:
        """Cumulative bucket counts (`iteration_tokens_le_<edge>`), sum and count: plain
        numbers for `engine_counters`' snapshot (counters: a dead core keeps them)."""
        cumulative = list(itertools.accumulate(self.steps))
        counters: dict[str, float] = {
            f"iteration_tokens_le_{edge}": count
            for edge, count in zip(ITERATION_TOKENS_BUCKETS, cumulative, strict=False)
        }
        counters["iteration_tokens_sum"] = self.total
        counters["iteration_tokens_count"] = cumulative[-1]
        return counters


def engine_counters(engine: Any) -> dict[str, float]:
    """A snapshot of one engine's totals and gauges (plain numbers: it travels in a pipe)."""
    scheduler, kv = engine.scheduler, engine.kv_manager
    blocks = kv.allocator.num_blocks
    spec = engine.spec_stats
    queues = queue_counts(engine)  # the live view's and /health's numbers
    counters: dict[str, float] = {
        "num_running": queues["running"],
        "num_waiting": queues["waiting"] + queues["loading"],  # loading its KV: not run yet
        "kv_cache_usage": (blocks - kv.num_free_blocks) / blocks if blocks else 0.0,
        "prefix_queries": kv.stats.queried_tokens,
        "prefix_hits": kv.stats.hit_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "spec_drafts": spec.num_verifications,
        "spec_draft_tokens": spec.num_draft_tokens,
        "spec_accepted_tokens": spec.num_accepted_tokens,
    }
    step_tokens = getattr(scheduler, "step_tokens", None)  # tokens per step (a histogram)
    if step_tokens is not None:
        counters |= step_tokens.counters()
    connector = getattr(engine, "kv_connector", None)
    if connector is not None:
        for name, value in dataclasses.asdict(connector.stats).items():
            counters[f"kv_connector_{name}"] = value
        if getattr(connector, "holds_swap", None) is not None:  # a host tier (stage 12)
            counters["num_swapped"] = queues["swapped"]
    return counters


# A dead core runs nothing and holds nothing: its last report's gauges no longer hold. Its
# counters keep their totals (a Prometheus counter never goes back); its requests failed.
GAUGES = ("num_running", "num_waiting", "kv_cache_usage", "num_swapped")


def _gauges_zeroed(stats: dict[str, float]) -> dict[str, float]:
    return {key: 0 if key in GAUGES else value for key, value in stats.items()}


def engine_snapshots(client: Any) -> list[tuple[str, dict[str, float]]]:
    """(label, numbers) per engine: each engine core's latest report, labelled by its role in a
    disaggregated pair (`client.roles`) or its replica index; or an in-process engine, read
    now (each number a snapshot, as /health reads them)."""
    replicas = getattr(client, "replicas", None)
    if replicas is None:
        return [("0", engine_counters(client.engine))]
    roles = getattr(client, "roles", None)
    return [
        (roles[i] if roles else str(i), r.stats if r.alive else _gauges_zeroed(r.stats))
        for i, r in enumerate(replicas)
    ]


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus wants them: counts[i] observations <= edges[i]."""

    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.edges)

    def observe(self, value: float) -> None:
        """Count `value` in every bucket whose upper edge is at least it; add it to the sum."""
        first = bisect.bisect_left(self.edges, value)  # every bucket from here up holds it
        for i in range(first, len(self.edges)):
            self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class FrontendMetrics:
    """What clients saw, per finished request. `observe` runs on the event loop: O(tokens)."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # A request's phases (`request_phases`): arrival to its first scheduling, that to its first
    # token, first to last token, first scheduling to last token.
    queue: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    max_model_len: int = 2048  # sizes the token-count buckets (the server passes the model's)
    prompt_lengths: Histogram = field(init=False)  # prompt tokens per request
    generation_lengths: Histogram = field(init=False)  # generated tokens per request
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The last TRACES_KEPT requests' lifecycle traces, by request id (`request_trace`).
    traces: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    # Requests in flight whose TTFT `first_token` already observed (`observe` skips it).
    timed: set[str] = field(default_factory=set)
    # Requests in flight, by identity (ObservedClient keeps it; event loop only): a request
    # answered in one piece at its end has a first token long before that.
    in_flight: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_lengths = Histogram(buckets_1_2_5(self.max_model_len))
        self.generation_lengths = Histogram(buckets_1_2_5(self.max_model_len))

    def first_token(self, request: Any) -> None:
        """Observe TTFT as the first token reaches the front end, not when the request ends:
        a request still streaming has a first token already."""
        with self.lock:
            if request.token_times and request.request_id not in self.timed:
                self.timed.add(request.request_id)
                self.ttft.observe(request.token_times[0] - request.arrival_time)

    def observe_first_tokens(self) -> None:
        """TTFT of every request in flight that has its first token, whether or not an output
        carried it to the front end yet (a non-streamed request gets one output, at its end):
        a scrape reads it as vLLM's front end does, which sees each engine step."""
        for request in list(self.in_flight.values()):
            self.first_token(request)

    def observe(self, request: Any) -> None:
        """Record one request that ended: its clocks (`arrival_time`, `token_times`,
        `finish_time`, one clock) and its token counts. One iteration's tokens share one time
        (several under speculation): a gap is between iterations, never a zero. Its phases
        (`request_phases`) and token counts go into their histograms too."""
        times = list(dict.fromkeys(request.token_times))  # one per iteration, in time order
        with self.lock:
            timed = request.request_id in self.timed
            self.timed.discard(request.request_id)
            self.prompt_tokens += len(request.prompt_token_ids)
            self.generation_tokens += len(request.output_token_ids)
            reason = request.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if times and not timed:
                self.ttft.observe(times[0] - request.arrival_time)
            for before, after in itertools.pairwise(times):
                self.itl.observe(after - before)
            if request.finish_time is not None:
                self.e2e.observe(request.finish_time - request.arrival_time)
            self.prompt_lengths.observe(len(request.prompt_token_ids))
            self.generation_lengths.observe(len(request.output_token_ids))
            for name, seconds in request_phases(request).items():
                getattr(self, name).observe(seconds)
            self.traces[request.request_id] = request_trace(request)
            self.traces.move_to_end(request.request_id)
            while len(self.traces) > TRACES_KEPT:
                self.traces.popitem(last=False)


SCHEDULED = ("scheduled", "prefill_scheduled")  # an engine core's, or a prefill core's (13)


def request_phases(request: Any) -> dict[str, float]:
    """The phases of a request that ended, in seconds, as vLLM V1 times them
    (`FinishedRequestStats`), from its clocks and its scheduler trace (`Request.events`, sent
    by cores in other processes too): "queue", arrival to its first scheduling (a preemption
    does not start it again); "prefill", that to its first token; "decode", first to last
    token; "inference", first scheduling to last token. A phase it never reached is left out
    (a request aborted while waiting has no queue time)."""
    scheduled = [at for name, at in request.events if name in SCHEDULED]
    times = request.token_times
    phases: dict[str, float] = {}
    if scheduled:
        first = min(scheduled)
        phases["queue"] = max(0.0, first - request.arrival_time)
        if times:
            phases["prefill"] = max(0.0, times[0] - first)
            phases["inference"] = max(0.0, times[-1] - first)
    if times:
        phases["decode"] = times[-1] - times[0]
    return phases


def request_trace(request: Any) -> dict[str, Any]:
    """A finished request's lifecycle, seconds after its arrival, in time order: arrived, what
    the scheduler did ("scheduled", "preempted", "kv_load_started", "kv_loaded",
    "kv_load_failed": `Request.events`, recorded in whichever process ran it; the clocks are
    the machine's monotonic clock, shared by its processes), the first token, the end."""
    start = request.arrival_time
    events = [("arrived", start), *request.events]
    if request.token_times:
        events.append(("first_token", request.token_times[0]))
    if request.finish_time is not None:
        events.append(("finished", request.finish_time))
    return {
        "request_id": request.request_id,
        "events": [
            {"event": name, "t_s": round(at - start, 6)}
            for name, at in sorted(events, key=lambda e: e[1])
        ],
        "finish_reason": request.finish_reason,
        "prompt_tokens": len(request.prompt_token_ids),
        "cached_tokens": request.num_cached_tokens or 0,
        "output_tokens": len(request.output_token_ids),
    }


class ObservedClient:
    """A front end's client (AsyncLLM, DPClient, DisaggClient) whose `generate` records each
    request in `metrics` when its stream ends, however it ends. Adds no await of its own, so a
    request is still submitted on the first iteration (streaming.py relies on it)."""

    def __init__(self, inner: Any, metrics: FrontendMetrics) -> None:
        self.inner, self.metrics = inner, metrics

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        """A refused request (draining, no engine left, its id running already: a 503 or a
        400) never started and is not counted. The inner client refuses before its first
        suspension, so a refusal is an exception raised before the event loop turned once;
        an accepted request suspends at least once, and `turned` says so."""
        turned: list[bool] = []
        asyncio.get_running_loop().call_soon(turned.append, True)
        self.metrics.in_flight[id(request)] = request
        try:
            async for output in self.inner.generate(request):
                if request.request_id not in self.metrics.timed:
                    self.metrics.first_token(request)
                yield output
        except Exception:
            if not turned:
                raise  # refused: never a finished request
            self.metrics.observe(request)
            raise
        except BaseException:  # cancelled, or the consumer closed the stream
            self.metrics.observe(request)
            raise
        else:
            self.metrics.observe(request)
        finally:
            self.metrics.in_flight.pop(id(request), None)
