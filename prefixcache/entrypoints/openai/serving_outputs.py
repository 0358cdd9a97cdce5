"""From engine outputs to OpenAI answers, shared by the endpoints (and ``/v1/messages``): usage,
SGLang's ``cached_tokens_details``, each sample's final output, SSE streaming and its text and
logprobs rules.

A request that the engine finishes with ``finish_reason == "error"`` (the step that ran it
failed) is answered with a 500 in OpenAI's error format, or in a stream with an error event
followed by ``data: [DONE]``; other requests go on.

Logprobs are the engine's: the model's raw distribution (``SamplingParams.logprobs``), one entry
per generated token, shaped by the endpoint (OpenAI's chat ``choices[].logprobs.content[]`` or the
legacy completions object). A stream sends a token's logprobs in the chunk whose text delta
completes the token's text: a token whose text is held back (a possible stop string, an incomplete
UTF-8 character) waits with it, and the final chunk carries every token left, so the chunks'
logprobs concatenate to the non-streamed ones. -inf is sent as -9999.0 (vLLM's clamp; JSON has no
infinity).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from fastapi import Request

from prefixcache.engine.async_engine import EngineDeadError
from prefixcache.entrypoints.openai.api_errors import APIError, error_body
from prefixcache.entrypoints.openai.protocol import CachedTokensDetails, PromptTokensDetails, Usage
from prefixcache.outputs import RequestOutput

logger = logging.getLogger("prefixcache.server")

MIN_LOGPROB = -9999.0  # what -inf is sent as (vLLM's clamp)


def clamp_logprob(value: float) -> float:
    """A logprob as sent: -inf (and anything below) as :data:`MIN_LOGPROB`."""
    return max(value, MIN_LOGPROB)


def per_prompt(outs: list[RequestOutput]) -> list[RequestOutput]:
    """One final output per prompt of a request: its lowest choice index (the sample that carries
    the prompt's counts)."""
    return list({o.request_id: o for o in reversed(outs)}.values())


def usage(outs: list[RequestOutput]) -> Usage:
    """Usage of a request from its samples' final outputs: each prompt counted once (its first
    sample's counts; several prompts of one completion request are summed, as vLLM does), the
    completion tokens of every sample."""
    prompts = {o.request_id: o for o in per_prompt(outs)}
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts.values())
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in prompts.values())),
    )


def cached_tokens_details(prompts: Iterable[RequestOutput]) -> CachedTokensDetails:
    """SGLang's ``cached_tokens_details`` of a request, from one output of each of its prompts (the
    sample that carries the prompt's counts, as :func:`usage` takes): its cached tokens split by
    where they came from, ``device`` (the KV pool: full blocks, partial-block copies) and
    ``storage`` (the KV tiers, named in ``storage_backend``); ``host`` is 0, we have no memory
    tier between the pool and the disk."""
    tiers: dict[str, int] = {}
    device = 0
    for out in prompts:
        device += out.num_cached_tokens - sum(out.cached_tier_tokens.values())
        for name, num_tokens in out.cached_tier_tokens.items():
            tiers[name] = tiers.get(name, 0) + num_tokens
    storage = sum(tiers.values())
    return CachedTokensDetails(device=device, host=0, storage=storage,
                               storage_backend="+".join(n for n, t in tiers.items() if t) if storage else None)


async def numbered(stream: AsyncIterator[RequestOutput],
                   first_choice: Mapping[str, int]) -> AsyncIterator[RequestOutput]:
    """The outputs of a multi-prompt request with ``index`` turned into the choice index:
    ``first_choice[request_id] + sample index``, i.e. ``prompt_index * n + sample_index``
    (vLLM's ``serving_completion`` rule). Closing it closes ``stream`` (aborting what runs)."""
    async with contextlib.aclosing(stream):
        async for out in stream:
            yield dataclasses.replace(out, index=first_choice[out.request_id] + out.index)


def stream_text(out: RequestOutput, stops: tuple[str, ...]) -> str:
    """The part of a streaming output's text that is safe to send.

    Until the request finishes, hold back a trailing incomplete UTF-8 character and any tail that
    could still grow into a stop string (which the final text drops), so the concatenated deltas
    equal the non-streamed text.
    """
    text = out.text
    if out.finished:
        return text
    text = text.rstrip("\ufffd")
    return text[: len(text) - stop_prefix_hold(text, stops)]


def stop_prefix_hold(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (0 if none).

    Only tails starting at a character equal to a stop string's first one are compared, so the
    work is about the stop strings' length, not its square.
    """
    hold = 0
    for stop in stops:
        window = len(stop) - 1
        start = max(0, len(text) - window)
        i = text.find(stop[0], start)
        while 0 <= i and len(text) - i > hold:
            if stop.startswith(text[i:]):
                hold = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return hold


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's JSON of a request's prompt logprobs: per prompt token, token id (as a string) →
    {logprob, rank, decoded_token}; None when not asked for."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in out.prompt_logprobs]


def sse_event(data: dict) -> str:
    """One SSE event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def failed_output_error(out: RequestOutput) -> APIError:
    """The 500 for a request the engine finished with ``finish_reason == "error"``."""
    return APIError(500, f"the engine step running this request failed: {out.error or 'unknown error'}",
                    None, "engine_error")


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def final_outputs(stream: AsyncIterator[RequestOutput], raw_request: Request) -> list[RequestOutput] | None:
    """Each sample's final output, by index; None (and the request aborted) if the client
    disconnects.

    Raises:
        APIError: 500 when the engine finished a sample with ``finish_reason == "error"`` (the
            other samples are aborted).
        EngineDeadError: the engine loop stopped, or the server is shutting down.
    """

    async def last() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(stream):  # leaving early aborts the request's other samples
            async for out in stream:
                if out.finish_reason == "error":
                    raise failed_output_error(out)
                if out.finished:
                    finals[out.index] = out
        return [finals[i] for i in sorted(finals)]

    task = asyncio.ensure_future(last())
    disconnect = asyncio.ensure_future(_wait_disconnect(raw_request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if task.done():
        return task.result()
    task.cancel()  # the stream's cleanup aborts the request and frees its blocks
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class _TokenCoverage:
    """Which of a streamed sample's tokens its sent text covers: token i goes out once the text
    sent reaches the length its text had when it arrived (trailing U+FFFD not counted)."""

    def __init__(self) -> None:
        self.needs: list[int] = []  # per token, non-decreasing
        self.num_sent = 0  # tokens whose logprobs went out

    def advance(self, out: RequestOutput, num_chars_sent: int) -> tuple[int, int]:
        """Records ``out``'s new tokens; returns the token range ``[lo, hi)`` to send now."""
        if len(self.needs) < len(out.token_ids):
            need = max(len(out.text.rstrip("\ufffd")), self.needs[-1] if self.needs else 0)
            self.needs.extend([need] * (len(out.token_ids) - len(self.needs)))
        lo = self.num_sent
        hi = len(out.token_ids) if out.finished else bisect.bisect_right(self.needs, num_chars_sent)
        return lo, max(lo, hi)


async def sse_events(
    stream: AsyncIterator[RequestOutput],
    stops: tuple[str, ...],
    make_chunk: Callable[[RequestOutput, str, int, int], dict],
    usage_chunk: Callable[[list[RequestOutput]], dict] | None,
) -> AsyncIterator[str]:
    """SSE events: one chunk per text delta of each sample (its last one with finish_reason),
    then usage once every sample finished, then ``[DONE]``. ``make_chunk(out, delta, lo, hi)``
    gets the tokens ``[lo, hi)`` whose text the chunk completes (module docstring). A failure (a
    sample finished with ``"error"``, the engine gone, a bug here) becomes an error event before
    ``[DONE]``."""
    sent: dict[int, int] = {}
    coverage: dict[int, _TokenCoverage] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(stream):  # leaving early aborts the rest of the request
            async for out in stream:
                if out.finish_reason == "error":
                    e = failed_output_error(out)
                    yield sse_event(error_body(e.status, e.message, e.param, e.code))
                    break
                text = stream_text(out, stops)
                done = sent.get(out.index, 0)
                delta, sent[out.index] = text[done:], max(done, len(text))
                tokens = coverage.setdefault(out.index, _TokenCoverage())
                lo, hi = tokens.advance(out, sent[out.index])
                if delta or out.finished:
                    yield sse_event(make_chunk(out, delta, lo, hi))
                    tokens.num_sent = hi
                if out.finished:
                    finals[out.index] = out
            else:
                if usage_chunk is not None and finals:
                    yield sse_event(usage_chunk([finals[i] for i in sorted(finals)]))
    except EngineDeadError as e:
        yield sse_event(error_body(503, str(e), None, "engine_dead"))
    except Exception as e:  # the headers are out: report in the stream, never cut it silently
        logger.exception("streaming a response failed")
        yield sse_event(error_body(500, f"internal server error ({type(e).__name__})", None, "internal_error"))
    yield "data: [DONE]\n\n"
