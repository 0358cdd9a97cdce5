"""What a request returns: once when it finishes, or after every step when it streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from prefixcache.cache.pins import PinResult


class Logprob(NamedTuple):
    """One token's log-probability in a generated position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of the token's probability under the model's raw logits (see
            ``SamplingParams.logprobs``).
        rank: 1 + the number of other tokens whose logprob is >= this one's (vLLM's rule: ties
            take the worse rank); the top-k entries have ranks 1..k in order.
        decoded_token: the token's text on its own (its UTF-8 bytes decoded with replacement, so a
            token holding part of a character reads U+FFFD).
    """

    logprob: float
    rank: int
    decoded_token: str


# Per generated token: token id -> Logprob for the k most likely tokens (ranks 1..k, in that
# order) and the chosen token (last, when it is not among them).
SampleLogprobs = list[dict[int, Logprob]]


PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        request_id: the id given to ``add_request`` (shared by the samples of an ``n > 1`` request).
        index: which sample of the request this is, ``0 <= index < n``.
        prompt: the prompt text, when the request was given as text.
        prompt_token_ids: the prompt's tokens.
        text: generated text (special tokens skipped, stop string removed unless asked to keep it).
        token_ids: generated token ids (an EOS or stop token that ended generation included).
        finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", or "error" (the
            engine step that ran this request failed; ``error`` says why, the engine goes on).
        stop_reason: the stop string or stop token id that matched, if any.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        cached_tier_tokens: of those, the tokens loaded from each KV tier (tier name -> tokens;
            empty without tiers); the rest came from the KV pool.
        ttft_s: seconds from arrival to the first generated token.
        e2e_s: seconds from arrival to finish (None while unfinished).
        finished: False only for the intermediate outputs of a streaming request.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs = k``, per prompt token (None for
            the first) the token's own :class:`Logprob` then the k most likely ones at its position
            (vLLM's layout); None otherwise, and until the prompt is computed.
        num_cached_prompt_logprobs: of those entries, how many the prefix cache served.
        error: with finish_reason "error", what failed (an internal fault, not the request's input:
            bad input is refused before a request is queued).
        logprobs: with ``SamplingParams.logprobs`` set, one dict per generated token (aligned with
            ``token_ids``; see :data:`SampleLogprobs`); None otherwise.
        pinned: per cache breakpoint of the request (position order), the tokens its pin got
            within the budget (:mod:`prefixcache.cache.pins`); empty without breakpoints, and
            until the prompt is computed.
        num_retained_tokens: with ``retain_s``, the prompt's tokens (whole blocks) kept in the disk
            tier within its retention budget; None when not asked, and until the prompt is computed.
    """

    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    finished: bool = True
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_prompt_logprobs: int = 0
    logprobs: SampleLogprobs | None = None
    cached_tier_tokens: dict[str, int] = field(default_factory=dict)
    pinned: tuple[PinResult, ...] = ()
    num_retained_tokens: int | None = None
