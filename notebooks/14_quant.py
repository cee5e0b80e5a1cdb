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
# # Stage 14: quantization
#
# A batch-1 decode step reads every weight once, so its speed is set by how many bytes the
# weights take. Quantization stores each weight in fewer bits: integer (or 8-bit float)
# codes plus a few float scales, and `code x scale` gives the weight back, approximately. The
# same trick shrinks the KV cache, so one memory budget holds more tokens.
#
# We count a decode step's bytes by hand, then quantize one of SmolLM2's weight matrices by
# hand in INT8 (a scale per output channel) and INT4 (a scale per group of 32 or 64 inputs),
# and check that the engine's quantized layers hold exactly our codes and compute our matmul.
# We measure the quality cost as the KL divergence from the fp32 model, fill a KV cache of
# 1-byte codes and check one block by hand, and read the benchmark's four panels.
#
# One caveat runs through all of it: the embedded SmolLM2 is itself a dequantized Q4_1 GGUF
# checkpoint. Its weights already sit on a 4-bit grid, so one of the INT4 formats reproduces
# them exactly. The notebook runs in about a minute on a laptop CPU.

# %%
import json
import math
from pathlib import Path

import torch
from IPython.display import Image

import stages
from stages.common.weights import open_checkpoint, resolve_model

s14 = stages.load("14")
formats = stages.load("14", "quant.formats")
kv_quant = stages.load("14", "quant.kv_cache")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 256, "kv_cache_bytes": 32 * 2**20}
print(s14.TECHNIQUE)

# %% [markdown]
# ## What a decode step reads
#
# Each layer has four matrices: the fused q/k/v projection, the attention output, the fused
# gate/up projection and the MLP's down projection. One decode step reads all of them, the LM
# head (tied to the embedding: 49,152 x 576) and the norms. The embedding lookup reads one row
# only and is not counted. We add it up from the model's shape, in fp32.

# %%
fp32 = s14.LLM(**SMALL)
mc = fp32.model_config
h, q_kv = mc.hidden_size, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
matrices = {  # (out_features N, in_features K) of each layer's matmuls
    "qkv_proj": (q_kv, h),
    "o_proj": (h, mc.num_heads * mc.head_dim),
    "gate_up_proj": (2 * mc.intermediate_size, h),
    "down_proj": (h, mc.intermediate_size),
}
per_layer = sum(n * k for n, k in matrices.values())  # weights per layer
lm_head = mc.vocab_size * h * 4
norms = (2 * mc.num_layers + 1) * h * 4
fp32_bytes = mc.num_layers * per_layer * 4 + lm_head + norms
print(f"per layer {per_layer:,} weights; LM head {lm_head / 1e6:.0f} MB")
print(f"fp32: {fp32_bytes / 1e6:.1f} MB per decode step")
assert fp32_bytes == fp32.model.decode_weight_bytes()

# %% [markdown]
# The engine's count agrees. The LM head is a fifth of it, and it stays in fp32 in every
# format here (vLLM keeps it in full precision by default too).

# %% [markdown]
# ## INT8, one scale per output channel
#
# We take layer 0's down projection, `[576 out, 1536 in]`, from the checkpoint. INT8 per
# channel, symmetric: each output row n gets `scale[n] = max |W[n, :]| / 127`, and its codes
# are `round(W / scale)`, in [-127, 127]. The largest element of a row maps to +-127 exactly;
# every other element is off by at most half a step, `scale / 2`.

# %%
with open_checkpoint(resolve_model(None)) as checkpoint:
    w = dict(checkpoint.tensors())["model.layers.0.mlp.down_proj.weight"][:].float()

scale = w.abs().amax(dim=1) / 127
codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
w_int8 = codes.float() * scale[:, None]
error = (w_int8 - w).abs()
print(f"{tuple(codes.shape)} int8 codes, {tuple(scale.shape)} fp32 scales")
print(f"largest error {float(error.max()):.2e}, at most half a step: {float(scale.max() / 2):.2e}")
assert bool((error <= scale[:, None] / 2 + 1e-7).all())

# %% [markdown]
# The engine quantizes a float checkpoint as it loads (online quantization): each sharded
# linear layer gets a method that quantizes its weight once and then computes with the codes.
# `quantization="int8"` must give our codes and scales bit for bit.

# %%
int8 = s14.LLM(quantization="int8", **SMALL)
layer = int8.model.layers[0].mlp.down_proj
print(type(layer).__name__, "holds", type(layer.quant_weight).__name__)
assert torch.equal(layer.quant_weight.codes, codes)
assert torch.equal(layer.quant_weight.scale, scale)

# %% [markdown]
# Because the scale belongs to a whole output row, it factors out of the dot product:
# `y[:, n] = (x @ codes[n]) x scale[n]`. A kernel multiplies integers (or the codes as floats)
# and scales each output once. We compute the layer's output that way and compare with what
# the layer returns on random inputs.

# %%
torch.manual_seed(0)
x = torch.randn(3, w.shape[1])
with torch.inference_mode():
    from_layer = layer(x)
by_hand = (x @ codes.float().T) * scale
print(f"largest difference {float((from_layer - by_hand).abs().max()):.1e}, "
      f"outputs up to {float(by_hand.abs().max()):.0f}")  # fmt: skip
assert torch.allclose(from_layer, by_hand, rtol=1e-4, atol=1e-3)
assert torch.allclose(by_hand, x @ w_int8.T, rtol=1e-4, atol=1e-3)

# %% [markdown]
# ## INT4 in groups
#
# Four bits give only 16 codes, too few for one scale per row of 1,536 values. INT4 formats
# give each group of 32, 64 or 128 consecutive inputs of a row its own scale. Two forms:
#
# - symmetric: `scale = max |group| / 7`, codes `round(w / scale) + 8` in [1, 15];
# - asymmetric: the group's minimum is its offset, `scale = (max - min) / 15`, codes
#   `round((w - min) / scale)` in [0, 15], and `w = code x scale + min`.
#
# Two codes share a byte: the even column in the low nibble, the odd one in the high nibble.
# We quantize asymmetric with groups of 32 by hand.

# %%
groups = w.reshape(w.shape[0], -1, 32)  # [576, 48 groups, 32]
low, high = groups.amin(dim=-1), groups.amax(dim=-1)
step = (high - low) / 15
codes4 = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
w_int4 = (codes4 * step[..., None] + low[..., None]).reshape(w.shape)
flat = codes4.reshape(w.shape).to(torch.uint8)
packed = flat[:, 0::2] | (flat[:, 1::2] << 4)
print(f"codes {tuple(flat.shape)} packed into {tuple(packed.shape)} bytes")
print(f"largest error {float((w_int4 - w).abs().max()):.1e}")

# %% [markdown]
# Zero error. This is the caveat: the checkpoint was a Q4_1 GGUF, which stores exactly this
# format (groups of 32, a scale and a minimum each), and the embedded weights are its
# dequantized values. So asymmetric INT4 with groups of 32 finds the original grid again. Any
# other choice does not. `formats` has each format's quantizer; here is each one's relative
# error on this matrix.

# %%
q_asym32 = formats.quantize_int4(w, 32, symmetric=False)
assert torch.equal(q_asym32.packed, packed)
variants = {
    "int8": formats.dequantize_int8(formats.quantize_int8(w)),
    "fp8": formats.dequantize_fp8(formats.quantize_fp8(w)),
    "int4 sym g64": formats.dequantize_int4(formats.quantize_int4(w, 64, symmetric=True)),
    "int4 asym g64": formats.dequantize_int4(formats.quantize_int4(w, 64, symmetric=False)),
    "int4 asym g32": formats.dequantize_int4(q_asym32),
}
for name, approx in variants.items():
    print(f"{name:14s} relative error {float((approx - w).norm() / w.norm()):.4f}")

# %% [markdown]
# An engine with `quantization="int4-asym"` and `quant_group_size=32` must hold our packed
# bytes, and its matmul must equal `x @ W_int4.T` (here, `x @ W.T` itself).

# %%
int4 = s14.LLM(quantization="int4-asym", quant_group_size=32, **SMALL)
layer4 = int4.model.layers[0].mlp.down_proj
assert torch.equal(layer4.quant_weight.packed, packed)
with torch.inference_mode():
    from_layer4 = layer4(x)
print(f"largest difference {float((from_layer4 - x @ w_int4.T).abs().max()):.1e}")
assert torch.allclose(from_layer4, x @ w_int4.T, rtol=1e-4, atol=1e-3)

# %% [markdown]
# ## FP8 needs its scale
#
# FP8 e4m3 has 4 exponent bits and 3 mantissa bits; its largest value is 448. The standard's
# cast turns anything past 464 (the midpoint to the next binade) into NaN, and one NaN in a
# weight poisons every output it touches. This torch's CPU cast clips at 448 instead: a silent
# error. A scale per row that maps the row's largest value to 448 avoids both, at the price of
# 3 mantissa bits: neighbouring codes are up to 6% apart.

# %%
values = torch.tensor([1.0, 300.0, 448.0, 470.0, 1000.0])
print("standard cast:", formats.e4m3_from_bits(formats.e4m3_bits_nonsaturating(values)).tolist())
print("torch's cast: ", values.to(formats.FP8_DTYPE).float().tolist())
print("with a scale: ", formats.dequantize_fp8(formats.quantize_fp8(values[None]))[0].tolist())

# %% [markdown]
# ## The cost in quality: KL from fp32
#
# A weight's error is not the model's. We run the same text through each engine, teacher
# forced (`prompt_logits`: the logits at every position), and compare each position's
# next-token distribution q with fp32's p by the KL divergence, `sum p (log p - log q)`,
# averaged over the positions. Zero means the same distributions.

# %%
text = "The lighthouse keeper climbed the spiral stairs every evening to light the lamp."
ids = fp32.tokenizer.encode(text)
log_p = fp32.prompt_logits(ids).log_softmax(-1)
kl = {}
for name, engine in (("int8", int8), ("int4-asym g32", int4)):
    log_q = engine.prompt_logits(ids).log_softmax(-1)
    kl[name] = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    print(f"{name:14s} mean KL {kl[name]:.2e} over {len(ids)} positions")
assert abs(kl["int4-asym g32"]) < 1e-5 < kl["int8"]

# %% [markdown]
# INT8 costs a little: its per-row grid is finer than the checkpoint's 4-bit one, but it is a
# different grid. INT4-asym with groups of 32 costs nothing on this model, for the reason
# above; on a model trained in full precision it would cost more than INT8.
#
# What INT8 saves: the matmul weights shrink four times, the LM head stays. We count the bytes
# of a decode step again, with one byte per weight plus a 4-byte scale per output row.

# %%
scales_per_layer = sum(n for n, _k in matrices.values())
int8_bytes = mc.num_layers * (per_layer + 4 * scales_per_layer) + lm_head + norms
print(f"int8: {int8_bytes / 1e6:.1f} MB per decode step, {int8_bytes / fp32_bytes:.2f}x fp32")
assert int8_bytes == int8.model.decode_weight_bytes()

greedy = s14.SamplingParams(max_tokens=24, temperature=0)
prompt = "The three primary colors are"
answers = {name: e.generate(prompt, greedy)[0] for name, e in (("fp32", fp32), ("int8", int8))}
for name, out in answers.items():
    print(f"{name}: {out.text!r}")
print("same greedy tokens:", answers["fp32"].token_ids == answers["int8"].token_ids)

# %% [markdown]
# A small shift near a tie is enough to change a greedy answer, and every later token follows
# from the changed one. Whether a given prompt's answer changes depends on how close its
# ties are; the KL above measures the shift itself.

# %% [markdown]
# ## A KV cache of bytes
#
# `kv_cache_dtype="int8"` stores K and V as 1-byte codes with one fp32 scale per (block, KV
# head). A block of 16 tokens holds 16 x 64 codes per head and layer plus one 4-byte scale, so
# one byte budget buys almost 4x the fp32 blocks. We size a block by hand and compare the two
# engines' pools, built from the same budget.

# %%
kv8 = s14.LLM(kv_cache_dtype="int8", **SMALL)
size, heads, dim = fp32.block_size, mc.num_kv_heads, mc.head_dim
fp32_block = 2 * mc.num_layers * size * heads * dim * 4
int8_block = 2 * mc.num_layers * (size * heads * dim + heads * 4)
assert int8_block == kv_quant.kv_bytes_per_block(mc.num_layers, size, heads, dim, "int8")
print(f"block: {fp32_block:,} bytes in fp32, {int8_block:,} in int8, "
      f"{fp32_block / int8_block:.2f}x")  # fmt: skip
print("pool blocks, same budget: fp32", fp32.runner.num_blocks, "| int8", kv8.runner.num_blocks)
cache = kv8.runner.kv_cache
print(type(cache).__name__, cache.k.dtype, tuple(cache.k.shape))
print("scales", tuple(cache.k_scale.shape), "[layers, blocks, heads]")

# %% [markdown]
# Now one block by hand. Both engines run the same prompt. The model's weights are the same
# fp32 ones, so the K they compute is the same; the int8 engine stores it as codes. A
# prompt's first block is written at once by the prefill, so its scale is the block's largest
# |K| per head over 127, and each value is off by at most half a step. (A block that grows
# token by token raises its scale by powers of two as it goes; the error stays under one
# step.)

# %%
long_prompt = "In the morning the harbour was quiet, and the fishing boats rocked gently " * 2
runs = {}
for name, engine in (("fp32", fp32), ("int8", kv8)):
    request = engine.make_request(long_prompt, greedy)
    engine.add_request(request)
    engine.step()  # the prefill
    runs[name] = (request, engine.kv_manager.block_ids(request.request_id)[0])
    while engine.has_unfinished():
        engine.step()
(fp32_request, fp32_block_id), (int8_request, int8_block_id) = runs["fp32"], runs["int8"]
k_exact = fp32.runner.kv_cache.k[0, fp32_block_id]  # layer 0, [16 tokens, heads, dim]
k_codes, k_scale = cache.k[0, int8_block_id], cache.k_scale[0, int8_block_id]
expected_scale = k_exact.abs().amax(dim=(0, 2)) / 127  # one per head
k_back = k_codes.float() * k_scale[None, :, None]
half_step = float(k_scale.max() / 2)
print(f"{len(fp32_request.prompt_token_ids)} prompt tokens; layer 0, first block, per head:")
print("scale by hand:", expected_scale.tolist())
print("scale stored: ", k_scale.tolist())
print(f"largest error {float((k_back - k_exact).abs().max()):.2e}, half a step {half_step:.2e}")
assert torch.allclose(k_scale, expected_scale)
assert bool(((k_back - k_exact).abs() <= k_scale[None, :, None] / 2 + 1e-6).all())
same = int8_request.output_token_ids == fp32_request.output_token_ids
print("same greedy tokens as fp32 KV:", same)

# %% [markdown]
# ## Measured
#
# `python -m stages 14 bench` runs every format on the embedded model: the bytes a decode step
# reads and the bytes held in memory, batch-1 and batch-32 decode speed, and the quality on a
# fixed text. The numbers below are read from `plots/14_quant.json`, the run that drew the
# plot.

# %%
bench = json.loads((PLOTS / "14_quant.json").read_text())
summary, variants_measured = bench["summary"], bench["results"]["variants"]
print(bench["machine"])
Image(filename=str(PLOTS / "14_quant.png"))

# %% [markdown]
# **Top left: weight bytes**, read per decode token (blue) and held in memory (orange).

# %%
for name, v in variants_measured.items():
    if "bytes_per_token" in v:
        print(f"{name:24} read {v['bytes_per_token'] / 1e6:4.0f} MB  "
              f"held {v['weight_memory_bytes'] / 1e6:4.0f} MB")  # fmt: skip
print(f"int8 reads {summary['int8_bytes_per_token_vs_fp32']:.2f}x fp32's bytes")
assert variants_measured["int8"]["bytes_per_token"] == int8_bytes

# %% [markdown]
# The bench's int8 count is the one we made by hand. INT4 reads a little less than INT8, not
# half: the fp32 LM head is the same in every format, and groups of 32 carry a scale and an
# offset per 32 weights. The memory held is more than the bytes read: the token embedding
# is held twice, once for lookups and once in the LM head's prepared layout; the INT4 CPU
# paths keep their weights in a second, prepared layout too, and with bf16 activations a
# quantized format also holds a bf16 copy of its weights for batches (below). The KV formats
# change no weight.
#
# **Top right: batch-1 decode speed** against its roofline, the speed if a step cost only
# reading its weights at the machine's measured copy bandwidth.

# %%
print(f"copy bandwidth {summary['copy_bandwidth_gb_s']:.1f} GB/s")
for name, v in variants_measured.items():
    if "decode_tokens_per_s_batch1" in v:
        print(f"{name:24} {v['decode_tokens_per_s_batch1']:5.1f} tokens/s, "
              f"roofline {v['roofline_tokens_per_s_batch1']:5.1f}")  # fmt: skip

# %% [markdown]
# fp32 reaches about a third of its roofline. The quantized formats raise the roofline but mostly
# fall far below it: on this CPU the matmuls that take INT8 or INT4 codes with fp32 inputs are
# slow, far slower than reading the bytes. Rounding the activations to bf16
# (`quant_activations="bf16"`) opens faster paths: INT8 with bf16 activations beats fp32, and
# INT4-asym with groups of 64 and bf16 activations is the fastest of all. On a GPU, the
# dequantizing kernels run near the roofline and quantization pays directly.
#
# **Bottom left: batched decode**, 32 requests at once.

# %%
for name, v in variants_measured.items():
    if "decode_tokens_per_s_batch_big" in v:
        print(f"{name:24} {v['decode_tokens_per_s_batch_big']:5.0f} tokens/s at batch 32")

# %% [markdown]
# At batch 32 a step's weights are read once for 32 tokens, so compute matters more than
# bytes. The bf16-activation paths lead: past four rows they run one bf16 GEMM over a copy of
# the dequantized weights (torch's fused INT8/INT4 ops take one row at a time), then fp32; the
# INT8, FP8 and INT4 paths that take fp32 inputs stay far behind. The int8 KV cache costs
# some speed too: every read of the cache dequantizes.
#
# **Bottom right: quality**, the mean KL divergence from fp32 on a fixed text, read through
# the KV cache (teacher forced decode steps), on a log scale with a floor at 1e-6.

# %%
for name, v in variants_measured.items():
    if "kl_mean" in v:
        print(f"{name:24} KL {v['kl_mean']:.4f}  greedy tokens matched "
              f"{v['greedy_tokens_matched']}")  # fmt: skip
refused = summary["int4_g128_refused"]
print("int4 with groups of 128 refused:", refused)
tokens_ratio = summary["kv_int8_tokens_per_gib_vs_fp32"]
print(f"int8 KV holds {tokens_ratio:.2f}x the tokens per GiB; a block by hand gave "
      f"{fp32_block / int8_block:.2f}x")  # fmt: skip
assert math.isclose(tokens_ratio, fp32_block / int8_block, rel_tol=1e-2)

# %% [markdown]
# INT8 weights and both KV formats cost little. FP8's three mantissa bits cost more, and its
# greedy answer leaves fp32's early. The INT4 formats cost a lot, except asymmetric groups of
# 32, at the floor: the checkpoint's own grid. Groups of 128 do not divide
# the attention's input width of 576, so the engine refuses them. The int8 KV cache holds
# almost 4x the tokens of fp32 in the same memory, as our block count said.

# %% [markdown]
# ## Exercises
#
# 1. Quantize the down projection by hand with an integer zero point, as GPTQ stores it
#    (`w = (code - zero) x scale`, zero an integer in [0, 15]), instead of a float minimum.
#    How much larger is the error on this matrix, and why can the float offset not be beaten
#    for a group's extreme values?
# 2. Find the layers that suffer most: quantize one layer at a time to INT4 symmetric g64 (the
#    others fp32) and measure the KL of `prompt_logits` as above. Keep the worst three in
#    INT8 and the rest in INT4: how do bytes per step and KL compare with all-INT4?
# 3. Quantize the LM head to INT8 as well, by hand, with `formats.quantize_int8` on the
#    embedding matrix, and compute the logits of one position both ways. What does it save
#    per step, and what does it cost in KL?
# 4. Scale the KV cache per token instead of per (block, head): one scale per token and head.
#    Compute by hand the bytes per block and the error on the block above. Which one needs no
#    requantization as a block grows?
