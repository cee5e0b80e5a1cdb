"""Feature combinations the engine refuses, each with the reason and what to do instead.

`EngineConfig.__post_init__` checks each field on its own (a range, a choice). What is checked
here is a combination: a switch that needs another one, or a topology that one `LLMEngine`
cannot be. Keeping these rules apart from the fields keeps config.py a list of switches, and
gives each later stage one place to add the combinations its technique rules out.
"""

from __future__ import annotations

from typing import Any  # each check takes an EngineConfig: config.py imports these (no circle)


def check_one_engine(config: Any) -> None:
    """An `LLMEngine` is one engine of one replica: refuse a config that asks for several, and
    say which front end runs them."""
    if config.data_parallel_size > 1:  # one engine is one replica
        raise ValueError(
            "LLMEngine runs one replica; for data_parallel_size > 1 serve it (python -m "
            "stages 10 serve --config data_parallel_size=2) or use DPClient"
        )


def check_checkpoint(config: Any, num_experts: int) -> None:
    """What the checkpoint rules out, refused before any rank starts: expert parallelism
    splits experts, so a dense model (`num_experts` 0) has none to split unless its MLP is
    cut into experts (`moe_split_experts`)."""
    dense = not num_experts
    if config.expert_parallel and dense and config.moe_split_experts is None:
        raise ValueError(
            f"expert_parallel=True needs a mixture-of-experts checkpoint, and {config.model!r} "
            "is dense: every rank would hold the whole model and exchange nothing. Use a MoE "
            "checkpoint (Mixtral, Qwen3-MoE), split the dense MLP into experts "
            "(moe_split_experts=N), or leave expert_parallel off"
        )
