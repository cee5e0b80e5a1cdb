"""Stage 12's host tier, one piece at a time, without an engine (the assignment's direct tests).

- The LRU ledger (offload_manager.py): a key is invisible until its store completes; a failed
  store frees its block; a block is evicted only at reference 0 with no store in flight, least
  recently used first; a store that cannot make room changes nothing.
- The copy engine (copy_engine.py): a store and a load move blocks bit-exactly and in order; each
  waits for the compute before it (the fence: vLLM #45704 for stores, #47282 for loads), which a
  delayed compute makes reproducible here.
- The worker side (offload.py): before a forward writes a block, a store still reading it is
  flushed (vLLM PR #29870), and the invariant check catches the forward that does not wait.
"""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch

from .conftest import since

pytestmark = since("12")

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 3


def _module(stage, name):
    return importlib.import_module(f"{stage.__name__}.{name}")


def _pools(stage, device_blocks=6, host_blocks=5):
    engine = _module(stage, "offload.copy_engine")
    k = torch.randn(LAYERS, device_blocks, BLOCK, HEADS, DIM)
    device = engine.KVPool(k, torch.randn_like(k))
    return device, engine.host_pool_like(device.k, host_blocks)


# ---------------------------------------------------------------------------- the ledger


def test_a_key_is_invisible_until_its_store_completes_and_a_failed_store_frees_it(stage):
    manager = _module(stage, "offload.manager").LRUOffloadManager(4)
    prepared = manager.prepare_store(["a", "b", "c"])
    assert prepared.keys_to_store == ("a", "b", "c") and len(set(prepared.host_blocks)) == 3
    assert manager.lookup(["a", "b", "c"]) == 0, "a store in flight must not be a hit"
    manager.complete_store(["a", "b"])
    assert manager.lookup(["a", "b", "c"]) == 2
    manager.complete_store(["c"], success=False)
    assert manager.lookup(["c"]) == 0 and "c" not in manager.blocks
    assert manager.num_free == 2, "the failed store's block is free again"
    manager.check()


def test_eviction_takes_only_unreferenced_ready_blocks_least_recent_first(stage):
    manager = _module(stage, "offload.manager").LRUOffloadManager(3)
    manager.prepare_store(["a", "b"])
    manager.complete_store(["a", "b"])
    manager.prepare_store(["pending"])  # a store in flight: not evictable
    manager.prepare_load(["a"])  # a load in flight: not evictable
    assert manager.prepare_store(["x", "y"]) is None, "only b may go: not enough room"
    assert manager.lookup(["a"]) == 1 and manager.lookup(["b"]) == 1, "nothing changed"
    prepared = manager.prepare_store(["x"])
    assert prepared.keys_evicted == ("b",)
    manager.complete_load(["a"])
    manager.complete_store(["pending", "x"])
    manager.touch(["a"])  # a is now the most recent: pending goes first
    assert manager.prepare_store(["z"]).keys_evicted == ("pending",)
    with pytest.raises(AssertionError):
        manager.complete_load(["a"])  # no load in flight: a bug
    manager.check()


def test_prepare_store_skips_held_keys_and_discard_frees_only_idle_ones(stage):
    manager = _module(stage, "offload.manager").LRUOffloadManager(4)
    manager.prepare_store(["a"])
    manager.complete_store(["a"])
    assert manager.prepare_store(["a", "b"]).keys_to_store == ("b",)
    manager.discard(["a", "b"])  # b's store is in flight: it stays
    assert "a" not in manager.blocks and "b" in manager.blocks
    manager.check()


def test_prepare_store_never_evicts_a_key_the_same_call_stores(stage):
    """A held key in the same call is only marked recently used by the caller: evicting it to
    make room for the call's other keys would lose it (the caller counts on it staying)."""
    manager = _module(stage, "offload.manager").LRUOffloadManager(2)
    for key in ("a", "c"):  # "a" is the least recently used
        manager.prepare_store([key])
        manager.complete_store([key])
    prepared = manager.prepare_store(["a", "b"])
    assert prepared is not None and prepared.keys_to_store == ("b",)
    assert "a" in manager.blocks and "c" not in manager.blocks, "evicted a key it was storing"
    manager.complete_store(["b"])
    assert manager.prepare_store(["a", "b", "d"]) is None, "only a and b could make room"
    assert set(manager.blocks) == {"a", "b"}
    manager.check()


# ---------------------------------------------------------------------------- the copy engine


def test_store_then_load_round_trips_blocks_bit_exactly_in_order(stage):
    engine_module = _module(stage, "offload.copy_engine")
    device, host = _pools(stage)
    original = device.k[:, [1, 4]].clone(), device.v[:, [1, 4]].clone()
    engine = engine_module.CopyEngine(device, host, delay=0.01)
    job = engine_module.TransferJob
    engine.submit(job("s", "store", (1, 4), (3, 0)))
    # Queued after the store, the load overwrites a block the store reads: order matters.
    engine.submit(job("l", "load", (3, 0), (4, 1)))
    engine.wait(["s", "l"])
    assert torch.equal(host.k[:, [3, 0]], original[0])
    assert torch.equal(host.v[:, [3, 0]], original[1])
    assert torch.equal(device.k[:, [4, 1]], original[0]), "the load brought the blocks back"
    assert torch.equal(device.v[:, [4, 1]], original[1])
    assert {j.job_id for j, ok in engine.take_finished() if ok} == {"s", "l"}
    engine.close()


def _delayed_compute(write, seconds=0.05):
    """A forward still running: it does `write()` after `seconds`, then signals its fence."""
    fence = threading.Event()

    def run():
        time.sleep(seconds)
        write()
        fence.set()

    thread = threading.Thread(target=run)
    thread.start()
    return fence, thread


def test_regression_45704_a_store_waits_for_the_compute_that_writes_its_block(stage):
    """vLLM #45704: the copy stream did not wait for the compute stream, so a store copied a
    block before the forward had written it (garbled output after a reload)."""
    engine_module = _module(stage, "offload.copy_engine")
    device, host = _pools(stage)
    fence, thread = _delayed_compute(lambda: device.k[:, 2].fill_(7.0))
    engine = engine_module.CopyEngine(device, host)
    engine.submit(engine_module.TransferJob("s", "store", (2,), (0,)), fence)
    engine.wait(["s"])
    thread.join(5)
    assert torch.all(host.k[:, 0] == 7.0), "the store copied the block before it was written"
    engine.close()


def test_regression_47282_a_load_waits_for_the_compute_still_reading_its_block(stage):
    """vLLM #47282 (the loads' side of #45704): a load must not overwrite a device block that a
    forward queued before it still reads."""
    engine_module = _module(stage, "offload.copy_engine")
    device, host = _pools(stage)
    host.k[:, 1] = 5.0
    before = device.k[:, 3].clone()
    seen = {}
    fence, thread = _delayed_compute(lambda: seen.setdefault("k", device.k[:, 3].clone()))
    engine = engine_module.CopyEngine(device, host)
    engine.submit(engine_module.TransferJob("l", "load", (1,), (3,)), fence)
    engine.wait(["l"])
    thread.join(5)
    assert torch.equal(seen["k"], before), "the forward read a block the load overwrote"
    assert torch.all(device.k[:, 3] == 5.0)
    engine.close()


def test_an_injected_failure_is_reported_and_copies_nothing(stage):
    engine_module = _module(stage, "offload.copy_engine")
    device, host = _pools(stage)
    engine = engine_module.CopyEngine(device, host, fail=lambda job: job.kind == "load")
    before = device.k[:, 0].clone()
    engine.submit(engine_module.TransferJob("l", "load", (0,), (0,), "r"))
    engine.wait(["l"])
    assert [(j.job_id, ok) for j, ok in engine.take_finished()] == [("l", False)]
    assert torch.equal(device.k[:, 0], before)
    engine.close()


# ---------------------------------------------------------------------------- the worker side


def _worker(stage, delay):
    offload, kv_cache = _module(stage, "offload.connector"), _module(stage, "kv_cache")
    cache = kv_cache.PagedKVCache(LAYERS, 6, BLOCK, HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.k.normal_()
    worker = offload.OffloadingConnectorWorker(num_host_blocks=4)
    worker.register_kv_caches(cache)
    worker.engine.delay = delay
    job = _module(stage, "offload.copy_engine").TransferJob(
        "store-0", "store", (2, 3), (0, 1), "victim"
    )
    return worker, cache, offload.OffloadMetadata(stores=(job,))


def test_regression_29870_a_forward_never_overwrites_a_block_a_store_still_reads(stage):
    """vLLM PR #29870: a preempted request's blocks were handed out in the same step and the
    forward overwrote them while their store was in flight. The worker flushes such stores
    before the forward; without the flush the invariant check fires."""
    worker, cache, metadata = _worker(stage, delay=0.05)
    expected = cache.k[:, [2, 3]].clone()
    worker.start_load_kv(metadata)
    worker.handle_preemptions(frozenset({3, 5}))  # the forward is about to write block 3
    cache.k[:, 3] = -1.0  # ... and does
    worker.wait_for_save()
    assert torch.equal(worker.engine.host.k[:, [0, 1]], expected)
    sent, received = worker.get_finished()
    assert sent == {"store-0"} and not received

    worker, cache, metadata = _worker(stage, delay=0.05)
    worker.start_load_kv(metadata)
    with pytest.raises(AssertionError, match="overwrites blocks"):
        worker.check_no_store_reads(frozenset({3}))  # a forward that did not flush
    worker.handle_preemptions(frozenset({4}))  # unrelated blocks: no wait needed
    worker.wait_for_save()


def test_worker_reports_failed_loads_as_invalid_blocks(stage):
    worker, _, _ = _worker(stage, delay=0.0)
    worker.engine.fail = lambda job: True
    job = _module(stage, "offload.copy_engine").TransferJob("load-1", "load", (0,), (5,), "r")
    # A step with no forward (`flush`) waits for its transfers before it ends.
    worker.start_load_kv(
        _module(stage, "offload.connector").OffloadMetadata(loads=(job,), flush=True)
    )
    worker.wait_for_save()
    output = worker.take_output()
    assert output.finished_recving == {"load-1"} and output.failed == {"load-1"}
    assert output.invalid_block_ids == {5}
    assert worker.take_output().empty
