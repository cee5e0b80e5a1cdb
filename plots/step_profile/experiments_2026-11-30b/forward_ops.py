"""How many aten operations one decode step of stage 15 runs in the model (its forward and LM
head) on the step profile's tiny checkpoint, at 1 and 64 running requests: what the host runs
between two of the engine's own phases.

    python plots/step_profile/experiments_2026-11-30b/forward_ops.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stages import load
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.set_num_threads(1)
    module = load("15")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for requests in (1, 64):
            llm = step_profile._engine("15", requests, checkpoint, 64, "cpu")
            params = module.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            for prompt in step_profile._prompts(requests):
                llm.add_request(llm.make_request(prompt, params, output_kind="final"))
            for _ in range(4):  # the prefill and the first decodes
                llm.step()
            model, counter = llm.runner.model, CountOps()
            forward, logits = model.forward, model.compute_logits

            def counted(function, counter=counter):
                def run(*args, **kwargs):
                    with counter:
                        return function(*args, **kwargs)

                return run

            model.forward, model.compute_logits = counted(forward), counted(logits)
            llm.step()
            print(
                f"{requests} requests: {counter.count} aten operations in one decode step's "
                "forward and LM head"
            )


if __name__ == "__main__":
    main()
