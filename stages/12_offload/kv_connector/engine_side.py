"""The engine's side of the KV connector seam (stage 12), kept apart from the step loop.

vLLM gives its model runner the connector's plumbing through a mixin
(`KVConnectorModelRunnerMixin`); `LLMEngine` takes its own the same way, so engine.py keeps
the request lifecycle and only calls these at the points its step needs them:

- `_make_kv_connector` builds the scheduler side of the connector the config asks for: the
  host tier (offload/connector.py), sized by the runners, its prefix tier on when prefix caching is;
- `_settle_kv_transfers` runs one step of transfers only once no request is left, so an idle
  engine holds no store in flight;
- `check_no_leaks` is the check the tests run after every workload: both tiers are whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..offload.connector import OffloadingConnectorScheduler
from ..offload.manager import LRUOffloadManager

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..kv_cache import KVCacheManager
    from ..model_runner import ModelRunner, StepHandle
    from ..parallel.executor import MultiprocExecutor, UniProcExecutor
    from ..scheduler import Scheduler, SchedulerOutput


class KVConnectorEngineMixin:
    """The connector methods of `LLMEngine`; the attributes are the engine's, set in its
    `__init__`."""

    config: EngineConfig
    executor: UniProcExecutor | MultiprocExecutor
    runner: ModelRunner
    kv_manager: KVCacheManager
    kv_connector: OffloadingConnectorScheduler | None
    scheduler: Scheduler
    _in_flight: tuple[SchedulerOutput, StepHandle] | None

    def _make_kv_connector(self) -> OffloadingConnectorScheduler | None:
        """The scheduler side of the host tier (stage 12), sized by the runners; None without
        one. Its prefix tier is on when prefix caching is."""
        if not self.config.kv_offload_bytes:
            return None
        manager = LRUOffloadManager(self.runner.num_host_blocks)
        return OffloadingConnectorScheduler(manager, self.kv_manager, self.config.prefix_caching)

    def _settle_kv_transfers(self) -> None:
        """No request is left but host-tier transfers are in flight (stores run across steps):
        run one step of transfers only, which waits for them on every rank (there is no
        forward to overlap), and take its report. An idle engine then holds no transfer in
        flight, and the next request sees every block its stores brought to the host tier."""
        connector = self.kv_connector
        if connector is None:  # most engines: no call into the ABC's isinstance, every step
            return
        if not isinstance(connector, OffloadingConnectorScheduler) or self._in_flight is not None:
            return
        if self.scheduler.has_unfinished() or not connector.num_jobs_in_flight():
            return
        self.executor.execute_model(self.scheduler.schedule())  # no request: a flush
        self.scheduler.update_connector_output(self.runner.take_kv_connector_output())

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless both tiers are whole: with nothing running, every device
        block is free (cached content may stay) and no host block is referenced or mid-store."""
        allocator = self.kv_manager.allocator
        assert allocator.num_free == allocator.num_blocks, "a device block leaked"
        if self.kv_connector is not None:
            manager = self.kv_connector.manager
            manager.check()
            busy = [k for k, b in manager.blocks.items() if b.ref_count or not b.ready]
            assert not busy, f"host blocks still in use: {busy[:3]}"
            assert self.kv_connector.num_jobs_in_flight() == 0, "a KV transfer never ended"


def has_work(scheduler_output: SchedulerOutput) -> bool:
    """A step runs when it schedules a request or carries KV transfers."""
    return bool(scheduler_output.requests) or scheduler_output.kv_connector_metadata is not None
