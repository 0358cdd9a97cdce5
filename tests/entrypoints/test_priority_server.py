"""vLLM's ``priority`` request field: reaches the scheduler as the request's priority, changes no
output, and a bad value is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL


def post(server, path, body):
    return httpx.post(server.base_url + path, json={"model": MODEL, "max_tokens": 3, "temperature": 0, **body},
                      timeout=120)


def test_priority_reaches_the_scheduler_and_changes_no_output(server):
    scheduler = server.engine.engine.scheduler
    seen = []
    add = scheduler.add_request

    def observe(request):  # runs on the engine thread; observes, changes nothing
        seen.append(request.priority)
        add(request)

    scheduler.add_request = observe
    try:
        plain = post(server, "/v1/completions", {"prompt": "The capital of France is"})
        urgent = post(server, "/v1/completions", {"prompt": "The capital of France is", "priority": -7})
        chat = post(server, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Hi"}], "priority": 3})
    finally:
        del scheduler.add_request
    assert plain.status_code == urgent.status_code == chat.status_code == 200, (plain.text, urgent.text, chat.text)
    assert seen == [0, -7, 3]
    assert urgent.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


@pytest.mark.parametrize("value", ["high", 1.5, True, 2**70, [1]])
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_bad_priority_is_a_400_naming_the_field(server, path, body, value):
    r = post(server, path, {**body, "priority": value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority" and "priority" in error["message"]
