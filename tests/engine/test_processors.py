"""The input and output processors on their own (the real tokenizer; no forward pass)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.config import EngineConfig
from prefixcache.engine.input_processor import InputProcessor, ProcessedPrompt, kv_blocks_needed, max_tokens_that_fit
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.entrypoints.openai.serving_outputs import stop_prefix_hold
from prefixcache.errors import InvalidInputError
from prefixcache.request import Request, RequestStatus
from prefixcache.sampling_params import SamplingParams

EQUALS64 = "=" * 64


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 17), num_blocks=st.integers(1, 40), max_model_len=st.integers(1, 300),
       num_prompt_tokens=st.integers(0, 300), n=st.integers(1, 5))
def test_max_tokens_that_fit_is_the_largest_that_the_block_rule_admits(block_size, num_blocks, max_model_len,
                                                                        num_prompt_tokens, n):
    """Chat's default max_tokens is the inverse of the admission rule, checked against it by brute force:
    the largest count within the context whose blocks (kv_blocks_needed) fit the pool."""
    fits = [m for m in range(0, max_model_len - num_prompt_tokens + 1)
            if kv_blocks_needed(block_size, num_prompt_tokens, m, n) <= num_blocks]
    best = max_tokens_that_fit(block_size, num_blocks, max_model_len, num_prompt_tokens, n)
    assert best == max(fits) if fits else best <= 0


@pytest.fixture(scope="module")
def inputs(smollm2) -> InputProcessor:
    return InputProcessor(EngineConfig(block_size=16), smollm2, max_model_len=256, num_blocks=32)


@pytest.fixture(scope="module")
def outputs(smollm2) -> OutputProcessor:
    return OutputProcessor(smollm2.tokenizer, smollm2.eos_token_ids, max_model_len=256)


def field_of(fn) -> str:
    with pytest.raises(InvalidInputError) as e:
        fn()
    return e.value.field


def test_input_errors_name_their_field(inputs):
    assert field_of(lambda: inputs.tokenize("")) == "prompt"
    assert field_of(lambda: inputs.tokenize([1, 49152])) == "prompt"
    assert field_of(lambda: inputs.tokenize("ok \ud800")) == "prompt"
    assert field_of(lambda: inputs.tokenize(ProcessedPrompt("x", [1, -1]))) == "prompt"  # ids checked again
    assert field_of(lambda: inputs.apply_chat_template([{"role": "user", "content": "\udfff"}])) == "messages"
    assert field_of(lambda: inputs.check_request(SamplingParams(stop=["a\ud800"]), None, None)) == "stop"
    assert field_of(lambda: inputs.check_request(None, "s\ud800", None)) == "cache_salt"
    assert field_of(lambda: inputs.check_request(None, None, "t\ud800")) == "tenant"
    assert field_of(lambda: inputs.check_fits(256, SamplingParams(max_tokens=1))) == "prompt"
    assert field_of(lambda: inputs.check_fits(200, SamplingParams(max_tokens=57))) == "max_tokens"
    inputs.check_fits(200, SamplingParams(max_tokens=56))  # exactly fits the context
    assert field_of(lambda: inputs.check_fits(200, SamplingParams(max_tokens=56, n=8))) == "max_tokens"  # the pool


def message_of(fn) -> str:
    with pytest.raises(InvalidInputError) as e:
        fn()
    return e.value.message


def test_fit_errors_count_in_the_right_number(inputs):
    """"the prompt's 1 token", never "1 tokens" (max_model_len 256, 32 blocks of 16)."""
    assert message_of(lambda: inputs.check_fits(1, SamplingParams(max_tokens=256))) == (
        "max_tokens 256 plus the prompt's 1 token exceed max_model_len 256; lower max_tokens to at most 255")
    assert message_of(lambda: inputs.check_fits(2, SamplingParams(max_tokens=255))) == (
        "max_tokens 255 plus the prompt's 2 tokens exceed max_model_len 256; lower max_tokens to at most 254")
    assert message_of(lambda: inputs.check_fits(1, SamplingParams(max_tokens=16, n=33))).startswith(
        "prompt + max_tokens (17 tokens x n=33 samples) needs 66 KV blocks but the pool has 32 blocks;")


def test_a_prompt_the_pool_cannot_hold_is_the_prompts_fault_and_held_blocks_are_named(inputs, monkeypatch):
    """No max_tokens or n would fit a prompt whose own blocks exceed the pool: the prompt is named, and the hint
    gives the flags. With sliding-window layers the pool a request counts on is said to be the rest."""
    monkeypatch.setattr(inputs, "num_blocks", 8)  # 128 tokens, under the 256-token context
    with pytest.raises(InvalidInputError) as e:
        inputs.check_fits(200, SamplingParams(max_tokens=4))
    assert e.value.field == "prompt" and e.value.message == (
        "the prompt (200 tokens) plus 1 token needs 13 KV blocks but the pool has 8 blocks; shorten the prompt or "
        "raise --num-blocks or --kv-cache-memory (num_blocks / kv_cache_memory_bytes offline)")
    monkeypatch.setattr(inputs, "held_blocks", 170)
    assert message_of(lambda: inputs.check_fits(100, SamplingParams(max_tokens=50))) == (
        "prompt + max_tokens (150 tokens) needs 10 KV blocks but the pool has 8 blocks for it (178, less 170 that the "
        "sliding-window layers hold); lower max_tokens or raise --num-blocks or --kv-cache-memory (num_blocks / "
        "kv_cache_memory_bytes offline)")


def test_text_too_long_for_any_tokenization_is_refused_without_tokenizing(inputs):
    longest = inputs.max_prompt_chars // (256 * 4)
    assert longest >= 16  # the longest token's text, in characters
    start = time.perf_counter()
    assert field_of(lambda: inputs.tokenize("a" * (inputs.max_prompt_chars + 1))) == "prompt"
    assert time.perf_counter() - start < 0.5  # no tokenization of the megabytes
    assert field_of(lambda: inputs.apply_chat_template(
        [{"role": "user", "content": "b" * inputs.max_prompt_chars}])) == "messages"


def test_root_key_follows_the_shared_models_fingerprint(inputs, smollm2):
    key = inputs.root_key("salt")
    original = smollm2.fingerprint
    try:
        smollm2.fingerprint = b"other weights"
        assert inputs.root_key("salt") != key
    finally:
        smollm2.fingerprint = original
    assert inputs.root_key("salt") == key


def request_with_output(inputs, text_ids: list[int], params: SamplingParams) -> Request:
    request = inputs.make_request("r", ProcessedPrompt(None, [1, 2, 3]), params)
    for t in text_ids:
        request.append_output_token_ids(t)
    return request


def test_stop_string_found_anywhere_in_the_steps_new_text(inputs, outputs, smollm2):
    (eq64,) = smollm2.tokenizer.encode(EQUALS64, add_special_tokens=False)
    word = smollm2.tokenizer.encode(" word", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=10, stop=["==="], ignore_eos=True)
    request = request_with_output(inputs, word, params)
    assert outputs.check_stop(request) is None
    request.append_output_token_ids(eq64)  # one token of 64 '=': the match starts inside it
    assert outputs.check_stop(request) == RequestStatus.FINISHED_STOPPED
    assert (request.stop_reason, request.stop_text_end) == ("===", len(" word"))


def test_stop_string_spanning_two_steps_and_the_earliest_wins(inputs, outputs, smollm2):
    ids = smollm2.tokenizer.encode(" alpha beta gamma", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=10, stop=["gamma", "ha be"], ignore_eos=True)
    request = request_with_output(inputs, [], params)
    for num_tokens, t in enumerate(ids, start=1):
        request.append_output_token_ids(t)
        if outputs.check_stop(request) is not None:
            break
    assert request.stop_reason == "ha be" and request.stop_text_end == len(" alp")
    text = smollm2.tokenizer.decode(ids[:num_tokens])
    assert "ha be" in text and "ha be" not in smollm2.tokenizer.decode(ids[: num_tokens - 1])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab=", max_size=14),
       stops=st.lists(st.text(alphabet="ab=", min_size=1, max_size=6), min_size=1, max_size=3))
def test_stream_hold_back_is_the_longest_tail_that_may_grow_into_a_stop(text, stops):
    expected = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), expected, -1):
            if text.endswith(stop[:k]):
                expected = k
                break
    assert stop_prefix_hold(text, tuple(stops)) == expected


def test_long_texts_are_counted_in_pieces_and_refused_fast(inputs):
    """Beyond max_model_len * 8 characters a text is counted in pieces first: one that is clearly
    too long is refused in milliseconds; one that fits (64 '=' per token) is still served."""
    start = time.perf_counter()
    assert field_of(lambda: inputs.tokenize("\U0001F600" * 100_000)) == "prompt"
    assert field_of(lambda: inputs.apply_chat_template([{"role": "user", "content": "x"}] * 300)) == "messages"
    assert time.perf_counter() - start < 2.0
    fits = EQUALS64 * 200  # 12,800 characters, 200 tokens: screened, and it fits
    assert len(fits) > 256 * 8 and len(inputs.tokenize(fits).token_ids) == 200


def test_token_ids_of_any_integer_type(inputs):
    import numpy as np

    assert inputs.tokenize(np.array([5, 6, 7], dtype=np.int64).tolist()).token_ids == [5, 6, 7]
    ids = inputs.tokenize([np.int64(5), np.int32(6)]).token_ids
    assert ids == [5, 6] and all(type(t) is int for t in ids)
    assert field_of(lambda: inputs.tokenize([True, 2])) == "prompt"
