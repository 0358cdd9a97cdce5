"""Issue 10: what a hostile or careless client can send, over real sockets to the real server.

Each test checks the exact answer (status, ``error.param``, message prefix, code) and that the
server then serves the next good request with no KV block left in use.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import httpx
import openai
import pytest

from prefixcache.entrypoints.openai.api_errors import MAX_MESSAGE_CHARS, error_body
from tests.entrypoints.conftest import MODEL, start_server, stop_server

LIMIT = 64 * 1024  # body limit of the limited server, bytes
TIMEOUT_S = 1.0  # its request head and body timeouts


@pytest.fixture(scope="module")
def limited(smollm2):
    s = start_server(smollm2, num_blocks=32, app_options={"max_request_body_bytes": LIMIT},
                     http_options={"timeout_request_header_s": TIMEOUT_S, "timeout_request_body_s": TIMEOUT_S})
    yield s
    stop_server(s)


def assert_still_serving(server) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def port_of(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def raw_exchange(server, *parts: bytes, pause_s: float = 0.0, wait_s: float = 10.0) -> tuple[bytes, float]:
    """Sends ``parts`` on a fresh connection (``pause_s`` apart), then reads until the server
    closes it. Returns (everything read, seconds from the last send to the close)."""
    with socket.create_connection(("127.0.0.1", port_of(server))) as sock:
        for i, part in enumerate(parts):
            if i and pause_s:
                time.sleep(pause_s)
            sock.sendall(part)
        sent = time.monotonic()
        sock.settimeout(wait_s)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data, time.monotonic() - sent


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def post_raw(server, endpoint: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"},
                      timeout=60)


# ---------------------------------------------------------------------------- 1. body size
def test_declared_body_over_the_limit_is_refused_before_it_is_sent(limited):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n")
    data, closed_after_s = raw_exchange(limited, head + b'{"prompt": "' + b"x" * 1000)  # 50 MB promised, 1 KB sent
    status, headers, body = parse_response(data)
    assert status == 413 and headers["connection"] == "close" and closed_after_s < 2
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["param"] is None
    assert error["message"] == ("request body is 50000000 bytes; the limit is 65536 bytes "
                                "(--max-request-body-bytes)")
    assert_still_serving(limited)


def test_chunked_body_is_counted_while_read(limited):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"x" * 16384
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 5  # 80 KiB, never terminated: refused at 64 KiB + 1
    data, _ = raw_exchange(limited, head, *chunks)
    status, headers, body = parse_response(data)
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["message"] == (
        "request body is over the limit of 65536 bytes (--max-request-body-bytes)")
    # A chunked body under the limit is served.
    payload = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    parts = [payload[:10], payload[10:]]
    data, _ = raw_exchange(limited, head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in parts),
                           b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert parse_response(data)[0] == 200
    assert_still_serving(limited)


def test_body_at_the_limit_is_served_and_50mb_from_httpx_is_refused(limited):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    body += b" " * (LIMIT - len(body))
    assert post_raw(limited, "completions", body).status_code == 200
    r = post_raw(limited, "completions", body + b" ")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post_raw(limited, "completions", b"x" * 50_000_000)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body is 50000000 bytes")
    assert_still_serving(limited)


def test_default_body_limit_is_16_mib(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (16 * 1024 * 1024 + 1))
    status, _, body = parse_response(raw_exchange(server, head)[0])
    assert status == 413 and json.loads(body)["error"]["message"].startswith(
        f"request body is {16 * 1024 * 1024 + 1} bytes; the limit is {16 * 1024 * 1024} bytes")


# ---------------------------------------------------------------------------- 2. slow clients
@pytest.mark.parametrize("what,parts", [
    ("head", [b""]),  # connects, sends nothing
    ("head", [b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le"]),  # half a head
    ("body", [b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": "]),  # a head, then half a body
], ids=["idle", "half-head", "half-body"])
def test_half_sent_request_is_answered_408_and_closed(limited, what, parts):
    data, closed_after_s = raw_exchange(limited, *parts)
    status, headers, body = parse_response(data)
    assert status == 408 and headers["connection"] == "close"
    assert TIMEOUT_S * 0.9 <= closed_after_s < TIMEOUT_S + 2
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["message"] == f"request {what} not received within 1 s"
    assert_still_serving(limited)


def test_keep_alive_connection_then_half_a_request_is_closed(limited):
    ok = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    data, closed_after_s = raw_exchange(limited, ok, b"GET /health HTTP/1.1\r\nHo", pause_s=0.3)
    assert data.startswith(b"HTTP/1.1 200") and data.count(b"HTTP/1.1 408") == 1
    assert closed_after_s < TIMEOUT_S + 2


def test_slow_but_timely_request_is_served(limited):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    data, _ = raw_exchange(limited, head[:20], head[20:], body[:5], body[5:], pause_s=0.2)  # 0.6 s in all
    assert parse_response(data)[0] == 200


# ---------------------------------------------------------------------------- 3. surrogates, 500s
SURROGATE_CASES = [
    ("completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("completions", '{"prompt": "hi", "stop": ["ok", "\\udfff"], "max_tokens": 2}', "stop"),
    ("completions", '{"prompt": "hi", "cache_salt": "a\\ud800b", "max_tokens": 2}', "cache_salt"),
    ("completions", '{"prompt": "hi", "model": "\\ud800", "max_tokens": 2}', "model"),
    ("completions", '{"prompt": "hi", "user": "\\ud800", "max_tokens": 2}', "user"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
    ("chat/completions", '{"messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 2}', "messages"),
    ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], '
                         '"max_tokens": 2}', "messages"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800", "max_tokens": 2}',
     "stop"),
]


@pytest.mark.parametrize("endpoint,body,field", SURROGATE_CASES)
def test_lone_surrogate_is_a_400_naming_the_field(server, endpoint, body, field):
    r = post_raw(server, endpoint, body.encode())
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (field, "invalid_unicode")
    assert error["message"].startswith(f"{field} contains a lone UTF-16 surrogate")
    assert_still_serving(server)


def app_of(server):
    return server.server.config.app


def test_unexpected_exception_is_a_json_500(limited, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_of(limited).state.serving_completion, "create_completion", boom)
    r = httpx.post(limited.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "internal server error (RuntimeError)", "type": "internal_server_error",
                                  "param": None, "code": "internal_error"}}
    monkeypatch.undo()
    assert_still_serving(limited)


def sse_data(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]


def test_exception_while_streaming_ends_the_stream_with_an_error_event(limited, monkeypatch):
    import prefixcache.entrypoints.openai.serving_outputs as serving_outputs

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(serving_outputs, "stream_text", boom)
    r = httpx.post(limited.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    events = sse_data(r)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert_still_serving(limited)  # the request was aborted, its blocks freed


def fail_final_outputs(monkeypatch, server) -> None:
    """Makes the engine finish every request with finish_reason "error" (as it will when the step
    that ran the request fails), by rewriting the real engine's final outputs."""
    real_generate = server.engine.generate_batch  # what the server calls, for one prompt or several

    async def generate(*args, **kwargs):
        stream = await real_generate(*args, **kwargs)

        async def outputs():
            async for out in stream:
                yield dataclasses.replace(out, finish_reason="error", error="CUDA error (test)") if out.finished else out

        return outputs()

    monkeypatch.setattr(server.engine, "generate_batch", generate)


def test_request_failed_in_the_engine_is_a_500(server, client, monkeypatch):
    fail_final_outputs(monkeypatch, server)
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 500
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("internal_server_error", "engine_error", None)
    assert error["message"] == "the engine step running this request failed: CUDA error (test)"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "stream": True})
    events = sse_data(r)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    assert all("error" not in json.loads(e) for e in events[:-2])  # the text chunks before the failure
    monkeypatch.undo()
    assert_still_serving(server)


# ---------------------------------------------------------------------------- 4. unsupported fields
UNSUPPORTED = [  # implemented fields: test_logprobs_server.py, test_structured_output_server.py, test_request_parity_server.py
    ("completions", "suffix", " end"), ("completions", "best_of", 2),
    ("completions", "guided_grammar", "root ::= \"a\""),
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "required"), ("chat/completions", "functions", [{"name": "f"}]),
    ("chat/completions", "function_call", {"name": "f"}), ("chat/completions", "parallel_tool_calls", False),
    ("chat/completions", "modalities", ["text", "audio"]), ("chat/completions", "echo", True),
]


def body_for(endpoint: str, **fields) -> dict:
    base = {"prompt": "Hello"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hello"}]}
    return {"model": MODEL, "max_tokens": 2, **base, **fields}


@pytest.mark.parametrize("endpoint,field,value", UNSUPPORTED, ids=[f"{e}-{f}" for e, f, _ in UNSUPPORTED])
def test_unsupported_field_is_refused(server, endpoint, field, value):
    r = httpx.post(f"{server.base_url}/v1/{endpoint}", json=body_for(endpoint, **{field: value}))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"{field} is not supported yet", "type": "invalid_request_error",
                                 "param": field, "code": "unsupported_parameter"}
    assert server.wait_idle()["prefixcache:kv_blocks_in_use"] == 0


def test_values_that_change_nothing_pass_and_unknown_fields_are_ignored(server, client):
    common = {"logprobs": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
              "best_of": 1, "user": "u-1", "repetition_penalty": 1.0, "min_tokens": 0, "not_a_field": [1, 2]}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body_for("completions", suffix="", **common))
    assert r.status_code == 200, r.text
    chat = {**common, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "modalities": ["text"]}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body_for("chat", **chat))
    assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:  # a real client gets the field back
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       modalities=["text", "audio"])
    assert e.value.param == "modalities" and e.value.code == "unsupported_parameter"
    assert_still_serving(server)


# ---------------------------------------------------------------------------- 5. OpenAPI
def test_openapi_documents_400_with_the_error_schema_and_no_422(server):
    schema = httpx.get(server.base_url + "/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for status, response in responses.items():
                if int(status) >= 400:  # the Messages routes answer their own errors in Anthropic's shape
                    anthropic = path.startswith("/v1/messages") and status in ("400", "404", "500", "503")
                    shape = "AnthropicErrorResponse" if anthropic else "ErrorResponse"
                    assert response["content"] == {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{shape}"}}}, (method, path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"400", "404", "413", "500"} <= set(schema["paths"][path]["post"]["responses"])
    # ... and the server does answer 400 for what FastAPI would call a 422.
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------------------- 6. echoes
def test_echoed_request_values_are_bounded(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "m" * 100_000, "prompt": "hi"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert message.startswith("model '" + "m" * 99 + "... does not exist") and len(message) < 200
    assert len(error_body(400, "x" * 10_000)["error"]["message"]) == MAX_MESSAGE_CHARS + 3  # any message


# ---------------------------------------------------------------------------- 9. numbers
BIG = "1" + "0" * 30  # 10**30: fits no 64-bit integer
NUMBER_CASES = [
    ("completions", '"temperature": 1e400', "temperature", "temperature: Input should be a finite number"),
    ("completions", '"temperature": NaN', "temperature", "temperature: Input should be a finite number"),
    ("completions", '"top_p": 1e400', "top_p", "top_p: Input should be a finite number"),
    ("completions", '"top_p": -0.0', "top_p", "top_p must be in (0, 1], got -0.0"),
    ("completions", '"max_tokens": -0.0', "max_tokens", "max_tokens: Input should be a valid integer"),
    ("completions", '"max_tokens": 1e30', "max_tokens", "max_tokens: Input should be a valid integer"),
    ("completions", f'"max_tokens": {BIG}', "max_tokens", "max_tokens: Input should be less than or equal to"),
    ("completions", f'"n": {BIG}', "n", "n: Input should be less than or equal to"),
    ("completions", f'"n": -{BIG}', "n", "n: Input should be greater than or equal to"),
    ("completions", f'"seed": {BIG}', "seed", "seed: Input should be less than or equal to 18446744073709551615"),
    ("completions", f'"top_k": {BIG}', "top_k", "top_k: Input should be less than or equal to"),
    ("completions", f'"stop_token_ids": [1, {BIG}]', "stop_token_ids", "stop_token_ids.1: Input should be less"),
    ("chat/completions", f'"max_completion_tokens": {BIG}', "max_completion_tokens",
     "max_completion_tokens: Input should be less than or equal to"),
    ("completions", f'"seed": {"9" * 5000}', None, "There was an error parsing the body"),  # over Python's int limit
]


@pytest.mark.parametrize("endpoint,field_json,param,prefix", NUMBER_CASES, ids=[c[1][:24] for c in NUMBER_CASES])
def test_edge_numbers_are_400s_naming_the_field(server, endpoint, field_json, param, prefix):
    base = '"prompt": "hi"' if endpoint == "completions" else '"messages": [{"role": "user", "content": "hi"}]'
    extra = '' if "max_tokens" in field_json or "max_completion_tokens" in field_json else ', "max_tokens": 2'
    r = post_raw(server, endpoint, f'{{{base}, {field_json}{extra}}}'.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(prefix)
    assert_still_serving(server)


UNION_CASES = [  # a field of several accepted forms names them all, then where the value went wrong
    ("completions", '"prompt": [1, 2, "x"]', "prompt", "prompt: must be a string, a list of integers, a list of "
     "strings or a list of lists of integers; prompt.2: Input should be a valid integer"),
    ("completions", '"prompt": {"a": 1}', "prompt",
     "prompt: must be a string, a list of integers, a list of strings or a list of lists of integers"),
    ("completions", '"prompt": [[1, 2], [3, "y"]]', "prompt", "prompt: must be a string, a list of integers, a "
     "list of strings or a list of lists of integers; prompt.1.1: Input should be a valid integer"),
    ("completions", '"prompt": "hi", "stop": ["a", 3]', "stop",
     "stop: must be a string or a list of strings; stop.1: Input should be a valid string"),
    ("chat/completions", '"messages": [{"role": "user", "content": 5}]', "messages",
     "messages.0.content: must be a string or a list of objects"),
    ("chat/completions", '"messages": [{"role": 5, "content": "x"}]', "messages",
     "messages.0.role: Input should be a valid string"),
    ("completions", '"prompt": ["a", 1, 2, 3, 4]', "prompt", "prompt: must be a string, a list of integers, a "
     "list of strings or a list of lists of integers; prompt.0: Input should be a valid integer"),  # 1 failure, not 4
    ("completions", '"prompt": ["a", 1]', "prompt", "prompt: must be a string, a list of integers, a "
     "list of strings or a list of lists of integers; prompt.1: Input should be a valid string"),  # got further
    # dict keys are no union members, whatever they spell (review: made-up unions, a key "body" dropped, a 500)
    ("completions", '"prompt": "hi", "logit_bias": {"int": "q"}', "logit_bias",
     "logit_bias.int: Input should be a valid number"),
    ("completions", '"prompt": "hi", "logit_bias": {"str": "q", "int": "r"}', "logit_bias",
     "logit_bias.str: Input should be a valid number"),
    ("completions", '"prompt": "hi", "logit_bias": {"body": "q", "str": "r"}', "logit_bias",
     "logit_bias.body: Input should be a valid number"),
    ("completions", '"prompt": "hi", "logit_bias": {"' + "list[" * 1200 + "]" * 1200 + '": "q", "str": "r"}',
     "logit_bias", ("logit_bias." + "list[" * 1200)[:100] + "...: Input should be a valid number"),
]


@pytest.mark.parametrize("endpoint,body,param,message", UNION_CASES, ids=[c[1][:30] for c in UNION_CASES])
def test_wrong_forms_of_union_fields_name_every_accepted_form(server, endpoint, body, param, message):
    """Before 2026-12-03 a union field reported its first member's failure alone: ``[1, 2, "x"]`` as a
    prompt got "prompt: Input should be a valid string"."""
    r = post_raw(server, endpoint, f'{{{body}, "max_tokens": 2}}'.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": "invalid_type"}
    assert_still_serving(server)


def test_prompt_token_id_beyond_64_bits_and_negative_zero_temperature(server):
    r = post_raw(server, "completions", f'{{"prompt": [1, {BIG}], "max_tokens": 2}}'.encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # -0.0 is a valid temperature: 0, greedy.
    texts = [post_raw(server, "completions", f'{{"prompt": "The sky is", "max_tokens": 6, "temperature": {t}}}'
                      .encode()).json()["choices"][0]["text"] for t in ("-0.0", "0")]
    assert texts[0] == texts[1]
    assert_still_serving(server)


def test_tiny_temperature_does_not_stop_the_engine(smollm2):
    """C14 on the server: degenerate sampling resolves to the argmax; the engine goes on."""
    s = start_server(smollm2, num_blocks=16)
    try:
        greedy = post_raw(s, "completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}')
        for body in (b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e-300}',
                     b'{"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "top_p": 1e-46}'):
            r = post_raw(s, "completions", body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
            assert httpx.get(s.base_url + "/health").status_code == 200
    finally:
        stop_server(s)


def test_a_prompt_over_the_context_is_refused_while_a_step_runs(server):
    """The context check runs on the input thread: found by a fresh user, a 9,000-id prompt got its
    400 only after the running step (6.9 s behind a long prefill). Here the engine thread is held
    (as by a long step) and the refusal still comes, with its message."""
    import threading

    release = threading.Event()
    held = server.engine._executor.submit(release.wait)
    try:
        r = httpx.post(server.base_url + "/v1/completions", timeout=10,
                       json={"model": MODEL, "prompt": [42] * 9000, "max_tokens": 2})
    finally:
        release.set()
    held.result(timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == ("prompt is 9000 tokens; max_model_len is 8192 (the prompt plus at "
                                            "least one generated token must fit)")
    assert_still_serving(server)
