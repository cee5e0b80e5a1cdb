"""Stage 12's host tier on a GPU: the CUDA path of the batched copies (a pinned, block-major host
pool, batches queued on the copy stream, their ends as events, the compute stream waiting on
them instead of the host).

Runs only where CUDA is available: the CPU suite runs the same code with plain tensors and a
copy thread (tests/test_12_host_copies.py, tests/test_12_host_tier.py), but not the streams,
events and pinned memory. `torch.cuda._sleep` holds a stream busy so that an ordering that is
missing shows as stale bytes.

    .venv/bin/pytest -q tests/test_12_host_tier_cuda.py            # every stage from 12
"""

from __future__ import annotations

import importlib
import threading

import torch

from .conftest import requires_cuda, since

pytestmark = [
    since("12"),
    *requires_cuda(
        "pinned host memory, the copy stream and its events exist only there (the CPU path is "
        "tests/test_12_host_copies.py)"
    ),
]

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 16, 4, 64
HOLD_CYCLES = 200_000_000  # a stream kept busy this long: any unordered read sees stale bytes


def _module(stage, name):
    return importlib.import_module(f"{stage.__name__}.{name}")


def _engine(stage):
    copy_engine = _module(stage, "offload.copy_engine")
    shape = (LAYERS, BLOCKS, BLOCK, HEADS, DIM)
    device = copy_engine.KVPool(
        torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        torch.randn(shape, device="cuda", dtype=torch.bfloat16),
    )
    host = copy_engine.host_pool_like(device.k, 6)
    return copy_engine, copy_engine.CopyEngine(device, host)


def _job(stage, *args):
    return _module(stage, "offload.copy_plan").TransferJob(*args)


def _warm(stage, engine):
    """One load, waited for, before a stream is held: CUDA loads a kernel's module at its first
    launch (lazy loading) and the first pinned allocation calls cudaHostAlloc, and either can
    wait for the whole device; a held stream would then end before the test's read (the first
    H100 run, 2026-11-26, saw the control read see the loaded bytes)."""
    engine.submit(_job(stage, "warm", "load", (5,), (6,), "r"))
    engine.wait(["warm"])
    engine.take_finished()
    engine.device.k[:, 6].clone()
    torch.cuda.synchronize()


def test_cuda_store_and_load_through_pinned_memory_are_bit_exact(stage):
    copy_engine, engine = _engine(stage)
    device, host = engine.device, engine.host
    assert host.k.is_pinned() and host.v.is_pinned(), "the host pool must be pinned on CUDA"
    original = device.k.clone(), device.v.clone()
    stores = [
        _job(stage, "s0", "store", (1, 4), (3, 4)),  # one run of two host blocks
        _job(stage, "s1", "store", (6,), (0,)),
    ]
    loads = [_job(stage, "l0", "load", (3, 4, 0, 3), (7, 2, 5, 0), "r")]  # host block 3 twice
    fence = copy_engine.compute_fence(device.k.device)
    engine.submit_batch(stores, fence)
    engine.submit_batch(loads, fence)
    engine.wait(["s0", "s1", "l0"])
    assert [(j.job_id, ok) for j, ok in engine.take_finished()] == [
        ("s0", True), ("s1", True), ("l0", True)
    ]  # fmt: skip
    for got, was in zip((host.k, host.v), original, strict=True):
        assert torch.equal(got[:, [3, 4, 0]], was[:, [1, 4, 6]].cpu())
    for got, was in zip((device.k, device.v), original, strict=True):
        assert torch.equal(got[:, [7, 2, 5, 0]], was[:, [1, 4, 6, 1]])
        assert torch.equal(got[:, [1, 3, 4, 6]], was[:, [1, 3, 4, 6]]), "other blocks untouched"
    engine.close()


def test_cuda_regression_45704_a_store_waits_for_the_compute_that_writes_its_block(stage):
    copy_engine, engine = _engine(stage)
    torch.cuda._sleep(HOLD_CYCLES)  # the compute stream is busy ...
    engine.device.k[:, 2].fill_(7.0)  # ... before the forward writes block 2
    fence = copy_engine.compute_fence(engine.device.k.device)
    engine.submit(_job(stage, "s", "store", (2,), (0,)), fence)
    engine.wait(["s"])
    assert torch.all(engine.host.k[:, 0] == 7.0), "the store copied the block before it was written"
    engine.close()


def test_cuda_a_load_is_ordered_before_the_forward_that_reads_it(stage):
    """The compute stream waits on the load's event (no host wait): the forward reads the
    loaded bytes although the copy stream was held back; without that wait it reads stale ones
    (the control read)."""
    copy_engine, engine = _engine(stage)
    _warm(stage, engine)
    engine.host.k[:, 3] = 9.0
    with torch.cuda.stream(engine._lane.stream):
        torch.cuda._sleep(HOLD_CYCLES)  # the copy stream is busy
    fence = copy_engine.compute_fence(engine.device.k.device)
    engine.submit(_job(stage, "l", "load", (3,), (4,), "r"), fence)
    control = engine.device.k[:, 4].clone()  # not ordered after the load
    engine.order_compute_after(["l"])
    seen = engine.device.k[:, 4].clone()  # the forward's read
    torch.cuda.synchronize()
    assert not torch.all(control == 9.0), "the copy stream was meant to be held back"
    assert torch.all(seen == 9.0), "the forward read the block before its load landed"
    engine.close()


def test_cuda_handle_preemptions_orders_the_forward_after_a_store_without_a_host_wait(stage):
    """PR #29870 on CUDA: the forward that overwrites a block a store still reads waits on the
    store's event on the compute stream; the invariant check accepts such a store."""
    offload, kv_cache = _module(stage, "offload.connector"), _module(stage, "kv_cache")
    cache = kv_cache.PagedKVCache(
        LAYERS, BLOCKS, BLOCK, HEADS, DIM, torch.bfloat16, torch.device("cuda")
    )
    cache.k.normal_()
    worker = offload.OffloadingConnectorWorker(num_host_blocks=4)
    worker.register_kv_caches(cache)
    expected = cache.k[:, 2].cpu()
    with torch.cuda.stream(worker.engine._lane.stream):
        torch.cuda._sleep(HOLD_CYCLES)  # the store is held back on the copy stream
    store = _job(stage, "store-0", "store", (2,), (1,), "victim")
    worker.start_load_kv(offload.OffloadMetadata(stores=(store,)))
    worker.handle_preemptions(frozenset({2}))  # the forward is about to write block 2
    cache.k[:, 2] = -1.0  # ... and does, on the compute stream
    worker.wait_for_save()
    torch.cuda.synchronize()
    assert torch.equal(worker.engine.host.k[:, 1], expected), "the forward overtook the store"
    worker.start_load_kv(offload.OffloadMetadata(flush=True))
    worker.wait_for_save()
    assert worker.take_output().finished_sending == {"store-0"}


def test_cuda_an_injected_delay_holds_the_batch_in_flight_not_the_caller(stage):
    """A test's delay (a gate here) keeps the store in flight while the caller goes on: spent
    by the submitting thread, it blocked the step that was to release it, and a slow store had
    ended before the next forward (test_12_offload's #46014 and #29870 tests on an H100)."""
    _, engine = _engine(stage)
    released = threading.Event()
    engine.delay = lambda job: released.wait(60.0) and 0.0
    expected = engine.device.k[:, 1].cpu()
    engine.submit(_job(stage, "s", "store", (1,), (0,), "r"))
    assert not released.is_set() and [j.job_id for j in engine.in_flight()] == ["s"]
    assert engine.unordered_store_reads(frozenset({1})), "the held store reads block 1"
    released.set()
    engine.wait(["s"])
    assert [(job.job_id, ok) for job, ok in engine.take_finished()] == [("s", True)]
    assert torch.equal(engine.host.k[:, 0], expected)
    engine.close()
