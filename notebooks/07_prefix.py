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
# # Stage 07: prefix caching
#
# Many requests begin alike: a system prompt, the earlier turns of a chat, a few-shot
# preamble. The K and V of a token depend only on that token and the tokens before it, so two
# requests that begin with the same tokens compute the same K and V for them. Stage 07
# computes them once.
#
# A full block of the paged cache is addressed by its content: a chained hash of its parent
# block's key and its own token ids. A new request looks its leading blocks up by their keys,
# puts the hits into its block table, shared and not copied, and computes only the rest.
#
# We compute block keys by hand and find them in the engine's cache. We predict by hand how
# many tokens a second request finds cached, and check the scheduler starts it exactly
# there, with the same block ids in its table. We follow the reference counts and the free
# queue, check that a hit changes no token, and read the measured plot.

# %%
import hashlib
import json
from array import array
from pathlib import Path

import torch
from IPython.display import Image

import stages

s07 = stages.load("07")
prefix_cache = stages.load("07", "prefix_cache")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20, "async_scheduling": False}
print(s07.TECHNIQUE)

# %% [markdown]
# ## A block's key, by hand
#
# A block's key is SHA-256 over its parent's key (a zero byte for the first block) and its
# token ids as 64-bit integers. We write that in three lines and compare it with
# `prefix_cache.block_content`, the function the engine calls.


# %%
def key_by_hand(parent: bytes | None, tokens: list[int]) -> bytes:
    digest = hashlib.sha256(parent or b"\x00")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


first = key_by_hand(None, [1, 2, 3, 4])
second = key_by_hand(first, [5, 6, 7, 8])
assert first == prefix_cache.block_content(None, [1, 2, 3, 4]).key
assert second == prefix_cache.block_content(first, [5, 6, 7, 8]).key
print("block 1:", first.hex()[:16])
print("block 2:", second.hex()[:16])

# %% [markdown]
# The chain is what makes a key stand for a whole prefix. The same four tokens after another
# first block get another key, because their K and V differ: attention mixed the earlier
# tokens in. A cache salt enters the first block's hash, so it changes every key after it:
# requests with different salts never share a block.

# %%
elsewhere = key_by_hand(key_by_hand(None, [9, 9, 9, 9]), [5, 6, 7, 8])
salted = prefix_cache.block_content(None, [1, 2, 3, 4], salt="tenant-a").key
print("[5, 6, 7, 8] after another block:", elsewhere.hex()[:16])
print("block 1 with a salt:             ", salted.hex()[:16])
assert len({second, elsewhere}) == 2 and salted != first

# %% [markdown]
# Only full blocks get a key. A block that is still filling has no fixed content yet. So a
# prompt's keys are one per full block, each chained to the one before.


# %%
def keys_by_hand(prompt: list[int], block_size: int) -> list[bytes]:
    keys, parent = [], None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = key_by_hand(parent, prompt[start : start + block_size])
        keys.append(parent)
    return keys


# %% [markdown]
# ## The engine publishes its blocks
#
# A first request has a 200-token system prompt and a question. When its prompt is scheduled,
# the engine publishes each block that the step fills: `allocator.cached` maps a key to the
# block that holds its K and V. Every key we compute by hand must be there, pointing at the
# request's own blocks, in order.

# %%
llm = s07.LLM(**SMALL)
block_size = llm.block_size
allocator = llm.kv_manager.allocator
greedy = s07.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
system = llm.tokenizer.encode("You are a careful assistant who explains things well. " * 20)[:200]


def ask(question: str) -> list[int]:
    return system + llm.tokenizer.encode(question, add_special_tokens=False)


prompt_a = ask("What is a KV cache?")
llm.add_request(llm.make_request(prompt_a, greedy, request_id="a"))
llm.step()  # the whole prompt fits one step's budget

keys_a = keys_by_hand(prompt_a, block_size)
table_a = llm.kv_manager.block_ids("a")
print(f"a: {len(prompt_a)} tokens, {len(keys_a)} full blocks, table {table_a}")
assert [allocator.cached[key] for key in keys_a] == table_a[: len(keys_a)]
print("every hand-made key is cached, at a's own blocks")

# %% [markdown]
# ## A hit, predicted by hand
#
# A second request asks another question after the same system prompt. Its first keys are
# a's first keys, until the first block that holds a token of the new question. From there
# the chain differs, and so does every later key. We count the shared keys by hand. A hit
# never covers the prompt's last token, because the step must compute that token's logits to
# sample from them. So the hit stops at the last full block before the final token.

# %%
prompt_b = ask("What is a block table?")
keys_b = keys_by_hand(prompt_b, block_size)
shared = 0
while shared < min(len(keys_a), len(keys_b)) and keys_a[shared] == keys_b[shared]:
    shared += 1
shared = min(shared, (len(prompt_b) - 1) // block_size)
predicted = shared * block_size
print(f"b: {len(prompt_b)} tokens; {shared} leading keys shared with a -> {predicted} cached")

# %% [markdown]
# Now the engine. The scheduler looks b's blocks up (`find_cached_prefix`), takes the hits
# into b's table and schedules only the rest: b's first step starts at the hit, not at 0.

# %%
b = llm.make_request(prompt_b, greedy, request_id="b")
llm.add_request(b)
so = llm.scheduler.schedule()
(scheduled_b,) = [s for s in so.requests if s.request_id == "b"]
table_b = llm.kv_manager.block_ids("b")
new, start = len(scheduled_b.token_ids), scheduled_b.num_computed_tokens
print(f"b's first step: {new} new tokens from position {start}")
print("a's table:", table_a)
print("b's table:", table_b)
assert scheduled_b.num_computed_tokens == predicted
assert table_b[:shared] == table_a[:shared]
assert [allocator.ref_counts[x] for x in table_b[:shared]] == [2] * shared
llm.update_from_output(so, llm.runner.execute_model(so))
print("holders of b's blocks:", [allocator.ref_counts[x] for x in table_b])

# %% [markdown]
# The shared blocks have two holders, a and b; b's own blocks have one. Nothing was copied:
# the model runner sees two block tables that begin with the same ids, and attention reads
# the same K and V through both.
#
# The engine reports the hit twice: on the request (`num_cached_tokens`, also in its output)
# and in `prefix_cache_stats`, which adds up prompt tokens looked up and tokens found.

# %%
while llm.has_unfinished():
    llm.step()
stats = llm.prefix_cache_stats
print(f"b.num_cached_tokens {b.num_cached_tokens}")
print(f"stats: {stats.requests} requests, {stats.hit_tokens} of {stats.queried_tokens} tokens hit")
assert b.num_cached_tokens == b.final_output().num_cached_tokens == predicted
assert stats.hit_tokens == predicted  # a found nothing, b its prefix
assert stats.queried_tokens == len(prompt_a) + len(prompt_b)

# %% [markdown]
# ## A hit changes no token
#
# b's K and V for the system prompt were computed by a. They must be exactly what b would
# have computed itself. We check b's answer against a forward with no cache at all:
# `runner.prompt_logits` runs the prompt and the answer in one pass (teacher forcing), and
# the argmax at each position from the prompt's last token on must be b's next token.

# %%
answer = b.output_token_ids
logits = llm.runner.prompt_logits(prompt_b + answer[:-1])
no_cache = logits[len(prompt_b) - 1 :].argmax(dim=-1).tolist()
print("b's answer     ", answer)
print("without a cache", no_cache)
assert no_cache == answer

# %% [markdown]
# ## Reference counts and the free queue
#
# a and b are finished, so their blocks have no holder. A block with no holder joins the back
# of the free queue but keeps its K, V and key: it is still a hit until `allocate` hands it
# out again and evicts it (lazy eviction). A request frees its tail first, so the tail of a
# prompt is evicted before the head that others are likelier to share.

# %%
print("holders of a's blocks:", [allocator.ref_counts[x] for x in table_a])
print(
    "free:", allocator.num_free, "of", allocator.num_blocks, " cached keys:", len(allocator.cached)
)
print("evictions so far:", allocator.num_evictions)
assert all(allocator.is_free(x) for x in table_a + table_b)

# %% [markdown]
# A third request after the same system prompt finds those free blocks and revives them:
# `touch` takes each one off the free queue and gives it a holder again.

# %%
c = llm.make_request(ask("What is a token?"), greedy, request_id="c")
llm.add_request(c)
llm.step()
table_c = llm.kv_manager.block_ids("c")
print("c's table:", table_c, " cached tokens:", c.num_cached_tokens)
assert table_c[:shared] == table_a[:shared] and c.num_cached_tokens == predicted
while llm.has_unfinished():
    llm.step()

# %% [markdown]
# ## What a hit saves
#
# The time to first token of a 400-token prompt, cold and then again with every full block
# but the last cached. The cached run computes one block's worth of tokens instead of 400.

# %%
long_prompt = llm.tokenizer.encode("The lighthouse keeper counted the ships. " * 60)[:400]
for attempt in ("cold", "cached"):
    out = llm.generate(long_prompt, s07.SamplingParams(max_tokens=1))[0]
    computed = len(long_prompt) - out.num_cached_tokens
    print(f"{attempt:>6}: TTFT {out.ttft * 1e3:5.0f} ms, computed {computed:3d} tokens")

# %% [markdown]
# ## Measured
#
# `python -m stages 07 bench` runs two engines, caching off (stage 06) and on. It measures
# the time to first token and batch throughput against the length of a shared system prompt,
# then the hit rate and time to first token per turn of a multi-turn chat. The numbers below
# come from the JSON of the same run.

# %%
record = json.loads((PLOTS / "07_prefix.json").read_text())
summary, results = record["summary"], record["results"]
off, on = results["caching off (stage 06)"], results["caching on"]
print(record["machine"], "|", record["workload"])
Image(filename=str(PLOTS / "07_prefix.png"))

# %% [markdown]
# **Left.** One request at a time, after a first request has met the prefix. Without caching,
# the time to first token grows with the shared prefix: every request computes all of it.
# With caching it stays flat, because each request computes only its own question and the
# partial block before it.

# %%
for prefix in off["shared_prefix"]:
    cold, hit = off["shared_prefix"][prefix], on["shared_prefix"][prefix]
    print(
        f"prefix {prefix:>4}: TTFT off {cold['ttft_ms']:5.0f} ms, on {hit['ttft_ms']:4.0f} ms,"
        f" hit {hit['hit_fraction']:4.0%}"
    )
print(f"at {summary['headline_prefix_tokens']} tokens: {summary['ttft_ratio_off_vs_on']:.1f}x")

# %% [markdown]
# **Middle.** Eight such requests submitted together, from a cold cache. The first request
# that reaches a block computes it; the others, admitted in later steps, find it. So even a
# batch that starts cold gains, and the gain grows with the prefix. With no prefix at all the
# two engines run the same work.

# %%
for prefix in off["shared_prefix"]:
    rate_off = off["shared_prefix"][prefix]["batch_output_tokens_per_s"]
    rate_on = on["shared_prefix"][prefix]["batch_output_tokens_per_s"]
    print(f"prefix {prefix:>4}: {rate_off:5.1f} -> {rate_on:5.1f} output tokens/s")
print(f"at {summary['headline_prefix_tokens']}: {summary['batch_throughput_ratio']:.1f}x")

# %% [markdown]
# **Right.** A chat: each turn sends the whole conversation so far. The bars are the share of
# each turn's prompt served from the cache, and they grow turn by turn, because everything
# but the newest message was computed by the previous turn. Without caching the time to first
# token climbs with the conversation; with it, it stays near the cost of the new message.

# %%
turns = zip(off["chat"]["turns"], on["chat"]["turns"], strict=True)
for n, (cold, hit) in enumerate(turns, start=1):
    print(
        f"turn {n}: {cold['prompt_tokens']:3.0f} prompt tokens, hit {hit['hit_rate']:4.0%},"
        f" TTFT off {cold['ttft_ms']:5.0f} ms, on {hit['ttft_ms']:4.0f} ms"
    )
print(f"hit rate over the chat: {summary['chat_hit_rate_on']:.0%}")

# %% [markdown]
# The first turn already hits: the conversations share one system prompt, so only the first
# conversation computes it. The last turn's prompt is served mostly from the cache, and its
# time to first token is several times lower than without caching.

# %% [markdown]
# ## Exercises
#
# 1. Give request `b` a `cache_salt` in `make_request`. Predict its hit with `keys_by_hand`
#    (add the salt to the first block's hash as `block_content` does), then check the table.
# 2. Make a prompt exactly 13 blocks long and send it twice. How many tokens does the second
#    request find cached, and why not all of them?
# 3. Build an engine with a pool of 40 blocks and send requests with four different 200-token
#    system prompts, one after another. Predict which keys `allocator.cached` still holds after
#    each request, and check. Why are tails evicted before heads?
# 4. From the chat turns' prompt lengths in the JSON, predict each turn's hit rate by hand
#    (full blocks only, the last token never). How close are you to the bars, and what does
#    the difference come from?
