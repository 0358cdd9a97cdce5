"""Golden test: our engine's greedy ids == transformers' generate(do_sample=False) on SmolLM2.

Both sides stop at EOS (<|im_end|>) or after 32 tokens. The expected ids live in golden/smollm2_greedy.json, produced by transformers on the same
converted weights; `pytest --regen-golden` recomputes them. Each prompt also stores the
reference's top-2 logit gap per step: a mismatch is accepted only at a floating-point near-tie
(gap < 1e-3, in logprob units), the vLLM-style fallback the issue allows, and nowhere else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixcache.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "smollm2_greedy.json"
MAX_TOKENS = 32
NEAR_TIE = 1e-3

TEXT_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Paris is the capital of France. Berlin is the capital of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Give me three tips for learning a new language."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and French."}],
    [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
]


def golden_prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in TEXT_PROMPTS]
    for chat in CHATS:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def reference_greedy(model_dir: Path, prompts: list[list[int]]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for ids in prompts:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=MAX_TOKENS,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        gaps = []
        for logits in out.logits:
            top2 = logits[0].float().log_softmax(-1).topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        results.append({"prompt_token_ids": ids, "token_ids": out.sequences[0, len(ids):].tolist(), "top2_gaps": gaps})
    return results


def assert_greedy_matches(ours: list[int], ref: list[int], gaps: list[float], what: str) -> None:
    """Exact equality, except that divergence at a recorded near-tie ends the comparison."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"{what}: token {i} is {a}, reference {b} (top-2 gap {gaps[i]:.2e})"
            return
    assert len(ours) == len(ref), what


@pytest.fixture(scope="module")
def golden(request, smollm2):
    prompts = golden_prompts(smollm2.tokenizer)
    if request.config.getoption("--regen-golden") or not GOLDEN.exists():
        data = reference_greedy(smollm2.model_dir, prompts)
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(data, indent=1))
    data = json.loads(GOLDEN.read_text())
    assert [d["prompt_token_ids"] for d in data] == prompts, "tokenizer changed: run pytest --regen-golden"
    return data


def test_greedy_matches_transformers_batched(make_llm, golden):
    llm = make_llm(enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([d["prompt_token_ids"] for d in golden], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, golden)):
        assert_greedy_matches(out.token_ids, ref["token_ids"], ref["top2_gaps"], f"prompt {i}")


def test_greedy_matches_transformers_one_at_a_time_with_cache(make_llm, golden):
    """Same ids when prompts run alone, each after the others have filled the cache."""
    # Full-block hits only, so the expected count is simple; partial reuse: test_eviction_and_partial.py.
    llm = make_llm(enable_prefix_caching=True, enable_partial_block_reuse=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, ref in enumerate(golden):
        (out,) = llm.generate(ref["prompt_token_ids"], params, use_tqdm=False)
        assert_greedy_matches(out.token_ids, ref["token_ids"], ref["top2_gaps"], f"prompt {i}")
    # Second pass: every prompt now hits its own cached full blocks.
    for i, ref in enumerate(golden):
        (out,) = llm.generate(ref["prompt_token_ids"], params, use_tqdm=False)
        n = len(ref["prompt_token_ids"])
        assert out.num_cached_tokens == (n - 1) // 16 * 16
        assert_greedy_matches(out.token_ids, ref["token_ids"], ref["top2_gaps"], f"prompt {i} warm")
