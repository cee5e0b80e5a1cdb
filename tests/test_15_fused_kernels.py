"""Stage 15's fused kernels (fused_kernels.py): each equals its PyTorch reference, and the model
built on them gives the same logits and tokens as the model without them.

On a CPU the kernels run under TRITON_INTERPRET=1; the model takes them only on CUDA, so the
model-level test forces them on (`use_triton`) to run the same code path a GPU runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from .conftest import needs_triton, since, unit

pytestmark = [since("15"), unit("fused_kernels.py")]


def _fused(stage):
    return importlib.import_module(f"{stage.__name__}.fused_kernels")


def _table(max_positions: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The RoPE table of model.RotaryEmbedding: cos, and sin with its first half negated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    return torch.stack([cos, torch.cat([-angles.sin(), angles.sin()], dim=-1)], dim=1)


@needs_triton
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 96), (3, 576)])
def test_add_rms_norm_equals_the_add_and_the_norm(stage, device, rows, hidden):
    fused = _fused(stage)
    generator = torch.Generator().manual_seed(rows)
    x, h = (torch.randn(rows, hidden, generator=generator) for _ in range(2))
    weight = torch.rand(hidden, generator=generator) + 0.5
    want = fused.add_rms_norm_reference(x, h, weight, 1e-5)
    got = fused.add_rms_norm_triton(x.to(device), h.to(device), weight.to(device), 1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize(("rows", "intermediate"), [(1, 128), (5, 1536), (2, 40)])
def test_silu_mul_equals_silu_times_up(stage, device, rows, intermediate):
    fused = _fused(stage)
    gate_up = torch.randn(rows, 2 * intermediate, generator=torch.Generator().manual_seed(1)) * 3
    got = fused.silu_mul_triton(gate_up.to(device))
    torch.testing.assert_close(got.cpu(), fused.silu_mul_reference(gate_up), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 2, 24), (8, 1, 32)]
)
def test_rope_and_cache_rotates_q_and_k_and_writes_only_their_slots(
    stage, device, heads, kv_heads, dim
):
    """q and k rotated by their positions as the reference rotates them; k and v written at
    their slots (shuffled, across blocks) and nowhere else."""
    fused = _fused(stage)
    generator = torch.Generator().manual_seed(heads)
    tokens, blocks, block_size = 6, 5, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)  # strided, as model's
    qk, v = qk.view(tokens, heads + kv_heads, dim), v.view(tokens, kv_heads, dim)
    positions = torch.tensor([0, 5, 17, 3, 30, 31])
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    table = _table(64, dim)
    caches = [torch.randn(blocks, block_size, kv_heads, dim, generator=generator) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    want = fused.rope_and_cache_reference(qk, v, positions, table, heads, *want_caches, slots)
    moved = [c.to(device) for c in caches]
    got = fused.rope_and_cache_triton(
        qk.to(device), v.to(device), positions.to(device), table.to(device), heads, *moved,
        slots.to(device),
    )  # fmt: skip
    for g, w in zip([*got, *moved], [*want, *want_caches], strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)


def test_a_cpu_tensor_runs_the_references(stage):
    """The CPU keeps the PyTorch calls the model made before the kernels existed."""
    fused = _fused(stage)
    assert not fused.use_triton(torch.zeros(1))
    gate_up = torch.randn(2, 8)
    assert torch.equal(fused.silu_mul(gate_up), fused.silu_mul_reference(gate_up))


@unit("model.py")
def test_every_residual_add_rides_in_a_norm(stage, tiny_model, make_llm, monkeypatch):
    """A layer leaves its last residual add to the next norm: a forward of L layers makes 2L
    add+norm calls (each layer's input norm but the first's, its post-attention norm, the final
    norm) and a single plain norm (the embedding's, at layer 0), and no other residual add: the
    kernels per layer on CUDA are 9. The logits are those of the unfolded form (HF's)."""
    llm = make_llm(stage, tiny_model("llama-gqa"))
    model_module = importlib.import_module(f"{stage.__name__}.model")
    layers = llm.runner.model.config.num_layers
    calls: list[str] = []
    real = model_module.add_rms_norm

    def counted(*args):
        calls.append("add_rms_norm")
        return real(*args)

    monkeypatch.setattr(model_module, "add_rms_norm", counted)
    norm = model_module.RMSNorm.forward
    monkeypatch.setattr(model_module.RMSNorm, "forward",
                        lambda self, x: (calls.append("rms_norm"), norm(self, x))[1])  # fmt: skip
    llm.prompt_logits([5, 9, 33, 2])
    assert calls.count("add_rms_norm") == 2 * layers and calls.count("rms_norm") == 1, calls


@needs_triton
@unit("model.py")
def test_the_model_on_the_kernels_gives_the_same_logits_and_tokens(
    stage, tiny_model, make_llm, monkeypatch
):
    """The tiny model with the kernels forced on (the path CUDA takes, here interpreted):
    the same teacher-forced logits and greedy tokens as without them."""
    # The PyTorch attention: on CUDA the Triton one would fold the decode steps' RoPE and K/V
    # write into itself (the next test), and this test is about the kernels before attention.
    llm = make_llm(stage, tiny_model("llama-gqa"), attention_backend="torch")
    params = stage.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [5, 9, 33, 2, 17, 60, 4]
    plain_logits = llm.prompt_logits(prompt)
    plain = llm.generate([prompt], params)[0].token_ids
    model_module = importlib.import_module(f"{stage.__name__}.model")
    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    fused = _fused(stage)
    for name in ("add_rms_norm", "silu_mul"):
        monkeypatch.setattr(model_module, name, getattr(fused, f"{name}_triton"))
    calls: list[int] = []

    def rope_and_cache(*args):
        calls.append(len(args[0]))
        return fused.rope_and_cache_triton(*args)

    monkeypatch.setattr(model_module, "rope_and_cache", rope_and_cache)
    torch.testing.assert_close(llm.prompt_logits(prompt), plain_logits, atol=1e-4, rtol=1e-4)
    assert llm.generate([prompt], params)[0].token_ids == plain
    assert calls and 1 in calls, "the decode steps never took the fused RoPE and K/V write"


@needs_triton
@unit("model.py")
def test_a_decode_step_folds_rope_and_the_kv_write_into_attention(
    stage, tiny_model, make_llm, monkeypatch
):
    """With the Triton attention and the kernels forced on (the CUDA path, interpreted here), a
    decode step runs one kernel where it ran two (`decode_attention_rope_cache_triton` instead
    of `rope_and_cache` then attention), a prompt keeps both: the same logits and greedy tokens
    as the plain path, and the folded kernel was taken by every decode step of every layer."""
    path = tiny_model("llama-gqa")
    params = stage.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = [5, 9, 33, 2, 17, 60, 4]
    model_module = importlib.import_module(f"{stage.__name__}.model")
    logits: list[torch.Tensor] = []  # every step's, in order: the prompt's, then each decode's
    compute_logits = model_module.CausalLM.compute_logits

    def recorded(self, hidden):
        out = compute_logits(self, hidden)
        logits.append(out.detach().float().cpu())
        return out

    monkeypatch.setattr(model_module.CausalLM, "compute_logits", recorded)
    want = make_llm(stage, path, attention_backend="torch").generate([prompt], params)[0].token_ids
    want_logits, logits[:] = list(logits), []
    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    calls: list[tuple[str, int]] = []
    rope, folded = model_module.rope_and_cache, model_module.decode_attention_rope_cache_triton

    def counted_rope(*args):
        calls.append(("rope_and_cache", len(args[0])))
        return rope(*args)

    def counted_folded(*args, **kwargs):
        calls.append(("folded", len(args[0])))
        return folded(*args, **kwargs)

    monkeypatch.setattr(model_module, "rope_and_cache", counted_rope)
    monkeypatch.setattr(model_module, "decode_attention_rope_cache_triton", counted_folded)
    llm = make_llm(stage, path, attention_backend="triton")
    assert llm.generate([prompt], params)[0].token_ids == want
    assert len(logits) == len(want_logits) == len(want)
    for got, expected in zip(logits, want_logits, strict=True):  # teacher-forced: same tokens
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    layers = llm.runner.model.config.num_layers
    assert ("rope_and_cache", 1) not in calls, "a decode step still ran the separate kernel"
    assert calls.count(("folded", 1)) == layers * (len(want) - 1), calls


@needs_triton
@unit("model.py")
def test_a_decode_layer_launches_eight_kernels(stage, tiny_model, make_llm, monkeypatch):
    """The step-cost issue's count, taken from what a layer issues in a decode step with the
    CUDA path forced on (interpreted here): every Triton launch, and every PyTorch op that is
    neither a view nor an allocation (a kernel on CUDA). Two add+norms, four matmuls, the
    attention with RoPE and the K/V write folded in, SiLU-mul: 8. The next GPU run's profiler
    counts the same on the device (`tools/gpu_check.sh`, the step profile's trace)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model_module = importlib.import_module(f"{stage.__name__}.model")
    fused = _fused(stage)
    launches: list[str] = []
    state = {"counting": False, "in_triton": False}

    class PyTorchLaunches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            allocation = name.startswith(("empty", "new_empty"))
            if state["counting"] and not state["in_triton"] and not func.is_view and not allocation:
                launches.append(name)
            return func(*args, **(kwargs or {}))

    def triton_launch(name, kernel):
        def launch(*args, **kwargs):
            if state["counting"]:
                launches.append(name)
            state["in_triton"] = True  # the interpreter's own tensor work is not the model's
            try:
                return kernel(*args, **kwargs)
            finally:
                state["in_triton"] = False

        return launch

    monkeypatch.setattr(model_module, "use_triton", lambda t: True)
    for name in ("add_rms_norm", "silu_mul"):
        monkeypatch.setattr(
            model_module, name, triton_launch(name, getattr(fused, f"{name}_triton"))
        )
    for name in ("rope_and_cache", "decode_attention_rope_cache_triton"):
        monkeypatch.setattr(model_module, name, triton_launch(name, getattr(model_module, name)))
    layer_forward = model_module.DecoderLayer.forward

    def counted_layer(self, positions, hidden, *args):
        counting = self.self_attn.layer_index == 1 and hidden.shape[0] == 1  # a decode step
        state["counting"] = counting
        try:
            if not counting:
                return layer_forward(self, positions, hidden, *args)
            with PyTorchLaunches():
                return layer_forward(self, positions, hidden, *args)
        finally:
            state["counting"] = False

    monkeypatch.setattr(model_module.DecoderLayer, "forward", counted_layer)
    llm = make_llm(stage, tiny_model("llama-gqa"), attention_backend="triton")
    params = stage.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([[5, 9, 33, 2]], params)
    matmuls = {"mm", "addmm", "_linear_pointwise", "mkldnn_linear", "_weight_int8pack_mm"}
    kinds = sorted("matmul" if name in matmuls else name for name in launches)
    assert kinds == sorted(
        ["add_rms_norm", "add_rms_norm", "decode_attention_rope_cache_triton", "silu_mul"]
        + ["matmul"] * 4
    ), launches
