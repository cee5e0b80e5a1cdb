"""Stage 13 benchmark: decode latency while long prompts arrive, colocated vs disaggregated,
and what moving a prompt's KV costs, on this machine; plus a modelled GPU pair.

1. Interference. A few streams decode long answers; long prompts arrive one after another.
   Colocated: two full engine cores (data parallelism, stage 10), each prefilling and decoding,
   so a long prompt's chunks share steps with the streams of its core. Disaggregated: one
   prefill and one decode core (the same two processes' worth of CPU): the streams decode on
   one core, the long prompts prefill on the other, and only their KV (and their last token)
   reaches the decode core. Recorded: the streams' inter-token latency (p50, p90, p99, worst), the
   long prompts' time to first token, the wall time. Both modes must give the same tokens.
2. KV transfer time vs prompt length: GlooTransport between two processes, the embedded
   model's cache shapes, beside the same gather and scatter in one process.
3. MODELLED, not measured: the same transfer for Llama-3-8B between two H100s, over NVLink and
   over 400 Gb/s RDMA, against the prefill that produces the KV (formula below and in README).

    python -m stages 13 bench [--quick]

Each engine core runs one thread (OMP_NUM_THREADS=1 in its process): two cores on two CPUs.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from stages.common.tooling.latency import distribution
from stages.common.tooling.results import bench_record, new_figure, write_results

from .frontend.disagg_client import DisaggClient
from .frontend.dp_client import DPClient
from .harness.transfer_peer import PoolShape, measure_transfers
from .llm import LLM
from .sampling import SamplingParams

NAME = "13_disagg"
BLOCK = 16
MODES = {
    "colocated: 2 engines (DP=2)": {"data_parallel_size": 2, "routing_policy": "round_robin"},
    "disaggregated: 1 prefill + 1 decode": {"disaggregated": True},
}
# The modelled GPU pair (public specifications; assumptions, not measurements): Llama-3-8B in
# bf16 (32 layers, 8 KV heads of 128), H100 SXM. transfer(n) = LATENCY + n * KV_BYTES / LINK;
# prefill(n) = 2 * PARAMS * n / (PEAK_FLOPS * MFU).
GPU_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, heads, dim, bf16: 128 KiB
GPU_LINKS = {"NVLink 4 (450 GB/s)": 450e9, "RDMA 400 Gb/s (50 GB/s)": 50e9}
GPU_LINK_LATENCY_S = 20e-6
GPU_PARAMS, GPU_PEAK_FLOPS, GPU_MFU = 8.0e9, 989e12, 0.5


def _log(message: str) -> None:
    print(f"[bench 13] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "streams": 2 if quick else 4,
        "stream_prompt_tokens": 32,
        "stream_output_tokens": 40 if quick else 160,
        "long_prompts": 2 if quick else 6,
        "long_prompt_tokens": 384 if quick else 1536,
        "long_output_tokens": 4,
        "long_every_s": 1.0 if quick else 2.0,
        "first_long_at_s": 0.5 if quick else 1.0,
        "transfer_tokens": [64, 256] if quick else [64, 128, 256, 512, 1024, 2048, 4096],
        "transfer_repeats": 1 if quick else 5,
        "kv_cache_bytes": 2**27 if quick else 2**29,
    }


def _modelled(tokens: list[int]) -> dict[str, Any]:
    """The GPU pair's transfer and prefill times (ms) per prompt length: MODELLED."""
    rows = {"prompt_tokens": tokens}
    for link, rate in GPU_LINKS.items():
        rows[link] = [
            1e3 * (GPU_LINK_LATENCY_S + n * GPU_KV_BYTES_PER_TOKEN / rate) for n in tokens
        ]
    rows["prefill"] = [1e3 * 2 * GPU_PARAMS * n / (GPU_PEAK_FLOPS * GPU_MFU) for n in tokens]
    return rows


async def _run_workload(client: Any, work: dict[str, Any]) -> dict[str, Any]:
    """The streams at t = 0, the long prompts every `long_every_s` after `first_long_at_s`."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]
    jobs = [
        (0.0, ids(work["stream_prompt_tokens"]), work["stream_output_tokens"])
        for _ in range(work["streams"])
    ]
    jobs += [
        (
            work["first_long_at_s"] + i * work["long_every_s"],
            ids(work["long_prompt_tokens"]),
            work["long_output_tokens"],
        )
        for i in range(work["long_prompts"])
    ]
    started = time.perf_counter()

    async def one(at: float, prompt: list[int], n: int) -> Any:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        request = client.make_request(prompt, params, output_kind="final")
        return [o async for o in client.generate(request)][-1]

    outputs = await asyncio.gather(*(one(*job) for job in jobs))
    wall = time.perf_counter() - started
    streams, longs = outputs[: work["streams"]], outputs[work["streams"] :]
    itl = [gap * 1e3 for o in streams for gap in o.itl]
    return {
        "wall_s": wall,
        "stream_itl_ms": distribution(itl),
        "long_ttft_ms": distribution(o.ttft * 1e3 for o in longs),
        "stream_gaps_ms": itl,
        "token_ids": [o.token_ids for o in outputs],
    }


def interference(model: str | None, work: dict[str, Any]) -> dict[str, Any]:
    results = {}
    os.environ["OMP_NUM_THREADS"] = "1"  # each engine core: one CPU thread
    base = {"block_size": BLOCK, "kv_cache_bytes": work["kv_cache_bytes"]}
    for label, switches in MODES.items():
        kind = DisaggClient if switches.get("disaggregated") else DPClient
        client = kind(**({} if model is None else {"model": model}), **base, **switches)
        try:
            asyncio.run(_run_workload(client, work | {"streams": 1, "long_prompts": 1}))  # warm
            results[label] = asyncio.run(_run_workload(client, work))
        finally:
            client.shutdown()
        itl = results[label]["stream_itl_ms"]
        _log(
            f"{label}: stream ITL p50 {itl['p50']:.0f} ms, p90 {itl['p90']:.0f} ms, "
            f"p99 {itl['p99']:.0f} ms"
        )
    return results


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    probe = LLM(**({} if model is None else {"model": model}), kv_cache_bytes=2**24)
    k = probe.kv_cache.k
    shape = PoolShape(k.shape[0], 257, BLOCK, k.shape[3], k.shape[4], k.dtype)
    model_name, dtype, device = probe.model_name, str(k.dtype).removeprefix("torch."), str(k.device)
    del probe
    results: dict[str, Any] = {"interference": interference(model, work)}
    colocated, disaggregated = (results["interference"][label] for label in MODES)
    assert colocated.pop("token_ids") == disaggregated.pop("token_ids"), (
        "disaggregation changed tokens"
    )
    results["transfer"] = measure_transfers(
        shape, work["transfer_tokens"], work["transfer_repeats"]
    )
    _log(f"transfer: {[round(r['transfer_ms'], 1) for r in results['transfer']]} ms")
    results["modelled_gpu_pair"] = _modelled([64, 256, 1024, 4096, 16384, 65536])
    c, d = colocated["stream_itl_ms"], disaggregated["stream_itl_ms"]
    longest = max(results["transfer"], key=lambda r: r["prompt_tokens"])
    modelled = results["modelled_gpu_pair"]
    summary = {
        "stream_itl_p50_ms_colocated": c["p50"],
        "stream_itl_p50_ms_disaggregated": d["p50"],
        "stream_itl_p90_ms_colocated": c["p90"],
        "stream_itl_p90_ms_disaggregated": d["p90"],
        "stream_itl_p99_ms_colocated": c["p99"],
        "stream_itl_p99_ms_disaggregated": d["p99"],
        "stream_itl_p99_ratio_colocated_vs_disaggregated": c["p99"] / d["p99"],
        "long_ttft_p50_ms_colocated": colocated["long_ttft_ms"]["p50"],
        "long_ttft_p50_ms_disaggregated": disaggregated["long_ttft_ms"]["p50"],
        "transfer_ms_longest": longest["transfer_ms"],
        "transfer_tokens_longest": longest["prompt_tokens"],
        "transfer_gb_per_s_longest": longest["gb_per_s"],
        "modelled_gpu_rdma_transfer_share_of_prefill": modelled["RDMA 400 Gb/s (50 GB/s)"][-1]
        / modelled["prefill"][-1],
    }
    record = bench_record(
        stage=NAME,
        title="Disaggregated prefill and decode: decode latency under long prompts, KV transfer",
        summary=summary,
        results=results,
        workload=work
        | {
            "block_size": BLOCK,
            "threads_per_core": 1,
            "kv_shape": list(shape.__dict__.values())[:5],
        },
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, work: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 13 disaggregated prefill and decode: {model_name}")
    colors = ("tab:red", "tab:blue")
    for label, color in zip(MODES, colors, strict=True):
        gaps = sorted(results["interference"][label]["stream_gaps_ms"])
        ax1.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], color=color, label=label)
    ax1.set_xscale("log")
    ax1.set_xlabel("stream inter-token latency (ms)")
    ax1.set_ylabel("share of gaps at most this long")
    ax1.set_title(
        f"{work['streams']} streams decode while {work['long_prompts']} prompts of "
        f"{work['long_prompt_tokens']} tokens arrive: stream ITL p99 "
        f"{summary['stream_itl_p99_ms_colocated']:.0f} vs "
        f"{summary['stream_itl_p99_ms_disaggregated']:.0f} ms",
        fontsize=9,
    )
    ax1.legend(fontsize=7)
    rows = results["transfer"]
    tokens = [r["prompt_tokens"] for r in rows]
    ax2.plot(tokens, [r["transfer_ms"] for r in rows], "o-", label="gloo, two processes (median)")
    ax2.plot(
        tokens, [r["local_copy_ms"] for r in rows], "s--", label="gather + scatter, one process"
    )
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("ms")
    ax2.set_title(f"KV transfer time ({model_name} cache shapes)", fontsize=9)
    ax2.legend(fontsize=7)
    modelled = results["modelled_gpu_pair"]
    for key, style in (*((link, "o-") for link in GPU_LINKS), ("prefill", "k--")):
        label = f"transfer, {key}" if key in GPU_LINKS else "prefill compute (H100, 50% MFU)"
        ax3.plot(modelled["prompt_tokens"], modelled[key], style, label=label)
    ax3.set_xscale("log", base=2)
    ax3.set_yscale("log")
    ax3.set_xlabel("prompt tokens")
    ax3.set_ylabel("ms")
    ax3.set_title("MODELLED, not measured: Llama-3-8B bf16 KV between two H100s", fontsize=9)
    ax3.legend(fontsize=7)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                if axis in (ax1.xaxis, ax2.yaxis, ax3.yaxis):  # base 10: 1, 2, 5 per decade
                    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
                axis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    return fig
