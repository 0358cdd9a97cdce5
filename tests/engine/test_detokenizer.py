"""Incremental detokenization equals decoding the whole output (prefixcache/engine/detokenizer.py).

Streaming deltas and stop strings read the output text after every token; it is grown by each new
token's bytes, and must equal ``tokenizer.decode(ids, skip_special_tokens=True)`` exactly at every
length, partial UTF-8 characters, special tokens and ids past the vocabulary included.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from prefixcache.engine.detokenizer import IncrementalDetokenizer, TokenDecoder, byte_concat_decoder
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from prefixcache.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_every_token_adds_the_bytes_its_own_decode_has(tok):
    """Each id's bytes (empty for the 17 special tokens, which the decode skips) decode to what
    the tokenizer gives for that id alone; 313 tokens are a piece of a multi-byte character."""
    decoder = TokenDecoder(tok)
    text_bytes = byte_concat_decoder(tok, decoder)
    assert text_bytes is not None
    assert [i for i in range(len(tok)) if text_bytes(i) == b""] == list(range(17))
    assert all(text_bytes(i).decode("utf-8", errors="replace") == _decode(tok, [i]) for i in range(len(tok)))
    partial = [i for i in range(len(tok)) if b"\xef\xbf\xbd" not in text_bytes(i)
               and "\ufffd" in text_bytes(i).decode("utf-8", errors="replace")]
    assert len(partial) == 313


def test_the_text_at_every_length_equals_the_whole_decode(tok):
    """2,000 random sequences, half their ids pieces of multi-byte characters, some special tokens
    and ids past the vocabulary (a padded lm_head's rows: decoded as nothing), fed one token at a
    time and in uneven runs: the text after each equals the tokenizer's decode of the ids so far."""
    decoder = TokenDecoder(tok)
    text_bytes = byte_concat_decoder(tok, decoder)
    vocab = len(tok)
    partial = [i for i in range(vocab) if "\ufffd" in _decode(tok, [i])]
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        ids = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            ids.append(rng.choice(partial) if r < 0.5 else rng.randrange(17) if r < 0.6
                       else vocab + rng.randrange(3) if r < 0.62 else rng.randrange(vocab))
        detok = IncrementalDetokenizer(text_bytes)
        n = 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice((1, 1, 1, 2, 5)))
            assert detok.text(ids, n) == _decode(tok, ids[:n]), ids[:n]
            checked += 1
    assert checked > 10_000
    with pytest.raises(ValueError, match="num_ids 0 < the"):
        detok.text(ids, 0)


def test_an_emoji_split_over_tokens_reads_as_one_replacement_until_complete(tok):
    """The decode of an incomplete character ends in U+FFFD (the stop-string search holds it back);
    once its last byte arrives the text is the character."""
    ids = tok.encode(" ok 🦙!", add_special_tokens=False)
    decoder = TokenDecoder(tok)
    detok = IncrementalDetokenizer(byte_concat_decoder(tok, decoder))
    texts = [detok.text(ids, n) for n in range(1, len(ids) + 1)]
    assert texts == [_decode(tok, ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts[-1] == " ok 🦙!"
    assert any(t.endswith("\ufffd") for t in texts[:-1])


def test_a_decode_that_is_not_a_byte_concatenation_is_decoded_whole(tok):
    """Forced clean-up of tokenization spaces changes text across token boundaries (" ." -> "."),
    so the output processor decodes the whole output instead, and gives the tokenizer's text."""
    import copy

    cleaned = copy.deepcopy(tok)
    cleaned.clean_up_tokenization_spaces = True
    cleaned.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    processor = OutputProcessor(cleaned, [], 100)
    assert processor._text_bytes is None
    ids = cleaned.encode("Hello , world . Yes !", add_special_tokens=False)
    request = SimpleNamespace(output_token_ids=ids, detokenizer=None)
    assert processor.output_text(request, len(ids)) == "Hello, world. Yes!" == _decode(cleaned, ids)
    assert request.detokenizer is None

    plain = OutputProcessor(tok, [], 100)
    request = SimpleNamespace(output_token_ids=ids, detokenizer=None)
    assert plain.output_text(request, len(ids)) == "Hello , world . Yes !"
    assert request.detokenizer.num_ids == len(ids)
    assert plain.output_text(request, 2) == _decode(tok, ids[:2])  # asked for less: decoded again


def test_streamed_texts_equal_the_decode_of_their_tokens(make_llm):
    """Streamed: three samples at temperature 1.5 that stop on a stop string (two of their outputs
    end in half a character), and a greedy chat answer that ends on EOS: every output's text is the
    decode of its tokens so far (the hidden EOS left out, cut where the stop string starts)."""
    llm = make_llm()
    engine, tok = llm.engine, llm.tokenizer
    params = SamplingParams(temperature=1.5, seed=8, max_tokens=40, n=3, stop=["ing"], stop_token_ids=[13])
    engine.add_request("Write a poem about llamas with many emoji:", params, request_id="s", stream=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False)
    engine.add_request(chat, SamplingParams(temperature=0, max_tokens=40), request_id="c", stream=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = sorted((o.request_id, o.finish_reason, o.stop_reason) for o in outputs if o.finished)
    assert finished == [("c", "stop", None)] + [("s", "stop", "ing")] * 3
    assert sum(o.text.endswith("\ufffd") for o in outputs) == 2
    for out in outputs:
        hidden = out.finish_reason == "stop" and out.stop_reason is None  # EOS: its text left out
        text = _decode(tok, out.token_ids[:-1] if hidden else out.token_ids)
        if out.stop_reason == "ing":
            assert text[: len(out.text)] == out.text and text[len(out.text):].startswith("ing")
        else:
            assert out.text == text
