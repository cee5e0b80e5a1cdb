"""What `LLMEngine` shows of its parts, apart from the request lifecycle in engine.py.

Tests compare the engine with a reference model (`prompt_logits`), benchmarks read what it runs
on (`weight_bytes`, the backends), and the server lists its queues (`waiting`, `running`): each
reads the runner, the scheduler or the KV cache manager that the engine owns, and changes
nothing. `LLMEngine` inherits them from this base class, so that engine.py reads as the
lifecycle alone (vLLM's engine also keeps such accessors apart from its step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .kv_cache import KVCacheManager, PagedKVCache
    from .model_runner import ModelRunner
    from .parallel.executor import MultiprocExecutor, UniProcExecutor
    from .prefix_cache import PrefixCacheStats
    from .request import Request
    from .scheduler import Scheduler


class EngineViews:
    """Read-only views of the engine's parts (and `shutdown`, which stops them); the
    attributes are the engine's, set in its `__init__`."""

    runner: ModelRunner
    scheduler: Scheduler
    executor: UniProcExecutor | MultiprocExecutor
    kv_manager: KVCacheManager

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def linear_backend(self) -> str:
        return self.runner.linear_backend

    @property
    def waiting(self) -> list[Request]:
        return list(self.scheduler.waiting)

    @property
    def running(self) -> list[Request]:
        return list(self.scheduler.running)

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.kv_cache

    @property
    def block_size(self) -> int:
        return self.kv_manager.block_size

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of a sequence, for comparing against a reference model: in
        fp32 on the host, where the reference's are, whatever device the engine runs on."""
        return self.executor.call("prompt_logits", token_ids).cpu()  # every rank takes part

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache at admission, and how many hit."""
        return self.kv_manager.stats

    def shutdown(self) -> None:
        """Stop the executor's worker processes (also done when the engine is collected) and a
        transfer connector's transport."""
        self.executor.shutdown()
        close = getattr(self.runner.kv_connector, "close", None)
        if close is not None:
            close()

    def weight_bytes(self) -> int:
        """Bytes of weights each decode step must read from memory at least once."""
        return self.runner.model.decode_weight_bytes()
