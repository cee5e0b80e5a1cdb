r"""Executors: how the engine runs its model, in its own process or across tensor-parallel ranks.

    engine --SchedulerOutput--> executor --> rank 0: ModelRunner (in the engine's process)
                                         \-> ranks 1..N-1: worker processes (parallel/worker.py)

The seam is vLLM's (`UniProcExecutor`, `MultiprocExecutor`); the shape is nano-vllm's: rank 0
runs in the engine's process, so a step costs no extra hop for the rank that returns tokens.
The engine sees one interface either way (`launch`, `execute_model`, `call`, `call_all`,
`check_alive`, `workers`, `shutdown`), and `make_executor` picks the side of the seam: one
rank runs in this process as in stage 08 (`UniProcExecutor`, here), more run in worker
processes (`MultiprocExecutor`, parallel/multiproc_executor.py: shipping the steps, watching the
workers, naming the one that died).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.common.model_config import ModelConfig

from ..config import EngineConfig
from ..model_runner import ModelRunner, StepHandle
from ..scheduler import SchedulerOutput
from .multiproc_executor import MultiprocExecutor, WorkerDiedError
from .worker import bind_device


class UniProcExecutor:
    """Stage 08's behaviour: the model runner in the engine's own process."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        bind_device(device)
        self.driver = ModelRunner(config, model_path, model_config, device, dtype)
        self.tensor_parallel_size = 1

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return self.driver.launch(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        return self.launch(scheduler_output).result()

    def call(self, method: str, *args: Any) -> Any:
        """Run `ModelRunner.method(*args)` (on every rank; here there is one)."""
        return getattr(self.driver, method)(*args)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of `ModelRunner.method(*args)`, in rank order."""
        return [self.call(method, *args)]

    def check_alive(self) -> None:
        """Raise WorkerDiedError if a rank has failed (never, with one rank)."""

    def workers(self) -> list[dict[str, Any]]:
        return []

    def shutdown(self) -> None:
        """Nothing to stop."""


def make_executor(
    config: EngineConfig,
    model_path: Path,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> UniProcExecutor | MultiprocExecutor:
    """One rank: the runner in this process (stage 08). More: worker processes."""
    kind = UniProcExecutor if config.tensor_parallel_size == 1 else MultiprocExecutor
    return kind(config, model_path, model_config, device, dtype)


__all__ = ["MultiprocExecutor", "UniProcExecutor", "WorkerDiedError", "make_executor"]
