"""Where stage 15's `_forward_and_sample` spends a decode step at 64 requests, inside an
engine (caches as a real step leaves them): entering inference mode, the model, the LM head,
sampling, the tail (keeping the sampled ids, freeing the step's tensors), leaving inference
mode. Each part timed with the thread's CPU clock over three `generate` calls of the step
profile's workload (tiny random checkpoint, one torch thread, 64 greedy tokens each).

    python plots/step_profile/experiments_2026-11-29n/forward_and_sample_parts.py

The runner's method is replaced by a copy of its common path (no placeholders, no drafts, no
graphs: what this workload runs) with the clocks in between.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from stages import load
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

REQUESTS = 64


def main() -> None:
    torch.set_num_threads(1)
    seconds: collections.Counter[str] = collections.Counter()
    steps = [0]
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        llm = step_profile._engine("15", REQUESTS, checkpoint, 64, "cpu")
        runner = llm.runner
        sample = sys.modules[type(runner).__module__].sample

        def timed(inputs):
            clock = time.thread_time
            t0 = clock()
            with torch.inference_mode():
                t1 = clock()
                meta = inputs.attn_metadata
                hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, meta)
                t2 = clock()
                rows = hidden if inputs.every_row_samples else hidden[inputs.logits_indices]
                logits = runner.model.compute_logits(rows)
                t3 = clock()
                tokens = sample(logits, inputs.sampling).unsqueeze(1)
                t4 = clock()
                runner._last_sampled = tokens[:, 0]
                del hidden, logits, rows
                t5 = clock()
            t6 = clock()
            marks = (t0, t1, t2, t3, t4, t5, t6)
            parts = ("enter", "model", "LM head", "sample", "tail", "exit")
            for index, part in enumerate(parts):
                seconds[part] += marks[index + 1] - marks[index]
            steps[0] += 1
            return tokens

        params = load("15").SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        llm.generate(step_profile._prompts(REQUESTS), params)  # warm-up
        runner._forward_and_sample = timed
        for _ in range(3):
            llm.generate(step_profile._prompts(REQUESTS), params)
    for part, total in seconds.items():
        print(f"{part:8s} {total / steps[0] * 1e6:9.1f} us a step")


if __name__ == "__main__":
    main()
