"""The router: which of several engine replicas gets a request.

Data parallelism runs `data_parallel_size` copies of the engine, each with its own KV cache. A
request can be served by any of them, but only the replica that already holds its prefix can
skip computing it. The router is pure bookkeeping, no processes: the front end asks `route`,
tells `finished` when the request ends, and feeds it each replica's KV events.

Three policies:
- `round_robin`: the next live replica in turn. Blind to load and to caches.
- `least_loaded`: the replica with the fewest requests in flight.
- `cache_aware` (SGLang's router, with the fixes its users needed): when the loads are
  balanced, the replica holding the longest cached prefix of the prompt, if that prefix is more
  than `cache_threshold` of it; on a miss, the least loaded replica. When the loads are
  imbalanced (max - min > `balance_abs_threshold` and max > min * `balance_rel_threshold`), the
  overloaded replicas are left out and the same rule runs over the rest.

What a replica holds is known exactly, not guessed: each replica reports the block keys its
prefix cache stores and evicts (`block_pool.KVEvent`), and the router hashes a prompt with the
same chained SHA-256 (`prefix_cache.block_content`, salt included). SGLang's router instead
keeps an approximate tree of the text it routed; Dynamo's KV router uses events, as here.

Bugs public routers shipped, and the rule here that avoids each:
- On a miss, routing to the replica with the smallest cache, whatever its load: one replica
  took every new prefix (sglang #14305). Here a miss goes to the least loaded.
- Imbalance mode dropping cache affinity altogether (sglang #32195). Here it only drops the
  overloaded replicas.
- Load counted on one admission path only, so every request looked like the first and went to
  one engine (vllm-project/router #179). Here `route` itself counts the request.
- Ties broken by index: replica 0 took every request of an idle system. Here ties go by
  (load, requests served, index).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..block_pool import KVEvent
from ..prefix_cache import BlockKey, block_content

Policy = Literal["round_robin", "least_loaded", "cache_aware"]
POLICIES: tuple[str, ...] = get_args(Policy)


class NoReplicaAliveError(RuntimeError):
    """Every replica has been marked dead: nothing can serve a request."""


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockKey]:
    """The chained keys of the prompt's blocks a replica could serve from its cache: the full
    blocks before the one holding the last token (the engine computes that token's logits, so
    it never looks that far; `KVCacheManager.find_cached_prefix`). The salt goes into the
    first block's key, as in the engine, so different salts never match."""
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for index in range((len(token_ids) - 1) // block_size):
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        parent = block_content(parent, tokens, None if index else cache_salt).key
        keys.append(parent)
    return keys


@dataclass
class ReplicaState:
    """What the router knows of one replica."""

    index: int
    load: int = 0  # requests routed here and not yet finished
    served: int = 0  # requests ever routed here
    alive: bool = True
    cached: set[BlockKey] = field(default_factory=set)  # from its KV events

    def matched_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of the leading keys this replica holds, up to the first it does not."""
        return next((n for n, key in enumerate(keys) if key not in self.cached), len(keys))


@dataclass(frozen=True, slots=True)
class Decision:
    """One routing decision and why (for stats and notebooks)."""

    replica: int
    reason: Literal["round_robin", "least_loaded", "cache_hit"]
    matched_tokens: int  # prompt tokens the chosen replica holds (cache_aware; else 0)
    imbalanced: bool = False  # cache_aware: the loads were over both thresholds


class Router:
    """Chooses a replica per request and counts what it routed. Not thread-safe: one caller
    (the front end's event loop) at a time."""

    def __init__(
        self,
        num_replicas: int,
        policy: Policy = "cache_aware",
        block_size: int = 16,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("need balance_abs_threshold >= 0 and balance_rel_threshold >= 1")
        self.policy: Policy = policy
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.replicas = [ReplicaState(i) for i in range(num_replicas)]
        self._next = 0  # round_robin's cursor
        self.decisions: Counter[str] = Counter()
        self.last_decision: Decision | None = None

    # ------------------------------------------------------------------ the front end's calls
    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The replica for a request, counted as admitted there: its load goes up by one now,
        whatever happens to the request next. Every outcome (finished, aborted, refused by
        the replica, failed) must end with one `finished(replica)` (DPClient: `_retire`)."""
        alive = [r for r in self.replicas if r.alive]
        if not alive:
            raise NoReplicaAliveError(
                f"no replica is alive (all {len(self.replicas)} were marked dead)"
            )
        if self.policy == "round_robin":
            decision = self._round_robin()
        elif self.policy == "least_loaded":
            decision = Decision(_least_loaded(alive).index, "least_loaded", 0)
        else:
            decision = self._cache_aware(alive, token_ids, cache_salt)
        chosen = self.replicas[decision.replica]
        chosen.load += 1
        chosen.served += 1
        self.decisions[decision.reason] += 1
        self.decisions["imbalanced"] += decision.imbalanced
        self.last_decision = decision
        return decision.replica

    def finished(self, replica: int) -> None:
        """A request routed to `replica` is over (any way it ended, the replica dead or not)."""
        state = self.replicas[replica]
        if state.load <= 0:
            raise ValueError(f"replica {replica} finished a request it was never routed")
        state.load -= 1

    def apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        """Replay a replica's KV events, in the order it recorded them. A dead replica's late
        events are dropped: its cache died with it."""
        state = self.replicas[replica]
        if not state.alive:
            return
        for event in events:
            if event.kind == "stored":
                state.cached.add(event.block_hash)
            elif event.kind == "evicted":
                state.cached.discard(event.block_hash)
            else:
                raise ValueError(f"unknown KV event kind {event.kind!r}")

    def mark_dead(self, replica: int) -> None:
        """Take a replica out of the rotation for good and forget its cache. Its load stays
        until the front end fails its in-flight requests (one `finished` each)."""
        state = self.replicas[replica]
        state.alive = False
        state.cached.clear()

    def stats(self) -> dict[str, Any]:
        """A small summary for /health and the bench."""
        return {
            "policy": self.policy,
            "replicas": [
                {
                    "index": r.index,
                    "alive": r.alive,
                    "load": r.load,
                    "served": r.served,
                    "cached_blocks": len(r.cached),
                }
                for r in self.replicas
            ],
            "decisions": dict(self.decisions),
        }

    # ------------------------------------------------------------------------- the policies
    def _round_robin(self) -> Decision:
        count = len(self.replicas)
        for step in range(count):
            index = (self._next + step) % count
            if self.replicas[index].alive:
                self._next = index + 1
                return Decision(index, "round_robin", 0)
        raise AssertionError("route checked that a replica is alive")

    def _overloaded(self, load: int, lowest: int) -> bool:
        """Both of SGLang's thresholds, against the least loaded live replica."""
        return (
            load - lowest > self.balance_abs_threshold
            and load > lowest * self.balance_rel_threshold
        )

    def _cache_aware(
        self, alive: list[ReplicaState], token_ids: Sequence[int], cache_salt: str | None
    ) -> Decision:
        """SGLang's rule, fixed: leave out the replicas over both balance thresholds; among
        the rest, the longest cached prefix if it covers more than `cache_threshold` of the
        prompt, else the least loaded (ties by load, requests served, index)."""
        lowest = min(r.load for r in alive)
        imbalanced = self._overloaded(max(r.load for r in alive), lowest)
        # Imbalanced: leave out the overloaded, keep the cache rule among the rest (the least
        # loaded replica is always among them).
        candidates = [r for r in alive if not self._overloaded(r.load, lowest)]
        keys = prompt_block_keys(token_ids, self.block_size, cache_salt)
        best = max(candidates, key=lambda r: (r.matched_blocks(keys), *_tie_break(r)))
        matched = best.matched_blocks(keys) * self.block_size
        if token_ids and matched / len(token_ids) > self.cache_threshold:
            return Decision(best.index, "cache_hit", matched, imbalanced)
        # A miss goes by load, never to the "smallest cache" (the death spiral).
        target = _least_loaded(candidates)
        return Decision(
            target.index, "least_loaded", target.matched_blocks(keys) * self.block_size, imbalanced
        )


def _tie_break(replica: ReplicaState) -> tuple[int, int, int]:
    """Larger is better: lower load, then fewer served, then lower index."""
    return (-replica.load, -replica.served, -replica.index)


def _least_loaded(replicas: Iterable[ReplicaState]) -> ReplicaState:
    """The replica with the smallest (load, requests served, index): an idle system spreads
    its requests instead of pinning replica 0."""
    return min(replicas, key=lambda r: (r.load, r.served, r.index))


__all__ = [
    "POLICIES",
    "Decision",
    "NoReplicaAliveError",
    "Policy",
    "ReplicaState",
    "Router",
    "prompt_block_keys",
]
