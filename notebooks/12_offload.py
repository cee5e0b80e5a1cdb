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
# A device KV pool far too small for the work, and a host-memory tier behind it. We watch the
# host tier's ledger hide a block until its store lands, swap a preempted request out and back
# in bit for bit, compare recompute and swap preemption on a burst, and bring an evicted prefix
# back from the host tier.

# %%
import importlib
from pathlib import Path

import torch
from IPython.display import Image

import stages

s12 = stages.load("12")
manager_module = importlib.import_module(f"{s12.__name__}.offload.manager")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s12.TECHNIQUE)

# %% [markdown]
# ## The host tier's ledger
#
# A key is stored in two phases: `prepare_store` gives it a host block, `complete_store` makes
# it visible. In between a `lookup` does not see it, and eviction may not take it.

# %%
ledger = manager_module.LRUOffloadManager(num_blocks=2)
print("prepared:", ledger.prepare_store(["block A"]))
print("hit before the store lands:", ledger.lookup(["block A"]))
ledger.complete_store(["block A"])
print("hit after:", ledger.lookup(["block A"]))
ledger.prepare_store(["block B"])  # in flight: not evictable
print("room for C?", ledger.prepare_store(["block C"]))  # evicts A, the only idle one
print("room for D?", ledger.prepare_store(["block D"]))  # B and C are in flight: None

# %% [markdown]
# ## Swap out, swap in
#
# One request on the real model, preempted half-way with `preemption_mode="swap"`. We wipe the
# device pool while it waits: whatever it reads after resuming came from the host tier.

# %%
llm = s12.LLM(
    max_model_len=256, kv_cache_bytes=16 * 2**20, kv_offload_bytes=16 * 2**20,
    preemption_mode="swap", prefix_caching=False, async_scheduling=False,
)  # fmt: skip
greedy = s12.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
request = llm.make_request("The three primary colours are", greedy)
llm.add_request(request)
for _ in range(4):
    llm.step()
computed = request.num_computed_tokens
n = min(computed, llm.block_size)  # the first block's computed positions, every layer
before = llm.kv_cache.k[:, llm.kv_manager.block_ids(request.request_id)[0], :n].clone()
llm.scheduler._preempt(request)
llm.step()  # this step stores its blocks in the host tier
llm.kv_cache.k.zero_()
llm.kv_cache.v.zero_()
while request.num_computed_tokens <= computed:
    llm.step()
after = llm.kv_cache.k[:, llm.kv_manager.block_ids(request.request_id)[0], :n]
print("tokens loaded back:", llm.kv_connector.stats.tokens_loaded, "of", computed)
print("bit-exact:", torch.equal(before, after))
while llm.has_unfinished():
    llm.step()
print(repr(request.text))
llm.check_no_leaks()
del llm

# %% [markdown]
# ## The benchmark
#
# `python -m stages 12 bench` ran a burst beyond the device pool (recompute vs swap) and a
# multi-turn chat whose conversations do not fit the device pool together (with and without
# the host tier). The plot, measured on this machine:

# %%
Image(filename=str(PLOTS / "12_offload.png"))
