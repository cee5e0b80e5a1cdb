"""The model's shape, read from a Hugging Face `config.json`.

Every stage builds the same decoder-only transformer from this one description, so parsing lives
here, once. Supported families: Llama (SmolLM2, TinyLlama, Llama 3) and Qwen3 dense, which adds an
RMSNorm on each query and key head; from stage 11, the sparse Mixtral and Qwen3-MoE (the MoE
fields: zero experts means a dense model, and stages before 11 refuse a model with experts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "mixtral", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How rotary position frequencies are stretched for long contexts (HF `rope_scaling`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder, independent of any framework."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0  # sparse MoE: experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # columns of one expert
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is sparse

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding/LM head once."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * bytes_per_element

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        )
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = int(raw["num_hidden_layers"])
        num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        dense_layers = set(raw.get("mlp_only_layers") or ())
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        moe_layers = tuple(
            i
            for i in range(num_layers)
            if num_experts and i not in dense_layers and (i + 1) % sparse_step == 0
        )
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_scaling=scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=num_experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", model_type == "mixtral")),
            moe_layers=moe_layers,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        raw = json.loads((folder / "config.json").read_text())
        gen_file = folder / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.exists() else None
        return cls.from_dict(raw, generation)
