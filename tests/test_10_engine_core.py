"""Stage 10: the engine core's loop, alone: messages in, one outputs message per step out.

`_busy_loop` runs in a thread over a pipe with an in-process engine (no process, no server):
the front end's `add` becomes the same tokens the engine gives offline, each step's message
carries the new tokens, finish reasons and queue counts, an `abort` stops a request, and a
closed pipe or a `shutdown` ends the loop.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from multiprocessing import Pipe
from types import ModuleType

from .conftest import since, unit

pytestmark = since("10")

BLOCK = 4


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _core(stage, engine):
    """The busy loop in a thread; returns (thread, the front end's end of the pipe)."""
    core = _module(stage, "frontend.engine_core")
    front, back = Pipe()

    def run() -> None:
        with contextlib.suppress(core._Shutdown):
            core._busy_loop(0, engine, back)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, front


def _collect(front, until_finished: set[str], seconds: float = 30.0):
    """Every outputs message until each request in `until_finished` has a finish reason."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    messages = []
    deadline = time.monotonic() + seconds
    while not until_finished <= set(finish):
        assert front.poll(max(0.0, deadline - time.monotonic())), "the core went quiet"
        kind, message = front.recv()
        assert kind == "outputs", kind
        messages.append(message)
        for out in message.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return tokens, finish, messages


@unit("frontend/engine_core.py")
def test_the_core_turns_adds_into_the_engines_tokens_step_by_step(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    params = stage.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK)
    messages = _module(stage, "frontend.core_messages")
    thread, front = _core(stage, engine)
    for i, prompt in enumerate(prompts):
        request = messages.EngineCoreRequest(f"r{i}", tuple(prompt), params, None, time.time())
        front.send(("add", request))
    tokens, finish, steps = _collect(front, {"r0", "r1"})
    assert [tokens["r0"], tokens["r1"]] == expected
    assert finish == {"r0": "length", "r1": "length"}
    assert all(len(m.outputs) <= 2 for m in steps)  # one message per step
    assert steps[-1].num_waiting == 0 and steps[-1].num_running == 0
    front.send(("shutdown", None))
    thread.join(timeout=10)
    assert not thread.is_alive()


@unit("frontend/engine_core.py")
def test_an_abort_stops_a_request_and_a_closed_pipe_ends_the_core(stage, tiny_model):
    engine = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK)
    messages = _module(stage, "frontend.core_messages")
    thread, front = _core(stage, engine)
    params = stage.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    front.send(("add", messages.EngineCoreRequest("long", (3, 4, 5), params, None, time.time())))
    assert front.poll(30.0)  # it is running
    front.send(("abort", ["long"]))
    deadline = time.monotonic() + 30
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the abort was not applied"
        time.sleep(0.01)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.allocator.num_blocks
    front.close()  # the front end is gone
    thread.join(timeout=10)
    assert not thread.is_alive(), "a core whose front end vanished kept running"
