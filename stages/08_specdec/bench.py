"""Stage 08 benchmark: when speculative decoding pays, and when it does not.

One process, the embedded model, greedy decoding, every configuration checked to give the
plain engine's tokens. Two workloads: a repetitive one (rewrite a given piece of code with one
change: the answer copies most of the prompt) and open-ended chat. Recorded:
1. at batch 1, output tokens/s and accepted tokens per target forward against k, for the
   n-gram drafter and for the draft model (the target's first DRAFT_LAYERS layers); each point
   is the median of `repeats` rounds over every configuration (the range is kept), so that a
   change in the machine's load touches every configuration alike;
2. on the repetitive workload, the speedup of n-gram speculation against the batch size: a
   verification forward costs more as the batch grows, and speculation stops paying.

    python -m stages 08 bench [--quick]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from stages.common.devices import dtype_name
from stages.common.tooling.latency import peak_memory, reset_peak_memory
from stages.common.tooling.results import bench_record, new_figure, write_results

from .llm import LLM
from .sampling import SamplingParams

NAME = "08_specdec"
PLAIN, ASYNC = "plain, sync", "plain, async (stage 07's default)"
DRAFT_LAYERS = 10  # of SmolLM2-135M's 30
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages


def normalise(values):
    """Scale values so that they sum to one."""
    total = sum(values)
    if total == 0:
        raise ValueError("values must not sum to zero")
    return [value / total for value in values]
'''
RENAMES = ["total", "values", "window", "index", "value", "averages", "total", "values"]
CHAT = [
    "Tell me a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a child.",
    "Write a few sentences about autumn in a city.",
    "What makes a good teacher?",
]


def _log(message: str) -> None:
    print(f"[bench 08] {message}", file=sys.stderr, flush=True)


def _workload(quick: bool) -> dict[str, Any]:
    return {
        "k_ngram": [2] if quick else [1, 2, 3, 4, 6],
        "k_draft": [2] if quick else [1, 2, 3],
        "batch_sizes": [1, 2] if quick else [1, 2, 4, 8],
        "batch_k": 2 if quick else 4,
        "max_tokens": 16 if quick else 256,
        "draft_layers": DRAFT_LAYERS,
        "repeats": 1 if quick else 3,
    }


def _conversations(kind: str, count: int) -> list[list[dict[str, str]]]:
    if kind == "chat":
        return [[{"role": "user", "content": CHAT[i % len(CHAT)]}] for i in range(count)]
    return [
        [
            {
                "role": "user",
                "content": f"Rewrite this Python code, renaming the variable `{RENAMES[i]}` to "
                f"`renamed_{RENAMES[i]}`. Reply with the whole code only.\n\n{CODE}",
            }
        ]
        for i in range(count)
    ]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeated runs as one point: the median tokens/s, every run's value
    kept. Greedy decoding gives the same tokens and acceptance every time (asserted)."""
    for run in runs[1:]:
        assert run["token_ids"] == runs[0]["token_ids"], "greedy output changed between runs"
    rates = sorted(run["output_tokens_per_s"] for run in runs)
    return runs[0] | {"output_tokens_per_s": rates[len(rates) // 2], "tokens_per_s_runs": rates}


def measure(llm: LLM, kind: str, batch: int, max_tokens: int) -> dict[str, Any]:
    """Generate one batch; tokens/s, and tokens per target forward for each request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    stats = llm.spec_stats
    before = (stats.num_verifications, stats.num_draft_tokens, stats.num_accepted_tokens)
    started = time.perf_counter()
    outs = llm.chat(_conversations(kind, batch), params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    verifications = stats.num_verifications - before[0]
    drafted = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    return {
        "output_tokens_per_s": tokens / elapsed,
        "output_tokens": tokens,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_target_forward": (accepted + verifications) / verifications
        if verifications
        else 1.0,
        "token_ids": [o.token_ids for o in outs],
    }


def run(quick: bool = False, out_dir: Path | None = None, model: str | None = None) -> dict:
    work = _workload(quick)
    kwargs: dict[str, Any] = {} if model is None else {"model": model}
    base = {"max_model_len": 2048}
    reset_peak_memory()
    # Speculation runs steps synchronously, so the baseline is plain decoding run the same way;
    # stage 07's default (async scheduling on) is measured too.
    configs: dict[str, dict[str, Any]] = {PLAIN: {"async_scheduling": False}, ASYNC: {}}
    for k in work["k_ngram"]:
        configs[f"ngram k={k}"] = {"speculative": "ngram", "num_speculative_tokens": k}
    for k in work["k_draft"]:
        configs[f"draft k={k}"] = {
            "speculative": "draft",
            "num_speculative_tokens": k,
            "draft_num_layers": work["draft_layers"],
        }
    results: dict[str, Any] = {"batch1": {}, "batch_sweep": {}}
    # Rounds over every configuration, so that a change in the machine's load during the run
    # touches every configuration alike; each point is the median of its rounds.
    kinds = ("repetitive", "chat")
    runs: dict[str, dict[str, list]] = {label: {k: [] for k in kinds} for label in configs}
    for round_index in range(work["repeats"]):
        for label, config in configs.items():
            llm = LLM(**kwargs, **base, **config)
            llm.generate([[101, 102]], SamplingParams(max_tokens=2))  # warm-up
            for kind in kinds:
                runs[label][kind].append(measure(llm, kind, 1, work["max_tokens"]))
            rate = runs[label]["repetitive"][-1]["output_tokens_per_s"]
            _log(f"round {round_index + 1}, {label}: repetitive {rate:.1f} tok/s")
            if round_index == 0 and label in (PLAIN, f"ngram k={work['batch_k']}"):
                results["batch_sweep"][label] = {
                    b: measure(llm, "repetitive", b, work["max_tokens"])
                    for b in work["batch_sizes"]
                }
            model_name, dtype, device = llm.model_name, dtype_name(llm.dtype), str(llm.device)
            del llm
    for label in configs:
        results["batch1"][label] = {kind: median_run(runs[label][kind]) for kind in kinds}
    plain = results["batch1"][PLAIN]
    expected = {kind: plain[kind]["token_ids"] for kind in ("repetitive", "chat")}
    for label, point in results["batch1"].items():
        for kind in ("repetitive", "chat"):
            assert point[kind].pop("token_ids") == expected[kind], f"{label} changed {kind}"
            point[kind]["speedup"] = (
                point[kind]["output_tokens_per_s"] / plain[kind]["output_tokens_per_s"]
            )
    sweep_plain, sweep_ngram = results["batch_sweep"].values()
    for b in work["batch_sizes"]:
        assert sweep_ngram[b].pop("token_ids") == sweep_plain[b].pop("token_ids")
        sweep_ngram[b]["speedup"] = (
            sweep_ngram[b]["output_tokens_per_s"] / sweep_plain[b]["output_tokens_per_s"]
        )
    ngram = {k: results["batch1"][f"ngram k={k}"] for k in work["k_ngram"]}
    best_k = max(ngram, key=lambda k: ngram[k]["repetitive"]["speedup"])
    draft = {k: results["batch1"][f"draft k={k}"] for k in work["k_draft"]}
    best_draft = max(draft, key=lambda k: draft[k]["repetitive"]["speedup"])
    summary = {
        "ngram_best_k": best_k,
        "ngram_speedup_repetitive_batch1": ngram[best_k]["repetitive"]["speedup"],
        "ngram_tokens_per_forward_repetitive": ngram[best_k]["repetitive"][
            "tokens_per_target_forward"
        ],
        "ngram_speedup_chat_batch1": ngram[best_k]["chat"]["speedup"],
        "draft_best_k": best_draft,
        "draft_speedup_repetitive_batch1": draft[best_draft]["repetitive"]["speedup"],
        "draft_acceptance_rate_repetitive": draft[best_draft]["repetitive"]["acceptance_rate"],
        "plain_tokens_per_s_repetitive": plain["repetitive"]["output_tokens_per_s"],
        "plain_async_tokens_per_s_repetitive": results["batch1"][ASYNC]["repetitive"][
            "output_tokens_per_s"
        ],
        "ngram_speedup_at_largest_batch": sweep_ngram[work["batch_sizes"][-1]]["speedup"],
    }
    record = bench_record(
        stage=NAME,
        title="speculative decoding: speedup against k, drafter, workload and batch size",
        summary=summary,
        results=results | {"peak_memory": peak_memory()},
        workload=work | base,
        model=model_name,
        dtype=dtype,
        device=device,
        quick=quick,
    )
    path = write_results(NAME, record, _plot(summary, results, work, model_name), out_dir)
    _log(f"wrote {path} and its .png")
    return record


def _plot(summary: dict, results: dict, work: dict, model_name: str) -> Any:
    fig, (ax1, ax2, ax3) = new_figure(3, f"Stage 08 speculative decoding: {model_name}")
    styles = {"repetitive": "o-", "chat": "s--"}
    for drafter, color in (("ngram", "tab:blue"), ("draft", "tab:orange")):
        ks = work[f"k_{drafter}"]
        for kind, style in styles.items():
            points = [results["batch1"][f"{drafter} k={k}"][kind] for k in ks]
            name = "n-gram" if drafter == "ngram" else f"draft ({work['draft_layers']} layers)"
            ax1.plot(
                ks, [p["speedup"] for p in points], style, color=color, label=f"{name}, {kind}"
            )
            ax2.plot(
                ks,
                [p["tokens_per_target_forward"] for p in points],
                style,
                color=color,
                label=f"{name}, {kind}",
            )
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.set_xlabel("draft tokens per step (k)")
    ax1.set_ylabel("speedup over plain decoding (batch 1)")
    ax1.set_title(
        f"n-gram {summary['ngram_speedup_repetitive_batch1']:.2f}x on the repetitive workload "
        f"(k={summary['ngram_best_k']})",
        fontsize=9,
    )
    ax2.set_xlabel("draft tokens per step (k)")
    ax2.set_ylabel("tokens per target forward (accepted + 1)")
    ax2.set_title("What each verification yields", fontsize=9)
    sizes = work["batch_sizes"]
    sweep = results["batch_sweep"][f"ngram k={work['batch_k']}"]
    ax3.plot(sizes, [sweep[b]["speedup"] for b in sizes], "o-", color="tab:blue")
    ax3.axhline(1.0, color="gray", lw=1)
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(sizes, [str(b) for b in sizes])
    ax3.set_xlabel("batch size (repetitive workload)")
    ax3.set_ylabel(f"n-gram (k={work['batch_k']}) speedup")
    ax3.set_title("Speculation pays less as the batch grows", fontsize=9)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    return fig
