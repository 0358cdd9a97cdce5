"""The vectorised sampler (issue 13): the same draws as the row-by-row sampler, batch invariance,
each penalty and filter on constructed logits against hand-computed values, raw logprobs, and the
new SamplingParams fields' validation.

Expected values are chosen exactly representable in float32 (3 / 1.5 = 2, -1 * 1.5 = -1.5, ...), so
the comparisons are exact.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.layers.sampler import (
    SamplingMetadata,
    apply_logits_processors,
    apply_penalties,
    batch_sampling_probs,
    gather_logprobs,
    sample,
    sample_batch,
)
from prefixcache.runner.token_history import TokenHistories
from prefixcache.sampling_params import SamplingParams

INF = float("inf")


# ------------------------------------------------------------------ the row-by-row reference
def rowwise_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution of one row as the sampler computed it before it was vectorised (main at
    02daad1): temperature in float64, top-k on the raw row, then top-p on the scaled row."""
    x = logits.double()
    row_max = x.max()
    scaled = torch.where(x == row_max, 0.0, (x - row_max) / float(temperature))
    if 0 < top_k < x.shape[-1]:
        scaled = scaled.masked_fill(x < torch.topk(x, top_k).values[-1], -INF)
    if top_p < 1:
        sorted_scaled = torch.sort(scaled, descending=True).values
        probs = sorted_scaled.softmax(-1)
        mass_before = torch.cat([probs.new_zeros(1), probs.cumsum(-1)[:-1]])
        num_kept = int((mass_before < top_p).sum())
        scaled = scaled.masked_fill(scaled < sorted_scaled[num_kept - 1], -INF)
    return scaled.softmax(-1)


def rowwise_sample(logits, params, generators) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            probs = rowwise_probs(logits[i], p.temperature, p.top_k, p.top_p)
            tokens[i] = int(torch.multinomial(probs.float(), 1, generator=generators[i]).item())
    return tokens


def random_batch(rng: random.Random, gen: torch.Generator):
    num_rows, vocab = rng.randint(1, 6), rng.choice([5, 50, 1000, 8192])
    logits = torch.randn(num_rows, vocab, generator=gen) * rng.choice([0.1, 1.0, 5.0, 30.0])
    if rng.random() < 0.3:
        logits[:, : vocab // 3] = logits[:, :1]  # ties
    params = [SamplingParams(temperature=rng.choice([0, 0.5, 1.0, 1.3, 1e-40, 1e308]),
                             top_p=rng.choice([1.0, 0.9, 0.5, 1e-46]), top_k=rng.choice([0, -1, 1, 3, 40, 10**30]))
              for _ in range(num_rows)]
    seeds = [rng.randint(0, 10**6) for _ in range(num_rows)]
    return logits, params, seeds


def test_vectorised_sampler_draws_exactly_what_the_row_by_row_sampler_drew():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for _ in range(60):
        logits, params, seeds = random_batch(rng, gen)
        probs = batch_sampling_probs(logits, [p.temperature for p in params], [p.top_k for p in params],
                                     [p.top_p for p in params], [0.0] * len(params))
        for i, p in enumerate(params):
            assert torch.equal(probs[i], rowwise_probs(logits[i], p.temperature, p.top_k, p.top_p))  # bitwise
        got = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
        assert got == rowwise_sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])


def test_a_row_samples_the_same_alone_and_in_any_batch():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(15):
        logits, params, seeds = random_batch(rng, gen)
        params = [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=rng.choice([0, 0.05]),
                                 logprobs=2) for p in params]
        batch = sample_batch(logits, SamplingMetadata(params, [torch.Generator().manual_seed(s) for s in seeds],
                                                      [0] * len(params)))
        for i in range(len(params)):
            alone = sample_batch(logits[i : i + 1], SamplingMetadata(params[i : i + 1],
                                                                     [torch.Generator().manual_seed(seeds[i])], [0]))
            assert (alone.token_ids[0], alone.logprobs[0]) == (batch.token_ids[i], batch.logprobs[i])


# ------------------------------------------------------------------ penalties (hand-computed)
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[3.0, -1.0, 2.0, -0.5, 0.0, 4.5]])
    prompt = torch.tensor([[True, True, False, False, True, False]])
    counts = torch.tensor([[0, 0, 0, 2, 0, 1]], dtype=torch.int32)
    got = apply_penalties(logits, prompt, counts, [0.0], [0.0], [1.5])
    # seen: 0 (prompt), 1 (prompt), 3 (output), 4 (prompt, 0 * 1.5 = 0), 5 (output); 2 is not
    assert got.tolist() == [[2.0, -1.5, 2.0, -0.75, 0.0, 3.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    prompt = torch.tensor([[True, False, False, True]])  # the prompt never counts for these two
    counts = torch.tensor([[0, 1, 3, 0]], dtype=torch.int32)
    assert apply_penalties(logits, prompt, counts, [0.0], [0.5], [1.0]).tolist() == [[1.0, 0.5, -0.5, 1.0]]
    assert apply_penalties(logits, prompt, counts, [0.25], [0.0], [1.0]).tolist() == [[1.0, 0.75, 0.75, 1.0]]
    # Negative values encourage repeats.
    assert apply_penalties(logits, prompt, counts, [-1.0], [-0.5], [1.0]).tolist() == [[1.0, 2.5, 3.5, 1.0]]


def test_penalties_apply_repetition_then_frequency_then_presence():
    logits = torch.tensor([[3.0, -2.0]])
    counts = torch.tensor([[2, 1]], dtype=torch.int32)
    got = apply_penalties(logits, torch.tensor([[False, False]]), counts, [0.5], [0.25], [2.0])
    # 3 / 2 - 0.25 * 2 - 0.5 = 0.5;  -2 * 2 - 0.25 - 0.5 = -4.75
    assert got.tolist() == [[0.5, -4.75]]


def metadata(params, num_output_tokens=None, eos=(), prompts=None, outputs=None, vocab=6):
    """SamplingMetadata with histories built by the runner's TokenHistories."""
    md = SamplingMetadata(list(params), [torch.Generator().manual_seed(0) for _ in params],
                          num_output_tokens or [0] * len(params), tuple(eos), history_rows=[-1] * len(params))
    histories, tables = TokenHistories(), []
    for i, p in enumerate(params):
        if p.has_penalties:
            md.history_rows[i] = len(tables)
            tables.append(histories.get(str(i), prompts[i], outputs[i], vocab))
    if tables:
        md.prompt_mask = torch.stack([h.prompt_mask for h in tables])
        md.output_counts = torch.stack([h.output_counts for h in tables])
    return md


def test_processors_touch_only_their_rows_and_greedy_takes_the_argmax_after_them():
    logits = torch.tensor([[1.0, 5.0, 4.0, 0.0, 2.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0),  # untouched
        SamplingParams(temperature=0, logit_bias={3: 10.0, 1: -100}),
        SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2, 10**30]),
    ]
    prompts = [None, None, [1, 1, 5], None]
    outputs = [None, None, [2, 1], None]
    md = metadata(params, [0, 0, 2, 1], eos=[1], prompts=prompts, outputs=outputs)
    x = apply_logits_processors(logits, md)
    assert x[0].tolist() == [1.0, 5.0, 4.0, 0.0, 2.0, -1.0]
    assert x[1].tolist() == [1.0, -95.0, 4.0, 10.0, 2.0, -1.0]
    # token 1: prompt + output, 5 / 2 - 1 = 1.5; token 2: output, 4 / 2 - 1 = 1; 5: prompt, -1 * 2
    assert x[2].tolist() == [1.0, 1.5, 1.0, 0.0, 2.0, -2.0]
    assert x[3].tolist() == [1.0, -INF, -INF, 0.0, 2.0, -1.0]  # EOS 1 and stop token 2 masked
    assert sample_batch(logits, md).token_ids == [1, 3, 4, 4]
    assert logits[0].tolist() == [1.0, 5.0, 4.0, 0.0, 2.0, -1.0]  # the caller's logits are left alone


def test_min_tokens_stops_masking_once_reached():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    params = [SamplingParams(temperature=0, min_tokens=2)]
    assert sample_batch(logits, metadata(params, [1], eos=[1], vocab=3)).token_ids == [2]
    assert sample_batch(logits, metadata(params, [2], eos=[1], vocab=3)).token_ids == [1]


def test_min_p_keeps_tokens_with_at_least_min_p_times_the_top_probability():
    # After temperature 1: probabilities relative to the top are exp(x - max) = 1, e^-1, e^-2, e^-3.
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    threshold = math.exp(-2)  # keeps 0, 1, 2 (exp(-2) is not below it), drops 3
    probs = batch_sampling_probs(logits, [1.0], [0], [1.0], [threshold])[0].tolist()
    z = 1 + math.exp(-1) + math.exp(-2)
    assert probs == pytest.approx([1 / z, math.exp(-1) / z, math.exp(-2) / z, 0.0], rel=1e-15, abs=0)
    # At temperature 0.5 the ratios square: e^-2 for token 1 still passes, e^-4 for token 2 does not.
    probs = batch_sampling_probs(logits, [0.5], [0], [1.0], [threshold])[0].tolist()
    assert probs == pytest.approx([1 / (1 + math.exp(-2)), math.exp(-2) / (1 + math.exp(-2)), 0.0, 0.0], rel=1e-15)
    # min_p = 1 keeps the argmax (and only ties with it).
    assert batch_sampling_probs(torch.tensor([[2.0, 2.0, 1.0]]), [1.0], [0], [1.0], [1.0])[0].tolist() == [0.5, 0.5, 0.0]


def test_min_tokens_yields_when_only_stop_tokens_are_allowed():
    """A complete grammar leaves EOS alone (every other logit -inf): min_tokens masking EOS too
    left no token, and token 0 was sampled, which the grammar refused (an HTTP 500). Such a row
    keeps its logits: greedy takes EOS, and a seeded row draws as it would without min_tokens."""
    grammar_done = torch.tensor([[-INF, -INF, 0.5, -INF], [-INF, 1.0, 0.5, -INF]])
    params = [SamplingParams(temperature=0, min_tokens=3)] * 2
    assert sample_batch(grammar_done, metadata(params, [0, 0], eos=[2], vocab=4)).token_ids == [2, 1]
    assert apply_logits_processors(grammar_done, metadata(params, [0, 0], eos=[2], vocab=4)).tolist() == [
        [-INF, -INF, 0.5, -INF], [-INF, 1.0, -INF, -INF]]
    logits = torch.tensor([[1.0, 2.0]])  # every token is a stop token
    seeded = [SamplingParams(temperature=0.7, min_tokens=1, stop_token_ids=[0], seed=1)]
    unmasked = [SamplingParams(temperature=0.7, stop_token_ids=[0], seed=1)]
    draws = [sample_batch(logits, metadata(p, [0], eos=[1], vocab=2)).token_ids for p in (seeded, unmasked)]
    assert draws[0] == draws[1]


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_the_raw_log_softmax_with_ranks_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 3.0, 1.0, -INF], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={1: 50.0}), SamplingParams(temperature=0)]
    out = sample_batch(logits, SamplingMetadata(params, [torch.Generator()] * 2, [0, 0]))
    raw = logits[0].log_softmax(-1)
    assert out.token_ids == [1, 0] and out.logprobs[1] is None
    lp = out.logprobs[0]
    # The chosen token (picked because of the bias) has its raw logprob; rank counts ties as worse.
    assert (lp.token_id, lp.logprob, lp.rank) == (1, raw[1].item(), 4)
    assert lp.top_token_ids == (2, 0, 1) or lp.top_token_ids == (2, 0, 3)
    assert lp.top_logprobs == (raw[2].item(), raw[0].item(), raw[1].item())
    [zero] = gather_logprobs(logits[1:].log_softmax(-1), [4], [0])
    assert (zero.logprob, zero.rank, zero.top_token_ids) == (torch.tensor(-math.log(5)).item(), 5, ())  # float32


# ------------------------------------------------------------------ token histories
def test_token_histories_count_only_new_tokens_and_rebuild_when_outputs_shrink():
    histories = TokenHistories()
    outputs = [3, 3]
    h = histories.get("r", [1, 2, 2], outputs, 6)
    assert h.prompt_mask.tolist() == [False, True, True, False, False, False]
    assert h.output_counts.tolist() == [0, 0, 0, 2, 0, 0] and h.num_counted == 2
    outputs.append(5)
    assert histories.get("r", [], outputs, 6).output_counts.tolist() == [0, 0, 0, 2, 0, 1]  # prompt read once
    assert histories.get("r", [1], [4], 6).output_counts.tolist() == [0, 0, 0, 0, 1, 0]
    histories.drop("r")
    assert "r" not in histories


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("presence_penalty", "1"), ("presence_penalty", True), ("frequency_penalty", -3), ("frequency_penalty", INF),
    ("frequency_penalty", 10**400), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", INF), ("repetition_penalty", None), ("min_p", -0.1), ("min_p", 1.5),
    ("min_p", float("nan")), ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0), ("min_tokens", True),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True), ("logit_bias", [1, 2]),
    ("logit_bias", {1: 101}), ("logit_bias", {1: -100.5}), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", {True: 1.0}), ("logit_bias", {1: "x"}),
])
def test_new_fields_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(max_tokens=16, **{field: value})
    assert info.value.field == field and str(info.value).startswith(field)


def test_new_fields_accept_their_ranges():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-9, min_p=1,
                       min_tokens=16, max_tokens=16, logprobs=20, logit_bias={0: -100, 7: 100.0})
    assert p.logit_bias == {0: -100.0, 7: 100.0} and p.has_penalties
    assert not SamplingParams(repetition_penalty=1.0, logprobs=0).has_penalties
