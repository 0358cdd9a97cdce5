"""Per-request token histories the penalties read, kept by the model runner across steps.

A request whose params have a penalty (presence, frequency, repetition) gets, the first time it
samples, a bool mask of its prompt's tokens (built once, O(prompt)) and an int32 count per
vocabulary token of its generated tokens. Each later step adds only the tokens generated since the
last one (``ScheduledSeq.output_token_ids[num_counted:]``, normally one), so a step costs
O(new tokens) Python work per request plus one ``[num_rows, vocab_size]`` gather, never O(context).

Invariants: ``output_counts.sum() == num_counted`` and ``num_counted <= len(output_token_ids)``
of the request; a history is dropped when the scheduler reports its request finished (the runner
calls :meth:`TokenHistories.drop`). A preempted request keeps its history: its output tokens stay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenHistory:
    """One request's prompt mask and output counts.

    Attributes:
        prompt_mask: shape = [vocab_size], bool: the token appears in the prompt.
        output_counts: shape = [vocab_size], int32: times the token was generated.
        num_counted: output tokens counted so far.
    """

    prompt_mask: torch.Tensor
    output_counts: torch.Tensor
    num_counted: int = 0


class TokenHistories:
    """The runner's histories, by request id."""

    def __init__(self) -> None:
        self._histories: dict[str, TokenHistory] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._histories

    def drop(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def get(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
            vocab_size: int) -> TokenHistory:
        """The request's history, brought up to date with ``output_token_ids``.

        Args:
            request_id: the sequence's id (a forked sample has its own).
            prompt_token_ids: the request's prompt (read once, when the history is created).
            output_token_ids: the request's generated tokens so far (only the new tail is read).
            vocab_size: the logits' width.
        """
        history = self._histories.get(request_id)
        if history is None or history.num_counted > len(output_token_ids):
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            if prompt_token_ids:
                mask[torch.tensor(prompt_token_ids)] = True
            history = self._histories[request_id] = TokenHistory(mask, torch.zeros(vocab_size, dtype=torch.int32))
        new = output_token_ids[history.num_counted :]
        if new:
            ids = torch.tensor(new)
            history.output_counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.int32))
            history.num_counted = len(output_token_ids)
        return history
