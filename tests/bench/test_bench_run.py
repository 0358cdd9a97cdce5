"""A tiny run of every workload on the real model: report fields and exact accounting.

Not a timing test: sizes are tiny (2 requests, 2 tokens, shared texts cut to a tenth) and no
timing is asserted.
"""

from __future__ import annotations

import json

import pytest

from prefixcache.bench.accounting import ideal_accounting
from prefixcache.bench.runner import BenchOptions, run_bench, run_rounds
from prefixcache.bench.workloads import WORKLOAD_NAMES, Workload, build_workload
from prefixcache.sampling_params import SamplingParams

from tests.bench.test_bench_accounting import SYNTHETIC

# Full-block sharing only: then computed == ideal exactly (partial-block reuse may compute less).
FULL_BLOCKS = {"enable_partial_block_reuse": False}
TINY = dict(num_requests=2, max_tokens=2, num_turns=2, text_scale=0.1, num_threads=1, cold_samples=1,
            micro_seconds=0.01, engine_options=FULL_BLOCKS)


@pytest.fixture(scope="module")
def tiny_result(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = run_bench(BenchOptions(skip_hf=True, out=str(out), **TINY), loaded=smollm2, log=lambda s: None)
    return result, out


def test_tiny_run_writes_every_output(tiny_result):
    result, out = tiny_result
    for name in ("bench.json", "bench.md", "ttft_cold_vs_warm.png", "prefill_vs_ideal.png", "throughput.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "throughput_vs_transformers.png").exists()  # skip_hf: no transformers bars to show
    assert json.loads((out / "bench.json").read_text())["workloads"][0]["name"] == "seed"
    md = (out / "bench.md").read_text()
    assert all(f"| {name} |" in md for name in WORKLOAD_NAMES)
    assert {m["block_size"] for m in result["micro"]} == {16, 64}
    assert all(m["total_tokens_per_s"] > 0 for m in result["micro"])


def test_tiny_run_report_fields_and_exact_accounting(tiny_result):
    result, _ = tiny_result
    by_name = {w["name"]: w for w in result["workloads"]}
    assert tuple(by_name) == WORKLOAD_NAMES
    for name, w in by_name.items():
        assert set(w) >= {"prefill", "ttft", "throughput", "kv", "worth", "goals", "outputs_equal_on_off"}
        p = w["prefill"]
        assert w["outputs_equal_on_off"], name
        assert p["computed_cache_off"] == w["prompt_tokens"], name
        assert p["computed_cache_on"] == w["prompt_tokens"] - p["hit_tokens"], name
        assert p["computed_cache_on"] == p["ideal"], name  # no missed hit, no eviction
        assert p["computed_equals_ideal"] and p["computed_over_ideal"] == 1.0
        assert p["hit_requests"] == p["ideal_hit_requests"]
        assert w["kv"]["num_evictions"] == 0 and w["kv"]["num_preemptions"] == 0
        assert w["kv"]["peak_blocks_cache_on"] <= w["kv"]["peak_blocks_cache_off"]
        assert w["worth"]["verdict"] in ("worth it", "marginal", "not worth it", "inconclusive")
        assert w["worth"]["reason"]
        th = w["throughput"]
        if w["sharing"] and th["wall_s_cache_on"] > th["wall_s_cache_off"]:  # timed slower: repeated to 3
            assert th["repeats"] >= 3 and th["timing_spread"] is not None, name
        if th["on_over_off"] < 0.95:  # the verdict never contradicts the measurement
            assert w["worth"]["verdict"] in ("not worth it", "inconclusive"), (name, th, w["worth"])
        assert th["output_tokens"] == w["num_requests"] * 2
        assert w["ttft"]["cold_median_s"] > 0
    assert by_name["multi-turn"]["num_rounds"] == 2 and by_name["multi-turn"]["num_requests"] == 4
    for name in ("seed", "system-prompt", "few-shot", "rag-doc", "multi-turn"):
        assert by_name[name]["prefill"]["hit_requests"] >= 1, name
        assert by_name[name]["ttft"]["num_warm"] >= 1, name
    assert by_name["no-sharing"]["prefill"]["hit_tokens"] == 0
    assert by_name["no-sharing"]["worth"]["verdict"] == "not worth it"
    goal_names = {(g["workload"], g["goal"]) for g in result["goals"]}
    assert ("system-prompt", "warm TTFT / cold TTFT") in goal_names
    assert ("no-sharing", "output tok/s caching on / off") in goal_names
    assert ("micro", "hash + verify + lookup tokens/s at block size 16") in goal_names


def test_seed_workload_full_size_accounting_is_exact(make_llm, smollm2):
    # The real seed workload (10 questions), a few tokens each: computed with the cache == ideal.
    workload = build_workload("seed", smollm2.tokenizer, smollm2.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run = run_rounds(make_llm(**FULL_BLOCKS), workload, params)
    prompts = run.rounds[0]
    ideal = ideal_accounting(run.rounds, 16, [[o.token_ids for o in run.outputs[0]]])
    hits = sum(o.num_cached_tokens for o in run.flat)
    assert len(prompts) == 10
    assert run.prompt_tokens_computed == ideal.ideal_prefill_tokens == sum(map(len, prompts)) - hits
    # one shared system prompt: the first request computes it, the nine others hit all its full blocks
    shared = ideal.ideal_hit_tokens // 9
    assert [o.num_cached_tokens for o in run.flat] == [0] + [shared] * 9
    # with the engine's defaults (partial-block reuse may copy more), never more than the ideal
    assert run_rounds(make_llm(), workload, params).prompt_tokens_computed <= ideal.ideal_prefill_tokens


def test_synthetic_token_prompts_match_hand_computed_ideal(make_llm):
    # See test_bench_accounting: block size 4, ideal prefill 20 of 32 prompt tokens.
    prompts = [[100 + t for t in p] for p in SYNTHETIC]
    workload = Workload("synthetic", "hand-made", len(prompts), 1, lambda k, outputs: prompts)
    llm = make_llm(block_size=4, **FULL_BLOCKS)
    run = run_rounds(llm, workload, SamplingParams(temperature=0, max_tokens=1))
    assert run.prompt_tokens_computed == 20
    assert [o.num_cached_tokens for o in run.flat] == [0, 8, 4, 0]


def test_hf_baselines_tiny(smollm2):
    from prefixcache.bench.hf_baselines import VARIANTS, HFBaselines, load_hf_model

    workload = build_workload("seed", smollm2.tokenizer, smollm2.eos_token_ids, num_requests=2)
    rounds = [workload.build_round(0, [])]
    hf = HFBaselines(load_hf_model(smollm2.model_dir), smollm2.eos_token_ids[0], num_threads=2)
    for variant in VARIANTS:
        run = hf.run(variant, rounds, max_tokens=2)
        assert run.num_output_tokens == 4 and all(len(o) == 2 for o in run.output_token_ids)
        assert run.wall_s > 0 and run.output_tokens_per_s > 0
        assert len(run.ttft_s) == (0 if variant == "batched" else 2)
    assert hf.run("prefix_copy", rounds, 2).shared_prefix_tokens > 100
    with pytest.raises(ValueError):
        hf.run("nope", rounds, 2)


def test_bad_options_raise(smollm2):
    with pytest.raises(ValueError, match="workload"):
        run_bench(BenchOptions(workloads=("nope",), out=None), loaded=smollm2)
    with pytest.raises(ValueError, match="max_tokens"):
        run_bench(BenchOptions(max_tokens=0, out=None), loaded=smollm2)
    with pytest.raises(ValueError, match="num_turns"):
        build_workload("multi-turn", smollm2.tokenizer, smollm2.eos_token_ids, num_turns=9)
