"""Stage 10 promises, the router: where a request goes, and what the router knows to decide it.

One regression test per failure a public router shipped: a miss routed to the replica with the
smallest cache whatever its load (sglang #14305); imbalance mode throwing away cache affinity
(sglang #32195); load counted on one path only, so every request went to one engine
(vllm-project/router #179); ties broken by index, pinning replica 0. Then the router's view of a
replica's cache: replaying a real engine's KV events gives exactly the keys its allocator
holds, after a randomized run with evictions, and the router hashes a prompt into exactly the
engine's block keys (salt included). Last, the offline simulation: cache-aware routing finds at
least twice round-robin's prefix hits on a multi-tenant workload.
"""

from __future__ import annotations

import importlib
import pickle
import random
from collections import Counter
from types import ModuleType

import pytest

from stages.common.tooling import routing_sim

from .conftest import since, unit
from .test_03_paged import _bytes_per_block

pytestmark = since("10")

BLOCK = 4


def _router_module(stage: ModuleType) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.frontend.router")


def _router(stage: ModuleType, replicas: int = 3, policy: str = "cache_aware", **options):
    return _router_module(stage).Router(replicas, policy, BLOCK, **options)


def _event(stage: ModuleType, kind: str, key: bytes):
    return importlib.import_module(f"{stage.__name__}.block_pool").KVEvent(kind, key)


def _hold(stage: ModuleType, router, replica: int, tokens: list[int], salt=None) -> None:
    """Tell the router that `replica` caches every full block of `tokens` (as its events
    would). One token more makes `prompt_block_keys` cover the last full block too."""
    keys = _router_module(stage).prompt_block_keys([*tokens, 0], BLOCK, salt)
    router.apply_events(replica, [_event(stage, "stored", key) for key in keys])


def _prompt(seed: int, length: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _greedy(stage: ModuleType, n: int):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ------------------------------------------------------------------------------- the basics
@unit("frontend/router.py")
def test_round_robin_and_least_loaded_basics(stage):
    rr = _router(stage, 3, "round_robin")
    assert [rr.route(_prompt(i)) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    least = _router(stage, 3, "least_loaded")
    least.replicas[0].load, least.replicas[1].load = 2, 1
    assert least.route(_prompt(0)) == 2  # the idle one
    assert least.route(_prompt(1)) == 1  # now 2, 1, 1: the tie goes by requests served
    assert least.stats()["replicas"][2]["load"] >= 1
    with pytest.raises(ValueError, match="policy"):
        _router(stage, 2, "random")


@unit("frontend/router.py")
def test_a_hit_goes_to_the_replica_holding_the_longest_prefix(stage):
    router = _router(stage, 3)
    prompt = _prompt(1)
    _hold(stage, router, 1, prompt[:16])  # a third of the prompt: under the threshold
    _hold(stage, router, 2, prompt[:36])
    assert router.route(prompt) == 2
    assert router.last_decision.reason == "cache_hit"
    assert router.last_decision.matched_tokens == 36  # 9 full blocks of 41 tokens
    other_salt = router.route(prompt, "tenant-b")  # the same tokens under a salt: a miss
    assert router.last_decision.reason == "least_loaded" and other_salt != 2
    short = _router(stage, 3)
    _hold(stage, short, 1, prompt[:16])  # 16 of 41 tokens: not above cache_threshold (0.5)
    assert short.route(prompt) == 0 and short.last_decision.reason == "least_loaded"


# ---------------------------------------------------------------------- shipped failures
@unit("frontend/router.py")
def test_a_miss_routes_by_load_not_to_the_smallest_cache(stage):
    """sglang #14305: an overloaded replica evicts its cache, has the smallest cache, gets every
    miss, evicts more. A miss must go to the least loaded replica."""
    router = _router(stage, 3)
    for replica in (1, 2):
        for seed in range(10 * replica):
            _hold(stage, router, replica, _prompt(100 + seed))
    router.replicas[0].load = 6  # busy, and its cache (empty) is the smallest
    router.replicas[2].load = 1
    misses = [router.route(_prompt(1000 + i)) for i in range(8)]
    assert misses == [1, 2, 1, 2, 1, 2, 1, 2]  # loads 6/0/1 -> 6/4/5: never the busy one


@unit("frontend/router.py")
def test_imbalance_mode_still_prefers_a_cache_hit_among_the_lightly_loaded(stage):
    """sglang #32195: once loads are imbalanced, the router went to the least loaded replica
    even when a lightly loaded one held the prefix. Only the overloaded are left out."""
    router = _router(stage, 3)
    prompt = _prompt(2)
    _hold(stage, router, 0, prompt)
    _hold(stage, router, 2, prompt)
    router.replicas[0].load, router.replicas[1].load, router.replicas[2].load = 50, 0, 5
    assert router.route(prompt) == 2  # not 1 (least loaded), not 0 (overloaded)
    assert router.last_decision.imbalanced and router.last_decision.reason == "cache_hit"
    # Only the overloaded replica holds it: the request goes by load.
    other = _prompt(3)
    _hold(stage, router, 0, other)
    assert router.route(other) == 1 and router.last_decision.imbalanced
    # Balanced again (50 vs 20 and 20): the hit wins over load.
    router.replicas[1].load = router.replicas[2].load = 20
    assert router.route(other) == 0 and not router.last_decision.imbalanced


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
@unit("frontend/router.py")
def test_load_is_counted_on_every_path(stage, policy):
    """vllm-project/router #179: load counted on one admission path only, so every request
    looked like the first and went to one engine. `route` itself counts, whatever happens to
    the request after; one `finished` gives it back however the request ends."""
    router = _router(stage, 2, policy)
    prompt = _prompt(4)
    chosen = [router.route(prompt) for _ in range(6)]  # nothing finishes
    assert [r.load for r in router.replicas] == [3, 3] and Counter(chosen) == {0: 3, 1: 3}
    for replica in chosen:  # finished, aborted, refused by the replica: one `finished` each
        router.finished(replica)
    assert [r.load for r in router.replicas] == [0, 0]
    with pytest.raises(ValueError, match="never routed"):
        router.finished(0)
    replica = router.route(prompt)
    with pytest.raises(RuntimeError, match="refused"):
        try:
            assert router.replicas[replica].load == 1
            raise RuntimeError("the replica refused the request")
        finally:
            router.finished(replica)
    assert [r.load for r in router.replicas] == [0, 0]
    assert sum(r.served for r in router.replicas) == 7


@unit("frontend/router.py")
def test_cache_hits_count_load_until_the_imbalance_rule_moves_requests(stage):
    """The cache-hit path counts load too: a hot prefix stays on its replica only until that
    replica is over both thresholds, then the next request goes elsewhere."""
    router = _router(stage, 2, balance_abs_threshold=8, balance_rel_threshold=1.5)
    prompt = _prompt(5)
    first = router.route(prompt)
    _hold(stage, router, first, prompt)
    chosen = [router.route(prompt) for _ in range(12)]
    assert chosen[:8] == [first] * 8  # loads 9 vs 0: over 8 and over 1.5 x 0
    assert chosen[8] == 1 - first and router.last_decision is not None


@pytest.mark.parametrize("policy", ["least_loaded", "cache_aware"])
@unit("frontend/router.py")
def test_ties_do_not_pin_replica_0(stage, policy):
    """An idle system (every request done before the next) has equal loads every time: ties
    broken by index alone would send everything to replica 0."""
    router = _router(stage, 4, policy)
    chosen = []
    for i in range(40):
        replica = router.route(_prompt(200 + i))
        chosen.append(replica)
        router.finished(replica)
    assert Counter(chosen) == {0: 10, 1: 10, 2: 10, 3: 10}


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
@unit("frontend/router.py")
def test_a_dead_replica_gets_nothing(stage, policy):
    router = _router(stage, 3, policy)
    prompt = _prompt(6)
    _hold(stage, router, 1, prompt)
    router.replicas[1].load = 2  # in flight when it died: the front end fails them later
    router.mark_dead(1)
    _hold(stage, router, 1, prompt)  # a late event from the dead replica is dropped
    chosen = [router.route(prompt if i % 2 else _prompt(300 + i)) for i in range(30)]
    assert 1 not in chosen and set(chosen) == {0, 2}
    assert router.stats()["replicas"][1] == {
        "index": 1,
        "alive": False,
        "load": 2,
        "served": 0,
        "cached_blocks": 0,
    }
    router.finished(1)  # its requests fail: the load goes back
    router.mark_dead(0)
    router.mark_dead(2)
    with pytest.raises(_router_module(stage).NoReplicaAliveError, match="no replica is alive"):
        router.route(prompt)


# ----------------------------------------------------------------------- KV events
@unit("kv_cache.py")
def test_kv_events_record_stored_and_evicted_keys_in_order(stage):
    kv_cache = importlib.import_module(f"{stage.__name__}.kv_cache")
    block_pool = importlib.import_module(f"{stage.__name__}.block_pool")
    prefix_cache = importlib.import_module(f"{stage.__name__}.prefix_cache")
    quiet = kv_cache.KVCacheManager(4, BLOCK)
    assert quiet.allocator.events is None and quiet.drain_kv_events() == []
    allocator = block_pool.BlockAllocator(2, record_events=True)
    first, second = allocator.allocate(), allocator.allocate()
    a = prefix_cache.block_content(None, [1, 2, 3, 4])
    b = prefix_cache.block_content(None, [5, 6, 7, 8], "salt")
    allocator.cache(first, a)
    allocator.cache(second, a)  # the same content twice: the first copy stays, no event
    allocator.free([first, second])
    allocator.allocate()  # `first` is reused: its key goes
    allocator.cache(second, b)
    stored, evicted = "stored", "evicted"
    assert allocator.events == [
        block_pool.KVEvent(stored, a.key),
        block_pool.KVEvent(evicted, a.key),
        block_pool.KVEvent(stored, b.key),
    ]
    assert pickle.loads(pickle.dumps(allocator.events)) == allocator.events


def _apply_and_compare(router, llm) -> None:
    router.apply_events(0, llm.kv_manager.drain_kv_events())
    assert router.replicas[0].cached == set(llm.kv_manager.allocator.cached)


@unit("engine.py")
def test_events_from_a_real_engine_mirror_its_cache_through_evictions(stage, tiny_model, make_llm):
    """A randomized run on a pool small enough to evict and preempt: after every step, the
    router's set for the replica (its events replayed) equals the allocator's cached keys."""
    model = str(tiny_model("llama-gqa"))
    probe = make_llm(stage, model, block_size=BLOCK)
    per_block = _bytes_per_block(probe, BLOCK)
    assert probe.kv_manager.drain_kv_events() == []  # off by default
    llm = stage.LLM(
        model, block_size=BLOCK, kv_cache_bytes=30 * per_block, max_num_seqs=6, kv_events=True
    )
    router = _router(stage, 1)
    rng = random.Random(10)
    heads = [[rng.randrange(3, 250) for _ in range(rng.randrange(6, 30))] for _ in range(4)]
    for _ in range(400):
        if rng.random() < 0.3 and len(llm.scheduler.requests) < 8:
            prompt = rng.choice(heads) + [rng.randrange(3, 250) for _ in range(rng.randrange(4))]
            salt = rng.choice([None, None, "tenant-b"])
            params = _greedy(stage, rng.randrange(1, 16))
            llm.add_request(llm.make_request(prompt, params, cache_salt=salt))
        if llm.scheduler.running and rng.random() < 0.03:
            llm.abort_request(rng.choice(llm.scheduler.running).request_id)
        llm.step()
        _apply_and_compare(router, llm)
    while llm.has_unfinished():
        llm.step()
        _apply_and_compare(router, llm)
    assert llm.kv_manager.allocator.num_evictions > 0
    assert llm.prefix_cache_stats.hit_tokens > 0


@unit("engine.py")
def test_the_router_hashes_a_prompt_into_the_engine_block_keys(stage, tiny_model):
    llm = stage.LLM(
        str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=16 << 20, kv_events=True
    )
    keys_of = _router_module(stage).prompt_block_keys
    prompt = _prompt(7, 22)  # 5 blocks the engine can look up, then the last token's block
    seen = {}
    for salt in (None, "tenant-a", "tenant-b"):
        llm.kv_manager.drain_kv_events()
        llm.run(llm.make_request(prompt, _greedy(stage, 2), cache_salt=salt))
        stored = [e.block_hash for e in llm.kv_manager.drain_kv_events() if e.kind == "stored"]
        assert len(keys_of(prompt, BLOCK, salt)) == 5
        assert stored[:5] == keys_of(prompt, BLOCK, salt)
        seen[salt] = set(stored[:5])
        again = llm.run(llm.make_request(prompt, _greedy(stage, 2), cache_salt=salt))
        assert again.num_cached_tokens == 5 * BLOCK  # the same salt: the same keys, all hits
    assert not (seen[None] & seen["tenant-a"] or seen["tenant-a"] & seen["tenant-b"])


# ------------------------------------------------------------------------- the simulation
@unit("frontend/router.py")  # with its block pool; stage 12 changes both the pool and the cache
def test_simulated_cache_aware_hits_at_least_twice_round_robin(stage):
    """stages/common/tooling/routing_sim.py drives this stage's own router and KV cache managers."""
    workload = routing_sim.shared_prefix_workload(num_requests=300, salted=True, seed=3)
    results = {r.policy: r for r in routing_sim.compare(workload, stage=stage)}
    assert set(results) == {"round_robin", "least_loaded", "cache_aware"}
    for result in results.values():
        assert sum(result.served) == len(workload)
        assert result.prompt_tokens == sum(len(r.token_ids) for r in workload)
    assert results["round_robin"].hit_rate > 0
    assert results["cache_aware"].hit_rate >= 2 * results["round_robin"].hit_rate
