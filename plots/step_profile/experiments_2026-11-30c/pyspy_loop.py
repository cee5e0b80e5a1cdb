"""The workload py-spy recorded (pyspy_summary.py): stage 15 on the tiny checkpoint, one torch
thread, N requests of 64 greedy tokens through `LLM.generate`, REPEATS times.

    python pyspy_loop.py N REPEATS
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from stages import load
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


def main(requests: int, repeats: int) -> None:
    torch.set_num_threads(1)
    checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()), TinySpec())
    stage = load("15")
    llm = step_profile._engine("15", requests, checkpoint, 64, "cpu")
    params = stage.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = step_profile._prompts(requests)
    llm.generate(prompts[:1], params)
    for _ in range(repeats):
        llm.generate(prompts, params)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
