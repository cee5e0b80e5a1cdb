"""An all-greedy decode step's `InputBatch.sampling_tensors` (stage 04), microseconds a call.

    python plots/step_profile/experiments_2026-11-29n/sampling_tensors_bench.py

Run from a checkout's root; run it in a worktree of an older commit for the before side (the
log beside it: be2e449, then the ninth session's code). Best of five runs of 2,000 calls.
"""

from __future__ import annotations

import importlib
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))


def bench(requests: int) -> float:
    input_batch = importlib.import_module("stages.04_batching.input_batch")
    scheduler_output = importlib.import_module("stages.04_batching.scheduler_output")
    sampling = importlib.import_module("stages.04_batching.sampling")
    batch = input_batch.InputBatch(max_num_seqs=requests, max_blocks=8, block_size=16)
    greedy = sampling.SamplingParams(temperature=0)
    step = batch.pack(
        [
            scheduler_output.ScheduledRequest(f"r{i}", 0, (5,), 40, greedy, i, True, (i, i + 1))
            for i in range(requests)
        ]
    )
    cpu = torch.device("cpu")
    runs = timeit.repeat(lambda: batch.sampling_tensors(step, 100, cpu), number=2000, repeat=5)
    return min(runs) / 2000 * 1e6


if __name__ == "__main__":
    for n in (1, 64, 256):
        print(f"n={n}: sampling_tensors {bench(n):.2f} us")
