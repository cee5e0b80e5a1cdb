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
# # Stage 01: the naive engine
#
# This is the smallest engine in the repository. It serves one request at a time, keeps one
# contiguous KV cache per request, and picks each next token greedily or by sampling. Every
# later stage answers something this one does slowly.
#
# We load the stage and look at the model. Then we run one prefill and a few decode steps by
# hand, and watch the engine do the same, one step at a time: the scheduler picks the tokens,
# the model runner runs the forward. We finish with sampling and with what the KV cache saves.
# The notebook runs in about a minute on a laptop CPU.

# %% [markdown]
# Stage folders start with digits (`stages/01_naive`), which Python cannot import by name.
# `stages.load("01")` imports the folder for us and returns the package.

# %%
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from IPython.display import Image

import stages

s01 = stages.load("01")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s01.TECHNIQUE)

# %%
llm = s01.LLM()  # the embedded SmolLM2-135M-Instruct
print(f"{llm.model_name} on {llm.device} in {llm.dtype}")
print(f"loaded in {llm.load_seconds:.1f} s")

# %% [markdown]
# ## The model
#
# SmolLM2-135M is a Llama-family decoder. `llm.model_config` holds its shape, read from the
# checkpoint's `config.json`. Note the grouped-query attention: 9 query heads share 3
# key/value heads, so the KV cache is a third of what plain multi-head attention needs.

# %%
mc = llm.model_config
print(f"layers        {mc.num_layers}")
print(f"hidden size   {mc.hidden_size}")
print(f"query heads   {mc.num_heads}")
print(f"kv heads      {mc.num_kv_heads}")
print(f"head_dim      {mc.head_dim}")
print(f"vocabulary    {mc.vocab_size}")
print(f"context       {llm.max_model_len} tokens")

# %%
bytes_per_value = torch.finfo(llm.dtype).bits // 8
print(f"parameters    {mc.num_parameters() / 1e6:.1f} M")
print(f"weights       {llm.weight_bytes() / 2**20:.0f} MiB")
print(f"KV per token  {mc.kv_bytes_per_token(bytes_per_value) / 2**10:.0f} KiB")

# %% [markdown]
# Each decode step produces one token and reads every weight once to do it. On a CPU, or a
# GPU serving one request, that read is most of the cost of a step.

# %% [markdown]
# ## From a chat to token ids
#
# The model reads text, not messages. The chat template turns a conversation into the text
# the model was trained on, with its special markers. It ends with the assistant's header, so
# the model's next words are the answer. The tokenizer then turns the text into ids.
# `encode_chat` does both steps.

# %%
messages = [{"role": "user", "content": "What is the capital of France?"}]
print(llm.tokenizer.apply_chat_template(messages))

# %%
prompt_ids = llm.tokenizer.encode_chat(messages)
print(len(prompt_ids), "tokens:", prompt_ids)
pieces = [llm.tokenizer.decode([i], skip_special_tokens=False) for i in prompt_ids]
print("the last 8 as text:", pieces[-8:])

# %% [markdown]
# ## Prefill and decode, by hand
#
# This is the core of every engine in this repository.
#
# - **Prefill** runs the whole prompt through the model in one forward. Every layer computes
#   K and V for every prompt token and stores them in the KV cache. Only the last position's
#   logits matter: they predict the first output token.
# - **Decode** then runs the model on one token at a time, the newest one. Its attention
#   reads the K and V of all earlier tokens from the cache instead of recomputing them.
#
# The model works on flat tensors: `input_ids` and `positions` are both `[num_tokens]`, with
# no batch dimension. `AttentionMetadata` says where the new tokens sit in their sequence:
# `query_start_loc=(0, n)` for `n` new tokens, and `seq_lens` counts the cached tokens plus the
# new ones. The forward returns hidden states `[num_tokens, hidden]`, and `compute_logits`
# applies the LM head.
#
# The stage-01 cache, `ContiguousKVCache`, is one buffer per request, reserved up front for
# the longest the request may grow: `[layers, capacity, kv_heads, head_dim]` for K, and the
# same for V. Each attention layer calls `cache.store(layer, start, k, v)`: it writes the new
# tokens' K and V at positions `start..` and returns K and V of every position so far.

# %%
model = llm.model
AttentionMetadata = s01.model.AttentionMetadata
max_new = 16
cache = s01.kv_cache.ContiguousKVCache(
    mc.num_layers,
    len(prompt_ids) + max_new,  # capacity: the prompt plus the longest answer we allow
    mc.num_kv_heads,
    mc.head_dim,
    llm.dtype,
    llm.device,
)
print(f"cache.k {tuple(cache.k.shape)}, cache.v the same")
print(f"reserved: {cache.reserved_bytes / 2**20:.1f} MiB")

# %%
n = len(prompt_ids)
with torch.inference_mode():
    ids = torch.tensor(prompt_ids, device=llm.device)
    positions = torch.arange(n, device=llm.device)
    meta = AttentionMetadata(query_start_loc=(0, n), seq_lens=(n,))  # no cached tokens yet
    hidden = model(ids, positions, cache, meta)  # the prefill
    first_logits = model.compute_logits(hidden[-1])

token = int(first_logits.argmax())  # greedy: the most likely token
print(f"hidden states {tuple(hidden.shape)}, last logits {tuple(first_logits.shape)}")
print(f"first token: {token} {llm.tokenizer.decode([token])!r}")

# %% [markdown]
# Now decode. Each step feeds the token the previous step chose, at the next position, over
# everything cached so far. The cache grows by one token per step. We stop at an
# end-of-sequence token, as the engine does.

# %%
eos = set(llm.tokenizer.eos_token_ids)
by_hand = [token]
cached = n  # tokens whose K and V are in the cache
with torch.inference_mode():
    while token not in eos and len(by_hand) < max_new:
        meta = AttentionMetadata(query_start_loc=(0, 1), seq_lens=(cached + 1,))
        hidden = model(
            torch.tensor([token], device=llm.device),
            torch.tensor([cached], device=llm.device),  # its position
            cache,
            meta,
        )
        position, cached = cached, cached + 1
        token = int(model.compute_logits(hidden[-1]).argmax())
        by_hand.append(token)
        piece = llm.tokenizer.decode([token], skip_special_tokens=False)
        print(f"position {position}: token {token:5d} {piece!r:14} cached {cached}")

print(repr(llm.tokenizer.decode(by_hand)))

# %% [markdown]
# ## The engine, one step at a time
#
# The engine runs exactly this loop, in three parts that every later stage keeps:
#
# - the **scheduler** decides what runs next. Each request counts `num_computed_tokens`, the
#   tokens whose K/V are in the cache, and a step gives it every token it has not computed
#   yet: the whole prompt on its first step, one token after that. `schedule()` returns plain
#   data, a `SchedulerOutput`;
# - the **model runner** turns that output into tensors (`prepare_inputs`), runs the forward
#   and samples (`execute_model`). It owns the model and the KV caches;
# - the **engine** appends each sampled token to its request, detokenizes, and checks the stop
#   conditions (`update_from_output`).
#
# `llm.step()` is these three calls. We make them ourselves, on the same prompt, greedy.

# %%
greedy = s01.SamplingParams(temperature=0, max_tokens=max_new)
request = llm.make_request(prompt_ids, greedy, request_id="walkthrough")
llm.add_request(request)

so = llm.scheduler.schedule()
(scheduled,) = so.requests
print(f"request        {scheduled.request_id}")
print(f"new tokens     {len(scheduled.token_ids)}: {list(scheduled.token_ids[:6])} ...")
print(f"cached before  {scheduled.num_computed_tokens}")
print(f"kv_capacity    {scheduled.kv_capacity} (prompt + max_tokens)")
print(f"the request's num_computed_tokens is now {request.num_computed_tokens}")

# %% [markdown]
# `schedule()` has already moved `num_computed_tokens` past the new tokens: their K/V will be
# in the cache once the forward has run. The runner packs them into the forward's inputs.
# The token it samples comes right after the prompt: its position, the prompt's length, is
# the sampler's offset (more on that below).

# %%
inputs = llm.runner.prepare_inputs(so)
print("input_ids     ", tuple(inputs.input_ids.shape))
print("positions     ", inputs.positions[:4].tolist(), "...", inputs.positions[-1].item())
print("attn_metadata ", inputs.attn_metadata)
print("logits_indices", inputs.logits_indices.tolist())
print("offsets       ", inputs.sampling.offsets.tolist())

# %%
sampled = llm.runner.execute_model(so)  # forward + sampling: request id -> token id
outputs = llm.update_from_output(so, sampled)
print(sampled, repr(outputs[0].text))

# %% [markdown]
# The second step is a decode: one new token, after the prompt's cached ones. Here is the
# whole `SchedulerOutput`, as the runner receives it.

# %%
so = llm.scheduler.schedule()
print(so)
sampled = llm.runner.execute_model(so)
outputs = llm.update_from_output(so, sampled)
print(sampled, repr(outputs[0].text))

# %% [markdown]
# From here `step()` does the same until the request finishes. It must choose the tokens we
# chose by hand.

# %%
while llm.has_unfinished():
    llm.step()
print(request.output_token_ids, request.finish_reason)
assert request.output_token_ids == by_hand

# %% [markdown]
# `llm.generate` wraps all of it: make the requests, add them, step until they are done. It
# gives the same tokens again, with timestamps.

# %%
out = llm.generate(prompt_ids, greedy)[0]
print(repr(out.text), out.finish_reason)
assert out.token_ids == by_hand
decode_ms = 1e3 * sum(out.itl) / len(out.itl)
print(f"time to first token {1e3 * out.ttft:.0f} ms, then {decode_ms:.0f} ms per token")

# %% [markdown]
# `llm.chat(messages, greedy)` applies the chat template for us and gives the same answer.
# `finish_reason` is `"stop"`: the model produced its end-of-sequence token, which is counted
# in `token_ids` but not shown in `text`.

# %% [markdown]
# ## Sampling
#
# Greedy decoding always takes the most likely token. Sampling draws from the distribution
# instead, after three filters, applied in this order as in vLLM:
#
# 1. divide the logits by the **temperature** (below 1 sharpens, above 1 flattens);
# 2. keep the **top-k** most likely tokens;
# 3. keep the smallest set of tokens whose probability reaches **top-p**.
#
# The sampler works on a batch: logits `[B, vocab]` and one value per row for each parameter.
# Here is the distribution of the first answer token, from our prefill's logits, and how many
# candidates each filter leaves. A disabled top-k is the vocabulary size.

# %%
probs = first_logits.float().softmax(dim=-1)
top = probs.topk(5)
for p, i in zip(top.values, top.indices, strict=True):
    print(f"{float(p):.3f}  {llm.tokenizer.decode([int(i)])!r}")
print()
vocab = mc.vocab_size
for top_k, top_p in [(vocab, 1.0), (50, 1.0), (vocab, 0.9), (50, 0.9)]:
    kept = s01.sampling.apply_top_k_top_p(
        first_logits[None] / 0.8, torch.tensor([top_k]), torch.tensor([top_p])
    )
    count = int(kept.isfinite().sum())
    print(f"temperature 0.8, top_k={top_k:5d}, top_p={top_p}: {count} candidates")

# %% [markdown]
# The draw itself needs random numbers. There is no random generator that carries state from
# step to step. Each row's noise is a hash of `(seed, offset, token index)`, where the offset
# is the position of the token being sampled. One `argmax` of `probability / noise` (the
# exponential race) then picks token `i` with probability `p_i`.
#
# So a draw depends only on the request's seed and the token's position. Below, four rows with
# the same logits: rows 0 and 1 share seed and offset and always agree; rows 2 and 3 change
# one of the two.

# %%
params = s01.SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
tensors = s01.sampling.SamplingTensors.from_params(
    [params] * 4, seeds=[1, 1, 2, 1], offsets=[37, 37, 37, 38], vocab_size=vocab, device=llm.device
)
rows = first_logits[None].expand(4, -1)
for _ in range(3):  # the same every time
    drawn = s01.sampling.sample(rows, tensors).tolist()
    print(drawn, [llm.tokenizer.decode([t]) for t in drawn])

# %% [markdown]
# That is what makes a seeded request reproducible, whatever else is in its batch: later
# stages batch requests and even stop and recompute them, and the same seed still draws the
# same tokens. A request without a seed gets one from the engine (seeded by
# `EngineConfig.seed`).

# %%
haiku = [{"role": "user", "content": "Write a haiku about the sea."}]
sampled_params = s01.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1, max_tokens=24)
first, again = llm.chat([haiku, haiku], sampled_params)
other = llm.chat(haiku, replace(sampled_params, seed=2))[0]
print("seed 1:", repr(first.text))
print("seed 1:", repr(again.text))
print("seed 2:", repr(other.text))
assert first.text == again.text

# %% [markdown]
# A stop string ends the answer before its first occurrence. The string itself is not part of
# the text.

# %%
stopped = llm.chat(messages, replace(greedy, stop=["Paris"]))[0]
print(repr(stopped.text), stopped.finish_reason, f"after {len(stopped.token_ids)} tokens")

# %% [markdown]
# ## What the KV cache saves
#
# `use_kv_cache=False` makes the engine recompute the whole sequence at every step: its
# scheduler never counts a token as computed, so every step's new tokens are all of them.
# Output token n then costs a forward over the prompt and n earlier tokens. It exists only
# for this comparison. We time 20 tokens each way; `ignore_eos=True` makes both produce
# exactly 20. (The median step ignores the odd slow step of a busy machine.)

# %%
no_cache = s01.LLM(use_kv_cache=False)
story = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
fixed = s01.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
answers = {}
for name, engine in [("with KV cache", llm), ("without", no_cache)]:
    start = time.perf_counter()
    result = engine.chat(story, fixed)[0]
    elapsed = time.perf_counter() - start
    answers[name] = result.token_ids
    per_token = 1e3 * elapsed / len(result.token_ids)
    per_step = 1e3 * statistics.median(result.itl)
    print(f"{name:14} {per_token:4.0f} ms per token, median decode step {per_step:4.0f} ms")
print("same tokens:", answers["with KV cache"] == answers["without"])

# %% [markdown]
# With the cache, a decode step costs about the same at the 1st and the 20th token: it reads
# the weights once, plus a little cache. Without it, each step does a prefill of the whole
# sequence so far, and the gap grows with the length of the prompt and the answer. The
# prefill itself (the time to first token) costs the same either way.

# %% [markdown]
# ## Measured
#
# `python -m stages 01 bench` times longer answers and prompts on the same model.

# %%
Image(filename=str(PLOTS / "01_naive.png"))

# %% [markdown]
# - **Left.** With the cache, a token costs the same at position 40 and 290. Without it, the
#   cost grows with the position, so a whole answer costs quadratic time.
# - **Middle.** Prefill processes hundreds of tokens per second, because one read of the
#   weights serves every prompt token; decode gets one token per read.
# - **Right.** Decode speed against transformers' `generate` on the same weights, and the
#   bandwidth roofline: the weights read once per token at the machine's memory bandwidth.

# %% [markdown]
# ## Exercises
#
# 1. Make the by-hand loop sample instead of taking the argmax. Build the row's
#    `SamplingTensors.from_params([params], [seed], [offset], vocab, llm.device)` with the
#    offset of the token you sample, draw with `s01.sampling.sample`, and check that you get
#    the tokens of `llm.generate` with the same `SamplingParams` and seed.
# 2. Rerun the timing with `max_tokens=100`. How does the time per token of each engine
#    change, and why?
# 3. A request with `max_tokens=None` may fill the whole context. How many bytes does its
#    `ContiguousKVCache` reserve (`llm.max_model_len` tokens), and how many such requests fit
#    in 8 GiB? How much of that does a 40-token answer use? Stage 03 starts from this waste.
