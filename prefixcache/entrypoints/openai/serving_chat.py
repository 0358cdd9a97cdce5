"""``POST /v1/chat/completions`` (vLLM's ``serving_chat``): the messages rendered by the model's chat
template, the default ``max_tokens`` (what the context and the KV pool leave), OpenAI's chat
``logprobs``; and the conversation a chat request renders, which ``/tokenize`` shares.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from prefixcache.engine.detokenizer import TokenDecoder
from prefixcache.engine.input_processor import POOL_HINT
from prefixcache.entrypoints.openai.api_errors import APIError
from prefixcache.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ResponseMessage,
    TopLogprob,
)
from prefixcache.entrypoints.openai.serving_engine import OpenAIServing
from prefixcache.entrypoints.openai.serving_outputs import clamp_logprob, prompt_logprobs_json, usage
from prefixcache.errors import counted
from prefixcache.outputs import RequestOutput

MAX_CHAT_DEFAULT_MAX_TOKENS = 512  # chat default: the rest of the context, capped at this


def message_text(content: str | list[dict] | None) -> str:
    """A chat message's text: a string, or the concatenated text of its content parts.

    Raises:
        APIError: 400 (``messages``) for a non-text part.
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The ``{role, content}`` dicts the chat template renders (chat completions and ``/tokenize``).

    Raises:
        APIError: 400 (``messages``) for an empty list or a non-text content part.
    """
    if not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return [{"role": m.role, "content": message_text(m.content)} for m in messages]


def chat_logprobs(out: RequestOutput, lo: int, hi: int, top_logprobs: int, decoder: TokenDecoder) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of tokens ``[lo, hi)`` of ``out``: each chosen token with its
    text, logprob and bytes, and the ``top_logprobs`` most likely tokens (best first)."""
    content = []
    for token_id, entry in zip(out.token_ids[lo:hi], out.logprobs[lo:hi]):
        top = [TopLogprob(token=lp.decoded_token, logprob=clamp_logprob(lp.logprob), bytes=list(decoder.bytes(t)))
               for t, lp in list(entry.items())[:top_logprobs]]
        chosen = entry[token_id]
        content.append(ChatLogprobToken(token=chosen.decoded_token, logprob=clamp_logprob(chosen.logprob),
                                        bytes=list(decoder.bytes(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)


def chat_num_logprobs(req: ChatCompletionRequest) -> int | None:
    """``SamplingParams.logprobs`` of a chat request: ``top_logprobs`` (default 0) when ``logprobs``
    is true, else None.

    Raises:
        APIError: 400 (``top_logprobs``) for top_logprobs > 0 without ``logprobs: true`` (OpenAI's rule).
    """
    if req.logprobs:
        return 0 if req.top_logprobs is None else req.top_logprobs
    if req.top_logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    return None


class OpenAIServingChat:
    """Runs ``/v1/chat/completions`` requests through an :class:`OpenAIServing`.

    Args:
        serving: the engine, the served model's name and its adapters.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request,
                                     tenant: str | None) -> Response | BaseModel:
        """``POST /v1/chat/completions``.

        Raises:
            APIError: 400 / 404 for a bad request, 500 when the engine failed to run it.
            EngineDeadError: the engine loop has stopped.
        """
        lora, model_name = self.serving.begin(req, "chat")
        try:
            prompt_ids = await self.engine.apply_chat_template(chat_conversation(req.messages))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        n = req.n if isinstance(req.n, int) and req.n >= 1 else 1
        max_tokens, renames = req.max_tokens, {}
        if req.max_completion_tokens is not None:
            max_tokens, renames = req.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
        default_max_tokens = self.chat_default_max_tokens(len(prompt_ids), n)
        params = self.serving.sampling_params(req, max_tokens, default_max_tokens, "messages", chat_num_logprobs(req),
                                              {**renames, "logprobs": "top_logprobs"})
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            stream = await self.serving.start([prompt_ids], params, req, request_id, "messages", lora, tenant, renames)
        except APIError as e:
            if max_tokens is None and e.param == "max_tokens":  # the default (1 at least) doesn't fit
                raise self.default_does_not_fit(len(prompt_ids), n) from e
            raise
        started: set[int] = set()  # samples whose first chunk (with the role) went out

        def logprobs(out: RequestOutput, lo: int, hi: int) -> ChatLogprobs | None:
            if params.logprobs is None:
                return None
            return chat_logprobs(out, lo, hi, params.logprobs, self.serving.token_decoder)

        def choice(out: RequestOutput, delta: str, lo: int, hi: int) -> dict:
            message = {"content": delta}
            if out.index not in started:
                message["role"] = "assistant"
                started.add(out.index)
            lp = logprobs(out, lo, hi)
            return {"index": out.index, "delta": message, "logprobs": None if lp is None else lp.model_dump()}

        def response(outs: list[RequestOutput], created: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id, created=created, model=model_name, usage=usage(outs),
                choices=[ChatChoice(index=o.index, message=ResponseMessage(content=o.text),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                    logprobs=logprobs(o, 0, len(o.token_ids))) for o in outs],
                prompt_logprobs=prompt_logprobs_json(outs[0]) if outs else None,
            )

        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name}
        return await self.serving.respond(req, params, stream, raw_request, head, choice, response)

    def chat_default_max_tokens(self, num_prompt_tokens: int, n: int) -> int:
        """Chat's default ``max_tokens``: the rest of the context, as far as the pool can hold it for
        each of the ``n`` samples (they share the prompt's full blocks), capped at
        :data:`MAX_CHAT_DEFAULT_MAX_TOKENS`."""
        room = self.engine.engine.input_processor.max_tokens_that_fit(num_prompt_tokens, n)
        return max(1, min(MAX_CHAT_DEFAULT_MAX_TOKENS, room))

    def default_does_not_fit(self, num_prompt_tokens: int, n: int) -> APIError:
        """The 400 for a chat request without ``max_tokens`` that the pool can't hold even with the
        smallest default (1 token per sample), naming ``n`` and how many samples would fit. (The engine
        refuses a prompt that doesn't fit even once itself, naming the prompt, so here one sample fits.)
        The blocks are counted by the engine's own rule (``InputProcessor.kv_blocks_needed``)."""
        engine = self.engine.engine
        inputs = engine.input_processor
        full = num_prompt_tokens // engine.config.block_size
        per_sample = inputs.kv_blocks_needed(num_prompt_tokens, 1) - full  # blocks after the shared ones
        needed = inputs.kv_blocks_needed(num_prompt_tokens, 1, n)
        fitting = (inputs.num_blocks - full) // per_sample
        return APIError(400, f"n={n} samples don't fit the KV pool even with the smallest default max_tokens (1): "
                             f"the prompt ({counted(num_prompt_tokens, 'token')}) plus 1 token for each of n={n} "
                             f"samples needs {counted(needed, 'KV block')} but the pool has {inputs.pool_text()}; "
                             f"lower n to at most {fitting} or {POOL_HINT}", "n")
