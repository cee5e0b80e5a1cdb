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
# Every technique of stages 01-14 sits behind one `EngineConfig`, each behind its own switch.
# A deployment preset names the switches a scenario wants and says why. The server speaks
# OpenAI's API, and exposes the engine's counters the way a Prometheus server reads them
# (`GET /metrics`, under vLLM's metric names), a trace per request, and a live view of each
# step.
#
# We resolve a preset by hand and check it against the engine's configuration. Then we switch
# the techniques on one at a time, as the benchmark does, on a small chat workload: every
# exact technique must leave the greedy tokens alone. We serve the chatbot preset, send a few
# requests, and check that every counter in `/metrics` adds up to what the clients were told.
# We watch the engine's step stream, and end with the benchmark's plot. The notebook runs in
# about a minute on a laptop CPU.

# %%
import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import torch
from IPython.display import IFrame, Image, display

import stages
from stages.common.tooling.server_process import ThreadedServer

s15 = stages.load("15")
presets = stages.load("15", "presets")
bench_module = stages.load("15", "bench")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s15.TECHNIQUE)

# %% [markdown]
# ## Presets, resolved by hand
#
# A preset is a scenario, the settings it wants, and the measurements behind them.

# %%
for name, preset in s15.PRESETS.items():
    print(f"{name}: {preset.scenario}\n  {preset.settings}\n  why: {preset.why}\n")

# %% [markdown]
# The rule: a preset fills the fields you did not pass; a field you pass keeps your value,
# even when it equals the default. A setting may depend on the device (`PerDevice`): the
# long-context preset caps one request's prefill at one CPU step's tokens on a CPU, one GPU
# step's on a GPU. We resolve `long-context` by hand for this CPU, with our own host tier of
# 256 MiB instead of the preset's 1 GiB, and compare every field with what `EngineConfig`
# makes of the same arguments.

# %%
given = {"max_model_len": 512, "kv_cache_bytes": 64 * 2**20, "kv_offload_bytes": 2**28}
settings = {
    key: value.pick(torch.device("cpu")) if isinstance(value, presets.PerDevice) else value
    for key, value in s15.PRESETS["long-context"].settings.items()
}
by_hand = s15.EngineConfig(**(settings | given))  # what we passed wins
resolved = s15.EngineConfig(preset="long-context", **given)
differ = {
    f.name: (getattr(by_hand, f.name), getattr(resolved, f.name))
    for f in dataclasses.fields(s15.EngineConfig)
    if getattr(by_hand, f.name) != getattr(resolved, f.name)
}
print("settings on this CPU:", settings)
print(f"{len(dataclasses.fields(s15.EngineConfig))} fields; different: {differ}")
assert differ == {"preset": (None, "long-context")}
assert resolved.kv_offload_bytes == 2**28 and resolved.kv_cache_dtype == "int8"

# %% [markdown]
# Only the `preset` field itself differs: the preset is a shorthand for those settings, no
# more. Passing `speculative=None` to the chatbot preset turns its drafts off, because a value
# you pass is kept whatever it is.

# %% [markdown]
# ## Each technique's switch
#
# `python -m stages 15 bench` runs one chat workload through a series of engines, each with
# one more technique switched on than the one before: a static batch over contiguous KV
# (stage 03's first half), then paged KV, continuous batching, async scheduling, chunked
# prefill, prefix caching, n-gram speculation and the default weight format
# (`quantization="auto"`: INT4 with bf16 activations where the CPU allows, fp32 elsewhere; every
# row before it sets `quantization="none"`). `bench.WATERFALL` holds each
# row's switches. We run the same series on a small workload: four chats sharing a system
# prompt, 8 greedy tokens each.
#
# Every technique but the last is exact: it changes when and how tokens are computed, never
# which. So every row before the weight format must give the first row's tokens.

# %%
for label, switches in bench_module.WATERFALL:
    print(f"{label:38} {switches}")

# %%
system = bench_module.SYSTEM * 2
questions = ["What is rain?", "Why is grass green?", "Name a fruit.", "What is snow?"]
chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
params = s15.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
config, rows = {}, {}
for label, switches in bench_module.WATERFALL:
    config |= switches
    llm = s15.LLM(max_model_len=512, kv_cache_bytes=48 * 2**20, **config)
    started = time.perf_counter()
    outputs = llm.chat(chats, params)
    seconds = time.perf_counter() - started
    rows[label] = [o.token_ids for o in outputs]
    cached = sum(o.num_cached_tokens for o in outputs)
    weights = llm.model.decode_weight_bytes() / 1e6
    same = rows[label] == rows[bench_module.WATERFALL[0][0]]
    print(f"{label:38} {seconds:5.1f} s  cached {cached:3d}  {weights:3.0f} MB/step  same {same}")
    llm.shutdown()
lossy = {label for label, switches in bench_module.WATERFALL if "quantization" in switches}
exact = [label for label, _switches in bench_module.WATERFALL if label not in lossy]
assert all(rows[label] == rows[exact[0]] for label in exact)
print(len(exact), "exact rows, one set of tokens")

# %% [markdown]
# The greedy tokens survive every exact switch. Prefix caching is the first row with cached
# prompt tokens: the later chats find the shared system prompt's blocks. On a CPU with native
# bf16 the auto format cuts the bytes a step reads about threefold (INT4 codes, a bf16 LM
# head) and may change tokens (bf16 activations): the benchmark marks that row lossy. On
# another CPU it keeps fp32, and its bytes do not change. The times here are too short to
# compare; the benchmark measures them below.

# %% [markdown]
# ## Serve the chatbot preset, then read /metrics
#
# The chatbot preset switches on prefix caching, chunked prefill and n-gram speculation (its
# drafts only while at most two requests run). Four questions share a system prompt, one
# after the other. The OpenAI API's `usage` tells each client its prompt tokens, how many of
# them were cached, and the tokens it got.

# %%
engine = s15.LLM(preset="chatbot", max_model_len=512, kv_cache_bytes=64 * 2**20)
print({key: getattr(engine.config, key) for key in s15.PRESETS["chatbot"].settings})
server = ThreadedServer(s15.create_app(engine)).start()
system = "You are a helpful assistant. Answer in one sentence. " * 4
replies = []
for question in ["What is the sky?", "Why is grass green?", "What is rain?", "Name a fruit."]:
    body = {
        "model": engine.model_name,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0,
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    replies.append(reply)
    print(question, "->", repr(reply["choices"][0]["message"]["content"]), reply["usage"])

# %% [markdown]
# `/metrics` is plain text, one sample per line: a name, labels in braces, a value. We parse
# it by hand into `(name, labels) -> value`.

# %%
text = httpx.get(f"{server.url}/metrics", timeout=10).text
metrics = {}
for line in text.splitlines():
    if line.startswith("#") or not line:
        continue
    sample, value = line.rsplit(" ", 1)
    name, _, labels = sample.partition("{")
    metrics[name, labels.rstrip("}")] = float(value)


def total(name, **labels):
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for (n, lab), v in metrics.items() if n == name and all(w in lab for w in wanted))


print(len(metrics), "samples; for example:")
for (name, labels), value in list(metrics.items())[:3]:
    print(f"  {name} {{{labels}}} = {value}")

# %% [markdown]
# Now the check: the engine's counters against what the four clients were told, one by one.
# Prompt and generated tokens come from the front end; the prefix cache's queries and hits
# from the engine core; the finished requests are counted by their finish reason.

# %%
usage = [r["usage"] for r in replies]
seen = {
    "vllm:prompt_tokens_total": sum(u["prompt_tokens"] for u in usage),
    "vllm:generation_tokens_total": sum(u["completion_tokens"] for u in usage),
    "vllm:prefix_cache_queries_total": sum(u["prompt_tokens"] for u in usage),
    "vllm:prefix_cache_hits_total": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage),
    "vllm:time_to_first_token_seconds_count": len(replies),
    "vllm:e2e_request_latency_seconds_count": len(replies),
}
for name, by_clients in seen.items():
    print(f"{name:42} {total(name):6.0f}   clients: {by_clients}")
    assert total(name) == by_clients
for reason in {r["choices"][0]["finish_reason"] for r in replies}:
    count = sum(r["choices"][0]["finish_reason"] == reason for r in replies)
    assert total("vllm:request_success_total", finished_reason=reason) == count
    print(f"vllm:request_success_total{{finished_reason={reason!r}}} = {count}")
accepted = total("vllm:spec_decode_num_accepted_tokens_total")
drafted = total("vllm:spec_decode_num_draft_tokens_total")
print(f"n-gram drafts: {drafted:.0f} tokens proposed, {accepted:.0f} accepted")

# %% [markdown]
# Every counter adds up. The first request found nothing cached; the later ones found the
# system prompt's full blocks. The drafts come from n-gram speculation: a draft is a guess
# copied from earlier text, and the model verifies several in one step.
#
# Each request also has a trace: when it arrived, when the scheduler took it, its first token
# and its end, in seconds after arrival. It carries the same counts as the reply's usage.

# %%
last = replies[-1]
trace = httpx.get(f"{server.url}/v1/requests/{last['id']}/trace", timeout=10).json()
for event in trace["events"]:
    print(f"  {event['event']:12} {1e3 * event['t_s']:7.1f} ms")
assert trace["prompt_tokens"] == last["usage"]["prompt_tokens"]
assert trace["cached_tokens"] == last["usage"]["prompt_tokens_details"]["cached_tokens"]
assert trace["output_tokens"] == last["usage"]["completion_tokens"]

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

# %% [markdown]
# Read the first rows: the four requests arrive a few milliseconds apart, so the first steps
# prefill them (`p`), each after a prefix hit on the system prompt's blocks (the third
# number of the block column). From then on every step decodes all four (`d`, one new token
# each), and with four requests running the preset gives no drafts. We stop the server; the
# engine runs in this process and goes with it.

# %%
server.stop()
print("server thread alive:", server.thread.is_alive())

# %% [markdown]
# ## Measured
#
# The benchmark's workload is 16 chats sharing a long system prompt, 48 greedy tokens each,
# all submitted at once; each row adds one technique, as above. Beside them, on the same
# prompts: transformers' `generate` in one padded batch, and llama.cpp on the embedded Q4_1
# file, one request at a time. The numbers below are read from `plots/15_full.json`, the run
# that drew the plot.

# %%
bench = json.loads((PLOTS / "15_full.json").read_text())
summary, results = bench["summary"], bench["results"]
print(bench["machine"])
Image(filename=str(PLOTS / "15_full.png"))

# %% [markdown]
# **Left: output tokens per second**, one bar per row, higher is better; the grey bars are
# the peers.

# %%
for label, row in results["waterfall"].items():
    tag = "" if row["same_tokens_as_first_row"] else "  (tokens differ: lossy)"
    print(f"{label:40} {row['tokens_per_s']:6.1f} tokens/s{tag}")
print(f"{'transformers generate':40} {summary['tokens_per_s_transformers_generate']:6.1f}")
print(f"{'llama.cpp':40} {summary['tokens_per_s_llama_cpp']:6.1f}")
print(f"best exact row: {summary['speedup_best_exact_vs_first_row']:.1f}x the first row, "
      f"{summary['engine_vs_transformers']:.1f}x transformers")  # fmt: skip

# %% [markdown]
# The steps up to chunked prefill each move throughput a little, up or down: batching shares
# each read of the weights, but on this CPU a step's cost also grows with its batch. Prefix
# caching is the big step: 16 chats share a long system prompt, and all but the first skip
# computing it.
# N-gram speculation then costs throughput: at a batch of 16, verifying drafts costs more
# than the accepted ones save, which is why the chatbot preset gives drafts only to small
# batches. The auto weight format gains a little at this batch of 16 (one sequence gains
# most: the README's 'Served, against llama.cpp'), and changes tokens. The best
# exact row beats transformers' batched `generate` on the same weights; llama.cpp runs the
# 4-bit file one request at a time with kernels made for it.
#
# **Right: time to first token**, the median over the 16 requests, lower is better.

# %%
for label, row in results["waterfall"].items():
    ttft = row["ttft_ms"]
    print(f"{label:40} p50 {ttft['p50']:6.0f} ms  p99 {ttft['p99']:6.0f} ms")
before, after = summary["ttft_p50_ms_first_row"], summary["ttft_p50_ms_prefix_row"]
print(f"first row -> prefix caching: {before:.0f} -> {after:.0f} ms, {before / after:.0f}x")

# %% [markdown]
# All 16 requests arrive at once, so a request's TTFT is mostly waiting for the prefills
# before it. Every row that shortens that wait helps: paged KV and continuous batching admit
# requests sooner, chunked prefill spreads prompts over steps, and prefix caching removes
# most of the prompt's compute. Speculation and INT8 do not shorten it: the first token
# comes from a prefill, which neither makes cheaper on this CPU.

# %% [markdown]
# ## Exercises
#
# 1. Write a preset of your own, `"batch"`, for offline jobs: throughput only, no latency
#    target. Choose its switches from the waterfall above (and stage 10's or 12's numbers if
#    you like), state why for each, and check with the resolution by hand that a field the
#    caller passes still wins.
# 2. Extend the by-hand check of `/metrics` to `vllm:iteration_tokens_total_sum`, the tokens
#    every step computed. Predict it from the replies' usage and the drafting counters before
#    you read it. What does the difference tell you?
# 3. Run the waterfall above with the rows in another order, say prefix caching first. Which
#    techniques' gains depend on the ones before them, and which stand alone?
# 4. Count per tenant: take a tenant name from a request header, add it as a label to the
#    front end's token counters, and check by hand, as above, that each tenant's counters add
#    up to its own clients' usage. What must a label's values be kept to, and why?
