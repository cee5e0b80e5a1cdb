"""Stage 06 benchmark: what chunked prefill does for running decodes when long prompts arrive.

One process, one model. A few streams decode steadily; meanwhile long prompts (thousands of
tokens) arrive at fixed times. Without chunking each long prompt is prefilled whole in one step
and every running stream waits for it; with chunking the prompt is split under the step's token
budget and the streams keep getting a token every step. Recorded: every inter-token gap of the
running streams (over time, p50 and p99), the long prompts' time to first token (the cost of
chunking), and a sweep of the token budget (throughput against p99 inter-token latency: the
trade-off the budget sets).

Then the defaults (issue 14): one stream decodes while a 3,000-token prompt arrives, and every
gap the stream sees is recorded against the prompt's cached context. Four configurations in one
process, interleaved and repeated: the token budget before (512) and the device's default
(`devices.default_max_num_batched_tokens`), each with the CPU attention before (one masked SDPA
over context + new tokens, see `_one_masked_sdpa`) and now (`cpu_attention._prompt`). And the
cost of a decode step against the batch size, which sets the default `max_num_seqs`.

    python -m stages 06 bench [--quick]
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import default_max_num_batched_tokens, dtype_name, resolve_device
from stages.common.tooling.latency import (
    GreedyRequest,
    decode_step_ms,
    distribution,
    gaps_while_a_prompt_arrives,
    peak_memory,
    reset_peak_memory,
)
from stages.common.tooling.online import run_online
from stages.common.tooling.results import bench_record, new_figure, write_results

from . import cpu_attention, kernels
from .llm import LLM
from .sampling import SamplingParams

NAME = "06_chunked"
BUDGET = 256  # tokens per step with chunking: the headline comparison
SWEEP = (64, 128, 256, 512, 1024)
OLD_BUDGET = 512  # the default with chunked prefill before issue 14


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


def _one_masked_sdpa(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_context: torch.Tensor | None,
    v_context: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The CPU path before issue 14: one SDPA over context + new positions with an offset-causal
    mask and grouped heads (`enable_gqa`), which SDPA runs with unfused matmuls on a CPU."""
    if k_context is not None and v_context is not None:
        k_new, v_new = torch.cat([k_context, k_new]), torch.cat([v_context, v_new])
    return kernels._attend(q, k_new, v_new, scale)


@contextlib.contextmanager
def _attention(kind: str) -> Iterator[None]:
    """Run the CPU attention of prompts as it is ("new") or as it was ("old")."""
    current = cpu_attention._prompt
    if kind == "old":
        cpu_attention._prompt = _one_masked_sdpa
    try:
        yield
    finally:
        cpu_attention._prompt = current


def _greedy(llm: LLM) -> GreedyRequest:
    """(prompt ids, max_tokens) -> a greedy request of `llm`, for the step-cost probes."""
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return lambda ids, n: llm.make_request(ids, params(n), output_kind="final")


def run_defaults(kwargs: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Gap vs context for {old, new} budget x {old, new} attention, and decode step vs batch."""
    prompt_tokens, repeats = (600, 1) if quick else (3000, 3)
    # The device's default budget, passed explicitly (the comparison does not depend on the
    # engine's wiring), with seats for the decode sweep. Steps run synchronously, so that each
    # gap is one chunk's step (async overlap saves a few ms of host work per step).
    device = resolve_device(kwargs.get("device"))
    budget = default_max_num_batched_tokens(
        device, chunked_prefill=True, max_model_len=prompt_tokens + 256
    )
    probe = LLM(**kwargs, max_num_seqs=128, max_num_batched_tokens=budget, async_scheduling=False)
    old = LLM(**kwargs, max_num_batched_tokens=OLD_BUDGET, async_scheduling=False)
    engines = {OLD_BUDGET: old, budget: probe}
    for llm in engines.values():
        llm.generate([[101, 102]], SamplingParams(max_tokens=2))  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {}
    order = itertools.product(range(repeats), engines.items(), ("old", "new"))
    for seed, (_, (size, llm), kind) in enumerate(order):  # a new prompt every run
        label = f"budget {size}, {kind} attention"
        prompt = [100 + (j * 7919 + seed * 104729) % 9000 for j in range(prompt_tokens)]
        with _attention(kind):
            run = gaps_while_a_prompt_arrives(llm, _greedy(llm), prompt)
        runs.setdefault(label, []).append(run)
        _log(f"{label}: longest gap {run['max_gap_ms']:.0f} ms, TTFT {run['ttft_ms']:.0f} ms")
    decode = {}
    for batch in (1, 8) if quick else (1, 8, 32, 64, 128):
        decode[batch] = decode_step_ms(probe, _greedy(probe), batch, budget)
        _log(f"decode step at batch {batch}: {decode[batch]:.0f} ms")
    model_config = probe.model_config
    del probe, old, engines, llm
    return {
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "default_budget": budget,
        "runs": runs,
        "median_max_gap_ms": {
            k: statistics.median(r["max_gap_ms"] for r in v) for k, v in runs.items()
        },
        "median_ttft_ms": {k: statistics.median(r["ttft_ms"] for r in v) for k, v in runs.items()},
        "decode_step_ms_by_batch": decode,
        "attention_ms_per_layer": _attention_ms(model_config, prompt_tokens, repeats=7),
    }


def _attention_ms(model_config: Any, positions: int, repeats: int) -> dict[str, float]:
    """One layer's attention of a 512-token chunk (fewer for short prompts) at the end of
    `positions`, median ms: the CPU path before and now, and SDPA's fused kernel on contiguous
    [1, heads, positions, dim] tensors with the offset-causal mask (the yardstick)."""
    heads, kv_heads, dim = model_config.num_heads, model_config.num_kv_heads, model_config.head_dim
    new = min(512, positions // 2)
    q = torch.randn(new, heads, dim)
    k, v = torch.randn(positions, kv_heads, dim), torch.randn(positions, kv_heads, dim)
    args = (q, k[-new:], v[-new:], k[:-new], v[:-new], dim**-0.5)
    expand = lambda x: x.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None]
    qc, kc, vc = q.transpose(0, 1)[None].contiguous(), expand(k), expand(v)
    mask = torch.ones(new, positions, dtype=torch.bool).tril(positions - new)
    candidates = {
        "before: one masked SDPA, grouped heads": lambda: _one_masked_sdpa(*args),
        "now: cpu_attention._prompt": lambda: cpu_attention._prompt(*args),
        "SDPA on contiguous tensors, one mask": lambda: (
            torch.nn.functional.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=dim**-0.5
            )
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):  # interleaved, so a busy machine slows all of them alike
        for name, run in candidates.items():
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1e3)
    result = {name: statistics.median(t) for name, t in times.items()}
    _log(f"attention of {new} queries over {positions} positions: {result}")
    return result


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
    defaults = results["defaults"] = run_defaults(kwargs, quick)
    gap, ttft, new_budget = (
        defaults["median_max_gap_ms"],
        defaults["median_ttft_ms"],
        defaults["default_budget"],
    )
    before, after = f"budget {OLD_BUDGET}, old attention", f"budget {new_budget}, new attention"
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
        "long_prompt_tokens_defaults": defaults["prompt_tokens"],
        "max_gap_ms_before": gap[before],
        "max_gap_ms_new_attention": gap[f"budget {OLD_BUDGET}, new attention"],
        "max_gap_ms_after": gap[after],
        "ttft_ms_before": ttft[before],
        "ttft_ms_after": ttft[after],
        "default_budget_tokens": new_budget,
        "attention_ms_before": defaults["attention_ms_per_layer"][
            "before: one masked SDPA, grouped heads"
        ],
        "attention_ms_after": defaults["attention_ms_per_layer"]["now: cpu_attention._prompt"],
        "attention_ms_sdpa_contiguous": defaults["attention_ms_per_layer"][
            "SDPA on contiguous tensors, one mask"
        ],
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
    fig, axes = new_figure(2, f"Stage 06 chunked prefill: {model_name}", nrows=2)
    ax1, ax2, ax3, ax4 = axes
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
    _plot_defaults(ax4, results["defaults"])
    fig.tight_layout()
    return fig


def _plot_defaults(ax: Any, defaults: dict[str, Any]) -> None:
    """Gap vs cached context of the long prompt, one line per configuration (every repeat)."""
    styles = {"old": "--", "new": "-"}
    budgets = list(dict.fromkeys(label.split(", ")[0] for label in defaults["runs"]))
    for label, runs in defaults["runs"].items():
        budget, kind = label.split(", ")[0], label.split(", ")[1].split()[0]
        color = ["tab:red", "tab:blue"][budgets.index(budget) % 2]
        for i, run in enumerate(runs):
            ax.plot(
                [g["context"] for g in run["gaps"]],
                [g["gap_ms"] / 1e3 for g in run["gaps"]],
                styles[kind], color=color, alpha=0.7, marker=".",
                label=f"{label}: TTFT {defaults['median_ttft_ms'][label] / 1e3:.1f} s"
                if i == 0 else None,
            )  # fmt: skip
    ax.axhline(1.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel(f"cached tokens of the {defaults['prompt_tokens']:,}-token prompt")
    ax.set_ylabel("gap between a running stream's tokens (s)")
    ax.set_title("One stream while a long prompt arrives (every repeat)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
