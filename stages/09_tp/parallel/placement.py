"""Placement: the device each tensor-parallel rank runs on.

    tensor_parallel_size=2, an engine on cuda:0:  rank 0 on cuda:0 (the engine's process),
                                                   rank 1 on cuda:1 (a worker)

On GPUs rank r of an engine on cuda:b runs on cuda:b+r, one GPU each (vLLM offsets a
data-parallel replica's ranks the same way; stage 10 gives each replica its own b), and with
NCCL too few GPUs is refused before any worker starts. Gloo (`distributed_backend`) takes CUDA
tensors too, staged through host memory, and lets ranks share a GPU: rank r then runs on
cuda:(b+r) mod the visible GPUs, and the default KV budget splits each GPU's free memory between
the ranks on it (`ranks_per_device`, as the ranks of a CPU host always did). Every process makes
its rank's GPU current before it touches CUDA (`worker.bind_device`), so what runs outside a
step's stream (`prompt_logits`, NCCL's set-up) lands there too, not on cuda:0.
"""

from __future__ import annotations

import torch


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
