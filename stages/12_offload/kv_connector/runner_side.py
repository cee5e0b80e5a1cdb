"""The worker side of the KV connector, built for one rank's model runner.

Each rank runs its own connector worker over its own shard of the KV cache: the host tier
(offload/connector.py) holds `kv_offload_bytes` of this rank's blocks. The runner starts the
transfers a step's metadata names and reports what they did (`take_kv_connector_output`).
"""

from __future__ import annotations

from ..config import EngineConfig
from ..kv_cache import PagedKVCache
from ..offload.connector import OffloadingConnectorWorker
from .base import KVConnectorWorker


def make_kv_connector(config: EngineConfig, kv_cache: PagedKVCache) -> KVConnectorWorker | None:
    """The worker side of the host tier: `kv_offload_bytes` of this rank's block shape (the
    same count on every rank, since their blocks are equal in size). None without one."""
    if not config.kv_offload_bytes:
        return None
    k = kv_cache.k
    per_block = 2 * k[:, 0].numel() * k.element_size()
    num_host_blocks = config.kv_offload_bytes // per_block
    if num_host_blocks < 1:
        raise ValueError(
            f"kv_offload_bytes={config.kv_offload_bytes} holds no KV block of {per_block} "
            "bytes: raise it, or set it to 0 for no host tier"
        )
    connector = OffloadingConnectorWorker(num_host_blocks)
    connector.register_kv_caches(kv_cache)
    return connector
