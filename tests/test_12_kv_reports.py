"""Stage 12: every tensor-parallel rank's KV transfer report counts, not only rank 0's.

Each rank copies its own KV heads of a transfer's blocks, so:
- `KVOutputAggregator` (vLLM's): a transfer has ended only when every rank reported it, across
  rounds if the ranks disagree; a transfer failed on any rank is failed, reported with its end;
  a block any rank could not load is invalid at once.
- The executor combines rank 0's report with the workers' (sent after each step they run), and
  waits for each worker's report of every step whose tokens the engine took. Pipes stand in for
  the worker processes; test_12_offload.py runs TP=2 for real.
"""

from __future__ import annotations

import importlib
import pickle
import threading
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from .conftest import since, unit

pytestmark = since("12")


def _kv(stage):
    return importlib.import_module(f"{stage.__name__}.kv_connector.base")


def _out(stage, sending=(), recving=(), failed=(), invalid=()):
    return _kv(stage).KVConnectorOutput(
        frozenset(sending), frozenset(recving), frozenset(failed), frozenset(invalid)
    )


@unit("kv_connector/base.py")
def test_a_transfer_ends_only_when_every_rank_reported_it(stage):
    aggregator = _kv(stage).KVOutputAggregator(2)
    first = aggregator.aggregate([_out(stage, sending={"s"}, recving={"r"}), _out(stage)])
    assert first == _out(stage), "rank 1 still copies its heads: nothing has ended"
    second = aggregator.aggregate([_out(stage), _out(stage, sending={"s"}, recving={"r"})])
    assert second == _out(stage, sending={"s"}, recving={"r"})
    assert aggregator.aggregate([_out(stage)] * 2) == _out(stage), "reported once"


@unit("kv_connector/base.py")
def test_ranks_that_agree_end_a_transfer_in_one_round(stage):
    aggregator = _kv(stage).KVOutputAggregator(3)
    reports = [
        _out(stage, recving={"a", "b"}),
        _out(stage, recving={"a"}),
        _out(stage, recving={"a"}),
    ]
    assert aggregator.aggregate(reports) == _out(stage, recving={"a"})
    later = [_out(stage), _out(stage, recving={"b"}), _out(stage, recving={"b"})]
    assert aggregator.aggregate(later) == _out(stage, recving={"b"})


@unit("kv_connector/base.py")
def test_a_failure_on_one_rank_fails_the_transfer_and_its_blocks(stage):
    """Rank 1's load of blocks 7 and 8 failed; rank 0's went well. The load is failed (its
    request recomputes) and the blocks are invalid: rank 1's heads there hold no valid KV."""
    aggregator = _kv(stage).KVOutputAggregator(2)
    report = aggregator.aggregate(
        [
            _out(stage, recving={"load"}),
            _out(stage, recving={"load"}, failed={"load"}, invalid={7, 8}),
        ]
    )
    assert report == _out(stage, recving={"load"}, failed={"load"}, invalid={7, 8})


@unit("kv_connector/base.py")
def test_a_failure_waits_for_the_transfers_end_on_every_rank(stage):
    """The scheduler reads `failed` for the ids that end in the same report: a failure seen
    before the last rank ends the transfer is kept until then."""
    aggregator = _kv(stage).KVOutputAggregator(2)
    early = aggregator.aggregate([_out(stage, sending={"st"}, failed={"st"}), _out(stage)])
    assert early == _out(stage)
    assert aggregator.aggregate([_out(stage), _out(stage, sending={"st"})]) == _out(
        stage, sending={"st"}, failed={"st"}
    )


@unit("kv_connector/base.py")
def test_one_rank_reports_pass_through(stage):
    aggregator = _kv(stage).KVOutputAggregator(1)
    report = _out(stage, sending={"a"}, recving={"b"}, failed={"b"}, invalid={3})
    assert aggregator.aggregate([report]) == report


# ------------------------------------------------------------------------- the executor
class _Runner:
    """Rank 0: a connector whose report the test sets."""

    kv_connector = object()

    def __init__(self, stage) -> None:
        self.report = self.empty = _out(stage)
        module = importlib.import_module(f"{stage.__name__}.model_runner")
        self.step = module.StepHandle((), list)

    def launch(self, scheduler_output):
        return self.step

    def take_kv_connector_output(self):
        report, self.report = self.report, self.empty
        return report


def _executor(stage, workers: int = 1):
    module = importlib.import_module(f"{stage.__name__}.parallel.multiproc_executor")
    executor = module.MultiprocExecutor.__new__(module.MultiprocExecutor)
    executor._workers, theirs = [], []
    for rank in range(1, workers + 1):
        ours, their_end = Pipe()
        executor._workers.append(
            module._Worker(rank, SimpleNamespace(pid=0, poll=lambda: None), ours, [])
        )
        theirs.append(their_end)
    executor.failure, executor._sent, executor._timeout = None, (0, 0, 0.0), 5.0
    executor._replied = module.threading.Condition()
    executor._kv_aggregator = _kv(stage).KVOutputAggregator(workers + 1)
    executor._kv_steps = executor._kv_resolved = 0
    executor.driver = _Runner(stage)
    return executor, theirs


def _step(stage):
    metadata = _kv(stage).KVConnectorMetadata()
    return stage.scheduler.SchedulerOutput(requests=(), kv_connector_metadata=metadata)


def _report(executor, end, report) -> None:
    """Worker `end` reports, and its reader thread hands the message on."""
    end.send(("kv_output", report))
    assert executor._workers[0].conn.poll(5.0)
    executor._on_message(0, *executor._workers[0].conn.recv())


@unit("parallel/multiproc_executor.py")
def test_the_executor_combines_rank_0_with_the_workers_reports(stage):
    executor, (worker,) = _executor(stage)
    step = executor.launch(_step(stage))
    assert pickle.loads(worker.recv_bytes())[0] == "execute_model"
    step.result()
    executor.driver.report = _out(stage, recving={"load"})
    _report(executor, worker, _out(stage, recving={"load"}, failed={"load"}, invalid={4}))
    assert executor.take_kv_connector_output() == _out(
        stage, recving={"load"}, failed={"load"}, invalid={4}
    )


@unit("parallel/multiproc_executor.py")
def test_rank_0_alone_ends_nothing(stage):
    """Before: only rank 0's report counted, and a transfer rank 1 still copied was 'done'."""
    executor, (worker,) = _executor(stage)
    executor.launch(_step(stage))  # never resolved: no worker report is waited for
    executor.driver.report = _out(stage, sending={"store"})
    assert executor.take_kv_connector_output() == _out(stage)
    _report(executor, worker, _out(stage, sending={"store"}))
    assert executor.take_kv_connector_output() == _out(stage, sending={"store"})


@unit("parallel/multiproc_executor.py")
def test_the_executor_waits_for_the_report_of_a_step_it_resolved(stage):
    """A step whose tokens the engine took has a report coming from every worker: without it
    the executor waits (here: until its bound, naming what is missing)."""
    executor, (worker,) = _executor(stage)
    executor._timeout = 0.05
    executor.launch(_step(stage)).result()
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="no KV transfer report"):
        executor.take_kv_connector_output()
    _report(executor, worker, _out(stage))
    assert executor.take_kv_connector_output() == _out(stage)


@unit("parallel/worker.py")
def test_a_worker_reports_its_transfers_after_each_step(stage):
    worker = importlib.import_module(f"{stage.__name__}.parallel.worker")
    reports = iter([_out(stage, recving={"a"}), _out(stage)])
    runner = SimpleNamespace(
        kv_connector=object(),
        execute_model=lambda output: {},
        take_kv_connector_output=lambda: next(reports),
    )
    engine, worker_end = Pipe()
    thread = threading.Thread(target=worker._serve, args=(runner, worker_end), daemon=True)
    thread.start()
    for n in range(2):
        engine.send_bytes(pickle.dumps(("execute_model", (f"step {n}",))))
    assert engine.recv() == ("kv_output", _out(stage, recving={"a"}))
    assert engine.recv() == ("kv_output", _out(stage))
    engine.send_bytes(pickle.dumps(("shutdown", ())))
    thread.join(timeout=5.0)
    assert not thread.is_alive()
