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
from stages.common.tooling.server_process import ThreadedServer

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

# %% [markdown]
# ## Watch the engine think
#
# `GET /dashboard` shows the engine step by step: each step's batch, the queues, the block pool
# as a grid (a prefix hit lights the shared blocks), and the last minute's TTFT and
# inter-token latency. In Jupyter the page opens below (or open the printed address in a
# browser tab). Nothing is computed while nobody watches: the first viewer switches the
# engine's step views on.
#
# The page reads `GET /v1/engine/stream`, one JSON event at most ten times a second. Here we
# read the same stream while four requests run, and print what the page draws from it.

# %%
import json
import threading

from IPython.display import IFrame, display

print(f"{server.url}/dashboard")
display(IFrame(f"{server.url}/dashboard", width=1000, height=620))


def ask(question: str) -> None:
    body = {"model": engine.model_name, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}  # fmt: skip
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


questions = ["What is snow?", "Why is the sea salty?", "What is a cloud?", "Name a tree."]
askers = [threading.Thread(target=ask, args=(q,)) for q in questions]
events = []
with httpx.stream("GET", f"{server.url}/v1/engine/stream", timeout=60) as stream:
    for thread in askers:
        thread.start()
    for line in stream.iter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
        if len(events) >= 30 or (len(events) > 1 and not any(t.is_alive() for t in askers)):
            break
for thread in askers:
    thread.join()
print(f"{'step':>4}  {'batch (request:new tokens, p/d: prefill/decode)':44s}  waiting/running  "
      "blocks used/cached/hit")  # fmt: skip
for event in events:
    view = event["engines"]["0"]
    if not view or not view["batch"]:
        continue
    batch = ", ".join(f"{b['id'][-4:]}:{b['new']}{b['kind'][0]}" for b in view["batch"])
    queues, blocks = event["queues"]["0"], view["blocks"]
    counts = f"{queues['waiting']}/{queues['running']}"
    shown = f"{blocks['used']}/{blocks['cached']}/{blocks['hit']}"
    print(f"{view['step']:4d}  {batch[:44]:44s}  {counts:15s}  {shown}")
server.stop()

# %% [markdown]
# ## What each technique adds
#
# `python -m stages 15 bench`: one chat workload, one row per technique added on top of the
# rows above it, and transformers' `generate` on the same prompts.

# %%
Image(PLOTS / "15_full.png")
