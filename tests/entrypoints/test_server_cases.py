"""Cases over the real server: C11 and C20 (stop strings, streamed and not), and faults inside the
engine that fail only their own requests (a forward pass that raises; a fault elsewhere in a step).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine.test_cases_hardening import C11_PROMPT, EQUALS
from tests.entrypoints.conftest import MODEL, start_server, stop_server


def complete(server, stream: bool, **fields) -> tuple[int, str, str | None, str | int | None]:
    """(status, text, finish_reason, stop_reason) of a completion, streamed deltas joined (an error
    event in the stream reads as finish_reason "error")."""
    body = {"model": MODEL, "temperature": 0, **fields, "stream": stream}
    if not stream:
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        return r.status_code, choice.get("text"), choice.get("finish_reason"), choice.get("stop_reason")
    text, finish, stop = "", None, None
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if "error" in data:
                    finish = "error"
                    continue
                choice = data["choices"][0]
                text += choice["text"]
                finish, stop = choice["finish_reason"] or finish, choice.get("stop_reason", stop)
        return r.status_code, text, finish, stop


@pytest.mark.parametrize("stream", [False, True])
def test_c11_stop_string_inside_one_long_token_on_the_server(server, stream):
    status, unstopped, _, _ = complete(server, stream, prompt=C11_PROMPT, max_tokens=24)
    assert status == 200 and unstopped.startswith(EQUALS)
    for keep, text in ((False, ""), (True, "===")):
        got = complete(server, stream, prompt=C11_PROMPT, max_tokens=24, stop=["==="],
                       include_stop_str_in_output=keep)
        assert got == (200, text, "stop", "===")


@pytest.mark.parametrize("stream", [False, True])
def test_c20_stop_string_at_the_very_start_on_the_server(server, stream):
    prompt = "The three primary colors are"
    status, unstopped, _, _ = complete(server, stream, prompt=prompt, max_tokens=12, ignore_eos=True)
    head = unstopped[:3]
    assert status == 200 and len(head) == 3
    for keep, text in ((False, ""), (True, head)):
        got = complete(server, stream, prompt=prompt, max_tokens=12, stop=[head], include_stop_str_in_output=keep)
        assert got == (200, text, "stop", head)


@pytest.fixture
def own_server(smollm2):
    s = start_server(smollm2, num_blocks=64)
    yield s
    stop_server(s)


def test_a_forward_pass_that_raises_fails_only_its_requests(own_server, monkeypatch):
    """The step's requests get a 500 (non-streamed) / an error event (streamed); the blocks cached in
    that step are dropped, the engine serves the next request, /health stays 200."""
    runner = own_server.engine.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def fail_once(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", fail_once)
    prompt = "A prompt long enough to fill a couple of KV blocks of sixteen tokens each, or more."
    r = httpx.post(own_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert "device lost" in r.json()["error"]["message"]
    assert httpx.get(own_server.base_url + "/health").status_code == 200
    m = own_server.wait_idle()
    assert m["prefixcache:kv_blocks_in_use"] == 0 and m["prefixcache:kv_blocks_cached"] == 0
    status, text, finish, _ = complete(own_server, True, prompt=prompt, max_tokens=4)
    assert status == 200 and finish == "length" and text
    again = httpx.post(own_server.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
    assert again["choices"][0]["text"] == text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the good run's blocks hit


def test_a_fault_outside_the_forward_pass_resets_the_engine_and_it_goes_on(own_server, monkeypatch):
    scheduler = own_server.engine.engine.scheduler
    real = scheduler.schedule
    calls = {"n": 0}

    def fail_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("scheduler bug")
        return real()

    monkeypatch.setattr(scheduler, "schedule", fail_once)
    status, text, finish, _ = complete(own_server, True, prompt="Hello there", max_tokens=4)
    assert status == 200 and finish == "error"
    assert httpx.get(own_server.base_url + "/health").status_code == 200
    assert own_server.engine.num_recoveries == 1
    assert own_server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0
    r = httpx.post(own_server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_malformed_http_gets_a_json_400(server, raw):
    import socket

    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_http"


def test_http_layer_answers_are_json_and_documented(server):
    latin1 = httpx.post(server.base_url + "/v1/completions", content='{"prompt": "caf\xe9"}'.encode("latin-1"),
                        headers={"content-type": "application/json"})
    assert latin1.status_code == 400 and latin1.json()["error"]["code"] == "invalid_json"
    broken = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi",, "max_tokens": 2}',
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["message"] == (
        "malformed JSON body at character 16: Expecting property name enclosed in double quotes")
    form = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                      headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert form.status_code == 400 and form.json()["error"]["message"] == (
        "body: send a JSON object with content-type: application/json (this request had content-type "
        "'application/x-www-form-urlencoded')")
    for body, message in ((b'"x"', "body: must be a JSON object, got a JSON string"),  # not "send ... (it had json)"
                          (b'[1]', "body: Input should be a valid dictionary or object to extract fields from")):
        r = httpx.post(server.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.json()
    slash = httpx.post(server.base_url + "/v1/completions/", json={"model": MODEL, "prompt": "hi"})
    assert slash.status_code == 404 and "error" in slash.json()  # no redirect
    head = httpx.get(server.base_url + "/v1/completions")
    assert head.status_code == 405 and "error" in head.json()
    documented = httpx.get(server.base_url + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "405", "408", "413", "500", "503"} <= set(documented)


@pytest.mark.parametrize("field,value", [("stop", ""), ("stop_token_ids", list(range(1025))),
                                         ("return_tokens_as_token_ids", True)])
def test_more_fields_refused_naming_them(server, field, value):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
