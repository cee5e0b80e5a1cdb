"""What each weight format costs in quality, on the embedded SmolLM2-135M and a fixed text.

Every nn.Linear of the decoder layers of a plain Hugging Face model gets the dequantized
weight of its format (the numbers a quantized matmul computes with: `test_quant.py` checks that
every matmul path equals dequantize-then-matmul), the LM head and embedding stay as they are
(tied), and the model is compared with its unquantized self:

Three more rows run the fast CPU ops themselves (`cpu_paths`), to see what their bf16 or int8
activations add to the weight format's own error.

- KL(p_fp32 || p_quant) of the next-token distributions over the text, mean and max;
- perplexity of the text, and its change;
- greedy agreement over 64 tokens: the fp32 model's greedy continuation of a prompt, then the
  quantized model teacher-forced on it (share of positions whose argmax agrees) and free
  running (how many tokens it matches before the first difference).

Caveat: the embedded checkpoint is itself a Q4_1 GGUF (groups of 32 along the input dimension,
w = q * d + m): its "fp32" weights already lie on a 16-level grid per group of 32. INT4
asymmetric with group 32 finds the same grid and is near lossless HERE, and larger groups
inherit part of that luck; on a checkpoint trained in bf16 they would not. Read the INT4 rows
as a lower bound of the damage.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/quant/measure_quality.py
"""

from __future__ import annotations

import argparse
import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stages.common.weights import resolve_model

cpu_paths = importlib.import_module("stages.14_quant.quant.cpu_paths")
_formats = importlib.import_module("stages.14_quant.quant.formats")
quantize_fp8, quantize_int4, quantize_int8 = (
    _formats.quantize_fp8,
    _formats.quantize_int4,
    _formats.quantize_int8,
)
weight_bytes = importlib.import_module("stages.14_quant.quant.linear").weight_bytes

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth for the lens. From the gallery he could see the whole bay: the fishing "
    "boats returning with their catch, the ferry crossing to the island, and far out, the grey "
    "line where the sea met the sky. In winter the storms came from the north and the waves "
    "broke over the rocks below, throwing spray as high as the lamp room. He kept a logbook of "
    "every ship that passed, the weather at each watch, and the hours the light had burned. "
    "After forty years he knew the rhythm of the tides better than the names of his neighbours "
    "in the village. When the lighthouse was finally automated, he was asked to train the "
    "engineers who installed the new equipment. He showed them how the clockwork had turned "
    "the great lens, how to trim the wick, and where the draughts came in through the old "
    "window frames. Then he walked down the stairs for the last time and did not look back."
)
PROMPT = "Explain in a few sentences why the sky is blue."
GREEDY_TOKENS = 64


@dataclass(frozen=True)
class Variant:
    label: str
    fmt: str
    group_size: int = 0
    symmetric: bool = True
    path: str | None = None  # run this cpu_paths matmul instead of loading dequantized weights


VARIANTS = (
    Variant("int8 per-channel", "int8"),
    Variant("fp8 e4m3 per-channel", "fp8"),
    *(
        Variant(f"int4 {'sym' if sym else 'asym'} g{g}", "int4", g, sym)
        for sym in (True, False)
        for g in (32, 64, 128)
    ),
    Variant("int8, bf16 activations (int8pack)", "int8", path="int8_weight_int8pack_mm_bf16"),
    Variant("int8 W8A8 dynamic (fbgemm)", "int8", path="w8a8_fbgemm_linear_dynamic"),
    Variant(
        "int4 asym g64, bf16 activations (int4pack)",
        "int4",
        64,
        False,
        path="int4_weight_int4pack_mm_for_cpu_bf16",
    ),
)


def quantized(w: torch.Tensor, variant: Variant) -> object:
    """The variant's weight object. Group 128 does not divide 576 (SmolLM2's hidden size):
    those layers take group 64, the largest that does."""
    if variant.fmt == "int8":
        return quantize_int8(w)
    if variant.fmt == "fp8":
        return quantize_fp8(w)
    group = variant.group_size if w.shape[1] % variant.group_size == 0 else 64
    return quantize_int4(w, group, variant.symmetric)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in f".{name}"
    }


def _path_forward(path: cpu_paths.CpuPath, weight: object):
    state = path.prepare(weight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = path.run(x.reshape(-1, x.shape[-1]), state)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


@torch.no_grad()
def apply_variant(model: nn.Module, originals: dict[str, torch.Tensor], variant: Variant | None):
    """Load each decoder linear with its dequantized weight (None: the originals). Returns
    (bytes of the quantized linears, mean relative weight error)."""
    total_bytes, errors = 0, []
    for name, module in decoder_linears(model).items():
        w = originals[name]
        module.__dict__.pop("forward", None)  # undo a previous variant's path
        if variant is None:
            module.weight.copy_(w)
            total_bytes += w.numel() * 4
            continue
        q = quantized(w, variant)
        dq = cpu_paths.dequantize(q)
        module.weight.copy_(dq)
        if variant.path is not None:  # the real matmul op (its activation rounding included)
            module.forward = _path_forward(cpu_paths.registry().by_name[variant.path], q)
        total_bytes += weight_bytes(q)
        errors.append(((dq - w).norm() / w.norm()).item())
    return total_bytes, (sum(errors) / len(errors) if errors else 0.0)


@torch.no_grad()
def log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model(ids).logits[0].float(), dim=-1)


@torch.no_grad()
def greedy(model: nn.Module, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, ids.shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    originals = {n: m.weight.detach().clone() for n, m in decoder_linears(model).items()}
    text_ids = tokenizer(TEXT, return_tensors="pt").input_ids
    chat = [{"role": "user", "content": PROMPT}]
    prompt_ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]

    fp32_bytes, _ = apply_variant(model, originals, None)
    ref_logp = log_probs(model, text_ids)
    targets = text_ids[0, 1:]
    ref_nll = -ref_logp[:-1].gather(1, targets[:, None]).mean().item()
    ref_continuation = greedy(model, prompt_ids, GREEDY_TOKENS)
    forced_ids = torch.cat([prompt_ids, ref_continuation[None]], dim=1)
    start = prompt_ids.shape[1] - 1  # logits at these positions predict the continuation

    print(f"model {folder.name}; text {text_ids.shape[1]} tokens; fp32 ppl {math.exp(ref_nll):.3f}")
    print(f"fp32 greedy: {tokenizer.decode(ref_continuation)!r}")
    print()
    print(
        "| format | linear weights MB | weight rel. error | KL mean | KL max | ppl | ppl delta "
        "| teacher-forced agreement | free-run tokens matched |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| fp32 | {fp32_bytes / 1e6:.1f} | 0 | 0 | 0 | {math.exp(ref_nll):.3f} | 0 "
        f"| {GREEDY_TOKENS}/{GREEDY_TOKENS} | {GREEDY_TOKENS} |"
    )
    for variant in VARIANTS:
        size, weight_error = apply_variant(model, originals, variant)
        logp = log_probs(model, text_ids)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
        nll = -logp[:-1].gather(1, targets[:, None]).mean().item()
        forced = log_probs(model, forced_ids)[start : start + GREEDY_TOKENS].argmax(dim=-1)
        agree = int((forced == ref_continuation).sum())
        free = greedy(model, prompt_ids, GREEDY_TOKENS)
        differs = (free != ref_continuation).nonzero()
        matched = GREEDY_TOKENS if differs.numel() == 0 else int(differs[0, 0])
        ppl = math.exp(nll)
        print(
            f"| {variant.label} | {size / 1e6:.1f} | {weight_error:.4f} | {kl.mean():.5f} "
            f"| {kl.max():.4f} | {ppl:.3f} | {ppl - math.exp(ref_nll):+.3f} "
            f"| {agree}/{GREEDY_TOKENS} | {matched} |",
            flush=True,
        )
    apply_variant(model, originals, None)


if __name__ == "__main__":
    main()
