"""Stage 06 benchmark: what chunked prefill does for running decodes when long prompts arrive.

One process, one model. A few streams decode steadily; meanwhile long prompts (thousands of
tokens) arrive at fixed times. Without chunking each long prompt is prefilled whole in one step
and every running stream waits for it; with chunking the prompt is split under the step's token
budget and the streams keep getting a token every step. Recorded: every inter-token gap of the
running streams (over time, p50 and p99), the long prompts' time to first token (the cost of
chunking), and a sweep of the token budget (throughput against p99 inter-token latency: the
trade-off the budget sets).

    python -m stages 06 bench [--quick]
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

from stages.common.devices import dtype_name
from stages.common.metrics import distribution, peak_memory, reset_peak_memory
from stages.common.online import run_online
from stages.common.results import bench_record, new_figure, write_results

from .llm import LLM
from .sampling import SamplingParams

NAME = "06_chunked"
BUDGET = 256  # tokens per step with chunking: the headline comparison
SWEEP = (64, 128, 256, 512, 1024)


def _log(message: str) -> None:
    print(f"[bench 06] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "streams": 4 if quick else 8,
        "stream_output_tokens": 40 if quick else 160,
        "long_prompt_tokens": 400 if quick else 2000,
        "long_prompt_arrivals_s": [0.5] if quick else [1.0, 5.0, 9.0],
    }


def run_interference(llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Streams from t = 0, long prompts at their arrival times; every gap of the streams."""
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    streams = [
        llm.make_request(
            [101 + i, 102, 103, 104], greedy(work["stream_output_tokens"]), output_kind="final"
        )
        for i in range(work["streams"])
    ]
    longs = [
        llm.make_request(
            [100 + (i * 7919 + j * 31) % 9000 for j in range(work["long_prompt_tokens"])],
            greedy(1),
            output_kind="final",
        )
        for i in range(len(work["long_prompt_arrivals_s"]))
    ]
    offsets = [0.0] * len(streams) + list(work["long_prompt_arrivals_s"])
    run = run_online(llm, streams + longs, offsets)
    start = min(r.arrival_time for r in streams)
    gaps = [
        (b - start, (b - a) * 1e3) for r in streams for a, b in itertools.pairwise(r.token_times)
    ]
    itl = distribution([g for _, g in gaps])
    return {
        "itl_ms": itl,
        "gaps": [{"t_s": t, "gap_ms": g} for t, g in gaps],
        "long_prompt_ttft_ms": distribution([r.final_output().ttft * 1e3 for r in longs]),
        "output_tokens_per_s": run["metrics"]["output_tokens_per_s"],
        "token_ids": run["token_ids"],
    }


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_model_len": work["long_prompt_tokens"] + 256, "max_num_seqs": 16}
    reset_peak_memory()
    results: dict[str, Any] = {}
    modes = {
        "whole prefill (stage 05)": {"chunked_prefill": False},
        f"chunked, budget {BUDGET}": {"chunked_prefill": True, "max_num_batched_tokens": BUDGET},
    }
    for label, switches in modes.items():
        llm = LLM(**kwargs, **base, **switches)
        llm.generate([[101, 102]], SamplingParams(max_tokens=2))  # warm-up
        results[label] = run_interference(llm, work) | {"config": switches}
        _log(f"{label}: ITL p99 {results[label]['itl_ms']['p99']:.0f} ms")
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        del llm
    whole, chunked = (results[label] for label in modes)
    assert whole.pop("token_ids") == chunked.pop("token_ids"), "chunking changed the outputs"
    sweep = {}
    for budget in SWEEP[:3] if quick else SWEEP:
        llm = LLM(**kwargs, **base, chunked_prefill=True, max_num_batched_tokens=budget)
        point = run_interference(llm, work)
        point.pop("token_ids")
        sweep[budget] = {
            k: point[k] for k in ("itl_ms", "long_prompt_ttft_ms", "output_tokens_per_s")
        }
        _log(f"budget {budget}: ITL p99 {point['itl_ms']['p99']:.0f} ms")
        del llm
    results["budget_sweep"] = sweep
    summary = {
        "p99_itl_ms_whole": whole["itl_ms"]["p99"],
        "p99_itl_ms_chunked": chunked["itl_ms"]["p99"],
        "p99_itl_ratio_whole_vs_chunked": whole["itl_ms"]["p99"] / chunked["itl_ms"]["p99"],
        "p50_itl_ms_whole": whole["itl_ms"]["p50"],
        "p50_itl_ms_chunked": chunked["itl_ms"]["p50"],
        "long_prompt_ttft_ms_whole": whole["long_prompt_ttft_ms"]["p50"],
        "long_prompt_ttft_ms_chunked": chunked["long_prompt_ttft_ms"]["p50"],
        "output_tokens_per_s_whole": whole["output_tokens_per_s"],
        "output_tokens_per_s_chunked": chunked["output_tokens_per_s"],
        "chunk_budget_tokens": BUDGET,
    }
    record = bench_record(
        stage=NAME,
        title="chunked prefill: decode latency while long prompts arrive",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | base,
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, list(modes), model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, labels: list[str], model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 06 chunked prefill: {model_name}")
    colors = {labels[0]: "tab:red", labels[1]: "tab:blue"}
    for label in labels:
        gaps = results[label]["gaps"]
        ax1.scatter([g["t_s"] for g in gaps], [g["gap_ms"] for g in gaps], s=6, label=label,
                    color=colors[label], alpha=0.6)  # fmt: skip
    ax1.set_yscale("log")
    ax1.set_xlabel("time (s); long prompts arrive during the run")
    ax1.set_ylabel("gap between a stream's tokens (ms)")
    ax1.set_title("Inter-token gaps of the running streams")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    for offset, (q, hatch) in enumerate((("p50", ""), ("p99", "//"))):
        values = [results[label]["itl_ms"][q] for label in labels]
        xs = [i + offset * 0.4 for i in range(len(labels))]
        ax2.bar(xs, values, width=0.4, color=[colors[label] for label in labels], hatch=hatch,
                label=q)  # fmt: skip
    ttft = [results[label]["long_prompt_ttft_ms"]["p50"] for label in labels]
    ax2.set_xticks(
        [i + 0.2 for i in range(len(labels))], [label.replace(", ", ",\n") for label in labels]
    )
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.set_title(
        f"p99 ITL {summary['p99_itl_ratio_whole_vs_chunked']:.1f}x lower chunked; long-prompt "
        f"TTFT {ttft[0] / 1e3:.1f} -> {ttft[1] / 1e3:.1f} s",
        fontsize=9,
    )
    ax2.legend()
    sweep = results["budget_sweep"]
    budgets = list(sweep)
    p99 = [sweep[b]["itl_ms"]["p99"] for b in budgets]
    ax3.plot(p99, [sweep[b]["output_tokens_per_s"] for b in budgets], "o-", color="tab:blue")
    for b in budgets:
        ax3.annotate(
            str(b), (sweep[b]["itl_ms"]["p99"], sweep[b]["output_tokens_per_s"]), fontsize=8
        )
    ax3.set_xlabel("p99 inter-token latency of the streams (ms)")
    ax3.set_ylabel("output tokens / s")
    ax3.set_title("Token budget sweep (labels: tokens per step)")
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    return fig
