"""Structured output on SmolLM2 through the offline API: every output parses and validates, greedy
and seeded; cache on == off; each sample of n > 1 and each preempted request keeps its own
grammar state; bad constraints are refused at admission."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from prefixcache.errors import InvalidInputError
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with their name, age and city."}]
ASK_SENTIMENT = [{"role": "user", "content": "Is this review positive or negative? 'The food was cold.'"}]
ASK_PHONE = [{"role": "user", "content": "Make up a phone number."}]
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


def chat(llm, conversation, **params):
    return llm.chat([conversation], SamplingParams(**params))[0]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_json_schema_outputs_parse_and_validate(llm, sampling):
    validator = jsonschema_rs.validator_for(PERSON)
    outs = llm.chat([ASK_PERSON] * 3, [SamplingParams(max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=PERSON), **{**sampling, "seed": sampling.get("seed", 0) + i}) for i in range(3)])
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.loaded.eos_token_ids
        value = json.loads(out.text)
        validator.validate(value)
        assert list(value) == ["name", "age", "city"]  # the schema's order
        assert out.text == json.dumps(value, ensure_ascii=False)  # the fixed layout
    assert llm.engine.runner.structured_output.num_matchers <= 3  # dropped at the next step


def test_json_object_choice_and_regex(llm):
    out = chat(llm, ASK_PERSON, temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json_object=True))
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    choices = ["positive", "negative"]
    for seed in range(3):
        out = chat(llm, ASK_SENTIMENT, temperature=1.0, seed=seed, max_tokens=10,
                   structured_outputs=StructuredOutputsParams(choice=choices))
        assert out.text in choices and out.finish_reason == "stop"
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
        out = chat(llm, ASK_PHONE, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=PHONE), **sampling)
        assert re.fullmatch(PHONE, out.text) and out.finish_reason == "stop", out.text


def test_cache_on_equals_cache_off(make_llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PERSON))
    on = make_llm(enable_prefix_caching=True)
    first = on.chat([ASK_PERSON], params)[0]
    again = on.chat([ASK_PERSON], params)[0]
    off = make_llm(enable_prefix_caching=False).chat([ASK_PERSON], params)[0]
    assert again.num_cached_tokens > 0  # the grammar is no part of the cache key
    assert first.token_ids == again.token_ids == off.token_ids


def test_samples_and_preempted_requests_keep_their_own_grammar_state(make_llm):
    # 24 digits (one token each), then EOS: a matcher that lost or repeated a token would end
    # the text early or late. 10 blocks: the n=4 request peaks at 1 shared + 4 x 2 blocks, the
    # other needs 3, so someone is preempted and recomputed (test_parallel_sampling's setup).
    spec = StructuredOutputsParams(regex="[0-9]{24}")
    alone = make_llm(enable_prefix_caching=False)
    tok = alone.engine.tokenizer
    prompt = tok.encode("The three most useful things to pack for a long train journey across Europe in winter are")[:21]
    other = tok.encode("Write a short note to a neighbour about a parcel that was delivered to you.")[:20]
    params = SamplingParams(temperature=0.9, seed=11, n=4, max_tokens=26, structured_outputs=spec)
    other_params = SamplingParams(temperature=0.9, seed=99, max_tokens=26, ignore_eos=True)
    expected = [alone.generate(prompt, SamplingParams(temperature=0.9, seed=11 + i, max_tokens=26,
                                                      structured_outputs=spec), use_tqdm=False)[0].token_ids
                for i in range(4)]
    small = make_llm(num_blocks=10, enable_partial_block_reuse=False)
    outs = small.generate([prompt, other], [params, other_params], use_tqdm=False)
    assert small.get_metrics().num_preemptions > 0
    assert [o.token_ids for o in outs[:4]] == expected
    assert len({tuple(e) for e in expected}) == 4  # four different samples, each through its own matcher
    for o in outs[:4]:
        assert re.fullmatch("[0-9]{24}", o.text) and o.finish_reason == "stop" and len(o.token_ids) == 25
    assert outs[4].token_ids == alone.generate(other, other_params, use_tqdm=False)[0].token_ids
    small.engine.step()  # delivers the finished ids to the runner
    assert small.engine.runner.structured_output.num_matchers == 0


def test_bad_constraint_is_refused_at_admission_and_queues_nothing(llm):
    engine = llm.engine
    for spec in (StructuredOutputsParams(regex="[a-"), StructuredOutputsParams(json={"type": "nope"})):
        with pytest.raises(InvalidInputError, match="the constraint does not compile") as e:
            engine.add_request("Hello", SamplingParams(max_tokens=4, structured_outputs=spec))
        assert e.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests()


def test_abort_drops_the_matcher(llm):
    engine = llm.engine
    engine.add_request("Count:", SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(
        regex="[0-9 ]+")), request_id="ab")
    engine.step()
    engine.step()
    assert engine.runner.structured_output.num_matchers == 1
    engine.abort_request("ab")
    engine.step()
    assert engine.runner.structured_output.num_matchers == 0


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutputsParams(regex="a{1000000}"), "lexer error: too many expressions"),  # fails at its first token
    (StructuredOutputsParams(regex="((a{100}){100}){100}"), "lexer error: too many expressions"),
    (StructuredOutputsParams(regex="x((a{100}){100}){100}"), "lexer error: too many expressions"),  # 'x' forced first
    (StructuredOutputsParams(regex="[^\\s\\S]"), "it matches no text"),
    (StructuredOutputsParams(json={"$ref": "#"}), "it matches no text"),
], ids=["huge-repeat", "nested-repeats", "after-a-forced-token", "empty-class", "self-reference"])
def test_constraint_failing_at_its_first_tokens_is_refused_at_admission(llm, spec, reason):
    """Found by a review (2026-12-02): llguidance compiles these, then fails (or allows nothing) at
    the first mask or the first forced token; they used to fail the engine step with every request
    in it, or end with "" and finish_reason "stop"."""
    engine = llm.engine
    with pytest.raises(InvalidInputError, match=f"the constraint does not compile: {reason}") as e:
        engine.add_request("Hi", SamplingParams(max_tokens=5, structured_outputs=spec))
    assert e.value.field == "structured_outputs"
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidInputError):  # refused again: the failure is not cached as a grammar
        engine.add_request("Hi", SamplingParams(max_tokens=5, structured_outputs=spec))


def test_grammar_failing_mid_generation_fails_only_its_own_request(llm):
    """(x|y) then a regex whose lexer explodes: admitted (two tokens allowed first, nothing forced),
    fails once its first token is in. That request ends with "error" and a message naming the
    grammar; the greedy request in the same steps gets exactly its tokens alone; nothing leaks."""
    engine = llm.engine
    pool = engine.kv_cache_manager.block_pool
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].token_ids
    free_before = pool.get_num_free_blocks()
    bad = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(
        regex="(x|y)((a{100}){100}){100}"))
    engine.add_request("The capital of France is", greedy, request_id="good")
    engine.add_request("Say x or y:", bad, request_id="bad")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error"
    assert "structured output" in finished["bad"].error and "too many expressions" in finished["bad"].error
    assert finished["bad"].text in ("", "x", "y")  # what its grammar allowed before it failed, nothing after
    assert finished["good"].finish_reason == "length" and finished["good"].token_ids == alone
    assert engine.runner.structured_output.num_matchers == 0
    assert pool.get_num_free_blocks() == free_before  # every block of both requests back in the pool


def test_min_tokens_beyond_a_complete_grammar_ends_at_the_grammar(llm):
    """min_tokens masked EOS where a complete grammar allows nothing else: the request failed with
    "token 0 ... is outside its grammar" (HTTP 500). The grammar wins: "yes"/"no" then EOS, "stop";
    and a grammar that still has room honours min_tokens as before."""
    plain = chat(llm, ASK_SENTIMENT, temperature=0, max_tokens=10,
                 structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
    for min_tokens in (3, 10):
        out = chat(llm, ASK_SENTIMENT, temperature=0, max_tokens=10, min_tokens=min_tokens,
                   structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
        assert out.error is None and out.finish_reason == "stop" and out.stop_reason is None
        assert (out.text, out.token_ids) == (plain.text, plain.token_ids) and out.text in ("positive", "negative")
        assert out.token_ids[-1] in llm.engine.loaded.eos_token_ids
    free = chat(llm, ASK_PHONE, temperature=0, max_tokens=30, min_tokens=20,
                structured_outputs=StructuredOutputsParams(regex=r"[0-9 ()-]{5,40}"))
    assert free.error is None and len(free.token_ids) >= 20 and re.fullmatch(r"[0-9 ()-]{5,40}", free.text)
    assert not llm.engine.has_unfinished_requests()
