"""Disaggregated prefill and decode: moving a request's KV between two engines, as a connector.

A long prompt's prefill is one big forward; every decode step that waits behind it stalls.
Disaggregation runs prefill and decode on different engines (vLLM's NixlConnector, SGLang's
`disaggregation/`, DistServe, Splitwise): the prefill engine computes the prompt's KV, the
decode engine receives it and generates. The proxy in front (frontend/disagg_client.py) sends a
request to the prefill engine with `max_tokens=1` and `kv_transfer_params={"do_remote_decode":
True}`, copies the parameters the prefill engine hands back into the request, and sends that to the
decode engine, whose tokens it streams.

Both engines keep stage 12's connector seam (kv_connector/base.py); only the connector differs:

    prefill engine (PrefillConnector)             decode engine (DecodeConnector)
    request_finished: hold the blocks under a     get_num_new_matched_tokens: the prompt but
      lease (delay_free) and hand back where        its last token comes from the prefill
      they are (transfer params)                    engine, asynchronously (it waits in
                                                    `loading`)
                                                  update_state_after_alloc: receive into the
                                                    blocks after the local prefix hit
                          <--- "pull" (request, prefill blocks) ---
    build_connector_meta: start the send          build_connector_meta: post the receive,
                                                    then send the pull
    update_connector_output: a drained send       update_connector_output: a drained
      frees the blocks (`sent`)                     receive schedules the request (`loaded`),
                                                    or computes it here / fails it

The decisions are the state machine's (disagg/transfer_sides.py: leases, deadlines, frees only after
the transport drained); this module turns the scheduler's calls into its events and its
effects into the scheduler's `ConnectorUpdate`. Control messages between the engines
(`PeerMessage`) leave through `take_peer_messages` and arrive through `deliver`; the front end
relays them. Time is read from `clock`, so a test can move it. What both roles share (the
metadata, the mailboxes, the clock) is `TransferConnector`, in disagg/transfer_connector.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..kv_connector.base import ConnectorUpdate, KVConnectorOutput, ScheduledStep
from .transfer_connector import TransferConnector, TransferMetadata, wants
from .transfer_sides import DecodeTransfers, PrefillTransfers
from .transfer_state import Effects, KVPoll, PeerMessage

if TYPE_CHECKING:
    from ..kv_cache import KVCacheManager
    from ..request import Request


class PrefillConnector(TransferConnector):
    """The prefill engine's side: compute, hold, send when decode pulls, free when drained."""

    def __init__(self, side: PrefillTransfers, kv: KVCacheManager, **kwargs: Any) -> None:
        super().__init__(kv, **kwargs)
        self.side = side
        self._refused: set[str] = set()  # sends that were refusals: nothing to report

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Nothing comes from elsewhere; a `do_remote_decode` request gets its record now (the
        decode side is known at once: one fixed peer, so the handshake is done)."""
        rid = request.request_id
        if wants(request, "do_remote_decode") and rid not in self.side.records:
            self.side.add(rid, self.clock())
            self.side.bootstrapped(rid, self.clock())
        return 0, False

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, Any]:
        """Finished with its KV computed: hold the blocks the decode side needs (its prompt but
        the last token) under a lease and hand back where they are. Aborted or failed: tell
        the decode side; nothing is held."""
        rid, now = request.request_id, self.clock()
        if rid not in self.side.records:
            return False, None
        if request.finish_reason not in ("stop", "length"):  # aborted (no reason yet), failed
            self.side.abort(rid, now)
            self._collect()
            return False, None
        send = tuple(block_ids[: self.kv.blocks_needed(len(request.prompt_token_ids) - 1)])
        delay = self.side.hold(rid, send, now)
        self._collect()
        if not delay and send:  # the transfer failed before the prefill ended
            return False, None
        params = {"do_remote_prefill": True, "remote_request_id": rid}
        return delay, params | {"remote_block_ids": list(send)}

    def build_connector_meta(self, scheduler_output: ScheduledStep) -> TransferMetadata | None:
        """Apply decode's messages (a pull starts a send, or a refusal), run the deadlines."""
        now, sends = self.clock(), []
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            if message.kind != "pull":
                self.side.on_peer_message(message, now)
            elif self.side.pull(message.request_id, message.block_ids, now):
                sends.append((message.request_id, message.block_ids))
            else:  # keep the stream in step: the decode side's receive is posted
                sends.append((message.request_id, ()))
                self._refused.add(message.request_id)
        self.side.poll_timeouts(now)
        self._free(self._collect())
        return self._metadata(sends, [])

    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        """A drained send ends the transfer (sent or failed); its blocks go back to the pool
        now, or once a transfer that failed earlier drains."""
        now = self.clock()
        for rid in sorted(output.finished_sending):
            if rid in self._refused:
                self._refused.discard(rid)
                continue
            self.side.send_finished(rid, rid not in output.failed, now)
            self.stats.blocks_stored += rid not in output.failed
        self._free(self._collect())
        sent, self._sent = tuple(self._sent), []
        return ConnectorUpdate(sent=sent)

    def has_pending(self) -> bool:
        return super().has_pending() or bool(self._refused)

    def _free(self, effects: Effects) -> None:
        self._sent.extend(rid for rid, _ in effects.free)


class DecodeConnector(TransferConnector):
    """The decode engine's side: admit, allocate, pull, receive; on failure compute the
    prompt here or fail the request (`TransferConfig.on_failure`)."""

    def __init__(self, side: DecodeTransfers, kv: KVCacheManager, **kwargs: Any) -> None:
        super().__init__(kv, **kwargs)
        self.side = side
        self._recvs: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # (id, dst, src)
        self._resolved: set[str] = set()  # transfer over: the request computes what it lacks
        self._fallback: set[str] = set()  # failed: compute here once the transport drained
        self._failing: dict[str, str] = {}  # failed: fail the request once drained
        self._gone: set[str] = set()  # finished while a receive was in flight: free when drained
        self._loaded: list[str] = []  # the next report's ConnectorUpdate, gathered from
        self._load_failed: list[str] = []  # every hook (the state machine moves in each)
        self._failed: list[tuple[str, str]] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A `do_remote_prefill` request: its prompt but the last token, after the local hit,
        comes from the prefill engine, asynchronously (never the last token: its logits are
        what the request samples from). Nothing to receive (a full local hit, or a one-token
        prompt): the transfer is complete now and the prefill side frees (PR #56640). A
        request this engine can never hold is rejected before admission, and the prefill side
        told (PR #41269); None makes the scheduler wait for the next report, which fails it."""
        rid, now = request.request_id, self.clock()
        params = wants(request, "do_remote_prefill")
        if params is None or rid in self._resolved:
            return 0, False
        if rid not in self.side.records:
            self.side.add(rid, now)
            problem = self._refusal(request, params)
            if problem:
                self.side.reject(rid, now, problem)
                self._settle(self._collect())
                return None, False
            self.side.bootstrapped(rid, now)
        record = self.side.records[rid]
        if record.state is not KVPoll.WAITING_FOR_INPUT or record.block_ids:
            return 0, False
        external = max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens)
        if external == 0:
            self.side.allocate(rid, (), 0, now)
            self._settle(self._collect())
            return 0, False
        return external, True

    def _refusal(self, request: Request, params: dict[str, Any]) -> str:
        """Why this engine cannot take the request's KV ("" when it can)."""
        if params.get("remote_request_id") != request.request_id:
            return f"the prefill engine knows it as {params.get('remote_request_id')!r}"
        needed = self.kv.blocks_needed(len(request.prompt_token_ids) - 1)
        held = len(params.get("remote_block_ids") or ())
        if held != needed:
            return f"the prefill engine holds {held} blocks, {needed} needed"
        longest = len(request.prompt_token_ids) + (request.params.max_tokens or 0)
        if self.kv.blocks_needed(longest) > self.kv.allocator.num_blocks:
            return f"{longest} tokens at most: more than this engine's whole KV pool"
        return ""

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Queue the receive into the blocks after the local hit, from the same positions of
        the prefill engine's blocks (the scheduler calls this before it moves
        `num_computed_tokens` past the external tokens).

        The state machine records the receive (`self.side.allocate(request id, destination
        blocks, num_external_tokens, now)`); `(request id, destination blocks, source blocks)`
        goes on `self._recvs`, which `build_connector_meta` posts and pulls; `self.stats`
        counts what is moved (`tokens_loaded` += the external tokens, `blocks_loaded` += the
        destination blocks)."""
        rid = request.request_id
        first = request.num_computed_tokens // self.block_size
        end = self.kv.blocks_needed(request.num_computed_tokens + num_external_tokens)
        dst = tuple(block_ids[first:end])
        src = tuple(request.kv_transfer_params["remote_block_ids"][first:end])
        self.side.allocate(rid, dst, num_external_tokens, self.clock())
        self._recvs.append((rid, dst, src))
        self.stats.tokens_loaded += num_external_tokens
        self.stats.blocks_loaded += len(dst)

    def build_connector_meta(self, scheduler_output: ScheduledStep) -> TransferMetadata | None:
        """Apply prefill's messages, post the queued receives and pull them (in this order, so
        the prefill side sends in the order the receives wait), run the deadlines."""
        now, recvs = self.clock(), []
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            self.side.on_peer_message(message, now)
        queued, self._recvs = self._recvs, []
        for rid, dst, src in queued:
            record = self.side.records.get(rid)
            if record is None or record.state is not KVPoll.WAITING_FOR_INPUT:
                continue  # failed meanwhile (prefill said so, or it timed out)
            self.side.start_recv(rid, now)
            recvs.append((rid, dst))
            self._outbox.append(PeerMessage("pull", rid, src))
        self.side.poll_timeouts(now)
        self._settle(self._collect())
        return self._metadata([], recvs)

    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        """A drained receive: the request runs (loaded), or its transfer failed. Reports what
        changed since the last report, from every hook."""
        now = self.clock()
        for rid in sorted(output.finished_recving):
            ok = rid not in output.failed
            self.side.recv_finished(rid, ok, now, "" if ok else "the transfer failed")
        self._settle(self._collect())
        update = ConnectorUpdate(
            tuple(self._loaded), tuple(self._load_failed), tuple(self._sent), tuple(self._failed)
        )
        self._loaded, self._load_failed, self._sent, self._failed = [], [], [], []
        return update

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, Any]:
        """Aborted while its transfer is under way: tell the prefill side, cancel the receive,
        and keep the blocks until it drained (SGLang PR #32564): delay_free."""
        rid = request.request_id
        self._recvs = [r for r in self._recvs if r[0] != rid]
        delay = False
        if rid in self.side.records:
            self.side.abort(rid, self.clock())
            self._settle(self._collect())
            delay = rid in self.side.records  # a receive still writes its blocks
        for pending in (self._resolved, self._fallback):
            pending.discard(rid)
        self._failing.pop(rid, None)
        if delay:
            self._gone.add(rid)
        return delay, None

    def has_pending(self) -> bool:
        return super().has_pending() or bool(
            self._recvs or self._loaded or self._load_failed or self._sent or self._failed
        )

    def _settle(self, effects: Effects) -> None:
        """Turn effects into the scheduler's next update. A failed request's blocks may still
        be written: it is computed here (load_failed) or failed only once its record is gone,
        when the transport has drained."""
        self._fallback.update(effects.local_prefill)
        for rid in effects.failed:
            self._failing[rid] = "KV transfer failed"
        self._loaded += effects.loaded
        for rid, _, reason in effects.ended:
            self._resolved.add(rid)
            if rid in self._gone:
                self._gone.discard(rid)
                self._sent.append(rid)
            elif rid in self._fallback:
                self._fallback.discard(rid)
                self._load_failed.append(rid)
                self.stats.load_failures += 1
            elif rid in self._failing:
                self._failed.append((rid, f"{self._failing.pop(rid)}: {reason}"))
                self.stats.load_failures += 1
