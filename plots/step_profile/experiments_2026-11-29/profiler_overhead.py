"""What the step profile's own wrappers cost: stage 04's process CPU per step with them (the
profile's `cpu_per_step_us`) and without (the same `LLM.generate` on the same tiny checkpoint,
only the steps counted), medians of five alternating runs at 1 and 64 requests.

    python plots/step_profile/experiments_2026-11-29/profiler_overhead.py

The difference is the timing itself (two `time.thread_time()` and two `time.perf_counter()`
per wrapped call, seven wrapped calls a step in stage 04), and it lands in the engine's "own
CPU", on both sides of every before-and-after run alike.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from stages import load
from stages.common.tooling import step_profile as sp
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


def plain_cpu_per_step(checkpoint: Path, requests: int) -> float:
    llm = sp._engine("04", requests, checkpoint, sp.OUTPUT_TOKENS, "cpu")
    params = load("04").SamplingParams(
        temperature=0.0, max_tokens=sp.OUTPUT_TOKENS, ignore_eos=True
    )
    prompts = sp._prompts(requests)
    llm.generate(prompts[:1], params)  # warm-up, as the profile does
    steps, step = [0], llm.step

    def counted():
        steps[0] += 1
        return step()

    llm.step = counted
    start = time.process_time()
    llm.generate(prompts, params)
    return (time.process_time() - start) * 1e6 / steps[0]


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny", TinySpec())
        for requests in (1, 64):
            wrapped, plain = [], []
            for _ in range(5):
                wrapped.append(sp.profile_stage("04", requests, checkpoint).cpu_per_step_us)
                plain.append(plain_cpu_per_step(checkpoint, requests))
            print(
                f"{requests} requests: CPU per step with the wrappers "
                f"{statistics.median(wrapped):,.0f} us {sorted(round(w) for w in wrapped)}, "
                f"without {statistics.median(plain):,.0f} us {sorted(round(p) for p in plain)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
