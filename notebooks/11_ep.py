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
# A mixture-of-experts (MoE) layer replaces the dense MLP with E smaller MLPs, the experts,
# and a router that sends each token to k of them. The parameters grow with E, the work per
# token with k. Expert parallelism (EP) gives each rank whole experts. A token's hidden state
# then travels to the ranks that own its experts, and the results travel back.
#
# SmolLM2 is a dense model. `moe_split_experts=8` cuts its MLP into 8 experts of 192 columns
# each, and the router scores expert e by the mean of its gate rows. It is not a trained MoE:
# with top-2 the text falls apart. But the routing and the traffic are real, and with all 8
# experts it is the dense model exactly. That gives us an oracle at full scale.
#
# We check the oracle by hand, route a prompt's tokens by hand and combine their experts'
# outputs, count the pairs each expert runs, and predict to the byte what two ranks send each
# other. Then two real processes run the model and must agree with all of it. The notebook
# runs in about a minute on a laptop CPU.

# %%
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from IPython.display import Image

import stages

s11 = stages.load("11")
moe = stages.load("11", "moe.layer")
expert_parallel = stages.load("11", "moe.expert_parallel")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 256, "kv_cache_bytes": 32 * 2**20}
MOE = {"moe_split_experts": 8, "moe_top_k": 2}
print(s11.TECHNIQUE)

# %% [markdown]
# ## A dense MLP cut into experts
#
# Each layer's MLP is now a `SparseMoE` block. It stacks its experts' weights: `w13` holds
# each expert's gate rows and then its up rows, `[E, 2 x 192, 576]`, and `w2` its down
# projection, `[E, 576, 192]`. Expert e is the SwiGLU MLP on columns `192 e .. 192 (e + 1)` of
# the dense one.

# %%
ep1 = s11.LLM(**MOE, **SMALL)
mc = ep1.model_config
block = ep1.model.layers[0].mlp
inter = block.intermediate
print(f"{block.num_experts} experts, top-{block.top_k}, {inter} columns each")
print("w13", tuple(block.w13.shape), " w2", tuple(block.w2.shape))


def expert(layer, e, x):
    """Expert e of `layer` on rows x, written out: down(silu(gate x) * up x)."""
    gate, up = layer.w13[e, :inter], layer.w13[e, inter:]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), layer.w2[e])


# %% [markdown]
# A SwiGLU MLP works column by column: column j of the intermediate layer depends only on gate
# row j and up row j, and the down projection adds the columns up. So the sum of all 8 experts
# is the dense MLP, whose weights are the experts' slices put back side by side. We check it
# on random rows.

# %%
torch.manual_seed(0)
rows = torch.randn(4, mc.hidden_size)
with torch.inference_mode():
    dense_gate = torch.cat([block.w13[e, :inter] for e in range(8)])  # [1536, 576]
    dense_up = torch.cat([block.w13[e, inter:] for e in range(8)])
    dense_down = torch.cat([block.w2[e] for e in range(8)], dim=1)  # [576, 1536]
    dense = F.linear(F.silu(F.linear(rows, dense_gate)) * F.linear(rows, dense_up), dense_down)
    all_eight = sum(expert(block, e, rows) for e in range(8))
print("largest difference:", float((dense - all_eight).abs().max()))
assert torch.allclose(dense, all_eight, atol=1e-5)

# %% [markdown]
# The router is a linear layer with one row per expert. Here its row e is the mean of expert
# e's gate rows, so a token scores high for the expert whose gate it excites on average. We
# rebuild it from `w13` and compare with the block's own router.

# %%
router_rows = block.w13[:, :inter].mean(dim=1)  # [8, 576]
with torch.inference_mode():
    assert torch.allclose(block.router(rows), rows @ router_rows.T, atol=1e-5)
print("router row e = mean of expert e's gate rows")

# %% [markdown]
# ## Routing by hand
#
# We run one short prompt through the model and record the input and the output of every
# layer's MoE block with a forward hook. `prompt_logits` runs a prefill without touching the
# KV cache: one forward, every token at once.

# %%
seen = {}


def record(index):
    def hook(_module, args, output):
        seen[index] = (args[0].clone(), output.clone())

    return hook


blocks = [layer.mlp for layer in ep1.model.layers]
hooks = [b.register_forward_hook(record(i)) for i, b in enumerate(blocks)]
ids = ep1.tokenizer.encode("The capital of France is")
ep1.runner.ep.stats.reset()
ep1.prompt_logits(ids)
for hook in hooks:
    hook.remove()
counted = ep1.runner.ep.stats.expert_tokens.clone()
print(len(ids), "tokens,", len(seen), "MoE blocks recorded")

# %% [markdown]
# The router's work for layer 0, by hand: its logits, a softmax in fp32, the top 2. A split
# dense MLP gives each chosen expert weight 1, not its softmax probability, so that top-8
# keeps the dense scale. `moe.route` is the block's function; it must choose the same experts.

# %%
x, y = seen[0]
with torch.inference_mode():
    scores = torch.softmax(x @ router_rows.T, dim=-1)
top = scores.topk(block.top_k, dim=-1)
chosen = top.indices
weights, route_ids = moe.route(block.router(x), block.top_k, block.renormalize, block.split)
assert torch.equal(route_ids, chosen) and bool((weights == 1).all())
for t, token_id in enumerate(ids):
    piece = ep1.tokenizer.decode([token_id])
    probs = [round(float(p), 3) for p in top.values[t]]
    print(f"token {t} {piece!r:10} experts {chosen[t].tolist()}  scores {probs}")

# %% [markdown]
# The scores are close to uniform (1/8 = 0.125): an untrained router has no strong opinion.
# Now the combine, by hand: each token's output is the sum of its two experts' outputs, each
# computed with the `expert` function above. It must equal what the block returned.

# %%
with torch.inference_mode():
    by_hand = torch.stack(
        [sum(expert(block, int(e), x[t]) for e in chosen[t]) for t in range(len(ids))]
    )
print("largest difference:", float((by_hand - y).abs().max()))
assert torch.allclose(by_hand, y, atol=1e-5)

# %% [markdown]
# ## Tokens per expert
#
# `EPStats` counts, for each expert, the (token, expert) pairs it ran, added up over the 30
# layers. We count the same by hand from the recorded inputs: route every layer's tokens and
# add up the choices. The total is tokens x top-k x layers.

# %%
pairs = torch.zeros(8, dtype=torch.long)
chosen_by_layer = []
with torch.inference_mode():
    for i, b in enumerate(blocks):
        layer_x = seen[i][0]
        layer_rows = b.w13[:, :inter].mean(dim=1)
        layer_chosen = torch.softmax(layer_x @ layer_rows.T, dim=-1).topk(2).indices
        chosen_by_layer.append(layer_chosen)
        pairs += torch.bincount(layer_chosen.reshape(-1), minlength=8)
print("by hand:  ", pairs.tolist())
print("EPStats:  ", counted.tolist())
assert torch.equal(pairs, counted)
assert int(pairs.sum()) == len(ids) * 2 * mc.num_layers

# %% [markdown]
# How evenly the pairs spread is the load balance. At EP=2 the rank with the busier experts
# sets the pace of every step. A trained MoE adds a loss term that pushes toward balance; this
# router has none.

# %% [markdown]
# ## Two ranks, by hand
#
# At EP=2 rank 0 owns experts 0-3 and rank 1 experts 4-7. `expert_map(E, EP, rank)` maps a
# global expert to its index among the rank's experts, -1 for another rank's;
# `expert_owner` is the inverse.
#
# Attention stays replicated in this stage: both ranks compute the whole batch. For the MoE
# each rank takes its own half of the tokens (`ceil(n / 2)` of them, rank 0 first). With the
# all-to-all method, `dispatch` sends each of its (token, expert) pairs to the expert's owner,
# `combine` sends the results back, and a final all-gather (the "gather-back") gives both
# ranks every token's output again. A pair crosses the wire only if its expert lives on the
# other rank.

# %%
owner = expert_parallel.expert_owner(8, 2)
for rank in range(2):
    print(f"expert_map rank {rank}:", expert_parallel.expert_map(8, 2, rank).tolist())
print("owner of each expert: ", owner.tolist())

# %% [markdown]
# What each rank sends, per MoE layer, counted the way `EPStats` counts it:
#
# - dispatch: each remote pair's row (576 fp32 values), its expert id (8 bytes) and its weight
#   (4 bytes), plus one 8-byte count per other rank;
# - combine: one result row back for each pair this rank received from the other;
# - gather-back: this rank's whole share of the tokens, `ceil(n / 2)` rows.

# %%
n, hidden = len(ids), mc.hidden_size
chunk = -(-n // 2)
row = hidden * 4  # one fp32 row
predicted = {rank: {"dispatch": 0, "combine": 0, "gather_back": 0} for rank in range(2)}
for layer_chosen in chosen_by_layer:
    for rank in range(2):
        mine = layer_chosen[rank * chunk : (rank + 1) * chunk]
        theirs = layer_chosen[(1 - rank) * chunk : (2 - rank) * chunk]
        remote = int((owner[mine] != rank).sum())  # my pairs whose expert is over there
        received = int((owner[theirs] == rank).sum())  # their pairs whose expert is mine
        predicted[rank]["dispatch"] += remote * (row + 8 + 4) + 8
        predicted[rank]["combine"] += received * row
        predicted[rank]["gather_back"] += chunk * row
for rank, sent in predicted.items():
    print(f"rank {rank} will send", {k: f"{v / 1024:.1f} KiB" for k, v in sent.items()})

# %% [markdown]
# Now the real thing: two processes over gloo, `tensor_parallel_size=2` with
# `expert_parallel=True`. Each rank loads only its experts. `rank_report` returns each rank's
# counters; we read them after the same prefill and compare with the prediction.

# %%
a2a = s11.LLM(**MOE, **SMALL, tensor_parallel_size=2, expert_parallel=True)
a2a.prompt_logits(ids)
reports = a2a.executor.call_all("rank_report")
for report in reports:
    rank, traffic = report["rank"], report["moe"]
    print(f"rank {rank}: pairs run {traffic['expert_tokens']}")
    assert traffic["dispatch_bytes"] == predicted[rank]["dispatch"]
    assert traffic["combine_bytes"] == predicted[rank]["combine"]
    assert traffic["gather_back_bytes"] == predicted[rank]["gather_back"]
per_expert = torch.tensor([r["moe"]["expert_tokens"] for r in reports]).sum(0)
assert torch.equal(per_expert, counted)
print("bytes and pair counts as predicted; the same pairs as one rank")

# %% [markdown]
# Each rank ran exactly its own experts' pairs, and the two ranks together ran the pairs of
# EP=1. Rank 0's combine is rank 1's dispatch of rows without ids and weights, and the other
# way round: the results go back where the rows came from.

# %% [markdown]
# ## The other method, and the tokens
#
# With `moe_dispatch="all_gather"` (vLLM's default) each rank gathers every rank's tokens,
# runs its own experts on all of them, and one reduce-scatter adds the partial sums and hands
# each rank its tokens back. No counts, no sorting; but every token goes to the other rank
# whatever its experts. Per layer each rank sends `ceil(n / 2)` rows out, as many partial sums
# back, and its gather-back, so the three counters are equal.
#
# Both methods must give the greedy tokens of EP=1.

# %%
gather = s11.LLM(
    **MOE, **SMALL, tensor_parallel_size=2, expert_parallel=True, moe_dispatch="all_gather"
)
gather.prompt_logits(ids)
for report in gather.executor.call_all("rank_report"):
    traffic = report["moe"]
    assert traffic["dispatch_bytes"] == traffic["combine_bytes"] == mc.num_layers * chunk * row
    assert traffic["gather_back_bytes"] == mc.num_layers * chunk * row
print(f"all-gather: {mc.num_layers * chunk * row / 1024:.1f} KiB each way per rank")

greedy = s11.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
prompts = ["Why do cats purr?", "Name some famous painters.", "How do vaccines work?"]
expected = [o.token_ids for o in ep1.generate(prompts, greedy)]
for name, engine in (("all_to_all", a2a), ("all_gather", gather)):
    outs = engine.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == expected
    print(f"{name}: EP=1's tokens. {outs[0].text!r}")
a2a.shutdown()
gather.shutdown()

# %% [markdown]
# The text is poor, as promised: each token runs a quarter of the MLP, chosen by a router
# nobody trained. The point is the machinery: the same tokens by three routes.

# %% [markdown]
# ## Measured
#
# `python -m stages 11 bench` runs 8 chat prompts at once, 48 greedy tokens each, through the
# dense model, the split model at EP=1, and EP=2 by both methods. It writes the plot and a JSON
# file; the numbers below are read from the JSON, the run that drew the plot.

# %%
bench = json.loads((PLOTS / "11_ep.json").read_text())
summary, by_config = bench["summary"], bench["results"]["by_config"]
print(bench["machine"])
Image(filename=str(PLOTS / "11_ep.png"))

# %% [markdown]
# **Left: the load.** Pairs per expert over the whole run, summed over the 30 layers, blue for
# rank 0's experts and orange for rank 1's. The dashed line is perfect balance.

# %%
expert_tokens = by_config["ep1"]["moe"]["expert_tokens"]
print("pairs per expert:", expert_tokens)
busiest, idlest = (summary[f"tokens_per_expert_{k}_over_mean"] for k in ("max", "min"))
print(f"busiest {busiest:.2f}x the mean, idlest {idlest:.2f}x")
print("rank 0 runs", sum(expert_tokens[:4]), "pairs, rank 1", sum(expert_tokens[4:]))

# %% [markdown]
# Rank 1 holds two of the busiest experts, so at EP=2 it runs more pairs than rank 0, and
# rank 0 waits for it at every exchange. Large deployments replicate hot experts (vLLM's
# EPLB) for this reason.
#
# **Middle: bytes on the wire.** What the two ranks send each other per MoE layer per step,
# averaged over the run's prefills and decodes: dispatch + combine in blue, the gather-back in
# grey.

# %%
for key in ("all_to_all", "all_gather", "gather_back"):
    print(f"{key:12} {summary[f'bytes_per_layer_step_{key}'] / 1024:5.1f} KiB per layer step")
ratio = summary["bytes_ratio_all_gather_vs_all_to_all"]
ratio_ep8 = summary["modelled_bytes_ratio_all_gather_vs_all_to_all_ep8"]
print(f"all-gather / all-to-all: {ratio:.2f}x here, {ratio_ep8:.1f}x modelled at EP=8")
print("rows per token and layer, modelled:", bench["results"]["modelled_rows_per_token_layer"])

# %% [markdown]
# At EP=2 with top-2 the two methods move the same rows: all-to-all sends each token's two
# pairs out with chance 1/2 each and brings them back, all-gather sends every token once each
# way. All-to-all is a little heavier here because it also sends ids, weights and counts. The
# model says how that changes with more ranks: all-to-all's rows per token grow toward
# 2 x top-k, all-gather's as 2 (EP - 1). At EP=8 all-gather moves 4x more.
#
# **Right: throughput.** Output tokens per second for the same workload.

# %%
for name in ("dense", "ep1", "ep2_all_to_all", "ep2_all_gather"):
    print(f"{name:15} {summary[f'tokens_per_s_{name}']:6.1f} tokens/s")
matching = summary["share_of_requests_matching_dense_tokens"]
print(f"requests whose tokens equal the dense model's: {matching:.0%}")

# %% [markdown]
# The split model at EP=1 does a quarter of the MLP's multiply-adds, yet runs at less than
# half the dense model's speed: 8 small matmuls per layer, the routing and the sorting cost
# more on this CPU than the work they save. EP=2 is slower still: two processes share two
# cores that were already busy, both compute attention for the whole batch, and every layer
# adds three exchanges. On GPUs each rank brings its own memory and compute for its experts;
# this machine shows only what the exchanges cost. None of the split model's answers equals
# the dense model's, as expected of an untrained router.

# %% [markdown]
# ## Exercises
#
# 1. Balance the load without training. DeepSeek-V3 adds a bias per expert to the router's
#    logits for the choice only (not for the weights), raised for idle experts and lowered for
#    busy ones. Add such a bias to the routing loop of "Tokens per expert" and tune it on a
#    few prompts: how close to 1.0x can you bring the busiest expert on other prompts?
# 2. Give each expert a capacity, as Switch Transformer does: at most
#    `capacity_factor x tokens x k / E` pairs per layer, the rest dropped (the token keeps
#    only its residual). With the recorded inputs, count the dropped pairs at factors 1.0 and
#    1.25. What would a drop do to the greedy tokens?
# 3. Find the smallest `moe_top_k` whose greedy tokens equal the dense model's on the three
#    prompts above, and plot the mean KL divergence from the dense model's `prompt_logits`
#    against k. What does the curve say about how much of the MLP a token needs?
# 4. Predict the bytes at EP=4 with this notebook's counting loop (`expert_owner(8, 4)`,
#    a quarter of the tokens per rank) for both methods, before running anything. Which
#    method wins, and by how much, on the prompt above?
# 5. Replicate the busiest expert on the other rank (vLLM's EPLB): send half its pairs to the
#    replica. How do the two ranks' pair counts in the plot's first panel change, and what
#    must `expert_map` become?
