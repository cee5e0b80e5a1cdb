"""CUDA graphs in the model runner: whether to use them, capturing them at start, and the
bucket each step replays (the graphs themselves: cuda_graphs.py).

The runner captures the decode forward at start, one graph per batch-size bucket over the same
persistent buffers. `prepare_inputs` pads a pure decode step up to its bucket (padding rows
write to a scratch block, one more than the scheduler's pool) and `_forward_and_sample`
replays the graph instead of running the model.
"""

from __future__ import annotations

import functools
import logging

import torch

from stages.common.devices import synchronize

from .config import EngineConfig
from .cuda_graphs import (
    DecodeGraphs,
    GraphPlan,
    capture_cuda_graph,
    capture_sizes,
    unsupported_reason,
)
from .input_buffers import InputBuffers
from .kv_cache import PagedKVCache
from .model import AttentionMetadata, CausalLM
from .parallel.layers import ParallelLMHead
from .quant.kv_cache import QuantizedPagedKVCache
from .scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def cuda_graphs_reason(
    config: EngineConfig,
    device: torch.device,
    attention_backend: str,
    tp_size: int,
    model: CausalLM,
) -> str | None:
    """Why decode graphs cannot run with what this runner holds (its device, attention backend,
    parallelism, checkpoint and KV cache type); None when they can."""
    return unsupported_reason(
        device_type=device.type,
        attention_backend=attention_backend,
        tensor_parallel_size=tp_size,
        expert_parallel=config.expert_parallel,
        moe=bool(model.config.moe_layers),
        kv_cache_dtype=config.kv_cache_dtype,
    )


@torch.inference_mode()
def capture_decode_graphs(
    config: EngineConfig,
    model: CausalLM,
    kv_cache: PagedKVCache | QuantizedPagedKVCache,
    buffers: InputBuffers,
    attention_backend: str,
    scratch_block: int,
) -> DecodeGraphs:
    """Capture each bucket's decode forward over the persistent input buffers, which first
    get padding rows only: warming up and capturing write nothing but the scratch block."""
    assert config.max_num_seqs is not None and config.max_model_len is not None
    largest = min(config.max_num_seqs, buffers.device_tensors["input_ids"].numel())
    largest = min(largest, config.cuda_graph_max_batch or largest)
    plan = GraphPlan(
        sizes=capture_sizes(largest),
        max_blocks=-(-config.max_model_len // kv_cache.block_size),
        block_size=kv_cache.block_size,
        scratch_block=scratch_block,  # the block past the scheduler's pool
    )
    staged, _ = buffers.stage(plan.idle_values(plan.sizes[-1]))
    buffers.copy_to_device(staged)
    synchronize(buffers.device)
    forward = functools.partial(graph_forward, model, kv_cache, buffers, attention_backend, plan)
    graphs = DecodeGraphs(plan, forward, buffers.device_tensors, capture_cuda_graph)
    graphs.capture()
    logger.info("captured %d decode graphs, batch 1 to %d", len(plan.sizes), largest)
    return graphs


def graph_forward(
    model: CausalLM,
    kv_cache: PagedKVCache | QuantizedPagedKVCache,
    buffers: InputBuffers,
    attention_backend: str,
    plan: GraphPlan,
    size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The captured forward: the model and its LM head over the first `size` rows of the
    buffers, one new token each: [size, vocab] logits, written into `out[:size]` when `out` is
    given and the LM head is a plain matrix (`lm_head_into`). The host-side lengths are the
    same for every step (the kernel reads the real ones from the device tensors), so the graph
    depends on device memory only."""
    t, width = buffers.device_tensors, plan.max_blocks
    meta = AttentionMetadata(
        query_start_loc=t["query_start_loc"][: size + 1],
        seq_lens=t["seq_lens"][:size],
        block_tables=t["block_tables"][: size * width].view(size, width),
        slot_mapping=t["slot_mapping"][:size],
        query_lens=(1,) * size,
        context_lens=(plan.max_context,) * size,
        attention_backend=attention_backend,
    )
    hidden = model(t["input_ids"][:size], t["positions"][:size], kv_cache, meta)
    if out is not None and lm_head_into(model.lm_head, hidden, out):
        return out[:size]
    return model.lm_head(hidden)  # `compute_logits`, inside the graph (tensor parallelism 1)


def lm_head_into(head: torch.nn.Module, hidden: torch.Tensor, out: torch.Tensor) -> bool:
    """Write `head(hidden)` into `out[:rows]` with one matmul and say so, where the head is a
    plain unsharded, unpacked matrix without bias in `out`'s dtype (the graph path's usual
    case); False, writing nothing, for any other head (quantized, packed for oneDNN, sharded),
    which the caller runs as it is."""
    weight = getattr(head, "weight", None)
    plain = (
        type(head) is ParallelLMHead
        and head.tp.size == 1
        and head.packed_weight is None
        and head.bias is None
        and isinstance(weight, torch.Tensor)
        and weight.dtype == out.dtype == hidden.dtype
        and out.device == hidden.device
    )
    if plain:
        torch.mm(hidden, weight.t(), out=out[: hidden.shape[0]])
    return plain


def graph_bucket(graphs: DecodeGraphs | None, scheduler_output: SchedulerOutput) -> int | None:
    """The bucket whose graph this step replays; None: it runs eagerly."""
    if graphs is None or not graphs.usable():
        return None
    requests = scheduler_output.requests
    return graphs.plan.bucket(
        [r.num_new_tokens for r in requests],
        [r.num_draft_tokens for r in requests],
        [len(r.block_ids) for r in requests],
        [r.sample for r in requests],
    )
