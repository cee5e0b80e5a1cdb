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
# # Stage 02: streaming
#
# In stage 01 the HTTP handler ran the model itself, on the event loop. While it computed,
# the server could do nothing else, not even answer `/health`. And the client saw no text
# until the whole answer was done.
#
# Stage 02 changes only the serving side. The engine runs on its own thread, behind
# `AsyncLLM`, and the event loop only does I/O. Each new token goes back to its handler and
# out to the client as a server-sent event (SSE). Requests still run one at a time.
#
# We first watch a request's outputs arrive token by token, from the engine and then from
# `AsyncLLM` while the event loop stays free. Then we start a real server inside this notebook
# and talk to it over HTTP: a raw stream, the official OpenAI client, `/health` during a long
# generation, and a client that leaves early.

# %%
import asyncio
import itertools
import json
import time
from pathlib import Path

import httpx
import openai
from IPython.display import Image

import stages
from stages.common.tooling.server_process import ThreadedServer

s02 = stages.load("02")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s02.TECHNIQUE)

# %%
llm = s02.LLM()
print(f"{llm.model_name} loaded in {llm.load_seconds:.1f} s")
warm_up = llm.generate(
    "Hello", s02.SamplingParams(max_tokens=8)
)  # a process's first steps are slow

# %% [markdown]
# ## One output per token
#
# The engine is stage 01's: `step()` runs one forward and returns the outputs of the requests
# that got a token. A request's `output_kind` says what each output holds: `"cumulative"`
# (all the text so far), `"delta"` (only what is new since the last output: what a stream
# sends) or `"final"` (one output, at the end: what `generate` uses).
#
# `llm.stream(request)` steps the engine and yields the request's outputs as they come.

# %%
colors = [{"role": "user", "content": "Name three colors of the rainbow."}]
params = s02.SamplingParams(temperature=0, max_tokens=30)
request = llm.make_request(None, params, messages=colors, output_kind="delta")
start = time.perf_counter()
for output in llm.stream(request):
    ms = 1e3 * (time.perf_counter() - start)
    reason = f"  ({output.finish_reason})" if output.finished else ""
    print(f"{ms:6.0f} ms  {output.token_ids}  {output.text!r}{reason}")

# %% [markdown]
# The first output waits for the prefill; the others follow one decode step apart. The last
# carries the end-of-sequence token: no text, and the finish reason.

# %% [markdown]
# ## The engine on its own thread
#
# `llm.stream` runs the model on the caller's thread. A server cannot do that: while the
# model computes, its event loop would stop. `AsyncLLM` owns one worker thread that drives the
# same step loop. `generate(request)` is an async iterator: the worker hands each output back
# to the event loop with `call_soon_threadsafe`.
#
# To see that the loop stays free, we run a second task beside the request. It wakes up every
# 10 ms and counts. If the model ran on the loop, it would barely count at all.

# %%
async_llm = s02.AsyncLLM(llm)


async def ticker(ticks):
    while True:
        await asyncio.sleep(0.01)
        ticks.append(time.perf_counter())


async def stream_beside_a_ticker():
    ticks = []
    task = asyncio.create_task(ticker(ticks))
    request = llm.make_request(None, params, messages=colors, output_kind="delta")
    start = time.perf_counter()
    async for output in async_llm.generate(request):
        print(f"{1e3 * (time.perf_counter() - start):6.0f} ms  {output.text!r}")
    elapsed = time.perf_counter() - start
    task.cancel()
    longest = max(b - a for a, b in itertools.pairwise(ticks))
    print(f"{elapsed:.1f} s of generation, the ticker woke {len(ticks)} times")
    print(f"longest gap between two ticks: {1e3 * longest:.0f} ms")


await stream_beside_a_ticker()  # noqa: F704, RUF100 (a notebook cell may await)
async_llm.shutdown()

# %% [markdown]
# The model releases Python's lock (the GIL) inside its matrix kernels, so the ticker runs
# while the worker computes. The longest gap is a step's Python bookkeeping, not a step.

# %% [markdown]
# ## A server in the notebook
#
# `create_app` builds the FastAPI app around a new `AsyncLLM` on our engine.
# `app.state.engine` is that `AsyncLLM`. We run uvicorn on a background thread, on a free
# local port, so that the notebook can be the client.

# %%
app = s02.create_app(llm)
engine = app.state.engine

server = ThreadedServer(app).start()  # uvicorn on a free port, on a background thread
url = server.url

health_client = httpx.Client(base_url=url, timeout=5)  # one connection, kept open
print(url, health_client.get("/health").json())

# %% [markdown]
# ## Streaming `/generate`
#
# With `"stream": true` the response is a `text/event-stream`. Each event is a line
# `data: <json>` followed by a blank line, and the stream ends with `data: [DONE]`. There is
# one event per token, carrying the new text and token ids: the handler asks for `"delta"`
# outputs. We print the first three events exactly as they arrive, then only each event's new
# text and when it arrived.

# %%
body = {"messages": colors, "max_tokens": 30, "temperature": 0, "stream": True}
start = time.perf_counter()
with httpx.stream("POST", url + "/generate", json=body, timeout=60) as response:
    print(response.headers["content-type"])
    for number, line in enumerate(response.iter_lines()):
        ms = 1e3 * (time.perf_counter() - start)
        if number < 6:  # three events, raw: a data line, then a blank line
            print(f"{ms:6.0f} ms  {line!r}")
        elif line == "data: [DONE]":
            print(f"{ms:6.0f} ms  [DONE]")
        elif line:
            event = json.loads(line.removeprefix("data: "))
            reason = event["finish_reason"]
            print(f"{ms:6.0f} ms  {event['text']!r}" + (f"  ({reason})" if reason else ""))

# %% [markdown]
# The same tokens as `llm.stream` gave us, now over HTTP. A stage-01 client would have seen
# nothing until the last one.

# %% [markdown]
# ## The official OpenAI client
#
# The server also speaks the OpenAI API, so the `openai` package works unchanged. A streaming
# chat completion arrives as chunks, each with a `delta` holding the new text. The first chunk
# carries only the role, the last only the finish reason. We print a `|` after each chunk to
# show where they break.

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24,
    temperature=0,
    stream=True,
)
for chunk in stream:
    choice = chunk.choices[0]
    if choice.delta.role:
        print(f"role: {choice.delta.role}")
    if choice.delta.content:
        print(choice.delta.content, end="|")
    if choice.finish_reason:
        print(f"\nfinish_reason: {choice.finish_reason}")

# %% [markdown]
# ## The server stays responsive
#
# Now a long request: 500 tokens, more than half a minute of work on a CPU. We start it, wait
# for its first event, then ask `/health`. In stage 01 that call would wait for the whole
# generation. Here the event loop is free, so it answers at once, and `pending_requests`
# counts the request still running. (`health_client` keeps its connection open, so the time
# we measure is the server's, not a new connection's.)

# %%
long_body = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 500,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
with httpx.stream("POST", url + "/generate", json=long_body, timeout=60) as response:
    lines = response.iter_lines()
    print("first event:", next(lines))
    start = time.perf_counter()
    health = health_client.get("/health")
    latency_ms = 1e3 * (time.perf_counter() - start)
    print(f"/health answered in {latency_ms:.0f} ms: {health.json()}")

# %% [markdown]
# ## A client that leaves aborts its request
#
# Leaving the `with` block above closed the connection with hundreds of tokens to go.
# Starlette sees the disconnect and cancels the response generator. `AsyncLLM.generate` then
# asks the engine thread to abort the request, and the engine stops it before its next step.
# Without this, the engine would spend half a minute on an answer nobody reads.
#
# Let us watch it happen once more, with the counters of `AsyncLLM`.


# %%
def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


assert wait_until(lambda: engine.num_pending == 0)  # the last request is gone already
before = engine.num_aborted
with httpx.stream("POST", url + "/generate", json=long_body, timeout=60) as response:
    lines = response.iter_lines()
    for _ in range(4):  # two events: a data line and a blank line each
        next(lines)
    print("pending while we read:", engine.num_pending)
# the connection is closed now
assert wait_until(lambda: engine.num_aborted == before + 1)
print(f"aborted requests: {before} -> {engine.num_aborted}")
assert wait_until(lambda: engine.num_pending == 0)
print("pending after the abort:", engine.num_pending)

# %% [markdown]
# ## Shutting down
#
# `server.stop()` tells uvicorn to exit. The app's shutdown hook stops the engine thread.

# %%
health_client.close()
server.stop()
print("server thread alive:", server.thread.is_alive())

# %% [markdown]
# ## Measured
#
# `python -m stages 02 bench` runs stage 01's and stage 02's servers as separate processes
# and drives both over HTTP with the same client.

# %%
Image(filename=str(PLOTS / "02_streaming.png"))

# %% [markdown]
# - **Left.** A blocking client's first token arrives with its last, so its time to first
#   token grows with the answer. A streaming client's is one prefill and one decode step,
#   whatever the length.
# - **Right.** `/health` probes sent during a long generation. Stage 01 answers the first one
#   when the generation is over; stage 02 answers every one in a few milliseconds.
#
# Streaming does not make the model faster: the whole answer takes as long as before. It
# changes what the user sees and keeps the server responsive.

# %% [markdown]
# ## Exercises
#
# 1. Repeat the `/health` experiment against stage 01. Its server cannot stream, so send the
#    long request without `"stream"` from a background thread, then time `/health`. How long
#    does it wait?
# 2. Start two streaming requests at once, from two threads, and record when each one's
#    tokens arrive. What does the second client see while the first runs? Batching, from
#    stage 03 on, changes this.
# 3. Send the long request without streaming, with
#    `httpx.post(..., timeout=httpx.Timeout(30, read=1.0))`, so the client gives up after a
#    second. Check that `num_aborted` still goes up, and find in `server.py` how the server
#    notices a client that is gone when it has nothing to send.
