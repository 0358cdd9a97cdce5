"""The structured-output masks: the bitmask unpacking, the constraint's validation, and the exact
set of tokens a grammar allows (against an independent computation on SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.runner.structured_output import StructuredOutputManager, apply_token_bitmask
from prefixcache.sampling_params import SamplingParams, StructuredOutputsParams


def test_apply_token_bitmask_masks_exactly_the_zero_bits_of_the_given_rows():
    gen = torch.Generator().manual_seed(0)
    vocab_size = 70  # not a multiple of 32: the last word's high bits are padding
    logits = torch.randn(4, vocab_size, generator=gen)
    before = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31, (2, 3), dtype=torch.int32, generator=gen)
    apply_token_bitmask(logits, bitmask, [1, 3])
    for k, row in enumerate([1, 3]):
        for t in range(vocab_size):
            bit = (int(bitmask[k, t // 32]) & 0xFFFF_FFFF) >> (t % 32) & 1  # the word as unsigned
            assert logits[row, t].item() == (before[row, t].item() if bit else float("-inf")), (row, t)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # rows without a mask are untouched


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of json, regex, choice or json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json": "{not json"}, "json schema is not valid JSON"),
    ({"json": [1]}, "json schema must be a JSON object"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list of non-empty strings"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of non-empty strings"),
    ({"json_object": 1}, "json_object must be a bool"),
    ({"regex": "\ud800"}, "lone surrogate"),
])
def test_invalid_constraints_name_the_field(kwargs, message):
    with pytest.raises(InvalidInputError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(structured_outputs={"json_object": True})
    assert e.value.field == "structured_outputs"


def test_schema_text_keeps_key_order_and_equal_schemas_are_equal_constraints():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b)
    assert a.json == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert StructuredOutputsParams(choice="yes").choice == ("yes",)


@pytest.fixture(scope="module")
def manager(smollm2):
    return StructuredOutputManager(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.eos_token_ids)


def allowed(manager, request_id: str, params: SamplingParams) -> set[int]:
    logits = torch.zeros(1, manager.vocab_size)
    manager.mask_logits(logits, [request_id], [params])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_first_step_allows_exactly_the_tokens_that_start_a_choice(manager, smollm2):
    tok = smollm2.tokenizer
    choices = ["positive", "negative", "neutral", "not sure"]
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=choices))
    # Independently: every token whose text is a non-empty prefix of a choice (a byte-level BPE
    # token that is part of a UTF-8 character decodes to U+FFFD and is a prefix of none).
    texts = [tok.decode([t]) for t in range(manager.vocab_size)]
    expected = {t for t, s in enumerate(texts) if s and any(c.startswith(s) for c in choices)}
    got = allowed(manager, "r1", params)
    assert got == expected and len(got) > 4  # "p", "pos", "n", "ne", "neg", "not", ...
    assert not set(smollm2.eos_token_ids) & got  # the empty text is no choice
    # "positive" tokenized and accepted: the text is complete, EOS is the only continuation.
    ids = tok.encode("positive", add_special_tokens=False)
    assert manager.accept_tokens(["r1"], [params], [ids[0]]) == {}
    for t in ids[1:]:
        assert t in allowed(manager, "r1", params)
        assert manager.accept_tokens(["r1"], [params], [t]) == {}
    assert allowed(manager, "r1", params) == set(smollm2.eos_token_ids)
    assert manager.num_matchers == 1
    manager.free(["r1", "unknown"])
    assert manager.num_matchers == 0


def test_each_request_has_its_own_matcher(manager, smollm2):
    tok = smollm2.tokenizer
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"], "additionalProperties": False})
    params = SamplingParams(temperature=0, structured_outputs=spec)
    start = allowed(manager, "a", params)
    # The grammar forces the text '{"n": ' here: llguidance allows only the first token of its
    # own tokenization ('{"'), not every token spelling a prefix of it ('{' too).
    spelled = {t for t in range(manager.vocab_size) if tok.decode([t]) and '{"n": '.startswith(tok.decode([t]))}
    assert start == {tok.encode('{"n": ', add_special_tokens=False)[0]} and start < spelled
    for t in tok.encode('{"n": 7', add_special_tokens=False):
        manager.accept_tokens(["a"], [params], [t])
    assert allowed(manager, "b", params) == start  # a new request starts from the grammar's start
    digits_or_close = allowed(manager, "a", params)
    assert {tok.decode([t]) for t in digits_or_close} >= {"}", "0", "9"} and not set(smollm2.eos_token_ids) & digits_or_close
    manager.free(["a", "b"])


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputsParams(regex="(("), "unclosed group"),
    (StructuredOutputsParams(json={"type": "objectx"}), "Invalid type: objectx"),
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "does not exist"),
    (StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_the_field(manager, spec, message):
    with pytest.raises(InvalidInputError, match=message) as e:
        manager.compile(spec)
    assert e.value.field == "structured_outputs" and str(e.value).startswith("the constraint does not compile")


def test_compiled_constraints_are_cached_and_bounded(smollm2):
    small = StructuredOutputManager(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.eos_token_ids,
                                    max_cached_grammars=2)
    specs = [StructuredOutputsParams(choice=[f"c{i}"]) for i in range(3)]
    for spec in specs:
        small.compile(spec)
    assert list(small._templates) == specs[1:]
    small.compile(specs[1])  # a hit moves it to the end
    assert list(small._templates) == [specs[2], specs[1]]


def test_a_refused_token_or_a_failed_mask_is_reported_for_its_request_only(manager, smollm2):
    """A token the grammar refuses (a sampler bug, or a row with no finite allowed logit) and a
    grammar that fails while building its mask are reported per request id, not raised: the engine
    fails that request alone (tests/engine/test_structured_output_engine.py)."""
    tok = smollm2.tokenizer
    choice = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=0)
    allowed(manager, "c", choice)
    wrong = tok.encode(" maybe", add_special_tokens=False)[0]
    failed = manager.accept_tokens(["c", "u"], [choice, free], [wrong, wrong])
    assert list(failed) == ["c"] and f"token {wrong} of request 'c' is outside its grammar" in failed["c"]
    explodes = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(
        regex="(x|y)((a{100}){100}){100}"))  # admitted: two tokens allowed first
    logits = torch.zeros(2, manager.vocab_size)
    _, failed = manager.mask_logits(logits, ["e", "u"], [explodes, free])
    assert failed == {}
    token = tok.encode("x", add_special_tokens=False)[0]
    for _ in range(4):  # llguidance reports the lexer's limit at a token or at the mask after it
        failed = manager.accept_tokens(["e", "u"], [explodes, free], [token, token])
        if failed:
            break
        logits = torch.zeros(2, manager.vocab_size)
        _, failed = manager.mask_logits(logits, ["e", "u"], [explodes, free])
        if failed:
            assert bool((logits[0] == 0).all())  # the failed row is left unmasked (its sample is dropped)
            break
        token = int(torch.nonzero(logits[0] == 0)[0])
    assert list(failed) == ["e"] and "too many expressions" in failed["e"]
    manager.free(["c", "e"])
    assert manager.num_matchers == 0
