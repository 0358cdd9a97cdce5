"""Edge sampling parameters on the real model (issue 10, C14 offline).

Degenerate distributions resolve to their argmax, so a tiny temperature or a tiny top_p gives the
greedy tokens; huge top_k and stop token ids are served as they are (a max_tokens beyond the context
is refused, naming the field); and the same LLM
serves ordinary requests afterwards.
"""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidInputError
from prefixcache.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea,"


def test_tiny_top_p_and_tiny_temperature_give_the_greedy_tokens_and_leave_the_llm_usable(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].token_ids
    assert len(greedy) == 8

    # 1e-46 is 0 in float32: the old sampler dropped every token and torch.multinomial raised.
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=2), use_tqdm=False)[0]
    assert out.token_ids == greedy[:2] and out.finish_reason == "length"
    # logits / 1e-40 overflowed to inf, softmax to NaN.
    out = llm.generate(PROMPT, SamplingParams(temperature=1e-40, max_tokens=4), use_tqdm=False)[0]
    assert out.token_ids == greedy[:4] and out.finish_reason == "length"

    edges = [
        SamplingParams(temperature=5e-324, max_tokens=4),
        SamplingParams(temperature=1.4e-45, top_p=5e-324, top_k=10**30, max_tokens=4),
        SamplingParams(temperature=1e308, top_k=1, max_tokens=4),
        SamplingParams(temperature=3.4e38, top_p=1e-46, max_tokens=4, seed=2**64 - 1),
        SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[10**30, 2**63]),
        SamplingParams(temperature=1e-40, n=2, max_tokens=4, seed=-(2**63)),
    ]
    outs = llm.generate([PROMPT] * len(edges), edges, use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy[:4]] * 5 + [greedy[:4], greedy[:4]]
    assert [o.finish_reason for o in outs] == ["length"] * 7

    # The same LLM still serves: greedy as before, and a seeded sample as a fresh LLM gives it.
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].token_ids == greedy
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=8, seed=5, ignore_eos=True)
    after = llm.generate(PROMPT, seeded, use_tqdm=False)[0].token_ids
    assert after == make_llm().generate(PROMPT, seeded, use_tqdm=False)[0].token_ids and len(after) == 8
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_metrics().num_blocks_in_use == 0


def test_max_tokens_beyond_the_context_is_refused(make_llm):
    """prompt + max_tokens must fit max_model_len (OpenAI's and vLLM's server rule); exactly fitting
    is served and stops at max_model_len."""
    probe = make_llm()
    num_prompt_tokens = len(probe.tokenizer.encode(PROMPT))
    greedy = probe.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].token_ids
    llm = make_llm(max_model_len=num_prompt_tokens + 3)
    for max_tokens in (4, 10**30):
        with pytest.raises(InvalidInputError, match="max_tokens") as e:
            llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        assert e.value.field == "max_tokens"
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.token_ids == greedy and out.finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()

def test_max_model_len_beyond_the_models_context_is_refused(make_llm):
    """vLLM refuses a max_model_len over the model's max_position_embeddings (8192 for SmolLM2) rather
    than capping it silently."""
    with pytest.raises(InvalidInputError, match="max_model_len 8193 is more than the model's context of 8192"):
        make_llm(max_model_len=8193)
    assert make_llm(max_model_len=8192).engine.max_model_len == 8192


def test_a_stop_string_never_matches_half_a_character(make_llm):
    """Found by a review (2026-12-02): stop "\\ufffd" ended this request at once with "" — it matched
    the replacement character that decoding shows while an emoji's bytes are only partly
    generated. Stop strings are searched in the text up to such a trailing character."""
    llm = make_llm(num_blocks=32)
    prompt = "Emoji list: 😀😃😄😁"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert plain.finish_reason == "length" and plain.text.endswith("\ufffd") and "\ufffd" not in plain.text[:-1]
    assert len(plain.text) > 1  # whole emoji came before the cut
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=["\ufffd"]), use_tqdm=False)[0]
    assert (stopped.text, stopped.token_ids, stopped.finish_reason) == (plain.text, plain.token_ids, "length")
    first = plain.text[0]  # a whole character still stops the request where it is complete
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[first]), use_tqdm=False)[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("", "stop", first)
