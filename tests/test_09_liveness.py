"""Stage 09: where each rank runs, and a step whose peer died is given up, not waited for.

- `wait_until` (stages/common/step_wait.py, shared by stages 09-15) returns once the step is
  done, raises naming the failure as soon as one is reported, and raises TimeoutError once its
  deadline passes: plain callables and a fake clock stand in for the CUDA event and time.
- The executor waits for rank 0's step that way: a worker that dies while the step hangs (an
  NCCL collective on a dead peer never returns) fails the step with WorkerDiedError naming it;
  a step that outlives the distributed timeout marks the executor failed.
- `rank_devices`: rank r of an engine on cuda:b runs on cuda:b+r; too few GPUs is a ValueError
  naming the numbers; on a CPU every rank shares the host. No CUDA is needed to check it.
- `bind_device` makes the rank's GPU current (never on a CPU, nor for a bare "cuda").
- On a GPU (skipped without one): a wait on a busy stream is given up at once when told.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from stages.common import step_wait

from .conftest import requires_cuda, since, unit

pytestmark = since("09")


class _Clock:
    """A fake monotonic clock that `sleep` moves forward: no real time passes."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1


def test_wait_until_returns_once_done():
    clock, looks = _Clock(), iter([False, False, True])
    step_wait.wait_until(lambda: next(looks), lambda: None, 5.0, clock=clock, sleep=clock.sleep)
    assert clock.slept == 2


def test_wait_until_gives_up_naming_the_failure():
    module, clock = step_wait, _Clock()
    failure = iter([None, None, "tensor-parallel rank 1 (pid 7) exited with code -9"])
    with pytest.raises(module.StepAbortedError, match=r"rank 1 \(pid 7\) exited with code -9"):
        module.wait_until(
            lambda: False, lambda: next(failure), None, clock=clock, sleep=clock.sleep
        )
    assert clock.slept == 2, "it gives up at the first look that sees the failure"


def test_wait_until_times_out_at_its_deadline():
    module, clock = step_wait, _Clock()
    with pytest.raises(TimeoutError, match=r"0\.5 s"):
        module.wait_until(lambda: False, lambda: None, 0.5, clock=clock, sleep=clock.sleep)
    assert 100.5 <= clock.now < 100.5 + module.LONGEST_PAUSE_SECONDS + 1e-9


def test_wait_until_prefers_a_finished_step_to_a_failure():
    """A step that is done is returned even if a worker failed meanwhile (its tokens exist)."""
    step_wait.wait_until(lambda: True, lambda: "rank 1 died", 0.0)


def _executor(stage, done, timeout=120.0):
    """A MultiprocExecutor with no worker process, whose rank-0 step finishes when `done()`."""
    module = importlib.import_module(f"{stage.__name__}.parallel.multiproc_executor")
    executor = module.MultiprocExecutor.__new__(module.MultiprocExecutor)
    executor._workers, executor._sent, executor._timeout = [], (0, 0, 0.0), timeout
    executor.failure = None
    executor._replied = module.threading.Condition()
    handle = module.StepHandle(("a",), lambda: [[7]], done)
    executor.driver = SimpleNamespace(launch=lambda output: handle)
    return module, executor


@unit("parallel/multiproc_executor.py")
def test_a_step_hanging_on_a_dead_worker_fails_naming_it(stage):
    """The step never finishes (NCCL waits for ever on a dead peer); the monitor's report of
    the death ends the wait with WorkerDiedError, which fails the requests (a 503 at /health)."""
    reported = []

    def done() -> bool:  # the monitor notices the death while rank 0 waits
        if not reported:
            reported.append(True)
            executor._fail("tensor-parallel rank 1 (pid 7) exited with code -9")
        return False

    module, executor = _executor(stage, done)
    step = executor.launch(stage.scheduler.SchedulerOutput(requests=()))
    with pytest.raises(module.WorkerDiedError, match=r"rank 1 \(pid 7\)"):
        step.result()


@unit("parallel/multiproc_executor.py")
def test_a_step_past_the_distributed_timeout_fails_the_executor(stage):
    module, executor = _executor(stage, lambda: False, timeout=0.05)
    step = executor.launch(stage.scheduler.SchedulerOutput(requests=()))
    with pytest.raises(module.WorkerDiedError, match="distributed_timeout_seconds"):
        step.result()
    assert executor.failure is not None, "/health must say the engine is broken"
    with pytest.raises(module.WorkerDiedError):
        executor.check_alive()


@unit("parallel/multiproc_executor.py")
def test_a_finished_step_returns_its_tokens(stage):
    _, executor = _executor(stage, lambda: True)
    step = executor.launch(stage.scheduler.SchedulerOutput(requests=()))
    assert step.result() == {"a": [7]}


@unit("parallel/placement.py")
@pytest.mark.parametrize("base", [0, 1, 2])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_rank_r_of_an_engine_on_cuda_b_runs_on_cuda_b_plus_r(stage, base, size):
    devices = stage.parallel.placement.rank_devices(torch.device("cuda", base), size, num_gpus=5)
    assert devices == [torch.device("cuda", base + r) for r in range(size)]


@unit("parallel/placement.py")
def test_rank_devices_refuses_too_few_gpus_and_shares_a_cpu(stage):
    rank_devices = stage.parallel.placement.rank_devices
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 on cuda:1 .* 2 are visible"):
        rank_devices(torch.device("cuda", 1), 2, num_gpus=2)
    assert rank_devices(torch.device("cuda"), 2, num_gpus=2) == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    cpu = torch.device("cpu")
    assert rank_devices(cpu, 3, num_gpus=0) == [cpu, cpu, cpu]


@unit("parallel/worker.py")
def test_bind_device_makes_the_ranks_gpu_current(stage, monkeypatch):
    worker = importlib.import_module(f"{stage.__name__}.parallel.worker")
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    worker.bind_device(torch.device("cpu"))
    worker.bind_device(torch.device("cuda"))  # no index: the current device is meant
    assert bound == []
    worker.bind_device(torch.device("cuda", 3))
    assert bound == [3]


@requires_cuda("a real CUDA event on a busy stream")
def test_cuda_a_wait_on_a_busy_stream_is_given_up_when_told():
    """A kernel that runs for a long while stands in for a collective on a dead peer: the
    wait on its event ends as soon as the failure is reported, long before the kernel."""
    module = step_wait
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles
        ready = torch.cuda.Event()
        ready.record(stream)
    with pytest.raises(module.StepAbortedError, match="peer died"):
        module.wait_until(ready.query, lambda: "peer died", None)
    assert not ready.query(), "the wait gave up while the kernel still ran"
    module.wait_until(ready.query, lambda: None, 60.0)  # it does end, and the wait sees it
    torch.cuda.synchronize()


@unit("parallel/worker.py")
@requires_cuda("binding a second GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_bind_device_sets_the_current_device(stage):
    worker = importlib.import_module(f"{stage.__name__}.parallel.worker")
    previous = torch.cuda.current_device()
    try:
        worker.bind_device(torch.device("cuda", 1))
        assert torch.cuda.current_device() == 1
    finally:
        torch.cuda.set_device(previous)
