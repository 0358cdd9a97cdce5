"""Parallel sampling (n > 1) with copy-on-write on SmolLM2.

The n samples share the prompt's blocks; the last, partial block is shared until a sample writes
to it, then copied for that sample only (n - 1 copies; the last holder writes in place). Sample i
with seed s equals the same prompt run alone with seed s + i (vLLM v1's rule).
"""

from __future__ import annotations

import pytest

from prefixcache.request import sample_request_id
from prefixcache.sampling_params import SamplingParams

PROMPT = "The three most useful things to pack for a long train journey across Europe in winter are"


def alone(make_llm, prompt, params: SamplingParams, n: int) -> list[list[int]]:
    llm = make_llm(enable_prefix_caching=False)
    return [
        llm.generate(prompt, SamplingParams(temperature=params.temperature, seed=params.seed + i,
                                            max_tokens=params.max_tokens, ignore_eos=True),
                     use_tqdm=False)[0].token_ids
        for i in range(n)
    ]


def test_n4_samples_equal_their_seeds_alone_and_share_the_prompt_blocks(make_llm):
    llm = make_llm(num_blocks=64)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    prompt = engine.tokenizer.encode(PROMPT)
    assert len(prompt) % 16 != 0 and len(prompt) > 16
    num_full, k = divmod(len(prompt), 16)
    params = SamplingParams(temperature=0.8, seed=7, n=4, max_tokens=12, ignore_eos=True)
    engine.add_request(prompt, params, request_id="g")
    ids = [sample_request_id("g", i) for i in range(4)]

    outputs = engine.step()  # the whole prompt: computed once, 4 tokens sampled, 3 samples forked
    assert outputs == []  # nothing finished, nothing streamed
    tables = [kv.get_block_ids(rid) for rid in ids]
    assert tables[1:] == [tables[0]] * 3  # one block table, referenced 4 times: stored once
    blocks = kv.get_blocks("g")
    assert len(blocks) == num_full + 1 and [b.ref_cnt for b in blocks] == [4] * (num_full + 1)
    assert engine.get_metrics().num_forks == 3 and engine.get_metrics().num_cow_copies == 0
    shared_last = blocks[-1].block_id

    engine.step()  # first decode: each sample writes into the shared last block
    tables = [kv.get_block_ids(rid) for rid in ids]
    assert all(t[:num_full] == tables[0][:num_full] for t in tables)  # full blocks still shared
    last = [t[num_full] for t in tables]
    assert len(set(last)) == 4 and shared_last in last  # 3 copies + the original (last holder)
    assert engine.get_metrics().num_cow_copies == 3
    kv_cache = engine.runner.kv_caches[0]  # [2, num_blocks, block_size, kv_heads, head_dim]
    for block_id in last:  # the copied slots hold the prompt tail's K/V, bit for bit
        assert kv_cache[:, block_id, :k].equal(kv_cache[:, shared_last, :k])
    assert [b.ref_cnt for b in kv.get_blocks("g")[:num_full]] == [4] * num_full

    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.index] = out
    assert engine.get_metrics().num_cow_copies == 3  # copies happen only on first write
    assert [results[i].token_ids for i in range(4)] == alone(make_llm, prompt, params, 4)
    assert {results[i].request_id for i in range(4)} == {"g"}
    assert len({tuple(results[i].token_ids) for i in range(4)}) > 1  # they really are different samples
    assert kv.usage == 0.0


def test_prompt_ending_on_a_block_boundary_copies_nothing(make_llm):
    llm = make_llm(num_blocks=64)
    prompt = llm.engine.tokenizer.encode(PROMPT)[:16]
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert [(o.index, len(o.token_ids)) for o in outs] == [(0, 5), (1, 5), (2, 5)]
    m = llm.get_metrics()
    assert (m.num_forks, m.num_cow_copies) == (2, 0)
    assert [o.token_ids for o in outs] == alone(make_llm, prompt, params, 3)


def test_generate_mixes_n_and_single_requests_in_order(make_llm):
    llm = make_llm(num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([PROMPT, "Hello"], [SamplingParams(temperature=0, n=2, max_tokens=4, ignore_eos=True), greedy],
                        use_tqdm=False)
    assert [(o.prompt, o.index) for o in outs] == [(PROMPT, 0), (PROMPT, 1), ("Hello", 0)]
    assert outs[0].token_ids == outs[1].token_ids  # greedy samples agree
    assert outs[0].num_cached_tokens == outs[1].num_cached_tokens == 0


def test_abort_frees_every_sample(make_llm):
    llm = make_llm(num_blocks=64)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(temperature=1.0, n=3, max_tokens=50), request_id="g")
    engine.step()
    engine.step()
    assert engine.scheduler.requests.keys() == {"g", "g#1", "g#2"}
    outs = engine.abort_request_samples("g")  # the server counts every sample's tokens
    assert [(o.request_id, o.index, len(o.token_ids), o.finish_reason) for o in outs] == [
        ("g", 0, 2, "abort"), ("g", 1, 2, "abort"), ("g", 2, 2, "abort")]
    assert engine.abort_request("g") is None
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0
    engine.add_request("again", SamplingParams(n=2, max_tokens=2), request_id="g")  # ids are free again


def test_bad_n_and_reserved_ids(make_llm):
    llm = make_llm(num_blocks=16)
    for n in (0, 65, 2.0):
        with pytest.raises(ValueError, match="^n must"):
            SamplingParams(n=n)
    with pytest.raises(ValueError, match="seed must be"):
        SamplingParams(seed=2**64 - 2, n=3)
    with pytest.raises(ValueError, match="n=8 samples"):  # 8 samples x 3 blocks each can't fit 16
        llm.generate("hi", SamplingParams(n=8, max_tokens=40), use_tqdm=False)
    engine = llm.engine
    engine.add_request("hi", SamplingParams(n=2, max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match="'x#1' is already in use"):
        engine.add_request("hi", SamplingParams(max_tokens=2), request_id="x#1")
    engine.abort_request("x")


def test_samples_survive_preemption_and_count_toward_max_num_seqs(make_llm):
    # 10 blocks: the n=4 request peaks at 1 shared + 4 x 2 blocks, the other request needs 3, so
    # someone is preempted and recomputed; every output must still equal its run alone.
    llm = make_llm(num_blocks=10, enable_partial_block_reuse=False)
    tok = llm.engine.tokenizer
    prompt = tok.encode(PROMPT)[:21]
    other = tok.encode("Write a short note to a neighbour about a parcel that was delivered to you.")[:20]
    params = SamplingParams(temperature=0.9, seed=11, n=4, max_tokens=26, ignore_eos=True)
    other_params = SamplingParams(temperature=0.9, seed=99, max_tokens=26, ignore_eos=True)
    outs = llm.generate([prompt, other], [params, other_params], use_tqdm=False)
    assert llm.get_metrics().num_preemptions > 0
    assert [o.token_ids for o in outs[:4]] == alone(make_llm, prompt, params, 4)
    assert outs[4].token_ids == alone(make_llm, other, other_params, 1)[0]
    # max_num_seqs=4: the n=4 request fills it; the single request waits for a free seat.
    llm = make_llm(num_blocks=64, max_num_seqs=4)
    engine = llm.engine
    engine.add_request(prompt, params, request_id="g")
    engine.add_request(other, other_params, request_id="o")
    engine.step()
    engine.step()
    assert list(engine.scheduler.running) == ["g", "g#1", "g#2", "g#3"]
    while engine.has_unfinished_requests():
        engine.step()


def test_sample_ids_stay_reserved_until_the_whole_request_is_done(make_llm):
    # Found by a code review: ids were released when sample 0 ended, or when an unforked sample
    # was "aborted", and could then collide with live samples.
    engine = make_llm(num_blocks=64).engine
    engine.add_request("Hello there", SamplingParams(temperature=0, n=3, max_tokens=4, ignore_eos=True),
                       request_id="x")
    assert engine.abort_request("x#1") is None  # not forked yet: nothing to stop, still reserved
    with pytest.raises(ValueError, match="'x#1' is already in use"):
        engine.add_request("Hi", SamplingParams(max_tokens=2), request_id="x#1")
    engine.step()  # prompt computed: x#1 and x#2 forked
    assert sorted(engine.scheduler.requests) == ["x", "x#1", "x#2"]
    engine.abort_request("x#1")  # one live sample stops; the others go on
    assert sorted(engine.scheduler.requests) == ["x", "x#2"]
    # Sample 0 finishing (stop at max_tokens) does not release "x" while x#2 runs.
    engine.scheduler.requests["x#2"].sampling_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    while "x" in engine.scheduler.requests:
        engine.step()
    assert list(engine.scheduler.requests) == ["x#2"]
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request("Hi", SamplingParams(max_tokens=2), request_id="x")
    outs = engine.abort_request_samples("x")
    assert [(o.request_id, o.index) for o in outs] == [("x", 2)]
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage == 0.0
    engine.add_request("Hi", SamplingParams(max_tokens=2), request_id="x")  # released now
    engine.add_request("Hi", SamplingParams(max_tokens=2), request_id="x#1")


def test_aborting_a_request_before_it_forks_releases_all_its_ids(make_llm):
    engine = make_llm(num_blocks=64).engine
    engine.add_request("Hello there", SamplingParams(n=3, max_tokens=4), request_id="y")
    assert [o.index for o in engine.abort_request_samples("y")] == [0]
    assert not engine.has_unfinished_requests()
    for rid in ("y", "y#1", "y#2"):
        engine.add_request("Hi", SamplingParams(max_tokens=2), request_id=rid)
