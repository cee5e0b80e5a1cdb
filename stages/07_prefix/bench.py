"""Stage 07 benchmark: what prefix caching does for requests that begin alike.

One process, the embedded model, two engines: prefix caching off (stage 06) and on.
1. Shared system prompt of 0 to 1,500 tokens, each request adding its own short question:
   - time to first token, one request at a time after a first request has met the prefix;
   - throughput of a batch of such requests submitted together, from a cold cache (every run
     uses a prefix no earlier run has seen).
2. A multi-turn chat: a few conversations with one system prompt, each turn sending the whole
   conversation so far; hit rate and time to first token per turn.
Both engines must produce identical tokens (asserted).

    python -m stages 07 bench [--quick]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results

from .llm import LLM
from .sampling import SamplingParams

NAME = "07_prefix"
MODES = {"caching off (stage 06)": False, "caching on": True}
HEADLINE_PREFIX = 1000  # the target: TTFT at least 3x lower with a 1,000-token shared prefix


def _log(message: str) -> None:
    print(f"[bench 07] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "prefix_tokens": [0, 128] if quick else [0, 250, 500, HEADLINE_PREFIX, 1500],
        "question_tokens": 24,
        "ttft_requests": 2 if quick else 4,
        "batch_requests": 3 if quick else 8,
        "output_tokens": 8 if quick else 16,
        "conversations": 2 if quick else 4,
        "turns": 2 if quick else 4,
        "chat_output_tokens": 8 if quick else 32,
    }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def shared_prefix_point(llm: LLM, prefix_len: int, work: dict[str, Any]) -> dict[str, Any]:
    """TTFT of requests sharing a prefix (after one request met it) and batch throughput."""
    rng = random.Random(prefix_len)  # the same prompts for both engines
    prefix = _tokens(rng, prefix_len)
    question = lambda: _tokens(rng, work["question_tokens"])
    params = _greedy(work["output_tokens"])
    first = llm.generate(prefix + question(), params)[0]  # meets the prefix
    ttft, hits, ids = [], [], [first.token_ids]
    for _ in range(work["ttft_requests"]):
        out = llm.generate(prefix + question(), params)[0]
        ttft.append(out.ttft * 1e3)
        hits.append(out.num_cached_tokens / len(out.prompt_token_ids))
        ids.append(out.token_ids)
    cold = _tokens(rng, prefix_len)  # a prefix never seen: the batch starts from a cold cache
    batch = [cold + question() for _ in range(work["batch_requests"])]
    started = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    ids += [o.token_ids for o in outs]
    return {
        "ttft_ms": sum(ttft) / len(ttft),
        "first_request_ttft_ms": first.ttft * 1e3,
        "hit_fraction": sum(hits) / len(hits),
        "batch_output_tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "batch_seconds": elapsed,
        "token_ids": ids,
    }


def multi_turn_chat(llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Conversations sharing a system prompt; each turn resends everything so far."""
    system = (
        "You are a patient tutor for a course on how LLM inference engines work. Answer in two "
        "or three short sentences, and end every answer with a question for the student."
    )
    topics = ["paged attention", "continuous batching", "chunked prefill", "prefix caching"]
    followups = ["Why does that help?", "Give an example.", "What does it cost?", "Summarise."]
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"What is {t}?"}]
        for t in topics[: work["conversations"]]
    ]
    turns = []
    params = _greedy(work["chat_output_tokens"])
    for turn in range(work["turns"]):
        outs = llm.chat(conversations, params)
        turns.append(
            {
                "hit_rate": sum(o.num_cached_tokens for o in outs)
                / sum(len(o.prompt_token_ids) for o in outs),
                "ttft_ms": sum(o.ttft for o in outs) / len(outs) * 1e3,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs) / len(outs),
                "token_ids": [o.token_ids for o in outs],
            }
        )
        for conversation, out in zip(conversations, outs, strict=True):
            conversation += [
                {"role": "assistant", "content": out.text},
                {"role": "user", "content": followups[turn % len(followups)]},
            ]
    return {"turns": turns, "aggregate_hit_rate": llm.prefix_cache_stats.hit_rate}


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_model_len": max(work["prefix_tokens"]) + 256}
    reset_peak_memory()
    results: dict[str, Any] = {}
    for label, caching in MODES.items():
        llm = LLM(**kwargs, **base, prefix_caching=caching)
        llm.generate([[101, 102]], _greedy(2))  # warm-up
        points = {}
        for prefix_len in work["prefix_tokens"]:
            points[prefix_len] = shared_prefix_point(llm, prefix_len, work)
            _log(f"{label}, prefix {prefix_len}: TTFT {points[prefix_len]['ttft_ms']:.0f} ms")
        chat = multi_turn_chat(llm, work)
        _log(f"{label}, chat: hit rate {chat['aggregate_hit_rate']:.2f}")
        results[label] = {
            "shared_prefix": points,
            "chat": chat,
            "config": {"prefix_caching": caching},
        }
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        del llm
    off, on = (results[label] for label in MODES)
    for prefix_len in work["prefix_tokens"]:
        same = off["shared_prefix"][prefix_len].pop("token_ids")
        assert same == on["shared_prefix"][prefix_len].pop("token_ids"), "caching changed tokens"
    for a, b in zip(off["chat"]["turns"], on["chat"]["turns"], strict=True):
        assert a.pop("token_ids") == b.pop("token_ids"), "caching changed a chat answer"
    longest = (
        HEADLINE_PREFIX if HEADLINE_PREFIX in work["prefix_tokens"] else max(work["prefix_tokens"])
    )
    headline_off, headline_on = off["shared_prefix"][longest], on["shared_prefix"][longest]
    chat_on = on["chat"]["turns"]
    summary = {
        "headline_prefix_tokens": longest,
        "ttft_ms_off": headline_off["ttft_ms"],
        "ttft_ms_on": headline_on["ttft_ms"],
        "ttft_ratio_off_vs_on": headline_off["ttft_ms"] / headline_on["ttft_ms"],
        "batch_tokens_per_s_off": headline_off["batch_output_tokens_per_s"],
        "batch_tokens_per_s_on": headline_on["batch_output_tokens_per_s"],
        "batch_throughput_ratio": headline_on["batch_output_tokens_per_s"]
        / headline_off["batch_output_tokens_per_s"],
        "hit_fraction_at_headline": headline_on["hit_fraction"],
        "chat_hit_rate_on": on["chat"]["aggregate_hit_rate"],
        "chat_last_turn_hit_rate_on": chat_on[-1]["hit_rate"],
        "chat_last_turn_ttft_ratio": off["chat"]["turns"][-1]["ttft_ms"] / chat_on[-1]["ttft_ms"],
    }
    record = bench_record(
        stage=NAME,
        title="prefix caching: time to first token and throughput with shared prompts",
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
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 07 prefix caching: {model_name}")
    colors = dict(zip(MODES, ("tab:red", "tab:blue"), strict=True))
    lengths = work["prefix_tokens"]
    for label in MODES:
        points = results[label]["shared_prefix"]
        ax1.plot(lengths, [points[n]["ttft_ms"] for n in lengths], "o-", color=colors[label],
                 label=label)  # fmt: skip
        ax2.plot(lengths, [points[n]["batch_output_tokens_per_s"] for n in lengths], "o-",
                 color=colors[label], label=label)  # fmt: skip
        turns = results[label]["chat"]["turns"]
        ax3.plot(range(1, len(turns) + 1), [t["ttft_ms"] for t in turns], "o-",
                 color=colors[label], label=f"TTFT, {label}")  # fmt: skip
    ax1.set_xlabel("shared prefix (tokens)")
    ax1.set_ylabel("time to first token (ms)")
    ax1.set_title(
        f"TTFT {summary['ttft_ratio_off_vs_on']:.1f}x lower at {summary['headline_prefix_tokens']}"
        " shared tokens",
        fontsize=9,
    )
    ax2.set_xlabel("shared prefix (tokens)")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title(
        f"Batch of {work['batch_requests']} from a cold cache: "
        f"{summary['batch_throughput_ratio']:.1f}x at {summary['headline_prefix_tokens']}",
        fontsize=9,
    )
    turns_on = results["caching on"]["chat"]["turns"]
    hit = ax3.twinx()
    hit.bar(range(1, len(turns_on) + 1), [t["hit_rate"] for t in turns_on], alpha=0.2,
            color="tab:blue", label="hit rate, caching on")  # fmt: skip
    hit.set_ylim(0, 1)
    hit.set_ylabel("prompt tokens served from the cache")
    ax3.set_xlabel("conversation turn")
    ax3.set_ylabel("time to first token (ms)")
    ax3.set_title(f"Multi-turn chat: hit rate {summary['chat_hit_rate_on']:.0%}", fontsize=9)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
