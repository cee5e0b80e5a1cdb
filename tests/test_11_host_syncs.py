"""Stage 11's MoE layer forward makes the host wait for the device only where it must.

A host sync in a layer's forward (`.tolist()`, `.cpu()`, `nonzero`, a boolean-mask index, ...)
stops the CPU until the GPU has caught up, once per layer: the next kernels are not queued while
it waits, and async scheduling (stage 05) loses its overlap. The one sync the all-to-all needs
is its split sizes: gloo's and NCCL's `all_to_all_single` take them as Python lists. The
statistics stay on the device until someone reads them (`EPStats.snapshot`). Where
`grouped_mm` cannot run (an older torch, or widths it cannot take, such as bf16 rows of 12), the
fallback runs every expert on every row rather than read the group sizes on the host.

On the CPU the calls are counted (tests/host_syncs.py); on CUDA `set_sync_debug_mode("error")`
raises at a real synchronisation.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from .conftest import requires_cuda, since
from .host_syncs import record_host_syncs
from .test_11_moe import NUM_EXPERTS, TOP_K, _ep, _layer

pytestmark = since("11")

SPLIT_SIZES = ["Tensor.tolist"]  # the all-to-all's split sizes: one read per layer


def _moe(stage):
    return importlib.import_module(f"{stage.__name__}.moe.layer")


def test_the_detector_sees_each_kind_of_sync():
    """The guard can fail: each call it claims to catch is caught, plain device ops are not."""
    x = torch.arange(6.0)
    with record_host_syncs() as calls:
        _ = (x * 2).sum() + x.amax()
        torch.where(x > 2, x, 0)
        x[torch.tensor([1, 2])] = 0.0
        x.to(torch.float64)
    assert calls == []
    with record_host_syncs() as calls:
        x.tolist(), x.sum().item(), x.cpu(), torch.nonzero(x), x.unique(), bool(x[0] > 0)
        x[x > 2], torch.bincount(x.long()), torch.where(x > 2)
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long)), x.to("cpu")
        x[x > 3] = 1.0
    assert calls == [
        "Tensor.tolist", "Tensor.item", "Tensor.cpu", "torch.nonzero", "Tensor.unique",
        "Tensor.__bool__", "mask index", "torch.bincount", "torch.where(condition)",
        "repeat_interleave", "Tensor.to(cpu)", "mask index",
    ]  # fmt: skip
    assert "tolist" not in vars(torch.Tensor) and "__getitem__" not in vars(torch.Tensor)
    assert not hasattr(torch.nonzero, "__wrapped__")  # every patch undone


@pytest.mark.parametrize(
    ("size", "dispatch", "expected"),
    [(1, "all_to_all", []), (2, "all_gather", []), (2, "all_to_all", SPLIT_SIZES)],
    ids=["one-rank", "all-gather", "all-to-all"],
)
def test_moe_layer_forward_reads_nothing_on_the_host_but_split_sizes(
    stage, size, dispatch, expected
):
    moe = _moe(stage)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(5))
    layer = _layer(moe, _ep(moe, 0, size) if size > 1 else moe.EPGroup(), dispatch)
    with torch.inference_mode():
        layer(x)  # warm: the first call may set things up
        with record_host_syncs() as calls:
            layer(x)
    assert calls == expected


@pytest.mark.parametrize(
    ("dtype", "grouped_mm"),
    [(torch.bfloat16, True), (torch.float32, False)],
    ids=["bf16-widths-grouped-mm-cannot-take", "no-grouped-mm"],
)
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_the_fallback_without_grouped_mm_reads_nothing_on_the_host(
    stage, monkeypatch, dtype, grouped_mm, dispatch
):
    """The first GPU run (bf16) took the fallback: bf16 rows of the tiny model's 12
    intermediate features are 24 bytes, which grouped_mm cannot take, and the fallback read the
    group sizes on the host (`sizes.tolist()`). The fp32 CPU run never got there."""
    moe = _moe(stage)
    if not grouped_mm:
        monkeypatch.setattr(moe, "_GROUPED_MM", None)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    layer = _layer(moe, moe.EPGroup(), dispatch).to(dtype=dtype)
    with torch.inference_mode():
        layer(x)
        with record_host_syncs() as calls:
            layer(x)
    assert calls == []


def _each_expert_on_its_slice(layer, rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The fallback as stage 11 first had it (each expert on its rows, sliced by host sizes)."""
    out, start = rows.new_zeros(rows.shape), 0
    for expert, count in enumerate(sizes.tolist()):
        picked = slice(start, start + count)
        gate, up = F.linear(rows[picked], layer.w13[expert]).chunk(2, dim=-1)
        out[picked] = F.linear(F.silu(gate) * up, layer.w2[expert])
        start += count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fallback_equals_each_expert_on_its_own_rows(stage, dtype):
    """Every expert runs every row and each row keeps its own expert's output: the rows of each
    group (not the skipped ones past the last group) equal the sliced loop's. A GEMM's rows may
    round differently with the batch's size, hence fp32 rounding, not bit-equality."""
    moe = _moe(stage)
    layer = _layer(moe, moe.EPGroup(), "all_to_all").to(dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    for m in (1, 9, 64):
        rows = torch.randn(m, 8, generator=gen).to(dtype)
        cuts = torch.randint(0, m + 1, (layer.w13.shape[0],), generator=gen).sort().values
        sizes = torch.diff(cuts, prepend=torch.zeros(1, dtype=torch.long))
        used = int(sizes.sum())
        got = layer._run_each_expert(rows, sizes)[:used]
        expected = _each_expert_on_its_slice(layer, rows, sizes)[:used]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_expert_counts_accumulate_on_the_device_and_read_on_request(stage, dispatch):
    """The per-expert counts are a tensor on the tokens' device, added to per layer; the
    snapshot reads them: the pairs this rank's experts ran (padding rows and other ranks'
    experts not counted)."""
    moe = _moe(stage)
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(5))
    ep = _ep(moe, 0, 2)
    layer = _layer(moe, ep, dispatch)
    ep.stats.reset()
    with torch.inference_mode():
        layer(x)
        layer(x)
    assert isinstance(ep.stats.expert_tokens, torch.Tensor)
    assert ep.stats.expert_tokens.device == x.device
    # Rank 0's tokens are the first 4; on the all-gather path it also runs its experts on the
    # peer's 3 (zeros from the stub); the padding row is not counted.
    mine = torch.cat([x[:4], torch.zeros(3, 8)]) if dispatch == "all_gather" else x[:4]
    _, ids = layer._route(mine)
    owned = layer.expert_map >= 0
    expected = torch.zeros(NUM_EXPERTS, dtype=torch.long).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.long)
    )
    expected = (2 * expected * owned).tolist()
    assert ep.stats.snapshot()["expert_tokens"] == expected
    assert sum(expected) < 2 * ids.numel() * TOP_K  # some pairs were another rank's


@requires_cuda("torch.cuda.set_sync_debug_mode reports host syncs only there")
@pytest.mark.parametrize(("size", "dispatch"), [(1, "all_to_all"), (2, "all_gather")])
def test_cuda_moe_layer_forward_never_synchronises(stage, size, dispatch):
    """In bf16 the tiny model's experts take the layer's own fallback (grouped_mm cannot take
    rows of 12 bf16 features); with wider ones, sm90/sm100 take grouped_mm's CUTLASS kernel,
    while elsewhere torch's grouped_mm reads the group offsets on the host (a sync inside
    torch), so the check is for those GPUs only."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("grouped_mm is sync-free only on sm90/sm100 (bf16)")
    moe = _moe(stage)
    layer = _layer(moe, _ep(moe, 0, size) if size > 1 else moe.EPGroup(), dispatch)
    layer = layer.to("cuda", torch.bfloat16)
    layer.reset_maps()
    x = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
