"""Stage 13's transfer state machine (transfer_state.py, transfer_sides.py), without engines:
its order, its checked moves, and one named test per failure that shipped in vLLM or SGLang
(the issue or PR number is in the test's name). Both sides and both pools run in one process
(tests/transfer_sim.py); every scenario ends with both block pools full and no record left."""

from __future__ import annotations

import importlib
import random
from types import ModuleType, SimpleNamespace

import pytest

from .conftest import since, unit
from .transfer_sim import Cluster

pytestmark = [since("13"), unit("disagg/transfer_sides.py")]

TIMES = SimpleNamespace(
    lease_seconds=5.0,
    bootstrap_timeout_seconds=2.0,
    waiting_timeout_seconds=3.0,
    transfer_timeout_seconds=4.0,
)


def _state(stage: ModuleType) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.disagg.transfer_state")


def _config(stage: ModuleType, **changes: object) -> object:
    return _state(stage).TransferConfig(**{**vars(TIMES), **changes})


def ready_to_send(cluster: Cluster, rid: str = "r", blocks: int = 3) -> None:
    cluster.arrive(rid)
    cluster.bootstrap(rid)
    cluster.prefill_done(rid, blocks)
    cluster.decode_allocate(rid, blocks, external_tokens=16 * blocks - 1)


def test_states_are_ordered_as_sglang_and_min_is_the_combined_state(stage) -> None:
    st = _state(stage)
    assert list(st.KVPoll) == sorted(st.KVPoll)
    assert st.KVPoll.FAILED < st.KVPoll.BOOTSTRAPPING < st.KVPoll.WAITING_FOR_INPUT
    assert st.KVPoll.WAITING_FOR_INPUT < st.KVPoll.TRANSFERRING < st.KVPoll.SUCCESS
    assert st.combined_poll([st.KVPoll.SUCCESS, st.KVPoll.TRANSFERRING]) is st.KVPoll.TRANSFERRING
    assert (
        st.combined_poll([st.KVPoll.SUCCESS, st.KVPoll.FAILED, st.KVPoll.SUCCESS])
        is st.KVPoll.FAILED
    )
    assert not st.ALLOWED[st.KVPoll.SUCCESS] and not st.ALLOWED[st.KVPoll.FAILED]
    for state, targets in st.ALLOWED.items():  # only forward, or to FAILED
        assert all(t > state or t is st.KVPoll.FAILED for t in targets)


def test_illegal_transitions_raise(stage) -> None:
    st = _state(stage)
    decode = importlib.import_module(f"{stage.__name__}.disagg.transfer_sides").DecodeTransfers(
        _config(stage)
    )
    decode.add("r", 0.0)
    with pytest.raises(AssertionError):  # receive before any block is allocated
        decode.start_recv("r", 0.0)
    decode.bootstrapped("r", 0.0)
    with pytest.raises(st.IllegalTransition):
        decode.bootstrapped("r", 0.0)
    with pytest.raises(ValueError):
        decode.add("r", 0.0)
    with pytest.raises(st.IllegalTransition):  # a drain with nothing in flight
        decode.recv_finished("r", True, 0.0)


def test_config_refuses_nonsense(stage) -> None:
    st = _state(stage)
    with pytest.raises(ValueError):
        st.TransferConfig(lease_seconds=0)
    with pytest.raises(ValueError):
        st.TransferConfig(on_failure="retry")  # type: ignore[arg-type]


def test_happy_path_loads_then_both_pools_are_full(stage) -> None:
    st = _state(stage)
    cluster = Cluster(stage, _config(stage))
    ready_to_send(cluster)
    assert cluster.prefill.poll("r") is st.KVPoll.WAITING_FOR_INPUT
    cluster.start_transfer("r")
    assert st.combined_poll([cluster.prefill.poll("r"), cluster.decode.poll("r")]) is (
        st.KVPoll.TRANSFERRING
    )
    cluster.send_drained("r", ok=True)
    cluster.recv_drained("r", ok=True)
    cluster.settle()
    assert cluster.outcome == {"r": "loaded"}
    cluster.finish_request("r")
    cluster.assert_clean()


def test_prefill_lease_expiry_frees_blocks_decode_never_took(stage) -> None:
    st = _state(stage)
    cluster = Cluster(stage, _config(stage))
    cluster.arrive("r")
    cluster.bootstrap("r")
    cluster.prefill_done("r", 4)
    cluster.decode.abort("r", cluster.now)  # decode forgets it, and the "abort" is lost
    cluster.decode.drain()
    cluster.tick(TIMES.lease_seconds - 1)
    assert cluster.prefill.poll("r") is st.KVPoll.WAITING_FOR_INPUT
    cluster.tick(2)
    assert "r" not in cluster.prefill.records
    cluster.assert_clean()


def test_vllm_21570_lease_never_expires_while_a_send_reads_the_blocks(stage) -> None:
    cluster = Cluster(stage, _config(stage, transfer_timeout_seconds=60.0))
    ready_to_send(cluster)
    cluster.start_transfer("r")
    cluster.tick(TIMES.lease_seconds + 1)  # past the lease: the read must keep its blocks
    assert cluster.prefill.records["r"].block_ids
    assert cluster.prefill_pool.free_ids.isdisjoint(cluster.reading["r"])
    cluster.send_drained("r", ok=True)
    cluster.recv_drained("r", ok=True)
    cluster.settle()
    cluster.finish_request("r")
    cluster.assert_clean()


def test_sglang_pr32564_decode_abort_mid_transfer_frees_only_after_the_drain(stage) -> None:
    st = _state(stage)
    cluster = Cluster(stage, _config(stage))
    ready_to_send(cluster)
    cluster.start_transfer("r")
    cluster.decode.abort("r", cluster.now)
    cluster.settle()  # the _apply check fails if the blocks being written were freed here
    assert cluster.decode.poll("r") is st.KVPoll.FAILED
    assert cluster.cancelled == {"r"}
    assert cluster.decode_pool.free_ids.isdisjoint(cluster.writing["r"])
    cluster.drain_cancelled()
    cluster.assert_clean()


def test_vllm_pr41269_decode_rejects_before_admission_and_prefill_frees_at_once(stage) -> None:
    cluster = Cluster(stage, _config(stage))
    cluster.arrive("r")
    cluster.bootstrap("r")
    cluster.prefill_done("r", 5)
    cluster.decode.reject("r", cluster.now, "prompt longer than the decode pool")
    cluster.settle()  # no time passes: the lease is not what frees the prefill blocks
    assert cluster.outcome == {"r": "failed"}
    cluster.assert_clean()


def test_vllm_46283_decode_that_never_hears_from_prefill_frees_after_timeout(stage) -> None:
    cluster = Cluster(stage, _config(stage), lose_messages=True)
    cluster.arrive("r")
    cluster.bootstrap("r")
    cluster.decode_allocate("r", 3, external_tokens=47)
    cluster.prefill.records.pop("r")  # the prefill engine lost the request entirely
    cluster.tick(TIMES.waiting_timeout_seconds - 0.5)
    assert not cluster.decode_pool.full
    cluster.tick(1.0)
    assert cluster.outcome == {"r": "local_prefill"}
    cluster.assert_clean()


def test_vllm_pr56640_full_prefix_hit_on_decode_completes_and_frees_prefill(stage) -> None:
    cluster = Cluster(stage, _config(stage))
    cluster.arrive("r")
    cluster.bootstrap("r")
    cluster.prefill_done("r", 2)
    cluster.decode_allocate("r", 2, external_tokens=0)  # every prompt token cached on decode
    cluster.settle()
    assert cluster.outcome == {"r": "loaded"}
    assert "r" not in cluster.prefill.records  # freed by decode's "done", not by the lease
    cluster.finish_request("r")
    cluster.assert_clean()


def test_sglang_11648_lost_done_signal_times_out_into_failed(stage) -> None:
    st = _state(stage)
    cluster = Cluster(stage, _config(stage), lose_messages=True)
    ready_to_send(cluster)
    cluster.start_transfer("r")
    cluster.send_drained("r", ok=True)  # prefill sent; decode's "done" never comes
    cluster.tick(TIMES.transfer_timeout_seconds + 0.5)
    assert cluster.decode.poll("r") is st.KVPoll.FAILED
    assert cluster.outcome == {"r": "local_prefill"}  # decided now: the request does not hang
    cluster.drain_cancelled()  # the transport stops writing, then the blocks go back
    cluster.assert_clean()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_sglang_10110_stuck_bootstrap_times_out_into_failed(stage, side: str) -> None:
    cluster = Cluster(stage, _config(stage), lose_messages=True)
    cluster.arrive("r")
    stuck = cluster.prefill if side == "prefill" else cluster.decode
    other = cluster.decode if side == "prefill" else cluster.prefill
    other.bootstrapped("r", cluster.now)
    cluster.tick(TIMES.bootstrap_timeout_seconds + 0.5)
    assert "r" not in stuck.records
    cluster.prefill_done("r", 2)  # a failed prefill record frees at once, else its lease runs
    cluster.tick(TIMES.lease_seconds + TIMES.waiting_timeout_seconds)
    assert cluster.outcome == {"r": "local_prefill"}
    cluster.assert_clean()


def test_prefill_abort_before_hold_tells_decode(stage) -> None:
    cluster = Cluster(stage, _config(stage))
    cluster.arrive("r")
    cluster.bootstrap("r")
    cluster.prefill.abort("r", cluster.now)
    cluster.settle()
    assert cluster.outcome == {"r": "local_prefill"}
    cluster.assert_clean()


@pytest.mark.parametrize("on_failure", ["local_prefill", "fail"])
def test_failed_transfer_falls_back_or_fails_as_configured(stage, on_failure: str) -> None:
    cluster = Cluster(stage, _config(stage, on_failure=on_failure))
    ready_to_send(cluster)
    cluster.start_transfer("r")
    cluster.send_drained("r", ok=False)
    cluster.recv_drained("r", ok=False)
    cluster.settle()
    assert cluster.outcome == {"r": "local_prefill" if on_failure == "local_prefill" else "failed"}
    cluster.assert_clean()


def test_late_message_about_a_forgotten_request_is_counted_not_raised(stage) -> None:
    st = _state(stage)
    cluster = Cluster(stage, _config(stage))
    cluster.prefill.on_peer_message(st.PeerMessage("done", "gone"), 0.0)
    cluster.decode.on_peer_message(st.PeerMessage("failed", "gone"), 0.0)
    assert cluster.prefill.late_messages == cluster.decode.late_messages == 1


@pytest.mark.parametrize("seed", range(40))
def test_random_event_orders_never_hang_and_leak_nothing(stage, seed: int) -> None:
    """Random requests, random event order, lost messages, failing and hung transfers. Oracle:
    each request gets at most one outcome, no block is freed while the transport holds it
    (checked on every free), and after the deadlines pass everything is back."""
    st, rng = _state(stage), random.Random(seed)
    cluster = Cluster(stage, _config(stage), lose_messages=rng.random() < 0.3)
    rids = [f"r{i}" for i in range(8)]
    steps = {rid: 0 for rid in rids}
    for rid in rids:
        cluster.arrive(rid)
    for _ in range(60):
        rid = rng.choice(rids)
        _random_step(st, cluster, rid, steps, rng)
        cluster.settle()
        cluster.tick(rng.choice([0.0, 0.3, 1.0, 2.5]))
    for _ in range(20):  # no new events: the deadlines and the transport's own timeouts
        cluster.drain_cancelled()
        for rid in list(cluster.reading):
            cluster.send_drained(rid, ok=False)
        for rid in list(cluster.writing):
            cluster.recv_drained(rid, ok=False)
        cluster.tick(TIMES.lease_seconds)
    for rid in list(cluster.running):
        cluster.finish_request(rid)
    cluster.assert_clean()


def _random_step(
    st: ModuleType, cluster: Cluster, rid: str, steps: dict[str, int], rng: random.Random
) -> None:
    """Advance one request by one event, or disturb it (abort, reject, fail its transfer)."""
    decode = cluster.decode.records.get(rid)
    prefill = cluster.prefill.records.get(rid)
    roll = rng.random()
    if decode and roll < 0.05:
        cluster.decode.abort(rid, cluster.now)
    elif decode and decode.state is st.KVPoll.BOOTSTRAPPING and roll < 0.1:
        cluster.decode.reject(rid, cluster.now, "full")
    elif steps[rid] == 0 and decode and prefill:
        for side in (cluster.prefill, cluster.decode):
            if side.records[rid].state is st.KVPoll.BOOTSTRAPPING:
                side.bootstrapped(rid, cluster.now)
        steps[rid] = 1
    elif steps[rid] == 1:
        if prefill:
            cluster.prefill_done(rid, rng.randint(1, 4))
        if decode and decode.state is st.KVPoll.WAITING_FOR_INPUT:
            external = 0 if rng.random() < 0.15 else 40
            cluster.decode_allocate(rid, rng.randint(1, 4), external)
        steps[rid] = 2
    elif steps[rid] == 2 and prefill and decode and prefill.block_ids and decode.block_ids:
        if prefill.state is decode.state is st.KVPoll.WAITING_FOR_INPUT:
            cluster.start_transfer(rid)
        steps[rid] = 3
    elif steps[rid] == 3 and rid in cluster.reading and roll < 0.7:
        ok = rng.random() < 0.7
        cluster.send_drained(rid, ok)
        if rid in cluster.writing and rng.random() < 0.8:  # else: a hung receive
            cluster.recv_drained(rid, ok)


def _prefill(stage: ModuleType, **changes: object) -> object:
    sides = importlib.import_module(f"{stage.__name__}.disagg.transfer_sides")
    return sides.PrefillTransfers(_config(stage, **changes))


def test_prefill_times_out_a_send_that_never_ends_and_frees_only_when_it_drains(stage) -> None:
    """A send past `transfer_timeout_seconds` (from when it started, not from the hold) fails:
    the decode side is told, the send cancelled, and the blocks it reads go back only once the
    transport drains it. Without the deadline the record stays TRANSFERRING and its blocks held
    for as long as the transport never reports (an hour later, still held)."""
    st = _state(stage)
    prefill = _prefill(stage, lease_seconds=30.0, transfer_timeout_seconds=4.0)
    prefill.add("r", 0.0)
    prefill.bootstrapped("r", 0.0)
    assert prefill.hold("r", (7, 3, 9), 1.0)
    assert prefill.pull("r", (7, 3, 9), 3.0)  # the send starts at t=3
    prefill.drain()
    for now in (5.0, 6.5, 7.0):  # 4 s after the hold, and exactly 4 s after the start: not past
        prefill.poll_timeouts(now)
        assert prefill.poll("r") is st.KVPoll.TRANSFERRING, now
        assert prefill.drain() == st.Effects()
    prefill.poll_timeouts(7.5)
    assert prefill.poll("r") is st.KVPoll.FAILED
    assert prefill.drain() == st.Effects(
        cancel=("r",), to_peer=(st.PeerMessage("failed", "r"),)
    )  # nothing freed: the transport still reads the blocks
    prefill.poll_timeouts(3600.0)  # an hour later, the transport still has it: still held
    assert prefill.drain() == st.Effects() and prefill.records["r"].block_ids == (7, 3, 9)
    prefill.send_finished("r", False, 3601.0, "cancelled")
    effects = prefill.drain()
    assert effects.free == (("r", (7, 3, 9)),) and not effects.to_peer  # decode knows already
    assert [(rid, state) for rid, state, _ in effects.ended] == [("r", st.KVPoll.FAILED)]
    assert not prefill.records


def test_prefill_lease_expiry_tells_decode_and_frees_once_when_the_lease_ran_out(stage) -> None:
    """The lease runs from the hold (not from when the record last moved) and ends once
    `lease_seconds` are past: the held blocks are freed once and the decode side is told
    ("failed"), else a decode engine that pulls later waits for its own deadline on blocks that
    are gone. It holds in every state before the send, a record that never met its decode
    side (BOOTSTRAPPING) included."""
    st = _state(stage)
    for bootstrapped in (True, False):
        prefill = _prefill(stage, lease_seconds=5.0, bootstrap_timeout_seconds=60.0)
        prefill.add("r", 0.0)
        if bootstrapped:
            prefill.bootstrapped("r", 1.0)
        assert prefill.hold("r", (4, 5), 10.0)  # the lease: until t=15
        for now in (12.0, 14.0, 15.0):
            prefill.poll_timeouts(now)
            assert prefill.records["r"].block_ids == (4, 5), now
            assert prefill.drain() == st.Effects()
        prefill.poll_timeouts(15.5)
        effects = prefill.drain()
        assert effects.free == (("r", (4, 5)),) and not effects.cancel  # nothing in flight
        assert effects.to_peer == (st.PeerMessage("failed", "r"),)
        assert [(rid, state) for rid, state, _ in effects.ended] == [("r", st.KVPoll.FAILED)]
        assert not prefill.records
        prefill.poll_timeouts(100.0)
        assert prefill.drain() == st.Effects()  # freed once, told once
        assert not prefill.pull("r", (4, 5), 100.0)  # a late pull is refused
