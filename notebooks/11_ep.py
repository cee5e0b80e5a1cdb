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
# # Stage 11: expert parallelism
#
# SmolLM2's MLP cut into 8 experts of 192 columns, with a router that sends each token to 2 of
# them (not a trained MoE: the router is derived from the weights, so the answers are worse
# than the dense model's; the routing and the traffic are real). We follow one token through
# the router, to its experts' rank and back, count the tokens per expert, then run the same
# model over two real processes (EP=2) and check it gives the one-process tokens.

# %%
import importlib
from pathlib import Path

import torch
from IPython.display import Image

import stages

s11 = stages.load("11")
moe = importlib.import_module(f"{s11.__name__}.moe.layer")
expert_parallel = importlib.import_module(f"{s11.__name__}.moe.expert_parallel")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 256, "kv_cache_bytes": 32 * 2**20}
MOE = {"moe_split_experts": 8, "moe_top_k": 2}
print(s11.TECHNIQUE)

# %% [markdown]
# ## The router
#
# We capture the input of layer 0's MoE block for a short prompt, and route it as the block
# does: softmax over 8 scores, top 2, weight 1 each (a split dense MLP keeps the dense scale).

# %%
ep1 = s11.LLM(**MOE, **SMALL)
block = ep1.model.layers[0].mlp
seen = {}
hook = block.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
ids = ep1.tokenizer.encode("The capital of France is")
ep1.prompt_logits(ids)
hook.remove()
x = seen["x"]
weights, experts = moe.route(block.router(x), block.top_k, block.renormalize, block.split)
token = len(ids) - 1  # the last token of the prompt
print("scores:", torch.softmax(block.router(x[token]).float(), -1).numpy().round(3))
print(
    "token", token, "goes to experts", experts[token].tolist(), "weights", weights[token].tolist()
)

# %% [markdown]
# ## One token's trip at EP=2
#
# At EP=2 rank 0 owns experts 0-3, rank 1 experts 4-7 (`expert_map`, in moe/expert_parallel.py).
# `dispatch` sorts each rank's (token, expert) pairs by the owner, sends the counts, then the
# rows; the owner runs the expert and multiplies by the weight; `combine` sends the result back
# and adds the token's two rows. Here we do by hand what the two ranks do, for our token.

# %%
owner = expert_parallel.expert_owner(8, 2)
print("expert_map rank 0:", expert_parallel.expert_map(8, 2, 0).tolist())
print("expert_map rank 1:", expert_parallel.expert_map(8, 2, 1).tolist())
for e in experts[token].tolist():
    rank = int(owner[e])
    local = int(expert_parallel.expert_map(8, 2, rank)[e])
    print(f"expert {e}: owned by rank {rank}, its local index {local}")
pairs_to = torch.bincount(owner[experts].reshape(-1), minlength=2)
print("pairs of this prompt each rank would receive:", pairs_to.tolist())

# %%
with torch.inference_mode():
    parts = [
        block.run_experts(
            x[token : token + 1], experts[token, j : j + 1], weights[token, j : j + 1]
        )
        for j in range(block.top_k)
    ]  # what each owner computes and sends back
    combined = parts[0] + parts[1]  # what combine adds up on the token's rank
print("combined == the block's output:", torch.allclose(combined[0], seen["y"][token], atol=1e-5))

# %% [markdown]
# ## Tokens per expert
#
# `EPStats` counts the (token, expert) pairs each expert ran, summed over the 30 layers. They
# add up to tokens x top-k x layers; how evenly they spread is the load balance.

# %%
stats = ep1.runner.ep.stats
stats.reset()
greedy = s11.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
prompts = ["Why do cats purr?", "Name some famous painters.", "How do vaccines work?"]
outs = ep1.generate(prompts, greedy)
counts = stats.expert_tokens
print("pairs per expert:", counts.tolist())
print(
    "sum:",
    int(counts.sum()),
    "busiest / mean:",
    round(float(counts.max() / counts.float().mean()), 2),
)

# %% [markdown]
# ## EP=2 equals EP=1
#
# Two real processes (gloo), the experts split between them, attention replicated. The greedy
# tokens must be EP=1's, by both dispatch methods; each rank reports the bytes it sent.

# %%
for method in ("all_to_all", "all_gather"):
    ep2 = s11.LLM(**MOE, **SMALL, tensor_parallel_size=2, expert_parallel=True, moe_dispatch=method)
    same = [o.token_ids for o in ep2.generate(prompts, greedy)] == [o.token_ids for o in outs]
    print(method, "same tokens as EP=1:", same)
    for report in ep2.executor.call_all("rank_report"):
        m = report["moe"]
        print(
            f"  rank {report['rank']}: dispatch {m['dispatch_bytes']} B, "
            f"combine {m['combine_bytes']} B, gather-back {m['gather_back_bytes']} B, "
            f"pairs run {sum(m['expert_tokens'])}"
        )
    ep2.shutdown()

# %% [markdown]
# ## Measured
#
# `python -m stages 11 bench` on this machine: tokens per expert, bytes per MoE layer per step
# for both methods, throughput EP=1 vs EP=2 (the README has the numbers and why EP cannot win
# on two shared cores).

# %%
plot = PLOTS / "11_ep.png"
Image(filename=str(plot)) if plot.exists() else print("run: python -m stages 11 bench")
