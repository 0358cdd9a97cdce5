"""Schemathesis against the live server's own /openapi.json: valid and invalid requests generated
from the schema must never get a 5xx, and every answer must match what the schema documents
(status code, content type, body schema). Bounded: a few dozen examples per operation and mode,
and a server whose requests can't run long (short context, max_tokens and n capped before sending).

Driven through schemathesis' Hypothesis strategies rather than its pytest plugin, whose lazy
``from_fixture`` loader reads a private attribute pytest 9 no longer has.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.conftest import start_server, stop_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
OPERATIONS = [("/health", "GET"), ("/v1/models", "GET"), ("/metrics", "GET"), ("/reset_prefix_cache", "POST"),
              ("/flush_cache", "POST"),
              ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
              ("/detokenize", "POST"), ("/v1/cache/stats", "GET"), ("/dashboard", "GET"), ("/server_info", "GET"),
              ("/get_server_info", "GET"), ("/model_info", "GET"), ("/get_model_info", "GET"),
              ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST")]
WITH_BODY = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/messages",
             "/v1/messages/count_tokens"}


@pytest.fixture(scope="module")
def fuzz_server(smollm2):
    # pins off: a fuzzed /v1/messages breakpoint would hold blocks on purpose (tests/cache/test_pins.py)
    s = start_server(smollm2, num_blocks=32, max_model_len=64, max_pinned_fraction=0.0)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def _bounded(body: object) -> None:
    """Caps the work a generated request may ask for (values that are valid stay valid)."""
    if not isinstance(body, dict):
        return
    for name, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2


def test_every_operation_is_fuzzed(api_schema):
    documented = {(path, method.upper()) for path, item in api_schema.raw_schema["paths"].items() for method in item}
    assert documented == set(OPERATIONS)


# Negative cases need something to get wrong: only the operations with a request body have them.
CASES = [(path, method, GenerationMode.POSITIVE) for path, method in OPERATIONS] + [
    (path, method, GenerationMode.NEGATIVE) for path, method in OPERATIONS if path in WITH_BODY]


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m}-{p}-{g.value}" for p, m, g in CASES])
def test_schema_conformance(api_schema, fuzz_server, path, method, mode):
    operation = api_schema[path][method]
    statuses: list[int] = []

    @given(operation.as_strategy(generation_mode=mode))
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        _bounded(case.body)
        response = case.call(base_url=fuzz_server.base_url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=CHECKS)

    run()
    assert len(statuses) >= 10 if path in WITH_BODY else statuses
    if mode == GenerationMode.NEGATIVE:
        assert set(statuses) <= {400, 404}, statuses  # refused, each with the error schema (checked above)


def test_nothing_leaked_after_fuzzing(fuzz_server):
    after = fuzz_server.wait_idle()
    assert after["prefixcache:kv_blocks_in_use"] == 0 and after["prefixcache:num_requests_running"] == 0
    r = httpx.post(fuzz_server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
