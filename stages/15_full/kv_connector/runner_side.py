"""The worker side of the KV connector, built for one rank's model runner.

Each rank runs its own connector worker over its own shard of the KV cache: the host tier
(offload/connector.py) holds `kv_offload_bytes` of this rank's blocks, and from stage 13 a transport
to another engine (a prefill or a decode role, disagg/transfer_worker.py) takes its place. The
runner starts the transfers a step's metadata names and reports what they did
(`take_kv_connector_output`).
"""

from __future__ import annotations

from ..config import EngineConfig
from ..disagg.transfer_worker import TransferConnectorWorker
from ..kv_cache import PagedKVCache
from ..offload.connector import OffloadingConnectorWorker
from ..quant.kv_cache import QuantizedPagedKVCache, block_tensors
from .base import KVConnectorWorker

KVCache = PagedKVCache | QuantizedPagedKVCache


def make_kv_connector(config: EngineConfig, kv_cache: KVCache) -> KVConnectorWorker | None:
    """The worker side of the connector: a prefill or decode role's transport to the other
    engine (stage 13); else the host tier, `kv_offload_bytes` of this rank's block shape
    (the same count on every rank, since their blocks are equal in size). None without."""
    if config.kv_role != "both":
        assert config.kv_transfer_address is not None  # the config checked it
        worker = TransferConnectorWorker(
            config.kv_transfer_address, config.kv_role, config.kv_transfer_timeout_seconds
        )
        worker.register_kv_caches(kv_cache)
        return worker
    if not config.kv_offload_bytes:
        return None
    # A block's bytes in every tensor that holds it: K, V (and a quantized cache's scales).
    per_block = sum(t[:, 0].numel() * t.element_size() for t in block_tensors(kv_cache))
    num_host_blocks = config.kv_offload_bytes // per_block
    if num_host_blocks < 1:
        raise ValueError(
            f"kv_offload_bytes={config.kv_offload_bytes} holds no KV block of {per_block} "
            "bytes: raise it, or set it to 0 for no host tier"
        )
    connector = OffloadingConnectorWorker(num_host_blocks)
    connector.register_kv_caches(kv_cache)
    return connector
