"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Greedy rows (temperature == 0) take ``argmax`` of the raw logits (no temperature, no filtering), so
greedy output does not depend on what else is in the batch. Sampled rows apply temperature, then
top-k, then top-p (the order of vLLM's and HF's samplers), and draw with the row's own
``torch.Generator``.

Every temperature > 0 and top_p in (0, 1] that :class:`SamplingParams` accepts is handled exactly;
the probabilities a row is drawn from are always finite, sum to 1 and include the argmax:

- Temperature: the row is shifted by its max and divided in float64,
  ``scaled = (logits - max) / temperature``, so the argmax tokens get exactly 0 and every other
  token a value <= 0. The softmax's largest term is exp(0) = 1, so nothing overflows and the sum
  is never 0. A tiny temperature (1e-40, 5e-324) sends every non-argmax token to -inf: the argmax,
  with tied argmaxes sharing the mass (the limit T -> 0+). A huge one (1e308) brings the finite
  tokens within rounding of 0, where exp gives 1: uniform over them (top-p still ranks them by
  their scaled logits, which stay distinct unless they underflow to -0.0).
- Top-k ranks the raw logits (dividing by T > 0 keeps their order, while the scaled row can tie
  tokens that under/overflow together). Tokens tied with the k-th are kept.
- Top-p keeps the most likely tokens until the mass before the next one reaches top_p; the first
  token has mass 0 before it, so the argmax is always kept, however small top_p is (1e-46 rounds
  to 0 in float32 but not in the float64 the mass is computed in). Tokens tied with the last kept
  one are kept too, so the result does not depend on how the sort orders ties.

Logits are assumed free of NaN (a NaN is a model fault, not a sampling choice). A row whose max is
+inf or -inf resolves like any other: the tokens equal to the max share the mass.
"""

from __future__ import annotations

import torch

from prefixcache.sampling_params import SamplingParams


def top_k_drop(logits: torch.Tensor, top_k: int) -> torch.Tensor | None:
    """Tokens outside the top k (True = drop), or None when top-k keeps every token.

    Args:
        logits: shape = [vocab_size].
        top_k: keep the k largest logits and any tied with the k-th; <= 0 or >= vocab_size keeps all.
    """
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return None
    kth = torch.topk(logits, top_k).values[-1]
    return logits < kth


def top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """Tokens outside the nucleus of ``softmax(logits)`` (True = drop), or None when top_p == 1.

    The nucleus is the most likely tokens, taken in order until the mass of those before the next
    one reaches top_p, plus any tied with the last taken. It always holds the argmax.

    Args:
        logits: shape = [vocab_size], already divided by the temperature; -inf = dropped before.
        top_p: in (0, 1].
    """
    if top_p >= 1:
        return None
    sorted_logits = torch.sort(logits, descending=True).values  # [vocab_size]
    sorted_probs = sorted_logits.double().softmax(-1)
    mass_before = torch.cat([sorted_probs.new_zeros(1), sorted_probs.cumsum(-1)[:-1]])  # non-decreasing
    num_kept = int((mass_before < top_p).sum())  # >= 1: mass_before[0] == 0 < top_p
    return logits < sorted_logits[num_kept - 1]


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks tokens outside the top-k, then outside the top-p nucleus, to ``-inf``.

    Args:
        logits: shape = [vocab_size], already divided by the temperature.
        top_k: see :func:`top_k_drop`.
        top_p: see :func:`top_p_drop`.

    Returns:
        shape = [vocab_size], the same dtype; the kept tokens keep their logits.
    """
    drop = top_k_drop(logits, top_k)
    if drop is not None:
        logits = logits.masked_fill(drop, float("-inf"))
    drop = top_p_drop(logits, top_p)
    if drop is not None:
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a sampled row is drawn from: temperature, then top-k, then top-p.

    Args:
        logits: shape = [vocab_size], raw (any float dtype).
        temperature: > 0.
        top_k: see :func:`top_k_drop`.
        top_p: see :func:`top_p_drop`.

    Returns:
        shape = [vocab_size], float64: finite, summing to 1, > 0 at the argmax (see the module
        docstring for how degenerate cases resolve).
    """
    x = logits.double()  # [vocab_size]
    row_max = x.max()
    # == row_max is 0 exactly, also when the max is +-inf (where x - row_max would be NaN).
    scaled = torch.where(x == row_max, 0.0, (x - row_max) / float(temperature))  # [vocab_size], <= 0
    drop = top_k_drop(x, top_k)  # on the raw logits: same order, no ties made by the division
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    drop = top_p_drop(scaled, top_p)
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(-1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """Picks one token per row.

    Args:
        logits: shape = [num_seqs, vocab_size], float32.
        params: sampling parameters per row.
        generators: RNG per row (used only by non-greedy rows).

    Returns:
        One token id per row: the argmax of the raw logits for greedy rows, else a draw from
        :func:`sampling_probs` with the row's generator.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = sampling_probs(logits[i], p.temperature, p.top_k, p.top_p)
        # float32 for the draw: same RNG use as ever. The argmax's probability is >= 1 / vocab_size,
        # so the row never rounds to all zeros.
        tokens[i] = int(torch.multinomial(probs.float(), 1, generator=generators[i]).item())
    return tokens
