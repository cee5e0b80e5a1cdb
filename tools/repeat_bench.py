"""Run a stage's bench several times and report each headline as the median with its range.

    python tools/repeat_bench.py 12 --runs 3        # plots/12_offload.json + _repeats.json
    python tools/repeat_bench.py 13 --runs 3 --key stream_itl_p99_ratio_colocated_vs_disaggregated

One run of a bench on a shared 2-core machine can be off by 10-20% (another process, the
allocator, a thermal step). A headline that rests on one run says more than it knows, so this
runs `python -m stages NN bench` `--runs` times, one after another in fresh processes, and
writes `plots/NN_name_repeats.json`: per summary key the median, the lowest and the highest
value, and every run's value. The plot and JSON of the run whose `--key` value is the median
become `plots/NN_name.{png,json}` (what the stage README shows), so the picture is a typical
run, not the best.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "plots"


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per numeric key present in every run: median, min, max and the values in run order.
    Booleans and strings are kept only when every run agrees."""
    keys = [k for k in summaries[0] if all(k in s for s in summaries)]
    result: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = [s[key] for s in summaries]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if numeric:
            result[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
        elif all(v == values[0] for v in values):
            result[key] = {"value": values[0], "runs": values}
    return result


def median_run(summaries: list[dict[str, Any]], key: str) -> int:
    """The index of the run whose `key` is the median (the lower middle for an even count)."""
    order = sorted(range(len(summaries)), key=lambda i: summaries[i][key])
    return order[(len(order) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", help="stage number, e.g. 12")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--key", default=None, help="summary key that picks the plotted run")
    parser.add_argument("--quick", action="store_true", help="the benches' quick form")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: plots/")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    out = args.out_dir or (PLOTS / "quick" if args.quick else PLOTS)
    summaries, folders = [], []
    work = Path(tempfile.mkdtemp(prefix=f"repeat-{args.stage}-"))
    for run in range(args.runs):
        folder = work / f"run{run}"
        command = [sys.executable, "-m", "stages", args.stage, "bench", "--out-dir", str(folder)]
        print(f"[repeat_bench] run {run + 1}/{args.runs}: {' '.join(command[1:])}", flush=True)
        subprocess.run([*command, *(["--quick"] if args.quick else [])], cwd=ROOT, check=True)
        (record,) = [p for p in folder.glob("*.json")]
        summaries.append(json.loads(record.read_text())["summary"])
        folders.append(folder)
    name = record.stem
    numeric = [k for k, v in summaries[0].items() if isinstance(v, int | float)]
    key = args.key or numeric[0]
    if key not in summaries[0]:
        parser.error(f"--key {key!r} is not in the summary: {sorted(summaries[0])}")
    chosen = median_run(summaries, key)
    out.mkdir(parents=True, exist_ok=True)
    for path in folders[chosen].iterdir():
        shutil.copy(path, out / path.name)
    repeats = {
        "summary": {k: v.get("median", v.get("value")) for k, v in aggregate(summaries).items()},
        "range": aggregate(summaries),
        "runs": args.runs,
        "plotted_run": chosen,
        "picked_by": key,
        "command": f"python tools/repeat_bench.py {args.stage} --runs {args.runs}"
        + (f" --key {args.key}" if args.key else ""),
        "machine": json.loads((out / f"{name}.json").read_text()).get("machine"),
        "date": json.loads((out / f"{name}.json").read_text()).get("date"),
    }
    (out / f"{name}_repeats.json").write_text(json.dumps(repeats, indent=2) + "\n")
    for k, v in repeats["range"].items():
        if "median" in v:
            print(f"{k}: median {v['median']:.4g} (range {v['min']:.4g}-{v['max']:.4g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
