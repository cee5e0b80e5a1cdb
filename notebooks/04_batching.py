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
# # Stage 04: continuous batching
#
# Stage 03 ran requests in static batches: admit a batch, prefill it, decode it until its
# last member finishes, and only then admit the next. A request that finishes early leaves an
# empty seat. A request that arrives meanwhile waits for the whole batch.
#
# Stage 04 adds a scheduler that decides again at every step who runs. Finished requests
# leave at once, waiting requests join the next step, and prefills and decodes share one
# forward. When the block pool runs out, the newest request is preempted: its blocks are
# freed and it is recomputed later.
#
# We watch the scheduler step by step, against static batching on the same requests, and
# look at one mixed step up close. Then we force preemptions with a tiny pool and check they
# change no output, watch eight HTTP clients streaming at once from one server, and end with
# what packing each step from scratch costs the host.

# %%
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from IPython.display import Image

import stages
from stages.common.tooling.server_process import ThreadedServer

s04 = stages.load("04")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20}  # plenty here, quick to set up
print(s04.TECHNIQUE)

# %% [markdown]
# ## The scheduler, step by step
#
# An engine with four seats (`max_num_seqs=4`) and six requests. Each answer has a fixed
# length: `ignore_eos=True` makes a request run to its `max_tokens`. We name the requests `r0`
# to `r5`.

# %%
llm = s04.LLM(max_num_seqs=4, **SMALL)
scheduler = llm.scheduler
print(f"policy {scheduler.policy}, {scheduler.max_num_seqs} seats,")
print(f"at most {scheduler.max_num_batched_tokens} tokens per forward")

topics = ["the sea", "a cat", "the moon", "bread", "rain", "a river"]
lengths = [3, 12, 5, 8, 4, 10]
chats = [[{"role": "user", "content": f"Say one thing about {t}."}] for t in topics]


def make_requests(engine, lengths=lengths):
    requests = []
    for i, (chat, n) in enumerate(zip(chats, lengths, strict=True)):
        params = s04.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        request = engine.make_request(None, params, messages=chat, request_id=f"r{i}")
        requests.append(request)
    return requests


for i, n in enumerate(lengths):
    print(f"r{i}: {n:2d} tokens")

# %% [markdown]
# `trace` adds the requests and calls `step()` until none is left. After each step it prints
# who ran. A request that was not running before the step and got a token was prefilled in
# it. A running request that got no token was preempted. `engine.running` and
# `engine.waiting` are the scheduler's two queues.


# %%
def names(items):
    return " ".join(items) or "-"


def trace(engine, requests, quiet=False):
    for request in requests:
        engine.add_request(request)
    steps, start = 0, time.perf_counter()
    preemptions = collections.Counter()
    while engine.has_unfinished():
        before = [r.request_id for r in engine.running]
        outputs = engine.step()
        steps += 1
        ran = [o.request_id for o in outputs]
        prefill = [i for i in ran if i not in before]
        decode = [i for i in ran if i in before]
        preempted = [i for i in before if i not in ran]
        preemptions.update(preempted)
        done = [o.request_id for o in outputs if o.finished]
        if quiet and not (prefill or preempted or done):
            continue  # a step of plain decodes
        waiting = [r.request_id for r in engine.waiting]
        line = f"step {steps:2d}  prefill {names(prefill):11}  decode {names(decode):11}"
        line += f"  done {names(done):5}  waiting {names(waiting)}"
        if preempted:
            line += f"  preempted {names(preempted)}"
        print(line)
    print(f"{steps} steps, {time.perf_counter() - start:.1f} s")
    if preemptions:
        print("preempted:", dict(preemptions))
    return [r.final_output().token_ids for r in requests]


continuous = trace(llm, make_requests(llm))

# %% [markdown]
# Read it from the top. Four requests prefill together in step 1; `r4` and `r5` wait. `r0` is
# done after three tokens, and in the very next step `r4` takes its seat: its prompt is
# prefilled in the same forward as the three decodes. The seats stay full while anyone is
# waiting. The batch shrinks only at the end, when nobody is left to join.
#
# ## A mixed step, up close
#
# We run the same requests again, take three steps, and then make step 4's calls ourselves.
# `schedule()` returns plain data: for each request, its new tokens and how many of its tokens
# were cached before. There is no separate prefill or decode in it. A prefill is a request
# with nothing cached and the whole prompt new; a decode has one new token.

# %%
requests = make_requests(llm)
for request in requests:
    llm.add_request(request)
for _ in range(3):
    llm.step()

so = scheduler.schedule()
for r in so.requests:
    kind = "prefill" if r.num_computed_tokens == 0 else "decode"
    new, cached = r.num_new_tokens, r.num_computed_tokens
    print(f"{r.request_id}: {new:2d} new after {cached:2d} cached ({kind:7}), blocks {r.block_ids}")
print("finished since the last step:", so.finished_request_ids)

# %% [markdown]
# It also names the requests that finished since the last step (`r0`, in step 3), so that a
# runner keeping state per request can drop it. The model runner packs the four into one
# forward of `so.num_tokens` tokens. The attention
# metadata describes each sequence the same way, whatever its kind; the one paged attention of
# stage 03 serves them all.

# %%
meta = llm.runner.prepare_inputs(so).attn_metadata
print("tokens in the forward", so.num_tokens)
print("query_start_loc      ", meta.query_start_loc.tolist())
print("seq_lens             ", meta.seq_lens.tolist())
print("context_lens         ", meta.context_lens)
outputs = llm.update_from_output(so, llm.runner.execute_model(so))
print("got a token:", [o.request_id for o in outputs])
while llm.has_unfinished():
    llm.step()
assert [r.final_output().token_ids for r in requests] == continuous

# %% [markdown]
# ## Static batching, for comparison
#
# Now the same requests with `scheduling="static"`, stage 03's policy run by this engine.

# %%
static_llm = s04.LLM(max_num_seqs=4, scheduling="static", **SMALL)
static = trace(static_llm, make_requests(static_llm))
assert static == continuous
print("same tokens either way")

# %% [markdown]
# The first batch runs until `r1`, its longest member, has all twelve tokens. Seats empty one
# by one as the others finish, and `r4` and `r5` wait for all of it. The same tokens cost
# more steps. Each step reads all the weights once, so fewer, fuller steps are faster.
#
# The scheduler decides only who runs and when. Each request's tokens are the same under both
# policies.

# %% [markdown]
# ## Preemption
#
# Continuous batching hands out blocks as tokens arrive, not against a worst case. More
# requests fit, but running requests can now grow until the pool is empty. Then the scheduler
# *preempts* the newest running request: it frees its blocks, keeps its tokens, sets its
# `num_computed_tokens` back to 0, and puts it at the front of the waiting queue. When it is
# readmitted, its prompt and its output so far are its new tokens: one prefill recomputes them
# all.
#
# We force this with a pool of 24 blocks of 4 tokens, 96 tokens in all.
# `PagedKVCache.bytes_per_block` gives the size of one block. No request can be longer than
# the pool, so the context (`max_model_len`) is 96 tokens too. Each chat prompt is about 37
# tokens, 10 blocks, so two requests fill most of the pool. This time every answer is 16
# tokens long.

# %%
mc = llm.model_config
per_block = s04.PagedKVCache.bytes_per_block(
    mc.num_layers, 4, mc.num_kv_heads, mc.head_dim, llm.dtype
)
tight = s04.LLM(block_size=4, kv_cache_bytes=24 * per_block, max_model_len=96)
pool = tight.kv_manager.allocator
print(f"{pool.num_blocks} blocks of {tight.block_size} tokens, {per_block} bytes each")
print("prompt lengths:", [len(r.prompt_token_ids) for r in make_requests(tight)])

# %% [markdown]
# We print only the steps where a request is prefilled, preempted or done; the steps between
# are plain decodes.

# %%
tight_out = trace(tight, make_requests(tight, lengths=[16] * 6), quiet=True)
print("preemptions:", tight.scheduler.num_preemptions)
assert tight.scheduler.num_preemptions > 0

roomy_out = [o.token_ids for o in llm.run_all(make_requests(llm, lengths=[16] * 6))]
assert tight_out == roomy_out
print("same tokens as the roomy engine")
print("free blocks:", tight.kv_manager.num_free_blocks, "of", pool.num_blocks)

# %% [markdown]
# In step 13 both running requests need a new block and none is free. `r1`, the newer, is
# preempted, and `r0` takes one of the blocks it gave back. `r1` then needs 13 blocks for its
# prompt and the 12 tokens it had produced, more than are free, so it waits until `r0` is
# done. In the next step it is prefilled again, all 49 tokens, beside `r2`, and goes on from
# there. `r3` and `r5` go the same way later.
#
# A preempted request loses its K and V, never its tokens or its place: it waits at the front
# of the queue and comes back with a longer prefill. Its sampled tokens do not change either:
# a seeded draw depends only on the seed and the token's position. Recomputing costs a
# forward over tokens we had already processed, but it needs no extra memory. Stage 12 swaps
# blocks to host memory instead.

# %% [markdown]
# ## Many clients, one batch
#
# The server and `AsyncLLM` are the same as in stages 02 and 03. The worker thread moves new
# requests into the engine before every step, so a request that arrives while others run
# joins them at the next step.
#
# We start the server as notebook 02 does, then eight clients, each on its own thread, each
# streaming a `/generate` request of a different length. Each client records when it sent its
# request, when the first token arrived and when the last one did.

# %%
app = s04.create_app(s04.LLM(**SMALL))
server = ThreadedServer(app).start()
url = server.url
print(url, httpx.get(url + "/health").json())


# %%
def client(i):
    body = {
        "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
        "max_tokens": 8 + 4 * i,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return sent, first, time.perf_counter()


start = time.perf_counter()
with ThreadPoolExecutor(max_workers=8) as executor:
    timings = list(executor.map(client, range(8)))
total = time.perf_counter() - start

width = 48
print(f"{'':24}0 s{'':{width - 8}}{total:.1f} s")
for i, (sent, first, done) in enumerate(timings):
    a, b, c = (round(width * (t - start) / total) for t in (sent, first, done))
    bar = " " * a + "." * (b - a) + "#" * max(1, c - b)
    print(f"{8 + 4 * i:2d} tokens  {first - start:4.1f} {done - start:4.1f} s  |{bar}")
assert max(first for _, first, _ in timings) < min(done for _, _, done in timings)

# %% [markdown]
# Each row is one client: `.` while it waits for its first token, `#` while tokens stream.
# The two numbers are the time to the first token and to the last, from the start of the run.
# The requests reach the engine a few milliseconds apart. The first to arrive is prefilled at
# once; those that arrive during that step join at the next one, with one prefill of all
# their prompts. From then on all eight decode in the same steps, so every client got its
# first token before any finished. The short answers end first and leave the batch; the long
# ones go on without them. In stage 02 the eighth client would have waited for the seven
# before it.

# %%
server.stop()
print("server thread alive:", server.thread.is_alive())

# %% [markdown]
# ## Packing a step from scratch
#
# Each step the runner turns the scheduler's output into flat tensors: every new token's id,
# position and cache slot, and each request's block table, built from Python lists for every
# running request (`ModelRunner.prepare_inputs`), as nano-vllm does. It is simple and correct
# by construction, and its cost grows with the batch: at 256 running requests this stage's
# own CPU per step is about 2.6 ms on this course's CPU (the README's "The host's share of a
# step"). Stage 05 overlaps that work with the forward and then shrinks it.

# %% [markdown]
# ## Measured
#
# `python -m stages 04 bench` runs 64 requests three ways: one at a time, in static batches
# and with continuous batching, all with up to 16 requests per batch.

# %%
Image(filename=str(PLOTS / "04_batching.png"))

# %% [markdown]
# Continuous batching keeps the batch full (third panel), so the same requests take fewer
# steps. On this CPU that gains little over static batching: a step's cost grows with its
# batch (fourth panel), so a half-empty static step is also a cheaper one. Against one
# request at a time, batching shares each read of the weights across the batch (first panel),
# and requests finish far sooner (second panel).

# %% [markdown]
# ## Exercises
#
# 1. In the trace, give `r0` a 40-token answer and run both policies again. How many steps
#    does each take now, and how long does `r4` wait for its first token?
# 2. Shrink the tight pool to the smallest whose context (clamped to the pool at start-up,
#    `llm.max_model_len`) still accepts these requests. How many preemptions happen now?
#    Wrap `tight.scheduler.schedule` to add up `so.num_tokens` over all steps, and compare
#    with the same total on the roomy engine: the difference is what recompute cost.
# 3. Run the eight clients against stage 02's server (`stages.load("02")`) and compare the
#    times to first token. Then against stage 04 with `max_num_seqs=2`. What changes, and
#    what does not?
# 4. Time `llm.runner.prepare_inputs` on a decode step of 4, 16 and 64 running requests
#    (`max_num_seqs=64`). How does its cost grow with the batch? Stage 05 keeps the batch
#    between steps; predict what it saves before you read its notebook.
