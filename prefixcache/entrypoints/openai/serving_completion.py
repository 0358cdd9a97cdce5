"""``POST /v1/completions`` (vLLM's ``serving_completion``): one prompt or a list of them (one
engine request each), ``echo`` (its prompt's logprobs included, and ``max_tokens: 0`` to score a
prompt alone), the legacy ``logprobs`` object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from pydantic import BaseModel
from fastapi.responses import Response

from prefixcache.engine.detokenizer import TokenDecoder
from prefixcache.entrypoints.openai.api_errors import APIError
from prefixcache.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                                   CompletionResponse)
from prefixcache.entrypoints.openai.serving_engine import OpenAIServing
from prefixcache.entrypoints.openai.serving_outputs import clamp_logprob, prompt_logprobs_json, usage
from prefixcache.outputs import RequestOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS_PER_REQUEST = 1024  # prompts in one /v1/completions request (each is an engine request)


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text or token-id list, or a list of them.

    Raises:
        APIError: 400 (``prompt``) for an empty list of prompts or more than
            :data:`MAX_PROMPTS_PER_REQUEST` (an empty single prompt is the engine's to refuse).
    """
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
        return [prompt]  # one text, or one token-id list ([] included: the engine names it)
    if len(prompt) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(400, f"prompt: a list of {len(prompt)} prompts; at most {MAX_PROMPTS_PER_REQUEST} per "
                            "request", "prompt")
    return list(prompt)


def check_echo(req: CompletionRequest) -> None:
    """``echo`` with ``logprobs`` covers the prompt's tokens too (from its prompt logprobs, which
    come whole once the prompt is computed), so it is not streamed, as vLLM's prompt logprobs.

    Raises:
        APIError: 400 (``echo``) for ``echo: true`` with ``logprobs`` and ``stream: true``.
    """
    if req.echo and req.logprobs is not None and req.stream:
        raise APIError(400, "echo with logprobs is not available with stream: true", "echo", "unsupported_parameter")


def echo_only(req: CompletionRequest) -> bool:
    """``echo: true`` with ``max_tokens: 0`` (OpenAI's legacy API and vLLM's
    ``echo_without_generation``, used to score a prompt's logprobs): the answer is the prompt alone.
    The engine generates at least one token, so the request runs with ``max_tokens = 1`` and
    :func:`without_generation` drops that token. ``max_tokens: 0`` without echo stays a 400.

    Raises:
        APIError: 400 (``min_tokens``) for ``min_tokens`` > 0 with it, as for any ``max_tokens``.
    """
    if not (req.echo and req.max_tokens == 0):
        return False
    if req.min_tokens:
        raise APIError(400, f"min_tokens must be in [0, max_tokens=0], got {req.min_tokens}", "min_tokens")
    return True


async def without_generation(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The outputs of an :func:`echo_only` request with the generated token dropped: no text,
    tokens or logprobs, finished by ``"length"`` (``max_tokens`` 0 reached; a failed or aborted
    request keeps its reason). Closing it closes ``stream``."""
    async with contextlib.aclosing(stream):
        async for out in stream:
            ended = out.finish_reason in ("stop", "length")
            yield dataclasses.replace(out, text="", token_ids=[], logprobs=None if out.logprobs is None else [],
                                      finish_reason="length" if ended else out.finish_reason,
                                      stop_reason=None if ended else out.stop_reason)


def echo_logprobs(out: RequestOutput, num_logprobs: int, decoder: TokenDecoder) -> CompletionLogprobs:
    """The legacy ``logprobs`` of an echoed prompt's tokens (vLLM's layout: the first token has
    ``None``; offsets add up the tokens' texts from 0), from ``out.prompt_logprobs``."""
    result = CompletionLogprobs()
    offset = 0
    for i, token_id in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[i]
        text = decoder.text(token_id) if entry is None else entry[token_id].decoded_token
        result.tokens.append(text)
        result.token_logprobs.append(None if entry is None else clamp_logprob(entry[token_id].logprob))
        result.top_logprobs.append(None if entry is None else {
            lp.decoded_token: clamp_logprob(lp.logprob) for lp in list(entry.values())[:num_logprobs]})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def completion_logprobs(out: RequestOutput, lo: int, hi: int, num_logprobs: int, text_offset: int) -> CompletionLogprobs:
    """The legacy completions ``logprobs`` of tokens ``[lo, hi)`` of ``out``; ``text_offset`` is
    where token ``lo`` starts (offsets add up the tokens' texts, as vLLM's do)."""
    result = CompletionLogprobs()
    for token_id, entry in zip(out.token_ids[lo:hi], out.logprobs[lo:hi]):
        chosen = entry[token_id]
        result.tokens.append(chosen.decoded_token)
        result.token_logprobs.append(clamp_logprob(chosen.logprob))
        result.top_logprobs.append({lp.decoded_token: clamp_logprob(lp.logprob)
                                    for lp in list(entry.values())[:num_logprobs]})
        result.text_offset.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return result


class OpenAIServingCompletion:
    """Runs ``/v1/completions`` requests through an :class:`OpenAIServing`.

    Args:
        serving: the engine, the served model's name and its adapters.
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def create_completion(self, req: CompletionRequest, raw_request: Request,
                                tenant: str | None) -> Response | BaseModel:
        """``POST /v1/completions``: one prompt or a list of them (``n`` choices each, indexes
        ``prompt_index * n + sample_index``, usage summed over the prompts); ``echo`` starts each
        choice's text with its prompt (a streamed choice's first chunk carries it).

        Raises:
            APIError: 400 / 404 for a bad request, 500 when the engine failed to run it.
            EngineDeadError: the engine loop has stopped.
        """
        check_echo(req)
        lora, model_name = self.serving.begin(req, "completions")
        prompts = completion_prompts(req.prompt)
        prompt_only = echo_only(req)
        params = self.serving.sampling_params(req, 1 if prompt_only else req.max_tokens,
                                              DEFAULT_COMPLETION_MAX_TOKENS, "prompt", req.logprobs)
        echo_lps = bool(req.echo) and params.logprobs is not None  # the prompt's tokens get logprobs too
        if echo_lps:
            params = dataclasses.replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
        echoes = await self.prompt_texts(prompts) if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.serving.start(prompts, params, req, request_id, "prompt", lora, tenant)
        if prompt_only:
            stream = without_generation(stream)
        echoed: set[int] = set()  # choices whose prompt went out (streaming)
        offsets: dict[int, int] = {}  # per streamed choice: where its next token's text starts

        def logprobs(out: RequestOutput, lo: int, hi: int) -> CompletionLogprobs | None:
            if params.logprobs is None:
                return None
            head = echo_logprobs(out, params.logprobs, self.serving.token_decoder) if echo_lps else None
            start = offsets.get(out.index, 0) if head is None else sum(len(t) for t in head.tokens)
            result = completion_logprobs(out, lo, hi, params.logprobs, start)
            offsets[out.index] = start + sum(len(t) for t in result.tokens)
            if head is not None:  # non-streamed: the prompt's tokens first
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(head, name).extend(getattr(result, name))
                return head
            return result

        def choice(out: RequestOutput, delta: str, lo: int, hi: int) -> dict:
            if echoes is not None and out.index not in echoed:
                echoed.add(out.index)
                delta = echoes[out.index // params.n] + delta
            lp = logprobs(out, lo, hi)
            return {"index": out.index, "text": delta, "logprobs": None if lp is None else lp.model_dump()}

        def response(outs: list[RequestOutput], created: int) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=model_name, usage=usage(outs),
                choices=[CompletionChoice(index=o.index, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                          text=o.text if echoes is None else echoes[o.index // params.n] + o.text,
                                          logprobs=logprobs(o, 0, len(o.token_ids)),
                                          prompt_logprobs=None if req.prompt_logprobs is None else prompt_logprobs_json(o))
                         for o in outs],
            )

        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name}
        return await self.serving.respond(req, params, stream, raw_request, head, choice, response)

    async def prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        """Each prompt's text for ``echo``: a text as sent, token ids decoded (special tokens kept).

        Raises:
            APIError: 400 (``prompt``) for a token id outside the vocabulary.
        """
        texts = []
        for i, prompt in enumerate(prompts):
            try:
                texts.append(prompt if isinstance(prompt, str) else await self.engine.detokenize(prompt, "prompt"))
            except ValueError as e:
                where = f"prompt[{i}]: " if len(prompts) > 1 else ""
                raise APIError(400, where + str(e), "prompt") from e
        return texts
