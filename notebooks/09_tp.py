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
# # Stage 09: tensor parallelism
#
# The model's heads, MLP columns and vocabulary are split over ranks: processes that each hold
# a shard and meet in an all-reduce after every row-parallel layer. We see how SmolLM2's sizes
# split, start three ranks, follow one step's scheduler output to every rank, count the
# collectives of one forward, check the tokens against one rank, and read the measured plot.

# %%
import importlib
from pathlib import Path

from IPython.display import Image

import stages

s09 = stages.load("09")
parallel = importlib.import_module(f"{s09.__name__}.parallel.group")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
print(s09.TECHNIQUE)

# %% [markdown]
# ## What splits, and what cannot
#
# SmolLM2-135M has 9 query heads and 3 KV heads. Two ranks cannot split 9 heads; three can.
# With fewer KV heads than ranks, each rank keeps one KV head (replicated), as mini-sglang does.

# %%
from stages.common.model_config import ModelConfig
from stages.common.weights import resolve_model

config = ModelConfig.from_pretrained(resolve_model(None))
for size in (2, 3):
    try:
        parallel.check_tensor_parallel_fits(config, size)
        print(
            f"TP={size}: fits; rank KV heads:",
            [list(parallel.kv_head_range(config.num_kv_heads, size, r)) for r in range(size)],
        )
    except ValueError as error:
        print(f"TP={size}: {error}")
print(
    "8 KV heads over 16 ranks, rank by rank:",
    [list(parallel.kv_head_range(8, 16, r)) for r in range(16)],
)

# %% [markdown]
# ## Three ranks, one step
#
# `tensor_parallel_size=3` makes the engine start two worker processes; rank 0 runs in this
# process. Each step the engine pickles its scheduler output once and writes it to each worker's
# pipe; every rank builds its inputs from it and runs its shard. Only rank 0 returns tokens.

# %%
tp3 = s09.LLM(tensor_parallel_size=3, **SMALL)
print("workers:", tp3.executor.workers())
print("weight MiB on rank 0:", round(tp3.weight_bytes() / 2**20, 1))
print("KV heads per rank:", tp3.kv_cache.k.shape[3])

# %%
greedy = s09.SamplingParams(max_tokens=8, temperature=0)
out = tp3.generate(["The capital of France is"], greedy)[0]
print(repr(out.text))
print("scheduler outputs shipped:", tp3.executor.send_stats())
for report in tp3.executor.call_all("rank_report"):  # rank by rank: the same share, the
    print(report)  # same collectives, call for call

# %% [markdown]
# Each forward all-reduces twice per layer (after the attention output projection and after
# the MLP down projection) and once for the embedding, and all-gathers the logits once, so that
# every rank samples the same token from the same logits.

# %% [markdown]
# ## The same tokens as one rank

# %%
tp1 = s09.LLM(**SMALL)
print(tp1.generate(["The capital of France is"], greedy)[0].token_ids == out.token_ids)
tp3.shutdown()

# %% [markdown]
# ## Measured
#
# `python -m stages 09 bench` on this machine: weight bytes per rank, decode step latency and
# the share of the step spent in collectives, and a modelled panel for a large model on NVLink
# GPUs (the README gives the formula).

# %%
plot = PLOTS / "09_tp.png"
Image(filename=str(plot)) if plot.exists() else print("run: python -m stages 09 bench")
