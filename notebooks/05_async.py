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
# # Stage 05: async scheduling
#
# In stage 04 a step is strictly sequential: schedule, prepare inputs, run the model, wait for
# the tokens, then detokenize, check stops and stream. Only then is the next step scheduled.
# Whatever the host does, the model waits for it.
#
# Stage 05 keeps two steps in flight. It launches step t+1 before it processes step t's
# tokens. The tokens step t is still computing are *placeholders* when step t+1 is scheduled;
# the model runner fills them in on the device.
#
# We look at the placeholders the scheduler hands out, launch and resolve two steps by hand,
# check that outputs do not change, and read the measured plot.

# %%
import time
from pathlib import Path

from IPython.display import Image

import stages

s05 = stages.load("05")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20}
print(s05.TECHNIQUE)

# %% [markdown]
# ## Placeholders, by hand
#
# Two requests. We schedule a step, launch it without waiting, and schedule the next step at
# once, while the first is still running. The second step's new token for each request is
# `PLACEHOLDER` (-1): the token step 1 is sampling right now.

# %%
llm = s05.LLM(max_num_seqs=4, **SMALL)
PLACEHOLDER = s05.scheduler.PLACEHOLDER
params = s05.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
requests = [llm.make_request(p, params) for p in ("The sea is", "A cat sat on")]
for request in requests:
    llm.add_request(request)

step1 = llm.scheduler.schedule()
handle1 = llm.runner.launch(step1)  # returns at once: the model runs on a worker thread
step2 = llm.scheduler.schedule()  # step 1's tokens are not known yet
for scheduled in step2.requests:
    print(
        scheduled.request_id,
        "new token ids:",
        scheduled.token_ids,
        "at position",
        scheduled.num_computed_tokens,
    )
print("placeholders per request:", [r.num_output_placeholders for r in requests])
assert all(s.token_ids == (PLACEHOLDER,) for s in step2.requests)

# %% [markdown]
# Launch step 2 and only then resolve step 1. The runner takes step 2's input ids from step
# 1's sampled ids on the device; the host learns them when `result()` returns.

# %%
handle2 = llm.runner.launch(step2)
first = llm.update_from_output(step1, handle1.result())
print("step 1 tokens:", {o.request_id: o.token_ids for o in first})
second = llm.update_from_output(step2, handle2.result())
print("step 2 tokens:", {o.request_id: o.token_ids for o in second})
print("placeholders per request:", [r.num_output_placeholders for r in requests])
while llm.has_unfinished():
    llm.step()

# %% [markdown]
# ## Nothing a request sees changes
#
# The same prompts with the overlap on and off. A request that stops on a stop token in step
# t was already scheduled for step t+1; its token from step t+1 is dropped, so the outputs
# match exactly.

# %%
prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Roses are red"]
params = s05.SamplingParams(max_tokens=24, temperature=0)
timings = {}
outputs = {}
for on in (False, True):
    engine = s05.LLM(max_num_seqs=4, async_scheduling=on, **SMALL)
    engine.generate(prompts[:1], s05.SamplingParams(max_tokens=2))  # warm-up
    started = time.perf_counter()
    outputs[on] = [o.token_ids for o in engine.generate(prompts, params)]
    timings[on] = time.perf_counter() - started
assert outputs[True] == outputs[False]
print(f"same tokens; sync {timings[False]:.2f} s, async {timings[True]:.2f} s on this machine")

# %% [markdown]
# ## Measured
#
# `python -m stages 05 bench` runs the throughput workload with the overlap off and on,
# interleaved, and times the host's work and the model's separately. On a CPU the model and
# the host share the same cores, so the overlap can only help as far as the model leaves a
# core free. The right panel is modelled, not measured: the sync step costs host + model, the
# async step max(host, model), with the host time measured here.

# %%
Image(filename=str(PLOTS / "05_async.png"))

# %% [markdown]
# ## Exercises
#
# 1. Schedule three steps in a row without resolving any. What does the scheduler do with a
#    request that already has a placeholder? Why is the queue depth 2?
# 2. Abort a request between `launch` and `result`. What happens to its token?
# 3. Preempt a request while its token is in flight (a tiny `kv_cache_bytes`). Why does it
#    wait for that token before it is readmitted?
