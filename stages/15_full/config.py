"""Engine configuration: one frozen dataclass, validated once, shared by every component."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from stages.common.devices import default_async_scheduling
from stages.common.weights import DEFAULT_MODEL

from .config_checks import check_cuda_graphs, check_disaggregation, check_quantization, device_type
from .presets import preset_settings


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
    # Overlap step t+1's host work with step t's forward (stage 05). None: per device, on with
    # CUDA and off on a CPU, where the forward shares the host's cores and the overlap gains
    # nothing (devices.default_async_scheduling says what was measured).
    async_scheduling: bool | None = None
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
    # KV offloading: a host-memory tier of this many bytes per rank behind the device pool
    # (offload/connector.py). Cached blocks the device pool evicts are stored there under their
    # content key and loaded back on a later prefix hit. 0: no host tier, stage 11.
    kv_offload_bytes: int = 0
    # What preemption does with the victim's KV: "recompute" discards it (stage 04); "swap"
    # stores it in the host tier and loads it back when the victim resumes.
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Disaggregated prefill and decode (disagg/connector.py). "both": stage 12, this engine
    # prefills and decodes. "prefill": a request marked do_remote_decode keeps its prompt's KV
    # for a decode engine; "decode": a request marked do_remote_prefill receives it from a
    # prefill engine. Plain requests run whole in either role.
    kv_role: Literal["both", "prefill", "decode"] = "both"
    # The gloo pair's TCP store: tcp://host:port (the decode engine serves it) or store://host:port
    # (another process does: DisaggClient, which leaves this None and serves one of its own)
    kv_transfer_address: str | None = None
    kv_transfer_timeout_seconds: float = 30.0  # longest a transfer may take, from its start
    kv_lease_seconds: float = 30.0  # prefill holds computed KV this long for decode to pull
    # A failed or timed-out transfer: compute the prompt on the decode engine, or fail it.
    kv_transfer_on_failure: Literal["local_prefill", "fail"] = "local_prefill"
    # Serving: one prefill and one decode engine core behind the front end
    # (frontend/disagg_client.py) instead of one engine. False: stage 12.
    disaggregated: bool = False
    # Serving: the engine in an engine-core process of its own behind the HTTP front end, as
    # vLLM V1 runs it (frontend/dp_client.py with one replica): tokenizing, detokenizing and
    # the event loop no longer share the engine's process and its GIL (1-stream inter-token
    # latency 29.0 -> 23.9 ms, 32 streams 238 -> 307 tok/s: README, 'Served as fast as
    # offline'). False: the engine on a thread of the server's process (stages 02-14).
    engine_core_process: bool = True
    # Quantization (quant/linear.py): the decoder's linear weights as INT8 per channel, INT4 in
    # groups of quant_group_size along the input (symmetric, or "int4-asym" with an offset), or
    # FP8 e4m3 per channel, quantized per rank after loading. "none": stage 13, fp32 weights.
    # "auto" (stage 15): the fastest format that keeps the model's outputs on this device,
    # chosen once the weights are loaded (quant/auto.py; INT4-asym g32 with bf16 activations
    # for a Q4_1-converted checkpoint on an AVX-512 bf16 CPU, fp32 elsewhere).
    quantization: Literal["auto", "none", "int8", "int4", "int4-asym", "fp8"] = "auto"
    quant_group_size: int = 32  # INT4 only: 32, 64 or 128; must divide each layer's input
    # "bf16": the quantized matmuls may round activations to bf16, which torch's fused CPU
    # INT8/INT4 ops need to be fast (with fp32 they fall back to a scalar loop).
    quant_activations: Literal["fp32", "bf16"] = "fp32"
    # The KV cache's element type: "auto" is the model's dtype (stage 13); "int8" / "fp8" store
    # one byte per element with a scale per (block, KV head), ~4x the fp32 blocks
    # (quant/kv_cache.py).
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    # CUDA graphs (cuda_graphs.py): replay each pure decode step from a graph captured per
    # batch-size bucket, one launch instead of hundreds. None: on with CUDA wherever the engine
    # can be captured, off elsewhere; True where it cannot is an error; False: stage 14, eager.
    cuda_graphs: bool | None = None
    # The largest decode batch given a graph (vLLM's max_cudagraph_capture_size); larger ones
    # run eagerly. None: max_num_seqs, at most 512. Each bucket costs a capture at start.
    cuda_graph_max_batch: int | None = None
    # Speculation is optional work: while more requests than this run, the scheduler gives
    # them no drafts (vLLM's speculative_disable_by_batch_size). None: drafts at any batch.
    speculative_disable_batch_size: int | None = None
    # A deployment preset (presets.py: chatbot, api, long-context, moe) fills the fields the
    # caller did not pass. None: every field as given (stage 14).
    preset: str | None = None

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
        if self.speculative_disable_batch_size is not None and (
            self.speculative_disable_batch_size < 0
        ):
            raise ValueError("speculative_disable_batch_size must be >= 0 (or None)")
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
        if not isinstance(self.kv_offload_bytes, int) or self.kv_offload_bytes < 0:
            raise ValueError(
                f"kv_offload_bytes must be a whole number of bytes >= 0, got "
                f"{self.kv_offload_bytes!r} (0: no host tier)"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not self.kv_offload_bytes:
            raise ValueError(
                "preemption_mode='swap' needs a host tier to swap to: set kv_offload_bytes > 0 "
                "(bytes of host memory per rank), or use preemption_mode='recompute'"
            )
        check_disaggregation(self)
        check_quantization(self)
        check_cuda_graphs(self)
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")

    @staticmethod
    def _apply_preset(given: dict[str, Any]) -> dict[str, Any]:
        """The caller's keyword arguments plus, for each field the caller did not pass, the
        preset's value (`given["preset"]`; none: `given` as it is). Only what was passed counts,
        never what a value looks like: `preset="chatbot", speculative=None` turns speculation
        off, though None is the default. `dataclasses.replace` passes every field, so a
        replaced config keeps its values and the preset is not applied twice."""
        name = given.get("preset")
        if name is None:
            return given
        return preset_settings(name, torch.device(device_type(given.get("device")))) | given


def with_device_defaults(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with the fields it leaves to the device decided for `device` (the engine calls
    it once the device is resolved): `async_scheduling`, on with CUDA and off on a CPU
    (`devices.default_async_scheduling` says what was measured)."""
    if config.async_scheduling is not None:
        return config
    return replace(config, async_scheduling=default_async_scheduling(device))


def resolution_notes(config: EngineConfig) -> dict[str, str]:
    """What the engine decides from a configuration that no field of it says, by field: shown
    beside the resolved configuration in /health, so that a switch turned off by a rule (not by
    the caller) says why."""
    notes: dict[str, str] = {}
    limit = config.speculative_disable_batch_size
    if config.speculative and limit is None:
        notes["async_scheduling"] = (
            f"off: speculative={config.speculative!r} runs steps one at a time (a step's drafts "
            "need the step before it on the host)"
        )
    elif config.async_scheduling is False:  # None: not resolved yet (the engine does)
        notes["async_scheduling"] = (
            "off; on a CPU that is the default: the forward runs on the host's own cores, so "
            "the overlap gains nothing (async_scheduling=True turns it on)"
            if device_type(config.device) == "cpu"
            else "off, as asked"
        )
    elif config.speculative:
        notes["async_scheduling"] = (
            f"off while at most {limit} requests run: those steps get drafts "
            f"(speculative={config.speculative!r}), and a step's drafts need the step before it "
            "on the host; above it no drafts, and steps overlap"
        )
    if config.speculative and limit is not None:
        notes["speculative_disable_batch_size"] = f"no drafts while more than {limit} requests run"
    return notes


# The generated __init__ sees values, not which arguments were passed: wrap it, so that the
# preset fills exactly the fields the caller left out (EngineConfig._apply_preset).
_DATACLASS_INIT = EngineConfig.__init__
_INIT_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.init)


@functools.wraps(_DATACLASS_INIT)
def _init_with_preset(self: EngineConfig, *args: Any, **kwargs: Any) -> None:
    positional = dict(zip(_INIT_FIELDS, args, strict=False))
    if len(args) > len(_INIT_FIELDS) or positional.keys() & kwargs.keys():
        _DATACLASS_INIT(self, *args, **kwargs)  # the dataclass's own TypeError
    given = positional | kwargs
    if given.get("preset") is not None:  # no preset: nothing to fill (and no call to make)
        given = EngineConfig._apply_preset(given)
    _DATACLASS_INIT(self, **given)


EngineConfig.__init__ = _init_with_preset  # type: ignore[method-assign]
