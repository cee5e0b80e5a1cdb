"""A prefill engine and a decode engine in one process, joined by the proxy's logic.

What the front end (frontend/disagg_client.py) does across processes, done here by hand over two
`LLMEngine`s that share an in-process transport (built with the same
`kv_transfer_address="in-process://name"` inside fake_transport.in_process_transports()): each
request goes to the prefill engine with `max_tokens=1` and `{"do_remote_decode": True}`; when it
finishes, the parameters it hands back (where its KV waits) go with the original request to the
decode engine, whose tokens are the answer. Both engines step in turn and the control messages
between them are relayed after each step. Tests and the notebook use it to watch
the two sides without processes.

The first token is the decode engine's: it receives the prompt's KV but the last token, computes
that token itself and samples from its logits (the prefill engine's token is dropped), so a
seeded request samples exactly what it would on one engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..disagg.transfer_state import PeerMessage
from ..engine import LLMEngine, Prompt
from ..request import Request, RequestOutput
from ..sampling import SamplingParams

MAX_IDLE_SECONDS = 120.0  # the pair made no progress this long: a bug, not a slow transfer


def prefill_request(engine: LLMEngine, request: Request) -> Request:
    """The prefill engine's copy of a request: one token, its KV kept for a decode engine."""
    params = replace(request.params, max_tokens=1, stop=())
    copy = engine.make_request(
        list(request.prompt_token_ids), params, request_id=request.request_id
    )
    copy.seed = request.seed
    copy.kv_transfer_params = {"do_remote_decode": True}
    return copy


def decode_request(request: Request, transfer_params: dict[str, Any] | None) -> Request:
    """The request for the decode engine: the original, with where its KV waits (None: the
    prefill engine kept none, and the decode engine computes the prompt itself)."""
    request.kv_transfer_params = transfer_params
    return request


class DisaggregatedPair:
    """Two engines of one process, one prefilling, one decoding, stepped together."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        assert prefill.config.kv_role == "prefill" and decode.config.kv_role == "decode"
        self.prefill, self.decode = prefill, decode
        self.handed_over: dict[str, dict[str, Any] | None] = {}  # request id -> its params
        self._waiting: dict[str, Request] = {}  # prefilling: the request the decode gets next

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        on_step: Callable[[DisaggregatedPair], None] | None = None,
    ) -> list[RequestOutput]:
        """Each prompt prefilled on one engine and decoded on the other; outputs in order."""
        many = params if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [  # validated as the prefill engine sees them: the decode engine may refuse
            self.prefill.make_request(p, sp, output_kind="final")
            for p, sp in zip(prompts, many, strict=True)
        ]
        for request in requests:
            self.prefill.add_request(prefill_request(self.prefill, request))
            self._waiting[request.request_id] = request
        last_progress = time.monotonic()
        while any(not r.finished for r in requests) or self.busy():
            progress = self.step()
            if on_step is not None:
                on_step(self)
            if progress:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > MAX_IDLE_SECONDS:
                raise RuntimeError("the disaggregated pair made no progress")
            else:
                time.sleep(0.001)
        return [r.final_output() for r in requests]

    def add(self, request: Request) -> None:
        """Start one request (made by either engine's make_request): prefill first."""
        self.prefill.add_request(prefill_request(self.prefill, request))
        self._waiting[request.request_id] = request

    def abort(self, request_id: str) -> None:
        """The client left: end the request wherever it is, as the front end does."""
        request = self._waiting.pop(request_id, None)
        if request is not None:  # prefilling: the prefill engine drops it, nothing is held
            self.prefill.abort_request(request_id)
            request.finish("abort")
        elif self.decode.abort_request(request_id) is not None:  # the decode engine tells
            self.prefill.deliver_peer_messages([PeerMessage("abort", request_id)])

    def step(self) -> bool:
        """One step of each engine, then the messages between them. Returns whether anything
        happened."""
        outputs = self.prefill.step()
        self.prefill.check_progress()  # as every engine loop does: a livelock raises
        for output in outputs:  # failed: no params, the decode engine computes all
            if output.finished and output.request_id in self._waiting:
                request = self._waiting.pop(output.request_id)
                self.handed_over[request.request_id] = output.kv_transfer_params
                self.decode.add_request(decode_request(request, output.kv_transfer_params))
        outputs += self.decode.step()
        self.decode.check_progress()
        to_prefill = self.decode.take_peer_messages()
        to_decode = self.prefill.take_peer_messages()
        self.prefill.deliver_peer_messages(to_prefill)
        self.decode.deliver_peer_messages(to_decode)
        return bool(outputs or to_prefill or to_decode)

    def busy(self) -> bool:
        """Either engine still has requests, transfers or messages under way."""
        return any(
            e.has_unfinished() or e.has_pending_transfers() for e in (self.prefill, self.decode)
        )
