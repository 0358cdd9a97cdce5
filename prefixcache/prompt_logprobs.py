"""Prompt logprobs (vLLM's ``prompt_logprobs``) that the prefix cache can serve.

For each prompt token ``i >= 1``: its logprob and rank under the model's distribution at position
``i - 1`` (the raw logits' ``log_softmax``: no temperature, penalty or filter), and that
distribution's top :data:`PROMPT_LOGPROBS_TOPK` tokens. Token 0 has none.

A cached block keeps these for its own tokens (:class:`BlockPromptLogprobs`), plus the final hidden
state of its last position, from which the runner recomputes the distribution that predicts the
*next* block's first token (whatever that token is). So a later request with ``prompt_logprobs``
takes the entries of every cached block it hits and computes only its uncached tokens, the first
of them from the last hit block's hidden state: one ``lm_head`` row instead of the whole prompt.
The entries are stored and cleared with the block (they are part of what the hit verifies: the
block's whole prefix), and a block cached by a request that did not ask for prompt logprobs has
none, so it is not a hit for one that does (:meth:`KVCacheManager.admit`). vLLM instead skips the
prefix cache for such requests (vllm-project/vllm#8268, vllm-project/vllm#42019).

A low-level data module: the cache, the runner and the engine all see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PROMPT_LOGPROBS_TOPK = 20  # alternatives kept per position: vLLM's default max_logprobs


@dataclass(frozen=True, slots=True)
class PromptLogprobsWork:
    """What the runner needs, besides the step's tokens, to compute a chunk's prompt logprobs.

    Attributes:
        next_token_id: the prompt token right after the chunk, or ``None`` when the chunk reaches
            the prompt's last token (its logits predict an output token, not a prompt token).
        prev_hidden: shape = [hidden_size]: the final hidden state of the position before the
            chunk, when the chunk's first token has no entry yet (it follows cache hits); else None.
    """

    next_token_id: int | None
    prev_hidden: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """The runner's prompt logprobs for prompt tokens ``[start, start + n)``.

    Attributes:
        start: the first prompt token covered, >= 1.
        token_logprobs: shape = [n] float32, each token's logprob.
        token_ranks: shape = [n] int64, the tokens with a logprob >= its own (itself included: vLLM's rank).
        topk_ids: shape = [n, PROMPT_LOGPROBS_TOPK] int64, the most likely tokens, best first.
        topk_logprobs: shape = [n, PROMPT_LOGPROBS_TOPK] float32.
        block_hidden: block index -> shape = [hidden_size]: the final hidden state of the last
            position of each prompt block the chunk completes.
    """

    start: int
    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    block_hidden: dict[int, torch.Tensor]


@dataclass(frozen=True, slots=True)
class BlockPromptLogprobs:
    """A cached block's prompt-logprob entries: its ``block_size`` tokens, then its last hidden state.

    Attributes:
        token_logprobs: shape = [block_size] float32 (NaN for a sequence's token 0).
        token_ranks: shape = [block_size] int64 (0 for token 0).
        topk_ids: shape = [block_size, PROMPT_LOGPROBS_TOPK] int64.
        topk_logprobs: shape = [block_size, PROMPT_LOGPROBS_TOPK] float32.
        last_hidden: shape = [hidden_size], the model's dtype.
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    last_hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.token_logprobs, self.token_ranks, self.topk_ids, self.topk_logprobs, self.last_hidden))


@dataclass(slots=True, eq=False)
class PromptLogprobsState:
    """A request's prompt logprobs as they are filled: from cache hits and from computed chunks.

    Args:
        num_prompt_tokens: the prompt's length.
        block_size: tokens per KV block.
    """

    num_prompt_tokens: int
    block_size: int
    token_logprobs: torch.Tensor = field(init=False)  # [num_prompt_tokens] float32, NaN at 0
    token_ranks: torch.Tensor = field(init=False)  # [num_prompt_tokens] int64
    topk_ids: torch.Tensor = field(init=False)  # [num_prompt_tokens, PROMPT_LOGPROBS_TOPK] int64
    topk_logprobs: torch.Tensor = field(init=False)  # [num_prompt_tokens, PROMPT_LOGPROBS_TOPK] float32
    filled: torch.Tensor = field(init=False)  # [num_prompt_tokens] bool; token 0 counts as filled
    block_hidden: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    num_from_cache: int = field(init=False, default=0)  # entries taken from cached blocks
    built: list | None = field(init=False, default=None)  # the output's list, once complete (shared by samples)

    def __post_init__(self) -> None:
        n, k = self.num_prompt_tokens, PROMPT_LOGPROBS_TOPK
        self.token_logprobs = torch.full((n,), float("nan"))
        self.token_ranks = torch.zeros(n, dtype=torch.int64)
        self.topk_ids = torch.zeros(n, k, dtype=torch.int64)
        self.topk_logprobs = torch.full((n, k), float("nan"))
        self.filled = torch.zeros(n, dtype=torch.bool)
        self.filled[0] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def has_entry(self, token_index: int) -> bool:
        return token_index >= self.num_prompt_tokens or bool(self.filled[token_index])

    def add_chunk(self, chunk: PromptLogprobsChunk) -> None:
        """Records a computed chunk (entries already filled keep their first value)."""
        n = chunk.token_logprobs.shape[0]
        s = slice(chunk.start, chunk.start + n)
        new = ~self.filled[s]
        self.token_logprobs[s] = torch.where(new, chunk.token_logprobs, self.token_logprobs[s])
        self.token_ranks[s] = torch.where(new, chunk.token_ranks, self.token_ranks[s])
        self.topk_ids[s] = torch.where(new[:, None], chunk.topk_ids, self.topk_ids[s])
        self.topk_logprobs[s] = torch.where(new[:, None], chunk.topk_logprobs, self.topk_logprobs[s])
        self.filled[s] = True
        for b, hidden in chunk.block_hidden.items():
            self.block_hidden.setdefault(b, hidden)

    def add_cached_block(self, block_index: int, data: BlockPromptLogprobs) -> None:
        """Takes a cache-hit block's entries (its tokens) and its last hidden state."""
        s = slice(block_index * self.block_size, (block_index + 1) * self.block_size)
        self.num_from_cache += int((~self.filled[s]).sum())
        self.token_logprobs[s] = data.token_logprobs
        self.token_ranks[s] = data.token_ranks
        self.topk_ids[s] = data.topk_ids
        self.topk_logprobs[s] = data.topk_logprobs
        self.filled[s] = True
        self.block_hidden[block_index] = data.last_hidden

    def block_entries(self, block_index: int) -> BlockPromptLogprobs | None:
        """A full prompt block's entries for caching, or ``None`` when not all known yet."""
        s = slice(block_index * self.block_size, (block_index + 1) * self.block_size)
        hidden = self.block_hidden.get(block_index)
        if hidden is None or s.stop > self.num_prompt_tokens or not bool(self.filled[s].all()):
            return None
        return BlockPromptLogprobs(
            token_logprobs=self.token_logprobs[s].clone(), token_ranks=self.token_ranks[s].clone(),
            topk_ids=self.topk_ids[s].clone(), topk_logprobs=self.topk_logprobs[s].clone(),
            last_hidden=hidden,
        )

    def work(self, start: int, end: int, all_token_ids: list[int]) -> PromptLogprobsWork | None:
        """The runner's work item for a chunk of tokens ``[start, end)``, or ``None`` when the
        chunk holds no prompt position whose entry is missing."""
        if start >= self.num_prompt_tokens:
            return None
        prev_hidden = None
        if start > 0 and not self.has_entry(start):
            prev_hidden = self.block_hidden.get(start // self.block_size - 1) if start % self.block_size == 0 else None
            if prev_hidden is None:
                raise RuntimeError(f"prompt logprobs: no hidden state before token {start}")
        return PromptLogprobsWork(
            next_token_id=all_token_ids[end] if end < self.num_prompt_tokens else None,
            prev_hidden=prev_hidden,
        )
