"""Hugging Face transformers as the oracle: same weights, reference logits and greedy tokens.

transformers is never the engine; tests and benchmarks use it to check and to compare against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Largest |logit difference| accepted between the engine and transformers, per dtype. fp32
# differences come from matmul blocking and fused projections (measured ~1e-4 on SmolLM2-135M).
LOGIT_ATOL = {torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 0.1}


def load_hf_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Any:
    """transformers' own model on the same checkpoint, in eval mode, on `device` (the CPU
    unless a GPU run asks for the engine's device: `pytest --device cuda`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


# The oracle's answers, by (model, question): the cumulative suite asks the same question of
# every stage, and transformers' answer does not depend on the stage. Each entry keeps its
# model, so an id is never reused for another model while its answers are kept.
_ANSWERS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _memo(kind: str, model: Any, token_ids: list[int], extra: int, compute: Any) -> Any:
    key = (kind, id(model), tuple(token_ids), extra)
    entry = _ANSWERS.get(key)
    if entry is None or entry[0] is not model:
        entry = _ANSWERS[key] = (model, compute())
    return entry[1]


@torch.inference_mode()
def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Logits `[len(token_ids), vocab]` for one sequence, in fp32 on the host (a fresh copy
    each call), wherever the model runs."""
    ids = torch.tensor([token_ids], device=model.device)
    logits = _memo(
        "logits", model, token_ids, 0, lambda: model(input_ids=ids).logits[0].float().cpu()
    )
    return logits.clone()


@torch.inference_mode()
def hf_greedy(model: Any, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """`transformers.generate` greedy continuation (stops at EOS like the engine does)."""
    ids = torch.tensor([token_ids], device=model.device)

    def generate() -> list[int]:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        return out[0, len(token_ids) :].tolist()

    return list(_memo("greedy", model, token_ids, max_new_tokens, generate))
