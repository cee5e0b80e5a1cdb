"""Rendering `GET /metrics`: the Prometheus text exposition (format 0.0.4) under vLLM's names.

observability/metrics.py counts (the engine's snapshot, the front end's histograms); this module
only writes them out: which number goes under which name, with which labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import (
    Any,  # observability/metrics.py's Histogram and FrontendMetrics: it imports this module
)

FRONTEND = "frontend"  # the `engine` label of what the front end times, over every core

# Engine-side numbers: (key in `engine_counters`, metric name, type, help)
ENGINE_METRICS = (
    ("num_running", "vllm:num_requests_running", "gauge", "Requests in the running batch."),
    ("num_waiting", "vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    ("kv_cache_usage", "vllm:kv_cache_usage_perc", "gauge", "Share of KV blocks in use (0-1)."),
    (
        "prefix_queries",
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "prefix_hits",
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
    ),
    ("num_preemptions", "vllm:num_preemptions_total", "counter", "Requests preempted."),
    (
        "spec_drafts",
        "vllm:spec_decode_num_drafts_total",
        "counter",
        "Verifications of at least one draft token.",
    ),
    (
        "spec_draft_tokens",
        "vllm:spec_decode_num_draft_tokens_total",
        "counter",
        "Draft tokens proposed.",
    ),
    (
        "spec_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_total",
        "counter",
        "Draft tokens accepted.",
    ),
)

# The KV connector's counters (stage 12's host tier, stage 13's transfers), named after
# `ConnectorStats`' fields: vLLM's connectors each register their own names (`vllm:kv_offload_*`
# for its offloading connector, `vllm:nixl_*` for NIXL), so there is no one name to borrow.
# Rendered only for engines that have a connector.
CONNECTOR_METRICS = tuple(
    (f"kv_connector_{field_name}", f"vllm:kv_connector_{field_name}_total", "counter", help_text)
    for field_name, help_text in (
        ("tokens_loaded", "Tokens whose KV a connector loaded instead of computing."),
        ("blocks_stored", "KV blocks a connector stored (to the host tier, or sent)."),
        ("blocks_loaded", "KV blocks a connector loaded (from the host tier, or received)."),
        ("load_failures", "Connector loads that failed (the request recomputed)."),
        ("store_failures", "Connector stores that failed."),
        ("swapped_in", "Swapped-out requests that came back by a load."),
        ("swap_lost", "Swapped-out requests that had to recompute instead."),
    )
)


# Only where a host tier holds swapped-out requests (vLLM V0's gauge of the same name).
HOST_TIER_METRICS = (
    (
        "num_swapped",
        "vllm:num_requests_swapped",
        "gauge",
        "Waiting requests whose KV is swapped out to the host tier.",
    ),
)


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _labels(**labels: str | None) -> str:
    """`{a="x",b="y"}` for the labels given (None: left out), escaped as the format wants."""
    given = [
        (k, str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in labels.items()
        if v is not None
    ]
    return "{" + ",".join(f'{k}="{v}"' for k, v in given) + "}" if given else ""


def _histogram_lines(
    name: str, help_text: str, histogram: Any, labels: dict[str, str | None]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for edge, count in zip(histogram.edges, histogram.counts, strict=True):
        lines.append(f"{name}_bucket{_labels(**labels, le=str(edge))} {count}")
    lines.append(f"{name}_bucket{_labels(**labels, le='+Inf')} {histogram.count}")
    lines.append(f"{name}_sum{_labels(**labels)} {_number(histogram.total)}")
    lines.append(f"{name}_count{_labels(**labels)} {histogram.count}")
    return lines


def _iteration_tokens_lines(
    engines: list[tuple[str, dict[str, float]]], model_name: str | None
) -> list[str]:
    """`vllm:iteration_tokens_total`, per engine, from the cumulative counts its snapshot
    carries (metrics.StepTokens.counters: `iteration_tokens_le_<edge>`, `_sum`, `_count`)."""
    name = "vllm:iteration_tokens_total"
    having = [(e, stats) for e, stats in engines if "iteration_tokens_count" in stats]
    if not having:
        return []
    lines = [f"# HELP {name} Tokens scheduled per engine step.", f"# TYPE {name} histogram"]
    for engine, stats in having:
        labels = {"model_name": model_name, "engine": engine}
        buckets = [
            (k.removeprefix("iteration_tokens_le_"), v)
            for k, v in stats.items()
            if k.startswith("iteration_tokens_le_")
        ]
        buckets.append(("+Inf", stats["iteration_tokens_count"]))
        lines += [
            f"{name}_bucket{_labels(**labels, le=edge)} {_number(count)}" for edge, count in buckets
        ]
        lines.append(f"{name}_sum{_labels(**labels)} {_number(stats['iteration_tokens_sum'])}")
        lines.append(f"{name}_count{_labels(**labels)} {_number(stats['iteration_tokens_count'])}")
    return lines


def render(
    frontend: Any,
    engines: Iterable[tuple[str, dict[str, float]]],
    model_name: str | None = None,
) -> str:
    """The text exposition (format 0.0.4): the front end's histograms and totals, then each
    engine's numbers labelled by `engine`. Every series carries `model_name` when given (the
    server always gives it: vLLM's dashboards filter on it); the front end's carry
    `engine="frontend"`, since it times requests whichever core ran them."""
    front = {"model_name": model_name, "engine": FRONTEND}
    with frontend.lock:
        lines = []
        for name, help_text, histogram in (
            ("vllm:time_to_first_token_seconds", "Time to first token.", frontend.ttft),
            (
                "vllm:inter_token_latency_seconds",
                "Time between engine iterations that brought a request tokens.",
                frontend.itl,
            ),
            ("vllm:e2e_request_latency_seconds", "Arrival to finish of a request.", frontend.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Arrival to a request's first scheduling.",
                frontend.queue,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "First scheduling to first token of a request.",
                frontend.prefill,
            ),
            (
                "vllm:request_decode_time_seconds",
                "First token to last token of a request.",
                frontend.decode,
            ),
            (
                "vllm:request_inference_time_seconds",
                "First scheduling to last token of a request.",
                frontend.inference,
            ),
            (
                "vllm:request_prompt_tokens",
                "Prompt tokens per finished request.",
                frontend.prompt_lengths,
            ),
            (
                "vllm:request_generation_tokens",
                "Tokens generated per finished request.",
                frontend.generation_lengths,
            ),
        ):
            lines += _histogram_lines(name, help_text, histogram, front)
        for name, help_text, value in (
            (
                "vllm:prompt_tokens_total",
                "Prompt tokens of finished requests.",
                frontend.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Tokens generated by finished requests.",
                frontend.generation_tokens,
            ),
        ):
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} counter",
                f"{name}{_labels(**front)} {value}",
            ]
        lines += [
            "# HELP vllm:request_success_total Finished requests by finish reason.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason, count in sorted(frontend.finished.items()):
            labels = _labels(**front, finished_reason=reason)
            lines.append(f"vllm:request_success_total{labels} {count}")
    cores = list(engines)
    snapshots = [(_labels(model_name=model_name, engine=e), stats) for e, stats in cores]
    for key, name, kind, help_text in ENGINE_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, stats in snapshots:  # a core that has not stepped yet has counted nothing
            lines.append(f"{name}{labels} {_number(stats.get(key, 0))}")
    lines += _iteration_tokens_lines(cores, model_name)
    for key, name, kind, help_text in (*HOST_TIER_METRICS, *CONNECTOR_METRICS):
        having = [(labels, stats[key]) for labels, stats in snapshots if key in stats]
        if having:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {_number(value)}" for labels, value in having]
    return "\n".join(lines) + "\n"
