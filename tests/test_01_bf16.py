"""bf16, the GPU's default dtype, with its own stated tolerances (the rest of the suite runs the
engines in fp32, whose oracle tolerance is 2e-3; `pytest --dtype` changes that default).

bf16 keeps 8 bits of mantissa: a logit near 5 is rounded to steps of 1/32, and every layer's
activations are rounded too. `LOGIT_ATOL[torch.bfloat16]` (0.25) bounds the engine in bf16
against transformers in fp32; measured on the tiny checkpoints: 0.16-0.19 on a 2-core EPYC.
The runs use the test device (`pytest --device cuda` takes them to a GPU, where bf16 matmuls
accumulate in fp32 the same way)."""

from __future__ import annotations

import pytest
import torch

from stages.common.tooling.hf_oracle import LOGIT_ATOL, hf_logits

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject

pytestmark = [since("01"), subject("model.py", "model_loader.py", "model_runner.py")]

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
BF16_ATOL = LOGIT_ATOL[torch.bfloat16]


@pytest.mark.parametrize("spec", ["llama-gqa", "llama-odd-heads", "qwen3"])
def test_bf16_prompt_logits_match_fp32_transformers_within_the_bf16_tolerance(
    stage, tiny_model, make_llm, hf_model, spec
):
    path = tiny_model(spec)
    llm = make_llm(stage, path, dtype="bfloat16")
    assert llm.runner.dtype == torch.bfloat16
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.prompt_logits(ids).float().cpu()
    ref = hf_logits(hf_model(path), ids)
    error = (ours - ref).abs().max().item()
    assert error <= BF16_ATOL, f"bf16 logits off by {error:.3f} (bound {BF16_ATOL})"
    assert error > 0, "a bf16 run equal to fp32 to the last bit did not run in bf16"


def test_bf16_decode_through_the_cache_matches_bf16_teacher_forcing(stage, tiny_model, make_llm):
    """Each sampled token's logits, computed step by step through the (bf16) KV cache, equal a
    bf16 forward over prompt + output without a cache, within the bf16 tolerance."""
    llm = make_llm(stage, tiny_model("llama-gqa"), dtype="bfloat16")
    params = [stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 17)]
    prompts = [PROMPT, "Two households, both alike in dignity"]
    with step_logits(llm) as recorded:
        outputs = llm.generate(prompts, params)
    assert_logits_match_teacher_forcing(llm, outputs, recorded, atol=BF16_ATOL)
