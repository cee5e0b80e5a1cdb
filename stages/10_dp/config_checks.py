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
