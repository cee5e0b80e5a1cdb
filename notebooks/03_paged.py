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
# # Stage 03: paged attention
#
# Stage 01 gave each request its own contiguous KV buffer, sized for the longest the request
# might grow. To decode many requests together, their caches must share memory, and those
# reservations waste most of it.
#
# Stage 03 cuts the KV memory into one pool of fixed-size blocks that every request shares. A
# request gets a new block only when its last one is full. A per-request *block table*
# records where its blocks are, and attention reads K and V through it.
#
# We drive the block allocator and the cache manager by hand first. Then we check the Triton
# attention kernel against the PyTorch reference, and work out one query's attention through
# a block table. We finish with the engine: the same memory budget, laid out contiguously and
# in blocks, one scheduler step at a time.

# %% [markdown]
# Triton compiles kernels for a GPU. With `TRITON_INTERPRET=1` it runs them instead in a
# Python interpreter, on the CPU, slowly but exactly. Triton reads the variable when
# `@triton.jit` wraps a kernel, and that happens when the stage is imported. So we set it in
# the first cell, before anything imports triton. Setting it later has no effect on kernels
# already defined.

# %%
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import itertools
import time
from pathlib import Path

import torch
from IPython.display import Image

import stages
from stages.common.model_config import ModelConfig
from stages.common.weights import resolve_model

s03 = stages.load("03")
PLOTS = Path(stages.__file__).resolve().parent.parent / "plots"
print(s03.TECHNIQUE)

# %% [markdown]
# ## The block allocator
#
# `BlockAllocator` is a free list of block ids. `allocate` takes the first free block, `free`
# puts blocks back at the end. It knows nothing about tokens or requests.

# %%
allocator = s03.BlockAllocator(4)
taken = [allocator.allocate() for _ in range(3)]
print("taken", taken, "free", allocator.num_free)
allocator.free([taken[0]])
print("freed block", taken[0], "free", allocator.num_free)
print("next two:", allocator.allocate(), allocator.allocate())

# %% [markdown]
# Block 0 went back to the end of the list, so block 3 came out first. Blocks are
# interchangeable: which one a request gets does not matter. Two mistakes get a clear error:
# asking an empty pool for a block, and freeing a block that is not in use.

# %%
for bad in [allocator.allocate, lambda: allocator.free([taken[0], taken[0]])]:
    try:
        bad()
    except (s03.OutOfBlocksError, ValueError) as error:
        print(f"{type(error).__name__}: {error}")

# %% [markdown]
# ## Block tables and slot mappings
#
# `KVCacheManager` owns an allocator and one block table per request id. The scheduler asks
# it for room before a step: `allocate_slots(request_id, num_tokens)` makes the table cover
# positions `0 .. num_tokens - 1`, taking only the blocks that are missing.
#
# Position `p` lives in block `table[p // block_size]`, at offset `p % block_size`, so its flat
# index in the pool, its *slot*, is `block * block_size + offset`. `slot_mapping(table,
# start, end, block_size)` lists the slots of positions `start .. end - 1`: the model writes
# each new token's K and V there.
#
# We use a tiny pool: 6 blocks of 4 tokens. Request `a` has a 5-token prompt, and `b` arrives
# just after with 3 tokens.

# %%
slot_mapping = s03.kv_cache.slot_mapping
manager = s03.KVCacheManager(num_blocks=6, block_size=4)
for request_id, prompt_len in [("a", 5), ("b", 3)]:
    assert manager.allocate_slots(request_id, prompt_len)
    table = manager.block_ids(request_id)
    slots = slot_mapping(table, 0, prompt_len, manager.block_size)
    print(f"{request_id}: block table {table}, slots of its prompt {slots}")
print("free blocks", manager.num_free_blocks)

# %% [markdown]
# Five tokens need two blocks of four. `a` holds blocks 0 and 1, with three slots of block 1
# still empty. Now `a` decodes: one new position per step. A new block is taken only when a
# position crosses a block boundary, here at position 8. By then `b` holds block 2, so `a`'s
# table is no longer contiguous in the pool. Attention does not care: it follows the table.

# %%
for position in range(5, 10):
    assert manager.allocate_slots("a", position + 1)
    table = manager.block_ids("a")
    (slot,) = slot_mapping(table, position, position + 1, manager.block_size)
    block, offset = divmod(slot, manager.block_size)
    print(
        f"position {position}: block {block} offset {offset} -> slot {slot:2d}"
        f"   a's table {table}, free {manager.num_free_blocks}"
    )

# %% [markdown]
# When a request finishes, `free` returns all its blocks at once. The last partly filled
# block is the only waste a request ever causes: at most `block_size - 1` slots.

# %%
manager.free("a")
print("a's table", manager.block_ids("a"), "free blocks", manager.num_free_blocks)

# %% [markdown]
# A request asking for more blocks than are free gets `False`. The allocation is all or
# nothing: the request's table is left as it was, so the scheduler can wait or make room and
# try again.

# %%
print("room for 30 tokens?", manager.allocate_slots("big", 30))  # 8 blocks, 5 are free
print("big's table", manager.block_ids("big"), "free blocks", manager.num_free_blocks)

# %% [markdown]
# ## Attention through block tables
#
# One step's batch is flat: the new tokens of every sequence, end to end. Sequence `s` owns
# the query rows `query_start_loc[s] : query_start_loc[s + 1]` and has `seq_lens[s]` tokens in
# all: a cached context, then its new tokens. Query `i` sits at position `context + i` and
# attends to every position up to its own. A fresh prompt has no context; a decode has one
# new token. When attention runs, the K and V of every position, cached and new, are already
# in the pool.
#
# One function covers every case, like vLLM's unified attention. It has two implementations:
#
# - `unified_attention_reference`, in PyTorch: per sequence, gather K and V position by
#   position through the table, then ordinary attention with a causal mask. The definition.
# - `unified_attention_triton`: one program per (sequence, KV head, tile of queries). It walks
#   the positions a tile at a time, looks up each one's block in the table, and keeps a
#   running softmax. K and V are read once and never copied. The default on a GPU.
#
# We build a small random pool with SmolLM2's attention shape (9 query heads, 3 KV heads,
# head_dim 64) and shuffled block tables. The four sequences are a fresh 5-token prompt, a
# decode after 16 cached tokens, 4 new tokens after 17 cached ones, and a decode after 39.

# %%
gen = torch.Generator().manual_seed(0)
num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
context_lens = [0, 16, 17, 39]
query_lens = [5, 1, 4, 1]
lengths = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
width = max(-(-n // block_size) for n in lengths)  # blocks in the longest table
num_blocks = len(lengths) * width + 4  # a few spare blocks that no table uses

k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
shuffled = torch.randperm(num_blocks, generator=gen)
block_tables = shuffled[: len(lengths) * width].view(len(lengths), width).int()
query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
seq_lens = torch.tensor(lengths, dtype=torch.int32)
q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
scale = head_dim**-0.5
print("query_start_loc", query_start_loc.tolist(), " seq_lens", seq_lens.tolist())
print("block tables (entries past a sequence's end are ignored):")
print(block_tables)

# %%
args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
start = time.perf_counter()
reference = s03.unified_attention_reference(*args)
reference_ms = 1e3 * (time.perf_counter() - start)
start = time.perf_counter()
kernel = s03.unified_attention_triton(*args)
kernel_ms = 1e3 * (time.perf_counter() - start)
print(f"output {tuple(kernel.shape)}: one row per new token")
print(f"largest difference: {float((kernel - reference).abs().max()):.1e}")
print(f"reference {reference_ms:.1f} ms, Triton interpreted {kernel_ms:.0f} ms")
torch.testing.assert_close(kernel, reference, atol=1e-5, rtol=1e-5)

# %% [markdown]
# The two agree to float rounding. The interpreter is slow: it runs every program of the grid
# in Python. On a GPU the same kernel is compiled.
#
# The third sequence shows the rule. Its 4 queries sit at positions 17 to 20; each sees the
# 17 cached positions and the new ones up to itself (`#`), never a later one (`.`). A `|`
# marks a block boundary.

# %%
s, context, n = 2, context_lens[2], query_lens[2]
for i in range(n):
    row = "".join("#" if p <= context + i else "." for p in range(context + n))
    row = "|".join(row[b : b + block_size] for b in range(0, len(row), block_size))
    print(f"query at position {context + i}: {row}")

# %% [markdown]
# Now one query by hand: the first new token of that sequence, at position 17. Position `p` is
# read from block `table[p // block_size]` at offset `p % block_size`. Each KV head serves
# three query heads (grouped-query attention). We print where its five largest attention
# weights of head 0 come from.

# %%
row = int(query_start_loc[s])  # the query's row in the flat batch
positions = torch.arange(context + 1)  # what it may see: 0 .. 17
blocks = block_tables[s, positions // block_size].long()
k = k_cache[blocks, positions % block_size]  # [18, kv_heads, head_dim]
v = v_cache[blocks, positions % block_size]
group = num_heads // num_kv_heads
k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
weights = (torch.einsum("hd,thd->ht", q[row], k) * scale).softmax(dim=-1)  # [heads, 18]
by_hand = torch.einsum("ht,thd->hd", weights, v)
for w, p in zip(*weights[0].topk(5), strict=True):
    block = int(block_tables[s, p // block_size])
    print(f"position {int(p):2d} (block {block:2d}, offset {int(p) % block_size:2d}): {w:.3f}")
print("blocks read, in order:", blocks.unique_consecutive().tolist())
torch.testing.assert_close(by_hand, kernel[row], atol=1e-5, rtol=1e-5)
print("by hand == kernel")

# %% [markdown]
# The engine calls neither of these on a CPU. `paged_attention(..., backend="torch")` is the
# fast CPU path: it sorts the sequences into fresh prompts (attention over their own new
# tokens), decodes (one batched gather of whole blocks) and the rest. It also takes this
# step's new K and V, `k_new` and `v_new`, which a fresh prompt reads directly. Here they are
# the pool's entries at the new positions.

# %%
new_seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(query_lens))
new_pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, query_lens, strict=True)])
new_blocks = block_tables[new_seq, new_pos // block_size].long()
k_new = k_cache[new_blocks, new_pos % block_size]
v_new = v_cache[new_blocks, new_pos % block_size]
fast = s03.paged_attention(
    q, k_new, v_new, *args[1:],
    query_lens=tuple(query_lens), context_lens=tuple(context_lens), backend="torch",
)  # fmt: skip
torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)
print("paged_attention (torch) == reference")

# %% [markdown]
# ## The engine: one budget, two layouts
#
# The pool is sized from a memory budget, `kv_cache_bytes`, not from requests' maximum
# lengths. Without one, the engine takes a share of free memory (on a CPU, a tenth of the
# available RAM, at most 1 GiB). Here we give both engines the same budget: room for six
# requests of a 1024-token context, reserved whole. We read the model's shape from its
# checkpoint to work it out.

# %%
mc = ModelConfig.from_pretrained(resolve_model(None))
bytes_per_token = mc.kv_bytes_per_token(4)  # fp32 on a CPU
budget = 6 * 1024 * bytes_per_token  # six full-context reservations
print(f"KV per token: {bytes_per_token / 2**10:.0f} KiB")
print(f"our budget: 6 x 1024 tokens = {budget / 2**20:.0f} MiB")

# %% [markdown]
# `kv_layout="contiguous"` lays the pool out the way stage 01's caches would share memory:
# one block of `max_model_len` tokens per request. `kv_layout="paged"` (the default) cuts the
# same bytes into blocks of 16 tokens.

# %%
engines = {
    layout: s03.LLM(kv_layout=layout, max_model_len=1024, kv_cache_bytes=budget)
    for layout in ("contiguous", "paged")
}
for layout, engine in engines.items():
    blocks = engine.kv_manager.allocator.num_blocks
    print(f"{layout:10}  {blocks:3d} blocks of {engine.block_size:4d} tokens")

# %% [markdown]
# ## One step of the scheduler
#
# Twelve short chat requests go into each engine. This stage batches them *statically*: when
# nothing runs, the scheduler admits waiting requests in arrival order while the worst case of
# each (prompt plus `max_tokens`) fits in the free blocks, and runs that batch until its last
# member is done. So a batch can never run out of blocks.
#
# We call `schedule()` ourselves on the paged engine and print what it returns: for each
# request, its new tokens (the whole prompt), how many were cached before (none), and its
# block table.

# %%
topics = ["the sea", "a cat", "the moon", "bread", "rain", "a river"]
asks = ["Say one thing about", "Name a colour that goes with"]
chats = [[{"role": "user", "content": f"{ask} {t}."}] for ask in asks for t in topics]
params = s03.SamplingParams(temperature=0, max_tokens=16)

results = {}
for layout, engine in engines.items():
    results[layout] = [engine.make_request(None, params, messages=chat) for chat in chats]
    for request in results[layout]:
        engine.add_request(request)

paged = engines["paged"]
so = paged.scheduler.schedule()
for r in so.requests:
    new, cached = r.num_new_tokens, r.num_computed_tokens
    print(f"{r.request_id:6}  {new} new, {cached} cached, blocks {r.block_ids}")

# %% [markdown]
# The model runner packs all twelve prompts into one flat batch and describes it with the
# attention metadata: where each sequence's rows start, its length, its block table, and the
# slot of every new token.

# %%
meta = paged.runner.prepare_inputs(so).attn_metadata
print("query_start_loc", meta.query_start_loc.tolist())
print("seq_lens       ", meta.seq_lens.tolist())
print("block_tables   ", tuple(meta.block_tables.shape), "- the first two rows:")
print(meta.block_tables[:2])
print("slot_mapping    ", meta.slot_mapping[:4].tolist(), "...", meta.slot_mapping[-1].item())

# %% [markdown]
# Then the forward and the sampling, and the engine appends each request's first token. That
# is one `step()`. The contiguous engine takes its step in one call.

# %%
sampled = paged.runner.execute_model(so)
outputs = paged.update_from_output(so, sampled)
print(len(outputs), "requests got their first token")
outputs = engines["contiguous"].step()  # the same three calls
print(len(outputs), "requests got their first token in the contiguous engine")

# %% [markdown]
# Now we count the running requests and how full their allocated blocks are: the tokens in
# the cache over the slots of every block in use. (The newest token of each request enters
# the cache at the next step, so it is not counted yet.)

# %%
for layout, engine in engines.items():
    kv = engine.kv_manager
    cached = sum(r.num_computed_tokens for r in engine.running)
    in_use = kv.allocator.num_blocks - kv.num_free_blocks
    used = cached / (in_use * engine.block_size)
    print(
        f"{layout:10}  running {len(engine.running):2d}, waiting {len(engine.waiting):2d}, "
        f"{cached} tokens in {in_use:2d} blocks of {engine.block_size:4d}: {used:.0%} used"
    )

# %% [markdown]
# The contiguous layout has room for six requests; the other six wait for the whole first
# batch to finish. Each of its reservations holds a prompt of about 37 tokens in 1024 slots.
# The paged layout runs all twelve. It wastes only the end of each request's last block: 37
# tokens take three blocks, 48 slots.
#
# ## The block table, drawn
#
# Here is the paged pool, one character per block: the letter of the request that holds it
# (`A` is `req-0`, `B` is `req-1`, ...), `.` for a free block. The tables are consecutive only
# because the whole batch was allocated at once, in order. We decode a few steps and draw it
# again: prompts of 38 and 39 tokens fill their third block first and take a fourth, from
# wherever the free list points.


# %%
def draw_pool(engine, shown=64):
    owner = ["."] * engine.kv_manager.allocator.num_blocks
    for request in engine.running:
        letter = chr(ord("A") + int(request.request_id.removeprefix("req-")) % 26)
        for block in engine.kv_manager.block_ids(request.request_id):
            owner[block] = letter
    return "".join(owner[:shown])


print("after the prefill  ", draw_pool(paged))
for _ in range(12):
    paged.step()
print("after 12 decodes   ", draw_pool(paged))
for request in paged.running[6:9]:
    print(f"{request.request_id}: blocks {paged.kv_manager.block_ids(request.request_id)}")

# %% [markdown]
# We finish both runs and count the steps each took. The contiguous engine needs two batches,
# one after the other. Paging changes where K and V live, not what attention computes, so the
# answers are the same.

# %%
for layout, engine in engines.items():
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    print(f"{layout:10}  {steps:2d} more steps, {elapsed:.1f} s")
answers = {layout: [r.output().token_ids for r in rs] for layout, rs in results.items()}
assert answers["contiguous"] == answers["paged"]
print("same tokens in both layouts")
print(repr(results["paged"][0].output().text))

# %% [markdown]
# ## Measured
#
# `python -m stages 03 bench` runs 48 requests with longer prompts and answers through both
# layouts at one budget. It records, at every step, how many requests decode together and how
# much of the allocated KV memory holds tokens.

# %%
Image(filename=str(PLOTS / "03_paged.png"))

# %% [markdown]
# With the same memory, paging fits several times more requests in a batch (left) because it
# wastes almost none of it (middle). On a memory-bound decode, more requests per step means
# more tokens per second (right).

# %% [markdown]
# ## Exercises
#
# 1. Rerun the engine comparison with `max_tokens=None` (each answer may fill the rest of the
#    context). How many requests does the paged engine admit now, and why? What does stage 04
#    do differently?
# 2. Build the paged engine with `block_size` 1, 4, 16 and 256 at the same budget, and print
#    the utilisation after the first step. What does a small block cost that this number does
#    not show?
# 3. Time `unified_attention_reference` against `paged_attention(..., backend="torch")` for 32
#    decodes of 500 tokens each. Which is faster on your machine, and why?
