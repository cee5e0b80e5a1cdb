"""Stage 05 benchmark: what overlapping the host's work with the model buys, measured.

One process, one model, one workload (nano-vllm's shape, all requests at t = 0, continuous
batching), the same engine with `async_scheduling` off and on, runs interleaved. Per step, the
host's work (scheduling, preparing inputs, detokenizing, stop checks) and the model's time
(forward + sampling, timed where it runs) are recorded, so the plot shows the split, the
fraction of the run the model sits idle, and the output tokens/s.

On a CPU the model and the host share the same two cores, so hiding the host's work behind the
model can only help as far as the model leaves a core free. On a GPU the model runs on the
device and the host on the CPU: the fourth panel models that case from the measured host time,
    step time (sync) = host + model,   step time (async) = max(host, model),
labelled as modelled, not measured.

    python -m stages 05 bench [--quick]
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory, summarize_outputs
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.workloads import ThroughputWorkload

from . import model_runner
from .llm import LLM
from .sampling import SamplingParams

NAME = "05_async"
MODES = {"sync (stage 04)": False, "async (overlap)": True}
REPEATS = 3


def _log(message: str) -> None:
    print(f"[bench 05] {message}", file=sys.stderr, flush=True)


def run_mode(llm: LLM, workload: ThroughputWorkload) -> dict[str, Any]:
    """Run the workload; time each step, the model's busy intervals and the host's waits."""
    model_busy: list[float] = []
    inline: list[float] = []  # model time spent on the engine's own thread (overlap off)
    waits: list[float] = []
    forward, result = llm.runner._forward_and_sample, model_runner.StepHandle.result

    def timed_forward(inputs: Any) -> Any:
        started = time.perf_counter()
        tokens = forward(inputs)
        if tokens.is_cuda:
            tokens.cpu()  # time the device work, not the launch
        model_busy.append(time.perf_counter() - started)
        if threading.current_thread() is threading.main_thread():  # run inside `launch`
            inline.append(model_busy[-1])
        return tokens

    def timed_result(handle: Any) -> Any:
        started = time.perf_counter()
        out = result(handle)
        waits.append(time.perf_counter() - started)
        return out

    llm.runner._forward_and_sample = timed_forward
    model_runner.StepHandle.result = timed_result
    try:
        requests = [
            llm.make_request(
                item.prompt_token_ids,
                SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True),
                output_kind="delta",
            )
            for item in workload.requests()
        ]
        started = time.perf_counter()
        for request in requests:
            request.arrival_time = started
            llm.add_request(request)
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
        wall = time.perf_counter() - started
    finally:
        del llm.runner._forward_and_sample
        model_runner.StepHandle.result = result
    # The main thread's time not spent on the model: neither waiting for the worker (overlap
    # on) nor running the forward itself (overlap off: the step runs inside `launch`).
    host = wall - sum(waits) - sum(inline)
    return {
        "metrics": summarize_outputs([r.final_output() for r in requests], wall),
        "steps": steps,
        "wall_s": wall,
        "model_s": sum(model_busy),
        "host_s": host,
        "host_ms_per_step": host / steps * 1e3,
        "model_ms_per_step": sum(model_busy) / len(model_busy) * 1e3,
        "model_idle_fraction": max(0.0, 1 - sum(model_busy) / wall),
        "token_ids": [r.output_token_ids for r in requests],
    }


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    workload = ThroughputWorkload(
        num_requests=8 if quick else 64,
        input_len=(16, 48) if quick else (16, 128),
        output_len=(4, 24) if quick else (8, 128),
    )
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_num_seqs": 4 if quick else 16, "max_model_len": 1024}
    reset_peak_memory()
    engines = {label: LLM(**kwargs, **base, async_scheduling=on) for label, on in MODES.items()}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in MODES}
    for attempt in range(1 if quick else REPEATS):  # interleaved: drift hits both alike
        for label, llm in engines.items():
            runs[label].append(run_mode(llm, workload))
            rate = runs[label][-1]["metrics"]["output_tokens_per_s"]
            _log(f"{label}, run {attempt + 1}: {rate:.1f} output tok/s")
    results: dict[str, Any] = {}
    for label in MODES:
        rates = [r["metrics"]["output_tokens_per_s"] for r in runs[label]]
        ordered = sorted(runs[label], key=lambda r: r["metrics"]["output_tokens_per_s"])
        results[label] = ordered[len(ordered) // 2] | {"output_tokens_per_s_all_runs": rates}
    sync, overlap = (results[label] for label in MODES)
    assert sync.pop("token_ids") == overlap.pop("token_ids"), "async changed the outputs"
    llm = next(iter(engines.values()))
    model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
    host_ms, model_ms = sync["host_ms_per_step"], sync["model_ms_per_step"]
    summary = {
        "output_tokens_per_s_sync": sync["metrics"]["output_tokens_per_s"],
        "output_tokens_per_s_async": overlap["metrics"]["output_tokens_per_s"],
        "speedup_async_vs_sync": overlap["metrics"]["output_tokens_per_s"]
        / sync["metrics"]["output_tokens_per_s"],
        "host_ms_per_step_sync": host_ms,
        "model_ms_per_step_sync": model_ms,
        "host_ms_per_step_async": overlap["host_ms_per_step"],
        "model_ms_per_step_async": overlap["model_ms_per_step"],
        "model_idle_fraction_sync": sync["model_idle_fraction"],
        "model_idle_fraction_async": overlap["model_idle_fraction"],
        "host_share_of_sync_step": host_ms / (host_ms + model_ms),
    }
    record = bench_record(
        stage=NAME,
        title="async scheduling: host/model overlap",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=workload.describe() | base | {"arrival": "all at t=0", "repeats": REPEATS},
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3, ax4) = new_figure(4, f"Stage 05 async scheduling: {model_name}")
    labels = list(MODES)
    colors = ["tab:red", "tab:blue"]
    host = [results[label]["host_ms_per_step"] for label in labels]
    model = [results[label]["model_ms_per_step"] for label in labels]
    ax1.bar(labels, model, color="tab:gray", label="model (forward + sample)")
    ax1.bar(labels, host, bottom=model, color="tab:orange", label="host work")
    ax1.set_ylabel("ms per step (async: host runs while the model does)")
    ax1.set_title("Where a step's time goes")
    ax1.legend(fontsize=8)
    idle = [100 * results[label]["model_idle_fraction"] for label in labels]
    ax2.bar(labels, idle, color=colors)
    ax2.set_ylabel("% of the run the model is idle")
    ax2.set_title("Model idle fraction")
    rates = [results[label]["metrics"]["output_tokens_per_s"] for label in labels]
    bars = ax3.bar(labels, rates, color=colors)
    for bar, value in zip(bars, rates, strict=True):
        ax3.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.0f}", ha="center", va="bottom")
    ax3.set_ylabel("output tokens / s")
    ax3.set_title(f"Throughput: async = {summary['speedup_async_vs_sync']:.2f}x sync")
    h = summary["host_ms_per_step_sync"]
    model_ms = [h * x / 10 for x in range(2, 201)]
    speedup = [(h + m) / max(h, m) for m in model_ms]
    ax4.plot(model_ms, speedup, color="black")
    ax4.axvline(summary["model_ms_per_step_sync"], color="tab:gray", linestyle=":")
    ax4.text(summary["model_ms_per_step_sync"], 1.02, " this CPU", fontsize=8)
    ax4.set_xscale("log")
    ax4.set_xlabel("model ms per step (a GPU: the device's time)")
    ax4.set_ylabel("speedup, (host + model) / max(host, model)")
    ax4.set_title(f"MODELLED, host = {h:.1f} ms/step as measured")
    ax4.grid(alpha=0.3)
    fig.tight_layout()
    return fig
