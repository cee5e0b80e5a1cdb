"""Stage 01 benchmark: what the KV cache saves, and why decode is memory-bound.

All in one process, on one model and dtype:
1. time per generated token vs its position, with the KV cache and without it (recompute);
2. prefill tokens/s across prompt lengths vs decode tokens/s;
3. batch-1 greedy decode tokens/s of this engine vs transformers' `generate` on the same
   weights, prompt and dtype, against the memory-bandwidth roofline. The engine runs twice:
   with its default CPU matmul (oneDNN, weights prepacked) and with plain `F.linear`, the
   matmul transformers uses, so the plot separates the two sources of the gap.

    python -m stages 01 bench [--quick]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stages.common.devices import dtype_name
from stages.common.tooling.hardware import measure_memory_bandwidth
from stages.common.tooling.hf_oracle import load_hf_model
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.workloads import SAMPLE_QUESTIONS

from .llm import LLM
from .request import RequestOutput
from .sampling import SamplingParams

NAME = "01_naive"


def _log(message: str) -> None:
    print(f"[bench 01] {message}", file=sys.stderr, flush=True)


def decode_rate(token_times: list[float]) -> float:
    """Decode tokens/s from the timestamps of consecutive tokens (prefill excluded)."""
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def _hf_token_times(hf_model: Any, prompt_ids: list[int], num_tokens: int) -> list[float]:
    """Timestamps at which transformers' greedy `generate` produced each token."""
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:  # the first call carries the prompt, not a new token
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    streamer = TimingStreamer()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            streamer=streamer,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return streamer.times


def _per_token_ms(output: RequestOutput) -> list[float]:
    return [gap * 1e3 for gap in output.itl]


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    gen_tokens = 24 if quick else 256
    hf_tokens = 16 if quick else 128
    repeats = 1 if quick else 5
    prefill_lengths = [16, 64] if quick else [16, 32, 64, 128, 256, 512, 1024]

    _log("loading the engine (with and without KV cache) and the transformers reference")
    kwargs = {} if model is None else {"model": model}
    llm = LLM(**kwargs)
    recompute = LLM(**kwargs, use_kv_cache=False)
    plain = LLM(**kwargs, linear_backend="torch")  # transformers' matmul path
    hf = load_hf_model(llm.model_path, llm.dtype)
    prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": SAMPLE_QUESTIONS[5]}])
    greedy = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)

    _log(f"1/3 decoding {gen_tokens} tokens with and without the KV cache")
    cached = llm.generate([prompt_ids], greedy)[0]
    uncached = recompute.generate([prompt_ids], greedy)[0]
    assert cached.token_ids == uncached.token_ids, "recompute must produce the same tokens"

    _log(f"2/3 prefill throughput at prompt lengths {prefill_lengths}")
    rng = random.Random(0)
    prefill: dict[int, float] = {}
    for length in prefill_lengths:
        ids = [rng.randrange(100, 10_000) for _ in range(length)]
        one = SamplingParams(max_tokens=1, temperature=0)
        times = [llm.generate([ids], one)[0].ttft for _ in range(repeats)]
        prefill[length] = length / statistics.median(times)

    _log(
        f"3/3 batch-1 decode, engine vs transformers generate ({hf_tokens} tokens, "
        f"{repeats} interleaved runs each)"
    )
    fair = SamplingParams(max_tokens=hf_tokens, temperature=0, ignore_eos=True)
    ours, ours_plain, theirs = [], [], []
    for engine in (llm, plain):  # warm-up
        engine.generate([prompt_ids], SamplingParams(max_tokens=4, temperature=0))
    _hf_token_times(hf, prompt_ids, 4)
    for _ in range(repeats):
        ours.append(decode_rate(llm.generate([prompt_ids], fair)[0].token_times))
        ours_plain.append(decode_rate(plain.generate([prompt_ids], fair)[0].token_times))
        theirs.append(decode_rate(_hf_token_times(hf, prompt_ids, hf_tokens)))
    engine_rate, hf_rate = statistics.median(ours), statistics.median(theirs)
    plain_rate = statistics.median(ours_plain)
    bandwidth = measure_memory_bandwidth()
    weight_bytes = llm.weight_bytes()
    roofline = bandwidth * 1e9 / weight_bytes
    decode_now = decode_rate(cached.token_times)

    positions = [len(prompt_ids) + i + 1 for i in range(len(cached.itl))]
    summary = {
        "decode_tokens_per_s_engine": engine_rate,
        "decode_tokens_per_s_hf_generate": hf_rate,
        "speedup_vs_hf_generate": engine_rate / hf_rate,
        "linear_backend_engine": llm.linear_backend,
        "decode_tokens_per_s_engine_plain_linear": plain_rate,
        "speedup_vs_hf_generate_same_matmul": plain_rate / hf_rate,
        "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": engine_rate / roofline,
        "memory_bandwidth_gb_s": bandwidth,
        "weight_bytes_per_token": weight_bytes,
        "ms_per_token_at_last_position_cached": _per_token_ms(cached)[-1],
        "ms_per_token_at_last_position_recompute": _per_token_ms(uncached)[-1],
        "recompute_slowdown_at_last_position": _per_token_ms(uncached)[-1]
        / _per_token_ms(cached)[-1],
        "prefill_tokens_per_s_longest": prefill[prefill_lengths[-1]],
        "prefill_vs_decode_throughput_ratio": prefill[prefill_lengths[-1]] / decode_now,
    }
    results = {
        "per_token_ms_cached": _per_token_ms(cached),
        "per_token_ms_recompute": _per_token_ms(uncached),
        "positions": positions,
        "prefill_tokens_per_s": {str(k): v for k, v in prefill.items()},
        "decode_tokens_per_s_runs_engine": ours,
        "decode_tokens_per_s_runs_engine_plain_linear": ours_plain,
        "decode_tokens_per_s_runs_hf_generate": theirs,
        "total_s_cached": cached.e2e_latency,
        "total_s_recompute": uncached.e2e_latency,
    }
    workload = {
        "prompt": SAMPLE_QUESTIONS[5],
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": gen_tokens,
        "hf_comparison_tokens": hf_tokens,
        "repeats": repeats,
        "prefill_lengths": prefill_lengths,
        "sampling": "greedy, ignore_eos",
    }
    record = bench_record(
        stage=NAME,
        title="KV cache, prefill vs decode, engine vs HF",
        summary=summary,
        results=results,
        workload=workload,
        model=llm.model_name,
        dtype=dtype_name(llm.dtype),
        device=str(llm.device),
        quick=quick,
    )
    figure = _plot(summary, results, prefill, decode_now, llm)
    path = write_results(NAME, record, figure, out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(
    summary: dict, results: dict, prefill: dict[int, float], decode_now: float, llm: LLM
) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(
        3, f"Stage 01 naive: {llm.model_name}, {dtype_name(llm.dtype)}, batch 1"
    )
    positions = results["positions"]
    ax1.plot(
        positions,
        results["per_token_ms_recompute"],
        label="no KV cache (recompute all)",
        color="tab:red",
    )
    ax1.plot(positions, results["per_token_ms_cached"], label="KV cache", color="tab:blue")
    ax1.set_xlabel("position of the generated token")
    ax1.set_ylabel("time for this token (ms)")
    ax1.set_title("Cost per token grows without a cache")
    ax1.legend()
    ax1.grid(alpha=0.3)

    lengths = sorted(prefill)
    ax2.plot(lengths, [prefill[n] for n in lengths], marker="o", label="prefill (whole prompt)")
    ax2.axhline(
        decode_now,
        color="tab:orange",
        linestyle="--",
        label=f"decode, batch 1 ({decode_now:.1f} tok/s)",
    )
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(lengths, [str(n) for n in lengths])
    ax2.set_ylim(0, None)
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("tokens / s")
    ax2.set_title("Prefill is compute-bound, decode memory-bound")
    ax2.legend()
    ax2.grid(alpha=0.3, which="both")

    names = ["transformers\ngenerate", "engine,\nF.linear", f"engine,\n{llm.linear_backend}"]
    values = [
        summary["decode_tokens_per_s_hf_generate"],
        summary["decode_tokens_per_s_engine_plain_linear"],
        summary["decode_tokens_per_s_engine"],
    ]
    bars = ax3.bar(names, values, color=["tab:gray", "tab:cyan", "tab:blue"])
    for bar, value in zip(bars, values, strict=True):
        ax3.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.1f}", ha="center", va="bottom")
    ax3.axhline(
        summary["roofline_tokens_per_s"],
        color="black",
        linestyle=":",
        label=f"roofline {summary['roofline_tokens_per_s']:.0f} tok/s "
        f"({summary['memory_bandwidth_gb_s']:.0f} GB/s / "
        f"{summary['weight_bytes_per_token'] / 1e6:.0f} MB)",
    )
    ax3.set_ylabel("decode tokens / s (batch 1, greedy)")
    ax3.set_title(f"{summary['speedup_vs_hf_generate']:.2f}x transformers generate")
    ax3.legend(loc="upper left")
    ax3.set_ylim(0, summary["roofline_tokens_per_s"] * 1.15)
    fig.tight_layout()
    return fig
