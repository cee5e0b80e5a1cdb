"""The scheduler alone: microseconds of `Scheduler.schedule` per decode step.

    python tools/scheduler_bench.py [--stages 04 05 06 07 08 15] [--requests 64 256] [--steps 80]

A stage's `LLM` on the tiny random checkpoint (the step profile's) takes N requests of 16
prompt tokens and runs two real steps, so that every request is running and decoding. Then
only the scheduler runs: each step `schedule()`, and each scheduled request's token lands at
once (one fewer placeholder, a token appended), as a step that does not overlap the next
leaves it. No model, no runner, no detokenizing: the step profile's "schedule" phase without
the rest of the step around it, so a change to the scheduler is measured apart from the
machine's drift in everything else (the step profile still decides a claim: caches are warmer
here than in an engine step). Reports the median of 5 runs of `--steps` steps, and the best.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from stages import load, stage_info
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

OUTPUT_TOKENS = 480  # room for the timed steps: each request decodes this long at most


def schedule_us(stage: str, requests: int, checkpoint: Path, steps: int) -> list[float]:
    """Five runs' microseconds of CPU per `schedule()` over `requests` running decodes."""
    module = load(stage)
    llm = step_profile._engine(stage, requests, checkpoint, OUTPUT_TOKENS, "cpu")
    try:
        params = module.SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        batch = [
            llm.make_request(p, params, output_kind="final")
            for p in step_profile._prompts(requests)
        ]
        for request in batch:
            llm.add_request(request)
        llm.step()
        llm.step()  # with async scheduling the first tokens land in the second step
        scheduler = llm.scheduler
        if len(scheduler.running) != requests:
            raise RuntimeError(f"{len(scheduler.running)} of {requests} requests running")
        if 5 * steps > OUTPUT_TOKENS - 8:
            raise ValueError(f"--steps {steps}: at most {(OUTPUT_TOKENS - 8) // 5}")
        runs = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(steps):
                for scheduled in scheduler.schedule().requests:
                    request = scheduler.requests[scheduled.request_id]
                    if hasattr(request, "num_output_placeholders"):  # stage 05 on
                        request.num_output_placeholders -= 1
                    request.output_token_ids.append(7)  # the token lands
            runs.append((time.thread_time() - start) / steps * 1e6)
        for request in batch:
            llm.abort_request(request.request_id)
        return runs
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", nargs="+", default=["04", "05", "06", "07", "08", "15"])
    parser.add_argument("--requests", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'stage':>12} {'reqs':>5} {'us/step':>9} {'best':>9} {'us/req':>7}")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for stage in args.stages:
            if int(stage_info(stage).number) < 4:
                raise SystemExit(f"stage {stage}: the bench needs a batching engine (04 on)")
            for requests in args.requests:
                runs = schedule_us(stage, requests, checkpoint, args.steps)
                median = statistics.median(runs)
                print(
                    f"{stage_info(stage).folder:>12} {requests:>5} {median:>9.1f} "
                    f"{min(runs):>9.1f} {median / requests:>7.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
