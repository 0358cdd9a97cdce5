"""Token sampling over a batch: logits processors, penalties, greedy, temperature, min-p, top-k,
top-p, per-request seeded generators, logprobs.

The order is vLLM v1's ``Sampler`` (``vllm/v1/sample/sampler.py``):

1. logprobs, when asked for, are ``log_softmax`` of the *raw* logits in float32 (vLLM v1's default
   ``logprobs_mode="raw_logprobs"``: before any of what follows);
2. min_tokens (EOS and stop_token_ids to -inf while too few tokens are generated) and logit_bias
   (vLLM's non-argmax-invariant logits processors);
3. penalties in float32: repetition (prompt + output tokens; positive logits divided, the others
   multiplied), then frequency (``- frequency_penalty * count`` over output tokens), then presence
   (``- presence_penalty`` once per token present in the output), as
   ``vllm/model_executor/layers/utils.py::apply_penalties``;
4. greedy rows (temperature == 0) take the ``argmax`` of these logits; with no bias, min_tokens or
   penalty, that is the argmax of the raw logits;
5. sampled rows: temperature, then min-p, then top-k, then top-p, then a draw with the row's own
   ``torch.Generator``.

Batch invariance: every step is row-wise (no value of one row depends on another's), so a row's
token and logprobs do not depend on what else is in the batch. The processing is vectorised over
the rows; only the draws loop over the sampled rows, one ``torch.multinomial`` each with the row's
generator, so a seeded request draws exactly what it drew when the sampler worked row by row.

Every temperature > 0, top_p in (0, 1] and min_p in [0, 1] that :class:`SamplingParams` accepts is
handled exactly; the probabilities a row is drawn from are always finite, sum to 1 and include the
argmax (of the processed logits):

- Temperature: the row is shifted by its max and divided in float64,
  ``scaled = (logits - max) / temperature``, so the argmax tokens get exactly 0 and every other
  token a value <= 0. The softmax's largest term is exp(0) = 1, so nothing overflows and the sum
  is never 0. A tiny temperature (1e-40, 5e-324) sends every non-argmax token to -inf: the argmax,
  with tied argmaxes sharing the mass (the limit T -> 0+). A huge one (1e308) brings the finite
  tokens within rounding of 0, where exp gives 1: uniform over them (top-p still ranks them by
  their scaled logits, which stay distinct unless they underflow to -0.0).
- Min-p drops the tokens whose probability is below ``min_p`` times the most likely token's; as
  that ratio is ``exp(scaled)``, the test is ``exp(scaled) < min_p`` in float64. The argmax has
  ratio 1 and always stays.
- Top-k ranks the logits before temperature (dividing by T > 0 keeps their order, while the scaled
  row can tie tokens that under/overflow together). Tokens tied with the k-th are kept.
- Top-p keeps the most likely tokens until the mass before the next one reaches top_p; the first
  token has mass 0 before it, so the argmax is always kept, however small top_p is (1e-46 rounds
  to 0 in float32 but not in the float64 the mass is computed in). Tokens tied with the last kept
  one are kept too, so the result does not depend on how the sort orders ties.

Logits are assumed free of NaN (a NaN is a model fault, not a sampling choice). A row whose max is
+inf or -inf resolves like any other: the tokens equal to the max share the mass. A row the
processors set entirely to -inf (e.g. every token biased away and masked) resolves the same way:
all tokens tie at the max and share the mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixcache.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The logprobs of one sampled position (ids and values; the engine decodes the tokens).

    Attributes:
        token_id: the sampled token.
        logprob: its logprob under the raw logits.
        rank: 1 + the number of other tokens with logprob >= its own (vLLM's ``batched_count_greater_than``).
        top_token_ids: the ``SamplingParams.logprobs`` most likely tokens, most likely first.
        top_logprobs: their logprobs, in the same order.
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, one entry per logits row.

    Built by the model runner from what the scheduler hands it (see
    ``prefixcache.runner.sampling_state``). Rows whose params need no token history have
    ``history_rows`` entries of -1.

    Attributes:
        params: sampling parameters per row, ``[num_rows]``.
        generators: RNG per row (used only by sampled rows).
        num_output_tokens: tokens generated so far per row (min_tokens reads it).
        eos_token_ids: the model's EOS tokens (masked with stop_token_ids under min_tokens).
        prompt_mask: shape = [num_history_rows, vocab_size], bool: the token appears in the prompt.
        output_counts: shape = [num_history_rows, vocab_size], int32: times the token was generated.
        history_rows: per row, its index into ``prompt_mask``/``output_counts``, or -1.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator]
    num_output_tokens: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    history_rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SamplerOutput:
    """One step's picks: ``token_ids[i]`` for row i, ``logprobs[i]`` when row i asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# ------------------------------------------------------------------------------ the step
def sample_batch(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Picks one token per row (see the module docstring for the order of operations).

    Args:
        logits: shape = [num_rows, vocab_size], float32, raw model output (not modified).
        metadata: the rows' parameters, generators and token histories.

    Returns:
        The token per row and, for rows with ``params.logprobs`` set, its logprobs.
    """
    params = metadata.params
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = logits[lp_rows].log_softmax(-1) if lp_rows else None  # [num_lp_rows, vocab_size]
    processed = apply_logits_processors(logits, metadata)
    tokens = processed.argmax(dim=-1).tolist()  # greedy rows keep these
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = [params[i] for i in sampled_rows]
        probs = batch_sampling_probs(
            processed[sampled_rows],
            [p.temperature for p in rows], [p.top_k for p in rows], [p.top_p for p in rows], [p.min_p for p in rows],
        ).float()  # [num_sampled_rows, vocab_size]: float32 for the draw, as ever
        # One draw per row with its own generator: the same RNG use as the row-by-row sampler. The
        # argmax's probability is >= 1 / vocab_size, so a row never rounds to all zeros.
        for j, i in enumerate(sampled_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=metadata.generators[i]).item())
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if raw_logprobs is not None:
        for i, entry in zip(lp_rows, gather_logprobs(raw_logprobs, [tokens[i] for i in lp_rows],
                                                     [params[i].logprobs for i in lp_rows])):
            logprobs[i] = entry
    return SamplerOutput(tokens, logprobs)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Picks one token per row of rows without token history (no penalties, no min_tokens count).

    Args:
        logits: shape = [num_seqs, vocab_size], float32.
        params: sampling parameters per row.
        generators: RNG per row (used only by non-greedy rows).

    Returns:
        One token id per row (see :func:`sample_batch`).

    Raises:
        ValueError: a row has a penalty (penalties need the token histories of :func:`sample_batch`).
    """
    if any(p.has_penalties for p in params):
        raise ValueError("sample() has no token histories; use sample_batch() for penalties")
    return sample_batch(logits, SamplingMetadata(params, generators, num_output_tokens=[0] * len(params))).token_ids


# ------------------------------------------------------------------------------ logits processors
def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """min_tokens, logit_bias and the penalties, in vLLM's order; a new tensor when any applies.

    min_tokens leaves a row whose only finite logits are stop tokens as it is: a structured-output
    grammar that is complete allows EOS alone, and the request ends there (``"stop"``) with fewer
    than ``min_tokens`` tokens rather than sample a token the grammar refuses (vLLM masks both and
    leaves the row with no token).

    Args:
        logits: shape = [num_rows, vocab_size], float32 (not modified).
        metadata: see :class:`SamplingMetadata`.

    Returns:
        shape = [num_rows, vocab_size], float32: rows without any of these are unchanged.
    """
    params, vocab_size = metadata.params, logits.shape[-1]
    mask_rows, mask_ids, bias_rows, bias_ids, biases = [], [], [], [], []
    for i, p in enumerate(params):
        if p.min_tokens and metadata.num_output_tokens[i] < p.min_tokens:
            stops = {t for t in (*p.stop_token_ids, *metadata.eos_token_ids) if t < vocab_size}
            mask_rows += [i] * len(stops)
            mask_ids += stops
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            biases += p.logit_bias.values()
    history = [i for i, p in enumerate(params) if p.has_penalties]
    if not (mask_ids or biases or history):
        return logits
    x = logits.clone()
    if mask_ids:
        x[mask_rows, mask_ids] = float("-inf")
        rows = sorted(set(mask_rows))
        stuck = [r for r, dead in zip(rows, torch.isneginf(x[rows]).all(-1).tolist()) if dead]
        if stuck:  # only a stop token was allowed (a complete grammar): it wins over min_tokens
            x[stuck] = logits[stuck]
    if biases:
        x.index_put_((torch.tensor(bias_rows), torch.tensor(bias_ids)), torch.tensor(biases, dtype=x.dtype),
                     accumulate=True)
    if history:
        hist = torch.tensor([metadata.history_rows[i] for i in history])
        x[history] = apply_penalties(
            x[history], metadata.prompt_mask[hist], metadata.output_counts[hist],
            [params[i].presence_penalty for i in history], [params[i].frequency_penalty for i in history],
            [params[i].repetition_penalty for i in history],
        )
    return x


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence_penalties: list[float],
    frequency_penalties: list[float],
    repetition_penalties: list[float],
) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's ``apply_penalties``; the
    repetition rule is HF's ``RepetitionPenaltyLogitsProcessor``: a positive logit is divided by the
    penalty, any other multiplied; frequency and presence follow OpenAI's definition).

    Args:
        logits: shape = [num_rows, vocab_size], float32.
        prompt_mask: shape = [num_rows, vocab_size], bool: token in the prompt.
        output_counts: shape = [num_rows, vocab_size], int: times the token was generated.
        presence_penalties, frequency_penalties, repetition_penalties: one per row (as float32).

    Returns:
        shape = [num_rows, vocab_size], float32.
    """
    dtype = logits.dtype
    rep = torch.tensor(repetition_penalties, dtype=dtype)[:, None]  # [num_rows, 1]
    seen = prompt_mask | (output_counts > 0)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    x = torch.where(seen, penalized, logits)
    x = x - torch.tensor(frequency_penalties, dtype=dtype)[:, None] * output_counts.to(dtype)
    return x - torch.tensor(presence_penalties, dtype=dtype)[:, None] * (output_counts > 0).to(dtype)


# ------------------------------------------------------------------------------ sampled rows
def batch_top_k_drop(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor | None:
    """Tokens outside each row's top k (True = drop), or None when top-k keeps every token.

    Args:
        logits: shape = [num_rows, vocab_size].
        top_ks: per row: keep the k largest logits and any tied with the k-th; <= 0 or >= vocab_size
            keeps all.
    """
    vocab_size = logits.shape[-1]
    active = [0 < k < vocab_size for k in top_ks]
    if not any(active):
        return None
    kth_index = torch.tensor([k - 1 if a else 0 for k, a in zip(top_ks, active)])[:, None]  # [num_rows, 1]
    max_k = max(k for k, a in zip(top_ks, active) if a)
    kth = logits.topk(max_k, dim=-1).values.gather(1, kth_index)  # [num_rows, 1]: the k-th largest value
    return (logits < kth) & torch.tensor(active)[:, None]


def batch_top_p_drop(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor | None:
    """Tokens outside each row's nucleus of ``softmax(logits)`` (True = drop), or None when every
    top_p is 1.

    The nucleus is the most likely tokens, taken in order until the mass of those before the next
    one reaches top_p, plus any tied with the last taken. It always holds the argmax.

    Args:
        logits: shape = [num_rows, vocab_size], already divided by the temperature; -inf = dropped before.
        top_ps: per row, in (0, 1].
    """
    active = [p < 1 for p in top_ps]
    if not any(active):
        return None
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [num_rows, vocab_size]
    sorted_probs = sorted_logits.double().softmax(-1)
    mass_before = torch.cat([sorted_probs.new_zeros(len(top_ps), 1), sorted_probs.cumsum(-1)[:, :-1]], dim=-1)
    top_p = torch.tensor(top_ps, dtype=torch.float64)[:, None]
    num_kept = (mass_before < top_p).sum(-1, keepdim=True)  # >= 1: mass_before[:, 0] == 0 < top_p
    return (logits < sorted_logits.gather(1, num_kept - 1)) & torch.tensor(active)[:, None]


def batch_sampling_probs(
    logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float]
) -> torch.Tensor:
    """The distributions sampled rows are drawn from: temperature, then min-p, top-k, top-p.

    Args:
        logits: shape = [num_rows, vocab_size], after the logits processors (any float dtype).
        temperatures: per row, > 0.
        top_ks: see :func:`batch_top_k_drop`.
        top_ps: see :func:`batch_top_p_drop`.
        min_ps: per row, in [0, 1].

    Returns:
        shape = [num_rows, vocab_size], float64: finite, summing to 1 per row, > 0 at the argmax
        (see the module docstring for how degenerate cases resolve).
    """
    x = logits.double()  # [num_rows, vocab_size]
    row_max = x.max(dim=-1, keepdim=True).values
    temperature = torch.tensor(temperatures, dtype=torch.float64)[:, None]
    # == row_max is 0 exactly, also when the max is +-inf (where x - row_max would be NaN).
    scaled = torch.where(x == row_max, 0.0, (x - row_max) / temperature)  # <= 0
    if any(m > 0 for m in min_ps):  # p / p_max == exp(scaled)
        scaled = scaled.masked_fill(scaled.exp() < torch.tensor(min_ps, dtype=torch.float64)[:, None], float("-inf"))
    drop = batch_top_k_drop(x, top_ks)  # on the unscaled logits: same order, no ties made by the division
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    drop = batch_top_p_drop(scaled, top_ps)
    if drop is not None:
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """:func:`batch_sampling_probs` of one row: shape = [vocab_size] in, float64 [vocab_size] out."""
    return batch_sampling_probs(logits[None], [temperature], [top_k], [top_p], [min_p])[0]


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks tokens outside the top-k, then outside the top-p nucleus, to ``-inf`` (one row).

    Args:
        logits: shape = [vocab_size], already divided by the temperature.
        top_k: see :func:`batch_top_k_drop`.
        top_p: see :func:`batch_top_p_drop`.

    Returns:
        shape = [vocab_size], the same dtype; the kept tokens keep their logits.
    """
    logits = logits[None]  # [1, vocab_size]
    drop = batch_top_k_drop(logits, [top_k])
    if drop is not None:
        logits = logits.masked_fill(drop, float("-inf"))
    drop = batch_top_p_drop(logits, [top_p])
    if drop is not None:
        logits = logits.masked_fill(drop, float("-inf"))
    return logits[0]


# ------------------------------------------------------------------------------ logprobs
def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_logprobs: list[int]) -> list[TokenLogprobs]:
    """The chosen token's logprob and rank, and each row's top ``num_logprobs`` (vLLM's
    ``Sampler.gather_logprobs``).

    Args:
        logprobs: shape = [num_rows, vocab_size], float32 log-probabilities.
        token_ids: the chosen token per row.
        num_logprobs: k per row, in [0, vocab_size].
    """
    chosen_ids = torch.tensor(token_ids)[:, None]
    chosen = logprobs.gather(1, chosen_ids)  # [num_rows, 1]
    ranks = (logprobs >= chosen).sum(-1).tolist()
    k_max = max(num_logprobs)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], chosen_ids[:, :0])
    out = []
    for i, (k, top_v, top_i) in enumerate(zip(num_logprobs, top_values.tolist(), top_ids.tolist())):
        out.append(TokenLogprobs(token_ids[i], float(chosen[i, 0]), ranks[i], tuple(top_i[:k]), tuple(top_v[:k])))
    return out
