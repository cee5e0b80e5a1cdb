"""Megatron-LM's sharded layers: each rank holds a slice of every weight and the layers say
where the slices meet.

An attention block or an MLP is a column-parallel matmul followed by a row-parallel one:

    x (replicated) -> [W_1 split by output rows] -> h_r (this rank's features, never exchanged)
                   -> [W_2 split by input columns] -> partial y_r -> all-reduce -> y (replicated)

so each block costs ONE all-reduce. Attention splits naturally by heads (a head's q, k, v rows
and its o_proj columns stay on one rank); the MLP by intermediate columns (silu(gate) * up is
elementwise, so gate and up must be split the same way). The vocabulary is split by rows for
the embedding (a lookup outside the rank's rows gives zeros; an all-reduce fills them in) and
the LM head (each rank scores its words; an all-gather joins the scores).

Every parameter carries `weight_loader(param, loaded, shard_id=None)`: `loaded` is the whole
checkpoint tensor, a `torch.Tensor` or a `LazyTensor` (stages.common.weights) that reads only
what is indexed, and the loader takes this rank's part of it into the parameter's place, so q,
k, v (and gate, up) are split first and fused after, into one matmul per rank. `shard_ids`
lists which checkpoint tensors a fused parameter expects. Layers mirror vLLM's and nano-vllm's
`layers/linear.py`; KV heads fewer than ranks are replicated (mini-sglang's rule). At TP=1
every layer is the plain layer of stage 08: same shapes, same math, no collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.linear import Linear

from .group import TPGroup, kv_head_range

ShardId = str | int | None
TensorSource = Any  # torch.Tensor or stages.common.weights.LazyTensor: `.shape` and `[...]`
WeightLoader = Callable[[nn.Parameter, TensorSource, ShardId], None]


def _expect_shape(loaded: TensorSource, expected: Sequence[int]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint {tuple(loaded.shape)} vs model {tuple(expected)}")


@torch.no_grad()
def replicated_weight_loader(
    param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
) -> None:
    """Every rank holds the whole tensor (norms)."""
    _expect_shape(loaded, param.shape)
    param.data.copy_(loaded[:])


@torch.no_grad()
def _copy_rows(param: nn.Parameter, dst: int, loaded: TensorSource, src: int, rows: int) -> None:
    """param[dst : dst+rows] = loaded[src : src+rows], reading only those rows."""
    param.data[dst : dst + rows].copy_(loaded[src : src + rows])


class _ShardedLinear(Linear):
    """A `Linear` of this rank's shape that knows its group (oneDNN prepacking still applies)
    and gives its parameters its weight loader."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        shard_ids: tuple[ShardId, ...] = (None,),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp, self.shard_ids = tp, shard_ids
        bind_weight_loaders(self)


def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide {what}={total}")
    return total // size


class ColumnParallelLinear(_ShardedLinear):
    """W split by output rows: rank r computes features [r*out/TP, (r+1)*out/TP), kept local."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        local = _divide(out_features, tp.size, "out_features")
        super().__init__(in_features, local, bias, tp)

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        rows = param.shape[0]
        _expect_shape(loaded, (rows * self.tp.size, *param.shape[1:]))
        _copy_rows(param, 0, loaded, self.tp.rank * rows, rows)


class MergedColumnParallelLinear(_ShardedLinear):
    """Several column-parallel matrices stacked into one matmul (gate and up): each is split
    first, then this rank's slices are stacked, so `chunk(len(sizes))` of the output gives
    each matrix's local features."""

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TPGroup
    ) -> None:
        local_sizes = [_divide(n, tp.size, "output size") for n in output_sizes]
        shard_ids = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(local_sizes), bias, tp, shard_ids)
        self.local_sizes = local_sizes

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        index = int(shard_id or 0)
        rows = self.local_sizes[index]
        _expect_shape(loaded, (rows * self.tp.size, *param.shape[1:]))
        _copy_rows(param, sum(self.local_sizes[:index]), loaded, self.tp.rank * rows, rows)


class QKVParallelLinear(_ShardedLinear):
    """q, k and v by heads, stacked [q heads | k heads | v heads] for one matmul per rank.

    Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
    with fewer, each rank holds the one KV head its query heads read (`kv_head_range`), a
    replicated copy."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        local_heads = _divide(num_heads, tp.size, "num_heads")
        kv_heads = kv_head_range(num_kv_heads, tp.size, tp.rank)
        out_features = (local_heads + 2 * len(kv_heads)) * head_dim
        super().__init__(hidden_size, out_features, bias, tp, ("q", "k", "v"))
        self.head_dim, self.num_heads = head_dim, local_heads
        self.kv_heads, self.num_kv_heads = kv_heads, len(kv_heads)
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's heads of the checkpoint's q, k or v matrix (`shard_id`) into
        the fused weight: q heads [r * heads, (r + 1) * heads), then the KV heads of
        `kv_head_range` (a slice, or the one replicated head) for k and for v."""
        if shard_id not in self.total_heads:
            raise ValueError(f"QKVParallelLinear takes shard 'q', 'k' or 'v', got {shard_id!r}")
        d = self.head_dim
        _expect_shape(loaded, (self.total_heads[shard_id] * d, *param.shape[1:]))
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            _copy_rows(param, 0, loaded, self.tp.rank * q_rows, q_rows)
        else:
            dst = q_rows if shard_id == "k" else q_rows + kv_rows
            _copy_rows(param, dst, loaded, self.kv_heads.start * d, kv_rows)


class RowParallelLinear(_ShardedLinear):
    """W split by input columns: rank r multiplies its features by its columns, and ONE
    all-reduce sums the partial outputs. A bias is held by rank 0 only (zeros elsewhere), so
    the sum adds it exactly once and `Linear`'s (packed) matmul is used unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        local = _divide(in_features, tp.size, "in_features")
        super().__init__(local, out_features, bias, tp)

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        """Take this rank's input columns of the weight, [r * cols, (r + 1) * cols); the bias
        goes to rank 0 only (zeros elsewhere), so the all-reduce adds it once."""
        if param.dim() == 1:  # the bias: rank 0's partial sum carries it
            _expect_shape(loaded, param.shape)
            if self.tp.rank == 0:
                param.data.copy_(loaded[:])
            else:
                param.data.zero_()
            return
        cols = param.shape[1]
        _expect_shape(loaded, (param.shape[0], cols * self.tp.size))
        start = self.tp.rank * cols
        param.data.copy_(loaded[:, start : start + cols])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, summed over the ranks by one all-reduce."""
        return self.tp.all_reduce(super().forward(x))


class _VocabShard:
    """Rows [start, end) of the vocabulary, padded to `rows` per rank: the vocabulary is
    padded to a multiple of TP (259 words over 2 ranks: 130 + 129 real rows, one zero row)."""

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = min(tp.rank * self.rows, vocab_size)
        self.end = min(self.start + self.rows, vocab_size)

    @torch.no_grad()
    def load(self, param: nn.Parameter, loaded: TensorSource) -> None:
        _expect_shape(loaded, (self.vocab_size, *param.shape[1:]))
        real = self.end - self.start
        _copy_rows(param, 0, loaded, self.start, real)
        param.data[real:].zero_()  # padding rows: never looked up, their logits dropped


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary rows. A rank looks up the ids it holds, gives zero rows
    for the others, and one all-reduce assembles every row (each id is held by one rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.shard = _VocabShard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))
        bind_weight_loaders(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        self.shard.load(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed the ids this rank holds (shifted to its rows), zero rows for the others,
        then one all-reduce: each id's row comes from the one rank that holds it."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        held = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        local_ids = torch.where(held, input_ids - self.shard.start, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill_(~held.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(rows)


class ParallelLMHead(Linear):
    """The LM head split by vocabulary rows (the embedding's rows when the two are tied). Each
    rank scores its words; one all-gather gives every rank the full row of logits, padding
    dropped, so every rank samples the same token."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        shard = _VocabShard(vocab_size, tp)
        super().__init__(hidden_size, shard.rows, bias=False)
        self.tp, self.shard = tp, shard
        bind_weight_loaders(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: TensorSource, shard_id: ShardId = None
    ) -> None:
        self.shard.load(param, loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.tp.size == 1:
            return logits
        gathered = self.tp.all_gather(logits, dim=-1)
        return gathered[..., : self.shard.vocab_size].contiguous()


def bind_weight_loaders(model: nn.Module) -> None:
    """Give every parameter its `weight_loader` and `shard_ids` (its module's, or replicated).

    Call again after `to_empty`, which replaces parameter objects and so drops attributes."""
    for module in model.modules():
        loader = getattr(module, "weight_loader", replicated_weight_loader)
        shard_ids = getattr(module, "shard_ids", (None,))
        for param in module.parameters(recurse=False):
            param.weight_loader = loader  # type: ignore[attr-defined]
            param.shard_ids = shard_ids  # type: ignore[attr-defined]
