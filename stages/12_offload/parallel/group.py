"""The tensor-parallel group: which rank this process is, how many there are, and the two
collectives the sharded model needs (all-reduce after a row-parallel matmul, all-gather of the
vocabulary-parallel logits).

Megatron-LM's split (Shoeybi et al., 2019), as vLLM, SGLang and nano-vllm use it: every rank
holds 1/TP of each weight matrix, runs the same forward on its shard, and exchanges activations
twice per layer. `TPGroup()` is the single-process group: its collectives do nothing, so the
model of stage 08 is the special case TP=1.

Every collective counts its calls, bytes and host wall time in `CommStats` (the bench reports
them). On CUDA, NCCL returns before the data moved, so `seconds` is launch time there; on a CPU
with gloo the call blocks until the exchange is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stages.common.model_config import ModelConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class CommStats:
    """Counters of one process's collectives (mutable, unlike the group that holds them)."""

    __slots__ = (
        "all_gather_bytes",
        "all_gather_calls",
        "all_reduce_bytes",
        "all_reduce_calls",
        "seconds",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.all_reduce_calls = 0
        self.all_reduce_bytes = 0
        self.all_gather_calls = 0
        self.all_gather_bytes = 0
        self.seconds = 0.0

    def snapshot(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in sorted(self.__slots__)}


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. `group` is None when size == 1."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the same sum); no-op at size 1.

        Bytes counted are the tensor's size: what each rank contributes, not what a ring
        algorithm moves on the wire (about 2 (TP-1)/TP times that)."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.seconds += time.perf_counter() - started
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += x.numel() * x.element_size()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order; `x` itself at size 1.

        Bytes counted are the gathered result's size. Gloo has no all_gather into one tensor,
        so the list form is used on every backend (one code path)."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        gathered = torch.cat(parts, dim=dim)
        self.stats.seconds += time.perf_counter() - started
        self.stats.all_gather_calls += 1
        self.stats.all_gather_bytes += gathered.numel() * gathered.element_size()
        return gathered


def open_rendezvous(size: int, timeout_seconds: float) -> tuple[dist.TCPStore, str]:
    """Rank 0's TCP store, on a port the OS picks as the store binds it, and the address the
    other ranks join. A port probed free and bound later can be taken in between (it was, once,
    by a test next to ours): binding port 0 leaves no such window."""
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
    return store, f"tcp://127.0.0.1:{store.port}"


def init_tensor_parallel(
    rank: int,
    size: int,
    init_method: str,
    backend: str,
    timeout_seconds: float,
    store: dist.TCPStore | None = None,
) -> TPGroup:
    """Join a tensor-parallel group (gloo on CPU, nccl on CUDA: the caller chooses) and return
    this rank's group. Every collective then fails after `timeout_seconds` instead of hanging
    when a peer is gone. Size 1 starts nothing.

    The group is a private one, made from its own TCP store, not torch's default process
    group: one process may hold several engines (a test suite does), each with its own ranks.
    Rank 0 may pass the store it opened (`open_rendezvous`)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of size {size}")
    if size == 1:
        return TPGroup()
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    timeout = timedelta(seconds=timeout_seconds)
    if store is None:
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return TPGroup(rank=rank, size=size, group=group)  # the group keeps its store alive


def check_tensor_parallel_fits(model_config: ModelConfig, size: int) -> None:
    """Refuse, with the sizes named, a group the model cannot be split over.

    Query heads and MLP columns must divide evenly. KV heads are split when there are at least
    as many as ranks (evenly) and replicated when there are fewer (then each KV head serves a
    whole number of ranks). The vocabulary never refuses: it is padded to a multiple of TP."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    mc = model_config
    if mc.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {mc.num_heads} "
            f"attention heads (num_heads={mc.num_heads})"
        )
    if mc.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the MLP's "
            f"intermediate_size={mc.intermediate_size}"
        )
    if size % mc.num_kv_heads and mc.num_kv_heads % size:
        raise ValueError(
            f"num_kv_heads={mc.num_kv_heads} can be neither split over nor replicated across "
            f"tensor_parallel_size={size} ranks (one must divide the other)"
        )


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when there are fewer."""
    return max(1, num_kv_heads // size)


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> range:
    """The checkpoint's KV heads that `rank` holds.

    With at least as many KV heads as ranks, a contiguous slice. With fewer, the single head
    r * num_kv_heads // size (mini-sglang's rule): ranks 2h and 2h+1 of 4 over 2 KV heads both
    hold head h, which is the head their query heads read in the unsplit model."""
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


# The group of a model that runs in one process (stage 08's): its collectives do nothing.
SINGLE_PROCESS = TPGroup()
