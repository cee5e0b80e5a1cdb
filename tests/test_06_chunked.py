"""Stage 06 promises: chunking a prefill changes when its KV is written, never what it is.

For chunk sizes 1, 7, block_size, block_size + 1 and larger than any prompt, chunked prefill
gives the logits of a full recompute (teacher forcing) and the unchunked greedy tokens; chunk
boundaries fall inside blocks; no step ever passes the token budget; intermediate chunks never
sample; it all holds with preemption and with async scheduling on or off.
"""

from __future__ import annotations

import pytest

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject, unit
from .test_03_paged import _bytes_per_block

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [since("06"), subject("scheduler.py")]

BLOCK = 8
PROMPTS = [
    "A long prompt that spans several blocks of the KV cache, " * 3,
    "short",
    "Another prompt, of middling length, " * 2,
    "x y z " * 9,
]


def _params(stage, i: int):
    return stage.SamplingParams(max_tokens=5 + 4 * i, temperature=0, ignore_eos=True)


def _all_blocks_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


def _record_steps(llm):
    seen = []
    original = llm.scheduler.schedule

    def recording():
        scheduler_output = original()
        seen.append(scheduler_output)
        return scheduler_output

    llm.scheduler.schedule = recording
    return seen


@pytest.mark.parametrize("chunk", [1, 7, BLOCK, BLOCK + 1, 4096])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_equals_unchunked(stage, tiny_model, make_llm, chunk, async_scheduling):
    path = tiny_model("llama-odd-heads")
    whole = make_llm(stage, path, block_size=BLOCK, chunked_prefill=False)
    chunked = make_llm(
        stage,
        path,
        block_size=BLOCK,
        chunked_prefill=True,
        long_prefill_token_threshold=chunk,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    params = [_params(stage, i) for i in range(len(PROMPTS))]
    seen = _record_steps(chunked)
    try:
        with step_logits(chunked) as recorded:
            out = chunked.generate(PROMPTS, params)
    finally:
        del chunked.scheduler.schedule
    assert [o.token_ids for o in out] == [o.token_ids for o in whole.generate(PROMPTS, params)]
    assert_logits_match_teacher_forcing(chunked, out, recorded)
    assert all(so.num_tokens <= 64 for so in seen), "the token budget was passed"
    longest = max(len(o.prompt_token_ids) for o in out)
    if chunk < longest:  # some prompt really was split, and only its last chunk sampled
        partial = [s for so in seen for s in so.requests if not s.sample]
        assert partial and all(len(s.token_ids) <= chunk for s in partial)
        if chunk % BLOCK:
            assert any(s.num_computed_tokens % BLOCK for s in partial), "no mid-block boundary"
    assert _all_blocks_free(chunked)


def test_long_prompt_does_not_stall_running_decodes(stage, tiny_model, make_llm):
    """With a budget of 32 tokens, a 300-token prompt joins running decodes chunk by chunk: no
    step carries more than the budget, and the decodes get a token in every step meanwhile."""
    llm = make_llm(
        stage, tiny_model("llama-gqa"), max_num_batched_tokens=32, async_scheduling=False
    )
    decodes = [llm.make_request(p, _params(stage, 5)) for p in ("one", "two")]
    for request in decodes:
        llm.add_request(request)
    llm.step()
    long = llm.make_request([100 + i % 50 for i in range(300)], _params(stage, 0))
    llm.add_request(long)
    seen = _record_steps(llm)
    try:
        while not long.output_token_ids:
            before = [len(r.output_token_ids) for r in decodes]
            llm.step()
            assert [len(r.output_token_ids) for r in decodes] == [n + 1 for n in before]
    finally:
        del llm.scheduler.schedule
    assert len(seen) >= 300 // 32 and all(so.num_tokens <= 32 for so in seen)
    while llm.has_unfinished():
        llm.step()
    solo = llm.generate([long.prompt_token_ids], long.params)[0].token_ids
    assert long.output_token_ids == solo and _all_blocks_free(llm)


def test_chunked_prefill_with_preemption(stage, tiny_model, make_llm):
    path = tiny_model("llama-odd-heads")
    roomy = make_llm(stage, path, chunked_prefill=False)
    tight = make_llm(
        stage,
        path,
        block_size=4,
        kv_cache_bytes=_bytes_per_block(roomy, 4) * 30,
        long_prefill_token_threshold=6,
        max_num_batched_tokens=24,
    )
    prompts = [f"Request {i}: " + "tell me something " * (i % 4) for i in range(7)]
    params = [_params(stage, i) for i in range(7)]
    before = tight.scheduler.num_preemptions
    with step_logits(tight) as recorded:
        out = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > before, "the pool was meant to force preemption"
    assert [o.token_ids for o in out] == [o.token_ids for o in roomy.generate(prompts, params)]
    assert_logits_match_teacher_forcing(tight, out, recorded)
    assert _all_blocks_free(tight)


def test_without_chunking_a_prompt_is_scheduled_whole(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), chunked_prefill=False, async_scheduling=False)
    seen = _record_steps(llm)
    try:
        llm.generate([[10 + i % 200 for i in range(200)]], _params(stage, 0))
    finally:
        del llm.scheduler.schedule
    assert len(seen[0].requests[0].token_ids) == 200 and seen[0].requests[0].sample


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_static_batches_chunk_prompts_longer_than_the_budget(
    stage, tiny_model, make_llm, async_scheduling
):
    """Static scheduling with chunked prefill admits a prompt longer than the token budget (its
    admission once compared the whole prompt with the budget and waited for ever) and runs the
    batch's prompts chunk by chunk under the budget: the outputs equal continuous batching's."""
    path = tiny_model("llama-odd-heads")
    config = {"block_size": BLOCK, "chunked_prefill": True, "max_num_batched_tokens": 32}
    continuous = make_llm(stage, path, **config)
    static = make_llm(stage, path, scheduling="static", async_scheduling=async_scheduling, **config)
    params = [_params(stage, i) for i in range(len(PROMPTS))]
    seen, batch_sizes = _record_steps(static), []
    recording = static.scheduler.schedule
    static.scheduler.schedule = lambda: (recording(), batch_sizes.append(len(static.running)))[0]
    try:
        out = static.generate(PROMPTS, params)
    finally:
        del static.scheduler.schedule
    assert max(len(o.prompt_token_ids) for o in out) > 32, "no prompt was over the budget"
    assert [o.token_ids for o in out] == [o.token_ids for o in continuous.generate(PROMPTS, params)]
    assert all(so.num_tokens <= 32 for so in seen), "the token budget was passed"
    assert batch_sizes[0] == len(PROMPTS), "the whole batch was admitted at once"
    assert _all_blocks_free(static)


def test_the_default_token_budget_fits_the_device(stage, make_llm, tiny_model):
    """With no budget given, a CPU engine takes the CPU default (256 tokens per step: a step's
    cost bounds every running stream's gap), not the GPU's 2,048; an explicit budget wins."""
    llm = make_llm(stage, tiny_model("llama-gqa"), device="cpu")
    assert llm.scheduler.max_num_batched_tokens == 256
    explicit = make_llm(stage, tiny_model("llama-gqa"), device="cpu", max_num_batched_tokens=64)
    assert explicit.scheduler.max_num_batched_tokens == 64


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
@unit("scheduler.py")
def test_chunk_takes_what_fits_the_budget_and_the_threshold(stage, tiny_model, make_llm):
    """Scheduler._chunk alone (on a copy of an engine's scheduler, its settings set by hand):
    what a request has left (its token in flight included), cut to the budget left and the
    per-request threshold with chunked prefill; without it, all of it or 0 (it waits)."""
    import copy
    import types

    scheduler = copy.copy(make_llm(stage, tiny_model("llama-gqa")).scheduler)

    def chunk(budget: int, tokens: int, computed: int = 0, in_flight: int = 0) -> int:
        request = types.SimpleNamespace(
            num_tokens=tokens, num_computed_tokens=computed, num_output_placeholders=in_flight
        )
        return scheduler._chunk(request, budget)

    scheduler.chunked, scheduler.long_prefill_token_threshold = True, 0
    assert chunk(30, 100) == 30 and chunk(30, 10) == 10 and chunk(30, 100, 90) == 10
    assert chunk(30, 12, 12, in_flight=1) == 1, "the token in flight is computed too"
    scheduler.long_prefill_token_threshold = 8
    assert chunk(30, 100) == 8 and chunk(5, 100) == 5 and chunk(30, 3) == 3
    scheduler.chunked, scheduler.long_prefill_token_threshold = False, 0
    assert chunk(30, 100) == 0, "a whole prompt or nothing"
    assert chunk(30, 20) == 20 and chunk(30, 100, 90) == 10 and chunk(30, 30) == 30


def _schedule_by_hand(scheduler, request, num_new: int):
    """`Scheduler._schedule_new_tokens` as its callers use it: they allocate the slots first
    (`allocate_slots` once per request per step; it does not check again)."""
    assert scheduler.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
    return scheduler._schedule_new_tokens(request, num_new)


@unit("scheduler.py")
def test_schedule_new_tokens_samples_only_at_the_end_of_the_tokens(stage, tiny_model, make_llm):
    """Scheduler._schedule_new_tokens alone (a request seated by hand, its slots allocated
    first as the scheduler's callers do): the next num_new tokens from num_computed_tokens
    on; an intermediate chunk samples
    nothing and counts no placeholder; the chunk reaching the end samples, and the token in
    flight is scheduled as a PLACEHOLDER before it lands."""
    scheduler_module = __import__(f"{stage.__name__}.scheduler", fromlist=["PLACEHOLDER"])
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    scheduler = llm.scheduler
    prompt = list(range(30, 40))
    params = stage.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    request = llm.make_request(prompt, params, request_id="chunked")
    llm.add_request(request)
    scheduler.waiting.remove(request)
    scheduler.running.append(request)
    try:
        first = _schedule_by_hand(scheduler, request, 4)
        assert first.token_ids == tuple(prompt[:4]) and first.num_computed_tokens == 0
        assert not first.sample and request.num_output_placeholders == 0
        assert request.num_computed_tokens == 4
        second = _schedule_by_hand(scheduler, request, 6)
        assert second.token_ids == tuple(prompt[4:]) and second.num_computed_tokens == 4
        assert second.sample and request.num_output_placeholders == 1
        assert len(second.block_ids) == llm.kv_manager.blocks_needed(10)
        third = _schedule_by_hand(scheduler, request, 1)  # before the second step resolves
        assert third.token_ids == (scheduler_module.PLACEHOLDER,) and third.sample
        assert request.num_computed_tokens == 11 and request.num_output_placeholders == 2
    finally:
        llm.abort_request("chunked")


@unit("scheduler.py")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_decode_path_schedules_what_the_general_path_does(stage, tiny_model, async_scheduling):
    """The decode path in `Scheduler._schedule_running`'s loop is `_schedule_new_tokens(request,
    1)` made cheap for the common case, so the oracle is the general path itself: an engine
    whose decodes all take the general path (`decode_path` off) must schedule the same steps
    (every field of every request), publish the same prefix-cache blocks after each step
    (stage 07 on: the decode path publishes only at the steps where a block's last token is
    on the host), and produce the same tokens. The
    requests reach every case: one-token last chunks of a prompt (so a decode-sized step with
    no output yet), prefix hits (repeated prompts), preemptions (a small pool); run again with
    tables that grow a block ahead, a decode at a block's start on the decode path (publishing
    the block before it, whose last token was in flight a step ago)."""
    path = tiny_model("llama-odd-heads")
    probe = stage.LLM(str(path), block_size=4, kv_cache_bytes=8 << 20)
    settings = {
        "block_size": 4,
        "kv_cache_bytes": _bytes_per_block(probe, 4) * 20,
        "long_prefill_token_threshold": 3,
        "max_num_batched_tokens": 10,
        "async_scheduling": async_scheduling,
    }
    # 10, 13, 16 tokens in chunks of 3: a 1-token tail, inside a block (10, 16) or at its
    # start (13); the tokens differ within a prompt, and prompts i and i + 3 are the same
    prompts = [[7 + 5 * (i % 3) + j for j in range(10 + 3 * (i % 3))] for i in range(6)]
    params = stage.SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    runs = [_decode_run(stage, path, settings, prompts, params, general) for general in (0, 1)]
    (fast_steps, fast_published, fast_out, preemptions, decodes, fast_at_block_start) = runs[0]
    general = runs[1]
    assert decodes > 0 and preemptions > 0, "the case was meant to decode and to preempt"
    assert general[4] == 0, "with decode_path off, every request takes the general path"
    assert any(  # a prompt's one-token last chunk, the decode path's case with no output yet
        r.num_computed_tokens == len(prompts[0]) - 1 and len(r.token_ids) == 1
        for out in fast_steps
        for r in out.requests
    )
    assert fast_steps == general[0]
    assert fast_published == general[1]
    assert fast_out == general[2]
    assert fast_at_block_start == 0, "exact tables: a decode at a block's start needs a block"
    # Tables with room at a block's start (every allocation a block ahead, as a KV load that
    # allocated ahead would leave them): only then does a decode that starts a block take the
    # decode path, one step after the block's last token was scheduled, and (in flight then)
    # it is that step that must publish the block (`end % block_size == 1`).
    ahead = [_decode_run(stage, path, settings, prompts, params, g, ahead=True) for g in (0, 1)]
    assert ahead[0][5] > 0, "the case was meant to reach a decode path at a block's start"
    assert ahead[0][:3] == ahead[1][:3]  # steps, published blocks, tokens


def _decode_run(stage, path, settings, prompts, params, general, ahead=False):
    """Generate `prompts` recording each step's scheduler output and, after it, the blocks
    each request has published; `general`: every decode through `_schedule_new_tokens`;
    `ahead`: every allocation covers a block more than asked. Returns the steps, the blocks,
    the outputs, the preemptions, how many requests the decode path scheduled (every
    `ScheduledRequest` not built by the general path) and how many of those start a block."""
    llm = stage.LLM(str(path), **settings)
    scheduler, steps, published, built = llm.scheduler, [], [], [0, 0, 0]
    inside_general = [False]
    scheduler.decode_path = not general
    if ahead:  # a table that must grow grows a block further (one with room stays as it is)
        kv, allocate = scheduler.kv, scheduler.kv.allocate_slots

        def allocate_ahead(request_id, num_tokens, *more):
            room = len(kv.block_tables.get(request_id, ())) * kv.block_size
            return allocate(request_id, num_tokens + kv.block_size * (room < num_tokens), *more)

        kv.allocate_slots = allocate_ahead
    schedule, build, general_path = (
        scheduler.schedule,
        scheduler._scheduled,
        scheduler._schedule_new_tokens,
    )

    def counted_build(request, token_ids, start, *args, **kwargs):
        built[0] += 1
        built[2] += not inside_general[0] and start % settings["block_size"] == 0
        return build(request, token_ids, start, *args, **kwargs)

    def counted_general(*args, **kwargs):
        built[1] += 1
        inside_general[0] = True
        try:
            return general_path(*args, **kwargs)
        finally:
            inside_general[0] = False

    def recording():
        steps.append(schedule())
        published.append(dict(getattr(llm.kv_manager, "_num_published", {})))
        return steps[-1]

    scheduler._scheduled, scheduler._schedule_new_tokens = counted_build, counted_general
    scheduler.schedule = recording
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    return steps, published, outputs, scheduler.num_preemptions, built[0] - built[1], built[2]
