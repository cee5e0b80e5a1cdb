"""Linear layers on the fastest correct matmul the device offers.

On CUDA this is plain `F.linear` (cuBLAS). On x86 CPUs, PyTorch's `F.linear` goes through MKL,
which on the AMD EPYC that produced the committed plots runs skinny matmuls poorly: a batch-1
decode reached ~12 GB/s of weight streaming against ~25 GB/s of memory bandwidth, and batches of
4-64 rows were barely faster than one. oneDNN with the weight reordered once into its blocked
layout is 1.4x faster at batch 1 and up to 2x at small batches on that machine (and what
vLLM's CPU backend and torch.compile's CPU "freezing" use). So on a CPU with oneDNN and fp32
weights, `Linear.prepack` replaces the weight by its packed form; everywhere else, nothing
changes. Either way the math is the same `x @ W.T + b`; tests compare against transformers.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "torch")
_BATCH_HINT = 16  # oneDNN picks its blocking for this many rows; good from 1 to a few hundred
logger = logging.getLogger(__name__)


@functools.cache
def onednn_available() -> bool:
    """This build has oneDNN's packed linear and it runs here: tried once on a small weight, so
    that a build or CPU where it is present but fails (an Arm build without its kernels, say)
    takes `F.linear` instead of crashing at load."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        weight = torch.eye(16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        x = torch.arange(32.0).view(2, 16)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(y, x))
    except RuntimeError as exc:
        logger.info("oneDNN's packed linear does not run here (%s): F.linear instead", exc)
        return False


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto' -> 'onednn' for fp32 on a CPU that has it, else 'torch'."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_available()
    if name == "onednn" and not usable:
        raise ValueError("linear_backend='onednn' needs fp32 weights on a CPU with oneDNN")
    if name == "auto":
        return "onednn" if usable else "torch"
    return name


class Linear(nn.Linear):
    """`nn.Linear` whose weight can be packed once for oneDNN (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("packed_weight", None, persistent=False)
        self.compute_dtype: torch.dtype | None = None  # set by prepack: x is cast to it

    @torch.no_grad()
    def prepack(
        self, source: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None
    ) -> None:
        """Pack `source` (default: this layer's weight) for oneDNN and drop the dense copy.

        A tied LM head passes the embedding matrix, which stays where it is for lookups.
        `compute_dtype` (bf16) packs a rounded copy and runs the matmul in it: half the bytes
        a step reads, for a rounding of weights and inputs (stage 15's LM head under
        quantization="auto")."""
        weight = self.weight if source is None else source
        if compute_dtype is not None:
            weight = weight.to(compute_dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.packed_weight, self.compute_dtype = packed, compute_dtype
        self.weight = None  # type: ignore[assignment]  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # oneDNN's op takes [rows, features]
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            return self.forward(x.to(self.compute_dtype)).to(x.dtype)
        x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def weight_bytes(self) -> int:
        weight = self.packed_weight if self.packed_weight is not None else self.weight
        return weight.numel() * weight.element_size()
