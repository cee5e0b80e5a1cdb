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
# ## Shrinking the host's share: the persistent batch
#
# Overlap hides the host's work only while it is shorter than the device's step, and stage 04
# packs every step from scratch. Each step the runner turns the scheduler's output into flat
# tensors: every new token's id, position and cache slot, and each request's block table.
# From one step to the next almost
# nothing changes: each running request adds one token, and one block every `block_size`
# tokens. So the runner keeps a seat per running request and the block tables as one array
# (`InputBatch`, `input_batch.py`, as vLLM's `InputBatch`), and writes a row only when its
# table changed. Here are three requests with blocks of 4 tokens: a 6-token prompt, a 3-token
# one and a 1-token one, then decode steps.

# %%
batch = s05.input_batch.InputBatch(max_num_seqs=4, max_blocks=4, block_size=4)
prompts = {"a": 6, "b": 3, "c": 1}
tables = {"a": (7, 2), "b": (5,), "c": (9,)}  # block ids the KV manager handed out
computed = dict.fromkeys(prompts, 0)


def scheduled(rid, new_tokens):
    return s05.scheduler_output.ScheduledRequest(
        request_id=rid, admission_id=0, token_ids=tuple(range(100, 100 + new_tokens)),
        num_computed_tokens=computed[rid], params=s05.SamplingParams(), seed=0, sample=True,
        block_ids=tables[rid],
    )  # fmt: skip


step = batch.pack([scheduled(rid, n) for rid, n in prompts.items()])
print("positions   ", step.positions.tolist())
print("slot mapping", step.slot_mapping.tolist())
print("block table\n", step.block_tables)
print("rows written:", batch.rows_written)

# %% [markdown]
# The prefill step has ten tokens. Each token's slot is `block_table[seat, position // 4] * 4
# + position % 4`, computed for all of them in one array operation: request `a`'s positions 4
# and 5 land in block 2, slots 8 and 9. Now five decode steps, one token each. A request
# whose next position starts a new block gets one from the KV manager first (here: the next
# unused id), as the scheduler's `allocate_slots` does.

# %%
for rid, n in prompts.items():
    computed[rid] = n
unused = iter([3, 4, 6, 8])
for _ in range(5):
    for rid in prompts:
        if computed[rid] // 4 == len(tables[rid]):  # the next token starts a block
            tables[rid] += (next(unused),)
    step = batch.pack([scheduled(rid, 1) for rid in prompts])
    print(f"positions {step.positions.tolist()}  slots {step.slot_mapping.tolist()}")
    for rid in prompts:
        computed[rid] += 1
print("tables:", tables)
print("rows written after 5 decode steps of 3 requests:", batch.rows_written)
assert batch.rows_written == 6

# %% [markdown]
# Fifteen request-steps wrote three rows, one for each request that got a block (`b` at
# position 4, `a` at 8, `c` at 4), on top of the three written at the prefill; every other
# step reused its row as it was. A runner that packs each step from scratch copies and pads
# every table at every step. The oracle test (`tests/test_05_input_batch.py`) checks that the
# two give the same tensors over random steps: joins, finishes, new blocks, preemptions.
# `python tools/input_batch_bench.py` times the two packings on your machine.

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

# %%
import json

summary = json.loads((PLOTS / "05_async.json").read_text())["summary"]
for key in ("host_ms_per_step_sync", "model_ms_per_step_sync", "model_idle_fraction_sync",
            "model_idle_fraction_async", "speedup_async_vs_sync"):  # fmt: skip
    print(f"{key:28s} {summary[key]:.4f}")
h, m = summary["host_ms_per_step_sync"], summary["model_ms_per_step_sync"]
assert h < 0.05 * m, "on this CPU the host's work is a sliver of a step"
for device_ms in (3.0, 10.0):  # the right panel's curve at two GPU step times
    print(f"modelled at {device_ms:4.0f} ms a step: {(h + device_ms) / max(h, device_ms):.2f}x")

# %% [markdown]
# Reading the four panels, left to right:
#
# - **Where a step's time goes.** The grey bar is the model, the orange one the host. The
#   host's share is under a millisecond against a model step of tens of milliseconds: on
#   this CPU there is almost nothing to hide.
# - **Model idle fraction.** The share of the run in which no forward runs. It is already
#   about one percent without the overlap, so the overlap has little to recover.
# - **Throughput.** The two modes within their runs' spread: the overlap pays nothing here,
#   and the host's work, run beside the model, takes its cycles from the same two cores.
# - **Modelled.** The speedup a device would see if its step took the x-axis's time while
#   the host kept this CPU's cost: large when the device step is as short as the host's work,
#   near 1 when it is much longer. A GPU runs a small model's decode step in a few
#   milliseconds, which is where the overlap earns its keep.

# %% [markdown]
# ## Exercises
#
# 1. Schedule three steps in a row without resolving any. What does the scheduler do with a
#    request that already has a placeholder? Why is the queue depth 2?
# 2. Abort a request between `launch` and `result`. What happens to its token?
# 3. Preempt a request while its token is in flight (a tiny `kv_cache_bytes`). Why does it
#    wait for that token before it is readmitted?
# 4. In the persistent batch, give request `a` a whole new table (it was preempted and came
#    back with other blocks, `tables["a"] = (1, 10, 11)`) and pack one more step. How many
#    rows are written, and what does `InputBatch._write` do differently from an append?
