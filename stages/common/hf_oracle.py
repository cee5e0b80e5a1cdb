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


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model on the same checkpoint, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Logits `[len(token_ids), vocab]` for one sequence, in fp32."""
    ids = torch.tensor([token_ids])
    return model(input_ids=ids).logits[0].float()


@torch.inference_mode()
def hf_greedy(model: Any, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """`transformers.generate` greedy continuation (stops at EOS like the engine does)."""
    ids = torch.tensor([token_ids])
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
