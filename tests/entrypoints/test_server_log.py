"""What ``serve`` logs (issue 17): the start-up summary of the engine, and one line per finished
request whose numbers are the response's usage, on the real server."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx

from prefixcache.config import EngineConfig
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.entrypoints.openai.server_log import request_line, startup_lines
from prefixcache.kernels.cpu_features import describe_cpu
from prefixcache.kernels.cpu_kernels import amx_ready
from prefixcache.outputs import RequestOutput
from tests.entrypoints.conftest import MODEL

MS = r"(\d+\.\d) ms"


def test_startup_lines_state_the_engine(smollm2):
    engine = LLMEngine(EngineConfig(model=MODEL, num_blocks=64, block_size=16, max_model_len=1024, num_threads=2,
                                    device="cpu", eviction_policy="lfu"), loaded=smollm2)
    c = smollm2.config
    # K and V, per layer, per token of a block, fp32: computed here from the model's config.
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 4
    assert per_block == 737_280  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    lines = startup_lines(engine)
    assert lines == [
        f"model {MODEL} ({smollm2.model_dir}), weights fingerprint {smollm2.fingerprint.hex()[:16]}",
        f"dtype float32, quantization none, device cpu, 2 threads; {describe_cpu()}, amx: "
        f"{'yes' if amx_ready() else 'no'}",
        f"KV pool 64 blocks x 16 tokens = 1024 tokens, {64 * per_block / 2**20:.1f} MiB ({per_block} bytes per "
        "block); max model len 1024 tokens",
        *lines[3:4],  # the scheduler line: checked below (a scheduling-policy field may join it)
        "prefix caching on (hash xxh64, eviction lfu, partial-block reuse on)",
    ]
    assert lines[2].startswith("KV pool 64 blocks x 16 tokens = 1024 tokens, 45.0 MiB (737280 bytes per block)")
    assert lines[3].startswith(f"scheduler: up to {engine.config.max_num_seqs} requests, "
                               f"{engine.config.max_num_batched_tokens} tokens per step")


def _wait_for_records(caplog, count: int, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "prefixcache.requests"]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_one_line_per_finished_request_with_its_usage(server, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.requests")
    prompt = "The history of the printing press begins " * 8  # > 1 block: the second request hits
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0},
              {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "n": 2, "temperature": 1,
               "seed": 3}]
    answers = []
    for body in bodies:
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        answers.append(r.json())
    lines = _wait_for_records(caplog, 2)
    assert len(lines) == 2, lines
    for line, answer in zip(lines, answers):
        u = answer["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        m = re.fullmatch(rf"request {answer['id']} length: prompt {u['prompt_tokens']} tokens \({cached} cached\), "
                         rf"completion {u['completion_tokens']} tokens, TTFT {MS}, e2e {MS}", line)
        assert m, line
        ttft_ms, e2e_ms = float(m.group(1)), float(m.group(2))
        assert 0 < ttft_ms <= e2e_ms
    assert answers[1]["usage"]["completion_tokens"] == 8  # both samples' tokens in one line
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the line shows a real hit


def test_an_aborted_stream_is_logged_as_abort(server, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.requests")
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                request_id = json.loads(line[6:])["id"]
                break  # the client goes away after its first chunk
    lines = _wait_for_records(caplog, 1)
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"request {request_id} abort: prompt \d+ tokens \(\d+ cached\), completion \d+ tokens, "
                        rf"TTFT {MS}, e2e {MS}", lines[0]), lines[0]
    n = int(re.search(r"completion (\d+) tokens", lines[0]).group(1))
    assert 1 <= n < 400


def test_the_docs_page_and_schema_readme_points_to_are_served(server):
    docs = httpx.get(server.base_url + "/docs", timeout=30)
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text
    schema = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"} <= set(schema["paths"])


def test_request_line_counts_in_the_right_number():
    def out(num_prompt):
        return RequestOutput(request_id="cmpl-1", index=0, prompt=None, prompt_token_ids=[7] * num_prompt, text="x",
                             token_ids=[5], finish_reason="length", stop_reason=None, num_prompt_tokens=num_prompt,
                             num_cached_tokens=0, ttft_s=0.0125, e2e_s=0.5)

    assert request_line(out(1), 1) == ("request cmpl-1 length: prompt 1 token (0 cached), completion 1 token, "
                                       "TTFT 12.5 ms, e2e 500.0 ms")
    assert request_line(out(2), 3).startswith("request cmpl-1 length: prompt 2 tokens (0 cached), completion 3 tokens,")
