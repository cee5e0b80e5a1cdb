"""Device and dtype choice: the code is GPU code that also runs on a CPU.

`cuda` when available, else `cpu`; bf16 on GPU, fp32 on CPU (on CPUs without bf16 units, such as
the AVX2 machine the committed plots ran on, bf16 matmuls are slower than fp32).
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str | None = None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings mean something on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


CPU_KV_BUDGET_CAP = 1 << 30  # on a CPU the pool shares RAM with everything else: 1 GiB at most


def kv_memory_budget(device: torch.device) -> int:
    """Default bytes for the KV block pool: half of what is free on a GPU once the weights are
    loaded (vLLM reserves a fraction the same way); on a CPU, a tenth of available RAM, at most
    `CPU_KV_BUDGET_CAP`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        with open("/proc/meminfo") as handle:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle}
        available = info.get("MemAvailable", 8 << 30)
    except OSError:
        available = 8 << 30
    return min(CPU_KV_BUDGET_CAP, available // 10)
