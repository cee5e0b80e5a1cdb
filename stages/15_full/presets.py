"""Deployment presets: one name for the switches a scenario wants, with the reason for each.

A preset fills the `EngineConfig` fields the caller did not pass; a field passed explicitly keeps
its value, its default included (`EngineConfig(preset="long-context", kv_offload_bytes=2**31)`
keeps that host tier; `EngineConfig(preset="chatbot", speculative=None)` drafts nothing).

A setting may depend on the device (`PerDevice`, as `devices.py`'s defaults do): the
long-context cap is one CPU step's tokens on a CPU and one GPU step's on a GPU.

The reasons are the earlier stages' measurements on this project's CPU (their READMEs); on a GPU
the same switches are the usual choice for the same reasons, at other sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stages.common.devices import default_long_prefill_token_threshold


@dataclass(frozen=True, slots=True)
class PerDevice:
    """A setting whose value depends on the device, as `devices.py`'s defaults do: `pick`
    gives it for a device."""

    pick: Callable[[torch.device], Any]

    def __repr__(self) -> str:
        cpu, cuda = (self.pick(torch.device(kind)) for kind in ("cpu", "cuda"))
        return f"PerDevice({self.pick.__name__}: cpu {cpu}, cuda {cuda})"


@dataclass(frozen=True, slots=True)
class Preset:
    scenario: str
    settings: dict[str, Any] = field(default_factory=dict)  # a value, or PerDevice
    why: str = ""
    # What the settings switch on or off without naming it (the engine's own rules): said here
    # and in /health's resolved configuration (config.resolution_notes).
    implies: str = ""


# The largest batch that still gets drafts (measured on the CPU: README, 'Speculation by batch
# size').
SPECULATION_MAX_BATCH = 2

PRESETS: dict[str, Preset] = {
    "chatbot": Preset(
        "one device, few users at a time, chats that share a system prompt and quote earlier turns",
        {
            "prefix_caching": True,
            "chunked_prefill": True,
            "speculative": "ngram",
            "speculative_disable_batch_size": SPECULATION_MAX_BATCH,
        },
        "prefix hits cut TTFT 14x on a shared 1,000-token prefix (stage 07); n-gram drafts "
        "give 1.26x on chat and 2.8x on copy-heavy answers at batch 1 (stage 08); on chat "
        f"answers, above {SPECULATION_MAX_BATCH} running requests they cost more than they save "
        "(0.89x at 4, 0.7x at 16: README, 'Speculation by batch size'), so none are given there",
        f"async scheduling is off while at most {SPECULATION_MAX_BATCH} requests run: a step "
        "with drafts runs alone (its drafts need the step before it on the host); above it "
        "steps get no drafts and overlap, as without speculation (on a GPU: a CPU runs every "
        "step alone by default)",
    ),
    "api": Preset(
        "many concurrent users on several devices, tenants with their own system prompts",
        {"data_parallel_size": 2, "routing_policy": "cache_aware"},
        "one replica per device, requests routed to the replica that holds their prefix: 87.3% "
        "vs 28.0% prefix hits round-robin (stage 10); no speculation, which gains nothing "
        "at batch 8 (stage 08)",
    ),
    "long-context": Preset(
        "long prompts and long chats on one device, more context than the KV pool holds",
        {
            "chunked_prefill": True,
            "long_prefill_token_threshold": PerDevice(default_long_prefill_token_threshold),
            "kv_cache_dtype": "int8",
            "kv_offload_bytes": 2**30,
            "preemption_mode": "swap",
        },
        "chunks keep running streams moving while a long prompt arrives (stage 06); int8 KV "
        "holds 3.98x the tokens (stage 14); a host tier keeps evicted prefixes and swapped "
        "requests instead of recomputing them (stage 12); one request gets at most a default "
        "step's tokens (256 on a CPU, 2,048 on a GPU), so a second long prompt is not shut out "
        "when the budget is raised",
    ),
    "moe": Preset(
        "a mixture-of-experts checkpoint (Mixtral, Qwen3-MoE) over two devices",
        {"tensor_parallel_size": 2, "expert_parallel": True, "moe_dispatch": "all_to_all"},
        "each rank holds half the experts and receives only the tokens routed to them "
        "(stage 11); attention is replicated",
        "needs a mixture-of-experts checkpoint: a dense one is refused (both ranks would hold "
        "the whole model and exchange nothing); moe_split_experts=N splits a dense MLP",
    ),
}


def preset_settings(name: str, device: torch.device) -> dict[str, Any]:
    """The settings of preset `name` on `device` (a per-device setting resolved); a clear
    error for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
    return {
        key: value.pick(device) if isinstance(value, PerDevice) else value
        for key, value in PRESETS[name].settings.items()
    }
