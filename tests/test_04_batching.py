"""Stage 04 promises: the scheduler changes when requests run, never what they produce; limits
hold; preemption loses nothing; every concurrent HTTP request shares one engine loop."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject, until
from .test_03_paged import _bytes_per_block

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [since("04"), subject("scheduler.py")]

PROMPTS = [f"Request {i}: " + "tell me something " * (i % 4) for i in range(7)]


def _params(stage, i: int, **extra):
    return stage.SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True, **extra)


def _fields(stage) -> set[str]:
    return set(stage.EngineConfig.__dataclass_fields__)


def _solo(llm, stage, prompt, params):
    return llm.generate(prompt, params)[0].token_ids


def _all_blocks_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


def test_staggered_arrivals_match_solo_outputs(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    requests = [llm.make_request(p, _params(stage, i)) for i, p in enumerate(PROMPTS)]
    pending = list(requests)
    steps = 0
    with step_logits(llm) as recorded:
        while pending or llm.has_unfinished():
            if pending and steps % 3 == 0:  # a new request joins every third step
                llm.add_request(pending.pop(0))
            llm.step()
            steps += 1
    assert_logits_match_teacher_forcing(llm, [r.final_output() for r in requests], recorded)
    for i, request in enumerate(requests):
        assert request.output_token_ids == _solo(llm, stage, PROMPTS[i], _params(stage, i))
    assert _all_blocks_free(llm)


def test_requests_join_a_running_batch(stage, tiny_model, make_llm):
    """Continuous batching: a late request starts before the earlier ones finish."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    long = llm.make_request("first", stage.SamplingParams(max_tokens=40, ignore_eos=True))
    llm.add_request(long)
    for _ in range(5):
        llm.step()
    late = llm.make_request("second", stage.SamplingParams(max_tokens=3, ignore_eos=True))
    llm.add_request(late)
    while not late.finished:
        llm.step()
    assert not long.finished  # the late one overtook it
    while llm.has_unfinished():
        llm.step()


def test_static_scheduling_still_available_and_equal(stage, tiny_model, make_llm):
    path = tiny_model("llama-gqa")
    continuous = make_llm(stage, path)
    static = make_llm(stage, path, scheduling="static")
    params = [_params(stage, i) for i in range(len(PROMPTS))]
    assert [o.token_ids for o in static.generate(PROMPTS, params)] == [
        o.token_ids for o in continuous.generate(PROMPTS, params)
    ]


def test_tiny_pool_forces_preemption_without_changing_outputs(stage, tiny_model, make_llm):
    path = tiny_model("llama-odd-heads")
    roomy = make_llm(stage, path)
    per_block = _bytes_per_block(roomy, 4)
    tight = make_llm(stage, path, block_size=4, kv_cache_bytes=per_block * 24)
    params = [_params(stage, i) for i in range(len(PROMPTS))]
    before = tight.scheduler.num_preemptions
    with step_logits(tight) as recorded:
        tight_out = tight.generate(PROMPTS, params)
    assert tight.scheduler.num_preemptions > before, "the pool was meant to force preemption"
    assert_logits_match_teacher_forcing(tight, tight_out, recorded)
    assert [o.token_ids for o in tight_out] == [
        o.token_ids for o in roomy.generate(PROMPTS, params)
    ]
    assert _all_blocks_free(tight)


def test_preemption_keeps_seeded_sampling(stage, tiny_model, make_llm):
    path = tiny_model("llama-odd-heads")
    roomy = make_llm(stage, path)
    per_block = _bytes_per_block(roomy, 4)
    tight = make_llm(stage, path, block_size=4, kv_cache_bytes=per_block * 24)
    params = [
        stage.SamplingParams(max_tokens=30, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    before = tight.scheduler.num_preemptions
    a = [o.token_ids for o in tight.generate(PROMPTS, params)]
    assert tight.scheduler.num_preemptions > before
    assert a == [o.token_ids for o in roomy.generate(PROMPTS, params)]


def test_limits_are_respected(stage, tiny_model, make_llm):
    """Both limits bind and neither is ever passed: the token budget (100-token prompts against
    256 tokens admit two per step although seats are free) and the seat limit."""
    whole = {"chunked_prefill": False} if "chunked_prefill" in _fields(stage) else {}
    llm = make_llm(
        stage,
        tiny_model("llama-gqa"),
        max_num_seqs=3,
        max_num_batched_tokens=256,
        max_model_len=256,
        **whole,  # the budget as stage 04 defines it: whole prompts (stage 06 chunks them)
    )
    seen = []
    original = llm.scheduler.schedule

    def recording_schedule():
        scheduler_output = original()
        running = len(llm.scheduler.running)
        seen.append((len(scheduler_output.requests), scheduler_output.num_tokens, running))
        return scheduler_output

    llm.scheduler.schedule = recording_schedule
    prompts = [[100 + i] * 100 for i in range(5)]
    params = stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        llm.generate(prompts, params)
    finally:
        del llm.scheduler.schedule
    assert seen[0] == (2, 200, 2), "the token budget should stop a third prompt joining"
    assert max(n for n, _, _ in seen) == 3  # the seat cap was reached, never passed
    assert all(n <= 3 and tokens <= 256 and running <= 3 for n, tokens, running in seen)


def test_prompt_that_never_fits_fails_alone(stage, tiny_model, make_llm):
    path = tiny_model("llama-gqa")
    per_block = _bytes_per_block(make_llm(stage, path), 16)
    llm = make_llm(stage, path, kv_cache_bytes=per_block * 8)
    good = [llm.make_request(p, _params(stage, 1)) for p in PROMPTS[:3]]
    for request in good:
        llm.add_request(request)
    llm.step()
    with pytest.raises(ValueError, match="the context is 128 tokens"):  # clamped to the pool
        llm.make_request("x" * 200, stage.SamplingParams(max_tokens=4))
    while llm.has_unfinished():
        llm.step()
    assert all(r.finish_reason == "length" for r in good)
    assert _all_blocks_free(llm)


def _stream(url: str, body: dict) -> tuple[list[int], str, str | None]:
    tokens, text, finish = [], "", None
    with httpx.stream(
        "POST", f"{url}/generate", json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            tokens += event["token_ids"]
            text += event["text"]
            finish = event["finish_reason"] or finish
    return tokens, text, finish


def test_sixteen_concurrent_streams_all_complete_correctly(
    stage, tiny_model, live_server, make_llm
):
    path = tiny_model("llama-gqa")
    server, app = live_server(stage, path)
    bodies = [
        {
            "prompt": f"client {i} says " + "hello " * (i % 5),
            "max_tokens": 10 + i,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(16)
    ]
    results: dict[int, tuple] = {}

    def client(i: int) -> None:
        results[i] = _stream(server.url, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    reference = make_llm(stage, path)
    for i, body in enumerate(bodies):
        tokens, text, finish = results[i]
        params = stage.SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
        expected = reference.generate(body["prompt"], params)[0]
        assert tokens == expected.token_ids and text == expected.text and finish == "length"
    async_llm = app.state.engine
    assert async_llm.largest_step >= 4, "concurrent requests were meant to share steps"
    assert _all_blocks_free(async_llm.engine)


def test_recompute_after_preemption_is_just_more_new_tokens(stage, tiny_model, make_llm):
    """A preempted request comes back with every token it has (prompt and output so far) after
    its cached ones as new tokens: from position 0, or from the end of its prefix-cache hit
    (stage 07 on). No special case in the scheduler's data."""
    path = tiny_model("llama-odd-heads")
    per_block = _bytes_per_block(make_llm(stage, path), 4)
    tight = make_llm(stage, path, block_size=4, kv_cache_bytes=per_block * 24)
    requests = [tight.make_request(p, _params(stage, i)) for i, p in enumerate(PROMPTS)]
    for request in requests:
        tight.add_request(request)
    by_id = {r.request_id: r for r in requests}
    recomputed, preempted = [], set()
    while tight.has_unfinished():
        before = tight.scheduler.num_preemptions
        running = {r.request_id for r in tight.scheduler.running}
        scheduler_output = tight.scheduler.schedule()
        for scheduled in scheduler_output.requests:
            request = by_id[scheduled.request_id]
            start = scheduled.num_computed_tokens
            assert start + len(scheduled.token_ids) == request.num_tokens
            if request.request_id in preempted:  # back after a preemption
                assert start % 4 == 0, "a recompute starts at a block boundary"
                assert scheduled.token_ids == tuple(request.all_token_ids[start:])
                recomputed.append(scheduled.request_id)
                preempted.discard(request.request_id)
        preempted |= running & {r.request_id for r in tight.scheduler.waiting}
        if tight.scheduler.num_preemptions > before:
            assert all(s.num_computed_tokens > 0 for s in scheduler_output.requests), (
                "no admissions in a step that preempted"
            )
        tight.update_from_output(scheduler_output, tight.runner.execute_model(scheduler_output))
    assert recomputed, "the pool was meant to force a preemption and a recompute"
    assert _all_blocks_free(tight)


def test_the_newest_running_request_gives_way(stage, tiny_model, make_llm):
    """Scheduler._schedule_running directly: when blocks run out, the request preempted is the
    newest of those running, so the oldest keep their place and finish first (vLLM's policy;
    preempting the oldest would recompute the most and could starve it)."""
    path = tiny_model("llama-odd-heads")
    per_block = _bytes_per_block(make_llm(stage, path), 4)
    llm = stage.LLM(str(path), block_size=4, kv_cache_bytes=per_block * 24)
    scheduler, victims = llm.scheduler, []
    preempt = scheduler._preempt

    def recording(victim):
        victims.append((victim.request_id, [r.request_id for r in scheduler.running]))
        preempt(victim)

    scheduler._preempt = recording
    llm.generate(PROMPTS, [_params(stage, i) for i in range(len(PROMPTS))])
    assert victims, "the pool was meant to force preemption"
    for victim, running in victims:
        assert victim == running[-1], (victim, running)


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
def _seated(stage, tiny_model, make_llm, num_blocks: int, prompts: dict[str, int]):
    """An engine with a pool of `num_blocks` blocks of 4 tokens and requests seated by hand
    (no admission runs): each running with its whole prompt computed, its blocks allocated."""
    path = tiny_model("llama-gqa")
    per_block = _bytes_per_block(make_llm(stage, path), 4)
    llm = make_llm(stage, path, block_size=4, kv_cache_bytes=per_block * num_blocks)
    scheduler, seated = llm.scheduler, []
    params = stage.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for request_id, length in prompts.items():
        request = llm.make_request(list(range(60, 60 + length)), params, request_id=request_id)
        llm.add_request(request)
        scheduler.waiting.remove(request)
        scheduler.running.append(request)
        assert llm.kv_manager.allocate_slots(request_id, length)
        request.num_computed_tokens = length
        seated.append(request)
    return llm, scheduler, seated


def _unseat(llm, requests) -> None:
    for request in requests:
        llm.abort_request(request.request_id)
    assert _all_blocks_free(llm)


def test_preempt_frees_the_victim_resets_it_and_queues_it_first(stage, tiny_model, make_llm):
    """Scheduler._preempt alone: the victim leaves the running queue, gives back every block,
    forgets its computed tokens (its KV is gone) but keeps its tokens, and waits at the FRONT
    of the queue, ahead of requests that never ran."""
    llm, scheduler, (a, b) = _seated(stage, tiny_model, make_llm, 8, {"a": 6, "b": 9})
    c = llm.make_request([1, 2, 3], stage.SamplingParams(max_tokens=2), request_id="c")
    llm.add_request(c)
    b.output_token_ids.append(7)
    free = llm.kv_manager.num_free_blocks
    try:
        scheduler._preempt(b)
        assert scheduler.running == [a] and list(scheduler.waiting) == [b, c]
        assert llm.kv_manager.block_ids("b") == [] and llm.kv_manager.num_free_blocks == free + 3
        assert b.num_computed_tokens == 0 and b.num_tokens == 10, "tokens kept, KV gone"
        assert b.output_token_ids == [7] and scheduler.num_preemptions == 1
    finally:
        _unseat(llm, [a, b, c])


def test_the_scheduler_allocates_each_scheduled_request_once_a_step(stage, tiny_model, make_llm):
    """`allocate_slots` runs at most once per scheduled request per step: the call that decides
    whether a request fits is its allocation, and `_schedule_*_new_tokens` does not ask again
    (the second call cost stage 04's schedule phase 0.14-0.16 us a request:
    plots/step_profile/fewer_calls_per_request_2026-11-29.log). From stage 06 a decode whose
    last block has room is scheduled in the loop without the call (`decode_path`): exactly one
    call for each request the general path (`_schedule_new_tokens`) schedules, none for the
    others, never two. Counted over every schedule() of five requests from admission to the
    end."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    calls: list[str] = []
    per_step: list[tuple[int, int, int]] = []  # (allocate_slots calls, requests to allocate
    # for, requests scheduled)
    twice: list[str] = []  # requests allocated for twice in one step
    scheduler = llm.scheduler
    allocate, schedule = llm.kv_manager.allocate_slots, scheduler.schedule
    decode_path = getattr(scheduler, "decode_path", False)  # stage 06 on
    general: list[str] = []  # requests the general path scheduled (stage 06 on)

    def counting(request_id, *args, **kwargs):
        calls.append(request_id)
        return allocate(request_id, *args, **kwargs)

    def recording():
        before, general_before = len(calls), len(general)
        output = schedule()
        wanted = len(general) - general_before if decode_path else len(output.requests)
        per_step.append((len(calls) - before, wanted, len(output.requests)))
        step_calls = calls[before:]
        twice.extend(r for r in set(step_calls) if step_calls.count(r) > 1)
        return output

    if decode_path:
        general_path = scheduler._schedule_new_tokens

        def counted_general(request, *args, **kwargs):
            general.append(request.request_id)
            return general_path(request, *args, **kwargs)

        scheduler._schedule_new_tokens = counted_general
    llm.kv_manager.allocate_slots, scheduler.schedule = counting, recording
    outputs = llm.generate(PROMPTS[:5], [_params(stage, i) for i in range(5)])
    assert all(o.finish_reason == "length" for o in outputs)
    assert sum(n for _, _, n in per_step) > 5, "decode steps were meant to run"
    assert not twice, twice
    assert [c for c, _, _ in per_step] == [w for _, w, _ in per_step]
    if decode_path:  # and the decode path took some requests: fewer calls than requests
        assert sum(c for c, _, _ in per_step) < sum(n for _, _, n in per_step)
    assert _all_blocks_free(llm)


@since("05")  # the persistent batch's step (stage 05) knows when every row samples
def test_a_decode_step_feeds_the_lm_head_the_hidden_states_without_a_gather(
    stage, tiny_model, make_llm
):
    """When every row of a step samples (a decode step: one new token per request), the LM
    head reads the forward's output itself, not a gather of it by `logits_indices` (an
    identity there: one copy, and on a GPU one kernel, fewer per step). A step with a prompt
    in it gathers each sequence's last row. Stage 15's CUDA graphs are off: a replayed decode
    step runs its LM head inside the graph, so on a GPU it would call no `compute_logits`."""
    graphs_off = {"cuda_graphs": False} if "cuda_graphs" in _fields(stage) else {}
    llm = make_llm(stage, tiny_model("llama-gqa"), **graphs_off)
    model = llm.runner.model
    forward, compute_logits = model.forward, model.compute_logits
    outputs: list = []
    seen: list[tuple[bool, int, int]] = []  # (no gather, LM head rows, forward rows)

    def recording_forward(*args, **kwargs):
        outputs.append(forward(*args, **kwargs))
        return outputs[-1]

    def recording_logits(hidden):
        seen.append((hidden is outputs[-1], hidden.shape[0], outputs[-1].shape[0]))
        return compute_logits(hidden)

    model.forward, model.compute_logits = recording_forward, recording_logits
    try:
        llm.generate(PROMPTS[:3], [_params(stage, i) for i in range(3)])
    finally:
        del model.forward, model.compute_logits
    assert {direct for direct, _, _ in seen} == {True, False}, "decode and prompt steps both ran"
    assert all(direct == (rows == total) for direct, rows, total in seen)


@until("04")  # stage 05 adds tokens in flight, 06 a token budget: their own direct tests
def test_schedule_running_grows_the_oldest_first_and_preempts_the_newest(
    stage, tiny_model, make_llm
):
    """Scheduler._schedule_running alone (requests seated by hand, _preempt solved): each
    running request, oldest first, gets its new tokens and the blocks they need; when the
    pool runs dry the newest running request is preempted (possibly the one asking)."""
    seats = {"a": 8, "b": 8, "c": 8}  # two full blocks each: the whole pool of 6
    llm, scheduler, (a, b, c) = _seated(stage, tiny_model, make_llm, 6, seats)
    try:
        for request in (a, b, c):
            request.output_token_ids.append(7)  # a decode step: position 8 needs a 3rd block
        scheduled, budget, preempted = scheduler._schedule_running()
        assert preempted and [s.request_id for s in scheduled] == ["a", "b"]
        assert budget == scheduler.max_num_batched_tokens - 2, "the tokens it left for admission"
        assert [s.num_computed_tokens for s in scheduled] == [8, 8]
        assert [s.token_ids for s in scheduled] == [(7,), (7,)]
        assert a.num_computed_tokens == 9 and len(llm.kv_manager.block_ids("a")) == 3
        assert scheduler.running == [a, b] and list(scheduler.waiting) == [c]
        assert c.num_computed_tokens == 0 and llm.kv_manager.block_ids("c") == []
        for request in (a, b):
            request.output_token_ids += [7, 7, 7, 7]  # positions 9-12: a 4th block each
        scheduled, budget, preempted = scheduler._schedule_running()
        assert preempted and [s.request_id for s in scheduled] == ["a"]
        assert scheduler.running == [a] and list(scheduler.waiting) == [b, c]
        assert scheduled[0].token_ids == (7, 7, 7, 7) and b.num_computed_tokens == 0
        assert budget == scheduler.max_num_batched_tokens - 4
        a.output_token_ids += [7] * 8  # 21 tokens: 6 blocks, the whole pool
        scheduled, _, _ = scheduler._schedule_running()
        assert [s.request_id for s in scheduled] == ["a"]
        a.output_token_ids += [7] * 4  # 25 tokens: more than the pool holds
        scheduled, budget, preempted = scheduler._schedule_running()
        assert preempted and scheduled == [] and scheduler.running == []
        assert budget == scheduler.max_num_batched_tokens
        assert list(scheduler.waiting) == [a, b, c], "the one asking gave way itself"
    finally:
        _unseat(llm, [a, b, c])
