"""A stage's server against llama.cpp's llama-server: the same streaming load, interleaved.

Most readers run the course on a laptop CPU, where llama.cpp is the engine they know. This puts
both behind the same OpenAI-compatible `/v1/chat/completions`, sends the same chat prompts at
1 / 8 / 32 / 64 concurrent streams (each answer exactly `--max-tokens` tokens: `ignore_eos`),
and records what the client sees: output tokens per second over the whole load, time to first
token and inter-token latency. Rounds alternate which server goes first, so a slow minute of a
shared machine falls on both.

llama-server runs the embedded model's own file (the Q4_1 GGUF the stages read), with as many
threads as the machine has cores and a slot per stream; it is built once from the
llama-cpp-python sdist by `tools/llama_build.py` (about 5 minutes on two cores).

    python tools/serve_compare.py                        # stage 15 vs llama-server
    python tools/serve_compare.py --no-llama --streams 1 8   # the stage alone
    python tools/serve_compare.py --stage 15 --config max_num_seqs=64 --rounds 2

Writes `plots/serve_compare.json` and `plots/serve_compare.png` (or under `--out-dir`), with
the machine, the versions and every cell's numbers. Not part of the suite (minutes); a test
runs its load against a stage alone on the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common.tooling.hardware import hardware_info  # noqa: E402
from stages.common.tooling.load_client import ClientRequest, send_request  # noqa: E402
from stages.common.tooling.server_process import ServerProcess, stop_process  # noqa: E402
from stages.common.weights import embedded_gguf_path  # noqa: E402

STREAMS = (1, 8, 32, 64)
MAX_TOKENS = 128
QUESTIONS = (
    "Explain how a hash map works.",
    "Write a short poem about the sea.",
    "What causes the seasons on Earth?",
    "Give three tips for learning a new language.",
    "Describe the water cycle.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Summarize the plot of a detective story in a few sentences.",
)


def _log(message: str) -> None:
    print(f"[serve_compare] {message}", file=sys.stderr, flush=True)


def chat_requests(streams: int, max_tokens: int) -> list[ClientRequest]:
    """`streams` chat requests, the questions in turn, each exactly `max_tokens` long."""
    return [
        ClientRequest(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            max_tokens,
            api="chat",
            extra={
                "temperature": 0.0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},  # the server counts the tokens
            },
        )
        for i in range(streams)
    ]


def _p50_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1000, 1) if values else None


async def _load(url: str, requests: list[ClientRequest], model: str | None) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(send_request(client, url, r, model) for r in requests))
        seconds = time.perf_counter() - started
    errors = [r.error for r in results if not r.ok]
    # Tokens as the server counted them: a chunk whose token ends mid-character carries no
    # text, so counting chunks with text undercounts.
    tokens = sum(r.usage_tokens if r.usage_tokens is not None else r.num_tokens for r in results)
    return {
        "streams": len(requests),
        "ok": not errors,
        "errors": errors[:3],
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "ttft_p50_ms": _p50_ms([r.ttft for r in results if r.ttft is not None]),
        "itl_p50_ms": _p50_ms([gap for r in results for gap in r.itl]),
    }


def run_load(url: str, streams: int, max_tokens: int, model: str | None = None) -> dict[str, Any]:
    """One cell: `streams` concurrent streaming chat requests against `url`."""
    return asyncio.run(_load(url, chat_requests(streams, max_tokens), model))


class LlamaServer:
    """llama-server on the embedded GGUF, on a free port, until the `with` block ends."""

    def __init__(self, binary: Path, slots: int, threads: int, context_per_slot: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            str(binary), "-m", str(embedded_gguf_path()), "--host", "127.0.0.1",
            "--port", str(self.port), "-t", str(threads), "-np", str(slots),
            "-c", str(slots * context_per_slot), "--no-webui",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        _log("$ " + " ".join(self.command))
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:  # our timeout or Ctrl-C during the start: no server left behind
            self._wait_until_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited at start ({self.process.returncode})")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama-server did not answer /health within 120 s")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process)


OFFLINE = """
import argparse, json, sys, time
from stages import load
from stages.cli_args import engine_kwargs
stage_id, model, config, max_tokens, question = json.loads(sys.argv[1])
stage = load(stage_id)
kwargs = engine_kwargs(stage, argparse.Namespace(config=config))  # as `serve --config` parses
llm = stage.LLM(model, **kwargs) if model else stage.LLM(**kwargs)
ids = llm.tokenizer.encode_chat([{"role": "user", "content": question}])
def run(n):
    params = stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([ids], params)
    return time.perf_counter() - started
run(8)  # warm
rounds = [(run(max_tokens) - run(1)) / (max_tokens - 1) for _ in range(3)]
print(json.dumps(sorted(rounds)[1]))
"""


def offline_itl_ms(stage: str, model: str | None, config: list[str], max_tokens: int) -> float:
    """The same engine offline, in a process of its own: one sequence's time per output token
    after the first ((time of `max_tokens` - time of 1) / (max_tokens - 1), median of 3), the
    number a served stream's inter-token latency is held to."""
    payload = json.dumps([stage, model, config, max_tokens, QUESTIONS[0]])
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE, payload], cwd=ROOT, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the offline run failed: {done.stderr[-2000:]}")
    return round(float(done.stdout.strip().splitlines()[-1]) * 1000, 2)


def compare(
    servers: dict[str, str], streams: list[int], rounds: int, max_tokens: int
) -> list[dict[str, Any]]:
    """Every (server, streams) cell `rounds` times, the servers' order alternating per round;
    each server is warmed once first. Cells are kept per round (the JSON has every one)."""
    for name, url in servers.items():
        _log(f"warming {name}")
        run_load(url, 2, 8)
    cells = []
    names = list(servers)
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for count in streams:
            for name in order:
                cell = {
                    "server": name,
                    "round": round_index,
                    **run_load(servers[name], count, max_tokens),
                }
                _log(
                    f"round {round_index} {name:>14} {count:>3} streams: "
                    f"{cell['tokens_per_s']:7.1f} tok/s, TTFT p50 {cell['ttft_p50_ms']} ms, "
                    f"ITL p50 {cell['itl_p50_ms']} ms{'' if cell['ok'] else ' ERRORS'}"
                )
                cells.append(cell)
    return cells


def summarize(cells: list[dict[str, Any]], stage_name: str) -> list[dict[str, Any]]:
    """Per stream count: each server's median over rounds, and the stage / llama ratio."""
    rows = []
    for count in sorted({c["streams"] for c in cells}):
        row: dict[str, Any] = {"streams": count}
        for server in sorted({c["server"] for c in cells}):
            mine = [c for c in cells if c["server"] == server and c["streams"] == count]
            for key in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms"):
                values = [c[key] for c in mine if c[key] is not None]
                row[f"{server} {key}"] = round(statistics.median(values), 2) if values else None
        llama = row.get("llama-server tokens_per_s")
        if llama:
            row["ratio"] = round(row[f"{stage_name} tokens_per_s"] / llama, 2)
        rows.append(row)
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, stage_name = result["summary"], result["stage_name"]
    servers = [s for s in (stage_name, "llama-server") if f"{s} tokens_per_s" in rows[0]]
    streams = [r["streams"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for server in servers:
        for axis, key in zip(axes, ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms"), strict=True):
            axis.plot(streams, [r[f"{server} {key}"] for r in rows], marker="o", label=server)
    for axis, title in zip(
        axes,
        ("output tokens/s (all streams)", "time to first token, p50 (ms)", "inter-token p50 (ms)"),
        strict=True,
    ):
        axis.set_xscale("log", base=2)
        axis.set_xticks(streams, [str(s) for s in streams])
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    if "llama-server" in servers:
        for row in rows:
            point = (row["streams"], row[f"{stage_name} tokens_per_s"])
            axes[0].annotate(
                f"{row['ratio']}x", point, textcoords="offset points", xytext=(0, 6),
                ha="center", fontsize=8,
            )  # fmt: skip
    machine = result["machine"]
    fig.suptitle(
        f"{stage_name} vs llama-server, {result['max_tokens']} tokens per answer, "
        f"{result['rounds']} rounds: {machine.get('cpu_model', '?')}, "
        f"{machine.get('cpu_cores', '?')} cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="15")
    parser.add_argument("--model", default=None, help="the stage's model (default: embedded)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to the stage's serve (default: max_num_seqs=64)")  # fmt: skip
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--no-llama", action="store_true", help="the stage alone")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "plots")
    parser.add_argument("--name", default="serve_compare", help="file name of the JSON and PNG")
    args = parser.parse_args(argv)
    if any(s < 1 for s in args.streams) or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--streams, --rounds and --max-tokens must be positive")
    config = args.config or [f"max_num_seqs={max(args.streams)}"]
    stage_args: list[str] = [arg for pair in config for arg in ("--config", pair)]
    stage_name = f"stage {args.stage}"
    versions: dict[str, Any] = {}
    with ServerProcess(args.stage, model=args.model, extra_args=tuple(stage_args)) as stage:
        servers = {stage_name: stage.url}
        _log(f"{stage_name} at {stage.url} ({' '.join(stage_args)})")
        if args.no_llama:
            cells = compare(servers, args.streams, args.rounds, args.max_tokens)
        else:
            sys.path.insert(0, str(ROOT / "tools"))
            from llama_build import VERSION, build

            binary = build()
            versions["llama-cpp-python"] = VERSION
            per_slot = 512 + args.max_tokens
            with LlamaServer(binary, max(args.streams), args.llama_threads, per_slot) as llama:
                servers["llama-server"] = llama.url
                cells = compare(servers, args.streams, args.rounds, args.max_tokens)
        health = httpx.get(f"{stage.url}/health", timeout=5.0).json()
    _log("the same engine offline, one sequence")
    offline = offline_itl_ms(args.stage, args.model, config, args.max_tokens)
    summary = summarize(cells, stage_name)
    one = next((row for row in summary if row["streams"] == 1), None)
    served = one and one[f"{stage_name} itl_p50_ms"]
    result = {
        "tool": "tools/serve_compare.py",
        "stage": args.stage,
        "stage_name": stage_name,
        "stage_config": config,
        "stage_health": health,
        "llama_threads": None if args.no_llama else args.llama_threads,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "machine": hardware_info(),
        "versions": versions,
        "cells": cells,
        "summary": summary,
        "offline_itl_ms": offline,
        "served_over_offline_itl": round(served / offline, 3) if served else None,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out_dir / f"{args.name}.png")
    for row in result["summary"]:
        print(json.dumps(row))
    print(json.dumps({key: result[key] for key in ("offline_itl_ms", "served_over_offline_itl")}))
    _log(f"wrote {json_path} and its .png")
    return result


if __name__ == "__main__":
    main()
