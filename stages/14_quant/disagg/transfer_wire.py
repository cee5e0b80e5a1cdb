"""The wire format of a KV transfer: what both ends check before a byte of KV moves.

disagg/transport.py moves the bytes; this module says what they must look like. A pair of engines
swaps its pools' layouts once at start-up (`encode_layout`); every request's messages then go
under their own gloo tag (`transfer_tag`) and start with a header (`encode_header`: request id,
block count, layout, payload bytes) that the receiver compares with what it expects
(`check_header`), so a stale or foreign message is refused, never scattered into cache blocks.
"""

from __future__ import annotations

import zlib

import torch

from ..kv_connector.base import KVPool  # a PagedKVCache has the same `k` and `v`: tests pass one
from ..quant.kv_cache import block_tensors
from .kv_staging import layouts, plan_transfer

MAX_ID_BYTES = 96
HANDSHAKE_TAG, FIRST_TAG = 0, 2  # tag 1: the bench's "go"; 2 and up: one per request
LAYOUT_FIELDS = 32
MAGIC = 0x4B56_5846  # "KVXF"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)


class TransferError(RuntimeError):
    """A transfer failed: the peer died or went silent, or the two sides disagreed."""


class TransferRefused(TransferError):
    """The sender has no KV for the request (its lease ran out, or it was aborted): it sent a
    header naming no blocks. The stream between the two ends is still in step."""


def pool_tensors(pool: KVPool) -> tuple[torch.Tensor, ...]:
    """Every tensor that holds a block's state, each [num_layers, num_blocks, ...]: K, V, and a
    quantized pool's scales (`block_tensors`)."""
    return block_tensors(pool)


def transfer_tag(request_id: str) -> int:
    """The gloo tag of a request's messages: its own, so a failed transfer's stale messages
    never match another request's (0 is the handshake's, 1 the bench's)."""
    return FIRST_TAG + zlib.crc32(request_id.encode()) % (2**31 - FIRST_TAG)


def check_pool(pool: KVPool) -> None:
    """At start-up: a pool this transport can move (CPU or CUDA tensors of a known dtype)."""
    for tensor in pool_tensors(pool):
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"a KV transfer moves blocks of {_DTYPES}, not {tensor.dtype}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"a KV transfer stages blocks through host memory from cpu or cuda, not "
                f"{tensor.device}"
            )


def encode_layout(pool: KVPool) -> torch.Tensor:
    """What both ends of a pair must share: per block tensor its dtype code and its shape
    without the block count (the two pools may hold different numbers of blocks)."""
    fields = [MAGIC]
    for tensor in pool_tensors(pool):
        shape = tensor.shape[:1] + tensor.shape[2:]
        fields += [_DTYPES.index(tensor.dtype), len(shape), *shape]
    layout = torch.zeros(LAYOUT_FIELDS, dtype=torch.long)
    layout[: len(fields)] = torch.tensor(fields)
    return layout


def encode_header(request_id: str, pool: KVPool, num_blocks: int) -> torch.Tensor:
    """[magic, blocks, dtype, layers, block_size, kv_heads, head_dim, id length, payload
    bytes, id bytes...]: the payload is the staged message that follows (none: a refusal).

    The codes' dtype tells a float cache from an int8 or fp8 one (stage 14; fp8 travels as its
    uint8 bits), and the payload's size counts the scales, so two engines whose
    `kv_cache_dtype` differ refuse each other's blocks."""
    raw = request_id.encode()
    if len(raw) > MAX_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_ID_BYTES} bytes: {request_id!r}")
    tensors = pool_tensors(pool)
    if pool.k.dtype not in _DTYPES:
        raise ValueError(f"a KV transfer moves blocks of {_DTYPES}, not {pool.k.dtype}")
    layers, _, block_size, heads, dim = pool.k.shape
    payload = plan_transfer(layouts(tensors), range(num_blocks)).nbytes if num_blocks else 0
    fields = [MAGIC, num_blocks, _DTYPES.index(pool.k.dtype), layers, block_size, heads, dim]
    header = torch.zeros(9 + MAX_ID_BYTES, dtype=torch.long)
    header[:9] = torch.tensor([*fields, len(raw), payload])
    header[9 : 9 + len(raw)] = torch.tensor(list(raw))
    return header


def check_header(header: torch.Tensor, request_id: str, pool: KVPool, num_blocks: int) -> None:
    """Raise TransferRefused for the sender's refusal (no blocks), TransferError for a header
    that disagrees with what this end expects."""
    expected = encode_header(request_id, pool, num_blocks)
    if num_blocks and torch.equal(header, encode_header(request_id, pool, 0)):
        raise TransferRefused(f"{request_id}: the sender has no KV for it")
    if not torch.equal(header, expected):
        length = min(max(int(header[7]), 0), MAX_ID_BYTES)
        got = bytes(header[9 : 9 + length].clamp(0, 255).tolist()).decode(errors="replace")
        raise TransferError(
            f"header mismatch: expected {request_id!r}, {num_blocks} blocks, "
            f"layout {expected[2:7].tolist()}, {int(expected[8])} bytes; got {got!r}, "
            f"{int(header[1])} blocks, layout {header[2:7].tolist()}, {int(header[8])} bytes"
        )
