"""Take the screenshot of stage 15's live view that its README shows.

Starts `python -m stages 15 serve` (the embedded SmolLM2 unless --model), opens `/dashboard` in
headless Chromium, sends a workload of chat requests that share a system prompt (so prefix hits
light up), and saves the page while they run. Needs Debian's `chromium` and `chromium-driver`
(`make browser`) and selenium (a dev dependency).

    python tools/dashboard_screenshot.py                       # plots/15_dashboard.png
    python tools/dashboard_screenshot.py --config preset=api   # two replicas side by side
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common.tooling.browser import headless_chromium  # noqa: E402
from stages.common.tooling.server_process import ServerProcess  # noqa: E402

SYSTEM = "You are a helpful assistant who explains how inference engines schedule work. " * 3
QUESTIONS = [
    "What is a KV cache?", "Why batch requests?", "What is paged attention?",
    "What does a scheduler do?", "Why cache prefixes?", "What is speculative decoding?",
    "What is tensor parallelism?", "Why quantize the KV cache?",
]  # fmt: skip


def _chat(url: str, model: str, question: str, max_tokens: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 0,
    }
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "plots" / "15_dashboard.png")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--after", type=float, default=4.0, help="seconds into the workload")
    parser.add_argument("--size", default="1400x1000")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    extra = tuple(a for item in args.config for a in ("--config", item))
    print(f"starting the stage 15 server ({args.model or 'embedded SmolLM2'}) ...", flush=True)
    with ServerProcess("15", model=args.model, extra_args=extra) as server:
        try:
            browser = headless_chromium(width, height)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        try:
            browser.get(f"{server.url}/dashboard")
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            _chat(server.url, model, "Hello!", 4)  # caches the shared system prompt
            with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
                futures = [
                    pool.submit(_chat, server.url, model, q, args.max_tokens) for q in QUESTIONS
                ]
                time.sleep(args.after)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(args.out))
                print(f"wrote {args.out} ({args.after:.1f} s into {len(QUESTIONS)} requests)")
                for future in futures:
                    future.result()
        finally:
            browser.quit()


if __name__ == "__main__":
    main()
