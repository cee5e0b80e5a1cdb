"""Experiment, not adopted (stage 05's README): stage NN's steps run where they are launched,
on the engine's thread, instead of on the runner's worker thread. The runner module's
ThreadPoolExecutor is replaced by one that runs each submitted call at once, so the runner is
also built on the engine's thread (one OpenMP team). Nothing else changes.

    python plots/step_profile/experiments_2026-11-29/inline_step.py thread|inline tiny 05 1 64 256
    python plots/step_profile/experiments_2026-11-29/inline_step.py thread|inline embedded 05 1 64
"""

from __future__ import annotations

import importlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path


class Inline:
    """An executor that runs each call when it is submitted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def submit(self, fn: Callable[..., object], *args: object, **kwargs: object) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, as a worker thread would
            future.set_exception(exc)
        return future

    def shutdown(self, *args: object, **kwargs: object) -> None:
        pass


def main() -> None:
    mode, model, stage, *counts = sys.argv[1:]
    folder = importlib.import_module("stages").stage_info(stage).folder
    if mode == "inline":
        importlib.import_module(f"stages.{folder}.model_runner").ThreadPoolExecutor = Inline
    if model == "embedded":
        from stages.common.tooling.embedded_throughput import measure

        for streams in map(int, counts):
            result = measure(stage, streams)
            print(f"{mode} {folder} {streams} streams: {result.tokens_per_second:.1f} tok/s")
        return
    import torch

    torch.set_num_threads(1)
    from stages.common.tooling import step_profile
    from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny", TinySpec())
        for requests in map(int, counts):
            runs = [step_profile.profile_stage(stage, requests, checkpoint) for _ in range(3)]

            def median(field: str, runs: list = runs) -> float:
                return statistics.median(getattr(r, field) for r in runs)

            print(
                f"{mode} {folder} {requests} requests (medians of 3):"
                f" own CPU {median('own_cpu_per_step_us'):.0f} us/step,"
                f" switches {median('switches_per_step'):.1f}/step,"
                f" {median('tokens_per_second'):.0f} tok/s"
            )


if __name__ == "__main__":
    main()
