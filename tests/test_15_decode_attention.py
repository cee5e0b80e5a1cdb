"""Stage 15's split-K decode attention (flash-decoding) and the decode step with RoPE and the
K/V write folded into it (kernels.py): each equals the naive oracle of stage 03's attention
tests, or the two steps it replaces, and the dispatcher takes the split only for a long
decode-only batch that leaves the device idle."""

from __future__ import annotations

import importlib

import pytest
import torch

from .conftest import needs_triton, since, unit
from .test_03_attention import _batch, _decodes, _kernels, _oracle

pytestmark = [since("15"), unit("kernels.py")]


# Split-K decodes (flash-decoding): heads, kv_heads, head_dim, block_size, context lengths.
SPLIT_CASES = {
    "batch1-gqa3-smollm-shape": (9, 3, 64, 16, [700]),
    "ragged-some-chunks-empty": (12, 3, 16, 8, [1, 33, 300, 64]),  # 1 position, 8 splits
    "gqa4-block1": (8, 2, 16, 1, [97, 5]),
    "odd-head-dim-block32": (6, 3, 24, 32, [257, 31]),
    "wide-group": (20, 1, 8, 4, [129]),
}


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_split_decode_matches_the_naive_oracle(stage, case, splits, device):
    """Each context cut into `splits` chunks, partial outputs merged by their log-sum-exps:
    the oracle's answer, also where a chunk starts past its sequence's end (empty)."""
    heads, kv_heads, dim, block_size, lengths = SPLIT_CASES[case]
    on_host = _batch(heads, kv_heads, dim, block_size, _decodes(lengths), seed=splits)
    oracle, batch = _oracle(on_host), on_host.to(device)
    out = _kernels(stage).decode_attention_split_triton(*batch.args, splits)
    torch.testing.assert_close(out.cpu(), oracle, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_decode_with_rope_and_cache_folded_in_equals_the_two_steps(stage, case, device):
    """`decode_attention_rope_cache_triton` from the raw projections: the output of
    `rope_and_cache_reference` then the reference attention, and the same caches after (the new
    K/V in their slots, nothing else touched), whole (one kernel) or split (two)."""
    from .test_15_fused_kernels import _table

    kernels = _kernels(stage)
    fused = importlib.import_module(f"{stage.__name__}.fused_kernels")
    heads, kv_heads, dim, block_size, lengths = SPLIT_CASES[case]
    batch = _batch(heads, kv_heads, dim, block_size, _decodes(lengths), seed=3)
    generator = torch.Generator().manual_seed(4)
    qk = torch.randn(len(lengths), heads + kv_heads, dim, generator=generator)
    v_new = torch.randn(len(lengths), kv_heads, dim, generator=generator)
    positions = batch.seq_lens.long() - 1
    tables = batch.block_tables.long()
    rows = torch.arange(len(lengths))
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    cos_sin = _table(max(lengths) + 1, dim)
    k_want, v_want = batch.k_cache.clone(), batch.v_cache.clone()
    q, _ = fused.rope_and_cache_reference(
        qk, v_new, positions, cos_sin, heads, k_want, v_want, slots
    )
    want = kernels.unified_attention_reference(
        q, k_want, v_want, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale
    )
    k_got, v_got = batch.k_cache.clone().to(device), batch.v_cache.clone().to(device)
    got = kernels.decode_attention_rope_cache_triton(
        qk.to(device), v_new.to(device), positions.to(device), cos_sin.to(device),
        k_got, v_got, slots.to(device), batch.query_start_loc.to(device),
        batch.seq_lens.to(device), batch.block_tables.to(device), batch.scale,
        max_seq_len=max(lengths),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_got.cpu(), k_want, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_got.cpu(), v_want)


def test_the_folded_decode_splits_where_the_plain_one_does():
    """The cases above run both ways: whole where one program per kv head fills the device,
    split in two for one long sequence (so the write happens in the last chunk only)."""
    kernels = importlib.import_module("stages.15_full.kernels")
    counts = {
        case: kernels.decode_splits(len(lengths), kv_heads, max(lengths), 8)
        for case, (_, kv_heads, _, _, lengths) in SPLIT_CASES.items()
    }
    assert counts["batch1-gqa3-smollm-shape"] == 2 and counts["ragged-some-chunks-empty"] == 1


def test_split_count_fills_the_device_only_when_the_batch_does_not():
    """Batch 1 of SmolLM2 (3 kv heads) at 4,096 positions on 132 multiprocessors: 16 chunks
    (3 programs -> 48); a batch that fills the device, or a short context, is not split."""
    from importlib import import_module

    decode_splits = import_module("stages.15_full.kernels").decode_splits
    assert decode_splits(1, 3, 4096, 132) == 16
    assert decode_splits(8, 3, 4096, 132) == 8  # 24 programs: 11 wanted, a power of two
    assert decode_splits(256, 3, 4096, 132) == 1
    assert decode_splits(1, 3, 300, 132) == 1  # chunks would be under 256 positions
    assert decode_splits(1, 3, 600, 132) == 2
    assert all(n & (n - 1) == 0 for n in (decode_splits(s, 2, 9000, 80) for s in range(1, 99)))


@needs_triton
def test_the_dispatcher_splits_long_decodes_and_never_a_prompt(stage, device, monkeypatch):
    """Through `paged_attention`: a long decode-only batch takes the split kernel (and equals
    the oracle); a batch with a prompt in it takes the unified kernel, however long."""
    kernels = _kernels(stage)
    taken: list[int] = []
    split = kernels.decode_attention_split_triton
    monkeypatch.setattr(
        kernels,
        "decode_attention_split_triton",
        lambda *args: taken.append(args[-1]) or split(*args),
    )
    decodes = _batch(9, 3, 64, 16, _decodes([600, 40]), seed=3)
    out = decodes.to(device).dispatch(kernels, "triton")
    assert taken == [2]  # 6 programs on 8 "multiprocessors" (interpreted), 600 positions
    torch.testing.assert_close(out.cpu(), _oracle(decodes), atol=1e-5, rtol=1e-5)
    mixed = _batch(9, 3, 64, 16, [(600, 1), (0, 5)], seed=4)
    out = mixed.to(device).dispatch(kernels, "triton")
    assert taken == [2]
    torch.testing.assert_close(out.cpu(), _oracle(mixed), atol=1e-5, rtol=1e-5)
