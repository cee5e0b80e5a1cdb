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
# # Stage 13: disaggregated prefill and decode
#
# A prefill engine and a decode engine, here both in this process over the in-process
# transport. We follow one request from one to the other, watch the transfer's state machine
# keep blocks that a transfer still touches, make a transfer fail and see the decode engine
# compute the prompt itself, and look at the measured benchmark.

# %%
import importlib
from pathlib import Path

from IPython.display import Image

import stages

s13 = stages.load("13")
pair_module = importlib.import_module(f"{s13.__name__}.harness.disagg_pair")
fake = importlib.import_module(f"{s13.__name__}.harness.fake_transport")
sides = importlib.import_module(f"{s13.__name__}.disagg.transfer_sides")
state = importlib.import_module(f"{s13.__name__}.disagg.transfer_state")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s13.TECHNIQUE)

# %% [markdown]
# ## One request, two engines
#
# Both engines live in this process: inside `fake.in_process_transports()` two engines built
# with the same `in-process://` address meet over an in-process transport (a test harness; a
# real pair meets over gloo at a `tcp://` address). The prefill engine gets the request with
# `max_tokens=1` and `do_remote_decode`; it computes the prompt, keeps the blocks and hands
# back where they are. The decode engine receives the prompt's KV but the last token, computes
# that token and generates.

# %%
engines = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
with fake.in_process_transports():
    prefill = s13.LLM(kv_role="prefill", kv_transfer_address="in-process://notebook", **engines)
    decode = s13.LLM(kv_role="decode", kv_transfer_address="in-process://notebook", **engines)
colocated = s13.LLM(**engines)
pair = pair_module.DisaggregatedPair(prefill, decode)
greedy = s13.SamplingParams(max_tokens=24, temperature=0)
prompt = "The sky looks blue during the day because sunlight"
[answer] = pair.generate([prompt], greedy)
print("handed over:", pair.handed_over[answer.request_id])
print("prompt tokens:", len(answer.prompt_token_ids), "received:", answer.num_cached_tokens)
print(repr(answer.text))
print("one engine says the same:", colocated.generate([prompt], greedy)[0].text == answer.text)
prefill.check_no_leaks()
decode.check_no_leaks()

# %% [markdown]
# ## The state machine keeps what a transfer touches
#
# The two sides of one request, driven by hand. The prefill side holds three blocks under a
# 5-second lease and starts sending them; ten seconds later the lease has long run out, but a
# send is reading the blocks, so nothing is freed (vLLM #21570). Only when the transport
# reports the send drained do the blocks go back.

# %%
config = state.TransferConfig(lease_seconds=5.0, transfer_timeout_seconds=60.0)
side = sides.PrefillTransfers(config)
side.add("r", now=0.0)
side.bootstrapped("r", now=0.0)
side.hold("r", (7, 3, 9), now=0.0)
side.pull("r", (7, 3, 9), now=1.0)  # decode posted its receive: the send starts
print("state:", side.poll("r").name)
side.poll_timeouts(now=10.0)
print("after the lease, while sending:", side.poll("r").name, side.drain().free)
side.send_finished("r", ok=True, now=11.0)
print("drained:", side.drain().free)

# %% [markdown]
# ## A failed transfer costs one request
#
# The prefill engine refuses one request's transfer (it sends a header naming no blocks): that
# receive fails, the decode engine computes the prompt itself, and the answer is the same.

# %%
transport = prefill.runner.kv_connector.transport
send, sent = transport.start_send, []


def refuse_the_second(rid, pool, ids):
    sent.append(rid)
    return send(rid, pool, () if len(sent) == 2 else ids)


transport.start_send = refuse_the_second
prompts = [
    "The capital of France is a city called",
    "Water boils at a temperature of",
    "The three primary colours of light are",
]
outputs = pair.generate(prompts, greedy)
del transport.start_send
print("received (prompt tokens - 1 when the transfer worked):")
for output in outputs:
    print(f"  {len(output.prompt_token_ids) - 1:3d} wanted, {output.num_cached_tokens:3d} received")
print("transfers that failed:", decode.kv_connector.stats.load_failures)
same = [o.text for o in outputs] == [o.text for o in colocated.generate(prompts, greedy)]
print("same answers as one engine:", same)
prefill.check_no_leaks()
decode.check_no_leaks()

# %% [markdown]
# ## The benchmark
#
# `python -m stages 13 bench` ran four decoding streams while long prompts arrived, on two
# engine cores that prefill and decode (data parallelism) and on one prefill and one decode
# core; measured the KV transfer over gloo against the prompt length; and drew a modelled GPU
# pair (not measured). The plot:

# %%
Image(filename=str(PLOTS / "13_disagg.png"))
