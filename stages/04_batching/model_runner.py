"""The model runner: the only part of the engine that touches the model and its KV cache.

    SchedulerOutput (plain data) --prepare_inputs--> flat tensors + AttentionMetadata
                                 --execute_model---> forward, logits, sampling --> token ids

The split is nano-vllm's and vLLM V1's (`ModelRunner`, `GPUModelRunner`): the scheduler decides
*what* runs, the runner decides *how*. Everything the runner needs comes in the scheduler's
output, so a later stage can run it in another process (a tensor-parallel worker) or overlap it
with the scheduling of the next step (async scheduling) without touching the scheduler.

Here the cache is one pool of blocks, sized from a memory budget when the runner starts. The
scheduler sends each request's block table; the runner turns it into the batch's block-table
tensor and the slot mapping that says where each new token's K/V go.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.devices import kv_memory_budget
from stages.common.linear import resolve_linear_backend
from stages.common.model_config import ModelConfig

from .config import EngineConfig
from .kernels import resolve_attention_backend
from .kv_cache import PagedKVCache, num_blocks_for_budget, slot_mapping
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
    logits_indices: torch.Tensor  # rows whose logits are sampled (a sequence's last new token)
    sampling: SamplingTensors
    sampled_request_ids: tuple[str, ...]  # whose token each sampled row is


class ModelRunner:
    """Owns the model and the paged KV pool; runs one scheduled step at a time."""

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
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        assert config.max_model_len is not None  # the engine resolves it
        self.model: CausalLM = load_model(
            model_path, model_config, device, dtype, config.max_model_len, self.linear_backend
        )
        self.kv_cache = self._allocate_kv_cache(config, config.max_model_len)
        self.num_blocks, self.block_size = self.kv_cache.num_blocks, self.kv_cache.block_size

    def _allocate_kv_cache(self, config: EngineConfig, max_model_len: int) -> PagedKVCache:
        """Size the block pool from the memory budget, not from requests' maximum lengths."""
        mc = self.model_config
        # A contiguous reservation is one block of max_model_len tokens per request.
        block_size = max_model_len if config.kv_layout == "contiguous" else config.block_size
        per_block = PagedKVCache.bytes_per_block(
            mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        budget = config.kv_cache_bytes or kv_memory_budget(self.device)
        useful = config.max_num_seqs * -(-max_model_len // block_size)  # more would sit idle
        num_blocks = num_blocks_for_budget(budget, per_block, useful)
        return PagedKVCache(
            mc.num_layers, num_blocks, block_size, mc.num_kv_heads, mc.head_dim,
            self.dtype, self.device,
        )  # fmt: skip

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Pack every scheduled request's new tokens end to end, with the metadata attention
        needs to find each sequence's cached K/V through its block table."""
        requests = scheduler_output.requests
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for r in requests:
            start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
            ids += r.token_ids
            positions += range(start, end)
            slots += slot_mapping(r.block_ids, start, end, self.block_size)
            if r.sample:
                logits_rows.append(len(ids) - 1)
        query_lens = [r.num_new_tokens for r in requests]
        context_lens = [r.num_computed_tokens for r in requests]
        seq_lens = [r.num_computed_tokens + r.num_new_tokens for r in requests]
        width = max(len(r.block_ids) for r in requests)
        tables = [list(r.block_ids) + [0] * (width - len(r.block_ids)) for r in requests]
        meta = AttentionMetadata(
            query_start_loc=self._tensor([0, *itertools.accumulate(query_lens)], torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            slot_mapping=self._tensor(slots),
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            attention_backend=self.attention_backend,
        )
        sampled = [r for r in requests if r.sample]
        return ModelInputs(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            attn_metadata=meta,
            logits_indices=self._tensor(logits_rows),
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
        if not scheduler_output.requests:
            return {}
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata)
        if not inputs.sampled_request_ids:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = sample(logits, inputs.sampling).tolist()  # the step's one device-to-host copy
        return dict(zip(inputs.sampled_request_ids, tokens, strict=True))

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence (teacher forcing), for comparing against a
        reference model. Writes nothing to the cache."""
        n = len(token_ids)
        meta = AttentionMetadata(
            query_start_loc=self._tensor([0, n], torch.int32),
            seq_lens=self._tensor([n], torch.int32),
            block_tables=None,
            slot_mapping=None,
            query_lens=(n,),
            context_lens=(0,),
            attention_backend=self.attention_backend,
        )
        ids, positions = self._tensor(token_ids), torch.arange(n, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, None, meta)).float()

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
