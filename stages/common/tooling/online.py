"""Online load for a step-driven engine: requests that arrive over time, not all at t = 0.

An offline benchmark submits every request at once, which hides what a scheduler does for a
request that arrives while others run. `poisson_arrivals` draws arrival times for a given
request rate (exponential gaps, seeded), and `run_online` replays them against an engine in
this process: before every step it admits the requests whose arrival time has passed, and when
the engine is idle it sleeps until the next arrival. Each request's `arrival_time` is its
scheduled arrival, so TTFT and end-to-end latency include the time it spent waiting for a seat.

`stall_during_long_prefill` measures the other cost of an arrival: how long a running stream
waits for its next token while a long prompt is prefilled whole in the same step.
"""

from __future__ import annotations

import random
import statistics
import time
from itertools import pairwise
from typing import Any

from stages.common.tooling.latency import summarize_outputs


def poisson_arrivals(num_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds for a Poisson process of `rate_per_s` requests per second."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def run_online(engine: Any, requests: list[Any], offsets: list[float]) -> dict[str, Any]:
    """Drive `engine` (add_request / step / has_unfinished) with requests arriving at
    `offsets` seconds after the start. Returns the serving metrics (TTFT, ITL, end-to-end
    latency, throughput) and every request's tokens."""
    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    started = time.perf_counter()
    for i in order:
        requests[i].arrival_time = started + offsets[i]
    pending = list(order)
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and requests[pending[0]].arrival_time <= now:
            engine.add_request(requests[pending.pop(0)])
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, requests[pending[0]].arrival_time - time.perf_counter()))
    wall = time.perf_counter() - started
    outputs = [r.final_output() for r in requests]
    metrics = summarize_outputs(outputs, wall)
    return {"metrics": metrics, "token_ids": [o.token_ids for o in outputs]}


def stall_during_long_prefill(
    engine: Any, make_request: Any, long_prompt_ids: list[int], warmup_tokens: int = 12
) -> dict[str, float]:
    """Start one decoding stream, let it settle, then submit a long prompt. Returns the stream's
    median inter-token gap before the arrival and the gap that contains the long prefill."""
    stream = make_request([101, 102, 103, 104], 64)
    engine.add_request(stream)
    while len(stream.output_token_ids) < warmup_tokens:
        engine.step()
    engine.add_request(make_request(long_prompt_ids, 1))
    seen = len(stream.output_token_ids)
    while len(stream.output_token_ids) < seen + 3:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    gaps = [(b - a) * 1e3 for a, b in pairwise(stream.token_times)]
    before = gaps[: seen - 1]
    return {
        "prompt_tokens": len(long_prompt_ids),
        "itl_ms_before": statistics.median(before),
        "stall_ms": gaps[seen - 1],
    }
