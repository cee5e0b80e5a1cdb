"""Stage 11 promises: a sparse MoE computes what transformers computes, and expert parallelism
changes where the experts run, never what they compute.

- Mixtral and Qwen3-MoE tiny checkpoints: prompt logits and greedy tokens equal transformers'.
- A dense model whose MLP is split into 8 experts, routed to all with weight 1, is the dense model.
- Per-expert token counts add up to tokens x top-k.
- Dispatch then combine is the identity (real gloo processes, uneven token counts, E % EP != 0);
  a MoE layer over 2 and 3 ranks equals the one-process layer, by all-to-all and by all-gather.
- EP=2 engines (both dispatch methods) give EP=1's and transformers' greedy tokens and logits.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stages
from stages.common.model_config import ModelConfig
from stages.common.tooling.hf_oracle import hf_greedy, hf_logits

from .conftest import since, subject

pytestmark = since("11")
# The slow tests' subject: on a later newest stage they rerun only if one of these changed.
EP_SUBJECT = subject(
    "moe/layer.py", "model.py", "model_loader.py", "model_runner.py", "parallel/executor.py",
    "parallel/multiproc_executor.py", "parallel/worker.py", "parallel/group.py",
)  # fmt: skip

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(30, 67)), [3, 4], [10, 11, 12]]
# fp32: the experts' outputs are summed in another order across ranks; ~1e-6 seen here.
LOGITS_ATOL = 1e-4
MOE_SPECS = ["mixtral", "qwen3-moe", "qwen3-moe-unnormed"]


def _greedy(stage, n: int = 12):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(llm, stage, prompts=PROMPTS, n: int = 12):
    return [o.token_ids for o in llm.generate(prompts, [_greedy(stage, n)] * len(prompts))]


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_sparse_moe_equals_transformers(stage, tiny_model, make_llm, hf_model, spec):
    path = tiny_model(spec)
    llm = make_llm(stage, path, block_size=BLOCK)
    hf = hf_model(path)
    for prompt, tokens in zip(PROMPTS, _tokens(llm, stage), strict=True):
        assert list(tokens) == hf_greedy(hf, prompt, 12)[: len(tokens)]
        ids = prompt + list(tokens)
        torch.testing.assert_close(llm.prompt_logits(ids), hf_logits(hf, ids), atol=1e-5, rtol=0)


def test_expert_token_counts_add_up_to_tokens_times_top_k(stage, tiny_model, make_llm):
    path = tiny_model("qwen3-moe")
    llm = make_llm(stage, path, block_size=BLOCK)
    stats = llm.runner.ep.stats
    stats.reset()
    ids = PROMPTS[1]
    llm.prompt_logits(ids)
    config = llm.runner.model.config
    expected = len(ids) * config.num_experts_per_tok * len(config.moe_layers)
    assert stats.expert_tokens.sum().item() == expected
    assert (stats.expert_tokens > 0).sum() > 1  # the router spreads tokens


def test_split_dense_mlp_routed_to_all_is_the_dense_model(stage, tiny_model, make_llm):
    path = tiny_model("llama-gqa")
    dense = make_llm(stage, path, block_size=BLOCK)
    split = make_llm(stage, path, block_size=BLOCK, moe_split_experts=8)
    assert split.runner.model.config.num_experts == 8
    assert _tokens(split, stage) == _tokens(dense, stage)
    ids = PROMPTS[1]
    torch.testing.assert_close(
        split.prompt_logits(ids), dense.prompt_logits(ids), atol=1e-5, rtol=0
    )
    routed = make_llm(stage, path, block_size=BLOCK, moe_split_experts=8, moe_top_k=2)
    assert not torch.allclose(routed.prompt_logits(ids), dense.prompt_logits(ids), atol=1e-3)


def test_expert_parallel_refuses_a_dense_checkpoint_unless_split(stage, tiny_model):
    """On a dense model expert parallelism would hold the whole model on every rank and
    exchange nothing: refused before any rank starts, naming the way out."""
    with pytest.raises(ValueError, match="dense") as refused:
        stage.LLM(str(tiny_model("llama-gqa")), tensor_parallel_size=2, expert_parallel=True)
    assert "moe_split_experts" in str(refused.value)


def test_expert_map_follows_vllm(stage):
    moe = importlib.import_module(f"{stage.__name__}.moe.layer")
    assert moe.expert_map(5, 2, 0).tolist() == [0, 1, 2, -1, -1]
    assert moe.expert_map(5, 2, 1).tolist() == [-1, -1, -1, 0, 1]
    assert moe.expert_owner(7, 3).tolist() == [0, 0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="cannot be split"):
        moe.experts_per_rank(2, 3)


# ------------------------------------------------------------------ real gloo processes
def _moe_config(num_experts: int, top_k: int) -> ModelConfig:
    return ModelConfig(
        model_type="mixtral", vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=True, num_experts=num_experts,
        num_experts_per_tok=top_k, moe_intermediate_size=12, moe_layers=(0,),
    )  # fmt: skip


def _layer(moe, ep, dispatch: str, config: ModelConfig):
    """A SparseMoE on `ep` filled from one seeded full set of weights (this rank's experts)."""
    layer = moe.SparseMoE(config, moe.MoESettings(dispatch=dispatch), ep).requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    router, w13, w2 = (torch.randn(s, generator=gen) for s in ((e, h), (e, 2 * i, h), (e, h, i)))
    local = layer.expert_map >= 0
    with torch.no_grad():
        layer.router.weight.copy_(router)
        layer.w13.copy_(w13[local])
        layer.w2.copy_(w2[local])
    return layer


def _ep_worker(rank: int, size: int, stage_name: str, folder: str, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:  # a copy from --stage-path exists only in the parent: load it again (import_stage)
        moe = importlib.import_module(
            f"{stages.import_stage(stage_name, folder).__name__}.moe.layer"
        )
        ep = moe.EPGroup(rank, size, dist.group.WORLD)
        num_experts, top_k, hidden = 5, 2, 8
        for trial in range(4):  # uneven token counts, a rank with none included
            gen = torch.Generator().manual_seed(100 * trial + rank)
            n = [0, 3, 7, 1][(trial + rank) % 4]
            x = torch.randn(n, hidden, generator=gen)
            ids = torch.rand(n, num_experts, generator=gen).argsort(-1)[:, :top_k]
            weights = torch.rand(n, top_k, generator=gen)
            sent = moe.dispatch(ep, x, ids, weights, moe.expert_owner(num_experts, size))
            owned = moe.expert_map(num_experts, size, rank)[sent.expert_ids]
            assert bool((owned >= 0).all()), "a row reached a rank that does not own its expert"
            back = moe.combine(ep, sent.rows * sent.weights.unsqueeze(-1), sent, n)
            torch.testing.assert_close(back, x * weights.sum(-1, keepdim=True))
            total = torch.tensor([len(sent.rows)])
            dist.all_reduce(total)
            pairs = torch.tensor([n * top_k])
            dist.all_reduce(pairs)
            assert total.item() == pairs.item()
        config = _moe_config(num_experts, top_k)
        x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(7))  # every rank
        with torch.inference_mode():  # as the engine runs it
            reference = _layer(moe, moe.EPGroup(), "all_to_all", config)(x)
            for method in ("all_to_all", "all_gather"):
                got = _layer(moe, ep, method, config)(x)
                torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@EP_SUBJECT
@pytest.mark.parametrize("size", [2, 3])
def test_dispatch_then_combine_is_the_identity_and_both_methods_match(stage, size):
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        folder = str(Path(stage.__file__).parent)
        mp.spawn(_ep_worker, args=(size, stage.__name__, folder, init_file), nprocs=size)


@pytest.mark.slow
@EP_SUBJECT
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_expert_parallel_equals_one_rank_and_transformers(
    stage, tiny_model, make_llm, hf_model, dispatch
):
    path = tiny_model("mixtral")
    single = make_llm(stage, path, block_size=BLOCK)
    parallel = make_llm(
        stage, path, block_size=BLOCK, tensor_parallel_size=2, expert_parallel=True,
        moe_dispatch=dispatch,
    )  # fmt: skip
    tokens = _tokens(parallel, stage)
    assert tokens == _tokens(single, stage)
    hf = hf_model(path)
    for prompt, out in zip(PROMPTS, tokens, strict=True):
        assert list(out) == hf_greedy(hf, prompt, 12)[: len(out)]
        ids = prompt + list(out)
        torch.testing.assert_close(
            parallel.prompt_logits(ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0
        )
    reports = parallel.executor.call_all("rank_report")
    moved = [r["moe"]["dispatch_bytes"] for r in reports]
    assert all(b > 0 for b in moved), moved


# ------------------------------------------------------------------ the real model
@pytest.mark.slow
@pytest.mark.fixed_cost  # the real model in two processes: the newest stage and those being edited
@EP_SUBJECT
def test_real_model_split_into_8_experts_routed_to_all_is_the_dense_model(
    stage, real_model, make_llm
):
    """SmolLM2's MLP as 8 experts of 192 columns, every token routed to all 8 with weight 1:
    the same sum as the dense MLP, in 8 pieces. Greedy tokens equal; logits (which reach ~30)
    move only by the changed order of the fp32 sums, ~1e-5 seen here."""
    dense = make_llm(stage, real_model)
    split = make_llm(stage, real_model, moe_split_experts=8)
    config = split.runner.model.config
    assert (config.num_experts, config.num_experts_per_tok) == (8, 8)
    assert config.moe_intermediate_size == 192
    params = stage.SamplingParams(max_tokens=16, temperature=0)
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    expected = [o.token_ids for o in dense.generate(prompts, params)]
    got = split.generate(prompts, params)
    assert [o.token_ids for o in got] == expected
    ids = list(got[0].prompt_token_ids) + list(got[0].token_ids)
    torch.testing.assert_close(
        split.prompt_logits(ids), dense.prompt_logits(ids), atol=1e-3, rtol=0
    )
