"""Stage 09 promises: tensor parallelism changes where the model runs, never what it computes.

Real processes under torch.distributed (gloo here), started by the engine from its config. At
TP=2 and TP=3 greedy tokens equal TP=1's and transformers', teacher-forced logits agree within
fp32 rounding (the all-reduces sum partial products in another order); chunked prefill, prefix
caching and speculation still match; the server answers the official `openai` client at TP=3 on
the real model. Workers die with the engine (killed, SIGTERM, Ctrl-C); a dead worker fails the
requests instead of hanging them and `/health` says which rank; sizes that cannot be split are
refused before any process starts.

Process start-up costs seconds, so engines are kept per module (`make_llm`'s cache) and these
tests run where tensor parallelism is introduced and on the newest stage (`slow`).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import stages
from stages.common.tooling.hf_oracle import hf_greedy, hf_logits
from stages.common.tooling.server_process import ThreadedServer

from .conftest import assert_logits_match_teacher_forcing, since, step_logits, subject
from .parents import ParentProcesses

# What these tests are about: on a later newest stage they run again only if one of these changed.
TP_MODULES = (
    "parallel/executor.py",
    "parallel/multiproc_executor.py",
    "parallel/worker.py",
    "parallel/group.py",
    "parallel/layers.py",
    "model.py",
    "model_loader.py",
    "model_runner.py",
)
pytestmark = [since("09"), pytest.mark.slow, subject(*TP_MODULES)]
# The workers' lifecycle: what the tests of dying and failing workers are about.
LIFECYCLE = subject("parallel/executor.py", "parallel/multiproc_executor.py", "parallel/worker.py")

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(30, 67)), [3, 4], [10, 11, 12]]
# Summing the same fp32 partial products in another order moves a logit by ~1e-6 here.
LOGITS_ATOL = 1e-4
CASES = [("llama-gqa", 2), ("llama-mqa", 2), ("llama-tp3", 3)]  # KV heads =, <, = ranks


def _greedy(stage, n: int = 12):
    return stage.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(llm, stage, prompts=PROMPTS, n: int = 12):
    return [o.token_ids for o in llm.generate(prompts, [_greedy(stage, n)] * len(prompts))]


def _worker_pids(llm) -> list[int]:
    return [w["pid"] for w in llm.executor.workers()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is dead but not yet reaped by its parent: it holds nothing. The process can be
    # reaped between the signal and the read (a run with three workers did it): gone too.
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(("spec", "tp"), CASES, ids=[f"{s}-tp{t}" for s, t in CASES])
def test_tensor_parallel_equals_one_rank_and_transformers(
    stage, tiny_model, make_llm, hf_model, spec, tp
):
    path = tiny_model(spec)
    single = make_llm(stage, path, block_size=BLOCK)
    parallel = make_llm(stage, path, block_size=BLOCK, tensor_parallel_size=tp)
    assert len(_worker_pids(parallel)) == tp - 1
    with step_logits(parallel) as recorded:
        outputs = parallel.generate(PROMPTS, [_greedy(stage)] * len(PROMPTS))
    assert [o.token_ids for o in outputs] == _tokens(single, stage)
    assert_logits_match_teacher_forcing(parallel, outputs, recorded, atol=LOGITS_ATOL)
    hf = hf_model(path)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 12)[: len(out.token_ids)]
        ids = prompt + list(out.token_ids)
        torch.testing.assert_close(
            parallel.prompt_logits(ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0
        )


def test_each_rank_holds_its_share_of_the_weights(stage, tiny_model, make_llm):
    """llama-gqa at TP=2 splits every matmul, the embedding and the head; only the norms
    (2 per layer + 1, hidden_size each) are whole on every rank."""
    path = tiny_model("llama-gqa")
    single = make_llm(stage, path, block_size=BLOCK)
    parallel = make_llm(stage, path, block_size=BLOCK, tensor_parallel_size=2)
    norms = sum(
        p.numel() * p.element_size() for n, p in single.model.named_parameters() if "norm" in n
    )
    whole, half = single.weight_bytes(), parallel.weight_bytes()
    # The padded vocabulary rounds the head up a little.
    assert (whole - norms) / 2 <= half - norms <= (whole - norms) / 2 * 1.01, (whole, half)
    assert parallel.kv_cache.k.shape[3] == single.kv_cache.k.shape[3] // 2  # its KV heads
    _tokens(parallel, stage)
    reports = parallel.executor.call_all("rank_report")  # every rank: the same share, and
    assert [r["rank"] for r in reports] == [0, 1]  # the same collectives, call for call
    assert len({(r["weight_bytes"], r["kv_heads"]) for r in reports}) == 1
    calls = {
        (r["collectives"]["all_reduce_calls"], r["collectives"]["all_gather_calls"])
        for r in reports
    }
    assert len(calls) == 1 and min(calls)[0] > 0


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 8},  # chunked prefill: prompts over several steps
        {"speculative": "ngram", "num_speculative_tokens": 3},
        {"speculative": "draft", "draft_num_layers": 1},
    ],
    ids=["chunked", "ngram", "draft"],
)
def test_chunks_prefix_hits_and_speculation_match_at_tp2(stage, tiny_model, make_llm, config):
    path = tiny_model("llama-gqa")
    expected = _tokens(make_llm(stage, path, block_size=BLOCK), stage)
    parallel = make_llm(stage, path, block_size=BLOCK, tensor_parallel_size=2, **config)
    hits = parallel.prefix_cache_stats.hit_tokens
    for _ in range(2):  # the second run hits the prefix cache
        assert _tokens(parallel, stage) == expected
    assert parallel.prefix_cache_stats.hit_tokens > hits


def test_seeded_sampling_is_the_same_at_tp2(stage, tiny_model, make_llm):
    """Every rank samples with the same counter-based noise from the same gathered logits."""
    path = tiny_model("llama-gqa")
    params = [stage.SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i) for i in range(4)]
    single = make_llm(stage, path, block_size=BLOCK)
    parallel = make_llm(stage, path, block_size=BLOCK, tensor_parallel_size=2)
    expected = [o.token_ids for o in single.generate(PROMPTS, params)]
    assert [o.token_ids for o in parallel.generate(PROMPTS, params)] == expected


# The real model in three processes, with transformers beside it: a fixed cost like a notebook's
# (conftest's `fixed_cost_stages`: the newest stage and the stages being edited). Stage 09's own
# layers, loader and ranks are checked against one rank and transformers on every tiny shape above.
@pytest.mark.fixed_cost
def test_real_model_at_tp3_equals_transformers_offline_and_served(
    stage, real_model, make_llm, hf_model
):
    """One TP=3 engine on the real model (three processes load it once): offline, its tokens
    and logits against transformers; then served, the official client's answer against the same
    engine's offline one. (One rank on the real model against transformers is test_01_model's;
    a second engine here cost about 7 s of the suite.)"""
    openai = pytest.importorskip("openai")
    parallel = make_llm(stage, real_model, tensor_parallel_size=3)
    params = stage.SamplingParams(max_tokens=16, temperature=0)
    out = parallel.generate(["The three primary colors are"], params)[0]
    hf = hf_model(real_model)
    assert list(out.token_ids) == hf_greedy(hf, list(out.prompt_token_ids), 16)
    ids = list(out.prompt_token_ids) + list(out.token_ids)
    # Logits reach ~30 here; sharded sums move them by ~3e-4, and transformers' own kernels by
    # as much again: the suite's real-model tolerance.
    torch.testing.assert_close(parallel.prompt_logits(ids), hf_logits(hf, ids), atol=2e-3, rtol=0)
    with ThreadedServer(stage.create_app(parallel)) as server:  # the same engine, now served
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Name a fruit."}]
        reply = client.chat.completions.create(
            model=server_model_name(server), messages=messages, max_tokens=12, temperature=0
        )
        health = httpx.get(f"{server.url}/health", timeout=10).json()
    expected = parallel.chat([messages], stage.SamplingParams(max_tokens=12, temperature=0))[0]
    assert reply.choices[0].message.content == expected.text and expected.token_ids
    assert health["tensor_parallel_size"] == 3
    assert [w["alive"] for w in health["workers"]] == [True, True]


def server_model_name(server: ThreadedServer) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_stage_loaded_from_a_path_starts_its_workers(stage, tiny_model, make_llm, tmp_path):
    """`pytest --stage-path` grades a copy loaded as `stages._external.<alias>`, a package only
    the process that loaded it knows. Its workers must load the copy again from its folder
    (`stages.import_stage`), never fail to import it, and compute what the repository's does."""
    copy = tmp_path / Path(stage.__file__).parent.name
    shutil.copytree(Path(stage.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    copied = stages.load_from_path(copy, alias=f"tp_copy_{os.getpid()}_{tmp_path.name}")
    assert copied.__name__.startswith("stages._external.") and copied is not stage
    path = tiny_model("llama-gqa")
    llm = copied.LLM(str(path), block_size=BLOCK, tensor_parallel_size=2, kv_cache_bytes=2**20)
    try:
        assert [w["pid"] for w in llm.executor.workers()] != [os.getpid()]
        assert _tokens(llm, copied) == _tokens(make_llm(stage, path, block_size=BLOCK), stage)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------- refusals
def test_sizes_that_cannot_be_split_are_refused_before_any_process(stage, tiny_model):
    with pytest.raises(ValueError, match=r"9.*2|2.*9"):  # 9 query heads over 2 ranks
        stage.LLM(str(tiny_model("llama-odd-heads")), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        stage.EngineConfig(tensor_parallel_size=0)


def test_one_rank_starts_no_process(stage, tiny_model, make_llm):
    llm = make_llm(stage, tiny_model("llama-gqa"), block_size=BLOCK)
    assert llm.executor.tensor_parallel_size == 1 and llm.executor.workers() == []


# ------------------------------------------------------------------------- failures
@LIFECYCLE
def test_a_dead_worker_fails_requests_and_health_names_it(stage, tiny_model):
    llm = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK, tensor_parallel_size=2)
    try:
        app = stage.create_app(llm)
        with ThreadedServer(app) as server:
            body = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{server.url}/generate", json=body, timeout=30).status_code == 200
            (pid,) = _worker_pids(llm)
            os.kill(pid, signal.SIGKILL)
            assert _wait_gone([pid])
            deadline = time.monotonic() + 10
            while (health := httpx.get(f"{server.url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "a dead worker went unnoticed"
                time.sleep(0.1)
            assert health.status_code == 503 and "rank 1" in health.text
            failed = httpx.post(f"{server.url}/generate", json=body, timeout=30)
            assert failed.status_code >= 500 and "rank 1" in failed.text
    finally:
        llm.shutdown()


@LIFECYCLE
def test_a_worker_killed_mid_step_fails_the_step_naming_its_rank(stage, tiny_model):
    """The worker dies after the step was shipped, while rank 0 runs it: rank 0's collective
    fails (gloo: the socket closes; NCCL would wait for ever), and the error the caller sees
    is the executor's, naming the dead rank, not the transport's. Without async scheduling
    the step's result is taken before another step is shipped (whose pipe write would name the
    rank by itself)."""
    llm = stage.LLM(
        str(tiny_model("llama-gqa")),
        block_size=BLOCK,
        tensor_parallel_size=2,
        async_scheduling=False,
    )
    try:
        llm.generate([[3, 4, 5]], _greedy(stage, 2))
        (pid,) = _worker_pids(llm)
        driver_launch = llm.executor.driver.launch

        def launch_without_the_worker(scheduler_output):
            if scheduler_output.requests:  # the step is on the worker's pipe: it dies now
                os.kill(pid, signal.SIGKILL)
                assert _wait_gone([pid])
            return driver_launch(scheduler_output)

        llm.executor.driver.launch = launch_without_the_worker
        with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 1"):
            llm.generate([[6, 7, 8, 9]], _greedy(stage, 4))
    finally:
        llm.shutdown()


@LIFECYCLE
def test_a_collective_raising_inside_launch_names_the_dead_rank(stage, tiny_model):
    """On CUDA rank 0's step runs inside `launch` (queued on its stream, and gloo's collective
    on a CUDA tensor blocks the host), so a dead peer's socket error is raised by `launch`
    itself, not by the step's result: the caller got gloo's `Connection reset by peer` (H100
    run). Here rank 0's launch runs its step to the end before it returns, as on CUDA, with the
    worker killed first: the error must still be the executor's, naming rank 1."""
    llm = stage.LLM(
        str(tiny_model("llama-gqa")),
        block_size=BLOCK,
        tensor_parallel_size=2,
        async_scheduling=False,
    )
    try:
        llm.generate([[3, 4, 5]], _greedy(stage, 2))
        (pid,) = _worker_pids(llm)
        driver_launch = llm.executor.driver.launch

        def launch_that_runs_the_step(scheduler_output):
            if scheduler_output.requests:  # the step is on the worker's pipe: it dies now
                os.kill(pid, signal.SIGKILL)
                assert _wait_gone([pid])
            step = driver_launch(scheduler_output)
            step.result()  # the collective fails here, inside launch (gloo's RuntimeError)
            return step

        llm.executor.driver.launch = launch_that_runs_the_step
        with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 1"):
            llm.generate([[6, 7, 8, 9]], _greedy(stage, 4))
    finally:
        llm.shutdown()


@LIFECYCLE
def test_a_worker_error_fails_the_engine_with_its_traceback(stage, tiny_model):
    llm = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK, tensor_parallel_size=2)
    try:
        with pytest.raises(stage.parallel.executor.WorkerDiedError, match="no_such_method"):
            llm.executor.call("no_such_method")
        with pytest.raises(stage.parallel.executor.WorkerDiedError, match="rank 1"):
            llm.generate([[3, 4]], _greedy(stage, 2))
    finally:
        llm.shutdown()
    assert _wait_gone(_worker_pids(llm))


@LIFECYCLE
def test_a_rank_killed_mid_generation_is_named_not_its_neighbour(stage, tiny_model):
    """TP=3, rank 2 killed while the ranks run steps back to back: rank 1's collective fails,
    and it reports an error and exits too, often before the monitor has seen the kill. The
    error names rank 2, the rank that died first (before: `rank 1 ... exited`)."""
    llm = stage.LLM(str(tiny_model("llama-tp3")), block_size=BLOCK, tensor_parallel_size=3)
    try:
        rank_2 = _worker_pids(llm)[1]
        request = llm.make_request([3, 4, 5], _greedy(stage, 400))
        with pytest.raises(stage.parallel.executor.WorkerDiedError) as died:
            for count, _ in enumerate(llm.stream(request)):
                if count == 5:  # from another thread: this one goes on stepping meanwhile
                    threading.Thread(target=os.kill, args=(rank_2, signal.SIGKILL)).start()
        assert "rank 2" in str(died.value) and "rank 1" not in str(died.value), died.value
        assert "SIGKILL" in str(died.value), died.value
    finally:
        llm.shutdown()
    assert _wait_gone(_worker_pids(llm))


@LIFECYCLE
def test_an_engine_nobody_holds_stops_its_workers(stage, tiny_model):
    """The executor's monitor thread does not keep the engine alive: once collected, its
    finalizer stops the workers (a suite that drops engines leaves no process behind)."""
    llm = stage.LLM(str(tiny_model("llama-gqa")), block_size=BLOCK, tensor_parallel_size=2)
    llm.generate([[3, 4, 5]], _greedy(stage, 2))
    pids = _worker_pids(llm)
    del llm
    gc.collect()
    assert _wait_gone(pids)


# Ctrl-C raises KeyboardInterrupt in a program started from a terminal; a process started in
# the background inherits SIGINT ignored (POSIX), so the script restores Python's handler.
ORPHAN_SCRIPT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import stages
stage = stages.load({stage!r})
llm = stage.LLM({model!r}, block_size=4, tensor_parallel_size=2)
llm.generate([[3, 4, 5]], stage.SamplingParams(max_tokens=2, temperature=0))
print(" ".join(str(w["pid"]) for w in llm.executor.workers()), flush=True)
time.sleep(120)
"""


WAYS = ("SIGKILL", "SIGTERM", "SIGINT")


@pytest.fixture(scope="module")
def parents() -> Iterator[ParentProcesses]:
    started = ParentProcesses()
    yield started
    started.kill_all()


@LIFECYCLE
@pytest.mark.parametrize("how", WAYS)
def test_workers_die_with_the_engine(stage, tiny_model, parents, how):
    """No orphan: the engine's process is killed, terminated, or interrupted (Ctrl-C reaches
    the whole process group: the workers ignore it and the engine stops them on its way out).
    The three engines start together (tests/parents.py); each test kills its own."""
    script = ORPHAN_SCRIPT.format(stage=stage.STAGE, model=str(tiny_model("llama-gqa")))
    parent = parents.started(stage.STAGE, dict.fromkeys(WAYS, script))[how]
    proc, pids = parent.process, parent.child_pids
    assert len(pids) == 1, f"the engine did not start: {pids!r}"
    if how == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    else:
        os.kill(proc.pid, getattr(signal, how))
    proc.wait(timeout=30)
    assert _wait_gone(pids), f"worker {pids} outlived its engine ({how})"
