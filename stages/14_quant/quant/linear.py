"""Per-layer linear methods in vLLM's shape: create the weights, process them once loaded, apply.

A layer does not know its format; it owns a `LinearMethod` that (vLLM's `LinearMethodBase`):

1. `create_weights(layer, in_features, out_features, **attrs)` registers an fp32 `weight`
   parameter of this rank's shard shape and hangs `attrs` on it (stage 09's `weight_loader` and
   `shard_ids`), so the loader fills it exactly as it fills an unquantized layer;
2. `process_weights_after_loading(layer, row_amax_reducer)` quantizes the loaded shard, drops
   the fp32 weight and prepares the operands of the matmul it will use;
3. `apply(layer, x, bias)` computes x @ W.T (+ bias) from the quantized operands.

This is online quantization of a float checkpoint: each rank quantizes its own shard, so the
formats compose with tensor parallelism without a quantized checkpoint per TP size. What holds:

- Column-parallel (rows of W): every scale belongs to one output row, so quantizing the shard
  gives exactly the shard of the quantized whole, for every format.
- Row-parallel (columns of W), per-channel formats (INT8, FP8): a row's scale is its amax over
  ALL columns, which a rank does not see. Quantizing alone, a rank uses its local amax: still a
  correct quantization (error <= local scale / 2, never worse), but not the whole's bytes. Pass
  `row_amax_reducer` (an all-reduce MAX over the TP group) and the shard is bit-identical.
- Row-parallel, INT4 groups: groups run along K, so a shard is exact iff its width
  K / TP is a multiple of the group size (groups never straddle ranks). Otherwise this raises:
  SmolLM2's o_proj at TP=2 has 288 columns per rank, fine for group 32, not for 64 or 128.

In the engine (`quantize_model`), the loader fills each sharded layer's fp32 weight exactly as
in stage 13, then every column- and row-parallel layer of the decoder gets a method and
quantizes its shard. vLLM creates the method with the layer, because its checkpoints may
already be quantized (weights created in the quantized shape); a float checkpoint quantized
online needs the method only after loading. Not quantized: the LM head (tied to the embedding
in SmolLM2; vLLM also keeps it in full precision by default), the MoE routers and experts
(moe/layer.py's stacked [E, N, K] would quantize per expert; left in fp32 here).

Backends: "reference" dequantizes and runs F.linear (the definition); "auto" runs the fastest
correct CPU path measured in `quant_cpu_paths.FASTEST` for the batch and the activations allowed
(`activations="bf16"` lets x be rounded to bf16, which the fast INT8/INT4 CPU ops need), or the
Triton kernel on CUDA; a CPU path that raises (an instruction this CPU lacks) hands its layer,
and every later one, to its format's portable path; "triton" forces the kernel (on a CPU only
under TRITON_INTERPRET=1); any `quant_cpu_paths` name forces that path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.layers import RowParallelLinear, _ShardedLinear
from . import cpu_paths
from .formats import INT4_GROUP_SIZES, quantize_fp8, quantize_int4, quantize_int8

AmaxReducer = Callable[[torch.Tensor], torch.Tensor]
BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class QuantConfig:
    fmt: str = "fp32"  # fp32 | int8 | int4 | fp8
    group_size: int = 128  # INT4 only
    symmetric: bool = False  # INT4 only; INT8 and FP8 are always symmetric
    backend: str = "auto"
    activations: str = "fp32"  # "bf16": "auto" may round x to bf16 (the fast CPU INT4/INT8 ops)

    def __post_init__(self) -> None:
        if self.fmt not in cpu_paths.FORMATS:
            raise ValueError(f"fmt must be one of {cpu_paths.FORMATS}, got {self.fmt!r}")
        if self.fmt == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"INT4 group_size must be one of {INT4_GROUP_SIZES}")
        if self.activations not in ("fp32", "bf16"):
            raise ValueError(f"activations must be fp32 or bf16, got {self.activations!r}")
        if self.backend in BACKENDS:
            return
        paths = cpu_paths.registry()  # a named path: probed here, before any weight is loaded
        if self.backend in paths.unavailable:
            raise ValueError(
                f"backend {self.backend!r} cannot run on this machine "
                f"({paths.unavailable[self.backend]})"
            )
        if self.backend not in paths.by_name:
            raise ValueError(f"unknown backend {self.backend!r}")


class LinearMethod:
    """One format's create / process / apply. The fp32 method is the plain layer."""

    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        dtype: torch.dtype = torch.float32,
        **weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        for name, value in weight_attrs.items():
            setattr(weight, name, value)
        layer.register_parameter("weight", weight)
        layer.in_features, layer.out_features = in_features, out_features

    def quantize(self, weight: torch.Tensor, row_amax: torch.Tensor | None) -> Any:
        """The loaded fp32 shard -> this format's weight object."""
        return weight.float()

    @torch.no_grad()
    def process_weights_after_loading(
        self, layer: nn.Module, row_amax_reducer: AmaxReducer | None = None
    ) -> None:
        weight = layer.weight.detach()
        row_amax = None
        if row_amax_reducer is not None and self.config.fmt in ("int8", "fp8"):
            row_amax = row_amax_reducer(weight.abs().amax(dim=1).float())
        quantized = self.quantize(weight, row_amax)
        del layer.weight
        layer.register_parameter("weight", None)
        layer.quant_weight = quantized
        layer.quant_states = self._prepare(quantized, weight.device)

    def _prepare(self, quantized: Any, device: torch.device) -> dict[str, tuple[Any, Any]]:
        """Operands for every path `apply` may take: name -> (path or None, state). The
        reference (the weight object itself) is added only when a wanted path cannot take this
        shape. (`layer.quant_weight` keeps the weight object for inspection; stage 14 should
        drop it where a prepared path holds its own copy, or the layer holds the weight twice.)
        """
        backend = self.config.backend
        if backend in ("reference", "triton") or (backend == "auto" and device.type == "cuda"):
            use_triton = backend != "reference" and self.config.fmt != "fp32"
            return {"triton" if use_triton else "reference": (None, quantized)}
        states: dict[str, tuple[Any, Any]] = {}
        for rows in (1, 32):  # asked after each: a path that failed over is not offered again
            name = backend if backend != "auto" else self._fastest(rows)
            if name not in states:
                self._add_state(states, name, quantized)
        return states

    def _add_state(self, states: dict[str, tuple[Any, Any]], name: str, quantized: Any) -> None:
        """Prepare path `name` for this weight into `states` (the reference where the path
        cannot take its shape); one that raises fails over to its format's portable path."""
        path = cpu_paths.registry().by_name[name]
        if not path.needs(quantized):
            if self.config.backend != "auto":
                raise ValueError(f"backend {name} cannot take this layer's weight")
            states["reference"] = (None, quantized)
            return
        try:
            states[name] = (path, path.prepare(quantized))
        except Exception as exc:
            self._fail_over(name, exc)
            self._add_state(states, cpu_paths.PORTABLE[self.config.fmt], quantized)

    def _fail_over(self, name: str, error: Exception) -> None:
        """`name` raised: a path this machine cannot run at this layer's shape. Under "auto" it
        leaves the run (`Registry.disable`); a forced backend says why it failed. Running out of
        memory is one large batch's trouble, not the path's: it is raised, the path stays."""
        if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
            raise error
        if self.config.backend != "auto":
            raise ValueError(f"backend {name} failed on this machine: {error}") from error
        cpu_paths.registry().disable(name, error)

    def _fastest(self, rows: int) -> str:
        return cpu_paths.fastest_path(self.config.fmt, rows, self.config.activations).name

    def _pick(self, layer: nn.Module, rows: int) -> tuple[str, Any, Any]:
        states = layer.quant_states
        wanted = self.config.backend
        if wanted == "auto" and "triton" not in states:  # a CPU: the rule's path for the rows
            wanted = self._fastest(rows)
            runs = cpu_paths.registry().by_name
            if any(name not in runs for name in states if name != "reference"):
                # a path failed over: drop its operands (the portable one may be held already)
                states = {n: s for n, s in states.items() if n in runs or n == "reference"}
                layer.quant_states = states
            if wanted not in states and "reference" not in states:
                self._add_state(states, wanted, layer.quant_weight)
        name = wanted if wanted in states else next(reversed(states))
        return name, *states[name]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's [tokens, features]: a decode row pays for no reshape
        rows = (x if flat else x.reshape(-1, x.shape[-1])).float()  # bf16 model: paths take fp32
        name, path, state = self._pick(layer, rows.shape[0])
        if name == "reference":
            y = F.linear(rows, cpu_paths.dequantize(state))
        elif name == "triton":
            from .kernels import dequant_matmul_triton

            y = dequant_matmul_triton(rows, state)
        else:
            try:
                y = path.run(rows, state)
            except Exception as exc:  # a portable path's error is re-raised by `disable`
                self._fail_over(name, exc)
                return self.apply(layer, x, bias)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype) if flat else y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes a matmul of `layer` reads: its quantized codes and their scales (and offsets)."""
        return weight_bytes(layer.quant_weight)


class Int8LinearMethod(LinearMethod):
    def quantize(self, weight: torch.Tensor, row_amax: torch.Tensor | None) -> Any:
        return quantize_int8(weight, row_amax)


class Int4LinearMethod(LinearMethod):
    def quantize(self, weight: torch.Tensor, row_amax: torch.Tensor | None) -> Any:
        return quantize_int4(weight, self.config.group_size, self.config.symmetric)


class Fp8LinearMethod(LinearMethod):
    def quantize(self, weight: torch.Tensor, row_amax: torch.Tensor | None) -> Any:
        return quantize_fp8(weight, row_amax)


METHODS: dict[str, type[LinearMethod]] = {
    "fp32": LinearMethod,
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
    "fp8": Fp8LinearMethod,
}


def amax_reducer_for(tp: Any) -> AmaxReducer:
    """A row-parallel layer's reducer from stage 09's `TPGroup`, whose all-reduce only sums:
    all-gather every rank's per-row amax (N floats, once, at load time) and take the max."""
    return lambda amax: tp.all_gather(amax[:, None], dim=1).amax(dim=1)


def linear_method(config: QuantConfig) -> LinearMethod:
    return METHODS[config.fmt](config)


class QuantLinear(nn.Module):
    """A linear layer whose weight goes through a `LinearMethod` (what stage 14's sharded
    layers will become: the same loaders, a method instead of a bare weight)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: QuantConfig):
        super().__init__()
        self.method = linear_method(config)
        self.method.create_weights(self, in_features, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features), False) if bias else None

    def process_weights_after_loading(self, row_amax_reducer: AmaxReducer | None = None) -> None:
        self.method.process_weights_after_loading(self, row_amax_reducer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


def weight_bytes(quantized: Any) -> int:
    """Bytes of a weight object's tensors (codes plus scales and offsets)."""
    if isinstance(quantized, torch.Tensor):
        return quantized.numel() * quantized.element_size()
    tensors = [v for v in vars(quantized).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- the engine's side ------------------------------------------------------------------------

# EngineConfig.quantization -> (format, symmetric). "int4" is symmetric (scales only), as GPTQ's
# and AWQ's kernels mostly run it; "int4-asym" adds a per-group offset (gpt-fast's and torch's).
ENGINE_FORMATS: dict[str, tuple[str, bool]] = {
    "int8": ("int8", True),
    "int4": ("int4", True),
    "int4-asym": ("int4", False),
    "fp8": ("fp8", True),
}


def quant_config_for(quantization: str, group_size: int, activations: str) -> QuantConfig | None:
    """EngineConfig's switches -> the layers' QuantConfig; None for "none" (stage 13)."""
    if quantization == "none":
        return None
    if quantization not in ENGINE_FORMATS:
        raise ValueError(f"quantization must be 'none' or one of {tuple(ENGINE_FORMATS)}")
    fmt, symmetric = ENGINE_FORMATS[quantization]
    return QuantConfig(fmt, group_size, symmetric, activations=activations)


def quantizable_layers(model: nn.Module) -> list[tuple[str, _ShardedLinear]]:
    """(name, layer) of every column- and row-parallel linear layer: attention's qkv and o,
    the dense MLP's gate_up and down."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _ShardedLinear)]


def check_group_size(name: str, layer: _ShardedLinear, config: QuantConfig) -> None:
    """INT4 groups run along the input: the group size must divide this rank's input width."""
    width = layer.weight.shape[1]
    if config.fmt == "int4" and width % config.group_size:
        split = isinstance(layer, RowParallelLinear) and layer.tp.size > 1
        shard = f" (this rank's 1/{layer.tp.size} of {width * layer.tp.size})" if split else ""
        raise ValueError(
            f"quant_group_size={config.group_size} does not divide the input width of {name}: "
            f"{width}{shard}; choose a group size that divides it"
        )


@torch.no_grad()
def quantize_model(model: nn.Module, config: QuantConfig) -> None:
    """Quantize every sharded linear's loaded shard in place (checked first, all or none).

    A row-parallel layer under TP reduces its per-row amax over the ranks first
    (`amax_reducer_for`), so its INT8 / FP8 scales are the unsharded model's."""
    layers = quantizable_layers(model)
    for name, layer in layers:
        check_group_size(name, layer, config)
    for _name, layer in layers:
        row_parallel = isinstance(layer, RowParallelLinear) and layer.tp.size > 1
        reducer = amax_reducer_for(layer.tp) if row_parallel else None
        method = linear_method(config)
        method.process_weights_after_loading(layer, reducer)
        layer.quant_method = method


def held_bytes(layer: nn.Module) -> int:
    """Bytes a quantized layer holds: its weight object and every path's prepared operand,
    each storage counted once (a path that runs on the weight object itself adds nothing)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            try:
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            except NotImplementedError:  # oneDNN's packed weight is opaque: count its elements
                seen[id(value)] = value.numel() * value.element_size()
        elif isinstance(value, tuple | list):
            for item in value:
                visit(item)
        elif hasattr(value, "__dataclass_fields__"):
            visit(list(vars(value).values()))

    visit(layer.quant_weight)
    for _path, state in layer.quant_states.values():
        visit(state)
    return sum(seen.values())
