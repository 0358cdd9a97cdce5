"""The field's load generators, run unchanged against a real ``prefixcache serve`` on loopback.

GuideLLM, SGLang's ``bench_serving`` (``--backend sglang-oai --cache-report --flush-cache``) and AIPerf each run
a small shared-prefix workload from their own venv (``prefixcache bench --install-field-tools``; CI creates them
through ``PREFIXCACHE_FIELD_TOOLS=1 scripts/setup.sh``). Each must exit 0 with every request served, report
exactly the cached tokens our ``/metrics`` counters grew by (ours and the vLLM-named ones), and a hit rate of at
least 0.99x the exact theoretical one of the prompts it sent (the run fits the pool). SGLang also runs against
llama.cpp's server where ``llama-cpp-python[server]`` is installed. Skipped, with the install command, where a
tool's venv is absent.
"""

from __future__ import annotations

import pytest

from prefixcache.bench import field, field_venvs
from prefixcache.bench.field import FieldWorkload, run_tool, start_prefixcache, tool_missing

WORKLOAD = FieldWorkload(groups=2, num_requests=20, prefix_tokens=256, question_tokens=32, max_tokens=4,
                         concurrency=4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if all(tool_missing(t) for t in field.TOOLS):
        pytest.skip("no field tool installed: " + "; ".join(tool_missing(t) for t in field.TOOLS))
    from prefixcache.models.loader import resolve_model_dir

    server = start_prefixcache("smollm2-135m", num_threads=2, log_dir=tmp_path_factory.mktemp("serve"))
    yield server, resolve_model_dir("smollm2-135m")
    server.stop()


@pytest.mark.slow  # a served model and a tool run: tens of seconds each
@pytest.mark.parametrize("tool", field.TOOLS)
def test_tool_reads_the_truth(tool, served, tmp_path):
    if tool_missing(tool):
        pytest.skip(tool_missing(tool))
    server, tokenizer = served
    run = run_tool(tool, server, WORKLOAD, tokenizer, tmp_path, model_name="smollm2-135m", timeout_s=420)
    log = (tmp_path / f"{tool}-prefixcache" / "tool.log").read_text(errors="replace")[-3000:]
    assert run.exit_code == 0, log
    assert run.note == "", run.note
    assert run.requests == WORKLOAD.num_requests and run.succeeded + run.unrecorded == run.requests, log
    delta = run.server_counters
    assert run.cached_tokens > 0 and delta["hits"] == delta["vllm_hits"], (run.cached_tokens, delta)
    if run.unrecorded == 0:  # what the tool says was cached is what our counters say was hit, token for token
        assert run.cached_tokens == delta["hits"], (run.cached_tokens, delta)
    else:  # GuideLLM sometimes ends with a request served but left out of its report: at most its prompt more
        per_request = run.prompt_tokens / run.succeeded
        assert run.cached_tokens <= delta["hits"] <= run.cached_tokens + run.unrecorded * per_request, (run, delta)
    assert delta["queries"] == delta["vllm_queries"] >= run.prompt_tokens > 0  # SGLang's warm-up is queried too
    # the prompts read back from the tool's files, tokenized as our server does: the tokens it was sent
    assert run.sent_prompts == run.succeeded
    if tool != "guidellm":  # GuideLLM's prompt_tokens leave out its prefix buckets' tokens
        assert run.sent_prompt_tokens == run.prompt_tokens, (run.sent_prompt_tokens, run.prompt_tokens)
    assert run.theoretical_hit_rate > 0.6
    assert run.hit_rate_source == "tool"
    assert run.hit_rate >= 0.99 * run.theoretical_hit_rate, (run.hit_rate, run.theoretical_hit_rate)
    assert delta["hits"] <= run.theoretical_hit_tokens + run.unrecorded * run.sent_prompt_tokens / run.sent_prompts
    for value in (run.ttft_p50_ms, run.ttft_p99_ms, run.tpot_p50_ms, run.output_tokens_per_s):
        assert value is not None and value > 0


@pytest.mark.slow  # llama.cpp's server and one SGLang run: about a minute
def test_sglang_against_llama_cpp_server(tmp_path):
    """Every request answered in full (``--interrupt_requests false``), hits read from its log."""
    if tool_missing("sglang"):
        pytest.skip(tool_missing("sglang"))
    if field.llama_cpp_server_missing():
        pytest.skip(field.llama_cpp_server_missing())
    from prefixcache.bench.speed import gguf_for_model
    from prefixcache.models.loader import resolve_model_dir

    gguf = gguf_for_model("smollm2-135m")
    if gguf is None:
        pytest.skip("smollm2-135m has no GGUF here")
    w = FieldWorkload(groups=2, num_requests=8, prefix_tokens=128, question_tokens=32, max_tokens=4, concurrency=2)
    server = field.start_llama_cpp(gguf, "smollm2-135m", 2, log_dir=tmp_path)
    try:
        run = run_tool("sglang", server, w, resolve_model_dir("smollm2-135m"), tmp_path, "smollm2-135m",
                       timeout_s=420)
    finally:
        server.stop()
    log = (tmp_path / "sglang-llamacpp-server" / "tool.log").read_text(errors="replace")[-3000:]
    assert run.exit_code == 0 and run.succeeded == 8 and run.note == "", log
    assert run.sent_prompts == 8 and run.sent_prompt_tokens == run.prompt_tokens  # SGLang counts them itself
    assert not run.usage_in_stream and run.hit_rate_source == "server"
    # no flush route: SGLang's warm-up (its first prompt) precedes the run, so the first request hits it too
    assert run.theoretical_hit_tokens > 7 * 128
    assert run.server_counters["hits"] >= 0.99 * run.theoretical_hit_tokens, (run.server_counters, run)


def test_llama_cpp_hits_are_read_from_its_log(tmp_path):
    log = tmp_path / "llama.log"
    log.write_text('INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK\n'
                   "Llama._create_completion: cache miss\n"
                   'INFO:     127.0.0.1:2 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
                   "Llama.generate: 264 prefix-match hit, remaining 38 prompt tokens to eval\n"
                   'INFO:     127.0.0.1:3 - "GET /v1/models HTTP/1.1" 200 OK\n'
                   "Llama.generate: 3 prefix-match hit, remaining 107 prompt tokens to eval\n"
                   "Llama.generate: full prompt already cached, skipping reset\n")
    server = field.ServerProcess(field.LLAMA_CPP, "http://127.0.0.1:1", None, log, has_metrics=False)
    assert server.log_counters() == {"hits": 267.0, "requests_with_hits": 2.0, "full_prompt_hits": 1.0,
                                     "requests": 2.0}


def test_a_log_that_counts_other_requests_than_the_tool_gives_no_measured_rate(tmp_path, monkeypatch):
    """An interrupted run: the server's log holds a request the tool never recorded, so its hits can't be set
    against the recorded prompts' theoretical ones."""
    import json

    (tmp_path / field.SGLANG_PROMPTS).write_text(json.dumps(["a b c d", "a b c e"]))

    class Tokenizer:
        def encode(self, text, add_special_tokens):
            return [ord(c) for c in text]

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tokenizer())
    run = field.FieldRun("sglang", field.LLAMA_CPP, 0, succeeded=2, usage_in_stream=False,
                         server_counters={"hits": 12.0, "requests": 3.0})
    field._theoretical(run, "sglang", tmp_path, False, tmp_path)  # warm-up = the first prompt, not flushed
    assert (run.sent_prompts, run.sent_prompt_tokens, run.theoretical_hit_tokens) == (2, 14, 6 + 6)
    assert run.server_counters == {"hits": 12.0, "requests": 3.0} and run.hit_rate == pytest.approx(12 / 14)
    run.server_counters = {"hits": 12.0, "requests": 4.0}
    field._theoretical(run, "sglang", tmp_path, False, tmp_path)
    assert run.server_counters is None and run.hit_rate_source == "" and "log counts 4 requests" in run.note


def test_prompts_are_read_back_in_the_order_sent_and_tokenized_as_the_server_does(tmp_path):
    import json

    (tmp_path / "aiperf").mkdir()
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    (tmp_path / "aiperf" / "inputs.json").write_text(json.dumps({"data": [
        {"session_id": "s0", "payloads": [{"messages": chat}]},
        {"session_id": "s1", "payloads": [{"messages": chat[:1] + [{"role": "user", "content": "Yo"}]}]},
        {"session_id": "s2", "payloads": [{"messages": chat}]}]}))
    records = [{"metadata": {"conversation_id": "s1", "request_start_ns": 20}},
               {"metadata": {"conversation_id": "s0", "request_start_ns": 10}},
               {"metadata": {"conversation_id": "s2", "request_start_ns": 30}, "error": {"type": "X"}}]
    (tmp_path / "aiperf" / "profile_export.jsonl").write_text("\n".join(map(json.dumps, records)))
    prompts, warm = field.sent_prompts("aiperf", tmp_path)
    assert prompts == [chat, chat[:1] + [{"role": "user", "content": "Yo"}]] and warm == []  # errored s2 left out

    (tmp_path / field.SGLANG_PROMPTS).write_text(json.dumps(["warm and first", "second"]))
    assert field.sent_prompts("sglang", tmp_path, flushed=True) == (["warm and first", "second"], [])
    assert field.sent_prompts("sglang", tmp_path, flushed=False) == (["warm and first", "second"], ["warm and first"])

    class Tokenizer:  # records what the server-side path asks of a tokenizer
        def encode(self, text, add_special_tokens):
            return [len(text), int(add_special_tokens)]

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "|".join(m["role"] + ":" + m["content"] for m in messages)

    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert field.tokenize_prompts(["hello", parts], Tokenizer()) == [[5, 1], [len("user:abcd"), 0]]


def test_missing_tool_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv(field_venvs.VENVS_ENV, str(tmp_path))
    reason = tool_missing("aiperf")
    assert "prefixcache bench --install-field-tools aiperf" in reason and str(tmp_path) in reason
    with pytest.raises(ValueError, match="install-field-tools"):
        run_tool("aiperf", None, WORKLOAD, tmp_path, tmp_path)
    (tmp_path / "aiperf").mkdir()
    (tmp_path / "aiperf" / ".installed").write_text("")
    assert tool_missing("aiperf") is None


def test_field_markdown_has_one_table_per_tool_and_says_what_was_skipped():
    run = field.FieldRun("sglang", field.OURS, 0, requests=20, succeeded=20, ttft_p50_ms=600.0, ttft_p99_ms=2600.0,
                         tpot_p50_ms=190.0, tpot_p99_ms=340.0, output_tokens_per_s=9.6, requests_per_s=2.4,
                         prompt_tokens=6135, cached_tokens=4911, theoretical_hit_rate=4911 / 6135, sent_prompts=20,
                         sent_prompt_tokens=6135, theoretical_hit_tokens=4911,
                         server_counters={"vllm_hits": 4911.0, "vllm_queries": 6438.0, "hits": 4911.0,
                                          "queries": 6438.0})
    # llama.cpp: SGLang counted the prompt tokens itself, no usage came back; the hits are its log's
    theirs = field.FieldRun("sglang", field.LLAMA_CPP, 0, requests=20, succeeded=20, ttft_p50_ms=1800.0,
                            ttft_p99_ms=2900.0, tpot_p50_ms=30.0, tpot_p99_ms=40.0, output_tokens_per_s=5.0,
                            requests_per_s=1.0, prompt_tokens=6135, cached_tokens=0, theoretical_hit_rate=0.8,
                            sent_prompts=20, sent_prompt_tokens=6135, theoretical_hit_tokens=4908,
                            server_counters={"hits": 4908.0, "requests_with_hits": 20.0, "full_prompt_hits": 0.0},
                            usage_in_stream=False)
    assert theirs.hit_rate_source == "server" and theirs.hit_rate == pytest.approx(4908 / 6135)
    from dataclasses import asdict

    result = {"workload": asdict(WORKLOAD), "model": "smollm2-135m", "num_threads": 2, "versions": {"sglang": "0.5.23"},
              "llama_cpp_gguf": "smollm2-135m.Q4_1.gguf", "runs": [field._run_dict(run), field._run_dict(theirs)],
              "skipped": {"guidellm": "guidellm is not installed"}}
    text = field.field_markdown(result)
    assert "**SGLang bench_serving 0.5.23**" in text
    assert ("| prefixcache | 20/20 | 600 / 2,600 | 190 / 340 | 9.6 | 2.40 | 80.0% | 80.0% | 1.000 | 4,911 | 4,911 |"
            in text)
    assert ("| llama.cpp server | 20/20 | 1,800 / 2,900 | 30 / 40 | 5.0 | 1.00 | 80.0% (log) | 80.0% | 1.000 | – | "
            "4,908 (log) |" in text)
    assert "llama.cpp: smollm2-135m.Q4_1.gguf" in text and "carry no `usage`" in text
    assert "**GuideLLM**: not run: guidellm is not installed" in text
    result["skipped"][field.LLAMA_CPP] = "not installed"
    result["runs"] = result["runs"][:1]
    text = field.field_markdown(result)
    assert "llama.cpp server: not run: not installed" in text and "carry no `usage`" not in text


def test_a_tool_named_twice_is_installed_once(monkeypatch):
    # `--install-field-tools sglang,sglang`: two installs at once would both rmtree and rebuild one venv
    calls = []
    monkeypatch.setattr(field, "install_tool", lambda tool, log: calls.append(tool) or 1.0)
    assert field.install_tools(["sglang", "aiperf", "sglang"]) == {"sglang": 1.0, "aiperf": 1.0}
    assert sorted(calls) == ["aiperf", "sglang"]
