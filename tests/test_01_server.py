"""Stage 01 promises for the HTTP API (non-streaming): OpenAI-compatible answers, and every bad
input gets a 400 with an OpenAI-style error body while the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from .conftest import SERVER_MODULES, since, subject

pytestmark = [since("01"), subject(*SERVER_MODULES)]

LONG_PROMPT = "x" * 600  # the tiny models' context is 512 tokens


@pytest.fixture
def tiny_server(stage, tiny_model, live_server):
    server, app = live_server(stage, tiny_model("llama-gqa"))
    return server, app.state.engine


def _model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def test_health_and_models(tiny_server):
    server, _ = tiny_server
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1


def test_generate_endpoint(tiny_server):
    server, _ = tiny_server
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6
    again = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert again["token_ids"] == out["token_ids"]


def test_generate_ids_are_unguessable(tiny_server):
    """Each /generate request gets a long random id, as completions and chat do (before:
    req-0, req-1, ..., so anyone could name another client's request)."""
    server, _ = tiny_server
    body = {"prompt": "hello", "max_tokens": 2}
    ids = [httpx.post(f"{server.url}/generate", json=body, timeout=60).json()["request_id"]
           for _ in range(3)]  # fmt: skip
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == 3


@pytest.mark.slow
def test_openai_client_non_streaming(stage, real_model, live_server):
    server, _ = live_server(stage, real_model)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 10
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    assert completion.choices[0].text.strip()


BAD_GENERATE_BODIES = {
    "empty-prompt": {"prompt": ""},
    "prompt-too-long": {"prompt": LONG_PROMPT},
    "max-tokens-zero": {"prompt": "hi", "max_tokens": 0},
    "max-tokens-negative": {"prompt": "hi", "max_tokens": -5},
    "max-tokens-past-context": {"prompt": "hi", "max_tokens": 100_000},
    "temperature-negative": {"prompt": "hi", "temperature": -0.5},
    "top-p-zero": {"prompt": "hi", "top_p": 0},
    "top-p-above-one": {"prompt": "hi", "top_p": 1.5},
    "top-k-negative": {"prompt": "hi", "top_k": -2},
    "wrong-type": {"prompt": "hi", "max_tokens": "many"},
    "no-prompt": {"max_tokens": 3},
    "token-id-out-of-vocab": {"prompt": [1, 2, 10_000_000]},
    "max-tokens-string": {"prompt": "hi", "max_tokens": "8"},
    "max-tokens-float": {"prompt": "hi", "max_tokens": 8.0},
    "max-tokens-bool": {"prompt": "hi", "max_tokens": True},
    "stream-string": {"prompt": "hi", "stream": "yes"},
    "prompt-bools": {"prompt": [True, False]},
    "temperature-string": {"prompt": "hi", "temperature": "0.5"},
    "stop-empty-string": {"prompt": "hi", "stop": ""},
    "stop-empty-in-list": {"prompt": "hi", "stop": [""]},
    "best-of": {"prompt": "hi", "best_of": 2},
    "n": {"prompt": "hi", "n": 2},
    "logit-bias": {"prompt": "hi", "logit_bias": {"1": 5}},
    "tools": {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
    "response-format": {"prompt": "hi", "response_format": {"type": "json_object"}},
    "penalty": {"prompt": "hi", "presence_penalty": 0.5},
    "unknown-parameter": {"prompt": "hi", "max_tokenz": 3},
    "lone-surrogate": {"prompt": "hi \ud800 there"},
    "too-many-stop-strings": {"prompt": "hi", "stop": [f"s{i}" for i in range(100)]},
    "huge-stop-string": {"prompt": "hi", "stop": ["x" * 100_000]},
    "prompt-and-messages": {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
    "stream-options-not-a-boolean": {"prompt": "hi", "stream_options": {"include_usage": "no"}},
    "stream-options-unknown-key": {"prompt": "hi", "stream_options": {"include_usag": True}},
}


def _post_json(server, path: str, body: dict) -> httpx.Response:
    """POST `body` as ASCII JSON, so that even a lone surrogate travels as its \\u escape."""
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("name", sorted(BAD_GENERATE_BODIES))
def test_bad_generate_input_is_a_400(tiny_server, name):
    server, _ = tiny_server
    response = _post_json(server, "/generate", BAD_GENERATE_BODIES[name])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == 400
    ok = httpx.post(f"{server.url}/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # and the server still serves


NAMED_IN_MESSAGE = {
    "best-of": "best_of",
    "n": "n=",
    "logit-bias": "logit_bias",
    "tools": "tools",
    "response-format": "response_format",
    "penalty": "presence_penalty",
    "unknown-parameter": "max_tokenz",
    "max-tokens-string": "max_tokens",
    "lone-surrogate": "Unicode",
    "stop-empty-string": "stop",
    "prompt-and-messages": "not both",
    "stream-options-not-a-boolean": "stream_options",
}


# The parameter each 400 names in its `param`, as OpenAI's errors do (the engine's own checks
# raise ValueError; the server's APIError takes the parameter the message names).
PARAM_AT_FAULT = {
    "empty-prompt": "prompt", "prompt-too-long": "prompt", "max-tokens-zero": "max_tokens",
    "max-tokens-negative": "max_tokens", "max-tokens-past-context": "prompt",
    "temperature-negative": "temperature", "top-p-zero": "top_p", "top-p-above-one": "top_p",
    "top-k-negative": "top_k", "wrong-type": "max_tokens", "lone-surrogate": "prompt",
    "too-many-stop-strings": "stop", "huge-stop-string": "stop", "stop-empty-string": "stop",
    "best-of": "best_of", "unknown-parameter": "max_tokenz",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PARAM_AT_FAULT))
def test_a_400_names_the_parameter_at_fault(tiny_server, name):
    server, _ = tiny_server
    response = _post_json(server, "/generate", BAD_GENERATE_BODIES[name])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == PARAM_AT_FAULT[name], response.text


@pytest.mark.parametrize("name", sorted(NAMED_IN_MESSAGE))
def test_bad_input_messages_name_the_problem(tiny_server, name):
    server, _ = tiny_server
    response = _post_json(server, "/generate", BAD_GENERATE_BODIES[name])
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and NAMED_IN_MESSAGE[name] in message, message
    if name in ("best-of", "logit-bias", "tools", "response-format", "penalty", "n"):
        assert "not supported by this engine" in message


def test_non_finite_numbers_are_a_400(tiny_server):
    server, _ = tiny_server
    for value in (b"Infinity", b"-Infinity", b"NaN"):
        response = httpx.post(
            f"{server.url}/generate",
            content=b'{"prompt": "hi", "temperature": ' + value + b"}",
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 400, (value, response.text)


def test_json_body_is_accepted_whatever_its_content_type(tiny_server):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: the body is still JSON."""
    server, _ = tiny_server
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(
            f"{server.url}/generate",
            content=b'{"prompt": "hi", "max_tokens": 2, "ignore_eos": true}',
            headers=headers,
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["token_ids"]) == 2


def test_huge_seeds_work(tiny_server):
    server, _ = tiny_server
    for seed in (2**70, -(2**70), 0):
        body = {"prompt": "hi", "max_tokens": 2, "seed": seed, "temperature": 1.0}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=30)
        assert response.status_code == 200, response.text


def test_malformed_json_is_a_400(tiny_server):
    server, _ = tiny_server
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        response = httpx.post(
            f"{server.url}{path}",
            content=b'{"prompt": "hi",',
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 400
        assert "error" in response.json()


def test_openai_bad_input_is_a_400(tiny_server):
    server, _ = tiny_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = _model_name(server)
    bad_calls = [
        lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=2),
        lambda: client.completions.create(model=model, prompt="", max_tokens=2),
        lambda: client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=0),
        lambda: client.completions.create(model=model, prompt="hi", temperature=-1),
        lambda: client.completions.create(model=model, prompt="hi", top_p=2),
        lambda: client.chat.completions.create(model=model, messages=[]),
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6
        ),
        lambda: client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        ),
    ]
    for call in bad_calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.status_code == 400
    ok = client.completions.create(
        model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2


def test_openai_client_retrieves_the_served_model(tiny_server):
    """`GET /v1/models/{id}`: the openai client's `models.retrieve`; an unknown id is a 404
    with an OpenAI-style error body."""
    server, _ = tiny_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = _model_name(server)
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    error = info.value.body
    assert info.value.status_code == 404 and "no-such-model" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"


def test_head_health_answers_200(tiny_server):
    """Health checkers (load balancers, `curl -I`) probe with HEAD."""
    server, _ = tiny_server
    response = httpx.head(f"{server.url}/health", timeout=10)
    assert response.status_code == 200 and response.content == b""


def test_chunked_body_over_the_cap_is_a_413(tiny_server):
    """A body without Content-Length (chunked) is counted as it streams in: past the cap it is
    the documented 413, not a 400 about parsing."""
    server, _ = tiny_server

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 2**16  # 2.5 MiB in all
        yield b'"}'

    response = httpx.post(
        f"{server.url}/generate",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413, response.text
    assert "too large" in response.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_cors_is_off_by_default(tiny_server):
    """Without `serve --cors-origin`, a browser page from another origin gets no CORS grant."""
    server, _ = tiny_server
    headers = {"Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{server.url}/v1/completions", headers=headers, timeout=10)
    assert "access-control-allow-origin" not in preflight.headers
    health = httpx.get(f"{server.url}/health", headers={"Origin": headers["Origin"]}, timeout=10)
    assert "access-control-allow-origin" not in health.headers
