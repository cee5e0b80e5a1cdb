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
# decode makes that one step very long, and every running stream waits for it: a 2,000-token
# prompt on this CPU stalls every stream for seconds.
#
# Stage 06 gives every step one token budget, `max_num_batched_tokens`. Running requests come
# first, then waiting ones, and a long prompt is split into chunks that fit what the budget
# leaves. Its K and V are written chunk by chunk over several steps, and only its last chunk
# samples a token.
#
# We work out the chunk sizes by hand and check the scheduler makes the same ones. Then we
# prefill a prompt chunk by chunk ourselves, through the model and a paged cache, and check
# that the last chunk predicts what the whole prompt predicts. We finish with what a running
# stream sees with and without chunking, and read the measured plot.

# %%
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from IPython.display import Image

import stages

s06 = stages.load("06")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20, "async_scheduling": False}
print(s06.TECHNIQUE)

# %% [markdown]
# `async_scheduling=False` runs each step to the end before the next is scheduled (stage 05's
# overlap off), so the steps we print are the steps that run.
#
# ## The rule, by hand
#
# The scheduler gives each request `min(tokens it has not computed, budget left)` new tokens.
# Running requests are served first, oldest first, so a decoding stream takes its one token
# before a waiting prompt is looked at. The prompt gets whatever the budget has left.
#
# So with a budget of 64 and one stream decoding, a 200-token prompt should arrive in chunks
# of 63, 63, 63 and 11 tokens, over four steps. We write that down before the engine runs.


# %%
def chunks_by_hand(prompt_len: int, budget: int, decodes: int) -> list[int]:
    """The chunk sizes of one prompt, next to `decodes` streams that each take one token."""
    chunks, left = [], prompt_len
    while left:
        chunk = min(left, budget - decodes)
        chunks.append(chunk)
        left -= chunk
    return chunks


BUDGET = 64
expected = chunks_by_hand(200, BUDGET, decodes=1)
print("expected chunks:", expected)

# %% [markdown]
# ## The scheduler, step by step
#
# Now the engine, with the same budget. One stream starts decoding; then a 200-token prompt
# arrives. We call `schedule()` ourselves and print, for each step, who ran, how many new
# tokens, from which position, and whether the step samples a token for them.

# %%
llm = s06.LLM(max_num_batched_tokens=BUDGET, **SMALL)
greedy = s06.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
stream = llm.make_request("Tell me a story.", greedy, request_id="stream")
llm.add_request(stream)
llm.step()  # the stream's prompt; it decodes from now on

story = "The lighthouse keeper counted the ships in the harbour every night. " * 30
long_prompt = llm.tokenizer.encode(story)[:200]
first_only = s06.SamplingParams(max_tokens=1, temperature=0)
long = llm.make_request(long_prompt, first_only, request_id="long")
llm.add_request(long)

seen = []  # (new tokens, first position, samples?) of the long prompt, step by step
while long.num_computed_tokens < len(long_prompt):
    so = llm.scheduler.schedule()
    for s in so.requests:
        print(
            f"{s.request_id:>6}: {len(s.token_ids):3d} new tokens from position "
            f"{s.num_computed_tokens:3d}, sample={s.sample}"
        )
        if s.request_id == "long":
            seen.append((len(s.token_ids), s.num_computed_tokens, s.sample))
    print(f"  step total {so.num_tokens} tokens (budget {BUDGET})")
    assert so.num_tokens <= BUDGET
    llm.update_from_output(so, llm.runner.execute_model(so))

assert [n for n, _, _ in seen] == expected
assert [sample for _, _, sample in seen] == [False] * (len(expected) - 1) + [True]
print("chunks as computed by hand; only the last one samples")
print("the long prompt's first token:", long.output_token_ids)

# %% [markdown]
# Each chunk starts where the previous one ended: the cached positions of one step are the
# context of the next. The first three chunks sample nothing. Their logits would predict a
# token in the middle of the prompt, which is already known. Only the last chunk ends at the
# prompt's end, so only its last row goes through the LM head and the sampler.
#
# The request's `num_computed_tokens` is the whole state of the split. The scheduler moves it
# past each chunk when it schedules the chunk; the next step picks up from there. Nothing else
# records that a prompt is part-way through.

# %%
while llm.has_unfinished():
    llm.step()
first_token = long.output_token_ids[0]

# %% [markdown]
# ## A chunked prefill, by hand
#
# Why are the chunks' results the same as one whole prefill? Each layer's attention is the
# only place where tokens meet. A query at position `p` attends to positions `0 .. p`. In a
# chunk, positions before the chunk are the *context*: their K and V are already in the cache,
# written by earlier chunks, and every query of the chunk sees all of them. Inside the chunk
# the mask is causal. That is exactly the row `p` of the whole prompt's causal attention. The
# other layers work token by token, so they do not care how the prompt is cut.
#
# We do it ourselves on the engine's model. A fresh `PagedKVCache` with 16 blocks and a
# `KVCacheManager` over it hold one sequence. For each chunk we grow its block table, work out
# the slots of the chunk's positions, and describe the chunk with `AttentionMetadata`: its new
# tokens (`query_lens`), its cached ones (`context_lens`), and where they live.

# %%
mc = llm.model_config
model = llm.runner.model
AttentionMetadata = stages.load("06", "model").AttentionMetadata
slot_mapping = stages.load("06", "kv_cache").slot_mapping

cache = s06.PagedKVCache(
    mc.num_layers, 16, llm.block_size, mc.num_kv_heads, mc.head_dim, llm.dtype, llm.device
)
manager = s06.KVCacheManager(num_blocks=16, block_size=llm.block_size)


def prefill_in_chunks(tokens: list[int], chunk: int) -> torch.Tensor:
    """Run `tokens` through the model `chunk` tokens at a time; the last position's logits."""
    done = 0
    with torch.inference_mode():
        while done < len(tokens):
            n = min(chunk, len(tokens) - done)
            assert manager.allocate_slots("by-hand", done + n)
            table = manager.block_ids("by-hand")
            meta = AttentionMetadata(
                query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                seq_lens=torch.tensor([done + n], dtype=torch.int32),
                block_tables=torch.tensor([table], dtype=torch.int32),
                slot_mapping=torch.tensor(slot_mapping(table, done, done + n, llm.block_size)),
                query_lens=(n,),
                context_lens=(done,),
            )
            ids = torch.tensor(tokens[done : done + n], device=llm.device)
            positions = torch.arange(done, done + n, device=llm.device)
            hidden = model(ids, positions, cache, meta)
            print(f"chunk of {n:2d} after {done:3d} cached: blocks {table}")
            done += n
        return model.compute_logits(hidden[-1]).float()


by_chunks = prefill_in_chunks(long_prompt, chunk=63)
manager.free("by-hand")

# %% [markdown]
# `runner.prompt_logits` runs the whole prompt in one forward, without a cache. Its last row
# and our last chunk's logits must agree, up to float rounding (the sums are done in another
# order), and both must pick the token the engine sampled after its four chunks.

# %%
whole = llm.runner.prompt_logits(long_prompt)[-1]
difference = float((by_chunks - whole).abs().max())
print(f"largest logit difference: {difference:.1e}")
print("argmax by chunks", int(by_chunks.argmax()), " whole", int(whole.argmax()))
torch.testing.assert_close(by_chunks, whole, atol=1e-3, rtol=1e-3)
assert int(by_chunks.argmax()) == int(whole.argmax()) == first_token
print("by hand == one whole forward == the engine")

# %% [markdown]
# ## What a running stream sees
#
# The point of the split is the other requests. One stream decodes; after three of its tokens
# a 320-token prompt arrives. With chunking off the prompt is prefilled in one step; with it
# on, in chunks under the 64-token budget. We step the engine ourselves and record, for each
# step that gives the stream a token, how many tokens that forward held and how long it took.
# We also keep every token both requests produce.


# %%
def around_a_long_prompt(engine) -> tuple[list[tuple[int, float]], list[list[int]]]:
    stream = engine.make_request([101, 102, 103], s06.SamplingParams(max_tokens=10, temperature=0))
    engine.add_request(stream)
    for _ in range(3):
        engine.step()
    prompt = [100 + i % 900 for i in range(320)]
    arrival = engine.make_request(prompt, s06.SamplingParams(max_tokens=4, temperature=0))
    engine.add_request(arrival)
    steps = []  # (tokens in the forward, ms) of each step that gave the stream a token
    while engine.has_unfinished():
        start = time.perf_counter()
        so = engine.scheduler.schedule()
        engine.update_from_output(so, engine.runner.execute_model(so))
        if any(s.request_id == stream.request_id for s in so.requests):
            steps.append((so.num_tokens, (time.perf_counter() - start) * 1e3))
    return steps, [stream.output_token_ids, arrival.output_token_ids]


engines = {"whole": s06.LLM(chunked_prefill=False, **SMALL), "chunked": llm}
steps, tokens = {}, {}
for name, engine in engines.items():
    steps[name], tokens[name] = around_a_long_prompt(engine)
    biggest, slowest = max(n for n, _ in steps[name]), max(ms for _, ms in steps[name])
    median = statistics.median(ms for _, ms in steps[name])
    print(f"{name:8} the stream's biggest step {biggest:3d} tokens;", end=" ")
    print(f"its slowest {slowest:4.0f} ms, median {median:3.0f} ms")
assert max(n for n, _ in steps["whole"]) == 320 + 1  # the whole prompt and the stream's token
assert max(n for n, _ in steps["chunked"]) <= BUDGET
assert tokens["whole"] == tokens["chunked"]
print("the same tokens either way")

# %% [markdown]
# Without chunking, one of the stream's steps holds the whole prompt and its own token: 321
# tokens in one forward, and the stream's longest gap is that forward. With chunking no step
# holds more than the budget, so the longest gap is one chunk's step. The token counts are
# exact; the times move with whatever else the machine runs, so compare them within one run.
# The median barely moves: most steps are plain decodes either way.
#
# Both runs produce the same tokens, for the stream and for the long prompt. The scheduler
# decides only how the prompt's positions are grouped into forwards; what is computed at each
# position is the same.

# %% [markdown]
# ## Measured
#
# `python -m stages 06 bench` runs 8 streams that decode while 2,000-token prompts arrive,
# whole and chunked, then sweeps the token budget, then times one stream against a
# 3,000-token prompt with the default budgets. The numbers below come from the JSON the
# same run wrote next to the plot.

# %%
record = json.loads((PLOTS / "06_chunked.json").read_text())
summary, results = record["summary"], record["results"]
print(record["machine"], "|", record["workload"])
Image(filename=str(PLOTS / "06_chunked.png"))

# %% [markdown]
# **Top left** shows every gap between two tokens of a stream, over time, on a log scale.
# Without chunking (red) there are three points far above the rest: the three long prompts,
# each prefilled in one step that every stream waits for. With chunking (blue) the gaps rise
# during each prefill, to about one step of 256 tokens plus the decodes, and stay there. The
# streams slow down during a prefill instead of stopping.

# %%
for label in ("whole prefill (stage 05)", f"chunked, budget {summary['chunk_budget_tokens']}"):
    itl = results[label]["itl_ms"]
    print(f"{label:26} p50 {itl['p50']:5.0f}  p90 {itl['p90']:5.0f}  max {itl['max']:5.0f} ms")

# %% [markdown]
# **Top right** sums that up. The median gap is the same in both modes, because most steps
# are plain decodes. The p99 gap is one long prefill without chunking, and one chunk's step
# with it.

# %%
print(f"p99 gap: whole {summary['p99_itl_ms_whole']:.0f} ms,", end=" ")
print(f"chunked {summary['p99_itl_ms_chunked']:.0f} ms", end=" ")
print(f"({summary['p99_itl_ratio_whole_vs_chunked']:.1f}x lower)")
print(f"long prompts' TTFT: whole {summary['long_prompt_ttft_ms_whole'] / 1e3:.1f} s,", end=" ")
print(f"chunked {summary['long_prompt_ttft_ms_chunked'] / 1e3:.1f} s")
print(f"output tokens/s: whole {summary['output_tokens_per_s_whole']:.1f},", end=" ")
print(f"chunked {summary['output_tokens_per_s_chunked']:.1f}")

# %% [markdown]
# The long prompts' time to first token (the title) barely changes. A chunked prompt does the
# same prefill work, in more steps that it shares with the decodes. With no
# `long_prefill_token_threshold` the prompt being chunked takes all the budget the decodes
# leave, so the three long prompts are still prefilled one after another.
#
# **Bottom left** sweeps the budget. Each point is one run of the same workload: the p99 gap
# of the streams against the throughput, labelled with the tokens per step.

# %%
sweep = results["budget_sweep"]
for budget, point in sweep.items():
    p99, rate = point["itl_ms"]["p99"], point["output_tokens_per_s"]
    ttft = point["long_prompt_ttft_ms"]["p50"] / 1e3
    print(f"budget {budget:>4}: p99 gap {p99:5.0f} ms, {rate:4.1f} tokens/s, TTFT {ttft:4.1f} s")
steadiest = min(sweep, key=lambda b: sweep[b]["itl_ms"]["p99"])
print("steadiest streams at budget", steadiest)

# %% [markdown]
# The budget is the trade-off. A small budget bounds every step, so the streams are steady,
# but a long prompt needs many steps, and each step pays the fixed cost of a forward (reading
# every weight once). A large budget approaches whole prefill: few steps, long gaps. The
# throughput is flat in the middle; single points move with the load of a shared machine, so
# read the shape rather than one number.
#
# **Bottom right** is one stream while a 3,000-token prompt arrives, every repeat drawn. Each
# gap the stream sees is plotted against how much of the prompt was cached when it began. A
# chunk's attention reads the whole cached context, so late chunks cost more than early ones
# and the lines climb. Dashed lines are the CPU attention before `cpu_attention.py` (one
# masked SDPA over context and chunk), solid lines the present one.

# %%
defaults = results["defaults"]
for label, gap in defaults["median_max_gap_ms"].items():
    ttft = defaults["median_ttft_ms"][label]
    print(f"{label:28} longest gap {gap / 1e3:4.1f} s, prompt TTFT {ttft / 1e3:4.1f} s")
print("default budget on this CPU:", summary["default_budget_tokens"], "tokens")
print("attention of one 512-token chunk over 3,000 positions, per layer:")
before, now = summary["attention_ms_before"], summary["attention_ms_after"]
print(f"  before {before:.0f} ms, now {now:.0f} ms")

# %% [markdown]
# Two choices bring the longest gap down: the attention of a chunk over its context runs the
# fused CPU kernel (the solid lines sit under the dashed ones), and the default budget on a
# CPU is 256 tokens rather than 512 (blue under red). Halving the chunk halves the cost of the
# late steps; the prompt's time to first token hardly moves, because the attention over its
# context is the same total work in any chunk size.

# %% [markdown]
# ## Exercises
#
# 1. Set `long_prefill_token_threshold=16` and send two 200-token prompts at once to the
#    64-token engine. Extend `chunks_by_hand` to predict both prompts' chunks, and assert the
#    scheduler agrees. When does the threshold help a second prompt's time to first token?
# 2. Run `prefill_in_chunks` with chunks of 1, 7 and 200 tokens. Does the largest logit
#    difference to the whole forward change with the chunk size? Explain what rounding does
#    and does not depend on.
# 3. Measure the long prompt's time to first token in `around_a_long_prompt` on engines with
#    budgets of 32, 64, 128 and 256. Fit time = steps x fixed cost + prompt work, and
#    estimate the fixed cost of a step on your machine.
# 4. Only the last chunk samples. Change `prefill_in_chunks` to return every chunk's last
#    logits, and find what the model predicts at each chunk boundary. Why would an engine that
#    returns prompt log-probabilities (vLLM's `prompt_logprobs`) need more than the last row?
