"""Sparse mixture-of-experts layers and expert parallelism (EP).

A sparse MoE block replaces the dense SwiGLU MLP with E SwiGLU experts and a router:

    scores = softmax(router(x))            one score per expert, per token
    ids, w = top_k(scores)                 each token picks k experts
    w = w / w.sum()                        renormalised (Mixtral; Qwen3-MoE if norm_topk_prob)
    y = sum_j w_j * expert_{ids_j}(x)

Each token runs k experts, not E: the parameters grow with E, the work per token with k.

Expert parallelism gives each rank a slice of the experts and moves tokens to them and back
(moe/expert_parallel.py: `expert_map`, all-to-all `dispatch` / `combine`, and the all-gather /
reduce-scatter exchanges that `SparseMoE._gather_scatter` uses, vLLM's default).

Attention stays replicated in stage 11: every rank computes the whole batch. For the MoE each
rank takes its own 1/EP of the tokens (as it would under data-parallel attention, where each rank
has different tokens), dispatches them, and the ranks all-gather their outputs at the end of the
block so the next attention sees the whole batch again. With TP attention every rank would hold
every token, and an all-to-all would only send copies.

The experts run as one grouped matmul (`F.grouped_mm`, as torchtitan does; vLLM's fused_moe
kernel is the same idea): the rows sorted by expert, the groups' ends as a device tensor. A
loop over the experts would need each expert's row count on the host, a sync per layer.
Host synchronisations in a layer: none on one rank and on the all-gather path; one on the
all-to-all path (its split sizes, moe/expert_parallel.py). Two places fall back to reading counts
on the host: torch without `grouped_mm`, or rows whose bytes are not a multiple of 16 (the
loop in `_run_grouped`); and torch's own CUDA `grouped_mm` outside bf16 on sm90/sm100 reads
the group ends on the host inside the op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.linear import Linear
from stages.common.model_config import ModelConfig

from .expert_parallel import (
    EPGroup,
    all_gather_into,
    combine,
    dispatch,
    expert_map,
    expert_owner,
    experts_per_rank,
    reduce_scatter_into,
    row_bytes,
)

Dispatch = Literal["all_to_all", "all_gather"]
_GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9


@dataclass(frozen=True, slots=True)
class MoESettings:
    """The engine's MoE switches. `split_experts`: run a dense model's MLP as that many experts
    of equal column slices (routed to the top_k with weight 1; with top_k = all, the dense MLP
    exactly). `top_k`: None keeps the checkpoint's (all experts when split)."""

    dispatch: Dispatch = "all_to_all"
    split_experts: int | None = None
    top_k: int | None = None


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, unit_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).

    Softmax in fp32, top-k, renormalised over the k chosen when `renormalize`; `unit_weights`
    gives each chosen expert weight 1 (a split dense MLP)."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if unit_weights:
        weights = torch.ones_like(weights)
    elif renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    """A router and this rank's experts, stacked: w13 [E_local, 2I, H] (gate rows then up rows),
    w2 [E_local, H, I]. With a single-rank group the block runs in place, no exchange."""

    def __init__(self, config: ModelConfig, settings: MoESettings, ep: EPGroup) -> None:
        super().__init__()
        self.split = settings.split_experts is not None
        self.num_experts = config.num_experts
        self.top_k = settings.top_k or config.num_experts_per_tok
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} with {self.num_experts} experts")
        self.renormalize = config.norm_topk_prob
        self.dispatch_method = settings.dispatch
        self.ep = ep
        self.register_buffer("expert_map", torch.empty(self.num_experts, dtype=torch.long), False)
        self.register_buffer("owner", torch.empty(self.num_experts, dtype=torch.long), False)
        self.local_experts = experts_per_rank(self.num_experts, ep.size)[ep.rank]
        self.reset_maps()
        self.intermediate = config.moe_intermediate_size
        hidden, inter = config.hidden_size, self.intermediate
        self.router = Linear(config.hidden_size, self.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.local_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.local_experts, hidden, inter))

    @torch.no_grad()
    def reset_maps(self) -> None:
        """(Re)fill the expert tables on the buffers' device (after `to_empty`, as the model's
        rotary table)."""
        if self.expert_map.is_meta:
            return
        self.expert_map.copy_(expert_map(self.num_experts, self.ep.size, self.ep.rank))
        self.owner.copy_(expert_owner(self.num_experts, self.ep.size))

    # ----------------------------------------------------------------------------- loading
    def bind_shard_ids(self) -> None:
        """Which checkpoint tensors this rank must receive (bind_weight_loaders gave every
        parameter of the module the same list; experts differ)."""
        counts = experts_per_rank(self.num_experts, self.ep.size)
        first = sum(counts[: self.ep.rank])
        local = range(first, first + counts[self.ep.rank])
        if self.split:
            self.router.weight.shard_ids = ()  # derived from the dense gate rows while loading
            self.w13.shard_ids, self.w2.shard_ids = ("gate", "up"), ("down",)
        else:
            self.w13.shard_ids = tuple(2 * e + part for e in local for part in (0, 1))
            self.w2.shard_ids = tuple(local)
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: object, shard_id: object) -> None:
        """One expert's gate (2e), up (2e + 1) or down (e) matrix, read only if this rank owns
        it; or, split, the dense gate/up/down matrix cut into column slices."""
        inter = self.intermediate
        if self.split:
            self._load_split(param, loaded, str(shard_id))
            return
        index = int(shard_id)  # type: ignore[call-overload]
        expert, part = divmod(index, 2) if param is self.w13 else (index, 0)
        local = int(self.expert_map[expert])
        if local < 0:
            return  # another rank's expert: not read at all
        target = (
            param.data[local, part * inter : (part + 1) * inter]
            if param is self.w13
            else (param.data[local])
        )
        if tuple(loaded.shape) != tuple(target.shape):  # type: ignore[attr-defined]
            raise ValueError(f"expert {expert}: {tuple(loaded.shape)} vs {tuple(target.shape)}")  # type: ignore[attr-defined]
        target.copy_(loaded[:])  # type: ignore[index]

    def _load_split(self, param: nn.Parameter, loaded: object, which: str) -> None:
        inter = self.intermediate
        for expert in range(self.num_experts):
            cols = slice(expert * inter, (expert + 1) * inter)
            local = int(self.expert_map[expert])
            if which == "gate":  # the router scores expert e by its mean gate row
                self.router.weight.data[expert] = loaded[cols].float().mean(0)  # type: ignore[index]
            if local < 0:
                continue
            if which == "down":
                param.data[local].copy_(loaded[:, cols])  # type: ignore[index]
            else:
                part = 0 if which == "gate" else 1
                param.data[local, part * inter : (part + 1) * inter].copy_(loaded[cols])  # type: ignore[index]

    # ----------------------------------------------------------------------------- forward
    def run_experts(
        self,
        rows: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows [m, H] and their experts (global ids) -> weighted outputs [m, H]. A row whose
        expert another rank owns, or that `keep` leaves out, gives zeros and is not counted."""
        local = self.expert_map[expert_ids]
        if keep is not None:
            local = torch.where(keep, local, -1)
        ran = local >= 0
        self.ep.stats.count(expert_ids, self.num_experts, ran)
        group = torch.where(ran, local, self.local_experts)  # rows to skip sort last
        order = torch.argsort(group, stable=True)
        sizes = torch.zeros(self.local_experts + 1, dtype=torch.long, device=rows.device)
        sizes.index_add_(0, group, torch.ones_like(group))
        y = self._run_grouped(rows[order], sizes[:-1])
        out = torch.empty_like(y).index_copy_(0, order, y)  # back to the rows' order
        return torch.where(ran.unsqueeze(-1), out * weights.unsqueeze(-1), 0.0)

    def _run_grouped(self, rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """rows [m, H] sorted by local expert, `sizes` [E_local] rows each -> each expert's
        SwiGLU output; rows past the last group (skipped ones) are left undefined."""
        widths = (
            self.w13.shape[2] * rows.element_size(),
            self.intermediate * rows.element_size(),
        )
        if _GROUPED_MM is not None and all(b % 16 == 0 for b in widths):
            ends = sizes.cumsum(0).to(torch.int32)
            gate, up = _GROUPED_MM(rows, self.w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
            return _GROUPED_MM(F.silu(gate) * up, self.w2.transpose(1, 2), offs=ends)
        return self._run_each_expert(rows, sizes)

    def _run_each_expert(self, rows: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The fallback (no grouped_mm, or widths it cannot take, such as bf16 rows of 12):
        every local expert runs every row and each row keeps its own expert's output. That is
        E_local times the work, but no host sync: slicing each expert's rows would need the
        sizes on the host (`sizes.tolist()`, a sync per layer on CUDA)."""
        ends = sizes.cumsum(0)
        row = torch.arange(rows.shape[0], device=rows.device)
        expert_of_row = torch.searchsorted(ends, row, right=True)[:, None]  # skipped: E_local
        out = rows.new_zeros(rows.shape)
        for expert in range(self.w13.shape[0]):
            gate, up = F.linear(rows, self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            out = torch.where(expert_of_row == expert, y, out)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.router(x), self.top_k, self.renormalize, self.split)

    def _in_place(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(x)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        y = self.run_experts(x[token], ids.reshape(-1), weights.reshape(-1))
        return x.new_zeros(x.shape).index_add_(0, token, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep.size == 1:
            return self._in_place(x)
        chunk = -(-x.shape[0] // self.ep.size)
        start = min(self.ep.rank * chunk, x.shape[0])
        mine = x[start : start + chunk]
        if self.dispatch_method == "all_to_all":
            weights, ids = self._route(mine)
            sent = dispatch(self.ep, mine, ids, weights, self.owner)
            y = self.run_experts(sent.rows, sent.expert_ids, sent.weights)
            out = combine(self.ep, y, sent, mine.shape[0])
        else:
            out = self._gather_scatter(mine, chunk, x.shape[0])
        return self._gather_back(out, chunk, x.shape[0])

    def _gather_scatter(self, mine: torch.Tensor, chunk: int, num_tokens: int) -> torch.Tensor:
        """vLLM's default: all-gather every rank's tokens, run this rank's experts on all of
        them, reduce-scatter the partial sums back to their ranks."""
        gathered = self._all_gather(mine, chunk)
        self.ep.stats.dispatch_bytes += (self.ep.size - 1) * chunk * row_bytes(mine)
        weights, ids = self._route(gathered)
        token = torch.arange(gathered.shape[0], device=gathered.device).repeat_interleave(
            self.top_k
        )
        keep = token < num_tokens  # padding rows: skipped (and other ranks' experts)
        y = self.run_experts(gathered[token], ids.reshape(-1), weights.reshape(-1), keep)
        partial = gathered.new_zeros(gathered.shape).index_add_(0, token, y)
        out = partial.new_empty(chunk, partial.shape[1])
        reduce_scatter_into(self.ep, out, partial)
        self.ep.stats.combine_bytes += (self.ep.size - 1) * chunk * row_bytes(partial)
        self.ep.stats.exchanges += 2
        return out[: mine.shape[0]]

    def _all_gather(self, mine: torch.Tensor, chunk: int) -> torch.Tensor:
        padded = mine.new_zeros(chunk, mine.shape[1])
        padded[: mine.shape[0]] = mine
        gathered = padded.new_empty(chunk * self.ep.size, mine.shape[1])
        all_gather_into(self.ep, gathered, padded)
        return gathered

    def _gather_back(self, out: torch.Tensor, chunk: int, num_tokens: int) -> torch.Tensor:
        """Every rank's outputs to every rank: the next attention needs the whole batch."""
        self.ep.stats.gather_back_bytes += (self.ep.size - 1) * chunk * row_bytes(out)
        self.ep.stats.exchanges += 1
        return self._all_gather(out, chunk)[:num_tokens]


def split_dense_config(config: ModelConfig, settings: MoESettings) -> ModelConfig:
    """The model config with every dense MLP as `split_experts` experts of equal column slices
    (top-k all by default); unchanged when the switch is off."""
    n = settings.split_experts
    if n is None:
        return config
    if config.num_experts:
        raise ValueError("split_experts applies to a dense model; this one has experts")
    if n < 1 or config.intermediate_size % n:
        raise ValueError(
            f"split_experts={n} must divide intermediate_size={config.intermediate_size}"
        )
    return replace(
        config,
        num_experts=n,
        num_experts_per_tok=settings.top_k or n,
        moe_intermediate_size=config.intermediate_size // n,
        norm_topk_prob=False,
        moe_layers=tuple(range(config.num_layers)),
    )
