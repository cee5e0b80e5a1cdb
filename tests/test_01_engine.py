"""Stage 01 promises: the offline API validates input and reports honest timings."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import since

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
