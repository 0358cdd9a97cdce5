"""OpenAI request and response models (the subset we serve), plus vLLM's extra fields.

Unknown fields are ignored, as OpenAI-compatible servers do, so any client version works; a known
field of the wrong type is a validation error naming that field (HTTP 400): request models are
strict, so ``"n": "3"``, ``"n": true`` or ``"n": 2.0`` are rejected rather than converted (an int
is accepted where a float is expected). ``null`` means the default for every optional field. Value checks (ranges,
prompt length) are left to :class:`SamplingParams` and the engine, which raise ``ValueError`` naming
the field.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# ---------------------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool | None = None  # default False


class _SamplingFields(_Request):
    """Fields shared by both endpoints. ``None`` means the server's default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0 (OpenAI's)
    top_p: float | None = None
    top_k: int | None = None  # vLLM extra; 0 or -1 keeps all tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    ignore_eos: bool | None = None  # vLLM extra; default False
    include_stop_str_in_output: bool | None = None  # vLLM extra; default False
    n: int | None = None  # default 1
    stream: bool | None = None  # default False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # vLLM extra: the request's prefix-cache namespace


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(_Request):
    role: str
    content: str | list[dict] | None = None  # a string, or content parts ({"type": "text", ...})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


# ---------------------------------------------------------------------------- responses
class PromptTokensDetails(_Model):
    cached_tokens: int = 0


class Usage(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Choice(_Model):
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token that matched


class _Response(_Model):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ResponseMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "prefixcache"
    parent: str | None = None  # the base model, for a LoRA adapter
    max_model_len: int


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo
