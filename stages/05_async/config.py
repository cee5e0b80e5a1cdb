"""Engine configuration: one frozen dataclass, validated once, shared by every component."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stages.common.weights import DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build the engine.

    `kv_layout="contiguous"` reserves one `max_model_len`-token region per request instead of
    blocks, the way a cache without paging must: it exists so the benchmark can compare the two.
    (Stage 01's `use_kv_cache=False` recompute mode is gone: paged attention needs a cache.)
    """

    model: str = DEFAULT_MODEL
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # seeds requests that bring no seed of their own
    served_model_name: str | None = None  # the name the HTTP API answers to
    linear_backend: str = "auto"  # auto: oneDNN-packed weights on CPU, F.linear elsewhere
    kv_layout: Literal["paged", "contiguous"] = "paged"
    block_size: int = 16  # tokens per KV block (a power of two)
    kv_cache_bytes: int | None = None  # None: a share of free memory (devices.kv_memory_budget)
    max_num_seqs: int | None = None  # most requests in one batch; None: per device (see engine)
    max_num_batched_tokens: int | None = None  # tokens per forward; None: max(2048, context)
    scheduling: Literal["continuous", "static"] = "continuous"  # static: stage 03's batches
    async_scheduling: bool = True  # overlap step t+1's host work with step t's forward
    attention_backend: Literal["auto", "triton", "torch"] = "auto"  # auto: triton on cuda

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(
                f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
