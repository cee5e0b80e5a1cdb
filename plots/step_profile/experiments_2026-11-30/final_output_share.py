"""The final output's share of a step: the CPU stage 15 spends building each finished request's
output (`Request.output`: detokenizing its tokens at once, `_decode_pending`, then the
snapshot), per step of the step profile's workload (tiny random checkpoint, one torch thread,
N requests of 64 greedy tokens, output kind "final"), against the whole process's CPU per
step. Every request finishes in the step profile's run, so this is paid once per request,
inside the step that finishes it.

    python plots/step_profile/experiments_2026-11-30/final_output_share.py

Run from a checkout's root (the log beside it: 4855be0, a 2-core Sapphire Rapids Xeon).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from stages import load
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

TOKENS = 64


def measure(requests: int, checkpoint: Path) -> str:
    module = load("15")
    request_class = module.request.Request
    spent = {"output": 0.0, "detokenize": 0.0}

    def timed(name: str, method):  # the thread's CPU inside `method`
        def wrapper(self):
            start = time.thread_time()
            try:
                return method(self)
            finally:
                spent[name] += time.thread_time() - start

        return wrapper

    originals = request_class.output, request_class._decode_pending
    request_class.output = timed("output", originals[0])
    request_class._decode_pending = timed("detokenize", originals[1])
    try:
        llm = step_profile._engine("15", requests, checkpoint, TOKENS, "cpu")
        params = module.SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        llm.generate(step_profile._prompts(1), params)  # warm-up
        spent.update(output=0.0, detokenize=0.0)
        steps = [0]
        step = llm.step

        def counted():
            steps[0] += 1
            return step()

        llm.step = counted
        start = time.process_time()
        llm.generate(step_profile._prompts(requests), params)
        cpu = time.process_time() - start
    finally:
        request_class.output, request_class._decode_pending = originals
    per_step = {name: seconds * 1e6 / steps[0] for name, seconds in spent.items()}
    return (
        f"{requests:5} requests, {steps[0]} steps: CPU {cpu * 1e6 / steps[0]:,.0f} us a step; "
        f"final outputs {per_step['output']:,.0f} us a step "
        f"(detokenizing {per_step['detokenize']:,.0f}), "
        f"{spent['output'] * 1e6 / requests:,.0f} us a request"
    )


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for requests in (64, 256):
            print(measure(requests, checkpoint))


if __name__ == "__main__":
    main()
