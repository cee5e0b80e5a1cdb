"""Moving one request's KV blocks from a prefill engine's pool into a decode engine's pool.

The connector (stage 13) asks for a transfer and polls its handle; the transport moves bytes and
nothing else: which blocks, when, and what a failure means are the state machine's business
(transfer_state.py). Two transports share one protocol:

- `FakeTransport` (fake_transport.py): two ends in one process over a dict. A receive completes
  when its send arrives, or it fails or holds on command, so the tests can stage every race.
- `GlooTransport`: a private gloo group between one prefill and one decode process (its own TCP
  store, as stage 09's `init_tensor_parallel`). The sender gathers the request's blocks layer
  by layer (`index_select` on the block ids) and sends them; the receiver checks a header
  (request id, block count, dtype, shape), receives each layer into a staging buffer and
  scatters it into its own block ids (`index_copy_`). Bit-exact: the bytes are copied, never
  converted. Every wait has a deadline: a silent peer times out, a dead one closes the
  connection, and both raise `TransferError` instead of hanging.

Why staging, not receiving straight into the cache: a receive that timed out may still be
posted inside gloo, and a late message would land in its buffer. Into a staging tensor that is
harmless; into cache blocks freed and handed to another request it is SGLang's PR #32564 (a
request reads another's KV). A cancelled receive keeps draining the stream into staging and
skips the scatters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from .kv_quant import block_tensors

MAX_ID_BYTES = 96
_MAGIC = 0x4B56_5846  # "KVXF"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)


class TransferError(RuntimeError):
    """A transfer failed: the peer died or went silent, or the two sides disagreed."""


class TransferRefused(TransferError):
    """The sender has no KV for the request (its lease ran out, or it was aborted): it sent a
    header naming no blocks. The stream between the two ends is still in step."""


class KVPool(Protocol):
    """What a transport reads and writes: stage 03's `PagedKVCache` fits. `k` and `v` are
    [num_layers, num_blocks, block_size, num_kv_heads, head_dim]. A quantized cache (stage 14)
    also has `scales`, per-block tensors that move with the codes (`kv_quant.block_tensors`)."""

    k: torch.Tensor
    v: torch.Tensor


class TransferHandle:
    """One transfer under way. `done()` means drained: the transport will not touch the
    request's blocks again, so the state machine may free them."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.error: BaseException | None = None
        self.cancelled = False
        self.on_cancel: Callable[[], None] | None = None  # a transport that must act on it
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop touching the blocks: no later write reaches them; `done()` follows."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def result(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) and raise the transfer's error, if any."""
        if not self._done.wait(timeout):
            raise TransferError(f"{self.request_id}: not done after {timeout} s")
        if self.error is not None:
            kind = TransferRefused if isinstance(self.error, TransferRefused) else TransferError
            raise kind(f"{self.request_id}: {self.error}") from self.error
        if self.cancelled:
            raise TransferError(f"{self.request_id}: cancelled")

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class KVTransport(Protocol):
    def start_send(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        """Start sending the blocks `block_ids` of `pool`; returns at once."""
        ...

    def start_recv(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        """Start receiving the request's blocks into `block_ids` of `pool`; returns at once."""
        ...

    def close(self) -> None: ...


def gather_blocks(pool: KVPool, block_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Copies of the blocks' tensors (`block_tensors`: K, V, and a quantized pool's scales)."""
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    return tuple(tensor.index_select(1, ids) for tensor in block_tensors(pool))


def scatter_blocks(pool: KVPool, block_ids: Sequence[int], *blocks: torch.Tensor) -> None:
    """Write `gather_blocks`' tensors into `block_ids`; a sender whose pool holds other tensors
    (a quantized cache against a float one, int8 against fp8) is a TransferError."""
    targets = block_tensors(pool)
    layouts = [(tensor.dtype, tensor.shape[2:]) for tensor in targets]
    if [(block.dtype, block.shape[2:]) for block in blocks] != layouts:
        raise TransferError(f"the sender's blocks are not this pool's: expected {layouts}")
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    for target, block in zip(targets, blocks, strict=True):
        target.index_copy_(1, ids, block)


class GlooTransport:
    """One end of a gloo pair: rank 0 and rank 1 of a private two-process group. Transfers run
    one at a time, in the order started, on a background thread (the engine loop never blocks
    on them); the two ends must start matching transfers in the same order. After an error the
    stream between the two is out of step: every later transfer fails at once (`broken`)."""

    def __init__(
        self,
        rank: int,
        init_method: str,
        timeout_seconds: float,
        connect_timeout_seconds: float = 60.0,
    ) -> None:
        """Meet the peer (rank 0 serves the TCP store; both wait up to
        `connect_timeout_seconds` for the other to start); every transfer then has
        `timeout_seconds` from its start to its end."""
        if rank not in (0, 1):
            raise ValueError(f"a transfer pair has ranks 0 and 1, got {rank}")
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        connect = timedelta(seconds=connect_timeout_seconds)
        self._store = dist.TCPStore(host, int(port), 2, is_master=rank == 0, timeout=connect)
        self.group = dist.ProcessGroupGloo(self._store, rank, 2, connect)
        self.peer = 1 - rank
        self.timeout_seconds = timeout_seconds
        self.broken: str | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")

    def start_send(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        return self._submit(TransferHandle(request_id), self._send, pool, list(block_ids))

    def start_recv(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        return self._submit(TransferHandle(request_id), self._recv, pool, list(block_ids))

    def close(self) -> None:
        """Wait for the transfer under way (bounded by its deadline) and stop the thread."""
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _submit(
        self, handle: TransferHandle, job: Callable[..., None], pool: KVPool, ids: list[int]
    ) -> TransferHandle:
        def run() -> None:
            try:
                if self.broken:
                    raise TransferError(f"transport broken earlier: {self.broken}")
                job(handle, pool, ids, time.monotonic() + self.timeout_seconds)
                handle._finish()
            except TransferRefused as error:  # a header and nothing else: still in step
                handle._finish(error)
            except Exception as error:  # gloo raises RuntimeError for timeouts and dead peers
                self.broken = self.broken or f"{handle.request_id}: {error}"
                handle._finish(error)

        self._thread.submit(run)
        return handle

    def _wait(self, work: dist.Work, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"no progress within {self.timeout_seconds} s")
        work.wait(timedelta(seconds=left))

    def _send(self, handle: TransferHandle, pool: KVPool, ids: list[int], deadline: float) -> None:
        """The header, then each layer's K and V of the blocks. No blocks: a refusal, the
        header alone (the receiver asked for KV this end no longer has)."""
        header = encode_header(handle.request_id, pool, len(ids))
        index = torch.tensor(ids, dtype=torch.long)
        self._wait(self.group.send([header], self.peer, 0), deadline)
        if not ids:
            return
        pending = []  # (work, its tensor): the tensor must outlive the send
        for layer in range(pool.k.shape[0]):
            for cache in block_tensors(pool):  # K, V (and a quantized pool's scales)
                blocks = cache[layer].index_select(0, index)  # a copy: the send runs async
                pending.append((self.group.send([blocks], self.peer, 0), blocks))
        for work, _ in pending:
            self._wait(work, deadline)

    def _recv(self, handle: TransferHandle, pool: KVPool, ids: list[int], deadline: float) -> None:
        header = torch.empty_like(encode_header(handle.request_id, pool, len(ids)))
        self._wait(self.group.recv([header], self.peer, 0), deadline)
        check_header(header, handle.request_id, pool, len(ids))
        index = torch.tensor(ids, dtype=torch.long)
        caches = block_tensors(pool)
        staging = [torch.empty((len(ids), *c.shape[2:]), dtype=c.dtype) for c in caches]
        for layer in range(pool.k.shape[0]):
            for cache, buffer in zip(caches, staging, strict=True):
                self._wait(self.group.recv([buffer], self.peer, 0), deadline)
                if not handle.cancelled:
                    cache[layer].index_copy_(0, index, buffer)


def encode_header(request_id: str, pool: KVPool, num_blocks: int) -> torch.Tensor:
    """[magic, blocks, dtype, layers, block_size, kv_heads, head_dim, id length, id bytes...]

    The codes' dtype tells a float cache from an int8 or fp8 one (stage 14; fp8 travels as its
    uint8 bits), so two engines whose `kv_cache_dtype` differ refuse each other's blocks."""
    raw = request_id.encode()
    if len(raw) > MAX_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_ID_BYTES} bytes: {request_id!r}")
    if pool.k.dtype not in _DTYPES or pool.k.device.type != "cpu":
        raise ValueError(f"gloo moves CPU tensors of {_DTYPES}, not {pool.k.dtype}")
    layers, _, block_size, heads, dim = pool.k.shape
    fields = [_MAGIC, num_blocks, _DTYPES.index(pool.k.dtype), layers, block_size, heads, dim]
    header = torch.zeros(8 + MAX_ID_BYTES, dtype=torch.long)
    header[:8] = torch.tensor([*fields, len(raw)])
    header[8 : 8 + len(raw)] = torch.tensor(list(raw))
    return header


def check_header(header: torch.Tensor, request_id: str, pool: KVPool, num_blocks: int) -> None:
    """Raise TransferRefused for the sender's refusal (no blocks), TransferError for a header
    that disagrees with what this end expects."""
    expected = encode_header(request_id, pool, num_blocks)
    if num_blocks and torch.equal(header, encode_header(request_id, pool, 0)):
        raise TransferRefused(f"{request_id}: the sender has no KV for it")
    if not torch.equal(header, expected):
        length = min(max(int(header[7]), 0), MAX_ID_BYTES)
        got = bytes(header[8 : 8 + length].clamp(0, 255).tolist()).decode(errors="replace")
        raise TransferError(
            f"header mismatch: expected {request_id!r}, {num_blocks} blocks, "
            f"layout {expected[2:7].tolist()}; got {got!r}, {int(header[1])} blocks, "
            f"layout {header[2:7].tolist()}"
        )
