"""Stage 15's quantization="auto": the fastest weight format that keeps the model's outputs.

- The grid check: weights built as Q4_1 builds them (codes 0-15 times a scale plus a minimum,
  groups of 32) are on INT4-asym g32's grid; random weights, or a width that 32 does not
  divide, are not.
- The rule: a GPU keeps its dtype, a CPU off the measured class (AVX2) keeps fp32, weights off
  the grid keep fp32; the embedded model on a measured-class CPU takes INT4-asym g32 with bf16
  activations, and the engine, /health and the CLI say so.
- The bound: that format's teacher-forced logits on the embedded model stay within
  `KL_BOUND` of fp32's per token (on any CPU: forced explicitly), and so do auto's. Its
  INT4 weights equal the fp32 ones exactly.
- The topology: `serve` runs one engine in an engine-core process (`engine_core_process`),
  whose replica takes every core; the in-process engine stays one switch away.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from stages.common import devices
from stages.common.model_config import ModelConfig
from stages.common.tooling.server_process import ThreadedServer

from .conftest import TEST_KV_CACHE_BYTES, since

pytestmark = since("15")
REPO = Path(__file__).resolve().parent.parent
TEXT = (
    "The water cycle moves water between the oceans, the air and the land. The sun warms the "
    "sea, water evaporates, rises, cools and condenses into clouds. Rain and snow fall, rivers "
    "carry the water back to the sea, and the cycle begins again."
)


def _auto(stage):
    return importlib.import_module(f"{stage.__name__}.quant.auto")


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    p = reference.float().log_softmax(-1)
    return F.kl_div(other.float().log_softmax(-1), p, log_target=True, reduction="none").sum(-1)


def test_q4_1_weights_are_on_the_grid_and_random_ones_are_not(stage):
    auto = _auto(stage)
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 4, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 takes each group's min and max as its ends
    scale = torch.rand(48, 4, 1, generator=generator).half().float() * 0.01 + 1e-3
    minimum = -torch.rand(48, 4, 1, generator=generator).half().float() * 0.05
    q4_1 = (codes * scale + minimum).reshape(48, 128)
    assert auto.on_int4_grid(q4_1)
    assert not auto.on_int4_grid(torch.randn(48, 128, generator=generator))
    assert not auto.on_int4_grid(q4_1[:, :100]), "a width 32 does not divide has no grid"
    nudged = q4_1.clone()
    nudged[3, 7] += 0.3 * scale[3, 0, 0]  # one weight a third of a step off
    assert not auto.on_int4_grid(nudged)


def test_the_rule_keeps_fp32_off_the_measured_cpu_off_the_grid_and_on_a_gpu(
    stage, tiny_model, monkeypatch
):
    auto = _auto(stage)
    path = tiny_model("llama-gqa")
    loader = importlib.import_module(f"{stage.__name__}.model_loader")
    cpu = torch.device("cpu")
    model = loader.load_model(path, ModelConfig.from_pretrained(path), cpu, torch.float32, 64)
    monkeypatch.setattr(auto, "like_the_measured_cpu", lambda: True)
    choice = auto.choose_format(model, cpu)
    assert choice.quantization == "none" and "not on a 4-bit grid" in choice.reason
    assert auto.choose_format(model, torch.device("cuda")).quantization == "none"
    monkeypatch.setattr(auto, "like_the_measured_cpu", lambda: False)
    choice = auto.choose_format(model, cpu)
    assert choice.quantization == "none" and "scalar loops" in choice.reason


@pytest.mark.slow
def test_the_embedded_model_takes_int4_asym_g32_on_the_measured_cpu_and_says_so(
    stage, real_model, make_llm
):
    engine = make_llm(stage, real_model, quantization="auto")
    choice = engine.weight_format
    paths = importlib.import_module(f"{stage.__name__}.quant.cpu_paths")
    if paths.like_the_measured_cpu():
        assert (choice.quantization, choice.group_size, choice.activations) == (
            "int4-asym", 32, "bf16",
        )  # fmt: skip
        layer = engine.runner.model.layers[0].mlp.down_proj
        assert layer.weight is None, "the fp32 weight was replaced by its INT4 codes"
    else:
        assert choice.quantization == "none", choice
    assert choice.describe() in _health_note(stage, engine)


def _health_note(stage, engine) -> str:
    server = importlib.import_module(f"{stage.__name__}.server")
    report = server.with_format_note({"config_notes": {}}, engine)
    return report["config_notes"]["quantization"]


@pytest.mark.slow
def test_the_auto_format_stays_within_its_kl_bound_of_fp32_on_the_embedded_model(
    stage, real_model, make_llm
):
    """Teacher-forced over a fixed text: INT4-asym g32 holds the embedded model's weights
    exactly (the dequantized codes equal fp32's), so only bf16 rounding moves the logits (the
    activations; in a prefill, the batch path's bf16 copy of the weights too), and less than
    KL_BOUND per token. Forced explicitly, so that it holds on every CPU."""
    auto = _auto(stage)
    fp32 = make_llm(stage, real_model, quantization="none")
    ids = fp32.tokenizer.encode(TEXT)
    reference = fp32.prompt_logits(ids)
    forced = make_llm(
        stage, real_model, quantization="int4-asym", quant_group_size=32, quant_activations="bf16"
    )
    kl = _kl(reference, forced.prompt_logits(ids))
    assert kl.mean().item() < auto.KL_BOUND, f"KL {kl.mean().item():.2e} per token"
    assert (reference.argmax(-1) == forced.prompt_logits(ids).argmax(-1)).float().mean() > 0.95
    loader = importlib.import_module(f"{stage.__name__}.model_loader")
    linear = importlib.import_module(f"{stage.__name__}.quant.linear")
    model_config = ModelConfig.from_pretrained(real_model)
    model = loader.load_model(real_model, model_config, torch.device("cpu"), torch.float32, 64)
    layers = linear.quantizable_layers(model)
    assert layers and all(auto.on_int4_grid(layer.weight) for _, layer in layers)
    chosen = make_llm(stage, real_model, quantization="auto")
    assert _kl(reference, chosen.prompt_logits(ids)).mean().item() < auto.KL_BOUND


@pytest.mark.slow
def test_serve_runs_one_engine_in_an_engine_core_process(stage, tiny_model, make_llm):
    """The default topology: the engine in a core process of its own, the front end here;
    it answers what the in-process engine answers."""
    path = str(tiny_model("llama-gqa"))
    config = {"max_model_len": 128, "kv_cache_bytes": TEST_KV_CACHE_BYTES}
    client = stage.serving_engine(path, **config)
    try:
        assert type(client).__name__ == "DPClient" and len(client.replicas) == 1
        assert client.replicas[0].process.pid != os.getpid()
        with ThreadedServer(stage.create_app(client)) as server:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            served = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
            health = httpx.get(f"{server.url}/health", timeout=10).json()
    finally:
        client.shutdown()
    params = stage.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = make_llm(stage, path, **config).generate([[5, 6, 7, 8]], params)[0].token_ids
    assert served["token_ids"] == expected
    assert health["data_parallel_size"] == 1 and health["config"]["engine_core_process"]


def test_data_parallel_cores_take_their_share_of_the_cpu_threads():
    assert devices.cpu_threads_per_process(10**6) == 1, "never zero threads"
    with pytest.raises(ValueError, match="at least 1"):
        devices.cpu_threads_per_process(0)
    code = (
        "import torch; from stages.common import devices; "
        "devices.place_cpu_threads(torch.device('cpu'), 2); print(torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    default = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert int(out.stdout) == max(1, int(default.stdout) // 2)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code.replace("2)", "1)")], cwd=REPO, env=env,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert int(out.stdout) == 1, "a user's OMP_NUM_THREADS wins"
