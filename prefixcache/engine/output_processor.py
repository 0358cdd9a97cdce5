"""Output processing: stop conditions, detokenization and :class:`RequestOutput` (vLLM v1's
``OutputProcessor`` role). Runs on the engine thread after each step, for the requests that got a
token.

Text: grown by each new token's bytes (:mod:`prefixcache.engine.detokenizer`), equal to decoding the
whole output (special tokens skipped); tokenizers whose decode is not a concatenation of bytes are
decoded whole at each step.

Stop strings: after each new token the output text is searched from the first
character that could start a match not seen before: the settled text checked last time, less one
character short of the longest stop string. So a match is found wherever it lies in the text the
step added, however long the new token's text is (SmolLM2 has single tokens of 64 ``=``). A
trailing U+FFFD (an incomplete UTF-8 character) is not settled: it may turn into another character
when the next token arrives.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from prefixcache.engine.detokenizer import IncrementalDetokenizer, TokenDecoder, byte_concat_decoder
from prefixcache.layers.sampler import TokenLogprobs
from prefixcache.outputs import Logprob, PromptLogprobs, RequestOutput
from prefixcache.request import Request, RequestStatus


class OutputProcessor:
    """Decides when requests stop and builds their outputs.

    Args:
        tokenizer: decodes output tokens (special tokens skipped).
        eos_token_ids: tokens that end generation unless ``ignore_eos``.
        max_model_len: a request stops ("length") when it holds this many tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.token_decoder = TokenDecoder(tokenizer)
        self._text_bytes = byte_concat_decoder(tokenizer, self.token_decoder)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Whether the request's last token ends it, and how; sets ``stop_reason`` and, for a
        stop string, ``stop_text_end`` (where its text ends). A stop token (``stop_token_ids`` or
        EOS) stays in ``token_ids`` but its text is left out of ``text`` unless
        ``include_stop_str_in_output`` (vLLM v1's detokenizer: ``stop_terminated``).

        Returns:
            ``FINISHED_STOPPED`` (EOS, stop token or stop string), ``FINISHED_LENGTH``
            (``max_tokens`` or the context is full), or ``None`` to go on.
        """
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            request.stop_reason = token if token in params.stop_token_ids else None
            request.stop_token_hidden = not params.include_stop_str_in_output
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self._find_stop_string(request):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _find_stop_string(self, request: Request) -> bool:
        """Searches the text the last step added (and the stop-string overlap before it), up to a
        trailing U+FFFD: the decode of a character whose bytes are not all generated yet (vLLM's
        detokenizer holds such text back too), so a stop string never matches half a character
        (``"\ufffd"`` used to match the first half of an emoji)."""
        params = request.sampling_params
        text = self.output_text(request, request.num_output_tokens).rstrip("\ufffd")
        start = max(0, request.num_checked_chars - (max(len(s) for s in params.stop) - 1))
        request.num_checked_chars = len(text)
        found = [(idx, stop) for stop in params.stop if (idx := text.find(stop, start)) >= 0]
        if not found:
            return False
        idx, stop = min(found, key=lambda f: f[0])  # the earliest match; a tie goes to the first listed
        request.stop_reason = stop
        request.stop_text_end = idx + (len(stop) if params.include_stop_str_in_output else 0)
        return True

    def output_text(self, request: Request, num_ids: int) -> str:
        """The text of the request's first ``num_ids`` output tokens, special tokens skipped:
        ``tokenizer.decode(output_token_ids[:num_ids], skip_special_tokens=True)``, grown from the
        last call's text where the tokenizer allows (module docstring)."""
        if self._text_bytes is None:
            return self.tokenizer.decode(request.output_token_ids[:num_ids], skip_special_tokens=True)
        detokenizer = request.detokenizer
        if detokenizer is None or detokenizer.num_ids > num_ids:  # new, or asked for less (start again)
            detokenizer = request.detokenizer = IncrementalDetokenizer(self._text_bytes)
        return detokenizer.text(request.output_token_ids, num_ids)

    def append_logprobs(self, request: Request, sampled: TokenLogprobs) -> None:
        """Adds the logprobs of the request's newest token: the top-k (ranks 1..k), then the
        chosen token when it is not among them (vLLM's ``{token_id: Logprob}`` per position)."""
        text = self.token_decoder.text
        entry = {t: Logprob(lp, rank, text(t))
                 for rank, (t, lp) in enumerate(zip(sampled.top_token_ids, sampled.top_logprobs), start=1)}
        if sampled.token_id not in entry:
            entry[sampled.token_id] = Logprob(sampled.logprob, sampled.rank, text(sampled.token_id))
        request.logprobs.append(entry)

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: cumulative text and tokens, finish state and timings."""
        text = self.output_text(request, request.num_output_tokens - request.stop_token_hidden)
        if request.stop_text_end is not None:
            text = text[: request.stop_text_end]
        return RequestOutput(
            request_id=request.group_id,
            index=request.sample_index,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            cached_tier_tokens=dict(request.cached_tier_tokens),
            ttft_s=None if request.first_token_s is None else request.first_token_s - request.arrival_s,
            e2e_s=None if request.finish_s is None else request.finish_s - request.arrival_s,
            finished=request.is_finished,
            error=request.error,
            prompt_logprobs=self.prompt_logprobs(request),
            num_cached_prompt_logprobs=0 if request.prompt_logprobs is None else request.prompt_logprobs.num_from_cache,
            logprobs=None if request.sampling_params.logprobs is None else list(request.logprobs),
            pinned=request.pinned or (),
            num_retained_tokens=request.num_retained_tokens,
        )

    def prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        """vLLM's prompt-logprobs list of a request whose prompt is computed (else None): per prompt
        token from the second on, the top ``k`` of its position (ranks 1..k), then the token itself
        when it is not among them (the layout of the generated tokens' logprobs). Built once."""
        state, k = request.prompt_logprobs, request.sampling_params.prompt_logprobs
        if state is None or not state.complete:
            return None
        if state.built is None:
            prompt, text = request.prompt_token_ids, self.token_decoder.text
            top_ids, top_lps = state.topk_ids[:, :k].tolist(), state.topk_logprobs[:, :k].tolist()
            out: PromptLogprobs = [None]
            for i, (lp, rank) in enumerate(zip(state.token_logprobs.tolist(), state.token_ranks.tolist())):
                if i == 0:
                    continue
                entry = {t: Logprob(tlp, r, text(t)) for r, (t, tlp) in enumerate(zip(top_ids[i], top_lps[i]), start=1)}
                entry.setdefault(prompt[i], Logprob(lp, rank, text(prompt[i])))
                out.append(entry)
            state.built = out
        return state.built
