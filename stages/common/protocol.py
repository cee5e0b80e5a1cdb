"""The HTTP protocol every stage's server speaks: request schemas, responses, error bodies.

Two APIs:
- `POST /generate`: this project's own, minimal (prompt or messages in; text and token ids out,
  or SSE frames when `stream` is true).
- the OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`, so the
  official `openai` client and standard load generators work unchanged.

Nothing here knows about an engine: the schemas turn JSON into plain sampling arguments, and the
builders (responses.py, re-exported here) turn results back into JSON. Each stage's `server.py`
wires them to its engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Re-exported: every stage's server imports its HTTP vocabulary from this one module.
from stages.common.http_errors import APIError as APIError
from stages.common.http_errors import error_body as error_body
from stages.common.http_errors import install_error_handlers as install_error_handlers
from stages.common.responses import SSE_DONE as SSE_DONE
from stages.common.responses import chat_chunk as chat_chunk
from stages.common.responses import chat_response as chat_response
from stages.common.responses import completion_chunk as completion_chunk
from stages.common.responses import completion_response as completion_response
from stages.common.responses import model_card as model_card
from stages.common.responses import models_response as models_response
from stages.common.responses import new_id as new_id
from stages.common.responses import sse as sse
from stages.common.responses import usage as usage
from stages.common.responses import usage_chunk as usage_chunk

# --------------------------------------------------------------------------- request schemas
Finite = Annotated[float, Field(allow_inf_nan=False)]

# OpenAI parameters this engine does not implement, with the values that mean "not used". A
# request that sets one to anything else gets a 400 naming it, never a silent no-op.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
}


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: strict like the rest (`"include_usage": "no"` is a 400, not a
    truthy string that turns usage on)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool | None = None


class _SamplingFields(BaseModel):
    """Sampling fields shared by every endpoint. Types are strict (`"8"`, `8.0` and `true` are
    not integers, `"yes"` is not a boolean, `Infinity` is not a temperature); values are checked
    by the stage's SamplingParams; unknown parameters are refused, as OpenAI refuses them."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extension: requests with different salts never share prefix-cache blocks. Stages
    # before 07 share no cache at all, so for them every request is already isolated.
    cache_salt: str | None = None
    # known OpenAI parameters the engine does not implement (see UNSUPPORTED)
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None

    def check_supported(self) -> None:
        """A 400 for every OpenAI parameter set to something this engine cannot do."""
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if not any(value == n and type(value) is type(n) for n in neutral):
                raise APIError(
                    f"{name}={json.dumps(value)} is not supported by this engine", param=name
                )

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for the stage's SamplingParams; rejects what the engine lacks."""
        self.check_supported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not s for s in stop):
            raise APIError("stop strings must not be empty", param="stop")
        kwargs: dict[str, Any] = {
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # name, tool_call_id, ...: harmless

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; OpenAI's list-of-parts form is joined, non-text parts refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError("only text content parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)


class GenerateRequest(_SamplingFields):
    """Body of `POST /generate`: a prompt (text or token ids) or a chat conversation."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = 16

    def conversation(self) -> list[dict[str, str]] | None:
        """The chat messages, if the request is a conversation; a prompt sent beside them would
        be silently dropped, so both at once is a 400."""
        if self.messages is None:
            return None
        if self.prompt is not None:
            raise APIError("give either prompt or messages, not both", param="messages")
        return [m.model_dump() for m in self.messages]


class CompletionRequest(_SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
            raise APIError("only one prompt per request is supported", param="prompt")
        if (isinstance(prompt, str) and not prompt) or (isinstance(prompt, list) and not prompt):
            raise APIError("prompt must not be empty", param="prompt")
        return prompt


class ChatCompletionRequest(_SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_kwargs(self, default_max_tokens: int | None) -> dict[str, Any]:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_kwargs(default_max_tokens)


def include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def check_model_id(model_id: str, served: str) -> None:
    """`GET /v1/models/{id}` for a model this server does not serve: OpenAI's 404."""
    if model_id != served:
        raise APIError(
            f"model {model_id!r} does not exist; this server serves {served!r}",
            status=404,
            param="model",
        )


def check_model_name(requested: str | None, served: str) -> None:
    """Reject a request for a model this server does not serve."""
    if requested is not None and requested != served:
        raise APIError(
            f"model {requested!r} does not exist; this server serves {served!r}", param="model"
        )
