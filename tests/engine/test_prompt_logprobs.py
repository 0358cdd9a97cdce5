"""Prompt logprobs (vLLM's ``prompt_logprobs``), served from the prefix cache for cached blocks.

The reference is transformers' own forward pass: ``log_softmax`` of its logits at position i - 1
for prompt token i. A warm request takes its cached blocks' stored entries and computes only the
rest, the first of them from the last cached block's stored hidden state.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

K = 5


def params(k=K, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, "prompt_logprobs": k, **kw})


@pytest.fixture(scope="module")
def prompt(smollm2):
    ids = smollm2.tokenizer(SYSTEM_PROMPT + " " + " ".join(QUESTIONS)).input_ids[:150]
    assert len(ids) == 150
    return ids


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    """transformers' log_softmax for the prompt: [len(prompt), vocab_size]."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(-1)


def own(entries, prompt):
    """Each token's own logprob and rank, from the vLLM-shaped list."""
    assert entries[0] is None
    return [entries[i][t].logprob for i, t in enumerate(prompt) if i], [entries[i][t].rank for i, t in enumerate(prompt) if i]


def test_cold_prompt_logprobs_match_transformers(make_llm, prompt, reference):
    out = make_llm().generate([prompt], params(), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.num_cached_prompt_logprobs == 0
    lps, ranks = own(out.prompt_logprobs, prompt)
    expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), expected, atol=2e-3, rtol=0)
    expected_ranks = (reference[:-1] > expected[:, None]).sum(-1) + 1
    assert sum(r != e for r, e in zip(ranks, expected_ranks.tolist())) <= 2  # near-ties may swap
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert len(entry) in (K, K + 1)  # the top K, then the prompt token when it is not among them
        top = list(entry)[:K]
        assert [entry[t].rank for t in top] == list(range(1, K + 1))
        ref_top = reference[i - 1].topk(K + 1)
        if float((ref_top.values[:-1] - ref_top.values[1:]).min()) > 1e-2:  # no near tie: the same order
            assert top == ref_top.indices[:K].tolist(), i


def test_warm_request_is_served_from_the_cache(make_llm, prompt):
    llm = make_llm()
    first = llm.generate([prompt[:100]], params(), use_tqdm=False)[0]
    computed = llm.engine.runner.num_prompt_tokens_computed
    warm = llm.generate([prompt], params(), use_tqdm=False)[0]
    # 6 full blocks (96 tokens) cached with their entries: only the other 54 prompt tokens run
    assert warm.num_cached_tokens == 96 and warm.num_cached_prompt_logprobs == 95
    assert llm.engine.runner.num_prompt_tokens_computed - computed == 150 - 96
    assert warm.prompt_logprobs[:96] == first.prompt_logprobs[:96]  # the stored entries themselves
    cold = make_llm(enable_prefix_caching=False).generate([prompt], params(), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.num_cached_prompt_logprobs == 0
    # token 96 comes from block 5's stored hidden state, the rest from the computed chunk
    for i in range(1, 150):
        for t, lp in cold.prompt_logprobs[i].items():
            assert warm.prompt_logprobs[i][t].rank == lp.rank or abs(lp.logprob - warm.prompt_logprobs[i][t].logprob) < 1e-4
            assert abs(warm.prompt_logprobs[i][t].logprob - lp.logprob) < 1e-4, (i, t)
    assert warm.prompt_logprobs[96].keys() == cold.prompt_logprobs[96].keys()


def test_blocks_cached_without_entries_are_recomputed_then_serve(make_llm, prompt):
    llm = make_llm()
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    first = llm.generate([prompt], params(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and first.num_cached_prompt_logprobs == 0  # the KV is cached, the
    # entries are not: not a hit for this request
    second = llm.generate([prompt], params(k=2), use_tqdm=False)[0]
    assert second.num_cached_tokens == 144 and second.num_cached_prompt_logprobs == 143
    top2 = [{t: v for t, v in e.items() if v.rank <= 2 or t == p} for e, p in zip(first.prompt_logprobs[1:], prompt[1:])]
    assert top2[:143] == second.prompt_logprobs[1:144]  # stored entries; k=2 is a prefix of the stored top 20
    assert top2[143].keys() == second.prompt_logprobs[144].keys()  # token 144: from the stored hidden state
    assert llm.reset_prefix_cache()
    assert all(b.prompt_logprobs is None for b in llm.engine.kv_cache_manager.block_pool.blocks)


def test_chunked_prefill_and_samples(make_llm, prompt):
    whole = make_llm(enable_prefix_caching=False).generate([prompt], params(), use_tqdm=False)[0]
    chunked_llm = make_llm(enable_prefix_caching=False, max_num_batched_tokens=40)
    outs = chunked_llm.generate([prompt], params(n=2, temperature=1.0, seed=3), use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt_logprobs == outs[1].prompt_logprobs
    for i in range(1, len(prompt)):  # chunk boundaries at 40, 80, 120: the next prompt token's entry
        a, b = whole.prompt_logprobs[i][prompt[i]], outs[0].prompt_logprobs[i][prompt[i]]
        assert abs(a.logprob - b.logprob) < 1e-4, i


@pytest.mark.parametrize("k", [-1, 21, 2.0, True])
def test_bad_prompt_logprobs_are_refused(k):
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(prompt_logprobs=k)
    assert e.value.field == "prompt_logprobs"
