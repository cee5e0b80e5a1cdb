"""Stage 01 promises: the offline API validates input and reports honest timings."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from .conftest import since, unit

pytestmark = since("01")


def test_generate_returns_outputs_in_prompt_order(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    params = stage.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate(["alpha", "beta gamma", "delta"], params)
    assert [o.prompt for o in outs] == ["alpha", "beta gamma", "delta"]
    solo = llm.generate("beta gamma", params)[0]
    assert outs[1].token_ids == solo.token_ids


def test_timings_are_consistent(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    out = llm.generate("hi", stage.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_times) == len(out.token_ids) == 6
    assert out.arrival_time <= out.first_token_time <= out.finish_time
    assert out.ttft >= 0 and all(gap >= 0 for gap in out.itl) and len(out.itl) == 5
    assert out.e2e_latency >= out.ttft


def test_token_id_prompts(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    ids = llm.tokenizer.encode("hello")
    params = stage.SamplingParams(max_tokens=5, temperature=0)
    assert llm.generate([ids], params)[0].token_ids == llm.generate("hello", params)[0].token_ids
    assert llm.generate(ids, params)[0].prompt_token_ids == ids
    numpy_ids = [np.int64(i) for i in ids]  # e.g. from a numpy array
    assert llm.generate(numpy_ids, params)[0].prompt_token_ids == ids


@pytest.mark.parametrize(
    "prompt, kwargs",
    [
        ("", {}),
        ("x" * 600, {}),  # the tiny models' context is 512 tokens (one byte per token)
        ("hello", {"max_tokens": 510}),
        ([10_000], {}),  # outside the vocabulary
        ([], {}),
    ],
    ids=["empty", "too-long", "max-tokens-past-context", "bad-token-id", "no-prompts"],
)
def test_bad_input_raises_value_error(stage, tiny_model, make_llm, prompt, kwargs):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    with pytest.raises(ValueError):
        llm.generate(prompt, stage.SamplingParams(**kwargs))


def test_unknown_model_is_a_value_error(stage):
    with pytest.raises(ValueError, match="unknown model"):
        stage.LLM("no-such-model-anywhere")


def test_max_tokens_none_fills_the_context(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), max_model_len=40)
    ids = llm.tokenizer.encode("hello")
    out = llm.generate(
        [ids], stage.SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    )[0]
    assert len(ids) + len(out.token_ids) == 40


def _assert_plain(value, path="output"):
    """Only immutable plain values: what a pickle to another process carries faithfully and
    what cannot alias the engine's live state (no tensors, generators, Requests or lists)."""
    if value is None or isinstance(value, bool | int | float | str):
        return
    if isinstance(value, tuple | frozenset):
        for i, item in enumerate(value):
            _assert_plain(item, f"{path}[{i}]")
        return
    assert dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen, (
        f"{path} is a {type(value).__name__}, not plain frozen data"
    )
    for field in dataclasses.fields(value):
        _assert_plain(getattr(value, field.name), f"{path}.{field.name}")


def test_scheduler_output_is_plain_data(stage, tiny_model, make_llm):
    """What the scheduler hands the model runner could be sent to another process: picklable,
    equal after a round trip, and made of immutable plain values only."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    params = [
        stage.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        stage.SamplingParams(max_tokens=5, temperature=0.8, seed=3, stop=["zz"], ignore_eos=True),
    ]
    requests = [llm.make_request(p, sp) for p, sp in zip(["alpha", "beta"], params, strict=True)]
    for request in requests:
        llm.add_request(request)
    steps = 0
    while llm.has_unfinished():
        scheduler_output = llm.scheduler.schedule()
        _assert_plain(scheduler_output)
        assert pickle.loads(pickle.dumps(scheduler_output)) == scheduler_output
        sampled = llm.runner.execute_model(scheduler_output)
        llm.update_from_output(scheduler_output, sampled)
        steps += 1
    assert steps >= 5 and all(len(r.output_token_ids) == r.params.max_tokens for r in requests)


def test_a_step_schedules_new_tokens_after_the_computed_ones(stage, tiny_model, make_llm):
    """vLLM V1's rule: a request's first step carries its whole prompt from position 0, every
    later step the one token sampled last, right after the tokens already in the cache."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    request = llm.make_request("hello there", stage.SamplingParams(max_tokens=4, ignore_eos=True))
    llm.add_request(request)
    seen = []
    while llm.has_unfinished():
        scheduler_output = llm.scheduler.schedule()
        (scheduled,) = [s for s in scheduler_output.requests if s.request_id == request.request_id]
        seen.append((scheduled.num_computed_tokens, scheduled.token_ids))
        # the scheduler counts them computed now, before the forward runs
        assert request.num_computed_tokens == scheduled.num_computed_tokens + len(
            scheduled.token_ids
        )
        llm.update_from_output(scheduler_output, llm.runner.execute_model(scheduler_output))
    prompt, out = request.prompt_token_ids, request.output_token_ids
    assert seen[0] == (0, tuple(prompt))
    assert seen[1:] == [(len(prompt) + i, (out[i],)) for i in range(len(out) - 1)]


@since("05")  # stage 05 shrinks the host's share of a step
@unit("request.py")
def test_a_final_output_is_detokenized_at_the_end_and_reads_the_same(
    stage, tiny_model, make_llm, monkeypatch
):
    """A request read only at its end (output kind "final", no stop strings) appends tokens
    without detokenizing them; its text, once read, is the text a request detokenized token by
    token has, multi-byte characters split across tokens included. A stop string, or a stream,
    needs the text at every step: those detokenize as they go."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    token_ids = llm.tokenizer.encode("€ café 你好 ok", add_special_tokens=False)
    assert len(token_ids) > 8  # byte-level: the multi-byte characters span several tokens
    params = stage.SamplingParams(max_tokens=len(token_ids), ignore_eos=True)
    lazy = llm.make_request([1, 2], params, output_kind="final")
    eager = llm.make_request([1, 2], params, output_kind="cumulative")
    stopping = llm.make_request(
        [1, 2], stage.SamplingParams(max_tokens=99, stop=["zz"]), output_kind="final"
    )
    calls = {"n": 0}
    add = type(lazy.detokenizer).add

    def counting(self, token_id):
        calls["n"] += 1
        return add(self, token_id)

    monkeypatch.setattr(type(lazy.detokenizer), "add", counting)
    extends = []
    extend = type(lazy.detokenizer).extend
    monkeypatch.setattr(
        type(lazy.detokenizer), "extend", lambda self, ids: extends.append(1) or extend(self, ids)
    )
    for token_id in token_ids[:-1]:
        lazy.append_token(token_id)
    assert calls["n"] == 0 and lazy.output() is None
    for token_id in token_ids[:-1]:
        eager.append_token(token_id)
        stopping.append_token(token_id)
    assert calls["n"] == 2 * (len(token_ids) - 1)
    lazy.append_token(token_ids[-1])
    eager.append_token(token_ids[-1])
    assert lazy.finished and eager.finished
    assert lazy.final_output().text == eager.final_output().text == "€ café 你好 ok"
    assert lazy.final_output().text == lazy.output().text  # read twice, decoded once
    # the lazy one's tokens all at once, when first read: one call, none token by token
    assert calls["n"] == 2 * len(token_ids) - 1 and len(extends) == 1
