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
# A model too large for one device, or too slow to read from one device's memory, can be
# split across several. Tensor parallelism (Megatron-LM's split) gives every rank a slice of
# every weight matrix: its share of the attention heads, of the MLP's intermediate columns,
# and of the vocabulary. All ranks run the same forward on their slices, and they meet in an
# all-reduce twice per layer.
#
# The pattern is always a column-parallel matmul followed by a row-parallel one. The first
# splits the output features, so each rank computes its own features and never needs the
# others'. The second splits the input features, so each rank's product is a partial sum of
# the output, and one all-reduce adds the partial sums up.
#
# We split one MLP and one attention block of the real checkpoint by hand, in this process,
# and check that the sum of the ranks' parts is the full layer, and that the stage's sharded
# layers load exactly our slices. We work out each rank's weight bytes and the collectives of
# a forward by hand, start an engine with three ranks and check both counts and its tokens
# against one rank. We finish with the measured plot.

# %%
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from IPython.display import Image

import stages
from stages.common.weights import load_state_dict, resolve_model

s09 = stages.load("09")
group = stages.load("09", "parallel.group")
layers = stages.load("09", "parallel.layers")
AttentionMetadata = stages.load("09", "model").AttentionMetadata
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
print(s09.TECHNIQUE)

# %% [markdown]
# ## What splits, and what cannot
#
# SmolLM2-135M has 9 query heads and 3 KV heads. A head cannot be cut in two, so the number
# of ranks must divide 9: two ranks cannot split it, three can. With three ranks each holds
# 3 query heads and the one KV head they read. With more ranks than KV heads, each rank keeps
# a copy of the KV head its query heads read (replicated), as mini-sglang does.

# %%
tp1 = s09.LLM(**SMALL)  # one rank: the plain model of stage 08
mc = tp1.model_config
for size in (2, 3):
    try:
        group.check_tensor_parallel_fits(mc, size)
        heads = [list(group.kv_head_range(mc.num_kv_heads, size, r)) for r in range(size)]
        print(f"TP={size}: fits; KV heads of each rank: {heads}")
    except ValueError as error:
        print(f"TP={size}: {error}")
print("8 KV heads over 16 ranks:", [list(group.kv_head_range(8, 16, r)) for r in range(16)])

# %% [markdown]
# ## One MLP over three ranks, by hand
#
# The MLP is `down(silu(gate(x)) * up(x))`. We read layer 0's three matrices from the
# checkpoint. With `inter` the intermediate size (1,536), rank r takes rows
# `[r inter/3, (r+1) inter/3)` of `gate` and `up` (its intermediate features) and the same
# columns of `down`. The product `silu(gate) * up` is elementwise, so it needs nothing from
# the other ranks. Each rank's `down` product is a full-size partial output; the all-reduce
# is their sum.

# %%
checkpoint = load_state_dict(resolve_model(None))
W = {
    name.removeprefix("model.layers.0."): tensor.float()
    for name, tensor in checkpoint.items()
    if name.startswith("model.layers.0.")
}
del checkpoint
TP, inter, H = 3, mc.intermediate_size, mc.hidden_size
gate, up, down = W["mlp.gate_proj.weight"], W["mlp.up_proj.weight"], W["mlp.down_proj.weight"]

x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))  # five tokens
full = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
partials = []
for r in range(TP):
    cols = slice(r * inter // TP, (r + 1) * inter // TP)
    partials.append((F.silu(x @ gate[cols].T) * (x @ up[cols].T)) @ down[:, cols].T)
    print(
        f"rank {r}: gate/up rows {cols.start}..{cols.stop - 1}, partial {tuple(partials[-1].shape)}"
    )
all_reduced = sum(partials)
torch.testing.assert_close(all_reduced, full, atol=1e-3, rtol=1e-3)
largest = float((all_reduced - full).abs().max())
print(f"sum of the partials == the full MLP (largest difference {largest:.1e})")

# %% [markdown]
# The stage's sharded layers do that split when they load. A `TPGroup(rank, size)` tells a
# layer which rank it is; its parameters' `weight_loader` takes the whole checkpoint tensor
# and copies the rank's part. `MergedColumnParallelLinear` stacks the rank's gate rows and up
# rows into one matrix, so one matmul computes both. We build rank 0's to 2's layers here,
# without any process group (loading needs none), and check they hold our slices.

# %%
for r in range(TP):
    tp = group.TPGroup(rank=r, size=TP)
    gate_up = layers.MergedColumnParallelLinear(H, [inter, inter], bias=False, tp=tp)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    down_r = layers.RowParallelLinear(inter, H, bias=False, tp=tp)
    down_r.weight.weight_loader(down_r.weight, down)
    cols = slice(r * inter // TP, (r + 1) * inter // TP)
    assert torch.equal(gate_up.weight, torch.cat([gate[cols], up[cols]]))
    assert torch.equal(down_r.weight, down[:, cols])
print("the stage's layers load exactly the hand-made slices")

# %% [markdown]
# And the one-rank engine's own MLP of layer 0 gives the same output as our full MLP, so the
# checkpoint matrices are the ones the engine runs.

# %%
with torch.inference_mode():
    engine_mlp = tp1.runner.model.layers[0].mlp(x)
torch.testing.assert_close(engine_mlp, all_reduced, atol=1e-3, rtol=1e-3)
print("engine's layer 0 MLP == the all-reduced shards")

# %% [markdown]
# ## One attention block over three ranks, by hand
#
# Attention splits by heads. Rank r projects only its 3 query heads and its KV head (its
# rows of `q_proj`, `k_proj`, `v_proj`: column-parallel), rotates them, and attends over them
# alone: heads never mix inside attention. Its output, 3 heads of 64 features, meets its
# columns of `o_proj` (row-parallel), and the all-reduce sums the three partial outputs.
#
# The engine's attention without a cache (the way `prompt_logits` runs it) is the reference.

# %%
n, d = x.shape[0], mc.head_dim
positions = torch.arange(n)
rotary = tp1.runner.model.rotary
q_all, k_all, v_all = (W[f"self_attn.{p}_proj.weight"] for p in "qkv")
o_proj = W["self_attn.o_proj.weight"]
heads = mc.num_heads // TP  # query heads per rank

partials = []
for r in range(TP):
    kv = r * mc.num_kv_heads // TP  # the KV head rank r holds
    q = (x @ q_all[r * heads * d : (r + 1) * heads * d].T).view(n, heads, d)
    k = (x @ k_all[kv * d : (kv + 1) * d].T).view(n, 1, d)
    v = (x @ v_all[kv * d : (kv + 1) * d].T).view(n, 1, d)
    q, k = rotary(positions, torch.cat([q, k], dim=1)).split([heads, 1], dim=1)
    k, v = k.expand(n, heads, d), v.expand(n, heads, d)  # one KV head serves three
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    out = out.transpose(0, 1).reshape(n, heads * d)
    partials.append(out @ o_proj[:, r * heads * d : (r + 1) * heads * d].T)

meta = AttentionMetadata(
    query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    seq_lens=torch.tensor([n], dtype=torch.int32),
    block_tables=None,
    slot_mapping=None,
    query_lens=(n,),
    context_lens=(0,),
)
with torch.inference_mode():
    engine_attention = tp1.runner.model.layers[0].self_attn(positions, x, None, meta)
torch.testing.assert_close(sum(partials), engine_attention, atol=1e-3, rtol=1e-3)
print("sum of three ranks' attention == the engine's attention block")

# %% [markdown]
# So a layer costs two all-reduces: one after `o_proj`, one after `down_proj`. The
# embedding adds one more: each rank holds a third of the vocabulary's rows, looks up the
# ids it holds, writes zeros for the others, and an all-reduce fills every row in. The LM
# head is split by vocabulary rows too: each rank scores its third of the words, and one
# all-gather joins the scores, so every rank samples the same token.

# %% [markdown]
# ## A rank's share, by hand
#
# Every matmul weight is split three ways except the KV heads, which here are one per rank
# anyway. The norms are replicated. The embedding is tied to the LM head, one matrix of
# `vocab / 3` rows per rank. We add up the bytes a rank must read in a decode step, the way
# `decode_weight_bytes` counts them (the embedding's lookup reads one row: not counted).


# %%
def weight_bytes_by_hand(size: int) -> int:
    kv_heads = max(1, mc.num_kv_heads // size)
    qkv = (mc.num_heads // size + 2 * kv_heads) * d * H
    o = H * (mc.num_heads // size) * d
    mlp = 3 * H * (inter // size)  # gate and up rows, down columns
    norms = 2 * H
    vocab_rows = -(-mc.vocab_size // size)
    elements = mc.num_layers * (qkv + o + mlp + norms) + H + vocab_rows * H
    return elements * 4  # fp32 on a CPU


for size in (1, 3):
    print(f"TP={size}: {weight_bytes_by_hand(size) / 2**20:.1f} MiB per rank")
assert tp1.weight_bytes() == weight_bytes_by_hand(1)

# %% [markdown]
# ## Three ranks, one engine
#
# `tensor_parallel_size=3` makes the engine start two worker processes; rank 0 runs in this
# process. They join one gloo group (NCCL on GPUs). Each step the engine pickles the
# scheduler output once and writes it to each worker's pipe; every rank builds its inputs
# from it and runs its shard. Only rank 0's sampled tokens go back to the engine.

# %%
tp3 = s09.LLM(tensor_parallel_size=3, **SMALL)
print("workers:", tp3.executor.workers())
prompt = tp3.tokenizer.encode("The capital of France is")
greedy = s09.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
out = tp3.generate([prompt], greedy)[0]
print(repr(out.text))
reports = tp3.executor.call_all("rank_report")
for report in reports:
    print(report)

# %% [markdown]
# Every rank reports the same share of weights, the one KV head, and the same collectives,
# call for call: they run one program. We check the counts by hand. Eight tokens take eight
# forwards (the prompt's, then seven decodes). Each forward makes 2 all-reduces per layer
# plus one for the embedding, over `tokens x hidden` floats, and one all-gather of the
# logits of the row that samples.

# %%
forwards = [len(prompt)] + [1] * (greedy.max_tokens - 1)  # tokens in each forward
per_forward = 2 * mc.num_layers + 1
vocab_rows = -(-mc.vocab_size // TP)
for report in reports:
    stats = report["collectives"]
    assert report["weight_bytes"] == weight_bytes_by_hand(TP)
    assert stats["all_reduce_calls"] == per_forward * len(forwards)
    assert stats["all_reduce_bytes"] == per_forward * sum(forwards) * H * 4
    assert stats["all_gather_calls"] == len(forwards)
    assert stats["all_gather_bytes"] == len(forwards) * TP * vocab_rows * 4
print(f"{per_forward} all-reduces and 1 all-gather per forward, bytes as computed, on every rank")

# %% [markdown]
# ## The same tokens as one rank
#
# The shards compute the same sums in another order, so the logits differ by rounding. The
# greedy tokens are the same.

# %%
alone = tp1.generate([prompt], greedy)[0]
print(repr(alone.text))
assert alone.token_ids == out.token_ids
tp3.shutdown()
print("workers after shutdown:", tp3.executor.workers())

# %% [markdown]
# ## Measured
#
# `python -m stages 09 bench` measures on this machine the weight bytes per rank, the decode
# step at batch 1 and 8 with the share of it spent in collectives, and the cost of shipping
# each step to the workers. A third panel is modelled, not measured: a 70B model on H100s
# with NVLink. The numbers come from the JSON of the same run.

# %%
record = json.loads((PLOTS / "09_tp.json").read_text())
summary, results = record["summary"], record["results"]
print(record["machine"], "|", record["workload"])
Image(filename=str(PLOTS / "09_tp.png"))

# %% [markdown]
# **Left.** Each rank holds its shard: the measured weight bytes per rank against the dashed
# line of a third of one rank's. The bar meets the line because every matrix splits evenly
# here; the replicated norms are too small to show.

# %%
tp1_mib, tp3_mib = summary["weight_mib_per_rank_tp1"], summary["weight_mib_per_rank_tp3"]
print(
    f"weights per rank: TP=1 {tp1_mib:.0f} MiB, TP=3 {tp3_mib:.0f} MiB ({tp1_mib / tp3_mib:.2f}x)"
)
assert results["by_tp"]["3"]["weight_bytes_per_rank"] == weight_bytes_by_hand(3)

# %% [markdown]
# **Middle.** The decode step, per token, at batch 1 and 8, with the share of it spent in
# collectives shaded. On this machine TP=3 is several times slower. Three ranks share two
# cores, so each gets one thread and they take turns, and 61 all-reduces per forward through
# gloo on a CPU cost more than the matmuls they connect. The plot shows the mechanism's cost,
# not its gain: the gain needs a device per rank.

# %%
for batch in (1, 8):
    tp1_ms, tp3_ms = summary[f"itl_ms_batch{batch}_tp1"], summary[f"itl_ms_batch{batch}_tp3"]
    print(f"batch {batch}: TP=1 {tp1_ms:4.0f} ms, TP=3 {tp3_ms:4.0f} ms per step")
share = summary["collective_share_batch1_tp3"]
print(f"TP=3, batch 1: {share:.0%} of the step in collectives,", end=" ")
print(f"{summary['all_reduces_per_forward_tp3']:.0f} all-reduces per forward")
print(f"shipping a step: {summary['step_broadcast_pipe_send_us']:.0f} us by pipe,", end=" ")
print(f"{summary['step_broadcast_gloo_broadcast_object_us']:.0f} us by gloo broadcast_object")

# %% [markdown]
# **Right (modelled).** Llama-3-70B in bf16 on H100s with NVLink, batch 8: the time to read
# one rank's weights at the GPU's memory bandwidth, plus the all-reduces at NVLink's. One GPU
# cannot hold the model at all. From two GPUs on, each doubling halves the weights' read,
# while the all-reduces stay about the same size, so their share grows.

# %%
for size, point in results["modelled_nvlink"].items():
    fits = "" if point["fits_in_gpu_memory"] else "  (does not fit one GPU)"
    print(
        f"TP={size}: weights {point['weights_ms']:5.1f} ms + all-reduces"
        f" {point['all_reduce_ms']:4.2f} ms = {point['step_ms']:5.1f} ms{fits}"
    )

# %% [markdown]
# ## Exercises
#
# 1. Split layer 0's MLP over 2 ranks and its attention over 9 (one head each), by hand as
#    above. Which of the two would the engine refuse, and why does the other work?
# 2. Load the embedding over three ranks with `VocabParallelEmbedding` and a `TPGroup`, look
#    up a few ids on each rank by hand (zeros for ids a rank does not hold), and check that
#    the sum of the three lookups is the full embedding.
# 3. The all-reduce after `o_proj` and the one after `down_proj` each move `tokens x hidden`
#    floats. Work out the bytes for a 4,096-token prefill of Llama-3-70B (hidden 8,192, 80
#    layers) at TP=8, and the time at 450 GB/s per direction. Compare with the weights' read.
# 4. Sequence parallelism replaces each all-reduce with a reduce-scatter and an all-gather,
#    and runs the norms on a slice of the tokens. Write down what each rank holds between the
#    two collectives, and what it saves.
