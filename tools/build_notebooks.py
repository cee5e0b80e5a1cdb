"""Write the walkthrough notebooks from the cell lists below, then run them and save the outputs.

    python tools/build_notebooks.py                 # write and execute every notebook
    python tools/build_notebooks.py 02              # only notebooks whose name starts with 02
    python tools/build_notebooks.py --no-execute    # write the cells, no outputs

The cells live here, as plain strings, so that a change to a notebook is a readable diff of this
file. Cell ids are fixed and timing metadata is not recorded, so a rebuild changes only what the
cells print. The kernel runs with the repository root as its working directory, as the test
suite's (tests/test_notebooks.py) does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from textwrap import dedent

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"

Cell = tuple[str, str]  # ("md" | "code", source)


def md(text: str) -> Cell:
    return ("md", dedent(text).strip())


def code(text: str) -> Cell:
    return ("code", dedent(text).strip())


# ------------------------------------------------------------------------------ 01_naive
NAIVE: list[Cell] = [
    md(
        """
        # Stage 01: the naive engine

        This is the smallest engine in the repository. It serves one request at a time, keeps
        one contiguous KV cache per request, and picks each next token greedily or by sampling.
        Every later stage answers something this one does slowly.

        We load the stage and look at the model. Then we run one prefill and a few decode steps
        by hand, and check that the engine produces the same tokens. We finish with sampling and
        with what the KV cache saves. The notebook runs in under a minute on a laptop CPU.
        """
    ),
    md(
        """
        Stage folders start with digits (`stages/01_naive`), which Python cannot import by
        name. `stages.load("01")` imports the folder for us and returns the package.
        """
    ),
    code(
        """
        import time
        from dataclasses import replace

        import torch

        import stages

        s01 = stages.load("01")
        print(s01.TECHNIQUE)
        """
    ),
    code(
        """
        llm = s01.LLM()  # the embedded SmolLM2-135M-Instruct
        print(f"{llm.model_name} on {llm.device} in {llm.dtype}")
        print(f"loaded in {llm.load_seconds:.1f} s")
        """
    ),
    md(
        """
        ## The model

        SmolLM2-135M is a Llama-family decoder. `llm.model_config` holds its shape, read from
        the checkpoint's `config.json`. Note the grouped-query attention: 9 query heads share 3
        key/value heads, so the KV cache is a third of what plain multi-head attention needs.
        """
    ),
    code(
        """
        mc = llm.model_config
        print(f"layers        {mc.num_layers}")
        print(f"hidden size   {mc.hidden_size}")
        print(f"query heads   {mc.num_heads}")
        print(f"kv heads      {mc.num_kv_heads}")
        print(f"head_dim      {mc.head_dim}")
        print(f"vocabulary    {mc.vocab_size}")
        print(f"context       {llm.max_model_len} tokens")
        """
    ),
    code(
        """
        num_params = sum(p.numel() for p in llm.model.parameters())
        bytes_per_value = torch.finfo(llm.dtype).bits // 8
        print(f"parameters    {num_params / 1e6:.1f} M")
        print(f"weights       {llm.weight_bytes() / 2**20:.0f} MiB")
        print(f"KV per token  {mc.kv_bytes_per_token(bytes_per_value) / 2**10:.0f} KiB")
        """
    ),
    md(
        """
        Each decode step produces one token and reads every weight once to do it. On a CPU,
        or a GPU serving one request, that read is most of the cost of a step.
        """
    ),
    md(
        """
        ## From a chat to token ids

        The model reads text, not messages. The chat template turns a conversation into the
        text the model was trained on, with its special markers. It ends with the assistant's
        header, so the model's next words are the answer. The tokenizer then turns the text
        into ids. `encode_chat` does both steps.
        """
    ),
    code(
        """
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        print(llm.tokenizer.apply_chat_template(messages))
        """
    ),
    code(
        """
        prompt_ids = llm.tokenizer.encode_chat(messages)
        print(len(prompt_ids), "tokens:", prompt_ids)
        pieces = [llm.tokenizer.decode([i], skip_special_tokens=False) for i in prompt_ids]
        print("the last 8 as text:", pieces[-8:])
        """
    ),
    md(
        """
        ## Prefill and decode, by hand

        This is the core of every engine in this repository.

        - **Prefill** runs the whole prompt through the model in one forward. Every layer
          computes K and V for every prompt token and stores them in the KV cache. Only the
          last position's logits matter: they predict the first output token.
        - **Decode** then runs the model on one token at a time, the newest one. Its attention
          reads the K and V of all earlier tokens from the cache instead of recomputing them.

        The model works on flat tensors: `input_ids` and `positions` are both `[num_tokens]`,
        with no batch dimension. `forward` returns hidden states `[num_tokens, hidden]`, and
        `compute_logits` applies the LM head.

        The stage-01 cache, `ContiguousKVCache`, is one buffer per request, reserved up front
        for the longest the request may grow: `[layers, capacity, kv_heads, head_dim]` for K,
        and the same for V.
        """
    ),
    code(
        """
        model = llm.model
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
        print(f"cache length before prefill: {cache.length}")
        """
    ),
    code(
        """
        with torch.inference_mode():
            ids = torch.tensor(prompt_ids, device=llm.device)
            positions = torch.arange(len(prompt_ids), device=llm.device)
            hidden = model(ids, positions, cache)  # the prefill
            first_logits = model.compute_logits(hidden[-1])

        token = int(first_logits.argmax())  # greedy: the most likely token
        print(f"hidden states {tuple(hidden.shape)}, last logits {tuple(first_logits.shape)}")
        print(f"cache length after prefill: {cache.length}")
        print(f"first token: {token} {llm.tokenizer.decode([token])!r}")
        """
    ),
    md(
        """
        Now decode. Each step feeds the token the previous step chose, at the next position.
        The cache grows by one token per step. We stop at an end-of-sequence token, as the
        engine does.
        """
    ),
    code(
        """
        eos = set(llm.tokenizer.eos_token_ids)
        by_hand = [token]
        with torch.inference_mode():
            while token not in eos and len(by_hand) < max_new:
                position = cache.length  # the prompt plus every token fed so far
                hidden = model(
                    torch.tensor([token], device=llm.device),
                    torch.tensor([position], device=llm.device),
                    cache,
                )
                token = int(model.compute_logits(hidden[-1]).argmax())
                by_hand.append(token)
                piece = llm.tokenizer.decode([token], skip_special_tokens=False)
                print(f"position {position}: token {token:5d} {piece!r:14} cache {cache.length}")

        print(repr(llm.tokenizer.decode(by_hand)))
        """
    ),
    md(
        """
        ## The engine does the same

        `llm.generate` runs exactly this loop (see `LLM.stream` in `engine.py`), plus
        tokenization, stop conditions and timestamps. `temperature=0` means greedy, so it must
        choose the same tokens we did.
        """
    ),
    code(
        """
        greedy = s01.SamplingParams(temperature=0, max_tokens=max_new)
        out = llm.generate(prompt_ids, greedy)[0]
        print(repr(out.text), out.finish_reason)
        print(out.token_ids)
        assert out.token_ids == by_hand
        decode_ms = 1e3 * sum(out.itl) / len(out.itl)
        print(f"time to first token {1e3 * out.ttft:.0f} ms, then {decode_ms:.0f} ms per token")
        """
    ),
    md(
        """
        `llm.chat(messages, greedy)` applies the chat template for us and gives the same answer.
        `finish_reason` is `"stop"`: the model produced its end-of-sequence token, which is
        counted in `token_ids` but not shown in `text`.
        """
    ),
    md(
        """
        ## Sampling

        Greedy decoding always takes the most likely token. Sampling draws from the
        distribution instead, after three filters, applied in this order as in vLLM:

        1. divide the logits by the **temperature** (below 1 sharpens, above 1 flattens);
        2. keep the **top-k** most likely tokens;
        3. keep the smallest set of tokens whose probability reaches **top-p**.

        Here is the distribution of the first answer token, from our prefill's logits, and how
        many candidates each filter leaves.
        """
    ),
    code(
        """
        probs = first_logits.float().softmax(dim=-1)
        top = probs.topk(5)
        for p, i in zip(top.values, top.indices, strict=True):
            print(f"{float(p):.3f}  {llm.tokenizer.decode([int(i)])!r}")
        print()
        for top_k, top_p in [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.9)]:
            kept = s01.sampling.apply_top_k_top_p(first_logits / 0.8, top_k, top_p)
            count = int(kept.isfinite().sum())
            print(f"temperature 0.8, top_k={top_k:2d}, top_p={top_p}: {count} candidates")
        """
    ),
    md(
        """
        Each request draws from its own random generator, seeded by `seed`. The same seed gives
        the same answer; another seed, another answer. (A request without a seed gets one from
        the engine's own generator, seeded by `EngineConfig.seed`.)
        """
    ),
    code(
        """
        haiku = [{"role": "user", "content": "Write a haiku about the sea."}]
        sampled = s01.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1, max_tokens=24)
        first, again = llm.chat([haiku, haiku], sampled)
        other = llm.chat(haiku, replace(sampled, seed=2))[0]
        print("seed 1:", repr(first.text))
        print("seed 1:", repr(again.text))
        print("seed 2:", repr(other.text))
        assert first.text == again.text
        """
    ),
    md(
        """
        A stop string ends the answer before its first occurrence. The string itself is not
        part of the text.
        """
    ),
    code(
        """
        stopped = llm.chat(messages, replace(greedy, stop=["Paris"]))[0]
        print(repr(stopped.text), stopped.finish_reason, f"after {len(stopped.token_ids)} tokens")
        """
    ),
    md(
        """
        ## What the KV cache saves

        `use_kv_cache=False` makes the engine recompute the whole sequence at every step, so
        output token n costs a forward over the prompt and n earlier tokens. It exists only for
        this comparison. We time 20 tokens each way; `ignore_eos=True` makes both produce
        exactly 20.
        """
    ),
    code(
        """
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
            per_step = 1e3 * sum(result.itl) / len(result.itl)
            print(f"{name:14} {per_token:4.0f} ms per token, {per_step:4.0f} ms per decode step")
        print("same tokens:", answers["with KV cache"] == answers["without"])
        """
    ),
    md(
        """
        With the cache, a decode step costs about the same at the 1st and the 20th token: it
        reads the weights once, plus a little cache. Without it, each step does a prefill of
        the whole sequence so far, and the gap grows with the length of the prompt and the
        answer. The prefill itself (the time to first token) costs the same either way.
        """
    ),
    md(
        """
        ## Exercises

        1. Make the by-hand loop sample instead of taking the argmax. Use
           `s01.sampling.sample_next_token` with a generator from
           `s01.sampling.make_generator(seed, llm.device)`, and check that you get the same
           tokens as `llm.generate` with the same `SamplingParams` and seed.
        2. Rerun the timing with `max_tokens=100`. How does the time per token of each engine
           change, and why?
        3. A request with `max_tokens=None` may fill the whole context. How many bytes does
           its `ContiguousKVCache` reserve (`llm.max_model_len` tokens), and how many such
           requests fit in 8 GiB? How much of that does a 40-token answer use? Stage 03 starts
           from this waste.
        """
    ),
]


# ------------------------------------------------------------------------------ 02_streaming
STREAMING: list[Cell] = [
    md(
        """
        # Stage 02: streaming

        In stage 01 the HTTP handler ran the model itself, on the event loop. While it
        computed, the server could do nothing else, not even answer `/health`. And the client
        saw no text until the whole answer was done.

        Stage 02 changes only the serving side. The engine runs on its own thread, behind
        `AsyncLLM`, and the event loop only does I/O. Each new token goes back to its handler
        and out to the client as a server-sent event (SSE). Requests still run one at a time.

        We start a real server inside this notebook and talk to it over HTTP: a raw stream, the
        official OpenAI client, `/health` during a long generation, and a client that leaves
        early.
        """
    ),
    code(
        """
        import json
        import time

        import httpx
        import openai

        import stages
        from stages.common.server_process import ThreadedServer

        s02 = stages.load("02")
        print(s02.TECHNIQUE)
        """
    ),
    md(
        """
        ## A server in the notebook

        `create_app` builds the FastAPI app and starts the engine thread. `app.state.engine` is
        the `AsyncLLM`: a queue of requests and the one worker thread that runs them. We run
        uvicorn on a background thread, on a free local port, so that the notebook can be the
        client.
        """
    ),
    code(
        """
        app = s02.create_app(s02.LLM())
        engine = app.state.engine

        server = ThreadedServer(app).start()  # uvicorn on a free port, on a background thread
        url = server.url

        health_client = httpx.Client(base_url=url, timeout=5)  # one connection, kept open
        print(url, health_client.get("/health").json())
        """
    ),
    md(
        """
        ## Streaming `/generate`

        With `"stream": true` the response is a `text/event-stream`. Each event is a line
        `data: <json>` followed by a blank line, and the stream ends with `data: [DONE]`. There
        is one event per token, carrying the new text and token ids. We print the first three
        events exactly as they arrive, then only each event's new text and when it arrived.
        """
    ),
    code(
        """
        body = {
            "messages": [{"role": "user", "content": "Name three colors of the rainbow."}],
            "max_tokens": 30,
            "temperature": 0,
            "stream": True,
        }
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
        """
    ),
    md(
        """
        The first token waits for the prefill; the others follow one decode step apart. The
        last event carries the end-of-sequence token: no text, and the finish reason. A
        stage-01 client would have seen nothing until then.
        """
    ),
    md(
        """
        ## The official OpenAI client

        The server also speaks the OpenAI API, so the `openai` package works unchanged. A
        streaming chat completion arrives as chunks, each with a `delta` holding the new text.
        The first chunk carries only the role, the last only the finish reason. We print a `|`
        after each chunk to show where they break.
        """
    ),
    code(
        """
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
                print(f"\\nfinish_reason: {choice.finish_reason}")
        """
    ),
    md(
        """
        ## The server stays responsive

        Now a long request: 500 tokens, more than half a minute of work on a CPU. We start it,
        wait for its first event, then ask `/health`. In stage 01 that call would wait for the
        whole generation. Here the event loop is free, so it answers at once, and
        `pending_requests` counts the request still running. (`health_client` keeps its
        connection open, so the time we measure is the server's, not a new connection's.)
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## A client that leaves aborts its request

        Leaving the `with` block above closed the connection with hundreds of tokens to go.
        Starlette sees the disconnect and cancels the response generator. `AsyncLLM.generate`
        then asks the engine thread to abort the request, and the engine stops it at its next
        token. Without this, the engine would spend half a minute on an answer nobody reads.

        Let us watch it happen once more, with the counters of `AsyncLLM`.
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        ## Shutting down

        `server.stop()` tells uvicorn to exit. The app's shutdown hook stops the engine thread.
        """
    ),
    code(
        """
        health_client.close()
        server.stop()
        print("server thread alive:", server.thread.is_alive())
        """
    ),
    md(
        """
        ## Exercises

        1. Repeat the `/health` experiment against stage 01. Its server cannot stream, so send
           the long request without `"stream"` from a background thread, then time `/health`.
           How long does it wait?
        2. Start two streaming requests at once, from two threads, and record when each one's
           tokens arrive. What does the second client see while the first runs? Batching, from
           stage 03 on, changes this.
        3. Send the long request without streaming, with
           `httpx.post(..., timeout=httpx.Timeout(30, read=1.0))`, so the client gives up after
           a second. Check that `num_aborted` still goes up, and find in `server.py` how the
           server notices a client that is gone when it has nothing to send.
        """
    ),
]


# ------------------------------------------------------------------------------ 03_paged
PAGED: list[Cell] = [
    md(
        """
        # Stage 03: paged attention

        Stage 01 gave each request its own contiguous KV buffer, sized for the longest the
        request might grow. To decode many requests together, their caches must share memory,
        and those reservations waste most of it.

        Stage 03 cuts the KV memory into one pool of fixed-size blocks that every request
        shares. A request gets a new block only when its last one is full. A per-request
        *block table* records where its blocks are, and attention reads K and V through it.

        We drive the block allocator and the cache manager by hand first. Then we check the
        Triton paged-attention kernel against the PyTorch reference. We finish with the engine:
        the same memory budget, laid out contiguously and in blocks, and how many requests each
        runs at once.
        """
    ),
    md(
        """
        Triton compiles kernels for a GPU. With `TRITON_INTERPRET=1` it runs them instead in a
        Python interpreter, on the CPU, slowly but exactly. Triton reads the variable when
        `@triton.jit` wraps a kernel, and that happens when the stage is imported. So we set
        it in the first cell, before anything imports triton. Setting it later has no effect on
        kernels already defined.
        """
    ),
    code(
        """
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

        import time

        import torch

        import stages

        s03 = stages.load("03")
        print(s03.TECHNIQUE)
        """
    ),
    md(
        """
        ## The block allocator

        `BlockAllocator` is a free list of block ids. `allocate` takes the first free block,
        `free` puts blocks back at the end. It knows nothing about tokens or requests.
        """
    ),
    code(
        """
        allocator = s03.BlockAllocator(4)
        taken = [allocator.allocate() for _ in range(3)]
        print("taken", taken, "free", allocator.num_free)
        allocator.free([taken[0]])
        print("freed block", taken[0], "free", allocator.num_free)
        print("next two:", allocator.allocate(), allocator.allocate())
        """
    ),
    md(
        """
        Block 0 went back to the end of the list, so block 3 came out first. Blocks are
        interchangeable: which one a request gets does not matter. Two mistakes get a clear
        error: asking an empty pool for a block, and freeing a block that is not in use.
        """
    ),
    code(
        """
        for bad in [allocator.allocate, lambda: allocator.free([taken[0], taken[0]])]:
            try:
                bad()
            except (s03.OutOfBlocksError, ValueError) as error:
                print(f"{type(error).__name__}: {error}")
        """
    ),
    md(
        """
        ## Block tables and slot mappings

        `KVCacheManager` owns an allocator and grows each request's block table as its tokens
        arrive. The only thing it touches on a request is `block_ids`, its block table, so any
        object with that list will do.

        `allocate_slots(request, start, count)` makes room for positions `start` to
        `start + count - 1` and returns their *slot mapping*: the flat index of each position
        in the pool. Position `p` lives in block `block_ids[p // block_size]`, at offset
        `p % block_size`, so its slot is `block * block_size + offset`. The model writes each
        new token's K and V at its slot.

        We use a tiny pool: 6 blocks of 4 tokens. Request `a` has a 5-token prompt, and `b`
        arrives just after with 3 tokens.
        """
    ),
    code(
        """
        class FakeRequest:
            def __init__(self, name):
                self.name = name
                self.block_ids = []  # the block table


        manager = s03.KVCacheManager(num_blocks=6, block_size=4)
        a, b = FakeRequest("a"), FakeRequest("b")
        print("a's slots", manager.allocate_slots(a, start=0, count=5))
        print("b's slots", manager.allocate_slots(b, start=0, count=3))
        for request in (a, b):
            print(f"{request.name}: block table {request.block_ids}")
        print("free blocks", manager.num_free_blocks)
        """
    ),
    md(
        """
        Five tokens need two blocks of four. `a` holds blocks 0 and 1, with three slots of
        block 1 still empty. Now `a` decodes: one new position per step. A new block is taken
        only when a position crosses a block boundary, here at position 8. By then `b` holds
        block 2, so `a`'s table is no longer contiguous in the pool. Attention does not care:
        it follows the table.
        """
    ),
    code(
        """
        for position in range(5, 10):
            (slot,) = manager.allocate_slots(a, start=position, count=1)
            block, offset = divmod(slot, manager.block_size)
            print(
                f"position {position}: block {block} offset {offset} -> slot {slot:2d}"
                f"   a's table {a.block_ids}, free {manager.num_free_blocks}"
            )
        """
    ),
    md(
        """
        When a request finishes, `free` returns all its blocks at once. The last partly filled
        block is the only waste a request ever causes: at most `block_size - 1` slots.
        """
    ),
    code(
        """
        manager.free(a)
        print("a's table", a.block_ids, "free blocks", manager.num_free_blocks)
        """
    ),
    md(
        """
        A request asking for more blocks than are free gets `OutOfBlocksError`. The allocation
        is all or nothing: the request's table is left as it was, so the caller can wait or
        preempt and try again.
        """
    ),
    code(
        """
        big = FakeRequest("big")
        try:
            manager.allocate_slots(big, start=0, count=30)  # 8 blocks, 5 are free
        except s03.OutOfBlocksError as error:
            print(f"OutOfBlocksError: {error}")
        print("big's table", big.block_ids, "free blocks", manager.num_free_blocks)
        """
    ),
    md(
        """
        ## The paged-attention kernel

        At decode, each sequence has one new query token, and its keys and values are spread
        over blocks of the pool. `paged_attention(q, k_cache, v_cache, block_tables,
        context_lens, scale)` has two implementations:

        - `paged_attention_reference`, in PyTorch: gather each sequence's blocks into one
          padded tensor, then ordinary attention with a length mask. The fast path on a CPU.
        - `paged_attention_triton`: one program per (sequence, kv head). It walks the context
          a tile at a time, looks up each position's block in the table, and keeps a running
          softmax. K and V are read once and never copied. The default on a GPU.

        We build a small random pool with SmolLM2's attention shape (9 query heads, 3 KV heads,
        head_dim 64) and shuffled block tables. The lengths sit below, at and across block
        boundaries.
        """
    ),
    code(
        """
        gen = torch.Generator().manual_seed(0)
        num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
        lengths = [5, 16, 17, 40]
        width = max(-(-n // block_size) for n in lengths)  # blocks in the longest table
        num_blocks = len(lengths) * width + 4  # a few spare blocks that no table uses

        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        shuffled = torch.randperm(num_blocks, generator=gen)
        block_tables = shuffled[: len(lengths) * width].view(len(lengths), width).int()
        context_lens = torch.tensor(lengths, dtype=torch.int32)
        q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
        scale = head_dim**-0.5
        print("block tables (unused entries are ignored):")
        print(block_tables)
        """
    ),
    code(
        """
        args = (q, k_cache, v_cache, block_tables, context_lens, scale)
        start = time.perf_counter()
        reference = s03.paged_attention_reference(*args)
        reference_ms = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        kernel = s03.paged_attention_triton(*args)
        kernel_ms = 1e3 * (time.perf_counter() - start)
        print(f"output {tuple(kernel.shape)}")
        print(f"largest difference: {float((kernel - reference).abs().max()):.1e}")
        print(f"reference {reference_ms:.1f} ms, Triton interpreted {kernel_ms:.0f} ms")
        torch.testing.assert_close(kernel, reference, atol=1e-5, rtol=1e-5)
        """
    ),
    md(
        """
        The two agree to float rounding. The interpreter is slow: it runs every program of the
        grid in Python. On a GPU the same kernel is compiled.

        To see what the table means, we redo the last sequence by hand. Position `p` is read
        from block `table[p // block_size]` at offset `p % block_size`. Each KV head serves
        three query heads (grouped-query attention).
        """
    ),
    code(
        """
        i = len(lengths) - 1
        positions = torch.arange(lengths[i])
        blocks = block_tables[i, positions // block_size].long()
        k = k_cache[blocks, positions % block_size]  # [length, kv_heads, head_dim]
        v = v_cache[blocks, positions % block_size]
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i], k) * scale
        by_hand = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
        print(f"sequence {i}: {lengths[i]} tokens in blocks {blocks.unique_consecutive().tolist()}")
        torch.testing.assert_close(by_hand, kernel[i], atol=1e-5, rtol=1e-5)
        print("by hand == kernel")
        """
    ),
    md(
        """
        ## The engine: one budget, two layouts

        The pool is sized from a memory budget, `kv_cache_bytes`, not from requests' maximum
        lengths. Without one, the engine takes a share of free memory (on a CPU, a tenth of
        the available RAM, at most 1 GiB). We load the engine once with that default, to see
        the pool and to read how many bytes a token's K and V take.
        """
    ),
    code(
        """
        llm = s03.LLM(max_model_len=1024)
        mc = llm.model_config
        bytes_per_token = mc.kv_bytes_per_token(torch.finfo(llm.dtype).bits // 8)
        pool = llm.kv_manager.allocator
        print(f"default pool: {llm.kv_cache.total_bytes / 2**20:.0f} MiB")
        print(f"  {pool.num_blocks} blocks of {llm.block_size} tokens")
        print(f"KV per token: {bytes_per_token / 2**10:.0f} KiB")
        budget = 6 * llm.max_model_len * bytes_per_token  # six full-context reservations
        print(f"our budget: 6 x {llm.max_model_len} tokens = {budget / 2**20:.0f} MiB")
        del llm
        """
    ),
    md(
        """
        `kv_layout="contiguous"` lays the pool out the way stage 01's caches would share
        memory: one block of `max_model_len` tokens per request. `kv_layout="paged"` (the
        default) cuts the same bytes into blocks of 16 tokens.
        """
    ),
    code(
        """
        engines = {
            layout: s03.LLM(kv_layout=layout, max_model_len=1024, kv_cache_bytes=budget)
            for layout in ("contiguous", "paged")
        }
        for layout, engine in engines.items():
            blocks = engine.kv_manager.allocator.num_blocks
            print(f"{layout:10}  {blocks:3d} blocks of {engine.block_size:4d} tokens")
        """
    ),
    md(
        """
        Now twelve short chat requests. We add them all, then call `step()` once. A step runs
        one forward. The first one admits a batch and prefills every prompt in it. Then we
        count the running requests and how full their allocated blocks are: the tokens in the
        cache over the slots of every block in use. (The newest token of each request enters
        the cache at the next step, so it is not counted yet.)

        Admission in this stage counts each request's worst case, prompt plus `max_tokens`, so
        a batch can never run out of blocks. Our answers are short, so the worst case is small.
        """
    ),
    code(
        """
        topics = ["the sea", "a cat", "the moon", "bread", "rain", "a river"]
        asks = ["Say one thing about", "Name a colour that goes with"]
        chats = [[{"role": "user", "content": f"{ask} {t}."}] for ask in asks for t in topics]
        params = s03.SamplingParams(temperature=0, max_tokens=10)

        results = {}
        for layout, engine in engines.items():
            requests = [engine.make_request(None, params, messages=chat) for chat in chats]
            for request in requests:
                engine.add_request(request)
            engine.step()  # admit a batch and prefill it
            kv = engine.kv_manager
            cached = sum(r.num_tokens - 1 for r in engine.running)
            in_use = kv.allocator.num_blocks - kv.num_free_blocks
            used = cached / (in_use * engine.block_size)
            print(
                f"{layout:10}  running {len(engine.running):2d}, waiting {len(engine.waiting):2d}, "
                f"{cached} tokens in {in_use:2d} blocks of {engine.block_size:4d}: {used:.0%} used"
            )
            results[layout] = requests
        """
    ),
    md(
        """
        The contiguous layout has room for six requests; the other six wait for the whole first
        batch to finish. Each of its reservations holds a prompt of about 37 tokens in 1024
        slots. The paged layout runs all twelve. It wastes only the end of each request's last
        block: 37 tokens take three blocks, 48 slots.

        Here are the first few block tables of the paged engine. They are consecutive only
        because the whole batch was allocated at once, in order; nothing requires it.
        """
    ),
    code(
        """
        for request in engines["paged"].running[:4]:
            cached = request.num_tokens - 1
            print(f"{request.request_id}: {cached} tokens, blocks {request.block_ids}")
        """
    ),
    md(
        """
        We finish both runs and count the steps each took. The contiguous engine needs two
        batches, one after the other. Paging changes where K and V live, not what attention
        computes, so the answers are the same.
        """
    ),
    code(
        """
        for layout, engine in engines.items():
            steps, start = 1, time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            elapsed = time.perf_counter() - start
            print(f"{layout:10}  {steps:2d} steps, the rest took {elapsed:.1f} s")
        answers = {layout: [r.output().token_ids for r in rs] for layout, rs in results.items()}
        assert answers["contiguous"] == answers["paged"]
        print("same tokens in both layouts")
        print(repr(results["paged"][0].output().text))
        """
    ),
    md(
        """
        ## Measured

        `python -m stages 03 bench` runs 48 requests with longer prompts and answers through
        both layouts at one budget. It records, at every step, how many requests decode
        together and how much of the allocated KV memory holds tokens.

        ![](../plots/03_paged.png)

        With the same memory, paging fits several times more requests in a batch, and on a
        memory-bound decode more requests per step means more tokens per second.
        """
    ),
    md(
        """
        ## Exercises

        1. Rerun the engine comparison with `max_tokens=None` (each answer may fill the rest
           of the context). How many requests does the paged engine admit now, and why? What
           does stage 04 do differently?
        2. Build the paged engine with `block_size` 1, 4, 16 and 256 at the same budget, and
           print the utilisation after the first step. What does a small block cost that this
           number does not show?
        3. Time `paged_attention_reference` against a loop over sequences that gathers each
           one's blocks by hand, as we did for one sequence above, for 32 sequences of 500
           tokens. Which is faster on your machine, and why?
        """
    ),
]


# ------------------------------------------------------------------------------ 04_batching
BATCHING: list[Cell] = [
    md(
        """
        # Stage 04: continuous batching

        Stage 03 ran requests in static batches: admit a batch, prefill it, decode it until its
        last member finishes, and only then admit the next. A request that finishes early
        leaves an empty seat. A request that arrives meanwhile waits for the whole batch.

        Stage 04 adds a scheduler that decides again at every step who runs. Finished requests
        leave at once, waiting requests join the next step, and prefills and decodes share one
        forward. When the block pool runs out, the newest request is preempted: its blocks are
        freed and it is recomputed later.

        We watch the scheduler step by step, against static batching on the same requests.
        Then we force preemptions with a tiny pool and check they change no output. We finish
        with eight HTTP clients streaming at once from one server.
        """
    ),
    code(
        """
        import time
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        import stages
        from stages.common.server_process import ThreadedServer

        s04 = stages.load("04")
        print(s04.TECHNIQUE)
        """
    ),
    md(
        """
        ## The scheduler, step by step

        An engine with four seats (`max_num_seqs=4`) and six requests. Each answer has a fixed
        length: `ignore_eos=True` makes a request run to its `max_tokens`. We name the requests
        `r0` to `r5`.
        """
    ),
    code(
        """
        llm = s04.LLM(max_num_seqs=4)
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
        """
    ),
    md(
        """
        `trace` adds the requests and calls `step()` until none is left. After each step it
        prints who ran. A request that was not running before the step and got a token was
        prefilled in it. A running request that got no token was preempted. `engine.running`
        and `engine.waiting` are the scheduler's two queues.
        """
    ),
    code(
        """
        def names(items):
            return " ".join(items) or "-"


        def trace(engine, requests, quiet=False):
            for request in requests:
                engine.add_request(request)
            steps, start = 0, time.perf_counter()
            while engine.has_unfinished():
                before = [r.request_id for r in engine.running]
                outputs = engine.step()
                steps += 1
                ran = [o.request_id for o in outputs]
                prefill = [i for i in ran if i not in before]
                decode = [i for i in ran if i in before]
                preempted = [i for i in before if i not in ran]
                done = [o.request_id for o in outputs if o.finished]
                if quiet and not (prefill or preempted):
                    continue  # a step of plain decodes
                waiting = [r.request_id for r in engine.waiting]
                line = f"step {steps:2d}  prefill {names(prefill):11}  decode {names(decode):11}"
                line += f"  done {names(done):5}  waiting {names(waiting)}"
                if preempted:
                    line += f"  preempted {names(preempted)}"
                print(line)
            print(f"{steps} steps, {time.perf_counter() - start:.1f} s")
            return [r.output().token_ids for r in requests]


        continuous = trace(llm, make_requests(llm))
        """
    ),
    md(
        """
        Read it from the top. Four requests prefill together in step 1; `r4` and `r5` wait.
        `r0` is done after three tokens, and in the very next step `r4` takes its seat: its
        prompt is prefilled in the same forward as the three decodes. The seats stay full
        while anyone is waiting. The batch shrinks only at the end, when nobody is left to
        join.

        Now the same requests with `scheduling="static"`, stage 03's policy run by this
        engine.
        """
    ),
    code(
        """
        static_llm = s04.LLM(max_num_seqs=4, scheduling="static")
        static = trace(static_llm, make_requests(static_llm))
        assert static == continuous
        print("same tokens either way")
        """
    ),
    md(
        """
        The first batch runs until `r1`, its longest member, has all twelve tokens. Seats empty
        one by one as the others finish, and `r4` and `r5` wait for all of it. The same tokens
        cost more steps. Each step reads all the weights once, so fewer, fuller steps are
        faster.

        The scheduler decides only who runs and when. Each request's tokens are the same under
        both policies.
        """
    ),
    md(
        """
        ## Preemption

        Continuous batching hands out blocks as tokens arrive, not against a worst case. More
        requests fit, but running requests can now grow until the pool is empty. Then the
        scheduler *preempts* the newest running request: it frees its blocks, keeps its tokens,
        and puts it at the front of the waiting queue. When it is readmitted, its prompt and
        its output so far are prefilled again (recompute).

        We force this with a pool of 24 blocks of 4 tokens, 96 tokens in all.
        `PagedKVCache.bytes_per_block` gives the size of one block. Each chat prompt is about
        37 tokens, 10 blocks, so two requests fill most of the pool. This time every answer
        is 16 tokens long.
        """
    ),
    code(
        """
        mc = llm.model_config
        per_block = s04.PagedKVCache.bytes_per_block(
            mc.num_layers, 4, mc.num_kv_heads, mc.head_dim, llm.dtype
        )
        tight = s04.LLM(block_size=4, kv_cache_bytes=24 * per_block)
        pool = tight.kv_manager.allocator
        print(f"{pool.num_blocks} blocks of {tight.block_size} tokens, {per_block} bytes each")
        print("prompt lengths:", [len(r.prompt_token_ids) for r in make_requests(tight)])
        """
    ),
    md(
        """
        We print only the steps where a request is prefilled or preempted; the steps between
        are plain decodes.
        """
    ),
    code(
        """
        tight_requests = make_requests(tight, lengths=[16] * 6)
        tight_out = trace(tight, tight_requests, quiet=True)
        print("preemptions:", tight.scheduler.num_preemptions)
        print("per request:", {r.request_id: r.num_preemptions for r in tight_requests})
        assert tight.scheduler.num_preemptions > 0

        roomy_out = [o.token_ids for o in llm.run_all(make_requests(llm, lengths=[16] * 6))]
        assert tight_out == roomy_out
        print("same tokens as the roomy engine")
        print("free blocks:", tight.kv_manager.num_free_blocks, "of", pool.num_blocks)
        """
    ),
    md(
        """
        In step 13 both running requests need a new block and none is free. `r1`, the newer,
        is preempted, and `r0` takes one of the blocks it gave back. `r1` then needs 13 blocks
        for its prompt and the 12 tokens it had produced, more than are free, so it waits until
        `r0` is done. In step 17 it is prefilled again, all 49 tokens, and goes on from there.

        A preempted request loses its K and V, never its tokens or its place: it waits at the
        front of the queue and comes back with a longer prefill. Recomputing costs a forward
        over tokens we had already processed, but it needs no extra memory. Stage 12 swaps
        blocks to host memory instead.
        """
    ),
    md(
        """
        ## Many clients, one batch

        The server and `AsyncLLM` are the same as in stages 02 and 03. The worker thread moves
        new requests into the engine before every step, so a request that arrives while others
        run joins them at the next step.

        We start the server as notebook 02 does, then eight clients, each on its own thread,
        each streaming a `/generate` request of a different length. Each client records when
        it sent its request, when the first token arrived and when the last one did.
        """
    ),
    code(
        """
        app = s04.create_app(s04.LLM())
        server = ThreadedServer(app).start()
        url = server.url
        print(url, httpx.get(url + "/health").json())
        """
    ),
    code(
        """
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
        """
    ),
    md(
        """
        Each row is one client: `.` while it waits for its first token, `#` while tokens
        stream. The two numbers are the time to the first token and to the last, from the start
        of the run. The requests reach the engine a few milliseconds apart. The first to arrive
        is prefilled at once; those that arrive during that step join at the next one, with
        one prefill of all their prompts. From then on all eight decode in the same steps, so
        every client got its first token before any finished. The short answers end first and
        leave the batch; the long ones go on without them. In stage 02 the eighth client would
        have waited for the seven before it.
        """
    ),
    code(
        """
        server.stop()
        print("server thread alive:", server.thread.is_alive())
        """
    ),
    md(
        """
        ## Measured

        `python -m stages 04 bench` runs 64 requests three ways: one at a time, in static
        batches and with continuous batching, all with up to 16 requests per batch.

        ![](../plots/04_batching.png)

        Continuous batching keeps the batch full (right), so the same requests finish sooner
        (middle) and more tokens come out per second (left).
        """
    ),
    md(
        """
        ## Exercises

        1. In the trace, give `r0` a 40-token answer and run both policies again. How many
           steps does each take now, and how long does `r4` wait for its first token?
        2. Shrink the tight pool to the smallest that `make_request` still accepts for these
           requests (`check_fits`). How many preemptions happen now? Wrap
           `tight.scheduler.schedule` to add up `sum(r.num_tokens for r in batch.prefills)`
           over all steps, and compare with the prompts' total length: the difference is what
           recompute cost.
        3. Run the eight clients against stage 02's server (`stages.load("02")`) and compare
           the times to first token. Then against stage 04 with `max_num_seqs=2`. What
           changes, and what does not?
        """
    ),
]


NOTEBOOKS: dict[str, list[Cell]] = {
    "01_naive": NAIVE,
    "02_streaming": STREAMING,
    "03_paged": PAGED,
    "04_batching": BATCHING,
}


def build(name: str, cells: list[Cell]) -> nbformat.NotebookNode:
    """A notebook with stable cell ids (`<name>-NN`), so rebuilds diff cleanly."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for index, (kind, source) in enumerate(cells):
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(source, id=f"{name.replace('_', '-')}-{index:02d}"))
    nbformat.validate(nb)
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    """Run every cell in a fresh kernel whose working directory is the repository root."""
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
        record_timing=False,
        coalesce_streams=True,
    ).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="build only notebooks starting with these")
    parser.add_argument("--no-execute", action="store_true", help="write cells without outputs")
    args = parser.parse_args(argv)
    NOTEBOOK_DIR.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        nb = build(name, cells)
        if not args.no_execute:
            started = time.perf_counter()
            execute(nb)
            print(f"{name}: executed in {time.perf_counter() - started:.1f} s", flush=True)
        path = NOTEBOOK_DIR / f"{name}.ipynb"
        nbformat.write(nb, path)
        print(f"wrote {path.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
