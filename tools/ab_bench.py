"""A/B timing of two copies of the engine on the same workloads, interleaved in one process.

A refactor must not cost speed. Machines here differ from session to session (and a VM's memory
bandwidth drifts within one), so a "before" number from another day proves nothing: this tool
loads each selected stage from the working tree (B) and from another checkout (A, for example a
`git worktree` of the previous commit), and alternates A and B runs of the same workload so that
drift hits both alike. It reports the median of each side and the B/A ratio.

    git worktree add /tmp/base HEAD~1
    python tools/ab_bench.py --base /tmp/base --stages 01 03 04 --repeats 5

Workloads (real model, greedy, fixed lengths):
- decode: batch-1 decode tokens/s of one 128-token answer (stages 01 and 02);
- prefill: time to first token of a ~450-token prompt (stages 01 and 02);
- batch: output tokens/s of a 24-request throughput workload at max_num_seqs 8 (stages 03+).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stages  # noqa: E402
from stages.common.tooling.hardware import hardware_info  # noqa: E402
from stages.common.tooling.workloads import ThroughputWorkload  # noqa: E402

KV_BYTES = 256 * 2**20


def _engine(stage: ModuleType) -> Any:
    fields = stage.EngineConfig.__dataclass_fields__
    config = {"kv_cache_bytes": KV_BYTES} if "kv_cache_bytes" in fields else {}
    if "max_num_seqs" in fields:
        config["max_num_seqs"] = 8
    return stage.LLM(**config)


def decode_rate(stage: ModuleType, llm: Any) -> float:
    params = stage.SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    out = llm.generate("Tell me a story about a lighthouse keeper.", params)[0]
    gaps = out.itl
    return len(gaps) / sum(gaps)


def prefill_seconds(stage: ModuleType, llm: Any) -> float:
    prompt = "The history of the lighthouse on the northern cape. " * 40
    params = stage.SamplingParams(max_tokens=1, temperature=0)
    return llm.generate(prompt, params)[0].ttft


def batch_rate(stage: ModuleType, llm: Any) -> float:
    work = ThroughputWorkload(num_requests=24, input_len=(16, 128), output_len=(8, 96))
    prompts = [r.prompt_token_ids for r in work.requests()]
    params = [
        stage.SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        for r in work.requests()
    ]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="root of the other checkout (A)")
    parser.add_argument("--stages", nargs="+", default=["01", "02", "03", "04"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the numbers to this JSON file")
    args = parser.parse_args()
    results: dict[str, Any] = {"hardware": hardware_info(), "repeats": args.repeats}
    for number in args.stages:
        info = stages.stage_info(number)
        base = Path(args.base) / "stages" / info.folder
        sides = {"A": stages.load_from_path(base, alias=f"ab_{number}"), "B": stages.load(number)}
        engines = {side: _engine(stage) for side, stage in sides.items()}
        workloads = [decode_rate, prefill_seconds] if number < "03" else [batch_rate]
        for workload in workloads:
            for side in sides:  # warm-up
                workload(sides[side], engines[side])
            samples: dict[str, list[float]] = {"A": [], "B": []}
            for _ in range(args.repeats):
                for side in ("A", "B"):
                    samples[side].append(workload(sides[side], engines[side]))
            a, b = statistics.median(samples["A"]), statistics.median(samples["B"])
            key = f"{number}/{workload.__name__}"
            results[key] = {"A": a, "B": b, "B_over_A": b / a, "samples": samples}
            print(f"{key:22s} A {a:9.4f}   B {b:9.4f}   B/A {b / a:.3f}", flush=True)
        del engines
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
