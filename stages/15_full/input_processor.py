"""Input processing: turn what a client sent (text, token ids or chat messages) into a Request.

Everything a client can get wrong is refused here, with a ValueError that says what to change,
before the request reaches the scheduler: the engine loop only ever sees requests it can run.
vLLM's `InputProcessor` has the same job. The engine owns one (`LLMEngine.input_processor`) and
`LLMEngine.make_request` hands over to it.

Text is refused by its length before it is tokenized, and a text far over the context stops
being tokenized after a few pieces: tokenizing holds the GIL, time that a prompt that cannot
fit should not get to take from the requests that are running.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import replace

from stages.common.tokenizer import Message, Tokenizer

from .config import EngineConfig
from .request import OutputKind, Request
from .sampling import SamplingParams

Prompt = str | list[int]
MAX_CACHE_SALT_CHARS = 1024


class InputProcessor:
    """Tokenizes and validates requests against the context of one engine."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_size: int) -> None:
        assert config.max_model_len is not None, "the engine resolves max_model_len first"
        self.max_model_len: int = config.max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._request_ids = itertools.count()
        self._seeds = random.Random(config.seed)

    def make_request(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Message] | None = None,
        request_id: str | None = None,
        output_kind: OutputKind = "cumulative",
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate a request; raises ValueError for anything the engine can't run.

        Requests with different `cache_salt`s never share prefix-cache blocks (say, one salt
        per tenant); requests without one share with each other."""
        params = params or SamplingParams()
        if cache_salt is not None and not (
            isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                "characters"
            )
        if messages is not None:
            self.check_text([str(m.get("content") or "") for m in messages], "messages")
            prompt = self.tokenizer.apply_chat_template(messages)
            prompt_ids = self.encode(prompt, "messages", add_special_tokens=False)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            self.check_text([prompt], "prompt")
            prompt_ids = self.encode(prompt, "prompt")
        elif prompt is not None:
            prompt_ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.vocab_size for t in prompt_ids):
                raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
            prompt = None
        else:
            raise ValueError("give a prompt or messages")
        if params.max_tokens is None:  # fill the rest of the context
            params = replace(params, max_tokens=max(1, self.max_model_len - len(prompt_ids)))
        self.check_lengths(len(prompt_ids), params)
        return Request.create(
            request_id=request_id or f"req-{next(self._request_ids)}",
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            tokenizer=self.tokenizer,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            output_kind=output_kind,
            cache_salt=cache_salt,
        )

    def check_text(self, texts: Sequence[str], what: str) -> None:
        """Refuse text before paying to tokenize it: too many characters to fit the context
        (each token covers at most `max_chars_per_token` of them), or not valid Unicode."""
        limit = self.max_model_len * self.tokenizer.max_chars_per_token
        length = sum(len(text) for text in texts)
        if length > limit:
            raise ValueError(
                f"{what} is too long: {length} characters cannot fit in the context of "
                f"{self.max_model_len} tokens"
            )
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{what} is not valid Unicode text: {exc.reason} at character {exc.start}"
                ) from None

    def encode(self, text: str, what: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize, giving up early on a text far longer than the context (the tokenizer
        measures it in pieces first, so a hostile prompt costs little of anyone's time)."""
        ids = self.tokenizer.encode_within(
            text, self.max_model_len, add_special_tokens=add_special_tokens
        )
        if ids is None:
            raise ValueError(
                f"{what} is too long: it has more than {self.max_model_len} tokens, the whole "
                "context"
            )
        return ids

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """The prompt and its answer must fit in the model's context."""
        if prompt_len == 0:
            raise ValueError("prompt must not be empty")
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt is {prompt_len} tokens but the context is {self.max_model_len} tokens "
                "(the prompt plus at least one output token must fit)"
            )
        assert params.max_tokens is not None
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens; lower max_tokens to at most "
                f"{self.max_model_len - prompt_len}"
            )
