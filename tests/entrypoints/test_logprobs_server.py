"""Logprobs, penalties and filters over HTTP (issue 13): OpenAI's shapes, values equal to the
offline engine's, streaming equal to non-streaming with each chunk's logprobs lined up with its
text (stop-string hold-back included), and 400s naming the field for bad values."""

from __future__ import annotations

import json

import httpx
import pytest

from prefixcache.sampling_params import SamplingParams
from tests.entrypoints.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Describe a small town library in two sentences."}]
PROMPT = "Once upon a time, in a small village by the sea,"


def sse(r: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def post(server, endpoint: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=120)


def test_chat_logprobs_equal_the_engine_and_stream_in_line_with_the_text(server, make_llm):
    body = dict(messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True)
    # its own cache_salt: cold whatever earlier tests on this server cached (the template's default system prompt)
    r = post(server, "chat/completions", cache_salt="plain", **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 16

    llm = make_llm()
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    decoder = llm.engine.output_processor.token_decoder
    for entry, token_id, expected in zip(content, offline.token_ids, offline.logprobs):
        assert entry["token"] == expected[token_id].decoded_token and bytes(entry["bytes"]) == decoder.bytes(token_id)
        assert entry["logprob"] == pytest.approx(expected[token_id].logprob, abs=1e-4)
        top = list(expected.items())[:3]
        assert [t["token"] for t in entry["top_logprobs"]] == [lp.decoded_token for _, lp in top]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp.logprob for _, lp in top], abs=1e-4)
        assert [bytes(t["bytes"]) for t in entry["top_logprobs"]] == [decoder.bytes(t) for t, _ in top]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]

    # Another cache_salt: cold again, so the same computation to the bit (docs/weight-formats-and-kernels.md).
    chunks = sse(post(server, "chat/completions", stream=True, cache_salt="stream", **body))
    streamed, text, sent = [], "", b""
    for c in chunks:
        delta = c["choices"][0]
        text += delta["delta"].get("content") or ""
        streamed += delta["logprobs"]["content"]
        sent = b"".join(bytes(e["bytes"]) for e in streamed)
        assert sent.decode("utf-8", errors="replace") == text  # the tokens sent are exactly the text sent
    assert streamed == content and text == choice["message"]["content"]


def test_completion_logprobs_legacy_shape_and_stop_string_hold_back(server):
    base = dict(prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    plain = post(server, "completions", **base).json()["choices"][0]
    lp = plain["logprobs"]
    n = len(lp["tokens"])
    assert n == 20 and len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert "".join(lp["tokens"]) == plain["text"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2 and max(top.values()) >= value and top.get(token, value) == value  # greedy: rank 1
        assert top[token] == value

    # A stop string: the stream holds back text that may start it, and the tokens with it.
    stop = plain["text"][6:10]
    stopped = post(server, "completions", stop=[stop], cache_salt="plain", **base).json()["choices"][0]
    assert stopped["text"] == plain["text"][: plain["text"].index(stop)]
    chunks = sse(post(server, "completions", stop=[stop], stream=True, cache_salt="stream", **base))
    text = ""
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        choice = c["choices"][0]
        text += choice["text"]
        for key in merged:
            merged[key] += choice["logprobs"][key]
        if choice["finish_reason"] is None:
            assert "".join(merged["tokens"]) == text  # never a token ahead of its text, nor behind
    assert text == stopped["text"] and merged == stopped["logprobs"]
    assert merged["tokens"] == lp["tokens"][: len(merged["tokens"])]  # the tokens that made the stop string


def test_penalties_and_filters_over_http_equal_the_offline_engine(server, make_llm):
    llm = make_llm()
    colours = "The list of colours: red, green, blue, red, green, blue, red, green,"
    first = llm.generate(colours, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].token_ids[0]
    cases = [
        (colours, dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)),
        (colours, dict(temperature=0, logit_bias={str(first): -100, "11": 2.5})),
        (PROMPT, dict(temperature=0.9, seed=5, min_p=0.1, min_tokens=10)),
    ]
    for prompt, fields in cases:
        got = post(server, "completions", prompt=prompt, max_tokens=10, **fields).json()["choices"][0]["text"]
        params = {**fields}
        if "logit_bias" in params:
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        expected = llm.generate(prompt, SamplingParams(max_tokens=10, **params), use_tqdm=False)[0].text
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].text
        assert got == expected and got != plain, fields  # as offline, and not the plain greedy answer
    # max_completion_tokens is chat's name for max_tokens.
    r = post(server, "chat/completions", messages=MESSAGES, max_completion_tokens=3, temperature=0, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("endpoint,fields,param", [
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"max_completion_tokens": 10**9}, "max_completion_tokens"),
])
def test_bad_values_are_400_naming_the_field(server, endpoint, fields, param):
    base = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    r = post(server, endpoint, **{"max_tokens": 4, **base, **fields}) if "max_completion_tokens" not in fields \
        else post(server, endpoint, **{**base, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0
