"""``attention_dtype="int8"`` end to end on the default model in bfloat16: batch-invariant, cache on == off to
the bit, keyed apart from float attention, and within a small perplexity cost of it."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import assert_cached_prompt_logprobs_equal_a_cold_run, seed_prompts

from prefixcache.bench.quality import perplexity
from prefixcache.bench.texts import RAG_DOCUMENT
from prefixcache.errors import InvalidInputError
from prefixcache.kernels.prefill_attention import INT8_FORM, form_supported
from prefixcache.llm import LLM
from prefixcache.sampling_params import SamplingParams

pytestmark = [pytest.mark.requires_format("bfloat16", "none"),
              pytest.mark.skipif(not form_supported(INT8_FORM), reason="the kernel's AVX2 form needs AVX2, FMA, F16C")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_int8_attention(smollm2):  # depends on smollm2: marked slow, loaded after the fp32 copy is cached
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m", dtype=torch.bfloat16, attention_dtype="int8")


@pytest.fixture(scope="module")
def bf16(smollm2):
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m", dtype=torch.bfloat16)


def make(loaded, **options):
    return LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", quantization="none",
               attention_dtype=loaded.model.attention_dtype, num_threads=2, **options)


def test_one_batch_equals_one_at_a_time_and_cache_off(bf16_int8_attention):
    llm = make(bf16_int8_attention)
    assert llm.engine.loaded.model.paged_attention_form == INT8_FORM
    prompts = seed_prompts(llm)
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.get_metrics().num_hit_requests == 9
    off = make(bf16_int8_attention, enable_prefix_caching=False)
    alone = [off.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert batched == alone
    assert [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts] == alone


def test_prompt_logprobs_from_the_cache_equal_a_cold_run(bf16_int8_attention):
    assert_cached_prompt_logprobs_equal_a_cold_run(lambda **options: make(bf16_int8_attention, **options), 4)


def test_keyed_apart_from_float_attention_and_close_to_it(bf16_int8_attention, bf16):
    int8, flt = make(bf16_int8_attention), make(bf16)
    assert int8.engine.root_key() != flt.engine.root_key()
    prompts = seed_prompts(int8)
    a = [o.token_ids for o in int8.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.token_ids for o in flt.generate(prompts, GREEDY, use_tqdm=False)]
    assert sum(x[0] == y[0] for x, y in zip(a, b)) >= 9, (a, b)
    ids = bf16.tokenizer(RAG_DOCUMENT).input_ids
    ppl_int8, ppl_float = perplexity(bf16_int8_attention, ids), perplexity(bf16, ids)
    assert ppl_int8 != ppl_float and abs(ppl_int8 / ppl_float - 1) < 0.005, (ppl_int8, ppl_float)


def test_refused_where_it_cannot_run_or_the_model_disagrees(smollm2, bf16_int8_attention):
    with pytest.raises(InvalidInputError, match="float32 model without int8 weights") as e:
        LLM("smollm2-135m", loaded=smollm2, attention_dtype="int8")
    assert e.value.field == "attention_dtype"
    with pytest.raises(InvalidInputError, match="loaded with 'int8'") as e:
        LLM("smollm2-135m", loaded=bf16_int8_attention, dtype="bfloat16", quantization="none")
    assert e.value.field == "attention_dtype"
    with pytest.raises(ValueError, match="float32 model without int8 weights"):
        smollm2.model.set_attention_dtype("int8")
    with pytest.raises(ValueError, match="attention_dtype must be one of"):
        smollm2.model.set_attention_dtype("fp8")
    assert smollm2.model.attention_dtype == "float"
