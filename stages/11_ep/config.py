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
    kv_cache_bytes: int | None = None  # per rank; None: a share of free memory (kv_memory_budget)
    max_num_seqs: int | None = None  # most requests in one batch; None: per device (see engine)
    max_num_batched_tokens: int | None = None  # tokens per forward; None with chunked
    # prefill: 256 on a CPU, 2,048 on a GPU (devices.default_max_num_batched_tokens); else
    # max(2048, context)
    scheduling: Literal["continuous", "static"] = "continuous"  # static: stage 03's batches
    async_scheduling: bool = True  # overlap step t+1's host work with step t's forward
    chunked_prefill: bool = True  # split long prompts across steps under the token budget
    long_prefill_token_threshold: int | None = None  # most tokens one request gets per step
    prefix_caching: bool = True  # share the K/V of full blocks that requests have in common
    # Speculative decoding: None (off), "ngram" (prompt lookup) or "draft" (the target's first
    # draft_num_layers layers as the draft model). Speculation runs steps synchronously.
    speculative: Literal["ngram", "draft"] | None = None
    num_speculative_tokens: int = 3  # most draft tokens per request per step (k)
    prompt_lookup_min: int = 2  # n-gram drafter: shortest suffix worth matching
    prompt_lookup_max: int = 4  # ... and the longest tried first
    draft_num_layers: int = 4  # draft drafter: how many of the target's layers it runs
    attention_backend: Literal["auto", "triton", "torch"] = "auto"  # auto: triton on cuda
    # Tensor parallelism: the model's heads, MLP columns and vocabulary split over this many
    # ranks (processes; with NCCL one GPU each). 1: stage 08, one process.
    tensor_parallel_size: int = 1
    # auto: $STAGES_DIST_BACKEND, else nccl on cuda, gloo on cpu; gloo lets ranks share a GPU
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    ranks_per_device: int | None = None  # ranks splitting a device's free memory; None: counted
    distributed_timeout_seconds: float = 120.0  # the longest one rank waits on another
    # Data parallelism: record the prefix cache's stored/evicted block keys (block_pool.KVEvent)
    # for a cache-aware router (frontend/router.py). False: nothing is recorded, stage 09.
    kv_events: bool = False
    # Data parallelism: this many engine-core processes (replicas) behind one front end
    # (frontend/dp_client.py), each with its own KV cache; a router picks the replica per request.
    # 1: stage 09, the engine in the server's process.
    data_parallel_size: int = 1
    routing_policy: Literal["round_robin", "least_loaded", "cache_aware"] = "cache_aware"
    # Expert parallelism: the tensor_parallel_size ranks split the MoE layers' experts instead
    # of the matrices; attention is replicated on every rank (moe/layer.py says why). False: stage
    # 10.
    expert_parallel: bool = False
    moe_dispatch: Literal["all_to_all", "all_gather"] = "all_to_all"  # how tokens reach experts
    # Run a dense model's MLP as this many experts of equal column slices (None: off); routed
    # to moe_top_k of them (None: the checkpoint's top-k, or all when split) with weight 1.
    moe_split_experts: int | None = None
    moe_top_k: int | None = None

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
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be positive (or None)")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(
                f"speculative must be None, 'ngram' or 'draft', got {self.speculative!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.draft_num_layers < 1:
            raise ValueError("draft_num_layers must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if not self.distributed_timeout_seconds > 0:
            raise ValueError("distributed_timeout_seconds must be positive")
        if self.distributed_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(
                "distributed_backend must be 'auto', 'nccl' or 'gloo', "
                f"got {self.distributed_backend!r}"
            )
        if self.distributed_backend == "nccl" and str(self.device).startswith("cpu"):
            raise ValueError("distributed_backend='nccl' needs CUDA; on a CPU use 'gloo' or 'auto'")
        if self.ranks_per_device is not None and self.ranks_per_device < 1:
            raise ValueError(f"ranks_per_device must be at least 1, got {self.ranks_per_device}")
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        if self.routing_policy not in ("round_robin", "least_loaded", "cache_aware"):
            raise ValueError(
                "routing_policy must be 'round_robin', 'least_loaded' or 'cache_aware', "
                f"got {self.routing_policy!r}"
            )
        if self.moe_dispatch not in ("all_to_all", "all_gather"):
            raise ValueError(
                f"moe_dispatch must be 'all_to_all' or 'all_gather', got {self.moe_dispatch!r}"
            )
        if self.moe_split_experts is not None and self.moe_split_experts < 1:
            raise ValueError("moe_split_experts must be at least 1 (or None)")
        if self.moe_top_k is not None and self.moe_top_k < 1:
            raise ValueError("moe_top_k must be at least 1 (or None)")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
