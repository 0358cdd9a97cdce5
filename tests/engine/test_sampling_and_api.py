"""Sampling, stop conditions, the offline API and its input validation."""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidInputError
from prefixcache.layers.sampler import apply_top_k_top_p
from prefixcache.sampling_params import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea,"


def test_top_k_top_p_masks():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, False, True, True]
    probs = logits.softmax(-1)  # [0.61, 0.22, 0.14, 0.03]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [False, True, True, True]
    assert not torch.isinf(apply_top_k_top_p(logits, 0, 1.0)).any()


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", 0),
    ("max_tokens", -3), ("seed", "x"), ("seed", 2**70), ("stop", [""]), ("stop_token_ids", [-1]),
    ("temperature", float("inf")), ("ignore_eos", "yes"), ("include_stop_str_in_output", None),
])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_and_batch_independent(make_llm):
    llm = make_llm()
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2)]
    batch = llm.generate([PROMPT, "Hello there", PROMPT], [p] + others, use_tqdm=False)
    assert batch[0].token_ids == alone
    assert batch[2].token_ids != alone  # same prompt, other seed
    assert make_llm().generate(PROMPT, p, use_tqdm=False)[0].token_ids == alone


def test_top_k_1_equals_greedy(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    topk1 = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, seed=7), use_tqdm=False)[0]
    assert topk1.token_ids == greedy.token_ids


def test_stop_token_ids_stop_strings_eos_and_length(make_llm):
    llm = make_llm()
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20

    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # vLLM v1: the stop token's id stays, its text is left out unless include_stop_str_in_output
    assert out.text == llm.tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True,
                                               include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.token_ids == out.token_ids
    assert kept.text == llm.tokenizer.decode(base.token_ids[: first + 1], skip_special_tokens=True) != out.text

    word = base.text.split()[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[word], ignore_eos=True),
                       use_tqdm=False)[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", word)
    assert out.text == base.text[: base.text.index(word)]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[word], ignore_eos=True,
                                               include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == base.text[: base.text.index(word) + len(word)]


def test_eos_stops_unless_ignored(make_llm):
    llm = make_llm()
    conv = [{"role": "user", "content": "Say just the word yes."}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.output_processor.eos_token_ids
    assert len(out.token_ids) < 64
    ignored = llm.chat(conv, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 64
    assert ignored.token_ids[: len(out.token_ids)] == out.token_ids


def test_output_fields(make_llm):
    llm = make_llm()
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    ids = llm.tokenizer.encode(PROMPT)
    assert out.prompt == PROMPT and out.prompt_token_ids == ids and out.num_prompt_tokens == len(ids)
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.ttft_s is not None and 0 < out.ttft_s <= out.e2e_s


def test_invalid_input_raises_value_error_and_leaks_nothing(make_llm):
    llm = make_llm(num_blocks=64)
    vocab = llm.engine.input_processor.vocab_size
    cases = [
        ("prompt", lambda: llm.generate("", use_tqdm=False)),
        ("prompt", lambda: llm.generate([[]], use_tqdm=False)),
        ("prompt token ids", lambda: llm.generate([[1, vocab]], use_tqdm=False)),
        ("prompt token ids", lambda: llm.generate([[1, -5]], use_tqdm=False)),
        ("max_model_len", lambda: llm.generate([[1] * 9000], use_tqdm=False)),
        ("KV blocks", lambda: llm.generate([[1] * 1000], SamplingParams(max_tokens=100), use_tqdm=False)),
        ("sampling_params has 1", lambda: llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)),
        ("messages", lambda: llm.chat([[]], use_tqdm=False)),
        ("messages", lambda: llm.chat(None, use_tqdm=False)),
        ("prompts", lambda: llm.generate(None, use_tqdm=False)),
        ("prompts", lambda: llm.generate(5, use_tqdm=False)),
        ("prompts", lambda: llm.generate({"a": 1}, use_tqdm=False)),
        ("role", lambda: llm.chat([{"content": "hi"}], use_tqdm=False)),
    ]
    for what, call in cases:
        with pytest.raises(ValueError, match=what):
            call()
    # A bad prompt in a batch queues nothing from that batch.
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine prompt", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_metrics().num_blocks_in_use == 0
    out = llm.generate("The sun is", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_none_in_the_sampling_params_list_is_the_default_and_leaves_no_orphan(make_llm):
    """Found by a review (2026-12-02): ``[None]`` was queued (the engine takes None as the default)
    but ``generate`` then failed reading its ``n``, leaving the request queued; later calls counted
    its output as theirs and failed with KeyError. Now None entries are the default params, and a
    call collects only its own requests' outputs."""
    llm = make_llm(num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(["Hello"], [None], use_tqdm=False)
    assert len(first) == 1 and first[0].finished and 1 <= len(first[0].token_ids) <= SamplingParams().max_tokens
    chat = llm.chat([{"role": "user", "content": "Hi"}], [None], use_tqdm=False)
    assert len(chat) == 1 and chat[0].finished
    capital = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    again = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    assert capital[0].token_ids == again[0].token_ids and capital[0].prompt == "The capital of France is"
    assert llm.get_metrics().num_blocks_in_use == 0


def test_generate_leaves_requests_added_through_the_engine_to_their_caller(make_llm):
    """Found by a review (2026-12-02): a request queued with ``llm.engine.add_request`` was stepped
    by the next ``generate``, which dropped its output (gone for good); and the call's own
    automatic request id "1" collided with a caller's "1". Now generate refuses to start while
    such a request is queued (nothing of its batch is queued then), and automatic ids skip ids in
    use."""
    llm = make_llm(num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].token_ids
    llm.engine.add_request("Stray", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="stray")
    with pytest.raises(RuntimeError, match=r"^generate: the engine holds requests added through llm.engine; step "
                                           r"them with llm.engine.step\(\) \(or abort them\) first"):
        llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    assert set(llm.engine.scheduler.requests) == {"stray"}
    outs = [o for _ in range(3) for o in llm.engine.step()]
    assert [(o.request_id, len(o.token_ids), o.finish_reason) for o in outs] == [("stray", 2, "length")]
    auto = llm.engine.add_request("Auto", SamplingParams(max_tokens=1))
    llm.engine.add_request("Auto", SamplingParams(max_tokens=1), request_id=str(int(auto) + 1))
    auto2 = llm.engine.add_request("Auto", SamplingParams(max_tokens=1))
    assert int(auto2) == int(auto) + 2  # "auto + 1" taken by a caller: skipped
    for rid in (auto, str(int(auto) + 1), auto2):
        assert llm.engine.abort_request(rid).finish_reason == "abort"
    for bad in ("", 5, ["x"]):
        with pytest.raises(InvalidInputError, match="^request_id must be a non-empty string"):
            llm.engine.add_request("x", SamplingParams(max_tokens=1), request_id=bad)
        with pytest.raises(InvalidInputError, match="^request_id must be a non-empty string"):
            llm.engine.abort_request(bad)
    assert llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].token_ids == alone
    assert llm.get_metrics().num_blocks_in_use == 0


def test_engine_options_are_validated(make_llm):
    cases = [({"block_size": 0}, "block_size"), ({"hash_algo": "md5"}, "hash_algo"),
             ({"max_num_seqs": 0}, "max_num_seqs"), ({"bogus": 1}, "bogus"),
             ({"dtype": "int8"}, "dtype"), ({"seed": "x"}, "seed"), ({"seed": 2**64}, "seed"),
             ({"device": "tpu"}, "device"), ({"device": 3}, "device"), ({"device": "nope:0"}, "device")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "CUDA is not available"))
    for opts, field in cases:
        with pytest.raises(ValueError, match=field):
            make_llm(**opts)


def test_abort_frees_blocks(make_llm):
    llm = make_llm()
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    assert llm.get_metrics().num_blocks_in_use > 0
    out = engine.abort_request(rid)
    assert out.finish_reason == "abort" and len(out.token_ids) == 1
    assert llm.get_metrics().num_blocks_in_use == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request(rid) is None


def test_reset_prefix_cache(make_llm):
    llm = make_llm()
    p = SamplingParams(temperature=0, max_tokens=4)
    prompt = "A long sentence about trains, stations, platforms and timetables in the morning rush."
    llm.generate(prompt, p, use_tqdm=False)
    assert llm.get_metrics().num_blocks_cached > 0
    rid = llm.engine.add_request(prompt, p)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False  # refused while a request holds blocks
    llm.engine.abort_request(rid)
    assert llm.reset_prefix_cache() is True
    assert llm.get_metrics().num_blocks_cached == 0
    assert llm.generate(prompt, p, use_tqdm=False)[0].num_cached_tokens == 0


def test_streaming_request_reports_every_token(make_llm):
    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    full = llm.generate(PROMPT, params, use_tqdm=False)[0]
    rid = engine.add_request(PROMPT, params, stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert [o.request_id for o in seen] == [rid] * 6
    assert [o.token_ids for o in seen] == [full.token_ids[:i] for i in range(1, 7)]
    assert [o.finished for o in seen] == [False] * 5 + [True]
    assert seen[-1].text == full.text and seen[-1].e2e_s is not None and seen[0].e2e_s is None


@pytest.mark.requires_format("bfloat16", "none")
def test_dtype_is_part_of_the_cache_key(make_llm):
    from prefixcache import LLM

    fp32 = make_llm().engine.cache_fingerprint
    bf16 = LLM("smollm2-135m", dtype="bfloat16", num_blocks=16, num_threads=2)
    assert next(bf16.engine.loaded.model.parameters()).dtype == torch.bfloat16
    assert bf16.engine.cache_fingerprint != fp32
    out = bf16.generate("The sun is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_failed_step_fails_its_requests_and_keeps_earlier_cache(make_llm, monkeypatch):
    """A step that raises fails only its requests; blocks cached in that step are dropped (their
    K/V was never written), blocks cached before stay hit-able, and the engine goes on."""
    llm = make_llm(num_blocks=64)
    prompt = "A sentence that is long enough to fill at least one block of sixteen tokens, surely."
    # 16 new tokens fill the prompt's second block, so the repeat below takes a partial hit (a pinned source).
    cold = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    cached_before = llm.get_metrics().num_blocks_cached
    assert cached_before > 0
    other = " ".join(["Another prompt, about something else entirely."] * 6)
    num_other_blocks = len(llm.engine.input_processor.tokenize(other).token_ids) // 16
    assert num_other_blocks >= 2

    def boom(scheduler_output):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner, "execute_model", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([prompt, other], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    m = llm.get_metrics()
    assert not llm.engine.has_unfinished_requests()
    assert (m.num_blocks_in_use, m.num_blocks_cached) == (0, cached_before)
    assert m.evictions_by_reason == {"failed_step": num_other_blocks}  # cached in the failed step
    monkeypatch.undo()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == len(out.prompt_token_ids) - 1 and out.token_ids == cold.token_ids
    again = llm.generate(other, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # nothing of the failed step is ever served
