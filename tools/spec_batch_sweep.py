"""Where n-gram speculation stops paying: stage 15 at batch 1..16, with and without drafts.

    python tools/spec_batch_sweep.py [--max-tokens 32] [--batches 1 2 4 8 16]

Two workloads: "repetitive" (stage 08's rewrite-this-code chats, where drafts are accepted
often) and "chat" (stage 15's bench prompts: one shared system prompt, a different question).
The chatbot preset's switches (prefix caching, chunked prefill) and four engines: "off" (no
speculation, async scheduling as the engine runs it), "off_sync" (no speculation, steps one at
a time, as speculation runs them), "ngram" (drafts at every batch) and "capped" (ngram with the
chatbot preset's speculative_disable_batch_size, above it only). Runs are interleaved, best of
2. On a machine shared with other work wall-clock rates swing by 2x between runs, so each row
also gives output tokens per CPU second of this process (`time.process_time`), which other
processes' load moves far less; the speculation ratio read from it is ngram against off_sync.
Greedy tokens are compared across the engines (same_tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    s15, s08 = load("15"), load("08")
    bench15 = __import__(f"{s15.__name__}.bench", fromlist=["_prompts"])
    bench08 = __import__(f"{s08.__name__}.bench", fromlist=["CODE"])
    limit = s15.presets.SPECULATION_MAX_BATCH
    work = bench15._workload(False)
    base = {"max_model_len": 1024, "kv_cache_bytes": work["kv_cache_bytes"],
            "prefix_caching": True, "chunked_prefill": True}  # fmt: skip
    configs = {
        "off": {},
        "off_sync": {"async_scheduling": False},
        "ngram": {"speculative": "ngram"},
        "capped": {"speculative": "ngram", "speculative_disable_batch_size": limit},
    }
    llms = {name: s15.LLM(**base, **config) for name, config in configs.items()}
    chat = bench15._prompts(llms["off"], work)
    params = s15.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(chat[:1], params)  # warm, and the shared system prompt cached

    def repetitive(count: int) -> list[list[dict[str, str]]]:
        names = bench08.RENAMES
        return [
            [{"role": "user", "content": f"Rewrite this Python code, renaming the variable "
              f"`{names[i % len(names)]}` to `renamed_{names[i % len(names)]}`. Reply with the "
              f"whole code only.\n\n{bench08.CODE}"}]
            for i in range(count)
        ]  # fmt: skip

    results = {}
    for kind in ("repetitive", "chat"):
        for batch in args.batches:
            names = [n for n in configs if n != "capped" or batch > limit]
            rate, cpu_rate, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), {}
            for _ in range(2):
                for name in names:
                    cpu, wall = time.process_time(), time.perf_counter()
                    if kind == "chat":
                        outputs = llms[name].generate(chat[:batch], params)
                    else:
                        outputs = llms[name].chat(repetitive(batch), params)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    tokens[name] = [o.token_ids for o in outputs]
                    count = sum(len(t) for t in tokens[name])
                    rate[name] = max(rate[name], count / wall)
                    cpu_rate[name] = max(cpu_rate[name], count / cpu)
            row = {f"{n}_tokens_per_s": round(rate[n], 1) for n in names}
            row |= {f"{n}_tokens_per_cpu_s": round(cpu_rate[n], 1) for n in names}
            row |= {f"{n}_vs_off_sync_cpu": round(cpu_rate[n] / cpu_rate["off_sync"], 3)
                    for n in names if n != "off_sync"}  # fmt: skip
            row["same_tokens"] = all(t == tokens["off"] for t in tokens.values())
            results[f"{kind} {batch}"] = row
            print(kind, batch, row, file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
