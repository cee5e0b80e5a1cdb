"""Expert parallelism (EP): which rank owns which expert, and how tokens reach them and return.

Each rank holds a slice of the experts (`expert_map`, as vLLM's `determine_expert_map`: E // EP
per rank, one more for the first E % EP ranks). A token must then travel to the ranks owning its
experts and its results back. Two ways; this module has the exchanges, moe/layer.py's SparseMoE uses
them:
- all-to-all (`dispatch` / `combine`): each rank sends every (token, expert) pair only to the
  expert's owner. The counts go first (`all_to_all_single` of one int per rank), then the rows,
  their expert ids and weights; the combine is the same exchange reversed. gloo has only the
  single-tensor form, so every exchange is one flat tensor with split sizes.
- all-gather / reduce-scatter (vLLM's default; `all_gather_into`, `reduce_scatter_into`): every
  rank gathers every rank's tokens, runs its own experts on all of them (other experts count
  zero) and a reduce-scatter sums the partial outputs and hands each rank its tokens back.
  Simple, but it moves every token to every rank.

Host synchronisations (on a GPU the host waits for the device): one per MoE layer, in
`dispatch`, where the split sizes of the all-to-all are read as Python lists, which
`all_to_all_single` needs (gloo's and NCCL's). Nothing else in a layer reads a value on the
host: the counts are added with `index_add_` (CUDA's `bincount` reads the ids' max), and
`EPStats` keeps its counts on the device until `snapshot()` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class EPStats:
    """One rank's MoE traffic: bytes this rank sent to OTHER ranks, per exchange, and how many
    (token, expert) pairs each of its experts ran (global expert index; zeros elsewhere). The
    byte counts are host ints (from shapes and split sizes the host has); the pair counts are a
    tensor on the tokens' device, added to in every MoE layer and read only by `snapshot()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.dispatch_bytes = 0
        self.combine_bytes = 0
        self.gather_back_bytes = 0
        self.exchanges = 0
        self.expert_tokens = torch.zeros(0, dtype=torch.long)

    def count(
        self, expert_ids: torch.Tensor, num_experts: int, ran: torch.Tensor | None = None
    ) -> None:
        """Add the pairs of `expert_ids` (those where `ran` is true) to their experts' counts,
        on the device: no host sync in the layer."""
        tokens = self.expert_tokens
        if tokens.numel() != num_experts or tokens.device != expert_ids.device:
            self.expert_tokens = torch.zeros(
                num_experts, dtype=torch.long, device=expert_ids.device
            )
        ones = torch.ones_like(expert_ids) if ran is None else ran.long()
        self.expert_tokens.index_add_(0, expert_ids, ones)

    def snapshot(self) -> dict[str, object]:
        return {
            "dispatch_bytes": self.dispatch_bytes,
            "combine_bytes": self.combine_bytes,
            "gather_back_bytes": self.gather_back_bytes,
            "exchanges": self.exchanges,
            "expert_tokens": self.expert_tokens.tolist(),
        }


@dataclass(frozen=True)
class EPGroup:
    """This process's place among the expert-parallel ranks (the executor's ranks)."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    stats: EPStats = field(default_factory=EPStats)


def experts_per_rank(num_experts: int, size: int) -> list[int]:
    """E // size experts per rank, one more for the first E % size ranks (vLLM's split)."""
    if num_experts < size:
        raise ValueError(f"{num_experts} experts cannot be split over {size} expert ranks")
    base, extra = divmod(num_experts, size)
    return [base + (rank < extra) for rank in range(size)]


def expert_map(num_experts: int, size: int, rank: int) -> torch.Tensor:
    """[E] int64: global expert -> its index among `rank`'s experts, or -1 if another owns it."""
    counts = experts_per_rank(num_experts, size)
    start = sum(counts[:rank])
    mapping = torch.full((num_experts,), -1, dtype=torch.long)
    mapping[start : start + counts[rank]] = torch.arange(counts[rank])
    return mapping


def expert_owner(num_experts: int, size: int) -> torch.Tensor:
    """[E] int64: the rank that owns each global expert."""
    counts = torch.tensor(experts_per_rank(num_experts, size))
    return torch.repeat_interleave(torch.arange(size), counts)


@dataclass(frozen=True)
class Dispatched:
    """What a rank received in an all-to-all dispatch, and how to send the results back."""

    rows: torch.Tensor  # [received, H] the tokens to run, grouped by sending rank
    expert_ids: torch.Tensor  # [received] global expert of each row (owned by this rank)
    weights: torch.Tensor  # [received] its routing weight
    send_counts: list[int]  # rows this rank sent to each rank
    recv_counts: list[int]  # rows it received from each rank
    token_index: torch.Tensor  # [sent] which local token each sent row was, in send order


# The executor's private group is a bare gloo/NCCL backend (parallel/group.py), which torch's
# functional wrappers for these three collectives do not accept; a ProcessGroup (tests) is.
def all_to_all_single(
    ep: EPGroup, out: torch.Tensor, x: torch.Tensor, recv: list[int], send: list[int]
) -> None:
    if ep.group is None or isinstance(ep.group, dist.ProcessGroup):
        dist.all_to_all_single(out, x, recv, send, group=ep.group)
    else:
        ep.group.alltoall_base(out, x, recv, send, c10d.AllToAllOptions()).wait()


def all_gather_into(ep: EPGroup, out: torch.Tensor, x: torch.Tensor) -> None:
    if ep.group is None or isinstance(ep.group, dist.ProcessGroup):
        dist.all_gather_into_tensor(out, x, group=ep.group)
    else:
        ep.group._allgather_base(out, x, c10d.AllgatherOptions()).wait()


def reduce_scatter_into(ep: EPGroup, out: torch.Tensor, x: torch.Tensor) -> None:
    if ep.group is None or isinstance(ep.group, dist.ProcessGroup):
        dist.reduce_scatter_tensor(out, x, group=ep.group)
    else:
        ep.group._reduce_scatter_base(out, x, c10d.ReduceScatterOptions()).wait()


def _exchange(ep: EPGroup, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    all_to_all_single(ep, out, x.contiguous(), recv, send)
    return out


def dispatch(
    ep: EPGroup, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, owner: torch.Tensor
) -> Dispatched:
    """Send each (token, expert) pair of this rank's tokens x [n, H] to the expert's owner."""
    k = ids.shape[1]
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    destination = owner[flat_ids]
    order = torch.argsort(destination, stable=True)
    token_index = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[order]
    send_counts = torch.zeros(ep.size, dtype=torch.long, device=x.device)
    send_counts.index_add_(0, destination, torch.ones_like(destination))
    recv_counts = torch.empty_like(send_counts)
    all_to_all_single(ep, recv_counts, send_counts, [1] * ep.size, [1] * ep.size)  # counts first
    # The layer's one host sync: all_to_all_single takes its split sizes as Python lists.
    send, recv = torch.stack([send_counts, recv_counts]).tolist()
    rows = _exchange(ep, x[token_index], send, recv)
    expert_ids = _exchange(ep, flat_ids[order], send, recv)
    received_weights = _exchange(ep, flat_weights[order], send, recv)
    remote = sum(send) - send[ep.rank]
    per_row = x.shape[1] * x.element_size() + 8 + weights.element_size()
    ep.stats.dispatch_bytes += remote * per_row + 8 * (ep.size - 1)
    ep.stats.exchanges += 4
    return Dispatched(rows, expert_ids, received_weights, send, recv, token_index)


def combine(ep: EPGroup, results: torch.Tensor, sent: Dispatched, num_tokens: int) -> torch.Tensor:
    """Send each result row back to the rank it came from; sum each token's k rows there."""
    back = _exchange(ep, results, sent.recv_counts, sent.send_counts)
    remote = sum(sent.recv_counts) - sent.recv_counts[ep.rank]
    ep.stats.combine_bytes += remote * results.shape[1] * results.element_size()
    ep.stats.exchanges += 1
    out = results.new_zeros(num_tokens, results.shape[1])
    return out.index_add_(0, sent.token_index, back)


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of a [rows, H] tensor."""
    return x.shape[1] * x.element_size()
