# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 10: data parallelism and routing
#
# Tensor parallelism splits one model over several devices. Data parallelism copies the whole
# engine instead: several replicas, each in its own process with its own KV cache, behind one
# front end. Any replica can serve any request, so the throughput adds up. What a replica
# cannot share is its cache: a request whose prefix is cached on replica 0 computes it all
# again on replica 1. So where a request goes matters, and that is the router's job.
#
# The front end tokenizes, routes, detokenizes and cuts stop strings. A replica, an *engine
# core*, only sees token ids. It steps its engine and sends back each step's new tokens, its
# queue lengths and the blocks its prefix cache stored or evicted (the KV events).
#
# We start two replicas and look at what crosses the pipe. Then we write the cache-aware rule
# by hand, keep our own record of what each replica caches, and check that the router picks
# the same replica for every request of a small multi-tenant workload. We check that two
# replicas answer what one engine answers, read `/health`'s view, shut the replicas down, and
# read the measured plot.

# %%
import asyncio
import json
from pathlib import Path

from IPython.display import Image

import stages

s10 = stages.load("10")
output_processor = stages.load("10", "frontend.output_processor")
prefix_cache = stages.load("10", "prefix_cache")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
print(s10.TECHNIQUE)

# %% [markdown]
# ## Two replicas
#
# `DPClient` starts `data_parallel_size` engine-core processes. Each loads the model, says
# "ready", then loops: take the messages waiting, step, send one `EngineCoreOutputs`. It
# offers what `AsyncLLM` offers (`generate`, `abort`, `shutdown`), so the server of earlier
# stages runs on it unchanged.

# %%
client = s10.DPClient(data_parallel_size=2, routing_policy="cache_aware", **SMALL)
for replica in client.health_report()["replicas"]:
    print(replica)

# %% [markdown]
# ## What crosses the pipe
#
# The front end makes a `Request`: text, token ids, stop strings, a detokenizer. The core
# gets only an `EngineCoreRequest`: the token ids, the sampling parameters without stop
# strings, and the seed, resolved here so that every replica would draw the same tokens.
# Each step the core answers with new token ids per request, finish reasons, its KV events
# and its queue lengths. The front end's `OutputProcessor` appends the ids to the request
# and detokenizes them: the text exists only in the front end.


# %%
async def final_output(prompt, params):
    request = client.make_request(prompt, params, output_kind="final")
    return [o async for o in client.generate(request)][-1]


greedy = s10.SamplingParams(max_tokens=6, temperature=0)
request = client.make_request("The capital of France is", greedy)
print(output_processor.core_request(request))
out = await final_output("The capital of France is", greedy)  # noqa: F704, RUF100
print(repr(out.text))

# %% [markdown]
# ## The cache-aware rule, by hand
#
# The router knows exactly which blocks each replica caches: it replays their KV events, and
# it hashes a prompt with the chained block keys of stage 07. The rule, SGLang's with the
# fixes its users needed:
#
# 1. For each replica, count the prompt's leading block keys it holds. Only the full blocks
#    before the one with the last token count, as in the engine.
# 2. Take the replica with the longest match (ties: lower load, then fewer requests served,
#    then lower index). If the match covers more than half the prompt, that is a *hit*.
# 3. Otherwise it is a miss, and the request goes to the least loaded replica (ties the same
#    way), so new prefixes spread out instead of piling onto one replica.
#
# (When loads differ a lot, overloaded replicas are left out first; with one request at a
# time here, that never happens.) We write the rule as a function of our own record of what
# each replica holds.

# %%
BLOCK = client.router.block_size
NUM_REPLICAS = len(client.router.replicas)


def block_keys(tokens: list[int], count: int) -> list[bytes]:
    keys, parent = [], None
    for index in range(count):
        parent = prefix_cache.block_content(parent, tokens[index * BLOCK : (index + 1) * BLOCK]).key
        keys.append(parent)
    return keys


def route_by_hand(prompt, held, loads, served):
    keys = block_keys(prompt, (len(prompt) - 1) // BLOCK)

    def matched(r):
        n = 0
        while n < len(keys) and keys[n] in held[r]:
            n += 1
        return n * BLOCK

    def tie(r):
        return (-loads[r], -served[r], -r)

    best = max(range(NUM_REPLICAS), key=lambda r: (matched(r), *tie(r)))
    if matched(best) / len(prompt) > 0.5:
        return best, "cache_hit", matched(best)
    target = max(range(NUM_REPLICAS), key=tie)
    return target, "least_loaded", matched(target)


# %% [markdown]
# ## A multi-tenant workload
#
# Three tenants, each with its own system prompt, and two users each. A request is a
# system prompt plus a short question; the tenants take turns. We keep `held`: the block keys
# of every full block of every prompt a replica has served (its cache stores them, and
# nothing is evicted in so small a workload). Before each request we predict the router's
# pick; after it, we add the prompt's blocks to the chosen replica.

# %%
SYSTEMS = {
    "bank": "You are the assistant of a bank. Answer questions about accounts, cards, "
    "transfers and fees politely, in two sentences at most, and never give financial advice.",
    "clinic": "You are the receptionist of a small clinic. You book, move and cancel "
    "appointments, explain opening hours, and ask callers to dial the emergency number for "
    "anything urgent.",
    "shop": "You are the help desk of an online shop selling shoes. You track orders, explain "
    "the return policy of thirty days, and suggest sizes from the customer's usual size.",
}
QUESTIONS = ["How do I start?", "What does it cost?"]
short = s10.SamplingParams(max_tokens=2, temperature=0)
router = client.router
held = [set() for _ in range(NUM_REPLICAS)]
served = [r.served for r in router.replicas]  # the France request went somewhere already
for r, state in enumerate(router.replicas):
    held[r] |= state.cached  # and its blocks are cached there

for question in QUESTIONS:
    for tenant, system in SYSTEMS.items():
        text = f"{system}\nUser: {question}\nAssistant:"
        prompt = client.make_request(text, short).prompt_token_ids
        loads = [r.load for r in router.replicas]
        predicted = route_by_hand(prompt, held, loads, served)
        await final_output(text, short)  # noqa: F704
        d = router.last_decision
        print(
            f"{tenant:>6} | {question:<22} -> replica {d.replica} ({d.reason}, "
            f"{d.matched_tokens:2d} of {len(prompt)} tokens cached there)"
        )
        assert (d.replica, d.reason, d.matched_tokens) == predicted
        served[d.replica] += 1
        held[d.replica] |= set(block_keys(prompt, len(prompt) // BLOCK))
        assert held[d.replica] <= router.replicas[d.replica].cached  # the events agree
print("every decision as predicted by hand")

# %% [markdown]
# Each tenant's first request is a miss. With the loads equal, it goes to the replica that
# has served fewer requests, so the three tenants spread over the two replicas. Every later
# request of a tenant finds its system prompt cached where the tenant's first request ran and
# goes there: a hit, with only the question and the partial block before it left to compute.
# Round robin would send each tenant to both replicas and compute every system prompt twice.
#
# Our record is a subset of what the router learned from the events: a replica also caches
# the blocks its answers fill, which no new prompt here can match.

# %% [markdown]
# ## Two replicas answer what one engine answers
#
# A replica is the engine of stage 09 in another process, and the front end resolves each
# request's seed before routing. So greedy and seeded requests get the same tokens whichever
# replica runs them, and the same as one in-process engine.

# %%
prompts = ["The three primary colors are", "Write a haiku about the sea."]
seeded = s10.SamplingParams(max_tokens=6, temperature=0.8, seed=3)
one = s10.LLM(**SMALL)
for params in (greedy, seeded):
    outputs = await asyncio.gather(*(final_output(p, params) for p in prompts))  # noqa: F704
    two = [o.token_ids for o in outputs]
    alone = [o.token_ids for o in one.generate(prompts, params)]
    print(f"temperature {params.temperature}: same tokens as one engine: {two == alone}")
    assert two == alone

# %% [markdown]
# ## What `/health` shows
#
# Per replica: its pid, whether it is alive, its queues and its load (requests routed there
# and not finished). Then the router's view: requests served and blocks cached per replica,
# and how many decisions of each kind it made.

# %%
health = client.health_report()
for replica in health["replicas"]:
    print(replica)
print(health["router"])
client.shutdown()
print("replicas alive after shutdown:", [r.process.poll() is None for r in client.replicas])
assert not any(r.process.poll() is None for r in client.replicas)

# %% [markdown]
# ## Measured
#
# `python -m stages 10 bench` measures on this machine the throughput of one engine against
# several replicas, then a multi-tenant workload with Poisson arrivals under each routing
# policy, with fresh replicas per policy. The numbers come from the JSON of the same run.

# %%
record = json.loads((PLOTS / "10_dp.json").read_text())
summary, results = record["summary"], record["results"]
print(record["machine"], "|", record["workload"])
Image(filename=str(PLOTS / "10_dp.png"))

# %% [markdown]
# **Left.** One batch of requests sent at once, to one in-process engine and to the replicas.
# The replicas are slower here: they share the machine's two cores, each with fewer threads,
# and each reads the whole model on its own. Data parallelism pays when each replica has a
# device of its own; on one CPU it only divides the same cores.

# %%
dp_n = summary["replicas"]
print(f"one engine {summary['output_tokens_per_s_dp1']:.0f} output tokens/s,", end=" ")
print(f"{dp_n} replicas {summary['output_tokens_per_s_dp_n']:.0f}")

# %% [markdown]
# **Middle.** The prefix-cache hit rate per policy, with the requests each replica served
# under each bar. The middle title says DP=2; the run used the number of replicas printed
# above, as the three counts under each bar show. Six tenants have system prompts of about
# 440 tokens, and a replica's pool holds 1,024 tokens: two tenants' prompts at a time.
# Round robin and least loaded spread every tenant over every replica, so each replica
# cycles through six prefixes and evicts them before they are reused. Cache-aware routing
# keeps each tenant on one replica, two tenants per replica, and they stay cached.

# %%
routing = results["routing_by_policy"]
print("tenant prefix tokens:", results["tenant_prefix_tokens"])
print("pool per replica:", results["kv_pool_tokens_per_replica"], "tokens")
for policy, run in routing.items():
    print(
        f"{policy:12} hit rate {run['hit_rate']:4.0%}, requests per replica"
        f" {run['requests_per_replica']}, decisions {run['decisions']}"
    )
print(f"cache-aware / round robin: {summary['hit_rate_ratio_cache_aware_to_round_robin']:.1f}x")

# %% [markdown]
# The load stays balanced under cache-aware routing: the requests per replica differ by one
# or two. Its few misses, each tenant's first request among them, are routed by load; after
# that the tenants stay where their prefixes are.
#
# **Right.** The time to first token per policy, median and p99. A hit computes only the
# question, so the median under cache-aware routing is several times lower. Its p99 comes
# from the few misses, which compute a whole system prompt, and the requests that wait
# behind them.

# %%
for policy in routing:
    p50, p99 = summary[f"ttft_ms_p50_{policy}"], summary[f"ttft_ms_p99_{policy}"]
    print(f"{policy:12} TTFT p50 {p50:5.0f} ms, p99 {p99:5.0f} ms")

# %% [markdown]
# ## Exercises
#
# 1. Rerun the multi-tenant workload with `routing_policy="round_robin"`. Predict each
#    request's replica by hand, then compare the replicas' cached blocks in `/health`: how
#    many times is each system prompt computed?
# 2. Set `cache_threshold` high enough (build a `Router` directly, its arguments are
#    public) that the second request of a tenant misses. Where does it go, and what happens
#    to the hit rate over many tenants?
# 3. Send 40 requests of one tenant at once. With cache-aware routing and no balance
#    thresholds, every one would go to one replica. Work out when the imbalance rule
#    (`balance_abs_threshold`, `balance_rel_threshold`) steps in, and check it.
# 4. Kill one replica's process while requests run (`client.replicas[0].process.kill()`).
#    What happens to its in-flight requests, to the router's rotation and to `/health`?
