"""Engine configuration: one frozen dataclass, validated once, shared by every component."""

from __future__ import annotations

from dataclasses import dataclass

from stages.common.weights import DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build the engine.

    `use_kv_cache=False` recomputes the whole sequence at every step: it exists only so the
    benchmark can show what the KV cache saves.
    """

    model: str = DEFAULT_MODEL
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    use_kv_cache: bool = True
    seed: int = 0  # seeds requests that bring no seed of their own
    served_model_name: str | None = None  # the name the HTTP API answers to
    linear_backend: str = "auto"  # auto: oneDNN-packed weights on CPU, F.linear elsewhere

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
