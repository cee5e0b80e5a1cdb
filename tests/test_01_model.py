"""Stage 01 promises: the from-scratch forward equals transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from stages.common.tooling.hf_oracle import LOGIT_ATOL, hf_greedy, hf_logits
from stages.common.tooling.tiny import TINY_SPECS

from .conftest import since, subject, unit, until

# What these tests are about: elsewhere they run only where one of these changes (subject_stages).
pytestmark = [since("01"), subject("model.py", "model_loader.py")]

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Dense checkpoints; sparse MoE ones arrive at stage 11 (test_11_ep checks them against HF).
DENSE_SPECS = sorted(name for name, spec in TINY_SPECS.items() if spec.family in ("llama", "qwen3"))


@pytest.mark.parametrize("spec", DENSE_SPECS)
def test_prompt_logits_match_transformers(stage, tiny_model, make_llm, hf_model, spec):
    path = tiny_model(spec)
    llm = make_llm(stage, path)
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.prompt_logits(ids)
    ref = hf_logits(hf_model(path), ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("spec", DENSE_SPECS)
def test_greedy_tokens_match_transformers_generate(stage, tiny_model, make_llm, hf_model, spec):
    path = tiny_model(spec)
    llm = make_llm(stage, path)
    ids = llm.tokenizer.encode(PROMPT)
    expected = hf_greedy(hf_model(path), ids, max_new_tokens=40)
    out = llm.generate([ids], stage.SamplingParams(max_tokens=40, temperature=0))[0]
    assert out.token_ids == expected


@until("02")  # stage 03 drops the recompute mode; test_03 checks paged == contiguous instead
def test_cached_decode_equals_full_recompute(stage, tiny_model, make_llm):
    """The KV cache is an optimisation: decode through it must give the recompute result."""
    path = tiny_model("llama-odd-heads")
    cached = make_llm(stage, path)
    recompute = make_llm(stage, path, use_kv_cache=False)
    params = stage.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    a = cached.generate([PROMPT], params)[0]
    b = recompute.generate([PROMPT], params)[0]
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 30


@pytest.mark.slow
def test_real_model_logits_and_32_greedy_tokens(stage, real_model, make_llm, hf_model):
    llm = make_llm(stage, real_model)
    hf = hf_model(real_model)
    ids = llm.tokenizer.encode_chat(
        [{"role": "user", "content": "Write a short story about a dragon who learns to fly."}]
    )
    torch.testing.assert_close(
        llm.prompt_logits(ids), hf_logits(hf, ids), atol=LOGIT_ATOL[torch.float32], rtol=0
    )
    expected = hf_greedy(hf, ids, max_new_tokens=32)
    out = llm.generate([ids], stage.SamplingParams(max_tokens=32, temperature=0))[0]
    assert len(expected) == 32
    assert out.token_ids == expected


@pytest.mark.slow
def test_real_model_knows_the_capital_of_france(stage, real_model, make_llm):
    llm = make_llm(stage, real_model)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        stage.SamplingParams(max_tokens=24, temperature=0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@unit("model_loader.py")  # the backend is chosen where the weights are loaded into the model
@pytest.mark.parametrize("spec", ["llama-gqa", "qwen3", "llama-mha-untied"])
def test_linear_backends_give_the_same_tokens(stage, tiny_model, make_llm, spec, device):
    """oneDNN-packed matmuls (the CPU default) are an optimisation of F.linear, nothing more.
    oneDNN is a CPU backend: on another device (`pytest --device cuda`) the engine refuses it
    and 'auto' picks plain F.linear, which is checked there before the test skips."""
    from stages.common.linear import onednn_available

    path = tiny_model(spec)
    if device.type != "cpu":
        with pytest.raises(ValueError, match=r"onednn.*CPU"):
            make_llm(stage, path, linear_backend="onednn")
        assert make_llm(stage, path, linear_backend="auto").linear_backend == "torch"
        pytest.skip(
            f"oneDNN is CPU-only: on {device.type} only linear_backend='torch' exists (the "
            "refusal of 'onednn' and 'auto' -> 'torch' were checked); packed vs plain runs on a CPU"
        )
    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    packed = make_llm(stage, path, linear_backend="onednn")
    plain = make_llm(stage, path, linear_backend="torch")
    ids = packed.tokenizer.encode(PROMPT)
    torch.testing.assert_close(
        packed.prompt_logits(ids), plain.prompt_logits(ids), atol=1e-4, rtol=0
    )
    params = stage.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert packed.generate([ids], params)[0].token_ids == plain.generate([ids], params)[0].token_ids


# Direct tests of the assignment's tasks, in their order: each uses only the tasks before it.
@until("02")  # stage 03 replaces the contiguous cache with the paged one
def test_contiguous_store_writes_the_new_positions_and_returns_the_whole_context(stage):
    """ContiguousKVCache.store alone: the new tokens' K/V land at positions start.. of their
    layer (no other layer touched), and the answer is that layer's K/V of positions 0 .. the
    last new one: the cached context followed by the new tokens, not the new tokens only."""
    kv_cache = __import__(f"{stage.__name__}.kv_cache", fromlist=["ContiguousKVCache"])
    cache = kv_cache.ContiguousKVCache(2, 8, 2, 4, torch.float32, torch.device("cpu"))
    cache.k.zero_(), cache.v.zero_()  # allocated with torch.empty: no NaN to compare
    gen = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    k, v = cache.store(1, 0, k1, v1)  # a prompt of 3 tokens
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(1, 2, 4, generator=gen), torch.randn(1, 2, 4, generator=gen)
    other = cache.k[0].clone()
    k, v = cache.store(1, 3, k2, v2)  # a decode step at position 3
    assert k.shape == (4, 2, 4), "every position so far, not the new token only"
    assert torch.equal(k, torch.cat([k1, k2])) and torch.equal(v, torch.cat([v1, v2]))
    assert torch.equal(cache.k[1, 3], k2[0]) and torch.equal(cache.v[1, :4], v)
    assert torch.equal(cache.k[0], other), "another layer's K is left alone"
