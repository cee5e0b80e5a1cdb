"""The prefill and the decode side of a disaggregated request's transfer (disagg/transfer_state.py
holds the states, the checked moves and the effects they share).

The rules, each a bug that shipped in vLLM or SGLang:
- Blocks the transport may still touch are never freed: a lease that expires during a read
  (vLLM #21570), a decode abort or timeout during a write (SGLang PR #32564) mark the record
  FAILED at once but free its blocks only when the transport reports the transfer drained.
- A decode that rejects a request before admission tells the prefill side, which frees its lease
  at once instead of stranding the blocks (vLLM PR #41269).
- A decode that never hears from prefill frees its blocks after `waiting_timeout_seconds`
  (vLLM #46283); a stuck handshake (SGLang #10110) and a lost "done" (SGLang #11648) time out.
- A full prefix hit on the decode side has nothing to move: it succeeds at once and tells the
  prefill side to free (vLLM PR #56640).
- A failed or timed-out transfer ends the request's wait: it is prefilled locally, or failed
  (`on_failure`). Nothing waits without a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

from .transfer_state import KVPoll, PeerMessage, TransferRecord, TransferSide


class PrefillTransfers(TransferSide):
    """The prefill engine's records: it computes a request's KV, holds the blocks under a lease
    and sends them; the blocks go back to its pool when decode has them, or never will."""

    def add(self, request_id: str, now: float) -> None:
        """A request with `do_remote_decode` arrived: the decode side is not known yet."""
        self._add(request_id, now)

    def bootstrapped(self, request_id: str, now: float) -> None:
        self._move(self.records[request_id], KVPoll.WAITING_FOR_INPUT, now)

    def hold(self, request_id: str, block_ids: Sequence[int], now: float) -> bool:
        """Prefill finished: keep the request's blocks until decode takes them or the lease
        runs out. False when the transfer already failed: free them now (request_finished's
        delay_free)."""
        record = self.records.get(request_id)
        if record is None:
            return False
        assert not record.block_ids and record.state < KVPoll.TRANSFERRING, record
        if not block_ids:  # a one-token prompt: decode computes it all, nothing to hold
            self._move(record, KVPoll.SUCCESS, now, "nothing to send")
            self._release(record)
            return False
        record.block_ids = tuple(block_ids)
        record.lease_until = now + self.config.lease_seconds
        return True

    def abort(self, request_id: str, now: float) -> None:
        """The prefill request ended without KV to send (aborted, or failed): tell decode."""
        record = self.records.get(request_id)
        if record is not None and record.state is not KVPoll.FAILED:
            self._fail(record, now, "prefill aborted")

    def pull(self, request_id: str, block_ids: Sequence[int], now: float) -> bool:
        """Decode posted its receive of `block_ids` (held blocks, in the order it wants them):
        start the send. False when there is nothing to send from (the lease ran out, the
        request was aborted, or it asks for blocks this side does not hold): the caller sends
        a refusal, so the two ends of the stream stay in step."""
        record = self.records.get(request_id)
        if record is None or record.state is not KVPoll.WAITING_FOR_INPUT:
            return False
        if not block_ids or not set(block_ids) <= set(record.block_ids):
            return False
        self.start_send(request_id, now)
        return True

    def start_send(self, request_id: str, now: float) -> None:
        record = self.records[request_id]
        assert record.block_ids, f"{request_id}: send before hold"
        self._move(record, KVPoll.TRANSFERRING, now)
        record.in_flight = True

    def send_finished(self, request_id: str, ok: bool, now: float, reason: str = "") -> None:
        """The transport no longer reads the blocks (sent, failed, or cancelled)."""
        record = self._drained(request_id)
        if record.state is KVPoll.TRANSFERRING and ok:
            self._move(record, KVPoll.SUCCESS, now, "sent")
        elif record.state is KVPoll.TRANSFERRING:
            self._move(record, KVPoll.FAILED, now, reason or "send failed")
            self._out.to_peer.append(PeerMessage("failed", request_id))
        self._release(record)  # a record that failed earlier only waited for this drain

    def on_peer_message(self, message: PeerMessage, now: float) -> None:
        record = self.records.get(message.request_id)
        if record is None or record.state is KVPoll.FAILED:
            self.late_messages += record is None
            return
        if message.kind == "done" and record.state is KVPoll.WAITING_FOR_INPUT:
            self._move(record, KVPoll.SUCCESS, now, "decode has the KV")  # a full prefix hit
        elif message.kind in ("reject", "abort"):
            self._move(record, KVPoll.FAILED, now, f"decode sent {message.kind}")
            if record.in_flight:
                self._out.cancel.append(record.request_id)
        self._release(record)

    def poll_timeouts(self, now: float) -> None:
        """Fail what waited too long: a handshake past `bootstrap_timeout_seconds`, a send past
        `transfer_timeout_seconds` (cancelled: its blocks go back once it drains), and held
        blocks past their lease, checked only while no send reads them (vLLM #21570). Each
        failure tells the decode side."""
        for record in list(self.records.values()):
            if record.state is KVPoll.BOOTSTRAPPING and (
                now - record.since > self.config.bootstrap_timeout_seconds
            ):
                self._fail(record, now, "bootstrap timed out")
            elif record.state is KVPoll.TRANSFERRING and (
                now - record.since > self.config.transfer_timeout_seconds
            ):
                self._fail(record, now, "send timed out")
            elif not record.in_flight and record.block_ids and now > record.lease_until:
                self._fail(record, now, "lease expired")  # never while a send reads them

    def _fail(self, record: TransferRecord, now: float, reason: str) -> None:
        self._move(record, KVPoll.FAILED, now, reason)
        self._out.to_peer.append(PeerMessage("failed", record.request_id))
        if record.in_flight:
            self._out.cancel.append(record.request_id)
        self._release(record)


class DecodeTransfers(TransferSide):
    """The decode engine's records: it admits a request, allocates its blocks, receives its KV,
    then schedules it like a prefix-cache hit; a failure prefills it here or fails it."""

    def add(self, request_id: str, now: float) -> None:
        """A request with `do_remote_prefill` arrived: waiting for the prefill side."""
        self._add(request_id, now)

    def reject(self, request_id: str, now: float, reason: str) -> None:
        """Refuse the request before any block is allocated, and tell the prefill side."""
        record = self.records[request_id]
        assert not record.block_ids, f"{request_id}: reject after allocation; abort instead"
        self._move(record, KVPoll.FAILED, now, f"rejected: {reason}")
        self._out.to_peer.append(PeerMessage("reject", request_id))
        self._out.failed.append(request_id)
        self._release(record)

    def bootstrapped(self, request_id: str, now: float) -> None:
        self._move(self.records[request_id], KVPoll.WAITING_FOR_INPUT, now)

    def allocate(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: int, now: float
    ) -> None:
        """The scheduler gave the request its blocks. With nothing to receive (its prompt is a
        local prefix hit) the transfer is complete now: the request runs and prefill frees."""
        record = self.records[request_id]
        assert record.state is KVPoll.WAITING_FOR_INPUT and not record.block_ids, record
        record.block_ids, record.since = tuple(block_ids), now
        if num_external_tokens == 0:
            self._succeed(record, now, "full prefix hit")

    def start_recv(self, request_id: str, now: float) -> None:
        record = self.records[request_id]
        assert record.block_ids, f"{request_id}: receive before allocation"
        self._move(record, KVPoll.TRANSFERRING, now)
        record.in_flight = True

    def recv_finished(self, request_id: str, ok: bool, now: float, reason: str = "") -> None:
        """The transport no longer writes the blocks (received, failed, or cancelled)."""
        record = self._drained(request_id)
        if record.state is not KVPoll.TRANSFERRING:  # it failed earlier; only the free waited
            self._release(record)
        elif ok:
            self._succeed(record, now, "received")
        else:
            self._fail(record, now, reason or "receive failed")

    def abort(self, request_id: str, now: float) -> None:
        """The client went away: stop, free when drained, tell the prefill side."""
        record = self.records.get(request_id)
        if record is None or record.state in (KVPoll.SUCCESS, KVPoll.FAILED):
            return  # already running or gone: the scheduler frees it as any request
        self._move(record, KVPoll.FAILED, now, "aborted")
        self._out.to_peer.append(PeerMessage("abort", request_id))
        if record.in_flight:
            self._out.cancel.append(request_id)
        self._release(record)

    def on_peer_message(self, message: PeerMessage, now: float) -> None:
        record = self.records.get(message.request_id)
        if record is None:
            self.late_messages += 1
        elif message.kind == "failed" and KVPoll.FAILED < record.state < KVPoll.SUCCESS:
            self._fail(record, now, "prefill failed")

    def poll_timeouts(self, now: float) -> None:
        deadlines = {
            KVPoll.BOOTSTRAPPING: (self.config.bootstrap_timeout_seconds, "bootstrap timed out"),
            KVPoll.WAITING_FOR_INPUT: (self.config.waiting_timeout_seconds, "prefill silent"),
            KVPoll.TRANSFERRING: (self.config.transfer_timeout_seconds, "no done signal"),
        }
        for record in list(self.records.values()):
            if record.state in deadlines:
                seconds, reason = deadlines[record.state]
                if now - record.since > seconds:
                    self._fail(record, now, reason)

    def _succeed(self, record: TransferRecord, now: float, reason: str) -> None:
        self._move(record, KVPoll.SUCCESS, now, reason)
        self._out.to_peer.append(PeerMessage("done", record.request_id))
        self._out.loaded.append(record.request_id)
        record.block_ids = ()  # they belong to the running request now, not to the transfer
        self._release(record)

    def _fail(self, record: TransferRecord, now: float, reason: str) -> None:
        self._move(record, KVPoll.FAILED, now, reason)
        self._out.to_peer.append(PeerMessage("abort", record.request_id))
        if record.in_flight:
            self._out.cancel.append(record.request_id)
        if self.config.on_failure == "local_prefill":
            self._out.local_prefill.append(record.request_id)
        else:
            self._out.failed.append(record.request_id)
        self._release(record)
