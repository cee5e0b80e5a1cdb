"""The engine's side of the KV connector seam (stages 12-13), kept apart from the step loop.

vLLM gives its model runner the connector's plumbing through a mixin
(`KVConnectorModelRunnerMixin`); `LLMEngine` takes its own the same way, so engine.py keeps
the request lifecycle and only calls these at the points its step needs them:

- `_make_kv_connector` builds the scheduler side of the connector the config asks for: the
  host tier (offload/connector.py), sized by the runners, its prefix tier on when prefix caching is;
  or the transfer to or from another engine (disagg/connector.py) for a prefill or decode role;
- `_settle_kv_transfers` runs one step of transfers only once no request is left, so an idle
  engine holds no store in flight;
- `_poll_connector` hands the workers' report to the scheduler after each step;
- `check_no_leaks` is the check the tests run after every workload: both tiers are whole.

Disaggregation (stage 13): with `kv_role="prefill"` or `"decode"` the connector moves a
request's KV to or from another engine. A transfer may span many steps: every step polls the
workers' report, even a step with nothing to run, and a decode request waiting for its KV is no
livelock. The control messages between the two engines leave by `take_peer_messages` and
arrive by `deliver_peer_messages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..disagg.connector import DecodeConnector, PrefillConnector, TransferConnector
from ..disagg.transfer_sides import DecodeTransfers, PrefillTransfers
from ..disagg.transfer_state import PeerMessage, TransferConfig
from ..offload.connector import OffloadingConnectorScheduler
from ..offload.manager import LRUOffloadManager

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..kv_cache import KVCacheManager
    from ..model_runner import ModelRunner, StepHandle
    from ..parallel.executor import MultiprocExecutor, UniProcExecutor
    from ..request import RequestOutput
    from ..scheduler import Scheduler, SchedulerOutput


class KVConnectorEngineMixin:
    """The connector methods of `LLMEngine`; the attributes are the engine's, set in its
    `__init__`."""

    config: EngineConfig
    executor: UniProcExecutor | MultiprocExecutor
    runner: ModelRunner
    kv_manager: KVCacheManager
    kv_connector: OffloadingConnectorScheduler | TransferConnector | None
    scheduler: Scheduler
    _in_flight: tuple[SchedulerOutput, StepHandle] | None
    _idle: bool

    def _make_kv_connector(self) -> OffloadingConnectorScheduler | TransferConnector | None:
        """The scheduler side of the connector: the transfer to or from another engine (stage
        13) for a prefill or decode role; else the host tier (stage 12), sized by the runners,
        its prefix tier on when prefix caching is; None without one."""
        config = self.config
        if config.kv_role != "both":
            transfers = TransferConfig(
                lease_seconds=config.kv_lease_seconds,
                bootstrap_timeout_seconds=config.kv_transfer_timeout_seconds,
                waiting_timeout_seconds=config.kv_transfer_timeout_seconds,
                transfer_timeout_seconds=config.kv_transfer_timeout_seconds,
                on_failure=config.kv_transfer_on_failure,
            )
            if config.kv_role == "prefill":
                return PrefillConnector(PrefillTransfers(transfers), self.kv_manager)
            return DecodeConnector(DecodeTransfers(transfers), self.kv_manager)
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

    def _poll_connector(self) -> list[RequestOutput]:
        """Hand the workers' report to the scheduler; outputs of the requests it failed. A
        report that moved a request (its KV arrived, or its transfer failed) is progress: the
        step was not idle, though it ran nothing. Without a connector nothing reports: no
        call at all (this runs after every step)."""
        if self.kv_connector is None:
            return []
        loading = len(self.scheduler.loading)
        failed = self.scheduler.update_connector_output(self.executor.take_kv_connector_output())
        if failed or len(self.scheduler.loading) != loading:
            self._idle = False
        for request in failed:
            self._forget_drafts(request.request_id)  # the engine's (its n-gram index)
        return [o for o in (r.output() for r in failed) if o is not None]

    # ----------------------------------------------------------------------- disaggregation
    def take_peer_messages(self) -> list[PeerMessage]:
        """Control messages for the other engine of a prefill/decode pair (none otherwise)."""
        if isinstance(self.kv_connector, TransferConnector):
            return self.kv_connector.take_peer_messages()
        return []

    def deliver_peer_messages(self, messages: Sequence[PeerMessage]) -> None:
        """Control messages from the other engine, applied at the next step."""
        if isinstance(self.kv_connector, TransferConnector):
            self.kv_connector.deliver(messages)

    def has_pending_transfers(self) -> bool:
        """A transfer to or from another engine, or a message about one, is under way: keep
        stepping (a step with nothing to run still polls it)."""
        connector = self.kv_connector
        return isinstance(connector, TransferConnector) and connector.has_pending()

    def waiting_on_transfers(self) -> bool:
        """The last step did nothing, and only transfers are left to wait for: a loop may
        sleep a little before the next step instead of spinning."""
        return self._idle and self._in_flight is None and self.has_pending_transfers()

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless both tiers are whole: with nothing running, every device
        block is free (cached content may stay) and no host block is referenced or mid-store."""
        allocator = self.kv_manager.allocator
        assert allocator.num_free == allocator.num_blocks, "a device block leaked"
        assert not self.scheduler._held, f"blocks still held: {list(self.scheduler._held)[:3]}"
        if isinstance(self.kv_connector, TransferConnector):
            records = self.kv_connector.side.records
            assert not records, f"transfers not ended: {list(records.values())[:3]}"
            assert not self.runner.kv_connector.in_flight(), "a transport still holds a transfer"
        elif self.kv_connector is not None:
            manager = self.kv_connector.manager
            manager.check()
            busy = [k for k, b in manager.blocks.items() if b.ref_count or not b.ready]
            assert not busy, f"host blocks still in use: {busy[:3]}"
            assert self.kv_connector.num_jobs_in_flight() == 0, "a KV transfer never ended"


def has_work(scheduler_output: SchedulerOutput) -> bool:
    """A step runs when it schedules a request or carries KV transfers."""
    return bool(scheduler_output.requests) or scheduler_output.kv_connector_metadata is not None
