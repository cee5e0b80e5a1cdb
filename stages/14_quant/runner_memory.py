"""The model runner's device memory, sized once when it starts: the KV block pool and the
persistent input buffers.

Both are sized from the config, never from the requests that happen to arrive: the KV pool from
a memory budget (what is left of the device after the weights), the input buffers from the
largest step the config allows. A request that fits the config then never needs a new
allocation in the middle of serving.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stages.common.devices import kv_memory_budget
from stages.common.model_config import ModelConfig

from .config import EngineConfig
from .input_buffers import InputBuffers
from .kv_cache import PagedKVCache, num_blocks_for_budget
from .parallel.group import TPGroup, local_kv_heads
from .quant.kv_cache import QuantizedPagedKVCache, kv_cache_block_bytes, make_kv_cache


def allocate_kv_cache(
    config: EngineConfig,
    mc: ModelConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPGroup,
    attention_tp: TPGroup,
) -> PagedKVCache | QuantizedPagedKVCache:
    """Size the block pool from the memory budget, not from requests' maximum lengths.

    With tensor parallelism a rank holds only its KV heads, and every rank must hold the same
    number of blocks (the scheduler hands out one block id for all of them): each rank sizes
    its pool, and all take the smallest. `kv_cache_bytes` is per rank; the default budget is
    a share of the device's free memory, split between the ranks that share the device (every
    rank of a CPU host; with gloo, the ranks on one GPU): `ranks_per_device`, which the
    executor counts. With expert parallelism attention is replicated (`attention_tp` of size
    1): every rank holds every KV head."""
    # A contiguous reservation is one block of max_model_len tokens per request.
    block_size = max_model_len if config.kv_layout == "contiguous" else config.block_size
    kv_heads = local_kv_heads(mc.num_kv_heads, attention_tp.size)
    per_block = kv_cache_block_bytes(  # stage 14: 1-byte codes for kv_cache_dtype int8/fp8
        config.kv_cache_dtype, mc.num_layers, block_size, kv_heads, mc.head_dim, dtype
    )
    budget = config.kv_cache_bytes or (kv_memory_budget(device) // (config.ranks_per_device or 1))
    useful = config.max_num_seqs * -(-max_model_len // block_size)  # more would sit idle
    num_blocks = num_blocks_for_budget(budget, per_block, useful)
    if tp.size > 1:  # the smallest pool of any rank
        count = torch.tensor([num_blocks], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.group)
        num_blocks = int(count.item())
    return make_kv_cache(
        config.kv_cache_dtype,
        mc.num_layers,
        num_blocks,
        block_size,
        kv_heads,
        mc.head_dim,
        dtype,
        device,
    )


def allocate_input_buffers(
    config: EngineConfig,
    block_size: int,
    device: torch.device,
    stream: torch.cuda.Stream | None,
) -> InputBuffers:
    """One persistent device buffer per input, sized for the largest step the config
    allows (the token budget, max_num_seqs requests, a full context of blocks each)."""
    assert config.max_model_len is not None
    tokens = config.max_num_batched_tokens or max(2048, config.max_model_len)
    seqs, blocks = config.max_num_seqs, -(-config.max_model_len // block_size)
    long, int32 = torch.long, torch.int32
    sizes = {
        "input_ids": (tokens, long),
        "positions": (tokens, long),
        "slot_mapping": (tokens, long),
        "logits_indices": (tokens, long),
        "query_start_loc": (seqs + 1, int32),
        "seq_lens": (seqs, int32),
        "block_tables": (seqs * blocks, int32),  # [requests, width], stored flat
        "placeholder_rows": (seqs, long),
        "placeholder_sources": (seqs, long),
        "draft_rows": (tokens, long),
        "verify_rows": (tokens, long),
    }
    # A CPU without the overlap runs each step before staging the next: one copy of the
    # inputs is enough, and the step reads it where the host wrote it.
    direct = device.type == "cpu" and not config.async_scheduling
    return InputBuffers(sizes, device, stream, direct)
