"""Prefix caching end to end on the real model: exact outputs and exact cached-token counts.

"Cold" = a fresh engine with prefix caching off. Equality = identical greedy token ids.
Cases C3–C8 are from ../shared/cases/README.md.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.cache import hashing
from prefixcache.request import Request
from prefixcache.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

SYSTEM = (
    "You are a careful travel assistant for a European rail company. Give short, factual answers "
    "about timetables, tickets, luggage rules and accessibility. When a question is about a specific "
    "train, ask for the train number if it was not given. Never invent prices."
)
QUESTIONS = [
    "Can I bring my bicycle on the night train to Vienna?",
    "How early should I arrive at the station for an international train?",
    "Is there step-free access at the central station?",
    "What happens to my ticket if my connecting train is cancelled?",
    "Are dogs allowed in first class?",
    "Do children under six travel for free?",
]


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def cold(make_llm, prompts, params=GREEDY, **options):
    llm = make_llm(enable_prefix_caching=False, **options)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def chat_ids(llm, questions, system=SYSTEM):
    return [llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
            for q in questions]


def test_shared_system_prompt_batch_equals_cold_and_hits(make_llm):
    llm = make_llm()
    prompts = chat_ids(llm, QUESTIONS)
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == cold(make_llm, prompts)
    # All six run in one step: the first computes the shared blocks, the others hit them.
    assert outs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outs[1:]] == [shared // 16 * 16] * 5
    m = llm.get_metrics()
    assert m.num_requests == 6 and m.num_hit_requests == 5
    assert m.prefix_cache_queries == sum(len(p) for p in prompts)
    assert m.prefix_cache_hits == 5 * (shared // 16 * 16)
    assert m.prompt_tokens_computed == m.prefix_cache_queries - m.prefix_cache_hits
    assert m.num_blocks_in_use == 0


def test_chunked_prefill_and_small_batches_equal_cold(make_llm):
    llm = make_llm(max_num_batched_tokens=40, max_num_seqs=3)
    runner = llm.engine.runner
    steps = []
    execute = runner.execute_model

    def spy(scheduler_output):
        steps.append([(s.request_id, len(s.token_ids), s.sampling_params is not None) for s in scheduler_output.seqs])
        return execute(scheduler_output)

    runner.execute_model = spy
    prompts = chat_ids(llm, QUESTIONS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == cold(make_llm, prompts)
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
    assert max(sum(n for _, n, _ in step) for step in steps) == 40
    assert max(len(step) for step in steps) == 3
    # The first prompt (> 40 tokens) is split into chunks; only its last chunk samples.
    first = [(n, samples) for step in steps for rid, n, samples in step if rid == outs[0].request_id]
    assert first[0] == (40, False) and sum(n for n, _ in first[:-GREEDY.max_tokens + 1]) == len(prompts[0])


def test_block_sizes_equal_cold(make_llm):
    llm_ref = cold(make_llm, chat_ids(make_llm(), QUESTIONS[:3]))
    for block_size in (1, 4, 32):
        # Full-block counts only; partial reuse is covered in tests/engine/test_eviction_and_partial.py.
        llm = make_llm(block_size=block_size, enable_partial_block_reuse=False)
        prompts = chat_ids(llm, QUESTIONS[:3])
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in first] == llm_ref
        assert [o.token_ids for o in again] == llm_ref
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // block_size * block_size for p in prompts]


def test_c3_evicted_block_is_gone_from_index(make_llm):
    rng = random.Random(3)
    a = rand_ids(rng, 3 * 4 + 1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm = make_llm(block_size=4, num_blocks=8)
    first = llm.generate(a, params, use_tqdm=False)[0]
    pool = llm.engine.kv_cache_manager.block_pool
    a_blocks = [b.block_id for b in pool.blocks if b.token_ids is not None and list(b.token_ids) in
                [a[i:i + 4] for i in range(0, 12, 4)]]
    assert len(a_blocks) == 3
    # 26 prompt + 6 output tokens = 8 blocks: every block of the pool, so A's blocks are evicted and reused.
    llm.generate(rand_ids(rng, 26), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert llm.get_metrics().num_evictions >= 3
    assert all(b.token_ids is None or list(b.token_ids) not in [a[i:i + 4] for i in range(0, 12, 4)]
               for b in pool.blocks)
    again = llm.generate(a, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids == cold(make_llm, [a], params, block_size=4, num_blocks=8)[0]


def test_c3_hit_blocks_hold_the_kv_of_their_tokens(make_llm):
    """KV read through a cache hit equals the KV a cold engine computes for the same tokens."""
    rng = random.Random(33)
    prefix = rand_ids(rng, 40)
    p1, p2 = prefix + rand_ids(rng, 7), prefix + rand_ids(rng, 9)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    warm = make_llm(block_size=8, num_blocks=64)
    warm.generate(p1, params, use_tqdm=False)
    manager = warm.engine.kv_cache_manager
    # Look up p2 the way admission does.
    probe = Request("probe", p2, params, warm.engine.input_processor.block_hasher, warm.engine.root_key())
    blocks, num_hit = manager.get_computed_blocks(probe)
    assert num_hit == 40 and len(blocks) == 5
    ref = make_llm(block_size=8, num_blocks=64, enable_prefix_caching=False)
    ref.generate(p2, params, use_tqdm=False)
    # The cold engine used blocks 0..5 for p2 in order (fresh pool, LRU from block 0).
    for layer, (kw, kr) in enumerate(zip(warm.engine.runner.kv_caches, ref.engine.runner.kv_caches)):
        for i, block in enumerate(blocks):
            torch.testing.assert_close(kw[:, block.block_id], kr[:, i], atol=1e-4, rtol=1e-4,
                                       msg=f"layer {layer} block {i}")


def test_c4_constant_hash_cannot_serve_wrong_kv(make_llm, monkeypatch):
    monkeypatch.setitem(hashing._DIGESTS, "xxh64", lambda data: b"\x00" * 8)
    rng = random.Random(4)
    unrelated = [rand_ids(rng, 40 + 3 * i) for i in range(5)]
    shared = rand_ids(rng, 32)
    pair = [shared + rand_ids(rng, 11), shared + rand_ids(rng, 13)]
    llm = make_llm()
    got = []
    for p in unrelated + pair:  # one at a time so each sees everything cached before it
        got.append(llm.generate(p, GREEDY, use_tqdm=False)[0])
    assert [o.num_cached_tokens for o in got] == [0, 0, 0, 0, 0, 0, 32]
    assert [o.token_ids for o in got] == cold(make_llm, unrelated + pair)


def test_c5_recompute_after_preemption_is_not_a_hit(make_llm):
    rng = random.Random(5)
    prompts = [rand_ids(rng, rng.randrange(40, 61)) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    small = make_llm(num_blocks=14, max_num_seqs=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    m = small.get_metrics()
    assert m.num_preemptions > 0, "the pool must be small enough to force preemption"
    assert m.prefix_cache_hits == 0 and m.num_hit_requests == 0
    assert [o.num_cached_tokens for o in outs] == [0] * 8
    big = make_llm(num_blocks=512, max_num_seqs=8)
    ref = big.generate(prompts, params, use_tqdm=False)
    assert big.get_metrics().num_preemptions == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert m.num_blocks_in_use == 0


def test_c6_warm_equals_cold(make_llm):
    llm = make_llm()
    warmup = chat_ids(llm, QUESTIONS[:3] + ["Tell me about the rail pass for students."])
    plain = llm.generate(warmup, GREEDY, use_tqdm=False)
    word = plain[3].text.split()[4]  # a stop string the warm-up request really reaches
    stopped = llm.generate(warmup[3], SamplingParams(temperature=0, max_tokens=16, stop=[word]), use_tqdm=False)[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", word)
    batch = chat_ids(llm, QUESTIONS)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == cold(make_llm, batch)


def test_c7_decode_output_is_cached_for_the_next_turn(make_llm):
    llm = make_llm(enable_partial_block_reuse=False)  # full blocks only (partial: separate test)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    p1 = llm.apply_chat_template(conv)
    r1 = llm.generate(p1, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    conv2 = conv + [{"role": "assistant", "content": r1.text},
                    {"role": "user", "content": "And on the day train to Munich?"}]
    p2 = llm.apply_chat_template(conv2)
    turn1 = p1 + r1.token_ids
    lcp = 0
    while lcp < min(len(p2), len(turn1)) and p2[lcp] == turn1[lcp]:
        lcp += 1
    # KV exists for every turn-1 token but the last sampled one; full blocks of that are cached.
    cached_blocks = (len(turn1) - 1) // 16
    expected = min(lcp // 16, cached_blocks, (len(p2) - 1) // 16) * 16
    assert expected > len(p1) // 16 * 16, "the reply must contribute at least one full block"
    r2 = llm.generate(p2, GREEDY, use_tqdm=False)[0]
    assert r2.num_cached_tokens == expected
    assert r2.token_ids == cold(make_llm, [p2])[0]


def test_c8_shared_partial_block_is_not_a_shared_prefix(make_llm):
    rng = random.Random(8)
    s = rand_ids(rng, 24)  # 1.5 blocks
    a, b = s + rand_ids(rng, 9), s + rand_ids(rng, 9)
    llm = make_llm(enable_partial_block_reuse=False)  # with it on: 24 cached, see test_eviction_and_partial
    out_a = llm.generate(a, GREEDY, use_tqdm=False)[0]
    out_b = llm.generate(b, GREEDY, use_tqdm=False)[0]
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 16)
    assert [out_a.token_ids, out_b.token_ids] == cold(make_llm, [a, b])


def test_last_prompt_token_always_computed(make_llm):
    rng = random.Random(9)
    p = rand_ids(rng, 32)  # exactly two blocks
    llm = make_llm(enable_partial_block_reuse=False)  # with it on: 31 cached, see test_eviction_and_partial
    first = llm.generate(p, GREEDY, use_tqdm=False)[0]
    again = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16  # block 2 holds the last token: recomputed for logits
    assert again.token_ids == first.token_ids


def test_caching_off_never_hits(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    prompts = chat_ids(llm, QUESTIONS[:2])
    llm.generate(prompts, GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    m = llm.get_metrics()
    assert m.prefix_cache_hits == 0 and m.num_blocks_cached == 0


def test_salts_isolate_and_equal_salts_share(make_llm):
    """C1's offline half (the server half belongs to the server issue)."""
    rng = random.Random(1)
    p = rand_ids(rng, 3 * 16 + 5)
    llm = make_llm(enable_partial_block_reuse=False)  # the case's values count full blocks
    got = [llm.generate(p, GREEDY, cache_salt=s, use_tqdm=False)[0] for s in ("alpha", "beta", "alpha", None)]
    assert [o.num_cached_tokens for o in got] == [0, 0, 48, 0]
    assert len({tuple(o.token_ids) for o in got}) == 1
    for bad in ("", "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate(p, GREEDY, cache_salt=bad, use_tqdm=False)
    assert llm.generate(p, GREEDY, cache_salt="alpha", use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.get_metrics().num_blocks_in_use == 0


def test_sha256_hash_algo_hits_the_same(make_llm):
    llm = make_llm(hash_algo="sha256")
    prompts = chat_ids(llm, QUESTIONS[:2])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].num_cached_tokens > 0
    assert [o.token_ids for o in outs] == cold(make_llm, prompts)


def test_hash_seed_fixes_block_hashes_default_is_random(make_llm):
    def hashes(llm):
        probe = Request("p", list(range(100, 140)), GREEDY, llm.engine.input_processor.block_hasher, llm.engine.root_key())
        return probe.block_hashes

    a, b = make_llm(hash_seed=11, num_blocks=8), make_llm(hash_seed=11, num_blocks=8)
    assert len(hashes(a)) == 2 and hashes(a) == hashes(b)
    assert hashes(make_llm(hash_seed=12, num_blocks=8)) != hashes(a)
    # Without hash_seed the root mixes this process's random seed: stable within the process.
    assert hashes(make_llm(num_blocks=8)) == hashes(make_llm(num_blocks=8)) != hashes(a)
    with pytest.raises(ValueError, match="hash_seed"):
        make_llm(hash_seed=-1)
