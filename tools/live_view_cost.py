"""What stage 15's live view costs the engine: decode throughput with nobody watching, against
stage 14's engine, and with a viewer (a `StepWatcher` building a view after every step).

One process, the embedded SmolLM2 on this machine's CPU, the same greedy decode-heavy workload
for every variant, the variants interleaved round by round so that a drift of the machine hits
them all alike. Reports the median of the rounds and each variant's spread (min..max).

    python tools/live_view_cost.py                 # plots/15_live_view_cost.json
    python tools/live_view_cost.py --rounds 7 --requests 16 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import stages  # noqa: E402

PROMPT = "Explain, step by step, how a paged KV cache lets an inference server batch requests: "


def _tokens_per_second(llm: Any, stage: Any, requests: int, max_tokens: int) -> float:
    params = stage.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"{PROMPT}({i})" for i in range(requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds


def _cpu() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "plots" / "15_live_view_cost.json")
    args = parser.parse_args()
    s14, s15 = stages.load("14"), stages.load("15")
    live_view = sys.modules[f"{s15.__name__}.observability.live_view"]
    print("loading the engines ...", flush=True)
    engines = {"14": s14.LLM(), "15": s15.LLM()}
    views: deque[Any] = deque(maxlen=64)  # what a core keeps for its next message
    build_seconds: list[float] = []
    plain_step_view = live_view.step_view

    def timed_step_view(*a: Any, **k: Any) -> Any:  # the watcher's per-step work, timed
        start = time.perf_counter()
        view = plain_step_view(*a, **k)
        build_seconds.append(time.perf_counter() - start)
        return view

    live_view.step_view = timed_step_view
    watched = engines["15"]
    variants = {
        "stage 14, nobody watching": ("14", None),
        "stage 15, nobody watching": ("15", None),
        "stage 15, a viewer": ("15", lambda: live_view.StepWatcher(watched, views.append)),
    }
    for stage_number, llm in engines.items():  # warm-up: first-call costs out of the rounds
        _tokens_per_second(llm, s14 if stage_number == "14" else s15, 2, 8)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for round_number in range(args.rounds):
        for name, (number, make_watcher) in variants.items():
            llm, stage = engines[number], (s14 if number == "14" else s15)
            if number == "15":
                llm.watcher = make_watcher() if make_watcher else None
            rates[name].append(_tokens_per_second(llm, stage, args.requests, args.max_tokens))
            print(f"round {round_number + 1}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    watched.watcher = None
    view = max(views, key=lambda v: len(json.dumps(v)), default=None)
    build_ms = statistics.median(build_seconds) * 1e3
    build_p99_ms = sorted(build_seconds)[int(0.99 * (len(build_seconds) - 1))] * 1e3
    base = statistics.median(rates["stage 14, nobody watching"])
    result = {
        "machine": f"{_cpu()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "workload": f"{args.requests} requests x {args.max_tokens} tokens, greedy, "
        f"embedded SmolLM2, {args.rounds} rounds interleaved",
        "tokens_per_second": {
            name: {"median": statistics.median(r), "min": min(r), "max": max(r), "runs": r}
            for name, r in rates.items()
        },
        "relative_to_stage_14": {name: statistics.median(r) / base for name, r in rates.items()},
        "view_build_ms_median": build_ms,
        "view_build_ms_p99": build_p99_ms,
        "views_built": len(build_seconds),
        "view_bytes": len(json.dumps(view)) if view is not None else None,
        "num_blocks": watched.kv_manager.allocator.num_blocks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, ratio in result["relative_to_stage_14"].items():
        spread = result["tokens_per_second"][name]
        low, high = spread["min"], spread["max"]
        print(f"{name}: median {spread['median']:.1f} tok/s ({low:.1f}..{high:.1f}), {ratio:.3f}x")
    print(
        f"a view per step: {build_ms:.3f} ms median, {build_p99_ms:.3f} ms p99 "
        f"({len(build_seconds)} steps, {result['num_blocks']} blocks, up to "
        f"{result['view_bytes']} bytes of JSON); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
