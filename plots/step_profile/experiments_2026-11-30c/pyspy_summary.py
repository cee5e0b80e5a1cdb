"""The engine's own samples in a py-spy profile of the step profile's workload, by function.

Recorded (raw stacks of the engine's thread kept in `pyspy_64_requests.raw.gz`):

    py-spy record -r 997 --format raw -o raw.txt -- python pyspy_loop.py 64 12

(`pyspy_loop.py`: stage 15 on the tiny checkpoint, one torch thread, 64 requests of 64 greedy
tokens through `LLM.generate`, twelve times.) Read:

    python plots/step_profile/experiments_2026-11-30c/pyspy_summary.py pyspy_64_requests.raw.gz

A sample is the engine's own when it is inside `LLM.run_all` and outside the model's phases (the
forward, the LM head, sampling). Printed: each function's share of those samples (inclusive),
then the samples outside schedule, prepare and update, by their first frames under `launch`.
"""

from __future__ import annotations

import gzip
import re
import sys
from collections import Counter

MODEL = ("forward (stages/15_full/model.py", "compute_logits", "sample (stages/15_full/sampling.py")
PHASES = ("Scheduler.schedule (", "ModelRunner.prepare_inputs (", "update_from_output (")


def main(path: str) -> None:
    own, inclusive, rest = 0, Counter(), Counter()
    with gzip.open(path, "rt") as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            n, frames = int(count), stack.split(";")
            if "run_all" not in stack or any(m in f for f in frames for m in MODEL):
                continue
            own += n
            for name in {re.sub(r":\d+\)", ")", f) for f in frames}:
                inclusive[name] += n
            if not any(p in f for f in frames for p in PHASES):
                at = next((i for i, f in enumerate(frames) if "ModelRunner.launch" in f), None)
                key = frames[at : at + 4] if at is not None else frames[-2:]
                rest[" > ".join(re.sub(r" \(.*", "", f) for f in key)] += n
    print(f"the engine's own samples: {own}")
    for name, n in inclusive.most_common(45):
        print(f"{n / own:6.1%}  {name[:140]}")
    outside = sum(rest.values())
    print(f"outside schedule, prepare and update: {outside} ({outside / own:.0%})")
    for name, n in rest.most_common(15):
        print(f"{n:5d}  {name[:160]}")


if __name__ == "__main__":
    main(sys.argv[1])
