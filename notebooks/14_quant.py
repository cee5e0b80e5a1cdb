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
# We quantize one of SmolLM2's weight matrices in each format and look at the error, run the
# engine with INT8 weights against fp32, and fill a KV cache of 1-byte codes. One caveat runs
# through everything: the embedded SmolLM2 is itself a dequantized Q4_1 GGUF, so INT4
# asymmetric with groups of 32 reproduces its weights exactly.

# %%
import importlib
from pathlib import Path

import torch
import torch.nn.functional as F
from IPython.display import Image

import stages
from stages.common.weights import open_checkpoint, resolve_model

s14 = stages.load("14")
formats = importlib.import_module(f"{s14.__name__}.quant.formats")
kv_quant = importlib.import_module(f"{s14.__name__}.quant.kv_cache")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 256, "kv_cache_bytes": 32 * 2**20}
print(s14.TECHNIQUE)

# %% [markdown]
# ## One matrix, four formats
#
# Layer 0's down_proj, [576 out, 1536 in]. Each format stores codes plus scales; we compare the
# dequantized matrix with the original. INT4-asym g32 lands on the checkpoint's own Q4_1 grid.

# %%
with open_checkpoint(resolve_model(None)) as checkpoint:
    w = dict(checkpoint.tensors())["model.layers.0.mlp.down_proj.weight"][:].float()

variants = {
    "int8": formats.dequantize_int8(formats.quantize_int8(w)),
    "fp8": formats.dequantize_fp8(formats.quantize_fp8(w)),
    "int4 sym g64": formats.dequantize_int4(formats.quantize_int4(w, 64, symmetric=True)),
    "int4 asym g64": formats.dequantize_int4(formats.quantize_int4(w, 64, symmetric=False)),
    "int4 asym g32": formats.dequantize_int4(formats.quantize_int4(w, 32, symmetric=False)),
}
for name, approx in variants.items():
    error = ((approx - w).norm() / w.norm()).item()
    print(f"{name:14s} relative error {error:.4f}")

# %% [markdown]
# ## FP8 needs its scale
#
# e4m3's largest value is 448. The standard cast turns anything past 464 into NaN; this
# torch's CPU cast clips at 448. Scaling each row so its largest value maps to 448 avoids both,
# at the price of 3 mantissa bits: neighbouring codes are up to 6% apart.

# %%
x = torch.tensor([1.0, 300.0, 448.0, 470.0, 1000.0])
print("standard cast:", formats.e4m3_from_bits(formats.e4m3_bits_nonsaturating(x)).tolist())
print("torch's cast: ", x.to(formats.FP8_DTYPE).float().tolist())
print("with a scale: ", formats.dequantize_fp8(formats.quantize_fp8(x[None]))[0].tolist())

# %% [markdown]
# ## The engine, fp32 vs INT8
#
# The same prompt, greedy. `decode_weight_bytes` counts what one batch-1 step reads: the LM
# head (113 MB) stays fp32. KL is over the prompt's teacher-forced next-token distributions.

# %%
fp32 = s14.LLM(**SMALL)
int8 = s14.LLM(quantization="int8", quant_activations="bf16", **SMALL)
params = s14.SamplingParams(max_tokens=24, temperature=0)
prompt = "The three primary colors are"
for name, llm in (("fp32", fp32), ("int8", int8)):
    text = llm.generate(prompt, params)[0].text
    print(f"{name}: {llm.model.decode_weight_bytes() / 1e6:.0f} MB per token | {text!r}")
ids = fp32.tokenizer.encode("The lighthouse keeper climbed the spiral stairs every evening.")
p, q = fp32.prompt_logits(ids).log_softmax(-1), int8.prompt_logits(ids).log_softmax(-1)
print("mean KL:", F.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean().item())

# %% [markdown]
# ## A KV cache of bytes
#
# One budget, two pools: fp32 elements, and int8 codes with a scale per (block, KV head).

# %%
kv8 = s14.LLM(kv_cache_dtype="int8", **SMALL)
print("fp32 blocks:", fp32.runner.num_blocks, "| int8 blocks:", kv8.runner.num_blocks)
cache = kv8.runner.kv_cache
print(type(cache).__name__, cache.k.dtype, tuple(cache.k_scale.shape))
print(kv8.generate(prompt, params)[0].text)

# %% [markdown]
# ## Measured
#
# `python -m stages 14 bench`: bytes, memory, KV capacity, speed and quality per format.

# %%
Image(PLOTS / "14_quant.png")
