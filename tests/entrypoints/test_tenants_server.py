"""Server tenant isolation: per-API-key namespaces and an approved shared system prompt.

Driven by the real ``openai`` client, one client per API key. Partial-block reuse is on (the
default): even so, a tenant gets exactly the approved prompt's full blocks from another tenant.
"""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest

from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.cli.serve import add_cli_args, parse_tenant_args
from prefixcache.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL, start_server, stop_server

SYSTEM = (
    "You are the support assistant of Northwind Rail. Answer in two sentences at most, cite the "
    "relevant rule number when you know it, and never promise refunds: refer those to the desk."
)
KEYS = {"key-acme-1": "acme", "key-acme-2": "acme", "key-globex": "globex"}


def chat(client, system, user):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content


@pytest.fixture(scope="module")
def tenant_server(smollm2):
    s = start_server(smollm2, app_options={
        "api_keys": KEYS, "tenant_isolation": True, "approved_system_prompts": [SYSTEM]})
    yield s
    stop_server(s)


def client_for(server, key):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_tenants_share_the_approved_system_prompt_only(tenant_server, smollm2):
    s = tenant_server
    acme, acme2, globex = (client_for(s, k) for k in KEYS)
    approved_len = len(s.engine.engine.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                           add_generation_prompt=False))
    shared = approved_len // 16 * 16
    user = "My train from Leeds was cancelled yesterday evening; what are my options for tomorrow?"
    n, cached, text_a = chat(acme, SYSTEM, user)
    assert cached == 0 and n > shared + 16
    n_b, cached_b, text_b = chat(globex, SYSTEM, user)
    assert (n_b, cached_b) == (n, shared)  # the approved blocks, none of acme's private ones
    assert text_b == text_a
    _, cached_a2, text_a2 = chat(acme2, SYSTEM, user)  # acme's second key: the same namespace
    # Every full block; the prompt's last block never filled (3 tokens generated): no partial copy.
    assert cached_a2 == (n - 1) // 16 * 16 > shared and text_a2 == text_a
    # A private system prompt is never shared across tenants, whatever its content.
    private = "You are the internal pricing bot of Acme. The Q3 discount code is WINTER-4471."
    chat(acme, private, "Summarise the discount rules.")
    assert chat(globex, private, "Summarise the discount rules.")[1] == 0
    assert chat(acme2, private, "Summarise the discount rules.")[1] > 0


def test_a_salted_request_shares_nothing_across_tenants(tenant_server):
    """A cache_salt is the requester's secret. Its approved blocks were keyed with the salt but not
    the tenant, so another tenant sending the approved prompt with a guessed salt got 16 cached tokens
    exactly when the guess was right, and saw the salt's unkeyed sha256 on /v1/cache/stats. Now a
    salted request's every block is its tenant's, and the digest shown is keyed per process."""
    import hashlib

    s = tenant_server
    acme, acme2, globex = (client_for(s, k) for k in KEYS)

    def salted(client, salt, user):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=2, temperature=0, extra_body={"cache_salt": salt},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    user = "Which platform does the 07:12 to York leave from on Sundays?"
    n, cached = salted(acme, "user-1234", user)
    assert cached == 0
    assert salted(globex, "user-1234", user + " Thanks.") == (n + 2, 0)  # the same salt: no hit
    assert salted(acme2, "user-1234", user + " Thanks.")[1] == (n - 1) // 16 * 16  # its own tenant: a hit

    def salted_namespaces(key):
        doc = httpx.get(s.base_url + "/v1/cache/stats", headers={"Authorization": f"Bearer {key}"}).json()
        return [(p["namespace"]["tenant"], p["namespace"]["salt"]) for p in doc["prefixes"] if p["namespace"]["salt"]]

    ((tenant, digest),) = salted_namespaces("key-acme-1")
    assert tenant == "acme" and len(digest) == 8 and digest != hashlib.sha256(b"user-1234").hexdigest()[:8]
    assert salted_namespaces("key-globex") == [("globex", digest)]  # its own chain only


def test_tenant_server_auth_and_reset(tenant_server):
    url = tenant_server.base_url
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                   headers={"Authorization": "Bearer key-unknown"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/reset_prefix_cache", "/flush_cache"):
        r = httpx.post(url + path, headers={"Authorization": "Bearer key-globex"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert r.json()["error"]["message"].startswith(f"{path} is disabled under --tenant-isolation")


def test_tenant_isolation_needs_keys(smollm2):
    from prefixcache.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=16, num_threads=2), loaded=smollm2)
    with pytest.raises(ValueError, match="tenant isolation needs API keys"):
        build_app(engine, MODEL, tenant_isolation=True)
    with pytest.raises(ValueError, match="tenant must be"):
        build_app(engine, MODEL, api_keys={"k": ""})
    # A JSON keys file can name a tenant "\ud800": it was accepted, then every request of that key
    # was a 400 naming "tenant" and /v1/cache/stats a 500.
    with pytest.raises(ValueError, match=r"tenant '\\ud800': tenant contains a lone surrogate \(U\+D800 at character 0\)"):
        build_app(engine, MODEL, api_keys={"k": "\ud800"})
    for key in ("clé", " k", "k ", "", "a\tb"):  # no client could send these in a header
        with pytest.raises(ValueError, match="printable ASCII"):
            build_app(engine, MODEL, api_keys={key: "acme"})


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parse_tenant_args(parser.parse_args(argv))


def test_tenant_flags_and_files(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"acme": ["k1", "k2"], "globex": "k3"}))
    prefixes = tmp_path / "prefixes.json"
    prefixes.write_text(json.dumps([{"text": "Doc A"}, {"system": "Be brief."}]))
    api_keys, texts, systems = parse([
        "--tenant-api-key", "initech=k4", "--api-keys-file", str(keys), "--tenant-isolation",
        "--approved-prefix", "Doc B", "--approved-system-prompt", "Be kind.",
        "--approved-prefixes-file", str(prefixes)])
    assert api_keys == {"k4": "initech", "k1": "acme", "k2": "acme", "k3": "globex"}
    assert texts == ["Doc B", "Doc A"] and systems == ["Be kind.", "Be brief."]
    with pytest.raises(ValueError, match="TENANT=KEY"):
        parse(["--tenant-api-key", "no-separator"])
    with pytest.raises(ValueError, match="given twice"):
        parse(["--tenant-api-key", "a=k", "--tenant-api-key", "b=k"])
    prefixes.write_text(json.dumps([{"prompt": "x"}]))
    with pytest.raises(ValueError, match="approved-prefixes-file"):
        parse(["--approved-prefixes-file", str(prefixes)])
    with pytest.raises(ValueError, match="cannot read JSON"):
        parse(["--api-keys-file", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="only matter with --tenant-isolation"):
        parse(["--approved-prefix", "Doc"])
    with pytest.raises(ValueError, match="must not be empty"):
        parse(["--tenant-isolation", "--approved-system-prompt", ""])
    prefixes.write_text(json.dumps([{"system": ""}]))
    with pytest.raises(ValueError, match="approved-prefixes-file: empty prefix"):
        parse(["--tenant-isolation", "--approved-prefixes-file", str(prefixes)])
