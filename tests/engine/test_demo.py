"""The seed demo's report on the real model (issue 2's "done when" numbers)."""

from prefixcache.entrypoints.cli.demo import run_demo
from prefixcache.kernels.cpu_features import describe_cpu


def test_demo_report(smollm2):
    r = run_demo(loaded=smollm2, num_threads=2)
    assert r["format"] == "dtype float32, quantization none" and r["cpu"] == describe_cpu()
    assert r["outputs_equal"] is True
    assert (r["num_requests"], r["hit_requests"]) == (10, 9)
    assert r["prefill_tokens_no_cache"] == r["prompt_tokens"]
    # The shared prefix (system message + user header) is computed once; 9 requests reuse its full blocks.
    shared_full_blocks = min(a["num_cached_tokens"] for a in r["answers"][1:]) // 16
    assert shared_full_blocks == 7
    assert r["prefill_tokens_cache"] == r["prompt_tokens"] - 9 * 7 * 16
    assert r["saved_fraction"] >= 0.70
    assert all(a["answer"].strip() for a in r["answers"])


def test_demo_progress_path_generates_what_generate_does(smollm2):
    """The demo drives the engine itself (to count tokens for its bar): same tokens as ``LLM.chat``."""
    from prefixcache.entrypoints.cli.demo import conversations, generate_with_progress
    from prefixcache.llm import LLM
    from prefixcache.sampling_params import SamplingParams

    llm = LLM("smollm2-135m", loaded=smollm2, num_threads=2, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [llm.apply_chat_template(c) for c in conversations()[:3]]
    ours = generate_with_progress(llm, prompts, params, "test", progress=True)
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in reference]
    assert [o.text for o in ours] == [o.text for o in reference]
    assert [o.num_prompt_tokens for o in ours] == [len(p) for p in prompts]
    assert all(o.finished for o in ours)


def test_generate_draws_its_bar_only_on_a_terminal(smollm2, monkeypatch):
    """``use_tqdm`` shows the bar where stderr is a terminal; into a log or pipe (CI) it writes nothing."""
    import io
    import sys

    from prefixcache.llm import LLM
    from prefixcache.sampling_params import SamplingParams

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    llm = LLM("smollm2-135m", loaded=smollm2, num_threads=2)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        outputs = llm.generate(["Hi", "Hello there"], params)
        assert [len(o.token_ids) for o in outputs] == [2, 2]
        assert ("Generating" in stream.getvalue()) is shown
