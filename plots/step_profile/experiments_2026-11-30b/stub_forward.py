"""How much of the engine's own CPU per step is the forward's doing: the step profile with the
real forward, and with a forward that returns a kept tensor at once (no kernel runs, no memory
is touched; the LM head and sampling still run).

    python plots/step_profile/experiments_2026-11-30b/stub_forward.py [--rounds 3]
        [--requests 1 64 256]

Alternating, stage 15, the step profile's workload (tiny random checkpoint, one torch thread,
64 greedy tokens a request). The stub's hidden states are zeros, so every request samples the
same token and the final detokenizing differs from the real run's: the update phase is not
comparable and is left out. Compared: the schedule and prepare-inputs phases (CPU per step),
and the engine's own CPU per step less the update phase.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint

UPDATE = "update, stop, detokenize"


def stubbed_engine(real_engine):
    def engine(*args, **kwargs):
        llm = real_engine(*args, **kwargs)
        hidden = torch.zeros(1 << 14, llm.runner.model.config.hidden_size)
        llm.runner.model.forward = lambda input_ids, *rest: hidden[: input_ids.shape[0]]
        return llm

    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256])
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = step_profile._engine
    print(step_profile.machine())
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for n in args.requests:
            cells: dict[str, dict[str, list[float]]] = {"real": {}, "stub": {}}
            for round_ in range(args.rounds):
                for mode in ("real", "stub"):
                    step_profile._engine = stubbed_engine(real) if mode == "stub" else real
                    p = step_profile.profile_stage("15", n, checkpoint)
                    values = {
                        "schedule": p.phases_cpu_us["schedule"],
                        "prepare": p.phases_cpu_us["prepare inputs"],
                        "own less update": p.own_cpu_per_step_us - p.phases_cpu_us[UPDATE],
                        "forward": p.phases_cpu_us["forward"],
                    }
                    for key, value in values.items():
                        cells[mode].setdefault(key, []).append(value)
                    shown = "  ".join(f"{k} {v:,.0f}" for k, v in values.items())
                    print(f"{n:>4} requests, round {round_}, {mode}: {shown}", flush=True)
            step_profile._engine = real
            for key in cells["real"]:
                r, s = statistics.median(cells["real"][key]), statistics.median(cells["stub"][key])
                print(f"{n:>4} requests, {key}: real {r:,.0f} us, stub {s:,.0f} us (medians)")


if __name__ == "__main__":
    main()
