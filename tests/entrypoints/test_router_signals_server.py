"""What routers read from a replica: SGLang's /server_info and /model_info probes, and the vLLM-named
metric aliases on /metrics (equal to our own series after a known sequence of requests)."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.entrypoints.openai.metrics import VLLM_ALIASES
from tests.entrypoints.conftest import MODEL, start_server, stop_server

# A long shared system prompt (several 16-token blocks), then distinct questions.
SYSTEM = "You are the support assistant of a small public library. Answer briefly and politely. " * 4
QUESTIONS = ["When do you open on Sunday?", "Can I renew a book online?", "Do you lend e-readers?"]


def samples(base_url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_router_probes_describe_the_replica(smollm2):
    server = start_server(smollm2)
    try:
        bodies = {path: httpx.get(server.base_url + path).json()
                  for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info")}
    finally:
        stop_server(server)
    assert bodies["/server_info"] == bodies["/get_server_info"]
    assert bodies["/model_info"] == bodies["/get_model_info"]
    model_dir = str(smollm2.model_dir)
    hf_config = json.loads((smollm2.model_dir / "config.json").read_text())
    info = bodies["/server_info"]
    # start_server: block_size 16, num_blocks 160, max_num_seqs 16; SmolLM2's context is 8192 tokens
    assert info == {"model_path": model_dir, "tokenizer_path": model_dir, "served_model_name": MODEL,
                    "context_length": hf_config["max_position_embeddings"], "max_total_tokens": 160 * 16,
                    "max_running_requests": 16, "page_size": 16, "disable_radix_cache": False,
                    "tp_size": 1, "dp_size": 1, "pp_size": 1, "is_embedding": False, "version": "0.1.0"}
    assert bodies["/model_info"] == {"model_path": model_dir, "tokenizer_path": model_dir, "is_generation": True,
                                     "has_image_understanding": False, "has_audio_understanding": False,
                                     "model_type": hf_config["model_type"],
                                     "architectures": hf_config["architectures"]}


def test_probes_need_no_api_key(smollm2):
    server = start_server(smollm2, api_key="k")
    try:
        assert httpx.get(server.base_url + "/server_info").status_code == 200
        assert httpx.get(server.base_url + "/model_info").status_code == 200
        assert httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    finally:
        stop_server(server)


def test_vllm_aliases_equal_our_series(smollm2):
    server = start_server(smollm2, enable_partial_block_reuse=False)
    try:
        usages = []
        for question in QUESTIONS:  # one at a time: the 2nd and 3rd hit the system prompt's blocks
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
            usages.append(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"])
        server.wait_idle()
        values = samples(server.base_url)
    finally:
        stop_server(server)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    cached_tokens = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached_tokens[0] == 0 and cached_tokens[1] > 0 and cached_tokens[2] > 0
    vllm_labels = (("engine", "0"), ("model_name", MODEL))
    ours_labels = (("model_name", MODEL),)
    expected = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                "prefix_cache_queries_total": prompt_tokens, "prefix_cache_hits_total": sum(cached_tokens)}
    assert len(expected) == len(VLLM_ALIASES)
    for name, value in expected.items():
        assert values[("vllm:" + name, vllm_labels)] == value, name
        assert values[("prefixcache:" + name, ours_labels)] == value, name


def test_vllm_gauges_follow_ours_while_a_request_runs(smollm2):
    server = start_server(smollm2)
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped generator would close the stream (an abort)
            next(lines)  # the first chunk: the request runs (for seconds) and holds its blocks
            values = samples(server.base_url)
    finally:
        stop_server(server)
    vllm_labels, ours_labels = (("engine", "0"), ("model_name", MODEL)), (("model_name", MODEL),)
    assert values[("prefixcache:num_requests_running", ours_labels)] == 1
    assert values[("prefixcache:kv_cache_usage_perc", ours_labels)] > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert values[("vllm:" + name, vllm_labels)] == values[("prefixcache:" + name, ours_labels)], name
