"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Greedy rows take ``argmax`` of the raw logits (no temperature, no filtering), so greedy output
does not depend on what else is in the batch. Sampled rows apply temperature, then top-k, then
top-p (the order of vLLM's and HF's samplers), and draw with the row's own ``torch.Generator``.
"""

from __future__ import annotations

import torch

from prefixcache.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks tokens outside the top-k / nucleus to ``-inf``.

    Args:
        logits: shape = [vocab_size], already divided by the temperature.
        top_k: keep this many tokens; <= 0 keeps all.
        top_p: keep the smallest set of tokens whose probability mass reaches top_p.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of the tokens before it already reaches top_p.
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
    return logits


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
        One token id per row.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens
