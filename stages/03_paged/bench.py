"""Stage 03 benchmark: what paging buys at a fixed KV memory budget.

The same workload runs twice in one process, with the same KV budget and static batching:
- `kv_layout="contiguous"`: every request reserves `max_model_len` tokens of KV up front;
- `kv_layout="paged"`: requests take 16-token blocks as their tokens arrive.
Recorded at every step: how many requests are decoding together, and what fraction of the
reserved KV memory holds real tokens; at the end, the output throughput the bigger batches buy.

    python -m stages 03 bench [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory, summarize_outputs
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.workloads import ThroughputWorkload

from .llm import LLM
from .request import Request
from .sampling import SamplingParams

NAME = "03_paged"
LAYOUTS = ("contiguous", "paged")


def _log(message: str) -> None:
    print(f"[bench 03] {message}", file=sys.stderr, flush=True)


def run_layout(llm: LLM, workload: ThroughputWorkload) -> dict[str, Any]:
    """Run the workload to completion, sampling batch size and KV utilisation every step."""
    requests: list[Request] = []
    for item in workload.requests():
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True)
        requests.append(llm.make_request(item.prompt_token_ids, params, output_kind="delta"))
    for request in requests:
        llm.add_request(request)
    pool = llm.kv_manager
    batch_sizes, utilisation, step_times = [], [], []
    started = time.perf_counter()
    while llm.has_unfinished():
        t0 = time.perf_counter()
        llm.step()
        step_times.append(time.perf_counter() - t0)
        if not llm.running:
            continue
        # K/V is in the cache for every computed token (the one just sampled comes next step)
        stored = sum(r.num_computed_tokens for r in llm.running)
        reserved = (pool.allocator.num_blocks - pool.num_free_blocks) * llm.block_size
        batch_sizes.append(len(llm.running))
        utilisation.append(stored / reserved)
    wall = time.perf_counter() - started
    outputs = [r.final_output() for r in requests]
    return {
        "batch_sizes": batch_sizes,
        "kv_utilisation": utilisation,
        "step_s": step_times,
        "max_batch": max(batch_sizes),
        "mean_batch": statistics.fmean(batch_sizes),
        "mean_kv_utilisation": statistics.fmean(utilisation),
        "metrics": summarize_outputs(outputs, wall),
        "kv_pool_blocks": pool.allocator.num_blocks,
        "block_size": llm.block_size,
        "token_ids": [o.token_ids for o in outputs],
    }


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    max_model_len = 512 if quick else 1024
    contiguous_slots = 3 if quick else 6  # the budget holds this many max-length reservations
    workload = ThroughputWorkload(
        num_requests=6 if quick else 48,
        input_len=(16, 64) if quick else (16, 192),
        output_len=(8, 24) if quick else (16, 192),
    )
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    results: dict[str, Any] = {}
    budget = 0
    for layout in LAYOUTS:
        llm = LLM(
            **kwargs,
            kv_layout=layout,
            max_model_len=max_model_len,
            max_num_seqs=256,
            kv_cache_bytes=budget or None,
        )
        if not budget:  # size the budget from the first engine: N max-length reservations
            mc = llm.model_config
            budget = contiguous_slots * max_model_len * mc.kv_bytes_per_token(llm.dtype.itemsize)
            llm = LLM(
                **kwargs,
                kv_layout=layout,
                max_model_len=max_model_len,
                max_num_seqs=256,
                kv_cache_bytes=budget,
            )
        reset_peak_memory()  # from here: this layout's engine only, not the budget-sizing one
        _log(f"{layout}: {workload.num_requests} requests, KV budget {budget / 2**20:.0f} MiB")
        results[layout] = run_layout(llm, workload)
        results[layout]["peak_memory"] = peak_memory()
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        del llm
    assert results["paged"]["token_ids"] == results["contiguous"]["token_ids"], (
        "paged and contiguous layouts must produce the same tokens"
    )
    contiguous, paged = results["contiguous"], results["paged"]
    summary = {
        "max_concurrent_requests_contiguous": contiguous["max_batch"],
        "max_concurrent_requests_paged": paged["max_batch"],
        "concurrency_ratio_paged_vs_contiguous": paged["max_batch"] / contiguous["max_batch"],
        "kv_utilisation_contiguous": contiguous["mean_kv_utilisation"],
        "kv_utilisation_paged": paged["mean_kv_utilisation"],
        "output_tokens_per_s_contiguous": contiguous["metrics"]["output_tokens_per_s"],
        "output_tokens_per_s_paged": paged["metrics"]["output_tokens_per_s"],
        "throughput_ratio_paged_vs_contiguous": paged["metrics"]["output_tokens_per_s"]
        / contiguous["metrics"]["output_tokens_per_s"],
        "kv_budget_mib": budget / 2**20,
    }
    for layout in LAYOUTS:
        del results[layout]["token_ids"]
    describe = workload.describe() | {
        "max_model_len": max_model_len,
        "scheduling": "static",
        "kv_budget_bytes": budget,
        "block_size_paged": 16,
    }
    record = bench_record(
        stage=NAME,
        title="contiguous vs paged KV at one budget",
        summary=summary,
        results=results,
        workload=describe,
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, model_name, budget), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, model_name: str, budget: int) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(
        3, f"Stage 03 paged: {model_name}, KV budget {budget / 2**20:.0f} MiB, static batching"
    )
    colors = {"contiguous": "tab:red", "paged": "tab:blue"}
    for layout in LAYOUTS:
        sizes = results[layout]["batch_sizes"]
        ax1.plot(range(len(sizes)), sizes, label=layout, color=colors[layout])
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("requests decoding together")
    ax1.set_title(f"{summary['concurrency_ratio_paged_vs_contiguous']:.1f}x more requests fit")
    ax1.legend()
    ax1.grid(alpha=0.3)
    for layout in LAYOUTS:
        used = [u * 100 for u in results[layout]["kv_utilisation"]]
        ax2.plot(
            range(len(used)),
            used,
            label=f"{layout} (mean {statistics.fmean(used):.0f}%)",
            color=colors[layout],
        )
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("engine step")
    ax2.set_ylabel("reserved KV memory holding tokens (%)")
    ax2.set_title("KV memory utilisation")
    ax2.legend(loc="lower right")
    ax2.grid(alpha=0.3)
    values = [results[layout]["metrics"]["output_tokens_per_s"] for layout in LAYOUTS]
    bars = ax3.bar(LAYOUTS, values, color=[colors[layout] for layout in LAYOUTS])
    for bar, value in zip(bars, values, strict=True):
        ax3.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    ax3.set_ylabel("output tokens / s (whole workload)")
    ax3.set_title(f"{summary['throughput_ratio_paged_vs_contiguous']:.1f}x throughput")
    fig.tight_layout()
    return fig
