"""Stage 14's quantized KV cache writes and reads a layer without a host sync.

Every layer writes the step's K/V (`QuantizedPagedKVCache.write`) and reads the step's blocks
(`step_blocks`). A `nonzero`, a boolean-mask index or a `torch.unique` there makes the host wait
for the GPU once per layer (their output sizes depend on the values). The write's growth and
the renumbering are computed with fixed-size device ops instead; this file checks that they
give exactly what the data-dependent version gave (`_write_with_nonzero`, the old code, kept
here as the oracle), and that nothing reads values on the host (tests/host_syncs.py on the CPU,
`set_sync_debug_mode("error")` on CUDA). A Python number stored into one element of a device
tensor (`source[i] = 0`) is a blocking host-to-device copy: the first GPU run caught one in
`step_blocks`, and the CPU detector now counts it.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from .conftest import requires_cuda, since, unit
from .host_syncs import record_host_syncs

pytestmark = [since("14"), unit("quant/kv_cache.py")]

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 16, 2, 64


def _kvq(stage):
    return importlib.import_module(f"{stage.__name__}.quant.kv_cache")


def _write_with_nonzero(kvq, cache, codes, scales, x, slots) -> None:
    """The write as stage 14 first had it (a nonzero per call): the equality oracle."""
    blocks, offsets = slots // cache.block_size, slots % cache.block_size
    scales[blocks[offsets == 0]] = 0.0
    token_amax = x.float().abs().amax(dim=-1)
    rows = blocks[:, None].expand_as(token_amax)
    block_amax = torch.zeros_like(scales).scatter_reduce_(0, rows, token_amax, "amax")
    needed = block_amax / kvq._qmax(cache.fmt)
    grow_block, grow_head = torch.nonzero(needed > scales, as_tuple=True)
    if grow_block.numel():
        old = scales[grow_block, grow_head][:, None, None]
        new = kvq._raised(old, needed[grow_block, grow_head][:, None, None])
        values = kvq._decode(codes[grow_block, :, grow_head, :], cache.fmt) * old
        codes[grow_block, :, grow_head, :] = kvq._encode(values / new, cache.fmt)
        scales[grow_block, grow_head] = new[:, 0, 0]
    token_scale = scales[blocks].clamp(min=kvq._TINY)[..., None]
    codes.view(-1, *codes.shape[2:])[slots] = kvq._encode(x.float() / token_scale, cache.fmt)


def _writes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step-like sequence of writes: prompts in chunks across blocks, decodes one token at a
    time with growing values (the scale grows), and a freed block begun again at offset 0."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for slots, scale in [
        ([*range(2 * 16, 2 * 16 + 21), *range(5 * 16, 5 * 16 + 7)], 1.0),  # two prompts
        ([2 * 16 + 21, 5 * 16 + 7], 3.0),  # decodes that widen the range
        ([*range(2 * 16 + 22, 2 * 16 + 26), 5 * 16 + 8], 0.5),
        ([*range(5 * 16 + 9, 6 * 16), *range(3 * 16, 3 * 16 + 3)], 9.0),  # into a new block
        ([5 * 16, 5 * 16 + 1], 0.01),  # block 5 freed and begun again
    ]:
        x = torch.randn(len(slots), HEADS, DIM, generator=gen) * scale
        steps.append((x, torch.tensor(slots)))
    return steps


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_write_equals_the_nonzero_version_bit_for_bit(stage, fmt):
    kvq = _kvq(stage)
    cache = kvq.QuantizedPagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, DIM, fmt)
    oracle = kvq.QuantizedPagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, DIM, fmt)
    for x, slots in _writes(seed=1):
        cache.write(1, x, x * 0.5, slots)
        _write_with_nonzero(kvq, oracle, oracle.k[1], oracle.k_scale[1], x, slots)
        _write_with_nonzero(kvq, oracle, oracle.v[1], oracle.v_scale[1], x * 0.5, slots)
        for mine, theirs in zip(kvq.block_tensors(cache), kvq.block_tensors(oracle), strict=True):
            assert torch.equal(mine, theirs)
    assert cache.k_scale[1, 5].max() < 0.01, "block 5 was begun again: its range forgotten"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_the_write_reads_nothing_on_the_host(stage, fmt):
    kvq = _kvq(stage)
    cache = kvq.QuantizedPagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, DIM, fmt)
    with record_host_syncs() as calls:
        for x, slots in _writes(seed=2):
            cache.write(0, x, x, slots)
    assert calls == []


def test_the_detector_sees_a_number_stored_into_one_element():
    """`x[i] = 0` on a CUDA tensor copies a host scalar in, a blocking copy: stage 14's
    `step_blocks` did it per layer (`source[num_used] = 0`). A slice or a fill stays on the
    device, and so does a number stored through a tensor of indices."""
    x, grid = torch.zeros(6, dtype=torch.long), torch.zeros(3, 4)
    with record_host_syncs() as calls:
        x[5:].zero_(), x[2:3].fill_(1)
        x[4:] = 0
        grid[1] = 2.0  # a row: filled on the device
        grid[:, 0] = 1.0
        x[torch.tensor([1, 2])] = 7
        x[3] = x[2]  # a device tensor stored: a device copy
    assert calls == []
    with record_host_syncs() as calls:
        x[5] = 0
        grid[1, 2] = 3.0
        grid[-1, 0] = True
    assert calls == ["scalar into one element"] * 3


def test_step_blocks_reads_nothing_on_the_host(stage):
    kvq = _kvq(stage)
    cache = kvq.QuantizedPagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, DIM, "int8")
    tables = torch.tensor([[5, 2, 0], [1, 7, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    with record_host_syncs() as calls:
        cache.step_blocks(0, tables)
        cache.step_blocks(0, tables, torch.float32, seq_lens, 3)
    assert calls == []


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_step_blocks_with_lengths_holds_the_blocks_in_use_and_reads_the_same(stage, fmt):
    """Given the sequences' lengths (and their block count, a host number), the pool holds each
    sequence's blocks in use and one spare row the padding entries point at; attention through
    it equals attention through the whole tables' pool."""
    kvq = _kvq(stage)
    kernels = importlib.import_module(f"{stage.__name__}.kernels")
    cache = kvq.QuantizedPagedKVCache(1, BLOCKS, BLOCK, HEADS, DIM, fmt)
    for x, slots in _writes(seed=3):
        cache.write(0, x, x, slots)
    tables = torch.tensor([[2, 3, 0], [5, 6, 0], [4, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([26, 32, 1], dtype=torch.int32)
    used = 2 + 2 + 1
    k_all, v_all, all_tables = cache.step_blocks(0, tables)
    k_used, v_used, used_tables = cache.step_blocks(0, tables, torch.float32, seq_lens, used)
    assert k_all.shape[0] == tables.numel() and k_used.shape[0] == used + 1
    assert used_tables.tolist() == [[0, 1, used], [2, 3, used], [4, used, used]]
    q = torch.randn(3, 4, DIM, generator=torch.Generator().manual_seed(0))
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    reference = kernels.unified_attention_reference
    expected = reference(q, k_all, v_all, starts, seq_lens, all_tables, 0.125)
    got = reference(q, k_used, v_used, starts, seq_lens, used_tables, 0.125)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@requires_cuda("torch.cuda.set_sync_debug_mode reports host syncs only there")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_cuda_kv_write_and_step_blocks_never_synchronise(stage, fmt):
    kvq = _kvq(stage)
    cache = kvq.QuantizedPagedKVCache(LAYERS, BLOCKS, BLOCK, HEADS, DIM, fmt, torch.device("cuda"))
    steps = [(x.cuda(), slots.cuda()) for x, slots in _writes(seed=4)]
    tables = torch.tensor([[2, 3, 0], [5, 6, 0]], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([26, 32], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, slots in steps:
            cache.write(0, x, x, slots)
        cache.step_blocks(0, tables, torch.bfloat16, seq_lens, 4)
        cache.step_blocks(0, tables, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
