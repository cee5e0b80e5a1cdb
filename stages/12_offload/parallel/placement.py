"""Placement: the devices each data-parallel replica's ranks run on.

    data_parallel_size=2, tensor_parallel_size=2, four GPUs:
        replica 0: cuda:0 (rank 0, in the replica's engine process), cuda:1 (rank 1, a worker)
        replica 1: cuda:2, cuda:3

Replica i of a tensor-parallel size t owns GPUs [i*t, (i+1)*t), as in vLLM, which offsets a
data-parallel rank's devices by its rank times the tensor-parallel size. The front end
(frontend/dp_client.py) gives each replica its base device, cuda:{i*t}; the replica's executor puts
rank r on cuda:{base+r} (`rank_devices`), and each rank sizes its KV pool from the free memory of
its own GPU. Without a plan every replica would use the same GPUs, and each would size its pool
from the same free memory, read at the same moment. On a CPU every replica and rank shares the
host. With NCCL, too few GPUs is a ValueError before any process starts. With gloo
(`distributed_backend`), which takes CUDA tensors and lets ranks share a GPU, the plan wraps
modulo the visible GPUs instead, and `ranks_per_device` says how many ranks of the whole plan
share each replica's GPUs, so that their default KV budgets split that GPU's free memory.
"""

from __future__ import annotations

from collections import Counter

import torch

from stages.common.devices import requested_device, resolve_distributed_backend

from ..config import EngineConfig


def device_plan(config: EngineConfig, num_gpus: int | None = None) -> list[list[str]]:
    """Per replica, the device of each of its ranks ("cuda:3", "cpu"): replica i's rank r is on
    cuda:{start + i*t + r}, where t is the tensor-parallel size and start is the index of
    `config.device` (0 unless it names one, as "cuda:2" does); with gloo, modulo the visible
    GPUs. `config.device` None or "auto" means cuda when there is a GPU. `num_gpus`: how many
    GPUs are visible (None: ask CUDA). When it is given CUDA is never asked, so a plan can be
    checked on a machine without a GPU."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    device = requested_device(config.device, None if num_gpus is None else num_gpus > 0)
    backend = resolve_distributed_backend(config.distributed_backend, device.type)
    if device.type != "cuda":
        return [[str(device)] * tp for _ in range(dp)]
    start = device.index or 0
    visible = torch.cuda.device_count() if num_gpus is None else num_gpus
    shared = backend == "gloo" and visible > 0  # gloo: ranks may share a GPU
    if not shared and start + dp * tp > visible:
        where = f" from cuda:{start}" if start else ""
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs{where}, "
            f"but {visible} are visible: lower a size, or run where there are more GPUs"
        )
    bases = [torch.device("cuda", start + i * tp) for i in range(dp)]
    return [[str(d) for d in rank_devices(b, tp, visible, backend=backend)] for b in bases]


def ranks_per_device(plan: list[list[str]]) -> list[int | None]:
    """Per replica of `plan`, the most ranks of the whole plan on any one of its GPUs: what its
    ranks divide a GPU's free memory by for their default KV budget (1 when each rank has its
    own GPU). None on a CPU: each replica counts its own ranks there (the executor), as in
    stage 09."""
    counts = Counter(device for replica in plan for device in replica)
    return [
        max(counts[d] for d in replica) if replica[0].startswith("cuda") else None
        for replica in plan
    ]


def rank_devices(
    device: torch.device, size: int, num_gpus: int | None = None, *, backend: str = "nccl"
) -> list[torch.device]:
    """The device of each of `size` ranks of an engine on `device`. On GPUs rank r of an engine
    on cuda:b runs on cuda:b+r, one GPU each (vLLM offsets a data-parallel replica's ranks the
    same way); on a CPU every rank shares the host. With NCCL, ValueError when the GPUs run out
    (NCCL refuses two ranks on one GPU); with gloo, rank r wraps to cuda:(b+r) mod the visible
    GPUs. `num_gpus`: how many are visible (None: ask CUDA; given, CUDA is never asked)."""
    if device.type != "cuda":
        return [device] * size
    base = device.index or 0
    visible = torch.cuda.device_count() if num_gpus is None else num_gpus
    if backend == "gloo" and visible > 0:
        return [torch.device("cuda", (base + rank) % visible) for rank in range(size)]
    if base + size > visible:
        raise ValueError(
            f"tensor_parallel_size={size} on cuda:{base} needs GPUs cuda:{base}..cuda:"
            f"{base + size - 1}, but {visible} are visible"
        )
    return [torch.device("cuda", base + rank) for rank in range(size)]


def ranks_sharing(devices: list[torch.device]) -> int:
    """The most ranks on any one device: each rank's default KV budget is that device's free
    memory divided by this (every rank of a CPU host; with gloo, the ranks sharing a GPU)."""
    return max(devices.count(device) for device in devices)
