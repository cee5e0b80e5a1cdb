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
  (`model_loader.py`) writes each of the checkpoint's separate matrices into its place in the fused
  one (under tensor parallelism, only this rank's rows of it).
- Linear layers are `stages.common.linear.Linear`: an `nn.Linear` that, on a CPU, packs its
  weight once for oneDNN (`prepare_linears`), the fastest matmul there; on a GPU, `F.linear`.
- On CUDA the elementwise work between the matmuls runs as three fused Triton kernels
  (`fused_kernels.py`: the residual add with the RMSNorm after it, SiLU times up, RoPE with the
  K/V write); a CPU runs their PyTorch references, the same calls as before they existed.
  A layer's last residual add is left to the next norm (`DecoderLayer.forward` returns the MLP
  output and the residual stream apart, vLLM's convention), so every add rides in an
  `add_rms_norm`: per layer and decode step, 9 kernels on CUDA (add+norm, qkv, RoPE+K/V write,
  attention, o_proj, add+norm, gate_up, SiLU*up, down), 4 of them matmuls.
- The math follows transformers' numerics (RMSNorm in fp32, RoPE's rotate-half layout) so the
  logits match it to float rounding.
- Tensor parallelism (stage 09): the linears, the embedding and the LM head are the sharded
  layers of `parallel/layers.py`. A model built with `tp=TPGroup(rank, size, group)` holds its
  rank's heads, MLP columns and vocabulary rows, and exchanges activations twice per layer;
  with the default single-process group every layer is stage 08's, with no collective.
- Mixture of experts (stage 11): a layer listed in `config.moe_layers` has a `SparseMoE`
  (moe/layer.py) where the dense MLP was; `moe=MoESettings(split_experts=n)` runs a dense model's
  MLP as n experts. Under expert parallelism (`ep` of size > 1) attention is replicated (`tp` of
  size 1) and each rank holds its share of the experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.linear import Linear
from stages.common.model_config import ModelConfig, RopeScaling

from .fused_kernels import add_rms_norm, rope_and_cache, silu_mul, use_triton
from .kernels import decode_attention_rope_cache_triton, paged_attention
from .kv_cache import PagedKVCache
from .moe.expert_parallel import EPGroup
from .moe.layer import MoESettings, SparseMoE, split_dense_config
from .parallel.group import SINGLE_PROCESS, TPGroup
from .parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    bind_weight_loaders,
)
from .quant.kv_cache import QuantizedPagedKVCache, blocks_in_use


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
    """Grouped-query attention over this rank's heads: its query heads and the KV heads they
    read (`num_heads`, `num_kv_heads` are the local counts; the KV cache holds these)."""

    def __init__(
        self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding, tp: TPGroup
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.attention_bias, tp=tp,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, bias=config.attention_bias, tp=tp
        )
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
        k_cache = v_cache = None
        block_tables = meta.block_tables
        plain = not isinstance(kv_cache, QuantizedPagedKVCache)  # stage 14: codes and scales
        if kv_cache is not None and meta.slot_mapping is not None and plain and use_triton(qk):
            # CUDA: the rotation and the K/V write in one kernel (fused_kernels.py).
            k_cache, v_cache = kv_cache.k[self.layer_index], kv_cache.v[self.layer_index]
            decoding = 0 < num_tokens == len(meta.query_lens)  # one new token per sequence
            if decoding and meta.attention_backend == "triton" and meta.block_tables is not None:
                # A decode step: the rotation and the write folded into attention (kernels.py).
                out = decode_attention_rope_cache_triton(
                    qk, v, positions, self.rotary.cos_sin, k_cache, v_cache, meta.slot_mapping,
                    meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
                    max_seq_len=max(meta.context_lens) + 1,
                )  # fmt: skip
                return self.o_proj(out.reshape(num_tokens, self.q_size))
            q, k = rope_and_cache(
                qk, v, positions, self.rotary.cos_sin, self.num_heads, k_cache, v_cache,
                meta.slot_mapping,
            )  # fmt: skip
        else:
            # q and k heads are rotated together: one pass instead of two.
            q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            if kv_cache is not None and meta.slot_mapping is not None:  # new K/V into blocks
                kv_cache.write(self.layer_index, k, v, meta.slot_mapping)
                k_cache, v_cache = kv_cache.k[self.layer_index], kv_cache.v[self.layer_index]
                if isinstance(kv_cache, QuantizedPagedKVCache) and block_tables is not None:
                    # stage 14: 1-byte codes; attend over the step's blocks, dequantized (as
                    # many as the host's lengths say: a count read from the device is a sync)
                    num_used = blocks_in_use(
                        meta.query_lens, meta.context_lens, kv_cache.block_size
                    )
                    k_cache, v_cache, block_tables = kv_cache.step_blocks(
                        self.layer_index, block_tables, q.dtype, meta.seq_lens, num_used
                    )
        out = paged_attention(
            q, k, v, k_cache, v_cache,
            meta.query_start_loc, meta.seq_lens, block_tables, self.scale,
            query_lens=meta.query_lens, context_lens=meta.context_lens,
            backend=meta.attention_backend,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul (of this
    rank's intermediate columns: silu(gate) * up is elementwise, so no exchange is needed
    before down_proj, whose all-reduce sums the ranks' parts)."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # one kernel on CUDA


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        moe: MoESettings,
        ep: EPGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = layer_index in config.moe_layers
        self.mlp: nn.Module = SparseMoE(config, moe, ep) if sparse else MLP(config, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: PagedKVCache | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it). The layer leaves its last residual add to
        whoever normalises next (the next layer's input norm, or the final norm), which does
        the add and the norm in one kernel on CUDA: vLLM's `residual` convention. `residual`
        is None for the first layer, whose `hidden` is the embedding."""
        norm = self.input_layernorm
        if residual is None:
            residual, normed = hidden, norm(hidden)
        else:  # the previous layer's add and this norm: one kernel on CUDA
            residual, normed = add_rms_norm(residual, hidden, norm.weight, norm.eps)
        attended = self.self_attn(positions, normed, kv_cache, meta)
        norm = self.post_attention_layernorm  # the add and the norm: one kernel on CUDA
        residual, normed = add_rms_norm(residual, attended, norm.weight, norm.eps)
        return self.mlp(normed), residual


def final_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The last layer's residual add and the final RMSNorm (one kernel on CUDA); a model run
    with no layer normalises the embedding."""
    if residual is None:
        return norm(hidden)
    return add_rms_norm(residual, hidden, norm.weight, norm.eps)[1]


class CausalLM(nn.Module):
    """The whole decoder. `forward` returns hidden states; `compute_logits` applies the head.

    With `tp` of size > 1 this is rank `tp.rank`'s shard; `compute_logits` still returns the
    full vocabulary's logits on every rank."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        tp: TPGroup = SINGLE_PROCESS,
        moe: MoESettings = MoESettings(),  # noqa: B008 (frozen)
        ep: EPGroup | None = None,
    ) -> None:
        super().__init__()
        if ep is not None and ep.size > 1 and tp.size > 1:
            raise ValueError("expert parallelism here replicates attention: tp must be 1")
        config = split_dense_config(config, moe)
        self.config, self.moe = config, moe
        self.tp = tp
        self.ep = ep or EPGroup()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, tp, moe, self.ep) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        self.tie_weights()
        self.checkpoint_bytes_read = 0  # set by the loader: this rank's reads from the files
        self.weight_format: Any = None  # quant/auto.py's FormatChoice, set by the loader

    def tie_weights(self) -> None:
        """A tied LM head reuses the embedding matrix (SmolLM2 does): one tensor, two roles
        (per rank, the same vocabulary rows). Every parameter then gets its weight loader."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        bind_weight_loaders(self)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.bind_shard_ids()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache | None,
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden].
        `num_layers` runs only the first layers (the draft model of stage 08)."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers[:num_layers]:
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return final_norm(self.norm, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab_size]: every word's logit, on every rank."""
        return self.lm_head(hidden)

    def prepare_linears(self, backend: str, head_dtype: torch.dtype | None = None) -> None:
        """Pack every linear layer's weight for `backend` ('onednn'; 'torch' keeps them); the
        LM head's in `head_dtype` where given (quantization="auto": bf16)."""
        if backend == "onednn":
            for module in self.modules():
                if module is self.lm_head and head_dtype is not None:
                    module.prepack(compute_dtype=head_dtype)
                elif isinstance(module, Linear):
                    module.prepack()

    def decode_weight_bytes(self) -> int:
        """Bytes one decode step must read on this rank: every matmul weight of its shard (the
        LM head included) and the norms. The embedding lookup reads a single row: not counted."""
        norms = sum(
            m.weight.numel() * m.weight.element_size()
            for m in self.modules()
            if isinstance(m, RMSNorm)
        )
        experts = sum(
            m.w13.nbytes + m.w2.nbytes for m in self.modules() if isinstance(m, SparseMoE)
        )  # all of this rank's experts, though a step reads only those its tokens chose
        linears = sum(m.weight_bytes() for m in self.modules() if isinstance(m, Linear))
        return norms + experts + linears
