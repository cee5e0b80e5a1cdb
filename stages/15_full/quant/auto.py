"""`quantization="auto"`: the fastest weight format that keeps the model's outputs, per device.

Stage 14 measured every format on the embedded model (its README's table, `python -m stages 14
bench`): on an AVX-512 CPU with native bf16, decoding one sequence reads fp32 weights at 41
tokens/s and INT4 weights with bf16 activations at 71, because torch's fused INT4 op
(`_weight_int4pack_mm_for_cpu`) runs vectorized for bf16 activations only. What INT4 costs in
accuracy depends on the checkpoint. Most are trained in bf16, and 4 bits cost them KL 0.3-0.5
per token. But a checkpoint converted from a GGUF Q4_1 file (the embedded model is one) holds
weights that already sit on a 4-bit grid of groups of 32 with a scale and a minimum: INT4
with an offset ("int4-asym", group 32) holds them exactly, and only the bf16 rounding of the
activations changes the numbers.

So "auto" picks, once, after loading:

- on a CPU of the measured class (`cpu_paths.like_the_measured_cpu`: AVX-512 with native bf16)
  and weights that INT4-asym group 32 reproduces exactly (`on_int4_grid`, every quantizable
  layer): INT4-asym g32 with bf16 activations, and the LM head (113 MB of fp32, tied to the
  embedding, which stays fp32 for lookups) packed in bf16. Its cost against fp32 is rounding
  alone: a KL per token below `KL_BOUND` (`tests/test_15_auto_format.py` measures it,
  teacher-forced, on the embedded model);
- anywhere else: fp32 ("none"). Weights off the grid lose far more than `KL_BOUND` at 4 bits
  (INT8 with bf16 activations costs 0.004), an AVX2 CPU runs the fused ops as scalar loops
  (slower than fp32: docs/quant_cpu_paths.md), and a GPU keeps the model's own dtype.

`--config quantization=none` keeps fp32 anywhere; any explicit format is taken as given.

Measured on a 2-core AMD EPYC (AVX-512, native bf16), the embedded model, two threads, 128
greedy tokens after a chat prompt: a decode step took 44.8 ms with fp32 weights, 24.4 ms with
INT4-asym g32 and bf16 activations, 21.5 ms with the LM head in bf16 too. KL(p_fp32 || p) per
token over a 53-token text, teacher-forced (one prefill, so the batch path: a bf16 copy of the
dequantized weights through one GEMM): 1e-8 with fp32 activations (the weights are exact),
2.4e-4 with bf16 activations, 6.8e-4 with the bf16 head as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cpu_paths import like_the_measured_cpu
from .linear import QuantConfig, quant_config_for, quantizable_layers

AUTO_GROUP_SIZE = 32  # GGUF Q4_1's block
# The largest KL(p_fp32 || p) per token (nats, teacher-forced, stage 14's measure) "auto" may
# cost: about what rounding activations to bf16 costs, a tenth of INT8's 0.004.
KL_BOUND = 0.002
# A weight is on the grid when no element is further from its INT4 value than this share of
# its group's step (exactly 0 for a Q4_1 conversion; 0.5 for weights off any grid).
GRID_SLACK = 1e-3


@dataclass(frozen=True, slots=True)
class FormatChoice:
    """What "auto" resolved to, and why (the engine logs it; /health shows it)."""

    quantization: str  # "none" or an EngineConfig format
    group_size: int
    activations: str
    reason: str

    @property
    def head_dtype(self) -> torch.dtype | None:
        """The LM head's matmul: in bf16 when the activations are (None: fp32, as loaded)."""
        return torch.bfloat16 if self.activations == "bf16" else None

    def quant_config(self) -> QuantConfig | None:
        return quant_config_for(self.quantization, self.group_size, self.activations)

    def describe(self) -> str:
        if self.quantization == "none":
            return f"fp32 weights ({self.reason})"
        return (
            f"{self.quantization} g{self.group_size} weights, {self.activations} activations "
            f"and LM head ({self.reason})"
        )


@torch.no_grad()
def on_int4_grid(weight: torch.Tensor, group_size: int = AUTO_GROUP_SIZE) -> bool:
    """Does INT4 with an offset, in groups of `group_size` along the input, hold `weight`
    exactly? Each group's codes are (w - min) / step with step = (max - min) / 15: on the grid
    every code is an integer."""
    rows, width = weight.shape
    if width % group_size:
        return False
    groups = weight.float().reshape(rows, width // group_size, group_size)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    codes = (groups - low) / step
    return bool(((codes - codes.round()).abs() <= GRID_SLACK).all())


def choose_format(model: nn.Module, device: torch.device) -> FormatChoice:
    """ "auto" for this loaded (fp32) model on `device`: see the module docstring."""
    fp32 = "none", AUTO_GROUP_SIZE, "fp32"
    if device.type != "cpu":
        return FormatChoice(*fp32, f"{device.type}: the model's own dtype")
    if not like_the_measured_cpu():
        return FormatChoice(
            *fp32, "this CPU runs torch's fused INT4/INT8 ops as scalar loops, slower than fp32"
        )
    layers = quantizable_layers(model)
    off_grid = next((name for name, layer in layers if not on_int4_grid(layer.weight)), None)
    if not layers or off_grid is not None:
        where = f" ({off_grid} is not)" if off_grid else ""
        why = f"the weights are not on a 4-bit grid{where}: INT4 would cost more than KL {KL_BOUND}"
        return FormatChoice(*fp32, why)
    why = (
        f"the weights sit on INT4-asym g{AUTO_GROUP_SIZE}'s grid, so it holds them exactly; "
        f"bf16 activations and LM head cost under KL {KL_BOUND} per token"
    )
    return FormatChoice("int4-asym", AUTO_GROUP_SIZE, "bf16", why)
