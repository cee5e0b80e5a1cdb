"""Time every CPU path of `cpu_paths` on SmolLM2-135M's matmul shapes and pick the winners.

For each (in, out) shape and batch (1: a decode step; 32: a batch of decodes) it quantizes one
random weight per format, checks every path against the float64 reference, times it (median of
repeated calls after a warm-up) and prints a markdown table: microseconds per call and the
weight bytes streamed per second. The last table sums each path over the five shapes, which is
the cost of one layer's worth of matmuls plus the LM head, and marks the fastest correct
weight-only path per format and batch (what `cpu_paths.FASTEST` should say). A single-thread
read of a large buffer gives the memory bandwidth these numbers can be compared with.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/quant/measure_cpu_paths.py [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

cpu_paths = importlib.import_module("stages.14_quant.quant.cpu_paths")
_formats = importlib.import_module("stages.14_quant.quant.formats")
quantize_fp8, quantize_int4, quantize_int8 = (
    _formats.quantize_fp8,
    _formats.quantize_int4,
    _formats.quantize_int8,
)
weight_bytes = importlib.import_module("stages.14_quant.quant.linear").weight_bytes

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))  # (in, out): q/k/v, o,
# gate/up, down (each fused as the engine runs them), the LM head
BATCHES = (1, 4, 8, 32)  # a decode step; the few rows where GEMV-shaped ops stop winning; "more"
INT4_GROUP = 32  # the embedded model's own groups (a Q4_1 file); 128 does not divide 576


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def median_seconds(fn: Callable[[], object], budget: float = 0.25, min_calls: int = 5) -> float:
    for _ in range(2):
        fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - started < budget:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def read_bandwidth_gb_s(megabytes: int = 512) -> float:
    buffer = torch.ones(megabytes * 2**20 // 4)
    seconds = median_seconds(lambda: buffer.sum(), budget=1.0)
    return buffer.numel() * 4 / seconds / 1e9


def weights_for(w: torch.Tensor) -> dict[tuple[str, bool], object]:
    """(format, symmetric) -> the weight object the paths of that format take."""
    return {
        ("fp32", True): w,
        ("int8", True): quantize_int8(w),
        ("int4", False): quantize_int4(w, INT4_GROUP, symmetric=False),
        ("int4", True): quantize_int4(w, INT4_GROUP, symmetric=True),
        ("fp8", True): quantize_fp8(w),
    }


def measure() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for in_features, out_features in SHAPES:
        w = torch.randn(out_features, in_features) * 0.02
        weights = weights_for(w)
        for path in cpu_paths.registry().by_name.values():
            symmetric = path.fmt != "int4" or path.activations == "int8"
            weight = weights[(path.fmt, symmetric)]
            if not path.needs(weight):
                continue
            state = path.prepare(weight)
            for batch in BATCHES:
                x = torch.randn(batch, in_features)
                error = cpu_paths.relative_error(
                    path.run(x, state), cpu_paths.reference_matmul(x, weight)
                )
                seconds = median_seconds(lambda p=path, x=x, s=state: p.run(x, s))
                rows.append(
                    {
                        "path": path.name,
                        "fmt": path.fmt,
                        "activations": path.activations,
                        "shape": f"{in_features}x{out_features}",
                        "batch": batch,
                        "us": seconds * 1e6,
                        "gb_s": weight_bytes(weight) / seconds / 1e9,
                        "error": error,
                        "correct": error <= path.tolerance,
                    }
                )
                print(
                    f"{path.name:32s} {in_features}x{out_features:<6d} b{batch:<3d}"
                    f" {seconds * 1e6:10.1f} us  err {error:.1e}",
                    flush=True,
                )
    return rows


def report(rows: list[dict[str, object]], threads: int) -> str:
    lines = [
        f"Machine: {cpu_model()}, {threads} thread(s), torch {torch.__version__}; "
        f"single-thread read bandwidth {read_bandwidth_gb_s():.1f} GB/s.",
        "",
        "| path | shape (in x out) | batch | us / call | weight GB/s | rel. error | correct |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['path']} | {r['shape']} | {r['batch']} | {r['us']:.1f} | {r['gb_s']:.1f} "
            f"| {r['error']:.1e} | {'yes' if r['correct'] else 'NO'} |"
        )
    lines += [
        "",
        "Sum over the five shapes (us). * = fastest correct path with fp32 activations (exact),",
        "+ = fastest correct path with bf16 activations:",
        "",
        "| format | path | activations | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
        "|---|---|---|" + "---|" * len(BATCHES),
    ]
    totals: dict[tuple[str, int], float] = {}
    info: dict[str, tuple[str, str, bool]] = {}  # path -> (fmt, activations, correct everywhere)
    for r in rows:
        name = str(r["path"])
        totals[(name, int(r["batch"]))] = totals.get((name, int(r["batch"])), 0.0) + float(r["us"])
        previous = info.get(name, (str(r["fmt"]), str(r["activations"]), True))
        info[name] = (previous[0], previous[1], previous[2] and bool(r["correct"]))
    best: dict[tuple[str, str, int], str] = {}
    for fmt in cpu_paths.FORMATS:
        for acts in ("fp32", "bf16"):
            for batch in BATCHES:
                # A decode row reads the format's codes: no bf16 copy of a quantized weight.
                copy_allowed = batch > 4 or fmt == "fp32"
                eligible = [
                    (totals[(name, batch)], name)
                    for name, (f, a, ok) in info.items()
                    if (f, ok) == (fmt, True) and a in ("fp32", acts)
                    if copy_allowed or "dense" not in name
                ]
                if eligible:
                    best[(fmt, acts, batch)] = min(eligible)[1]
    for name, (fmt, acts, ok) in info.items():
        cells = []
        for batch in BATCHES:
            mark = "*" if best.get((fmt, "fp32", batch)) == name else ""
            mark += "+" if best.get((fmt, "bf16", batch)) == name else ""
            cells.append(f"{totals[(name, batch)]:.0f}{mark}")
        flag = "" if ok else " (INCORRECT)"
        lines.append(f"| {fmt} | {name}{flag} | {acts} | " + " | ".join(cells) + " |")
    kept = {key: name for key, name in best.items() if key[2] in (1, 32)}  # FASTEST's keys
    lines += ["", f"FASTEST = {kept}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(report(measure(), args.threads))


if __name__ == "__main__":
    main()
