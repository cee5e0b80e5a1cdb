"""Stage 15 benchmark: what each technique adds on one workload, and the engine beside
transformers' `generate`, on this machine.

1. Waterfall. One chat workload (requests sharing a long system prompt, each a different
   question, a fixed answer length, all submitted at once) run by one engine per row, each row
   the previous one plus one technique: a static batch over contiguous KV (stage 03's first
   half), then paged KV, continuous batching, async scheduling, chunked prefill, prefix
   caching, n-gram speculation, and the default weight format (quantization="auto": INT4-asym
   g32 with bf16 activations where the CPU and the checkpoint allow, quant/auto.py). Recorded
   per row: wall time, output tokens/s, TTFT p50 and p99, and whether the greedy tokens equal
   the first row's (every exact technique must keep them; the auto format may change them
   within its KL bound, and says so).
   Not in the waterfall: tensor, data and expert parallelism, the host tier and
   disaggregation. On 2 shared cores they divide the same CPU and only cost (their stages'
   benches measure that); they pay on several devices.
2. Peers, on the same prompts, greedy, the same answer length: transformers' `generate` (one
   left-padded batch, the same fp32 weights), and llama.cpp through llama-cpp-python when it
   is installed (README: how). llama.cpp runs the embedded model's own file, the Q4_1 GGUF the
   engine's weights are dequantized from, with its quantized kernels, one sequence at a time
   (`Llama.generate` has no batch); it is left out, and the record says so, when
   `llama_cpp` does not import.

    python -m stages 15 bench [--quick]
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from stages.common.tooling.hf_oracle import load_hf_model
from stages.common.tooling.latency import distribution
from stages.common.tooling.results import bench_record, new_figure, write_results
from stages.common.tooling.workloads import SAMPLE_QUESTIONS
from stages.common.weights import embedded_gguf_path, resolve_model

from .llm import LLM
from .sampling import SamplingParams

NAME = "15_full"
SYSTEM = (
    "You are a patient teacher. Answer in plain words, in at most three short sentences, "
    "and give one example when it helps. Never invent facts; say when you do not know. "
)
# Each row: its label and the switches it adds to the row before it.
WATERFALL: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "static batch, contiguous KV",
        {
            "kv_layout": "contiguous",
            "scheduling": "static",
            "async_scheduling": False,
            "chunked_prefill": False,
            "prefix_caching": False,
            "quantization": "none",
        },
    ),
    ("+ paged KV (03)", {"kv_layout": "paged"}),
    ("+ continuous batching (04)", {"scheduling": "continuous"}),
    ("+ async scheduling (05)", {"async_scheduling": True}),
    ("+ chunked prefill (06)", {"chunked_prefill": True}),
    ("+ prefix caching (07)", {"prefix_caching": True}),
    ("+ n-gram speculation (08)", {"speculative": "ngram"}),
    ("+ auto weight format (14, 15)", {"quantization": "auto"}),
)
LOSSY = {"quantization"}


def _log(message: str) -> None:
    print(f"[bench 15] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "requests": 2 if quick else 16,  # quick: that it runs, not what it measures
        "system_repeats": 1 if quick else 6,  # the shared prefix: ~50 tokens per repeat
        "output_tokens": 8 if quick else 48,
        "max_model_len": 1024,
        "kv_cache_bytes": 2**27 if quick else 3 * 2**27,  # fp32 SmolLM2: ~8,700 tokens
    }


def _prompts(llm: LLM, work: dict[str, Any]) -> list[list[int]]:
    system = SYSTEM * work["system_repeats"]
    questions = [
        SAMPLE_QUESTIONS[i % len(SAMPLE_QUESTIONS)] + f" (#{i})" for i in range(work["requests"])
    ]
    return [
        llm.tokenizer.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        for question in questions
    ]


def _run_row(model: str | None, config: dict[str, Any], prompts: list[list[int]], n: int) -> dict:
    llm = LLM(**({} if model is None else {"model": model}), **config)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm
    if config.get("prefix_caching"):
        llm.generate(prompts[:1], params)  # the shared system prompt is cached, as in service
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_ms": distribution(o.ttft * 1e3 for o in outputs),
        "token_ids": [o.token_ids for o in outputs],
    }


@torch.inference_mode()
def _transformers(model: str | None, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """transformers' generate: one left-padded batch, greedy, exactly n new tokens each."""
    hf = load_hf_model(resolve_model(model))
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    hf.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, **kwargs)  # warm
    started = time.perf_counter()
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=pad,
        **kwargs,
    )
    wall = time.perf_counter() - started
    tokens = int(out[:, width:].numel())
    return {"wall_s": wall, "tokens_per_s": tokens / wall, "batch": len(prompts)}


def _llama_cpp(model: str | None, prompts: list[list[int]], n: int) -> dict[str, Any] | None:
    """llama.cpp on the embedded model's GGUF: each prompt in turn, greedy, exactly n tokens.
    None (and why, logged) when llama-cpp-python is not installed or the model is not the
    embedded one (its GGUF is the only file here llama.cpp can read)."""
    if importlib.util.find_spec("llama_cpp") is None:
        _log("llama.cpp: left out (pip install llama-cpp-python; README, 'Measured')")
        return None
    if model is not None:
        _log("llama.cpp: left out (it reads the embedded model's GGUF only)")
        return None
    try:
        from llama_cpp import Llama
    except ImportError as exc:  # installed without its dependencies, say
        _log(f"llama.cpp: left out ({exc})")
        return None
    threads = os.cpu_count() or 1
    llama = Llama(str(embedded_gguf_path()), n_ctx=2048, n_threads=threads, verbose=False)
    first = []
    for token in llama.generate(prompts[0], top_k=1, temp=0.0, repeat_penalty=1.0):  # warm
        first.append(token)
        if len(first) == 2:
            break
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for prompt in prompts:
        tokens: list[int] = []
        for token in llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            tokens.append(token)
            if len(tokens) == n:
                break
        outputs.append(tokens)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "tokens_per_s": sum(map(len, outputs)) / wall,
        "batch": 1,
        "threads": threads,
        "weights": "Q4_1 (the embedded GGUF)",
        "token_ids": outputs,
    }


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    base = {"max_model_len": work["max_model_len"], "kv_cache_bytes": work["kv_cache_bytes"]}
    probe = LLM(**({} if model is None else {"model": model}), kv_cache_bytes=2**24)
    prompts, model_name = _prompts(probe, work), probe.model_name
    del probe
    rows: dict[str, Any] = {}
    config = dict(base)
    for label, switches in WATERFALL:
        config |= switches
        rows[label] = _run_row(model, config, prompts, work["output_tokens"])
        first = next(iter(rows.values()))["token_ids"]
        rows[label]["same_tokens_as_first_row"] = rows[label]["token_ids"] == first
        rows[label]["exact"] = not any(config.get(key) not in (None, "none") for key in LOSSY)
        if rows[label]["exact"]:  # an exact technique must not change a greedy token
            assert rows[label]["same_tokens_as_first_row"], f"{label} changed greedy tokens"
        _log(
            f"{label}: {rows[label]['tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {rows[label]['ttft_ms']['p50']:.0f} ms"
        )
    first_tokens = next(iter(rows.values()))["token_ids"]
    for row in rows.values():
        row.pop("token_ids")
    peer = _transformers(model, prompts, work["output_tokens"])
    _log(f"transformers generate (batch {peer['batch']}): {peer['tokens_per_s']:.1f} tok/s")
    llama = _llama_cpp(model, prompts, work["output_tokens"])
    if llama is not None:  # Q4_1 arithmetic: how many answers match the fp32 engine's
        same = [a == b for a, b in zip(llama.pop("token_ids"), first_tokens, strict=True)]
        llama["answers_equal_to_the_engine"] = f"{sum(same)} of {len(same)}"
        _log(f"llama.cpp (one sequence at a time): {llama['tokens_per_s']:.1f} tok/s")
    labels = list(rows)
    exact_best = max((r for r in rows.values() if r["exact"]), key=lambda r: r["tokens_per_s"])
    summary = {
        "tokens_per_s_first_row": rows[labels[0]]["tokens_per_s"],
        "tokens_per_s_best_exact_row": exact_best["tokens_per_s"],
        "speedup_best_exact_vs_first_row": exact_best["tokens_per_s"]
        / rows[labels[0]]["tokens_per_s"],
        "ttft_p50_ms_first_row": rows[labels[0]]["ttft_ms"]["p50"],
        "ttft_p50_ms_prefix_row": rows["+ prefix caching (07)"]["ttft_ms"]["p50"],
        "tokens_per_s_transformers_generate": peer["tokens_per_s"],
        "engine_vs_transformers": exact_best["tokens_per_s"] / peer["tokens_per_s"],
    }
    if llama is not None:
        summary["tokens_per_s_llama_cpp"] = llama["tokens_per_s"]
    results = {"waterfall": rows, "transformers_generate": peer, "llama_cpp": llama}
    record = bench_record(
        stage=NAME,
        title="The full engine: each technique's contribution on one chat workload",
        summary=summary,
        results=results,
        workload=work | {"prompt_tokens": [len(p) for p in prompts], "order": labels},
        model=model_name,
        dtype="float32",
        device="cpu",
        quick=quick,
    )
    path = write_results(NAME, record, _plot(rows, peer, llama, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(
    rows: dict[str, Any],
    peer: dict[str, Any],
    llama: dict[str, Any] | None,
    work: dict[str, Any],
    model: str,
) -> Any:
    fig, (ax1, ax2) = new_figure(2, f"Stage 15 the full engine: {model}")
    labels = [*rows, f"transformers generate (batch {peer['batch']})"]
    speeds = [r["tokens_per_s"] for r in rows.values()] + [peer["tokens_per_s"]]
    if llama is not None:
        labels.append("llama.cpp, Q4_1, one at a time")
        speeds.append(llama["tokens_per_s"])
    colors = ["tab:blue"] * len(rows) + ["tab:gray"] * (len(labels) - len(rows))
    ax1.barh(labels[::-1], speeds[::-1], color=colors[::-1])
    for y, value in enumerate(speeds[::-1]):
        ax1.text(value, y, f" {value:.0f}", va="center", fontsize=7)
    ax1.set_xlabel("output tokens/s (higher is better)")
    ax1.set_title(
        f"{work['requests']} chats, one shared system prompt, {work['output_tokens']} tokens "
        "each; each row adds one technique",
        fontsize=9,
    )
    ttft = [r["ttft_ms"]["p50"] for r in rows.values()]
    ax2.barh(list(rows)[::-1], ttft[::-1], color="tab:orange")
    for y, value in enumerate(ttft[::-1]):
        ax2.text(value, y, f" {value:.0f}", va="center", fontsize=7)
    ax2.set_xlabel("TTFT p50 (ms, lower is better)")
    ax2.set_title("time to first token, all requests submitted at once", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig
