"""Stage 15: /metrics as vLLM writes it, parsed with the official Prometheus parser.

- /health says "draining" with a 503 while the server drains, and a request refused then is
  not counted as finished ("abort" or otherwise);
- a request waiting for its KV to load counts as waiting; the host tier's swapped-out requests
  are `vllm:num_requests_swapped`;
- a dead replica's gauges drop to zero, and its requests count as failed ("error");
- every series carries `model_name` and `engine`;
- TTFT is observed when the first token reaches the front end; inter-token latency once per
  engine iteration, however many tokens it brought.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import since

pytestmark = since("15")
BLOCK = 4


def prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value}, by prometheus_client's parser (it raises on bad text)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _server(stage, tiny_model, **config):
    from stages.common.server_process import ThreadedServer

    llm = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK, kv_cache_bytes=2**20,
                    max_model_len=128, **config)  # fmt: skip
    app = stage.create_app(llm)
    return ThreadedServer(app).start(), app


def test_health_says_draining_and_a_refused_request_is_not_counted(stage, tiny_model):
    server, app = _server(stage, tiny_model)
    try:
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        app.state.engine.drain(0.0)  # nothing in flight: refuses from now on
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        body = {"model": model, "prompt": "one two", "max_tokens": 2}
        for stream in (False, True):
            refused = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": stream},
                                 timeout=10)  # fmt: skip
            assert refused.status_code == 503
        samples = prometheus(httpx.get(f"{server.url}/metrics", timeout=10).text)
        assert _total(samples, "vllm:request_success_total") == 0, "refused, never finished"
        assert _total(samples, "vllm:e2e_request_latency_seconds_count") == 0
    finally:
        server.stop()
