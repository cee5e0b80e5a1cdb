"""The persistent batch against per-request packing: microseconds to pack one decode step.

    python tools/input_batch_bench.py [--requests 1 64 256]

Each request decodes one token at a context of about 100 with a table of 24 blocks of 16: the
step `InputBatch.pack` (stage 05) sees most often, its tables already held. The per-request
form is what the runners of stages 01-04 do: Python lists of ids, positions, slots (one
`slot_mapping` per request) and padded tables. The best of 5 x 300 runs each, on this machine.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16


def per_request(requests: list, block_size: int) -> None:
    """Stage 03's packing, lists only (no tensors): the baseline."""
    kv = importlib.import_module("stages.05_async.kv_cache")
    ids, positions, slots, logits_rows = [], [], [], []
    for r in requests:
        start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens
        ids += r.token_ids
        positions += range(start, end)
        slots += kv.slot_mapping(r.block_ids, start, end, block_size)
        if r.sample:
            logits_rows.append(len(ids) - 1)
    query_lens = [r.num_new_tokens for r in requests]
    width = max(len(r.block_ids) for r in requests)
    [list(r.block_ids) + [0] * (width - len(r.block_ids)) for r in requests]
    [0, *itertools.accumulate(query_lens)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 64, 256])
    args = parser.parse_args(argv)
    batch_module = importlib.import_module("stages.05_async.input_batch")
    output = importlib.import_module("stages.05_async.scheduler_output")
    params = importlib.import_module("stages.05_async.sampling").SamplingParams(temperature=0)
    for n in args.requests:
        requests = [
            output.ScheduledRequest(
                f"r{i}", 0, (5,), 100 + i, params, 0, True, tuple(range(i * 30, i * 30 + 24))
            )
            for i in range(n)
        ]
        batch = batch_module.InputBatch(max(n, 1), 128, BLOCK)
        batch.pack(requests)  # seats taken, tables written: the steady state
        best = {
            name: min(timeit.repeat(run, number=300, repeat=5)) / 300 * 1e6
            for name, run in (
                ("per-request lists", lambda r=requests: per_request(r, BLOCK)),
                ("InputBatch.pack", lambda r=requests, b=batch: b.pack(r)),
            )
        }
        print(f"{n:>4} requests: " + ", ".join(f"{k} {v:.1f} us" for k, v in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
