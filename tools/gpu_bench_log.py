"""A GPU bench record from a bench's printed log, for a run stopped before it wrote its JSON.

    python tools/gpu_bench_log.py plots/gpu/h100_2026-11-26/gpu_bench.log \
        --env plots/gpu/h100_2026-11-26/env.log --tokens 256 --out plots/gpu

The first H100 run (2026-11-26) printed every number of two shapes and was stopped at its
step's 150 s limit during the attention comparison, before `gpu_bench.py` wrote anything (it now
writes after each shape). This reads the printed lines back into the record `gpu_bench.py`
writes, with the same summary, targets and plot, and says where each number came from:

- tokens/s and the copy bandwidth are the printed ones (as printed: whole tok/s, GB/s);
- bytes per decode step are computed from the shape (every matmul weight, the LM head and the
  norms in bf16, plus the KV one step reads on average), as the engine's `decode_weight_bytes`
  counts them: the roofline share is recomputed from those, not read from its rounded print;
- no attention rows: that part of the run did not finish.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from gpu_bench import SHAPES, plot, targets  # noqa: E402

from stages.common.tooling.results import new_figure, now_iso, write_results  # noqa: E402

BANDWIDTH = re.compile(r"^copy bandwidth (\d+) GB/s")
DECODE = re.compile(r"^(\S+) batch-1 decode, (graphs=\w+, async=\w+): ([\d.]+) tok/s")
THROUGHPUT = re.compile(r"^(\S+)\s+(\d+) requests: engine (\d+) tok/s, transformers (\d+) tok/s")
PROMPT_TOKENS = 32  # gpu_bench.decode_batch1's prompt


def decode_step_bytes(shape: dict[str, Any], output_tokens: int, element: int = 2) -> int:
    """Bytes one batch-1 decode step reads: the matmul weights (LM head included), the norms,
    and the KV of the average context (prompt + half the output)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, layers = hidden // heads, shape["num_hidden_layers"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden  # + gate, up, down; two norms
    weights = layers * per_layer + shape["vocab_size"] * hidden + hidden  # LM head, final norm
    context = PROMPT_TOKENS + output_tokens / 2
    kv = 2 * layers * kv_heads * head_dim * context
    return int((weights + kv) * element)


def parse(text: str, tokens: int) -> dict[str, Any]:
    """The results dict gpu_bench.run builds, from its printed lines."""
    bandwidth = None
    shapes: dict[str, Any] = {}
    for line in text.splitlines():
        line = line.strip().replace("\r", "")
        if match := BANDWIDTH.match(line):
            bandwidth = float(match.group(1)) * 1e9
        elif match := DECODE.match(line):
            shape, label, rate = match.group(1), match.group(2), float(match.group(3))
            entry = shapes.setdefault(shape, {"decode_batch1": {}, "throughput": {}})
            entry["decode_batch1"][label] = {"tokens_per_s": rate}
        elif match := THROUGHPUT.match(line):
            shape, n, ours, theirs = match.groups()
            entry = shapes.setdefault(shape, {"decode_batch1": {}, "throughput": {}})
            entry["throughput"][n] = {
                "engine_tok_s": float(ours),
                "transformers_tok_s": float(theirs),
            }
    if bandwidth is None:
        raise ValueError("no 'copy bandwidth' line: not a gpu_bench.py log")
    for shape, entry in shapes.items():
        step_bytes = decode_step_bytes(SHAPES[shape], tokens)
        roofline = bandwidth / step_bytes
        entry["bytes_per_decode_step"] = step_bytes
        entry["roofline_tokens_per_s"] = roofline
        for row in entry["decode_batch1"].values():
            row["roofline_share"] = row["tokens_per_s"] / roofline
    return {"copy_bandwidth_gb_s": bandwidth / 1e9, "shapes": shapes}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {"copy_bandwidth_gb_s": results["copy_bandwidth_gb_s"]}
    for shape, data in results["shapes"].items():
        if data["decode_batch1"]:
            best = max(data["decode_batch1"].values(), key=lambda d: d["tokens_per_s"])
            summary[f"{shape}_batch1_tok_s_best"] = best["tokens_per_s"]
            summary[f"{shape}_batch1_roofline_share_best"] = best["roofline_share"]
        if "64" in data["throughput"]:
            row = data["throughput"]["64"]
            ratio = row["engine_tok_s"] / row["transformers_tok_s"]
            summary[f"{shape}_speedup_vs_transformers_at_64"] = ratio
    complete = {s: d for s, d in results["shapes"].items() if "graphs=off, async=off" in d.get(
        "decode_batch1", {})}  # fmt: skip
    summary["targets"] = targets({"shapes": complete})
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the bench's printed output")
    parser.add_argument("--env", type=Path, help="gpu_check.sh's env.log (card, versions)")
    parser.add_argument("--tokens", type=int, default=128, help="batch-1 output tokens run")
    parser.add_argument("--out", type=Path, default=ROOT / "plots" / "gpu")
    args = parser.parse_args(argv)
    results = parse(args.log.read_text(errors="replace"), args.tokens)
    env = args.env.read_text().strip() if args.env else "unknown"
    record = {
        "summary": summarize(results),
        "stage": "15_full",
        "benchmark": "GPU bench: batch-1 roofline, throughput vs transformers (from its log)",
        "command": "python tools/gpu_bench.py (read back by tools/gpu_bench_log.py)",
        "source": f"{args.log.name}: the printed lines of a run stopped before it wrote its "
        "JSON; bytes per step computed from the shapes; no attention rows",
        "device_environment": env,
        "model": "random weights: " + ", ".join(results["shapes"]),
        "dtype": "bfloat16",
        "workload": {"batch1_output_tokens": args.tokens, "prompt_and_output_tokens": [128, 128]},
        "results": results,
        "written": now_iso(),
    }
    figure, axes = new_figure(3, "Stage 15 on one GPU (bf16, random weights)")
    card = next((line.split(",")[0] for line in env.splitlines() if "NVIDIA" in line), "a GPU")
    figure.suptitle(f"Stage 15 on one GPU (bf16, random weights): {card}, read back from its log",
                    fontsize=11)  # fmt: skip
    plot(axes, results)
    figure.subplots_adjust(top=0.85)
    write_results("gpu_bench", record, figure, args.out)
    print(f"wrote {args.out / 'gpu_bench.json'}: {record['summary']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
