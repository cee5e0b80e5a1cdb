"""Stage 01 promises under faults: no request can hurt another, offline.

A positive but tiny temperature is greedy (never inf/NaN); an error tied to one request (its
detokenizer, a stop check) fails that request alone; an exception that escapes the step loop
leaves nothing behind in the engine, so the next `generate()` works.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from .conftest import eager_config, since

pytestmark = since("01")


def _free_blocks_all_back(llm) -> bool:
    manager = getattr(llm, "kv_manager", None)  # stages with a block pool
    return manager is None or manager.num_free_blocks == manager.allocator.num_blocks


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6, 5e-324])
def test_tiny_temperatures_behave_as_greedy(stage, tiny_model, make_llm, temperature):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    greedy = stage.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tiny = stage.SamplingParams(max_tokens=8, temperature=temperature, seed=1, ignore_eos=True)
    other = stage.SamplingParams(max_tokens=8, temperature=0.9, seed=2, ignore_eos=True)
    a, b, c = llm.generate(["hello", "hello", "world"], [greedy, tiny, other])
    assert a.token_ids == b.token_ids and len(c.token_ids) == 8


def test_an_error_in_one_request_fails_it_alone(stage, tiny_model, make_llm, monkeypatch):
    llm = make_llm(stage, tiny_model("llama-gqa"))
    request_module = importlib.import_module(f"{stage.__name__}.request")
    original = request_module.Request.append_token

    def append_token(self, token_id, *when):  # stage 15 passes the iteration's time
        if self.prompt == "doomed":
            raise RuntimeError("detokenizer exploded")
        original(self, token_id, *when)

    monkeypatch.setattr(request_module.Request, "append_token", append_token)
    params = stage.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(["fine", "doomed", "also fine"], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "detokenizer exploded" in outs[1].error
    assert len(outs[0].token_ids) == len(outs[2].token_ids) == 6
    assert not llm.has_unfinished() and _free_blocks_all_back(llm)


@pytest.mark.parametrize("where", ["forward", "schedule"])
def test_an_exception_in_the_step_loop_leaves_no_ghosts(
    stage, tiny_model, make_llm, monkeypatch, where
):
    """generate() aborts its unfinished requests on any exception (a Ctrl-C in a notebook
    included), so the next generate() starts from a clean engine. The third call raises: of
    the model's forward (with async scheduling it may raise on the runner's side, surfacing
    when its step is resolved), or of the scheduler's `schedule`, which every step calls on
    every device, CUDA graphs or not (the first GPU run never raised from the forward: its
    decode steps replayed graphs)."""
    config = eager_config(stage) if where == "forward" else {}
    llm = make_llm(stage, tiny_model("llama-gqa"), **config)
    params = stage.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = llm.generate(["one", "two"], params)
    calls = {"n": 0}
    owner = llm.runner.model if where == "forward" else llm.scheduler
    original = getattr(owner, where)

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(owner, where, flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two"], params)
    assert calls["n"] >= 3  # the fault fired (async scheduling may have launched one more)
    assert not llm.has_unfinished() and _free_blocks_all_back(llm)
    again = llm.generate(["one", "two"], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


def test_sampling_never_sees_non_finite_probabilities(stage):
    """Every valid parameter combination keeps the sampler finite, even on extreme logits."""
    sampling = importlib.import_module(f"{stage.__name__}.sampling")
    logits = torch.tensor([[1e30, -1e30, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    params = [
        sampling.SamplingParams(temperature=t, top_p=p, top_k=k)
        for t, p, k in [
            (1e-40, 1.0, 0),
            (1e-5, 0.5, 2),
            (2.0, 1e-9, 0),
            (100.0, 1.0, 1),
            (1.0, 0.999, 3),
            (0.0, 1.0, 0),
            (1e-38, 1e-38, 0),
            (1e5, 1.0, 4),
        ]
    ]
    tensors = sampling.SamplingTensors.from_params(
        params, list(range(8)), list(range(8)), 4, torch.device("cpu")
    )
    tokens = sampling.sample(logits, tensors)
    assert tokens.shape == (8,) and bool(((tokens >= 0) & (tokens < 4)).all())
