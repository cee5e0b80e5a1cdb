"""Stage 13's transfer connector, one hook at a time, without engines or transports (the
assignment's direct tests): a KV cache manager, a request, the connector, and a clock that
stands still.

- Prefill side, `request_finished`: a finished request holds exactly the blocks the decode
  side needs (its prompt but the last token) and hands back where they are; an aborted or
  failed one ("error") holds nothing and tells the decode side; a plain request is none of
  its business.
- Decode side, `update_state_after_alloc`: the receive goes into the blocks after the local
  prefix hit, from the same positions of the prefill side's blocks, and is pulled in that
  order; a full local hit receives nothing and says "done" at once (vLLM PR #56640).
- Decode side, `request_finished`: an abort during a receive cancels it and keeps the blocks
  until the transport drained (SGLang PR #32564), and so does one whose receive timed out but
  has not drained yet; a receive not started yet frees at once.
"""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

from .conftest import since, unit

pytestmark = [since("13"), unit("disagg/connector.py")]

BLOCK = 4


def _m(stage: ModuleType) -> SimpleNamespace:
    names = (
        "disagg.connector",
        "disagg.transfer_sides",
        "disagg.transfer_state",
        "kv_cache",
        "request",
    )
    found = [
        importlib.import_module(f"{stage.__name__}.{n}") for n in (*names, "kv_connector.base")
    ]
    return SimpleNamespace(**{k: v for m in found for k, v in vars(m).items() if k[0] != "_"})


def _request(stage, m, rid, num_prompt_tokens, params=None, max_tokens=4):
    return m.Request(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(range(10, 10 + num_prompt_tokens)),
        params=stage.SamplingParams(max_tokens=max_tokens, temperature=0),
        seed=0,
        eos_token_ids=frozenset(),
        detokenizer=None,
        kv_transfer_params=params,
    )


def _connector(stage, role: str):
    m = _m(stage)
    kv = m.KVCacheManager(32, BLOCK, True)
    config = m.TransferConfig()
    if role == "prefill":
        return m, m.PrefillConnector(m.PrefillTransfers(config), kv, clock=lambda: 0.0)
    return m, m.DecodeConnector(m.DecodeTransfers(config), kv, clock=lambda: 0.0)


def _messages(connector) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(x.kind, x.request_id, x.block_ids) for x in connector.take_peer_messages()]


def test_prefill_request_finished_holds_what_decode_needs_and_says_where(stage):
    m, connector = _connector(stage, "prefill")
    request = _request(stage, m, "r", 13, {"do_remote_decode": True})  # 12 tokens to send
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    request.finish_reason = "length"
    delay, params = connector.request_finished(request, [7, 3, 9, 4])  # 13 + 1 tokens: 4 blocks
    assert delay, "the blocks must outlive the request until decode has them"
    assert params == {
        "do_remote_prefill": True,
        "remote_request_id": "r",
        "remote_block_ids": [7, 3, 9],
    }
    assert connector.side.records["r"].block_ids == (7, 3, 9)
    aborted = _request(stage, m, "a", 9, {"do_remote_decode": True})
    connector.get_num_new_matched_tokens(aborted, 0)
    assert connector.request_finished(aborted, [1, 2, 5]) == (False, None)  # no reason: aborted
    assert _messages(connector) == [("failed", "a", ())]
    assert "a" not in connector.side.records
    one_token = _request(stage, m, "o", 1, {"do_remote_decode": True})
    connector.get_num_new_matched_tokens(one_token, 0)
    one_token.finish_reason = "length"
    delay, params = connector.request_finished(one_token, [6])
    assert not delay and params["remote_block_ids"] == []  # decode computes its one token
    plain = _request(stage, m, "p", 9)
    connector.get_num_new_matched_tokens(plain, 0)
    plain.finish_reason = "length"
    assert connector.request_finished(plain, [8, 10, 11]) == (False, None)
    assert set(connector.side.records) == {"r"}


def _remote(rid: str, blocks: list[int]) -> dict:
    return {"do_remote_prefill": True, "remote_request_id": rid, "remote_block_ids": blocks}


def test_decode_receives_after_the_local_hit_from_the_same_positions(stage):
    m, connector = _connector(stage, "decode")
    request = _request(stage, m, "r", 13, _remote("r", [20, 21, 22]))
    request.num_computed_tokens = BLOCK  # its first block is a local prefix hit
    assert connector.get_num_new_matched_tokens(request, BLOCK) == (12 - BLOCK, True)
    connector.update_state_after_alloc(request, [5, 6, 7, 8], 12 - BLOCK)
    metadata = connector.build_connector_meta(None)
    assert metadata.recvs == (("r", (6, 7)),)
    assert _messages(connector) == [("pull", "r", (21, 22))]
    full = _request(stage, m, "f", 13, _remote("f", [30, 31, 32]))
    assert connector.get_num_new_matched_tokens(full, 12) == (0, False)  # all cached here
    assert _messages(connector) == [("done", "f", ())]  # the prefill side frees now
    assert "f" not in connector.side.records


def test_decode_abort_mid_receive_keeps_the_blocks_until_the_drain(stage):
    m, connector = _connector(stage, "decode")
    request = _request(stage, m, "r", 9, _remote("r", [20, 21]))
    assert connector.get_num_new_matched_tokens(request, 0) == (8, True)
    connector.update_state_after_alloc(request, [5, 6, 7], 8)
    assert connector.build_connector_meta(None).recvs == (("r", (5, 6)),)
    assert connector.request_finished(request, [5, 6, 7]) == (True, None)
    assert [kind for kind, _, _ in _messages(connector)] == ["pull", "abort"]
    assert connector.build_connector_meta(None).cancels == ("r",)
    update = connector.update_connector_output(m.KVConnectorOutput())
    assert not update.sent, "freed before the transport drained"
    drained = m.KVConnectorOutput(finished_recving=frozenset({"r"}), failed=frozenset({"r"}))
    update = connector.update_connector_output(drained)
    assert update.sent == ("r",) and not update.load_failed and not update.failed
    assert not connector.side.records
    queued = _request(stage, m, "q", 9, _remote("q", [23, 24]))
    connector.get_num_new_matched_tokens(queued, 0)
    connector.update_state_after_alloc(queued, [9, 10, 11], 8)
    assert connector.request_finished(queued, [9, 10, 11]) == (False, None)  # never started
    assert connector.build_connector_meta(None) is None


def test_prefill_request_that_failed_or_was_aborted_holds_nothing_and_tells_decode(stage):
    """Only a request that finished with its KV computed ("stop", "length") has anything to
    send. One that failed ("error": its KV may be half written) or was aborted (with or
    without a reason yet) holds no block, hands back no parameters (the proxy would send a
    decode request pointing at blocks about to be reused) and tells the decode side."""
    m, connector = _connector(stage, "prefill")
    for rid, reason in (("e", "error"), ("a", "abort"), ("n", None)):
        request = _request(stage, m, rid, 13, {"do_remote_decode": True})
        connector.get_num_new_matched_tokens(request, 0)
        request.finish_reason = reason
        assert connector.request_finished(request, [7, 3, 9, 4]) == (False, None), reason
        assert _messages(connector) == [("failed", rid, ())], reason
        assert rid not in connector.side.records, reason
    connector.build_connector_meta(None)
    assert not connector.update_connector_output(m.KVConnectorOutput()).sent
    assert not connector.has_pending()


def test_decode_abort_after_a_receive_timed_out_keeps_the_blocks_until_the_drain(stage):
    """A receive that timed out is FAILED but still in the transport's hands until it drains
    (its cancel is only queued). If the request is aborted then, whether its blocks may go is
    decided by what is still in flight, not by the state: freeing now hands blocks a transfer
    still writes to the next request (SGLang PR #32564, by the timeout path)."""
    m = _m(stage)
    now = [0.0]
    config = m.TransferConfig(transfer_timeout_seconds=4.0)
    kv = m.KVCacheManager(32, BLOCK, True)
    connector = m.DecodeConnector(m.DecodeTransfers(config), kv, clock=lambda: now[0])
    request = _request(stage, m, "r", 9, _remote("r", [20, 21]))
    assert connector.get_num_new_matched_tokens(request, 0) == (8, True)
    connector.update_state_after_alloc(request, [5, 6, 7], 8)
    assert connector.build_connector_meta(None).recvs == (("r", (5, 6)),)
    now[0] = 5.0  # past the deadline: the receive fails, its cancel goes to the workers
    assert connector.build_connector_meta(None).cancels == ("r",)
    assert connector.side.poll("r") is m.KVPoll.FAILED
    assert connector.request_finished(request, [5, 6, 7]) == (True, None), "freed mid-write"
    assert not connector.update_connector_output(m.KVConnectorOutput()).sent
    drained = m.KVConnectorOutput(finished_recving=frozenset({"r"}), failed=frozenset({"r"}))
    update = connector.update_connector_output(drained)
    assert update.sent == ("r",), "the blocks must go back once the transport drained"
    assert not update.load_failed and not update.failed and not update.loaded  # it is gone
    assert [kind for kind, _, _ in _messages(connector)] == ["pull", "abort"]  # told once
    assert not connector.side.records and not connector.has_pending()
    received = _request(stage, m, "d", 9, _remote("d", [22, 23]))  # drained, not yet aborted
    connector.get_num_new_matched_tokens(received, 0)
    connector.update_state_after_alloc(received, [8, 9, 10], 8)
    connector.build_connector_meta(None)
    done = m.KVConnectorOutput(finished_recving=frozenset({"d"}))
    assert connector.update_connector_output(done).loaded == ("d",)
    assert connector.request_finished(received, [8, 9, 10]) == (False, None)  # its own now
