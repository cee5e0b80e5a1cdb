"""Stage 01 promises for the HTTP API (non-streaming): OpenAI-compatible answers, and every bad
input gets a 400 with an OpenAI-style error body while the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import since

pytestmark = since("01")

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
}


@pytest.mark.parametrize("name", sorted(BAD_GENERATE_BODIES))
def test_bad_generate_input_is_a_400(tiny_server, name):
    server, _ = tiny_server
    response = httpx.post(f"{server.url}/generate", json=BAD_GENERATE_BODIES[name], timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == 400
    ok = httpx.post(f"{server.url}/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # and the server still serves


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
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2
