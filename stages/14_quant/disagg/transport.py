"""Moving one request's KV blocks from a prefill engine's pool into a decode engine's pool.

The connector (stage 13) asks for a transfer and polls its handle; the transport moves bytes and
nothing else: which blocks, when, and what a failure means are the state machine's business
(disagg/transfer_state.py). Two transports share one protocol:

- `FakeTransport` (harness/fake_transport.py, a test harness): two ends in one process over a
  dict. A receive completes when its send arrives, or it fails or holds on command, so the
  tests can stage every race.
- `GlooTransport`: a private gloo group between one prefill and one decode process (its own TCP
  store, as stage 09's `init_tensor_parallel`). At start-up the two ends swap their pools'
  layouts (`handshake`): pools that disagree are a ValueError then, never a failed transfer
  later. The sender gathers the request's blocks into one host staging buffer (disagg/kv_staging.py:
  pinned memory and a side stream on CUDA, plain tensors on a CPU) and sends a header (request
  id, block count, layout, payload bytes) and the buffer; the receiver checks the header,
  receives into its own staging buffer and scatters it into its block ids. Bit-exact: the bytes
  are copied, never converted. Every wait has a deadline: a silent peer times out, a dead one
  closes the connection, and both raise `TransferError` instead of hanging.

A failure costs its request alone. Each request's messages carry their own gloo tag, and a
deadline is kept here, not by gloo (whose timeout closes the whole pair): a receive that timed
out may stay posted inside gloo, and a late message lands in its staging buffer under that
request's tag, where no other transfer looks and no cache block is written (writing into cache
blocks freed and handed to another request is SGLang's PR #32564: a request reads another's
KV). A cancelled receive still takes its message, into staging, and skips the scatter.

The wire format: what both ends check before a byte of KV moves. A pair of engines
swaps its pools' layouts once at start-up (`encode_layout`); every request's messages then go
under their own gloo tag (`transfer_tag`) and start with a header (`encode_header`: request id,
block count, layout, payload bytes) that the receiver compares with what it expects
(`check_header`), so a stale or foreign message is refused, never scattered into cache blocks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..kv_connector.base import KVPool  # a PagedKVCache has the same `k` and `v`: tests pass one
from ..quant.kv_cache import block_tensors
from .kv_staging import Stager, layouts, plan_transfer

MAX_ID_BYTES = 96
HANDSHAKE_TAG, FIRST_TAG = 0, 2  # tag 1: the bench's "go"; 2 and up: one per request
LAYOUT_FIELDS = 32
MAGIC = 0x4B56_5846  # "KVXF"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)


class TransferError(RuntimeError):
    """A transfer failed: the peer died or went silent, or the two sides disagreed."""


class TransferRefused(TransferError):
    """The sender has no KV for the request (its lease ran out, or it was aborted): it sent a
    header naming no blocks. The stream between the two ends is still in step."""


def pool_tensors(pool: KVPool) -> tuple[torch.Tensor, ...]:
    """Every tensor that holds a block's state, each [num_layers, num_blocks, ...]: K, V, and a
    quantized pool's scales (`block_tensors`)."""
    return block_tensors(pool)


def transfer_tag(request_id: str) -> int:
    """The gloo tag of a request's messages: its own, so a failed transfer's stale messages
    never match another request's (0 is the handshake's, 1 the bench's)."""
    return FIRST_TAG + zlib.crc32(request_id.encode()) % (2**31 - FIRST_TAG)


def check_pool(pool: KVPool) -> None:
    """At start-up: a pool this transport can move (CPU or CUDA tensors of a known dtype)."""
    for tensor in pool_tensors(pool):
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"a KV transfer moves blocks of {_DTYPES}, not {tensor.dtype}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"a KV transfer stages blocks through host memory from cpu or cuda, not "
                f"{tensor.device}"
            )


def encode_layout(pool: KVPool) -> torch.Tensor:
    """What both ends of a pair must share: per block tensor its dtype code and its shape
    without the block count (the two pools may hold different numbers of blocks)."""
    fields = [MAGIC]
    for tensor in pool_tensors(pool):
        shape = tensor.shape[:1] + tensor.shape[2:]
        fields += [_DTYPES.index(tensor.dtype), len(shape), *shape]
    layout = torch.zeros(LAYOUT_FIELDS, dtype=torch.long)
    layout[: len(fields)] = torch.tensor(fields)
    return layout


def encode_header(request_id: str, pool: KVPool, num_blocks: int) -> torch.Tensor:
    """[magic, blocks, dtype, layers, block_size, kv_heads, head_dim, id length, payload
    bytes, id bytes...]: the payload is the staged message that follows (none: a refusal).

    The codes' dtype tells a float cache from an int8 or fp8 one (stage 14; fp8 travels as its
    uint8 bits), and the payload's size counts the scales, so two engines whose
    `kv_cache_dtype` differ refuse each other's blocks."""
    raw = request_id.encode()
    if len(raw) > MAX_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_ID_BYTES} bytes: {request_id!r}")
    tensors = pool_tensors(pool)
    if pool.k.dtype not in _DTYPES:
        raise ValueError(f"a KV transfer moves blocks of {_DTYPES}, not {pool.k.dtype}")
    layers, _, block_size, heads, dim = pool.k.shape
    payload = plan_transfer(layouts(tensors), range(num_blocks)).nbytes if num_blocks else 0
    fields = [MAGIC, num_blocks, _DTYPES.index(pool.k.dtype), layers, block_size, heads, dim]
    header = torch.zeros(9 + MAX_ID_BYTES, dtype=torch.long)
    header[:9] = torch.tensor([*fields, len(raw), payload])
    header[9 : 9 + len(raw)] = torch.tensor(list(raw))
    return header


def check_header(header: torch.Tensor, request_id: str, pool: KVPool, num_blocks: int) -> None:
    """Raise TransferRefused for the sender's refusal (no blocks), TransferError for a header
    that disagrees with what this end expects."""
    expected = encode_header(request_id, pool, num_blocks)
    if num_blocks and torch.equal(header, encode_header(request_id, pool, 0)):
        raise TransferRefused(f"{request_id}: the sender has no KV for it")
    if not torch.equal(header, expected):
        length = min(max(int(header[7]), 0), MAX_ID_BYTES)
        got = bytes(header[9 : 9 + length].clamp(0, 255).tolist()).decode(errors="replace")
        raise TransferError(
            f"header mismatch: expected {request_id!r}, {num_blocks} blocks, "
            f"layout {expected[2:7].tolist()}, {int(expected[8])} bytes; got {got!r}, "
            f"{int(header[1])} blocks, layout {header[2:7].tolist()}, {int(header[8])} bytes"
        )


MAX_DRAIN_BYTES = 2**36  # a disagreeing header's payload is drained up to this size
GLOO_TIMEOUT = timedelta(days=7)  # never reached: the transfers keep their own deadlines


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
    def handshake(self, pool: KVPool) -> None:
        """At start-up, once the pool exists: a ValueError if the peer's blocks differ."""
        ...

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
    on them). Each request's messages go under its own tag (`transfer_tag`), so a transfer that
    failed leaves nothing the next one could take for its own: a failure costs its request
    alone, and the next transfer tries again. A dead peer fails every transfer at once (gloo
    closed the connection); nothing here restarts it."""

    def __init__(
        self,
        rank: int,
        init_method: str,
        timeout_seconds: float,
        connect_timeout_seconds: float = 60.0,
        serve_store: bool = True,
    ) -> None:
        """Meet the peer (rank 0 serves the TCP store at `init_method`, unless `serve_store`
        is False: a third process serves it; both wait up to `connect_timeout_seconds` for the
        other to start); every transfer then has `timeout_seconds` from its start to its end."""
        if rank not in (0, 1):
            raise ValueError(f"a transfer pair has ranks 0 and 1, got {rank}")
        host, _, port = init_method.partition("://")[2].rpartition(":")
        connect, master = timedelta(seconds=connect_timeout_seconds), serve_store and rank == 0
        self._store = dist.TCPStore(host, int(port), 2, is_master=master, timeout=connect)
        # gloo's own timeout closes the whole pair when it fires: deadlines are kept here instead
        self.group = dist.ProcessGroupGloo(self._store, rank, 2, GLOO_TIMEOUT)
        self.peer = 1 - rank
        self.timeout_seconds = timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self.failures = 0  # transfers that failed (refusals aside): a health counter, no state
        self.last_error: str | None = None
        self._stager: Stager | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")

    def handshake(self, pool: KVPool) -> None:
        """At start-up: both ends swap their pool's layout; two pools whose blocks differ
        (shape, dtype, `kv_cache_dtype`) are a ValueError here, not a failed transfer later."""
        check_pool(pool)
        mine = encode_layout(pool)
        theirs = torch.empty_like(mine)
        deadline = time.monotonic() + self.connect_timeout_seconds
        sent = self.group.send([mine], self.peer, HANDSHAKE_TAG)
        self._wait(self.group.recv([theirs], self.peer, HANDSHAKE_TAG), deadline)
        self._wait(sent, deadline)
        if not torch.equal(mine, theirs):
            raise ValueError(
                "the two engines' KV blocks differ (dtype code, layers, then each block "
                f"tensor's shape without its block count): this end {mine.tolist()}, the peer "
                f"{theirs.tolist()}; start both with the same model, block_size and kv_cache_dtype"
            )
        self._stager = Stager(pool_tensors(pool)[0].device)

    def start_send(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        return self._submit(TransferHandle(request_id), self._send, pool, list(block_ids))

    def start_recv(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        return self._submit(TransferHandle(request_id), self._recv, pool, list(block_ids))

    def close(self) -> None:
        """Wait for the transfer under way (bounded by its deadline, but for a receive's copies
        into the pool: see `Stager.scatter`) and stop the thread."""
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _submit(
        self, handle: TransferHandle, job: Callable[..., None], pool: KVPool, ids: list[int]
    ) -> TransferHandle:
        after = self._stager_for(pool).mark()  # on the engine thread: after its queued work

        def run() -> None:
            try:
                job(handle, pool, ids, time.monotonic() + self.timeout_seconds, after)
                handle._finish()
            except TransferRefused as error:  # the sender had nothing: no fault of the pair
                handle._finish(error)
            except Exception as error:  # a timeout, a dead peer, a disagreement: this one only
                self.failures += 1
                self.last_error = f"{handle.request_id}: {error}"
                handle._finish(error)

        self._thread.submit(run)
        return handle

    def _wait(
        self, work: dist.Work, deadline: float, late: Callable[[], None] | None = None
    ) -> None:
        """Wait for `work` until `deadline` without gloo's timeout (which would close the pair):
        a helper thread waits; past the deadline the transfer fails and the helper keeps the
        message's buffer alive until gloo lets go of it (the tag is this request's alone),
        then runs `late` if the message did come."""
        finished, errors, lock, gave_up = threading.Event(), [], threading.Lock(), [False]

        def wait() -> None:
            try:
                work.wait()
            except Exception as error:  # the peer died: the connection is closed
                errors.append(error)
            with lock:
                finished.set()
                run_late = gave_up[0] and not errors and late is not None
            if run_late:
                late()  # type: ignore[misc]

        threading.Thread(target=wait, name="kv-transfer-wait", daemon=True).start()
        finished.wait(max(0.0, deadline - time.monotonic()))
        with lock:
            if not finished.is_set():
                gave_up[0] = True
                raise TransferError(f"no progress within {self.timeout_seconds} s")
        if errors:
            raise TransferError(str(errors[0])) from errors[0]

    def _drain_late(self, header: torch.Tensor, tag: int) -> None:
        """A header that came after its receive gave up: take the payload that follows it into
        scratch memory, so the sender's send ends and nothing stays posted."""
        nbytes = int(header[8])
        if int(header[0]) == MAGIC and 0 < nbytes <= MAX_DRAIN_BYTES:
            with contextlib.suppress(Exception):  # the peer died meanwhile: nothing to drain
                self.group.recv([torch.empty(nbytes, dtype=torch.uint8)], self.peer, tag).wait()

    def _send(
        self, handle: TransferHandle, pool: KVPool, ids: list[int], deadline: float, after: Any
    ) -> None:
        """The header, then the blocks as one staged message. No blocks: a refusal, the header
        alone (the receiver asked for KV this end no longer has)."""
        tag = transfer_tag(handle.request_id)
        header = encode_header(handle.request_id, pool, len(ids))
        works = [self.group.send([header], self.peer, tag)]
        staging = None  # must outlive its send
        if ids:
            tensors = pool_tensors(pool)
            plan = plan_transfer(layouts(tensors), ids)
            stager = self._stager_for(pool)
            staging = stager.buffer(plan.nbytes)
            stager.gather(tensors, plan, staging, after, deadline - time.monotonic())
            works.append(self.group.send([staging], self.peer, tag))
        for work in works:
            self._wait(work, deadline)
        del staging

    def _recv(
        self, handle: TransferHandle, pool: KVPool, ids: list[int], deadline: float, after: Any
    ) -> None:
        """The header, then the staged blocks, scattered unless cancelled meanwhile (a
        cancelled receive still takes the message, into staging only). A header that disagrees
        is drained (its size is in it) before the error, and so is a late one after a timeout: the
        sender's send ends too, and a stale receive takes its message, never the next one's."""
        tag = transfer_tag(handle.request_id)
        header = torch.empty_like(encode_header(handle.request_id, pool, len(ids)))
        late = functools.partial(self._drain_late, header, tag)
        self._wait(self.group.recv([header], self.peer, tag), deadline, late)
        try:
            check_header(header, handle.request_id, pool, len(ids))
        except TransferRefused:
            raise
        except TransferError:
            self._drain_late(header, tag)  # bounded: the payload follows its header at once
            raise
        tensors = pool_tensors(pool)
        plan = plan_transfer(layouts(tensors), ids)
        stager = self._stager_for(pool)
        staging = stager.buffer(plan.nbytes)
        self._wait(self.group.recv([staging], self.peer, tag), deadline)
        if not handle.cancelled:
            stager.scatter(tensors, plan, staging, after)

    def _stager_for(self, pool: KVPool) -> Stager:
        """The stager of the pool's device (made at the handshake, or at the first transfer of
        an end that skipped it: the tests' and the bench's)."""
        if self._stager is None:
            self._stager = Stager(pool_tensors(pool)[0].device)
        return self._stager
