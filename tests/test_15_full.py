"""Stage 15 promises: every technique behind one configuration, presets, and /metrics.

- Composition: every exact technique on at once gives the plain engine's greedy tokens and
  teacher-forced logits; every pair of switches the configuration accepts starts and serves,
  with the plain tokens unless a switch is lossy; a pair it refuses says why.
- Presets fill the fields left at their defaults, an explicit field wins, an unknown name lists
  the known ones, and the server picks its topology from the resolved configuration.
- /metrics: Prometheus text with vLLM's names whose numbers add up to what the clients got:
  prompt and generated tokens, one TTFT and one end-to-end sample per request, one
  inter-token gap per token after the first, prefix-cache hits equal to the responses'
  `cached_tokens`, preemptions equal to /health's, nothing running or waiting at the end; with
  data parallelism one labelled series per replica, summing to the same totals.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import re
from types import SimpleNamespace

import httpx
import pytest
import torch

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject

pytestmark = since("15")
METRICS = subject(
    "observability/metrics.py", "server.py", "frontend/engine_core.py", "frontend/dp_client.py"
)

BLOCK = 4
PROMPTS = [list(range(10 + i, 40 + 3 * i)) + list(range(10 + i, 20 + i)) for i in range(5)]
# The plain engine: one technique at a time would be stage 03's first half.
PLAIN = {"kv_layout": "contiguous", "scheduling": "static", "async_scheduling": False,
         "chunked_prefill": False, "prefix_caching": False, "max_model_len": 128}  # fmt: skip
ALL_EXACT = {"kv_layout": "paged", "scheduling": "continuous", "async_scheduling": True,
             "chunked_prefill": True, "max_num_batched_tokens": 16, "prefix_caching": True,
             "speculative": "ngram", "kv_offload_bytes": 2**20, "preemption_mode": "swap",
             "max_model_len": 128}  # fmt: skip
# Switches a pair is drawn from: (name, value that differs from PLAIN, exact?)
TOGGLES = (
    ("kv_layout", "paged", True), ("scheduling", "continuous", True),
    ("async_scheduling", True, True), ("chunked_prefill", True, True),
    ("prefix_caching", True, True), ("speculative", "ngram", True),
    ("kv_offload_bytes", 2**20, True), ("quantization", "int8", False),
    ("kv_cache_dtype", "int8", False),
)  # fmt: skip


def _greedy(stage, n=10):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


# ------------------------------------------------------------------------------ composition
def test_every_exact_technique_at_once_gives_the_plain_tokens_and_logits(
    stage, make_llm, tiny_model
):
    path = tiny_model("llama-gqa")
    plain = make_llm(stage, path, block_size=BLOCK, **PLAIN)
    full = make_llm(stage, path, block_size=BLOCK, **ALL_EXACT)
    greedy = [_greedy(stage, 24)] * len(PROMPTS)  # long enough to repeat itself: drafts
    expected = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    full.generate(PROMPTS[:1], _greedy(stage, 2))  # a prefix to hit
    outputs = full.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outputs] == expected
    assert any(o.num_cached_tokens for o in outputs), "the prefix cache was meant to hit"
    assert full.spec_stats.num_accepted_tokens > 0, "speculation was meant to draft"
    # Logits, step by step (the recorder reads one row per request: no speculation there).
    unspeculated = make_llm(stage, path, block_size=BLOCK, **{**ALL_EXACT, "speculative": None})
    with step_logits(unspeculated) as recorded:
        outputs = unspeculated.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outputs] == expected
    assert_logits_match_teacher_forcing(unspeculated, outputs, recorded)
    full.check_no_leaks()


@pytest.mark.parametrize(
    ("first", "second"), list(itertools.combinations(range(len(TOGGLES)), 2)),
    ids=lambda i: TOGGLES[i][0],
)  # fmt: skip
def test_each_pair_of_switches_starts_and_serves(stage, make_llm, tiny_model, first, second):
    (a, a_value, a_exact), (b, b_value, b_exact) = TOGGLES[first], TOGGLES[second]
    config = {**PLAIN, a: a_value, b: b_value}
    if config.get("kv_offload_bytes"):
        config["preemption_mode"] = "swap"
    path = tiny_model("llama-gqa")
    try:
        stage.EngineConfig(**config)
    except ValueError as refused:  # the matrix excludes this pair: it must say why
        assert a in str(refused) or b in str(refused), refused
        return
    outputs = make_llm(stage, path, block_size=BLOCK, **config).generate(
        PROMPTS[:3], _greedy(stage, 6)
    )
    assert all(len(o.token_ids) == 6 for o in outputs)
    if a_exact and b_exact:
        plain = make_llm(stage, path, block_size=BLOCK, **PLAIN)
        expected = plain.generate(PROMPTS[:3], _greedy(stage, 6))
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_refused_combinations_name_their_switches(stage):
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        stage.EngineConfig(
            kv_role="prefill", kv_transfer_address="tcp://127.0.0.1:1", kv_offload_bytes=1
        )
    with pytest.raises(ValueError, match="disaggregated"):
        stage.EngineConfig(disaggregated=True, data_parallel_size=2)


# ------------------------------------------------------------------------------ presets
def test_presets_fill_defaults_and_an_explicit_field_wins(stage):
    presets = importlib.import_module(f"{stage.__name__}.presets")
    assert set(presets.PRESETS) == {"chatbot", "api", "long-context", "moe"}
    for name, preset in presets.PRESETS.items():
        config = stage.EngineConfig(preset=name, device="cpu")
        settings = presets.preset_settings(name, torch.device("cpu"))
        assert set(settings) == set(preset.settings), name
        assert all(getattr(config, k) == v for k, v in settings.items()), name
        assert preset.scenario and preset.why
    config = stage.EngineConfig(preset="long-context", kv_offload_bytes=2**31, block_size=32)
    assert config.kv_offload_bytes == 2**31 and config.block_size == 32
    assert config.kv_cache_dtype == "int8" and config.preemption_mode == "swap"
    with pytest.raises(ValueError, match="chatbot"):
        stage.EngineConfig(preset="laptop")


def test_an_explicit_value_wins_over_a_preset_even_the_default(stage):
    """Which fields the caller passed decides, not whether a value equals the default; a
    replace of a preset config keeps its values (replace passes every field)."""
    config = stage.EngineConfig(preset="chatbot", speculative=None)
    assert config.speculative is None and config.prefix_caching
    assert stage.EngineConfig(preset="chatbot", prefix_caching=True).speculative == "ngram"
    positional = stage.EngineConfig(stage.EngineConfig().model, None, preset="long-context")
    assert positional.device is None and positional.kv_cache_dtype == "int8"
    assert dataclasses.replace(config, block_size=32).speculative is None
    long = dataclasses.replace(stage.EngineConfig(preset="long-context"), kv_offload_bytes=2**31)
    assert long.kv_cache_dtype == "int8" and long.preemption_mode == "swap"
    assert long.kv_offload_bytes == 2**31
    with pytest.raises(TypeError):  # passed twice: refused, as the dataclass refuses it
        stage.EngineConfig("m", model="m", preset="chatbot")


def test_the_long_context_cap_is_per_device(stage, monkeypatch):
    """One default step's tokens per request: 256 on a CPU, 2,048 on a GPU (whose budget is
    2,048: a cap of 256 there gave a lone long prompt 8x the steps to its first token)."""
    from stages.common import devices

    presets = importlib.import_module(f"{stage.__name__}.presets")
    for device, cap in (("cpu", 256), ("cuda", 2048)):
        assert devices.default_long_prefill_token_threshold(torch.device(device)) == cap
        settings = presets.preset_settings("long-context", torch.device(device))
        assert settings["long_prefill_token_threshold"] == cap, device
        config = stage.EngineConfig(preset="long-context", device=device)
        assert config.long_prefill_token_threshold == cap, device
        budget = devices.default_max_num_batched_tokens(
            torch.device(device), chunked_prefill=True, max_model_len=8192
        )
        assert cap == budget, "a lone prompt gets whole default steps"
    assert stage.EngineConfig(preset="long-context", long_prefill_token_threshold=64) \
        .long_prefill_token_threshold == 64  # fmt: skip
    for auto, cap in (("cuda", 2048), ("cpu", 256)):  # no device given: "auto", resolved
        monkeypatch.setenv(devices.DEVICE_VARIABLE, auto)  # as a machine with(out) a GPU
        assert stage.EngineConfig(preset="long-context").long_prefill_token_threshold == cap


def test_the_moe_preset_refuses_a_dense_checkpoint(stage, tiny_model):
    """Expert parallelism on a dense model would replicate it on both ranks and exchange
    nothing: refused in the caller's process, before any rank starts, saying what to do."""
    with pytest.raises(ValueError, match="dense") as refused:
        stage.LLM(str(tiny_model("llama-gqa")), preset="moe", kv_cache_bytes=2**20)
    assert "moe_split_experts" in str(refused.value) and "expert_parallel" in str(refused.value)


def test_health_shows_the_resolved_config_and_why_async_is_off(stage, live_server, tiny_model):
    """The chatbot preset speculates, and a step with drafts runs alone: /health's resolved
    configuration says when async scheduling is off, and why. On a CPU it is off by default
    (`devices.default_async_scheduling`), and the note says that instead."""
    server, app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK, preset="chatbot")
    report = httpx.get(f"{server.url}/health", timeout=10).json()
    config = report["config"]
    assert config["preset"] == "chatbot" and config["speculative"] == "ngram"
    engine = app.state.engine.engine
    assert config == json.loads(json.dumps(dataclasses.asdict(engine.config)))
    limit = config["speculative_disable_batch_size"]
    note = report["config_notes"]["async_scheduling"]
    if engine.device.type == "cpu":
        assert config["async_scheduling"] is False and note.startswith("off; on a CPU")
    else:
        assert note.startswith(f"off while at most {limit} requests run") and "drafts" in note
    assert "speculative_disable_batch_size" in report["config_notes"]
    notes = importlib.import_module(f"{stage.__name__}.config").resolution_notes
    overlapping = notes(stage.EngineConfig(preset="chatbot", async_scheduling=True))
    assert overlapping["async_scheduling"].startswith(f"off while at most {limit} requests run")
    always = notes(stage.EngineConfig(preset="chatbot", speculative_disable_batch_size=None))
    assert always["async_scheduling"].startswith("off: speculative='ngram' runs steps one at")
    presets = importlib.import_module(f"{stage.__name__}.presets").PRESETS
    assert "async scheduling is off" in presets["chatbot"].implies
    assert notes(stage.EngineConfig()) == {}  # nothing resolved yet: nothing to say
    on_cpu = notes(stage.EngineConfig(device="cpu", async_scheduling=False))
    assert on_cpu["async_scheduling"].startswith("off; on a CPU that is the default")


def test_async_scheduling_is_per_device_by_default(stage, make_llm, tiny_model):
    """`async_scheduling=None` (the default) resolves to on with CUDA and off on a CPU, where
    the overlap gains nothing and its thread costs the engine (devices.default_async_scheduling);
    off, a CPU runner has no worker thread (its steps run in `launch`), and an explicit True
    keeps the overlap on a CPU too."""
    path = tiny_model("llama-gqa")
    llm = make_llm(stage, path, block_size=BLOCK, max_model_len=128)
    on_cpu = llm.device.type == "cpu"
    assert llm.config.async_scheduling is (not on_cpu)
    if on_cpu:
        assert llm.runner._worker is None
        overlapped = make_llm(stage, path, block_size=BLOCK, max_model_len=128,
                              async_scheduling=True)  # fmt: skip
        assert overlapped.config.async_scheduling and overlapped.runner._worker is not None
        params = _greedy(stage)
        prompts = PROMPTS[:3]
        assert [o.token_ids for o in llm.generate(prompts, params)] == [
            o.token_ids for o in overlapped.generate(prompts, params)
        ]


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_drafts_stop_above_the_batch_threshold_and_tokens_stay(
    stage, make_llm, tiny_model, monkeypatch, mode
):
    """speculative_disable_batch_size: while more requests run than it, no drafts are
    scheduled and steps overlap (async scheduling); at or below it, drafts are, and each step
    runs alone. Greedy tokens equal a run without speculation."""
    path = tiny_model("llama-gqa")
    plain = make_llm(stage, path, block_size=BLOCK, max_model_len=128)
    extra = {"draft_num_layers": 1} if mode == "draft" else {}
    capped = make_llm(stage, path, block_size=BLOCK, max_model_len=128, speculative=mode,
                      speculative_disable_batch_size=2, async_scheduling=True,
                      **extra)  # fmt: skip
    assert capped.config.async_scheduling, "async stays on: steps without drafts overlap"
    steps = []  # after each step: requests running, and whether a step is left in flight

    def step(step=capped.step):
        outputs = step()
        steps.append((len(capped.scheduler.running), capped._in_flight is not None))
        return outputs

    monkeypatch.setattr(capped, "step", step)
    params = [_greedy(stage, 24)] * 4
    expected = [o.token_ids for o in plain.generate(PROMPTS[:4], params)]
    assert [o.token_ids for o in capped.generate(PROMPTS[:4], params)] == expected
    assert capped.spec_stats.num_draft_tokens == 0, "4 running > 2: no drafts"
    assert any(in_flight for running, in_flight in steps if running > 2), "steps overlapped"
    steps.clear()
    assert [o.token_ids for o in capped.generate(PROMPTS[:2], params[:2])] == expected[:2]
    assert capped.spec_stats.num_draft_tokens > 0, "2 running <= 2: drafts"
    assert steps and not any(in_flight for _, in_flight in steps), "drafting steps run alone"
    with pytest.raises(ValueError, match="speculative_disable_batch_size"):
        stage.EngineConfig(speculative_disable_batch_size=-1)


def test_a_preset_picks_the_serving_topology(stage, tiny_model, monkeypatch):
    chosen = []
    for kind in ("LLM", "DPClient", "DisaggClient"):
        monkeypatch.setattr(stage, kind, lambda *a, _kind=kind, **k: chosen.append(_kind))
    stage.serving_engine(str(tiny_model("llama-gqa")), preset="api")
    stage.serving_engine(str(tiny_model("llama-gqa")), preset="chatbot")
    stage.serving_engine(str(tiny_model("llama-gqa")), preset="chatbot", engine_core_process=False)
    stage.serving_engine(str(tiny_model("llama-gqa")), disaggregated=True)
    # one engine is served from an engine-core process too (vLLM V1's layout), unless asked not
    assert chosen == ["DPClient", "DPClient", "LLM", "DisaggClient"]


# ------------------------------------------------------------------------------ /metrics
def test_histogram_buckets_are_cumulative_and_count_every_value(stage):
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    histogram = metrics.Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 3.0, 50.0):
        histogram.observe(value)
    assert histogram.counts == [2, 3, 4], "le=0.1 holds 0.05 and 0.1 itself"
    assert histogram.count == 5 and histogram.total == pytest.approx(53.65)


def test_observe_takes_ttft_every_gap_and_e2e_from_the_request_clocks(stage):
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics()
    request = SimpleNamespace(
        arrival_time=10.0, token_times=[10.5, 10.7, 11.2], finish_time=11.3,
        prompt_token_ids=[1] * 7, output_token_ids=[5, 6, 7], finish_reason="length",
        request_id="r", num_cached_tokens=4, events=[("scheduled", 10.1)],
    )  # fmt: skip
    frontend.observe(request)
    assert frontend.ttft.count == 1 and frontend.ttft.total == pytest.approx(0.5)
    assert frontend.itl.count == 2 and frontend.itl.total == pytest.approx(0.7)
    assert frontend.e2e.count == 1 and frontend.e2e.total == pytest.approx(1.3)
    assert (frontend.prompt_tokens, frontend.generation_tokens) == (7, 3)
    assert frontend.finished == {"length": 1}
    events = [(e["event"], e["t_s"]) for e in frontend.traces["r"]["events"]]
    approx = pytest.approx
    assert events == [("arrived", 0), ("scheduled", approx(0.1)), ("first_token", approx(0.5)),
                      ("finished", approx(1.3))]  # fmt: skip
    text = metrics.render(frontend, [("0", {"num_running": 2})])
    samples = parse_metrics(text)
    assert samples[("vllm:inter_token_latency_seconds_count", (("engine", "frontend"),))] == 2
    assert samples[("vllm:num_requests_running", (("engine", "0"),))] == 2


_SAMPLE = re.compile(r"^([a-z0-9_:]+)(?:\{([^}]*)\})? (\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text format 0.0.4 -> {(name, labels): value}; every line must parse."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert not line or re.match(r"# (HELP|TYPE) [a-z0-9_:]+ ", line), line
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match[2] or "")))
        samples[(match[1], labels)] = float(match[3])
    return samples


def _total(samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _complete(url: str, body: dict) -> dict:
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def _check_metrics_add_up(url: str, engines: int) -> None:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    before = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
    shared = "one two three four five six seven eight nine ten " * 3
    usages = []
    for i in range(6):
        body = {"model": model, "prompt": shared + f"question {i}", "max_tokens": 5 + i,
                "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1,
                "stream_options": {"include_usage": True} if i % 2 else None}  # fmt: skip
        usages.append(_complete(url, {k: v for k, v in body.items() if v is not None}))
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = parse_metrics(response.text)
    grew = lambda name: _total(after, name) - _total(before, name)
    assert grew("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert grew("vllm:time_to_first_token_seconds_count") == len(usages)
    assert grew("vllm:e2e_request_latency_seconds_count") == len(usages)
    assert grew("vllm:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages
    )
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    assert cached > 0 and grew("vllm:prefix_cache_hits_total") == cached
    assert grew("vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    labels = {dict(k[1]).get("engine") for k in after if k[0] == "vllm:num_requests_running"}
    assert len(labels) == engines
    assert _total(after, "vllm:num_requests_running") == 0
    assert _total(after, "vllm:num_requests_waiting") == 0
    buckets = sorted(
        (float(dict(k[1])["le"]), v) for k, v in after.items()
        if k[0] == "vllm:time_to_first_token_seconds_bucket"
    )  # fmt: skip
    assert [v for _, v in buckets] == sorted(v for _, v in buckets), "buckets are cumulative"
    assert buckets[-1][1] == _total(after, "vllm:time_to_first_token_seconds_count")


def _check_trace(url: str, model: str) -> list[str]:
    """A finished request's trace agrees with its response; an unknown id is a 404."""
    body = {"model": model, "prompt": "count: one two three", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    trace = httpx.get(f"{url}/v1/requests/{reply['id']}/trace", timeout=10)
    assert trace.status_code == 200, trace.text
    trace = trace.json()
    names = [e["event"] for e in trace["events"]]
    times = [e["t_s"] for e in trace["events"]]
    assert names[0] == "arrived" and times[0] == 0 and names[-1] == "finished"
    assert times == sorted(times) and "first_token" in names
    assert names.index("scheduled") < names.index("first_token")
    usage = reply["usage"]
    assert (trace["prompt_tokens"], trace["output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"],
    )  # fmt: skip
    assert trace["finish_reason"] == reply["choices"][0]["finish_reason"]
    missing = httpx.get(f"{url}/v1/requests/no-such-request/trace", timeout=10)
    assert missing.status_code == 404 and "no trace" in missing.json()["error"]["message"]
    # /generate's ids are unguessable too: nobody reads another client's trace by counting
    body = {"prompt": "count: one two", "max_tokens": 2}
    generated = httpx.post(f"{url}/generate", json=body, timeout=60).json()["request_id"]
    assert httpx.get(f"{url}/v1/requests/{generated}/trace", timeout=10).status_code == 200
    for guess in ("req-0", "req-1", "req-2"):
        assert httpx.get(f"{url}/v1/requests/{guess}/trace", timeout=10).status_code == 404
    return names


def test_a_preempted_request_traces_its_preemption_and_its_return(stage, make_llm, tiny_model):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, kv_cache_bytes=3 * 2**14,
                   async_scheduling=False)  # fmt: skip
    before = llm.scheduler.num_preemptions
    outputs = llm.generate(PROMPTS, [_greedy(stage, 24)] * len(PROMPTS))  # 96 tokens of KV
    preempted = sum(name == "preempted" for o in outputs for name, _ in o.events)
    assert preempted == llm.scheduler.num_preemptions - before > 0, "the pool was meant to preempt"
    for o in outputs:
        names = [name for name, _ in o.events]
        assert names[0] == "scheduled"
        assert all(after == "scheduled" for before, after in itertools.pairwise(names)
                   if before == "preempted")  # fmt: skip
        assert [t for _, t in o.events] == sorted(t for _, t in o.events)


def test_metrics_carry_the_host_tiers_counters(stage, make_llm, tiny_model):
    """A tight pool with swap preemption stores and loads blocks through the host tier: each of
    the connector's counters reaches /metrics' text; an engine without a connector has none."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, kv_cache_bytes=3 * 2**14,
                   kv_offload_bytes=2**20, preemption_mode="swap")  # fmt: skip
    llm.generate(PROMPTS, [_greedy(stage, 24)] * len(PROMPTS))
    stats = dataclasses.asdict(llm.kv_connector.stats)
    assert stats["blocks_stored"] > 0 and stats["tokens_loaded"] > 0, "the pool was meant to swap"
    text = metrics.render(metrics.FrontendMetrics(), [("0", metrics.engine_counters(llm))])
    samples = parse_metrics(text)
    for name, value in stats.items():
        assert samples[(f"vllm:kv_connector_{name}_total", (("engine", "0"),))] == value, name
    plain = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    assert "kv_connector" not in metrics.render(
        metrics.FrontendMetrics(), [("0", metrics.engine_counters(plain))]
    )


@METRICS
def test_metrics_add_up_to_what_the_clients_got(stage, tiny_model, live_server):
    server, _app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    _check_metrics_add_up(server.url, engines=1)
    _check_trace(
        server.url, httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    )
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    samples = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
    assert _total(samples, "vllm:num_preemptions_total") == health["num_preemptions"]


@METRICS
@pytest.mark.slow
def test_the_api_preset_serves_two_replicas_and_metrics_label_each(stage, tiny_model):
    from stages.common.tooling.server_process import ThreadedServer

    client = stage.serving_engine(  # the api preset: two replicas, cache-aware routing
        str(tiny_model("llama-gqa")), preset="api", block_size=BLOCK, kv_cache_bytes=2**22
    )
    assert isinstance(client, stage.DPClient) and len(client.replicas) == 2
    server = ThreadedServer(stage.create_app(client)).start()
    try:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        assert health["config"]["data_parallel_size"] == 2
        notes = health["config_notes"]  # only what quantization="auto" chose (random: fp32)
        assert set(notes) == {"quantization"} and "auto: fp32" in notes["quantization"]
        _check_metrics_add_up(server.url, engines=2)
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        _check_trace(server.url, model)  # the core's scheduler events crossed the pipe
    finally:
        server.stop()
        client.shutdown()


def test_health_reports_the_host_tier(stage, live_server, tiny_model):
    """/health shows the connector's counters: a swapped request's store and load count there."""
    server, app = live_server(
        stage, tiny_model("llama-gqa"), block_size=BLOCK, kv_offload_bytes=2**20,
        preemption_mode="swap",
    )  # fmt: skip
    engine = app.state.engine.engine
    body = {"model": engine.model_name, "prompt": [10, 11, 12, 13, 14, 15, 16, 17, 18],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    report = httpx.get(f"{server.url}/health", timeout=10).json()
    assert report["kv_connector"] == dataclasses.asdict(engine.kv_connector.stats)
    assert set(report["kv_connector"]) >= {"tokens_loaded", "blocks_stored", "swapped_in"}
    samples = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
    labels = (("engine", "0"), ("model_name", engine.model_name))
    for name, value in report["kv_connector"].items():  # /metrics says what /health says
        assert samples[(f"vllm:kv_connector_{name}_total", labels)] == value, name
