"""The offline API from several threads, and inputs a review (2026-12-02) got through: a
``reset_prefix_cache`` from another thread inside a step, two ``generate`` calls at once, a
``logit_bias`` changed after its check, a ``ProcessedPrompt`` of floats, a pool larger than memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from prefixcache import host_memory
from prefixcache.engine.input_processor import ProcessedPrompt
from prefixcache.errors import InvalidInputError
from prefixcache.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "My favourite book is"]


def test_reset_prefix_cache_from_another_thread_never_breaks_a_generate(make_llm):
    """Before: ``ValueError: block 23 is already free`` in the first round, then every later call
    failed (KeyError, "freed with ref_cnt 0") and requests stayed stuck in the scheduler. Every
    engine method now holds the engine's lock: a reset lands between steps and is refused while
    requests hold blocks."""
    llm = make_llm(num_blocks=64)
    alone = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    stop, answers = threading.Event(), []

    def reset_forever():
        while not stop.is_set():
            answers.append(llm.reset_prefix_cache())

    thread = threading.Thread(target=reset_forever)
    thread.start()
    try:
        rounds = [[o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] for _ in range(4)]
    finally:
        stop.set()
        thread.join(30)
    assert rounds == [alone] * 4
    assert False in answers  # it did land while blocks were held (and was refused)
    assert not llm.engine.has_unfinished_requests() and llm.get_metrics().num_blocks_in_use == 0
    assert llm.reset_prefix_cache() is True


def test_generate_from_two_threads_returns_each_its_own_outputs(make_llm):
    """Each call's samples may be finished by the other call's steps: both get exactly their
    tokens (those of a lone call), none hangs."""
    llm = make_llm(num_blocks=96)
    alone = {p: llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS}
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=5)
    alone_sampled = [o.token_ids for o in llm.generate(PROMPTS[0], sampled, use_tqdm=False)]
    results: dict[int, list] = {}

    def run(i):
        if i == 2:
            results[i] = [o.token_ids for o in llm.generate(PROMPTS[0], sampled, use_tqdm=False)]
        else:
            results[i] = [(o.prompt, o.token_ids) for o in llm.generate(PROMPTS[i::2], GREEDY, use_tqdm=False)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[0] == [(p, alone[p]) for p in PROMPTS[0::2]]
    assert results[1] == [(p, alone[p]) for p in PROMPTS[1::2]]
    assert results[2] == alone_sampled
    assert llm._finished == {} and llm._own_ids == set()
    assert llm.get_metrics().num_blocks_in_use == 0


def test_logit_bias_is_read_only_and_refused_outside_the_vocabulary(make_llm):
    """Before: ``sp.logit_bias[-1] = 100`` after construction gave token 49151 six times, and a key
    of -10**6 failed the whole step (its neighbours with it)."""
    import copy
    import dataclasses
    import pickle

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={5: 0.0})
    for change in (lambda b: b.__setitem__(-1, 100.0), lambda b: b.update({-1: 100.0}), lambda b: b.pop(5)):
        with pytest.raises(TypeError, match="^logit_bias is read-only once SamplingParams has checked it"):
            change(sp.logit_bias)
    assert dict(sp.logit_bias) == {5: 0.0}
    # still a value like any other (a review found mappingproxy broke these): copies stay read-only
    for twin in (copy.deepcopy(sp), pickle.loads(pickle.dumps(sp)), dataclasses.replace(sp, n=2)):
        assert dict(twin.logit_bias) == {5: 0.0}
        with pytest.raises(TypeError):
            twin.logit_bias[-1] = 100.0
    assert dataclasses.asdict(sp)["logit_bias"] == {5: 0.0}
    llm = make_llm(num_blocks=32)
    assert llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].token_ids == llm.generate(
        PROMPTS[0], GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(InvalidInputError, match=r"^logit_bias token ids must be in \[0, 49152\), got 49152$"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={49152: 1.0}), use_tqdm=False)


def test_numpy_scalars_are_plain_numbers_and_odd_containers_are_refused():
    sp = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_tokens=np.int64(4),
                        seed=np.int32(3), n=np.int8(2), logit_bias={np.int64(5): np.float32(1.5)})
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed, sp.n, dict(sp.logit_bias)) == (0.5, 0.9, 4, 3, 2, {5: 1.5})
    assert [type(v) for v in (sp.temperature, sp.max_tokens, sp.seed, sp.n)] == [float, int, int, int]
    for kwargs, message in (
        ({"stop": b"ab"}, "stop must be a list, got b'ab'"),
        ({"stop": {"a": 1}}, "stop must be a list, got {'a': 1}"),
        ({"stop_token_ids": b"\x01"}, "stop_token_ids must be a list, got b'\\x01'"),
        ({"max_tokens": np.float64(4.0)}, "max_tokens must be an integer, got np.float64(4.0)"),
        ({"max_tokens": True}, "max_tokens must be an integer, got True"),
        ({"temperature": np.float32("nan")}, "temperature must be a number, got nan"),
    ):
        with pytest.raises(InvalidInputError) as e:
            SamplingParams(**kwargs)
        assert str(e.value) == message


def test_api_misuse_gets_errors_naming_the_field(make_llm):
    llm = make_llm(num_blocks=32)
    with pytest.raises(InvalidInputError, match=r"^sampling_params must be a SamplingParams \(or a list of them\), "
                                                r"got a dict: build one with SamplingParams\(\*\*params\)$"):
        llm.generate([PROMPTS[0]], {"temperature": 0, "max_tokens": 4}, use_tqdm=False)
    with pytest.raises(InvalidInputError) as e:
        llm.chat([], use_tqdm=False)
    assert (e.value.field, str(e.value)) == ("messages", "messages must not be empty")
    ids = llm.tokenizer.encode(PROMPTS[0])
    for bad_ids, message in (
        ([float(t) for t in ids], f"prompt token ids must be integers in [0, 49152), got '{float(ids[0])}' (float)"),
        ([t + 0.5 for t in ids], f"prompt token ids must be integers in [0, 49152), got '{ids[0] + 0.5}' (float)"),
        ([True, False, True], "prompt token ids must be integers in [0, 49152), got 'True' (bool)"),
        (np.array(ids), "prompt must be a string or a list of token ids, got ndarray"),
    ):  # a ProcessedPrompt with text used to skip the per-id check: floats ran as their floor
        with pytest.raises(InvalidInputError) as e:
            llm.engine.add_request(ProcessedPrompt(PROMPTS[0], bad_ids), GREEDY)
        assert str(e.value) == message
    assert not llm.engine.has_unfinished_requests()


def test_a_pool_past_memory_or_a_block_past_the_context_is_refused_before_allocating(make_llm, monkeypatch):
    """Before: ``LLM(block_size=10**6)`` loaded, then failed in the allocator (98 GB asked)."""
    with pytest.raises(InvalidInputError) as e:
        make_llm(block_size=10**6, num_blocks=64)
    assert (e.value.field, str(e.value)) == ("block_size", "block_size 1000000 is more than the model's context of "
                                                           "8192 tokens (its max_position_embeddings): such a block "
                                                           "never fills")
    monkeypatch.setattr(host_memory, "physical_memory_bytes", lambda: 1 << 26)  # 64 MiB
    monkeypatch.setattr(host_memory, "cgroup_memory_limit_bytes", lambda: None)
    per_block = 2 * 30 * 16 * 3 * 64 * 4  # K and V x layers x block_size x KV heads x head_dim x fp32 bytes
    assert make_llm(num_blocks=(1 << 26) // per_block).engine.num_blocks == 91
    with pytest.raises(InvalidInputError) as e:
        make_llm(num_blocks=92)
    assert (e.value.field, str(e.value)) == (
        "num_blocks", f"num_blocks: a KV pool of 92 blocks of 16 tokens needs {92 * per_block} bytes ({per_block} "
                      "per block), more than the 67108864 bytes of physical memory")
    with pytest.raises(InvalidInputError) as e:
        make_llm(kv_cache_memory_bytes=2 << 26)
    assert e.value.field == "kv_cache_memory" and str(e.value).endswith("more than the 67108864 bytes of physical "
                                                                        "memory")
