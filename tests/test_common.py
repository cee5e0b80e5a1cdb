"""The shared, technique-free pieces: loader, model resolution, tokenizer, CLI."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stages
from stages.common.model_config import ModelConfig
from stages.common.tokenizer import IncrementalDetokenizer, Tokenizer
from stages.common.weights import resolve_model

from .conftest import LONG_CONTEXT_REQUEST

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world", "  leading spaces", "émoji 😀 and 中文", "a\nb\tc", "<|im_end|> special"]


def test_load_by_number_and_name():
    first = stages.list_stages()[0]
    assert stages.load(first.number) is stages.load(first.folder)
    assert stages.load(int(first.number)).LLM is not None
    with pytest.raises(ValueError, match="unknown stage"):
        stages.load("99")
    kv_cache = stages.load(first.number, "kv_cache")  # a module of the stage, by its name there
    assert kv_cache.__name__ == f"{stages.load(first.number).__name__}.kv_cache"
    with pytest.raises(ModuleNotFoundError):
        stages.load(first.number, "no_such_module")


def test_load_from_path_is_independent_of_the_repo_copy(tmp_path):
    import shutil

    info = stages.list_stages()[0]
    copy = tmp_path / info.folder
    shutil.copytree(info.path, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module = stages.load_from_path(copy)
    assert module.LLM is not stages.load(info.number).LLM
    assert Path(module.__file__).parent == copy


def test_unknown_model_names_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("definitely not a model")
    with pytest.raises(ValueError, match="not a model folder"):
        resolve_model(tmp_path)


@pytest.mark.slow
def test_embedded_model_cache(real_model):
    assert resolve_model(None) == real_model == resolve_model("SmolLM2-135M-Instruct")
    config = ModelConfig.from_pretrained(real_model)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert 130e6 < config.num_parameters() < 140e6


@pytest.mark.slow
def test_tokenizer_matches_transformers(real_model):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(real_model)
    ref = AutoTokenizer.from_pretrained(str(real_model))
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.parametrize("model", ["tiny", "real"])
def test_incremental_detokenizer_rebuilds_the_text(model, tiny_model, request):
    path = tiny_model("llama-gqa") if model == "tiny" else request.getfixturevalue("real_model")
    tok = Tokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
        pieces = [detok.add(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("model", ["tiny", "real"])
def test_detokenizing_many_tokens_at_once_gives_what_one_by_one_gives(model, tiny_model, request):
    """`extend` (a few decodes for any number of tokens) against `add` token by token: the
    same text, then the same deltas for the tokens after, on real text, on random ids
    (specials, tokens that render as nothing) and on random runs of the byte fragments of
    emoji and CJK text (answers that end inside a character, or hold one across tokens)."""
    path = tiny_model("llama-gqa") if model == "tiny" else request.getfixturevalue("real_model")
    tok = Tokenizer.from_pretrained(path)
    rng = random.Random(0)
    vocab = len(tok._backend.get_vocab(with_added_tokens=True))
    cases = [tok.encode(text) for text in TEXTS]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    fragments = sorted(set(tok.encode("😀👋🏽 中文字 🇫🇷 é ñ ü ß ∑ ≠ 漢字かな 한국어 hi")))
    pool = fragments + [rng.randrange(vocab) for _ in range(len(fragments) // 4)]
    cases += [[rng.choice(pool) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    for ids in cases:
        cut = rng.randrange(len(ids) + 1)
        prompt = tok.encode("Prompt:")
        one, many = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        expected = [one.add(i) for i in ids]
        assert many.extend(ids[:cut]) == "".join(expected[:cut]), ids
        assert [many.add(i) for i in ids[cut:]] == expected[cut:], ids
    # The point of it: a whole answer's text in two decodes, not two per token.
    calls = []
    decode = tok.decode
    tok.decode = lambda ids, **kw: calls.append(1) or decode(ids, **kw)
    whole = tok.encode(TEXTS[0]) * 4
    assert IncrementalDetokenizer(tok, []).extend(whole) == decode(whole) and len(calls) == 2
    # An answer that stops inside a character: a few decodes still, not two per token.
    calls.clear()
    cut = tok.encode("tokens " * 20 + "😀")[:-1]
    assert decode(cut).endswith("\ufffd") and len(cut) > 20
    one_by_one = "".join(IncrementalDetokenizer(tok, []).add(i) for i in cut)
    calls.clear()
    assert IncrementalDetokenizer(tok, []).extend(cut) == one_by_one
    # the prefix, up to four tries at where the text ends, two per token held back (three)
    assert len(calls) <= 1 + 4 + 2 * 3, f"{len(calls)} decodes for {len(cut)} tokens"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stages", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def test_cli_list_and_diff():
    out = _cli("list")
    assert out.returncode == 0 and "01_naive" in out.stdout
    infos = stages.list_stages()
    if len(infos) > 1:
        diff = _cli("diff", infos[0].number, infos[1].number)
        assert diff.returncode == 0 and diff.stdout.startswith("---")
    bad = _cli("diff", "01", "99")
    assert bad.returncode == 2 and "unknown stage" in bad.stderr


def test_cli_generate_on_a_tiny_model(tiny_model):
    path = tiny_model("llama-gqa")
    newest = stages.list_stages()[-1].number
    out = _cli(newest, "generate", "hello", "--model", str(path), "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert "5 tokens" in out.stderr
    bad = _cli(newest, "generate", "hello", "--model", str(path), "--max-tokens", "0")
    assert bad.returncode == 2 and "max_tokens" in bad.stderr


BAD_CONFIG_VALUES = [  # field=value, what the one-line error must say the field accepts
    ("tensor_parallel_size=abc", "an integer"),
    ("tensor_parallel_size=2.5", "an integer"),
    ("disaggregated=maybe", "true or false"),
    ("kv_layout=flat", "one of paged, contiguous"),
    ("kv_transfer_timeout_seconds=soon", "a number"),
    ("max_num_seqs=lots", "an integer or none"),
    ("speculative=eagle", "one of ngram, draft or none"),
    ("cuda_graphs=sometimes", "true or false or none"),
]
GOOD_CONFIG_VALUES = [
    ("tensor_parallel_size=2", 2),
    ("disaggregated=no", False),
    ("disaggregated=TRUE", True),
    ("kv_layout=contiguous", "contiguous"),
    ("kv_transfer_timeout_seconds=2.5", 2.5),
    ("max_num_seqs=none", None),
    ("speculative=ngram", "ngram"),
    ("speculative=null", None),
    ("quantization=none", "none"),  # a Literal's own "none" is not None
    ("served_model_name=none", None),
    ("served_model_name=my-model", "my-model"),
]


def _stage_with_field(field: str):
    """The newest stage whose EngineConfig has `field` (a student repository of stage NN holds
    no later stage, so the newest may predate the field); skip where none has it."""
    import dataclasses

    for info in reversed(stages.list_stages()):
        stage = stages.load(info.number)
        config = getattr(stage, "EngineConfig", None)
        if config and field in {f.name for f in dataclasses.fields(config)}:
            return stage
    pytest.skip(f"no stage here has the field {field!r}")


@pytest.mark.parametrize(("item", "accepted"), BAD_CONFIG_VALUES)
def test_a_config_value_of_the_wrong_type_is_one_line_naming_the_field(item, accepted):
    """`--config` parses each value by its field's type: anything else is refused in one line
    that names the field and what it takes (before: `tensor_parallel_size=abc` was a raw
    TypeError, `disaggregated=maybe` a truthy string that started a disaggregated server)."""
    import argparse

    from stages.cli_args import engine_kwargs

    newest = _stage_with_field(item.split("=")[0])
    with pytest.raises(ValueError) as refused:  # the CLI: `error: <message>`, exit 2
        engine_kwargs(newest, argparse.Namespace(config=[item]))
    message = str(refused.value)
    field = item.split("=")[0]
    assert "\n" not in message and field in message and accepted in message, message


@pytest.mark.parametrize(("item", "value"), GOOD_CONFIG_VALUES)
def test_a_config_value_of_the_right_type_parses(item, value):
    import argparse

    from stages.cli_args import engine_kwargs

    newest = _stage_with_field(item.split("=")[0])
    parsed = engine_kwargs(newest, argparse.Namespace(config=[item]))
    assert parsed == {item.split("=")[0]: value} and type(parsed[item.split("=")[0]]) is type(value)


def test_serve_on_a_busy_port_fails_before_loading_the_engine(tiny_model):
    """Another program holds the port: `serve` says so in one line and exits, without loading
    the engine or claiming to serve (before: it loaded the model, printed "serving on ...",
    then failed to bind)."""
    import socket

    newest = stages.list_stages()[-1].number
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = _cli(newest, "serve", "--port", port, "--model", str(tiny_model("llama-gqa")))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and port in lines[0] and "in use" in lines[0], out.stderr
    assert "loading" not in out.stderr and "serving on" not in out.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--port", "70000"), "ports are 0 to 65535"),
        (("--port", "-1"), "ports are 0 to 65535"),
        (("--port", "http"), "not a port number"),
        (("--log-level", "loud"), "invalid choice"),
        (("--drain-seconds", "nan"), "give 0 or more seconds"),
        (("--drain-seconds", "-2"), "give 0 or more seconds"),
    ],
)
def test_serve_refuses_a_bad_argument_before_loading_anything(args, named, capsys):
    """Before: a port out of range was a traceback from bind(), an unknown log level a KeyError
    from uvicorn after the model had loaded, and `--drain-seconds nan` was taken."""
    from stages.cli_args import build_stage_parser

    with pytest.raises(SystemExit) as refused:
        build_stage_parser("01").parse_args(["serve", *args])
    assert refused.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("repo", [False, True])
def test_assign_into_a_file_is_one_line_not_a_traceback(repo, tmp_path, capsys):
    from stages.cli import main

    file = tmp_path / "notes.txt"
    file.write_text("not a folder")
    assert main(["assign", "03", str(file), *(["--repo"] if repo else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cannot write the assignment to") and "\n" not in err, err


def test_a_server_process_interrupted_while_it_starts_is_stopped(monkeypatch):
    """A test's timeout or Ctrl-C lands in `ServerProcess.__enter__` while it waits for the
    server: the server must not outlive it (before: `__exit__` never ran, and the server was
    left serving, reparented to init)."""
    from stages.common.tooling.server_process import ServerProcess

    def interrupted(self: ServerProcess) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ServerProcess, "_wait_until_ready", interrupted)
    server = ServerProcess("01")
    with pytest.raises(KeyboardInterrupt):
        server.__enter__()
    assert server.process is not None and server.process.poll() is not None


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(bias):
    import torch

    from stages.common.linear import Linear, onednn_available

    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN")
    torch.manual_seed(0)
    layer = Linear(24, 40, bias=bias)
    reference_weight, reference_bias = layer.weight.detach().clone(), layer.bias
    for shape in [(1, 24), (7, 24), (300, 24), (24,), (2, 3, 24)]:
        x = torch.randn(shape)
        expected = torch.nn.functional.linear(x, reference_weight, reference_bias)
        if layer.packed_weight is None:
            layer.prepack()
            assert layer.weight is None and layer.weight_bytes() > 0
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_a_onednn_that_is_present_but_fails_here_is_not_chosen(monkeypatch):
    """oneDNN's packed linear is tried once before 'auto' picks it: a build or CPU where the op
    exists and raises (an Arm build without its kernels) takes F.linear, not a crash at load."""
    import torch

    from stages.common import linear

    def fails(*_args):
        raise RuntimeError("could not create a primitive descriptor for a reorder primitive")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fails)
    linear.onednn_available.cache_clear()
    try:
        assert not linear.onednn_available()
        cpu = torch.device("cpu")
        assert linear.resolve_linear_backend("auto", cpu, torch.float32) == "torch"
        with pytest.raises(ValueError, match="needs fp32 weights on a CPU with oneDNN"):
            linear.resolve_linear_backend("onednn", cpu, torch.float32)
    finally:
        monkeypatch.undo()
        linear.onednn_available.cache_clear()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak RSS is read from /proc")
def test_peak_memory_sees_a_new_allocation():
    import contextlib
    import ctypes

    import torch

    from stages.common.tooling.latency import peak_memory, reset_peak_memory

    reset_peak_memory()
    before = peak_memory()["host_rss_gib"]
    block = torch.ones(64 * 2**20)  # 256 MiB, written so the pages are resident
    after = peak_memory()["host_rss_gib"]
    del block
    with contextlib.suppress(OSError, AttributeError):  # glibc may keep the pages: give them back
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_peak_memory()  # a new window forgets the block; the whole-process peak keeps it
    window = peak_memory()["host_rss_gib"]
    lifetime = peak_memory(whole_process=True)["host_rss_gib"]
    assert before is not None and after is not None and window is not None
    assert after - before > 0.2
    assert after > window + 0.2  # the reset really started a new window
    # Linux updates its high-water mark lazily, so allow a few pages of slack
    assert lifetime is not None and lifetime > after - 0.01


def test_sigterm_drains_within_the_grace_period(tiny_long_context_model):
    """`serve` on SIGTERM: streams in flight end with an error frame and [DONE] after the grace
    period (not when they reach max_tokens), then the process exits. The server is a process of
    its own, where no test can hold its steps: the request is one no machine finishes within
    the grace (the long-context tiny model)."""
    import json
    import signal
    import subprocess
    import threading

    import httpx

    from stages.common.tooling.server_process import ServerProcess

    newest = stages.list_stages()[-1].number
    extra = ("--drain-seconds", "0.05")
    model = str(tiny_long_context_model)
    with ServerProcess(newest, model=model, extra_args=extra) as server:
        body = {"prompt": "hi", "max_tokens": LONG_CONTEXT_REQUEST, "ignore_eos": True}
        body["stream"] = True
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(timeout=60)
        server.process.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit after its drain")
        frames = [line[6:] for line in lines if line.startswith("data: ")]
        assert frames[-1] == "[DONE]" and "shutting down" in frames[-2]
        tokens = sum(len(json.loads(f).get("token_ids", [])) for f in frames[:-2])
        assert 0 < tokens < LONG_CONTEXT_REQUEST


def test_sigterm_ends_the_server_whatever_clients_do(tiny_model):
    """A client that sent half a body cannot keep `serve` alive: after SIGTERM the process
    exits within the drain's grace period plus a few seconds (plain uvicorn waits for that
    client for as long as it stays connected). Also: `--cors-origin` lets that origin in."""
    import signal
    import socket
    import time

    import httpx

    from stages.common.tooling.server_process import ServerProcess

    newest = stages.list_stages()[-1].number
    origin = "https://chat.example.org"
    extra = ("--drain-seconds", "1", "--cors-origin", origin)
    with ServerProcess(newest, model=str(tiny_model("llama-gqa")), extra_args=extra) as server:
        # `serve --port 0` (what ServerProcess runs) announced port 0 before; now the OS's pick
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        health = httpx.get(f"{server.url}/health", headers={"Origin": origin}, timeout=10)
        assert health.headers.get("access-control-allow-origin") == origin
        other = httpx.get(f"{server.url}/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                b'{"prompt":'
            )
            time.sleep(0.5)  # let the server read the headers and start the request
            server.process.send_signal(signal.SIGTERM)
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail("a half-sent body kept the server alive after SIGTERM")


def test_a_second_signal_stops_the_server_at_once():
    """The first SIGTERM/Ctrl-C starts the drain; a second one, during the drain, stops at once
    (uvicorn itself forces an exit only on a second SIGINT, and only after its own shutdown
    began)."""
    import signal
    import threading

    import uvicorn

    from stages.common.serving import DrainingServer

    release = threading.Event()
    server = DrainingServer(
        uvicorn.Config(app=None), drain=lambda grace: release.wait(30), grace_seconds=60
    )
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert server.draining and not server.should_exit  # draining: still serving
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit and server.force_exit
    finally:
        release.set()


def test_a_forced_stop_still_runs_the_apps_shutdown_hooks():
    """After a second signal uvicorn skips the app's shutdown hooks (they stop the engine); the
    interpreter's exit then cancelled the waiting lifespan task and printed a traceback.
    DrainingServer runs the hooks anyway."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from stages.common.serving import DrainingServer

    stopped = []
    app = FastAPI()
    app.router.on_shutdown.append(lambda: stopped.append(True))

    async def run() -> None:
        config = uvicorn.Config(app=app, lifespan="on", log_level="warning")
        config.load()
        server = DrainingServer(config, drain=None, grace_seconds=1)
        server.lifespan, server.servers = config.lifespan_class(config), []
        await server.lifespan.startup()
        server.force_exit = server.should_exit = True
        await server.shutdown()
        assert server.lifespan.shutdown_event.is_set()

    asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert stopped == [True]


def test_scheduling_defaults_are_chosen_per_device():
    """The token budget and seat count default per device: GPU numbers are vLLM's, CPU numbers
    were measured (devices.py says how); without chunked prefill a whole prompt must fit."""
    from stages.common.devices import default_max_num_batched_tokens, default_max_num_seqs

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_max_num_batched_tokens(cpu, chunked_prefill=True, max_model_len=8192) == 256
    assert default_max_num_batched_tokens(cuda, chunked_prefill=True, max_model_len=8192) == 2048
    assert default_max_num_batched_tokens(cpu, chunked_prefill=False, max_model_len=8192) == 8192
    assert default_max_num_batched_tokens(cuda, chunked_prefill=False, max_model_len=512) == 2048
    assert default_max_num_seqs(cpu) == 64 and default_max_num_seqs(cuda) == 256


def test_serve_names_the_live_view_and_the_metrics_where_the_app_has_them() -> None:
    from fastapi import FastAPI

    from stages.cli import serving_message

    app = FastAPI()
    plain = serving_message("m", app, "127.0.0.1", 8000)
    assert "http://127.0.0.1:8000" in plain and "/dashboard" not in plain
    assert "http://[::1]:8000 " in serving_message("m", app, "::1", 8000)  # IPv6 in brackets
    app.get("/dashboard")(lambda: None)
    app.get("/metrics")(lambda: None)
    message = serving_message("m", app, "127.0.0.1", 8000)
    assert "http://127.0.0.1:8000/dashboard" in message
    assert "http://127.0.0.1:8000/metrics" in message
