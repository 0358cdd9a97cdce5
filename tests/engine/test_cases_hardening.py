"""Cases C11, C12, C13, C19, C20 on the real model (offline API), with the values they assert.

- C11: a stop string is found wherever it lies in a step's new text (SmolLM2 has single tokens of
  64 ``=``).
- C12: repeating a prompt of exactly k full blocks keeps one cached copy of each block.
- C13: an engine sharing a loaded model never serves K/V of the weights another engine replaced.
- C19: every claimed hit is work not done: prompt tokens the runner computed == prompt - cached.
- C20: a stop string at the very start of the output.
"""

from __future__ import annotations

import random

import pytest

from prefixcache import LLM, SamplingParams
from prefixcache.models.loader import load_model
from tests.engine.test_prefix_caching import cold, rand_ids

EQUALS = "=" * 64
C11_PROMPT = f"Title\n{EQUALS}\nIntro text.\n\nChapter\n{EQUALS}\nMore text.\n\nAppendix\n"


def test_c11_stop_string_inside_one_long_token(make_llm):
    llm = make_llm()
    unstopped = llm.generate(C11_PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert unstopped.text.startswith(EQUALS)  # the first generated token is 64 '='
    assert llm.tokenizer.decode([unstopped.token_ids[0]]) == EQUALS
    for keep, text in ((False, ""), (True, "===")):
        params = SamplingParams(temperature=0, max_tokens=24, stop=["==="], include_stop_str_in_output=keep)
        out = llm.generate(C11_PROMPT, params, use_tqdm=False)[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", "===")
        assert out.token_ids == unstopped.token_ids[:1]  # stopped by the step that added the match


def test_c20_stop_string_at_the_very_start(make_llm):
    llm = make_llm()
    prompt = "The three primary colors are"
    unstopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    head = unstopped.text[:3]
    assert len(head) == 3
    for keep, text in ((False, ""), (True, head)):
        params = SamplingParams(temperature=0, max_tokens=12, stop=[head], include_stop_str_in_output=keep)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", head)


def test_earliest_stop_string_wins(make_llm):
    """Several stop strings: the one that matches first in the text, not first in the list."""
    llm = make_llm()
    prompt = "Count: one, two, three, four, five, six,"
    unstopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text = unstopped.text
    early, late = text[1:3], text[-3:]
    assert text.find(early) < text.find(late)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[late, early])
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert (out.text, out.stop_reason) == (text[: text.find(early)], early)


@pytest.mark.parametrize("max_tokens, num_cached_blocks", [(1, 3), (20, 4)])
def test_c12_one_prefix_one_cached_copy(make_llm, max_tokens, num_cached_blocks):
    llm = make_llm(block_size=16, num_blocks=64, enable_partial_block_reuse=False)
    prompt = list(range(2000, 2048))  # exactly 3 full blocks
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for i in range(5):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == (0 if i == 0 else 32)
        assert llm.get_metrics().num_blocks_cached == num_cached_blocks
        outs.append(out.token_ids)
    assert outs == [outs[0]] * 5
    assert llm.get_metrics().num_blocks_in_use == 0


def test_c12_same_step_duplicates_cached_once(make_llm):
    llm = make_llm(block_size=16, num_blocks=64, enable_partial_block_reuse=False)
    prompt = list(range(2000, 2048))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs = llm.generate([prompt, prompt, prompt], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]  # the later ones hit blocks cached this step
    assert llm.get_metrics().num_blocks_cached == 3
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


@pytest.fixture(scope="module")
def shared_model():
    """A private copy of the default model: C13 changes its weights in place."""
    return load_model("smollm2-135m")


@pytest.mark.slow  # its own copy of the default model
def test_c13_shared_weights_shared_invalidation(shared_model):
    rng = random.Random(13)
    prompt = rand_ids(rng, 2 * 16 + 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    l1 = LLM(loaded=shared_model, num_threads=2, num_blocks=64)
    l2 = LLM(loaded=shared_model, num_threads=2, num_blocks=64)
    before = l2.generate(prompt, params, use_tqdm=False)[0]
    assert l2.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0
    name = "model.layers.5.self_attn.v_proj.weight"
    original = dict(shared_model.model.named_parameters())[name].detach().clone()
    try:
        l1.load_weights({name: original * 3})
        after = l2.generate(prompt, params, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
        fresh = LLM(loaded=shared_model, num_threads=2, num_blocks=64, enable_prefix_caching=False)
        assert after.token_ids == fresh.generate(prompt, params, use_tqdm=False)[0].token_ids
        assert after.token_ids != before.token_ids  # the new weights really change the output
        # Refused while any engine sharing the model has a request in flight.
        rid = l2.engine.add_request(prompt, params)
        with pytest.raises(ValueError, match="in flight"):
            l1.load_weights({name: original})
        l2.engine.abort_request(rid)
    finally:
        l1.load_weights({name: original})
    restored = l2.generate(prompt, params, use_tqdm=False)[0]
    assert restored.num_cached_tokens == 0 and restored.token_ids == before.token_ids


def _computed(llm) -> int:
    return llm.engine.runner.num_prompt_tokens_computed


def test_c19_reuse_shows_up_in_the_work_done(make_llm):
    """computed == prompt - cached for every request and kind of hit, by the runner's own count."""
    rng = random.Random(19)
    llm = make_llm(block_size=16, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = rand_ids(rng, 137)
    start = _computed(llm)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert _computed(llm) - start == 137 and first.num_cached_tokens == 0
    start = _computed(llm)
    again = llm.generate(prompt, params, use_tqdm=False)[0]  # 8 full blocks + 8 copied (partial hit)
    assert again.num_cached_tokens == 136 and _computed(llm) - start == 1
    shorter = prompt[:100]  # 6 full blocks + a partial hit of 3 tokens
    start = _computed(llm)
    out = llm.generate(shorter, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 99 and _computed(llm) - start == 1
    other = prompt[:40] + rand_ids(rng, 30)  # 2 full blocks + 8 copied, the rest new
    start = _computed(llm)
    out = llm.generate(other, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40 and _computed(llm) - start == 70 - 40
    m = llm.get_metrics()
    assert m.prompt_tokens_computed == _computed(llm)
    assert m.prefix_cache_queries - m.prefix_cache_hits == m.prompt_tokens_computed  # partial copies are hits
    assert [again.token_ids] == cold(make_llm, [prompt], params)
