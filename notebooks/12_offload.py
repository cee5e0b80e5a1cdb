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
# # Stage 12: KV offloading
#
# The device's KV pool is the scarcest memory an engine has. When it runs out, stage 04
# preempts a request and throws its KV away: the request computes every token again when it
# comes back. And a conversation whose blocks other conversations pushed out of the prefix
# cache (stage 07) computes its whole history again at its next turn.
#
# Stage 12 puts a second tier behind the device pool, in host memory, which is larger and
# slower. A preempted request's blocks are copied there and back (swap preemption), and a
# cached block the device pool evicts is kept there under its content key (a prefix tier).
# Copying a block costs a memory copy, not a forward over its tokens.
#
# We size a block by hand, keep the host tier's ledger by hand, and then swap a running
# request's KV out to a host pool and back with the engine's own copy functions, checking
# every byte and the request's tokens. Then the engine does it: a burst on a pool too small
# for it, by recompute and by swap, and a conversation that comes back after its blocks were
# evicted. We end with the benchmark's plot. The notebook runs in about a minute on a laptop
# CPU.

# %%
import json
from pathlib import Path

import torch
from IPython.display import Image

import stages

s12 = stages.load("12")
manager = stages.load("12", "offload.manager")
copy_plan = stages.load("12", "offload.copy_plan")
copy_engine = stages.load("12", "offload.copy_engine")
connector_base = stages.load("12", "kv_connector.base")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s12.TECHNIQUE)

# %% [markdown]
# ## What a block weighs
#
# One token's KV is a K and a V vector per KV head per layer. SmolLM2 has 30 layers, 3 KV
# heads of 64 values, in fp32 here. A block holds `block_size` tokens of it. We compute both by
# hand and compare with the engine's cache. Blocks of 4 tokens keep the examples small.

# %%
llm = s12.LLM(block_size=4, max_model_len=256, kv_cache_bytes=16 * 2**20, async_scheduling=False)
mc = llm.model_config
per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4  # K and V, fp32
per_block = s12.PagedKVCache.bytes_per_block(
    mc.num_layers, 4, mc.num_kv_heads, mc.head_dim, llm.dtype
)
assert per_block == 4 * per_token
print(f"{per_token:,} bytes per token, {per_block:,} per block of 4")
print("device pool K:", tuple(llm.kv_cache.k.shape), "[layers, blocks, block_size, heads, dim]")

# %% [markdown]
# ## The host tier's ledger
#
# The host tier keeps a ledger, `LRUOffloadManager`, beside the scheduler. It never touches a
# tensor: it says which host block holds which key. A key is stored in two phases.
# `prepare_store` hands out a host block; `complete_store` makes it visible. In between, a
# `lookup` does not see it and eviction may not take it: its bytes are still on their way.
# When the ledger is full, `prepare_store` evicts the least recently used key that is ready
# and that no load is reading, or says no (`None`).

# %%
ledger = manager.LRUOffloadManager(num_blocks=2)
print("prepared:", ledger.prepare_store(["block A"]))
assert ledger.lookup(["block A"]) == 0  # in flight: invisible
ledger.complete_store(["block A"])
assert ledger.lookup(["block A"]) == 1  # landed: a hit
ledger.prepare_store(["block B"])  # in flight: not evictable
room_c = ledger.prepare_store(["block C"])  # evicts A, the only idle one
room_d = ledger.prepare_store(["block D"])  # B and C are in flight: no room
print("room for C:", room_c)
print("room for D:", room_d)
assert room_c.keys_evicted == ("block A",) and room_d is None

# %% [markdown]
# ## A swap, by hand
#
# One request runs on the engine above: its prefill and three decode steps. Its KV now fills
# a few device blocks. We swap it out and back in by hand, with the functions the engine's
# copy engine runs:
#
# 1. the ledger gives host blocks for the request's keys (`prepare_store`);
# 2. a `TransferJob` names the device blocks and the host blocks; `plan_batch` turns a step's
#    jobs into one copy, the host side cut into runs of consecutive blocks;
# 3. `copy_batch` gathers the device blocks into one staging tensor and writes each run to
#    the host pool, which has the device pool's block shape (`host_pool_like`);
# 4. `complete_store` makes the keys visible.
#
# Then we wipe the request's device blocks, so only the host copy remains, and load it back
# the same way in reverse.

# %%
greedy = s12.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
prompt = "The three primary colours are red, yellow and blue. Mixing them gives"
uninterrupted = llm.generate(prompt, greedy)[0].token_ids

request = llm.make_request(prompt, greedy)
llm.add_request(request)
for _ in range(4):
    llm.step()
blocks = llm.kv_manager.block_ids(request.request_id)
print(f"{request.num_computed_tokens} tokens computed, in device blocks {blocks}")

device_pool = connector_base.KVPool.of(llm.kv_cache)  # the engine's tensors, not a copy
host_pool = copy_engine.host_pool_like(llm.kv_cache.k, num_blocks=8)
host_ledger = manager.LRUOffloadManager(num_blocks=8)
keys = [("swap", request.request_id, i) for i in range(len(blocks))]
host_blocks = host_ledger.prepare_store(keys).host_blocks

store = copy_plan.TransferJob("store-1", "store", tuple(blocks), host_blocks)
plan = copy_plan.plan_batch([store])
print(plan)
keep = []  # temporaries a copy must keep alive until it ends
copy_engine.copy_batch(plan, device_pool, host_pool, keep)
host_ledger.complete_store(keys)

# %% [markdown]
# The host pool is block-major: block b of the host pool, all its layers, is one piece of
# memory, so a run of consecutive host blocks is one copy. We check every byte of the copy,
# keep the originals, and wipe the device blocks.

# %%
original_k = llm.kv_cache.k[:, blocks].clone()
original_v = llm.kv_cache.v[:, blocks].clone()
assert torch.equal(host_pool.k[:, list(host_blocks)], original_k)
assert torch.equal(host_pool.v[:, list(host_blocks)], original_v)
llm.kv_cache.k[:, blocks] = 0.0
llm.kv_cache.v[:, blocks] = 0.0
print(f"stored {len(blocks) * per_block:,} bytes; the device blocks now hold zeros")

# %% [markdown]
# Swap in: the ledger finds the keys ready (`lookup`) and references their host blocks while
# the load reads them (`prepare_load` ... `complete_load`). The load job goes the other way:
# host blocks are its sources, device blocks its targets. Here they are the request's own
# blocks; in the engine, a request that comes back gets whatever blocks are free.

# %%
assert host_ledger.lookup(keys) == len(keys)
sources = host_ledger.prepare_load(keys)
load = copy_plan.TransferJob("load-1", "load", tuple(sources), tuple(blocks))
copy_engine.copy_batch(copy_plan.plan_batch([load]), device_pool, host_pool, keep)
host_ledger.complete_load(keys)
assert torch.equal(llm.kv_cache.k[:, blocks], original_k)
assert torch.equal(llm.kv_cache.v[:, blocks], original_v)
print("K and V back bit for bit")

# %% [markdown]
# The request goes on from the KV that came back from the host. If the load had missed a
# byte, attention would read zeros and the greedy tokens would drift. They must be those of
# the uninterrupted run.

# %%
while llm.has_unfinished():
    llm.step()
print(repr(request.final_output().text))
assert request.output_token_ids == uninterrupted
host_ledger.discard(keys)  # a swapped-in request's host blocks are not needed any more
host_ledger.check()
print("same tokens as the uninterrupted run; host ledger:", host_ledger.num_free, "blocks free")

# %% [markdown]
# ## The engine swaps: a burst beyond the device pool
#
# Now the engine does all of that itself. Two engines with a pool of 16 blocks (64 tokens),
# one with `preemption_mode="recompute"` (stage 11's way) and one with `"swap"` and a host
# tier of 64 blocks. Four requests that need about 100 tokens of KV together arrive at once.
# The roomy engine above runs them without pressure.
#
# We count the tokens every forward runs by wrapping the scheduler's `schedule`: a token
# computed twice is counted twice. Whatever the mode, every request must get the same tokens.

# %%
tokenizer = llm.tokenizer
TIGHT = {"block_size": 4, "kv_cache_bytes": 16 * per_block, "max_model_len": 64}
recompute = s12.LLM(**TIGHT)
swap = s12.LLM(**TIGHT, preemption_mode="swap", kv_offload_bytes=64 * per_block)
print("device blocks:", recompute.kv_manager.allocator.num_blocks)
print("host blocks:  ", swap.runner.num_host_blocks)


def count_tokens(engine):
    """Make `engine.scheduler.schedule` add each step's tokens to the returned list's item."""
    total, schedule = [0], engine.scheduler.schedule

    def counted():
        output = schedule()
        total[0] += output.num_tokens
        return output

    engine.scheduler.schedule = counted
    return total


prompts = [f"Tell me about {topic}." for topic in ("the sea", "a cat", "the moon", "bread")]
burst = s12.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
need = sum(len(tokenizer.encode(p)) + burst.max_tokens for p in prompts)
print(f"the burst needs {need} tokens of KV at its longest")
tokens, computed = {}, {}
for name, engine in (("no pressure", llm), ("recompute", recompute), ("swap", swap)):
    counter = count_tokens(engine)
    tokens[name] = [o.token_ids for o in engine.generate(prompts, burst)]
    computed[name] = counter[0]
    del engine.scheduler.schedule  # the class's method again
    preempted = engine.scheduler.num_preemptions
    print(f"{name:12} {computed[name]:4d} tokens computed, {preempted} preemptions")
assert tokens["recompute"] == tokens["no pressure"] == tokens["swap"]

# %% [markdown]
# Both tight engines preempt. Recompute pays with a forward: its tokens computed exceed the
# unpressured run's by exactly what it threw away. Swap computes every token once, like the
# unpressured run, and copies the victims' KV instead. The connector's stats count what came
# back from the host.

# %%
stats = swap.kv_connector.stats
print("recomputed by recompute:", computed["recompute"] - computed["no pressure"], "tokens")
print("recomputed by swap:     ", computed["swap"] - computed["no pressure"], "tokens")
print(f"swap: {swap.scheduler.num_swapped_out} swapped out, {stats.swapped_in} swapped in")
print(f"      {stats.tokens_loaded} tokens loaded from {stats.blocks_loaded} host blocks")
assert computed["swap"] == computed["no pressure"] < computed["recompute"]
assert stats.swapped_in == swap.scheduler.num_swapped_out > 0
swap.check_no_leaks()

# %% [markdown]
# ## The prefix tier: a conversation comes back
#
# With prefix caching on, the host tier is also a second level of the prefix cache. When the
# device pool evicts a cached block to make room, the connector stores it in the host tier
# under its content key, before the step that reuses the device block writes it. A later
# prefix hit there loads it back and counts as cached tokens.
#
# Conversation A has a short first turn. Then conversation B's long prompt needs most of the
# pool, and the pool evicts A's cached blocks. Then A's second turn arrives: its first turn,
# the answer, and a follow-up.

# %%
chat = s12.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
a_first = tokenizer.encode("The lighthouse keeper climbed the spiral stairs every evening and")
b_first = tokenizer.encode(
    "A baker in the village woke long before dawn, lit the old oven, weighed the flour and "
    "the salt, and began to knead the dough for the morning bread while the street slept, the "
    "cats watched from the wall and the first cart rolled down the hill and"
)
print(len(a_first), "and", len(b_first), "prompt tokens;", 16 * 4, "tokens in the pool")
for name, engine in (("device tier only", recompute), ("device + host tier", swap)):
    answer = engine.generate([a_first], chat)[0]
    engine.generate([b_first], chat)
    a_second = a_first + answer.token_ids + tokenizer.encode(" Why did he do that?")
    again = engine.generate([a_second], chat)[0]
    cached = f"{again.num_cached_tokens} of {len(a_second)} prompt tokens cached"
    print(f"{name:18}: turn 2 of A, {cached}")
    tokens[name] = again.token_ids
    engine.check_no_leaks()
assert tokens["device tier only"] == tokens["device + host tier"]

# %% [markdown]
# With the device tier alone, B's prompt pushed most of A's blocks out, and A's second turn
# computes most of its history again. With the host tier, every full block of A's history
# comes back from the host: the same answer, most of the prompt not computed. Only full
# blocks are cached, so the history's last partial block and the follow-up are computed
# either way.

# %%
recompute.shutdown()
swap.shutdown()

# %% [markdown]
# ## Measured
#
# `python -m stages 12 bench` runs two workloads on pools far too small for them, with block
# 16. A burst: 16 requests of 128 prompt tokens and 128 greedy tokens at once, on a device
# pool that holds 35% of their KV, by recompute, by swap, and with a roomy pool. A multi-turn
# chat: six conversations take turns, each turn resending the whole conversation, on a device
# pool that holds 1.5 conversations, with and without a host tier. Every mode gave the same
# tokens. The numbers below are read from `plots/12_offload.json`, the run that drew the plot.

# %%
bench = json.loads((PLOTS / "12_offload.json").read_text())
summary, results = bench["summary"], bench["results"]
print(bench["machine"])
Image(filename=str(PLOTS / "12_offload.png"))

# %% [markdown]
# **Left: the burst's total time.** Red recompute, blue swap, grey no pressure.

# %%
for mode in ("recompute", "swap", "no_pressure"):
    print(f"{mode:12} {summary[f'burst_seconds_{mode}']:5.1f} s")
print(f"swap is {summary['burst_speedup_swap_vs_recompute']:.2f}x recompute")
for mode in ("recompute", "swap"):
    print(f"preemptions, {mode}: {summary[f'preemptions_{mode}']}")

# %% [markdown]
# Swap gains little on this CPU: recomputing a token's KV costs about as much as copying it
# out and back, both in the same memory. On a GPU the forward is cheap per token and the copy
# crosses PCIe, so the balance depends on the machine. Most of the gap to the grey bar is not
# preemption at all: a small pool admits fewer requests at a time, so both tight modes run
# smaller decode batches for longer.
#
# **Middle: tokens computed again**, against the unpressured run, as our counter above.

# %%
print("recomputed, recompute:", summary["recomputed_tokens_recompute"])
print("recomputed, swap:     ", summary["recomputed_tokens_swap"])
print("loaded from the host: ", summary["tokens_swapped_in"])

# %% [markdown]
# Recompute computes the victims' tokens a second time; swap computes none twice and loads
# about as many from the host instead. That is the trade the left panel prices.
#
# **Right: the chat, turn by turn.** Lines: the mean time to first token per turn (left
# axis). Bars: the share of prompt tokens served from a cache (right axis).

# %%
for mode in ("device tier only", "device + host tier"):
    turns = results["chat"][mode]["turns"]
    ttft = ", ".join(f"{t['ttft_ms']:.0f}" for t in turns)
    hits = ", ".join(f"{t['hit_rate']:.0%}" for t in turns)
    print(f"{mode:18}  TTFT ms by turn: {ttft}   hit rate: {hits}")
off, on = (summary[f"chat_ttft_ms_{mode}"] for mode in ("device_only", "with_host"))
ratio = summary["chat_ttft_ratio_device_only_vs_host"]
print(f"mean TTFT of turns 2-{len(turns)}: {off:.0f} vs {on:.0f} ms, {ratio:.1f}x lower")

# %% [markdown]
# Turn 1 meets an empty cache in both modes. From turn 2 on, the device tier alone never
# hits: by a conversation's next turn, the other five have evicted its blocks, and its TTFT
# grows with its history. With the host tier most of each prompt comes back as a copy, and the
# TTFT stays flat, a few times lower. A host hit costs a copy and one extra step, since the
# load is asynchronous.

# %% [markdown]
# ## Exercises
#
# 1. Find the break-even of swap against recompute on this machine: time one
#    `copy_batch` store and load of n blocks, as in "A swap, by hand", against a prefill of
#    n x 4 tokens, for n from 1 to 64. Below which length should a victim recompute rather
#    than swap?
# 2. The ledger evicts the least recently used block. In the chat workload a conversation's
#    first blocks are its oldest, yet every later turn needs them first. Write an eviction
#    order that keeps prefixes (evict a conversation's last blocks first) and compare the
#    bench's chat hit rate.
# 3. Compress the host tier: store int8 codes with one scale per block and layer in the host
#    pool, and dequantize on load. How many more conversations fit, and what does it do to
#    the greedy tokens of the chat above?
# 4. Give the burst a host tier that is too small for every victim. Predict from the ledger's
#    rules which victims recompute and which swap, then check with `stats.swap_lost`.
