"""Stage 09 benchmark: what tensor parallelism costs and saves, measured on this machine.

The embedded model at TP=1 and TP=3 (its 9 heads, 3 KV heads, 1,536 MLP columns and 49,152-token
vocabulary all divide by 3; nothing divides by 2). Recorded per TP size:
1. the weight bytes each rank holds;
2. decode step latency at batch 1 and 8, and the time to first token of a 512-token prompt;
3. the collectives of one forward on rank 0: all-reduces and all-gathers, their bytes, and the
   share of the step rank 0 spends inside them (waiting for slower ranks included);
4. what shipping each step's scheduler output to the workers costs: the pipe writes the engine
   makes, against a gloo `broadcast_object_list` of the same bytes between two processes.
Every TP size must give TP=1's tokens (asserted). On a 2-core CPU three ranks share two cores,
so TP cannot be faster here: the plot shows that, and a modelled panel shows what changes on
NVLink GPUs (formula in the README; no GPU was measured).

    python -m stages 09 bench [--quick]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import dtype_name
from stages.common.tooling.comm_model import broadcast_seconds, modelled_step_ms
from stages.common.tooling.latency import peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results

from .llm import LLM
from .sampling import SamplingParams

NAME = "09_tp"
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


def _log(message: str) -> None:
    print(f"[bench 09] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "tp_sizes": [1, 3],
        "decode_tokens": 8 if quick else 48,
        "batch_sizes": [1, 8],
        "long_prompt_tokens": 128 if quick else 512,
        "repeats": 1 if quick else 3,
        "broadcast_rounds": 50 if quick else 500,
    }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Step latencies and, on rank 0, the collectives of the forwards that ran."""
    stats = llm.model.tp.stats
    greedy = SamplingParams(max_tokens=work["decode_tokens"], temperature=0, ignore_eos=True)
    result: dict[str, Any] = {"token_ids": {}}
    for batch in work["batch_sizes"]:
        itls, comm = [], []
        for _ in range(work["repeats"]):
            stats.reset()
            started = time.perf_counter()
            outs = llm.generate(PROMPTS[:batch], greedy)
            elapsed = time.perf_counter() - started
            decode = [(o.e2e_latency - o.ttft) / (len(o.token_ids) - 1) for o in outs]
            itls.append(1000 * sum(decode) / len(decode))
            comm.append(stats.snapshot() | {"elapsed_s": elapsed})
        result[f"itl_ms_batch{batch}"] = _median(itls)
        result[f"itl_ms_batch{batch}_runs"] = itls
        result[f"collectives_batch{batch}"] = comm[itls.index(_median(itls))]
        result["token_ids"][batch] = [o.token_ids for o in outs]
    long_prompt = list(range(1000, 1000 + work["long_prompt_tokens"]))
    ttfts = []
    for _ in range(work["repeats"]):
        out = llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        ttfts.append(1000 * out.ttft)  # prefix caching is off: each run prefills it all
    result["ttft_ms_long_prompt"] = _median(ttfts)
    result["ttft_ms_long_prompt_runs"] = ttfts
    return result


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_model_len": 1024, "prefix_caching": False}
    reset_peak_memory()
    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    results: dict[str, Any] = {"by_tp": {}}
    for tp in work["tp_sizes"]:
        # Every rank takes its share of the cores (the workers do it themselves).
        torch.set_num_threads(max(1, cores // tp))
        llm = LLM(**kwargs, **base, tensor_parallel_size=tp)
        llm.generate([[101, 102]], SamplingParams(max_tokens=2))  # warm-up
        point = measure(llm, work) | {
            "weight_bytes_per_rank": llm.weight_bytes(),
            "kv_heads_per_rank": int(llm.kv_cache.k.shape[3]),
            "threads_per_rank": torch.get_num_threads(),
        }
        point["send_per_step"] = llm.executor.send_stats() if tp > 1 else None
        results["by_tp"][tp] = point
        _log(
            f"TP={tp}: {point['weight_bytes_per_rank'] / 2**20:.0f} MiB/rank, "
            f"ITL b1 {point['itl_ms_batch1']:.1f} ms, b8 {point['itl_ms_batch8']:.1f} ms"
        )
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        llm.shutdown()
        del llm
    torch.set_num_threads(threads_before)
    single = results["by_tp"][1]
    expected = single["token_ids"]
    for tp, point in results["by_tp"].items():
        assert point.pop("token_ids") == expected, f"TP={tp} changed the greedy tokens"
    payload_bytes = results["by_tp"][max(work["tp_sizes"])]["send_per_step"]["bytes_per_send"]
    results["step_broadcast"] = {
        "pipe_send_us": results["by_tp"][max(work["tp_sizes"])]["send_per_step"]["us_per_send"],
        "gloo_broadcast_object_us": 1e6
        * broadcast_seconds(int(payload_bytes), work["broadcast_rounds"]),
        "payload_bytes": payload_bytes,
    }
    results["modelled_nvlink"] = {tp: modelled_step_ms(tp) for tp in (1, 2, 4, 8)}
    top = results["by_tp"][max(work["tp_sizes"])]
    summary = {
        "weight_mib_per_rank_tp1": single["weight_bytes_per_rank"] / 2**20,
        "weight_mib_per_rank_tp3": top["weight_bytes_per_rank"] / 2**20,
        "itl_ms_batch1_tp1": single["itl_ms_batch1"],
        "itl_ms_batch1_tp3": top["itl_ms_batch1"],
        "itl_ms_batch8_tp1": single["itl_ms_batch8"],
        "itl_ms_batch8_tp3": top["itl_ms_batch8"],
        "all_reduces_per_forward_tp3": top["collectives_batch1"]["all_reduce_calls"]
        / max(1, top["collectives_batch1"]["all_gather_calls"]),
        "collective_share_batch1_tp3": top["collectives_batch1"]["seconds"]
        / top["collectives_batch1"]["elapsed_s"],
        **{f"step_broadcast_{k}": v for k, v in results["step_broadcast"].items()},
    }
    record = bench_record(
        stage=NAME,
        title="tensor parallelism: memory per rank, step latency and collectives by TP size",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | base,
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, work: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 09 tensor parallelism: {model_name}")
    sizes = work["tp_sizes"]
    by_tp = results["by_tp"]
    mib = [by_tp[t]["weight_bytes_per_rank"] / 2**20 for t in sizes]
    ax1.bar([str(t) for t in sizes], mib, color="tab:blue", label="measured")
    ax1.plot([str(t) for t in sizes], [mib[0] / t for t in sizes], "k--", label="1/TP of TP=1")
    ax1.set_xlabel("tensor-parallel size")
    ax1.set_ylabel("weight MiB per rank")
    ax1.set_title("Each rank holds its shard", fontsize=9)
    ax1.legend(fontsize=7)
    width = 0.35
    for i, batch in enumerate(work["batch_sizes"]):
        itl = [by_tp[t][f"itl_ms_batch{batch}"] for t in sizes]
        share = [
            by_tp[t][f"collectives_batch{batch}"]["seconds"]
            / by_tp[t][f"collectives_batch{batch}"]["elapsed_s"]
            for t in sizes
        ]
        xs = [j + (i - 0.5) * width for j in range(len(sizes))]
        ax2.bar(xs, itl, width, label=f"batch {batch}", alpha=0.8)
        ax2.bar(
            xs,
            [v * s for v, s in zip(itl, share, strict=True)],
            width,
            color="black",
            alpha=0.35,
            label="in collectives" if i == 0 else None,
        )
    ax2.set_xticks(range(len(sizes)), [str(t) for t in sizes])
    ax2.set_xlabel("tensor-parallel size")
    ax2.set_ylabel("decode step (ms per token)")
    top = by_tp[sizes[-1]]["collectives_batch1"]
    forwards = max(1, top["all_gather_calls"])
    ax2.set_title(
        f"{os.cpu_count()} cores shared by the ranks: no gain here\n"
        f"TP={sizes[-1]}: {top['all_reduce_calls'] / forwards:.0f} all-reduces + 1 all-gather "
        f"per forward, {top['all_reduce_bytes'] / forwards / 1024:.0f} KiB reduced (batch 1)",
        fontsize=9,
    )
    ax2.legend(fontsize=7)
    modelled = results["modelled_nvlink"]
    tps = sorted(modelled)
    ax3.bar([str(t) for t in tps], [modelled[t]["weights_ms"] for t in tps], label="read weights")
    ax3.bar(
        [str(t) for t in tps],
        [modelled[t]["all_reduce_ms"] for t in tps],
        bottom=[modelled[t]["weights_ms"] for t in tps],
        label="all-reduces",
    )
    for i, t in enumerate(tps):
        if not modelled[t]["fits_in_gpu_memory"]:
            ax3.text(
                i,
                modelled[t]["step_ms"] / 2,
                "does not fit\none 80 GB GPU",
                ha="center",
                fontsize=7,
                color="white",
            )
    ax3.set_xlabel("tensor-parallel size")
    ax3.set_ylabel("decode step, batch 8 (ms), MODELLED")
    ax3.set_title("Modelled: Llama-3-70B, bf16, H100 NVLink", fontsize=9)
    ax3.legend(fontsize=7)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
