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
# A long prompt's prefill costs seconds of compute; a decode step costs milliseconds. On one
# engine they share steps, so every stream waits whenever a long prompt's chunk runs. Stage 13
# runs the two phases on different engines. A prefill engine computes the prompt's KV and
# holds it. A decode engine receives it, block by block, through a KV connector (the seam stage
# 12 built for the host tier), and generates. A proxy joins the two.
#
# We first do the decode engine's job by hand: move one prompt's KV from one engine's pool to
# another's through the in-process transport, check every byte, and let the second engine
# decode from it. Then we play the proxy between a real prefill and decode engine, step by
# step, and read the messages they exchange. We drive the transfer's state machine to see why
# a lease never frees blocks a send still reads, make a transfer fail on purpose, and read the
# benchmark's plot. Everything runs in this process; the notebook takes about a minute on a
# laptop CPU.

# %%
import json
from pathlib import Path

import torch
from IPython.display import Image

import stages

s13 = stages.load("13")
fake = stages.load("13", "harness.fake_transport")
pair_module = stages.load("13", "harness.disagg_pair")
staging = stages.load("13", "disagg.kv_staging")
sides = stages.load("13", "disagg.transfer_sides")
state = stages.load("13", "disagg.transfer_state")
KVPool = stages.load("13", "kv_connector.base").KVPool
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
ENGINES = {"max_model_len": 512, "kv_cache_bytes": 32 * 2**20}
print(s13.TECHNIQUE)

# %% [markdown]
# ## One engine, for reference
#
# A plain engine (`kv_role="both"`, stage 12's behaviour) runs the prompt. We step it by hand:
# the first step prefills the prompt and gives it its blocks. We note them, then let it
# finish. Its greedy tokens are what the disaggregated engines must produce.

# %%
one = s13.LLM(**ENGINES)
greedy = s13.SamplingParams(max_tokens=24, temperature=0)
prompt = (
    "The sky looks blue during the day because sunlight is scattered by the air. At sunset "
    "the light crosses much more air before it reaches us, so the sky turns"
)
request = one.make_request(prompt, greedy)
one.add_request(request)
one.step()  # the prefill
prompt_ids = list(request.prompt_token_ids)
source_blocks = list(one.kv_manager.block_ids(request.request_id))
while one.has_unfinished():
    one.step()
reference = request.output_token_ids
print(f"{len(prompt_ids)} prompt tokens in blocks {source_blocks} of {one.block_size} tokens")
print(repr(request.final_output().text))

# %% [markdown]
# ## Moving a prompt's KV, by hand
#
# What must move? The decode engine computes the prompt's last token itself: it needs that
# token's logits to sample the first output token. So it receives the KV of every prompt token
# but the last, `len(prompt) - 1` tokens, in whole blocks.
#
# The receiving engine here is a second plain engine. We allocate blocks there for those
# tokens, as the decode engine's scheduler does when a request arrives.

# %%
receiver = s13.LLM(**ENGINES)
incoming = receiver.make_request(prompt_ids, greedy)
wanted = len(prompt_ids) - 1
send_blocks = source_blocks[: receiver.kv_manager.blocks_needed(wanted)]
assert receiver.kv_manager.allocate_slots(incoming.request_id, wanted)
target_blocks = receiver.kv_manager.block_ids(incoming.request_id)
print(f"{wanted} tokens: send blocks {send_blocks}, receive into blocks {target_blocks}")

# %% [markdown]
# The transport has two ends. `FakeTransport.pair()` gives two ends of one in-process wire;
# over gloo the same calls cross two processes. At start-up each end states its pool's layout
# (`handshake`): two engines whose blocks differ refuse each other.
#
# The decode side posts its receive first. The prefill side's send then gathers the blocks
# into one staging buffer, by a plan (`plan_transfer`: one segment per tensor, K and V), and
# puts it on the wire; the receive scatters it into its blocks. A handle says when each end
# has drained: only then may its blocks be freed.

# %%
send_end, recv_end = fake.FakeTransport.pair()
source_pool, target_pool = KVPool.of(one.kv_cache), KVPool.of(receiver.kv_cache)
send_end.handshake(source_pool)
recv_end.handshake(target_pool)

received = recv_end.start_recv("demo", target_pool, target_blocks)
print("receive posted, done:", received.done())
sent = send_end.start_send("demo", source_pool, send_blocks)
sent.result(timeout=10)
received.result(timeout=10)
print("after the send, done:", received.done())

plan = staging.plan_transfer(staging.layouts((one.kv_cache.k, one.kv_cache.v)), send_blocks)
mc = one.model_config
per_block = 2 * mc.num_layers * one.block_size * mc.num_kv_heads * mc.head_dim * 4
print(f"staging: {plan.nbytes:,} bytes in {len(plan.segments)} segments")
assert plan.nbytes == len(send_blocks) * per_block
assert torch.equal(one.kv_cache.k[:, send_blocks], receiver.kv_cache.k[:, target_blocks])
assert torch.equal(one.kv_cache.v[:, send_blocks], receiver.kv_cache.v[:, target_blocks])
print("every byte of K and V arrived")

# %% [markdown]
# ## Decoding from received KV
#
# A decode engine runs a received prompt like a prefix hit: the KV is in its blocks, and it
# computes only what is missing. We get the same effect by hand through the receiver's prefix
# cache. `cache_blocks` publishes the request's full blocks under their content keys, and
# `free` gives the blocks back with their content still cached. A request with this prompt
# then finds them.
#
# (The prefix cache keeps only full blocks, so here the tokens of the last, partial block are
# computed again. The decode engine's connector takes every received token, partial block
# included.)

# %%
receiver.kv_manager.cache_blocks(incoming, wanted)
receiver.kv_manager.free(incoming.request_id)
decoded = receiver.generate(prompt_ids, greedy)[0]
print(f"{decoded.num_cached_tokens} of {len(prompt_ids)} prompt tokens came from the transfer")
assert decoded.num_cached_tokens > 0
assert decoded.token_ids == reference
print("the receiver's tokens equal the one engine's")

# %% [markdown]
# The receiver never computed the KV of the first blocks; it read what the wire brought, and
# sampled exactly the one engine's tokens.

# %% [markdown]
# ## Two engines and a proxy, by hand
#
# Now the real roles. Inside `fake.in_process_transports()` two engines built with the same
# `in-process://` address meet over one in-process wire. We play the proxy (the front end's
# `DisaggClient` does this across processes):
#
# 1. send the prefill engine a copy of the request with `max_tokens=1` and
#    `kv_transfer_params={"do_remote_decode": True}` (`prefill_request`);
# 2. when it finishes, its output says where the KV waits (`kv_transfer_params`); its one
#    token is dropped;
# 3. send the original request with those parameters to the decode engine
#    (`decode_request`), step both engines, and relay their control messages after each
#    step.

# %%
with fake.in_process_transports():
    prefill = s13.LLM(kv_role="prefill", kv_transfer_address="in-process://notebook", **ENGINES)
    decode = s13.LLM(kv_role="decode", kv_transfer_address="in-process://notebook", **ENGINES)

request = prefill.make_request(prompt, greedy, output_kind="final")
first_half = pair_module.prefill_request(prefill, request)
print(
    "to the prefill engine:", first_half.params.max_tokens, "token,", first_half.kv_transfer_params
)
prefill.add_request(first_half)
while not first_half.finished:
    prefill.step()
params = first_half.final_output().kv_transfer_params
print("its answer says where the KV waits:", params)

# %% [markdown]
# The prefill engine keeps those blocks under a lease after the request finished. The decode
# engine gets the request with the parameters. At admission its connector says the prompt but
# its last token comes from elsewhere; the request waits in `loading` while the blocks arrive.

# %%
decode.add_request(pair_module.decode_request(request, params))
decode_blocks = None
while not request.finished:
    prefill.step()
    decode.step()
    if decode_blocks is None and decode.kv_manager.block_ids(request.request_id):
        decode_blocks = list(decode.kv_manager.block_ids(request.request_id))
    to_prefill, to_decode = decode.take_peer_messages(), prefill.take_peer_messages()
    for message in to_prefill:
        print(f"decode -> prefill: {message.kind:5} {message.block_ids}")
    for message in to_decode:
        print(f"prefill -> decode: {message.kind:5} {message.block_ids}")
    prefill.deliver_peer_messages(to_prefill)
    decode.deliver_peer_messages(to_decode)
print("decode engine's blocks:", decode_blocks)
print(repr(request.final_output().text))
assert request.output_token_ids == reference

# %% [markdown]
# Two messages made it work. The "pull" names the prefill side's blocks the decode side wants,
# in order, once its receive is posted: a gloo pair is one ordered stream, so a send must not
# start before its receive waits. The "done" tells the prefill side it may free the blocks.
# The tokens equal the one engine's, and the decode engine's copy of the prompt's KV equals
# the prefill engine's, position by position.

# %%
remote = params["remote_block_ids"]
for name in ("k", "v"):
    held = getattr(prefill.kv_cache, name)[:, remote].flatten(1, 2)[:, :wanted]
    got = getattr(decode.kv_cache, name)[:, decode_blocks[: len(remote)]].flatten(1, 2)[:, :wanted]
    assert torch.equal(held, got)
stats = decode.kv_connector.stats
print(f"decode received {stats.tokens_loaded} tokens in {stats.blocks_loaded} blocks")
assert stats.tokens_loaded == wanted
prefill.check_no_leaks()
decode.check_no_leaks()

# %% [markdown]
# ## The state machine keeps what a transfer touches
#
# Each side keeps a record per request and moves it through checked states: FAILED <
# BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS. Every state has a deadline, so
# nothing waits forever. Time is passed in, so we can drive it by hand.
#
# First, a lease that runs out with no send under way: the blocks go back, as they should.

# %%
config = state.TransferConfig(lease_seconds=5.0, transfer_timeout_seconds=60.0)
side = sides.PrefillTransfers(config)
side.add("q", now=0.0)
side.bootstrapped("q", now=0.0)
side.hold("q", (4, 5), now=0.0)
side.poll_timeouts(now=10.0)
freed = side.drain().free
print("lease expired, nothing sending: frees", freed, "and drops the record")
assert freed == (("q", (4, 5)),) and "q" not in side.records

# %% [markdown]
# Now the case vLLM got wrong (#21570). The decode side pulls, the send starts, and ten
# seconds later the lease has long expired. But a send is still reading the blocks: nothing
# may be freed. The blocks go back only when the transport reports that the send drained.

# %%
side.add("r", now=0.0)
side.bootstrapped("r", now=0.0)
side.hold("r", (7, 3, 9), now=0.0)
side.pull("r", (7, 3, 9), now=1.0)  # decode posted its receive: the send starts
print("state:", side.poll("r").name)
side.poll_timeouts(now=10.0)
early = side.drain().free
print("after the lease, while sending:", side.poll("r").name, "frees", early)
side.send_finished("r", ok=True, now=11.0)
late = side.drain().free
print("drained:", late)
assert not early and late == (("r", (7, 3, 9)),)

# %% [markdown]
# ## A failed transfer costs one request
#
# `DisaggregatedPair` does the proxy's work of the section above for many requests at once.
# We make the prefill engine refuse one request's transfer: its send carries a header naming
# no blocks. That receive fails; the decode engine computes the prompt itself
# (`kv_transfer_on_failure="local_prefill"`, the default), and the answer is the same. The
# other requests never notice.

# %%
pair = pair_module.DisaggregatedPair(prefill, decode)
transport = prefill.runner.kv_connector.transport
send, sends = transport.start_send, []


def refuse_the_second(request_id, pool, block_ids):
    sends.append(request_id)
    return send(request_id, pool, () if len(sends) == 2 else block_ids)


transport.start_send = refuse_the_second
prompts = [
    "The capital of France is a city called",
    "Water boils at a temperature of",
    "The three primary colours of light are",
]
loaded_before, failed_before = stats.tokens_loaded, stats.load_failures
outputs = pair.generate(prompts, greedy)
del transport.start_send  # the transport's own method again
wanted_all = sum(len(o.prompt_token_ids) - 1 for o in outputs)
planned = stats.tokens_loaded - loaded_before
print(f"receives posted for {planned} of {wanted_all} prompt tokens; refused: {sends[1]}")
print("transfers that failed:", stats.load_failures - failed_before)
assert stats.load_failures - failed_before == 1
same = [o.token_ids for o in outputs] == [o.token_ids for o in one.generate(prompts, greedy)]
print("same answers as one engine:", same)
assert same
prefill.check_no_leaks()
decode.check_no_leaks()

# %% [markdown]
# The decode engine posted a receive for every request; one was refused. That record failed
# alone: its request computed its prompt on the decode engine, the other two used what they
# received, and every block went back on both sides (`check_no_leaks`).

# %% [markdown]
# ## Measured
#
# `python -m stages 13 bench` measures three things on this machine. Four streams decode 160
# tokens each while six prompts of 1,536 tokens arrive two seconds apart, on two engine cores
# that both prefill and decode (data parallelism, stage 10), and on one prefill and one decode
# core. The KV transfer over gloo between two processes, against the prompt's length. And a
# GPU pair, modelled, not measured. The numbers below are read from `plots/13_disagg.json`,
# the run that drew the plot.

# %%
bench = json.loads((PLOTS / "13_disagg.json").read_text())
summary, results = bench["summary"], bench["results"]
print(bench["machine"])
Image(filename=str(PLOTS / "13_disagg.png"))

# %% [markdown]
# **Left: the streams' inter-token latency**, as a cumulative distribution: for each gap on
# the x axis, the share of gaps at most that long. Red colocated, blue disaggregated.

# %%
for mode in ("colocated", "disaggregated"):
    gaps = [summary[f"stream_itl_{p}_ms_{mode}"] for p in ("p50", "p90", "p99")]
    print(f"{mode:14} ITL p50 {gaps[0]:4.0f}  p90 {gaps[1]:4.0f}  p99 {gaps[2]:4.0f} ms")
print(f"p99 {summary['stream_itl_p99_ratio_colocated_vs_disaggregated']:.1f}x lower disaggregated")
for mode, label in (("colocated", "colocated: 2 engines (DP=2)"),
                    ("disaggregated", "disaggregated: 1 prefill + 1 decode")):  # fmt: skip
    gaps = results["interference"][label]["stream_gaps_ms"]
    median = summary[f"stream_itl_p50_ms_{mode}"]
    slow = sum(gap > 2 * median for gap in gaps) / len(gaps)
    ttft = summary[f"long_ttft_p50_ms_{mode}"] / 1e3
    print(f"{mode:14} gaps over twice the median: {slow:4.0%}; long prompts' TTFT p50 {ttft:.1f} s")

# %% [markdown]
# The medians are the same: a plain decode step costs the same on either core. The tails
# differ. A colocated stream shares its engine's steps with the long prompts' chunks: each
# gap that also ran a chunk is several times the median. They are the red curve's long flat
# stretch and its tail. The disaggregated decode core never runs a prefill, and its curve
# ends early. The price is on the long prompts: one prefill core instead of two, so their
# first token comes much later. On two CPU cores
# disaggregation moves prefill work; it does not add compute. It pays when decode latency has
# a target and the prefill pool is sized for the prompt load.
#
# **Middle: the KV transfer time** against the prompt's length, log-log. Blue: over gloo
# between two processes; orange: the gather and scatter alone, in one process.

# %%
for point in results["transfer"]:
    size = f"{point['prompt_tokens']:5d} tokens  {point['megabytes']:6.1f} MB"
    print(f"{size}  gloo {point['transfer_ms']:6.1f} ms  copies {point['local_copy_ms']:6.1f} ms")
longest = summary["transfer_tokens_longest"]
print(f"{longest} tokens at {summary['transfer_gb_per_s_longest']:.2f} GB/s")

# %% [markdown]
# Short prompts pay a floor of a few milliseconds per transfer; long ones grow linearly at
# well under a GB/s. The copies alone are several times faster: nothing in this transfer
# overlaps, since the receiver waits for the whole message before it scatters. Even so, a
# long prompt's KV moves in a small fraction of the seconds its prefill took.
#
# **Right: a GPU pair, modelled.** Llama-3-8B in bf16 (128 KiB of KV per token) between two
# H100s: the transfer over NVLink and over 400 Gb/s RDMA, and the prefill that produced it at
# half the H100's peak. None of it is a measurement.

# %%
model = results["modelled_gpu_pair"]
rdma, nvlink = model["RDMA 400 Gb/s (50 GB/s)"], model["NVLink 4 (450 GB/s)"]
for i, n in enumerate(model["prompt_tokens"]):
    print(f"{n:6d} tokens  prefill {model['prefill'][i]:7.1f} ms  "
          f"RDMA {rdma[i]:6.2f} ms  NVLink {nvlink[i]:6.2f} ms")  # fmt: skip
share = summary["modelled_gpu_rdma_transfer_share_of_prefill"]
print(f"transfer / prefill: RDMA {share:.1%}, NVLink {nvlink[-1] / model['prefill'][-1]:.1%}")

# %% [markdown]
# Both the transfer and the prefill grow linearly with the prompt, so past the transfer's
# fixed start-up cost the ratio is the same at every length: a small share of the prefill.
# Sent layer by layer while later layers still compute, most of it would hide behind the
# prefill.

# %% [markdown]
# ## Exercises
#
# 1. Compress on the wire: in the by-hand transfer above, send K and V as int8 codes with one
#    scale per (block, head) (stage 14's KV format) and decode them into the receiver's fp32
#    blocks. How many bytes does the transfer save, how far are the received values from the
#    sent ones, and do the receiver's greedy tokens change?
# 2. Time `start_send` over the fake transport for 1 to 32 blocks, in one process, and
#    compare with the middle panel's orange line. Where does the gap to gloo's blue line come
#    from?
# 3. While the prefill engine holds a request's blocks for the decode side, send the pair a
#    second request with the same prompt. Does the prefill engine's prefix cache hit the held
#    blocks? Should it, and what must the lease then count?
# 4. Give the prefill side a lease of 0.1 s and make the decode engine slow to pull (hold its
#    transport with `mode = "hold"`). Follow the record's states and the blocks: which rule
#    keeps the request alive, and what does it cost?
