"""Benchmark workloads, generated from a seed so every run sends the same requests.

- `throughput_workload`: nano-vllm's benchmark shape (N requests, random token-id prompts,
  random input and output lengths, seed 0), scaled down for a CPU.
- `SAMPLE_QUESTIONS`: short chat prompts for latency benchmarks and demos.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class ThroughputWorkload:
    """N requests with input and output lengths drawn uniformly from the given ranges."""

    num_requests: int = 64
    input_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (16, 256)
    token_id_range: tuple[int, int] = (100, 10_000)  # nano-vllm draws ids below 10000
    seed: int = 0

    def requests(self) -> list[WorkloadRequest]:
        rng = random.Random(self.seed)
        low, high = self.token_id_range
        out = []
        for _ in range(self.num_requests):
            n_in = rng.randint(*self.input_len)
            n_out = rng.randint(*self.output_len)
            out.append(WorkloadRequest([rng.randint(low, high - 1) for _ in range(n_in)], n_out))
        return out

    def describe(self) -> dict[str, object]:
        return {
            "name": "throughput (nano-vllm style)",
            "num_requests": self.num_requests,
            "input_len_range": list(self.input_len),
            "output_len_range": list(self.output_len),
            "prompt": "uniform random token ids",
            "seed": self.seed,
            "ignore_eos": True,
        }


SAMPLE_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.",
    "What are the primary colors?",
    "Write a short poem about autumn leaves.",
    "How do airplanes stay in the air?",
    "Name three famous painters and one work by each.",
)
