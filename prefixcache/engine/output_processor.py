"""Output processing: stop conditions, detokenization and :class:`RequestOutput` (vLLM v1's
``OutputProcessor`` role). Runs on the engine thread after each step, for the requests that got a
token.

Stop strings: after each new token the output is decoded whole and searched from the first
character that could start a match not seen before: the settled text checked last time, less one
character short of the longest stop string. So a match is found wherever it lies in the text the
step added, however long the new token's text is (SmolLM2 has single tokens of 64 ``=``). A
trailing U+FFFD (an incomplete UTF-8 character) is not settled: it may turn into another character
when the next token arrives.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

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
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Whether the request's last token ends it, and how; sets ``stop_reason`` and, for a
        stop string, ``stop_text_end`` (where its text ends).

        Returns:
            ``FINISHED_STOPPED`` (EOS, stop token or stop string), ``FINISHED_LENGTH``
            (``max_tokens`` or the context is full), or ``None`` to go on.
        """
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            request.stop_reason = token if token in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self._find_stop_string(request):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _find_stop_string(self, request: Request) -> bool:
        """Searches the text the last step added (and the stop-string overlap before it)."""
        params = request.sampling_params
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        start = max(0, request.num_checked_chars - (max(len(s) for s in params.stop) - 1))
        request.num_checked_chars = len(text.rstrip("\ufffd"))
        found = [(idx, stop) for stop in params.stop if (idx := text.find(stop, start)) >= 0]
        if not found:
            return False
        idx, stop = min(found, key=lambda f: f[0])  # the earliest match; a tie goes to the first listed
        request.stop_reason = stop
        request.stop_text_end = idx + (len(stop) if params.include_stop_str_in_output else 0)
        return True

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: cumulative text and tokens, finish state and timings."""
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
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
            ttft_s=None if request.first_token_s is None else request.first_token_s - request.arrival_s,
            e2e_s=None if request.finish_s is None else request.finish_s - request.arrival_s,
            finished=request.is_finished,
            error=request.error,
            prompt_logprobs=self.prompt_logprobs(request),
            num_cached_prompt_logprobs=0 if request.prompt_logprobs is None else request.prompt_logprobs.num_from_cache,
        )

    def prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        """vLLM's prompt-logprobs list of a request whose prompt is computed (else None): per prompt
        token from the second on, its own entry, then the top ``k`` of its position not already in."""
        state, k = request.prompt_logprobs, request.sampling_params.prompt_logprobs
        if state is None or not state.complete:
            return None
        prompt = request.prompt_token_ids
        top_ids, top_lps = state.topk_ids[:, :k].tolist(), state.topk_logprobs[:, :k].tolist()
        ids = set(prompt) | {t for row in top_ids for t in row}
        text = dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids])))
        out: PromptLogprobs = [None]
        for i, (lp, rank) in enumerate(zip(state.token_logprobs.tolist(), state.token_ranks.tolist())):
            if i == 0:
                continue
            entry = {prompt[i]: Logprob(lp, rank, text[prompt[i]])}
            for r, (t, tlp) in enumerate(zip(top_ids[i], top_lps[i]), start=1):
                entry.setdefault(t, Logprob(tlp, r, text[t]))
            out.append(entry)
        return out
