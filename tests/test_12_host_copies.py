"""Stage 12's host-tier copies: batched, and asynchronous across steps (the CPU path).

- The plan (copy_plan.py): a batch's blocks in order, the host side cut into runs of consecutive
  blocks, no block written twice; the ledger reports batches in submission order with their
  failures and says which transfers touch a block a forward writes.
- The batched copy (one gather, host runs, one scatter) equals the per-block reference, with
  random block ids and repeated sources (and, from stage 14, a quantized cache's scales).
- A store in flight does not hold up the step: `wait_for_save` returns, a later output reports
  it. `handle_preemptions` waits for exactly the transfers on the blocks the forward writes; a
  load another rank reported done is waited for before the forward reads it (`loads_done`).
- A copy that raises fails its batch, and the copy thread goes on.
- In an engine, a loaded request runs only in a step whose metadata names its load done, a step
  without a forward flushes, and an idle engine holds no transfer.

The copies are held by a gate the test releases (`_Gate`), never by a sleep: no assertion
depends on timing. The worker's tests run on both paths of the copy engine: the copy thread (a
CPU's) and the CUDA path with a stand-in for the stream and its events (`_StandInLane`: an end
event whose `query()` stays False until it is synchronized), so a bug only the CUDA branch has
shows here (the H100 run: an injected delay spent by the submitting thread held the step that
was to release it). tests/test_12_host_tier_cuda.py runs the real CUDA path (pinned memory, the
copy stream, its events) where a GPU is present.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import threading

import pytest
import torch

from .conftest import since

pytestmark = since("12")

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 5
GATE_SECONDS = 30.0  # a gate never released in time means a step waited for a copy it must not


def _module(stage, name):
    return importlib.import_module(f"{stage.__name__}.{name}")


def _job(stage, *args):
    return _module(stage, "offload.copy_plan").TransferJob(*args)


class _Gate:
    """The copy engine's injected `delay`: each job's copy waits until the test releases it."""

    def __init__(self) -> None:
        self._events: dict[str, threading.Event] = {}
        self.timed_out: list[str] = []

    def _event(self, job_id: str) -> threading.Event:
        return self._events.setdefault(job_id, threading.Event())

    def __call__(self, job) -> float:
        if not self._event(job.job_id).wait(GATE_SECONDS):
            self.timed_out.append(job.job_id)
        return 0.0

    def release(self, job_id: str) -> None:
        self._event(job_id).set()


class _StandInEvent:
    """A CUDA event as the host sees a copy still running: `query()` is False until someone
    synchronizes it (the copy itself already ran, on the host)."""

    def __init__(self) -> None:
        self.synchronized = False

    def query(self) -> bool:
        return self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True


class _StandInLane:
    """`CudaLane` on a CPU: copies run where they are queued, a fence is waited on at once,
    an end is a `_StandInEvent`, and the compute's waits on ends are recorded."""

    def __init__(self) -> None:
        self.compute_waited: list[_StandInEvent] = []
        self.fences: list[object] = []
        self.hung = False  # a stream stuck behind a hung compute: no end ever passes

    def queue(self):
        return contextlib.nullcontext()

    def wait_fence(self, fence) -> None:
        self.fences.append(fence)

    def record_end(self) -> _StandInEvent:
        return _StandInEvent()

    def compute_waits_for(self, end: _StandInEvent) -> None:
        self.compute_waited.append(end)

    def wait_end(self, end: _StandInEvent, seconds: float) -> bool:
        if self.hung:
            return False  # what CudaLane.wait_end answers at its deadline (tested below)
        end.synchronize()
        return True


LANES = ["thread", "stream"]  # the copy engine's CPU path, and its CUDA path on a stand-in


# ---------------------------------------------------------------------------- the plan


def test_the_plan_cuts_host_runs_and_refuses_a_block_written_twice(stage):
    plan_module = _module(stage, "offload.copy_plan")
    run = plan_module.Run
    assert plan_module.host_runs([3, 4, 5, 9, 2, 3]) == (run(0, 3, 3), run(3, 1, 9), run(4, 2, 2))
    stores = [_job(stage, "a", "store", (7, 1), (3, 4)), _job(stage, "b", "store", (2,), (5,))]
    plan = plan_module.plan_batch(stores)
    assert (plan.device, plan.host, plan.runs) == ((7, 1, 2), (3, 4, 5), (run(0, 3, 3),))
    load = _job(stage, "l", "load", (6, 6, 0), (0, 1, 2), "r")  # one host block loaded twice
    plan = plan_module.plan_batch([load])
    assert (plan.device, plan.host) == ((0, 1, 2), (6, 6, 0))
    assert plan.runs == (run(0, 1, 6), run(1, 1, 6), run(2, 1, 0))
    with pytest.raises(AssertionError, match="one way"):
        plan_module.plan_batch([stores[0], load])
    with pytest.raises(AssertionError, match="twice"):
        plan_module.plan_batch([_job(stage, "x", "load", (1, 2), (4, 4), "r")])


def test_the_ledger_reports_batches_in_order_with_their_failures(stage):
    plan_module = _module(stage, "offload.copy_plan")
    s1 = _job(stage, "s1", "store", (2, 3), (0, 1))
    l1, l2 = _job(stage, "l1", "load", (4,), (5,), "r"), _job(stage, "l2", "load", (4,), (6,), "q")
    s2 = _job(stage, "s2", "store", (7,), (2,))
    batches = [
        plan_module.Batch((s1,), "s1"),
        plan_module.Batch((l1, l2), "l", failed={"l2"}),
        plan_module.Batch((s2,), "s2"),
    ]
    ledger = plan_module.TransferLedger()
    for batch in batches:
        ledger.add(batch)
    ended: set[str] = set()
    done = lambda batch: batch.handle in ended
    ended.add("l")  # a later batch cannot be taken before an earlier one: one lane
    assert ledger.poll(done) == []
    assert [j.job_id for j in ledger.in_flight()] == ["s1", "l1", "l2", "s2"]
    assert ledger.touching(frozenset({3})) == ["s1"], "a store reads its device blocks"
    assert ledger.touching(frozenset({6})) == ["l2"], "a load writes its device blocks"
    assert ledger.touching(frozenset({4})) == [], "block 4 is a host block of the loads"
    reads = lambda: [j.job_id for j, _ in ledger.unordered_store_reads(frozenset({3, 7}))]
    assert reads() == ["s1", "s2"]
    batches[0].compute_waits = True  # the compute stream waits for s1: no clash any more
    assert reads() == ["s2"]
    ended.add("s1")
    assert ledger.poll(done) == [(s1, True), (l1, True), (l2, False)]
    ended.add("s2")
    assert ledger.poll(done, lambda batch: True) == [(s2, False)], "a raised copy fails all"
    assert ledger.in_flight() == []


# ---------------------------------------------------------------------------- the batched copy


def _random_pool(stage, num_blocks, quantized):
    """A device pool of random blocks: float K/V, or (stage 14) uint8 codes and their scales."""
    copy_engine = _module(stage, "offload.copy_engine")
    shape = (LAYERS, num_blocks, BLOCK, HEADS, DIM)
    if not quantized:
        return copy_engine.KVPool(torch.randn(shape), torch.randn(shape))
    k, v = (torch.randint(0, 256, shape, dtype=torch.uint8) for _ in range(2))
    scales = tuple(torch.rand(LAYERS, num_blocks, HEADS) for _ in range(2))
    return copy_engine.KVPool(k, v, scales)


def _host_like(stage, device, num_blocks):
    copy_engine = _module(stage, "offload.copy_engine")
    scales = getattr(device, "scales", ())
    if scales:
        return copy_engine.host_pool_like(device.k, num_blocks, scales)
    return copy_engine.host_pool_like(device.k, num_blocks)


def _per_block(src, dst, src_blocks, dst_blocks):
    """The reference: one block at a time, every tensor of the pool."""
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for source, target in zip(src.tensors(), dst.tensors(), strict=True):
            target[:, d] = source[:, s]


def _clone(stage, pool):
    scales = tuple(t.clone() for t in getattr(pool, "scales", ()))
    pool_type = _module(stage, "offload.copy_engine").KVPool
    return pool_type(pool.k.clone(), pool.v.clone(), *((scales,) if scales else ()))


def test_a_batched_copy_equals_the_per_block_reference(stage):
    copy_engine, plan_module = (
        _module(stage, "offload.copy_engine"),
        _module(stage, "offload.copy_plan"),
    )
    quantized = "scales" in getattr(copy_engine.KVPool, "__dataclass_fields__", {})
    rng = random.Random(12)
    for trial in range(24):
        device = _random_pool(stage, 10, quantized and trial % 2 == 1)
        host = _host_like(stage, device, 9)
        for tensor in host.tensors():
            tensor.copy_(torch.randint(0, 100, tensor.shape).to(tensor.dtype))
        # Stores: random device blocks (repeats allowed), distinct host blocks in random runs.
        targets = rng.sample(range(9), rng.randint(1, 9))
        if trial % 3 == 0:
            targets = sorted(targets)  # long runs of consecutive host blocks
        sources = [rng.randrange(10) for _ in targets]
        cut = rng.randint(0, len(targets))
        stores = [
            _job(stage, f"s{trial}a", "store", tuple(sources[:cut]), tuple(targets[:cut])),
            _job(stage, f"s{trial}b", "store", tuple(sources[cut:]), tuple(targets[cut:])),
        ]
        stores = [job for job in stores if job.src_blocks]
        expected = _clone(stage, host)
        _per_block(device, expected, sources, targets)
        copy_engine.copy_batch(plan_module.plan_batch(stores), device, host, [])
        for got, want in zip(host.tensors(), expected.tensors(), strict=True):
            assert torch.equal(got, want), (trial, "store")
        # Loads: random host blocks (one loaded into several device blocks), distinct targets.
        targets = rng.sample(range(10), rng.randint(1, 10))
        sources = [rng.randrange(9) for _ in targets]
        loads = [_job(stage, f"l{trial}", "load", tuple(sources), tuple(targets), "r")]
        expected = _clone(stage, device)
        _per_block(host, expected, sources, targets)
        engine = copy_engine.CopyEngine(device, host)  # the same copy through the copy thread
        engine.submit_batch(loads)
        engine.wait([loads[0].job_id])
        assert engine.take_finished() == [(loads[0], True)]
        engine.close()
        for got, want in zip(device.tensors(), expected.tensors(), strict=True):
            assert torch.equal(got, want), (trial, "load")


def test_a_copy_that_raises_fails_its_batch_and_the_copy_thread_goes_on(stage):
    copy_engine = _module(stage, "offload.copy_engine")
    device = _random_pool(stage, 4, False)
    host = copy_engine.host_pool_like(device.k, 3)
    engine = copy_engine.CopyEngine(device, host)
    engine.submit(_job(stage, "bad", "store", (99,), (0,)))  # no device block 99: it raises
    engine.submit(_job(stage, "good", "store", (1,), (2,)))
    engine.wait(["bad", "good"])
    assert {j.job_id: ok for j, ok in engine.take_finished()} == {"bad": False, "good": True}
    assert torch.equal(host.k[:, 2], device.k[:, 1])
    engine.close()


# ---------------------------------------------------------------------------- the worker side


def _worker(stage, device_blocks=8, host_blocks=6, lane="thread"):
    offload, kv_cache = _module(stage, "offload.connector"), _module(stage, "kv_cache")
    cache = kv_cache.PagedKVCache(
        LAYERS, device_blocks, BLOCK, HEADS, DIM, torch.float32, torch.device("cpu")
    )
    cache.k.normal_()
    cache.v.normal_()
    worker = offload.OffloadingConnectorWorker(num_host_blocks=host_blocks)
    worker.register_kv_caches(cache)
    if lane == "stream":
        engine, copy_engine = worker.engine, _module(stage, "offload.copy_engine")
        worker.engine = copy_engine.CopyEngine(engine.device, engine.host, lane=_StandInLane())
    gate = _Gate()
    worker.engine.delay = gate
    return worker, cache, gate, offload.OffloadMetadata


def _in_flight(worker) -> list[str]:
    return [job.job_id for job in worker.engine.in_flight()]


@pytest.mark.parametrize("lane", LANES)
def test_a_store_in_flight_does_not_hold_up_the_step_and_a_later_step_reports_it(stage, lane):
    worker, cache, gate, metadata = _worker(stage, lane=lane)
    expected = cache.k[:, [2, 3]].clone(), cache.v[:, [2, 3]].clone()
    store = _job(stage, "store-0", "store", (2, 3), (0, 1), "victim")
    for step_metadata in (metadata(stores=(store,)), None):  # the step that starts it, the next
        worker.start_load_kv(step_metadata)
        worker.handle_preemptions(frozenset({5, 6}))  # its forward writes other blocks
        worker.wait_for_save()
        assert worker.take_output().empty, "nothing ended: the store is held"
        assert _in_flight(worker) == ["store-0"]
    gate.release("store-0")
    worker.start_load_kv(metadata(flush=True))  # a step with no forward waits for them all
    worker.wait_for_save()
    output = worker.take_output()
    assert output.finished_sending == {"store-0"} and not output.failed
    assert torch.equal(worker.engine.host.k[:, [0, 1]], expected[0])
    assert torch.equal(worker.engine.host.v[:, [0, 1]], expected[1])
    assert not gate.timed_out, "a step waited for a store it should have left running"


@pytest.mark.parametrize("lane", LANES)
def test_handle_preemptions_waits_for_exactly_the_transfers_on_the_blocks_it_writes(stage, lane):
    """PR #29870 across steps: the stores of earlier steps still run. The forward waits for the
    one reading a block it writes, not for the other; and for a load still writing a block it
    writes (the loading request was aborted and its block handed out again)."""
    worker, cache, gate, metadata = _worker(stage, lane=lane)
    a = _job(stage, "store-a", "store", (2,), (0,), "victim")
    b = _job(stage, "store-b", "store", (5,), (1,), "other")
    load = _job(stage, "load-c", "load", (3,), (4,), "aborted")
    worker.engine.host.k[:, 3] = 9.0
    for step_metadata in (metadata(stores=(a,)), metadata(stores=(b,), loads=(load,))):
        worker.start_load_kv(step_metadata)
        worker.wait_for_save()
    expected = cache.k[:, 2].clone()
    gate.release("store-a")
    worker.handle_preemptions(frozenset({2, 7}))  # the next forward writes block 2 ...
    cache.k[:, 2] = -1.0  # ... and does
    assert _in_flight(worker) == ["store-b", "load-c"], "store-a (only) must have ended"
    assert torch.equal(worker.engine.host.k[:, 0], expected), "the forward overtook store-a"
    gate.release("store-b")
    gate.release("load-c")
    worker.handle_preemptions(frozenset({4}))  # a forward writing the load's block comes after
    cache.k[:, 4] = -2.0
    assert torch.all(cache.k[:, 4] == -2.0), "the load overwrote the forward's write"
    assert _in_flight(worker) == []
    output = worker.take_output()
    assert output.finished_sending == {"store-a", "store-b"}
    assert output.finished_recving == {"load-c"}
    assert not gate.timed_out


def test_on_the_cuda_path_a_store_ends_by_its_event_and_the_compute_waits_on_it(stage):
    """The CUDA path without an injected delay (the stand-in lane): a batch goes on the stream,
    not the copy thread; it stays in flight until its end event says so (polled, never waited
    for by a step); a forward writing its block waits on that event, not the host, and the
    invariant check accepts it; a step without a forward synchronizes it, and it is reported."""
    worker, cache, _, metadata = _worker(stage, lane="stream")
    worker.engine.delay = 0.0
    expected = cache.k[:, 2].clone()
    store = _job(stage, "store-0", "store", (2,), (1,), "victim")
    worker.start_load_kv(metadata(stores=(store,)))
    worker.handle_preemptions(frozenset({2}))  # the forward writes block 2: it waits on the end
    lane = worker.engine._lane
    assert len(lane.compute_waited) == 1 and not lane.compute_waited[0].synchronized
    assert worker.engine._thread is None, "a batch without a delay went through the thread"
    worker.wait_for_save()
    assert worker.take_output().empty, "the store's event is not done: nothing ended"
    assert _in_flight(worker) == ["store-0"]
    worker.start_load_kv(metadata(flush=True))
    worker.wait_for_save()
    assert worker.take_output().finished_sending == {"store-0"}
    assert torch.equal(worker.engine.host.k[:, 1], expected)


class _NeverEnds:
    """A CUDA event behind a collective on a dead peer: it never passes, and synchronizing it
    would never return."""

    def __init__(self, passes_after: int | None = None) -> None:
        self.queries, self.passes_after = 0, passes_after

    def query(self) -> bool:
        self.queries += 1
        return self.passes_after is not None and self.queries > self.passes_after

    def synchronize(self) -> None:
        raise AssertionError("synchronize() on a stream that never ends never returns")


def test_a_host_wait_on_a_copy_end_is_polled_under_a_deadline_not_synchronized(stage):
    """CudaLane.wait_end (no GPU needed: it only polls the event). Before, the CUDA branch of
    CopyEngine.wait called `synchronize()`, unbounded: a copy fenced after a forward whose
    all-reduce waits on a dead rank never ends, and the host thread hung with it."""
    wait_end = _module(stage, "offload.copy_engine").CudaLane.wait_end
    stuck = _NeverEnds()
    assert wait_end(stuck, 0.05) is False and stuck.queries > 1
    assert wait_end(_NeverEnds(passes_after=3), 5.0) is True


def test_a_copy_whose_end_never_passes_fails_the_wait_naming_it(stage):
    """The CUDA path (stand-in lane): a store whose end never passes makes `wait` raise
    TimeoutError naming the store within its timeout, instead of hanging the step."""
    worker, _, _, metadata = _worker(stage, lane="stream")
    worker.engine.delay = 0.0
    worker.start_load_kv(metadata(stores=(_job(stage, "store-0", "store", (2,), (1,), "v"),)))
    worker.engine._lane.hung = True
    with pytest.raises(TimeoutError, match="store-0"):
        worker.engine.wait(["store-0"], timeout=0.05)


@pytest.mark.parametrize("lane", LANES)
def test_a_load_named_done_is_waited_for_before_the_forward_reads_it(stage, lane):
    """With tensor parallelism only rank 0 reports: another rank may still copy a load the
    scheduler already counts as done. The step that may read it names it in `loads_done`, and
    each rank's worker orders its forward after its own copy (on a CPU: the host waits)."""
    worker, cache, gate, metadata = _worker(stage, lane=lane)
    worker.engine.host.k[:, 3] = 9.0
    load = _job(stage, "load-0", "load", (3,), (4,), "r")
    worker.start_load_kv(metadata(loads=(load,)))
    worker.wait_for_save()
    seen = {}

    def next_step():
        worker.start_load_kv(metadata(loads_done=("load-0",)))
        seen["k"] = cache.k[:, 4].clone()  # what its forward reads

    thread = threading.Thread(target=next_step)
    thread.start()
    thread.join(0.2)  # a step that does not wait has read the block by now
    gate.release("load-0")
    thread.join(GATE_SECONDS)
    assert torch.all(seen["k"] == 9.0), "the forward read the block before its load landed"


# ---------------------------------------------------------------------------- in an engine


def test_a_loaded_request_runs_only_in_a_step_that_names_its_load_done(stage, make_llm, tiny_model):
    """Heavy swapping: every load is named in `loads_done` after the step that started it and
    no later than the step that first runs its request; a step that carries `flush` runs no
    request; once `generate` returns, no transfer is in flight on either side."""
    path = tiny_model("llama-gqa")
    probe = make_llm(stage, path, block_size=BLOCK)
    per_block = 2 * probe.kv_cache.k[:, 0].numel() * probe.kv_cache.k.element_size()
    llm = make_llm(
        stage, path, block_size=BLOCK, kv_cache_bytes=per_block * 24, kv_offload_bytes=2**20,
        preemption_mode="swap",
    )  # fmt: skip
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    params = stage.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs, schedule = [], llm.scheduler.schedule
    llm.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    try:
        llm.generate(prompts, [params] * len(prompts))
    finally:
        del llm.scheduler.schedule
    started, named = {}, {}
    for step, output in enumerate(outputs):
        metadata = output.kv_connector_metadata
        if metadata is None:
            continue
        started.update({job.job_id: (job.request_id, step) for job in metadata.loads})
        named.update({job_id: step for job_id in metadata.loads_done})
        assert not (metadata.flush and output.requests), "a flush step runs no forward"
    assert started, "the pool was meant to force swapping"
    for job_id, (request_id, step) in started.items():
        runs = [
            s for s in range(step + 1, len(outputs))
            if any(r.request_id == request_id for r in outputs[s].requests)
        ]  # fmt: skip
        assert job_id in named and step < named[job_id], job_id
        assert not runs or named[job_id] <= runs[0], f"{request_id} ran before its load was named"
    assert llm.kv_connector.num_jobs_in_flight() == 0
    assert llm.runner.kv_connector.engine.in_flight() == []
    llm.check_no_leaks()
