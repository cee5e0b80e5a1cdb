"""Sampling parameters and the sampler that turns logits into the next token.

The order of operations is the one vLLM and transformers use: divide the logits by the
temperature, keep the top-k, keep the smallest set of tokens whose probability reaches top-p,
then draw from what is left. Temperature 0 means greedy: always the most likely token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate for one request. Invalid values raise ValueError at construction."""

    max_tokens: int | None = 16  # None: as many as the context leaves room for
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first match
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks want fixed lengths)

    def __post_init__(self) -> None:
        # Normalise user-friendly inputs (a single string, a list) into immutable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
                f"max_tokens must be an integer, got {self.max_tokens!r}",
            )
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be a list of non-empty strings",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own random stream, so its samples do not depend on other requests."""
    return torch.Generator(device=device).manual_seed(seed)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus. logits: [vocab]."""
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> int:
    """Choose the next token from one position's logits `[vocab]`."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    logits = apply_top_k_top_p(logits, params.top_k, params.top_p)
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` `[batch, vocab]`, each row with its own request's settings
    and random stream, so a request samples the same tokens in a batch as alone."""
    greedy = logits.argmax(dim=-1).tolist()  # one op for every greedy row
    return [
        greedy[row] if p.greedy else sample_next_token(logits[row], p, gen)  # type: ignore[arg-type]
        for row, (p, gen) in enumerate(zip(params, generators, strict=True))
    ]


def sampling_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: broadcast a single one, or check the list's length."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
