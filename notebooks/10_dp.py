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
# # Stage 10: data parallelism and routing
#
# Two copies of the engine, each in its own process with its own KV cache, behind one front
# end. The front end tokenizes, routes, detokenizes and cuts stop strings; a replica (an
# engine core) only sees token ids. We start two replicas, follow one request's messages,
# watch the router place a small multi-tenant workload, check that two replicas answer what
# one engine answers, read `/health`'s view, and the measured plot.

# %%
import asyncio
import importlib
from pathlib import Path

from IPython.display import Image

import stages

s10 = stages.load("10")
dp_client = importlib.import_module(f"{s10.__name__}.frontend.dp_client")
output_processor = importlib.import_module(f"{s10.__name__}.frontend.output_processor")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
print(s10.TECHNIQUE)

# %% [markdown]
# ## Two replicas
#
# `DPClient` starts `data_parallel_size` engine-core processes (frontend/engine_core.py). Each
# loads the model, says "ready", then loops: take the messages waiting, step, send one
# `EngineCoreOutputs`.

# %%
client = dp_client.DPClient(data_parallel_size=2, routing_policy="cache_aware", **SMALL)
for replica in client.health_report()["replicas"]:
    print(replica)

# %% [markdown]
# ## What crosses the pipe
#
# The front end makes a `Request` (text, tokenizer, stop strings, detokenizer) and sends the
# core only an `EngineCoreRequest`: token ids, sampling parameters without stop strings, the
# resolved seed. Each step the core answers with an `EngineCoreOutputs`: new token ids per
# request, finish reasons, the KV events of the step (blocks stored or evicted, for the
# router) and its queue lengths. We record the messages the front end receives.

# %%
greedy = s10.SamplingParams(max_tokens=6, temperature=0)
request = client.make_request("The capital of France is", greedy, output_kind="final")
print(output_processor.core_request(request))

received = []
on_outputs = client._on_outputs  # the reader threads call this with each core message


def recording(message):
    received.append(message)
    on_outputs(message)


async def run(request):
    return [o async for o in client.generate(request)][-1]


async def final_output(prompt, params):
    return await run(client.make_request(prompt, params, output_kind="final"))


client._on_outputs = recording
out = await run(request)  # noqa: F704, RUF100 (a notebook cell may await)
client._on_outputs = on_outputs
for m in received:  # the first: the queue lengths right after the add, before any step
    print(f"replica {m.replica} waiting {m.num_waiting} running {m.num_running}:", m.outputs)
print(repr(out.text))

# %% [markdown]
# The text exists only in the front end: the `OutputProcessor` appended each step's token ids
# to the request and detokenized them.
#
# ## The router's decisions on a multi-tenant workload
#
# Three tenants, each with its own long system prompt, three users each. A request is a system
# prompt plus a short question. `cache_aware` sends a request to the replica holding its
# longest cached prefix (known exactly, from the replicas' KV events) when that prefix covers
# more than half the prompt; on a miss, to the least loaded replica (ties by requests served,
# then index). `router.last_decision` says which and why.

# %%
SYSTEMS = {
    "bank": "You are the assistant of a bank. Answer questions about accounts, cards, "
    "transfers and fees politely, in two sentences at most, and never give financial advice.",
    "clinic": "You are the receptionist of a small clinic. You book, move and cancel "
    "appointments, explain opening hours, and ask callers to dial the emergency number for "
    "anything urgent.",
    "shop": "You are the help desk of an online shop selling shoes. You track orders, explain "
    "the return policy of thirty days, and suggest sizes from the customer's usual size.",
}
QUESTIONS = ["How do I start?", "What does it cost?", "Can you help me today?"]
short = s10.SamplingParams(max_tokens=4, temperature=0)
for question in QUESTIONS:
    for tenant, system in SYSTEMS.items():
        await final_output(f"{system}\nUser: {question}\nAssistant:", short)  # noqa: F704
        d = client.router.last_decision
        print(
            f"{tenant:>6} | {question:<22} -> replica {d.replica} ({d.reason}, "
            f"{d.matched_tokens} tokens cached there)"
        )

# %% [markdown]
# Each tenant's first request is a miss and goes by load (all idle here, so to the replica that
# served fewer requests): the tenants spread over the two replicas. Every later request of a
# tenant finds its system prompt cached on the replica that served it first, and goes there.
# Round robin would send each tenant to both replicas and compute every system prompt twice.
#
# ## Two replicas answer what one engine answers
#
# The front end resolves each request's seed before routing, so greedy and seeded sampling
# give the same tokens whichever replica runs them.

# %%
prompts = ["The three primary colors are", "Write a haiku about the sea.", "2 + 2 ="]
seeded = s10.SamplingParams(max_tokens=8, temperature=0.8, seed=3)


async def all_outputs(params):
    return await asyncio.gather(*(final_output(p, params) for p in prompts))


one = s10.LLM(**SMALL)
for params in (greedy, seeded):
    two = [o.token_ids for o in await all_outputs(params)]  # noqa: F704
    print(two == [o.token_ids for o in one.generate(prompts, params)])

# %% [markdown]
# ## What `/health` shows
#
# Per replica: its pid, whether it is alive, its queues and its load (requests routed there and
# not finished); the router's counts of each decision.

# %%
health = client.health_report()
for replica in health["replicas"]:
    print(replica)
print(health["router"])
client.shutdown()

# %% [markdown]
# ## Measured
#
# `python -m stages 10 bench` on this machine: throughput against the number of replicas, and
# the prefix hit rate and time to first token per routing policy on a multi-tenant workload.

# %%
plot = PLOTS / "10_dp.png"
Image(filename=str(plot)) if plot.exists() else print("run: python -m stages 10 bench")
