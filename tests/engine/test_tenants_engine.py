"""Tenant namespaces with an approved shared system prompt, end to end on SmolLM2 (offline API).

Two tenants share the approved system prompt's full blocks, never each other's private
continuations, and every output equals a cold run.
"""

from __future__ import annotations

import pytest

from prefixcache.sampling_params import SamplingParams
from tests.engine.test_prefix_caching import GREEDY, SYSTEM, cold

QUESTION = "Can I bring my bicycle on the night train to Vienna?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.mark.parametrize("partial", [False, True])
def test_two_tenants_share_only_the_approved_system_prompt(make_llm, partial):
    llm = make_llm(enable_partial_block_reuse=partial)
    approved_len = llm.add_approved_system_prompt(SYSTEM)
    prompt = llm.apply_chat_template(CHAT)
    assert prompt[:approved_len] == llm.apply_chat_template(CHAT[:1], add_generation_prompt=False)
    shared = approved_len // 16 * 16
    assert 0 < shared < len(prompt) - 16  # the private part spans more than one block

    first = llm.chat(CHAT, GREEDY, tenant="acme", use_tqdm=False)[0]
    other = llm.chat(CHAT, GREEDY, tenant="globex", use_tqdm=False)[0]
    again = llm.chat(CHAT, GREEDY, tenant="acme", use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == shared  # the approved blocks only, not even a partial copy
    full = (len(prompt) - 1) // 16 * 16
    assert again.num_cached_tokens == (len(prompt) - 1 if partial else full)
    expected = cold(make_llm, [prompt])[0]
    assert first.token_ids == other.token_ids == again.token_ids == expected


def test_private_system_prompts_are_not_shared(make_llm):
    llm = make_llm(enable_partial_block_reuse=False)
    llm.add_approved_system_prompt("You are a helpful assistant.")  # approved, but not this one
    llm.chat(CHAT, GREEDY, tenant="acme", use_tqdm=False)
    other = llm.chat(CHAT, GREEDY, tenant="globex", use_tqdm=False)[0]
    # Only the template's "<|im_start|>system\n" head is common with the approved text: < 1 block.
    assert other.num_cached_tokens == 0
    assert llm.chat(CHAT, GREEDY, tenant="acme", use_tqdm=False)[0].num_cached_tokens > 0


def test_approved_text_prefix_for_completions(make_llm):
    llm = make_llm(enable_partial_block_reuse=False)
    doc = " ".join(["The rail company publishes its timetable every spring."] * 6)
    n = llm.add_approved_prefix(doc)
    prompts = [doc + " Question from acme: when does the summer timetable start?",
               doc + " Question from acme: when does the summer timetable start?"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[0], params, tenant="acme", use_tqdm=False)
    out = llm.generate(prompts[1], params, tenant="globex", use_tqdm=False)[0]
    assert out.num_cached_tokens == n // 16 * 16 > 0


def test_bad_tenant_is_a_value_error(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="tenant must be"):
        llm.generate("hello", GREEDY, tenant="")
    with pytest.raises(ValueError, match="tenant contains a lone surrogate") as e:
        llm.generate("hello", GREEDY, tenant="acme\udfff")
    assert e.value.field == "tenant"
    assert llm.generate("hello", GREEDY, tenant="acme")[0].finish_reason == "length"
    with pytest.raises(ValueError, match="approved system prompt"):
        llm.add_approved_system_prompt("")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.add_approved_prefix("")
