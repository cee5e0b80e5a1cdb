"""Stage 15: /metrics as vLLM writes it, parsed with the official Prometheus parser.

- /health says "draining" with a 503 while the server drains, and a request refused then is
  not counted as finished ("abort" or otherwise);
- a request waiting for its KV to load counts as waiting; the host tier's swapped-out requests
  are `vllm:num_requests_swapped`;
- a dead replica's gauges drop to zero, and its requests count as failed ("error");
- every series carries `model_name` and `engine`;
- TTFT is observed when the first token reaches the front end; inter-token latency once per
  engine iteration, however many tokens it brought;
- vLLM's request histograms (queue, prefill, decode, inference time; prompt and generated
  tokens) and, per engine core, the tokens of each step (`vllm:iteration_tokens_total`);
- the counters add up to what the clients received, in one process, with two replicas (a
  replica killed mid-stream: its request counts as "error", its gauges and /health read 0) and
  disaggregated (the KV the decode core received is no prefix hit and no cached token).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import TEST_KV_CACHE_BYTES, since
from .test_09_tp import _wait_gone

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
    from stages.common.tooling.server_process import ThreadedServer

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


def _fake_engine(stage, *, waiting=(), loading=(), running=(), swaps=None):
    """An engine as engine_counters reads it: queues, a pool, totals; a host tier if `swaps`."""
    kv_stats = SimpleNamespace(queried_tokens=0, hit_tokens=0)
    kv = SimpleNamespace(allocator=SimpleNamespace(num_blocks=8), num_free_blocks=8, stats=kv_stats)
    spec = SimpleNamespace(num_verifications=0, num_draft_tokens=0, num_accepted_tokens=0)
    connector = None
    if swaps is not None:
        connector_stats = importlib.import_module(
            f"{stage.__name__}.kv_connector.base"
        ).ConnectorStats
        connector = SimpleNamespace(stats=connector_stats(), holds_swap=set(swaps).__contains__)
    scheduler = SimpleNamespace(
        waiting=[SimpleNamespace(request_id=r) for r in waiting],
        running=[SimpleNamespace(request_id=r) for r in running],
        loading={r: SimpleNamespace(request_id=r) for r in loading},
        num_preemptions=0,
        connector=connector,
    )
    return SimpleNamespace(scheduler=scheduler, kv_manager=kv, spec_stats=spec,
                           kv_connector=connector)  # fmt: skip


def test_a_loading_request_waits_and_the_host_tier_counts_swapped_requests(stage):
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    counters = metrics.engine_counters(_fake_engine(stage, waiting=["a"], loading=["b"]))
    assert counters["num_waiting"] == 2, "a request whose KV is loading has not run yet"
    plain = prometheus(metrics.render(metrics.FrontendMetrics(), [("0", counters)]))
    assert not any(name == "vllm:num_requests_swapped" for name, _ in plain)
    tiered = _fake_engine(stage, waiting=["a", "c"], loading=["b"], running=["d"], swaps=["a", "b"])
    counters = metrics.engine_counters(tiered)
    assert counters["num_swapped"] == 2 and counters["num_waiting"] == 3
    samples = prometheus(metrics.render(metrics.FrontendMetrics(), [("0", counters)]))
    assert _total(samples, "vllm:num_requests_swapped", engine="0") == 2


def test_a_dead_cores_gauges_drop_to_zero_and_its_requests_count_as_failed(stage):
    """A killed replica's last report said 3 running: a dead core runs nothing, so its gauges
    read zero; its counters keep their totals (a counter never goes back)."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    last = {"num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.5, "prefix_hits": 7,
            "num_swapped": 1}  # fmt: skip
    client = SimpleNamespace(
        replicas=[SimpleNamespace(alive=True, stats=dict(last)),
                  SimpleNamespace(alive=False, stats=dict(last))],
        roles=None,
    )  # fmt: skip
    snapshots = dict(metrics.engine_snapshots(client))
    assert snapshots["0"] == last
    assert snapshots["1"] == last | {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0,
                                     "num_swapped": 0}  # fmt: skip
    frontend = metrics.FrontendMetrics()
    failed = SimpleNamespace(
        arrival_time=1.0, token_times=[1.5], finish_time=2.0, prompt_token_ids=[1, 2],
        output_token_ids=[3], finish_reason="error", request_id="r", num_cached_tokens=0,
        events=[],
    )  # fmt: skip
    frontend.observe(failed)
    assert frontend.finished == {"error": 1}


def test_every_series_carries_model_name_and_engine(stage, tiny_model, live_server):
    server, _app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "one two three", "max_tokens": 3, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    samples = prometheus(httpx.get(f"{server.url}/metrics", timeout=10).text)
    assert len(samples) > 20
    for name, labels in samples:
        labels = dict(labels)
        assert labels.get("model_name") == model, name
        assert "engine" in labels, name
    assert _total(samples, "vllm:num_requests_running", model_name=model, engine="0") == 0


def _request(**fields) -> SimpleNamespace:
    """A request as the front end's metrics read it: arrived at 10.0, four prompt tokens,
    nothing generated, still running; `fields` override."""
    defaults = dict(
        arrival_time=10.0, token_times=[], finish_time=None, prompt_token_ids=[1] * 4,
        output_token_ids=[], finish_reason=None, request_id="r", num_cached_tokens=0, events=[],
    )  # fmt: skip
    return SimpleNamespace(**(defaults | fields))


def test_ttft_is_observed_at_the_first_token_and_itl_once_per_iteration(stage):
    """A stream's TTFT is in /metrics as soon as its first token reaches the front end; under
    speculation one iteration brings several tokens (one time): one gap, not zeros."""
    import asyncio

    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics()
    request = _request()  # arrived at 10.0, nothing generated yet
    seen = []

    class Inner:
        async def generate(self, _request):
            for times in ([10.5], [10.7, 10.7, 10.7], [11.2]):  # three iterations, five tokens
                request.token_times += times
                request.output_token_ids += [7] * len(times)
                yield SimpleNamespace(finished=False)
                await asyncio.sleep(0)
            request.finish_reason, request.finish_time = "length", 11.3

    async def consume():
        async for _ in metrics.ObservedClient(Inner(), frontend).generate(request):
            seen.append(frontend.ttft.count)

    asyncio.run(consume())
    assert seen == [1, 1, 1], "TTFT observed with the first token, once"
    assert frontend.ttft.total == pytest.approx(0.5)
    assert frontend.itl.count == 2 and frontend.itl.total == pytest.approx(0.7), "per iteration"
    assert frontend.e2e.count == 1 and frontend.generation_tokens == 5


def test_a_finished_request_leaves_nothing_behind_and_its_reason_is_a_label(stage):
    """`observe` is the end of a request's life in the front end: its id leaves `timed` (a
    server runs for weeks; a client may reuse an id, whose TTFT must count again), the traces
    keep the last TRACES_KEPT, and a request that ended without a reason (an abort) is counted
    as "abort", a label /metrics can render, not as None."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics()
    for arrival in (10.0, 20.0):  # the same id twice, one after the other
        request = _request(
            arrival_time=arrival, token_times=[arrival + 0.5], output_token_ids=[7],
            finish_reason="stop", finish_time=arrival + 1,
        )  # fmt: skip
        frontend.first_token(request)  # a stream's first token reached the front end
        frontend.observe(request)
        assert not frontend.timed, "a finished request's id is forgotten"
    assert frontend.ttft.count == 2 and frontend.ttft.total == pytest.approx(1.0)
    frontend.observe(_request(request_id="aborted"))  # no finish reason, nothing generated
    assert frontend.finished == {"stop": 2, "abort": 1}
    samples = prometheus(metrics.render(frontend, [], "m"))
    assert _total(samples, "vllm:request_success_total", finished_reason="abort") == 1
    kept = metrics.TRACES_KEPT
    for i in range(kept + 5):
        frontend.observe(_request(request_id=f"q{i}", finish_reason="length"))
    assert len(frontend.traces) == kept, "the oldest traces go"
    ids = list(frontend.traces)
    assert ids[0] == "q5" and ids[-1] == f"q{kept + 4}"


def test_observe_takes_the_lock_that_metrics_renders_under(stage):
    """/metrics renders from a worker thread while `observe` runs on the event loop: an update
    made without the lock can be read half done (a count without its sum)."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics()
    request = _request(token_times=[10.5], output_token_ids=[7], finish_reason="stop",
                       finish_time=11.0)  # fmt: skip
    with frontend.lock:  # a render holds it
        observer = threading.Thread(target=frontend.observe, args=(request,), daemon=True)
        observer.start()
        observer.join(0.2)
        assert observer.is_alive(), "observe waits for the render to finish"
        assert frontend.e2e.count == 0
    observer.join(10)
    assert not observer.is_alive() and frontend.e2e.count == 1


def test_a_request_not_streamed_has_its_ttft_in_metrics_while_it_runs(stage):
    """A non-streamed request reaches the front end in one output, at its end; vLLM's front end
    sees every engine step and observes its TTFT at the first token. Here a scrape does."""
    import asyncio

    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics()
    request = _request()  # arrived at 10.0, nothing generated yet
    scraped = []

    class Inner:  # one output, at the end
        async def generate(self, _request):
            request.token_times.append(10.5)  # the engine's first token: no output yet
            request.output_token_ids.append(7)
            await asyncio.sleep(0)
            scraped.append(render())
            request.token_times.append(10.7)
            request.output_token_ids.append(7)
            request.finish_reason, request.finish_time = "length", 10.8
            yield SimpleNamespace(finished=True)

    def render():
        frontend.observe_first_tokens()  # what GET /metrics does first
        return prometheus(metrics.render(frontend, [], "m"))

    async def consume():
        async for _ in metrics.ObservedClient(Inner(), frontend).generate(request):
            pass

    asyncio.run(consume())
    (during,) = scraped
    assert _total(during, "vllm:time_to_first_token_seconds_count") == 1
    assert _total(during, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert frontend.ttft.count == 1, "observed once"
    assert not frontend.in_flight, "a finished request is no longer in flight"


def test_one_iterations_tokens_share_one_time(stage, make_llm, tiny_model):
    """Speculation accepts several tokens in one step: they carry that step's time."""
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, speculative="ngram",
                   max_model_len=128, async_scheduling=False)  # fmt: skip
    prompt = [10, 11, 12, 13] * 6
    params = stage.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (output,) = llm.generate([prompt], params)
    assert llm.spec_stats.num_accepted_tokens > 0, "the prompt was meant to be drafted from"
    distinct = len(dict.fromkeys(output.token_times))
    assert distinct == len(output.token_times) - llm.spec_stats.num_accepted_tokens


def test_a_requests_phases_and_lengths_go_into_their_histograms(stage):
    """vLLM's request histograms, from the request's clocks and its scheduler trace: queue
    (arrival to first scheduling, a preemption does not restart it), prefill (to the first
    token), decode (first to last token), inference (first scheduling to last token); prompt
    and generated tokens per request. A disaggregated request's first scheduling is the
    prefill core's."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    frontend = metrics.FrontendMetrics(max_model_len=100)
    assert frontend.prompt_lengths.edges == (1, 2, 5, 10, 20, 50, 100)
    request = _request(
        token_times=[10.5, 10.7, 11.2], finish_time=11.3, prompt_token_ids=[1] * 7,
        output_token_ids=[5, 6, 7], finish_reason="length",
        events=[("prefill_scheduled", 10.1), ("scheduled", 10.3), ("preempted", 10.8),
                ("scheduled", 10.9)],
    )  # fmt: skip
    assert metrics.request_phases(request) == pytest.approx(
        {"queue": 0.1, "prefill": 0.4, "decode": 0.7, "inference": 1.1}
    )
    frontend.observe(request)
    never_ran = _request(
        arrival_time=20.0, finish_time=20.5, prompt_token_ids=[1] * 30, finish_reason="abort",
        request_id="q",
    )  # fmt: skip
    frontend.observe(never_ran)
    phases = ("queue", "prefill", "decode", "inference")
    assert [getattr(frontend, name).count for name in phases] == [1] * 4, "the abort: none"
    totals = [getattr(frontend, name).total for name in phases]
    assert totals == pytest.approx([0.1, 0.4, 0.7, 1.1])
    assert (frontend.prompt_lengths.count, frontend.prompt_lengths.total) == (2, 37)
    assert frontend.prompt_lengths.counts == [0, 0, 0, 1, 1, 2, 2]
    assert (frontend.generation_lengths.count, frontend.generation_lengths.total) == (2, 3)
    samples = prometheus(metrics.render(frontend, [], "m"))
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert _total(samples, f"vllm:request_{name}_seconds_count") == 1, name
    assert _total(samples, "vllm:request_prompt_tokens_sum") == 37
    assert _total(samples, "vllm:request_generation_tokens_bucket", le="+Inf") == 2


def test_the_engine_counters_read_the_engine_that_produced_them(stage, make_llm, tiny_model):
    """Each number against the engine state it describes, step by step: the KV gauge is the
    share of the pool that requests' block tables hold (a free block whose K/V is cached for a
    prefix hit is free), drafts count verifications (one per request per step that had drafts,
    not draft tokens), preemptions are the scheduler's. A tight pool preempts; repeated prompts
    give n-gram drafts."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, kv_cache_bytes=3 * 2**14,
                   speculative="ngram", async_scheduling=False, max_model_len=128)  # fmt: skip
    kv = llm.kv_manager
    params = stage.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i in range(4):
        llm.add_request(llm.make_request([10 + i, 11, 12, 13] * 5, params))
    usages = []
    while llm.has_unfinished():
        llm.step()
        counters = metrics.engine_counters(llm)
        held = {b for r in llm.scheduler.running for b in kv.block_ids(r.request_id)}
        assert counters["kv_cache_usage"] == pytest.approx(len(held) / kv.allocator.num_blocks)
        usages.append(counters["kv_cache_usage"])
    assert max(usages) > 0.5 and usages[-1] == 0, "the pool filled, then emptied"
    spec = llm.spec_stats
    assert spec.num_draft_tokens > spec.num_verifications > 0, "drafts of several tokens"
    assert counters["spec_drafts"] == spec.num_verifications
    assert counters["spec_draft_tokens"] == spec.num_draft_tokens
    assert counters["spec_accepted_tokens"] == spec.num_accepted_tokens
    assert counters["num_preemptions"] == llm.scheduler.num_preemptions > 0, "the pool preempted"
    samples = prometheus(metrics.render(metrics.FrontendMetrics(), [("0", counters)], "m"))
    assert _total(samples, "vllm:num_preemptions_total") == llm.scheduler.num_preemptions


def test_the_running_gauge_holds_while_requests_wait(stage, make_llm, tiny_model):
    """One request runs at a time (max_num_seqs=1), the other waits: `num_running` counts the
    running one alone at every step (running plus waiting would read 2), `num_waiting` the
    other, until both finished."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, max_model_len=64,
                   max_num_seqs=1, async_scheduling=False)  # fmt: skip
    params = stage.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i in range(2):
        llm.add_request(llm.make_request([10 + i, 11, 12], params))
    seen = []
    while llm.has_unfinished():
        llm.step()
        counters = metrics.engine_counters(llm)
        seen.append((counters["num_running"], counters["num_waiting"]))
        assert counters["num_running"] == len(llm.scheduler.running) <= 1, seen
    assert (1, 1) in seen and seen[-1] == (0, 0), seen


def test_the_engine_counts_tokens_per_step(stage, make_llm, tiny_model):
    """`vllm:iteration_tokens_total`: each step's scheduled tokens, counted by the scheduler
    (in the core's process) and sent as cumulative buckets with its other counters."""
    metrics = importlib.import_module(f"{stage.__name__}.observability.metrics")
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK, max_model_len=128,
                   prefix_caching=False)  # fmt: skip
    before = metrics.engine_counters(llm)
    prompts = [[10 + i] * (5 + 4 * i) for i in range(3)]
    params = stage.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    after = metrics.engine_counters(llm)
    grew = lambda key: after[key] - before.get(key, 0)
    computed = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outputs)
    assert grew("iteration_tokens_sum") == computed
    assert grew("iteration_tokens_count") >= 4, "a prefill step, then a decode step per token"
    assert grew("iteration_tokens_le_1") == 0, "three requests decode together: 3 per step"
    samples = prometheus(metrics.render(metrics.FrontendMetrics(), [("0", after)], "m"))
    assert (
        _total(samples, "vllm:iteration_tokens_total_sum", engine="0")
        == after["iteration_tokens_sum"]
    )
    assert (
        _total(samples, "vllm:iteration_tokens_total_bucket", le="+Inf")
        == after["iteration_tokens_count"]
    )


# ------------------------------------------------------------------ the counters add up
PHASES = ("queue_time", "prefill_time", "decode_time", "inference_time")


def _scrape(url: str):
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return prometheus(response.text)


def _requests(url: str, salt: str | None = None, n: int = 4, own: bool = False) -> list[dict]:
    """n short greedy completions sharing a prefix (a prefix hit after the first, unless each
    has its `own` salt); their usages."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    usages = []
    for i in range(n):
        body = {"model": model, "prompt": "one two three four five six seven " + f"q{i}",
                "max_tokens": 2 + i, "temperature": 0, "ignore_eos": True}  # fmt: skip
        if salt is not None:
            body["cache_salt"] = f"{salt}-{i}" if own else salt
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    return usages


def _check_frontend(before, after, usages: list[dict]) -> None:
    """What the front end counted equals what the clients got."""
    grew = lambda name, **labels: _total(after, name, **labels) - _total(before, name, **labels)
    prompts = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    n = len(usages)
    assert grew("vllm:request_success_total", finished_reason="length") == n
    assert grew("vllm:prompt_tokens_total") == prompts
    assert grew("vllm:generation_tokens_total") == generated
    assert grew("vllm:request_prompt_tokens_sum") == prompts
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_prompt_tokens_count") == n
    assert grew("vllm:request_generation_tokens_bucket", le="+Inf") == n
    for name in ("time_to_first_token", "e2e_request_latency", *(f"request_{p}" for p in PHASES)):
        assert grew(f"vllm:{name}_seconds_count") == n, name
    assert grew("vllm:inter_token_latency_seconds_count") == generated - n


def _cached(usages: list[dict]) -> int:
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)


def _check_colocated(before, after, usages: list[dict], engines: int) -> None:
    """Engines that compute whole requests: their prefix hits are the clients' cached tokens,
    and their steps computed every prompt token not cached and every token but the last."""
    _check_frontend(before, after, usages)
    grew = lambda name, **labels: _total(after, name, **labels) - _total(before, name, **labels)
    assert grew("vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("vllm:prefix_cache_hits_total") == _cached(usages) > 0
    computed = sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in usages) - _cached(
        usages
    )
    assert grew("vllm:iteration_tokens_total_sum") == computed
    labels = {dict(ls).get("engine") for n, ls in after if n == "vllm:iteration_tokens_total_sum"}
    assert labels == {str(i) for i in range(engines)}
    assert _total(after, "vllm:num_requests_running") == 0


def test_the_counters_add_up_in_process(stage, tiny_model, live_server):
    server, _app = live_server(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    before = _scrape(server.url)
    usages = _requests(server.url, salt=f"in-process-{time.monotonic_ns()}")
    _check_colocated(before, _scrape(server.url), usages, engines=1)


def _dp_client(stage, tiny_model):
    return stage.serving_engine(str(tiny_model("llama-gqa")), data_parallel_size=2,
                                routing_policy="round_robin", block_size=BLOCK,
                                kv_cache_bytes=TEST_KV_CACHE_BYTES)  # fmt: skip


@pytest.mark.slow
def test_two_replicas_add_up_and_a_killed_ones_request_counts_as_failed(stage, tiny_model):
    """DP=2: the counters add up over both replicas. Then a replica killed mid-stream: its
    request counts as failed ("error"), its gauges read zero in /metrics and /health."""
    from stages.common.tooling.server_process import ThreadedServer

    client = _dp_client(stage, tiny_model)
    try:
        with ThreadedServer(stage.create_app(client)) as server:
            before = _scrape(server.url)
            usages = _requests(server.url, salt=f"dp-{time.monotonic_ns()}")
            _check_colocated(before, _scrape(server.url), usages, engines=2)
            before = _scrape(server.url)
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0, "stream": True}  # fmt: skip
            killed: list[int] = []

            def stream() -> None:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and not killed:
                            victim = max(range(2), key=lambda i: client.replicas[i].num_running)
                            killed.append(victim)
                            os.kill(client.replicas[victim].process.pid, signal.SIGKILL)

            thread = threading.Thread(target=stream)
            thread.start()
            thread.join(timeout=60)
            assert not thread.is_alive() and killed
            assert _wait_gone([client.replicas[killed[0]].process.pid])
            after = _scrape(server.url)
            grew = lambda name, **ls: _total(after, name, **ls) - _total(before, name, **ls)
            assert grew("vllm:request_success_total", finished_reason="error") == 1
            assert grew("vllm:request_success_total") == 1, "failed, not aborted"
            dead = str(killed[0])
            for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                assert _total(after, f"vllm:{gauge}", engine=dead) == 0, gauge
            replica = httpx.get(f"{server.url}/health", timeout=10).json()["replicas"][killed[0]]
            assert not replica["alive"] and replica["running"] == replica["waiting"] == 0
    finally:
        client.shutdown()


@pytest.mark.slow
def test_a_disaggregated_pair_adds_up_and_counts_no_transfer_as_a_hit(stage, tiny_model):
    """Disaggregated: the prefill core computes the prompts (its prefix hits are the clients'
    cached tokens), the decode core computes one prompt token and the rest of the tokens of
    each request; the KV it received counts under its connector, never as a prefix hit."""
    from stages.common.tooling.server_process import ThreadedServer

    client = stage.serving_engine(str(tiny_model("llama-gqa")), disaggregated=True,
                                  block_size=BLOCK, kv_cache_bytes=TEST_KV_CACHE_BYTES)  # fmt: skip
    try:
        with ThreadedServer(stage.create_app(client)) as server:
            salt = f"disagg-{time.monotonic_ns()}"
            for fresh in (True, False):  # a salt each (nothing cached), then the same again
                before = _scrape(server.url)
                usages = _requests(server.url, salt=salt, own=True)
                after = _scrape(server.url)
                _check_frontend(before, after, usages)
                prompts = sum(u["prompt_tokens"] for u in usages)
                cached = _cached(usages)
                for engine, name, value in (
                    ("prefill", "prefix_cache_queries_total", prompts),
                    ("prefill", "prefix_cache_hits_total", cached),
                    ("prefill", "iteration_tokens_total_sum", prompts - cached),
                    # the decode core computes each prompt's last token, then decodes
                    ("decode", "iteration_tokens_total_sum",
                     sum(u["completion_tokens"] for u in usages)),
                ):  # fmt: skip
                    got = _total(after, f"vllm:{name}", engine=engine) - _total(
                        before, f"vllm:{name}", engine=engine
                    )
                    assert got == value, (engine, name)
                hits = [_total(m, "vllm:prefix_cache_hits_total", engine="decode")
                        for m in (before, after)]  # fmt: skip
                loaded = [_total(m, "vllm:kv_connector_tokens_loaded_total", engine="decode")
                          for m in (before, after)]  # fmt: skip
                if fresh:  # all but the last token of each prompt came by transfer: no hit
                    assert cached == 0 and hits[1] == hits[0]
                    assert loaded[1] - loaded[0] == prompts - len(usages)
                else:  # the prefill core's own hits
                    assert cached == sum((u["prompt_tokens"] - 1) // BLOCK * BLOCK for u in usages)
    finally:
        client.shutdown()
