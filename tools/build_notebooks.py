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
        import socket
        import threading
        import time

        import httpx
        import openai
        import uvicorn

        import stages

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

        with socket.socket() as sock:  # let the OS pick a free port
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"

        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            assert thread.is_alive(), "the server failed to start"
            time.sleep(0.05)

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

        Setting `should_exit` makes uvicorn stop. Its shutdown hook stops the engine thread.
        """
    ),
    code(
        """
        health_client.close()
        server.should_exit = True
        thread.join(timeout=10)
        print("server thread alive:", thread.is_alive())
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


NOTEBOOKS: dict[str, list[Cell]] = {"01_naive": NAIVE, "02_streaming": STREAMING}


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
