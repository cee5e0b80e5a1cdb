"""The embedded model's output tokens per second at N concurrent streams, through `LLM.generate`.

The step profile (`step_profile.py`) runs a tiny model, so that the engine's own work shows. A
cut to that work must not cost the real model anything either: the step-cost issue asks that
the embedded model's tok/s at 1 and 64 streams not be lower after it than before. This measures
exactly that, on whatever machine it runs: a stage's `LLM` on the embedded SmolLM2-135M (the
default model), greedy, `ignore_eos`, N prompts at once of `PROMPT_TOKENS` tokens, each asked
for `output_tokens` tokens (64 for one stream, 32 each for more), after a short warm-up.

    python -m stages.common.tooling.embedded_throughput --stages 04 15 --streams 1 64
    python -m stages.common.tooling.embedded_throughput --stages 15 --config async_scheduling=true

prints one row per (stage, streams): the output tokens, the wall time and tok/s. `--config
KEY=VALUE` (repeatable) passes an `EngineConfig` field to every engine measured, so two settings
of one stage compare too. Compare two commits with `python tools/step_profile_ab.py BEFORE
--embedded` (alternating rounds, one run).

Each measurement runs in a process of its own: what one engine leaves in a process changes the
next one's speed. (An engine that ran its forward on the main thread leaves an OpenMP thread
team there; a later engine whose forward runs on a worker thread then shares the cores with
two teams, and libgomp stops spinning between parallel regions: stage 05's model_runner.py.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from stages import load, stage_info

PROMPT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Throughput:
    stage: str
    streams: int
    output_tokens: int  # all streams together
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def _prompts(streams: int) -> list[list[int]]:
    """Distinct prompts of token ids the model knows (no prefix shared between streams)."""
    return [[(13 * i + 7 * j) % 200 + 10 for j in range(PROMPT_TOKENS)] for i in range(streams)]


def config_values(items: list[str] | None) -> dict[str, Any]:
    """`KEY=VALUE` strings as `EngineConfig` keyword arguments: true/false, none, a number, or
    else the text itself (the engine validates the field and its value)."""
    words = {"true": True, "false": False, "none": None}
    config: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config {item!r}: expected KEY=VALUE")
        text = text.strip()
        value: Any = words.get(text.lower(), text)
        if isinstance(value, str):
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        config[key.strip().replace("-", "_")] = value
    return config


def measure(
    stage: str,
    streams: int,
    output_tokens: int | None = None,
    model: str | None = None,
    config: dict[str, Any] | None = None,
) -> Throughput:
    """One stage's `LLM.generate` on the embedded model (or `model`, a checkpoint's path: the
    tests' tiny one) with `streams` prompts at once; `config` adds `EngineConfig` fields."""
    if streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    tokens = output_tokens or (64 if streams == 1 else 32)
    module = load(stage)
    sizes = {"max_num_seqs": streams, "max_model_len": PROMPT_TOKENS + tokens + 16}
    sizes |= config or {}
    llm = module.LLM(model, **sizes) if model else module.LLM(**sizes)
    try:
        params = module.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        warm = module.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(_prompts(1), warm)  # first-call costs out of the number
        start = time.perf_counter()
        outputs = llm.generate(_prompts(streams), params)
        seconds = time.perf_counter() - start
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
    produced = sum(len(o.token_ids) for o in outputs)
    return Throughput(stage_info(stage).folder, streams, produced, seconds)


def table(rows: list[Throughput]) -> str:
    head = ["stage", "streams", "tokens", "seconds", "tok/s"]
    body = [
        [
            r.stage,
            str(r.streams),
            str(r.output_tokens),
            f"{r.seconds:.2f}",
            f"{r.tokens_per_second:,.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
        for row in [head, *body]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=["15"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 64])
    parser.add_argument(
        "--config", action="append", metavar="KEY=VALUE",
        help="an EngineConfig field for every engine measured (repeatable)",
    )  # fmt: skip
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # in this process
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.streams):
        parser.error("--streams must be positive")
    try:
        config = config_values(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.one:  # one measurement, printed as JSON for the parent
        print(json.dumps(asdict(measure(args.stages[0], args.streams[0], config=config))))
        return 0
    rows = []
    for stage in args.stages:
        for streams in args.streams:
            print(f"[embedded_throughput] stage {stage}, {streams} streams", file=sys.stderr)
            rows.append(_in_own_process(stage, streams, args.config or []))
    print(table(rows))
    return 0


def _in_own_process(stage: str, streams: int, config: list[str]) -> Throughput:
    command = [sys.executable, "-m", __spec__.name if __spec__ else __name__, "--one"]
    command += ["--stages", stage, "--streams", str(streams)]
    command += [f"--config={item}" for item in config]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"stage {stage} at {streams} streams failed:\n{done.stderr[-3000:]}")
    return Throughput(**json.loads(done.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    sys.exit(main())
