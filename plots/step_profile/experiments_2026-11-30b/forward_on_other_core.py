"""Does running the forward on the other core spare the engine's caches? Stage 15's step profile
at 64 requests, three ways, alternating:

- default: a CPU engine's steps run on the engine's thread (no worker; its default);
- worker, same core: the runner's worker thread runs each step and the engine waits for it
  (async scheduling's runner with the overlap off, inputs read in place), both threads pinned
  to core 0;
- worker, other core: the same with the worker pinned to core 1 and the engine to core 0.

    python plots/step_profile/experiments_2026-11-30b/forward_on_other_core.py [--rounds 3]

Linux only (os.sched_setaffinity on a thread: pid 0 is the calling thread).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

REAL = step_profile._engine


def engine(mode: str):
    def make(stage, requests, checkpoint, output_tokens, device, config=None):
        os.sched_setaffinity(0, {0, 1})
        if mode == "default":
            return REAL(stage, requests, checkpoint, output_tokens, device, config)
        config = {"async_scheduling": True}  # the runner gets its worker thread
        llm = REAL(stage, requests, checkpoint, output_tokens, device, config)
        llm.config = dataclasses.replace(llm.config, async_scheduling=False)  # no overlap
        buffers = llm.runner.buffers
        buffers.direct = True  # inputs read where they are staged, as the default's
        buffers._allocate()
        worker_core = 1 if mode == "worker, other core" else 0
        os.sched_setaffinity(0, {0})
        llm.runner._worker.submit(os.sched_setaffinity, 0, {worker_core}).result()
        return llm

    return make


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(step_profile.machine())
    modes = ("default", "worker, same core", "worker, other core")
    own: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for round_ in range(args.rounds):
            for mode in modes:
                step_profile._engine = engine(mode)
                p = step_profile.profile_stage("15", args.requests, checkpoint)
                os.sched_setaffinity(0, {0, 1})
                own[mode].append(p.own_cpu_per_step_us)
                phases = "  ".join(f"{k} {v:,.0f}" for k, v in p.phases_cpu_us.items())
                print(
                    f"round {round_}, {mode}: own CPU/step {p.own_cpu_per_step_us:,.0f}, "
                    f"switches/step {p.switches_per_step:.1f}; {phases}",
                    flush=True,
                )
    step_profile._engine = REAL
    for mode in modes:
        print(f"{mode}: own CPU/step median {statistics.median(own[mode]):,.0f} us")


if __name__ == "__main__":
    main()
