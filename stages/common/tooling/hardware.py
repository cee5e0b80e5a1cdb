"""What a benchmark ran on: device, CPU model, cores, memory, library versions, date.

Every plot and JSON carries this, so a number is never separated from its machine.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import time
from functools import cache
from typing import Any

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def hardware_info() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "device": "cuda" if gpu else "cpu",
        "gpu": gpu,
        "cpu_model": _cpu_model(),
        "cpu_cores": cores,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
    }


def versions() -> dict[str, str | None]:
    packages = ("torch", "transformers", "triton", "fastapi", "uvicorn", "numpy")
    return {"python": platform.python_version(), **{p: _version(p) for p in packages}}


def machine_label() -> str:
    """Short text for plot titles, e.g. 'CPU: AMD EPYC, 2 cores'."""
    info = hardware_info()
    if info["gpu"]:
        return f"GPU: {info['gpu']}"
    return f"CPU: {info['cpu_model']}, {info['cpu_cores']} cores"


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


def measure_memory_bandwidth(megabytes: int = 512, repeats: int = 8) -> float:
    """Sustained read bandwidth in GB/s: the best of several full passes over a large buffer.

    Decode at batch 1 must stream every weight once per token, so bandwidth / weight bytes is
    the ceiling on single-request tokens/s (the roofline).
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    buffer.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        buffer.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9
