"""Stage 11 benchmark: a sparse MoE on this machine, at EP=1 and EP=2, by both dispatch methods.

There is no MoE checkpoint to install, so the embedded SmolLM2 plays one: its MLP is cut into 8
experts of 192 intermediate columns each and a router picks the top 2 per token. This is NOT a
trained MoE: the router's row for expert e is the mean of expert e's gate rows (moe/layer.py), so
the answers are worse than the dense model's. The routing and the traffic are real. Recorded:
1. tokens per expert (summed over the 30 layers): how evenly the router spreads the work;
2. bytes each rank sends to the other per MoE layer per forward step, for all-to-all dispatch
   and for all-gather / reduce-scatter, beside the gather-back both pay (attention is
   replicated, so every rank needs every token's output again);
3. output tokens per second at EP=1 and EP=2 (and the dense model), same workload.
EP=2 must give EP=1's greedy tokens, by both methods (asserted). Two ranks on a 2-core CPU
shared with other work: EP cannot be faster here, it can only show what the exchanges cost.

    python -m stages 11 bench [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results

from .llm import LLM
from .sampling import SamplingParams

NAME = "11_ep"
EXPERTS, TOP_K = 8, 2
PROMPTS = [
    "Explain how a lighthouse works.",
    "Write a short poem about rain.",
    "What is the capital of Japan?",
    "Give three tips for learning to cook.",
    "Why do cats purr?",
    "Describe a sunset over the sea.",
    "How do vaccines work?",
    "Name some famous painters.",
]
# Exchanges per MoE layer per forward on one rank (moe/layer.py): counts, rows, ids, weights,
# combine and gather-back for all-to-all; all-gather, reduce-scatter and gather-back for the other.
EXCHANGES_PER_LAYER = {"all_to_all": 6, "all_gather": 3}
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "ep1": {"moe_split_experts": EXPERTS, "moe_top_k": TOP_K},
    "ep2_all_to_all": {
        "moe_split_experts": EXPERTS,
        "moe_top_k": TOP_K,
        "tensor_parallel_size": 2,
        "expert_parallel": True,
        "moe_dispatch": "all_to_all",
    },
    "ep2_all_gather": {
        "moe_split_experts": EXPERTS,
        "moe_top_k": TOP_K,
        "tensor_parallel_size": 2,
        "expert_parallel": True,
        "moe_dispatch": "all_gather",
    },
}


def _log(message: str) -> None:
    print(f"[bench 11] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "experts": EXPERTS,
        "top_k": TOP_K,
        "batch": 4 if quick else 8,
        "max_tokens": 8 if quick else 48,
        "repeats": 1 if quick else 2,
        "configs": list(CONFIGS),
    }


def _moe_totals(llm: LLM) -> dict[str, Any]:
    """Every rank's MoE counters, summed (bytes) and rank 0's exchange count."""
    reports = [r["moe"] for r in llm.executor.call_all("rank_report")]
    tokens = [sum(col) for col in zip(*(r["expert_tokens"] for r in reports), strict=True)]
    return {
        "dispatch_bytes": sum(r["dispatch_bytes"] for r in reports),
        "combine_bytes": sum(r["combine_bytes"] for r in reports),
        "gather_back_bytes": sum(r["gather_back_bytes"] for r in reports),
        "exchanges_rank0": reports[0]["exchanges"],
        "expert_tokens": tokens,
    }


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in after if k != "expert_tokens"}
    old = before["expert_tokens"] or [0] * len(after["expert_tokens"])
    out["expert_tokens"] = [a - b for a, b in zip(after["expert_tokens"], old, strict=True)]
    return out


def measure(name: str, llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Throughput of one batch (median of the repeats) and the MoE traffic of the last run."""
    greedy = SamplingParams(max_tokens=work["max_tokens"], temperature=0, ignore_eos=True)
    prompts = PROMPTS[: work["batch"]]
    rates, traffic, outs = [], {}, []
    for _ in range(work["repeats"]):
        before = _moe_totals(llm) if name != "dense" else None
        started = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(o.token_ids) for o in outs) / elapsed)
        if before is not None:
            traffic = _delta(_moe_totals(llm), before)
    point: dict[str, Any] = {
        "output_tokens_per_s": sorted(rates)[len(rates) // 2],
        "output_tokens_per_s_runs": rates,
        "token_ids": [o.token_ids for o in outs],
        "tokens_processed": sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs),
    }
    if traffic:
        method = llm.config.moe_dispatch if "ep2" in name else None
        layer_steps = traffic["exchanges_rank0"] / EXCHANGES_PER_LAYER[method] if method else 0
        point["moe"] = traffic
        if layer_steps:
            moved = traffic["dispatch_bytes"] + traffic["combine_bytes"]
            point["layer_steps"] = layer_steps
            point["dispatch_combine_bytes_per_layer_step"] = moved / layer_steps
            point["gather_back_bytes_per_layer_step"] = traffic["gather_back_bytes"] / layer_steps
            point["dispatch_combine_bytes_per_token_layer"] = moved / (
                point["tokens_processed"] * llm.model.config.num_layers
            )
    return point


def modelled_rows_per_token(ep: int, top_k: int = TOP_K) -> dict[str, float]:
    """Hidden-state rows one token sends to other ranks per MoE layer (dispatch + combine), if
    its k experts are spread uniformly: all-to-all sends each pair off-rank with chance
    (EP-1)/EP, there and back; all-gather / reduce-scatter sends every token to the EP-1 others
    and every partial sum back, whatever its experts."""
    return {"all_to_all": 2 * top_k * (ep - 1) / ep, "all_gather": 2.0 * (ep - 1)}


def _balance(tokens: list[int]) -> float:
    """Busiest expert's tokens over the mean: 1.0 is perfect balance."""
    return max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 0.0


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_model_len": 512, "prefix_caching": False}
    reset_peak_memory()
    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    results: dict[str, Any] = {"by_config": {}}
    for name, extra in CONFIGS.items():
        ranks = extra.get("tensor_parallel_size", 1)
        torch.set_num_threads(max(1, cores // ranks))
        llm = LLM(**kwargs, **base, **extra)
        llm.generate([[101, 102]], SamplingParams(max_tokens=2))  # warm-up
        point = measure(name, llm, work)
        results["by_config"][name] = point
        _log(f"{name}: {point['output_tokens_per_s']:.1f} tok/s")
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        num_layers, hidden = llm.model.config.num_layers, llm.model.config.hidden_size
        llm.shutdown()
        del llm
    torch.set_num_threads(threads_before)
    by = results["by_config"]
    expected = by["ep1"]["token_ids"]
    for name in ("ep2_all_to_all", "ep2_all_gather"):
        assert by[name]["token_ids"] == expected, f"{name} changed EP=1's greedy tokens"
    same_as_dense = sum(
        a == b for a, b in zip(by["dense"]["token_ids"], expected, strict=True)
    ) / len(expected)
    for point in by.values():
        point.pop("token_ids")
    tokens = by["ep1"]["moe"]["expert_tokens"]
    results["num_layers"], results["hidden_size"] = num_layers, hidden
    a2a, ag = by["ep2_all_to_all"], by["ep2_all_gather"]
    results["modelled_rows_per_token_layer"] = {ep: modelled_rows_per_token(ep) for ep in (2, 4, 8)}
    summary = {
        "experts": EXPERTS,
        "top_k": TOP_K,
        "tokens_per_expert_max_over_mean": _balance(tokens),
        "tokens_per_expert_min_over_mean": min(tokens) / (sum(tokens) / len(tokens)),
        "bytes_per_layer_step_all_to_all": a2a["dispatch_combine_bytes_per_layer_step"],
        "bytes_per_layer_step_all_gather": ag["dispatch_combine_bytes_per_layer_step"],
        "bytes_per_layer_step_gather_back": a2a["gather_back_bytes_per_layer_step"],
        "bytes_ratio_all_gather_vs_all_to_all": ag["dispatch_combine_bytes_per_layer_step"]
        / a2a["dispatch_combine_bytes_per_layer_step"],
        "tokens_per_s_dense": by["dense"]["output_tokens_per_s"],
        "tokens_per_s_ep1": by["ep1"]["output_tokens_per_s"],
        "tokens_per_s_ep2_all_to_all": a2a["output_tokens_per_s"],
        "tokens_per_s_ep2_all_gather": ag["output_tokens_per_s"],
        "modelled_bytes_ratio_all_gather_vs_all_to_all_ep8": modelled_rows_per_token(8)[
            "all_gather"
        ]
        / modelled_rows_per_token(8)["all_to_all"],
        "share_of_requests_matching_dense_tokens": same_as_dense,
    }
    record = bench_record(
        stage=NAME,
        title="expert parallelism: tokens per expert, bytes per MoE layer, throughput by EP",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | base,
        model=f"{model_name} (MLP split into {EXPERTS} experts, top-{TOP_K}, untrained router)",
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, work: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(
        3, f"Stage 11 expert parallelism: {model_name}, {EXPERTS} experts, top-{TOP_K}"
    )
    by = results["by_config"]
    tokens = by["ep1"]["moe"]["expert_tokens"]
    owner = ["tab:blue"] * (EXPERTS // 2) + ["tab:orange"] * (EXPERTS - EXPERTS // 2)
    ax1.bar([str(e) for e in range(EXPERTS)], tokens, color=owner)
    ax1.axhline(sum(tokens) / len(tokens), color="k", ls="--", label="perfect balance")
    ax1.set_xlabel("expert (blue: rank 0's at EP=2, orange: rank 1's)")
    ax1.set_ylabel(f"(token, expert) pairs, summed over {results['num_layers']} layers")
    ax1.set_title(
        f"Load: busiest expert {summary['tokens_per_expert_max_over_mean']:.2f}x the mean\n"
        "(router derived from the weights, not trained)",
        fontsize=9,
    )
    ax1.legend(fontsize=7)
    methods = ["ep2_all_to_all", "ep2_all_gather"]
    labels = ["all-to-all", "all-gather /\nreduce-scatter"]
    moved = [by[m]["dispatch_combine_bytes_per_layer_step"] / 1024 for m in methods]
    back = [by[m]["gather_back_bytes_per_layer_step"] / 1024 for m in methods]
    ax2.bar(labels, moved, label="dispatch + combine")
    ax2.bar(labels, back, bottom=moved, color="tab:gray", label="gather-back (replicated attn)")
    ax2.set_ylabel("KiB sent between the 2 ranks per MoE layer per step")
    ax2.set_title(
        f"Bytes on the wire, EP=2, batch {work['batch']} (prefill + decode)\n"
        f"all-gather moves {summary['bytes_ratio_all_gather_vs_all_to_all']:.2f}x all-to-all's"
        f" (modelled at EP=8: "
        f"{summary['modelled_bytes_ratio_all_gather_vs_all_to_all_ep8']:.1f}x)",
        fontsize=9,
    )
    ax2.legend(fontsize=7)
    names = ["dense", "ep1", "ep2_all_to_all", "ep2_all_gather"]
    ticks = ["dense", "EP=1", "EP=2\nall-to-all", "EP=2\nall-gather"]
    ax3.bar(ticks, [by[n]["output_tokens_per_s"] for n in names], color="tab:green")
    ax3.set_ylabel("output tokens / s")
    ax3.set_title(
        f"Throughput, batch {work['batch']}, {work['max_tokens']} tokens each\n"
        f"{os.cpu_count()} cores shared by the ranks: no gain here",
        fontsize=9,
    )
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
