"""Stage 14 benchmark: what each weight format and KV format buys and costs, in
one run, on the embedded SmolLM2-135M.

Per variant (format, group size, activations, KV dtype), one engine, measured in turn:
1. bytes per decode token: every weight a batch-1 step reads (`decode_weight_bytes`: the
   quantized decoder linears, the fp32 LM head (113 MB, never quantized here), the norms);
2. weight memory held (every parameter, buffer and prepared operand, each storage once; the
   tied embedding and fp32 LM head count twice, as oneDNN packs its own copy of the head, and
   INT4 with fp32 activations holds two layouts: torch's int4pack tiles for batch 1 and the
   plain codes that the batch-32 path dequantizes);
3. KV capacity: tokens one 1 GiB KV budget holds (`kv_cache_block_bytes`);
4. decode tokens/s at batch 1 and 32: (time of N+1 tokens - time of 1 token) / N per step;
5. quality against the fp32 engine on a fixed text, teacher-forced through the KV cache (a
   prefill, then one decode step per token): mean KL, perplexity and its change, share of
   positions whose argmax agrees; and free-running greedy tokens matched before the first
   difference;
6. the batch-1 roofline: a copy of a large buffer measures the bandwidth B (read + write);
   a memory-bound decode step cannot beat bytes-per-token / B, and the table says what share
   of that bound each variant reaches.
Caveat: the embedded checkpoint is a dequantized Q4_1 GGUF (INT4 groups of 32 with an offset),
so "int4-asym g32" lands on its exact grid and is lossless; it says nothing about INT4 on a
model trained in bf16. Group 128 does not divide SmolLM2's 576: its row records the refusal.

    python -m stages 14 bench [--quick]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results

from .llm import LLM
from .model import AttentionMetadata
from .parallel.layers import _ShardedLinear
from .quant.kv_cache import kv_cache_block_bytes, make_kv_cache
from .quant.linear import held_bytes
from .sampling import SamplingParams

NAME = "14_quant"
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of "
    "oil and a cloth for the lens. From the gallery he could see the whole bay: the fishing "
    "boats returning with their catch, the ferry crossing to the island, and far out, the grey "
    "line where the sea met the sky. In winter the storms came from the north and the waves "
    "broke over the rocks below, throwing spray as high as the lamp room. He kept a logbook of "
    "every ship that passed, the weather at each watch, and the hours the light had burned."
)
PROMPT = "Explain in a few sentences why the sky is blue."
KV_BUDGET = 2**30  # capacity is reported per GiB of KV budget
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": {"quantization": "int8"},
    "int8 bf16-act": {"quantization": "int8", "quant_activations": "bf16"},
    "fp8": {"quantization": "fp8"},
    "int4 g32": {"quantization": "int4", "quant_group_size": 32},
    "int4 g64": {"quantization": "int4", "quant_group_size": 64},
    "int4 g128": {"quantization": "int4", "quant_group_size": 128},  # refused: 576 % 128
    "int4-asym g32": {"quantization": "int4-asym", "quant_group_size": 32},
    "int4-asym g64": {"quantization": "int4-asym", "quant_group_size": 64},
    "int4-asym g64 bf16-act": {
        "quantization": "int4-asym",
        "quant_group_size": 64,
        "quant_activations": "bf16",
    },
    "kv int8": {"kv_cache_dtype": "int8"},
    "kv fp8": {"kv_cache_dtype": "fp8"},
}
QUICK_VARIANTS = ("fp32", "int8", "int4-asym g32", "int4 g128", "kv int8")


def _log(message: str) -> None:
    print(f"[bench 14] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "variants": list(QUICK_VARIANTS if quick else VARIANTS),
        "decode_steps": 4 if quick else 24,
        "big_batch": 8 if quick else 32,
        "teacher_forced_decode_positions": 8 if quick else 48,
        "text_tokens_max": 48 if quick else 160,
        "greedy_tokens": 8 if quick else 32,
        "repeats": 1 if quick else 2,
    }


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + write), the best of `repeats`."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best


def memory_held(model: torch.nn.Module) -> int:
    """Every parameter, buffer and quantized operand of the model, each storage counted once."""
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        try:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except NotImplementedError:  # oneDNN's packed weight is opaque: count its elements
            storages[id(tensor)] = tensor.numel() * tensor.element_size()
    quantized = sum(
        held_bytes(m)
        for m in model.modules()
        if isinstance(m, _ShardedLinear) and m.quant_method is not None
    )
    return sum(storages.values()) + quantized


@torch.inference_mode()
def cached_logits(llm: LLM, ids: list[int], decode_positions: int) -> torch.Tensor:
    """Teacher-forced logits at every position, through a fresh cache of the engine's KV dtype:
    a prefill, then one decode step per token for the last `decode_positions` tokens."""
    runner, block = llm.runner, 16
    mc = runner.model.config
    blocks = -(-len(ids) // block)
    cache = make_kv_cache(
        llm.config.kv_cache_dtype,
        mc.num_layers,
        blocks,
        block,
        mc.num_kv_heads,
        mc.head_dim,
        runner.dtype,
        runner.device,
    )
    table = torch.arange(blocks, dtype=torch.int32)[None]
    prefill = len(ids) - decode_positions
    rows = []
    for start, end in [(0, prefill), *((p, p + 1) for p in range(prefill, len(ids)))]:
        positions = torch.arange(start, end)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=table,
            slot_mapping=positions,  # blocks 0, 1, ... in order: slot == position
            query_lens=(end - start,),
            context_lens=(start,),
        )
        hidden = runner.model(torch.tensor(ids[start:end]), positions, cache, meta)
        rows.append(runner.model.compute_logits(hidden).float())
    return torch.cat(rows)


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int, repeats: int) -> tuple[float, list]:
    """Decode tokens/s of this batch: (time for 1 + steps tokens - time for 1) / steps per
    step, median of the repeats; and the tokens of the last run."""
    rates, tokens = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        greedy = SamplingParams(max_tokens=1 + steps, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompts, greedy)
        step = (time.perf_counter() - started - prefill) / steps
        rates.append(len(prompts) / max(step, 1e-9))
        tokens = [list(o.token_ids) for o in outputs]
    return sorted(rates)[len(rates) // 2], tokens


def measure(llm: LLM, work: dict[str, Any], text_ids: list[int], chat_ids: list[int]) -> dict:
    model = llm.runner.model
    mc = model.config
    kv_block = kv_cache_block_bytes(
        llm.config.kv_cache_dtype, mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, llm.dtype
    )
    logits = cached_logits(llm, text_ids, work["teacher_forced_decode_positions"])
    steps, batch, repeats = work["decode_steps"], work["big_batch"], work["repeats"]
    rate_1, tokens_1 = decode_rate(llm, [chat_ids], work["greedy_tokens"], repeats)
    rate_big, _ = decode_rate(llm, [chat_ids] * batch, steps, repeats)
    return {
        "bytes_per_token": model.decode_weight_bytes(),
        "weight_memory_bytes": memory_held(model),
        "kv_tokens_per_gib": KV_BUDGET // kv_block * 16,
        "decode_tokens_per_s_batch1": rate_1,
        "decode_tokens_per_s_batch_big": rate_big,
        "logits": logits,
        "greedy_tokens": tokens_1[0],
    }


def quality(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """KL(p_fp32 || p), perplexity of the text and argmax agreement, over every position."""
    p = reference.log_softmax(-1)
    kl = F.kl_div(logits.log_softmax(-1), p, log_target=True, reduction="none").sum(-1)
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "perplexity": math.exp(nll.item()),
        "argmax_agreement": agree.item(),
    }


def _matched(tokens: list[int], reference: list[int]) -> int:
    pairs = enumerate(zip(tokens, reference, strict=True))
    return next((i for i, (a, b) in pairs if a != b), len(reference))


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {
        "max_model_len": 512,
        "prefix_caching": False,
        "kv_cache_bytes": 64 * 2**20,
        "max_num_seqs": 32,
    }
    reset_peak_memory()
    bandwidth = copy_bandwidth(64 if quick else 256)
    _log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    rows: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] = {}
    model_name = dtype = device = ""
    for name in work["variants"]:
        try:
            llm = LLM(**kwargs, **base, **VARIANTS[name])
        except ValueError as refused:
            rows[name] = {"refused": str(refused)}
            _log(f"{name}: refused ({refused})")
            continue
        text_ids = llm.tokenizer.encode(TEXT)[: work["text_tokens_max"]]
        chat_ids = llm.tokenizer.encode(PROMPT)
        point = measure(llm, work, text_ids, chat_ids)
        model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
        llm.shutdown()
        del llm
        logits, tokens = point.pop("logits"), point.pop("greedy_tokens")
        if not reference:
            reference = {"logits": logits, "tokens": tokens}
        point |= quality(logits, reference["logits"], text_ids)
        point["greedy_tokens_matched"] = _matched(tokens, reference["tokens"])
        point["roofline_tokens_per_s_batch1"] = bandwidth / point["bytes_per_token"]
        point["share_of_roofline_batch1"] = (
            point["decode_tokens_per_s_batch1"] / point["roofline_tokens_per_s_batch1"]
        )
        rows[name] = point
        _log(
            f"{name}: {point['decode_tokens_per_s_batch1']:.1f} tok/s at batch 1, "
            f"KL {point['kl_mean']:.4f}"
        )
    fp32 = rows["fp32"]
    for point in rows.values():
        if "perplexity" in point:
            point["perplexity_delta"] = point["perplexity"] - fp32["perplexity"]
    table = markdown_table(rows, work)
    _log("\n" + table)
    summary = {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "fp32_tokens_per_s_batch1": fp32["decode_tokens_per_s_batch1"],
        "int8_tokens_per_s_batch1": rows["int8"]["decode_tokens_per_s_batch1"],
        "int8_kl_mean": rows["int8"]["kl_mean"],
        "int8_bytes_per_token_vs_fp32": rows["int8"]["bytes_per_token"] / fp32["bytes_per_token"],
        "fp32_share_of_roofline_batch1": fp32["share_of_roofline_batch1"],
        "kv_int8_tokens_per_gib_vs_fp32": rows["kv int8"]["kv_tokens_per_gib"]
        / fp32["kv_tokens_per_gib"],
        "int4_g128_refused": "refused" in rows["int4 g128"],
    }
    record = bench_record(
        stage=NAME,
        title="quantization: bytes per token, memory, KV capacity, decode speed, quality",
        summary=summary,
        results={"variants": rows, "table": table, "peak_memory": peak_memory()},
        workload=work | base | {"variant_configs": {n: VARIANTS[n] for n in work["variants"]}},
        model=f"{model_name} (a dequantized Q4_1 GGUF: int4-asym g32 is lossless on it)",
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(rows, bandwidth, model_name, work), out_dir)
    _log(f"wrote {path} and its .png")
    return record


COLUMNS = [  # (header, key, format)
    ("MB/token", "bytes_per_token", lambda v: f"{v / 1e6:.0f}"),
    ("weights MB", "weight_memory_bytes", lambda v: f"{v / 1e6:.0f}"),
    ("KV tok/GiB", "kv_tokens_per_gib", lambda v: f"{v:,}"),
    ("tok/s b1", "decode_tokens_per_s_batch1", lambda v: f"{v:.1f}"),
    ("tok/s big", "decode_tokens_per_s_batch_big", lambda v: f"{v:.0f}"),
    ("roofline b1", "share_of_roofline_batch1", lambda v: f"{100 * v:.0f}%"),
    ("KL mean", "kl_mean", lambda v: f"{max(v, 0.0):.4f}"),
    ("ppl delta", "perplexity_delta", lambda v: f"{v:+.2f}"),
    ("argmax agree", "argmax_agreement", lambda v: f"{100 * v:.0f}%"),
    ("greedy matched", "greedy_tokens_matched", str),
]


def markdown_table(rows: dict[str, dict[str, Any]], work: dict[str, Any]) -> str:
    lines = ["| variant | " + " | ".join(h for h, _, _ in COLUMNS) + " |"]
    lines.append("|---" * (len(COLUMNS) + 1) + "|")
    for name, point in rows.items():
        if "refused" in point:
            lines.append(f"| {name} | refused: {point['refused']} |")
            continue
        cells = [fmt(point[key]) for _, key, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"(big batch = {work['big_batch']}; greedy matched: of {work['greedy_tokens'] + 1} tokens)"
    )
    return "\n".join(lines)


def _plot(rows: dict, bandwidth: float, model_name: str, work: dict) -> Any:
    fig, (ax1, ax2, ax3, ax4) = new_figure(
        2,
        f"Stage 14 quantization: {model_name} (a Q4_1 checkpoint: int4-asym g32 is lossless)",
        width_per_plot=6.5,
        nrows=2,
    )
    names = [n for n, p in rows.items() if "refused" not in p]
    x = range(len(names))
    mb = lambda key: [rows[n][key] / 1e6 for n in names]
    ax1.bar([i - 0.2 for i in x], mb("bytes_per_token"), 0.4, label="read per decode token")
    ax1.bar([i + 0.2 for i in x], mb("weight_memory_bytes"), 0.4, label="held in memory")
    ax1.set_ylabel("MB (LM head 113 MB stays fp32)")
    ax1.set_title("Weight bytes", fontsize=9)
    ax2.bar(x, [rows[n]["decode_tokens_per_s_batch1"] for n in names], label="measured")
    ax2.scatter(
        x,
        [rows[n]["roofline_tokens_per_s_batch1"] for n in names],
        color="k",
        marker="_",
        s=200,
        label=f"roofline ({bandwidth / 1e9:.0f} GB/s copy)",
    )
    ax2.set_ylabel("decode tokens/s, batch 1")
    ax2.set_yscale("log")
    ax2.set_title("Batch-1 decode vs its bandwidth roofline", fontsize=9)
    ax3.bar(x, [rows[n]["decode_tokens_per_s_batch_big"] for n in names], color="tab:green")
    ax3.set_ylabel(f"decode tokens/s, batch {work['big_batch']}")
    ax3.set_title("Batched decode", fontsize=9)
    ax4.bar(x, [max(rows[n]["kl_mean"], 1e-6) for n in names], color="tab:red")
    ax4.set_yscale("log")
    ax4.set_ylabel("mean KL vs fp32 (floor 1e-6)")
    ax4.set_title("Quality on a fixed text, through the KV cache", fontsize=9)
    for ax in (ax1, ax2, ax3, ax4):
        ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
