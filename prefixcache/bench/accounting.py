"""Exact prefill and KV-block accounting of a workload, from its token ids alone.

Definitions (``B`` = block size in tokens; a request has prompt ``p`` of ``L`` tokens and, once run,
output ``o``; "block key" ``k`` of a token sequence ``s`` = the whole prefix ``s[:(k + 1) * B]``, so two
blocks have the same key iff their K/V is identical):

- A request can take at most ``c = (L - 1) // B`` full blocks from a cache: its last prompt token is
  always computed, to yield logits. Its *non-shareable tail* is ``L - c * B`` tokens (1..B).
- A request *leaves behind* the full blocks of every token whose K/V it computed:
  ``p + o[:-1]`` (the last sampled token is never fed back).
- **Ideal prefill** of a run = prompt tokens an unbounded, perfect full-block cache would compute,
  requests taken in arrival order, every full block computed once::

      ideal = sum over requests of  L - B * h,   h = the longest run of leading blocks of p, capped
                                                     at c, whose keys are already known

  where the known keys, when a request is admitted, are those left behind by every request of an
  earlier round (their prompt and output) and the prompt blocks of the earlier requests of its own
  round (requests of a round arrive together and are admitted in order; an earlier request's output
  is not yet known). With one round of prompts that share only a common prefix, this is
  ``B * |distinct keys among all cacheable blocks| + sum of the non-shareable tails`` — every shared
  full block computed once.
- **Ideal peak blocks** of a round = blocks to hold all its requests at full length at once with
  every shared prompt block stored once: ``|distinct keys among the cacheable blocks| + sum of
  (ceil((L + len(o) - 1) / B) - c)``. The peak of a run is the largest round's.

The engine with caching on and full-block sharing only (``enable_partial_block_reuse=False``) must
compute exactly ``ideal`` tokens when its pool never evicts; more means a missed hit. Partial-block
reuse copies the matching first slots of a cached block too, so it may compute fewer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Round = Sequence[Sequence[int]]  # the prompts of one round, in arrival order


class _BlockKeys:
    """Interns block keys: key of block k = (key of block k-1, tokens of block k) → a small int."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def keys(self, token_ids: Sequence[int], num_blocks: int, create: bool) -> list[int]:
        """Ids of the first ``num_blocks`` block keys; stops at the first unknown one unless ``create``."""
        bs, parent, out = self.block_size, -1, []
        for k in range(num_blocks):
            key = (parent, tuple(token_ids[k * bs : (k + 1) * bs]))
            kid = self._ids.get(key)
            if kid is None:
                if not create:
                    break
                kid = self._ids[key] = len(self._ids)
            out.append(kid)
            parent = kid
        return out


@dataclass(frozen=True)
class IdealAccounting:
    """Ideal counts of a run (see the module docstring).

    Attributes:
        prompt_tokens: all prompt tokens of all requests.
        ideal_prefill_tokens: prompt tokens a perfect full-block cache computes.
        ideal_hit_tokens: ``prompt_tokens - ideal_prefill_tokens``.
        ideal_hit_requests: requests with at least one ideal hit.
        ideal_peak_blocks: the largest round's blocks with shared prompt blocks stored once.
        unshared_peak_blocks: the same with nothing shared (what caching off holds).
        distinct_hit_blocks: distinct blocks that serve at least one ideal hit.
        block_hits: ideal hits in blocks (each hit of each request counted).
    """

    prompt_tokens: int
    ideal_prefill_tokens: int
    ideal_hit_tokens: int
    ideal_hit_requests: int
    ideal_peak_blocks: int
    unshared_peak_blocks: int
    distinct_hit_blocks: int
    block_hits: int


def ideal_accounting(
    rounds: Sequence[Round], block_size: int, outputs: Sequence[Sequence[Sequence[int]]] | None = None
) -> IdealAccounting:
    """Computes the ideal prefill and peak blocks of a run of rounds.

    Args:
        rounds: prompts (token ids) per round, in arrival order.
        block_size: tokens per block, ``>= 1``.
        outputs: generated token ids per request, shaped like ``rounds``; ``None`` = no outputs
            (then nothing but prompts is left behind, and peak blocks count prompts only).

    Returns:
        The counts, exact.

    Raises:
        ValueError: ``block_size < 1``, an empty prompt, or ``outputs`` shaped unlike ``rounds``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if outputs is not None and [len(r) for r in outputs] != [len(r) for r in rounds]:
        raise ValueError("outputs must have one entry per prompt of each round")
    bs = block_size
    known = _BlockKeys(bs)
    prompt_tokens = ideal_prefill = hit_requests = peak = unshared_peak = block_hits = 0
    hit_keys: set[int] = set()
    for r, prompts in enumerate(rounds):
        round_keys: set[int] = set()
        round_private = round_unshared = 0
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError("prompts must not be empty")
            n = len(p)
            c = (n - 1) // bs
            hits = known.keys(p, c, create=False)
            hit_keys.update(hits)
            block_hits += len(hits)
            hit_requests += bool(hits)
            prompt_tokens += n
            ideal_prefill += n - bs * len(hits)
            round_keys.update(known.keys(p, n // bs, create=True)[:c])  # its full blocks become known
            out = outputs[r][i] if outputs is not None else ()
            total_blocks = -(-(n + max(len(out) - 1, 0)) // bs)
            round_private += total_blocks - c
            round_unshared += total_blocks
        peak = max(peak, len(round_keys) + round_private)
        unshared_peak = max(unshared_peak, round_unshared)
        if outputs is not None:  # the round finished: its outputs' full blocks are left behind
            for p, out in zip(prompts, outputs[r]):
                seq = list(p) + list(out[:-1])
                known.keys(seq, len(seq) // bs, create=True)
    return IdealAccounting(
        prompt_tokens=prompt_tokens,
        ideal_prefill_tokens=ideal_prefill,
        ideal_hit_tokens=prompt_tokens - ideal_prefill,
        ideal_hit_requests=hit_requests,
        ideal_peak_blocks=peak,
        unshared_peak_blocks=unshared_peak,
        distinct_hit_blocks=len(hit_keys),
        block_hits=block_hits,
    )


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix shared by all ``prompts`` (0 for fewer than two)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for i in range(n):
        t = first[i]
        if any(p[i] != t for p in prompts):
            return i
    return n
