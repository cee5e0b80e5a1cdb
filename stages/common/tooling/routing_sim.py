"""Routing policies compared offline: no model, only the replicas' real prefix-cache ledgers.

Each simulated replica is a `KVCacheManager` (the engine's own: same LRU free queue, same
chained keys, same KV events), and the router sees only those events. A request is routed,
looks its prefix up in its replica's cache, takes blocks for the rest, publishes them and
stays in flight until `concurrency` newer requests have arrived; then it finishes and frees
its blocks (they stay cached until the pool needs them). Compute is not modelled: the hit rate
is the share of prompt tokens a replica did not have to compute.

The workload is multi-tenant: a few long system prompts, many users each tied to one of them
with a short context of their own, and a fresh question per request. A replica's pool holds a
few tenants, not all of them: round-robin sends every tenant everywhere and the caches churn;
cache-aware keeps a tenant where its prefix lives.

A harness, not the engine: it drives the router and the KV cache manager of the stage it is
given (10, where routing appears, by default; any later stage has them too), and no engine
module imports it.

    python -m stages.common.tooling.routing_sim [STAGE]
"""

from __future__ import annotations

import importlib
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import stages

DEFAULT_STAGE = "10"  # the first stage with a router


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A prompt as the KV cache manager reads it: id, tokens, salt."""

    request_id: str
    token_ids: tuple[int, ...]
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return list(self.token_ids[start:end])


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's run: prompt tokens, the share found cached, and where requests went."""

    policy: str
    prompt_tokens: int
    hit_tokens: int
    served: tuple[int, ...]  # requests per replica
    computed_tokens: tuple[int, ...]  # prompt tokens each replica had to compute

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def shared_prefix_workload(
    *,
    num_system_prompts: int = 8,
    num_users: int = 64,
    num_requests: int = 400,
    system_tokens: int = 384,
    user_tokens: int = 32,
    question_tokens: int = 16,
    salted: bool = False,
    seed: int = 0,
) -> list[SimRequest]:
    """Requests of the form system prompt (one per tenant) + the user's context + a fresh
    question; users pick at random. With `salted`, each tenant's requests carry its own salt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(n)]

    systems = [tokens(system_tokens) for _ in range(num_system_prompts)]
    users = [(rng.randrange(num_system_prompts), tokens(user_tokens)) for _ in range(num_users)]
    requests = []
    for i in range(num_requests):
        tenant, context = users[rng.randrange(num_users)]
        prompt = (*systems[tenant], *context, *tokens(question_tokens))
        requests.append(SimRequest(f"sim-{i}", prompt, f"tenant-{tenant}" if salted else None))
    return requests


def _stage_modules(stage: str | ModuleType) -> tuple[ModuleType, ModuleType]:
    """The stage's router.py and kv_cache.py (`stage`: a number, or a loaded stage package)."""
    package = stage if isinstance(stage, ModuleType) else stages.load(stage)
    router = importlib.import_module(f"{package.__name__}.frontend.router")
    return router, importlib.import_module(f"{package.__name__}.kv_cache")


def simulate(
    policy: str,
    workload: Sequence[SimRequest],
    *,
    stage: str | ModuleType = DEFAULT_STAGE,
    num_replicas: int = 4,
    blocks_per_replica: int = 80,
    block_size: int = 16,
    concurrency: int = 16,
) -> SimResult:
    """Route `workload` in order over `num_replicas` simulated replicas of `stage`'s engine;
    see the module doc."""
    router_module, kv_cache = _stage_modules(stage)
    router = router_module.Router(num_replicas, policy, block_size)
    caches = [
        kv_cache.KVCacheManager(blocks_per_replica, block_size, kv_events=True)
        for _ in range(num_replicas)
    ]
    in_flight: deque[tuple[int, SimRequest]] = deque()
    computed = [0] * num_replicas
    prompt_tokens = hit_tokens = 0

    def finish_oldest() -> None:
        replica, request = in_flight.popleft()
        caches[replica].free(request.request_id)
        router.finished(replica)

    for request in workload:
        while len(in_flight) >= concurrency:
            finish_oldest()
        replica = router.route(request.token_ids, request.cache_salt)
        cache = caches[replica]
        hits = cache.find_cached_prefix(request)
        while not cache.allocate_slots(request.request_id, request.num_tokens, hits):
            if not in_flight:
                raise ValueError(
                    f"one request needs more than blocks_per_replica={blocks_per_replica}"
                )
            finish_oldest()  # the pool is full: wait for the oldest request to end
        cache.cache_blocks(request, request.num_tokens)
        router.apply_events(replica, cache.drain_kv_events())
        hit = len(hits) * block_size
        prompt_tokens += request.num_tokens
        hit_tokens += hit
        computed[replica] += request.num_tokens - hit
        in_flight.append((replica, request))
    while in_flight:
        finish_oldest()
    served = tuple(r.served for r in router.replicas)
    return SimResult(policy, prompt_tokens, hit_tokens, served, tuple(computed))


def compare(
    workload: Sequence[SimRequest] | None = None,
    *,
    stage: str | ModuleType = DEFAULT_STAGE,
    **options: int,
) -> list[SimResult]:
    """Every policy of `stage`'s router on the same workload (the default one when none is
    given)."""
    requests = workload if workload is not None else shared_prefix_workload()
    policies = _stage_modules(stage)[0].POLICIES
    return [simulate(policy, requests, stage=stage, **options) for policy in policies]


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    for result in compare(stage=args[0] if args else DEFAULT_STAGE):
        print(
            f"{result.policy:>13}: prefix hit rate {result.hit_rate:6.1%}, "
            f"requests per replica {list(result.served)}, "
            f"computed tokens per replica {list(result.computed_tokens)}"
        )


if __name__ == "__main__":
    main()
