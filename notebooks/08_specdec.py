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
# # Stage 08: speculative decoding
#
# A drafter guesses the next few tokens; one target forward checks them all. We watch the
# n-gram drafter find its guesses, look at one verification step (k + 1 new tokens for one
# request), check that greedy output is unchanged, and read the measured plot.

# %%
import importlib
from pathlib import Path

from IPython.display import Image

import stages

s08 = stages.load("08")
spec_decode = importlib.import_module(f"{s08.__name__}.spec_decode.drafters")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20}
print(s08.TECHNIQUE)

# %% [markdown]
# ## Prompt lookup
#
# The n-gram drafter looks for the latest earlier occurrence of the sequence's suffix and
# proposes what followed it.

# %%
proposer = spec_decode.NgramProposer(min_n=2, max_n=4)
print(proposer.propose([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], k=3))  # suffix [1, 2, 3] seen before
print(proposer.propose([1, 2, 3, 4, 5], k=3))  # nothing repeats: no drafts

# %% [markdown]
# ## One verification step
#
# A request that copies code. After a few steps, the scheduler gives it its last token and
# its drafts as new tokens, and the target emits the accepted drafts plus one more.

# %%
llm = s08.LLM(speculative="ngram", num_speculative_tokens=4, **SMALL)
code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}]
request = llm.make_request(None, s08.SamplingParams(max_tokens=48, temperature=0),
                           messages=messages)  # fmt: skip
llm.add_request(request)
for _ in range(8):
    scheduler_output = llm.scheduler.schedule()
    (scheduled,) = scheduler_output.requests
    emitted = llm.runner.execute_model(scheduler_output)[request.request_id]
    drafts = scheduled.token_ids[len(scheduled.token_ids) - scheduled.num_draft_tokens :]
    print(
        f"{scheduled.num_new_tokens:2d} new tokens, drafts {llm.tokenizer.decode(list(drafts))!r}"
        f" -> emitted {llm.tokenizer.decode(emitted)!r}"
    )
    llm.update_from_output(scheduler_output, {request.request_id: emitted})
while llm.has_unfinished():
    llm.step()
print(request.text)
print(f"accepted {llm.spec_stats.acceptance_rate:.0%} of drafts, "
      f"{llm.spec_stats.tokens_per_verification:.2f} tokens per verification")  # fmt: skip

# %% [markdown]
# ## Greedy output is unchanged
#
# The same request without speculation gives the same text.

# %%
plain = s08.LLM(**SMALL)
again = plain.chat(messages, s08.SamplingParams(max_tokens=48, temperature=0))[0]
print(again.text == request.text)

# %% [markdown]
# ## Measured
#
# `python -m stages 08 bench`: speedup and tokens per target forward against k for the n-gram
# drafter and the draft model, on a repetitive and a chat workload, and the speedup against the
# batch size.

# %%
Image(filename=str(PLOTS / "08_specdec.png"))

# %% [markdown]
# ## Exercises
#
# 1. Try `speculative="draft"` with `draft_num_layers=10` on the same request. How often is a
#    draft accepted?
# 2. Sample with `temperature=0.8` and a seed, with and without speculation. The texts differ;
#    why is that not a bug?
