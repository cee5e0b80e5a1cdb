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
# # Stage 15: the full engine
#
# Every technique of stages 01-14 sits behind one `EngineConfig`. We pick a deployment preset,
# serve the embedded SmolLM2 with it, send a few requests, and read the engine's numbers the way
# a Prometheus server would: `GET /metrics`, under vLLM's metric names.

# %%
from pathlib import Path

import httpx
from IPython.display import Image

import stages
from stages.common.server_process import ThreadedServer

s15 = stages.load("15")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s15.TECHNIQUE)

# %% [markdown]
# ## Presets
#
# A preset names the switches a scenario wants, and says why (the earlier stages' measurements).
# It fills the fields you leave at their defaults; a field you set keeps your value.

# %%
for name, preset in s15.PRESETS.items():
    print(f"{name}: {preset.scenario}\n  {preset.settings}\n  why: {preset.why}\n")
config = s15.EngineConfig(preset="long-context", kv_offload_bytes=2**28)
print(config.kv_cache_dtype, config.preemption_mode, config.kv_offload_bytes)

# %% [markdown]
# ## Serve with the chatbot preset, then read /metrics
#
# Prefix caching and n-gram speculation are on. Four questions share a system prompt, so the
# later ones find it cached; the counters below add up to what the clients received.

# %%
engine = s15.LLM(preset="chatbot", max_model_len=512, kv_cache_bytes=64 * 2**20)
server = ThreadedServer(s15.create_app(engine)).start()
system = "You are a helpful assistant. Answer in one sentence. " * 4
usages = []
for question in ["What is the sky?", "Why is grass green?", "What is rain?", "Name a fruit."]:
    body = {
        "model": engine.model_name,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    usages.append(reply["usage"])
    print(question, "->", reply["choices"][0]["message"]["content"])

# %%
text = httpx.get(f"{server.url}/metrics", timeout=10).text
wanted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
          "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum",
          "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_accepted_tokens_total",
          "vllm:num_requests_running")  # fmt: skip
for line in text.splitlines():
    if line.startswith(wanted):
        print(line)
print("prompt tokens the clients were billed:", sum(u["prompt_tokens"] for u in usages))
print("cached tokens they were told about:",
      sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages))  # fmt: skip

# %% [markdown]
# The last request's trace: when it arrived, when the scheduler took it, its first token, its
# end (seconds after arrival).

# %%
print(httpx.get(f"{server.url}/v1/requests/{reply['id']}/trace", timeout=10).json())
server.stop()

# %% [markdown]
# ## What each technique adds
#
# `python -m stages 15 bench`: one chat workload, one row per technique added on top of the
# rows above it, and transformers' `generate` on the same prompts.

# %%
Image(PLOTS / "15_full.png")
