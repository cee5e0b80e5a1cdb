"""The other process of the two-process transport tests and of the benchmark's transfer
measurement: a prefill end that builds a pool from a seed and sends the blocks it is told to,
or dies on command; and `measure_transfers`, the decode end of that measurement.

Run through `stages.common.spawn.start_stage_process(run_sender, (spec,), ...)`: the child
runs `run_sender(spec, conn)`. It answers on the pipe and exits when the parent says "bye", or
when the parent is silent for `spec.parent_timeout_seconds` (no orphan outlives a test).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from stages.common.spawn import start_stage_process

from ..disagg.transport import (
    GlooTransport,
    encode_header,
    gather_blocks,
    scatter_blocks,
    transfer_tag,
)


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32


class Pool:
    """A KV pool as stage 03's PagedKVCache holds it: k and v [layers, blocks, size, heads,
    dim]."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v


def random_pool(shape: PoolShape, seed: int) -> Pool:
    """The same random pool in every process that asks with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, shape.num_blocks, shape.block_size)
    dims += (shape.num_kv_heads, shape.head_dim)
    k, v = (torch.randn(dims, generator=generator).to(shape.dtype) for _ in "kv")
    return Pool(k, v)


def empty_pool(shape: PoolShape, fill: float = -7.0) -> Pool:
    dims = (shape.num_layers, shape.num_blocks, shape.block_size)
    dims += (shape.num_kv_heads, shape.head_dim)
    return Pool(*(torch.full(dims, fill, dtype=shape.dtype) for _ in "kv"))


@dataclass(frozen=True)
class SenderSpec:
    init_method: str
    shape: PoolShape
    seed: int
    sends: tuple[tuple[str, tuple[int, ...]], ...]  # (request id, source block ids), in order
    die_after_header: bool = False  # send the first request's header, not its blocks, then
    # exit at once (a crashed prefill engine)
    timeout_seconds: float = 10.0
    connect_timeout_seconds: float = 60.0
    parent_timeout_seconds: float = 60.0


def local_gloo_pair(
    timeout_seconds: float, connect_timeout_seconds: float = 30.0
) -> tuple[GlooTransport, GlooTransport]:
    """Both ends of a gloo pair in this process (prefill, decode): each end meets the other in
    its own thread, as two processes would. For tests that swap it into a DisaggregatedPair."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ends: dict[int, GlooTransport] = {}
    errors: list[BaseException] = []

    def meet(rank: int) -> None:
        try:
            ends[rank] = GlooTransport(rank, init, timeout_seconds, connect_timeout_seconds)
        except BaseException as error:  # re-raised below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=meet, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return ends[1], ends[0]  # rank 1 is the prefill end, as make_transport has it


def run_sender(spec: SenderSpec, conn: Connection) -> None:
    torch.set_num_threads(1)
    pool = random_pool(spec.shape, spec.seed)
    transport = GlooTransport(
        1, spec.init_method, spec.timeout_seconds, spec.connect_timeout_seconds
    )
    if spec.die_after_header:
        request_id, ids = spec.sends[0]
        header = encode_header(request_id, pool, len(ids))
        transport.group.send([header], transport.peer, transfer_tag(request_id)).wait()
        conn.send("dying")
        os._exit(1)
    results = []
    for request_id, ids in spec.sends:
        handle = transport.start_send(request_id, pool, ids)
        try:
            handle.result(timeout=3 * spec.timeout_seconds)
            results.append((request_id, "ok"))
        except Exception as error:
            results.append((request_id, f"error: {error}"))
    conn.send(results)
    if conn.poll(spec.parent_timeout_seconds):
        conn.recv()  # "bye"
    transport.close()


@dataclass(frozen=True)
class MeasureSpec:
    init_method: str
    shape: PoolShape
    plan: tuple[tuple[str, tuple[int, ...]], ...]  # (request id, source block ids), in order
    timeout_seconds: float = 60.0


def run_measure_sender(spec: MeasureSpec, conn: Connection) -> None:
    """`measure_transfers`' prefill process: send each planned request when the decode
    process says go (a one-element tensor on tag 1, apart from the KV on tag 0)."""
    torch.set_num_threads(1)
    pool = random_pool(spec.shape, seed=0)
    transport = GlooTransport(1, spec.init_method, spec.timeout_seconds)
    go = torch.zeros(1)
    try:
        for request_id, ids in spec.plan:
            transport.group.recv([go], 0, 1).wait()
            transport.start_send(request_id, pool, ids).result(spec.timeout_seconds)
        conn.send("done")
    finally:
        transport.close()


def scattered_ids(count: int, num_blocks: int) -> tuple[int, ...]:
    """Block ids as a busy pool hands them out: every other block, wrapping."""
    return tuple((2 * i + 1) % num_blocks for i in range(count))


def measure_transfers(shape: PoolShape, token_counts: list[int], repeats: int) -> list[dict]:
    """Median (and minimum) milliseconds to move a prompt's blocks of `shape` between two
    processes over GlooTransport, per prompt length: this process says "go" (a one-element
    tensor on tag 1), starts the receive and waits for it; the other gathers its blocks and
    sends. Beside it, the same gather and scatter in one process (the copies alone)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    blocks = {t: -(-t // shape.block_size) for t in token_counts}
    sizes = [256, *(t for t in token_counts for _ in range(repeats))]  # a warm-up first
    plan = tuple(
        (f"m{i}", scattered_ids(-(-t // shape.block_size), shape.num_blocks))
        for i, t in enumerate(sizes)
    )
    process, conn = start_stage_process(
        run_measure_sender, (MeasureSpec(init, shape, plan),), "kv-measure"
    )
    transport = GlooTransport(0, init, timeout_seconds=60.0)
    received, source = empty_pool(shape), random_pool(shape, seed=0)
    times: dict[int, list[float]] = {t: [] for t in token_counts}
    try:
        for index, ((request_id, ids), tokens) in enumerate(zip(plan, sizes, strict=True)):
            started = time.perf_counter()
            transport.group.send([torch.ones(1)], 1, 1).wait()
            transport.start_recv(request_id, received, tuple(range(len(ids)))).result(120)
            if index:
                times[tokens].append(time.perf_counter() - started)
        assert conn.poll(60) and conn.recv() == "done"
    finally:
        transport.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    rows = []
    for tokens, samples in times.items():
        ids = scattered_ids(blocks[tokens], shape.num_blocks)
        local = []
        for _ in range(repeats):
            started = time.perf_counter()
            scatter_blocks(received, ids[::-1], *gather_blocks(source, ids))
            local.append(time.perf_counter() - started)
        megabytes = received.k[:, : len(ids)].numel() * 2 * received.k.element_size() / 1e6
        rows.append(
            {
                "prompt_tokens": tokens,
                "blocks": len(ids),
                "megabytes": megabytes,
                "transfer_ms": 1e3 * statistics.median(samples),
                "transfer_min_ms": 1e3 * min(samples),
                "gb_per_s": megabytes / 1e3 / statistics.median(samples),
                "local_copy_ms": 1e3 * statistics.median(local),
            }
        )
    return rows
