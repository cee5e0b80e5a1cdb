"""Stage 13 promises: disaggregating prefill and decode changes where a prompt's KV is computed,
never what any request produces, and a transfer that goes wrong costs that request alone.

In one process (a prefill and a decode engine over the in-process transport,
harness/disagg_pair.py and harness/fake_transport.py):
- The switches validate; `kv_role="both"` is stage 12 (no connector).
- Disaggregated outputs equal colocated ones, greedy and seeded, with the decode engine's
  teacher-forced logits; the decode engine computes one prompt token per request (the rest
  arrived by transfer); both block pools are full again after every scenario.
- A failed transfer computes that request's prompt on the decode engine, or fails it
  (`kv_transfer_on_failure`); the others load as usual.
- Named regressions: vLLM #21570 (a lease never frees blocks a send still reads), SGLang PR
  #32564 (a decode abort mid-transfer frees only after the drain, nothing written), vLLM PR
  #41269 (a decode rejection frees the prefill's blocks at once), vLLM #46283 and SGLang #11648
  (a decode that never hears back times out and computes locally), vLLM PR #56640 (a full
  prefix hit on decode completes and frees the prefill's blocks), and a lease that expires on
  a prefill nobody pulls.
- A randomized run (aborts in either phase, refused transfers, decode-side prefix hits) leaks
  nothing and every request it did not abort answers as one engine does.

The multi-process tests (engine cores over gloo behind the front end) are in
test_13_disagg_processes.py.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject, unit

pytestmark = [
    since("13"),
    subject(
        "disagg/connector.py",
        "disagg/transfer_worker.py",
        "disagg/transfer_sides.py",
        "harness/disagg_pair.py",
    ),
]

BLOCK = 4
PROMPTS = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _greedy(stage, n=12):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _seeded(stage, i, n=12):
    return stage.SamplingParams(max_tokens=n, temperature=0.9, seed=i, ignore_eos=True)


@pytest.fixture
def path(tiny_model):
    return tiny_model("llama-gqa")


@pytest.fixture
def roomy(stage, make_llm, path):
    return make_llm(stage, path, block_size=BLOCK)


def _pair(stage, make_llm, path, name, decode_config=None, **config):
    """A prefill and a decode engine over the in-process transport `in-process://<stage>-<name>`
    (cached per module, like every engine of the suite)."""
    fake = _module(stage, "harness.fake_transport")
    address = f"{fake.ADDRESS}{stage.STAGE}-{name}"
    with fake.in_process_transports():
        prefill = make_llm(
            stage, path, block_size=BLOCK, kv_role="prefill", kv_transfer_address=address, **config
        )
        decode = make_llm(
            stage, path, block_size=BLOCK, kv_role="decode", kv_transfer_address=address,
            **{**config, **(decode_config or {})},
        )  # fmt: skip
    return _module(stage, "harness.disagg_pair").DisaggregatedPair(prefill, decode)


def _no_leaks(pair) -> None:
    pair.prefill.check_no_leaks()
    pair.decode.check_no_leaks()


@contextlib.contextmanager
def _clock(*engines) -> Iterator[list[float]]:
    """Let a test move the engines' transfer clocks: `offset[0] += seconds`."""
    offset = [0.0]
    for engine in engines:
        engine.kv_connector.clock = lambda: time.monotonic() + offset[0]
    try:
        yield offset
    finally:
        for engine in engines:
            engine.kv_connector.clock = time.monotonic


def _bounded(limit=400):
    """An on_step hook that stops a run that would otherwise spin for a deadline."""
    steps = [0]

    def count(_pair) -> None:
        steps[0] += 1
        assert steps[0] < limit, "the pair did not finish within the steps it needs"

    return count


def _decode_prompt_tokens(pair) -> list[int]:
    """Spy on the decode engine's schedules: the prompt tokens each step computes there."""
    computed: list[int] = []
    scheduler = pair.decode.scheduler
    schedule = scheduler.schedule

    def spy():
        output = schedule()
        for r in output.requests:
            prompt = len(scheduler.requests[r.request_id].prompt_token_ids)
            computed.append(max(0, min(prompt, r.num_computed_tokens + r.num_new_tokens)
                                - r.num_computed_tokens))  # fmt: skip
        return output

    scheduler.schedule = spy
    return computed


def test_switches_validate_and_both_means_stage_12(stage, path, roomy):
    config = stage.EngineConfig
    with pytest.raises(ValueError, match="kv_transfer_address"):
        config(kv_role="decode")
    with pytest.raises(ValueError, match="kv_role"):
        config(kv_role="relay")
    with pytest.raises(ValueError, match="one rank"):
        config(kv_role="prefill", kv_transfer_address="tcp://127.0.0.1:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="two connectors"):
        config(kv_role="prefill", kv_transfer_address="tcp://127.0.0.1:1", kv_offload_bytes=2**20)
    with pytest.raises(ValueError, match="kv_transfer_on_failure"):
        config(kv_transfer_on_failure="retry")
    with pytest.raises(ValueError, match="host memory"):
        config(kv_role="decode", kv_transfer_address="tcp://127.0.0.1:1", device="mps")
    with pytest.raises(ValueError, match="DisaggClient"):
        stage.LLM(str(path), disaggregated=True)
    assert roomy.kv_connector is None and roomy.runner.kv_connector is None
    request = roomy.make_request(PROMPTS[0], _greedy(stage, 2))
    request.kv_transfer_params = {"do_remote_decode": True}  # no connector: a plain request
    output = roomy.run(request)
    assert output.kv_transfer_params is None and len(output.token_ids) == 2


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_disaggregated_outputs_equal_colocated(stage, make_llm, path, roomy, sampling):
    """Every token and every logit of the decode engine's run equal one engine's, while the
    decode engine computes one prompt token per request: the rest came by transfer."""
    pair = _pair(stage, make_llm, path, "main")
    params = (
        [_greedy(stage)] * len(PROMPTS)
        if sampling == "greedy"
        else [_seeded(stage, i) for i in range(len(PROMPTS))]
    )
    loaded = pair.decode.kv_connector.stats.tokens_loaded
    computed = _decode_prompt_tokens(pair)
    try:
        with step_logits(pair.decode) as recorded:
            outputs = pair.generate(PROMPTS, params, on_step=_bounded())
    finally:
        del pair.decode.scheduler.schedule
    assert_logits_match_teacher_forcing(pair.decode, outputs, recorded)
    expected = roomy.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert sum(computed) == len(PROMPTS), "the decode engine computed more than the last tokens"
    assert pair.decode.kv_connector.stats.tokens_loaded > loaded
    assert all(p and p["do_remote_prefill"] for p in pair.handed_over.values())
    _no_leaks(pair)


def test_regression_pr56640_a_full_prefix_hit_on_decode_completes_and_frees_prefill(
    stage, make_llm, path, roomy
):
    """vLLM PR #56640: a request whose whole prompt (but the last token) the decode engine
    already caches had nothing to receive, and was never reported finished: the prefill side
    held its blocks until the lease ran out. Here it runs at once and the prefill side frees
    on decode's "done"."""
    pair = _pair(stage, make_llm, path, "hit")
    prompt = list(range(100, 100 + 4 * BLOCK + 1))  # its first 16 tokens: four full blocks
    first = pair.generate([prompt], _greedy(stage, 4), on_step=_bounded())
    loaded = pair.decode.kv_connector.stats.tokens_loaded
    with _clock(pair.prefill) as offset:  # the lease cannot run out: only "done" can free
        offset[0] = -1e6
        again = pair.generate([prompt], _greedy(stage, 4), on_step=_bounded())
    assert pair.decode.kv_connector.stats.tokens_loaded == loaded, "nothing was to be moved"
    assert again[0].num_cached_tokens == 4 * BLOCK
    assert (
        again[0].token_ids
        == first[0].token_ids
        == roomy.generate([prompt], _greedy(stage, 4))[0].token_ids
    )
    _no_leaks(pair)


def _refuse_third(pair) -> list[str]:
    """Make the prefill engine's third send a refusal (no blocks): that receive fails. Returns
    the request ids it sent, in order (the victim is the third)."""
    transport = pair.prefill.runner.kv_connector.transport
    send, seen = transport.start_send, []

    def start_send(rid, pool, ids):
        seen.append(rid)
        return send(rid, pool, () if len(seen) == 3 else ids)

    transport.start_send = start_send
    return seen


@pytest.mark.parametrize("on_failure", ["local_prefill", "fail"])
def test_a_failed_transfer_costs_that_request_only(stage, make_llm, path, roomy, on_failure):
    """One request's transfer fails: with local_prefill it computes its prompt on the decode
    engine (its tokens and logits still a colocated run's); with fail it ends with the error.
    The other requests load as usual."""
    pair = _pair(stage, make_llm, path, on_failure, kv_transfer_on_failure=on_failure)
    greedy = [_greedy(stage)] * len(PROMPTS)
    sent = _refuse_third(pair)
    failures = pair.decode.kv_connector.stats.load_failures
    try:
        with step_logits(pair.decode) as recorded:
            outputs = pair.generate(PROMPTS, greedy, on_step=_bounded())
    finally:
        del pair.prefill.runner.kv_connector.transport.start_send
    victim = sent[2]
    expected = [o.token_ids for o in roomy.generate(PROMPTS, greedy)]
    assert pair.decode.kv_connector.stats.load_failures == failures + 1
    by_id = {o.request_id: o for o in outputs}
    assert victim in by_id, sorted(by_id)
    if on_failure == "local_prefill":
        assert_logits_match_teacher_forcing(pair.decode, outputs, recorded)
        assert [o.token_ids for o in outputs] == expected
    else:
        assert by_id[victim].finish_reason == "error"
        assert "KV transfer failed" in by_id[victim].error
        others = [(o.token_ids, e) for o, e in zip(outputs, expected, strict=True)]
        assert all(o == e for o, e in others if o)  # the victim produced nothing
    _no_leaks(pair)


@contextlib.contextmanager
def _over_gloo(stage, pair, timeout_seconds: float) -> Iterator[tuple]:
    """Swap a gloo pair of this process (harness/transfer_peer.local_gloo_pair) in for the pair's
    in-process transport for the body, then put the cached engines' own back."""
    peer = _module(stage, "harness.transfer_peer")
    workers = (pair.prefill.runner.kv_connector, pair.decode.runner.kv_connector)
    own = [worker.transport for worker in workers]
    ends = peer.local_gloo_pair(timeout_seconds)
    for worker, end in zip(workers, ends, strict=True):
        worker.transport = end
    try:
        yield ends
    finally:
        for worker, end, transport in zip(workers, ends, own, strict=True):
            end.close()
            worker.transport = transport


def test_one_failed_gloo_transfer_computes_that_prompt_locally_and_the_next_loads(
    stage, make_llm, path, roomy
):
    """Over a real gloo pair: the first request's transfer fails (its sender sends one block
    where the receiver expects all: a header that disagrees). That request is computed on the
    decode engine (one fallback); the pair is not broken: the next request's transfer loads, and
    the decode engine computes only its last prompt token."""
    pair = _pair(stage, make_llm, path, "gloo")
    prompts = PROMPTS[:2]
    failures = pair.decode.kv_connector.stats.load_failures
    computed = _decode_prompt_tokens(pair)
    try:
        with _over_gloo(stage, pair, timeout_seconds=20.0) as (sending_end, receiving_end):
            send, sent = sending_end.start_send, []

            def garble_first(rid, pool, ids):
                sent.append(rid)
                return send(rid, pool, ids[:1] if len(sent) == 1 else ids)

            sending_end.start_send = garble_first
            outputs = pair.generate(prompts, _greedy(stage), on_step=_bounded(4000))
            assert receiving_end.failures == 1, receiving_end.last_error
    finally:
        del pair.decode.scheduler.schedule
    assert pair.decode.kv_connector.stats.load_failures == failures + 1
    assert len(sent) == 2
    victim = next(o for o in outputs if o.request_id == sent[0])  # computed whole, locally
    assert sum(computed) == len(victim.prompt_token_ids) + 1, computed  # + the other's last
    expected = roomy.generate(prompts, _greedy(stage))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    _no_leaks(pair)


def _start_one(stage, pair, prompt):
    """Submit one request to the pair by hand."""
    request = pair.prefill.make_request(prompt, _greedy(stage), output_kind="final")
    pair.add(request)
    return request


def _step_until(pair, done, limit=300):
    for _ in range(limit):
        if done():
            return
        pair.step()
    raise AssertionError("the condition never came true")


def test_regression_pr32564_a_decode_abort_mid_transfer_frees_only_after_the_drain(
    stage, make_llm, path
):
    """SGLang PR #32564: decode freed a request's pages while a transfer still wrote them, and
    another request read that KV. Here an abort mid-receive keeps the blocks (delay_free) until
    the transport drained, and the late bytes are never written."""
    pair = _pair(stage, make_llm, path, "abort")
    receiving_end = pair.decode.runner.kv_connector.transport
    receiving_end.mode = "hold"  # the receive is posted, and stays open
    try:
        request = _start_one(stage, pair, PROMPTS[1])
        rid = request.request_id
        _step_until(pair, lambda: pair.decode.runner.kv_connector.in_flight())
        blocks = list(pair.decode.kv_connector.side.records[rid].block_ids)
        before = pair.decode.kv_cache.k[:, blocks].clone()
        pair.decode.abort_request(rid)
        for _ in range(3):
            pair.step()
        assert rid in pair.decode.scheduler._held, "freed while the receive may still write"
        assert set(blocks) <= set(pair.decode.scheduler._held[rid])
        receiving_end.release()  # the bytes arrive after the cancel
        _step_until(pair, lambda: not pair.busy())
        assert pair.decode.kv_cache.k[:, blocks].equal(before), "a cancelled receive wrote"
    finally:
        receiving_end.mode = "ok"
        receiving_end.release(ok=False)
    _no_leaks(pair)


def test_regression_21570_the_lease_never_frees_blocks_a_send_still_reads(
    stage, make_llm, path, roomy
):
    """vLLM #21570: the prefill side freed a request's blocks when its lease ran out while the
    decode side was still reading them. Here the lease is checked only while no send runs: a
    send held past the lease keeps its blocks, completes, and the answer is right."""
    pair = _pair(stage, make_llm, path, "lease", kv_lease_seconds=5.0)
    sending_end = pair.prefill.runner.kv_connector.transport
    sending_end.mode = "hold"
    try:
        with _clock(pair.prefill) as offset:
            request = _start_one(stage, pair, PROMPTS[2])
            rid = request.request_id
            _step_until(pair, lambda: pair.prefill.runner.kv_connector.in_flight())
            offset[0] = 6.0  # past the lease, well inside the transfer's deadline
            for _ in range(3):
                pair.step()
            assert rid in pair.prefill.scheduler._held, "the lease freed blocks a send reads"
            sending_end.release()
            _step_until(pair, lambda: request.finished and not pair.busy())
    finally:
        sending_end.mode = "ok"
        sending_end.release(ok=False)
    assert request.output_token_ids == roomy.generate([PROMPTS[2]], _greedy(stage))[0].token_ids
    _no_leaks(pair)


def test_regression_pr41269_a_decode_rejection_frees_the_prefill_blocks_at_once(
    stage, make_llm, path, roomy
):
    """vLLM PR #41269: when decode rejected a request before admission, the prefill side kept
    its blocks until the lease ran out. Here decode says "reject" and the prefill side frees at
    once (its lease cannot run out in this test); the request fails with the reason."""
    per_block = 2 * roomy.kv_cache.k[:, 0].numel() * roomy.kv_cache.k.element_size()
    pair = _pair(stage, make_llm, path, "reject", decode_config={"kv_cache_bytes": 8 * per_block})
    prompts = [list(range(20, 60)), list(range(20, 40))]  # 40 + 4 tokens never fit 8 blocks
    with _clock(pair.prefill) as offset:
        offset[0] = -1e6
        outputs = pair.generate(prompts, _greedy(stage, 4), on_step=_bounded())
    assert outputs[0].finish_reason == "error" and "rejected" in outputs[0].error
    assert outputs[1].token_ids == roomy.generate(prompts[1:], _greedy(stage, 4))[0].token_ids
    _no_leaks(pair)


def test_regression_46283_a_decode_that_never_hears_back_times_out_and_computes_locally(
    stage, make_llm, path, roomy
):
    """vLLM #46283 (and SGLang #11648, a lost "done"): decode waited for a prefill that never
    signalled, and leaked the request's blocks. Here decode's messages are lost: its receive
    times out (transfer deadline), drains, and the prompt is computed locally; the prefill's
    blocks, never pulled, go back when its lease runs out."""
    pair = _pair(stage, make_llm, path, "silent")
    pair.prefill.deliver_peer_messages = lambda messages: None  # every pull and "done" lost
    failures = pair.decode.kv_connector.stats.load_failures
    steps = [0]
    try:
        with _clock(pair.prefill, pair.decode) as offset:

            def later(_pair) -> None:
                steps[0] += 1
                assert steps[0] < 400
                if steps[0] == 20:  # the receives are posted and waiting
                    assert pair.decode.scheduler.loading
                    offset[0] = 31.0  # past the transfer deadline and the lease

            outputs = pair.generate(PROMPTS[:3], _greedy(stage), on_step=later)
    finally:
        del pair.prefill.deliver_peer_messages
    assert pair.decode.kv_connector.stats.load_failures == failures + 3
    expected = roomy.generate(PROMPTS[:3], _greedy(stage))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    _no_leaks(pair)


def test_randomized_run_with_aborts_and_failed_transfers_leaks_nothing(
    stage, make_llm, path, roomy
):
    """Random prompts (some sharing prefixes, so decode-side hits), random aborts in either
    phase, random refused transfers: every request that was not aborted produces a colocated
    run's tokens, and both pools are full again at the end."""
    pair = _pair(stage, make_llm, path, "random")
    rng = random.Random(0)
    shared = list(range(60, 80))
    prompts = [
        [
            *shared[: rng.choice([0, 8, 17])],
            *(rng.randrange(100, 250) for _ in range(rng.randrange(1, 14))),
        ]
        for _ in range(14)
    ]
    params = [_greedy(stage, rng.randrange(2, 12)) for _ in prompts]
    requests = [
        pair.prefill.make_request(p, sp, output_kind="final")
        for p, sp in zip(prompts, params, strict=True)
    ]
    transport = pair.prefill.runner.kv_connector.transport
    send = transport.start_send
    transport.start_send = lambda rid, pool, ids: send(rid, pool, () if rng.random() < 0.2 else ids)
    aborted = set()
    try:
        for request in requests[:8]:
            pair.add(request)
        for steps in range(3000):
            if steps == 10:
                for request in requests[8:]:
                    pair.add(request)
            live = [r for r in requests[: 8 if steps < 10 else 14] if not r.finished]
            if live and rng.random() < 0.06:
                victim = rng.choice(live).request_id
                pair.abort(victim)
                aborted.add(victim)
            pair.step()
            if steps > 10 and all(r.finished for r in requests) and not pair.busy():
                break
        else:
            raise AssertionError("the run never ended")
    finally:
        del transport.start_send
    assert 0 < len(aborted) < len(requests)
    _no_leaks(pair)
    kept = [i for i, r in enumerate(requests) if r.request_id not in aborted]
    expected = roomy.generate([prompts[i] for i in kept], [params[i] for i in kept])
    assert [requests[i].output_token_ids for i in kept] == [o.token_ids for o in expected]


@unit("parallel/placement.py")
@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        (2, [(["cuda:0"], 1), (["cuda:1"], 1)]),  # one GPU each
        (3, [(["cuda:0"], 1), (["cuda:1"], 1)]),
        (1, [(["cuda:0"], 2), (["cuda:0"], 2)]),  # both share it, and split its KV budget
    ],
)
def test_the_pair_takes_a_gpu_each_or_shares_one(stage, monkeypatch, gpus, expected):
    """Prefill and decode cores are separate engines (no NCCL group between them): with two
    GPUs they take one each, with one they share it, each told how many ranks share it."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = stage.EngineConfig(device="cuda", disaggregated=True, distributed_backend="nccl")
    assert stage.parallel.placement.pair_devices(config, num_gpus=gpus) == expected


@unit("parallel/placement.py")
def test_a_cpu_pair_runs_both_cores_on_the_host(stage):
    config = stage.EngineConfig(device="cpu", disaggregated=True)
    assert stage.parallel.placement.pair_devices(config, num_gpus=0) == [(["cpu"], None)] * 2


def test_a_disaggregated_pair_with_a_host_tier_is_refused_in_the_callers_process(stage):
    """A disaggregated pair's engines hold a transfer connector; a host tier is a second one.
    The config refuses it at once, not a child process seconds later with its traceback."""
    with pytest.raises(ValueError, match=r"disaggregated.*kv_offload_bytes"):
        stage.EngineConfig(disaggregated=True, kv_offload_bytes=2**20)
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        stage.EngineConfig(disaggregated=True, kv_offload_bytes=2**20, preemption_mode="swap")
    with pytest.raises(ValueError, match="host tier"):  # swap alone: nothing to swap to
        stage.EngineConfig(disaggregated=True, preemption_mode="swap")


def test_transferred_kv_is_no_prefix_cache_hit(stage, make_llm, path):
    """Issue 27: a fresh prompt's KV, computed on the prefill engine and sent, is not a cache
    hit on the decode engine: the request reports the hits it had (none), the decode engine's
    prefix-cache counters count its own only, and the connector counts what it received."""
    pair = _pair(stage, make_llm, path, "main")
    decode_stats = pair.decode.kv_manager.stats
    hits, queried = decode_stats.hit_tokens, decode_stats.queried_tokens
    connector = pair.decode.kv_connector.stats
    loaded, blocks = connector.tokens_loaded, connector.blocks_loaded
    # 5 blocks and 1 token: the 5 * BLOCK tokens before the last fill exactly 5 blocks, the
    # prompt's table has 6 (no other test of the module sends this prompt)
    prompt = list(range(150, 150 + 5 * BLOCK + 1))
    (output,) = pair.generate([prompt], _greedy(stage, 3), on_step=_bounded())
    assert output.num_cached_tokens == 0, "transferred KV reported as cached tokens"
    assert decode_stats.hit_tokens == hits, "transferred KV counted as a prefix-cache hit"
    assert decode_stats.queried_tokens == queried + len(prompt)
    assert connector.tokens_loaded == loaded + len(prompt) - 1, "the last token is computed here"
    assert connector.blocks_loaded == blocks + 5, "only the blocks the transfer writes count"
    _no_leaks(pair)
