"""bfloat16 end to end on the default model: batch-invariant, so cache on == cache off exactly.

Its GEMMs run in calls of <= 32 rows (oneDNN gives a row the same bits for any such call; see
``prefixcache.layers.lora.row_tiled_linear``) and its attention pads as the int8 format's does.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.llm import LLM
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2):  # depends on smollm2: marked slow, loaded after the fp32 copy is cached
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m", dtype=torch.bfloat16)


def make(loaded, **options):
    return LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", num_threads=2, **options)


def test_bf16_one_batch_equals_one_at_a_time_and_cache_off(smollm2_bf16):
    llm = make(smollm2_bf16)
    assert llm.engine.runner.model.batch_invariant
    prompts = [llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": q}]) for q in QUESTIONS[:6]]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.get_metrics().num_hit_requests == 5  # the system prompt, served from the cache
    off = make(smollm2_bf16, enable_prefix_caching=False)
    alone = [off.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert batched == alone  # every prompt, every token
    assert [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts] == alone  # warm


def test_bf16_prompt_logprobs_from_the_cache_equal_a_cold_run(smollm2_bf16):
    llm = make(smollm2_bf16)
    prompt = llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    llm.generate([prompt[:70]], params, use_tqdm=False)
    warm = llm.generate([prompt], params, use_tqdm=False)[0]
    assert warm.num_cached_prompt_logprobs == 63
    cold = make(smollm2_bf16, enable_prefix_caching=False, max_num_batched_tokens=50).generate(
        [prompt], params, use_tqdm=False)[0]
    assert warm.prompt_logprobs == cold.prompt_logprobs  # bit for bit, chunked otherwise


def test_row_tiled_linear_gives_each_row_the_bits_of_a_one_row_call():
    from prefixcache.layers.lora import ROW_TILE, row_tiled_linear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1536, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(100, 576, generator=g).bfloat16()
    single = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(100)])
    assert ROW_TILE == 32
    for m in (1, 7, 32, 33, 64, 100):
        assert torch.equal(row_tiled_linear(x[:m], w), single[:m]), m
    assert torch.equal(row_tiled_linear(x[40:100], w), single[40:100])  # any offset


def test_prepacked_fused_linear_gives_each_row_the_bits_of_a_one_row_call():
    """q, k, v stacked in one prepacked matrix, called with up to PREPACKED_ROW_TILE rows: every row
    has the bits of a one-row call, for calls of any size and any offset (what keeps bf16's fused,
    128-row prefill batch-invariant), and each column slice has the separate modules' shapes."""
    from prefixcache.layers.lora import PREPACKED_ROW_TILE, PrepackedWeight, prepacked_linear_supported, row_tiled_linear

    if not prepacked_linear_supported():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(0)
    mods = [torch.nn.Linear(576, n, bias=False).bfloat16() for n in (576, 192, 192)]
    for m in mods:
        m.weight.data = (torch.randn(m.out_features, 576, generator=g) * 0.05).bfloat16()
    packed = PrepackedWeight(mods)
    x = torch.randn(300, 576, generator=g).bfloat16()
    single = torch.cat([packed.linear(x[i : i + 1]) for i in range(300)])
    assert single.shape == (300, 960) and PREPACKED_ROW_TILE == 128
    for m in (1, 2, 3, 31, 33, 64, 127, 128, 129, 300):
        assert torch.equal(row_tiled_linear(x[:m], None, packed=packed), single[:m]), m
    assert torch.equal(row_tiled_linear(x[40:300], None, packed=packed), single[40:300])  # any offset
    ref = torch.cat([torch.nn.functional.linear(x.float(), m.weight.float()) for m in mods], dim=1)
    assert torch.allclose(single.float(), ref, atol=0.05, rtol=0.02)  # the stacked product, not another
    with torch.no_grad():
        mods[1].weight.mul_(2)  # written in place: the next call repacks
    assert torch.allclose(packed.linear(x[:4]).float()[:, 576:768], 2 * ref[:4, 576:768], atol=0.05, rtol=0.02)
