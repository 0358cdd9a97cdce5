"""quantization="int4" end to end on the default model: generated tokens run the projections on
4-bit weights, prompt tokens on bf16; still batch-invariant, cache on == cache off, also when a
later prompt contains earlier generated tokens (their blocks are keyed apart, see
``prefixcache.cache.hashing.BlockHasher.output_block_key``)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.llm import LLM
from prefixcache.sample_texts import QUESTIONS, SYSTEM_PROMPT
from prefixcache.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_format("bfloat16", "int4")  # skipped where this CPU cannot run it

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_int4(smollm2):  # depends on smollm2: marked slow, loaded after the fp32 copy is cached
    from prefixcache.models.loader import load_model

    return load_model("smollm2-135m", dtype=torch.bfloat16, quantization="int4")


def make(loaded, **options):
    return LLM("smollm2-135m", loaded=loaded, dtype="bfloat16", quantization="int4", num_threads=2, **options)


def test_int4_batched_equals_alone_and_cache_off_across_turns(smollm2_int4):
    check_batched_equals_alone_and_cache_off_across_turns(lambda **options: make(smollm2_int4, **options))


def check_batched_equals_alone_and_cache_off_across_turns(make_llm) -> None:
    """For a format whose generated tokens run other kernels (int4, int4-int8; ``make_llm(**options)``
    makes its engine): four chat prompts batched = one at a time with caching off, then a second turn
    over the first one's answer."""
    llm = make_llm()
    assert llm.engine.runner.model.batch_invariant
    prompts = [list(llm.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                             {"role": "user", "content": q}])) for q in QUESTIONS[:4]]
    batched = [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.get_metrics().num_hit_requests == 3
    off = make_llm(enable_prefix_caching=False)
    assert [list(off.generate([p], GREEDY, use_tqdm=False)[0].token_ids) for p in prompts] == batched
    # Turn 2 contains turn 1's generated tokens: cache on reuses only blocks computed as prompt
    # (the prompt's full blocks), then computes the rest as cache off does.
    turn2 = [p + b + [198] for p, b in zip(prompts[:2], batched[:2])]
    outs = llm.generate(turn2, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [len(p) // 16 * 16 for p in prompts[:2]]
    assert [list(o.token_ids) for o in outs] == [list(off.generate([t], GREEDY, use_tqdm=False)[0].token_ids)
                                                 for t in turn2]


def test_int4_prompts_holding_earlier_generated_tokens_equal_cache_off(smollm2_int4):
    """Found by a review (2026-12-02), cache on != cache off in two ways: (R1) a prompt repeating the
    start of an earlier answer partial-copied the slots that answer's decoder computed; (R2) a prompt
    one generated token longer than an earlier one got, once its decode filled the block, the earlier
    request's copy of that block, whose slot 17 came from the decoder. Blocks holding generated
    tokens are now keyed by where generation starts in them (BlockHasher.output_key)."""
    logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    on, off = make(smollm2_int4, num_blocks=64), make(smollm2_int4, num_blocks=64, enable_prefix_caching=False)
    base = list(on.tokenizer.encode(SYSTEM_PROMPT))

    def same(prompt, cached):
        a, b = on.generate([prompt], logprobs, use_tqdm=False)[0], off.generate([prompt], logprobs, use_tqdm=False)[0]
        assert a.num_cached_tokens == cached
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)

    answer = list(on.generate([base[:32]], logprobs, use_tqdm=False)[0].token_ids)
    same(base[:32] + answer[:5] + [base[40]], 32)  # R1: was 37 cached, the last 5 from the decoder
    on.reset_prefix_cache()
    first = list(on.generate([base[:17]], logprobs, use_tqdm=False)[0].token_ids)[0]
    same(base[:17] + [first], 16)  # R2: logprobs differed from the 16th generated token on


def test_int4_first_token_and_its_logprobs_equal_bf16s(smollm2_int4):
    """The first token comes from the last prompt row, which runs bf16 (same weights, same kernels as
    the bf16 engine), so its id and its top-5 logprobs equal bf16's exactly."""
    from prefixcache.models.loader import load_model

    bf16 = LLM("smollm2-135m", loaded=load_model("smollm2-135m", dtype=torch.bfloat16), dtype="bfloat16",
               num_threads=2)
    int4 = make(smollm2_int4)
    prompt = int4.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    first4, first16 = int4.generate([prompt], params, use_tqdm=False)[0], bf16.generate([prompt], params,
                                                                                        use_tqdm=False)[0]
    assert first4.token_ids == first16.token_ids and first4.logprobs == first16.logprobs


def test_int4_generated_tokens_run_the_4bit_layers_and_the_8bit_lm_head(smollm2_int4, monkeypatch):
    """The prompt's last row takes the bf16 lm_head (the test above); each generated token's row the
    grouped 8-bit one (its logits rows only, one call per decode step), and the logprobs returned for
    the next token are that product's log-softmax; every layer of a generated token (and none of a
    prompt token's) runs in the generated rows' decoder (layers.decode_layers, 4-bit weights)."""
    import prefixcache.models.llama as llama
    from prefixcache.layers.decode_layers import DecodeLayers

    calls = []

    def recording(x, weight, out_dtype):
        y = group_int8_linear(x, weight, out_dtype)
        calls.append((x.shape[0], y.clone()))
        return y

    group_int8_linear = llama.group_int8_linear
    monkeypatch.setattr(llama, "group_int8_linear", recording)
    runs = []  # (rows, first layer, end layer) of each generated-rows decoder call
    run = DecodeLayers.run

    def recording_run(self, hidden, rows, kv_caches, begin=0, end=None):
        runs.append((hidden.shape[0], begin, end))
        return run(self, hidden, rows, kv_caches, begin, end)

    monkeypatch.setattr(DecodeLayers, "run", recording_run)
    llm = make(smollm2_int4)
    prompt = llm.apply_chat_template([{"role": "user", "content": QUESTIONS[1]}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=5), use_tqdm=False)[0]
    assert [rows for rows, _ in calls] == [1, 1, 1]  # decode steps 2..4, not the prompt's step
    # and the layers (4-bit q|k|v, o, gate|up, down): one call per decode step over all 30 layers, 1 row
    assert runs == [(1, 0, None)] * 3
    for step, (_, logits) in enumerate(calls, start=1):
        logprobs = torch.log_softmax(logits[0].float(), -1)
        top = torch.topk(logprobs, 5)
        assert out.token_ids[step] == top.indices[0].item()
        returned = out.logprobs[step]  # {token id: Logprob}: the sampled token and the top 5
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert returned[token_id].logprob == pytest.approx(value, abs=1e-6)


def _long_prompts(llm, shared_first: bool) -> list[list[int]]:
    """Three chat prompts of ~560 tokens: the long system text first (one shared prefix) or each
    question first (nothing shared)."""
    system = " ".join([SYSTEM_PROMPT] * 5)
    convs = [[{"role": "system", "content": system if shared_first else q},
              {"role": "user", "content": q if shared_first else system}] for q in QUESTIONS[:3]]
    return [list(llm.apply_chat_template(c)) for c in convs]


def test_int4_generated_tokens_over_a_shared_prefix_match_alone(smollm2_int4, monkeypatch):
    """Decodes over a shared prompt of > 512 tokens run as one batch of generated rows whose block
    tables start with the same pool blocks (kernels.decode_attention); their tokens equal each
    request alone with caching off."""
    import prefixcache.layers.attention.metadata as attention

    steps = []
    build = attention.build_decode_rows

    def recording_build(*args, **kwargs):
        rows = build(*args, **kwargs)
        steps.append(rows)
        return rows

    monkeypatch.setattr(attention, "build_decode_rows", recording_build)
    llm = make(smollm2_int4)
    prompts = _long_prompts(llm, shared_first=True)
    assert min(map(len, prompts)) > 512
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    common = next(i for i, ts in enumerate(zip(*prompts)) if len(set(ts)) > 1)  # shared prompt tokens
    decode_steps = [r for r in steps if r.token_indices.tolist() == [0, 1, 2]]
    assert len(decode_steps) == 7  # tokens 2..8 of the three requests, each step all three together
    table = decode_steps[0].block_table
    assert bool((table[:, : common // 16] == table[0, : common // 16]).all())  # the shared full blocks
    off = make(smollm2_int4, enable_prefix_caching=False)
    assert [list(off.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts] == batched


@pytest.mark.slow
def test_int4_recompute_after_preemption_gives_the_same_tokens(smollm2_int4):
    """Preempted requests recompute their generated tokens in a prefill, through the same kernel
    as their decodes: the same tokens as without preemption."""
    llm = make(smollm2_int4)
    prompts = _long_prompts(llm, shared_first=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # room for the three prompts and a block each: they preempt one another as they grow
    small = make(smollm2_int4, num_blocks=sum(-(-len(p) // 16) for p in prompts) + 3, max_num_seqs=3)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.get_metrics().num_preemptions > 0
    ref = [list(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts]
    assert [list(o.token_ids) for o in outs] == ref


def test_int4_refuses_a_lora_adapter_and_keeps_serving(smollm2_int4, tmp_path):
    """The generated rows' decoder adds no LoRA deltas, so an adapter is refused up front (naming the
    field), nothing is queued, and the engine goes on serving."""
    from prefixcache.errors import InvalidInputError
    from prefixcache.layers.lora import LoRARequest

    llm = make(smollm2_int4)
    with pytest.raises(InvalidInputError, match="lora: adapters need quantization") as e:
        llm.engine.add_request([1, 2, 3], GREEDY, lora=LoRARequest("mine", str(tmp_path)))
    assert e.value.field == "lora" and not llm.engine.scheduler.requests
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 2
