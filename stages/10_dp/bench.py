"""Stage 10 benchmark: what data parallelism and routing do, measured over HTTP as a client.

The embedded model, greedy, behind the stage's own OpenAI server (in this process, as the
tests run it), with N replicas (3; 2 with --quick). Two parts:
1. Throughput against replicas: one batch of chat requests sent at once to DP=1 (stage 09's
   in-process engine, `create_app(LLM(...))`, given the replicas' KV memory in one pool) and
   to DP=N (`DPClient`, the round-robin replicas after their routing run); output tokens per
   second; the texts must agree (asserted). Each replica gets its share of the cores, so on a
   2-core CPU the replicas split the same two cores.
2. Routing: a multi-tenant chat workload (long system prompts, many users asking short
   questions, Poisson arrivals) served at DP=N under each policy, fresh replicas per policy.
   Each replica's KV pool holds its share of the tenants' prefixes (tenants / N) plus room for
   the requests in flight: no replica can keep every tenant, all together can. Recorded per
   policy: the prefix-cache hit rate (cached prompt tokens over prompt tokens, from each
   response's usage), TTFT p50/p99 as a streaming client sees it, requests per replica.

    python -m stages 10 bench [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from stages.common.devices import dtype_name, resolve_device, resolve_dtype
from stages.common.model_config import ModelConfig
from stages.common.tooling.latency import distribution, peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.server_process import ThreadedServer
from stages.common.tooling.workloads import SAMPLE_QUESTIONS
from stages.common.weights import resolve_model

from .frontend.dp_client import DPClient
from .frontend.router import POLICIES
from .kv_cache import PagedKVCache
from .llm import LLM
from .server import create_app

NAME = "10_dp"
_VOCABULARY = (
    "account order refund invoice shipping warranty customer policy payment delivery return "
    "support ticket product service billing address contract renewal discount store manager "
    "team schedule request answer always never politely clearly briefly check confirm explain "
    "offer escalate record update cancel replace repair review monthly annual premium basic"
)
WORDS = _VOCABULARY.split()
QUESTIONS = (
    "How do I return an item?",
    "When will my order arrive?",
    "Can I change my address?",
    "Why was I charged twice?",
    "How do I cancel my plan?",
    "Is my warranty still valid?",
    "Can I get a discount?",
    "Who do I call for repairs?",
)


def _log(message: str) -> None:
    print(f"[bench 10] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "throughput_requests": 4 if quick else 16,
        "throughput_max_tokens": 8 if quick else 32,
        "tenants": 2 if quick else 6,
        "system_prompt_words": 40 if quick else 420,
        "users": 4 if quick else 48,
        "routing_requests": 6 if quick else 96,
        "arrival_rate_per_s": 6.0 if quick else 2.0,
        "routing_max_tokens": 4 if quick else 8,
        "working_blocks_per_replica": 8,
        "rounds": 1,
        "replicas": 2 if quick else 3,  # for routing and the DP throughput batch
        "policies": ["round_robin", "cache_aware"] if quick else list(POLICIES),
        "block_size": 16,
        "max_model_len": 1024,
        "seed": 0,
    }


def _tenant_conversations(work: dict[str, Any]) -> list[tuple[int, list[dict[str, str]]]]:
    """(tenant, chat messages) per request: a tenant's long system prompt, then a user's
    short question; users belong to one tenant and arrive in a seeded random order."""
    rng = random.Random(work["seed"])
    systems = []
    for tenant in range(work["tenants"]):
        words = [rng.choice(WORDS) for _ in range(work["system_prompt_words"])]
        systems.append(f"You are the support assistant of shop {tenant}. Rules: {' '.join(words)}.")
    users = [(rng.randrange(work["tenants"]), f"user{u}") for u in range(work["users"])]
    requests = []
    for _ in range(work["routing_requests"]):
        tenant, name = rng.choice(users)
        question = f"I am {name}. {rng.choice(QUESTIONS)}"
        requests.append(
            (
                tenant,
                [
                    {"role": "system", "content": systems[tenant]},
                    {"role": "user", "content": question},
                ],
            )
        )
    return requests


async def _stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict:
    """One streamed chat request: TTFT (first content), text, and the final usage block."""
    sent = time.perf_counter()
    result: dict[str, Any] = {"ttft": None, "text": "", "usage": None}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the server failed a request: {event['error']}")
            result["usage"] = event.get("usage") or result["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    result["ttft"] = result["ttft"] or time.perf_counter() - sent
                    result["text"] += choice["delta"]["content"]
    return result


def _send_all(url: str, bodies: list[dict], rate: float | None, seed: int) -> tuple[list, float]:
    """Send every body (at once, or as a Poisson process at `rate`/s); results in order."""

    async def main() -> tuple[list, float]:
        rng = random.Random(seed)
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            started = time.perf_counter()
            tasks = []
            for body in bodies:
                tasks.append(asyncio.create_task(_stream_chat(client, url, body)))
                if rate:
                    await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
            return list(results), time.perf_counter() - started

    return asyncio.run(main())


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@contextlib.contextmanager
def _serving(replicas: int, model: str | None, **config: Any) -> Iterator[tuple[str, Any]]:
    """A server over `replicas` engines, each with cores // replicas threads; the engines
    are stopped however the block ends."""
    cores = os.cpu_count() or 1
    threads, env_before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // replicas))  # a replica's process reads it
    torch.set_num_threads(cores)  # the in-process engine of DP=1
    engine: Any = None
    kwargs = {} if model is None else {"model": model}
    try:
        if replicas == 1:
            engine = LLM(**kwargs, **config)
        else:
            engine = DPClient(**kwargs, data_parallel_size=replicas, **config)
        server = ThreadedServer(create_app(engine)).start()
        try:
            yield server.url, engine
        finally:
            server.stop()
    finally:
        if engine is not None:
            engine.shutdown()
        torch.set_num_threads(threads)
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before


def _throughput(url: str, engine: Any, work: dict[str, Any]) -> tuple[dict, list[str]]:
    """One batch of distinct chat requests sent at once: output tokens/s, and the texts."""
    questions = [f"{q} (Ticket {i}.)" for i, q in enumerate(SAMPLE_QUESTIONS * 4)]
    bodies = [
        _body(engine.model_name, [{"role": "user", "content": q}], work["throughput_max_tokens"])
        for q in questions[: work["throughput_requests"]]
    ]
    results, wall = _send_all(url, bodies, None, 0)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    point = {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}
    return point, [r["text"] for r in results]


def kv_pool(work: dict[str, Any], model: str | None, prefix_tokens: list[int]) -> tuple[int, int]:
    """Its share of the tenants' prefixes (the longest: tenants / replicas) plus working room
    for the requests in flight: one replica cannot keep every tenant, all together can.
    Returns (bytes, tokens) per replica."""
    config = ModelConfig.from_pretrained(resolve_model(model))
    dtype = resolve_dtype(None, resolve_device(None))
    per_block = PagedKVCache.bytes_per_block(
        config.num_layers, work["block_size"], config.num_kv_heads, config.head_dim, dtype
    )
    blocks = [-(-n // work["block_size"]) for n in sorted(prefix_tokens, reverse=True)]
    share = -(-len(blocks) // work["replicas"])  # tenants per replica when each keeps its own
    total = sum(blocks[:share]) + work["working_blocks_per_replica"]
    return per_block * total, work["block_size"] * total


def measure_policy(
    policy: str, work: dict, model: str | None, config: dict, throughput: bool = False
) -> dict[str, Any]:
    """The tenant workload under one policy, on fresh replicas; then, if asked, the
    throughput batch on the same (warm) replicas."""
    with _serving(work["replicas"], model, routing_policy=policy, **config) as (url, engine):
        bodies = [
            _body(engine.model_name, messages, work["routing_max_tokens"])
            for _, messages in _tenant_conversations(work)
        ]
        for i in range(work["replicas"]):  # warm-up: one each, one at a time, distinct
            # (identical prompts sent at once may follow their shared prefix to one replica)
            hello = _body(engine.model_name, [{"role": "user", "content": f"Hello {i}"}], 2)
            _send_all(url, [hello], None, 0)
        before = _served(url)
        results, wall = _send_all(url, bodies, work["arrival_rate_per_s"], work["seed"])
        health = httpx.get(f"{url}/health", timeout=30).json()
        batch = _throughput(url, engine, work) if throughput else None
    assert min(before) == 1, f"the warm-up missed a replica: {before}"
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    ttft = distribution([r["ttft"] for r in results], 1e3)
    point = {
        "hit_rate": cached / prompt,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_ms": ttft,
        "wall_s": wall,
        "requests_per_replica": [
            r["served"] - b for r, b in zip(health["router"]["replicas"], before, strict=True)
        ],
        "decisions": health["router"]["decisions"],
        "throughput": batch,
    }
    _log(
        f"{policy}: hit {point['hit_rate']:.1%}, TTFT p50 {ttft['p50']:.0f} ms "
        f"p99 {ttft['p99']:.0f} ms, per replica {point['requests_per_replica']}"
    )
    return point


def _served(url: str) -> list[int]:
    return [
        r["served"] for r in httpx.get(f"{url}/health", timeout=30).json()["router"]["replicas"]
    ]


def _prefix_tokens(work: dict[str, Any], model: str | None) -> list[int]:
    """Each tenant's shared prefix in tokens: the common start of two of its requests."""
    from stages.common.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model(model))
    conversations = _tenant_conversations(work)
    out = []
    for tenant in range(work["tenants"]):
        system = next(m for t, m in conversations if t == tenant)[0]
        a, b = (tokenizer.encode_chat([system, {"role": "user", "content": q}]) for q in "AZ")
        out.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y))
    return out


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    reset_peak_memory()
    prefixes = _prefix_tokens(work, model)
    pool, pool_tokens = kv_pool(work, model, prefixes)
    config = {
        "block_size": work["block_size"],
        "kv_cache_bytes": pool,
        "max_model_len": min(work["max_model_len"], pool_tokens),
    }
    results: dict[str, Any] = {
        "tenant_prefix_tokens": prefixes,
        "kv_pool_tokens_per_replica": pool_tokens,
    }
    # DP=1 gets the replicas' KV memory: the same total, in one pool.
    pooled = {"kv_cache_bytes": work["replicas"] * pool}
    with _serving(1, model, **config | pooled) as (url, llm):
        _send_all(url, [_body(llm.model_name, [{"role": "user", "content": "Hi"}], 2)], None, 0)
        dp1, texts = _throughput(url, llm, work)
        meta = {"model": llm.model_name, "dtype": llm.dtype, "device": str(llm.device)}
    _log(f"DP=1: {dp1['output_tokens_per_s']:.1f} output tokens/s")
    runs: dict[str, list[dict]] = {p: [] for p in work["policies"]}
    for round_index in range(work["rounds"]):  # policies interleaved round by round
        for policy in work["policies"]:
            batch = policy == "round_robin" and round_index == 0
            runs[policy].append(measure_policy(policy, work, model, config, batch))
    batches = [run.pop("throughput") for run in runs["round_robin"]]
    dp2, texts2 = batches[0]
    assert texts2 == texts, "data parallelism changed the greedy outputs of the batch"
    _log(f"DP={work['replicas']}: {dp2['output_tokens_per_s']:.1f} output tokens/s")
    results["throughput_by_dp"] = {1: dp1, work["replicas"]: dp2}
    # Per policy, the round with the median hit rate (one round: itself).
    results["routing_by_policy"] = {
        p: sorted(r, key=lambda point: point["hit_rate"])[len(r) // 2] for p, r in runs.items()
    }
    results["routing_runs"] = runs
    by_policy = results["routing_by_policy"]
    dp = results["throughput_by_dp"]
    summary = {
        "output_tokens_per_s_dp1": dp[1]["output_tokens_per_s"],
        "output_tokens_per_s_dp_n": dp[work["replicas"]]["output_tokens_per_s"],
        "replicas": work["replicas"],
        **{f"hit_rate_{p}": by_policy[p]["hit_rate"] for p in by_policy},
        "hit_rate_ratio_cache_aware_to_round_robin": by_policy["cache_aware"]["hit_rate"]
        / max(by_policy["round_robin"]["hit_rate"], 1e-9),
        **{f"ttft_ms_p50_{p}": by_policy[p]["ttft_ms"]["p50"] for p in by_policy},
        **{f"ttft_ms_p99_{p}": by_policy[p]["ttft_ms"]["p99"] for p in by_policy},
    }
    record = bench_record(
        stage=NAME,
        title="data parallelism: tokens/s by replicas; prefix hit rate and TTFT by routing policy",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | {"kv_cache_bytes_per_replica": pool, "threads_per_replica": "cores / DP"},
        model=meta["model"],
        dtype=dtype_name(meta["dtype"]),
        device=meta["device"],
        quick=quick,
    )
    path = write_results(NAME, record, _plot(results, meta["model"]), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(results: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 10 data parallelism: {model_name}")
    dp = results["throughput_by_dp"]
    ax1.bar([0, 1], [dp[n]["output_tokens_per_s"] for n in dp], color="tab:blue")
    ax1.set_xlabel("replicas (data_parallel_size)")
    ax1.set_ylabel("output tokens/s (one batch, sent at once)")
    ax1.set_xticks([0, 1], ["1 (in-process engine)", f"{max(dp)} (round-robin replicas)"])
    ax1.set_title(f"{os.cpu_count()} cores shared by the replicas", fontsize=9)
    by_policy = results["routing_by_policy"]
    names = list(by_policy)
    colors = ["tab:gray", "tab:orange", "tab:green"]
    ax2.bar(names, [100 * by_policy[p]["hit_rate"] for p in names], color=colors)
    for i, p in enumerate(names):
        ax2.text(
            i,
            100 * by_policy[p]["hit_rate"] + 1,
            f"{by_policy[p]['hit_rate']:.0%}\n{by_policy[p]['requests_per_replica']}",
            ha="center",
            fontsize=7,
        )
    ax2.set_ylim(0, 110)
    ax2.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax2.set_title(
        f"DP={max(dp)}, {len(results['tenant_prefix_tokens'])} tenants; pool per replica "
        f"{results['kv_pool_tokens_per_replica']} tokens\n(requests per replica "
        "under each bar)",
        fontsize=9,
    )
    width = 0.38
    for offset, (key, label) in zip(
        (-width / 2, width / 2), (("p50", "p50"), ("p99", "p99")), strict=True
    ):
        values = [by_policy[p]["ttft_ms"][key] for p in names]
        ax3.bar([i + offset for i in range(len(names))], values, width, label=label)
    ax3.set_xticks(range(len(names)), names)
    ax3.set_ylabel("TTFT (ms, streaming client)")
    ax3.set_title("Time to first token per policy", fontsize=9)
    ax3.legend(fontsize=7)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
