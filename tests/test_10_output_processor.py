"""Stage 10: the front end detokenizes and cuts stop strings (OutputProcessor).

Fed a request's tokens one step at a time, as a core sends them, it gives the in-process
engine's text, cut, output kinds and finish reasons, and names the requests the core must drop.
No process: these grade the OutputProcessor alone (test_10_dp.py runs it behind real replicas).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from .conftest import since, unit

pytestmark = since("10")

BLOCK = 4
PROMPTS = ["The quick brown fox", "Once upon a time there", "A B C D E F G", "hello"]


def _module(stage: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{stage.__name__}.{name}")


def _core_outputs(stage, request_id: str, tokens: list[int], finish: str | None = "length"):
    message = _module(stage, "frontend.core_messages").EngineCoreOutput
    return [
        message(request_id, (t,), finish if i == len(tokens) - 1 else None, 0)
        for i, t in enumerate(tokens)
    ]


def _feed(stage, llm, prompt, params, kind: str, tokens: list[int]):
    """Feed a request's tokens to an OutputProcessor one step at a time, as a core would."""
    processor = _module(stage, "frontend.output_processor").OutputProcessor()
    request = llm.make_request(prompt, params, output_kind=kind)
    message = processor.add_request(request)
    assert message.params.stop == () and message.params.seed == request.seed
    outputs, aborts = [], []
    for core_output in _core_outputs(stage, request.request_id, tokens):
        processed = processor.process_outputs([core_output])
        outputs += processed.request_outputs
        aborts += processed.ids_to_abort
    assert not processor.has_unfinished()
    return request.request_id, outputs, aborts


@unit("frontend/output_processor.py")
def test_output_processor_cuts_stop_strings_as_the_engine_does(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    plain = stage.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], plain)[0]
    pieces = [llm.tokenizer.decode(full.token_ids[:n]) for n in range(len(full.token_ids) + 1)]
    boundary = len(pieces[5])
    stop = full.text[boundary - 2 : boundary + 2]  # spans the 5th/6th tokens' text
    assert len(stop) == 4, "the tiny model's text is too short to test a stop string"
    with_stop = stage.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    expected = llm.generate([PROMPTS[0]], with_stop)[0]
    assert expected.finish_reason == "stop"
    request_id, outputs, aborts = _feed(
        stage, llm, PROMPTS[0], with_stop, "cumulative", full.token_ids
    )
    last = outputs[-1]
    assert (last.text, last.token_ids, last.finish_reason) == (
        expected.text,
        expected.token_ids,
        "stop",
    )
    assert aborts == [request_id]  # the core never saw the stop string: it must drop it
    _, outputs, aborts = _feed(stage, llm, PROMPTS[0], plain, "cumulative", full.token_ids)
    assert outputs[-1].text == full.text and outputs[-1].finish_reason == "length"
    assert aborts == []  # the core finished it itself


@unit("frontend/output_processor.py")
def test_output_processor_deltas_add_up_to_the_cumulative_output(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    plain = stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate([PROMPTS[1]], plain)[0]
    params = stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["\n\n"])
    _, deltas, _ = _feed(stage, llm, PROMPTS[1], params, "delta", full.token_ids)
    _, cumulative, _ = _feed(stage, llm, PROMPTS[1], params, "cumulative", full.token_ids)
    _, final, _ = _feed(stage, llm, PROMPTS[1], params, "final", full.token_ids)
    assert len(final) == 1 and all(o.kind == "delta" for o in deltas)
    joined = [t for o in deltas for t in o.token_ids]
    assert joined == cumulative[-1].token_ids == final[0].token_ids
    assert "".join(o.text for o in deltas) == cumulative[-1].text == final[0].text
    assert cumulative[-1].token_ids == full.token_ids[: len(joined)]


@unit("frontend/output_processor.py")
def test_output_processor_abort_and_failure(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    processor = _module(stage, "frontend.output_processor").OutputProcessor()
    params = stage.SamplingParams(max_tokens=8, temperature=0)
    first, second = (llm.make_request(p, params) for p in PROMPTS[:2])
    processor.add_request(first)
    processor.add_request(second)
    with pytest.raises(ValueError, match="already running"):
        processor.add_request(first)
    assert processor.abort_request(first.request_id).finish_reason == "abort"
    assert processor.abort_request(first.request_id) is None
    failed = processor.fail_request(second.request_id, "engine replica 1 exited")
    assert failed.finish_reason == "error" and "replica 1" in failed.error
    late = _core_outputs(stage, second.request_id, [5, 6])
    assert processor.process_outputs(late).request_outputs == []  # dropped, not resurrected
