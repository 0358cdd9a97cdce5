"""The field's load generators, run unchanged against a real ``prefixcache serve`` on loopback.

GuideLLM, SGLang's ``bench_serving`` (``--backend sglang-oai --cache-report --flush-cache``) and AIPerf each run
a small shared-prefix workload from their own venv (``prefixcache bench --install-field-tools``; CI creates them
through ``PREFIXCACHE_FIELD_TOOLS=1 scripts/setup.sh``). Each must exit 0 with every request served, report
exactly the cached tokens our ``/metrics`` counters grew by (ours and the vLLM-named ones), and a hit rate of at
least 0.95x the workload's theoretical one. Skipped, with the install command, where a tool's venv is absent.
"""

from __future__ import annotations

import pytest

from prefixcache.bench import field
from prefixcache.bench.field import FieldWorkload, run_tool, start_prefixcache, theoretical_hit_rate, tool_missing

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
    theoretical = theoretical_hit_rate(WORKLOAD, tool, run.succeeded, run.prompt_tokens)
    assert theoretical > 0.6
    assert run.hit_rate >= 0.95 * theoretical, (run.hit_rate, theoretical)
    for value in (run.ttft_p50_ms, run.ttft_p99_ms, run.tpot_p50_ms, run.output_tokens_per_s):
        assert value is not None and value > 0


def test_theoretical_hit_rate_counts_each_prefix_once():
    w = FieldWorkload(groups=2, prefix_tokens=100)
    assert theoretical_hit_rate(w, "sglang", 10, 2000) == pytest.approx(8 * 100 / 2000)
    assert theoretical_hit_rate(w, "aiperf", 10, 2000) == pytest.approx(9 * 100 / 2000)  # one shared system prompt
    assert theoretical_hit_rate(w, "guidellm", 1, 500) == 0.0
    assert theoretical_hit_rate(w, "guidellm", 0, 0) == 0.0


def test_missing_tool_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv(field.VENVS_ENV, str(tmp_path))
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
                         prompt_tokens=6135, cached_tokens=4911, theoretical_hit_rate=0.751,
                         server_counters={"vllm_hits": 4911.0, "vllm_queries": 6438.0, "hits": 4911.0,
                                          "queries": 6438.0})
    from dataclasses import asdict

    result = {"workload": asdict(WORKLOAD), "model": "smollm2-135m", "num_threads": 2, "versions": {"sglang": "0.5.23"},
              "runs": [asdict(run) | {"hit_rate": run.hit_rate}],
              "skipped": {"guidellm": "guidellm is not installed", field.LLAMA_CPP: "not installed"}}
    text = field.field_markdown(result)
    assert "**SGLang bench_serving 0.5.23**" in text
    assert "| prefixcache | 20/20 | 600 / 2,600 | 190 / 340 | 9.6 | 2.40 | 80.0% | 75.1% | 4,911 | 4,911 |" in text
    assert "**GuideLLM**: not run: guidellm is not installed" in text
    assert "llama.cpp server: not run: not installed" in text


def test_a_tool_named_twice_is_installed_once(monkeypatch):
    # `--install-field-tools sglang,sglang`: two installs at once would both rmtree and rebuild one venv
    calls = []
    monkeypatch.setattr(field, "install_tool", lambda tool, log: calls.append(tool) or 1.0)
    assert field.install_tools(["sglang", "aiperf", "sglang"]) == {"sglang": 1.0, "aiperf": 1.0}
    assert sorted(calls) == ["aiperf", "sglang"]
