"""Deployment presets: one name for the switches a scenario wants, with the reason for each.

A preset fills the `EngineConfig` fields that are left at their defaults; a field set explicitly
keeps its value (`EngineConfig(preset="long-context", kv_offload_bytes=2**31)`). A field set to
its default value explicitly cannot be told apart from one left alone, so the preset wins there:
to switch a preset's technique off, use no preset and name the switches.

The reasons are the earlier stages' measurements on this project's CPU (their READMEs); on a GPU
the same switches are the usual choice for the same reasons, at other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Preset:
    scenario: str
    settings: dict[str, Any] = field(default_factory=dict)
    why: str = ""


PRESETS: dict[str, Preset] = {
    "chatbot": Preset(
        "one device, few users at a time, chats that share a system prompt and quote earlier turns",
        {"prefix_caching": True, "chunked_prefill": True, "speculative": "ngram"},
        "prefix hits cut TTFT 14x on a shared 1,000-token prefix (stage 07); n-gram drafts "
        "give 1.26x on chat and 2.8x on copy-heavy answers at batch 1 (stage 08), and cost "
        "little when few requests share a step",
    ),
    "api": Preset(
        "many concurrent users on several devices, tenants with their own system prompts",
        {"data_parallel_size": 2, "routing_policy": "cache_aware", "async_scheduling": True},
        "one replica per device, requests routed to the replica that holds their prefix: 87.8% "
        "vs 27.9% prefix hits round-robin (stage 10); no speculation, which gains nothing "
        "at batch 8 (stage 08)",
    ),
    "long-context": Preset(
        "long prompts and long chats on one device, more context than the KV pool holds",
        {
            "chunked_prefill": True,
            "long_prefill_token_threshold": 256,
            "kv_cache_dtype": "int8",
            "kv_offload_bytes": 2**30,
            "preemption_mode": "swap",
        },
        "chunks keep running streams moving while a long prompt arrives (stage 06); int8 KV "
        "holds 3.98x the tokens (stage 14); a host tier keeps evicted prefixes and swapped "
        "requests instead of recomputing them (stage 12)",
    ),
    "moe": Preset(
        "a mixture-of-experts checkpoint (Mixtral, Qwen3-MoE) over two devices",
        {"tensor_parallel_size": 2, "expert_parallel": True, "moe_dispatch": "all_to_all"},
        "each rank holds half the experts and receives only the tokens routed to them "
        "(stage 11); attention is replicated",
    ),
}


def preset_settings(name: str) -> dict[str, Any]:
    """The settings of preset `name`; a clear error for an unknown one."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name].settings)
