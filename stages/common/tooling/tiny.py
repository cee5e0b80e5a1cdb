"""Tiny random-weight checkpoints for tests.

Written by transformers itself (fixed seed, a couple of layers, a byte-level vocabulary), so the
oracle and the engine read exactly the same files. Each spec stresses one thing that a from-scratch
forward gets wrong easily: grouped-query attention, an untied LM head, head counts that are not
powers of two, a head_dim that is not hidden/heads, attention biases, Qwen3's per-head q/k
norms, Llama-3 RoPE scaling, Mixtral's and Qwen3-MoE's sparse experts. They run in milliseconds
on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Shape of a tiny checkpoint; `extra` goes straight into the transformers config."""

    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    init_std: float = 0.15  # large enough that greedy argmaxes are not near-ties
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


TINY_SPECS: dict[str, TinySpec] = {
    "llama-gqa": TinySpec(),
    "llama-mha-untied": TinySpec(num_kv_heads=4, tie_word_embeddings=False),
    "llama-odd-heads": TinySpec(hidden_size=72, num_heads=9, num_kv_heads=3, num_layers=3),
    "llama-gqa4-headdim": TinySpec(hidden_size=96, num_heads=12, num_kv_heads=3, head_dim=16),
    "llama-mqa": TinySpec(num_kv_heads=1),
    # Tensor parallelism at TP=3: heads, KV heads and MLP columns divide by 3 (the vocabulary,
    # 259, does not: padded). llama-gqa and llama-mqa cover KV heads equal to and fewer than
    # two ranks.
    "llama-tp3": TinySpec(
        hidden_size=72, num_heads=9, num_kv_heads=3, intermediate_size=96, num_layers=3
    ),
    # Attention biases (Llama's `attention_bias`: q, k, v and o_proj; Qwen2-style q/k/v biases
    # are real). Random, never zero (transformers initialises biases to zero), so a bias a rank
    # never loads shows. MQA: the one KV head (its k/v bias too) replicated at TP=2 and TP=3;
    # bias-tp3: three KV heads split at TP=3.
    "llama-bias-mqa": TinySpec(
        hidden_size=72,
        num_heads=6,
        num_kv_heads=1,
        intermediate_size=96,
        extra={"attention_bias": True},
    ),
    "llama-bias-tp3": TinySpec(
        hidden_size=72,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=96,
        extra={"attention_bias": True},
    ),
    "llama3-rope": TinySpec(
        extra={
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        }
    ),
    "qwen3": TinySpec(family="qwen3", head_dim=32, tie_word_embeddings=False, rope_theta=1e6),
    # Sparse MoE (stage 11): 5 experts so that two expert ranks hold 3 and 2 (E % EP != 0).
    "mixtral": TinySpec(
        family="mixtral",
        intermediate_size=32,
        extra={"num_local_experts": 5, "num_experts_per_tok": 2},
    ),
    "qwen3-moe": TinySpec(
        family="qwen3_moe",
        head_dim=32,
        tie_word_embeddings=False,
        num_layers=3,
        extra={
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],  # one dense layer between sparse ones
        },
    ),
    "qwen3-moe-unnormed": TinySpec(
        family="qwen3_moe",
        head_dim=32,
        tie_word_embeddings=False,
        extra={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer with ChatML specials: every string encodes, vocabulary 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def make_tiny_checkpoint(out_dir: str | Path, spec: TinySpec | str = "llama-gqa") -> Path:
    """Write a random-weight checkpoint + tokenizer in Hugging Face layout; return its folder."""
    import transformers

    if isinstance(spec, str):
        spec = TINY_SPECS[spec]
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tokenizer = build_byte_tokenizer()
    common = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        rope_theta=spec.rope_theta,
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        **spec.extra,
    )
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown tiny family {spec.family!r}")
    config_name, model_name = FAMILIES[spec.family]
    config = getattr(transformers, config_name)(**common)
    model_class = getattr(transformers, model_name)
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases too, so a missing one cannot hide
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, spec.init_std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return out
