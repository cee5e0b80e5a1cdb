"""Why the engine's own work costs several times more inside an engine than in a loop: the same
host calls, timed right after a decode step and again at once after (stage 15, the step
profile's workload: tiny random checkpoint, one torch thread, 64 running greedy requests).

A CPU step runs the model's forward on the host's own core: the linears, each request's cached
K/V gathered for attention (the KV cache here is sized for 400 tokens a request: about 30 MB),
the step's activations. The table shows each call's mean over 100 steps: right "after a
step", "again" at once (warm), and after reading a 32 MB array with no step ("after 32 MB
read"), which evicts what the L2 and L3 caches hold (code and data share them) and does
nothing else; and `prepare_inputs` for one scheduled step, in a loop of 2,000 (warm) against
right after each step. If the last column is near the first, evicted caches explain
the cost after a step; the script does not separate code from data, or caches from TLBs.

    python plots/step_profile/experiments_2026-11-30/cold_after_step.py

Run from a checkout's root (the log beside it: 4855be0's engine, a 2-core Sapphire Rapids Xeon).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path.cwd()))

from stages import load
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

REQUESTS, STEPS = 64, 100


def main() -> None:
    torch.set_num_threads(1)
    contexts = list(range(REQUESTS))
    tables = [tuple(range(i, i + 5)) for i in range(REQUESTS)]
    array, block_table = np.arange(REQUESTS), np.zeros((REQUESTS, 32), dtype=np.int32)
    flush = np.ones(32 * 2**20 // 8)  # 32 MB of float64, read whole to evict the caches
    calls = {
        "numpy: array + 1": lambda: array + 1,
        "numpy: divmod": lambda: np.divmod(array, 16),
        "numpy: a block-table gather": lambda: block_table[array, array // 16],
        "python: slots by list comprehension": lambda: [
            t[c // 16] * 16 + c % 16 for t, c in zip(tables, contexts, strict=True)
        ],
        "torch: empty(5)": lambda: torch.empty(5),
    }
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        llm = step_profile._engine("15", REQUESTS, checkpoint, 400, "cpu")
        params = load("15").SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        for prompt in step_profile._prompts(REQUESTS):
            llm.add_request(llm.make_request(prompt, params))
        for _ in range(3):  # the prompts, then decodes only
            llm.step()
        cold, warm, read = (dict.fromkeys(calls, 0.0) for _ in range(3))
        for _ in range(STEPS):
            llm.step()
            for side in (cold, warm, None):
                if side is None:
                    flush.sum()
                    side = read
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    side[name] += time.perf_counter() - start
        print(f"{'call':40} {'after a step us':>16} {'again us':>10} {'after 32 MB read us':>20}")
        for name in calls:
            print(
                f"{name:40} {cold[name] / STEPS * 1e6:16.2f} {warm[name] / STEPS * 1e6:10.2f}"
                f" {read[name] / STEPS * 1e6:20.2f}"
            )
        runner, scheduled = llm.runner, llm.scheduler.schedule()
        start = time.thread_time()
        for _ in range(2000):
            runner.prepare_inputs(scheduled)
        loop = (time.thread_time() - start) / 2000
        after = 0.0
        for _ in range(STEPS):
            llm.step()
            start = time.thread_time()
            runner.prepare_inputs(scheduled)
            after += time.thread_time() - start
        print(f"prepare_inputs, 64 decodes: in a loop {loop * 1e6:.1f} us, "
              f"after a step {after / STEPS * 1e6:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
