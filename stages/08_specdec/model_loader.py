"""Loading a Hugging Face checkpoint into the from-scratch model of `model.py`.

The checkpoint stores q, k, v and gate, up as separate matrices; the model fuses each group into
one matmul, so `load_weights` concatenates them on the way in. `load_model` builds the model on
the meta device first (no time spent on a random init the checkpoint overwrites), fills it, and
packs its linear layers for the fastest matmul of the device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stages.common.model_config import ModelConfig
from stages.common.weights import load_state_dict

from .model import CausalLM


def load_weights(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face state dict into the model, fusing q/k/v and gate/up as we go."""
    params = dict(model.named_parameters())
    filled: set[str] = set()

    def put(name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"checkpoint tensor has no place in the model: {name}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        filled.add(name)

    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, tensor in state_dict.items():
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            target, index = fused[parts[-2]]
            key = ".".join([*parts[:-2], target, parts[-1]])
            pending.setdefault(key, {})[index] = tensor
        else:
            put(name, tensor)
    for key, pieces in pending.items():
        put(key, torch.cat([pieces[i] for i in sorted(pieces)], dim=0))
    missing = set(params) - filled
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_model(
    folder: Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    linear_backend: str = "torch",
) -> CausalLM:
    """Build the model on `device`, fill it from the folder's safetensors, pack its linears."""
    with torch.device("meta"):  # no time spent on a random init that the checkpoint overwrites
        model = CausalLM(config, max_positions)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the head a tensor of its own
    model.rotary.reset_table()
    load_weights(model, load_state_dict(folder, device))
    model = model.to(dtype).eval().requires_grad_(False)
    model.prepare_linears(linear_backend)
    return model
