"""The GPU bench: what stage 15 does on one GPU, in one run, in bf16, against the GPU's own limits.

    python tools/gpu_bench.py --out plots/gpu            # on a GPU (tools/gpu_check.sh runs it)
    python tools/gpu_bench.py --quick --out /tmp/gpu     # a tiny CPU run: the suite's smoke test

Random weights (speed does not depend on the values) of two shapes: the embedded model's
(SmolLM2-135M) and a ~1B Llama (Llama-3.2-1B's). It measures, each number from this process:

- the device's bandwidth two ways: a large device-to-device copy (bytes read + written) and a
  read-only probe (a sum over a large tensor: bytes read, which is what a decode step does),
  and from them batch-1 decode's roofline: bandwidth / bytes one decode step reads (weights +
  KV so far); the card's specified bandwidth too, where the bench knows the card;
- batch-1 decode tokens/s with async scheduling and CUDA graphs each on and off, each cell's
  greedy tokens (every cell must give the same: `graph_tokens_equal_eager`) and the graph
  replays its timed runs made (proof that graphs ran);
- output tokens/s at 1, 8, 64 and 256 concurrent requests, and transformers' batched
  `generate` on the same GPU, weights and lengths at 64 (the target's level);
- the Triton paged attention against torch SDPA over the same K/V (decode and prefill shapes).

Each throughput cell is the median of REPEATS runs, with its range (`samples`, `min`, `max`).
The step-cost issue's targets are checked against the H100 run of 2026-11-27 (BASELINE). The
JSON is written after every measurement, before any plotting: a run stopped at its time limit
still brings back everything it measured. A cell that fails is recorded with its error and
the run goes on (`summary.errors`; the exit status is 1 if any failed or the tokens differ).
`--reference-kernels` runs the PyTorch references instead of the fused Triton kernels, with
neither split-K nor folded decode attention. It writes `gpu_bench.json` (a `summary` first, as
every bench does) and `gpu_bench.png`.
Nothing here runs in the engine: it is a harness, like the stages' bench.py files.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stages  # noqa: E402
from stages.common.tooling.results import bench_record, new_figure, write_results  # noqa: E402
from stages.common.tooling.tiny import build_byte_tokenizer  # noqa: E402

# Llama shapes of random-weight checkpoints, with the real models' vocabularies (the LM head is
# a large share of a small model's decode read). The byte tokenizer covers the prompts.
SHAPES = {
    "smollm2-135m": dict(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    ),
    "llama-1b": dict(
        num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5,
    ),
    "quick": dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
    ),
}  # fmt: skip
CONCURRENCY = (1, 8, 64, 256)
QUICK_CONCURRENCY = (1, 4)
TRANSFORMERS_AT = 64  # the level the speedup target is set at (QUICK: the largest)
REPEATS = 3  # runs per cell: the median and the range (the --quick smoke run: 1)
# The H100 run of 2026-11-27 (plots/gpu/h100_2026-11-27/, one run per cell): "today's" numbers
# of the step-cost issue's targets. Batch-1 eager: graphs off, async on (its best eager cell).
BASELINE = {
    "smollm2-135m": {"eager_batch1_tok_s": 70.0, "tok_s_at_256": 28053.0},
    "llama-1b": {"eager_batch1_tok_s": 115.0, "tok_s_at_256": 27671.0},
}
GAIN_AT_256 = {"smollm2-135m": 2.5, "llama-1b": 2.0}  # the targets' factors over BASELINE
# Specified memory bandwidth by card (GB/s, the vendor's figure), matched on the device name.
SPEC_BANDWIDTH_GB_S = {"H100 80GB HBM3": 3350, "H100 NVL": 3900, "H100 PCIe": 2000,
                       "H200": 4800, "A100-SXM4-80GB": 2039, "A100-SXM4-40GB": 1555}  # fmt: skip


def timed(run: Callable[[], Any], device: torch.device, repeats: int, warm: bool = True) -> float:
    """Median seconds of `run()` after one warm-up (unless `warm` is False: the caller warmed
    it), with the device drained around each."""
    if warm:
        run()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and bytes written."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=10)
    return 2 * src.numel() * 4 / seconds


def read_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of reading a large tensor once (a sum: one small write): the access
    pattern of a decode step, which reads every weight and writes almost nothing."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    seconds = timed(lambda: src.sum(), device, repeats=10)
    return src.numel() * 4 / seconds


def spec_bandwidth(device: torch.device) -> float | None:
    """The card's specified bandwidth in bytes per second, where the bench knows the card."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = [gb for card, gb in SPEC_BANDWIDTH_GB_S.items() if card in name]
    return found[0] * 1e9 if found else None


def spread(samples: list[float]) -> dict[str, Any]:
    """A cell: the median of its samples and their range."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}  # fmt: skip


def random_checkpoint(folder: Path, shape: dict[str, Any]) -> Path:
    """A Llama checkpoint of `shape` with random bf16 weights, and the byte tokenizer."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    config = transformers.LlamaConfig(
        max_position_embeddings=4096, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", '
        '"bos_token": "<|im_start|>", "pad_token": "<|endoftext|>"}'
    )
    return folder


def _supported(stage: Any, name: str) -> bool:
    return name in {f.name for f in stage.EngineConfig.__dataclass_fields__.values()}


def engine(stage: Any, path: Path, device: torch.device, **config: Any) -> Any:
    """Stage 15's engine on `device` in bf16 (fp32 on a CPU quick run), switches as given."""
    config = {k: v for k, v in config.items() if _supported(stage, k)}
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    return stage.LLM(str(path), device=str(device), dtype=dtype, **config)


def release(*engines: Any) -> None:
    for llm in engines:
        getattr(llm, "shutdown", lambda: None)()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_batch1(
    stage: Any, path: Path, device: torch.device, tokens: int, repeats: int, **switches: Any
):
    """Batch-1 decode tokens/s (first token to last) of `repeats` runs, and the bytes one
    decode step reads."""
    llm = engine(stage, path, device, max_num_seqs=4, kv_cache_bytes=1 << 30, **switches)
    params = stage.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompt = list(range(10, 42))
    llm.generate([prompt], params)  # warm-up: kernels compiled, graphs captured
    graphs = getattr(llm.runner, "graphs", None)
    replays_before = graphs.num_replays if graphs is not None else 0
    rates, token_ids = [], []
    for _ in range(repeats):
        out = llm.generate([prompt], params)[0]
        rates.append((len(out.token_ids) - 1) / (out.token_times[-1] - out.token_times[0]))
        token_ids = list(out.token_ids)
    mc, runner = llm.runner.model_config, llm.runner
    context = len(prompt) + tokens / 2  # the KV one step reads, on average
    element = torch.finfo(runner.dtype).bits // 8
    kv_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * context * element
    step_bytes = runner.model.decode_weight_bytes() + kv_bytes
    # Proof that graphs ran: the replays the timed runs made (0 where none was captured).
    replays = (graphs.num_replays - replays_before) if graphs is not None else 0
    release(llm)
    return rates, step_bytes, token_ids, replays


def engine_throughput(
    stage: Any, path: Path, device: torch.device, levels: tuple, lengths: tuple, repeats: int
):
    """Output tokens/s at each concurrency in `levels` (`repeats` runs each), from one engine
    (built, and its CUDA graphs captured, once: a cap of max(levels) sequences does not change
    a smaller batch)."""
    prompt_len, out_len = lengths
    llm = engine(stage, path, device, max_num_seqs=max(*levels, 8), kv_cache_bytes=8 << 30)
    params = stage.SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rates = {}
    for n in levels:
        prompts = [[(7 * i + j) % 250 + 3 for j in range(prompt_len)] for i in range(n)]
        llm.generate(prompts, params)  # warm-up at this batch
        samples = []
        for _ in range(repeats):
            seconds = timed(
                lambda p=prompts: llm.generate(p, params), device, repeats=1, warm=False
            )
            samples.append(n * out_len / seconds)
        rates[n] = samples
    release(llm)
    return rates


def hf_throughput(
    path: Path, device: torch.device, n: int, lengths: tuple, repeats: int
) -> list[float]:
    """transformers' batched greedy `generate` on the same weights, device and lengths:
    output tokens/s of `repeats` runs."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    prompt_len, out_len = lengths
    ids = torch.randint(3, 250, (n, prompt_len), device=device)

    def run(model: Any = model) -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=0,
            )  # fmt: skip

    run()  # warm-up
    samples = [n * out_len / timed(run, device, repeats=1, warm=False) for _ in range(repeats)]
    del model, run
    release()
    return samples


def attention_kernels(stage: Any, device: torch.device, quick: bool) -> list[dict[str, Any]]:
    """Triton paged attention against torch SDPA over the same K/V laid out contiguously."""
    kernels = importlib.import_module(f"{stage.__name__}.kernels")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim, block = 32, 8, 64, 16
    # batch 1 at 4,096 positions: the case split-K decoding (flash-decoding) is for
    cases = [("decode", 64, 1024, 1), ("decode-batch1-4096", 1, 4096, 1), ("prefill", 4, 512, 512)]
    if quick:
        heads, kv_heads, dim = 4, 2, 16
        cases = [("decode", 2, 32, 1), ("decode-batch1-long", 1, 600, 1), ("prefill", 1, 16, 16)]
    rows = []
    for name, seqs, context, query in cases:
        blocks_per = -(-context // block)
        k_cache = torch.randn(seqs * blocks_per, block, kv_heads, dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(seqs * blocks_per, device=device, dtype=torch.int32)
        tables = tables.view(seqs, blocks_per)
        q = torch.randn(seqs * query, heads, dim, device=device, dtype=dtype)
        starts = torch.arange(0, seqs * query + 1, query, device=device, dtype=torch.int32)
        lens = torch.full((seqs,), context, device=device, dtype=torch.int32)
        scale = dim**-0.5
        args = (q, k_cache, v_cache, starts, lens, tables, scale)
        k = k_cache.view(seqs, blocks_per * block, kv_heads, dim)[:, :context].transpose(1, 2)
        v = v_cache.view(seqs, blocks_per * block, kv_heads, dim)[:, :context].transpose(1, 2)
        qs = q.view(seqs, query, heads, dim).transpose(1, 2)
        mask = torch.ones(query, context, dtype=torch.bool, device=device).tril(context - query)

        def sdpa(qs=qs, k=k, v=v, mask=mask, scale=scale) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

        triton_seconds = timed(lambda a=args: kernels.unified_attention_triton(*a), device, 5)
        sdpa_seconds = timed(sdpa, device, 5)
        expected = sdpa().transpose(1, 2).reshape(seqs * query, heads, dim).float()
        error = (kernels.unified_attention_triton(*args).float() - expected).abs().max()
        row = {"case": name, "sequences": seqs, "context": context, "query": query,
               "triton_ms": 1e3 * triton_seconds, "sdpa_ms": 1e3 * sdpa_seconds,
               "max_abs_difference": float(error)}  # fmt: skip
        splits = getattr(kernels, "decode_splits", None)
        if query == 1 and splits is not None:  # the dispatcher's choice: split-K or not
            count = splits(seqs, kv_heads, context, kernels._sms(device))
            split = kernels.decode_attention_split_triton
            row["splits"] = count
            row["split_ms"] = 1e3 * timed(lambda a=args, n=count, f=split: f(*a, n), device, 5)
            row["split_max_abs_difference"] = float(
                (split(*args, count).float() - expected).abs().max()
            )
        rows.append(row)
    return rows


def run(out_dir: Path, quick: bool, shapes: list[str]) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    stage = stages.load("15")
    workdir = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    megabytes = 64 if quick else 2048
    bandwidth, read = copy_bandwidth(device, megabytes), read_bandwidth(device, megabytes)
    spec = spec_bandwidth(device)
    named = f"{spec / 1e9:.0f} GB/s" if spec else "unknown for this card"
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), read-only "
          f"{read / 1e9:.0f} GB/s, specified {named}", flush=True)  # fmt: skip
    tokens = 8 if quick else 128
    lengths = (8, 8) if quick else (128, 128)
    repeats = 1 if quick else REPEATS
    errors: list[str] = []  # each failed cell, by name; the run goes on past it
    results: dict[str, Any] = {
        "copy_bandwidth_gb_s": bandwidth / 1e9, "read_bandwidth_gb_s": read / 1e9,
        "spec_bandwidth_gb_s": spec / 1e9 if spec else None, "repeats": repeats, "shapes": {},
    }  # fmt: skip
    summary: dict[str, Any] = {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_gb_s": read / 1e9,
        "fused_kernels": os.environ.get("STAGES_FUSED_KERNELS", "1") != "0",
        "errors": errors,
    }
    context = (out_dir, summary, results, quick, device, shapes, tokens, lengths)
    for shape in ["quick"] if quick else shapes:
        path = random_checkpoint(workdir / shape, SHAPES[shape])
        decode: dict[str, Any] = {}
        entry = results["shapes"][shape] = {"decode_batch1": decode, "throughput": {}}
        for graphs in (False, True):
            for overlap in (False, True):
                if graphs and device.type != "cuda":
                    continue
                label = f"graphs={'on' if graphs else 'off'}, async={'on' if overlap else 'off'}"
                try:
                    rates, step_bytes, token_ids, replays = decode_batch1(
                        stage,
                        path,
                        device,
                        tokens,
                        repeats,
                        cuda_graphs=graphs,
                        async_scheduling=overlap,
                    )
                except Exception as exc:  # one cell failing loses no other cell
                    decode[label] = {"error": f"{type(exc).__name__}: {exc}"}
                    errors.append(f"{shape} batch-1 {label}: {decode[label]['error']}")
                    print(f"{shape} batch-1 decode, {label}: FAILED {decode[label]['error']}",
                          flush=True)  # fmt: skip
                    release()
                    _save_json(*context)
                    continue
                cell = spread(rates)
                cell["token_ids"], cell["graph_replays"] = token_ids, replays
                cell["tokens_per_s"] = cell["median"]
                cell["roofline_share"] = cell["median"] * step_bytes / bandwidth
                cell["read_roofline_share"] = cell["median"] * step_bytes / read
                if spec:
                    cell["spec_bandwidth_share"] = cell["median"] * step_bytes / spec
                decode[label] = cell
                entry["bytes_per_decode_step"] = step_bytes
                entry["roofline_tokens_per_s"] = bandwidth / step_bytes
                entry["read_roofline_tokens_per_s"] = read / step_bytes
                print(f"{shape} batch-1 decode, {label}: {cell['median']:.1f} tok/s "
                      f"({cell['min']:.1f}-{cell['max']:.1f}), {cell['read_roofline_share']:.0%} "
                      "of the read-only roofline", flush=True)  # fmt: skip
                _save_json(*context)
        agree = tokens_agree(decode)
        entry["graph_tokens_equal_eager"] = summary[f"{shape}_graph_tokens_equal_eager"] = agree
        if agree is False:
            errors.append(f"{shape}: greedy tokens differ between the batch-1 cells")
        _save_json(*context)
        levels = QUICK_CONCURRENCY if quick else CONCURRENCY
        try:
            engine_rates = engine_throughput(stage, path, device, levels, lengths, repeats)
        except Exception as exc:
            errors.append(f"{shape} throughput: {type(exc).__name__}: {exc}")
            print(f"{shape} throughput: FAILED {errors[-1]}", flush=True)
            release()
            _write(*context)
            continue
        for n in levels:
            cell = spread(engine_rates[n])
            entry["throughput"][str(n)] = {"engine_tok_s": cell["median"], "engine": cell}
            print(f"{shape} {n:>3} requests: engine {cell['median']:.0f} tok/s "
                  f"({cell['min']:.0f}-{cell['max']:.0f})", flush=True)  # fmt: skip
        _save_json(*context)
        at = levels[-1] if quick else TRANSFORMERS_AT
        try:
            theirs = spread(hf_throughput(path, device, at, lengths, repeats))
        except Exception as exc:
            errors.append(f"{shape} transformers: {type(exc).__name__}: {exc}")
            print(f"{shape} transformers: FAILED {errors[-1]}", flush=True)
            release()
            _write(*context)
            continue
        row = entry["throughput"][str(at)]
        row["transformers_tok_s"], row["transformers"] = theirs["median"], theirs
        print(f"{shape} {at:>3} requests: transformers {theirs['median']:.0f} tok/s "
              f"({theirs['min']:.0f}-{theirs['max']:.0f}), engine "
              f"{row['engine_tok_s'] / theirs['median']:.1f}x", flush=True)  # fmt: skip
        measured = [d for d in decode.values() if "tokens_per_s" in d]
        if measured:
            best = max(measured, key=lambda d: d["tokens_per_s"])
            summary[f"{shape}_batch1_tok_s_best"] = best["tokens_per_s"]
            summary[f"{shape}_batch1_roofline_share_best"] = best["roofline_share"]
        summary[f"{shape}_speedup_vs_transformers_at_{at}"] = (
            row["engine_tok_s"] / row["transformers_tok_s"]
        )
        _write(*context)  # the JSON, then the plot of what is measured so far
    try:
        results["attention"] = attention_kernels(stage, device, quick)
    except Exception as exc:
        errors.append(f"attention kernels: {type(exc).__name__}: {exc}")
        results["attention"] = []
    summary["errors"] = errors
    return _write(*context)


def tokens_agree(decode: dict[str, Any]) -> bool | None:
    """Whether every batch-1 cell that ran produced the same greedy tokens (graphs on and off,
    async on and off: the same prompt, the same weights, temperature 0); None with fewer than
    two cells. Graph replays that shift or corrupt a row show here, not only in tok/s."""
    runs = [cell["token_ids"] for cell in decode.values() if "token_ids" in cell]
    return None if len(runs) < 2 else all(run == runs[0] for run in runs)


def _record(
    summary: dict,
    results: dict,
    quick: bool,
    device: torch.device,
    shapes: list[str],
    tokens: int,
    lengths: tuple,
) -> dict[str, Any]:
    summary["targets"] = targets(results)
    record = bench_record(
        stage="15_full", title="GPU bench: batch-1 roofline, throughput vs transformers, attention",
        summary=summary, results=results, quick=quick, dtype="bfloat16" if device.type ==
        "cuda" else "float32", device=str(device), model="random weights: " + ", ".join(shapes),
        workload={"batch1_output_tokens": tokens, "prompt_and_output_tokens": lengths},
    )  # fmt: skip
    record["command"] = "python tools/gpu_bench.py" + (" --quick" if quick else "")
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        record["torch"] = torch.__version__
    return record


def _save_json(out_dir: Path, *args: Any) -> dict[str, Any]:
    """The JSON of what has been measured so far, and nothing else (no plotting: a plot that
    fails, or a step stopped at its limit, loses no number)."""
    record = _record(*args)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_bench.json").write_text(json.dumps(record, indent=2, default=float) + "\n")
    return record


def _write(out_dir: Path, *args: Any) -> dict[str, Any]:
    """The JSON first, then the plot of what has been measured so far."""
    record = _save_json(out_dir, *args)
    device = args[3]
    figure, axes = new_figure(3, "Stage 15 on one GPU (bf16, random weights)")
    if device.type == "cuda":  # the machine label names the host's CPU: name the card
        figure.suptitle(f"Stage 15 on one GPU (bf16, random weights): {record['gpu']}, "
                        f"torch {torch.__version__}", fontsize=11)  # fmt: skip
        figure.subplots_adjust(top=0.85)
    plot(axes, args[1])
    write_results("gpu_bench", record, figure, out_dir)
    return record


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """The targets, each with its number, its bar and whether it was met. The GPU issue's:
    CUDA graphs and async scheduling each a gain at batch 1. The step-cost issue's (against
    BASELINE, the H100 run of 2026-11-27): 1B batch-1 decode at least 70% of the read-only
    probe's roofline and 60% of the card's specified bandwidth; 135M batch-1 at least 1,500
    tok/s; eager batch-1 at least 3x BASELINE's; at 256 requests at least 2x BASELINE's for 1B
    and 2.5x for 135M; at least 8x transformers' `generate` at 64 requests."""
    met: dict[str, tuple[float, float]] = {}
    for shape, data in results["shapes"].items():
        decode = {
            k: v["tokens_per_s"] for k, v in data["decode_batch1"].items() if "tokens_per_s" in v
        }
        cells, on, eager = data["decode_batch1"], "graphs=on, async=on", "graphs=off, async=on"
        if eager not in decode:
            continue
        if on in decode:
            met[f"{shape}_graphs_gain_batch1"] = (decode[on] / decode[eager], 1.0)
            if shape == "llama-1b" and "read_roofline_share" in cells[on]:  # (older runs: none)
                met[f"{shape}_read_roofline_share"] = (cells[on]["read_roofline_share"], 0.7)
                if "spec_bandwidth_share" in cells[on]:
                    met[f"{shape}_spec_bandwidth_share"] = (cells[on]["spec_bandwidth_share"], 0.6)
            if shape == "smollm2-135m":
                met[f"{shape}_batch1_tok_s"] = (decode[on], 1500.0)
        if "graphs=off, async=off" in decode:
            met[f"{shape}_async_gain_batch1"] = (
                decode[eager] / decode["graphs=off, async=off"],
                1.0,
            )
        baseline = BASELINE.get(shape)
        if baseline:
            met[f"{shape}_eager_batch1_gain"] = (
                decode[eager] / baseline["eager_batch1_tok_s"],
                3.0,
            )
            if "256" in data["throughput"]:
                gain = data["throughput"]["256"]["engine_tok_s"] / baseline["tok_s_at_256"]
                met[f"{shape}_gain_at_256"] = (gain, GAIN_AT_256[shape])
        row = data["throughput"].get(str(TRANSFORMERS_AT), {})
        if "transformers_tok_s" in row:
            ratio = row["engine_tok_s"] / row["transformers_tok_s"]
            met[f"{shape}_vs_transformers_at_{TRANSFORMERS_AT}"] = (ratio, 8.0)
    strict = ("_gain_batch1",)  # a gain must be more than 1.0; the others reach their bar
    return {
        name: {"value": value, "target": target,
               "met": value > target if name.endswith(strict) else value >= target}
        for name, (value, target) in met.items()
    }  # fmt: skip


def _cell(row: dict[str, Any], key: str) -> dict[str, Any]:
    """A throughput cell with its range; a run of one sample per cell (before 2026-11-28) has
    only the number."""
    value = row[f"{key}_tok_s"]
    return row.get(key) or {"median": value, "min": value, "max": value}


def plot(axes: list[Any], results: dict[str, Any]) -> None:
    for shape, data in results["shapes"].items():
        labels = list(data["decode_batch1"])
        rates = [data["decode_batch1"][k]["tokens_per_s"] for k in labels]
        axes[0].barh([f"{shape}\n{k}" for k in labels], rates)
        if "read_roofline_tokens_per_s" in data:
            axes[0].axvline(data["read_roofline_tokens_per_s"], linestyle="--", color="gray")
        for key, style in (("engine", "-o"), ("transformers", "x")):
            cells = [(int(n), _cell(row, key)) for n, row in data["throughput"].items()
                     if f"{key}_tok_s" in row]  # fmt: skip
            if cells:  # the median, and a bar for the range of the runs
                levels, values = [n for n, _ in cells], [c["median"] for _, c in cells]
                low = [c["median"] - c["min"] for _, c in cells]
                high = [c["max"] - c["median"] for _, c in cells]
                axes[1].errorbar(levels, values, yerr=[low, high], fmt=style,
                                 label=f"{shape} {key}", capsize=3)  # fmt: skip
    axes[0].set(title="batch-1 decode tok/s (dashed: read-only roofline)", xscale="log")
    axes[1].set(title="output tok/s vs concurrent requests", xscale="log", yscale="log")
    axes[1].legend(fontsize=7)
    cases = results.get("attention", [])
    if not cases:
        axes[2].text(0.5, 0.5, "not measured in this run", ha="center", va="center",
                     transform=axes[2].transAxes)  # fmt: skip
        axes[2].set_axis_off()
    names = [c["case"] for c in cases]
    axes[2].bar([f"{n}\ntriton" for n in names], [c["triton_ms"] for c in cases])
    axes[2].bar([f"{n}\nsdpa" for n in names], [c["sdpa_ms"] for c in cases])
    axes[2].set_title("attention ms (paged Triton vs SDPA, same K/V)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "plots" / "gpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-1b"])
    parser.add_argument(
        "--reference-kernels", action="store_true",
        help="the PyTorch references instead of the fused Triton kernels, no split-K or folded "
        "decode attention (STAGES_FUSED_KERNELS=0): tells a kernel's fault from the engine's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.reference_kernels:
        os.environ["STAGES_FUSED_KERNELS"] = "0"  # read when stage 15 is imported, in run()
    if not args.quick and not torch.cuda.is_available():
        parser.error("no CUDA device: use --quick for the CPU smoke run")
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    record = run(args.out, args.quick, args.shapes)
    errors = record["summary"]["errors"]
    for error in errors:
        print(f"gpu_bench: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
