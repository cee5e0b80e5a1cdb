"""Stage 01 promises: sampling parameters mean what they say."""

from __future__ import annotations

import pytest
import torch

from .conftest import since

pytestmark = since("01")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -1},
        {"stop": [""]},
    ],
)
def test_invalid_sampling_params_raise(stage, kwargs):
    with pytest.raises(ValueError):
        stage.SamplingParams(**kwargs)


def test_top_k_one_is_greedy(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    greedy = llm.generate("hello", stage.SamplingParams(max_tokens=20, temperature=0))[0]
    top1 = llm.generate(
        "hello", stage.SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=3)
    )[0]
    assert top1.token_ids == greedy.token_ids


def test_seed_makes_sampling_reproducible(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    params = [
        stage.SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
        for s in (7, 7, 8)
    ]
    a, b, c = llm.generate(["hello"] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_cuts_output(stage, real_model, make_llm):
    llm = make_llm(stage, real_model)
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat(messages, stage.SamplingParams(max_tokens=40, temperature=0))[0]
    assert "5" in full.text, full.text
    cut = llm.chat(messages, stage.SamplingParams(max_tokens=40, temperature=0, stop=["5"]))[0]
    assert cut.finish_reason == "stop"
    assert "5" not in cut.text
    assert full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)


def test_max_tokens_and_ignore_eos(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    out = llm.generate("hi", stage.SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"


def test_stop_token_ids_end_the_request(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    base = llm.generate("hi", stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        "hi",
        stage.SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]
        ),
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_top_k_top_p_masks(stage):
    sampling = __import__(f"{stage.__name__}.sampling", fromlist=["apply_top_k_top_p"])
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = torch.isfinite(sampling.apply_top_k_top_p(logits, 2, 1.0))
    assert kept.tolist() == [True, True, False, False, False]
    probs = logits.softmax(-1)  # [0.636, 0.234, 0.086, 0.032, 0.012]
    kept = torch.isfinite(sampling.apply_top_k_top_p(logits, 0, 0.8))
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(sampling.apply_top_k_top_p(logits, 0, float(probs[0]) - 1e-3))
    assert kept.tolist() == [True, False, False, False, False]
    shuffled = logits[torch.tensor([3, 0, 4, 2, 1])]
    kept = torch.isfinite(sampling.apply_top_k_top_p(shuffled, 0, 0.8))
    assert kept.tolist() == [False, True, False, False, True]


# Chi-square critical value for 4 degrees of freedom at a 0.1% false-alarm rate.
CHI2_CRITICAL_DF4_P001 = 18.467


def test_sampled_tokens_follow_the_target_distribution(stage):
    """Draws from the sampler match softmax(logits / T) restricted to top-k/top-p (chi-square)."""
    sampling = __import__(f"{stage.__name__}.sampling", fromlist=["sample_next_token"])
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0])
    params = stage.SamplingParams(temperature=0.7, top_k=5)
    generator = torch.Generator().manual_seed(1234)
    draws = 6000
    counts = torch.zeros(7)
    for _ in range(draws):
        counts[sampling.sample_next_token(logits, params, generator)] += 1
    target = (logits[:5] / 0.7).softmax(-1)
    assert counts[5:].sum() == 0  # outside the top-k: never drawn
    expected = target * draws
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_DF4_P001
