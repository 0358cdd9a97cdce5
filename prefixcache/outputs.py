"""What a request returns: once when it finishes, or after every step when it streams."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log probability (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of its probability.
        rank: 1 + the tokens more likely than it.
        decoded_token: its text alone.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
        ttft_s: seconds from arrival to the first generated token.
        e2e_s: seconds from arrival to finish (None while unfinished).
        finished: False only for the intermediate outputs of a streaming request.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs = k``, per prompt token (None for
            the first) the token's own :class:`Logprob` then the k most likely ones at its position
            (vLLM's layout); None otherwise, and until the prompt is computed.
        num_cached_prompt_logprobs: of those entries, how many the prefix cache served.
        error: with finish_reason "error", what failed (an internal fault, not the request's input:
            bad input is refused before a request is queued).
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
