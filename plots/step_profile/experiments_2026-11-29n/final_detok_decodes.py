"""Decodes per request when the step profile's requests finish: stage 15, 64 requests of 64
greedy tokens on the tiny random checkpoint (byte vocabulary), every `Tokenizer.decode` call
counted; the text's hash shows that a change to the detokenizer left the text as it was.

    python plots/step_profile/experiments_2026-11-29n/final_detok_decodes.py

Run from a checkout's root; in a worktree of an older commit for the before side (the log
beside it: be2e449, then the ninth session's code).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from stages import load
from stages.common import tokenizer
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

REQUESTS = 64


def main() -> None:
    torch.set_num_threads(1)
    calls = [0]
    decode = tokenizer.Tokenizer.decode

    def counting(self, ids, **kwargs):
        calls[0] += 1
        return decode(self, ids, **kwargs)

    tokenizer.Tokenizer.decode = counting
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        llm = step_profile._engine("15", REQUESTS, checkpoint, 64, "cpu")
        params = load("15").SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        calls[0] = 0
        outputs = llm.generate(step_profile._prompts(REQUESTS), params)
        text = "".join(o.text for o in outputs)
        print(f"decodes per request {calls[0] / REQUESTS:.1f}")
        print(f"text: {len(text)} characters, md5 {hashlib.md5(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
