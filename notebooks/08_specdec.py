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
# A decode step reads every weight of the model to produce one token per request. The
# attention of stage 03 already takes any number of new tokens over a cached context, so a
# forward over five new tokens costs about what a forward over one does when the weights'
# read dominates. Speculative decoding uses that. A cheap drafter guesses the next k tokens;
# one target forward over `[last token, guess 1 .. guess k]` checks them all. Every guess the
# target agrees with is a token that cost no extra read of the weights.
#
# The output must not change. For a greedy request a guess is kept exactly when it is the
# target's argmax, and the step always adds one token of the target's own: the argmax at the
# first wrong guess, or a bonus token after the last right one.
#
# We write the n-gram drafter by hand and check it against the engine's. Then we run a
# request that copies code, and at every step we draft and verify by hand, with one forward
# and no cache, and assert the engine emitted the same tokens. We check that greedy output
# equals the plain engine's, that rejection sampling keeps the target's distribution when it
# samples, and read the measured plot.

# %%
import json
from pathlib import Path

import torch
from IPython.display import Image

import stages

s08 = stages.load("08")
drafters = stages.load("08", "spec_decode.drafters")
rejection_sampler = stages.load("08", "spec_decode.rejection_sampler")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
SMALL = {"max_model_len": 1024, "kv_cache_bytes": 64 * 2**20, "async_scheduling": False}
print(s08.TECHNIQUE)

# %% [markdown]
# ## Prompt lookup, by hand
#
# The n-gram drafter (prompt lookup decoding, vLLM's `"ngram"`) needs no model. It takes the
# last n tokens of the sequence, for n from `max_n` down to `min_n`, and looks for their most
# recent earlier occurrence. If it finds one, it proposes the k tokens that followed it
# there. When the output copies its input (editing, code, quoting) those guesses are often
# right; on open-ended chat they rarely are.


# %%
def lookup_by_hand(tokens: list[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


proposer = drafters.NgramProposer(min_n=2, max_n=4)
for tokens in ([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], [1, 2, 3, 4, 5], [7, 8, 1, 7, 8, 2, 7, 8]):
    by_hand = lookup_by_hand(tokens, k=3)
    print(f"{tokens} -> {by_hand}")
    assert by_hand == proposer.propose(tokens, k=3)

# %% [markdown]
# In the first sequence the suffix `[1, 2, 3]` occurred at the start, so the guess is what
# followed it. The second has no repeated suffix: no guess, and the step is a plain decode.
# In the third, `[7, 8]` occurred twice before; the most recent occurrence wins, so the guess
# starts with 2. The engine's proposer keeps an index of every n-gram's latest start, updated
# as tokens arrive, so a proposal costs a few dictionary lookups instead of a scan.

# %% [markdown]
# ## Draft and verify, by hand
#
# An engine with the n-gram drafter and k = 4, and a request that repeats a piece of code.
# At each step we read what the scheduler gives the request: its last token, then its
# drafts. We check the drafts against `lookup_by_hand` over the request's tokens so far.
#
# Then we verify them ourselves. `runner.prompt_logits` runs a whole sequence through the
# model in one forward with no cache. Over `tokens so far + drafts`, the argmax at the last
# real token's position is the target's next token; the argmax one position later is its
# token after the first draft, and so on. We keep drafts while each equals the target's
# argmax, then add the target's token at the first mismatch (or the bonus after the last
# draft). That must be exactly what the engine's step emits.

# %%
K = 4
llm = s08.LLM(speculative="ngram", num_speculative_tokens=K, **SMALL)
code = "def area(width, height):\n    return width * height\n"
messages = [{"role": "user", "content": f"Copy this Python function exactly:\n\n{code}"}]
greedy = s08.SamplingParams(max_tokens=32, temperature=0)
request = llm.make_request(None, greedy, messages=messages, request_id="copy")
llm.add_request(request)


def verify_by_hand(tokens: list[int], drafts: list[int]) -> list[int]:
    logits = llm.runner.prompt_logits(tokens + drafts)
    target = logits[len(tokens) - 1 :].argmax(dim=-1).tolist()  # len(drafts) + 1 tokens
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return [*drafts[:accepted], target[accepted]]


log = []  # (drafts, emitted) of every verification step
while llm.has_unfinished():
    so = llm.scheduler.schedule()
    (scheduled,) = so.requests
    tokens = request.prompt_token_ids + request.output_token_ids
    drafts = list(scheduled.token_ids[len(scheduled.token_ids) - scheduled.num_draft_tokens :])
    emitted = llm.runner.execute_model(so)[request.request_id]
    if drafts:
        room = greedy.max_tokens - len(request.output_token_ids) - 1
        assert drafts == lookup_by_hand(tokens, min(K, room))
        assert emitted == verify_by_hand(tokens, drafts)
        log.append((drafts, emitted))
        shown = llm.tokenizer.decode(emitted)
        print(f"{len(drafts)} drafts, {len(emitted) - 1} accepted, emitted {shown!r}")
    llm.update_from_output(so, {request.request_id: emitted})
print(f"{len(log)} verifications, each one by hand == the engine")

# %% [markdown]
# The drafter searches the prompt as well as the answer, so it guesses from the first decode
# on. While the answer copies the function, the suffix matches the prompt's copy and the
# guesses are the function's next tokens: whole runs of four are kept. A guess goes wrong
# where the copy and the original part, such as the code fence the model adds, and after the
# copy, where the model writes its own prose and the suffix rarely occurs earlier.

# %%
print(request.text)

# %% [markdown]
# ## The engine's counts
#
# `llm.spec_stats` counts every verification's drafts and the drafts accepted. The token the
# target adds after them is not an accepted draft. We count both from our log and check them.

# %%
num_drafts = sum(len(d) for d, _ in log)
num_accepted = sum(len(e) - 1 for _, e in log)
stats = llm.spec_stats
print(f"drafts {num_drafts}, accepted {num_accepted}: {num_accepted / num_drafts:.0%}")
print(f"tokens per verification: {(num_accepted + len(log)) / len(log):.2f}")
assert abs(stats.acceptance_rate - num_accepted / num_drafts) < 1e-9
assert abs(stats.tokens_per_verification - (num_accepted + len(log)) / len(log)) < 1e-9

# %% [markdown]
# ## Greedy output is unchanged
#
# The same request on the engine without speculation gives the same tokens. It takes one
# step per token; the speculative engine needed far fewer target forwards.

# %%
plain = s08.LLM(**SMALL)
again = plain.chat(messages, greedy)[0]
assert again.token_ids == request.output_token_ids
steps_spec = len(log) + (len(request.output_token_ids) - sum(len(e) for _, e in log))
print(f"same {len(again.token_ids)} tokens; target forwards: plain {len(again.token_ids)},")
print(f"speculative {steps_spec} (the prompt's and the plain decodes included)")

# %% [markdown]
# ## When the request samples
#
# With a temperature the target's next token is a draw, not an argmax. The rejection sampler
# then accepts a draft `d` with probability `min(1, p(d) / q(d))`, where `p` is the target's
# distribution and `q` the drafter's. At the first rejection it draws from the leftover mass
# `max(p - q, 0)`, normalised. The emitted token then follows `p` exactly, whatever `q` is.
# An n-gram drafter's `q` is one-hot on its guess, so its guess is kept with probability
# `p(guess)`.
#
# We check that with the engine's PyTorch reference, `rejection_sample_reference`: 20,000
# requests with one draft each, a target `p` over four tokens, and a drafter that always
# guesses token 2. The first emitted token's frequencies must match `p`.

# %%
gen = torch.Generator().manual_seed(0)
n, vocab = 20_000, 4
p = torch.tensor([0.1, 0.2, 0.3, 0.4])
q = torch.nn.functional.one_hot(torch.tensor(2), vocab).float()
target_probs = p.repeat(2 * n, 1)  # request r: its draft's row, then its bonus row
draft_probs = q.repeat(n, 1)
draft_ids = torch.full((n,), 2)
uniforms = torch.rand(n, generator=gen)
exponentials = -torch.rand(2 * n, vocab, generator=gen).log()
out = rejection_sampler.rejection_sample_reference(
    target_probs, draft_probs, draft_ids, list(range(n + 1)), uniforms, exponentials
)
frequencies = torch.bincount(out[:, 0], minlength=vocab) / n
print("target p         ", p.tolist())
print("emitted frequency", [round(f, 3) for f in frequencies.tolist()])
print(f"draft kept in {float((out[:, 0] == 2).float().mean()):.1%} of requests (p(2) = 0.3)")
assert (frequencies - p).abs().max() < 0.015

# %% [markdown]
# The draws are counter-based, as in stage 01: the noise for position x depends on the
# request's seed and x. The emitted token at x uses the same noise the plain sampler would
# use there, so a request with no drafts gets the plain sampler's token. A seeded request's
# text still differs with and without speculation, because accepting a draft consumes an
# acceptance draw that the plain sampler never makes. Both follow the target's distribution.

# %% [markdown]
# ## Measured
#
# `python -m stages 08 bench` measures the speedup and the tokens per target forward against
# k, for the n-gram drafter and a draft model (the target's first 10 layers), on a
# repetitive workload and a chat one. Then it measures the speedup against the batch size.
# The numbers below come from the JSON of the same run.

# %%
record = json.loads((PLOTS / "08_specdec.json").read_text())
summary, results = record["summary"], record["results"]
print(record["machine"], "|", record["workload"])
Image(filename=str(PLOTS / "08_specdec.png"))

# %% [markdown]
# **Left.** The speedup over plain decoding at batch 1, against k. The n-gram drafter gains
# most on the repetitive workload, and more with every extra draft: its guesses are free, and
# long runs of them are right. On chat it gains a little. The draft model loses on both: its
# guesses cost forwards of their own, and a truncated model rarely guesses right.

# %%
for label, point in results["batch1"].items():
    rep, chat = point["repetitive"], point["chat"]
    print(
        f"{label:36} repetitive {rep['speedup']:4.2f}x ({rep['acceptance_rate']:4.0%} kept),"
        f" chat {chat['speedup']:4.2f}x ({chat['acceptance_rate']:4.0%} kept)"
    )
print(
    f"best n-gram k {summary['ngram_best_k']}: {summary['ngram_speedup_repetitive_batch1']:.2f}x;"
    f" draft model at its best k {summary['draft_best_k']}:"
    f" {summary['draft_speedup_repetitive_batch1']:.2f}x"
)

# %% [markdown]
# **Middle.** What each verification yields: accepted drafts plus the target's own token. It
# is at least 1 and at most k + 1. It grows with k on the repetitive workload even though the
# share of drafts kept falls: a longer guess still adds tokens when its start is right. The
# draft model stays near 1: its guesses are almost never kept.

# %%
for label, point in results["batch1"].items():
    if label.startswith(("ngram", "draft")):
        rep, chat = point["repetitive"], point["chat"]
        yields = f"{rep['tokens_per_target_forward']:.2f} / {chat['tokens_per_target_forward']:.2f}"
        print(f"{label:20} tokens per target forward, repetitive / chat: {yields}")

# %% [markdown]
# **Right.** The n-gram drafter at k = 4 on the repetitive workload, against the batch size.
# The speedup shrinks as the batch grows. At batch 1 a step is bound by reading the weights,
# so four extra tokens in the forward are nearly free. A batch already shares that read among
# its requests, and each request's drafts add real compute, so the step gets slower with
# every draft. At the largest batch speculation barely pays.

# %%
for batch, point in results["batch_sweep"]["ngram k=4"].items():
    print(
        f"batch {batch}: {point['speedup']:.2f}x, {point['tokens_per_target_forward']:.2f} tokens"
    )

# %% [markdown]
# ## Exercises
#
# 1. Run the code request with `speculative="draft"` and `draft_num_layers` of 10, 20 and
#    28 (the model has 30). Read `llm.spec_stats` and time each run. Where does the draft
#    model break even with the plain engine, and why is that so late?
# 2. Change `lookup_by_hand` to prefer the *earliest* occurrence of the suffix instead of the
#    latest. Does the code request keep more or fewer drafts? Explain with the two functions.
# 3. Pick k per step from the recent acceptance rate (say k = 1 after two misses, up to 6
#    after hits). Simulate it on the tokens of the code request with `lookup_by_hand` and
#    count target forwards against a fixed k.
# 4. Run the rejection-sampling check with a drafter `q` that is not one-hot (say uniform).
#    Do the frequencies still match `p`? How does the share of kept drafts change?
