"""Stage 09: which process-group backend the ranks use, and gloo's ranks sharing a GPU.

- `resolve_distributed_backend` (stages/common/devices.py): "auto" is `STAGES_DIST_BACKEND` when
  set, else NCCL on CUDA and gloo on a CPU; NCCL off CUDA and unknown names are ValueErrors, and
  so is `distributed_backend="nccl"` in a CPU config.
- `rank_devices` with gloo on CUDA puts rank r on cuda:(b+r) mod the visible GPUs instead of
  refusing (NCCL still refuses: it takes one GPU per rank); CUDA is never asked when the count
  is given, so this is checked here.
- The default KV budget splits a device's free memory between the ranks on it
  (`ranks_per_device`, which the executor counts: every rank of a CPU host, the ranks sharing a
  GPU under gloo); an explicit `kv_cache_bytes` is per rank and never split.
- On a GPU (skipped elsewhere): TP=2 over gloo with both ranks on one GPU gives TP=1's greedy
  tokens, and both ranks report the same cuda device.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from stages.common.devices import DIST_BACKEND_VARIABLE, resolve_distributed_backend

from .conftest import requires_cuda, since, unit

pytestmark = since("09")

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(30, 67)), [3, 4], [10, 11, 12]]


@pytest.fixture
def no_cuda(monkeypatch):
    """Fail any test that asks CUDA while the GPU count was given."""

    def asked(*args, **kwargs):
        raise AssertionError("CUDA was asked although num_gpus was given")

    monkeypatch.setattr(torch.cuda, "device_count", asked)
    monkeypatch.setattr(torch.cuda, "is_available", asked)


# ------------------------------------------------------------------------- the backend
def test_auto_is_nccl_on_cuda_and_gloo_on_a_cpu_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(DIST_BACKEND_VARIABLE, raising=False)
    assert resolve_distributed_backend("auto", "cuda") == "nccl"
    assert resolve_distributed_backend(None, "cpu") == "gloo"
    assert resolve_distributed_backend("gloo", "cuda") == "gloo"
    monkeypatch.setenv(DIST_BACKEND_VARIABLE, "gloo")
    assert resolve_distributed_backend("auto", "cuda") == "gloo"
    assert resolve_distributed_backend("nccl", "cuda") == "nccl", "an explicit name wins"


def test_nccl_off_cuda_and_unknown_backends_are_refused(monkeypatch):
    monkeypatch.delenv(DIST_BACKEND_VARIABLE, raising=False)
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        resolve_distributed_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="'mpi' unknown"):
        resolve_distributed_backend("mpi", "cuda")
    monkeypatch.setenv(DIST_BACKEND_VARIABLE, "nccl")
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        resolve_distributed_backend("auto", "cpu")


@unit("config.py")
def test_the_config_refuses_nccl_on_a_cpu_and_unknown_backends(stage):
    with pytest.raises(ValueError, match="distributed_backend='nccl' needs CUDA"):
        stage.EngineConfig(device="cpu", distributed_backend="nccl")
    with pytest.raises(ValueError, match="distributed_backend must be"):
        stage.EngineConfig(distributed_backend="mpi")
    with pytest.raises(ValueError, match="ranks_per_device must be at least 1"):
        stage.EngineConfig(ranks_per_device=0)
    assert stage.EngineConfig(device="cuda", distributed_backend="nccl").distributed_backend


# ------------------------------------------------------------------------- placement
@unit("parallel/placement.py")
@pytest.mark.parametrize(("base", "size", "gpus"), [(0, 2, 1), (0, 3, 2), (1, 3, 2), (2, 2, 4)])
def test_gloo_ranks_wrap_around_the_visible_gpus(stage, no_cuda, base, size, gpus):
    rank_devices = stage.parallel.placement.rank_devices
    devices = rank_devices(torch.device("cuda", base), size, num_gpus=gpus, backend="gloo")
    assert devices == [torch.device("cuda", (base + r) % gpus) for r in range(size)]
    if base + size > gpus:
        with pytest.raises(ValueError, match="are visible"):  # NCCL: one GPU per rank
            rank_devices(torch.device("cuda", base), size, num_gpus=gpus, backend="nccl")


@unit("parallel/placement.py")
def test_the_ranks_sharing_a_device_are_counted(stage, no_cuda):
    placement = stage.parallel.placement
    cpu = torch.device("cpu")
    assert placement.ranks_sharing(placement.rank_devices(cpu, 3, num_gpus=0)) == 3
    one_gpu = placement.rank_devices(torch.device("cuda"), 3, num_gpus=1, backend="gloo")
    assert placement.ranks_sharing(one_gpu) == 3
    two_gpus = placement.rank_devices(torch.device("cuda"), 3, num_gpus=2, backend="gloo")
    assert placement.ranks_sharing(two_gpus) == 2  # cuda:0 holds ranks 0 and 2
    assert placement.ranks_sharing(placement.rank_devices(torch.device("cuda"), 2, 2)) == 1


# ------------------------------------------------------------------------- the KV budget
@unit("model_runner.py")
def test_the_default_kv_budget_is_split_between_the_ranks_on_a_device(
    stage, tiny_model, monkeypatch
):
    """Two ranks that each took half of one GPU's free memory would take all of it: each takes
    its share. An explicit kv_cache_bytes is per rank and is not split."""
    memory_module = importlib.import_module(f"{stage.__name__}.runner_memory")  # sizes the pool
    monkeypatch.setattr(memory_module, "kv_memory_budget", lambda device: 1 << 20)
    path = str(tiny_model("llama-gqa"))

    def blocks(**config) -> int:
        llm = stage.LLM(path, block_size=BLOCK, device="cpu", max_num_seqs=512, **config)
        return llm.runner.num_blocks

    alone = blocks()
    assert blocks(kv_cache_bytes=2 << 20) > alone, "the budget, not the seats, sizes the pool"
    assert blocks(ranks_per_device=2) == alone // 2
    assert blocks(ranks_per_device=2, kv_cache_bytes=1 << 20) == alone


# ------------------------------------------------------------------------- on a GPU
@pytest.mark.slow
@requires_cuda("two gloo ranks on one GPU: CUDA tensors through gloo's all-reduce/all-gather")
def test_tp2_over_gloo_on_one_gpu_equals_tp1(stage, tiny_model, make_llm, monkeypatch):
    """NCCL refuses two ranks on one GPU; gloo takes CUDA tensors (staged through pinned host
    memory), so TP=2 runs on a single GPU and must give TP=1's greedy tokens."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU, however many exist
    path = tiny_model("llama-gqa")
    single = make_llm(stage, path, block_size=BLOCK, device="cuda")
    parallel = make_llm(
        stage, path, block_size=BLOCK, device="cuda", tensor_parallel_size=2,
        distributed_backend="gloo",
    )  # fmt: skip
    devices = parallel.executor.call_all("__getattribute__", "device")
    assert [str(d) for d in devices] == ["cuda:0", "cuda:0"]
    params = stage.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in single.generate(PROMPTS, [params] * len(PROMPTS))]
    got = [o.token_ids for o in parallel.generate(PROMPTS, [params] * len(PROMPTS))]
    assert got == expected
    reports = parallel.executor.call_all("rank_report")
    assert all(r["collectives"]["all_reduce_calls"] > 0 for r in reports)
