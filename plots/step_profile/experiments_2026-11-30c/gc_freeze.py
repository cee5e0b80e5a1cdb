"""What Python's cyclic garbage collector costs the engine's steps, and whether freezing the
heap after the engine is built (`gc.freeze()`, as vLLM's engine core does after start-up)
changes the engine's own CPU per step.

    python plots/step_profile/experiments_2026-11-30c/gc_freeze.py 64 256

Stage 15, the step profile's workload (tiny random checkpoint, one torch thread, 64 greedy tokens
a request), alternating without and with the freeze, two rounds each. The collector's time is
read with `gc.callbacks`; with the freeze its column also holds the one full collection made
before freezing (outside the steps), so read the own CPU there, not the GC column.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


def main(requests: list[int]) -> None:
    torch.set_num_threads(1)
    checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()), TinySpec())
    stats: dict[int, list[float]] = {}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        cell = stats.setdefault(info["generation"], [0, 0.0])
        cell[0] += 1
        cell[1] += time.perf_counter() - started[0]

    gc.callbacks.append(timed)
    real = step_profile._engine
    for n in requests:
        for freeze in (False, True, False, True):

            def engine(*args, freeze=freeze, **kwargs):
                llm = real(*args, **kwargs)
                if freeze:
                    gc.collect()
                    gc.freeze()
                return llm

            step_profile._engine = engine
            stats.clear()
            profile = step_profile.profile_stage("15", n, checkpoint)
            step_profile._engine = real
            gc.unfreeze()
            total = sum(seconds for _, seconds in stats.values())
            per_generation = {g: (int(c), round(s * 1e3, 1)) for g, (c, s) in sorted(stats.items())}
            print(
                f"{n} requests, freeze={freeze}: own {profile.own_cpu_per_step_us:,.0f} us a step,"
                f" {profile.steps} steps, collector {total * 1e6 / profile.steps:,.1f} us a step,"
                f" (collections, ms) by generation {per_generation}",
                flush=True,
            )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
