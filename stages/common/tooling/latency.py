"""Latency and throughput statistics shared by every benchmark.

TTFT (time to first token), ITL (inter-token latency, also called TPOT), end-to-end latency,
output tokens/s and requests/s, summarized as p50/p90/p99 the way serving papers report them.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    data = sorted(values)
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return data[low] + (data[high] - data[low]) * (rank - low)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p90/p99/mean/max of `values` times `scale` (1e3 turns seconds into ms)."""
    data = [v * scale for v in values]
    if not data:
        return {
            "p50": math.nan,
            "p90": math.nan,
            "p99": math.nan,
            "mean": math.nan,
            "max": math.nan,
            "count": 0,
        }
    return {
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "mean": sum(data) / len(data),
        "max": max(data),
        "count": len(data),
    }


def summarize_requests(
    ttfts: Sequence[float],
    itls: Sequence[float],
    e2es: Sequence[float],
    output_tokens: int,
    wall_seconds: float,
    num_requests: int,
) -> dict[str, Any]:
    """The standard serving table for one run: latencies in ms, throughput per second."""
    return {
        "requests": num_requests,
        "output_tokens": output_tokens,
        "wall_s": wall_seconds,
        "output_tokens_per_s": output_tokens / wall_seconds if wall_seconds > 0 else math.nan,
        "requests_per_s": num_requests / wall_seconds if wall_seconds > 0 else math.nan,
        "ttft_ms": distribution(ttfts, 1e3),
        "itl_ms": distribution(itls, 1e3),
        "e2e_ms": distribution(e2es, 1e3),
    }


def summarize_outputs(outputs: Sequence[Any], wall_seconds: float) -> dict[str, Any]:
    """`summarize_requests` over engine `RequestOutput`s (offline benchmarks)."""
    return summarize_requests(
        ttfts=[o.ttft for o in outputs if o.ttft is not None],
        itls=[gap for o in outputs for gap in o.itl],
        e2es=[o.e2e_latency for o in outputs if o.e2e_latency is not None],
        output_tokens=sum(len(o.token_ids) for o in outputs),
        wall_seconds=wall_seconds,
        num_requests=len(outputs),
    )


def _linux_status_kib(field: str, pid: int | str = "self") -> int | None:
    """A `kB` field of /proc/<pid>/status (VmHWM = peak resident set), or None off Linux."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


# The largest peaks seen before each reset, so a whole-process peak survives per-mode windows.
_EARLIER_PEAKS: dict[str, float] = {"host_rss_gib": 0.0, "cuda_allocated_gib": 0.0}


def reset_peak_memory() -> None:
    """Start a new peak-memory window for this process (host RSS on Linux, and CUDA)."""
    for key, value in peak_memory().items():
        if value is not None:
            _EARLIER_PEAKS[key] = max(_EARLIER_PEAKS[key], value)
    # Not Linux, or not permitted: the window then never resets. "5" resets VmHWM to the RSS.
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory(pid: int | None = None, whole_process: bool = False) -> dict[str, float | None]:
    """Peak memory in GiB: host resident set (Linux) and, for this process, what the CUDA caching
    allocator handed out. Since the last `reset_peak_memory()`, or over the process's whole life
    with `whole_process=True`. Unavailable numbers are None."""
    kib = _linux_status_kib("VmHWM", pid if pid is not None else "self")
    result: dict[str, float | None] = {"host_rss_gib": None if kib is None else kib / 2**20}
    if pid is None:
        import torch

        cuda = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        result["cuda_allocated_gib"] = cuda
        if whole_process:
            result = {
                key: None if value is None else max(value, _EARLIER_PEAKS[key])
                for key, value in result.items()
            }
    return result


# ------------------------------------------------------------------ step cost (engine benchmarks)
# `occupancy` is one run's steps: [{"t_s": time since the start when the step ended, "batch":
# requests that advanced in it}, ...].


def step_durations(occupancy: list[dict[str, float]]) -> list[tuple[int, float]]:
    """(requests in the step, its duration in ms) for every step of one run."""
    starts = [0.0] + [p["t_s"] for p in occupancy[:-1]]
    return [(p["batch"], (p["t_s"] - t0) * 1e3) for p, t0 in zip(occupancy, starts, strict=True)]


def median_step_ms_by_batch(occupancy: list[dict[str, float]]) -> dict[int, float]:
    """Median step duration for each batch size (medians skip the few long prefill steps)."""
    by_batch: dict[int, list[float]] = {}
    for batch, ms in step_durations(occupancy):
        by_batch.setdefault(batch, []).append(ms)
    return {batch: statistics.median(by_batch[batch]) for batch in sorted(by_batch)}


def fit_step_cost(occupancy: list[dict[str, float]]) -> tuple[float, float]:
    """Least-squares line through the per-batch-size medians: fixed + per_request * batch (ms)."""
    medians = median_step_ms_by_batch(occupancy)
    slope, intercept = statistics.linear_regression(list(medians), list(medians.values()))
    return intercept, slope


def mean_batch(occupancy: list[dict[str, float]]) -> float:
    return statistics.fmean(p["batch"] for p in occupancy)


# A request with greedy sampling, from (prompt token ids, max_tokens): how the step-cost probes
# below make requests without knowing the stage.
GreedyRequest = Callable[[list[int], int], Any]


def gaps_while_a_prompt_arrives(
    engine: Any, greedy: GreedyRequest, prompt: list[int]
) -> dict[str, Any]:
    """One stream decodes; `prompt` arrives. Every gap the stream sees until the prompt's first
    token, with the prompt's cached tokens when the gap began, and the prompt's TTFT. Run it
    with synchronous steps: then each step is one chunk and one token of the stream."""
    stream, long_prompt = greedy([101, 102, 103, 104], len(prompt)), greedy(prompt, 1)
    engine.add_request(stream)
    while len(stream.output_token_ids) < 4:
        engine.step()
    long_prompt.arrival_time = time.perf_counter()
    engine.add_request(long_prompt)
    gaps = []
    while not long_prompt.output_token_ids:
        context, started = long_prompt.num_computed_tokens, stream.token_times[-1]
        engine.step()
        gaps.append({"context": context, "gap_ms": (stream.token_times[-1] - started) * 1e3})
    engine.abort_request(stream.request_id)
    ttft_ms = long_prompt.final_output().ttft * 1e3
    return {"gaps": gaps, "max_gap_ms": max(g["gap_ms"] for g in gaps), "ttft_ms": ttft_ms}


def decode_step_ms(engine: Any, greedy: GreedyRequest, batch: int, budget: int) -> float:
    """Median duration of a step in which `batch` requests all decode (none prefilling, none
    done). Their 16-token prompts take about batch * 16 / `budget` steps to admit: each decodes
    long enough that the first is still running when the last starts."""
    admit_steps = -(-batch * 16 // budget)
    requests = [
        greedy([100 + (i * 37 + j) % 9000 for j in range(16)], 8 + 2 * admit_steps)
        for i in range(batch)
    ]
    for request in requests:
        engine.add_request(request)
    durations = []
    while engine.has_unfinished():
        decoding = all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in requests)
        started = time.perf_counter()
        engine.step()
        if decoding and all(r.finish_reason is None for r in requests):
            durations.append((time.perf_counter() - started) * 1e3)
    return statistics.median(durations)
