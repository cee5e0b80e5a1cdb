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
# Many requests begin alike: a system prompt, the earlier turns of a chat. Their K/V are the
# same, so stage 07 computes them once. A full block is addressed by a chained hash of its
# parent's key and its own token ids; a new request whose leading blocks are in the pool puts
# them in its block table and computes only the rest.
#
# We compute a block key by hand, watch a second request start after its hit, look at the
# reference counts and the free queue, and read the measured plot.

# %%
import importlib
from pathlib import Path

from IPython.display import Image

import stages

s07 = stages.load("07")
prefix_cache = importlib.import_module(f"{s07.__name__}.prefix_cache")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20, "async_scheduling": False}
print(s07.TECHNIQUE)

# %% [markdown]
# ## Chained keys
#
# A block's key covers its parent's key, so two blocks with the same tokens after different
# prefixes get different keys. A cache salt changes the first key, and with it every later one.

# %%
first = prefix_cache.block_content(None, [1, 2, 3, 4])
second = prefix_cache.block_content(first.key, [5, 6, 7, 8])
elsewhere = prefix_cache.block_content(prefix_cache.block_content(None, [9, 9, 9, 9]).key,
                                       [5, 6, 7, 8])  # fmt: skip
salted = prefix_cache.block_content(None, [1, 2, 3, 4], salt="tenant-a")
print("block 1:", first.key.hex()[:16])
print("block 2:", second.key.hex()[:16])
print("same tokens after another prefix:", elsewhere.key.hex()[:16])
print("block 1 with a salt:", salted.key.hex()[:16])

# %% [markdown]
# ## A second request starts after its hit
#
# Two requests share a 200-token system prompt. The first computes it; the second's first
# step starts at the end of the cached blocks (a multiple of the block size, 16).

# %%
llm = s07.LLM(**SMALL)
greedy = s07.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
system = llm.tokenizer.encode("You are a careful assistant who explains things well. " * 20)[:200]
for name, question in (("first", "What is a KV cache?"), ("second", "What is a block table?")):
    prompt = system + llm.tokenizer.encode(question, add_special_tokens=False)
    request = llm.make_request(prompt, greedy, request_id=name)
    llm.add_request(request)
    scheduler_output = llm.scheduler.schedule()
    scheduled = scheduler_output.requests[0]
    print(
        f"{name}: prompt {len(prompt)} tokens, first step computes {len(scheduled.token_ids)} "
        f"from position {scheduled.num_computed_tokens}"
    )
    llm.update_from_output(scheduler_output, llm.runner.execute_model(scheduler_output))
    while llm.has_unfinished():
        llm.step()
    print(f"   cached tokens reported: {request.final_output().num_cached_tokens}")

# %% [markdown]
# ## Reference counts and the free queue
#
# While both requests run, the system prompt's blocks have two holders. When they finish, the
# blocks' counts drop to 0 but the blocks stay cached in the free queue until the pool needs them.

# %%
a = llm.make_request([*system, 1000, 1001], greedy, request_id="a")
b = llm.make_request([*system, 2000, 2001], greedy, request_id="b")
llm.add_request(a)
llm.add_request(b)
llm.step()
allocator = llm.kv_manager.allocator
table_a, table_b = llm.kv_manager.block_ids("a"), llm.kv_manager.block_ids("b")
print("a's table:", table_a)
print("b's table:", table_b)
print("holders of each block of b:", [allocator.ref_counts[x] for x in table_b])
while llm.has_unfinished():
    llm.step()
print("after both finished: free blocks", allocator.num_free, "of", allocator.num_blocks)
print("still cached:", len(allocator.cached), "blocks; hit rate so far",
      f"{llm.prefix_cache_stats.hit_rate:.0%}")  # fmt: skip

# %% [markdown]
# ## What a hit saves
#
# Time to first token for a 600-token prompt, cold and then with everything but its last
# block cached.

# %%
long_prompt = llm.tokenizer.encode("The lighthouse keeper counted the ships. " * 80)[:600]
for attempt in ("cold", "cached"):
    out = llm.generate(long_prompt, s07.SamplingParams(max_tokens=1))[0]
    print(f"{attempt:>6}: TTFT {out.ttft * 1e3:6.0f} ms, cached tokens {out.num_cached_tokens}")

# %% [markdown]
# ## Measured
#
# `python -m stages 07 bench`: time to first token and batch throughput against the length of
# a shared system prompt, caching off and on; hit rate and TTFT per turn of a multi-turn chat.

# %%
Image(filename=str(PLOTS / "07_prefix.png"))

# %% [markdown]
# ## Exercises
#
# 1. Give request `b` a `cache_salt` in `make_request`. What does its table look like now?
# 2. Run requests with four different 200-token system prompts on a pool of 40 blocks. Which
#    blocks are evicted first, and why are tails evicted before heads?
