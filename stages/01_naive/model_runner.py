"""The model runner: the only part of the engine that touches the model and its KV cache.

    SchedulerOutput (plain data) --prepare_inputs--> flat tensors + AttentionMetadata
                                 --execute_model---> forward, logits, sampling --> token ids

The split is nano-vllm's and vLLM V1's (`ModelRunner`, `GPUModelRunner`): the scheduler decides
*what* runs, the runner decides *how*. Everything the runner needs comes in the scheduler's
output, so a later stage can run it in another process (a tensor-parallel worker) or overlap it
with the scheduling of the next step (async scheduling) without touching the scheduler.

Here the cache is one contiguous buffer per request, created on the request's first step with
room for prompt + max_tokens and dropped when the scheduler reports the request gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig

from .config import EngineConfig
from .kv_cache import ContiguousKVCache
from .model import AttentionMetadata, CausalLM
from .model_loader import load_model
from .sampling import SamplingTensors, sample
from .scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """One forward's inputs, flat over the step's new tokens."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    kv_cache: ContiguousKVCache | None
    logits_indices: torch.Tensor  # rows whose logits are sampled (a sequence's last new token)
    sampling: SamplingTensors
    sampled_request_ids: tuple[str, ...]  # whose token each sampled row is


class ModelRunner:
    """Owns the model and the KV cache; runs one scheduled step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.device, self.dtype, self.model_config = device, dtype, model_config
        self.linear_backend = resolve_linear_backend(config.linear_backend, device, dtype)
        assert config.max_model_len is not None  # the engine resolves it
        self.model: CausalLM = load_model(
            model_path, model_config, device, dtype, config.max_model_len, self.linear_backend
        )
        self.kv_caches: dict[str, ContiguousKVCache] = {}  # request id -> its cache

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Turn the scheduled request into tensors. One sequence per step until stage 03."""
        (scheduled,) = scheduler_output.requests
        start, num_new = scheduled.num_computed_tokens, scheduled.num_new_tokens
        cache = None
        if scheduled.kv_capacity:
            cache = self.kv_caches.get(scheduled.request_id)
            if cache is None:  # first step: reserve the longest this request can grow
                mc = self.model_config
                cache = ContiguousKVCache(
                    mc.num_layers, scheduled.kv_capacity, mc.num_kv_heads, mc.head_dim,
                    self.dtype, self.device,
                )  # fmt: skip
                self.kv_caches[scheduled.request_id] = cache
        sampled = (scheduled,) if scheduled.sample else ()
        return ModelInputs(
            input_ids=self._tensor(list(scheduled.token_ids)),
            positions=torch.arange(start, start + num_new, device=self.device),
            attn_metadata=AttentionMetadata((0, num_new), seq_lens=(start + num_new,)),
            kv_cache=cache,
            logits_indices=self._tensor([num_new - 1] * len(sampled)),
            sampling=SamplingTensors.from_params(
                [r.params for r in sampled],
                [r.seed for r in sampled],
                [r.num_computed_tokens + r.num_new_tokens for r in sampled],  # sampled position
                self.model_config.vocab_size,
                self.device,
            ),
            sampled_request_ids=tuple(r.request_id for r in sampled),
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Run one step: forward the new tokens, sample. Returns request id -> sampled token."""
        for request_id in scheduler_output.finished_request_ids:
            self.kv_caches.pop(request_id, None)
        if not scheduler_output.requests:
            return {}
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.kv_cache, inputs.attn_metadata
        )
        if not inputs.sampled_request_ids:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = sample(logits, inputs.sampling).tolist()  # the step's one device-to-host copy
        return dict(zip(inputs.sampled_request_ids, tokens, strict=True))

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence (teacher forcing), for comparing against a
        reference model. Uses no cache."""
        n = len(token_ids)
        meta = AttentionMetadata(query_start_loc=(0, n), seq_lens=(n,))
        ids, positions = self._tensor(token_ids), torch.arange(n, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, None, meta)).float()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
