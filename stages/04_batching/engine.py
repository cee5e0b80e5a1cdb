"""The continuously batched engine: a scheduler decides every step who runs.

    step:  scheduler.schedule()  -> prefills + decodes, KV slots allocated (scheduler.py)
           one flat forward      -> [prompt tokens of each prefill | one token per decode]
           sample, append        -> finished requests leave at once, freeing their blocks

The engine is driven step by step (`add_request`, `step`, `abort_request`, as vLLM's engine
is): each `step` runs one forward. New requests join the very next step if there is room;
when the block pool runs out, the scheduler preempts and later recomputes. With
`scheduling="static"` the same engine runs stage 03's batches, for comparison.
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

from stages.common.devices import resolve_device, resolve_dtype, synchronize
from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig
from stages.common.tokenizer import Message, Tokenizer
from stages.common.weights import DEFAULT_MODEL, EMBEDDED_ALIASES, resolve_model

from .config import EngineConfig
from .kernels import resolve_attention_backend
from .kv_cache import KVCacheManager, PagedKVCache
from .model import AttentionMetadata, CausalLM, load_model
from .request import FINISH_ABORT, Request, RequestOutput
from .sampling import SamplingParams, make_generator, sample_next_tokens, sampling_params_list
from .scheduler import ScheduledBatch, Scheduler

CPU_KV_BUDGET_CAP = 1 << 30  # on a CPU the pool shares RAM with everything else: 1 GiB at most

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
        self.attention_backend = resolve_attention_backend(
            self.config.attention_backend, self.device
        )
        self._init_kv_cache()
        self.max_num_batched_tokens = self.config.max_num_batched_tokens or max(
            2048, self.max_model_len
        )
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}): a whole prompt runs in one forward"
            )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy=self.config.scheduling,
        )
        self.load_seconds = time.perf_counter() - started

    def _init_kv_cache(self) -> None:
        """Size the block pool from the memory budget, not from requests' maximum lengths."""
        mc, cfg = self.model_config, self.config
        # A contiguous reservation is one block of max_model_len tokens per request.
        self.block_size = self.max_model_len if cfg.kv_layout == "contiguous" else cfg.block_size
        per_block = PagedKVCache.bytes_per_block(
            mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        budget = cfg.kv_cache_bytes or kv_budget(self.device)
        useful = cfg.max_num_seqs * -(-self.max_model_len // self.block_size)  # more is idle
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise kv_cache_bytes or lower block_size / max_model_len"
            )
        self.kv_cache = PagedKVCache(
            mc.num_layers, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim,
            self.dtype, self.device,
        )  # fmt: skip
        self.kv_manager = KVCacheManager(num_blocks, self.block_size)

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
        return self.run_all(requests)

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
        return self.run_all(requests)

    def run_all(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Submit every request, step until all are done, return outputs in order."""
        for request in requests:
            self.add_request(request)
        while any(not r.finished for r in requests):
            self.step()
        return [request.output() for request in requests]

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
        self.check_fits(len(prompt_ids), params)
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

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """A request whose worst case needs more blocks than the whole pool can never run."""
        assert params.max_tokens is not None
        need = self.kv_manager.blocks_needed(prompt_len + params.max_tokens)
        have = self.kv_manager.allocator.num_blocks
        if need > have:
            raise ValueError(
                f"request can never fit in the KV cache: prompt + max_tokens needs {need} "
                f"blocks of {self.block_size} tokens, the cache has {have}"
            )

    def run(self, request: Request) -> RequestOutput:
        """Generate a request to completion and return its final output."""
        output = request.output()
        for output in self.stream(request):  # noqa: B007 (we want the last one)
            pass
        return output

    def stream(self, request: Request) -> Iterator[RequestOutput]:
        """Generate one request, yielding a snapshot after every token it gets.

        Other requests in the engine advance too. Closing the iterator early aborts it.
        """
        self.add_request(request)
        try:
            while not request.finished:
                for output in self.step():
                    if output.request_id == request.request_id:
                        yield output
        finally:
            if not request.finished:
                self.abort_request(request.request_id)

    # ----------------------------------------------------------------------- step API
    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Request]:
        return list(self.scheduler.running)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request early, returning its blocks; None if it is not in the engine."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.finish(FINISH_ABORT)
        return request.output()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, and return the outputs of every request that got a
        token."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        tokens = self._run_batch(batch)
        outputs = []
        for request, token in zip(batch.requests, tokens, strict=True):
            request.append_token(token)
            outputs.append(request.output())
            if request.finished:  # leaves now; its blocks serve the very next step
                self.scheduler.finish(request)
        return outputs

    # ----------------------------------------------------------------------- internals
    def _run_batch(self, batch: ScheduledBatch) -> list[int]:
        """One forward over the flat batch: every prefill's tokens back to back, then one token
        per decode. Returns one sampled token per request, in `batch.requests` order."""
        ids, positions, slots, prefill_lens = [], [], [], []
        for request in batch.prefills:  # whole prompt (plus output, after a preemption)
            tokens = request.all_token_ids
            ids += tokens
            positions += range(len(tokens))
            slots += batch.slots[request.request_id]
            prefill_lens.append(len(tokens))
        for request in batch.decodes:  # the newest token of each running request
            ids.append(request.all_token_ids[-1])
            positions.append(request.num_tokens - 1)
            slots += batch.slots[request.request_id]
        block_tables = context_lens = None
        if batch.decodes:
            width = max(len(r.block_ids) for r in batch.decodes)
            block_tables = self._tensor(
                [r.block_ids + [0] * (width - len(r.block_ids)) for r in batch.decodes],
                torch.int32,
            )
            context_lens = self._tensor([r.num_tokens for r in batch.decodes], torch.int32)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            prefill_lens=tuple(prefill_lens),
            block_tables=block_tables,
            context_lens=context_lens,
            attention_backend=self.attention_backend,
        )
        prefill_ends = list(itertools.accumulate(prefill_lens))
        rows = [end - 1 for end in prefill_ends]
        first_decode = prefill_ends[-1] if prefill_ends else 0
        rows += range(first_decode, first_decode + len(batch.decodes))
        return self._sample(batch.requests, ids, positions, meta, rows)

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def _sample(
        self,
        batch: list[Request],
        ids: list[int],
        positions: list[int],
        meta: AttentionMetadata,
        rows: list[int],
    ) -> list[int]:
        """Forward the flat batch, then sample one token per request from the given rows."""
        hidden = self.model(self._tensor(ids), self._tensor(positions), self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[rows])
        tokens = sample_next_tokens(logits, [r.params for r in batch], [r.generator for r in batch])
        synchronize(self.device)
        return tokens

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence, for comparing against a reference model."""
        ids = self._tensor(token_ids)
        positions = torch.arange(len(token_ids), device=self.device)
        meta = AttentionMetadata(slot_mapping=None, prefill_lens=(len(token_ids),))
        return self.model.compute_logits(self.model(ids, positions, None, meta)).float()

    def weight_bytes(self) -> int:
        """Bytes of weights each decode step must read from memory at least once."""
        return self.model.decode_weight_bytes()


def kv_budget(device: torch.device) -> int:
    """Default KV memory: half of what is free on a GPU once the weights are loaded (vLLM
    reserves a fraction the same way); on a CPU, a tenth of available RAM, at most 1 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        with open("/proc/meminfo") as handle:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return min(CPU_KV_BUDGET_CAP, available // 10)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, numbers.Integral) for p in prompts):  # one prompt as token ids
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]
