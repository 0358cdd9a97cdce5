"""The speed workload: its table and goals from given numbers, the measuring protocol on a fake engine,
llama.cpp's skip path and GGUF choice (no model), then one tiny real run (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixcache.bench import llamacpp_baseline, speed
from prefixcache.bench.goals import speed_targets
from prefixcache.bench.report import markdown, speed_markdown
from prefixcache.bench.speed import (HF, LLAMA_CPP, OURS, SpeedSizes, gguf_for_model, llama_cpp_skip_reason,
                                     measure_engine, speed_goals, speed_table)
from prefixcache.bench.workloads import SpeedPrompts
from prefixcache.config import DEFAULT_MODEL, GEMMA3_MODEL
from prefixcache.models import fetch


def make_section(engines: dict, long: bool = False, skipped: dict | None = None, model: str = DEFAULT_MODEL) -> dict:
    section = {
        "name": "speed", "threads": 2, "sizes": {**vars(SpeedSizes(long=long))},
        "prompt_tokens": {"cold": 2178, "shared_prefix": 2032, "per_request": [2178] * 10, "short": 130,
                          "long": 8000 if long else None},
        "engines": engines, "skipped": skipped or {}, "on_over_off_source": "given",
    }
    section["table"] = speed_table(section, model)
    section["goals"] = speed_goals(section, model)
    return section


# The issue's table (transformers, llama.cpp) and made-up numbers for ours.
ISSUE_HF = {"label": "transformers fp32", "cold_ttft_s": 3.16, "warm_ttft_s": 0.259,
            "batch_output_tokens_per_s": 15.1, "decode_tokens_per_s": 20.7, "long_prefill_s": 24.1,
            "long_decode_ms_per_token": 77.0, "batch_same_tokens_as_ours": 1.0}
ISSUE_LLAMA = {"label": "llama.cpp Q4_1", "cold_ttft_s": 5.99, "warm_ttft_s": 0.310,
               "batch_output_tokens_per_s": 24.1, "decode_tokens_per_s": 90.0, "long_prefill_s": 30.0,
               "long_decode_ms_per_token": 12.0, "batch_same_tokens_as_ours": 0.5}
OURS_NUMBERS = {"label": "prefixcache float32", "cold_ttft_s": 1.58, "warm_ttft_s": 0.077,
                "batch_output_tokens_per_s": 151.0, "decode_tokens_per_s": 99.0, "long_prefill_s": 12.0,
                "long_decode_ms_per_token": 31.0, "on_over_off": 0.99, "batch_same_tokens_as_ours": 1.0}


def test_table_ratios_are_ours_over_theirs():
    s = make_section({HF: ISSUE_HF, LLAMA_CPP: ISSUE_LLAMA, OURS: OURS_NUMBERS}, long=True)
    rows = {r["metric"]: r for r in s["table"]}
    assert list(rows) == ["cold_ttft_s", "warm_ttft_s", "batch_output_tokens_per_s", "decode_tokens_per_s",
                          "long_prefill_s", "long_decode_ms_per_token", "on_over_off"]
    assert rows["cold_ttft_s"]["label"] == "cold TTFT, 2,178-token prompt"
    assert rows["warm_ttft_s"]["label"] == "warm TTFT, 2,032-token prefix reused (median of 9)"
    assert rows["batch_output_tokens_per_s"]["label"].startswith("10 requests x 32 greedy tokens")
    assert rows["long_prefill_s"]["label"] == "cold prefill, 8,000-token prompt"
    assert rows["cold_ttft_s"]["values"] == {HF: 3.16, LLAMA_CPP: 5.99, OURS: 1.58}
    assert rows["cold_ttft_s"]["ours_over"] == {HF: pytest.approx(0.5), LLAMA_CPP: pytest.approx(1.58 / 5.99)}
    assert rows["batch_output_tokens_per_s"]["ours_over"][HF] == pytest.approx(10.0)
    assert rows["on_over_off"]["values"] == {HF: None, LLAMA_CPP: None, OURS: 0.99}
    assert rows["on_over_off"]["ours_over"] == {HF: None, LLAMA_CPP: None}
    assert rows["warm_ttft_s"]["target"] == "<= 0.08" and rows["decode_tokens_per_s"]["target"] == ">= 100"


def test_goals_follow_the_issue_targets():
    s = make_section({HF: ISSUE_HF, LLAMA_CPP: ISSUE_LLAMA, OURS: OURS_NUMBERS}, long=True)
    got = [(g["target"], round(g["value"], 4), g["met"]) for g in s["goals"]]
    assert got == [
        ("<= 0.08", 0.077, True),                         # warm TTFT
        ("<= 0.3", round(0.077 / 0.259, 4), True),        # vs transformers
        ("<= 0.3", round(0.077 / 0.310, 4), True),        # vs llama.cpp
        (">= 120", 151.0, True),                          # 10 x 32
        (">= 5", round(151 / 24.1, 4), True),             # vs llama.cpp
        (">= 8", round(151 / 15.1, 4), True),             # vs transformers
        (">= 100", 99.0, False),                          # single decode
        ("<= 1.5", 1.58, False),                          # cold TTFT
        ("<= 0.5", 0.5, True),                            # cold vs transformers
        ("<= 12", 12.0, True),                            # 8k prefill
        ("<= 30", 31.0, False),                           # decode at 8k
        (">= 0.99", 0.99, True),                          # cache on / off
    ]
    assert s["goals"][1]["goal"].endswith(": ours / transformers")
    assert s["goals"][0]["goal"].startswith("warm TTFT") and s["goals"][0]["goal"].endswith("(s)")


def test_without_llama_cpp_or_long_context_its_goals_are_not_measured():
    s = make_section({HF: ISSUE_HF, OURS: OURS_NUMBERS}, skipped={LLAMA_CPP: "not measured: no llama_cpp"})
    assert not any(r["metric"].startswith("long_") for r in s["table"])
    vs_llama = [g for g in s["goals"] if g["goal"].endswith("ours / llama.cpp")]
    assert len(vs_llama) == 2 and all(g["value"] is None and g["met"] is None for g in vs_llama)
    assert len(s["goals"]) == 10
    md = "\n".join(speed_markdown(s))
    assert "| llama.cpp (not measured) |" in md
    assert "llama.cpp: not measured: no llama_cpp." in md
    assert "| cold TTFT, 2,178-token prompt (s) | 3.160 | – | 1.580 | 0.50 | – |" in md


def test_gemma3_is_judged_by_its_own_goals_against_the_same_runs_llama_cpp():
    """gemma3-270m's goals: warm TTFT <= 0.5x llama.cpp's, decode >= llama.cpp's; none of the default
    model's absolute targets (cold TTFT <= 1.5 s, ...) in its rows or its table."""
    engines = {HF: ISSUE_HF, LLAMA_CPP: ISSUE_LLAMA, OURS: OURS_NUMBERS}
    s = make_section(engines, model=GEMMA3_MODEL)
    got = [(g["goal"], g["target"], round(g["value"], 4), g["met"]) for g in s["goals"]]
    assert got == [
        ("warm TTFT, 2,032-token prefix reused (median of 9): ours / llama.cpp", "<= 0.5",
         round(0.077 / 0.310, 4), True),
        ("single-sequence decode (128 tokens): ours / llama.cpp", ">= 1", round(99.0 / 90.0, 4), True),
    ]
    assert all(r["target"] is None for r in s["table"])  # both goals are ratios: no absolute target shown
    slower = make_section({**engines, OURS: {**OURS_NUMBERS, "warm_ttft_s": 0.2, "decode_tokens_per_s": 80.0}},
                          model=GEMMA3_MODEL)
    assert [(round(g["value"], 4), g["met"]) for g in slower["goals"]] == [(round(0.2 / 0.31, 4), False),
                                                                            (round(80 / 90, 4), False)]
    no_llama = make_section({HF: ISSUE_HF, OURS: OURS_NUMBERS}, model=GEMMA3_MODEL)
    assert [(g["value"], g["met"]) for g in no_llama["goals"]] == [(None, None), (None, None)]
    assert speed_targets("my-local-model") == ()  # a model without goals of its own gets none
    assert make_section(engines, model="my-local-model")["goals"] == []


def test_markdown_of_a_speed_only_run():
    s = make_section({HF: ISSUE_HF, LLAMA_CPP: ISSUE_LLAMA, OURS: OURS_NUMBERS})
    result = {"model": "m", "date": "d", "command": None, "workloads": [], "micro": [], "speed": s,
              "machine": {"cpu_cores": 2, "threads": 2, "torch": "t", "load_average_start": [0.0, 0, 0],
                          "load_average_end": [0.0, 0, 0]},
              "goals": [dict(g, workload="speed") for g in s["goals"]]}
    md = markdown(result)
    assert "## Speed, side by side (2 threads" in md and "## Prefill and cache" not in md
    assert "| speed | warm TTFT, 2,032-token prefix reused (median of 9) (s) | <= 0.08 | 0.077 | yes |" in md
    assert "requests with the same tokens as ours: transformers 100%, llama.cpp 50%" in md


class FakeEngine:
    """Returns exactly ``max_tokens`` ids with scripted timings; records what it was asked."""

    label = "fake"

    def __init__(self):
        self.calls = []
        self.cached = False

    def reset(self):
        self.calls.append("reset")
        self.cached = False

    def share_prefix(self, prefix):
        self.calls.append(("share", len(prefix)))

    def timed_generate(self, prompt, max_tokens):
        self.calls.append(("gen", len(prompt), max_tokens))
        ttft = 0.1 if self.cached else 1.0 + len(self.calls) / 1000  # cold samples differ a little
        self.cached = True
        return [7] * max_tokens, ttft, ttft + 0.01 * (max_tokens - 1)

    def generate_all(self, prompts, max_tokens):
        self.calls.append(("all", len(prompts), max_tokens))
        return [[7] * max_tokens for _ in prompts]


def test_measure_engine_protocol_on_a_fake_engine():
    prompts = SpeedPrompts(shared=[[1] * 20 + [i] * 5 for i in range(4)], prefix_tokens=20, short=[3] * 6,
                           long=[4] * 50)
    sizes = SpeedSizes(num_requests=4, max_tokens=3, decode_tokens=5, long=True, long_prompt_tokens=50,
                       long_decode_tokens=4)
    engine = FakeEngine()
    numbers, batch_ids = measure_engine(engine, prompts, sizes, cold_samples=2)
    assert engine.calls == [
        ("gen", 6, 2),                                    # warm-up
        "reset", ("gen", 25, 1), "reset", ("gen", 25, 1),  # two cold samples
        ("share", 20), ("gen", 25, 1), ("gen", 25, 1), ("gen", 25, 1),  # three warm
        "reset", ("share", 20), ("all", 4, 3),            # batch, from nothing reused
        "reset", ("gen", 6, 5),                           # single-sequence decode
        "reset", ("gen", 50, 4), "reset",                 # long context
    ]
    assert numbers["cold_ttft_s"] == pytest.approx((1.003 + 1.005) / 2)
    assert numbers["cold_ttft_samples_s"] == [pytest.approx(1.003), pytest.approx(1.005)]
    assert numbers["warm_ttft_s"] == 0.1 and numbers["num_warm"] == 3
    assert numbers["batch_output_tokens"] == 12 and batch_ids == [[7] * 3] * 4
    assert numbers["decode_output_tokens"] == 5 and numbers["decode_tokens_per_s"] == pytest.approx(100.0)
    assert numbers["long_output_tokens"] == 4 and numbers["long_decode_ms_per_token"] == pytest.approx(10.0)
    assert numbers["long_prefill_s"] == pytest.approx(1.016)


def test_sizes_are_validated():
    SpeedSizes().validate(8192)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 2"):
        SpeedSizes(num_requests=1).validate(8192)
    with pytest.raises(ValueError, match="decode_tokens"):
        SpeedSizes(decode_tokens=1).validate(8192)
    SpeedSizes(long_prompt_tokens=9000).validate(8192)  # long context not asked for: fine
    with pytest.raises(ValueError, match="context 8192"):
        SpeedSizes(long=True, long_prompt_tokens=8190).validate(8192)


def test_llama_cpp_missing_is_a_clear_skip(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    why = llamacpp_baseline.llama_cpp_missing()
    assert why.startswith("llama-cpp-python is not importable")
    assert "pip install 'prefixcache[llamacpp]'" in why and "PREFIXCACHE_LLAMACPP=1" in why
    assert llamacpp_baseline.llama_cpp_version() is None
    reason, gguf = llama_cpp_skip_reason("smollm2-135m", 2)
    assert gguf is None and reason == f"not measured: {why}"
    assert llama_cpp_skip_reason("smollm2-135m", 2, skip=True) == ("skipped (--skip-llamacpp)", None)


def test_gguf_for_model(tmp_path, monkeypatch):
    home = tmp_path / "home"
    kept = fetch.default_gguf_path(home)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("no download when present"))
    assert gguf_for_model("smollm2-135m", home) == kept
    own = tmp_path / "other.Q8_0.gguf"
    own.write_bytes(b"GGUF")
    assert gguf_for_model(str(own), home) == own
    assert speed._quant_name(own) == "Q8_0" and speed._quant_name(kept) == "Q4_1"
    assert gguf_for_model(str(tmp_path), home) is None  # an HF directory has no GGUF
    assert gguf_for_model(str(tmp_path / "missing.gguf"), home) is None
    gemma = fetch.gemma3_gguf_path(home)  # Gemma 3's Q4_K_M file, kept by its fetch: llama.cpp runs the same GGUF
    gemma.write_bytes(b"GGUF")
    assert gguf_for_model("gemma3-270m", home) == gemma
    assert speed._quant_name(gemma) == "Q4_K_M"


def test_llama_cpp_skip_reason_without_a_gguf_or_when_the_probe_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp_baseline, "llama_cpp_missing", lambda: None)
    reason, gguf = llama_cpp_skip_reason(str(tmp_path), 2)
    assert gguf is None and "has no GGUF file" in reason
    own = tmp_path / "m.Q4_1.gguf"
    own.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp_baseline, "llama_cpp_probe", lambda path, threads: f"probe of {path.name} died")
    assert llama_cpp_skip_reason(str(own), 2) == ("not measured: probe of m.Q4_1.gguf died", None)
    monkeypatch.setattr(llamacpp_baseline, "llama_cpp_probe", lambda path, threads: None)
    assert llama_cpp_skip_reason(str(own), 2) == (None, own)


def test_llama_cpp_probe_reports_a_child_killed_by_a_signal(monkeypatch):
    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, -4, "", "")  # SIGILL

    monkeypatch.setattr(llamacpp_baseline.subprocess, "run", run)
    why = llamacpp_baseline.llama_cpp_probe("m.gguf", 2)
    assert why.startswith("a llama.cpp probe died with SIGILL") and "-mno-amx-int8" in why
    monkeypatch.setattr(llamacpp_baseline.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom\nValueError: bad file"))
    assert llamacpp_baseline.llama_cpp_probe("m.gguf", 2) == "a llama.cpp probe failed (exit 1: ValueError: bad file)"


# ---------------------------------------------------------------------------------------- real, tiny

TINY_SPEED = SpeedSizes(prefix_tokens=64, num_requests=3, max_tokens=3, decode_tokens=4, long=True,
                        long_prompt_tokens=200, long_decode_tokens=3)


@pytest.mark.slow
def test_tiny_speed_run(smollm2, tmp_path, monkeypatch):
    from prefixcache.bench import runner
    from prefixcache.bench.runner import BenchOptions, run_bench

    modes = []  # caching on / off of each timed no-sharing run, in order
    run_rounds = runner.run_rounds

    def recording_run_rounds(llm, *args, **kwargs):
        modes.append("on" if llm.engine.kv_cache_manager.enable_caching else "off")
        return run_rounds(llm, *args, **kwargs)

    monkeypatch.setattr(runner, "run_rounds", recording_run_rounds)
    opts = BenchOptions(workloads=("speed",), speed=TINY_SPEED, num_requests=2, max_tokens=2, num_threads=2,
                        cold_samples=1, micro=False, out=str(tmp_path), skip_vllm=True, skip_openvino=True)
    result = run_bench(opts, loaded=smollm2, log=lambda s: None)
    assert modes == ["on", "off"] + ["off", "on", "on", "off"] * 4  # 9 pairs, order alternating
    s = result["speed"]
    # the venv baselines have their own test (tests/bench/test_baselines.py)
    assert {e: s["skipped"][e] for e in speed.VENV_ENGINES} == {
        speed.VLLM: "skipped (--skip-vllm)", speed.OPENVINO: "skipped (--skip-openvino)"}
    skipped = {e: why for e, why in s["skipped"].items() if e not in speed.VENV_ENGINES}
    if LLAMA_CPP in s["engines"]:  # importable, and its probe ran
        assert list(s["engines"]) == [OURS, HF, LLAMA_CPP] and skipped == {}
        assert s["engines"][LLAMA_CPP]["label"].startswith("llama.cpp Q4_1 (llama-cpp-python ")
    else:
        assert list(s["engines"]) == [OURS, HF] and list(skipped) == [LLAMA_CPP]
        missing = llamacpp_baseline.llama_cpp_missing()
        assert s["skipped"][LLAMA_CPP].startswith(f"not measured: {missing or 'a llama.cpp probe'}")
    assert result["workloads"] == [] and json.loads((tmp_path / "bench.json").read_text())["speed"] == s
    assert s["prompt_tokens"]["shared_prefix"] <= 64 and s["prompt_tokens"]["long"] == 200
    assert s["prompt_tokens"]["cold"] == s["prompt_tokens"]["per_request"][0] > 64
    for name, e in s["engines"].items():
        assert e["batch_output_tokens"] == 3 * 3, name
        assert e["decode_output_tokens"] == 4 and e["long_output_tokens"] == 3, name
        assert e["num_warm"] == 2 and len(e["cold_ttft_samples_s"]) == 1, name
        for key in ("cold_ttft_s", "warm_ttft_s", "batch_output_tokens_per_s", "decode_tokens_per_s",
                    "long_prefill_s", "long_decode_ms_per_token"):
            assert e[key] > 0, (name, key)
    assert s["engines"][OURS]["label"] == "prefixcache float32"
    assert s["engines"][HF]["batch_same_tokens_as_ours"] == 1.0  # fp32, same weights, greedy
    assert s["engines"][OURS]["on_over_off"] > 0 and "measured for this table" in s["on_over_off_source"]
    assert "median of 9 back-to-back pairs of runs" in s["on_over_off_source"]  # on and off, 9 times
    assert len(s["table"]) == 7 and len(s["goals"]) == 12
    assert {g["workload"] for g in result["goals"]} == {"speed"}
    md = (tmp_path / "bench.md").read_text()
    assert "## Speed, side by side" in md and "| cold TTFT, " in md
    assert (tmp_path / "speed.png").stat().st_size > 0


def test_speed_is_not_in_all_but_combines_with_it():
    from prefixcache.bench.cli import parse_workloads
    from prefixcache.bench.workloads import WORKLOAD_NAMES

    assert parse_workloads("all") == WORKLOAD_NAMES and "speed" not in WORKLOAD_NAMES
    assert parse_workloads("speed") == ("speed",)
    assert parse_workloads("all, speed,seed") == (*WORKLOAD_NAMES, "speed")
