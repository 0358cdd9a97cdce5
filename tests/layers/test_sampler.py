"""The sampler on edge parameters (issue 10, C14): every accepted value is served exactly.

For any temperature > 0, top_p in (0, 1] and top_k that SamplingParams accepts, on rows holding
ties, -inf and +inf, float32 extremes and subnormals, the distribution drawn from is finite, sums to
1, gives tied logits the same probability, lies inside the top-k set, is the nucleus of the
tempered top-k distribution (checked against a plain-Python computation), and the drawn token is in
it. SamplingParams refuses the rest with InvalidInputError naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import InvalidInputError
from prefixcache.layers.sampler import apply_top_k_top_p, sample, sampling_probs
from prefixcache.sampling_params import SamplingParams

INF = float("inf")
F32_MIN_SUBNORMAL = 1.401298464324817e-45  # nextafter(0, 1) in float32
EDGE_TEMPERATURES = [1e-46, 5e-324, math.nextafter(0, 1), F32_MIN_SUBNORMAL, 1e-38, 1e-40, 1 - 2**-24,
                     1.0, 3.4e38, 1e308, 2.0**1023]
EDGE_TOP_PS = [1e-46, 5e-324, F32_MIN_SUBNORMAL, 1e-38, 1 - 2**-24, 1 - 2**-53, 0.5, 1.0, 1]
EDGE_TOP_KS = [-1, 0, 1, 2, 3, 11, 12, 13, 2**63, 10**30]

temperatures = st.one_of(
    st.sampled_from(EDGE_TEMPERATURES),
    st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, width=32, allow_subnormal=True),
    st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_subnormal=True),
)
top_ps = st.one_of(
    st.sampled_from(EDGE_TOP_PS),
    st.floats(min_value=0.0, max_value=1.0, exclude_min=True, width=32, allow_subnormal=True),
)
top_ks = st.one_of(st.sampled_from(EDGE_TOP_KS), st.integers(min_value=1, max_value=12))
# Rows of float32 logits; the small pool makes ties, -inf and the float32 extremes common.
logit_values = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    st.sampled_from([0.0, 1.0, -1.0, 2.5, F32_MIN_SUBNORMAL, -INF, 3.4028234663852886e38, -3.4028234663852886e38]),
)
rows = st.lists(logit_values, min_size=1, max_size=12)
rows_with_inf = st.lists(st.one_of(logit_values, st.just(INF)), min_size=1, max_size=12)


def scaled_row(x: list[float], temperature: float) -> list[float]:
    """(x - max) / T in plain Python floats (IEEE double), the tokens equal to the max at 0."""
    m = max(x)
    return [0.0 if v == m else (v - m) / temperature for v in x]


def top_k_set(x: list[float], top_k: int) -> set[int]:
    """Tokens at least as large as the k-th largest logit (all when k <= 0 or k >= len)."""
    if top_k <= 0 or top_k >= len(x):
        return set(range(len(x)))
    kth = sorted(x, reverse=True)[top_k - 1]
    return {i for i, v in enumerate(x) if v >= kth}


def check_distribution(x: list[float], params: SamplingParams) -> list[float]:
    """Asserts every property of ``sampling_probs`` on one row; returns the probabilities."""
    probs = sampling_probs(torch.tensor(x, dtype=torch.float32), params.temperature, params.top_k, params.top_p)
    assert probs.dtype == torch.float64 and probs.shape == (len(x),)
    p = probs.tolist()
    assert all(math.isfinite(v) and v >= 0 for v in p)
    assert abs(math.fsum(p) - 1) < 1e-12
    support = {i for i, v in enumerate(p) if v > 0}
    m = max(x)
    assert {i for i, v in enumerate(x) if v == m} <= support  # the argmax is never dropped
    for i in range(len(x)):  # equal logits, equal probabilities; a larger logit, no smaller one
        for j in range(len(x)):
            if x[i] == x[j]:
                assert p[i] == p[j]
            elif x[i] > x[j]:
                assert p[i] >= p[j]

    kept_k = top_k_set(x, params.top_k)
    assert support <= kept_k
    # The tempered top-k distribution q, computed here in plain Python.
    s = scaled_row(x, params.temperature)
    e = [math.exp(v) if i in kept_k else 0.0 for i, v in enumerate(s)]
    q = [v / math.fsum(e) for v in e]
    likely = {i for i in kept_k if q[i] > 1e-300}  # clear of exp's rounding at the underflow edge
    if params.top_p >= 1:
        assert likely <= support
    else:  # the nucleus: closed upward in s, mass >= top_p, minimal up to ties with its lowest
        assert all(j in support for i in support for j in likely if s[j] >= s[i])
        assert math.fsum(q[i] for i in support) >= params.top_p - 1e-9
        lowest = min(s[i] for i in support)
        assert math.fsum(q[i] for i in support if s[i] > lowest) < params.top_p + 1e-9
    # Within the support, the probabilities are q renormalized.
    mass = math.fsum(q[i] for i in support)
    for i in support:
        assert math.isclose(p[i], q[i] / mass, rel_tol=1e-9, abs_tol=1e-300)
    return p


@settings(max_examples=300, deadline=None)
@given(x=rows, temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=st.integers(0, 2**32))
def test_every_accepted_temperature_top_p_top_k_gives_a_finite_distribution_and_a_kept_token(
    x, temperature, top_p, top_k, seed
):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    p = check_distribution(x, params)
    logits = torch.tensor([x], dtype=torch.float32)  # [1, vocab_size]
    (token,) = sample(logits, [params], [torch.Generator().manual_seed(seed)])
    assert p[token] > 0


@settings(max_examples=150, deadline=None)
@given(x=rows, temperature=temperatures, top_p=top_ps, top_k=top_ks)
def test_tiny_temperature_samples_the_argmax_and_ties_share_it(x, temperature, top_p, top_k):
    """When every other finite logit is >= 746 temperatures below the max, exp underflows to 0
    for it in float64: only the argmax tokens remain, with equal shares."""
    m = max(x)
    if not all(v == m or (m - v) / temperature >= 746 for v in x):
        temperature = 5e-324  # float32 gaps are >= 1.4e-45, so every gap is >= 2.8e278 of these
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    p = check_distribution(x, params)
    argmax = [i for i, v in enumerate(x) if v == m]
    assert p == [1 / len(argmax) if i in argmax else 0.0 for i in range(len(x))]


@settings(max_examples=150, deadline=None)
@given(x=rows, temperature=temperatures, top_p=top_ps, top_k=top_ks)
def test_tiny_top_p_keeps_only_the_most_likely_tokens(x, temperature, top_p, top_k):
    """top_p below 1 / vocab_size (the most likely token's least probability) keeps only the tokens
    tied with it: those equal to the max, and those whose distance to it / T underflows to 0."""
    if top_p >= 1 / (len(x) + 1):
        top_p = 1e-46  # 0 in float32: the old sampler dropped every token
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    p = check_distribution(x, params)
    top = [i for i, v in enumerate(scaled_row(x, temperature)) if v == 0 and i in top_k_set(x, top_k)]
    assert p == [1 / len(top) if i in top else 0.0 for i in range(len(x))]


@settings(max_examples=100, deadline=None)
@given(x=rows_with_inf, temperature=temperatures, top_p=top_ps, top_k=top_ks)
def test_rows_with_plus_inf_share_the_mass_among_the_inf_tokens(x, temperature, top_p, top_k):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    p = check_distribution(x, params)
    if INF in x:
        n = x.count(INF)
        assert p == [1 / n if v == INF else 0.0 for v in x]


ROW = [1.0, 3.0, 3.0, -INF, 2.0]
SUBNORMAL_ROW = [F32_MIN_SUBNORMAL, 0.0, -1.0]


@pytest.mark.parametrize("row,temperature,top_p,top_k,expected", [
    (ROW, 1e-40, 1.0, 0, [0.0, 0.5, 0.5, 0.0, 0.0]),       # tiny T: the tied argmaxes share the mass
    (ROW, 5e-324, 1.0, 0, [0.0, 0.5, 0.5, 0.0, 0.0]),
    (ROW, 1.0, 1e-46, 0, [0.0, 0.5, 0.5, 0.0, 0.0]),       # tiny top_p: the argmaxes, both of them
    (ROW, 1.0, 5e-324, -1, [0.0, 0.5, 0.5, 0.0, 0.0]),
    (ROW, 1e308, 1.0, 0, [0.25, 0.25, 0.25, 0.0, 0.25]),   # huge T: uniform over the finite logits
    (ROW, 3.4e38, 1.0, 10**30, [0.25, 0.25, 0.25, 0.0, 0.25]),
    (ROW, 1e308, 1.0, 2, [0.0, 0.5, 0.5, 0.0, 0.0]),       # top-k ranks the raw logits
    # exp rounds -2e-308 to 1, but top-p ranks the scaled logits: the argmaxes are still above the rest
    (ROW, 1e308, 1e-46, 0, [0.0, 0.5, 0.5, 0.0, 0.0]),
    # (0 - 1.4e-45) / 1e308 is -0.0: a true tie in the scaled row, so both stay in the nucleus
    (SUBNORMAL_ROW, 1e308, 1e-46, 0, [0.5, 0.5, 0.0]),
    (SUBNORMAL_ROW, F32_MIN_SUBNORMAL, 1.0, 0, [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)), 0.0]),
])
def test_degenerate_rows_resolve_exactly(row, temperature, top_p, top_k, expected):
    probs = sampling_probs(torch.tensor(row), temperature, top_k, top_p).tolist()
    assert probs == pytest.approx(expected, rel=1e-15, abs=0)


def test_top_k_and_top_p_keep_tokens_tied_with_the_last_kept():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, True, False, False]
    # probs [0.53, 0.07, 0.20, 0.20]: 0.6 needs a second token; its tie comes along. 0.5 does not.
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.6)).tolist() == [False, True, False, False]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [False, True, True, True]
    # 1e-46 is 0 in float32 (the old sampler's comparison); the argmax stays.
    assert torch.isinf(apply_top_k_top_p(logits, 0, 1e-46)).tolist() == [False, True, True, True]


def test_greedy_rows_take_the_argmax_of_the_raw_logits_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0, -INF], [1.0, 0.0, 3.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5e-324), SamplingParams(temperature=0)]
    tokens = sample(logits, params, [torch.Generator().manual_seed(0) for _ in params])
    assert tokens[0] == 1 and tokens[1] in (0, 1) and tokens[2] == 2


def test_same_seed_same_token_on_an_edge_temperature():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=3.4e38, seed=3)] * 2
    draws = [sample(logits, params, [torch.Generator().manual_seed(3) for _ in params]) for _ in range(2)]
    assert draws[0] == draws[1]


# ------------------------------------------------------------------ what SamplingParams refuses
@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", INF), ("temperature", -INF), ("temperature", -0.5),
    ("temperature", -F32_MIN_SUBNORMAL), ("temperature", -5e-324), ("temperature", True), ("temperature", "1"),
    ("temperature", None), ("temperature", 10**400), ("temperature", [1.0]),
    ("top_p", 0.0), ("top_p", -0.0), ("top_p", 0), ("top_p", 1 + 2**-52), ("top_p", 1.5), ("top_p", float("nan")),
    ("top_p", INF), ("top_p", -1e-46), ("top_p", True), ("top_p", "0.5"), ("top_p", 10**400),
    ("top_k", -2), ("top_k", -(10**30)), ("top_k", 1.0), ("top_k", True), ("top_k", "5"), ("top_k", None),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", -(10**5000)), ("max_tokens", 1.0), ("max_tokens", True),
    ("max_tokens", None),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0), ("seed", True), ("seed", "1"),
    ("n", 0), ("n", 65), ("n", 1.0), ("n", True),
    ("stop_token_ids", [-1]), ("stop_token_ids", [-(10**5000)]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", ["1"]), ("stop_token_ids", 5), ("stop_token_ids", 0),
    ("stop", 5), ("stop", [""]), ("stop", [None]),
    ("ignore_eos", 1), ("include_stop_str_in_output", None),
], ids=lambda v: f"int_{v.bit_length()}_bits" if isinstance(v, int) and v.bit_length() > 128 else None)
def test_refused_values_raise_invalid_input_error_naming_the_field(field, value):
    with pytest.raises(InvalidInputError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and str(info.value).startswith(field)
    assert len(str(info.value)) < 200  # huge ints are described, not printed


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.floats(allow_subnormal=True), st.floats(width=32, allow_subnormal=True)))
def test_temperature_and_top_p_are_accepted_exactly_on_their_ranges(value):
    for field, accepted in (("temperature", 0 <= value < INF), ("top_p", 0 < value <= 1)):
        if accepted:
            assert getattr(SamplingParams(**{field: value}), field) == value
        else:
            with pytest.raises(InvalidInputError, match=f"^{field}"):
                SamplingParams(**{field: value})


def test_accepted_extremes():
    p = SamplingParams(temperature=2.0**1023, top_p=5e-324, top_k=10**30, max_tokens=10**30, seed=2**64 - 1,
                       stop_token_ids=[0, 10**30])
    assert (p.top_k, p.max_tokens, p.stop_token_ids) == (10**30, 10**30, (0, 10**30))
    assert SamplingParams(seed=-(2**63), n=64).seed == -(2**63)
    assert SamplingParams(temperature=-0.0).greedy
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == ()
