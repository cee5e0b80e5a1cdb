"""The KV cache: keys and values of every past token, kept so decode never recomputes them.

Without it, producing token n means running the model over all n tokens again (O(n^2) work for a
whole answer). With it, each step runs the model over one new token and reads the stored K/V.

This first version is the simplest one: one contiguous buffer per request, reserved up front for
the longest the request can grow (prompt + max_tokens). Stage 03 shows what that reservation
costs when many requests share the memory, and replaces it with fixed-size blocks.
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    """K and V of one sequence: `[num_layers, capacity, num_kv_heads, head_dim]` each."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def store(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's K/V of the new tokens at positions start.. ; return that layer's
        K/V of every position up to the last new one (cached context + new tokens)."""
        end = start + k.shape[0]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} tokens > capacity {self.capacity}")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    @property
    def reserved_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
