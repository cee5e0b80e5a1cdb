"""The naive engine: one request at a time, prefill once, then one decode step per token.

    prompt ids --prefill--> logits --sample--> token --decode step--> logits --> ...

Prefill runs the whole prompt through the model in one forward and fills the KV cache. Each
decode step then runs the model on the single newest token, reading every earlier token's K/V
from the cache. Requests run strictly one after another: the engine is correct and simple, and
every later stage exists because of what this one leaves on the table.
"""

from __future__ import annotations

import itertools
import numbers
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from stages.common.devices import resolve_device, resolve_dtype
from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig
from stages.common.tokenizer import Message, Tokenizer
from stages.common.weights import DEFAULT_MODEL, EMBEDDED_ALIASES, resolve_model

from .config import EngineConfig
from .kv_cache import ContiguousKVCache
from .model import CausalLM, load_model
from .request import FINISH_ABORT, Request, RequestOutput
from .sampling import SamplingParams, make_generator, sample_next_token, sampling_params_list

Prompt = str | list[int]


class LLM:
    """Offline inference engine with vLLM's interface: ``LLM(model).generate(prompts, params)``."""

    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        started = time.perf_counter()
        self.config = EngineConfig(model=model, **config)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model_path = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(
            self.model_path, extra_eos_ids=self.model_config.eos_token_ids
        )
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.linear_backend = resolve_linear_backend(
            self.config.linear_backend, self.device, self.dtype
        )
        self.model: CausalLM = load_model(
            self.model_path,
            self.model_config,
            self.device,
            self.dtype,
            self.max_model_len,
            self.linear_backend,
        )
        self.model_name = self.config.served_model_name or (
            DEFAULT_MODEL if self.config.model in EMBEDDED_ALIASES else self.config.model
        )
        self._request_ids = itertools.count()
        self._seeds = random.Random(self.config.seed)
        self.load_seconds = time.perf_counter() - started

    # ----------------------------------------------------------------------- public API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params_list(sampling_params, len(prompt_list))
        requests = [self.make_request(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
        return [self.run(request) for request in requests]

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        params = sampling_params_list(sampling_params, len(conversations))
        requests = [
            self.make_request(None, sp, messages=messages)  # type: ignore[arg-type]
            for messages, sp in zip(conversations, params, strict=True)
        ]
        return [self.run(request) for request in requests]

    def make_request(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Message] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Tokenize and validate a request; raises ValueError for anything the engine can't run."""
        params = params or SamplingParams()
        if messages is not None:
            prompt = self.tokenizer.apply_chat_template(messages)
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_ids = self.tokenizer.encode(prompt)
        elif prompt is not None:
            prompt_ids = [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
            prompt = None
        else:
            raise ValueError("give a prompt or messages")
        if params.max_tokens is None:  # fill the rest of the context
            params = replace(params, max_tokens=max(1, self.max_model_len - len(prompt_ids)))
        self.check_lengths(len(prompt_ids), params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return Request.create(
            request_id=request_id or f"req-{next(self._request_ids)}",
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            tokenizer=self.tokenizer,
            generator=None if params.greedy else make_generator(seed, self.device),
        )

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

    def run(self, request: Request) -> RequestOutput:
        """Generate a request to completion and return its final output."""
        output = request.output()
        for output in self.stream(request):  # noqa: B007 (we want the last one)
            pass
        return output

    def stream(self, request: Request) -> Iterator[RequestOutput]:
        """Generate one request, yielding a snapshot after every token.

        Closing the iterator early aborts the request.
        """
        cache = self._new_kv_cache(request) if self.config.use_kv_cache else None
        try:
            logits = self._forward(request.prompt_token_ids, 0, cache)  # prefill
            while True:
                token = sample_next_token(logits, request.params, request.generator)
                request.append_token(token)
                yield request.output()
                if request.finished:
                    return
                if cache is None:  # no cache: recompute every position, every step
                    logits = self._forward(request.all_token_ids, 0, None)
                else:  # decode: one new token, all earlier K/V read from the cache
                    logits = self._forward([token], request.num_tokens - 1, cache)
        finally:
            request.finish(FINISH_ABORT)  # no-op if it already finished normally

    # ----------------------------------------------------------------------- internals
    def _new_kv_cache(self, request: Request) -> ContiguousKVCache:
        """Reserve room for the longest this request can grow: prompt + max_tokens."""
        mc = self.model_config
        assert request.params.max_tokens is not None
        capacity = len(request.prompt_token_ids) + request.params.max_tokens
        return ContiguousKVCache(
            mc.num_layers, capacity, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )

    @torch.inference_mode()
    def _forward(
        self, token_ids: list[int], start: int, cache: ContiguousKVCache | None
    ) -> torch.Tensor:
        """Run the model on tokens at positions start.. ; return the last position's logits."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        hidden = self.model(ids, positions, cache)
        return self.model.compute_logits(hidden[-1])

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence, for comparing against a reference model."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        return self.model.compute_logits(self.model(ids, positions, None)).float()

    def weight_bytes(self) -> int:
        """Bytes of weights each decode step must read from memory at least once."""
        return self.model.decode_weight_bytes()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, numbers.Integral) for p in prompts):  # one prompt as token ids
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]
