"""Stage 15's CUDA graphs, the parts a CPU can check (cuda_graphs.py, model_runner.py).

- The planner: vLLM's bucket sizes up to the largest batch, a batch rounded up to its bucket;
  only pure decode steps replay a graph (not a prefill, a chunk, drafts, or a batch beyond the
  largest bucket); padding rows write only the scratch slot.
- The switch: None is off on a CPU, True where graphs cannot run is a ValueError naming why,
  and the command line's `--config cuda_graphs=...` parses it.
- The runner's replay path, with a stand-in for a CUDA graph that runs the captured forward
  again on every replay: batches padded up to their bucket give the eager engine's tokens and
  logits, and the real blocks' K/V; only the scratch block (outside the scheduler's pool)
  holds the padding's. The real capture runs in tests/test_15_cuda_graphs.py (CUDA only).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
from typing import get_type_hints

import pytest
import torch

from stages.cli_args import _parse_value, engine_kwargs

from .conftest import assert_logits_match_teacher_forcing, since, step_logits

pytestmark = since("15")

PLAN_KW = {"max_blocks": 3, "block_size": 4, "scratch_block": 10}


def _graphs(stage):
    return importlib.import_module(f"{stage.__name__}.cuda_graphs")


# ------------------------------------------------------------------------------ the planner
def test_buckets_are_vllms_sizes_up_to_the_largest_batch(stage):
    capture_sizes = _graphs(stage).capture_sizes
    assert capture_sizes(1) == (1,)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(5) == (1, 2, 4, 5)  # the largest batch is always a bucket
    assert capture_sizes(30) == (1, 2, 4, 8, 16, 24, 30)
    sizes = capture_sizes(10_000)  # capped at 512: every 8 up to 256, then every 16
    assert sizes[-1] == 512 and len(sizes) == 51
    assert {248, 256, 272} <= set(sizes) and 264 not in sizes
    assert list(sizes) == sorted(set(sizes))
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_a_batch_rounds_up_to_the_smallest_bucket_that_holds_it(stage):
    bucket_for = _graphs(stage).bucket_for
    sizes = (1, 2, 4, 8, 16)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(17, sizes) is None


def test_only_pure_decode_steps_replay_a_graph(stage):
    plan = _graphs(stage).GraphPlan(sizes=(1, 2, 4, 8), **PLAN_KW)
    assert plan.bucket([1, 1, 1], [0, 0, 0]) == 4
    assert plan.bucket([1] * 8, [0] * 8) == 8
    cases = {
        "prefill": ([7], [0]),  # a whole prompt
        "chunk": ([1, 1, 4], [0, 0, 0]),  # decodes beside a prefill chunk
        "drafts": ([1, 1], [0, 2]),  # drafts to verify
        "beyond": ([1] * 9, [0] * 9),  # more rows than the largest graph
        "no request": ([], []),
    }
    for name, (query_lens, drafts) in cases.items():
        assert plan.bucket(query_lens, drafts) is None, name
        assert plan.why_eager(query_lens, drafts), name  # and it says why
    assert "beyond" in plan.why_eager([1] * 9, [0] * 9)
    # A graph samples every real row: a one-token chunk of a longer prompt (it does not sample,
    # `long_prefill_token_threshold=1` makes them) runs eagerly, wherever it sits in the batch.
    assert plan.bucket([1, 1, 1], [0, 0, 0], (), [True, True, True]) == 4
    for samples in ([True, False, True], [False, True, True], [True, True, False]):
        assert plan.bucket([1, 1, 1], [0, 0, 0], (), samples) is None, samples
        assert "does not sample" in plan.why_eager([1, 1, 1], [0, 0, 0], (), samples)
    # Tables are 3 blocks wide in every graph: a wider one runs eagerly.
    assert plan.bucket([1, 1], [0, 0], [3, 2]) == 2
    assert plan.bucket([1, 1], [0, 0], [4, 2]) is None


def test_padding_rows_write_only_the_scratch_slot(stage):
    plan = _graphs(stage).GraphPlan(sizes=(1, 2, 4, 8), **PLAN_KW)
    # Three decodes: contexts of 5, 2 and 9 tokens, in blocks (0, 1), (2,) and (3, 4, 5).
    real = {
        "input_ids": [11, 12, 13],
        "positions": [5, 2, 9],
        "slot_mapping": [1 * 4 + 1, 2 * 4 + 2, 5 * 4 + 1],
        "query_start_loc": [0, 1, 2, 3],
        "seq_lens": [6, 3, 10],
        "block_tables": [0, 1, 0, 2, 0, 0, 3, 4, 5],
        "logits_indices": [0, 1, 2],
    }
    before = copy.deepcopy(real)
    padded = {name: list(values) for name, values in plan.pad(real, 3, 8).items()}
    assert real == before, "a copy is padded: the caller's inputs stay as they were"
    scratch_slot = 10 * 4
    for name, values in real.items():  # the real rows come first, unchanged
        assert padded[name][: len(values)] == values, name
    assert padded["slot_mapping"][3:] == [scratch_slot] * 5
    assert padded["block_tables"][9:] == [10] * (5 * 3)  # [8 rows, 3 blocks] flat
    assert padded["seq_lens"][3:] == [1] * 5  # one token each: it sees only itself
    assert padded["positions"][3:] == [0] * 5 and len(padded["input_ids"]) == 8
    assert padded["query_start_loc"] == list(range(9))
    assert padded["logits_indices"] == [0, 1, 2]  # no padding row is ever sampled
    idle = plan.idle_values(8)  # what the buffers hold while graphs are captured
    assert list(idle["slot_mapping"]) == [scratch_slot] * 8 and list(idle["seq_lens"]) == [1] * 8
    assert plan.max_context == 3 * 4 - 1


def test_a_step_with_a_row_that_does_not_sample_runs_eagerly(stage):
    """Through the runner's `graph_bucket`: a decode batch whose middle request is a one-token
    chunk that does not sample gets no bucket (replaying would hand its neighbours' tokens
    along by one row); the same batch sampling everywhere gets one."""
    from types import SimpleNamespace

    graph_bucket = importlib.import_module(f"{stage.__name__}.runner_graphs").graph_bucket
    plan = _graphs(stage).GraphPlan(sizes=(1, 2, 4), **PLAN_KW)
    graphs = SimpleNamespace(plan=plan, usable=lambda: True)

    def step(*samples):
        requests = [
            SimpleNamespace(num_new_tokens=1, num_draft_tokens=0, block_ids=(1,), sample=s)
            for s in samples
        ]
        return SimpleNamespace(requests=requests)

    assert graph_bucket(graphs, step(True, True, True)) == 4
    assert graph_bucket(graphs, step(True, False, True)) is None


def test_the_split_count_warmed_up_is_the_one_captured(stage, monkeypatch):
    """A graph's warm-up and its capture must launch the same split-K specialisation (a
    Triton kernel first launched inside a capture loads a module there, which fails). The
    graph path declares every row's context as the plan's longest, so for every
    `max_model_len` and bucket the count chosen while capturing equals the one warmed up."""
    from types import SimpleNamespace

    kernels = importlib.import_module(f"{stage.__name__}.kernels")
    graphs = _graphs(stage)
    monkeypatch.setattr(kernels, "_sms", lambda device: 132)  # an H100's multiprocessors
    on_cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda"))
    for max_model_len in (96, 128, 512, 1024, 2048, 4096, 8192):
        plan = graphs.GraphPlan(
            sizes=graphs.capture_sizes(256), max_blocks=-(-max_model_len // 16), block_size=16,
            scratch_block=0,
        )  # fmt: skip
        longest = plan.max_context + 1  # what `Attention.forward` passes for graph rows
        for bucket in plan.sizes:
            chosen = {}
            for capturing in (False, True):
                monkeypatch.setattr(
                    torch.cuda, "is_current_stream_capturing", lambda c=capturing: c
                )
                chosen[capturing] = kernels._decode_num_splits(on_cuda, bucket, 3, longest)
            assert chosen[False] == chosen[True], (max_model_len, bucket, chosen)


def test_padding_keeps_the_steps_arrays_and_pads_as_the_rule_says(stage):
    """At 256 requests with 512-block tables the padding works on numpy arrays (no round trip
    through Python lists, which cost milliseconds a step there) and gives what the rule gives
    row by row: the real rows first, then one scratch token per padding row."""
    import numpy as np

    plan = _graphs(stage).GraphPlan(sizes=(256, 512), max_blocks=512, block_size=16,
                                    scratch_block=7)  # fmt: skip
    rng = np.random.default_rng(0)
    n = 256 - 3
    real = {
        "input_ids": rng.integers(0, 1000, n),
        "positions": rng.integers(0, 8000, n),
        "slot_mapping": rng.integers(0, 10_000, n),
        "query_start_loc": np.arange(n + 1),
        "seq_lens": rng.integers(1, 8000, n),
        "block_tables": rng.integers(0, 600, n * 512),
        "logits_indices": np.arange(n),
    }
    padded = plan.pad(real, n, 256)
    for name, values in padded.items():
        assert isinstance(values, np.ndarray), name
        assert values[: len(real[name])].tolist() == real[name].tolist(), name
    assert padded["slot_mapping"][n:].tolist() == [7 * 16] * 3
    assert padded["block_tables"][n * 512 :].tolist() == [7] * (3 * 512)
    assert padded["query_start_loc"].tolist() == list(range(257))
    assert padded["seq_lens"][n:].tolist() == [1] * 3 and len(padded["input_ids"]) == 256


# ------------------------------------------------------------------------------ the switch
def test_graphs_need_cuda_and_a_capturable_engine(stage):
    graphs = _graphs(stage)
    reason = graphs.unsupported_reason
    assert "CUDA" in reason(device_type="cpu", attention_backend="triton")
    assert reason(device_type="cuda", attention_backend="triton") is None
    assert "attention_backend" in reason(device_type="cuda", attention_backend="torch")
    cuda = {"device_type": "cuda", "attention_backend": "triton"}
    assert "parallel" in reason(**cuda, tensor_parallel_size=2)
    assert "parallel" in reason(**cuda, expert_parallel=True)
    assert "experts" in reason(**cuda, moe=True)
    assert "kv_cache_dtype" in reason(**cuda, kv_cache_dtype="int8")
    resolve = graphs.resolve_cuda_graphs
    assert resolve(None, "no CUDA") is False and resolve(None, None) is True
    assert resolve(False, None) is False and resolve(True, None) is True
    with pytest.raises(ValueError, match="no CUDA"):
        resolve(True, "no CUDA")


def test_the_config_refuses_graphs_it_cannot_run(stage):
    assert stage.EngineConfig().cuda_graphs is None
    with pytest.raises(ValueError, match="CUDA"):
        stage.EngineConfig(cuda_graphs=True, device="cpu")
    stage.EngineConfig(cuda_graphs=True, device="cuda")  # the config cannot tell more
    refused = {
        "attention_backend": {"attention_backend": "torch"},
        "parallel": {"tensor_parallel_size": 2},
        "kv_cache_dtype": {"kv_cache_dtype": "int8"},
        "experts": {"moe_split_experts": 2},
    }
    for name, fields in refused.items():
        with pytest.raises(ValueError, match=name):
            stage.EngineConfig(cuda_graphs=True, device="cuda", **fields)
        stage.EngineConfig(cuda_graphs=None, device="cuda", **fields)  # None: just off there
    with pytest.raises(ValueError, match="cuda_graphs"):
        stage.EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be at least 1"):
        stage.EngineConfig(cuda_graph_max_batch=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_graphs_on_a_machine_without_cuda_are_an_error_or_off(stage, make_llm, tiny_model):
    with pytest.raises(ValueError, match="CUDA"):
        stage.EngineConfig(cuda_graphs=True)
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=4, max_model_len=64)
    assert llm.runner.graphs is None and "CUDA" in llm.runner.cuda_graphs_reason
    assert llm.runner.num_blocks == llm.runner.kv_cache.num_blocks  # no scratch block


def test_the_command_line_sets_the_switch(stage):
    hints = get_type_hints(stage.EngineConfig)
    assert _parse_value("false", hints["cuda_graphs"]) is False
    assert _parse_value("true", hints["cuda_graphs"]) is True
    assert _parse_value("none", hints["cuda_graphs"]) is None
    args = argparse.Namespace(config=["cuda-graphs=off"])
    assert engine_kwargs(stage, args) == {"cuda_graphs": False}


# ------------------------------------------------------------------------------ replay, faked
class EagerGraph:
    """A CUDA graph's stand-in on a CPU: `replay` runs the captured function again, on
    whatever the buffers hold. What differs from eager is then only the runner's bookkeeping:
    the padding, the scratch block, the fixed-width tables, the rows it hands back."""

    def __init__(self, run) -> None:
        self.run = run

    def replay(self) -> None:
        self.run()


def _eager_capture(run, pool):
    run()  # the warm-up, as the real capture does
    return EagerGraph(run)


PROMPTS = [[11 + i, 23, 5 + 3 * i, 42, *range(60, 60 + 3 * i)] for i in range(7)]
CONFIG = {"block_size": 4, "max_num_seqs": 8, "max_model_len": 96, "kv_cache_bytes": 1 << 21,
          "max_num_batched_tokens": 16}  # fmt: skip


def _graphed(stage, monkeypatch, path, **config):
    """An engine whose runner captures 'graphs' on the CPU (with the stand-in above)."""
    runner_module = importlib.import_module(f"{stage.__name__}.runner_graphs")
    monkeypatch.setattr(runner_module, "unsupported_reason", lambda **_: None)
    monkeypatch.setattr(runner_module, "capture_cuda_graph", _eager_capture)
    return stage.LLM(str(path), **config)


def _record_buckets(llm) -> list[tuple[int, int | None]]:
    """(requests, graph bucket) of every step the runner prepares."""
    seen: list[tuple[int, int | None]] = []
    prepare = llm.runner.prepare_inputs

    def recording(scheduler_output):
        inputs = prepare(scheduler_output)
        seen.append((len(scheduler_output.requests), inputs.graph_bucket))
        return inputs

    llm.runner.prepare_inputs = recording
    return seen


@pytest.mark.parametrize("mode", ["greedy", "seeded", "ngram"])
def test_replay_padded_to_the_bucket_gives_the_eager_tokens(stage, tiny_model, monkeypatch, mode):
    """Seven requests of different lengths, prompts in chunks of a 16-token budget, then
    decodes whose batch shrinks from 7 to 1 (between the buckets 1, 2, 4, 8): the replayed
    steps give the eager engine's tokens, logits and real blocks' K/V."""
    path = tiny_model("llama-gqa")
    config = {**CONFIG, "speculative": "ngram" if mode == "ngram" else None}
    eager = stage.LLM(str(path), **config)
    graphed = _graphed(stage, monkeypatch, path, **config)
    runner = graphed.runner
    assert runner.graphs is not None and runner.graphs.plan.sizes == (1, 2, 4, 8)
    # The scratch block is one more than the scheduler's pool, which is the eager engine's.
    assert runner.graphs.plan.scratch_block == runner.num_blocks == eager.runner.num_blocks
    assert runner.kv_cache.num_blocks == runner.num_blocks + 1
    extra = {"temperature": 0} if mode != "seeded" else {"temperature": 0.9, "seed": 7}
    params = [
        stage.SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True, **extra)
        for i in range(len(PROMPTS))
    ]
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    steps = _record_buckets(graphed)
    # The logits recorder reads one row per request: not with speculation.
    record = step_logits(graphed) if mode != "ngram" else contextlib.nullcontext({})
    with record as recorded:
        outputs = graphed.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == expected
    assert any(bucket is None for _, bucket in steps), "the prompts were meant to run eagerly"
    padded = {(n, bucket) for n, bucket in steps if bucket is not None and bucket > n}
    assert {(3, 4), (5, 8)} <= padded, steps  # batches between buckets were padded up
    assert runner.graphs.num_replays == sum(bucket is not None for _, bucket in steps)
    if mode == "greedy":
        assert_logits_match_teacher_forcing(graphed, outputs, recorded)
        # Every real block holds what the eager run wrote: no padding row wrote one of them.
        pool = slice(0, runner.num_blocks)
        torch.testing.assert_close(runner.kv_cache.k[:, pool], eager.runner.kv_cache.k[:, pool])
        torch.testing.assert_close(runner.kv_cache.v[:, pool], eager.runner.kv_cache.v[:, pool])
    graphed.check_no_leaks()


def test_the_lm_head_writes_the_graphs_logits_in_place_where_it_can(stage, tiny_model, monkeypatch):
    """A plain LM head (unsharded, unpacked, no bias) writes its logits straight into the
    graphs' output buffer, so a replay copies no [bucket, vocab] logits; a head packed for
    oneDNN is run as it is and copied. Either way the replayed tokens are the eager ones."""
    runner_graphs = importlib.import_module(f"{stage.__name__}.runner_graphs")
    path = tiny_model("llama-gqa")
    params = [stage.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)] * 3
    expected = [o.token_ids for o in stage.LLM(str(path), **CONFIG).generate(PROMPTS[:3], params)]
    for backend, in_place in (("torch", True), ("onednn", False)):
        graphed = _graphed(stage, monkeypatch, path, **CONFIG, linear_backend=backend)
        head, shape = graphed.runner.model.lm_head, graphed.runner.model_config
        hidden = torch.randn(3, shape.hidden_size)
        out = torch.zeros(4, shape.vocab_size)
        assert runner_graphs.lm_head_into(head, hidden, out) is in_place, backend
        if in_place:
            torch.testing.assert_close(out[:3], head(hidden))
        else:
            assert not out.any(), "a head it cannot run in place writes nothing"
        outputs = graphed.generate(PROMPTS[:3], params)
        assert [o.token_ids for o in outputs] == expected, backend
        assert graphed.runner.graphs.num_replays > 0


def test_batches_past_the_largest_graph_run_eagerly(stage, tiny_model, monkeypatch):
    """`cuda_graph_max_batch=2`: buckets 1 and 2 only; a decode batch of 3 or more runs
    eagerly, and the tokens are the eager engine's either way."""
    path = tiny_model("llama-gqa")
    eager = stage.LLM(str(path), **CONFIG)
    graphed = _graphed(stage, monkeypatch, path, **CONFIG, cuda_graph_max_batch=2)
    assert graphed.runner.graphs.plan.sizes == (1, 2)
    params = [
        stage.SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True) for i in range(4)
    ]
    expected = [o.token_ids for o in eager.generate(PROMPTS[:4], params)]
    steps = _record_buckets(graphed)
    assert [o.token_ids for o in graphed.generate(PROMPTS[:4], params)] == expected
    decodes = [(n, bucket) for n, bucket in steps if n >= 3]
    assert decodes and all(bucket is None for _, bucket in decodes), steps
    assert any(bucket == 2 for _, bucket in steps), "batches of two were meant to replay"
