"""Stage 03 promises: the paged KV cache and its attention kernel are exact, the block
allocator never loses or double-books a block, and batching changes no request's output."""

from __future__ import annotations

import importlib
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import (
    abort_seen,
    assert_logits_match_teacher_forcing,
    held_until_abort,
    needs_triton,
    since,
    step_logits,
    subject,
    unit,
    wait_for,
)

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [
    since("03"),
    subject("block_pool.py", "kv_cache.py", "cpu_attention.py", "kernels.py"),
]

PROMPTS = [
    "The quick brown fox",
    "hi",
    "A much longer prompt that spans several KV blocks " * 2,
    "zebra",
]


@unit("block_pool.py")
def test_allocator_hands_out_each_block_once_and_reports_exhaustion(stage):
    allocator = stage.BlockAllocator(4)
    blocks = [allocator.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and allocator.num_free == 0
    with pytest.raises(stage.OutOfBlocksError, match="KV cache is full"):
        allocator.allocate()
    allocator.free(blocks[:2])
    assert allocator.num_free == 2
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([blocks[0]])  # double free
    assert set(allocator.allocate() for _ in range(2)) == set(blocks[:2])


@unit("kv_cache.py")
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # `stage` is a constant
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 40), st.booleans()), min_size=1, max_size=60
    ),
    block_size=st.sampled_from([1, 2, 4, 16]),
)
def test_kv_manager_random_operations_keep_invariants(stage, ops, block_size):
    """Random grow/free sequences: blocks are never shared, never lost, slots never collide,
    and a failed allocation changes nothing."""
    kv_cache = importlib.import_module(f"{stage.__name__}.kv_cache")
    manager = stage.KVCacheManager(num_blocks=24, block_size=block_size)
    lengths = dict.fromkeys((f"seq-{i}" for i in range(6)), 0)
    for index, grow, free in ops:
        seq = f"seq-{index}"
        if free:
            manager.free(seq)
            lengths[seq] = 0
            continue
        before, free_before = list(manager.block_ids(seq)), manager.num_free_blocks
        if not manager.allocate_slots(seq, lengths[seq] + grow):
            assert manager.block_ids(seq) == before  # all or nothing
            assert manager.num_free_blocks == free_before
            assert manager.blocks_needed(lengths[seq] + grow) - len(before) > free_before
            continue
        lengths[seq] += grow
        assert len(manager.block_ids(seq)) == manager.blocks_needed(lengths[seq])
        held = [b for s in lengths for b in manager.block_ids(s)]
        assert len(held) == len(set(held)), "a block is held twice"
        assert len(held) + manager.num_free_blocks == 24, "a block went missing"
        all_slots = [
            slot
            for s, n in lengths.items()
            for slot in kv_cache.slot_mapping(manager.block_ids(s), 0, n, block_size)
        ]
        assert len(all_slots) == len(set(all_slots)), "two tokens share a KV slot"
    for seq in lengths:
        manager.free(seq)
    assert manager.num_free_blocks == 24


def _bytes_per_block(llm, block_size: int) -> int:
    """One block's K/V bytes for this engine's model, derived from its config."""
    mc = llm.model_config
    return llm.kv_cache.bytes_per_block(
        mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, llm.dtype
    )


def _blocks_all_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


@pytest.mark.parametrize("spec", ["llama-gqa", "llama-odd-heads", "qwen3"])
def test_batched_outputs_equal_solo_outputs(stage, tiny_model, make_llm, spec):
    llm = make_llm(stage, tiny_model(spec))
    params = [
        stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 30, 5, 21)
    ]
    with step_logits(llm) as recorded:
        batched = llm.generate(PROMPTS, params)
    assert_logits_match_teacher_forcing(llm, batched, recorded)
    for prompt, p, out in zip(PROMPTS, params, batched, strict=True):
        solo = llm.generate(prompt, p)[0]
        assert out.token_ids == solo.token_ids
        assert len(out.token_ids) == p.max_tokens
    assert _blocks_all_free(llm)


def test_paged_equals_contiguous_layout(stage, tiny_model, make_llm):
    path = tiny_model("llama-gqa")
    paged = make_llm(stage, path, block_size=4)
    contiguous = make_llm(stage, path, kv_layout="contiguous", max_model_len=128)
    params = stage.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    a = paged.generate(PROMPTS, params)
    b = contiguous.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert contiguous.block_size == 128


def test_small_pool_runs_several_batches(stage, tiny_model, make_llm):
    """A pool that fits only a couple of requests at a time still serves all of them."""
    path = tiny_model("llama-gqa")
    big = make_llm(stage, path)
    per_block = _bytes_per_block(big, 16)
    small = make_llm(stage, path, kv_cache_bytes=per_block * 6)
    assert small.kv_manager.allocator.num_blocks == 6
    params = stage.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [f"request number {i}" for i in range(5)]
    assert [o.token_ids for o in small.generate(prompts, params)] == [
        o.token_ids for o in big.generate(prompts, params)
    ]
    assert _blocks_all_free(small)


def test_request_that_can_never_fit_is_rejected(stage, tiny_model, make_llm):
    path = tiny_model("llama-gqa")
    big = make_llm(stage, path)
    per_block = _bytes_per_block(big, 16)
    small = make_llm(stage, path, kv_cache_bytes=per_block * 2)
    with pytest.raises(ValueError, match="the context is 32 tokens"):  # clamped to the pool
        small.generate("x" * 40, stage.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="exceeds the context of 32 tokens"):
        small.generate("x" * 20, stage.SamplingParams(max_tokens=20))
    assert small.generate("hi", stage.SamplingParams(max_tokens=4))[0].finish_reason


def test_never_fitting_request_is_a_400_and_others_finish(stage, tiny_model, live_server, make_llm):
    path = tiny_model("llama-gqa")
    per_block = _bytes_per_block(make_llm(stage, path), 16)
    server, _ = live_server(stage, path, kv_cache_bytes=per_block * 4)
    bad = httpx.post(
        f"{server.url}/generate", json={"prompt": "x" * 100, "max_tokens": 4}, timeout=30
    )
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "context is 64 tokens" in message, message
    ok = httpx.post(f"{server.url}/generate", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["token_ids"]) >= 1


def test_aborting_frees_blocks(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    params = stage.SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    requests = [llm.make_request(p, params) for p in PROMPTS]
    for request in requests:
        llm.add_request(request)
    llm.step()
    llm.step()
    for request in requests:
        out = llm.abort_request(request.request_id)
        assert out is not None and out.finish_reason == "abort"
    assert not llm.has_unfinished()
    assert _blocks_all_free(llm)


@needs_triton
@pytest.mark.slow  # the interpreted kernel: seconds; its own tests run where kernels.py changes
def test_triton_backend_end_to_end(stage, tiny_model, make_llm):
    """The whole engine on the Triton kernel (interpreted on the CPU) gives the same tokens."""
    path = tiny_model("llama-odd-heads")
    torch_backend = make_llm(stage, path, block_size=8)
    triton_backend = make_llm(stage, path, block_size=8, attention_backend="triton")
    params = stage.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:3]
    assert [o.token_ids for o in triton_backend.generate(prompts, params)] == [
        o.token_ids for o in torch_backend.generate(prompts, params)
    ]


@pytest.mark.slow
def test_real_model_batch_equals_solo(stage, real_model, make_llm):
    llm = make_llm(stage, real_model)
    questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "Write one sentence about the sea.",
    ]
    params = stage.SamplingParams(max_tokens=16, temperature=0)
    batched = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    for question, out in zip(questions, batched, strict=True):
        solo = llm.chat([{"role": "user", "content": question}], params)[0]
        assert out.token_ids == solo.token_ids
    assert "Paris" in batched[0].text


@pytest.mark.slow
def test_client_disconnect_frees_blocks(stage, real_model, live_server):
    """A stream closed mid-answer aborts the request and returns every block to the pool."""
    server, app = live_server(stage, real_model)
    async_llm = app.state.engine
    aborted = async_llm.num_aborted
    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with held_until_abort(async_llm, free=5) as gate:  # still running when the client leaves
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)
        assert wait_for(lambda: abort_seen(async_llm, gate), 30), "no abort came"
    deadline = time.monotonic() + 20
    while async_llm.num_pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_llm.num_aborted == aborted + 1
    assert _blocks_all_free(async_llm.engine)


def test_context_is_clamped_to_what_the_pool_holds(stage, tiny_model, make_llm):
    """An engine whose pool cannot hold one max_model_len sequence clamps the context to what
    it holds, so a chat request without max_tokens (which fills the context) still runs."""
    path = tiny_model("llama-gqa")
    big = make_llm(stage, path)
    small = make_llm(stage, path, kv_cache_bytes=_bytes_per_block(big, 16) * 5)
    assert small.kv_manager.allocator.num_blocks == 5
    assert small.max_model_len == 5 * 16 < big.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    out = small.chat(messages, stage.SamplingParams(max_tokens=None, temperature=0))[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids


def test_static_admission_counts_each_block_once(stage, tiny_model, make_llm):
    """Static batching promises each request its worst case (prompt + max_tokens) once: with 10
    blocks of 16 and six 16 + 16-token requests, five fit (2 blocks each)."""
    path = tiny_model("llama-gqa")
    big = make_llm(stage, path)
    config = {"kv_cache_bytes": _bytes_per_block(big, 16) * 10}
    if "scheduling" in {f for f in stage.EngineConfig.__dataclass_fields__}:
        config["scheduling"] = "static"
    llm = make_llm(stage, path, **config)
    prompt = list(range(100, 116))  # 16 token ids
    params = stage.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    requests = [llm.make_request(prompt, params) for _ in range(6)]
    for request in requests:
        llm.add_request(request)
    try:
        llm.step()
        assert len(llm.running) == 5 and len(llm.waiting) == 1
    finally:
        for request in requests:
            llm.abort_request(request.request_id)
    assert _blocks_all_free(llm)


def test_a_scheduler_that_schedules_nothing_raises_instead_of_spinning(
    stage, tiny_model, make_llm, monkeypatch
):
    """A step that schedules nothing while nothing is in flight and requests remain can never
    be followed by one that does: `generate` raises a RuntimeError naming the likely cause
    within a bounded number of steps (here the scheduler is made to schedule nothing), and the
    requests it submitted are aborted, every block back in the pool."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    output_type = importlib.import_module(type(llm.scheduler).__module__).SchedulerOutput
    real_step, steps = llm.step, []

    def counted_step():
        steps.append(1)
        assert len(steps) <= 3, "the loop kept stepping: a livelock"
        return real_step()

    monkeypatch.setattr(llm, "step", counted_step)
    monkeypatch.setattr(llm.scheduler, "schedule", lambda: output_type())
    params = stage.SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(RuntimeError, match="max_num_batched_tokens"):
        llm.generate(PROMPTS, params)
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        list(llm.stream(llm.make_request("hi", params)))
    assert not llm.has_unfinished() and _blocks_all_free(llm)


def test_the_default_seat_count_fits_the_device(stage, make_llm, tiny_model):
    """With no max_num_seqs given, a CPU engine takes the CPU default (64, measured: a CPU
    decode step grows with the batch), not a GPU's 256; an explicit value wins."""
    llm = make_llm(stage, tiny_model("llama-gqa"), device="cpu")
    assert llm.scheduler.max_num_seqs == 64 and llm.config.max_num_seqs == 64
    explicit = make_llm(stage, tiny_model("llama-gqa"), device="cpu", max_num_seqs=3)
    assert explicit.scheduler.max_num_seqs == 3


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
@unit("kv_cache.py")
def test_allocate_slots_grows_a_table_to_cover_its_tokens_all_or_nothing(stage):
    """KVCacheManager.allocate_slots alone: a table grows by ceil(num_tokens / block_size)
    minus the blocks it has (none while its last block has room), takes the last free blocks
    when exactly enough are left, and a request the pool cannot serve whole gets nothing."""
    manager = stage.KVCacheManager(num_blocks=5, block_size=2)
    assert manager.allocate_slots("a", 3) and len(manager.block_ids("a")) == 2
    table = list(manager.block_ids("a"))
    assert manager.allocate_slots("a", 4) and manager.block_ids("a") == table, "room left"
    assert manager.allocate_slots("a", 5) and manager.block_ids("a")[:2] == table
    assert len(manager.block_ids("a")) == 3 and manager.num_free_blocks == 2
    assert not manager.allocate_slots("b", 5), "3 blocks wanted, 2 free"
    assert manager.block_ids("b") == [] and "b" not in manager.block_tables
    assert manager.num_free_blocks == 2, "a refusal takes no block"
    assert not manager.allocate_slots("a", 11) and len(manager.block_ids("a")) == 3
    assert manager.allocate_slots("b", 4), "exactly enough free blocks"
    held = manager.block_ids("a") + manager.block_ids("b")
    assert sorted(held) == list(range(5)) and manager.num_free_blocks == 0
    manager.free("a")
    assert manager.num_free_blocks == 3 and manager.block_ids("a") == []


def test_static_admission_promises_each_worst_case_once(stage, tiny_model, make_llm):
    """Scheduler._admit_static_batch alone (called directly: no step runs), with nothing
    running: in arrival order while the worst cases (prompt + max_tokens, in blocks) fit in
    the free blocks together, stopping at the first that does not (a later, smaller one waits
    too: arrival order is kept) and at max_num_seqs; nothing is allocated yet."""
    path = tiny_model("llama-gqa")
    big = make_llm(stage, path)
    llm = make_llm(stage, path, kv_cache_bytes=_bytes_per_block(big, 16) * 10, max_num_seqs=4)
    scheduler = llm.scheduler
    assert llm.kv_manager.num_free_blocks == 10
    prompt = list(range(100, 116))  # 16 token ids: one block

    def admit(max_tokens: list[int]) -> list:
        requests = [
            llm.make_request(prompt, stage.SamplingParams(max_tokens=n, ignore_eos=True))
            for n in max_tokens
        ]
        for request in requests:
            llm.add_request(request)
        scheduler._admit_static_batch()
        return requests

    try:
        requests = admit([16, 40, 16, 40, 1])  # worst cases of 2, 4, 2, 4 and 2 blocks
        assert scheduler.running == requests[:3], "2 + 4 + 2 blocks fit; 2 + 4 + 2 + 4 do not"
        assert list(scheduler.waiting) == requests[3:]
        assert llm.kv_manager.num_free_blocks == 10, "promised, not yet allocated"
        for request in requests:
            llm.abort_request(request.request_id)
        requests = admit([16] * 5)  # 2 blocks each: all five would fit
        assert scheduler.running == requests[:4] and list(scheduler.waiting) == requests[4:]
    finally:
        for request in requests:
            llm.abort_request(request.request_id)
    assert _blocks_all_free(llm)
