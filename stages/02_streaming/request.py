"""A request's life: its prompt, the tokens it has produced, its text, when it must stop.

`Request` is the engine's mutable record. Its `num_computed_tokens` counts the tokens whose K/V
are in the cache: the scheduler gives a request `num_tokens - num_computed_tokens` new tokens
per step (vLLM V1's rule), so a fresh prompt, a recompute and a one-token decode are one case.

`RequestOutput` is the immutable snapshot handed to callers, with the timestamps from which
TTFT, inter-token latency and end-to-end latency follow. Its `kind` decides how much it holds:
"cumulative" (everything so far), "delta" (only what is new since the previous output: what a
stream needs, O(new tokens) per step) or "final" (one output, at the end).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Literal

from stages.common.tokenizer import IncrementalDetokenizer, Tokenizer

from .sampling import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"
OutputKind = Literal["cumulative", "delta", "final"]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What a request has produced so far (all of it, once `finished`; see `kind`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    arrival_time: float  # time.perf_counter() clock
    first_token_time: float | None
    token_times: list[float]
    finish_time: float | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    kind: OutputKind = "cumulative"

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
    seed: int  # the request's random stream: its own seed, or one the engine drew for it
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    output_kind: OutputKind = "cumulative"
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Unique per admission (Scheduler.add numbers them): a request id can come back after an
    # abort, and a step still in flight must not hand the old admission's token to the new.
    admission_id: int = -1
    _sent_tokens: int = 0  # how much earlier delta outputs already carried
    _sent_text: int = 0

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seed: int,
        output_kind: OutputKind = "cumulative",
    ) -> Request:
        return cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            seed=seed,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt_token_ids),
            output_kind=output_kind,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output together (a new list: O(length), not for per-step use)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of prompt + output, without joining the two lists
        (a decode asks for one token: O(1), not O(length))."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record a sampled token (id, time) and extend the text, then decide whether the
        request is done: finish "stop" on a stop token id, on EOS unless `ignore_eos`, or when
        the new text completes a stop string (the text is cut before it, even when it spans
        two tokens); else finish "length" once the output holds `max_tokens` tokens.
        `now`: when the step that brought it ended (the engine reads the clock once a step:
        the tokens of one step share one time, as vLLM's engine core stamps its outputs)."""
        now = time.perf_counter() if now is None else now
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

    def fail(self, error: BaseException | str) -> None:
        """End the request because something tied to it went wrong; the others carry on."""
        if self.finish_reason is None:
            self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.finish(FINISH_ERROR)

    def visible_text(self) -> str:
        """Text that is safe to show: while running, hold back a possible stop-string prefix."""
        if self.finished or not self.params.stop:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]

    def output(self) -> RequestOutput | None:
        """This step's output in the request's `output_kind`; None when there is nothing to
        report ("final" before the end)."""
        if self.output_kind == "final" and not self.finished:
            return None
        if self.output_kind != "delta":
            return self.final_output()
        text = self.visible_text()
        text, self._sent_text = text[self._sent_text :], len(text)
        new_from, self._sent_tokens = self._sent_tokens, len(self.output_token_ids)
        return self._snapshot(
            self.output_token_ids[new_from:], self.token_times[new_from:], text, "delta"
        )

    def final_output(self) -> RequestOutput:
        """Everything the request has produced so far, whatever its output kind."""
        return self._snapshot(
            list(self.output_token_ids), list(self.token_times), self.visible_text(), "cumulative"
        )

    def _snapshot(
        self, tokens: list[int], times: list[float], text: str, kind: OutputKind
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,  # never changes: shared, not copied
            token_ids=tokens,
            text=text,
            finish_reason=self.finish_reason,
            arrival_time=self.arrival_time,
            first_token_time=self.token_times[0] if self.token_times else None,
            token_times=times,
            finish_time=self.finish_time,
            error=self.error,
            kind=kind,
        )
