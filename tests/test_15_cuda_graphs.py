"""Stage 15 on a GPU: decode steps replayed from captured CUDA graphs give the eager engine's
tokens (greedy and seeded) and its logits within the dtype's tolerance, over a workload whose
decode batches fall between the buckets and are padded up to them.

Runs only where CUDA is available: the CPU suite checks the planner and the replay
bookkeeping with a stand-in graph (tests/test_15_cuda_graph_plan.py), but cannot capture.

    .venv/bin/pytest -q tests/test_15_cuda_graphs.py
"""

from __future__ import annotations

import pytest
import torch

from .conftest import requires_cuda, since, step_logits

pytestmark = [since("15"), *requires_cuda("torch.cuda.graph captures only there")]

PROMPTS = [[11 + i, 23, 5 + 3 * i, 42, *range(60, 60 + 4 * i)] for i in range(7)]
# Eight seats: buckets 1, 2, 4, 8; seven requests of different lengths shrink the decode batch
# through 7, 6, 5 and 3 (padded to 8 and 4). A 16-token budget chunks the prompts (eager).
CONFIG = {"block_size": 4, "max_num_seqs": 8, "max_model_len": 128, "kv_cache_bytes": 8 << 20,
          "max_num_batched_tokens": 16, "device": "cuda"}  # fmt: skip
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}


def _params(stage, sampling):
    extra = {"temperature": 0} if sampling == "greedy" else {"temperature": 0.9, "seed": 7}
    return [
        stage.SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **extra)
        for i in range(len(PROMPTS))
    ]


def _engines(stage, path, dtype):
    eager = stage.LLM(str(path), cuda_graphs=False, dtype=dtype, **CONFIG)
    graphed = stage.LLM(str(path), cuda_graphs=True, dtype=dtype, **CONFIG)
    assert eager.runner.graphs is None
    assert graphed.runner.graphs is not None
    assert graphed.runner.graphs.plan.sizes == (1, 2, 4, 8)
    return eager, graphed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_graph_replay_gives_the_eager_tokens(stage, tiny_model, sampling, dtype):
    eager, graphed = _engines(stage, tiny_model("llama-gqa"), dtype)
    params = _params(stage, sampling)
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    for _ in range(2):  # graphs and buffers reused across runs
        assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == expected
    assert graphed.runner.graphs.num_replays > 0, "decode steps were meant to replay"
    graphed.check_no_leaks()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_logits_match_eager_within_the_dtype_tolerance(stage, tiny_model, dtype):
    """Step by step, every request's logits from the graphed run equal the eager run's (while
    their tokens agree: a later row depends on the earlier tokens)."""
    eager, graphed = _engines(stage, tiny_model("llama-gqa"), dtype)
    params = _params(stage, "greedy")
    with step_logits(eager) as expected_rows:
        expected = eager.generate(PROMPTS, params)
    with step_logits(graphed) as rows:
        outputs = graphed.generate(PROMPTS, params)
    tol = TOLERANCE[dtype]
    for want, got in zip(expected, outputs, strict=True):
        agree = next(
            (
                i
                for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True))
                if a != b
            ),
            len(want.token_ids) - 1,
        )
        for i in range(agree + 1):  # row i samples token i, from tokens before it
            torch.testing.assert_close(
                rows[got.request_id][i], expected_rows[want.request_id][i], atol=tol, rtol=tol
            )
    assert graphed.runner.graphs.num_replays > 0


def test_graphs_are_on_by_default_with_cuda_and_off_where_they_cannot_run(stage, tiny_model):
    dense = stage.LLM(str(tiny_model("llama-gqa")), **CONFIG)
    assert dense.runner.graphs is not None and dense.runner.cuda_graphs_reason is None
    moe = stage.LLM(str(tiny_model("mixtral")), **CONFIG)
    assert moe.runner.graphs is None and "experts" in moe.runner.cuda_graphs_reason
    with pytest.raises(ValueError, match="experts"):
        stage.LLM(str(tiny_model("mixtral")), cuda_graphs=True, **CONFIG)
    torch_path = stage.LLM(str(tiny_model("llama-gqa")), attention_backend="torch", **CONFIG)
    assert torch_path.runner.graphs is None
