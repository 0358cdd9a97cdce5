"""bfloat16 end to end on the default model: batch-invariant, so cache on == cache off exactly.

Its GEMMs run in calls of <= 32 rows (oneDNN gives a row the same bits for any such call; see
``prefixcache.layers.linear.row_tiled_linear``) and its attention pads as the int8 format's does.
"""

from __future__ import annotations

import pytest
import torch
from engine_testlib import assert_cached_prompt_logprobs_equal_a_cold_run

from prefixcache.llm import LLM
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_format("bfloat16", "none")  # skipped where this CPU cannot run it

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
    assert_cached_prompt_logprobs_equal_a_cold_run(lambda **options: make(smollm2_bf16, **options), 3)


def _silu_like(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Heavy-tailed rows like SiLU(gate) * up (many small values): with them a one-row call of the
    1536-input down_proj gets other bits than 2..128 rows (another kernel); Gaussian rows hid it."""
    return (torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g).pow(4) * 3).bfloat16()


def _in_pairs(linear, x: torch.Tensor) -> torch.Tensor:
    """Every row's product in a 2-row call (the bits of every call of 2..ROW_TILE rows)."""
    return torch.cat([linear(x[i : i + 2]) for i in range(0, x.shape[0], 2)])


@pytest.mark.parametrize("out_features,in_features", [(1536, 576), (576, 1536)])  # up/gate and down shapes
def test_row_tiled_linear_gives_each_row_the_same_bits_in_any_call(out_features, in_features):
    from prefixcache.layers.linear import ROW_TILE, row_tiled_linear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    x = _silu_like(100, in_features, g)
    pairs = _in_pairs(lambda rows: torch.nn.functional.linear(rows, w), x)
    assert ROW_TILE == 32
    for m in (1, 2, 7, 32, 33, 64, 65, 100):  # 33 and 65: a last tile of one row
        assert torch.equal(row_tiled_linear(x[:m], w), pairs[:m]), m
    assert torch.equal(row_tiled_linear(x[41:100], w), pairs[41:100])  # any offset
    assert all(torch.equal(row_tiled_linear(x[i : i + 1], w), pairs[i : i + 1]) for i in range(100))  # alone


@pytest.mark.parametrize("shapes,in_features", [((576, 192, 192), 576), ((576,), 1536)])  # q|k|v, down_proj
def test_prepacked_fused_linear_gives_each_row_the_same_bits_in_any_call(shapes, in_features):
    """q, k, v stacked in one prepacked matrix (and the down_proj alone), called with up to
    PREPACKED_ROW_TILE rows: every row has the same bits for calls of any size and any offset, alone
    included (what keeps bf16's fused, 128-row prefill and its decodes batch-invariant), and each
    column slice has the separate modules' shapes."""
    from prefixcache.layers.linear import PREPACKED_ROW_TILE, PrepackedWeight, prepacked_linear_supported, row_tiled_linear

    if not prepacked_linear_supported():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    g = torch.Generator().manual_seed(0)
    mods = [torch.nn.Linear(in_features, n, bias=False).bfloat16() for n in shapes]
    for m in mods:
        m.weight.data = (torch.randn(m.out_features, in_features, generator=g) * 0.05).bfloat16()
    packed = PrepackedWeight(mods)
    x = _silu_like(300, in_features, g)
    pairs = _in_pairs(packed.linear, x)
    assert pairs.shape == (300, sum(shapes)) and PREPACKED_ROW_TILE == 128
    for m in (1, 2, 3, 31, 33, 64, 127, 128, 129, 300):
        assert torch.equal(row_tiled_linear(x[:m], None, packed=packed), pairs[:m]), m
    assert torch.equal(row_tiled_linear(x[41:300], None, packed=packed), pairs[41:300])  # any offset
    assert all(torch.equal(row_tiled_linear(x[i : i + 1], None, packed=packed), pairs[i : i + 1]) for i in range(300))
    ref = torch.cat([torch.nn.functional.linear(x.float(), m.weight.float()) for m in mods], dim=1)
    assert torch.allclose(pairs.float(), ref, atol=0.05, rtol=0.02)  # the stacked product, not another
    if len(mods) == 1:
        return
    with torch.no_grad():
        mods[1].weight.mul_(2)  # written in place: the next call repacks
    assert torch.allclose(packed.linear(x[:4]).float()[:, 576:768], 2 * ref[:4, 576:768], atol=0.05, rtol=0.02)
