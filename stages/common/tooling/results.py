"""Writing a benchmark's evidence: `plots/NN_name.json` and `plots/NN_name.png`.

The JSON opens with a `summary` of headline numbers under plain names, then everything needed to
judge them: the workload, the model and dtype, the machine, library versions, the date and the
command that regenerates it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stages.common.tooling.hardware import hardware_info, machine_label, now_iso, versions
from stages.common.tooling.latency import peak_memory

REPO_ROOT = Path(__file__).resolve().parents[3]
PLOTS_DIR = REPO_ROOT / "plots"


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null; round floats to keep files readable."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, 6)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def bench_record(
    *,
    stage: str,
    title: str,
    summary: dict[str, Any],
    results: dict[str, Any],
    workload: dict[str, Any],
    model: str,
    dtype: str,
    device: str,
    quick: bool,
) -> dict[str, Any]:
    return {
        "summary": summary,
        "stage": stage,
        "benchmark": title,
        "command": f"python -m stages {stage[:2]} bench" + (" --quick" if quick else ""),
        "quick": quick,
        "model": model,
        "dtype": dtype,
        "device": device,
        "machine": machine_label(),
        "hardware": hardware_info(),
        "peak_memory_bench_process": peak_memory(whole_process=True),
        "versions": versions(),
        "date": now_iso(),
        "workload": workload,
        "results": results,
    }


def write_results(
    name: str, record: dict[str, Any], figure: Any, out_dir: Path | None = None
) -> Path:
    """Write `<out_dir>/<name>.json` and `.png`.

    out_dir defaults to the repo's plots/ for a full run and to plots/quick/ (not committed) for
    `--quick`, so a smoke run never overwrites the measured plots the READMEs cite.
    """
    if out_dir is not None:
        folder = Path(out_dir)
    else:
        folder = PLOTS_DIR / "quick" if record.get("quick") else PLOTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{name}.json"
    json_path.write_text(json.dumps(_clean(record), indent=2) + "\n")
    figure.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")
    return json_path


def new_figure(
    ncols: int, title: str, width_per_plot: float = 5.2, height: float = 4.2, nrows: int = 1
) -> Any:
    """A grid of `nrows` x `ncols` axes (returned as one flat list, row by row) with a title
    that names the machine the numbers came from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width_per_plot * ncols, height * nrows))
    fig.suptitle(f"{title}\nmeasured on {machine_label()}", fontsize=11)
    return fig, list(getattr(axes, "flat", [axes]))
