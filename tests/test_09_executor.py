"""Stage 09: the executor's two ends, each alone, with no process and no model.

`MultiprocExecutor.launch` ships a step to every worker and starts rank 0's, watched (a worker
dead mid-step is named); a worker's `_serve` runs what it is sent, in order, answers a call only
once it ran (call_all with its result), and stops when told or when the engine is gone. Pipes
and fake runners stand in for the processes, so each is graded in milliseconds (the
engine-level tests in test_09_tp.py run the real thing).
"""

from __future__ import annotations

import importlib
import pickle
import socket
import threading
from datetime import timedelta
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from .conftest import since, unit

pytestmark = since("09")


class _Runner:
    """Records what it is asked to do, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def launch(self, scheduler_output):
        self.calls.append(("launch", (scheduler_output,)))
        return SimpleNamespace(request_ids=(), result=dict, done=lambda: True)

    def execute_model(self, scheduler_output):
        self.calls.append(("execute_model", (scheduler_output,)))
        return {}

    def prompt_logits(self, token_ids):
        self.calls.append(("prompt_logits", (token_ids,)))
        return token_ids


def _executor_with_pipes(stage, workers: int):
    """A MultiprocExecutor whose workers are pipe ends we read (no process started)."""
    module = importlib.import_module(f"{stage.__name__}.parallel.multiproc_executor")
    executor = module.MultiprocExecutor.__new__(module.MultiprocExecutor)
    theirs = []
    executor._workers = []
    for rank in range(1, workers + 1):
        ours, their_end = Pipe()
        executor._workers.append(module._Worker(rank, SimpleNamespace(pid=0), ours, []))
        theirs.append(their_end)
    executor.failure, executor._sent, executor.driver = None, (0, 0, 0.0), _Runner()
    executor._timeout, executor._replied = 60.0, threading.Condition()
    return executor, theirs


@unit("parallel/multiproc_executor.py")
def test_launch_ships_the_step_to_every_worker_then_runs_rank_0(stage):
    executor, workers = _executor_with_pipes(stage, 2)
    step = stage.scheduler.SchedulerOutput(requests=(SimpleNamespace(request_id="a"),))
    executor.launch(step)
    for end in workers:
        assert end.poll(1.0), "a worker was sent nothing"
        method, args = pickle.loads(end.recv_bytes())
        assert method == "execute_model" and args[0].requests[0].request_id == "a"
        assert not end.poll(0.05), "a step is sent once"
    assert executor.driver.calls == [("launch", (step,))]
    assert executor.send_stats()["sends"] == 1


@unit("parallel/multiproc_executor.py")
def test_an_empty_step_is_sent_to_no_worker(stage):
    executor, workers = _executor_with_pipes(stage, 1)
    executor.launch(stage.scheduler.SchedulerOutput(requests=()))
    assert not workers[0].poll(0.05)


@unit("parallel/multiproc_executor.py")
def test_a_failed_executor_launches_nothing(stage):
    executor, workers = _executor_with_pipes(stage, 1)
    executor.failure = "tensor-parallel rank 1 (pid 7) exited with code -9"
    step = stage.scheduler.SchedulerOutput(requests=(SimpleNamespace(request_id="a"),))
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 1"):
        executor.launch(step)
    assert not workers[0].poll(0.05) and executor.driver.calls == []


class _StepWithADeadPeer:
    """Rank 0's step whose collective waits on a rank that died: never done, and its result is
    what gloo raises when the peer's socket closes (on NCCL it would never return at all)."""

    def __init__(self) -> None:
        self.request_ids = ("a",)
        self.results_taken = 0

    def done(self) -> bool:
        return False

    def result(self):
        self.results_taken += 1
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")


@unit("parallel/multiproc_executor.py")
def test_rank_0s_step_is_watched_and_names_the_worker_that_died_mid_step(stage):
    """A worker killed mid-step: rank 0's step must not be waited for blindly (on NCCL that
    never returns; on gloo it raises the transport's error, which names nobody). The handle
    launch returns gives up once the monitor marks the executor failed and raises
    WorkerDiedError naming that rank."""
    executor, _ = _executor_with_pipes(stage, 2)
    step = _StepWithADeadPeer()
    executor.driver.launch = lambda scheduler_output: step
    output = stage.scheduler.SchedulerOutput(requests=(SimpleNamespace(request_id="a"),))
    handle = executor.launch(output)
    assert tuple(handle.request_ids) == ("a",)
    assert not handle.done()
    executor.failure = "tensor-parallel rank 2 (pid 7) exited with code -9"  # the monitor saw it
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 2"):
        handle.result()
    assert step.results_taken == 0, "a step that is not done was waited for blindly"


@unit("parallel/multiproc_executor.py")
def test_a_launch_whose_collective_raises_names_the_worker_that_died(stage):
    """On CUDA rank 0's forward runs inside `driver.launch` (gloo's collective on a CUDA tensor
    blocks the host), so a dead peer's error comes out of the launch, not the step's result:
    the H100 run showed gloo's `Connection reset by peer` to the caller. It must name the rank
    the monitor found dead, as a failing result does."""
    executor, _ = _executor_with_pipes(stage, 2)

    def launch_on_cuda(scheduler_output):
        executor.failure = "tensor-parallel rank 2 (pid 7) exited with code -9"  # the monitor
        raise RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error: Connection reset by peer")

    executor.driver.launch = launch_on_cuda
    output = stage.scheduler.SchedulerOutput(requests=(SimpleNamespace(request_id="a"),))
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 2") as died:
        executor.launch(output)
    assert isinstance(died.value.__cause__, RuntimeError), "the transport's error is the cause"


@unit("parallel/multiproc_executor.py")
def test_a_broken_pipe_to_a_worker_waits_for_the_monitor_to_name_the_dead_rank(stage):
    """Rank 2 killed, the next step's pipe write breaks: the error must be the monitor's
    verdict, which weighs every rank's end and says how it died (`... killed by SIGKILL`), not
    `rank 2 cannot be reached: Broken pipe` (the H100 run, stepping back to back). Only when
    the monitor says nothing is the broken pipe itself the reason."""
    executor, _ = _executor_with_pipes(stage, 2)
    verdict = "tensor-parallel rank 2 (pid 7) exited with code -9 (killed by SIGKILL)"

    def send_to_the_dead(payload: bytes) -> None:  # the monitor names it a little later
        threading.Timer(0.1, executor._fail, (verdict,)).start()
        raise BrokenPipeError(32, "Broken pipe")

    executor._workers[1].conn = SimpleNamespace(send_bytes=send_to_the_dead)
    output = stage.scheduler.SchedulerOutput(requests=(SimpleNamespace(request_id="a"),))
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="SIGKILL"):
        executor.launch(output)
    silent, theirs = _executor_with_pipes(stage, 2)
    theirs[1].close()
    with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 2 cannot be reached"):
        silent.launch(output)


def _serve_in_thread(stage, runner):
    worker = importlib.import_module(f"{stage.__name__}.parallel.worker")
    engine_end, worker_end = Pipe()
    thread = threading.Thread(target=worker._serve, args=(runner, worker_end), daemon=True)
    thread.start()
    return thread, engine_end, worker_end


def _order(conn, method: str, *args) -> None:
    conn.send_bytes(pickle.dumps((method, args)))


@unit("parallel/worker.py")
def test_a_worker_runs_its_orders_in_turn_and_answers_only_calls(stage):
    runner = _Runner()
    thread, engine, worker_end = _serve_in_thread(stage, runner)
    _order(engine, "execute_model", "step 1")
    _order(engine, "call", "prompt_logits", ([1, 2],))
    _order(engine, "execute_model", "step 2")
    assert engine.poll(5.0)
    assert engine.recv() == ("reply", "prompt_logits")  # the call's acknowledgement only
    _order(engine, "shutdown")
    thread.join(timeout=5.0)
    assert not thread.is_alive(), "a worker told to stop did not"
    assert runner.calls == [
        ("execute_model", ("step 1",)),
        ("prompt_logits", ([1, 2],)),
        ("execute_model", ("step 2",)),
    ]
    worker_end.close()
    with pytest.raises(EOFError):  # nothing more was sent: no answer to a step
        engine.recv()


@unit("parallel/worker.py")
def test_a_worker_whose_engine_is_gone_stops(stage):
    thread, engine, _ = _serve_in_thread(stage, _Runner())
    engine.close()  # the engine died: its end of the pipe closes
    thread.join(timeout=5.0)
    assert not thread.is_alive()


class _BlockingRunner(_Runner):
    """A call that runs until the test lets it finish, and one that fails on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def slow_sum(self, values):
        self.calls.append(("slow_sum", (values,)))
        assert self.release.wait(5.0), "never released"
        return sum(values)

    def explode(self):
        self.calls.append(("explode", ()))
        raise ValueError("only on this rank")


def _serve_catching(stage, runner):
    """_serve in a thread that keeps what it raised (a worker's error ends its loop)."""
    worker = importlib.import_module(f"{stage.__name__}.parallel.worker")
    engine_end, worker_end = Pipe()
    raised: list[BaseException] = []

    def serve() -> None:
        try:
            worker._serve(runner, worker_end)
        except BaseException as exc:  # the test inspects it
            raised.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, engine_end, raised


@unit("parallel/worker.py")
def test_a_worker_answers_a_call_only_after_it_ran_and_call_all_with_its_result(stage):
    """The engine reads an answer as "this rank has run it" (executor._call waits for every
    rank): an acknowledgement sent before the call ran would let the engine go on while a
    worker still runs it, or fails in it. call_all's answer is the rank's result."""
    runner = _BlockingRunner()
    thread, engine, _ = _serve_catching(stage, runner)
    _order(engine, "call", "slow_sum", ([1, 2],))
    assert not engine.poll(0.3), "a call acknowledged before it returned"
    runner.release.set()
    assert engine.poll(5.0) and engine.recv() == ("reply", "slow_sum")
    _order(engine, "call_all", "slow_sum", ([3, 4],))
    assert engine.poll(5.0) and engine.recv() == ("reply", 7)  # the result, not the name
    _order(engine, "call_all", "prompt_logits", ([5, 6],))
    assert engine.poll(5.0) and engine.recv() == ("reply", [5, 6])
    _order(engine, "shutdown")
    thread.join(timeout=5.0)
    assert not thread.is_alive()


@unit("parallel/worker.py")
def test_a_call_that_fails_on_a_worker_is_never_acknowledged(stage):
    """An error in a call on this rank ends the loop with the error (worker_main reports it,
    then the process exits): no acknowledgement may precede it, or the engine's `call` returns
    as if every rank had run it, and the error reaches nobody who asked."""
    for method in ("call", "call_all"):
        runner = _BlockingRunner()
        thread, engine, raised = _serve_catching(stage, runner)
        _order(engine, method, "explode", ())
        thread.join(timeout=5.0)
        assert not thread.is_alive(), "a worker went on after its call failed"
        assert [type(e) for e in raised] == [ValueError], raised
        assert not engine.poll(0), f"a failed {method} was answered"
        assert runner.calls == [("explode", ())]


@unit("parallel/group.py")
def test_rank_0s_store_holds_its_port_from_the_start(stage) -> None:
    """The rendezvous is rank 0's TCP store on a port the OS picks as the store binds it. The
    port used to be probed free (bind, close), handed to the workers and bound by the store
    only later: a neighbouring test's process took it in between once (EADDRINUSE in a CI
    run). Now no other socket can bind it while the store lives, and a rank joins it."""
    parallel = importlib.import_module(f"{stage.__name__}.parallel.group")
    store, address = parallel.open_rendezvous(2, 5.0)
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((host, int(port)))
    joined = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timedelta(seconds=5))
    joined.set("rank 1", "here")
    assert store.get("rank 1") == b"here"
