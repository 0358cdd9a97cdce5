"""OpenAI request and response models (the subset we serve), plus vLLM's extra fields.

Unknown fields are ignored, as OpenAI-compatible servers do, so any client version works; a known
field of the wrong type is a validation error naming that field (HTTP 400): request models are
strict, so ``"n": "3"``, ``"n": true`` or ``"n": 2.0`` are rejected rather than converted (an int
is accepted where a float is expected). ``null`` means the default for every optional field.
Integers must fit in 64 bits and numbers must be finite (``1e400`` parses as infinity): these are
representation limits, checked here; value checks (ranges, prompt length) are left to
:class:`SamplingParams` and the engine, which raise :class:`~prefixcache.errors.InvalidInputError`
naming the field.

Fields of OpenAI's or vLLM's API that we don't implement are kept (``extra="allow"``) so that the
server can refuse them: :data:`UNSUPPORTED_FIELDS` lists, for each, the values that change nothing
(which pass, as ``null`` does); any other value is a 400 "<field> is not supported yet".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # torch.Generator takes an unsigned 64-bit seed too


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------------------- requests
class StreamOptions(_Request):
    """OpenAI's ``stream_options`` plus vLLM's ``continuous_usage_stats``; only with ``stream: true``."""

    include_usage: bool | None = None  # default False: a final chunk with the request's usage
    continuous_usage_stats: bool | None = None  # vLLM extra, default False: usage on every chunk too


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the schema is
    always enforced exactly."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``): exactly one of these; its
    other keys (``grammar``, ``structural_tag``, ...) are refused."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields shared by both endpoints. ``None`` means the server's default."""

    model: str | None = None
    prompt_logprobs: Int64 | None = None  # vLLM extra: 0..20 alternatives per prompt token; not with stream
    max_tokens: Int64 | None = None
    temperature: float | None = None  # default 1.0 (OpenAI's)
    top_p: float | None = None
    top_k: Int64 | None = None  # vLLM extra; 0 or -1 keeps all tokens
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None  # vLLM extra
    ignore_eos: bool | None = None  # vLLM extra; default False
    include_stop_str_in_output: bool | None = None  # vLLM extra; default False
    n: Int64 | None = None  # default 1
    stream: bool | None = None  # default False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # vLLM extra: the request's prefix-cache namespace
    return_cached_tokens_details: bool | None = None  # SGLang extra: the answer's sglext.cached_tokens_details
    priority: Int64 | None = None  # vLLM extra: scheduling priority, lower = earlier; default 0
    user: str | None = None  # OpenAI's end-user id: metadata, accepted and not used
    prompt_cache_key: str | None = None  # OpenAI's routing hint (the gateway's key), never an isolation key
    prompt_cache_retention: str | None = None  # OpenAI's: "in_memory" or "24h" (cache_retention.py)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    presence_penalty: float | None = None  # default 0, in [-2, 2]
    frequency_penalty: float | None = None  # default 0, in [-2, 2]
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    repetition_penalty: float | None = None  # vLLM extra; default 1 (off)
    min_p: float | None = None  # vLLM extra; default 0 (off)
    min_tokens: Int64 | None = None  # vLLM extra; default 0


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids), or a list of them: one choice per prompt and sample.
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    echo: bool | None = None  # OpenAI's legacy echo: each choice's text starts with its prompt
    logprobs: Int64 | None = None  # legacy: the k most likely tokens' logprobs per token, 0..20


class ChatMessage(_Request):
    role: str
    content: str | list[dict] | None = None  # a string, or content parts ({"type": "text", ...})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # default False: the chosen tokens' logprobs
    top_logprobs: Int64 | None = None  # with logprobs: the k most likely tokens' logprobs, 0..20


# Accepted-but-unimplemented fields → the values that change nothing (null always passes).
_UNSUPPORTED_COMMON: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "best_of": (1,),
    # vLLM's sampling and decoding extras
    "use_beam_search": (False,), "length_penalty": (1,), "bad_words": ([],), "allowed_token_ids": (),
    "truncate_prompt_tokens": (), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "guided_grammar": (),
    "return_tokens_as_token_ids": (False,),
})
UNSUPPORTED_FIELDS: Mapping[str, Mapping[str, tuple[Any, ...]]] = MappingProxyType({
    "completions": MappingProxyType({**_UNSUPPORTED_COMMON, "suffix": ("",)}),
    "chat": MappingProxyType({
        **_UNSUPPORTED_COMMON, "echo": (False,), "tools": ([],),
        "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
        "parallel_tool_calls": (True,), "audio": (), "modalities": (["text"],), "prediction": (),
        "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    }),
    "tokenize": MappingProxyType({
        "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": (), "tools": ([],),
    }),
})


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a completion prompt or a chat conversation, exactly one.

    One model for vLLM's two forms (``TokenizeCompletionRequest``: ``prompt``,
    ``add_special_tokens`` default true; ``TokenizeChatRequest``: ``messages``,
    ``add_generation_prompt`` default true, ``add_special_tokens`` default false). A token-id
    ``prompt`` is our extension: it is checked, not changed.
    """

    model: str | None = None
    prompt: str | list[Int64] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # default True
    return_token_strs: bool | None = None  # default False


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[Int64]


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
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string or token that matched


class PromptLogprob(_Model):
    """One entry of vLLM's ``prompt_logprobs`` (its ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[str, PromptLogprob] | None] | None  # per prompt token, keyed by token id


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (exact, a partial character too)


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # the top_logprobs most likely, best first


class ChatLogprobs(_Model):
    """OpenAI's ``choices[].logprobs`` of a chat completion: one entry per generated token."""

    content: list[ChatLogprobToken] | None = None


class CompletionLogprobs(_Model):
    """The legacy completions ``logprobs`` object: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)  # each token's start in the choice's text


class CachedTokensDetails(_Model):
    """SGLang's ``sglext.cached_tokens_details``: where a request's cached prompt tokens came from
    (they sum to ``usage.prompt_tokens_details.cached_tokens``)."""

    device: int = 0  # from the KV pool (full blocks and partial-block copies)
    host: int = 0  # from a host-memory tier below the pool: we have none (our pool is that memory)
    storage: int = 0  # from the KV tiers (disk, Redis)
    storage_backend: str | None = Field(default=None, exclude_if=lambda v: v is None)  # which tiers: "disk+redis"


class SGLangExtensions(_Model):
    """SGLang's ``sglext`` object of an answer, sent only when asked for."""

    cached_tokens_details: CachedTokensDetails | None = None


class _Response(_Model):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    # SGLang extra, with return_cached_tokens_details: true (absent otherwise)
    sglext: SGLangExtensions | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionChoice(_Choice):
    text: str
    prompt_logprobs: PromptLogprobsField = None  # vLLM extra


    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobsField = None  # vLLM extra


class PrefixCacheBlocks(_Model):
    """How a tokenized prompt falls into the prefix cache's blocks (our extension of vLLM's answer)."""

    block_size: int  # tokens per KV block
    num_full_blocks: int  # count // block_size: the blocks of this prompt the cache keeps (chained hashes)


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    prefix_cache: PrefixCacheBlocks


class DetokenizeResponse(_Model):
    prompt: str


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
