"""Stage 02 benchmark: what streaming and an engine thread change for the client.

Stage 01's blocking server and this stage's streaming server run side by side as real
subprocesses on the same model, and the same client measures both:
1. client-observed time to first token vs answer length: the blocking client sees nothing until
   the whole answer is done; the streaming client sees the first SSE event after one prefill;
2. `/health` latency while a long generation runs: stage 01's event loop is busy running the
   model, so the probe waits for the whole generation; stage 02 answers at once.

    python -m stages 02 bench [--quick]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from stages.common.tooling.load_client import ClientRequest, send_request
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.server_process import ServerProcess
from stages.common.tooling.workloads import SAMPLE_QUESTIONS
from stages.common.weights import DEFAULT_MODEL

NAME = "02_streaming"
SERVERS = {"blocking (stage 01)": "01", "streaming (stage 02)": "02"}


def _log(message: str) -> None:
    print(f"[bench 02] {message}", file=sys.stderr, flush=True)


async def _ttft(url: str, max_tokens: int, stream: bool, repeats: int) -> list[float]:
    """Client TTFT in seconds, sequential requests (nothing else in flight)."""
    messages = [{"role": "user", "content": SAMPLE_QUESTIONS[3]}]
    request = ClientRequest(
        messages,
        max_tokens,
        api="generate",
        stream=stream,
        extra={"temperature": 0, "ignore_eos": True},
    )
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(repeats):
            result = await send_request(client, url, request)
            assert result.ok and result.num_tokens == max_tokens, result.error
            out.append(result.ttft)
    return out


async def _health_during_generation(url: str, max_tokens: int) -> list[tuple[float, float]]:
    """(probe sent at, latency) pairs, seconds since the generation started, probing back to
    back every 100 ms until the generation ends."""
    messages = [{"role": "user", "content": SAMPLE_QUESTIONS[2]}]
    request = ClientRequest(
        messages,
        max_tokens,
        api="generate",
        stream=False,
        extra={"temperature": 0, "ignore_eos": True},
    )
    probes: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        generation = asyncio.create_task(send_request(client, url, request))
        await asyncio.sleep(0.3)  # let the request reach the engine
        while not generation.done():
            sent = time.perf_counter()
            response = await client.get(f"{url}/health")
            assert response.status_code == 200
            probes.append((sent - started, time.perf_counter() - sent))
            await asyncio.sleep(0.1)
        result = await generation
        assert result.ok, result.error
    return probes


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    lengths = [4, 16] if quick else [8, 32, 64, 128]
    repeats = 1 if quick else 3
    health_tokens = 24 if quick else 128
    ttft: dict[str, dict[int, list[float]]] = {}
    health: dict[str, list[tuple[float, float]]] = {}
    server_memory: dict[str, dict[str, float | None]] = {}
    for label, stage in SERVERS.items():
        _log(f"starting the {label} server")
        with ServerProcess(stage, model=model) as server:
            ttft[label] = {}
            for n in lengths:
                _log(f"{label}: TTFT for {n}-token answers x{repeats}")
                ttft[label][n] = asyncio.run(_ttft(server.url, n, stage != "01", repeats))
            _log(f"{label}: /health latency during a {health_tokens}-token generation")
            health[label] = asyncio.run(_health_during_generation(server.url, health_tokens))
            server_memory[label] = server.peak_memory()

    blocking, streaming = SERVERS
    median_ms = {
        label: {n: statistics.median(v) * 1e3 for n, v in by_len.items()}
        for label, by_len in ttft.items()
    }
    longest = lengths[-1]
    summary = {
        "ttft_ms_streaming_longest": median_ms[streaming][longest],
        "ttft_ms_blocking_longest": median_ms[blocking][longest],
        "ttft_ratio_blocking_vs_streaming": median_ms[blocking][longest]
        / median_ms[streaming][longest],
        "answer_tokens_longest": longest,
        "health_max_ms_blocking": max(lat for _, lat in health[blocking]) * 1e3,
        "health_max_ms_streaming": max(lat for _, lat in health[streaming]) * 1e3,
        "health_p50_ms_streaming": statistics.median(lat for _, lat in health[streaming]) * 1e3,
        "health_probes_answered_blocking": len(health[blocking]),
        "health_probes_answered_streaming": len(health[streaming]),
    }
    results = {
        "ttft_ms_median": {
            label: {str(n): v for n, v in d.items()} for label, d in median_ms.items()
        },
        "ttft_s_runs": {label: {str(n): v for n, v in d.items()} for label, d in ttft.items()},
        "peak_memory_server": server_memory,
        "health_probes": {
            label: [{"sent_s": s, "latency_ms": lat * 1e3} for s, lat in probes]
            for label, probes in health.items()
        },
    }
    workload = {
        "ttft_prompt": SAMPLE_QUESTIONS[3],
        "answer_lengths": lengths,
        "repeats": repeats,
        "health_generation_tokens": health_tokens,
        "health_probe_interval_s": 0.1,
        "sampling": "greedy, ignore_eos; one request at a time",
        "servers": "python -m stages 01 serve / 02 serve, separate processes",
    }
    record = bench_record(
        stage=NAME,
        title="streaming vs blocking server",
        summary=summary,
        results=results,
        workload=workload,
        model=model or DEFAULT_MODEL,
        dtype="float32",
        device="cpu",
        quick=quick,
    )
    path = write_results(NAME, record, _plot(median_ms, health, lengths, model), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(
    median_ms: dict[str, dict[int, float]],
    health: dict[str, list[tuple[float, float]]],
    lengths: list[int],
    model: str | None,
) -> Any:
    fig, (ax1, ax2) = new_figure(
        2,
        f"Stage 02 streaming: {model or DEFAULT_MODEL}, one request at a time",
        width_per_plot=6.0,
    )
    colors = {"blocking (stage 01)": "tab:red", "streaming (stage 02)": "tab:blue"}
    for label, by_len in median_ms.items():
        ax1.plot(
            lengths, [by_len[n] for n in lengths], marker="o", label=label, color=colors[label]
        )
    ax1.set_xlabel("answer length (tokens)")
    ax1.set_ylabel("client time to first token (ms)")
    ax1.set_title("Streaming: first token after one prefill")
    ax1.set_ylim(0, None)
    ax1.legend()
    ax1.grid(alpha=0.3)
    for label, probes in health.items():
        ax2.scatter(
            [s for s, _ in probes],
            [lat * 1e3 for _, lat in probes],
            label=label,
            color=colors[label],
            s=18,
        )
    ax2.set_yscale("log")
    ax2.set_xlabel("probe sent at (s after the generation started)")
    ax2.set_ylabel("/health latency (ms, log scale)")
    ax2.set_title("/health during a long generation")
    ax2.legend()
    ax2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
