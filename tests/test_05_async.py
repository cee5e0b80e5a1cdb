"""Stage 05 promises: overlapping the host's work with the model changes nothing a request sees.

Outputs are identical with async scheduling on and off (greedy and seeded, with preemption, with
aborts). The hard cases each pin a bug vLLM shipped and fixed: a request that stops in step t
was already scheduled for step t+1, and no token after its stop is ever emitted, its blocks freed
once; an abort between launch and resolve; a preemption while a step is in flight; a request
that finishes on its first token.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, unit, until
from .test_03_paged import _bytes_per_block

pytestmark = since("05")

PROMPTS = [f"Request {i}: " + "tell me something " * (i % 4) for i in range(7)]


def _params(stage, i: int, **extra):
    extra = {"temperature": 0, **extra}
    return stage.SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True, **extra)


def _all_blocks_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


def _engines(stage, tiny_model, make_llm, spec="llama-odd-heads", **config):
    path = tiny_model(spec)
    on = make_llm(stage, path, async_scheduling=True, **config)
    off = make_llm(stage, path, async_scheduling=False, **config)
    return on, off


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_identical_with_and_without_overlap(stage, tiny_model, make_llm, sampling):
    on, off = _engines(stage, tiny_model, make_llm)
    extra = {} if sampling == "greedy" else {"temperature": 0.9, "seed": 5}
    params = [_params(stage, i, **extra) for i in range(len(PROMPTS))]
    with step_logits(on) as recorded:
        overlapped = on.generate(PROMPTS, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in off.generate(PROMPTS, params)]
    assert_logits_match_teacher_forcing(on, overlapped, recorded)
    assert not on.has_unfinished() and _all_blocks_free(on)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_preemption_while_a_step_is_in_flight(stage, tiny_model, make_llm, sampling):
    """A tiny pool forces preemptions of requests whose last token is still in flight: no token
    is lost or duplicated on resume."""
    path = tiny_model("llama-odd-heads")
    roomy = make_llm(stage, path, async_scheduling=False)
    tight_bytes = _bytes_per_block(roomy, 4) * 24
    tight = make_llm(stage, path, block_size=4, kv_cache_bytes=tight_bytes, async_scheduling=True)
    extra = {} if sampling == "greedy" else {"temperature": 0.9, "seed": 11}
    params = [_params(stage, i, **extra) for i in range(len(PROMPTS))]
    before = tight.scheduler.num_preemptions
    with step_logits(tight) as recorded:
        out = tight.generate(PROMPTS, params)
    assert tight.scheduler.num_preemptions > before, "the pool was meant to force preemption"
    assert [o.token_ids for o in out] == [o.token_ids for o in roomy.generate(PROMPTS, params)]
    assert_logits_match_teacher_forcing(tight, out, recorded)
    assert _all_blocks_free(tight)


def test_no_token_after_a_stop(stage, tiny_model, make_llm):
    """EOS (a stop token id here), a stop string and max_tokens each end the request in step t
    although step t+1 already holds it: the outputs equal the synchronous run's exactly."""
    on, off = _engines(stage, tiny_model, make_llm, spec="llama-gqa")
    base = off.generate("hi", stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens, text = base[0].token_ids, base[0].text
    cases = [
        stage.SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[tokens[3]]),
        stage.SamplingParams(max_tokens=12, temperature=0, stop=[text[2:4]], ignore_eos=True),
        stage.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        stage.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    ]
    for params in cases:
        a, b = on.generate(["hi", "other"], params), off.generate(["hi", "other"], params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [
            (o.token_ids, o.text, o.finish_reason) for o in b
        ]
        assert len(a[0].token_times) == len(a[0].token_ids)
    assert not on.has_unfinished() and _all_blocks_free(on)


def test_a_request_that_finishes_on_its_first_token(stage, tiny_model, make_llm):
    on, _ = _engines(stage, tiny_model, make_llm, spec="llama-gqa")
    first = on.generate("hi", stage.SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    params = stage.SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first])
    requests = [on.make_request("hi", params), on.make_request("long one", _params(stage, 3))]
    outputs = []
    for request in requests:
        on.add_request(request)
    while on.has_unfinished():
        outputs += on.step()
    stopped = [o for o in outputs if o.request_id == requests[0].request_id]
    assert [len(o.token_ids) for o in stopped] == [1] and stopped[0].finish_reason == "stop"
    assert requests[0].final_output().token_ids == [first]
    assert _all_blocks_free(on)


def test_abort_between_launch_and_resolve(stage, tiny_model, make_llm):
    on, off = _engines(stage, tiny_model, make_llm, spec="llama-gqa")
    requests = [on.make_request(p, _params(stage, 4)) for p in PROMPTS[:4]]
    for request in requests:
        on.add_request(request)
    on.step()
    on.step()  # step 2 is in flight now, holding every request
    assert on._in_flight is not None
    aborted = on.abort_request(requests[1].request_id)
    assert aborted is not None and aborted.finish_reason == "abort"
    seen_after = [o for _ in range(3) for o in on.step() if o.request_id == aborted.request_id]
    assert not seen_after, "an aborted request got a token from the step in flight"
    while on.has_unfinished():
        on.step()
    survivors = [requests[i].final_output().token_ids for i in (0, 2, 3)]
    expected = off.generate([PROMPTS[i] for i in (0, 2, 3)], _params(stage, 4))
    assert survivors == [o.token_ids for o in expected]
    assert _all_blocks_free(on)


def test_random_runs_leak_no_blocks(stage, tiny_model, make_llm):
    """Random arrivals, aborts, stops and a tight pool: every block comes back, and every
    request that was not aborted matches its synchronous run."""
    path = tiny_model("llama-gqa")
    roomy = make_llm(stage, path, async_scheduling=False)
    tight = make_llm(
        stage,
        path,
        block_size=4,
        kv_cache_bytes=_bytes_per_block(roomy, 4) * 40,
        async_scheduling=True,
    )
    rng = random.Random(0)
    for _ in range(3):
        pending = [
            tight.make_request(
                f"prompt {i} " * rng.randint(1, 6),
                stage.SamplingParams(max_tokens=rng.randint(1, 25), temperature=0),
            )
            for i in range(10)
        ]
        live = []
        while pending or tight.has_unfinished():
            if pending and rng.random() < 0.5:
                request = pending.pop()
                tight.add_request(request)
                live.append(request)
            if live and rng.random() < 0.1:
                tight.abort_request(rng.choice(live).request_id)
            tight.step()
        assert _all_blocks_free(tight)
        for request in live:
            if request.finish_reason == "abort":
                continue
            solo = roomy.generate(request.prompt, request.params)[0]
            assert request.output_token_ids == solo.token_ids


def test_a_token_in_flight_never_lands_on_a_reused_request_id(stage, tiny_model, make_llm):
    """Abort "x" while its step is in flight, add a new "x" before the next step: the old
    admission's token is dropped, and the new "x" generates exactly what it generates alone.
    Every admission has its own id (`Request.admission_id`, carried in `ScheduledRequest`); the
    model runner keys its state by request id, which is safe because one step never holds two
    admissions of one id (a fresh admission has no token in flight to fill in)."""
    on, off = _engines(stage, tiny_model, make_llm, spec="llama-gqa")
    params = _params(stage, 2)
    expected = off.generate(PROMPTS[3], params)[0].token_ids
    old = on.make_request(PROMPTS[1], params, request_id="x")
    on.add_request(old)
    on.step()  # launches old "x"'s first step: its token is in flight
    assert on._in_flight is not None
    on.abort_request("x")
    new = on.make_request(PROMPTS[3], params, request_id="x")
    on.add_request(new)
    assert new.admission_id != old.admission_id
    on.step()  # launches new "x"'s first step, resolves old "x"'s
    assert new.output_token_ids == [] and new.num_output_placeholders == 1
    while on.has_unfinished():
        on.step()
    assert new.output_token_ids == expected and new.num_output_placeholders == 0
    assert _all_blocks_free(on)


def _reference_inputs(
    scheduler_output, block_size: int, previous_rows: dict[str, int], width: int | None = None
):
    """What a step's input tensors must hold, built plainly from the scheduler's output (the
    per-step tensors the runner made before it kept persistent buffers). Block tables are
    `width` wide, zero-padded (default: the widest request's; a CUDA graph's are wider)."""
    requests = scheduler_output.requests
    ids, positions, slots, logits_rows, placeholders, sources = [], [], [], [], [], []
    for r in requests:
        for j, token in enumerate(r.token_ids):
            position = r.num_computed_tokens + j
            if token < 0:
                placeholders.append(len(ids))
                sources.append(previous_rows[r.request_id])
            ids.append(token)
            positions.append(position)
            slots.append(r.block_ids[position // block_size] * block_size + position % block_size)
        if r.sample:
            logits_rows.append(len(ids) - 1)
    width = width or max(len(r.block_ids) for r in requests)
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + len(r.token_ids))
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "logits_indices": logits_rows,
        "query_start_loc": starts,
        "seq_lens": [r.num_computed_tokens + len(r.token_ids) for r in requests],
        "block_tables": [list(r.block_ids) + [0] * (width - len(r.block_ids)) for r in requests],
        "placeholder_rows": placeholders or None,
        "placeholder_sources": sources or None,
    }


@unit("model_runner.py")
def test_step_inputs_live_in_persistent_buffers_and_hold_the_scheduled_step(stage, tiny_model):
    """Each step's input tensors are views of the runner's persistent device buffers (the same
    memory every step, filled from host staging by the step itself), and hold exactly what the
    scheduler output says, placeholders and preemptions included."""
    path = tiny_model("llama-odd-heads")
    probe = stage.LLM(str(path), block_size=4, kv_cache_bytes=8 << 20)
    llm = stage.LLM(
        str(path), block_size=4, kv_cache_bytes=_bytes_per_block(probe, 4) * 24,
        async_scheduling=True,
    )  # fmt: skip
    runner, pending, seen = llm.runner, [], []
    prepare, forward = runner.prepare_inputs, runner._forward_and_sample

    def recording_prepare(scheduler_output):
        pending.append(scheduler_output)
        return prepare(scheduler_output)

    def recording_forward(inputs):  # runs where the step runs, after the step's copy
        meta = inputs.attn_metadata
        tensors = {
            "input_ids": inputs.input_ids, "positions": inputs.positions,
            "slot_mapping": meta.slot_mapping, "logits_indices": inputs.logits_indices,
            "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens,
            "block_tables": meta.block_tables, "placeholder_rows": inputs.placeholder_rows,
            "placeholder_sources": inputs.placeholder_sources,
        }  # fmt: skip
        seen.append(
            (
                pending.pop(0),
                {k: None if t is None else t.tolist() for k, t in tensors.items()},
                {k: t.data_ptr() for k, t in tensors.items() if t is not None},
                None if inputs.sampling.offsets is None else inputs.sampling.offsets.tolist(),
            )
        )
        return forward(inputs)

    runner.prepare_inputs, runner._forward_and_sample = recording_prepare, recording_forward
    # Greedy and random requests: a step with a random one carries every row's offset.
    params = [
        _params(stage, i, temperature=0.8, seed=i) if i % 2 else _params(stage, i)
        for i in range(len(PROMPTS))
    ]
    llm.generate(PROMPTS, params)
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert {offsets is None for _, _, _, offsets in seen} == {True, False}
    assert any(values["placeholder_rows"] for _, values, _, _ in seen), "no placeholder filled"
    previous_rows: dict[str, int] = {}
    graphs = getattr(runner, "graphs", None)  # stage 15 on CUDA: decode steps replay graphs
    for scheduler_output, values, pointers, offsets in seen:
        # Eager steps' tables are as wide as the widest request's; a graph's are always a full
        # context wide (it was captured on that shape), padded with zeros the same way.
        width = len(values["block_tables"][0])
        widest = max(len(r.block_ids) for r in scheduler_output.requests)
        assert width == widest or (graphs is not None and width == graphs.plan.max_blocks)
        expected = _reference_inputs(scheduler_output, 4, previous_rows, width)
        assert values == expected
        sampled = [r for r in scheduler_output.requests if r.sample]
        if all(r.params.greedy for r in sampled):  # an argmax needs no offsets (GREEDY_BATCH)
            assert offsets is None
        else:
            assert offsets == [r.num_computed_tokens + len(r.token_ids) for r in sampled]
        previous_rows = {r.request_id: i for i, r in enumerate(sampled)}
        buffers = runner.buffers.device_tensors
        assert pointers == {k: buffers[k].data_ptr() for k in pointers}, "a fresh tensor"


@unit("input_buffers.py")
def test_staging_is_double_buffered_and_guarded(stage):
    """Step t+1 is staged while step t's copy is still queued: step t's copy still delivers step
    t's values (two staging slots); staging step t+2 waits until step t's copy has run (it
    reuses that slot); a step larger than the buffers grows them, and the views of the inputs
    it hands out are of the new allocation from then on."""
    import importlib
    import threading

    import torch

    module = importlib.import_module(f"{stage.__name__}.input_buffers")
    buffers = module.InputBuffers({"ids": (4, torch.long)}, torch.device("cpu"), None)
    pointer = buffers.device_tensors["ids"].data_ptr()
    first, first_views = buffers.stage({"ids": [1, 2, 3]})
    second, second_views = buffers.stage({"ids": [7, 8]})  # before the first copy has run
    third: list = []
    waiting = threading.Thread(target=lambda: third.append(buffers.stage({"ids": [9]})))
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive(), "staged into a slot whose copy had not run"
    buffers.copy_to_device(first)
    waiting.join(timeout=60)
    assert not waiting.is_alive() and third
    assert first_views["ids"].tolist() == [1, 2, 3]
    buffers.copy_to_device(second)
    assert second_views["ids"].tolist() == [7, 8] and second_views["ids"].data_ptr() == pointer
    buffers.copy_to_device(third[0][0])
    grown, grown_views = buffers.stage({"ids": list(range(11))})
    buffers.copy_to_device(grown)
    assert grown_views["ids"].tolist() == list(range(11))
    again, again_views = buffers.stage({"ids": [5, 6, 7]})  # a length it kept a view for
    buffers.copy_to_device(again)
    assert again_views["ids"].data_ptr() == buffers.device_tensors["ids"].data_ptr(), "stale view"
    assert again_views["ids"].tolist() == [5, 6, 7]


@unit("input_buffers.py")
def test_a_copy_that_is_never_queued_fails_the_wait_instead_of_hanging(stage):
    """Staging waits for the copy two steps back; if the thread that runs steps died before it
    queued that copy, the wait ends in a RuntimeError after its timeout, not a hang."""
    import importlib

    import torch

    module = importlib.import_module(f"{stage.__name__}.input_buffers")
    done = module.CopyDone(torch.device("cpu"))
    done.wait(timeout=0.01)  # nothing queued: returns at once
    done.expect()  # a copy is about to be queued ... and never is
    with pytest.raises(RuntimeError, match="stuck or dead"):
        done.wait(timeout=0.05)
    done.record()
    done.wait(timeout=0.01)


@unit("input_buffers.py")
def test_a_block_table_view_is_kept_and_follows_a_growth(stage):
    """`matrix` hands out a [rows, width] view of a flat input, the same tensor while the shape
    repeats (no tensor made per step), and one of the new allocation once the buffers grow."""
    import importlib

    import torch

    module = importlib.import_module(f"{stage.__name__}.input_buffers")
    buffers = module.InputBuffers({"tables": (6, torch.int32)}, torch.device("cpu"), None)
    staged, _ = buffers.stage({"tables": [1, 2, 3, 4, 5, 6]})
    buffers.copy_to_device(staged)
    table = buffers.matrix("tables", 2, 3)
    assert table.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert buffers.matrix("tables", 2, 3) is table, "a view made again for the same shape"
    assert buffers.matrix("tables", 3, 2).tolist() == [[1, 2], [3, 4], [5, 6]]
    grown, _ = buffers.stage({"tables": list(range(9))})
    buffers.copy_to_device(grown)
    after = buffers.matrix("tables", 3, 3)
    assert after.data_ptr() == buffers.device_tensors["tables"].data_ptr(), "stale view"
    assert after.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    staged, _ = buffers.stage({"tables": [9, 8, 7, 6, 5, 4]})
    buffers.copy_to_device(staged)
    assert buffers.matrix("tables", 2, 3).tolist() == [[9, 8, 7], [6, 5, 4]]


@unit("input_buffers.py")
def test_a_step_reaches_the_device_in_one_copy(stage):
    """Every input is a view of one packed allocation at a fixed offset (a CUDA graph reads the
    same addresses each step): one copy of the bytes from the first input a step uses to the
    end of the last moves the whole step, whatever the inputs' dtypes; an input the step does
    not use keeps its old values. The sampling parameters travel packed the same way."""
    import importlib

    import torch

    module = importlib.import_module(f"{stage.__name__}.input_buffers")
    sizes = {"ids": (5, torch.long), "lens": (3, torch.int32), "rows": (4, torch.long)}
    buffers = module.InputBuffers(sizes, torch.device("cpu"), None)
    device = buffers.device_tensors
    storages = {t.untyped_storage().data_ptr() for t in device.values()}
    assert len(storages) == 1, "one allocation"
    pointers = {name: t.data_ptr() for name, t in device.items()}
    assert len(set(pointers.values())) == 3 and all(p % 64 == 0 for p in pointers.values())
    copies = []
    real_copy = torch.Tensor.copy_

    def counted(self, src, non_blocking=False):
        copies.append(self.numel())
        return real_copy(self, src, non_blocking)

    staged, views = buffers.stage({"ids": [4, 5, 6], "lens": [7, 8], "rows": [9]})
    torch.Tensor.copy_ = counted
    try:
        buffers.copy_to_device(staged)
    finally:
        torch.Tensor.copy_ = real_copy
    assert len(copies) == 1, f"{len(copies)} copies for one step"
    assert views["ids"].tolist() == [4, 5, 6] and views["lens"].tolist() == [7, 8]
    assert views["lens"].dtype == torch.int32 and views["rows"].tolist() == [9]
    staged, views = buffers.stage({"ids": [1], "lens": []})
    buffers.copy_to_device(staged)
    assert views["ids"].tolist() == [1] and device["rows"][:1].tolist() == [9], "left as it was"
    assert {n: t.data_ptr() for n, t in device.items()} == pointers, "the addresses stay"
    host = {"t": torch.tensor([0.5, 2.0]), "k": torch.tensor([3, 4]), "g": torch.tensor([True])}
    moved = module.packed_copy(host, torch.device("cpu"))
    assert all(torch.equal(moved[n], host[n]) and moved[n].dtype == host[n].dtype for n in host)


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
def _seat(stage, llm, prompts: dict[str, list[int]]) -> list:
    """Greedy requests added and moved to the running queue by hand (no admission runs)."""
    params = stage.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seated = []
    for request_id, prompt in prompts.items():
        request = llm.make_request(prompt, params, request_id=request_id)
        llm.add_request(request)
        llm.scheduler.waiting.remove(request)
        llm.scheduler.running.append(request)
        seated.append(request)
    return seated


def _schedule(scheduler, request):
    """A request's every new token, its tokens in flight included, whatever the stage calls it
    (stage 06 adds the number of tokens to take). Their slots are allocated first, as the
    scheduler's own callers do (once per request per step)."""
    end = request.num_tokens + request.num_output_placeholders
    assert scheduler.kv.allocate_slots(request.request_id, end)
    if hasattr(scheduler, "_schedule_all_new_tokens"):
        return scheduler._schedule_all_new_tokens(request)
    return scheduler._schedule_new_tokens(request, end - request.num_computed_tokens)


def _one_each(sampled: dict) -> dict[str, int]:
    """request id -> its sampled token (stage 08 answers a list: drafts accepted, then one)."""
    return {i: t if isinstance(t, int) else t[-1] for i, t in sampled.items() if t != []}


@until("05")  # stage 06 schedules a number of tokens (`_schedule_new_tokens`): its own test
def test_schedule_all_new_tokens_counts_the_token_in_flight(stage, tiny_model, make_llm):
    """Scheduler._schedule_all_new_tokens alone: a step takes every token not computed yet,
    the token still in flight included as a PLACEHOLDER id (the caller allocated their
    slots), moves num_computed_tokens past them, and counts one more placeholder for the
    token it samples."""
    scheduler_module = __import__(f"{stage.__name__}.scheduler", fromlist=["PLACEHOLDER"])
    placeholder = scheduler_module.PLACEHOLDER
    llm = make_llm(stage, tiny_model("llama-gqa"))
    (a,) = _seat(stage, llm, {"a": [5, 6, 7, 8, 9]})
    try:
        first = _schedule(llm.scheduler, a)
        assert first.token_ids == (5, 6, 7, 8, 9) and first.num_computed_tokens == 0
        assert first.sample and a.num_computed_tokens == 5 and a.num_output_placeholders == 1
        second = _schedule(llm.scheduler, a)  # before the first step resolved
        assert second.token_ids == (placeholder,) and second.num_computed_tokens == 5
        assert a.num_computed_tokens == 6 and a.num_output_placeholders == 2
        assert len(second.block_ids) == llm.kv_manager.blocks_needed(6)
        a.num_output_placeholders -= 1  # the first step's token lands
        a.output_token_ids.append(11)
        third = _schedule(llm.scheduler, a)
        assert third.token_ids == (placeholder,) and third.num_computed_tokens == 6
        assert a.num_computed_tokens == 7 and a.num_output_placeholders == 2
        a.num_output_placeholders = 0  # both land: nothing in flight
        a.output_token_ids += [12, 13]
        fourth = _schedule(llm.scheduler, a)
        assert fourth.token_ids == (13,) and fourth.num_computed_tokens == 7
    finally:
        llm.abort_request("a")
    assert _all_blocks_free(llm)


@unit("model_runner.py")
def test_forward_and_sample_fills_each_placeholder_with_its_own_requests_token(
    stage, tiny_model, make_llm
):
    """ModelRunner._forward_and_sample alone (steps scheduled by hand, launched without
    waiting): step 2 is launched before step 1 resolves, its requests in the other order;
    each placeholder input must be its own request's token of step 1, so both steps' greedy
    tokens equal the teacher-forced argmax of the prompt (and of the prompt + step 1's token)."""
    scheduler_module = __import__(f"{stage.__name__}.scheduler", fromlist=["SchedulerOutput"])
    output = scheduler_module.SchedulerOutput
    llm = make_llm(stage, tiny_model("llama-gqa"))
    prompts = {"a": [40, 41, 42, 43, 44, 45], "b": [90, 12, 77]}
    requests = _seat(stage, llm, prompts)
    scheduler, runner = llm.scheduler, llm.runner

    def argmax_after(tokens: list[int]) -> int:
        return int(runner.prompt_logits(tokens)[-1].argmax())

    try:
        first = runner.launch(output(tuple(_schedule(scheduler, r) for r in requests)))
        second = runner.launch(output(tuple(_schedule(scheduler, r) for r in requests[::-1])))
        tokens_1, tokens_2 = _one_each(first.result()), _one_each(second.result())
    finally:
        for request in requests:
            llm.abort_request(request.request_id)
    expected_1 = {i: argmax_after(p) for i, p in prompts.items()}
    assert tokens_1 == expected_1
    assert tokens_2 == {i: argmax_after([*p, expected_1[i]]) for i, p in prompts.items()}


def test_a_cpu_step_runs_on_a_worker_thread_only_when_it_overlaps(stage, tiny_model, make_llm):
    """On a CPU the runner's worker thread exists for the overlap: with async scheduling it
    runs every step (and built the model there, one OpenMP team); without it there is no
    worker, and each step runs on the engine's own thread inside `launch`, as in stage 04
    (a thread that runs nothing beside the engine only costs it the hand-offs). On CUDA the
    steps go to a stream either way."""
    import threading

    on, off = _engines(stage, tiny_model, make_llm)
    if on.runner.device.type != "cpu":
        pytest.skip("a CUDA runner queues its steps on a stream, with or without overlap")
    assert on.runner._worker is not None and off.runner._worker is None
    # Without the overlap the step reads its inputs where the host staged them: no copy.
    direct, copied = off.runner.buffers, on.runner.buffers
    assert direct.direct and not copied.direct
    staged_ids = direct.host[0]["input_ids"].data_ptr()
    assert direct.device_tensors["input_ids"].data_ptr() == staged_ids
    assert copied.device_tensors["input_ids"].data_ptr() != copied.host[0]["input_ids"].data_ptr()
    buffers_module = importlib.import_module(f"{stage.__name__}.input_buffers")
    with pytest.raises(ValueError, match="need a CPU"):
        buffers_module.InputBuffers({"x": (4, torch.long)}, torch.device("cuda"), None, True)
    for llm in (on, off):
        threads: set[int] = set()
        forward = llm.runner.model.forward

        def recording(*args, forward=forward, threads=threads, **kwargs):
            threads.add(threading.get_ident())
            return forward(*args, **kwargs)

        llm.runner.model.forward = recording
        llm.generate(PROMPTS[:2], [_params(stage, i) for i in range(2)])
        overlapped = llm is on
        assert (threading.get_ident() in threads) is not overlapped, threads
        assert len(threads) == 1, threads
