"""Checks shared by the weight-format engine tests (bf16, int8, int8 attention) on the default model."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.llm import LLM
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams


def seed_prompts(llm: LLM) -> list[str]:
    """The seed chat prompts (system prompt + each question) in the model's chat template."""
    return [llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                     {"role": "user", "content": q}]) for q in QUESTIONS]


def assert_cached_prompt_logprobs_equal_a_cold_run(make: Callable[..., LLM], num_logprobs: int) -> None:
    """A warm request's prompt logprobs, 63 of them from cached blocks (a 70-token request cached 4 blocks of 16),
    have the bits of a cold run chunked otherwise (cache off, 50-token steps). ``make(**options)`` builds an engine
    in the format under test."""
    llm = make()
    prompt = seed_prompts(llm)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_logprobs)
    llm.generate([prompt[:70]], params, use_tqdm=False)
    warm = llm.generate([prompt], params, use_tqdm=False)[0]
    assert warm.num_cached_prompt_logprobs == 63  # 4 blocks of 16, less token 0
    cold = make(enable_prefix_caching=False, max_num_batched_tokens=50).generate([prompt], params, use_tqdm=False)[0]
    assert warm.prompt_logprobs == cold.prompt_logprobs
