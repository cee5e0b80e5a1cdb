"""A request's life: its prompt, the tokens it has produced, its text, when it must stop.

`Request` is the engine's mutable record; `RequestOutput` is the immutable snapshot handed to
callers, carrying the timestamps from which TTFT, inter-token latency and end-to-end latency
follow.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from stages.common.tokenizer import IncrementalDetokenizer, Tokenizer

from .sampling import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What a request has produced so far (all of it, once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    arrival_time: float  # time.perf_counter() clock
    first_token_time: float | None
    token_times: list[float]
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive output tokens."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(eq=False)
class Request:
    """The engine's working state for one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    block_ids: list[int] = field(default_factory=list)  # this request's block table
    num_preemptions: int = 0  # times its KV was dropped to make room (recomputed later)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        generator: torch.Generator | None,
    ) -> Request:
        return cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids),
            generator=generator,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        """Record a sampled token, extend the text, and decide whether the request is done."""
        now = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        previous_length = len(self.text)
        self.text += self.detokenizer.add(token_id)
        params = self.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            self.finish(FINISH_STOP, now)
        elif params.stop and self._cut_at_stop_string(previous_length):
            self.finish(FINISH_STOP, now)
        elif len(self.output_token_ids) >= (params.max_tokens or 0):
            self.finish(FINISH_LENGTH, now)

    def _cut_at_stop_string(self, previous_length: int) -> bool:
        """Truncate the text before the earliest stop string that the new text completed."""
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, previous_length - longest + 1)
        hits = [i for s in self.params.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def finish(self, reason: str, when: float | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_time = time.perf_counter() if when is None else when

    def visible_text(self) -> str:
        """Text that is safe to show: while running, hold back a possible stop-string prefix."""
        if self.finished or not self.params.stop:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.output_token_ids),
            text=self.visible_text(),
            finish_reason=self.finish_reason,
            arrival_time=self.arrival_time,
            first_token_time=self.token_times[0] if self.token_times else None,
            token_times=list(self.token_times),
            finish_time=self.finish_time,
        )
