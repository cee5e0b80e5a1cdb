"""Stage 10: each data-parallel replica runs on its own devices.

`device_plan(config, num_gpus)`: replica i with tensor-parallel size t owns GPUs [i*t, (i+1)*t),
its rank r on cuda:{i*t + r} (vLLM's data-parallel rank offset); a config that names "cuda:k"
starts at GPU k; on a CPU every rank is "cpu"; with NCCL too few GPUs is a ValueError naming the
numbers, raised by `DPClient` before any replica process starts. With gloo the plan wraps modulo
the GPUs instead, and `ranks_per_device` tells each replica how many ranks of the whole plan
share its GPUs (DPClient passes it on, so that the replicas' default KV budgets split a GPU's
free memory). With `num_gpus` given CUDA is never asked, so all of it is checked here without a
GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stages.common import supervisor

from .conftest import since, unit

pytestmark = since("10")

SIZES = list(itertools.product([1, 2, 3], [1, 2, 3]))


@pytest.fixture
def no_cuda(monkeypatch):
    """Fail any test that asks CUDA while `num_gpus` was given."""

    def asked(*args, **kwargs):
        raise AssertionError("device_plan asked CUDA although num_gpus was given")

    monkeypatch.setattr(torch.cuda, "device_count", asked)
    monkeypatch.setattr(torch.cuda, "is_available", asked)


def _config(stage, dp: int, tp: int, device: str | None = "cuda", backend: str = "auto"):
    # Built without validation of the device: EngineConfig only stores the name. "auto" is
    # STAGES_DIST_BACKEND when set (gloo on a one-GPU test run): tests of refusals name NCCL.
    return stage.EngineConfig(
        device=device, data_parallel_size=dp, tensor_parallel_size=tp, distributed_backend=backend
    )


@unit("parallel/placement.py")
@pytest.mark.parametrize(("dp", "tp"), SIZES, ids=[f"dp{d}-tp{t}" for d, t in SIZES])
def test_each_replica_owns_its_own_gpus(stage, no_cuda, dp, tp):
    plan = stage.device_plan(_config(stage, dp, tp), num_gpus=dp * tp)
    assert plan == [[f"cuda:{i * tp + r}" for r in range(tp)] for i in range(dp)]
    every = [d for replica in plan for d in replica]
    assert len(set(every)) == len(every) == dp * tp, "no two ranks share a GPU"


@unit("parallel/placement.py")
@pytest.mark.parametrize(("dp", "tp"), SIZES[1:], ids=[f"dp{d}-tp{t}" for d, t in SIZES[1:]])
def test_too_few_gpus_is_refused_with_the_numbers(stage, no_cuda, dp, tp):
    need = dp * tp  # more than one: DP x TP = 1 x 1 fits any GPU
    with pytest.raises(ValueError) as refused:
        stage.device_plan(_config(stage, dp, tp, backend="nccl"), num_gpus=need - 1)
    message = str(refused.value)
    assert f"data_parallel_size={dp}" in message and f"tensor_parallel_size={tp}" in message
    assert f"needs {need} GPUs" in message and f"{need - 1} are visible" in message


@unit("parallel/placement.py")
def test_a_named_gpu_is_where_the_first_replica_starts(stage, no_cuda):
    plan = stage.device_plan(_config(stage, 2, 2, "cuda:2"), num_gpus=6)
    assert plan == [["cuda:2", "cuda:3"], ["cuda:4", "cuda:5"]]
    with pytest.raises(ValueError, match="from cuda:2, but 5 are visible"):
        stage.device_plan(_config(stage, 2, 2, "cuda:2", backend="nccl"), num_gpus=5)


@unit("parallel/placement.py")
@pytest.mark.parametrize("device", ["cpu", None, "auto"])
def test_a_cpu_plan_puts_every_rank_on_the_host(stage, no_cuda, device, monkeypatch):
    """On a CPU config the GPU count does not matter; unset or auto with no GPU means cpu.
    (`pytest --device cuda` sets STAGES_DEVICE, which "auto" follows: the H100 run of
    2026-11-26 refused these plans for want of GPUs, and the suite skipped them.)"""
    monkeypatch.delenv("STAGES_DEVICE", raising=False)
    gpus = 8 if device == "cpu" else 0
    plan = stage.device_plan(_config(stage, 3, 2, device), num_gpus=gpus)
    assert plan == [["cpu", "cpu"]] * 3


@unit("parallel/placement.py")
def test_auto_means_the_gpus_when_there_are_some(stage, no_cuda, monkeypatch):
    monkeypatch.delenv("STAGES_DEVICE", raising=False)  # `pytest --device` sets it
    assert stage.device_plan(_config(stage, 2, 1, None), num_gpus=2) == [["cuda:0"], ["cuda:1"]]
    monkeypatch.setenv("STAGES_DEVICE", "cpu")  # what "auto" means, as for one engine
    assert stage.device_plan(_config(stage, 2, 1, "auto"), num_gpus=2) == [["cpu"], ["cpu"]]


@unit("frontend/dp_client.py")
def test_the_front_end_refuses_too_few_gpus_before_starting_a_replica(stage, monkeypatch):
    """DPClient plans first: nothing is loaded and no process starts when the plan fails."""
    dp_client = stage.frontend.dp_client
    started = []
    monkeypatch.setattr(supervisor, "start_stage_process", lambda *a, **k: started.append(a))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 4 GPUs, but 1 are visible"):
        dp_client.DPClient(
            "no-such-model", device="cuda", data_parallel_size=2, tensor_parallel_size=2,
            distributed_backend="nccl",
        )  # fmt: skip
    assert started == []


@unit("parallel/placement.py")
@pytest.mark.parametrize(
    ("dp", "tp", "gpus", "expected", "shares"),
    [
        (2, 1, 1, [["cuda:0"], ["cuda:0"]], [2, 2]),
        (2, 2, 1, [["cuda:0", "cuda:0"], ["cuda:0", "cuda:0"]], [4, 4]),
        (2, 2, 2, [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]], [2, 2]),
        (3, 1, 2, [["cuda:0"], ["cuda:1"], ["cuda:0"]], [2, 1, 2]),
        (2, 2, 4, [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], [1, 1]),
    ],
)
def test_gloo_replicas_share_gpus_and_count_the_ranks_on_them(
    stage, no_cuda, dp, tp, gpus, expected, shares
):
    """With gloo the plan wraps modulo the GPUs instead of refusing; each replica's share is
    the most ranks of the whole plan on one of its GPUs."""
    plan = stage.device_plan(_config(stage, dp, tp, backend="gloo"), num_gpus=gpus)
    assert plan == expected
    assert stage.parallel.placement.ranks_per_device(plan) == shares


@unit("parallel/placement.py")
def test_a_cpu_plan_leaves_the_count_to_each_replica(stage, no_cuda):
    plan = stage.device_plan(_config(stage, 2, 2, "cpu"), num_gpus=0)
    assert stage.parallel.placement.ranks_per_device(plan) == [None, None]


@unit("frontend/dp_client.py")
def test_the_front_end_tells_replicas_sharing_a_gpu_how_many_share_it(
    stage, tiny_model, monkeypatch
):
    """Two replicas on one GPU (gloo): each engine is built with ranks_per_device=2, so their
    default KV budgets together take one engine's share of the GPU's free memory."""
    dp_client = stage.frontend.dp_client
    specs = []

    def start(target, args, name):
        specs.append(args[0])
        raise RuntimeError("stop here: no replica process is started")

    monkeypatch.setattr(supervisor, "start_stage_process", start)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="stop here"):
        dp_client.DPClient(
            str(tiny_model("llama-gqa")), device="cuda", data_parallel_size=2,
            distributed_backend="gloo",
        )  # fmt: skip
    assert specs[0].config["device"] == "cuda:0"
    assert specs[0].config["ranks_per_device"] == 2


@since("15")
def test_the_api_preset_gives_each_replica_its_own_gpu(stage, no_cuda):
    """Stage 15's preset "api" is two replicas: one GPU each, not both on cuda:0."""
    config = stage.EngineConfig(preset="api", device="cuda")
    assert config.data_parallel_size == 2
    assert stage.device_plan(config, num_gpus=2) == [["cuda:0"], ["cuda:1"]]
