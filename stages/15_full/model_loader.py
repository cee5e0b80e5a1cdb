"""Loading a Hugging Face checkpoint into the from-scratch model of `model.py`, one rank's shard.

The checkpoint stores q, k, v and gate, up as separate matrices; the model fuses each group into
one matmul. Under tensor parallelism the split must come first: rank r's fused qkv_proj holds
ITS query heads, then ITS KV heads (for k, then for v), which no slice of a fused full matrix
gives. So every checkpoint tensor goes to its parameter's `weight_loader` (parallel/layers.py)
with a shard id ("q", "k", "v"; 0, 1 for gate, up), and the loader copies this rank's rows or
columns into that shard's place: shard first, then fuse, in one copy.

The files are read lazily (`open_checkpoint`): a rank reads only the bytes of its slices, about
1/TP of the checkpoint (plus the replicated norms). `load_model` builds the model on the meta
device first (no time spent on a random init the checkpoint overwrites), fills it, and packs its
linear layers for the fastest matmul of the device.

Sparse MoE layers (stage 11) take Mixtral's `block_sparse_moe.experts.e.w1/w3/w2` and Qwen3-MoE's
`mlp.experts.e.gate_proj/up_proj/down_proj` as shards of the stacked `w13` / `w2` (gate 2e, up
2e + 1, down e); a rank reads only its own experts. A dense MLP split into experts
(`MoESettings.split_experts`) takes the dense matrices whole and cuts them into column slices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import torch

from stages.common.model_config import ModelConfig
from stages.common.weights import open_checkpoint

from .model import CausalLM
from .moe.expert_parallel import EPGroup
from .moe.layer import MoESettings, SparseMoE
from .parallel.group import SINGLE_PROCESS, TPGroup
from .parallel.layers import ShardId, TensorSource
from .quant.auto import choose_format
from .quant.linear import QuantConfig, quantize_model

# Checkpoint matrix -> (the model's fused parameter, the shard it fills).
FUSED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# An expert's matrix in the checkpoint -> (the stacked parameter, gate 0 / up 1 / down 0).
EXPERT_PARTS: dict[str, tuple[str, int]] = {
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", 0),  # Mixtral
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),  # Qwen3-MoE
}
SPLIT_DENSE = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down")}


def parameter_for(hf_name: str, split_dense: bool = False) -> tuple[str, ShardId]:
    """A Hugging Face tensor name -> (the model's parameter name, shard id or None).
    `split_dense`: the dense MLP's matrices go to the experts they are split into."""
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) >= 5 and parts[-4] == "experts":  # layers.i.mlp.experts.e.w1.weight
        target, part = EXPERT_PARTS[parts[-2]]
        expert = int(parts[-3])
        shard = 2 * expert + part if target == "w13" else expert
        return ".".join([*parts[:-4], target]), shard
    if len(parts) >= 2 and parts[-2] == "gate" and parts[-3] == "mlp":  # the router
        return ".".join([*parts[:-2], "router", parts[-1]]), None
    if split_dense and len(parts) >= 2 and parts[-2] in SPLIT_DENSE:
        target, which = SPLIT_DENSE[parts[-2]]
        return ".".join([*parts[:-2], target]), which
    if len(parts) >= 2 and parts[-2] in FUSED:
        target, shard_id = FUSED[parts[-2]]
        return ".".join([*parts[:-2], target, parts[-1]]), shard_id
    return name, None


def load_weights(
    model: CausalLM,
    tensors: Mapping[str, TensorSource] | Iterable[tuple[str, TensorSource]],
) -> None:
    """Hand every checkpoint tensor (a state dict, or lazy (name, tensor) pairs) to its
    parameter's weight loader, which takes this rank's part. A tensor with no place, a shape
    that differs from the checkpoint's, or a parameter (shard) left unfilled: ValueError."""
    params = dict(model.named_parameters())
    split_dense = model.moe.split_experts is not None
    expected = {(name, shard) for name, p in params.items() for shard in p.shard_ids}
    filled: set[tuple[str, ShardId]] = set()
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for hf_name, tensor in items:
        name, shard_id = parameter_for(hf_name, split_dense)
        if "rotary_emb" in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor has no place in the model: {hf_name}")
        param = params[name]
        try:
            param.weight_loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(f"{hf_name}: {exc}") from exc
        filled.add((name, shard_id))
    missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in expected - filled)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_model(
    folder: Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    linear_backend: str = "torch",
    tp: TPGroup = SINGLE_PROCESS,
    moe: MoESettings = MoESettings(),  # noqa: B008 (frozen)
    ep: EPGroup | None = None,
    quant: QuantConfig | Literal["auto"] | None = None,
) -> CausalLM:
    """Build rank `tp.rank`'s shard of the model on `device`, fill it from the folder's
    safetensors (reading only its slices; `model.checkpoint_bytes_read` says how much),
    quantize its sharded linears when `quant` says so (quant/linear.py), pack the others."""
    with torch.device("meta"):  # no time spent on a random init that the checkpoint overwrites
        model = CausalLM(config, max_positions, tp, moe, ep)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the head a tensor of its own (and dropped the loaders)
    model.rotary.reset_table()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.reset_maps()
    with open_checkpoint(folder) as checkpoint:
        load_weights(model, checkpoint.tensors())
        model.checkpoint_bytes_read = checkpoint.bytes_read
    model = model.to(dtype).eval().requires_grad_(False)
    head_dtype = None
    if quant == "auto":  # stage 15: the format that keeps this checkpoint's outputs here
        model.weight_format = choose_format(model, device)
        quant, head_dtype = model.weight_format.quant_config(), model.weight_format.head_dtype
    if quant is not None:  # stage 14: each rank quantizes its loaded shards
        quantize_model(model, quant)
    model.prepare_linears(linear_backend, head_dtype)  # packs what stayed (the LM head, routers)
    return model
