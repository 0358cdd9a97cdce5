"""Logprobs and penalties on the real model (issue 13).

- Logprobs equal ``log_softmax`` of our model's logits for the same context computed another way
  (the prompt and the generated tokens in one prefill, on other blocks), for greedy and seeded
  sampled runs; the cache on and off give identical logprobs.
- Penalties, logit_bias and min_tokens change greedy tokens exactly as an independent reference
  does: transformers' forward on prompt + generated tokens, HF's own
  ``RepetitionPenaltyLogitsProcessor`` for the repetition penalty, plain torch for OpenAI's
  frequency/presence formula, then argmax.
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.sampling_params import SamplingParams
from tests.models.model_testlib import PagedDriver

PROMPT = "The list of colours: red, green, blue, red, green, blue, red, green,"


def one_prefill_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """log_softmax of our model's logits for ``ids`` in one prefill: shape = [len(ids), vocab_size]."""
    driver = PagedDriver(loaded, block_size=16, num_blocks=-(-len(ids) // 16) + 1, seed=7)
    driver.add("a", len(ids))
    return driver.step([("a", ids)])["a"].float().log_softmax(-1)


def check_logprobs(out, reference: torch.Tensor, k: int) -> None:
    """Each generated token's logprob, rank and top-k against the reference rows."""
    n = len(out.prompt_token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[n - 1 + i]  # the position predicting token i
        top = row.topk(k)
        assert list(entry)[:k] == top.indices.tolist() or torch.allclose(
            row[list(entry)[:k]], top.values, atol=1e-5, rtol=0)  # equal up to near-ties
        for rank, (tid, lp) in enumerate(list(entry.items())[:k], start=1):
            assert lp.rank == rank and lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
        chosen = entry[token]
        assert chosen.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert chosen.rank == int((row > row[token]).sum()) + 1
        assert k == 0 or len(entry) in (k, k + 1)


def test_logprobs_equal_log_softmax_of_the_model_for_greedy_and_sampled_runs(make_llm, smollm2):
    llm = make_llm()
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=5), use_tqdm=False)[0]
    reference = one_prefill_logprobs(smollm2, greedy.prompt_token_ids + greedy.token_ids)
    check_logprobs(greedy, reference, 5)
    assert all(next(iter(e.values())).rank == 1 for e in greedy.logprobs)  # greedy picks rank 1
    assert greedy.logprobs[0][greedy.token_ids[0]].decoded_token == llm.tokenizer.decode([greedy.token_ids[0]])

    # Sampled at a high temperature with penalties: still the raw model's logprobs (vLLM v1's default).
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=3, max_tokens=8, logprobs=2, ignore_eos=True,
                            frequency_penalty=1.0)
    sampled = llm.generate(PROMPT, params, use_tqdm=False)[0]
    check_logprobs(sampled, one_prefill_logprobs(smollm2, sampled.prompt_token_ids + sampled.token_ids), 2)
    assert any(next(iter(e.values())).rank > 1 or e[t].rank > 1 for t, e in zip(sampled.token_ids, sampled.logprobs))
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].logprobs is None


def test_logprobs_cache_on_equal_cache_off(smollm2):
    """fp32 (the default): the same tokens and ranks, logprobs within float rounding (fp32 GEMMs round
    a row by how many rows share the call, README "Weight formats and batch invariance"); int8: the
    same bits, batched or alone, cache on or off."""
    from prefixcache.kernels.cpu_features import format_unavailable_reason
    from prefixcache.llm import LLM
    from prefixcache.models.loader import load_model

    def make_llm(loaded, **options):
        return LLM("smollm2-135m", loaded=loaded, num_threads=2, **options)

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=4)
    prompts = [PROMPT, PROMPT + " blue", "Hello there, how are"]
    formats = [(smollm2, {})]
    if format_unavailable_reason("float32", "int8") is None:  # int8 runs on this CPU
        formats.append((load_model("smollm2-135m", quantization="int8"), {"quantization": "int8"}))
    for loaded, options in formats:
        off_llm = make_llm(loaded, enable_prefix_caching=False, **options)
        off = [off_llm.generate(p, params, use_tqdm=False)[0] for p in prompts]  # one at a time, cold
        llm = make_llm(loaded, **options)
        llm.generate(PROMPT, params, use_tqdm=False)  # warm the cache
        on = llm.generate(prompts, params, use_tqdm=False)  # one batch, mostly cached
        assert on[0].num_cached_tokens > 0 and on[1].num_cached_tokens > 0
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        for a, b in zip(on, off):
            assert_logprobs_close(a.logprobs, b.logprobs)
        if options:
            assert [o.logprobs for o in on] == [o.logprobs for o in off]  # int8: exact


def assert_logprobs_close(a, b) -> None:
    """The same tokens and ranks, logprobs within fp32 rounding of another batch shape."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert [(t, lp.rank, lp.decoded_token) for t, lp in x.items()] == [(t, lp.rank, lp.decoded_token) for t, lp in y.items()]
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_parallel_samples_and_streaming_carry_their_logprobs(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=5, logprobs=1, ignore_eos=True)
    outs = llm.generate(PROMPT, params, use_tqdm=False)
    for i, out in enumerate(outs):  # each sample equals the same prompt alone with seed + i
        alone = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=5, logprobs=1,
                                                    ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids
        assert_logprobs_close(out.logprobs, alone.logprobs)  # n rows in a batch vs one
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2), stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == rid]
    final = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)[0]
    assert [len(o.logprobs) for o in seen] == [1, 2, 3, 4] and seen[-1].logprobs == final.logprobs


# ------------------------------------------------------------------ penalties against a reference
@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32).eval()


def reference_greedy(hf, prompt_ids: list[int], max_tokens: int, process) -> list[int]:
    """Greedy decoding with transformers' full forward each step; ``process(logits, prompt, out)``
    returns the logits to take the argmax of."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([prompt_ids + out])).logits[0, -1].float()  # [vocab_size]
            out.append(int(process(logits, prompt_ids, out).argmax()))
    return out


def openai_penalties(logits, out, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula: logit - count * frequency - (count > 0) * presence, over generated tokens."""
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float() if out else 0
    return logits - torch.as_tensor(counts) * frequency - (torch.as_tensor(counts) > 0).float() * presence


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=0.5, repetition_penalty=1.1),
], ids=["repetition", "frequency", "all_three"])
def test_greedy_penalties_give_the_reference_tokens(make_llm, hf, params):
    from transformers import RepetitionPenaltyLogitsProcessor

    llm = make_llm()
    ids = llm.tokenizer.encode(PROMPT)
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    got = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params),
                       use_tqdm=False)[0].token_ids
    repetition = RepetitionPenaltyLogitsProcessor(params.get("repetition_penalty", 1.0))

    def process(logits, prompt, out):
        x = repetition(torch.tensor([prompt + out]), logits[None])[0]
        return openai_penalties(x, out, params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0))

    assert got == reference_greedy(hf, ids, 12, process)
    assert got != plain.token_ids  # the penalty changed the answer
    # The direction: fewer tokens that repeat the context (prompt or earlier output).
    repeats = lambda toks: sum(t in ids or t in toks[:i] for i, t in enumerate(toks))  # noqa: E731
    assert repeats(got) < repeats(plain.token_ids)


def test_logit_bias_and_min_tokens_give_the_reference_tokens(make_llm, hf):
    llm = make_llm()
    conversation = [{"role": "user", "content": "Say just the word yes."}]
    ids = llm.apply_chat_template(conversation)
    eos = llm.engine.loaded.eos_token_ids
    plain = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 8

    # min_tokens: EOS masked until 8 tokens are out.
    got = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)[0]

    def no_eos(logits, prompt, out):
        return logits.index_fill(0, torch.tensor(eos), float("-inf"))

    assert got.token_ids == reference_greedy(hf, ids, 8, no_eos) and got.finish_reason == "length"
    assert not set(got.token_ids) & set(eos)

    # logit_bias: the greedy first token pushed down by 100, another pulled up by 5.
    first, other = plain.token_ids[0], llm.tokenizer.encode(" No")[0]
    bias = {first: -100.0, other: 5.0}
    got = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, logit_bias=bias), use_tqdm=False)[0]

    def biased(logits, prompt, out):
        return logits.index_add(0, torch.tensor(list(bias)), torch.tensor(list(bias.values())))

    expected = reference_greedy(hf, ids, 4, biased)
    assert got.token_ids == expected[: len(got.token_ids)] and got.token_ids[0] != first


def test_logit_bias_outside_the_vocabulary_is_refused(make_llm):
    llm = make_llm()
    vocab = llm.engine.input_processor.vocab_size
    with pytest.raises(InvalidInputError) as e:
        llm.generate(PROMPT, SamplingParams(logit_bias={1: 1.0, vocab: 2.0}), use_tqdm=False)
    assert e.value.field == "logit_bias" and str(vocab) in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logit_bias={vocab - 1: 1.0}), use_tqdm=False)
    assert len(out[0].token_ids) == 2
