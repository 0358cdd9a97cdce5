"""OpenAI's prompt-caching hints on the OpenAI routes, with the real ``openai`` client:
``prompt_cache_key`` is a routing hint, never isolation (C26); ``prompt_cache_retention`` is
``"in_memory"`` (today's behaviour) or refused with a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.conftest import MODEL, start_server, stop_server

B = 16
SYSTEM = (
    "You are the dispatcher of a mountain rescue team. Ask for the caller's position, the number of "
    "people involved and their injuries; keep every answer under twenty words and stay calm."
)
KEYS = {"key-acme": "acme", "key-globex": "globex"}


@pytest.fixture(scope="module")
def server(smollm2):
    s = start_server(smollm2, enable_partial_block_reuse=False,
                     app_options={"api_keys": KEYS, "tenant_isolation": True})
    yield s
    stop_server(s)


def client_for(server, key):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def cached(client, question, **extra):
    r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, extra_body=extra,
                                       messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": question}])
    return r.usage.prompt_tokens_details.cached_tokens


def expected_cached(server, q1, q2):
    """Full blocks of the two conversations' common prefix, never the block of the last token."""
    a, b = (server.engine.engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": q}]) for q in (q1, q2))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return min(n, len(b) - 1) // B * B


def test_c26_prompt_cache_key_routes_but_never_isolates(server):
    acme, globex = (client_for(server, k) for k in KEYS)
    assert cached(acme, "Two hikers are lost.", prompt_cache_key="k1") == 0
    shared = cached(acme, "One climber fell.", prompt_cache_key="k2")  # another key, same tenant: shares
    assert shared == expected_cached(server, "Two hikers are lost.", "One climber fell.") >= 2 * B
    assert cached(globex, "Two hikers are lost.", prompt_cache_key="k1") == 0  # same key, other tenant
    assert cached(acme, "Snow is falling.", prompt_cache_key="k1", cache_salt="s") == 0  # the salt isolates
    completions = acme.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=1, temperature=0,
                                          extra_body={"prompt_cache_key": "k3"})
    assert completions.usage.prompt_tokens_details.cached_tokens == 0  # a completion prompt: another prefix


def test_prompt_cache_retention_values(server):
    acme = client_for(server, "key-acme")
    assert cached(acme, "A skier is hurt.", prompt_cache_retention="in_memory", cache_salt="r") == 0
    assert cached(acme, "A skier is hurt.", prompt_cache_retention="in_memory", cache_salt="r") == \
        expected_cached(server, "A skier is hurt.", "A skier is hurt.")
    for value, message in (
        ("24h", "prompt_cache_retention '24h' keeps a prefix in the disk tier, and this server has none (start it "
                "with --kv-disk-dir); use 'in_memory'"),
        ("forever", "prompt_cache_retention must be 'in_memory' or '24h', got 'forever'"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            cached(acme, "A skier is hurt.", prompt_cache_retention=value)
        assert e.value.body["param"] == "prompt_cache_retention" and e.value.body["message"] == message
        with pytest.raises(openai.BadRequestError) as e:
            acme.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                    extra_body={"prompt_cache_retention": value})
        assert e.value.body["message"] == message
    with pytest.raises(openai.BadRequestError) as e:
        cached(acme, "A skier is hurt.", prompt_cache_retention=24)
    assert e.value.body["param"] == "prompt_cache_retention"
