"""A Llama-family decoder written from scratch in PyTorch.

embedding -> N x [RMSNorm -> attention (RoPE, grouped-query) -> residual ->
                 RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head

Tensors are flat over tokens: `[num_tokens, ...]`, no batch dimension. A batch is sequences
packed end to end, as in vLLM: each contributes its new tokens (a whole prompt, or one token of a
decode). `AttentionMetadata` says which token belongs to which sequence and where its K/V go in
the paged cache.

Two choices a reader of Hugging Face's Llama will notice:
- q, k and v come from one fused matmul (`qkv_proj`), and gate and up from another
  (`gate_up_proj`): fewer, larger matmuls read the weights once per step. `load_weights`
  (`model_loader.py`) concatenates the checkpoint's separate matrices.
- Linear layers are `stages.common.linear.Linear`: an `nn.Linear` that, on a CPU, packs its
  weight once for oneDNN (`prepare_linears`), the fastest matmul there; on a GPU, `F.linear`.
- The math follows transformers' numerics (RMSNorm in fp32, RoPE's rotate-half layout) so the
  logits match it to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.linear import Linear
from stages.common.model_config import ModelConfig, RopeScaling

from .kernels import paged_attention
from .kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """How one forward's flat token batch maps onto sequences and the paged KV cache.

    Every sequence is described the same way, whatever its number of new tokens: a fresh
    prompt, a decode, or new tokens continuing a cached context (vLLM V1's metadata).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens of each sequence
    block_tables: torch.Tensor | None  # [num_seqs, max_blocks] int32 (None: no cache)
    slot_mapping: torch.Tensor | None  # [num_tokens] cache slot of each new token's K/V
    query_lens: tuple[int, ...]  # host copies of the new-token and cached counts, so the CPU
    context_lens: tuple[int, ...]  # path picks its fast paths without a device sync
    attention_backend: str = "torch"  # "triton" kernel or the "torch" path (kernels.py)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (statistics in fp32 whatever the activation dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """One rotation frequency per pair of dimensions, with the checkpoint's scaling applied."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend in between.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position-dependent angles (RoPE), from a precomputed cos/sin table.

    Dimension i is paired with i + head_dim/2 (the "rotate-half" layout of transformers):
        out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]
    The table stores sin with the first half negated, so rotate_half becomes a plain roll.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, 2, head_dim), persistent=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        """(Re)compute the table in fp32 on the buffer's device; the model calls it after
        materialising itself from the meta device."""
        if self.cos_sin.is_meta:
            return
        device = self.cos_sin.device
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.cos_sin.shape[0], dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)  # [positions, head_dim / 2]
        self.cos_sin[:, 0] = torch.cat([angles.cos(), angles.cos()], dim=-1)
        self.cos_sin[:, 1] = torch.cat([-angles.sin(), angles.sin()], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [tokens, heads, head_dim] (q and k heads may be stacked together)."""
        cos, signed_sin = self.cos_sin[positions].unsqueeze(2).unbind(1)  # [tokens, 1, dim]
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: PagedKVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: norm each head
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k heads are rotated together: one pass instead of two.
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        k_cache = v_cache = None
        if kv_cache is not None and meta.slot_mapping is not None:  # new K/V into their blocks
            kv_cache.write(self.layer_index, k, v, meta.slot_mapping)
            k_cache, v_cache = kv_cache.k[self.layer_index], kv_cache.v[self.layer_index]
        out = paged_attention(
            q, k, v, k_cache, v_cache,
            meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            query_lens=meta.query_lens, context_lens=meta.context_lens,
            backend=meta.attention_backend,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: PagedKVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The whole decoder. `forward` returns hidden states; `compute_logits` applies the head."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """A tied LM head reuses the embedding matrix (SmolLM2 does): one tensor, two roles."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def prepare_linears(self, backend: str) -> None:
        """Pack every linear layer's weight for `backend` ('onednn'; 'torch' keeps them)."""
        if backend == "onednn":
            for module in self.modules():
                if isinstance(module, Linear):
                    module.prepack()

    def decode_weight_bytes(self) -> int:
        """Bytes one decode step must read: every matmul weight (the LM head included) and the
        norms. The embedding lookup reads a single row, so it does not count."""
        norms = sum(
            m.weight.numel() * m.weight.element_size()
            for m in self.modules()
            if isinstance(m, RMSNorm)
        )
        return norms + sum(m.weight_bytes() for m in self.modules() if isinstance(m, Linear))
