"""Stage 07 promises: a prefix-cache hit changes how much of a prompt is computed, never what
any request produces.

Outputs (greedy tokens, seeded samples, and the logits of a full recompute) are identical with
caching on and off, with chunked prefill, async scheduling, preemption and aborts; a fully
cached prompt recomputes only its last block; reference counts, the free queue and the hash map
agree after every step of a randomized run of thousands of steps, and no block whose content
was evicted or never published is read as a hit; different cache salts never share; a block's
key chains its parent's (a block repeating its parent is its own block); a key can collide and
still no two token runs alias one block; a preempted request's hit is counted once.
"""

from __future__ import annotations

import importlib
import random

import httpx
import pytest

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject, unit
from .test_03_paged import _bytes_per_block

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [
    since("07"),
    subject("block_pool.py", "kv_cache.py", "prefix_cache.py", "scheduler.py"),
]

BLOCK = 4
SYSTEM = list(range(40, 40 + 37))  # a shared "system prompt": 9 full blocks and a partial one


def _prompts() -> list[list[int]]:
    """Requests that share the system prompt (whole, or only part of it), and one that doesn't."""
    return [[*SYSTEM, 100 + i, 110 + i, 120] for i in range(4)] + [
        [*SYSTEM[:22], 7, 8, 9],
        [200, 201, 202, 203, 204, 205],
        SYSTEM[:8],
    ]


class _Tokens:
    """What the KV cache manager reads of a request: its id, tokens and salt."""

    def __init__(self, request_id: str, tokens: list[int], salt: str | None = None) -> None:
        self.request_id, self.tokens, self.cache_salt = request_id, tokens, salt
        self.num_tokens = len(tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def _greedy(stage, n: int = 10):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _all_blocks_free(llm) -> bool:
    return llm.kv_manager.num_free_blocks == llm.kv_manager.allocator.num_blocks


def _engine(stage, tiny_model, make_llm, **config):
    config = {"block_size": BLOCK, **config}
    return make_llm(stage, tiny_model("llama-gqa"), **config)


def _fresh(stage, tiny_model, **config):
    """An engine of its own: these tests read its cache from a known empty start."""
    return stage.LLM(str(tiny_model("llama-gqa")), kv_cache_bytes=16 << 20, **config)


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_identical_with_caching_on_and_off(
    stage, tiny_model, make_llm, chunk, async_scheduling
):
    cached = _fresh(
        stage,
        tiny_model,
        block_size=BLOCK,
        async_scheduling=async_scheduling,
        long_prefill_token_threshold=chunk,
    )
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    prompts = _prompts()
    params = [_greedy(stage, 6 + 3 * i) for i in range(len(prompts))]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    with step_logits(cached) as recorded:
        first = cached.generate(prompts, params)  # hits among themselves, in the same steps
        again = cached.generate(prompts, params)  # hits on everything the first run published
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert_logits_match_teacher_forcing(cached, first + again, recorded)
    assert sum(o.num_cached_tokens for o in first) > 0, "the shared prompt was never hit"
    assert all(o.num_cached_tokens > 0 for o in again[:5])
    assert _all_blocks_free(cached)


def test_a_block_repeating_its_parent_is_cached_under_its_own_key(stage, tiny_model, make_llm):
    """A prompt whose blocks repeat one another: each block's K/V depend on every token before
    it, so the second copy of a block is not the first. Its key is chained to its parent's: a
    key of the tokens alone would serve the first block's K/V at the second block's place."""
    repeated = [17, 5, 99, 3]
    prompts = [repeated * 4 + [8, 9], repeated * 3 + [6]]
    params = [_greedy(stage, 8) for _ in prompts]
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    cached = _fresh(stage, tiny_model, block_size=BLOCK)
    with step_logits(cached) as recorded:
        first = cached.generate(prompts, params)
        again = cached.generate(prompts, params)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert_logits_match_teacher_forcing(cached, first + again, recorded)
    # every full block but the one holding the last token is a hit the second time
    assert [o.num_cached_tokens for o in again] == [4 * BLOCK, 3 * BLOCK]
    assert _all_blocks_free(cached)


@unit("prefix_cache.py")
def test_a_block_key_chains_its_parent_and_salt(stage):
    """Equal tokens under different parents (or salts) are different blocks: different keys.
    Equal parents, tokens and salt give the same key (the hit)."""
    prefix_cache = importlib.import_module(f"{stage.__name__}.prefix_cache")
    block_content = prefix_cache.block_content
    tokens = [1, 2, 3, 4]
    root = block_content(None, tokens)
    under_a = block_content(block_content(None, [5, 6, 7, 8]).key, tokens)
    under_b = block_content(block_content(None, [5, 6, 7, 9]).key, tokens)
    under_root = block_content(root.key, tokens)  # a block repeating its parent
    keys = [root.key, under_a.key, under_b.key, under_root.key]
    assert len(set(keys)) == 4, "a block's key must depend on its parent's key"
    assert block_content(under_a.parent, tokens) == under_a, "a key is a pure function"
    assert under_root.parent == root.key and tuple(under_root.token_ids) == tuple(tokens)
    salted = [block_content(None, tokens, salt).key for salt in ("a", "b", "")]
    assert len({root.key, *salted}) == 4, "a cache salt changes the key"
    # the salt is length-prefixed: no salt passes for more tokens, no token run for a salt
    assert block_content(None, [1, 2], "x").key != block_content(None, [1, 2, 1], "").key


def test_a_preempted_request_records_its_hit_once(stage, tiny_model, make_llm):
    """Prefix-cache statistics count each request's first admission only: a request preempted
    and admitted again (a recompute, perhaps with a larger hit) is not a new lookup."""
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    per_block = _bytes_per_block(plain, BLOCK)
    # tight: four requests of 40 tokens and 24 outputs each, all seated at once, must preempt
    model = tiny_model("llama-gqa")
    llm = stage.LLM(str(model), block_size=BLOCK, kv_cache_bytes=24 * per_block, max_num_seqs=8)
    prompts = _prompts()[:4]
    outputs = llm.generate(prompts, [_greedy(stage, 24) for _ in prompts])
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to force a preemption"
    stats = llm.prefix_cache_stats
    assert stats.requests == len(prompts)
    assert stats.queried_tokens == sum(len(p) for p in prompts)
    assert stats.hit_tokens == sum(o.num_cached_tokens for o in outputs)
    assert outputs[0].num_cached_tokens == 0  # the first found an empty cache


def test_seeded_sampling_identical_with_caching_on_and_off(stage, tiny_model, make_llm):
    params = [
        stage.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    prompts = _prompts()[:6]
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    cached = _engine(stage, tiny_model, make_llm, prefix_caching=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for _ in range(2):
        assert [o.token_ids for o in cached.generate(prompts, params)] == expected


@pytest.mark.parametrize("length", [4 * BLOCK, 4 * BLOCK + 1, 4 * BLOCK + 3])
def test_a_fully_cached_prompt_recomputes_only_what_it_must(stage, tiny_model, length):
    """The second time, every full block is a hit except one holding the last token: its
    logits are what the request samples from, so at least that token is computed."""
    llm = _fresh(stage, tiny_model, block_size=BLOCK)
    prompt = list(range(60, 60 + length))
    first = llm.generate(prompt, _greedy(stage))[0]
    steps = []
    original = llm.scheduler.schedule
    llm.scheduler.schedule = lambda: steps.append(original()) or steps[-1]
    second = llm.generate(prompt, _greedy(stage))[0]
    hit = (length - 1) // BLOCK * BLOCK
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == hit
    assert second.token_ids == first.token_ids
    opening = steps[0].requests[0]
    assert opening.num_computed_tokens == hit and opening.token_ids == tuple(prompt[hit:])
    stats = llm.prefix_cache_stats
    assert (stats.requests, stats.queried_tokens, stats.hit_tokens) == (2, 2 * length, hit)


def test_a_sharer_aborted_or_preempted_leaves_the_others_intact(stage, tiny_model, make_llm):
    """Requests share the system prompt's blocks. Aborting one mid-generation and preempting
    others on a small pool changes no survivor's output (compared with caching off), and every
    block comes back."""
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    prompts = _prompts()[:4]
    params = [_greedy(stage, 24) for _ in prompts]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    model = tiny_model("llama-gqa")
    per_block = _bytes_per_block(plain, BLOCK)
    llm = stage.LLM(  # tight; every request seated at once (the default seats fit the pool)
        str(model), block_size=BLOCK, kv_cache_bytes=24 * per_block, max_num_seqs=8
    )
    requests = [llm.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for request in requests:
        llm.add_request(request)
    for _ in range(6):
        llm.step()
    shared = llm.kv_manager.block_ids(requests[0].request_id)[:2]
    holders = [llm.kv_manager.allocator.ref_counts[b] for b in shared]
    assert min(holders) >= 2, "the system prompt's blocks were meant to be shared"
    held = set(llm.kv_manager.block_ids(requests[1].request_id))
    llm.abort_request(requests[1].request_id)
    after = [llm.kv_manager.allocator.ref_counts[b] for b in shared]
    assert after == [h - (b in held) for h, b in zip(holders, shared, strict=True)]
    while llm.has_unfinished():
        llm.step()
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to force a preemption"
    for i in (0, 2, 3):
        assert requests[i].output_token_ids == expected[i]
    assert _all_blocks_free(llm)


def _check_ledger(llm) -> None:
    """Reference counts, the free queue, the hash map and the block tables agree; every
    published block a running request holds caches exactly that request's tokens."""
    manager, allocator = llm.kv_manager, llm.kv_manager.allocator
    holders = [0] * allocator.num_blocks
    for table in manager.block_tables.values():
        for block in table:
            holders[block] += 1
    assert allocator.ref_counts == holders, "a reference count disagrees with the tables"
    for block in range(allocator.num_blocks):
        assert allocator.is_free(block) == (holders[block] == 0)
    for key, block in allocator.cached.items():
        content = allocator.contents[block]
        assert content is not None and content.key == key
    published = [b for b in range(allocator.num_blocks) if allocator.contents[b] is not None]
    assert len(published) == len(allocator.cached), "a cached block is missing from the map"
    size = manager.block_size
    for request in llm.scheduler.running:
        table = manager.block_ids(request.request_id)
        assert len(table) >= manager.blocks_needed(request.num_computed_tokens)
        for index, block in enumerate(table):
            content = allocator.contents[block]
            if content is not None:
                expected = request.token_ids_between(index * size, (index + 1) * size)
                assert list(content.token_ids) == expected, "a block caches another request's KV"


@unit("kv_cache.py")
def test_ledger_consistent_after_every_step_of_a_randomized_run(stage, tiny_model, make_llm):
    """Thousands of steps: prompts drawn from a few shared prefixes arrive at random, some are
    aborted, the pool is small enough to evict and preempt. After every step the ledger holds;
    every request that finished has the tokens of its solo run with caching off."""
    rng = random.Random(7)
    plain = _engine(stage, tiny_model, make_llm, prefix_caching=False)
    model = tiny_model("llama-gqa")
    per_block = _bytes_per_block(plain, BLOCK)
    llm = stage.LLM(str(model), block_size=BLOCK, kv_cache_bytes=30 * per_block, max_num_seqs=8)
    heads = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    requests = []
    steps = 0
    while steps < 2000:
        if rng.random() < 0.3 and len(llm.scheduler.requests) < 10:
            prompt = rng.choice(heads) + [rng.randrange(3, 250) for _ in range(rng.randrange(4))]
            if rng.random() < 0.3:
                prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
            salt = rng.choice([None, None, None, "tenant-b"])
            request = llm.make_request(
                prompt, _greedy(stage, rng.randrange(1, 24)), cache_salt=salt
            )
            llm.add_request(request)
            requests.append(request)
        if llm.scheduler.running and rng.random() < 0.03:
            llm.abort_request(rng.choice(llm.scheduler.running).request_id)
        llm.step()
        steps += 1
        _check_ledger(llm)
    while llm.has_unfinished():
        llm.step()
        _check_ledger(llm)
    assert _all_blocks_free(llm)
    allocator = llm.kv_manager.allocator
    assert allocator.num_evictions > 0 and llm.scheduler.num_preemptions > 0
    assert llm.prefix_cache_stats.hit_tokens > 0
    done = [r for r in requests if r.finish_reason == "length"]
    solo = plain.generate([r.prompt_token_ids for r in done], [r.params for r in done])
    for request, alone in zip(done, solo, strict=True):
        assert request.output_token_ids == alone.token_ids, request.request_id


def test_different_cache_salts_never_share(stage, tiny_model):
    llm = _fresh(stage, tiny_model, block_size=BLOCK)
    prompt = [*SYSTEM, 1, 2, 3]

    def cached(salt):
        request = llm.make_request(prompt, _greedy(stage, 2), cache_salt=salt)
        return llm.run(request).num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0 and cached("tenant-b") > 0 and cached(None) > 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.make_request(prompt, _greedy(stage), cache_salt="")


@unit("kv_cache.py")
def test_colliding_keys_never_alias_a_block(stage, monkeypatch):
    """Every block's key made equal: the content kept beside it still refuses false hits."""
    kv_cache = importlib.import_module(f"{stage.__name__}.kv_cache")
    prefix_cache = importlib.import_module(f"{stage.__name__}.prefix_cache")
    original = prefix_cache.block_content

    def colliding(parent, token_ids, salt=None):
        content = original(parent, token_ids, salt)
        return prefix_cache.BlockContent(b"same", parent, content.token_ids, content.salt)

    monkeypatch.setattr(kv_cache, "block_content", colliding)
    manager = stage.KVCacheManager(num_blocks=8, block_size=2)

    a, b = _Tokens("a", [1, 2, 3, 4, 5]), _Tokens("b", [1, 2, 9, 9, 5])
    assert manager.allocate_slots("a", 5, manager.find_cached_prefix(a))
    manager.cache_blocks(a, 5)
    assert manager.find_cached_prefix(b) == [manager.block_ids("a")[0]]  # [1, 2] is shared
    assert manager.find_cached_prefix(_Tokens("c", [7, 7, 3, 4, 5])) == []


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
def _modules(stage):
    block_pool = importlib.import_module(f"{stage.__name__}.block_pool")
    return block_pool, importlib.import_module(f"{stage.__name__}.prefix_cache")


@unit("block_pool.py")
def test_free_drops_one_holder_and_queues_an_unheld_block_at_the_back(stage):
    """BlockAllocator.free alone (holders taken with `touch`): a block joins the back of the
    free queue, in the order given, when its last holder lets go; it keeps its content; a
    block nobody holds cannot be freed."""
    block_pool, prefix_cache = _modules(stage)
    allocator = block_pool.BlockAllocator(4)
    allocator.touch([0, 1, 2])
    allocator.touch([1])  # block 1 has two holders
    content = prefix_cache.block_content(None, [1, 2])
    allocator.cache(2, content)
    allocator.free([2, 1, 0])  # a request lets go tail first
    assert allocator.ref_counts == [0, 1, 0, 0]
    assert [allocator.is_free(b) for b in range(4)] == [True, False, True, True]
    assert list(allocator._free) == [3, 2, 0], "the free queue, least recently freed first"
    assert allocator.lookup(content) == 2, "a freed block keeps its content: still a hit"
    allocator.free([1])
    assert list(allocator._free) == [3, 2, 0, 1] and allocator.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([1])  # a double free
    assert allocator.ref_counts == [0, 0, 0, 0] and allocator.num_free == 4


@unit("block_pool.py")
def test_allocate_takes_the_least_recently_freed_block_and_evicts_its_content(stage):
    """BlockAllocator.allocate alone: the front of the free queue, its cached content dropped
    only now (lazy eviction, counted), and a clear error when every block is in use."""
    block_pool, prefix_cache = _modules(stage)
    allocator = block_pool.BlockAllocator(3)
    allocator.touch([0, 1, 2])
    content = prefix_cache.block_content(None, [1, 2])
    allocator.cache(1, content)
    allocator.free([2, 1, 0])  # queue: 2, 1, 0
    assert allocator.allocate() == 2 and allocator.num_evictions == 0
    assert allocator.lookup(content) == 1, "not evicted before it is handed out"
    assert allocator.allocate() == 1
    assert allocator.num_evictions == 1 and allocator.contents[1] is None
    assert allocator.lookup(content) is None and content.key not in allocator.cached
    assert allocator.ref_counts == [0, 1, 1] and allocator.num_free == 1
    assert allocator.allocate() == 0 and allocator.num_free == 0
    with pytest.raises(block_pool.OutOfBlocksError, match="KV cache is full"):
        allocator.allocate()


@unit("kv_cache.py")
def test_allocate_slots_takes_hits_first_all_or_nothing(stage):
    """KVCacheManager.allocate_slots alone: a table starts from the hit blocks (shared, not
    copied; a free one revived counts against the free blocks), the rest is allocated, and a
    request that cannot have every block gets none."""
    manager = stage.KVCacheManager(num_blocks=6, block_size=2)
    allocator = manager.allocator
    assert manager.allocate_slots("a", 5)
    head, second, _ = manager.block_ids("a")
    manager.free("a")  # every block free again; the queue ends tail, second, head
    hit = [head, second]
    assert not manager.allocate_slots("b", 14, hit)  # 2 hits + 5 new > 6 free blocks
    assert manager.block_ids("b") == [] and allocator.num_free == 6
    assert allocator.ref_counts == [0] * 6, "all or nothing: a refusal takes no block"
    assert manager.allocate_slots("b", 12, hit)  # 2 revived + 4 new == 6
    table = manager.block_ids("b")
    assert table[:2] == hit and len(set(table)) == 6 and allocator.num_free == 0
    assert allocator.ref_counts == [1] * 6
    assert not manager.allocate_slots("b", 13) and manager.block_ids("b") == table
    assert manager.allocate_slots("c", 4, hit[:1]) is False  # a held hit is shared: 1 new
    manager.free("b")
    assert manager.allocate_slots("c", 4, hit[:1])
    assert manager.block_ids("c")[0] == head and allocator.ref_counts[head] == 1


@unit("kv_cache.py")
def test_cache_blocks_publishes_full_known_blocks_under_chained_keys(stage):
    """KVCacheManager.cache_blocks alone: once a step computes them, each full block of known
    tokens is published under its chained key (the salt in the first); a partial block, or
    one whose last token is still in flight, is not."""
    _, prefix_cache = _modules(stage)
    block_content = prefix_cache.block_content
    manager = stage.KVCacheManager(num_blocks=8, block_size=2)
    allocator = manager.allocator
    a = _Tokens("a", [1, 2, 3, 4, 5])
    assert manager.allocate_slots("a", 5)
    table = manager.block_ids("a")
    first = block_content(None, [1, 2])
    second = block_content(first.key, [3, 4])
    manager.cache_blocks(a, 3)
    assert allocator.cached == {first.key: table[0]} and allocator.contents[table[0]] == first
    manager.cache_blocks(a, 5)
    assert allocator.cached == {first.key: table[0], second.key: table[1]}
    assert allocator.contents[table[1]] == second and allocator.contents[table[2]] is None
    assert manager.allocate_slots("a", 6)  # a step computes [5] and the token in flight
    manager.cache_blocks(a, 6)
    assert allocator.contents[table[2]] is None, "a token the host does not know yet"
    salted = _Tokens("s", [1, 2, 3], "tenant")
    assert manager.allocate_slots("s", 3)
    manager.cache_blocks(salted, 3)
    key = block_content(None, [1, 2], "tenant").key
    assert allocator.cached[key] == manager.block_ids("s")[0] and len(allocator.cached) == 3


@unit("kv_cache.py")
def test_find_cached_prefix_stops_at_the_first_miss_and_before_the_last_token(stage):
    """KVCacheManager.find_cached_prefix (blocks published with allocate_slots and
    cache_blocks): the leading run of cached full blocks, never the one holding the last
    token; another salt, or caching off, finds nothing."""
    manager = stage.KVCacheManager(num_blocks=8, block_size=2)
    a = _Tokens("a", [1, 2, 3, 4, 5, 6])
    assert manager.allocate_slots("a", 6)
    manager.cache_blocks(a, 6)
    table = manager.block_ids("a")
    assert manager.find_cached_prefix(_Tokens("b", [1, 2, 3, 4, 9])) == table[:2]
    assert manager.find_cached_prefix(_Tokens("c", [1, 2, 3, 4, 5, 6])) == table[:2]
    assert manager.find_cached_prefix(_Tokens("d", [1, 2, 3, 4, 5, 6, 7])) == table
    assert manager.find_cached_prefix(_Tokens("e", [9, 9, 3, 4, 5, 6, 7])) == []
    assert manager.find_cached_prefix(_Tokens("f", [1, 2, 9, 9, 5, 6, 7])) == table[:1]
    assert manager.find_cached_prefix(_Tokens("g", [1, 2, 3, 4, 5, 6, 7], "x")) == []
    off = stage.KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    assert off.allocate_slots("a", 6)
    off.cache_blocks(a, 6)
    assert off.find_cached_prefix(_Tokens("d", [1, 2, 3, 4, 5, 6, 7])) == []


@unit("kv_cache.py")
def test_free_queue_is_lru_with_tails_first_and_hits_revive_free_blocks(stage):
    manager = stage.KVCacheManager(num_blocks=6, block_size=2)

    a = _Tokens("a", [1, 2, 3, 4, 5, 6, 7])
    assert manager.allocate_slots("a", 7)
    manager.cache_blocks(a, 7)
    head, second, third, tail = manager.block_ids("a")
    manager.free("a")  # tail first: tail, third, second, head join the queue in that order
    allocator = manager.allocator
    assert allocator.num_free == 6 and len(allocator.cached) == 3
    again = _Tokens("a2", [1, 2, 3, 4, 8])
    hit = manager.find_cached_prefix(again)
    assert hit == [head, second]
    assert manager.allocate_slots("a2", 5, hit)  # the hits leave the free queue
    assert allocator.ref_counts[head] == 1 and not allocator.is_free(head)
    assert allocator.num_free == 3
    assert manager.allocate_slots("b", 4)  # the never used block, then the oldest freed: tail
    assert manager.block_ids("b") == [5, tail] and allocator.num_evictions == 0  # held nothing
    assert manager.allocate_slots("c", 1)  # next oldest: the third block, cached until now
    assert manager.block_ids("c") == [third] and allocator.num_evictions == 1
    assert allocator.contents[third] is None and len(allocator.cached) == 2
    manager.free("c")
    manager.free("b")
    manager.free("a2")
    assert allocator.num_free == 6


def test_http_usage_reports_cached_prompt_tokens(stage, tiny_model, live_server):
    server, _ = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    body = {"prompt": "the same long system prompt, " * 4, "max_tokens": 3, "temperature": 0}
    url = f"{server.url}/v1/completions"
    first = httpx.post(url, json=body, timeout=60).json()["usage"]
    second = httpx.post(url, json=body, timeout=60).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert first["prompt_tokens"] == second["prompt_tokens"]
    salted = httpx.post(url, json={**body, "cache_salt": "fresh-tenant"}, timeout=60).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    streamed = httpx.post(
        url,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ).text
    assert '"cached_tokens"' in streamed
    bad = httpx.post(url, json={**body, "cache_salt": ""}, timeout=60)
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["prefix_cache"]["hit_tokens"] > 0
