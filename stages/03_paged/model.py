"""A Llama-family decoder written from scratch in PyTorch.

embedding -> N x [RMSNorm -> attention (RoPE, grouped-query) -> residual ->
                 RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head

Tensors are flat over tokens: `[num_tokens, ...]`, no batch dimension. A batch is sequences
packed end to end, as in vLLM: the prompts being prefilled first, then one token per decoding
sequence. `AttentionMetadata` says which token belongs where, and where its K/V go in the paged
cache.

Two choices a reader of Hugging Face's Llama will notice:
- q, k and v come from one fused matmul (`qkv_proj`), and gate and up from another
  (`gate_up_proj`): fewer, larger matmuls read the weights once per step. `load_weights`
  concatenates the checkpoint's separate matrices.
- Linear layers are `stages.common.linear.Linear`: an `nn.Linear` that, on a CPU, packs its
  weight once for oneDNN (`prepare_linears`), the fastest matmul there; on a GPU, `F.linear`.
- The math follows transformers' numerics (RMSNorm in fp32, RoPE's rotate-half layout) so the
  logits match it to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.linear import Linear
from stages.common.model_config import ModelConfig, RopeScaling
from stages.common.weights import load_state_dict

from .kernels import paged_attention
from .kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """How one forward's flat token batch maps onto sequences and the paged KV cache.

    Tokens come in two groups: first whole prompts being prefilled, back to back
    (`prefill_lens`); then one token per decoding sequence (`block_tables`, `context_lens`).
    """

    slot_mapping: torch.Tensor | None  # [num_tokens] cache slot for each token's K/V (None:
    # a prefill-only forward that keeps nothing, as `LLM.prompt_logits` runs)
    prefill_lens: tuple[int, ...] = ()  # tokens of each prompt at the start of the batch
    block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32 block ids
    context_lens: torch.Tensor | None = None  # [num_decodes] int32 tokens each decode sees
    attention_backend: str = "torch"  # "triton" kernel or "torch" reference for decodes


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
    """Rotates q and k by position-dependent angles (RoPE), from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        """(Re)compute the table in fp32 on the buffers' device; the model calls it after
        materialising itself from the meta device."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.cos.shape[0], dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: [f0..fn, f0..fn]
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of the last `q.shape[0]` positions over all `k.shape[0]` positions.

    q: [tokens, heads, head_dim]; k, v: [context, kv_heads, head_dim] with context >= tokens.
    Query i sits at position context - tokens + i and sees keys up to and including itself.
    Grouped-query attention: query head h reads kv head h // (heads // kv_heads).
    """
    num_tokens, num_heads, head_dim = q.shape
    context, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    if num_tokens == 1:
        # Decode: one query per head. Group the query heads by the kv head they share, so two
        # small batched matmuls do the work without copying K/V `group` times.
        q = q.view(num_kv_heads, group, head_dim)
        scores = torch.bmm(q, k.permute(1, 2, 0)) * head_dim**-0.5  # [kv_heads, group, context]
        out = torch.bmm(scores.softmax(dim=-1), v.transpose(0, 1))  # [kv_heads, group, dim]
        return out.view(1, num_heads, head_dim)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    mask = None
    if num_tokens < context:  # a causal mask whose diagonal is offset by the cached prefix
        offset = context - num_tokens
        rows = torch.arange(num_tokens, device=q.device)[:, None] + offset
        mask = torch.arange(context, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(0, 1)


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
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: norm each head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if kv_cache is not None and meta.slot_mapping is not None:
            kv_cache.write(self.layer_index, k, v, meta.slot_mapping)  # into their blocks
        out = torch.empty_like(q)
        start = 0
        for length in meta.prefill_lens:  # a prompt attends causally to itself, nothing else
            end = start + length
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end])
            start = end
        if meta.block_tables is not None and kv_cache is not None:  # decodes read their blocks
            out[start:] = paged_attention(
                q[start:],
                kv_cache.k[self.layer_index],
                kv_cache.v[self.layer_index],
                meta.block_tables,
                meta.context_lens,
                self.scale,
                meta.attention_backend,
            )
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


def load_weights(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face state dict into the model, fusing q/k/v and gate/up as we go."""
    params = dict(model.named_parameters())
    filled: set[str] = set()

    def put(name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"checkpoint tensor has no place in the model: {name}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        filled.add(name)

    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, tensor in state_dict.items():
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            target, index = fused[parts[-2]]
            key = ".".join([*parts[:-2], target, parts[-1]])
            pending.setdefault(key, {})[index] = tensor
        else:
            put(name, tensor)
    for key, pieces in pending.items():
        put(key, torch.cat([pieces[i] for i in sorted(pieces)], dim=0))
    missing = set(params) - filled
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_model(
    folder: Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    linear_backend: str = "torch",
) -> CausalLM:
    """Build the model on `device`, fill it from the folder's safetensors, pack its linears."""
    with torch.device("meta"):  # no time spent on a random init that the checkpoint overwrites
        model = CausalLM(config, max_positions)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the head a tensor of its own
    model.rotary.reset_table()
    load_weights(model, load_state_dict(folder, device))
    model = model.to(dtype).eval().requires_grad_(False)
    model.prepare_linears(linear_backend)
    return model
