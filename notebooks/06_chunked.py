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
# # Stage 06: chunked prefill
#
# Until now a prompt was prefilled in one step. A long prompt that arrives while others
# decode makes that one step very long, and every running stream waits for it.
#
# Stage 06 gives every step one token budget. Running requests come first, then waiting ones,
# and a long prompt is split into chunks that fit the budget. Only its last chunk samples a
# token. We watch the scheduler split a prompt, measure what a running stream sees with and
# without chunking, and read the measured plot.

# %%
import itertools
import statistics
from pathlib import Path

from IPython.display import Image

import stages

s06 = stages.load("06")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20, "async_scheduling": False}
print(s06.TECHNIQUE)

# %% [markdown]
# ## One prompt, chunk by chunk
#
# A budget of 64 tokens per step, one stream decoding, and a 200-token prompt arriving. Each
# line is one step: who ran, how many new tokens, from which position, and whether the step
# sampled a token for them.

# %%
llm = s06.LLM(max_num_batched_tokens=64, **SMALL)
greedy = s06.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
stream = llm.make_request("Tell me a story.", greedy, request_id="stream")
llm.add_request(stream)
llm.step()
long_prompt = llm.tokenizer.encode("The lighthouse keeper counted the ships. " * 25)[:200]
llm.add_request(llm.make_request(long_prompt, greedy, request_id="long"))
for _ in range(5):
    scheduler_output = llm.scheduler.schedule()
    for s in scheduler_output.requests:
        print(
            f"{s.request_id:>6}: {len(s.token_ids):3d} new tokens from position "
            f"{s.num_computed_tokens:3d}, sample={s.sample}"
        )
    print(f"  step total {scheduler_output.num_tokens} tokens (budget 64)")
    llm.update_from_output(scheduler_output, llm.runner.execute_model(scheduler_output))
while llm.has_unfinished():
    llm.step()

# %% [markdown]
# ## What the running stream sees
#
# The same arrival with chunking off (the prompt prefilled whole) and on (64-token chunks).
# We record the stream's gaps between tokens around the arrival.


# %%
def gaps_around_a_long_prompt(chunked: bool) -> list[float]:
    budget = {"max_num_batched_tokens": 64} if chunked else {}
    engine = s06.LLM(chunked_prefill=chunked, **budget, **SMALL)
    engine.generate([[101, 102]], s06.SamplingParams(max_tokens=2))  # warm-up
    stream = engine.make_request([101, 102, 103], s06.SamplingParams(max_tokens=30, temperature=0))
    engine.add_request(stream)
    for _ in range(5):
        engine.step()
    prompt = [100 + i % 900 for i in range(600)]
    engine.add_request(engine.make_request(prompt, s06.SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    times = stream.token_times
    return [(b - a) * 1e3 for a, b in itertools.pairwise(times)]


for chunked in (False, True):
    gaps = gaps_around_a_long_prompt(chunked)
    longest, median = max(gaps), statistics.median(gaps)
    print(f"chunked={chunked!s:5}: longest gap {longest:5.0f} ms, median {median:4.0f} ms")

# %% [markdown]
# ## Measured
#
# `python -m stages 06 bench`: streams decoding while 2,000-token prompts arrive, whole vs
# chunked prefill, and a sweep of the token budget.

# %%
Image(filename=str(PLOTS / "06_chunked.png"))

# %% [markdown]
# ## Exercises
#
# 1. Set `long_prefill_token_threshold=16` and send two long prompts at once. Print the steps:
#    how do the two prompts share the budget?
# 2. With chunking on, a long prompt's time to first token grows. Measure it against the
#    budget, and explain the shape of the curve.
