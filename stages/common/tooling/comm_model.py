"""Two numbers the stage 09 benchmark needs besides its own runs.

1. `broadcast_seconds`: what a gloo `broadcast_object_list` of one step's scheduler output
   costs between two processes on this machine, to set against the pipe writes the executor
   makes instead (executor.py says why it writes to pipes).
2. `modelled_step_ms`: a MODELLED decode step of a large model on NVLink GPUs, since tensor
   parallelism's point (a model too big or too slow for one GPU) cannot show on a 2-core CPU.
   No GPU was measured; the formula and every constant are here and in the README:

       step(TP) = W / TP / HBM  +  A * (latency + 2 (TP - 1) / TP * M / NVLINK)

   W weight bytes, HBM one GPU's memory bandwidth, A all-reduces per step (2 per layer + 1 for
   the embedding), M bytes of one all-reduce (batch x hidden x 2 bytes in bf16), NVLINK one
   GPU's NVLink bandwidth per direction, latency a small all-reduce's fixed cost (ring).
"""

from __future__ import annotations

import os
import subprocess
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from stages.common.spawn import start_stage_process

# Llama-3-70B in bf16 on H100 SXM GPUs (public specifications; assumptions, not measurements).
MODEL_PARAMS = 70.6e9
NUM_LAYERS = 80
HIDDEN = 8192
BYTES_PER_VALUE = 2  # bf16
HBM_BYTES_PER_S = 3.35e12
NVLINK_BYTES_PER_S = 450e9  # per direction, per GPU (NVLink 4: 900 GB/s both ways)
ALL_REDUCE_LATENCY_S = 10e-6  # NCCL small-message all-reduce over NVLink, order of magnitude
GPU_MEMORY_BYTES = 80e9
BATCH = 8


def modelled_step_ms(tp: int, batch: int = BATCH) -> dict[str, float | bool]:
    """The decode step of the modelled model at tensor-parallel size `tp` (see the docstring)."""
    weights = MODEL_PARAMS * BYTES_PER_VALUE
    weights_s = weights / tp / HBM_BYTES_PER_S
    all_reduces = 2 * NUM_LAYERS + 1
    message = batch * HIDDEN * BYTES_PER_VALUE
    per_reduce = ALL_REDUCE_LATENCY_S + 2 * (tp - 1) / tp * message / NVLINK_BYTES_PER_S
    reduce_s = all_reduces * per_reduce if tp > 1 else 0.0
    return {
        "weights_ms": 1000 * weights_s,
        "all_reduce_ms": 1000 * reduce_s,
        "step_ms": 1000 * (weights_s + reduce_s),
        "fits_in_gpu_memory": weights / tp < GPU_MEMORY_BYTES,
    }


def broadcast_seconds(payload_bytes: int, rounds: int, timeout_s: float = 120.0) -> float:
    """Median seconds rank 0 spends in one `broadcast_object_list` of `payload_bytes` bytes to
    one other process (gloo, this host), over `rounds` broadcasts."""
    # rank 0's store, on a port the OS picks as it binds it (no probed port to lose meanwhile)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)
    peer, conn = start_stage_process(_peer, (store.port, rounds, timeout_s), name="bcast-peer")
    try:
        return _broadcast_rounds(0, store, payload_bytes, rounds, timeout_s)
    finally:
        try:
            peer.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            peer.kill()
        conn.close()


def _peer(port: int, rounds: int, timeout_s: float, conn: Connection) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=timeout_s))
    _broadcast_rounds(1, store, 0, rounds, timeout_s)
    conn.close()


def _broadcast_rounds(
    rank: int, store: dist.Store, payload_bytes: int, rounds: int, timeout_s: float
) -> float:
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s)
    )
    try:
        payload = os.urandom(payload_bytes)
        times = []
        for _ in range(rounds):
            message = [payload if rank == 0 else None]
            started = time.perf_counter()
            dist.broadcast_object_list(message, src=0)
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]
    finally:
        dist.destroy_process_group()
