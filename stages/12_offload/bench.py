"""Stage 12 benchmark: a host tier behind a device KV pool that is too small, on this machine.

One process, the embedded model, a device pool sized well below the workload's working set.
1. A burst of requests whose KV at their longest is about three times the device pool:
   recompute preemption (stage 11), swap preemption to the host tier, and a pool with room
   (no pressure). Recorded: total time, preemptions, tokens computed more than once (the tokens
   the forwards ran minus the unpressured run's), tokens swapped back in.
2. A multi-turn chat: conversations that take turns, each turn resending the whole conversation,
   whose KV together exceed the device pool: by its next turn a conversation's blocks were
   evicted. Device tier only vs device + host tier: hit rate (prompt tokens served from a cache,
   device or host) and time to first token per turn.
Every mode must produce the same tokens (asserted).

    python -m stages 12 bench [--quick]
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

NAME = "12_offload"
BLOCK = 16
BURST_MODES = {
    "recompute (stage 11)": {"preemption_mode": "recompute"},
    "swap to host": {"preemption_mode": "swap"},
    "no pressure": {},
}
CHAT_MODES = {"device tier only": False, "device + host tier": True}


def _log(message: str) -> None:
    print(f"[bench 12] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "burst_requests": 6 if quick else 16,
        "burst_prompt_tokens": 32 if quick else 128,
        "burst_output_tokens": 48 if quick else 128,
        "burst_device_fraction": 0.35,  # the device pool holds this share of the burst's KV
        "conversations": 3 if quick else 6,
        "turns": 2 if quick else 4,
        "first_turn_tokens": 96 if quick else 200,
        "user_tokens": 24 if quick else 32,
        "answer_tokens": 8 if quick else 32,
        "chat_device_conversations": 1.5,  # the device pool holds this many whole conversations
        "host_bytes": 2**29 if not quick else 2**27,
    }


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _counting(llm: LLM) -> list[int]:
    """Count the tokens every step's forward runs (into the returned one-item list)."""
    total, schedule = [0], llm.scheduler.schedule

    def counted():  # type: ignore[no-untyped-def]
        output = schedule()
        total[0] += output.num_tokens
        return output

    llm.scheduler.schedule = counted  # type: ignore[method-assign]
    return total


def burst(llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Every request submitted at once; the device pool cannot hold them all."""
    rng = random.Random(0)
    prompts = [_tokens(rng, work["burst_prompt_tokens"]) for _ in range(work["burst_requests"])]
    computed = _counting(llm)
    preempted, swapped = llm.scheduler.num_preemptions, llm.scheduler.num_swapped_out
    loaded = llm.kv_connector.stats.tokens_loaded if llm.kv_connector else 0
    started = time.perf_counter()
    outs = llm.generate(prompts, _greedy(work["burst_output_tokens"]))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
        "computed_tokens": computed[0],
        "preemptions": llm.scheduler.num_preemptions - preempted,
        "swapped_out": llm.scheduler.num_swapped_out - swapped,
        "tokens_swapped_in": (llm.kv_connector.stats.tokens_loaded if llm.kv_connector else 0)
        - loaded,
        "token_ids": [o.token_ids for o in outs],
    }


def multi_turn_chat(llm: LLM, work: dict[str, Any]) -> dict[str, Any]:
    """Conversations take turns, one request at a time; each turn resends the conversation."""
    rng = random.Random(1)
    histories = [_tokens(rng, work["first_turn_tokens"]) for _ in range(work["conversations"])]
    turns = []
    for _ in range(work["turns"]):
        hits, prompt_tokens, ttft, ids = 0, 0, [], []
        for history in histories:
            out = llm.generate([history], _greedy(work["answer_tokens"]))[0]
            hits += out.num_cached_tokens
            prompt_tokens += len(out.prompt_token_ids)
            ttft.append(out.ttft * 1e3)
            ids.append(out.token_ids)
            history += [*out.token_ids, *_tokens(rng, work["user_tokens"])]
        turns.append(
            {
                "hit_rate": hits / prompt_tokens,
                "ttft_ms": sum(ttft) / len(ttft),
                "prompt_tokens": prompt_tokens / len(histories),
                "token_ids": ids,
            }
        )
    later = turns[1:]  # the first turn meets nothing cached, in either mode
    return {
        "turns": turns,
        "later_turns_hit_rate": sum(t["hit_rate"] for t in later) / len(later),
        "later_turns_ttft_ms": sum(t["ttft_ms"] for t in later) / len(later),
    }


def _bytes_per_token(llm: LLM) -> int:
    k = llm.kv_cache.k
    return 2 * k[:, 0].numel() * k.element_size() // llm.block_size


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    probe = LLM(**kwargs, block_size=BLOCK, kv_cache_bytes=2**24, max_num_seqs=1)
    per_token = _bytes_per_token(probe)
    model_name, dtype, device = probe.model_name, dtype_name(probe.dtype), str(probe.device)
    del probe
    burst_tokens = work["burst_requests"] * (
        work["burst_prompt_tokens"] + work["burst_output_tokens"]
    )
    chat_tokens = work["first_turn_tokens"] + work["turns"] * (
        work["answer_tokens"] + work["user_tokens"]
    )
    base = {"block_size": BLOCK, "max_model_len": 2048, "max_num_seqs": work["burst_requests"]}
    device_bytes = {
        "burst": int(burst_tokens * work["burst_device_fraction"]) * per_token,
        "chat": int(chat_tokens * work["chat_device_conversations"]) * per_token,
    }
    reset_peak_memory()
    results: dict[str, Any] = {"burst": {}, "chat": {}}
    for label, switches in BURST_MODES.items():
        pool = device_bytes["burst"] if switches else 2 * burst_tokens * per_token
        offload = work["host_bytes"] if switches.get("preemption_mode") == "swap" else 0
        llm = LLM(**kwargs, **base, kv_cache_bytes=pool, kv_offload_bytes=offload, **switches)
        llm.generate([[101, 102]], _greedy(2))  # warm-up
        results["burst"][label] = burst(llm, work) | {"kv_cache_bytes": pool}
        point = results["burst"][label]
        _log(f"burst, {label}: {point['seconds']:.1f} s, {point['preemptions']} preemptions")
        del llm
    for label, host in CHAT_MODES.items():
        offload = work["host_bytes"] if host else 0
        llm = LLM(**kwargs, **base, kv_cache_bytes=device_bytes["chat"], kv_offload_bytes=offload)
        llm.generate([[101, 102]], _greedy(2))
        results["chat"][label] = multi_turn_chat(llm, work)
        _log(f"chat, {label}: hit rate {results['chat'][label]['later_turns_hit_rate']:.2f}")
        del llm
    recompute, swap, roomy = (results["burst"][label] for label in BURST_MODES)
    expected = roomy.pop("token_ids")
    assert recompute.pop("token_ids") == expected, "recompute preemption changed tokens"
    assert swap.pop("token_ids") == expected, "swap preemption changed tokens"
    off, on = (results["chat"][label] for label in CHAT_MODES)
    for a, b in zip(off["turns"], on["turns"], strict=True):
        assert a.pop("token_ids") == b.pop("token_ids"), "the host tier changed a chat answer"
    summary = {
        "burst_seconds_recompute": recompute["seconds"],
        "burst_seconds_swap": swap["seconds"],
        "burst_seconds_no_pressure": roomy["seconds"],
        "burst_speedup_swap_vs_recompute": recompute["seconds"] / swap["seconds"],
        "recomputed_tokens_recompute": recompute["computed_tokens"] - roomy["computed_tokens"],
        "recomputed_tokens_swap": swap["computed_tokens"] - roomy["computed_tokens"],
        "tokens_swapped_in": swap["tokens_swapped_in"],
        "preemptions_recompute": recompute["preemptions"],
        "preemptions_swap": swap["preemptions"],
        "chat_hit_rate_device_only": off["later_turns_hit_rate"],
        "chat_hit_rate_with_host": on["later_turns_hit_rate"],
        "chat_ttft_ms_device_only": off["later_turns_ttft_ms"],
        "chat_ttft_ms_with_host": on["later_turns_ttft_ms"],
        "chat_ttft_ratio_device_only_vs_host": off["later_turns_ttft_ms"]
        / on["later_turns_ttft_ms"],
    }
    record = bench_record(
        stage=NAME,
        title="KV offloading: swap preemption and a host prefix tier behind a small device pool",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | base | {"device_bytes": device_bytes, "kv_bytes_per_token": per_token},
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, work: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 12 KV offloading: {model_name}")
    labels = list(BURST_MODES)
    colors = ("tab:red", "tab:blue", "tab:gray")
    burst_points = [results["burst"][label] for label in labels]
    ax1.bar(labels, [p["seconds"] for p in burst_points], color=colors)
    ax1.set_ylabel("burst total time (s)")
    ax1.set_title(
        f"Burst of {work['burst_requests']} requests, device pool ~"
        f"{work['burst_device_fraction']:.0%} of their KV: swap "
        f"{summary['burst_speedup_swap_vs_recompute']:.2f}x recompute",
        fontsize=9,
    )
    roomy = results["burst"]["no pressure"]["computed_tokens"]
    ax2.bar(labels, [p["computed_tokens"] - roomy for p in burst_points], color=colors)
    ax2.set_ylabel("tokens computed again (vs no pressure)")
    ax2.set_title(
        f"Recomputed tokens; swap brought {summary['tokens_swapped_in']} back from the host",
        fontsize=9,
    )
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    hit = ax3.twinx()
    for offset, (label, color) in enumerate(zip(CHAT_MODES, ("tab:red", "tab:blue"), strict=True)):
        turns = results["chat"][label]["turns"]
        xs = range(1, len(turns) + 1)
        ax3.plot(xs, [t["ttft_ms"] for t in turns], "o-", color=color, label=f"TTFT, {label}")
        hit.bar(
            [x + (offset - 0.5) * 0.35 for x in xs],
            [t["hit_rate"] for t in turns],
            width=0.35,
            alpha=0.25,
            color=color,
            label=f"hit rate, {label}",
        )
    hit.set_ylim(0, 1)
    hit.set_ylabel("prompt tokens served from a cache")
    ax3.set_xlabel("conversation turn")
    ax3.set_ylabel("mean time to first token (ms)")
    ax3.set_title(
        f"Multi-turn chat, {work['conversations']} conversations: hit rate "
        f"{summary['chat_hit_rate_device_only']:.0%} -> {summary['chat_hit_rate_with_host']:.0%}",
        fontsize=9,
    )
    ax3.legend(fontsize=7, loc="upper left")
    hit.legend(fontsize=7, loc="upper right")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
