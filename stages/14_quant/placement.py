"""Placement: the devices each data-parallel replica's ranks run on.

    data_parallel_size=2, tensor_parallel_size=2, four GPUs:
        replica 0: cuda:0 (rank 0, in the replica's engine process), cuda:1 (rank 1, a worker)
        replica 1: cuda:2, cuda:3

Replica i of a tensor-parallel size t owns GPUs [i*t, (i+1)*t), as in vLLM, which offsets a
data-parallel rank's devices by its rank times the tensor-parallel size. The front end
(dp_client.py) gives each replica its base device, cuda:{i*t}; the replica's executor puts rank r
on cuda:{base+r} (executor.rank_devices), and each rank sizes its KV pool from the free memory of
its own GPU. Without a plan every replica would use the same GPUs, and each would size its pool
from the same free memory, read at the same moment. On a CPU every replica and rank shares the
host. Too few GPUs is a ValueError before any process starts.
"""

from __future__ import annotations

import torch

from .config import EngineConfig
from .executor import rank_devices


def device_plan(config: EngineConfig, num_gpus: int | None = None) -> list[list[str]]:
    """Per replica, the device of each of its ranks ("cuda:3", "cpu"): replica i's rank r is on
    cuda:{start + i*t + r}, where t is the tensor-parallel size and start is the index of
    `config.device` (0 unless it names one, as "cuda:2" does). `config.device` None or "auto"
    means cuda when there is a GPU. `num_gpus`: how many GPUs are visible (None: ask CUDA). When
    it is given CUDA is never asked, so a plan can be checked on a machine without a GPU."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    device = _base_device(config.device, num_gpus)
    if device.type != "cuda":
        return [[str(device)] * tp for _ in range(dp)]
    start = device.index or 0
    visible = torch.cuda.device_count() if num_gpus is None else num_gpus
    if start + dp * tp > visible:
        where = f" from cuda:{start}" if start else ""
        raise ValueError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs{where}, "
            f"but {visible} are visible: lower a size, or run where there are more GPUs"
        )
    return [
        [str(d) for d in rank_devices(torch.device("cuda", start + i * tp), tp, visible)]
        for i in range(dp)
    ]


def _base_device(name: str | None, num_gpus: int | None) -> torch.device:
    """The configured device; None or "auto": cuda when a GPU is visible, else cpu."""
    if name in (None, "auto"):
        has_gpu = torch.cuda.is_available() if num_gpus is None else num_gpus > 0
        return torch.device("cuda" if has_gpu else "cpu")
    return torch.device(name)
