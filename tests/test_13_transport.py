"""Stage 13's transports (transport.py, harness/fake_transport.py): bytes arrive unchanged in the
receiver's own block ids, nothing else in its pool changes; a refusal (the sender has no KV for
the request) fails that transfer alone; a dead or silent peer gives an error within the
deadline, never a hang.

The two-process tests start their sender processes (harness/transfer_peer.py) once per module,
together (their torch imports overlap), through `start_stage_process`."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType, SimpleNamespace

import pytest
import torch

from stages.common.spawn import start_stage_process

from .conftest import requires_cuda, since, subject

pytestmark = [
    since("13"),
    subject(
        "disagg/transport.py",
        "disagg/kv_staging.py",
        "harness/fake_transport.py",
        "harness/transfer_peer.py",
    ),
]

# (request id, prefill's block ids, decode's block ids): uneven, unsorted, disjoint on decode
# (blocks 7, 8, 10 stay untouched)
MOVES = (
    ("req-a", (7, 2, 11), (0, 5, 3)),
    ("req-b", (4,), (9,)),
    ("req-c-" + "x" * 40, (1, 0, 3, 5, 6, 8, 15, 9, 2), (15, 14, 12, 13, 1, 2, 4, 6, 11)),
)
TIMEOUT = 3.0
SEED = 1234


def _modules(stage: ModuleType) -> SimpleNamespace:
    """The stage's transport, staging, fake transport and peer modules, as one namespace."""
    names = (
        "disagg.transport",
        "disagg.kv_staging",
        "harness.fake_transport",
        "harness.transfer_peer",
    )
    found = [importlib.import_module(f"{stage.__name__}.{n}") for n in names]
    return SimpleNamespace(**{k: v for m in found for k, v in vars(m).items() if k[0] != "_"})


def _shape(m: SimpleNamespace):
    return m.PoolShape(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)


def assert_moved_exactly(sent, received, moves, untouched_fill: float = -7.0) -> None:
    """Each destination block equals its source block bit for bit; blocks outside every
    destination still hold the fill."""
    written: set[int] = set()
    for _, source, destination in moves:
        for name in ("k", "v"):
            got = getattr(received, name)[:, list(destination)]
            want = getattr(sent, name)[:, list(source)]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
        written |= set(destination)
    others = [b for b in range(received.k.shape[1]) if b not in written]
    assert bool((received.k[:, others] == untouched_fill).all())
    assert bool((received.v[:, others] == untouched_fill).all())


# ---------------------------------------------------------------- in one process
def test_fake_transport_moves_blocks_bit_exact_into_other_ids(stage) -> None:
    """Sent first or received first (the receive waits for its send): the same bytes."""
    m = _modules(stage)
    prefill, decode = m.FakeTransport.pair()
    sent, received = m.random_pool(_shape(m), SEED), m.empty_pool(_shape(m))
    for i, (rid, source, destination) in enumerate(MOVES):
        if i % 2:
            waiting = decode.start_recv(rid, received, destination)
            assert not waiting.done()
            prefill.start_send(rid, sent, source).result(timeout=1)
            waiting.result(timeout=1)
        else:
            prefill.start_send(rid, sent, source).result(timeout=1)
            decode.start_recv(rid, received, destination).result(timeout=1)
    assert_moved_exactly(sent, received, MOVES)


def test_fake_transport_fails_holds_refuses_and_cancels_on_command(stage) -> None:
    m = _modules(stage)
    prefill, decode = m.FakeTransport.pair()
    sent, received = m.random_pool(_shape(m), SEED), m.empty_pool(_shape(m))
    decode.mode = "fail"
    with pytest.raises(m.TransferError):
        decode.start_recv("r", received, (0,)).result(timeout=1)
    decode.mode = "hold"
    prefill.start_send("r", sent, (3,)).result(timeout=1)
    held = decode.start_recv("r", received, (0,))
    assert not held.done()
    held.cancel()  # a decode abort mid-transfer: the late bytes must not reach the pool
    decode.release()
    assert held.done() and bool((received.k == -7.0).all())
    with pytest.raises(m.TransferError, match="cancelled"):
        held.result(timeout=1)
    decode.mode = "ok"
    waiting = decode.start_recv("never-sent", received, (1,))
    waiting.cancel()  # cancelled while it waits for a send: drained at once, nothing written
    with pytest.raises(m.TransferError, match="cancelled"):
        waiting.result(timeout=1)
    refused = decode.start_recv("gone", received, (2,))
    prefill.start_send("gone", sent, ()).result(timeout=1)  # no blocks: a refusal
    with pytest.raises(m.TransferRefused):
        refused.result(timeout=1)
    assert bool((received.k == -7.0).all())


def test_header_names_what_disagrees(stage) -> None:
    m = _modules(stage)
    pool = m.empty_pool(_shape(m))
    header = m.encode_header("req-a", pool, 3)
    m.check_header(header, "req-a", pool, 3)
    with pytest.raises(m.TransferError, match="req-b"):
        m.check_header(header, "req-b", pool, 3)
    with pytest.raises(m.TransferError, match="blocks"):
        m.check_header(header, "req-a", pool, 4)
    half = m.empty_pool(replace(_shape(m), dtype=torch.float16))
    with pytest.raises(m.TransferError, match="layout"):
        m.check_header(header, "req-a", half, 3)
    with pytest.raises(m.TransferRefused):  # a header naming no blocks: the sender has none
        m.check_header(m.encode_header("req-a", pool, 0), "req-a", pool, 3)


def test_plan_lays_out_each_tensor_aligned_in_the_blocks_order(stage) -> None:
    """The plan: one segment per block tensor, [layers, blocks, ...] in the order asked, each
    at an aligned offset; a block out of range or named twice is refused before any copy."""
    m = _modules(stage)
    pool_layouts = [((3, 16, 4, 2, 8), torch.float16), ((3, 16, 2), torch.float32)]
    plan = m.plan_transfer(pool_layouts, (7, 2, 11))
    assert plan.block_ids == (7, 2, 11)
    first, second = plan.segments
    assert (first.offset, first.shape, first.nbytes) == (0, (3, 3, 4, 2, 8), 3 * 3 * 64 * 2)
    assert second.offset % m.ALIGN == 0 and second.offset >= first.nbytes
    assert (second.shape, second.nbytes) == ((3, 3, 2), 3 * 3 * 2 * 4)
    assert plan.nbytes >= second.offset + second.nbytes
    assert m.plan_transfer(pool_layouts, ()).segments[0].nbytes == 0
    with pytest.raises(ValueError, match="twice"):
        m.plan_transfer(pool_layouts, (1, 1))
    with pytest.raises(ValueError, match="outside"):
        m.plan_transfer(pool_layouts, (16,))


def test_staging_gathers_and_scatters_bit_exact_and_nothing_else(stage) -> None:
    """The staging path on plain CPU tensors (CUDA runs the same calls with pinned memory and a
    side stream): gather from one pool's blocks, scatter into other ids of another pool."""
    m = _modules(stage)
    sent, received = m.random_pool(_shape(m), SEED), m.empty_pool(_shape(m))
    stager = m.Stager(torch.device("cpu"))
    assert stager.mark() is None and stager.stream is None
    for _, source, destination in MOVES:
        plan = m.plan_transfer(m.layouts((sent.k, sent.v)), source)
        staging = stager.buffer(plan.nbytes)
        stager.gather((sent.k, sent.v), plan, staging)
        stager.scatter((received.k, received.v), replace(plan, block_ids=destination), staging)
    assert_moved_exactly(sent, received, MOVES)


def test_a_send_whose_staging_copies_never_end_times_out_instead_of_hanging(
    stage, monkeypatch
) -> None:
    """On CUDA a send's staging copies follow the forwards queued before it, and one hung on a
    dead peer's collective never ends: the wait on them is polled under the transfer's
    deadline (`synchronize()` has none; it would hold the transfer thread, and the transport's
    close, for ever). Stand-ins for the side stream and its event drive that branch here."""
    m = _modules(stage)
    staging = importlib.import_module(f"{stage.__name__}.disagg.kv_staging")

    class NeverEnds:
        def record(self, stream: object = None) -> None:
            pass

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            raise AssertionError("an unbounded wait on the staging copies")

    monkeypatch.setattr(staging.torch.cuda, "Event", NeverEnds)
    monkeypatch.setattr(staging.torch.cuda, "stream", lambda _: contextlib.nullcontext())
    sent = m.random_pool(_shape(m), SEED)
    stager = m.Stager(torch.device("cpu"))
    stager.stream = object()  # as on CUDA: the copies go to a side stream and end as an event
    plan = m.plan_transfer(m.layouts((sent.k, sent.v)), (1, 2))
    with pytest.raises(TimeoutError, match=r"staging copies did not end within 0\.05 s"):
        stager.gather((sent.k, sent.v), plan, stager.buffer(plan.nbytes), None, 0.05)


def test_a_timed_out_gloo_transfer_costs_that_request_alone(stage) -> None:
    """One receive whose send never comes times out; the next request's transfer moves its
    blocks bit-exact over the same pair (nothing is "broken" for good), and the late send of
    the first lands nowhere in the pool."""
    m = _modules(stage)
    prefill, decode = m.local_gloo_pair(timeout_seconds=0.5)
    try:
        sent, received = m.random_pool(_shape(m), SEED), m.empty_pool(_shape(m))
        lost = decode.start_recv("req-lost", received, (8, 10))
        with pytest.raises(m.TransferError, match=r"(?i)progress|timed out"):
            lost.result(timeout=30)
        assert decode.failures == 1
        # the transfers that must succeed get a deadline no loaded machine misses (each reads
        # `timeout_seconds` when it starts): 0.5 s was a bet on the machine's speed
        prefill.timeout_seconds = decode.timeout_seconds = 30.0
        for rid, source, destination in MOVES:
            handle = decode.start_recv(rid, received, destination)
            prefill.start_send(rid, sent, source).result(timeout=30)
            handle.result(timeout=30)
        late = prefill.start_send("req-lost", sent, (1, 2))  # taken by the stale receive
        late.result(timeout=30)  # into scratch memory: the sender's send ends, nothing lingers
        refused = decode.start_recv("req-refused", received, (7,))
        prefill.start_send("req-refused", sent, ()).result(timeout=30)
        with pytest.raises(m.TransferRefused):
            refused.result(timeout=30)
        assert decode.failures == 1, decode.last_error
        assert_moved_exactly(sent, received, MOVES)
    finally:
        prefill.close()
        decode.close()


def test_gloo_handshake_refuses_pools_that_differ_at_start_up(stage) -> None:
    """Pools that agree meet (their block counts may differ); a dtype or a shape that differs
    is a ValueError at the handshake, on both ends."""
    m = _modules(stage)
    cases = [
        (_shape(m), replace(_shape(m), num_blocks=5), None),
        (_shape(m), replace(_shape(m), dtype=torch.float16), "differ"),
        (_shape(m), replace(_shape(m), block_size=8), "differ"),
    ]
    for mine, theirs, error in cases:
        prefill, decode = m.local_gloo_pair(timeout_seconds=5.0)
        results: dict[str, BaseException | None] = {}

        def meet(end, shape, name, results=results) -> None:
            try:
                end.handshake(m.empty_pool(shape))
                results[name] = None
            except ValueError as exc:
                results[name] = exc

        threads = [
            threading.Thread(target=meet, args=(prefill, mine, "prefill")),
            threading.Thread(target=meet, args=(decode, theirs, "decode")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        prefill.close()
        decode.close()
        if error is None:
            assert results == {"prefill": None, "decode": None}
        else:
            assert all(error in str(results[name]) for name in ("prefill", "decode")), results


def test_fake_handshake_refuses_pools_that_differ(stage) -> None:
    m = _modules(stage)
    prefill, decode = m.FakeTransport.pair()
    prefill.handshake(m.empty_pool(_shape(m)))
    decode.handshake(m.empty_pool(replace(_shape(m), num_blocks=3)))  # fewer blocks: fine
    with pytest.raises(ValueError, match="differ"):
        decode.handshake(m.empty_pool(replace(_shape(m), dtype=torch.float16)))


@requires_cuda("two CUDA pools, pinned staging and a copy stream")
def test_cuda_pools_move_bit_exact_through_pinned_staging(stage) -> None:
    """Two CUDA KV pools (one GPU, two caches) over an in-process gloo pair: the blocks pass
    through pinned host buffers on a side stream and arrive bit-identical; a CUDA pool through
    the fake transport too."""
    m = _modules(stage)
    device = torch.device("cuda")
    sent, received = m.random_pool(_shape(m), SEED), m.empty_pool(_shape(m))
    sent.k, sent.v = sent.k.to(device), sent.v.to(device)
    received.k, received.v = received.k.to(device), received.v.to(device)
    prefill, decode = m.local_gloo_pair(timeout_seconds=30.0)
    try:
        assert decode._stager_for(received).stream is not None
        assert decode._stager_for(received).buffer(8).is_pinned()
        for rid, source, destination in MOVES:
            handle = decode.start_recv(rid, received, destination)
            prefill.start_send(rid, sent, source).result(timeout=60)
            handle.result(timeout=60)
    finally:
        prefill.close()
        decode.close()
    cpu = SimpleNamespace
    assert_moved_exactly(
        cpu(k=sent.k.cpu(), v=sent.v.cpu()), cpu(k=received.k.cpu(), v=received.v.cpu()), MOVES
    )
    fake_prefill, fake_decode = m.FakeTransport.pair()
    again = m.empty_pool(_shape(m))
    again.k, again.v = again.k.to(device), again.v.to(device)
    for rid, source, destination in MOVES:
        fake_prefill.start_send(rid, sent, source).result(timeout=60)
        fake_decode.start_recv(rid, again, destination).result(timeout=60)
    assert torch.equal(again.k.cpu().view(torch.int32), received.k.cpu().view(torch.int32))
    assert torch.equal(again.v.cpu().view(torch.int32), received.v.cpu().view(torch.int32))


# ---------------------------------------------------------------- two processes
_STORES: list[object] = []  # the senders' pairs' stores, held until the module ends
_SENDERS: dict[str, dict[str, tuple[subprocess.Popen, object, str]]] = {}  # per stage
REFUSED = ("req-refused", (), (6, 7))  # the sender has nothing: a header naming no blocks


@pytest.fixture(scope="module", autouse=True)
def _stop_senders() -> Iterator[None]:
    yield
    for started in _SENDERS.values():
        for process, conn, _ in started.values():
            with contextlib.suppress(OSError):
                conn.send("bye")
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    _SENDERS.clear()
    _STORES.clear()


@pytest.fixture
def senders(stage) -> dict[str, tuple[subprocess.Popen, object, str]]:
    """Three prefill processes per stage, started together: one sends MOVES (and a refusal
    after the first), one dies mid-transfer, one connects and never sends."""
    if stage.__name__ not in _SENDERS:
        m, started = _modules(stage), {}
        moves = tuple((rid, source) for rid, source, _ in MOVES)
        good = (moves[0], REFUSED[:2], *moves[1:])
        for name, sends, die_after in (("good", good, 0), ("dies", moves, 1), ("silent", (), 0)):
            # a store this process serves on a port the OS picked as it bound it (stage 09's
            # rendezvous): both ends join it (serve_store=False), no probed port to lose
            parallel = importlib.import_module(f"{stage.__name__}.parallel.group")
            store, init = parallel.open_rendezvous(2, 60.0)
            _STORES.append(store)
            spec = m.SenderSpec(init, _shape(m), SEED, sends, bool(die_after), TIMEOUT)
            process, conn = start_stage_process(m.run_sender, (spec,), name=f"kv-sender-{name}")
            started[name] = (process, conn, init)
        _SENDERS[stage.__name__] = started
    return _SENDERS[stage.__name__]


@pytest.mark.slow
def test_gloo_moves_random_blocks_bit_exact_with_uneven_ids(stage, senders) -> None:
    """The refusal between the first and second request fails that receive alone: the pair
    stays in step and the rest arrive."""
    m = _modules(stage)
    _, conn, init = senders["good"]
    transport = m.GlooTransport(0, init, TIMEOUT, serve_store=False)
    try:
        received = m.empty_pool(_shape(m))
        order = (MOVES[0], REFUSED, *MOVES[1:])
        handles = [transport.start_recv(rid, received, dst) for rid, _, dst in order]
        for handle in handles[:1] + handles[2:]:
            handle.result(timeout=TIMEOUT * 20)
        with pytest.raises(m.TransferRefused):
            handles[1].result(timeout=TIMEOUT * 20)
        assert transport.failures == 0, transport.last_error
        assert conn.poll(TIMEOUT * 10)
        assert conn.recv() == [(rid, "ok") for rid, _, _ in order]
        assert_moved_exactly(m.random_pool(_shape(m), SEED), received, MOVES)
    finally:
        transport.close()


@pytest.mark.slow
def test_gloo_peer_that_dies_mid_transfer_gives_an_error_within_the_timeout(stage, senders) -> None:
    m = _modules(stage)
    process, _, init = senders["dies"]
    transport = m.GlooTransport(0, init, TIMEOUT, serve_store=False)
    try:
        received = m.empty_pool(_shape(m))
        rid, _, destination = MOVES[0]
        started = time.monotonic()
        handle = transport.start_recv(rid, received, destination)
        with pytest.raises(m.TransferError, match=r"(?i)closed|reset"):
            handle.result(timeout=TIMEOUT * 10)  # bounds a hang; the error comes much sooner
        assert time.monotonic() - started < TIMEOUT * 10
        assert process.wait(timeout=TIMEOUT * 10) != 0
        assert transport.failures == 1
        later = transport.start_recv("req-b", received, (9,))  # tried, and fails at once
        with pytest.raises(m.TransferError, match=r"(?i)closed|reset"):
            later.result(timeout=TIMEOUT)
        assert transport.failures == 2
    finally:
        transport.close()


@pytest.mark.slow
def test_gloo_silent_peer_times_out_instead_of_hanging(stage, senders) -> None:
    m = _modules(stage)
    _, _, init = senders["silent"]
    transport = m.GlooTransport(0, init, timeout_seconds=1.0, serve_store=False)
    try:
        started = time.monotonic()
        handle = transport.start_recv("req-a", m.empty_pool(_shape(m)), (0, 5, 3))
        with pytest.raises(m.TransferError, match=r"(?i)timed out|progress"):
            handle.result(timeout=30)  # bounds a hang; the deadline is 1 s
        assert time.monotonic() - started < 30
    finally:
        transport.close()
