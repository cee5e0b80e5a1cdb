"""What entering inference mode once a step costs the engine: the step profile with the runner's
`_forward_and_sample` as it is (`@torch.inference_mode()`), with torch's C-level guard entered
directly (`torch._C._InferenceMode`, no Python context object), and with no inference mode at
all (the weights need no gradient either way, so nothing is recorded).

    python plots/step_profile/experiments_2026-11-30c/inference_mode_cost.py [--rounds 3]
        [--requests 64 256]

Alternating, stage 15, the step profile's workload (tiny random checkpoint, one torch thread,
64 greedy tokens a request). Reported: the engine's own CPU per step and the forward's CPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


def variant_engine(real_engine, mode):
    def engine(*args, **kwargs):
        llm = real_engine(*args, **kwargs)
        runner = llm.runner
        assert not any(p.requires_grad for p in runner.model.parameters())
        plain = type(runner)._forward_and_sample.__wrapped__
        if mode == "none":
            runner._forward_and_sample = types.MethodType(plain, runner)
        elif mode == "c guard":

            @functools.wraps(plain)
            def guarded(self, inputs):
                with torch._C._InferenceMode(True):
                    return plain(self, inputs)

            runner._forward_and_sample = types.MethodType(guarded, runner)
        return llm

    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = step_profile._engine
    print(step_profile.machine())
    modes = ("decorator", "c guard", "none")
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_tiny_checkpoint(Path(folder), TinySpec())
        for n in args.requests:
            cells: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
            for round_ in range(args.rounds):
                for mode in modes:
                    step_profile._engine = variant_engine(real, mode)
                    p = step_profile.profile_stage("15", n, checkpoint)
                    values = {"own": p.own_cpu_per_step_us, "forward": p.phases_cpu_us["forward"]}
                    for key, value in values.items():
                        cells[mode].setdefault(key, []).append(value)
                    shown = "  ".join(f"{k} {v:,.0f}" for k, v in values.items())
                    print(f"{n:>4} requests, round {round_}, {mode}: {shown}", flush=True)
            step_profile._engine = real
            for key in ("own", "forward"):
                shown = ", ".join(f"{m} {statistics.median(cells[m][key]):,.0f}" for m in modes)
                print(f"{n:>4} requests, {key} CPU us per step (medians): {shown}")


if __name__ == "__main__":
    main()
