"""Stage 11's MoE pieces, one at a time, in one process (the assignment's direct tests).

The exchanges go through `PeerlessGroup`, a stub transport for one rank of an EP group whose
other ranks hold no tokens and whose experts add nothing: what this rank sends to itself comes
back, what it sends to the others is recorded and they answer with zero rows. So one rank's
dispatch, combine and all-gather path can be checked against a plain sum over the experts it
owns, in milliseconds. The same functions over real gloo processes are tests/test_11_ep.py's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pytest
import torch

from stages.common.model_config import ModelConfig

from .conftest import since

pytestmark = since("11")

NUM_EXPERTS, TOP_K, HIDDEN = 5, 2, 8
PEER_PARTIAL = 0.25  # each other rank's partial sum per element, on the all-gather path


@pytest.fixture
def moe(stage):
    return importlib.import_module(f"{stage.__name__}.moe.layer")


class _Done:
    def wait(self) -> bool:
        return True


@dataclass
class PeerlessGroup:
    """One rank's view of an EP group whose other ranks have no tokens and zero experts. On
    the all-gather path each other rank's partial sum for every token is PEER_PARTIAL (as if
    its experts gave that), so a reduce-scatter that is skipped shows."""

    rank: int
    size: int
    sent: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)

    def alltoall_base(self, out, x, recv, send, _options) -> _Done:
        self.sent.append((x.clone(), list(send)))
        out.zero_()
        mine = slice(sum(send[: self.rank]), sum(send[: self.rank + 1]))
        out[sum(recv[: self.rank]) : sum(recv[: self.rank + 1])] = x[mine]
        return _Done()

    def _allgather_base(self, out, x, _options) -> _Done:
        out.zero_()
        out[self.rank * x.shape[0] : (self.rank + 1) * x.shape[0]] = x
        return _Done()

    def _reduce_scatter_base(self, out, x, _options) -> _Done:
        mine = x[self.rank * out.shape[0] : (self.rank + 1) * out.shape[0]]
        out.copy_(mine + PEER_PARTIAL * (self.size - 1))
        return _Done()


def _ep(moe, rank: int, size: int):
    return moe.EPGroup(rank, size, PeerlessGroup(rank, size))


def _inputs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=gen)
    ids = torch.rand(n, NUM_EXPERTS, generator=gen).argsort(-1)[:, :TOP_K]
    weights = torch.rand(n, TOP_K, generator=gen)
    return x, ids, weights


# ---------------------------------------------------------------------------- expert_map
def test_expert_map_gives_each_rank_a_contiguous_slice(moe):
    for size in (1, 2, 3, 5):
        maps = [moe.expert_map(7 if size < 7 else size, size, r) for r in range(size)]
        owned = torch.stack([m >= 0 for m in maps])
        assert owned.sum(0).tolist() == [1] * maps[0].numel()  # each expert owned once
        for mapping in maps:
            local = mapping[mapping >= 0]
            assert local.tolist() == list(range(local.numel()))  # local ids 0.. in order


# ---------------------------------------------------------------------------------- route
def test_route_picks_the_top_k_of_the_softmax_and_normalises_as_told(moe):
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 3.5, 0.5]])
    probs = torch.softmax(logits, -1)
    weights, ids = moe.route(logits, 2, renormalize=False, unit_weights=False)
    assert ids.tolist() == [[0, 2], [2, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))  # Qwen3-MoE, norm_topk_prob off
    normed, _ = moe.route(logits, 2, renormalize=True, unit_weights=False)
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))  # Mixtral
    assert normed.dtype == logits.dtype
    ones, _ = moe.route(logits, 3, renormalize=True, unit_weights=True)
    assert ones.tolist() == [[1.0] * 3] * 2  # a split dense MLP
    half, half_ids = moe.route(logits.half(), 2, renormalize=True, unit_weights=False)
    assert half.dtype == torch.float16 and half_ids.tolist() == ids.tolist()


# ------------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("size", [2, 3])
def test_dispatch_sends_each_pair_to_its_experts_owner(moe, size):
    for rank in range(size):
        ep = _ep(moe, rank, size)
        owner = moe.expert_owner(NUM_EXPERTS, size)
        x, ids, weights = _inputs(7, seed=rank)
        sent = moe.dispatch(ep, x, ids, weights, owner)
        (counts, _), (rows, split), (sent_ids, _), (sent_weights, _) = ep.group.sent
        assert counts.tolist() == split == sent.send_counts
        assert sum(split) == 7 * TOP_K
        pairs = sorted(zip(range(7 * TOP_K), ids.reshape(-1).tolist(), strict=True))
        token_of_pair = [p // TOP_K for p, _ in pairs]
        got = []
        start = 0
        for destination, count in enumerate(split):
            chunk = slice(start, start + count)
            assert (owner[sent_ids[chunk]] == destination).all(), "a pair sent to a non-owner"
            for row, token, expert, weight in zip(
                rows[chunk], sent.token_index[chunk], sent_ids[chunk], sent_weights[chunk],
                strict=True,
            ):  # fmt: skip
                torch.testing.assert_close(row, x[token])
                k = ids[token].tolist().index(int(expert))
                assert float(weight) == float(weights[token, k])
                got.append((int(token), int(expert)))
            start += count
        expected = [(t, e) for t, (_, e) in zip(token_of_pair, pairs, strict=True)]
        assert sorted(got) == sorted(expected)
        # What came back: this rank's own pairs only (the peers have no tokens).
        assert sent.recv_counts == [split[rank] if r == rank else 0 for r in range(size)]
        assert (owner[sent.expert_ids] == rank).all()


# -------------------------------------------------------------------------------- combine
@pytest.mark.parametrize("size", [2, 3])
def test_combine_sums_each_tokens_results_back_in_place(moe, size):
    owner = moe.expert_owner(NUM_EXPERTS, size)
    for rank in range(size):
        ep = _ep(moe, rank, size)
        x, ids, weights = _inputs(6, seed=10 + rank)
        sent = moe.dispatch(ep, x, ids, weights, owner)
        back = moe.combine(ep, sent.rows * sent.weights.unsqueeze(-1), sent, x.shape[0])
        mine = (owner[ids] == rank).to(weights.dtype)  # the peers' experts add nothing
        torch.testing.assert_close(back, x * (weights * mine).sum(-1, keepdim=True))
        sent_back, split = ep.group.sent[-1]
        assert split == sent.recv_counts and sent_back.shape[0] == sum(sent.recv_counts)


# ---------------------------------------------------------------- the all-gather path
def _config() -> ModelConfig:
    return ModelConfig(
        model_type="mixtral", vocab_size=16, hidden_size=HIDDEN, intermediate_size=12,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=12,
        moe_layers=(0,),
    )  # fmt: skip


def _layer(moe, ep, dispatch: str):
    config = _config()
    layer = moe.SparseMoE(config, moe.MoESettings(dispatch=dispatch), ep).requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    e, i, h = NUM_EXPERTS, config.moe_intermediate_size, HIDDEN
    router, w13, w2 = (torch.randn(s, generator=gen) for s in ((e, h), (e, 2 * i, h), (e, h, i)))
    local = layer.expert_map >= 0
    layer.router.weight.copy_(router)
    layer.w13.copy_(w13[local])
    layer.w2.copy_(w2[local])
    return layer


def _owned_part(moe, x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The one-rank layer's output, counting only the experts `rank` owns."""
    whole = _layer(moe, moe.EPGroup(), "all_to_all")
    weights, ids = whole._route(x)
    keep = (moe.expert_owner(NUM_EXPERTS, size)[ids] == rank).to(weights.dtype)
    token = torch.arange(x.shape[0]).repeat_interleave(TOP_K)
    y = whole.run_experts(x[token], ids.reshape(-1), (weights * keep).reshape(-1))
    return torch.zeros_like(x).index_add_(0, token, y)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_each_ranks_layer_runs_its_experts_on_its_tokens(moe, size, dispatch):
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5))  # 7 % size != 0
    chunk = -(-x.shape[0] // size)
    with torch.inference_mode():
        for rank in range(size):
            got = _layer(moe, _ep(moe, rank, size), dispatch)(x)
            expected = torch.zeros_like(x)
            rows = slice(rank * chunk, min((rank + 1) * chunk, x.shape[0]))
            expected[rows] = _owned_part(moe, x, rank, size)[rows]
            if dispatch == "all_gather":  # the other ranks' partial sums, reduce-scattered in
                expected[rows] += PEER_PARTIAL * (size - 1)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------- what the traffic statistics say
# The bench's bytes-moved plot reads EPStats: a count that is wrong must fail its task's grade.
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_counts_only_the_rows_that_leave_the_rank_and_its_four_exchanges(moe, size, dtype):
    owner = moe.expert_owner(NUM_EXPERTS, size)
    for rank in range(size):
        ep = _ep(moe, rank, size)
        x, ids, weights = _inputs(7, seed=20 + rank)
        sent = moe.dispatch(ep, x.to(dtype), ids, weights.to(dtype), owner)
        send = sent.send_counts
        remote = sum(send) - send[rank]
        assert 0 < remote < sum(send), "the rows to itself and to others both occur here"
        per_row = HIDDEN * x.to(dtype).element_size() + 8 + weights.to(dtype).element_size()
        assert ep.stats.dispatch_bytes == remote * per_row + 8 * (size - 1)
        assert ep.stats.exchanges == 4  # the counts, then the rows, the expert ids, the weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_counts_the_rows_it_sends_back_and_keeps_the_results_dtype(moe, dtype):
    """Rank 0 of 2 ran 3 rows of its own and 4 of rank 1's: those 4 go back over the wire;
    the output is in the results' dtype, on their device."""
    parallel = importlib.import_module(moe.dispatch.__module__)
    ep = _ep(moe, 0, 2)
    results = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    sent = parallel.Dispatched(
        rows=results, expert_ids=torch.zeros(7, dtype=torch.long), weights=torch.ones(7),
        send_counts=[3, 2], recv_counts=[3, 4], token_index=torch.tensor([0, 1, 1, 2, 3]),
    )  # fmt: skip
    back = moe.combine(ep, results, sent, num_tokens=4)
    assert back.dtype == dtype and back.device == results.device and back.shape == (4, HIDDEN)
    assert ep.stats.combine_bytes == 4 * HIDDEN * results.element_size()
    assert ep.stats.exchanges == 1


@pytest.mark.parametrize("size", [2, 3])
def test_the_all_gather_path_counts_its_three_exchanges_and_their_bytes(moe, size):
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5))
    chunk = -(-x.shape[0] // size)
    with torch.inference_mode():
        layer = _layer(moe, _ep(moe, 0, size), "all_gather")
        layer(x)
    stats, each = layer.ep.stats, (size - 1) * chunk * HIDDEN * x.element_size()
    assert (stats.dispatch_bytes, stats.combine_bytes, stats.gather_back_bytes) == (each,) * 3
    assert stats.exchanges == 3  # all-gather, reduce-scatter, and the outputs gathered back


def test_route_takes_the_softmax_in_fp32_whatever_the_logits_dtype(moe):
    logits = (torch.randn(64, 8, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    weights, ids = moe.route(logits, 2, renormalize=True, unit_weights=False)
    top, top_ids = torch.softmax(logits.float(), -1).topk(2, -1)
    expected = (top / top.sum(-1, keepdim=True)).bfloat16()
    assert torch.equal(ids, top_ids) and torch.equal(weights, expected)
    low, low_ids = torch.softmax(logits, -1).topk(2, -1)  # the softmax in bf16 differs here
    assert not (torch.equal(low_ids, top_ids) and torch.equal(low / low.sum(-1, True), expected))


def test_expert_map_is_an_int64_table(moe):
    """The contract says int64: an index into the experts' weights."""
    assert moe.expert_map(7, 3, 1).dtype == torch.int64
